"""Tests for kernels/verify.py: the Triton kernel against the reference bit for bit (same explicit randoms),
edge cases checked against the reference and against the math, the law of the emitted tokens, and the backend
switch. On a machine without CUDA the kernel runs in Triton's interpreter (see conftest.py)."""
import importlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from kernels.verify import draw_randoms, resolve_backend, triton_available, verify, verify_torch, verify_triton

ON_CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[2]
BACKEND_FNS = {"torch": verify_torch, "triton": verify_triton}
kv = importlib.import_module("kernels.verify")  # the module (kernels.verify, the attribute, is the function)


def seed_of(*parts) -> int:
    """A seed that depends only on the test case (str hashing is salted per process; crc32 is not)."""
    return zlib.crc32(repr(parts).encode())


def assert_same(ref: kv.VerifyResult, out: kv.VerifyResult, what: str):
    """Identical num_accepted and tokens; the message reports the largest differences."""
    assert out.tokens.shape == ref.tokens.shape, f"{what}: tokens shape {tuple(out.tokens.shape)} != {tuple(ref.tokens.shape)}"
    assert out.tokens.dtype == out.num_accepted.dtype == torch.int64, f"{what}: outputs must be int64"
    d_acc = (ref.num_accepted - out.num_accepted).abs().max().item() if ref.num_accepted.numel() else 0
    d_tok = (ref.tokens - out.tokens).abs().max().item() if ref.tokens.numel() else 0
    n_tok = (ref.tokens != out.tokens).sum().item()
    assert d_acc == 0 and d_tok == 0, (f"{what}: max |num_accepted diff| = {d_acc}, max |token diff| = {d_tok}, "
                                       f"{n_tok} of {ref.tokens.numel()} tokens differ")


def make_case(B, K, V, *, drafter, seed, device, scale=5.0, guess=0.7):
    """Fresh peaky p and q (softmax of randn * scale, p a perturbation of q), drafts that are argmax p with
    probability `guess` and otherwise sampled from q (so accepts, rejects and full accepts all occur), and
    explicit randoms. Everything is drawn on the CPU from one seed, so the case is the same on every device."""
    g = torch.Generator().manual_seed(seed)
    q_logits = torch.randn(B, K, V, generator=g) * scale
    p_logits = torch.cat([q_logits + torch.randn(B, K, V, generator=g), torch.randn(B, 1, V, generator=g) * scale], dim=1)
    p = torch.softmax(p_logits, dim=-1)  # [B, K+1, V]
    q = torch.softmax(q_logits, dim=-1)  # [B, K, V]
    if K:
        sampled = torch.multinomial(q.reshape(B * K, V), 1, generator=g).reshape(B, K)
    else:
        sampled = torch.empty((B, 0), dtype=torch.int64)
    draft = torch.where(torch.rand(B, K, generator=g) < guess, p[:, :K].argmax(dim=-1), sampled)
    uniform, noise = draw_randoms(B, K, V, "cpu", g)
    return {
        "draft_tokens": draft.to(device),
        "draft_probs": q.to(device) if drafter == "model" else None,
        "target_probs": p.to(device),
        "uniform": uniform.to(device),
        "noise": noise.to(device),
    }


# ----------------------------------------------------------------------------------------------------
# Parity: same randoms, identical outputs

GRID = [(B, K, V, drafter, greedy) for V in (1000, 32003, 49152) for B in (1, 3, 8) for K in (1, 4, 8)
        for drafter in ("model", "deterministic") for greedy in (False, True)]


@pytest.mark.parametrize("B,K,V,drafter,greedy", GRID)
def test_parity_with_reference(B, K, V, drafter, greedy, device):
    case = make_case(B, K, V, drafter=drafter, seed=seed_of(B, K, V, drafter, greedy), device=device)
    ref = verify_torch(**case, greedy=greedy)
    out = verify_triton(**case, greedy=greedy)
    assert_same(ref, out, f"B={B} K={K} V={V} {drafter} {'greedy' if greedy else 'sampled'}")


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_parity_cases_mix_accepts_and_rejects(drafter, greedy, device):
    """The parity inputs are not trivial: rows stop at 0, in the middle and after a full accept."""
    K = 4
    case = make_case(64, K, 1000, drafter=drafter, seed=seed_of("mix", drafter, greedy), device=device)
    n = verify_torch(**case, greedy=greedy).num_accepted
    counts = torch.bincount(n, minlength=K + 1).tolist()
    assert counts[0] > 0 and sum(counts[1:K]) > 0 and counts[K] > 0, f"accepted-count histogram {counts}"
    assert_same(verify_torch(**case, greedy=greedy), verify_triton(**case, greedy=greedy), f"mix {drafter} greedy={greedy}")


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
def test_parity_when_randoms_come_from_a_generator(drafter, device):
    """Both backends draw the same randoms in the same order from the same generator state."""
    case = make_case(8, 4, 1000, drafter=drafter, seed=seed_of("gen", drafter), device=device)
    uniform = case.pop("uniform")
    case.pop("noise")
    ref = verify_torch(**case, generator=torch.Generator(device).manual_seed(11))
    out = verify_triton(**case, generator=torch.Generator(device).manual_seed(11))
    assert_same(ref, out, f"generator draws, {drafter}")
    ref = verify_torch(**case, uniform=uniform, generator=torch.Generator(device).manual_seed(12))
    out = verify_triton(**case, uniform=uniform, generator=torch.Generator(device).manual_seed(12))
    assert_same(ref, out, f"given uniform, generator noise, {drafter}")


@pytest.mark.parametrize("greedy", [False, True])
def test_parity_on_strided_inputs(greedy, device):
    """Views with padding (NaN, so reading it would show) and transposed storage go through the strides."""
    B, K, V = 4, 4, 1000
    case = make_case(B, K, V, drafter="model", seed=seed_of("strided", greedy), device=device)

    def padded_view(t):  # same values, last-dim view into a wider NaN-filled buffer
        wide = torch.full((*t.shape[:-1], t.shape[-1] + 24), float("nan"), dtype=t.dtype, device=device)
        wide[..., 3:3 + t.shape[-1]] = t
        return wide[..., 3:3 + t.shape[-1]]

    def transposed_storage(t):  # same values, column-major [B, K]
        return t.t().contiguous().t()

    strided = {
        "draft_tokens": transposed_storage(case["draft_tokens"]),
        "draft_probs": padded_view(case["draft_probs"]),
        "target_probs": padded_view(case["target_probs"]),
        "uniform": transposed_storage(case["uniform"]),
        "noise": padded_view(case["noise"]),
    }
    assert not strided["target_probs"].is_contiguous() and not strided["draft_tokens"].is_contiguous()
    assert_same(verify_torch(**case, greedy=greedy), verify_triton(**strided, greedy=greedy), "strided inputs")


@pytest.mark.parametrize("block_b,block_v,num_stages", [(1, 256, 1), (1, 256, 3), (4, 128, 1), (2, 1024, 2)])
@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_parity_across_launch_configurations(block_b, block_v, num_stages, drafter, greedy, device):
    """One row per program (the CUDA layout) and several rows per program, with a partial last V block, and
    with the V loop software-pipelined (num_stages > 1: cp.async prefetch on CUDA)."""
    B, K, V = 5, 4, 1000
    case = make_case(B, K, V, drafter=drafter, seed=seed_of("tiles", block_b, block_v, drafter, greedy), device=device)
    ref = verify_torch(**case, greedy=greedy)
    out = kv._verify_triton_launch(case["draft_tokens"], case["draft_probs"], case["target_probs"], case["uniform"],
                                   case["noise"], greedy, block_b, block_v, 4, num_stages)
    assert_same(ref, out, f"BLOCK_B={block_b} BLOCK_V={block_v} stages={num_stages} {drafter} greedy={greedy}")


# ----------------------------------------------------------------------------------------------------
# V split over programs: partials per chunk, the last program to finish a row block reduces them


def launch(case, greedy, block_b, block_v, n_chunks, num_stages=1):
    return kv._verify_triton_launch(case["draft_tokens"], case["draft_probs"], case["target_probs"], case["uniform"],
                                    case["noise"], greedy, block_b, block_v, 4, num_stages, n_chunks)


SPLITS = [  # (B, K, V, BLOCK_B, BLOCK_V, n_chunks asked): chunk sizes and the partial last chunk are in the comments
    (5, 4, 1000, 2, 128, 3),  # 3 chunks of 384, the last 232 wide; a partial last row block
    (3, 8, 32003, 1, 4096, 3),  # 3 chunks of 12288, the last 7427 wide
    (2, 1, 49152, 2, 4096, 4),  # 4 chunks of 12288 exactly
    (4, 4, 1000, 4, 256, 100),  # more chunks asked than V blocks: 4 chunks of 256
]


@pytest.mark.parametrize("B,K,V,block_b,block_v,n_chunks", SPLITS)
@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_parity_when_v_is_split_over_programs(B, K, V, block_b, block_v, n_chunks, drafter, greedy, device):
    case = make_case(B, K, V, drafter=drafter, seed=seed_of("split", B, K, V, drafter, greedy), device=device)
    chunk, used = kv._chunking(V, block_v, n_chunks)
    assert used > 1 and chunk % block_v == 0 and (used - 1) * chunk < V <= used * chunk
    assert_same(verify_torch(**case, greedy=greedy), launch(case, greedy, block_b, block_v, n_chunks),
                f"B={B} K={K} V={V} BLOCK_B={block_b} BLOCK_V={block_v} {used} chunks of {chunk} {drafter} greedy={greedy}")


@pytest.mark.parametrize("greedy", [False, True])
def test_parity_when_a_large_vocabulary_is_split(greedy, device):
    B, K, V = 2, 4, 128256
    case = make_case(B, K, V, drafter="model", seed=seed_of("split-large", greedy), device=device)
    assert_same(verify_torch(**case, greedy=greedy), launch(case, greedy, 2, 8192, 5), f"V={V} 5 chunks greedy={greedy}")


def test_one_chunk_is_the_row_kernel_and_the_default_splits_here(device):
    """n_chunks == 1 runs the one-program-per-row kernel; the default configuration on this device splits V,
    so the parity grid above goes through the split kernel (on CUDA: when the rows alone do not fill the GPU)."""
    assert kv._chunking(1000, 1024, 1) == (1024, 1) and kv._chunking(1000, 128, 1) == (1024, 1)
    case = make_case(3, 4, 1000, drafter="model", seed=seed_of("one-chunk"), device=device)
    assert_same(verify_torch(**case), launch(case, False, 1, 128, 1), "n_chunks=1, 8 blocks per row")
    for V in (1000, 32003, 49152) if torch.device(device).type == "cpu" else (32003, 49152):  # on CUDA V=1000 is one block
        _, block_v, _, _, n_chunks = kv._launch_config(8, V, device)
        assert kv._chunking(V, block_v, n_chunks)[1] > 1, f"the default does not split V={V} on {device}"


def test_cuda_configuration_fills_the_gpu(monkeypatch):
    """About 4 programs per SM when rows are few; whole rows per program once the rows alone fill the GPU."""
    monkeypatch.setattr(kv, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for B, V in ((1, 128256), (32, 128256), (8, 32000), (32, 49152)):
        block_b, block_v, _, _, n_chunks = kv._launch_config(B, V, cuda)
        chunk, used = kv._chunking(V, block_v, n_chunks)
        assert block_b == 1 and used > 1, (B, V, used, chunk)
        assert B * used >= 132 or chunk == block_v, (B, V, used, chunk)  # every SM busy, or one V block per program
        assert B * used <= 4 * 132 + B, (B, V, used)  # not far past 4 per SM
    assert kv._launch_config(4096, 128256, cuda)[4] == 1


def test_split_ties_across_chunk_boundaries_pick_the_lowest_index(device):
    """Equal maxima in different chunks (and one at a chunk's first index): the lowest index wins, whichever
    chunk reports first, for the residual race, the fall-back race and greedy."""
    B, K, V, block_v, n_chunks = 2, 1, 5000, 256, 4  # chunks of 1280: [0, 1280), [1280, 2560), ...
    tied = [3840, 1280, 4999, 2600]
    x = torch.tensor([[7], [7]], device=device)
    flat = torch.zeros((B, K + 1, V), device=device)
    flat[:, :, tied] = 1.0 / len(tied)
    noise = torch.ones((B, V), device=device)
    uniform = torch.ones((B, K), device=device)  # reject x = 7 (p = 0 there)
    for drafter_q in (None, torch.zeros((B, K, V), device=device)):
        case = dict(draft_tokens=x, draft_probs=drafter_q, target_probs=flat, uniform=uniform, noise=noise)
        for greedy in (False, True):
            ref = verify_torch(**case, greedy=greedy)
            out = launch(case, greedy, 1, block_v, n_chunks)
            assert_same(ref, out, f"ties greedy={greedy}")
            assert out.tokens[:, 0].tolist() == [min(tied)] * B
    # fall-back: p == q everywhere, so the residual is empty in every chunk and the race is on p_0
    q_reject = dict(draft_tokens=torch.tensor([[1280], [1280]], device=device), draft_probs=flat[:, :1].contiguous(),
                    target_probs=flat, uniform=torch.ones((B, K), device=device), noise=noise)  # u * q >= p: rejected
    out = launch(q_reject, False, 2, block_v, n_chunks)
    assert_same(verify_torch(**q_reject), out, "fall-back ties")
    assert out.num_accepted.tolist() == [0] * B and out.tokens[:, 0].tolist() == [min(tied)] * B


@pytest.mark.parametrize("where", ["first", "last"])
def test_split_residual_empty_in_some_chunks_only_is_not_the_fall_back(where, device):
    """p == q on every chunk but one: the residual lives in that chunk only, and the draw must come from it
    (a chunk whose residual is empty must not make the row fall back to p)."""
    B, K, V, block_v, n_chunks = 3, 1, 3000, 256, 3  # chunks of 1024
    g = torch.Generator().manual_seed(seed_of("one-chunk-residual", where))
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, dim=-1)
    p = torch.cat([q.clone(), torch.softmax(torch.randn(B, 1, V, generator=g), dim=-1)], dim=1)
    lo, hi = (0, 1024) if where == "first" else (2048, 3000)
    bump = torch.rand(B, hi - lo, generator=g) * 1e-3
    p[:, 0, lo:hi] += bump  # residual > 0 here only
    p[:, 0] /= p[:, 0].sum(-1, keepdim=True)  # renormalising lowers p elsewhere: still p < q there, residual 0
    x = torch.full((B, K), 1500, dtype=torch.int64)  # in the middle chunk, where p < q
    case = dict(draft_tokens=x.to(device), draft_probs=q.to(device), target_probs=p.to(device),
                uniform=torch.ones((B, K), device=device), noise=torch.empty(B, V).exponential_(generator=g).to(device))
    residual = (p[:, 0] - q[:, 0]).clamp_min(0)
    assert (residual[:, lo:hi] > 0).any(-1).all() and residual[:, :lo].sum() == 0 and residual[:, hi:].sum() == 0
    ref = verify_torch(**case)
    out = launch(case, False, 1, block_v, n_chunks)
    assert_same(ref, out, f"residual only in the {where} chunk")
    assert out.num_accepted.tolist() == [0] * B
    assert all(lo <= t < hi for t in out.tokens[:, 0].tolist()), out.tokens[:, 0].tolist()


# ----------------------------------------------------------------------------------------------------
# Edge cases: against the reference and against what the math demands


def run_both(what, **kwargs):
    """Both backends on the same inputs; asserts they agree and returns the result."""
    ref = verify_torch(**kwargs)
    assert_same(ref, verify_triton(**kwargs), what)
    return ref


def test_zero_draft_probability_accepts_whenever_the_target_has_mass(device):
    """q(x) = 0 < p(x): the ratio p/q is infinite, so x is accepted even with a uniform draw just below 1;
    where p(x) = 0 too the test 0 < 0 fails and the row stops there."""
    B, K, V = 4, 4, 1000
    case = make_case(B, K, V, drafter="model", seed=seed_of("q0"), device=device)
    x, p, q, noise = case["draft_tokens"], case["target_probs"].clone(), case["draft_probs"].clone(), case["noise"]
    q.scatter_(-1, x.unsqueeze(-1), 0.0)
    q = q / q.sum(dim=-1, keepdim=True)  # q(x) = 0 at every draft token
    p[1, 2, x[1, 2]] = 0.0
    p[1, 2] = p[1, 2] / p[1, 2].sum()  # row 1, position 2: p(x) = 0 as well
    uniform = torch.full((B, K), 0.999999, device=device)
    out = run_both("q(x) = 0", draft_tokens=x, draft_probs=q, target_probs=p, uniform=uniform, noise=noise)
    assert out.num_accepted.tolist() == [K, 2, K, K]
    # row 1 resamples at position 2 from max(0, p - q): the exponential race over the residual
    residual = (p[1, 2] - q[1, 2]).clamp_min(0.0)
    expected = (residual / noise[1]).argmax().item()
    assert out.tokens[1].tolist() == [x[1, 0].item(), x[1, 1].item(), expected, -1, -1]
    assert p[1, 2, expected] > q[1, 2, expected]
    # the other rows emit the bonus token from p_K
    bonus = (p[:, K] / noise).argmax(dim=-1)
    assert torch.equal(out.tokens[[0, 2, 3], K], bonus[[0, 2, 3]])


def test_equal_p_and_q_accepts_everything_and_falls_back_to_p_when_the_residual_is_empty(device):
    """p == q exactly: every draft with q(x) > 0 is accepted (u < 1); a draft outside the support (p = q = 0)
    is rejected, the residual max(0, p - q) is all zeros, and the emitted token is drawn from p instead."""
    B, K, V = 4, 4, 1000
    g = torch.Generator().manual_seed(seed_of("p==q"))
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 5, dim=-1)
    p = p * (torch.rand(B, K + 1, V, generator=g) < 0.5)  # half the vocabulary has no mass
    p = (p / p.sum(dim=-1, keepdim=True)).to(device)
    q = p[:, :K].clone()
    x = torch.multinomial(q.reshape(B * K, V).cpu(), 1, generator=g).reshape(B, K).to(device)
    uniform, noise = draw_randoms(B, K, V, device, torch.Generator(device).manual_seed(3))
    uniform[:, 1] = 0.999999
    out = run_both("p == q", draft_tokens=x, draft_probs=q, target_probs=p, uniform=uniform, noise=noise)
    assert out.num_accepted.tolist() == [K] * B
    assert torch.equal(out.tokens[:, :K], x)
    assert torch.equal(out.tokens[:, K], (p[:, K] / noise).argmax(dim=-1))

    outside = (p[0, 0] == 0).nonzero()[0].item()
    x[0, 0] = outside
    out = run_both("p == q, empty residual", draft_tokens=x, draft_probs=q, target_probs=p, uniform=uniform, noise=noise)
    assert out.num_accepted[0].item() == 0
    fallback = (p[0, 0] / noise[0]).argmax().item()
    assert out.tokens[0].tolist() == [fallback] + [-1] * K
    assert p[0, 0, fallback] > 0


def test_deterministic_drafter_is_always_accepted_where_the_target_agrees(device):
    """q one-hot at x and p one-hot at x: p(x) = 1 > u for every u in [0, 1)."""
    B, K, V = 3, 5, 1000
    g = torch.Generator().manual_seed(seed_of("onehot"))
    x = torch.randint(0, V, (B, K), generator=g).to(device)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 5, dim=-1).to(device)
    p[:, :K] = torch.nn.functional.one_hot(x, V).float()
    uniform = torch.full((B, K), 0.999999, device=device)
    noise = torch.empty((B, V), device=device).exponential_(generator=torch.Generator(device).manual_seed(4))
    out = run_both("one-hot agreement", draft_tokens=x, draft_probs=None, target_probs=p, uniform=uniform, noise=noise)
    assert out.num_accepted.tolist() == [K] * B
    assert torch.equal(out.tokens[:, K], (p[:, K] / noise).argmax(dim=-1))


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_no_drafts_is_one_bonus_draw(drafter, greedy, device):
    """K = 0: tokens [B, 1] hold one draw from p_0 (argmax p_0 when greedy)."""
    B, V = 3, 1000
    case = make_case(B, 0, V, drafter=drafter, seed=seed_of("K0", drafter, greedy), device=device)
    out = run_both(f"K = 0 {drafter} greedy={greedy}", **case, greedy=greedy)
    p0 = case["target_probs"][:, 0]
    expected = p0.argmax(dim=-1) if greedy else (p0 / case["noise"]).argmax(dim=-1)
    assert out.num_accepted.tolist() == [0] * B
    assert torch.equal(out.tokens, expected.unsqueeze(1))


@pytest.mark.parametrize("K", [16, 32])
def test_long_drafts_stop_exactly_where_the_math_says(K, device):
    """q = p at positions < m accepts for certain; at m, p(x) = 0 < q(x) rejects for certain. Row 2 has m = K."""
    B, V = 3, 1000
    stops = [K * 2 // 3, 0, K]
    case = make_case(B, K, V, drafter="model", seed=seed_of("long", K), device=device)
    x, p, q, noise = case["draft_tokens"], case["target_probs"].clone(), case["draft_probs"].clone(), case["noise"]
    q[:] = p[:, :K]
    for row, m in enumerate(stops):
        if m < K:
            p[row, m, x[row, m]] = 0.0
            p[row, m] = p[row, m] / p[row, m].sum()
    case.update(draft_probs=q, target_probs=p)
    out = run_both(f"K = {K}", **case)
    assert out.num_accepted.tolist() == stops
    for row, m in enumerate(stops):
        w = (p[row, m] - q[row, m]).clamp_min(0.0) if m < K else p[row, K]
        expected = x[row, :m].tolist() + [(w / noise[row]).argmax().item()] + [-1] * (K - m)
        assert out.tokens[row].tolist() == expected
    # and a random case at this K in both modes
    for greedy in (False, True):
        case = make_case(4, K, V, drafter="model", seed=seed_of("long-random", K, greedy), device=device)
        run_both(f"K = {K} random greedy={greedy}", **case, greedy=greedy)


@pytest.mark.parametrize("V", [7, 1000, 4099])
def test_vocabulary_tail_is_reached_and_not_overrun(V, device):
    """All of the bonus mass on the last token (inside a partial block); greedy and sampled emit V - 1."""
    B, K = 2, 2
    case = make_case(B, K, V, drafter="model", seed=seed_of("tail", V), device=device)
    p = case["target_probs"].clone()
    p[:, :K] = case["draft_probs"]  # accept everything
    p[:, K] = 0.0
    p[:, K, V - 1] = 1.0
    case["target_probs"] = p
    case["draft_tokens"] = p[:, :K].argmax(dim=-1)  # greedy accepts too
    for greedy in (False, True):
        out = run_both(f"tail V={V} greedy={greedy}", **case, greedy=greedy)
        assert out.num_accepted.tolist() == [K] * B
        assert out.tokens[:, K].tolist() == [V - 1] * B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_argmax_helper_is_torch_argmax_on_ties_and_nans(dtype):
    """`verify.argmax` (NumPy's or max(dim=-1) on the CPU, faster there) picks what torch.argmax picks: the first of
    equal maxima, NaN as the maximum, over widths past a vectorised reduction's blocks, for rows, a single row, a
    strided view and an inference-mode tensor."""
    g = torch.Generator().manual_seed(5)
    for V in (1, 7, 64, 1000, 49152, 65537):
        x = torch.randint(0, 4, (3, 2, V), generator=g).to(dtype)  # many ties
        x[1, 0, V // 3] = float("nan")
        for view in (x, x[1, 0], x[:, :, ::2], x.transpose(0, 1)):
            out = kv.argmax(view)
            assert torch.equal(out, view.argmax(dim=-1)) and out.dtype == torch.int64, V
    with torch.inference_mode():
        y = torch.randn(2, 300, generator=g).to(dtype)
        assert torch.equal(kv.argmax(y), y.argmax(dim=-1))


@pytest.mark.parametrize("tied", [(15000, 3000, 11192), (9000, 5000, 13192)])
def test_ties_pick_the_lowest_index(tied, device):
    """Exact ties in argmax go to the lowest index, as torch.argmax does, across lanes and blocks: in the
    second set the lowest index (5000) sits in a higher lane than 9000 for 4096- and 8192-wide blocks."""
    B, V = 2, 20000
    g = torch.Generator().manual_seed(seed_of("ties", tied))
    p = torch.rand(1, 1, V, generator=g) * 0.5
    p[..., list(tied)] = 1.0
    p = (p / p.sum()).expand(B, 1, V).contiguous().to(device)  # K = 0: one draw from p_0
    lowest = min(tied)
    none = torch.empty((B, 0), dtype=torch.int64, device=device)
    greedy = run_both("greedy ties", draft_tokens=none, draft_probs=None, target_probs=p, greedy=True)
    assert greedy.tokens[:, 0].tolist() == [lowest] * B
    flat = torch.zeros_like(p)
    flat[..., list(tied)] = 1.0 / len(tied)
    noise = torch.ones((B, V), device=device)  # equal scores on the tied tokens
    sampled = run_both("sampled ties", draft_tokens=none, draft_probs=None, target_probs=flat,
                       uniform=torch.empty((B, 0), device=device), noise=noise)
    assert sampled.tokens[:, 0].tolist() == [lowest] * B
    for block_b, block_v in ((1, 1024), (2, 4096)):
        out = kv._verify_triton_launch(none, None, flat, None, noise, False, block_b, block_v, 4)
        assert out.tokens[:, 0].tolist() == [lowest] * B, f"BLOCK_B={block_b} BLOCK_V={block_v}"


# ----------------------------------------------------------------------------------------------------
# Distribution: the emitted tokens follow p

N = 30_000
CRITICAL = 15.086  # chi-squared, 5 degrees of freedom, 1% level
P0 = [0.30, 0.25, 0.20, 0.10, 0.10, 0.05]
Q0 = [0.05, 0.10, 0.10, 0.25, 0.20, 0.30]
P1 = [0.10, 0.35, 0.05, 0.20, 0.15, 0.15]
Q1 = [0.25, 0.05, 0.30, 0.10, 0.20, 0.10]
DETERMINISTIC_DRAFTS = [3, 2, 0, 5]  # the deterministic drafter's proposal at positions 0..3


def chi_squared(tokens: torch.Tensor, law) -> float:
    law = torch.tensor(law, dtype=torch.float64)
    counts = torch.bincount(tokens.cpu(), minlength=len(law)).double()
    expected = tokens.numel() * law
    return ((counts - expected) ** 2 / expected).sum().item()


def draw_round(laws, drafter, rows, g, device):
    """One round's inputs for `rows` rows: K drafts (position i from laws[i] for the model drafter, fixed for the
    deterministic one), their q, and the randoms. Drawn on the CPU, so every device sees the same samples."""
    K = len(laws)
    if drafter == "deterministic":
        x, q = torch.tensor(DETERMINISTIC_DRAFTS[:K]).expand(rows, K).contiguous(), None
    else:
        q = torch.tensor(laws).expand(rows, K, 6).contiguous()  # [rows, K, 6]
        x = torch.multinomial(q.reshape(rows * K, 6), 1, generator=g).reshape(rows, K)
    uniform, noise = draw_randoms(rows, K, 6, "cpu", g)
    to = lambda t: None if t is None else t.to(device)
    return {"draft_tokens": to(x), "draft_probs": to(q), "uniform": to(uniform), "noise": to(noise)}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("drafter", ["model", "deterministic"])
def test_emitted_tokens_follow_the_target(backend, K, drafter, device):
    """First emitted token ~ p_0 and second ~ p_1, with p_1 not depending on the first token.

    The second token is tokens[:, 1] where at least one draft was accepted (position 1 then uses u_1, x_1 and the
    noise, none of which decided the first token). Where nothing was accepted it comes from the next round: a second
    call whose first position has target p_1 and draft q_1, with fresh randoms, whose first emitted token ~ p_1.
    """
    verify_fn = BACKEND_FNS[backend]
    g = torch.Generator().manual_seed(seed_of("law", backend, K, drafter))
    later = [P0, P1, P0][: max(0, K - 1)]  # targets at positions 2..K; they do not matter for the first two tokens
    p = torch.tensor([P0, P1] + later, device=device).expand(N, K + 1, 6).contiguous()  # [N, K+1, 6]
    out = verify_fn(target_probs=p, **draw_round([Q0, Q1, Q1, Q0][:K], drafter, N, g, device))
    first = out.tokens[:, 0]
    second = out.tokens[:, 1].clone()

    again = (out.num_accepted == 0).nonzero().squeeze(1)  # rows whose second token comes from the next round
    p_next = torch.tensor([P1, P0], device=device).expand(again.numel(), 2, 6).contiguous()
    second[again] = verify_fn(target_probs=p_next, **draw_round([Q1], drafter, again.numel(), g, device)).tokens[:, 0]

    assert (second >= 0).all()
    stats = {"first vs p_0": chi_squared(first, P0), "second vs p_1": chi_squared(second, P1)}
    assert max(stats.values()) < CRITICAL, f"{backend} K={K} {drafter}: {stats}, critical {CRITICAL}"
    # the test has power: the draft law is rejected by a wide margin
    power = {"first vs q_0": chi_squared(first, Q0), "second vs q_1": chi_squared(second, Q1)}
    assert min(power.values()) > 100 * CRITICAL, f"{backend} K={K} {drafter}: {power}"
    assert 0 < again.numel() < N, "both branches of the second token are exercised"


# ----------------------------------------------------------------------------------------------------
# Backend switch, input checks, import and compilation


def test_unknown_backend_names_the_valid_ones(device):
    case = make_case(2, 2, 100, drafter="model", seed=1, device=device)
    with pytest.raises(ValueError, match="unknown backend 'cuda'") as info:
        verify(**case, backend="cuda")
    for name in ("auto", "torch", "triton"):
        assert repr(name) in str(info.value)


def test_auto_is_torch_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", "cpu") == "torch"
    assert not triton_available("cpu")
    with pytest.raises(ValueError, match="backend 'triton' needs CUDA"):
        resolve_backend("triton", "cpu")


def test_auto_is_triton_on_cuda_and_the_switch_dispatches(device):
    if ON_CUDA:
        assert resolve_backend("auto", device) == "triton"
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1" and resolve_backend("triton", "cpu") == "triton"
    case = make_case(3, 4, 1000, drafter="model", seed=seed_of("switch"), device=device)
    assert_same(verify_torch(**case), verify(**case, backend="triton"), "verify(backend='triton')")
    assert_same(verify_torch(**case), verify(**case, backend="torch"), "verify(backend='torch')")
    assert_same(verify_torch(**case), verify(**case, backend="auto"), "verify(backend='auto')")


def test_triton_launcher_rejects_what_it_cannot_match_bit_for_bit(device):
    case = make_case(2, 2, 100, drafter="model", seed=2, device=device)
    with pytest.raises(ValueError, match="target_probs must be float32"):
        verify_triton(**{**case, "target_probs": case["target_probs"].half()})
    with pytest.raises(ValueError, match="draft_tokens must be int64"):
        verify_triton(**{**case, "draft_tokens": case["draft_tokens"].int()})
    with pytest.raises(ValueError, match=r"noise must be \[B, V\]"):
        verify_triton(**{**case, "noise": case["noise"][:, :50]})


def test_module_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib, torch\nkv = importlib.import_module('kernels.verify')\n"
        "assert kv.verify_triton is None and not kv.triton_available('cpu')\n"
        "p = torch.softmax(torch.randn(2, 3, 50), -1)\n"
        "out = kv.verify(torch.randint(0, 50, (2, 2)), None, p, backend='auto')\n"
        "assert out.tokens.shape == (2, 3)\n"
        "try:\n    kv.resolve_backend('triton', 'cpu')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_kernel_compiles_for_hopper_with_precise_division():
    """Ahead-of-time compile (no GPU needed: triton's bundled ptxas) for sm_90, every constexpr branch, and
    check the PTX divides with div.rn.f32 (rounds like torch), never the approximate div.full/div.approx."""
    code = r"""
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.verify import _verify_kernel, _verify_split_kernel
i64_ptrs = {"draft_tokens_ptr", "num_accepted_ptr", "tokens_ptr"}
i32_ptrs = {"part_idx_ptr", "count_ptr"}
for kernel, split in ((_verify_kernel, {}), (_verify_split_kernel, {"CHUNK": 8192, "SLOTS": 3, "BLOCK_C": 4})):
    for has_q in (False, True):
        for greedy in (False, True):
            for block_k, stages in ((1, 1), (64, 3)):
                consts = {"V": 32003, "BLOCK_B": 1, "BLOCK_K": block_k, "BLOCK_V": 4096, "NUM_STAGES": stages,
                          "HAS_Q": has_q, "GREEDY": greedy, **split}
                sig = {n: "constexpr" if n in consts else ("*i64" if n in i64_ptrs else "*i32" if n in i32_ptrs else "*fp32")
                       if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
                k = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": 8})
                ptx = k.asm["ptx"]
                assert len(k.asm["cubin"]) > 0
                assert not re.search(r"div\.(full|approx)", ptx), "approximate division in the PTX"
                assert greedy or "div.rn.f32" in ptx, "no precise division in the PTX"
                if split:  # the counter bump orders the partial stores (release) before the reduction's loads (acquire)
                    assert re.search(r"atom\.[\w.]*acq_rel[\w.]*\.add", ptx) and re.search(r"atom\.[\w.]*gpu", ptx), \
                        "the counter is not an acq_rel, gpu-scope atomic add"
                    assert "bar.sync" in ptx and "ld.global.cg" in ptx, "no barrier before the bump or cached partial loads"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
