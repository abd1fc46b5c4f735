"""Tests for kernels/tree_verify.py: the Triton kernel against the reference bit for bit (same explicit randoms) on
irregular trees and vocabularies; a chain tree against the chain verifier; greedy against plain greedy decoding;
hand-checked sibling steps; and the law of the first and second emitted tokens (chi-squared, N = 30,000) for trees
of width 1, 2 and 4 with i.i.d., without-replacement and deterministic siblings. On a machine without CUDA the
kernel runs in Triton's interpreter (see conftest.py)."""
import importlib
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from flashspec_core.sampling import SamplingConfig, logits_to_probs
from flashspec_core.tree import DraftTree
from kernels.tree_verify import TreeVerifyResult, verify_tree, verify_tree_torch, verify_tree_triton
from kernels.verify import draw_randoms, verify_torch, verify_triton

REPO = Path(__file__).resolve().parents[2]
tv = importlib.import_module("kernels.tree_verify")
BACKEND_FNS = {"torch": verify_tree_torch, "triton": verify_tree_triton}

# root -+- 0 -+- 2 --- 5
#       |     +- 3
#       +- 1 --- 4
SMALL = DraftTree((-1, -1, 0, 0, 1, 2))
# four children at the root; the first has four, the second two, the last one; then a chain below node 4
WIDE = DraftTree((-1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 3, 4, 11))
TREES = {"chain1": DraftTree.chain(1), "chain4": DraftTree.chain(4), "small": SMALL, "wide": WIDE,
         "root-only": DraftTree((-1, -1, -1))}


def seed_of(*parts) -> int:
    """A seed that depends only on the test case (str hashing is salted per process; crc32 is not)."""
    return zlib.crc32(repr(parts).encode())


def assert_same(ref, out, what: str):
    """Identical num_accepted, path and tokens; the message reports the largest differences."""
    for name in ("num_accepted", "path", "tokens"):
        a, b = getattr(ref, name), getattr(out, name)
        assert b.shape == a.shape, f"{what}: {name} shape {tuple(b.shape)} != {tuple(a.shape)}"
        assert b.dtype == torch.int64, f"{what}: {name} must be int64, got {b.dtype}"
        diff = (a - b).abs().max().item() if a.numel() else 0
        assert diff == 0, f"{what}: max |{name} diff| = {diff}, {(a != b).sum().item()} of {a.numel()} differ"


def make_case(tree, B, V, *, drafter, seed, device, scale=3.0, guess=0.5):
    """Fresh peaky p and q: each node's q is a perturbation of the target's p at its parent, its token is the
    target's argmax there with probability `guess` and otherwise drawn from q (so first siblings, later siblings
    and full rejections all occur), and explicit randoms. Drawn on the CPU, the same on every device."""
    g = torch.Generator().manual_seed(seed)
    N = tree.N
    p_logits = torch.randn(B, N + 1, V, generator=g) * scale
    parent = tree.parent_slots()
    q = torch.softmax(p_logits[:, parent] + torch.randn(B, N, V, generator=g), dim=-1)  # [B, N, V]
    p = torch.softmax(p_logits, dim=-1)  # [B, N+1, V]
    if N:
        sampled = torch.multinomial(q.reshape(B * N, V), 1, generator=g).reshape(B, N)
        x = torch.where(torch.rand(B, N, generator=g) < guess, p[:, parent].argmax(-1), sampled)
    else:
        x = torch.empty((B, 0), dtype=torch.int64)
    uniform, noise = draw_randoms(B, N, V, "cpu", g)
    return {"tree": tree, "draft_tokens": x.to(device), "draft_probs": q.to(device) if drafter == "model" else None,
            "target_probs": p.to(device), "uniform": uniform.to(device), "noise": noise.to(device)}


def run_both(what, **case):
    """Both backends on the same inputs; asserts they agree and returns the reference's result."""
    ref = verify_tree_torch(**case)
    assert_same(ref, verify_tree_triton(**case), what)
    return ref


# ----------------------------------------------------------------------------------------------------
# Parity: same randoms, identical outputs

GRID = [(tree, B, V, drafter, greedy) for tree in TREES for B, V in ((1, 1000), (6, 1000), (3, 32003))
        for drafter in ("model", "deterministic") for greedy in (False, True)]


@pytest.mark.parametrize("tree,B,V,drafter,greedy", GRID)
def test_parity_with_reference(tree, B, V, drafter, greedy, device):
    case = make_case(TREES[tree], B, V, drafter=drafter, seed=seed_of(tree, B, V, drafter, greedy), device=device)
    run_both(f"{tree} B={B} V={V} {drafter} greedy={greedy}", **case, greedy=greedy)


def sibling_rank(tree, node):
    return tree.children[tree.parents[node] + 1].index(node)


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_parity_cases_take_every_kind_of_step(drafter, greedy, device):
    """The parity inputs are not trivial: rows stop at every depth, accept a later sibling after rejecting the
    first, and (sampled) reject all the siblings of a node that has several."""
    case = make_case(WIDE, 256, 1000, drafter=drafter, seed=seed_of("mix", drafter, greedy), device=device)
    out = run_both(f"mix {drafter} greedy={greedy}", **case, greedy=greedy)
    counts = torch.bincount(out.num_accepted.cpu(), minlength=WIDE.max_depth + 1).tolist()
    assert all(c > 0 for c in counts[:4]), f"accepted-count histogram {counts}"
    later = sum(sibling_rank(WIDE, node) > 0 for node in out.path.flatten().tolist() if node >= 0)
    assert later > 0, "no row accepted a sibling after the first"
    if not greedy:  # a row whose walk ended at a node with several children, none accepted
        ends = [max(row) for row in out.path.tolist()]  # the last accepted node, -1 for the root
        assert sum(len(WIDE.children[e + 1]) > 1 for e, n in zip(ends, out.num_accepted.tolist())
                   if n < WIDE.max_depth) > 0


def test_parity_when_randoms_come_from_a_generator(device):
    case = make_case(SMALL, 8, 1000, drafter="model", seed=seed_of("gen"), device=device)
    case.pop("uniform"), case.pop("noise")
    ref = verify_tree_torch(**case, generator=torch.Generator(device).manual_seed(11))
    out = verify_tree_triton(**case, generator=torch.Generator(device).manual_seed(11))
    assert_same(ref, out, "generator draws")


@pytest.mark.parametrize("greedy", [False, True])
def test_parity_on_strided_inputs(greedy, device):
    """Views with padding (NaN, so reading it would show) and transposed storage go through the strides."""
    case = make_case(WIDE, 4, 1000, drafter="model", seed=seed_of("strided", greedy), device=device)

    def padded_view(t):  # same values, last-dim view into a wider NaN-filled buffer
        wide = torch.full((*t.shape[:-1], t.shape[-1] + 24), float("nan"), dtype=t.dtype, device=device)
        wide[..., 3:3 + t.shape[-1]] = t
        return wide[..., 3:3 + t.shape[-1]]

    def transposed_storage(t):  # same values, column-major [B, N]
        return t.t().contiguous().t()

    strided = {**case, "draft_tokens": transposed_storage(case["draft_tokens"]),
               "draft_probs": padded_view(case["draft_probs"]), "target_probs": padded_view(case["target_probs"]),
               "uniform": transposed_storage(case["uniform"]), "noise": padded_view(case["noise"])}
    assert not strided["target_probs"].is_contiguous() and not strided["draft_tokens"].is_contiguous()
    assert_same(verify_tree_torch(**case, greedy=greedy), verify_tree_triton(**strided, greedy=greedy), "strided")


@pytest.mark.parametrize("block_b,block_v", [(1, 128), (4, 256), (8, 1024)])
@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_parity_across_launch_configurations(block_b, block_v, drafter, greedy, device):
    """One row per program (the CUDA layout) and several, with a partial last row block and V block."""
    case = make_case(WIDE, 5, 1000, drafter=drafter, seed=seed_of("tiles", block_b, block_v, drafter, greedy),
                     device=device)
    ref = verify_tree_torch(**case, greedy=greedy)
    out = tv._verify_tree_triton_launch(case["tree"], case["draft_tokens"], case["draft_probs"], case["target_probs"],
                                        case["uniform"], case["noise"], greedy, block_b, block_v, 4)
    assert_same(ref, out, f"BLOCK_B={block_b} BLOCK_V={block_v} {drafter} greedy={greedy}")


# ----------------------------------------------------------------------------------------------------
# A chain tree is the chain verifier


@pytest.mark.parametrize("K", [0, 1, 4, 8])
@pytest.mark.parametrize("drafter", ["model", "deterministic"])
@pytest.mark.parametrize("greedy", [False, True])
def test_chain_tree_is_the_chain_verifier(K, drafter, greedy, device):
    case = make_case(DraftTree.chain(K), 32, 1000, drafter=drafter, seed=seed_of("chain", K, drafter, greedy),
                     device=device)
    chain_args = {k: v for k, v in case.items() if k != "tree"}
    want = verify_torch(**chain_args, greedy=greedy)
    chain_triton = verify_triton(**chain_args, greedy=greedy)
    assert torch.equal(chain_triton.tokens, want.tokens), "the chain verifier's own backends differ"
    for backend, fn in BACKEND_FNS.items():
        out = fn(**case, greedy=greedy)
        assert torch.equal(out.num_accepted, want.num_accepted) and torch.equal(out.tokens, want.tokens), \
            f"{backend} K={K} {drafter} greedy={greedy}: {(out.tokens != want.tokens).sum().item()} tokens differ"
        expected_path = torch.arange(K, device=device).expand(32, K)
        assert torch.equal(out.path, torch.where(expected_path < want.num_accepted[:, None], expected_path, -1))
    if K:
        assert 0 < want.num_accepted.sum() < 32 * K, "both accepts and rejects"


# ----------------------------------------------------------------------------------------------------
# Greedy is plain greedy decoding


def toy_target(prefix: tuple, V: int) -> torch.Tensor:
    """A fixed 'model': the next-token law after `prefix`, a function of the prefix alone."""
    g = torch.Generator().manual_seed(seed_of("toy", prefix))
    return torch.softmax(torch.randn(V, generator=g) * 3, dim=-1)


def greedy_row(tree, V, g):
    """One row: node tokens that carry plain greedy decoding's continuation on a random part of the tree (stray
    tokens elsewhere), the toy target at every slot [N+1, V], and what the walk must give: the first
    n + 1 greedy tokens and the path, the first child in order carrying the greedy token at each step."""
    greedy = [0]  # the root token, then plain greedy decoding
    for _ in range(tree.max_depth + 1):
        greedy.append(toy_target(tuple(greedy), V).argmax().item())
    x = torch.randint(0, V, (tree.N,), generator=g).tolist()
    for node in range(tree.N):  # nodes in order: a parent's token is final before its children's
        on_greedy_branch = all(x[a] == greedy[d + 1] for d, a in enumerate(tree.path_to(node)[:-1]))
        if on_greedy_branch and torch.rand(1, generator=g).item() < 0.6:
            x[node] = greedy[tree.depth[node]]
    target = torch.stack([toy_target(tuple([0] + [x[a] for a in tree.path_to(s - 1)]), V) for s in range(tree.N + 1)])
    node, n = -1, 0
    while True:
        carrying = [c for c in tree.children[node + 1] if x[c] == greedy[n + 1]]
        if not carrying:
            return x, target, greedy[1:n + 2], list(tree.path_to(node))
        node, n = carrying[0], n + 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_emits_what_plain_greedy_decoding_emits(backend, device):
    """The emitted tokens are the first num_accepted + 1 tokens of plain greedy decoding, and the path is the
    first-in-order branch that carries them."""
    g = torch.Generator().manual_seed(seed_of("greedy-walk"))
    rows = [greedy_row(WIDE, 37, g) for _ in range(24)]
    x = torch.tensor([r[0] for r in rows], device=device)
    p = torch.stack([r[1] for r in rows]).to(device)
    out = BACKEND_FNS[backend](WIDE, x, None, p, greedy=True)
    for row, (_, _, want_tokens, want_path) in enumerate(rows):
        n = out.num_accepted[row].item()
        assert out.tokens[row].tolist() == want_tokens + [-1] * (WIDE.max_depth - n), f"row {row}"
        assert out.path[row].tolist() == want_path + [-1] * (WIDE.max_depth - n), f"row {row}"
    assert len(set(out.num_accepted.tolist())) >= 3, "rows stop at several depths"


# ----------------------------------------------------------------------------------------------------
# Sampled steps against the math


def one_level(V, tokens, p0, device):
    """A root with len(tokens) deterministic leaf children; the target at every child is p0 too."""
    tree = DraftTree((-1,) * len(tokens))
    p = torch.tensor(p0, device=device).expand(1, len(tokens) + 1, V).contiguous()
    return tree, torch.tensor([tokens], device=device), p


def test_deterministic_siblings_renormalise_and_never_emit_a_rejected_token(device):
    """p = [.4, .3, .2, .1, 0, 0], children 0 then 1. Child 0 is accepted iff u_0 < .4; then child 1 is tested
    against p without token 0, renormalised: accepted iff u_1 < .3 / .6 = .5. With both rejected the token is
    drawn from p without 0 and 1, i.e. from {2, 3} only, whatever the noise."""
    V, p0 = 6, [0.4, 0.3, 0.2, 0.1, 0.0, 0.0]
    tree, x, p = one_level(V, [0, 1], p0, device)
    noise = torch.tensor([[1e-6, 1e-6, 1.0, 5.0, 1.0, 1.0]], device=device)  # the race favours 0, 1, then 2
    cases = {(0.399, 0.9): [0], (0.401, 0.499): [1], (0.401, 0.501): [], (0.9, 0.9): []}
    for (u0, u1), accepted in cases.items():
        out = run_both(f"u = {u0}, {u1}", tree=tree, draft_tokens=x, draft_probs=None, target_probs=p,
                       uniform=torch.tensor([[u0, u1]], device=device), noise=noise)
        assert out.path[0, :len(accepted)].tolist() == accepted and out.num_accepted.item() == len(accepted)
        if not accepted:
            assert out.tokens[0].tolist() == [2, -1], "the residual is p without tokens 0 and 1"
        else:  # a leaf: the bonus race on p favours token 0 (smallest noise)
            assert out.tokens[0].tolist() == [accepted[0], 0]


def test_sampled_siblings_renormalise_the_residual_of_q(device):
    """Children drawn from q: after rejecting child 0 (token 2), child 1 (token 1) is tested against
    norm(max(0, p - q)). p = [.5, .3, .2], q = [.2, .2, .6]: the residual is [.3, .1, 0] / .4, so child 1 is
    accepted iff u_1 * q(1) < .25, i.e. u_1 < 1.25: always; and child 0 iff u_0 * .6 < .2, i.e. u_0 < 1/3."""
    V = 3
    tree = DraftTree((-1, -1))
    p = torch.tensor([0.5, 0.3, 0.2], device=device).expand(1, 3, V).contiguous()
    q = torch.tensor([0.2, 0.2, 0.6], device=device).expand(1, 2, V).contiguous()
    x = torch.tensor([[2, 1]], device=device)
    noise = torch.ones((1, V), device=device)
    for u0, want in ((0.33, [2]), (0.34, [1])):
        out = run_both(f"u0 = {u0}", tree=tree, draft_tokens=x, draft_probs=q, target_probs=p,
                       uniform=torch.tensor([[u0, 0.999]], device=device), noise=noise)
        assert out.path[0].tolist() == [0 if want == [2] else 1] and out.tokens[0, 0].tolist() == want[0]
    # child 1 = token 2 again (i.i.d. siblings may repeat): the residual has no mass at 2, so it is rejected and
    # the final token comes from norm(max(0, residual - q)) = [1, 0, 0]
    out = run_both("repeat", tree=tree, draft_tokens=torch.tensor([[2, 2]], device=device), draft_probs=q,
                   target_probs=p, uniform=torch.tensor([[0.5, 0.0]], device=device), noise=noise)
    assert out.num_accepted.item() == 0 and out.tokens[0].tolist() == [0, -1]


def test_the_residual_mass_is_the_same_in_any_order():
    """The normaliser between siblings is summed in fixed point: a permutation of the vocabulary (another order
    of additions) gives the identical float, which a float32 sum does not promise."""
    g = torch.Generator().manual_seed(5)
    r = torch.softmax(torch.randn(4, 50_000, generator=g) * 4, dim=-1)
    perm = torch.randperm(50_000, generator=g)
    assert torch.equal(tv._fixed_point_mass(r), tv._fixed_point_mass(r[:, perm]))
    assert torch.allclose(tv._fixed_point_mass(r).double().squeeze(1), r.double().sum(-1), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Distribution: the first and second emitted tokens follow the target
#
# The target is a Markov chain over V = 6 tokens: P0 for the first token, then P[last token] for every later one;
# the draft is another chain (Q0, Q) that disagrees with it. A round's tree is drafted row by row from the draft
# chain; where a round accepts nothing, the second token is the first token of the next round, rooted at the first.

N_SAMPLES = 30_000
V6 = 6
P0 = [0.30, 0.25, 0.20, 0.10, 0.10, 0.05]
Q0 = [0.10, 0.30, 0.05, 0.25, 0.10, 0.20]
P = torch.softmax(torch.randn(V6, V6, generator=torch.Generator().manual_seed(21)) * 1.5, dim=-1)
Q = torch.softmax(P.log() + torch.randn(V6, V6, generator=torch.Generator().manual_seed(22)), dim=-1)  # near P
LAW_TREES = {  # width 1, 2 and 4
    1: DraftTree.chain(3),
    2: DraftTree.full((2, 2)),
    4: DraftTree((-1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 2)),
}


def tables(sampling):
    """Target and draft laws indexed by the last token, row V6 (index -1) for the first token: [V6 + 1, V6]."""
    p = torch.cat([P, torch.tensor([P0])]).double()
    if sampling == "top_p":  # the engine's own processing, on the target only: q keeps mass where p has none
        p = logits_to_probs(p.log(), SamplingConfig(temperature=1.0, top_p=0.8)).double()
    return p.float(), torch.cat([Q, torch.tensor([Q0])])


def draw_round(tree, last, drafter, sampling, g):
    """One round for len(last) rows whose pending token is `last` (-1: the first token). Returns the verifier's
    inputs: node tokens drafted from the draft chain (i.i.d. siblings, siblings without replacement, or the
    parent's top-k in order), the law each node was drawn from, the target at every slot, and the randoms."""
    p_tab, q_tab = tables(sampling)
    B, N = last.shape[0], tree.N
    x = torch.empty((B, N), dtype=torch.int64)
    q_node = torch.empty((B, N, V6))
    for node in range(N):
        parent = tree.parents[node]
        q = q_tab[last if parent < 0 else x[:, parent]]  # [B, V6]: the draft's law after the parent
        earlier = tree.children[parent + 1][:tree.children[parent + 1].index(node)]
        if drafter == "deterministic":  # the parent's top-k, highest first
            x[:, node] = q.topk(len(earlier) + 1, dim=-1).indices[:, -1]
            continue
        if drafter == "without_replacement":
            for s in earlier:
                q = q.scatter(1, x[:, s:s + 1], 0.0)
            q = q / q.sum(-1, keepdim=True)
        q_node[:, node] = q
        x[:, node] = torch.multinomial(q, 1, generator=g).squeeze(1)
    slot_last = torch.cat([last[:, None], x], dim=1)  # [B, N+1]: the last token at every slot
    uniform, noise = draw_randoms(B, N, V6, "cpu", g)
    return {"tree": tree, "draft_tokens": x, "draft_probs": None if drafter == "deterministic" else q_node,
            "target_probs": p_tab[slot_last].contiguous(), "uniform": uniform, "noise": noise}


def critical(df: int) -> float:
    """The chi-squared 0.1% critical value (Wilson-Hilferty; within 0.5% of the exact value for df >= 2). The file
    computes about a hundred statistics: at 1% one or two would exceed their critical value by chance alone."""
    z = 3.090232306167813
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_squared(samples: torch.Tensor, law: torch.Tensor) -> tuple[float, float]:
    """(statistic, 1% critical value) of integer samples against `law` (flattened); no sample outside its support."""
    law = law.double().flatten()
    counts = torch.bincount(samples, minlength=law.numel()).double()
    support = law > 0
    assert counts[~support].sum() == 0, f"samples outside the law's support: {counts.tolist()}"
    expected = samples.numel() * law[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), critical(int(support.sum()) - 1)


def first_two_tokens(verify_fn, tree, drafter, sampling, g, device):
    """The first two emitted tokens of N_SAMPLES independent generations, and the first round's result."""
    to = lambda case: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    start = torch.full((N_SAMPLES,), -1, dtype=torch.int64)
    out = verify_fn(**to(draw_round(tree, start, drafter, sampling, g)))
    first, second = out.tokens[:, 0].cpu(), out.tokens[:, 1].cpu().clone()
    again = (out.num_accepted.cpu() == 0).nonzero().squeeze(1)  # their second token comes from the next round
    nxt = verify_fn(**to(draw_round(tree, first[again], drafter, sampling, g)))
    second[again] = nxt.tokens[:, 0].cpu()
    return first, second, out


def assert_law(first, second, sampling, what):
    p_tab, q_tab = tables(sampling)
    p0, p = p_tab[-1].double(), p_tab[:V6].double()
    stats = {"first": chi_squared(first, p0), "second": chi_squared(second, p0 @ p),
             "joint": chi_squared(first * V6 + second, p0[:, None] * p)}
    assert all(s < c for s, c in stats.values()), f"{what}: (chi2, critical) {stats}"
    return stats


LAW_CASES = [(width, drafter, sampling) for width in LAW_TREES for sampling in ("t1", "top_p")
             for drafter in ("iid", "without_replacement", "deterministic")
             if not (width == 1 and drafter == "without_replacement")]  # a chain has no siblings: that is iid


@pytest.mark.parametrize("width,drafter,sampling", LAW_CASES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_first_and_second_tokens_follow_the_target(backend, width, drafter, sampling, device):
    """First token ~ P0, second ~ P0 @ P, and the pair ~ P0(a) P(b | a), over the tree's accepts, later-sibling
    accepts, full rejections and next rounds."""
    tree = LAW_TREES[width]
    g = torch.Generator().manual_seed(seed_of("law", backend, width, drafter, sampling))
    first, second, out = first_two_tokens(BACKEND_FNS[backend], tree, drafter, sampling, g, device)
    assert_law(first, second, sampling, f"{backend} width {width} {drafter} {sampling}")
    n = out.num_accepted.cpu()
    assert 0 < (n == 0).sum() < N_SAMPLES and (n >= 2).sum() > 0, "rows stop at 0, 1 and 2 or more"
    if width > 1:
        later = sum(sibling_rank(tree, node) > 0 for node in out.path[:, 0].tolist() if node >= 0)
        assert later > N_SAMPLES // 100, f"only {later} rows accepted a later sibling at the root"


def test_the_law_test_has_power(device, monkeypatch):
    """The same statistics reject what a wrong verifier emits: the draft's law, and the residual left
    unnormalised between siblings (u * q(x) tested against max(0, p - q) instead of its normalised form)."""
    tree = LAW_TREES[4]
    g = torch.Generator().manual_seed(seed_of("power"))
    first, _, _ = first_two_tokens(verify_tree_torch, tree, "iid", "t1", g, device)
    stat, crit = chi_squared(first, torch.tensor(Q0))
    assert stat > 100 * crit, "the first token is far from the draft's law"
    monkeypatch.setattr(tv, "_fixed_point_mass", lambda r: torch.ones_like(r[:, :1]))
    first, second, _ = first_two_tokens(verify_tree_torch, tree, "iid", "t1", g, device)
    with pytest.raises(AssertionError, match="chi2, critical"):
        assert_law(first, second, "t1", "unnormalised residual")


# ----------------------------------------------------------------------------------------------------
# Backend switch, input checks


def test_the_switch_dispatches_and_rejects_unknown_names(device):
    case = make_case(SMALL, 3, 1000, drafter="model", seed=seed_of("switch"), device=device)
    for backend in ("torch", "triton", "auto"):
        assert_same(verify_tree_torch(**case), verify_tree(**case, backend=backend), f"backend={backend}")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        verify_tree(**case, backend="cuda")


def test_inputs_are_checked_against_the_tree(device):
    case = make_case(SMALL, 2, 100, drafter="model", seed=seed_of("checks"), device=device)
    with pytest.raises(ValueError, match=r"draft_tokens must be \[B, N\] = \[B, 6\]"):
        verify_tree_torch(**{**case, "draft_tokens": case["draft_tokens"][:, :4]})
    with pytest.raises(ValueError, match=r"target_probs must be \[B, N\+1, V\]"):
        verify_tree_torch(**{**case, "target_probs": case["target_probs"][:, :6]})
    with pytest.raises(ValueError, match=r"draft_probs must be \[B, N, V\]"):
        verify_tree_triton(**{**case, "draft_probs": case["draft_probs"][:, :, :50]})
    with pytest.raises(ValueError, match="tree must have N, max_depth and child_table"):
        verify_tree_torch(**{**case, "tree": (-1, -1, 0, 0, 1, 2)})
    with pytest.raises(ValueError, match="target_probs must be float32"):
        verify_tree_triton(**{**case, "target_probs": case["target_probs"].double()})
    assert isinstance(verify_tree_torch(**case), TreeVerifyResult)


def test_kernel_compiles_for_hopper_without_contracted_or_approximate_arithmetic():
    """Ahead-of-time compile (no GPU needed: triton's bundled ptxas) for sm_90, every constexpr branch, a chain, a
    wide tree and no tree: the PTX divides with div.rn.f32 (rounds like torch) and has no fused multiply-add (an
    FMA would round differently from the reference's separate multiply and add), and orders the scratch's writes
    before other lanes read them (bar.sync)."""
    code = r"""
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.tree_verify import _tree_verify_kernel
i64_ptrs = {"draft_tokens_ptr", "children_ptr", "num_accepted_ptr", "path_ptr", "tokens_ptr"}
for has_q in (False, True):
    for greedy in (False, True):
        for n, w, d in ((0, 1, 0), (4, 1, 4), (13, 4, 4)):
            consts = {"N": n, "W": w, "D": d, "V": 32003, "BLOCK_B": 1, "BLOCK_W": triton.next_power_of_2(w),
                      "BLOCK_D": triton.next_power_of_2(d + 1), "BLOCK_V": 4096, "HAS_Q": has_q, "GREEDY": greedy}
            sig = {a: "constexpr" if a in consts else ("*i64" if a in i64_ptrs else "*fp32") if a.endswith("_ptr")
                   else "i32" for a in _tree_verify_kernel.arg_names}
            k = triton.compile(ASTSource(_tree_verify_kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 8})
            ptx = k.asm["ptx"]
            assert len(k.asm["cubin"]) > 0
            assert not re.search(r"div\.(full|approx)", ptx), "approximate division in the PTX"
            assert not re.search(r"\bfma\.", ptx), "a fused multiply-add in the PTX"
            assert greedy or "div.rn.f32" in ptx, "no precise division in the PTX"
            assert greedy or w < 2 or "bar.sync" in ptx, "no barrier after the scratch is written"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_module_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib, torch\ntv = importlib.import_module('kernels.tree_verify')\n"
        "from flashspec_core.tree import DraftTree\n"
        "assert tv.verify_tree_triton is None\n"
        "p = torch.softmax(torch.randn(2, 4, 50), -1)\n"
        "out = tv.verify_tree(DraftTree((-1, -1, 0)), torch.randint(0, 50, (2, 3)), None, p, backend='auto')\n"
        "assert out.tokens.shape == (2, 3) and out.path.shape == (2, 2)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
