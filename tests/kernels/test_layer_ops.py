"""The layer's small-op kernels (kernels/layer_ops.py) against the torch ops they replace: rotary, the cache
write and q's layout bit for bit; silu * up and the RMSNorm within one rounding of the activations' dtype."""
from dataclasses import replace

import pytest
import torch

from kernels import layer_ops

SHAPE = (2, 3, 9, 3, 64)  # B, T, H, KV, D: the embedded model's heads, a 3-token verify
# The fused GEMV products ("fused" layer ops, not the default) cost minutes under Triton's interpreter: their slowest
# cases run in one dtype there and in both on a GPU (`benchmarks/gpu_session.sh r1` runs this file on CUDA).
ON_A_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="in this dtype on a GPU only (the interpreter "
                              "runs the other: minutes for a kernel that is not the default)")


def rotary(T, D, dtype, device):
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)
    freqs = torch.arange(40, 40 + T, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, :D // 2] *= -1  # signed: rotate_half up to sign, as the layer's tables
    return emb.cos().to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_the_cache_write_and_q_layout_are_the_torch_ops_bits(device, dtype):
    B, T, H, KV, D = SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(B * T, (H + 2 * KV) * D, generator=g, device=device).to(dtype)
    kv = torch.randn(2, B, KV, 16, D, generator=g, device=device).to(dtype)
    cos, sin = rotary(T, D, dtype, device)
    pos = torch.tensor([9, 4, 11], device=device)  # tree slots need not be in order
    kv_ref = kv.clone()
    q_ref = layer_ops.rope_and_cache_torch(qkv.clone(), cos, sin, pos, kv_ref, SHAPE)
    q = layer_ops.rope_and_cache(qkv, cos, sin, pos, kv, SHAPE)
    assert torch.equal(q, q_ref) and torch.equal(kv, kv_ref)
    assert not torch.equal(kv[:, :, :, pos], torch.zeros_like(kv[:, :, :, pos]))
    table_cos, table_sin = rotary(T + 5, D, dtype, device)  # tables read at rows `at` give the gathered rows' bits
    at = torch.tensor([6, 0, 3], device=device)
    kv_at = kv.clone()
    q_at = layer_ops.rope_and_cache(qkv, table_cos, table_sin, pos, kv_at, SHAPE, at=at)
    kv_ref2 = kv.clone()
    q_ref2 = layer_ops.rope_and_cache_torch(qkv.clone(), table_cos[at], table_sin[at], pos, kv_ref2, SHAPE)
    assert torch.equal(q_at, q_ref2) and torch.equal(kv_at, kv_ref2) and not torch.equal(q_at, q)
    level = torch.arange(4, device=device)[2].expand(T)  # a tree level's one position for all its nodes (stride 0)
    q_level = layer_ops.rope_and_cache(qkv, table_cos, table_sin, pos, kv.clone(), SHAPE, at=level)
    want = layer_ops.rope_and_cache_torch(qkv.clone(), table_cos[level], table_sin[level], pos, kv.clone(), SHAPE)
    assert torch.equal(q_level, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_and_rms_norm_are_the_torch_ops_within_a_rounding(device, dtype):
    g = torch.Generator(device=device).manual_seed(1)
    gate_up = (3 * torch.randn(5, 2 * 1536, generator=g, device=device)).to(dtype)
    x = torch.randn(5, 576, generator=g, device=device).to(dtype)
    w = (1 + torch.randn(576, generator=g, device=device) / 4).to(dtype)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), layer_ops.silu_mul_torch(gate_up), rtol=ulp, atol=ulp)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-5), layer_ops.rms_norm_torch(x, w, 1e-5), rtol=ulp, atol=ulp)
    swapped = torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1)  # up and gate the other way round: another result
    assert not torch.allclose(layer_ops.silu_mul(swapped), layer_ops.silu_mul_torch(gate_up), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folded_norms_scale_each_row_as_the_torch_ops_within_a_rounding_and_alone(device, dtype):
    """rows=x: the product over x's raw rows scaled by x's 1 / rms before the rotary (q, k and v) and before SiLU *
    up, as `scaled_rows_torch` then the op; each token's result is its bits alone (a verify = one-token steps)."""
    B, T, H, KV, D = SHAPE
    g = torch.Generator(device=device).manual_seed(4)
    x = (4 * torch.randn(B * T, 576, generator=g, device=device)).to(dtype)
    qkv = (40 * torch.randn(B * T, (H + 2 * KV) * D, generator=g, device=device)).to(dtype)
    gate_up = (40 * torch.randn(B * T, 2 * 1536, generator=g, device=device)).to(dtype)
    kv = torch.zeros(2, B, KV, 16, D, device=device, dtype=dtype)
    cos, sin = rotary(T, D, dtype, device)
    pos = torch.tensor([9, 4, 11], device=device)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    kv_ref = kv.clone()
    q_ref = layer_ops.rope_and_cache_torch(qkv.clone(), cos, sin, pos, kv_ref, SHAPE, rows=x, eps=1e-5)
    q = layer_ops.rope_and_cache(qkv, cos, sin, pos, kv, SHAPE, rows=x, eps=1e-5)
    torch.testing.assert_close(q, q_ref, rtol=2 * ulp, atol=2 * ulp)
    torch.testing.assert_close(kv, kv_ref, rtol=2 * ulp, atol=2 * ulp)
    assert q.abs().amax() < qkv.abs().amax() / 2  # scaled: x's rms is ~4, so the values ~4x smaller
    out = layer_ops.silu_mul(gate_up, rows=x, eps=1e-5)
    torch.testing.assert_close(out, layer_ops.silu_mul_torch(gate_up, rows=x, eps=1e-5), rtol=ulp, atol=ulp)
    one = B * T - 1  # the last token alone (B = 1, T = 1)
    kv_one = torch.zeros(2, 1, KV, 16, D, device=device, dtype=dtype)
    q_one = layer_ops.rope_and_cache(qkv[one:], cos[-1:], sin[-1:], pos[-1:], kv_one, (1, 1, H, KV, D),
                                     rows=x[one:], eps=1e-5)
    assert torch.equal(q_one, q[-1:, :, T - 1::T]) and torch.equal(kv_one[:, 0, :, 11], kv[:, 1, :, 11])
    assert torch.equal(layer_ops.silu_mul(gate_up[one:], rows=x[one:], eps=1e-5), out[one:])
    with pytest.raises(ValueError, match="rows"):
        layer_ops.silu_mul(gate_up, rows=x[:2], eps=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_pair_of_norms_in_one_kernel_is_two_norms_side_by_side(device, dtype):
    g = torch.Generator(device=device).manual_seed(3)
    a, b = (torch.randn(2, 3, 576, generator=g, device=device).to(dtype) for _ in range(2))
    wa, wb = ((1 + torch.randn(576, generator=g, device=device) / 4).to(dtype) for _ in range(2))
    want = torch.cat([layer_ops.rms_norm(a, wa, 1e-5), layer_ops.rms_norm(b, wb, 1e-5)], dim=-1)
    assert torch.equal(layer_ops.rms_norm_pair(a, wa, b, wb, 1e-5), want)
    assert not torch.equal(layer_ops.rms_norm_pair(a, wb, b, wa, 1e-5), want)  # each side its own weight
    with pytest.raises(ValueError, match="must match"):
        layer_ops.rms_norm_pair(a, wa, b[:, :2], wb, 1e-5)
    table = torch.randn(7, 576, generator=g, device=device).to(dtype)  # side 0 from a table's rows: a gather's bits
    rows = torch.tensor([[4, 0, 4], [6, 2, 1]], device=device)
    want = layer_ops.rms_norm_pair(table[rows], wa, b, wb, 1e-5)
    assert torch.equal(layer_ops.rms_norm_pair(table, wa, b, wb, 1e-5, a_rows=rows), want)
    assert not torch.equal(layer_ops.rms_norm_pair(table, wa, b, wb, 1e-5, a_rows=rows.flip(-1)), want)


def attention_inputs(T, S, dtype, device, capacity=160):
    """q rows of the embedded model's heads, a cache slice of S slots, and a mask in which token t sees slots
    [0, 37 + t) and slot 50 + t (a tree's shape: not a prefix), so blocks past 64 have no visible key."""
    B, H, KV, D = 2, 9, 3, 64
    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(B, KV, (H // KV) * T, D, generator=g, device=device).to(dtype)
    cache = torch.randn(2, B, KV, capacity, D, generator=g, device=device).to(dtype)
    slots = torch.arange(S, device=device)
    tokens = torch.arange(T, device=device)[:, None]
    visible = (slots[None, :] < 37 + tokens) | (slots[None, :] == 50 + tokens)
    mask = torch.where(visible, 0.0, float("-inf")).to(dtype).repeat(H // KV, 1)  # [R*T, S], row r * T + t
    return q, cache[0, :, :, :S], cache[1, :, :, :S], mask, (B, T, H, KV, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_is_the_torch_ops_within_a_rounding_and_a_tokens_bits_do_not_depend_on_the_width(device, dtype):
    q, k, v, mask, shape = attention_inputs(3, 130, dtype, device)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    o = layer_ops.attention(q, k, v, mask, 0.125, shape)
    torch.testing.assert_close(o, layer_ops.attention_torch(q, k, v, mask, 0.125, shape), rtol=tol, atol=tol)
    B, T, H, KV, D = shape
    for t in range(T):  # token t alone, and over a narrower context bucket: the same bits
        rows = torch.arange(H // KV, device=device) * T + t
        alone = layer_ops.attention(q[:, :, rows], k[:, :, :64], v[:, :, :64], mask[rows, :64], 0.125,
                                    (B, 1, H, KV, D))
        assert torch.equal(alone, o.view(B, T, H * D)[:, t])
    heads_swapped = layer_ops.attention(q.flip(1), k, v, mask, 0.125, shape)
    assert not torch.allclose(heads_swapped, o, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_bool_mask_a_token_gives_the_additive_masks_bits(device, dtype):
    """A bool mask [T, S] (True where token t sees key n, for all its query heads: a draft step's) gives the
    additive [R*T, S] mask's bits in the reference and its values within float32 rounding in the kernel (on a GPU
    its float32 sums may round apart); a mask of neither shape is refused."""
    q, k, v, mask, shape = attention_inputs(3, 130, dtype, device)
    B, T, H, KV, D = shape
    visible = mask[:T] == 0  # row t of query head 0 is token t's
    reference = layer_ops.attention_torch
    assert torch.equal(reference(q, k, v, visible, 0.125, shape), reference(q, k, v, mask, 0.125, shape))
    got, want = (layer_ops.attention(q, k, v, m, 0.125, shape) for m in (visible, mask))
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
    shifted = layer_ops.attention(q, k, v, visible.roll(1, dims=0), 0.125, shape)  # rows by token: it matters
    assert not torch.allclose(shifted.float(), want.float(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="mask must be"):
        layer_ops.attention(q, k, v, visible.repeat(H // KV, 1), 0.125, shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_token_reading_its_own_key_slots_gets_the_bits_of_those_keys_laid_out_in_order(device, dtype):
    """slots [T, S]: a draft tree's node reads its path (context, then ancestors and itself, wherever they sit in
    the cache) as a chain lays it out, so it gets plain decoding's bits; in float32 the tree's own mask over the cache
    as it is gives other bits for some node (the chunked sums follow the keys' lanes)."""
    from flashspec_core.tree import DraftTree

    tree, C, S = DraftTree((-1, -1, 0, 0, 1, 2, 2, 4)), 100, 160
    T = tree.N + 1
    q, k, v, _, shape = attention_inputs(T, S, dtype, device)
    B, _, H, KV, D = shape
    R, depth = H // KV, torch.tensor((0,) + tree.depth, device=device)
    slots = torch.arange(S, dtype=torch.int32, device=device).repeat(T, 1)
    slots[:, C:C + tree.max_depth + 1] = C + tree.path_table(device)
    chain = (torch.arange(S, device=device)[None, :] <= C + depth[:, None])  # token t sees its first C + depth + 1
    mask = torch.where(chain, 0.0, float("-inf")).to(dtype).repeat(R, 1)
    gathered = layer_ops.attention(q, k, v, mask, 0.125, shape, slots).view(B, T, H * D)
    allowed = torch.zeros(T, S, dtype=torch.bool, device=device)
    allowed[:, :C], allowed[:, C:C + T] = True, tree.ancestor_mask(device)
    in_place = layer_ops.attention(q, k, v, torch.where(allowed, 0.0, float("-inf")).to(dtype).repeat(R, 1), 0.125,
                                   shape).view(B, T, H * D)
    differ = 0
    for t in range(T):
        laid = slots[t].long()
        rows = torch.arange(R, device=device) * T + t
        alone = layer_ops.attention(q[:, :, rows], k[:, :, laid], v[:, :, laid], mask[rows], 0.125, (B, 1, H, KV, D))
        assert torch.equal(gathered[:, t], alone), t
        differ += not torch.equal(in_place[:, t], alone)
    assert differ > 0 or dtype == torch.bfloat16  # float32 shows it here; bfloat16's rounding of o mostly hides it
    with pytest.raises(ValueError, match="int32"):
        layer_ops.attention(q, k, v, mask, 0.125, shape, slots.long())


def tiny_model(device, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def test_the_model_with_the_kernels_gives_the_torch_ops_logits_and_greedy_tokens(device):
    from flashspec_core.fast_path import StaticCausalLM

    model = tiny_model(device)
    ids = torch.randint(0, 97, (1, 9), device=device)
    runs = {}
    for ops in ("torch", "triton", "folded", "fused"):
        fast = StaticCausalLM(model, max_len=64, use_graphs=False, layer_ops=ops)
        assert fast.layer_ops == ops
        logits = [fast.forward(ids)[:, -1]]
        for _ in range(4):  # greedy steps of one token
            logits.append(fast.forward(logits[-1].argmax(-1, keepdim=True))[:, -1])
        runs[ops] = torch.stack(logits)
    for ops in ("triton", "folded", "fused"):
        torch.testing.assert_close(runs[ops], runs["torch"], rtol=1e-4, atol=1e-4)
        assert torch.equal(runs[ops].argmax(-1), runs["torch"].argmax(-1))


@pytest.mark.parametrize("kind", ["loop", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=ON_A_GPU)])
def test_a_verify_on_the_fused_products_is_one_token_steps_bit_for_bit(device, dtype, kind, monkeypatch):
    """5 tokens in one forward give the logits and hidden states of 5 one-token steps, bit for bit: what keeps
    greedy speculative decoding equal to plain decoding (under either GEMV kind the products run by default)."""
    from flashspec_core.fast_path import StaticCausalLM

    monkeypatch.setattr(layer_ops, "GEMV_KIND", kind)
    lm = StaticCausalLM(tiny_model(device, dtype), max_len=64, use_graphs=False, layer_ops="fused")
    lm.aux_layers = (0, 1)
    g = torch.Generator(device=device).manual_seed(7)
    prompt = torch.randint(0, 97, (1, 6), generator=g, device=device)
    new = torch.randint(0, 97, (1, 5), generator=g, device=device)
    lm.forward(prompt)
    steps = [(lm.forward(new[:, i:i + 1]), lm.aux) for i in range(5)]
    lm.crop(6)
    verify = lm.forward(new)
    assert torch.equal(verify, torch.cat([s[0] for s in steps], dim=1))
    assert torch.equal(lm.aux, torch.cat([s[1] for s in steps], dim=1))



def tiny_pair(device):
    from tests.conftest import tiny_llama
    from tests.flashspec_core.test_draft_head import tiny_head

    target = tiny_llama(vocab=50, seed=3, hidden=32).to(device)  # head size 16: the kernels take it
    return target, tiny_head(target).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_draft_heads_captured_step_with_the_kernels_is_its_torch_step(device, dtype):
    from flashspec_core.draft_head import HeadCache

    _, head = tiny_pair(device)
    head = head.to(dtype)
    g = torch.Generator(device=device).manual_seed(4)
    tokens = torch.randint(0, 50, (1, 5), generator=g, device=device)
    hidden = torch.randn(1, 5, 32, generator=g, device=device).to(dtype)
    runs = {}
    for ops in ("torch", "triton"):  # a first pass over five slots, then a draft step at slot 5
        head.layer_ops = ops
        cache = HeadCache(head.cfg, 1, 64, device, dtype)
        h = head.step_at(cache, tokens, hidden, torch.arange(5, device=device), 64)
        step = head.step_at(cache, tokens[:, -1:], h[:, -1:], torch.tensor([5], device=device), 64)
        runs[ops] = (torch.cat([h, step], dim=1).float(), head.logits(step[:, -1]).float(), cache.kv[..., :6, :].float())
    for got, want in zip(runs["triton"], runs["torch"]):  # bfloat16: roundings apart through a whole layer
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            assert float((got - want).norm() / want.norm()) < 0.02
    head.layer_ops = "auto"


def test_the_head_runs_the_kernels_under_every_kernel_layer_ops_the_target_may_pick(device, monkeypatch):
    """"auto" follows the target's choice (FLASHSPEC_LAYER_OPS here): any of the kernel paths gives the head its
    kernel step, torch's its torch step (a head left on torch's ops beside a kernel target costs ~40% a round)."""
    _, head = tiny_pair(device)
    x = torch.zeros(1, device=device)
    for ops in ("triton", "folded", "fused", "torch"):
        monkeypatch.setenv("FLASHSPEC_LAYER_OPS", ops)
        assert head.uses_kernels(x) == (ops != "torch"), ops


@torch.no_grad()
def test_the_heads_kernel_step_follows_its_weights(device):
    """The kernel step's stacked weights (q, k, v as one; gate, up as one) are remade when a weight changes in
    place: after the change it gives the torch step's outputs again, not the old weights'."""
    from flashspec_core.draft_head import HeadCache

    _, head = tiny_pair(device)
    g = torch.Generator(device=device).manual_seed(9)
    tokens = torch.randint(0, 50, (1, 5), generator=g, device=device)
    hidden = torch.randn(1, 5, 32, generator=g, device=device)

    def step(ops):
        head.layer_ops = ops
        return head.step_at(HeadCache(head.cfg, 1, 64, device, torch.float32), tokens, hidden,
                            torch.arange(5, device=device), 64)

    before = step("triton")
    head.midlayer.self_attn.k_proj.weight.mul_(-1.5)
    head.midlayer.mlp.up_proj.weight.mul_(0.5)
    after, want = step("triton"), step("torch")
    torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
    head.layer_ops = "auto"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_product_that_adds_into_its_own_residual_gives_the_copying_products_bits(device, dtype):
    """The kernel step's down product adds into the step's own h (`own=True`: `addmm_`, no copy first): the same
    bits as `addmm` into a new tensor; a residual that is not the caller's (`own=False`) is left as it was."""
    _, head = tiny_pair(device)
    head = head.to(dtype)
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(3, head.cfg.intermediate_size, generator=g, device=device).to(dtype)
    residual = torch.randn(3, 32, generator=g, device=device).to(dtype)
    kept = residual.clone()
    want = head._joined_product("down", x, residual)
    assert torch.equal(residual, kept)
    mine = residual.clone()
    got = head._joined_product("down", x, mine, own=True)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_draft_heads_tree_step_with_the_kernels_is_its_torch_step(device, dtype, monkeypatch):
    """A tree level (`step_tree_at`: slots, rotary positions and a mask of its own) on the kernels gives the torch
    ops' outputs and cache: three siblings after a first pass over five slots, then two children of two of them."""
    from flashspec_core.draft_head import HeadCache

    calls, kernel = [], layer_ops.attention
    monkeypatch.setattr(layer_ops, "attention", lambda *a, **k: calls.append(a[3].shape) or kernel(*a, **k))

    _, head = tiny_pair(device)
    head = head.to(dtype)
    g = torch.Generator(device=device).manual_seed(6)
    tokens = torch.randint(0, 50, (1, 5), generator=g, device=device)
    hidden = torch.randn(1, 5, 32, generator=g, device=device).to(dtype)
    S, slots = 16, torch.arange(16, device=device)
    seen = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0],  # level 1 at slots 5-7
                         [1, 0, 0, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool, device=device)  # level 2 at 8, 9
    mask = (slots < 5)[None, :] | torch.cat([torch.zeros(5, 5, dtype=torch.bool, device=device), seen,
                                             torch.zeros(5, S - 10, dtype=torch.bool, device=device)], dim=1)
    runs = {}
    for ops in ("torch", "triton"):
        head.layer_ops = ops
        cache = HeadCache(head.cfg, 1, 64, device, dtype)
        h = head.step_at(cache, tokens, hidden, torch.arange(5, device=device), S)
        ids = torch.randint(0, 50, (1, 5), generator=torch.Generator(device=device).manual_seed(7), device=device)
        one = head.step_tree_at(cache, ids[:, :3], h[:, -1:].expand(1, 3, -1), slots[5:8],
                                torch.full((3,), 5, device=device), mask[:3])
        two = head.step_tree_at(cache, ids[:, 3:], one[:, [0, 2]], slots[8:10], torch.full((2,), 6, device=device),
                                mask[3:])
        runs[ops] = (torch.cat([one, two], dim=1).float(), cache.kv[..., :10, :].float())
    assert calls == [(5, S), (3, S), (2, S)]  # the "triton" run's three steps went through the kernel (bool masks)
    for got, want in zip(runs["triton"], runs["torch"]):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            assert float((got - want).norm() / want.norm()) < 0.02
    head.layer_ops = "auto"


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_with_the_heads_step_on_the_kernels_equals_plain(device, shape, monkeypatch):
    """The head's captured steps on the kernels (chains of 3, launched ahead; trees of depth 3, `step_tree_at`, each
    level's children and choice in `kernels.tree_level`'s kernels) give plain decoding's tokens."""
    from flashspec_core import Engine
    from flashspec_core.tree_round import TreeSize
    from kernels import tree_level

    levels, kernel = [], tree_level.tree_level_triton
    monkeypatch.setattr(tree_level, "tree_level_triton", lambda *a: levels.append(a[0].shape) or kernel(*a))
    target, head = tiny_pair(device)
    head.layer_ops = "triton"
    engine = Engine.from_models(target, [head], kernel_backend="torch", captured="eager")
    prompt = [3, 17, 8, 29, 3, 17]
    plain = engine.generate(prompt, 24, mode="plain").token_ids
    tree = TreeSize(3, 2, 6) if shape == "tree" else None
    result = engine.generate(prompt, 24, gamma=3, drafters=["draft_head"], tree=tree)
    assert result.token_ids == plain and engine.round.captured is not None
    if tree:
        assert any(e.drafted_tree is not None for e in result.events) and len(levels) >= 3
    else:
        assert engine.round.launched_ahead > 0


# ----------------------------------------------------------------------------------------------------
# The fused GEMV products (layer_ops="fused")


def product_inputs(M, K, N, dtype, device, seed=5):
    """x [M, K], a norm weight that is not all ones, a weight [N, K] ~ 1/sqrt(K) and an input a [M, N] for the
    products that add into x (weights [K, N] there)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    norm = (1 + torch.randn(K, generator=g, device=device) / 4).to(dtype)
    weight = (torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(dtype)
    a = torch.randn(M, N, generator=g, device=device).to(dtype)
    return x, norm, weight, a


def close(got, want, dtype) -> bool:
    """Within a rounding or two of the activations' dtype (float32: the sums' order)."""
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=2 * tol)


BLOCKS = {kind: layer_ops.GemvTiles(kind=kind) for kind in ("block", "dot", "stream")}
BLOCKS["stream-64"] = layer_ops.GemvTiles(kind="stream", block_k=64)  # K in several chunks
BLOCKS["dot-4"] = layer_ops.GemvTiles(kind="dot", block_n=4)  # 4 outputs a program in tl.dot's 16-wide tile
BLOCKS["dot-piped"] = layer_ops.GemvTiles(kind="dot", block_n=4, block_k=64, stages=3)  # the K loop pipelined


ON_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                               reason="a programmatic dependent launch needs a GPU of compute capability 9 or more")
PDL = [pytest.param(layer_ops.GemvTiles(kind=kind, pdl=True), marks=ON_HOPPER, id=f"{kind}-pdl")
       for kind in ("stream", "dot")]


@pytest.mark.parametrize("tiles", [layer_ops.GemvTiles(), *BLOCKS.values(), *PDL],
                         ids=["loop", *BLOCKS, *(p.id for p in PDL)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K,N", [(5, 96, 42), (3, 576, 40), (2, 1536, 24)],
                         ids=["irregular", "hidden-576", "intermediate-1536"])
def test_the_fused_products_are_the_torch_ops_within_a_rounding(device, dtype, M, K, N, tiles):
    x, norm, weight, a = product_inputs(M, K, N, dtype, device)
    eps = 1e-5
    want = layer_ops.norm_linear_torch(x, norm, eps, weight)
    got = layer_ops.norm_linear(x, norm, eps, weight, tiles=tiles)
    assert got.shape == (M, N) and got.dtype == dtype and close(got, want, dtype)
    assert not close(got, torch.nn.functional.linear(x, weight), dtype)  # the norm matters
    assert not close(got, layer_ops.norm_linear_torch(x, norm.flip(0), eps, weight), dtype)  # and its weight
    want = layer_ops.norm_gate_up_silu_torch(x, norm, eps, weight)  # gate rows 0..N/2-1, up rows N/2..N-1
    got = layer_ops.norm_gate_up_silu(x, norm, eps, weight, tiles=tiles)
    assert got.shape == (M, N // 2) and close(got, want, dtype)
    assert not close(got, layer_ops.norm_gate_up_silu_torch(x, norm, eps, weight.roll(N // 2, 0)), dtype)
    residual = x.clone()
    want = layer_ops.add_linear_torch_(x.clone(), a, weight.t().contiguous())
    assert layer_ops.add_linear_(residual, a, weight.t().contiguous(), tiles=tiles) is residual
    assert close(residual, want, dtype)
    assert not close(residual, a @ weight, dtype)  # the residual is added


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_fused_products_do_not_depend_on_the_other_rows(device, dtype):
    """Each of 11 rows computed alone (M = 1), in one call (M = 11), and in programs of 3 rows: the same bits (a
    verify of 11 tokens is 11 one-token steps)."""
    x, norm, weight, a = product_inputs(11, 576, 48, dtype, device, seed=6)
    down = (weight[:, :40].t() / 2).contiguous()  # [40, 48]: x[:, :40] += a @ down.T
    three, narrow = layer_ops.GemvTiles(rows=3), layer_ops.GemvTiles(block_n=4)  # the H200's block for N <= 2112
    products = {
        "norm_linear": lambda rows, **kw: layer_ops.norm_linear(x[rows], norm, 1e-5, weight, **kw),
        "norm_gate_up_silu": lambda rows, **kw: layer_ops.norm_gate_up_silu(x[rows], norm, 1e-5, weight, **kw),
        "add_linear_": lambda rows, **kw: layer_ops.add_linear_(x[rows, :40].contiguous(), a[rows], down, **kw),
    }
    for name, product in products.items():
        every = product(slice(None))
        assert torch.equal(product(slice(None), tiles=three), every), name
        for m in range(11):
            assert torch.equal(product(slice(m, m + 1)), every[m:m + 1]), (name, m)
        every = product(slice(None), tiles=narrow)
        assert close(every, product(slice(None)), dtype)  # another order of sums
        for m in (0, 5, 10):
            assert torch.equal(product(slice(m, m + 1), tiles=narrow), every[m:m + 1]), (name, m)


@pytest.mark.parametrize("kind", [k for k in BLOCKS if k != "stream-64"])  # the same code
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=ON_A_GPU)])
def test_the_block_variants_rows_do_not_depend_on_m_or_their_neighbours(device, dtype, kind):
    """The block variants (8 rows a program at once; tl.dot: 16) and the stream: rows computed alone (M = 1, masked rows beside
    them), among 11, and among 17 (two or three row blocks): the same bits; and within a rounding of the GEMV loop
    (another order of sums)."""
    x, norm, weight, a = product_inputs(17, 576, 48, dtype, device, seed=8)
    down = (weight[:, :40].t() / 2).contiguous()  # [40, 48]: x[:, :40] += a @ down.T
    products = {
        "norm_linear": lambda rows, **kw: layer_ops.norm_linear(x[rows], norm, 1e-5, weight, **kw),
        "norm_gate_up_silu": lambda rows, **kw: layer_ops.norm_gate_up_silu(x[rows], norm, 1e-5, weight, **kw),
        "add_linear_": lambda rows, **kw: layer_ops.add_linear_(x[rows, :40].contiguous(), a[rows], down, **kw),
    }
    tiles = BLOCKS[kind]
    for name, product in products.items():
        every = product(slice(None), tiles=tiles)
        assert close(every, product(slice(None)), dtype), name
        assert torch.equal(product(slice(0, 11), tiles=tiles), every[:11]), name
        assert torch.equal(product(slice(6, 17), tiles=tiles), every[6:]), name  # rows 6.. at other places
        for m in (0, 5, 10, 16):
            assert torch.equal(product(slice(m, m + 1), tiles=tiles), every[m:m + 1]), (name, m)


@pytest.mark.parametrize("kind", ["block", "dot"])
def test_a_pipelined_k_loop_keeps_the_unrolled_loops_bits(device, kind):
    """`GemvTiles.stages` changes when a chunk's loads are issued, not the sums: the same bits as the unrolled loop
    (on a GPU the pipelined loop's loads run chunks ahead; the interpreter runs both in order)."""
    x, norm, weight, _ = product_inputs(5, 576, 40, torch.bfloat16, device, seed=3)
    tiles = layer_ops.GemvTiles(kind=kind, block_n=4 if kind == "dot" else None, block_k=64)
    for product in (layer_ops.norm_linear, layer_ops.norm_gate_up_silu):
        unrolled = product(x, norm, 1e-5, weight, tiles=tiles)
        assert torch.equal(product(x, norm, 1e-5, weight, tiles=replace(tiles, stages=3)), unrolled), product


def test_the_gemv_tiles_refuse_what_their_kernels_cannot_take():
    with pytest.raises(ValueError, match="at least 16"):
        layer_ops.GemvTiles(kind="dot", block_rows=8)
    with pytest.raises(ValueError, match="block variants"):
        layer_ops.GemvTiles(block_k=64)
    with pytest.raises(ValueError, match="stages are the block variants"):
        layer_ops.GemvTiles(kind="stream", stages=3)
    with pytest.raises(ValueError, match="power of two"):
        layer_ops.GemvTiles(kind="block", block_rows=6)
    with pytest.raises(ValueError, match="kind must be"):
        layer_ops.GemvTiles(kind="tiles")
    with pytest.raises(ValueError, match="not the stream's"):
        layer_ops.GemvTiles(kind="stream", block_rows=8)


def test_the_stream_tiles_follow_the_product_shape_unless_asked():
    """An LM head streams 16 outputs a program in chunks of 256, a long K (a 1.1B model's down) 8 in chunks of 1024, the
    rest 4; a chunk never longer than K's power of two; tiles asked for are kept."""
    def tile(n_out, K, **asked):
        t = layer_ops.GemvTiles(kind="stream", **asked).resolved(n_out, K, False, torch.device("cpu"))
        return t.block_n, t.block_k

    assert tile(49152, 576) == (16, 256) and tile(2048, 5632) == (8, 1024) and tile(3072, 576) == (4, 1024)
    assert tile(960, 200) == (4, 256) and tile(49152, 576, block_n=8, block_k=512) == (8, 512)


def test_programmatic_dependent_launches_stay_off_where_the_device_has_none(monkeypatch):
    """FLASHSPEC_PDL asks for them; a CPU (or the interpreter) never gets them, and a GEMV's tiles say so."""
    monkeypatch.setattr(layer_ops, "PDL", True)
    cpu = torch.device("cpu")
    assert not layer_ops.pdl_on(cpu) and layer_ops._launch(cpu) == {"GDC": False}
    assert layer_ops._launch(cpu, pdl=False) == {"GDC": False}
    for kind in layer_ops.KINDS:
        assert layer_ops.GemvTiles(kind=kind).resolved(64, 576, False, cpu).pdl is False
        assert layer_ops.GemvTiles(kind=kind, pdl=True).resolved(64, 576, False, cpu).pdl is False
