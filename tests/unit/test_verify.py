"""Verification: the acceptance rule (``treespec.accept.accept``) on literal cases, and exact
output distributions of the rejection-sampling reference (``tests/helpers/rejection_sampling.py``).

The rule's cases are literal lists with the reason. The sampling tests replicate one small
tree over many trials in a single ``verify_sampling`` call (one row of uniforms per trial,
from a seeded generator) and chi-square test the committed tokens against the processed
target distribution (``SamplingParams.probs``): the first token against the root's, and,
conditional on the first accepted node being a given drafted child, the second token
against that child's. Negative controls run deliberately wrong rules through the same
tests, which must then fail.

Trial counts: ``verify_sampling`` costs about 0.4 ms per replicated tree on these CPUs
(per-tree Python in ``pad_trees``), so the main configuration runs 20000 trials and the
other processing variants 5000 each, the q-aware rule 6000, keeping the file near 30 s.
Set ``TREESPEC_VERIFY_TRIALS`` to run every deterministic-draft variant with that many.

Note: the deterministic rule (no ``draft_probs``) is lossless for *any* set of distinct
children chosen independently of the verifier's uniforms, q-sampled ones included (tried:
it passes the chi-square test), so it cannot serve as the q-aware rule's negative control;
the controls there are the q-aware rule with one step left out, and the acceptance rate,
which only the q-aware rule makes ``sum_x min(p, q)``.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.rejection_sampling import verify_sampling
from helpers.stats import chi_square, token_counts, token_probs
from helpers.trees import trees
from treespec import SamplingParams, Tree
from treespec.accept import Verdict, accept, accept_fixed, first_argmax, verdicts_of

# ---- greedy: literal cases ------------------------------------------------------------------

CHAIN = Tree([-1, 0, 1, 2], [7, 5, 3, 4])  # root 7 -> 5 -> 3 -> 4
#       root(7)
#      /   |   \
#    5(1) 6(2) 9(3)
#    |     |
#    3(4) 8(5)
#          |
#          2(6)
BRANCHY = Tree([-1, 0, 0, 0, 1, 2, 5], [7, 5, 6, 9, 3, 8, 2])

# (tree, target argmax at each node, expected path, expected committed tokens, reason)
GREEDY_CASES = [
    (CHAIN, [5, 3, 4, 9], [0, 1, 2, 3], [5, 3, 4, 9], "all match: 3 accepted + bonus 9"),
    (CHAIN, [5, 1, 4, 9], [0, 1], [5, 1], "mismatch at position 1: the correction 1 replaces 3"),
    (CHAIN, [6, 3, 4, 9], [0], [6], "mismatch at position 0: only the correction"),
    (CHAIN, [5, 3, 0, 9], [0, 1, 2], [5, 3, 0], "mismatch at the last drafted token"),
    (BRANCHY, [6, 0, 8, 0, 0, 2, 1], [0, 2, 5, 6], [6, 8, 2, 1], "second branch matches to its leaf"),
    (BRANCHY, [9, 3, 8, 0, 0, 2, 1], [0, 3], [9, 0], "third child matches; its leaf gives the bonus 0"),
    (BRANCHY, [5, 3, 8, 0, 4, 2, 1], [0, 1, 4], [5, 3, 4], "first branch, then its leaf's bonus"),
    (BRANCHY, [5, 8, 8, 0, 4, 2, 1], [0, 1], [5, 8], "8 matches only under the other branch"),
    (BRANCHY, [1, 3, 8, 0, 4, 2, 1], [0], [1], "no child matches the root's argmax"),
    (Tree([-1], [7]), [3], [0], [3], "root only: plain decoding"),
]


@pytest.mark.parametrize("tree,argmax,path,tokens,reason", GREEDY_CASES, ids=[c[-1] for c in GREEDY_CASES])
def test_greedy_literal(tree, argmax, path, tokens, reason):
    (v,) = accept([tree], torch.tensor([argmax]))
    assert v == Verdict(path, tokens), reason
    assert v.num_accepted == len(path) - 1


def test_greedy_batch_with_padding():
    """Trees of different sizes in one call; padding columns (-1 here) are never read."""
    trees = [CHAIN, Tree([-1], [7]), BRANCHY]
    argmax = torch.tensor([
        [5, 3, 4, 9, -1, -1, -1],
        [3, -1, -1, -1, -1, -1, -1],
        [6, 0, 8, 0, 0, 2, 1],
    ])
    got = accept(trees, argmax)
    assert got == [Verdict([0, 1, 2, 3], [5, 3, 4, 9]), Verdict([0], [3]), Verdict([0, 2, 5, 6], [6, 8, 2, 1])]


def fixed_verdicts(trees, choices, N: int, rows: int) -> list[Verdict]:
    """``accept_fixed`` on trees laid out as a fixed-shape bucket: tree i in row i of ``rows``
    (the others padding) of N tokens, ``choices`` of each tree's nodes in its row's first
    entries, random ones elsewhere (padding's choices must change nothing)."""
    from treespec.fixed_shape import ancestor_masks

    tokens = torch.randint(0, 50, (rows, N))
    parents = torch.full((rows, N), -1)
    full = torch.randint(0, 50, (rows, N))
    for i, (t, c) in enumerate(zip(trees, choices)):
        n = t.num_nodes
        tokens[i, :n], parents[i, :n], full[i, :n] = t.tokens, t.parents, torch.as_tensor(c)[:n]
    packed = accept_fixed(full, tokens, parents, ancestor_masks(parents))
    assert packed.shape == (rows, 1 + 2 * N) and packed.dtype == torch.int64
    for row in packed.tolist():  # past the path, positions stay where they are; past the tokens, -1
        a = row[0]
        assert row[a + 2: N + 1] == list(range(a + 1, N)) and row[N + a + 2:] == [-1] * (N - a - 1)
    return verdicts_of(packed.tolist(), range(rows))


@pytest.mark.parametrize("tree,argmax,path,tokens,reason", GREEDY_CASES, ids=[c[-1] for c in GREEDY_CASES])
def test_greedy_literal_on_a_fixed_shape_bucket(tree, argmax, path, tokens, reason):
    """The rule on the device (``accept_fixed``, what a fixed-shape verify runs after its
    forward): the same verdicts, a row of padding alone committing its root's choice."""
    got = fixed_verdicts([tree], [argmax], 8, 2)
    assert got[0] == Verdict(path, tokens), reason
    assert got[1].path == [0] and len(got[1].tokens) == 1


@settings(deadline=None, derandomize=True, max_examples=150)
@given(st.lists(trees(max_nodes=16, vocab=20), min_size=1, max_size=3), st.data())
def test_fixed_shape_rule_equals_accept(tree_list, data):
    """Random trees and choices (drawn from each node's children's tokens most of the time, so
    that paths run deep): ``accept_fixed`` gives ``accept``'s verdicts; its packed path leaves
    the positions past the accepted ones in place."""
    choices = []
    for t in tree_list:
        kids = [[int(t.tokens[j]) for j in range(t.num_nodes) if int(t.parents[j]) == i] for i in range(t.num_nodes)]
        choices.append([data.draw(st.sampled_from(k) if k and data.draw(st.booleans()) else st.integers(0, 19))
                        for k in kids])
    want = accept(tree_list, torch.tensor([c + [0] * (16 - len(c)) for c in choices]))
    assert fixed_verdicts(tree_list, choices, 16, len(tree_list) + 1)[: len(tree_list)] == want


@settings(deadline=None, derandomize=True, max_examples=100)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 16), st.data())
def test_first_argmax_is_torchs_argmax(rows, V, block, data):
    """The two-stage argmax the fixed-shape verify takes is ``argmax`` of the values widened to
    fp32, whatever the block size: ties (values from a set of five), NaN, rows of -inf, a
    vocabulary that is no multiple of the block."""
    values = st.sampled_from([0.0, 1.0, 2.5, -math.inf, math.nan])
    x = torch.tensor(data.draw(st.lists(st.lists(values, min_size=V, max_size=V), min_size=rows, max_size=rows)),
                     dtype=data.draw(st.sampled_from([torch.float32, torch.bfloat16])))
    assert torch.equal(first_argmax(x, block, two_stage=True), x.float().argmax(-1))


# ---- sampling: helpers ----------------------------------------------------------------------

def passes(samples, p) -> bool:
    """Whether the tokens ``samples`` (int64 ``[N]``) pass the chi-square test against ``p`` ``[V]``."""
    stat, thr = chi_square(token_counts(samples), token_probs(p))
    return stat < thr


# Root 0 has three children (tokens 2, 4, 1); child 1 has two (tokens 3, 5); V = 7.
#        root
#      /  |   \
#    2(1) 4(2) 1(3)
#    / \
#  3(4) 5(5)
TREE = Tree([-1, 0, 0, 0, 1, 1], [0, 2, 4, 1, 3, 5])
V = 7
D, C = 2, 3  # depth and most children: uniforms are [B, D+1, C+1]


@functools.lru_cache(maxsize=None)
def logits() -> torch.Tensor:
    """float ``[6, V]`` synthetic target logits; the drafted tokens carry real mass and
    token 1 (node 3) falls outside top-k / top-p, so some drafted child has p = 0."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(TREE.num_nodes, V, generator=g)
    x[0, 2] += 1.2
    x[0, 4] += 0.6
    x[0, 1] += 0.3
    x[1, 3] += 1.0
    x[1, 5] += 0.5
    return x


def trials(name: str) -> int:
    env = os.environ.get("TREESPEC_VERIFY_TRIALS")
    if env:
        return int(env)
    return 20000 if name == "t0.7" else 5000


def uniforms(B: int, seed: int) -> torch.Tensor:
    return torch.rand(B, D + 1, C + 1, generator=torch.Generator().manual_seed(seed))


PARAMS = {
    "t0.7": SamplingParams(0.7),
    "t1.3": SamplingParams(1.3),
    "top_k3": SamplingParams(1.0, top_k=3),
    "top_p0.8": SamplingParams(1.0, top_p=0.8),
    "min_p0.2": SamplingParams(1.0, min_p=0.2),
    "combined": SamplingParams(1.3, top_k=5, top_p=0.9, min_p=0.1),
}


@functools.lru_cache(maxsize=None)
def sampled_verdicts(name: str):
    """(probs [6, V], first token [N], second token [N] or -1, first accepted node [N])."""
    probs = PARAMS[name].probs(logits())
    N = trials(name)
    verdicts = verify_sampling([TREE] * N, probs.expand(N, -1, -1), uniforms(N, seed=list(PARAMS).index(name)))
    first = torch.tensor([v.tokens[0] for v in verdicts])
    second = torch.tensor([v.tokens[1] if len(v.tokens) > 1 else -1 for v in verdicts])
    node = torch.tensor([v.path[1] if len(v.path) > 1 else 0 for v in verdicts])
    for v in verdicts:  # structure: accepted nodes' tokens, then one bonus
        assert v.tokens[:-1] == TREE.tokens[v.path[1:]].tolist()
        assert all(int(TREE.parents[b]) == a for a, b in zip(v.path, v.path[1:]))
    return probs, first, second, node


# ---- sampling: exact distributions -----------------------------------------------------------

@pytest.mark.parametrize("name", list(PARAMS))
def test_first_token_is_target_distribution(name):
    probs, first, _, _ = sampled_verdicts(name)
    stat, thr = chi_square(token_counts(first), token_probs(probs[0]))
    assert stat < thr, f"{name}: chi2 {stat:.1f} >= {thr:.1f}"


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("child", [1, 2])
def test_second_token_given_accepted_child(name, child):
    """Given that drafted child ``child`` was accepted (node 1 has children of its own,
    node 2 is a leaf whose bonus is a plain sample), the next token follows the target's
    distribution at that child."""
    probs, _, second, node = sampled_verdicts(name)
    picked = second[node == child]
    assert picked.numel() > 300  # the condition is common enough to test
    stat, thr = chi_square(token_counts(picked), token_probs(probs[child]))
    assert stat < thr, f"{name}, child {child}: chi2 {stat:.1f} >= {thr:.1f}"


def test_zero_probability_children_never_accepted():
    for name in ("top_k3", "top_p0.8", "combined"):
        probs, first, _, node = sampled_verdicts(name)
        assert probs[0, 1] == 0  # node 3's token is outside the support
        assert not (node == 3).any() and not (first == 1).any()


def test_acceptance_rate_of_first_child():
    """P(first child accepted) = p(x1): the rule is the plain one, not just distribution-preserving."""
    probs, _, _, node = sampled_verdicts("t0.7")
    N = node.numel()
    p1 = float(probs[0, 2])
    assert abs(float((node == 1).float().mean()) - p1) < 4 * math.sqrt(p1 * (1 - p1) / N)


# ---- negative controls: wrong rules must fail the same tests ---------------------------------

def wrong_first_tokens(probs: torch.Tensor, u: torch.Tensor, rule: str) -> torch.Tensor:
    """First committed token under a wrong rule, vectorised over trials (root level only)."""
    p = probs[0].expand(u.shape[0], -1).clone()  # [N, V]
    kids = TREE.tokens[[1, 2, 3]]
    out = torch.full((u.shape[0],), -1, dtype=torch.int64)
    if rule == "greedy_first_child":  # accept the first child whenever its p > 0
        return torch.where(p[:, kids[0]] > 0, kids[0], p.argmax(-1))
    r = p.clone()
    for c, x in enumerate(kids.tolist()):
        undecided = out < 0
        if rule == "no_renormalise":  # accept with p(x), not r(x) / sum(r)
            acc = undecided & (u[:, 0, c] < p[:, x])
        else:  # "bonus_from_p": right acceptance, but the correction ignores rejections
            acc = undecided & (u[:, 0, c] * r.sum(-1) < r[:, x])
            r[undecided & ~acc, x] = 0
        out[acc] = x
    left = out < 0
    cdf = p[left].cumsum(-1)
    out[left] = torch.searchsorted(cdf, (u[left, 0, C] * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=V - 1)
    return out


@pytest.mark.parametrize("rule", ["greedy_first_child", "no_renormalise", "bonus_from_p"])
def test_wrong_rule_fails(rule):
    probs = PARAMS["t0.7"].probs(logits())
    N = trials("t0.7")
    wrong = wrong_first_tokens(probs, uniforms(N, seed=99), rule)
    assert not passes(wrong, probs[0]), rule


def test_wrong_conditional_fails():
    """Sampling the token after an accepted child from the root's distribution (a stale
    node index) fails the conditional test."""
    probs, _, second, node = sampled_verdicts("t0.7")
    picked = second[node == 2]  # leaf: its bonus is a plain sample from probs[2]
    g = torch.Generator().manual_seed(5)
    stale = torch.multinomial(probs[0], picked.numel(), replacement=True, generator=g)
    assert passes(picked, probs[2]) and not passes(stale, probs[2])


# ---- q-aware rule: drafts sampled without replacement from q ---------------------------------

def q_of(seed: int, zero: int | None = None) -> torch.Tensor:
    q = torch.rand(V, generator=torch.Generator().manual_seed(seed)) + 0.2
    if zero is not None:
        q[zero] = 0  # a token the target can emit but the draft never proposes
    return q / q.sum()


@functools.lru_cache(maxsize=None)
def q_trials(N: int = 6000, seed: int = 7):
    """Per trial: the root's 3 children drawn without replacement from q0, node 1's 2
    children from q1; one Tree per distinct outcome."""
    g = torch.Generator().manual_seed(seed)
    q0, q1 = q_of(1, zero=6), q_of(2)
    root_kids = torch.multinomial(q0.expand(N, -1), 3, replacement=False, generator=g)  # [N, 3]
    node1_kids = torch.multinomial(q1.expand(N, -1), 2, replacement=False, generator=g)  # [N, 2]
    cache: dict[tuple, Tree] = {}
    trees = []
    for a, b in zip(root_kids.tolist(), node1_kids.tolist()):
        key = (*a, *b)
        if key not in cache:
            cache[key] = Tree([-1, 0, 0, 0, 1, 1], [0, *a, *b])
        trees.append(cache[key])
    q = torch.zeros(TREE.num_nodes, V)
    q[0], q[1] = q0, q1  # the other nodes have no children: their q is never read
    probs = PARAMS["t1.3"].probs(logits())
    return trees, probs, q, uniforms(N, seed=seed)


@functools.lru_cache(maxsize=None)
def q_run():
    trees, probs, q, u = q_trials()
    N = len(trees)
    verdicts = verify_sampling(trees, probs.expand(N, -1, -1), u, q.expand(N, -1, -1))
    first = torch.tensor([v.tokens[0] for v in verdicts])
    second = torch.tensor([v.tokens[1] if len(v.tokens) > 1 else -1 for v in verdicts])
    node = torch.tensor([v.path[1] if len(v.path) > 1 else 0 for v in verdicts])
    return probs, first, second, node


def test_q_aware_first_token_is_target_distribution():
    probs, first, _, _ = q_run()
    stat, thr = chi_square(token_counts(first), token_probs(probs[0]))
    assert stat < thr, f"chi2 {stat:.1f} >= {thr:.1f}"
    assert (first == 6).any()  # reached only through the residual (q0[6] = 0)


def test_q_aware_second_token_given_first_child():
    probs, _, second, node = q_run()
    picked = second[node == 1]
    assert picked.numel() > 300
    stat, thr = chi_square(token_counts(picked), token_probs(probs[1]))
    assert stat < thr, f"chi2 {stat:.1f} >= {thr:.1f}"


def test_q_aware_first_child_acceptance_rate():
    """With x ~ q, P(accept x) = E_q[min(1, p/q)] = sum_x min(p(x), q(x)), the q-aware rate;
    the deterministic rule would give sum_x q(x) p(x). Pins that draft_probs is used."""
    probs, _, _, node = q_run()
    q0 = q_trials()[2][0]
    want = float(torch.minimum(probs[0], q0).sum())
    naive = float((probs[0] * q0).sum())
    N = node.numel()
    got = float((node == 1).float().mean())
    sd = math.sqrt(want * (1 - want) / N)
    assert abs(got - want) < 4 * sd and abs(got - naive) > 8 * sd


def wrong_q_first_tokens(rule: str) -> torch.Tensor:
    """First token of the q-aware rule with one step left out, vectorised (root level)."""
    trees, probs, q, u = q_trials()
    N = len(trees)
    kids = torch.tensor([t.tokens[1:4].tolist() for t in trees])  # [N, 3]
    r, qq = probs[0].expand(N, -1).clone(), q[0].expand(N, -1).clone()
    out = torch.full((N,), -1, dtype=torch.int64)
    ar = torch.arange(N)
    for c in range(3):
        x = kids[:, c]
        undecided = out < 0
        qx = qq[ar, x] / qq.sum(-1)
        acc = undecided & (u[:, 0, c] * qx * r.sum(-1) < r[ar, x])
        rej = undecided & ~acc
        out[acc] = x[acc]
        if rule != "no_residual":
            rn, qn = r / r.sum(-1, keepdim=True), qq / qq.sum(-1, keepdim=True)
            res = (rn - qn).clamp(min=0)
            r = torch.where(rej[:, None], torch.where(res.sum(-1, keepdim=True) > 0, res, rn), r)
        if rule != "no_q_update":  # without replacement: a rejected draft leaves q
            qq[rej, x[rej]] = 0
    left = out < 0
    cdf = r[left].cumsum(-1)
    out[left] = torch.searchsorted(cdf, (u[left, 0, C] * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=V - 1)
    return out


@pytest.mark.parametrize("rule", ["no_q_update", "no_residual"])
def test_wrong_q_rule_fails(rule):
    """Negative controls: the with-replacement residual (q not updated after a rejection)
    applied to drafts sampled without replacement, or no residual at all, are biased."""
    probs = q_trials()[1]
    assert not passes(wrong_q_first_tokens(rule), probs[0])


def test_verify_sampling_rejects_short_uniforms():
    probs = PARAMS["t0.7"].probs(logits())[None]
    with pytest.raises(ValueError, match="children"):
        verify_sampling([TREE], probs, torch.rand(1, D + 1, 3))  # C = 2 < 3 children
    with pytest.raises(ValueError, match="depth"):
        verify_sampling([TREE], probs, torch.rand(1, D, C + 1))


def test_verify_sampling_refuses_a_child_its_draft_could_not_sample():
    """A child whose token has draft probability 0 could not have been sampled from q: the
    rule's ratio r/q is undefined there, so the call is refused, not decided."""
    probs = PARAMS["t0.7"].probs(logits())[None]
    q = torch.full_like(probs, 1.0 / V)
    q[0, 0, int(TREE.tokens[1])] = 0.0
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_sampling([TREE], probs, torch.rand(1, D + 1, C + 1), draft_probs=q)
