"""Sampled acceptance on the device (treespec.device_sampling): the warpers written over a whole
bucket, each row with its own parameters, give transformers' own warpers' scores bit for bit
(the warpers as ``NodeProcessor.build`` builds them from a generation config, fp32 logits and
bf16-rounded ones, whose ties top-k and top-p must cut as transformers does); the choice at a
token is the host's rule's (its processed scores plus the noise of its position); a decoding the
device cannot apply is told apart; and the rows' buffers hold what each row asked for.

The engine's tokens through this path, against today's, are in tests/model/test_verify_graphs.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, LogitsProcessor

from helpers.trees import trees
from treespec import Tree
from treespec.accept import RequestDecoding
from treespec.device_sampling import RowWarp, SamplingRows, row_warp, sampled_choices, warp
from treespec.processing import NodeProcessor, exact_generation_config

V = 300

warpers = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0.1, 2.5),
    "top_k": st.integers(1, V + 20),
    "top_p": st.floats(0.05, 0.999),
    "min_p": st.floats(0.001, 0.5),
})


def warpers_of(model, fields: dict, prompt_len: int = 4) -> NodeProcessor:
    """What treespec builds for a request sampling with ``fields`` (exactly those)."""
    cfg = exact_generation_config(model, do_sample=True, max_length=prompt_len + 8, **fields)
    return NodeProcessor.build(model, cfg, prompt_len)


@pytest.fixture(scope="module")
def vocab300_model():
    from helpers.tiny import tiny_model

    return tiny_model(vocab=V)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.one_of(st.none(), warpers), min_size=1, max_size=4), n=st.integers(1, 6),
       bf16=st.booleans(), scale=st.floats(0.5, 8.0), data=st.data())
def test_warped_rows_are_transformers_warpers_bit_for_bit(vocab300_model, rows, n, bf16, scale, data):
    """Row r (None: greedy) through :func:`warp` equals its request's warpers applied by
    transformers to each token's scores alone."""
    seed = data.draw(st.integers(0, 2 ** 31 - 1))
    logits = torch.randn(len(rows), n, V, generator=torch.Generator().manual_seed(seed)) * scale
    if bf16:  # the logits a bf16 model gives: many ties
        logits = logits.bfloat16().float()
    procs = [None if f is None else warpers_of(vocab300_model, f) for f in rows]
    warps = {r: RowWarp() if p is None else row_warp(RequestDecoding(p, seed=r)) for r, p in enumerate(procs)}
    assert None not in warps.values()
    buffers = SamplingRows.empty(len(rows), 4, V, "cpu")
    buffers.set_rows(warps)
    got = warp(logits, buffers, frozenset().union(*(w.uses for w in warps.values())))
    for r, p in enumerate(procs):
        for i in range(n):
            want = logits[r, i] if p is None else p.processors(torch.zeros(1, 4, dtype=torch.int64),
                                                                logits[r, i: i + 1].clone())[0]
            assert torch.equal(got[r, i], want), (r, i, rows[r])


def test_each_rule_cuts_where_transformers_does(vocab300_model):
    """One literal case a warper: the tokens each keeps (top-p: four tokens of probability 1/4
    each, whose cumulative sums meet the cut ``1 - top_p`` exactly, where transformers drops)."""
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0] + [-9.0] * (V - 5)]])
    quarters = torch.tensor([[[0.0] * 4 + [-math.inf] * (V - 4)]])
    cases = {"top_k": ({"top_k": 2}, 2), "top_p": ({"top_p": 0.5}, 2), "min_p": ({"min_p": 0.3}, 2),
             "temperature": ({"temperature": 0.5}, V)}
    for name, (fields, kept) in cases.items():
        row = quarters if name == "top_p" else logits
        w = row_warp(RequestDecoding(warpers_of(vocab300_model, fields), seed=0))
        assert w.uses == {name}
        buffers = SamplingRows.empty(1, 1, V, "cpu")
        buffers.set_rows({0: w})
        out = warp(row, buffers, w.uses)
        assert int(torch.isfinite(out).sum()) == kept, name
        if name == "temperature":
            assert torch.equal(out, logits / 0.5)


@settings(max_examples=40, deadline=None)
@given(tree=trees(max_nodes=12, vocab=V), fields=warpers, seed=st.integers(0, 10 ** 6), L=st.integers(1, 30))
def test_the_choice_at_every_token_is_the_hosts(vocab300_model, tree, fields, seed, L):
    """:func:`sampled_choices` at every node of a tree after ``L`` cached tokens (its root at
    position L, its noise from L + 1 on) equals the host's choice at that node,
    :meth:`RequestDecoding.choose_all_nodes` over a history of ``L + 1`` tokens."""
    proc = warpers_of(vocab300_model, fields)
    decoding = RequestDecoding(proc, seed=seed)
    logits = torch.randn(tree.num_nodes, V, generator=torch.Generator().manual_seed(seed)) * 4
    history = list(range(L + 1))  # its processors read no history
    want = decoding.choose_all_nodes(history, logits, tree)
    buffers = SamplingRows.empty(1, 12, V, "cpu")
    w = row_warp(decoding)
    buffers.set_rows({0: w})
    buffers.fill_noise([0], [L], [tree])
    got = sampled_choices(logits[None], tree.depth[None], buffers, w.uses, lambda x: x.argmax(-1))[0]
    assert torch.equal(got, want)


class Shift(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


@pytest.mark.parametrize("fields, user", [
    (dict(repetition_penalty=1.3), None),  # reads the node's history
    (dict(min_new_tokens=3, eos_token_id=2), None),
    (dict(typical_p=0.9), None),  # a warper the device does not apply
    (dict(temperature=0.7), [Shift()]),  # a user's own
])
def test_a_decoding_the_device_cannot_apply_is_none(vocab300_model, fields, user):
    cfg = exact_generation_config(vocab300_model, do_sample=True, max_length=12, **fields)
    assert row_warp(RequestDecoding(NodeProcessor.build(vocab300_model, cfg, 4, user), seed=1)) is None


def test_warpers_out_of_transformers_order_or_keeping_more_are_none(vocab300_model):
    procs = warpers_of(vocab300_model, dict(temperature=0.7, top_k=5)).processors
    assert row_warp(RequestDecoding(NodeProcessor.of(procs[::-1]), seed=1)) is None
    wide = warpers_of(vocab300_model, dict(top_p=0.9)).processors
    wide[0].min_tokens_to_keep = 2
    assert row_warp(RequestDecoding(NodeProcessor(wide), seed=1)) is None
    greedy = RequestDecoding(NodeProcessor.of([]))
    assert row_warp(greedy) == RowWarp() and not RowWarp().uses


def test_rows_hold_their_parameters_and_greedy_rows_no_noise(vocab300_model):
    fields = dict(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1)
    w = row_warp(RequestDecoding(warpers_of(vocab300_model, fields), seed=3))
    assert (w.temperature, w.top_k, w.top_p, w.min_p, w.seed) == (0.5, 7, 0.9, 0.1, 3)
    buffers = SamplingRows.empty(3, 4, V, "cpu")
    buffers.set_rows({1: w})
    assert buffers.temperature.tolist() == [1.0, 0.5, 1.0] and buffers.top_k.tolist() == [V, 7, V]
    assert buffers.top_p[1] == torch.tensor(1 - 0.9, dtype=torch.float32) and buffers.top_p[0] == -1
    assert buffers.seeds == [None, 3, None]
    tree = Tree.from_parents([-1, 0, 0, 1], tokens=[9, 4, 5, 6])  # depths 0, 1, 1, 2
    buffers.fill_noise([0, 1], [5, 5], [tree, tree])
    assert not buffers.noise[0].any() and buffers.noise[1, :3].isfinite().any() and not buffers.noise[1, 3:].any()
    deep = SamplingRows.empty(1, 2, V, "cpu")
    deep.set_rows({0: w})
    with pytest.raises(ValueError, match="2 deep"):
        deep.fill_noise([0], [5], [tree])
