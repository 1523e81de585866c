"""TreeConfig, the presets, and the vLLM / Medusa path-list format."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.builder import build_trees
from treespec.config import _EAGLE1_TREE, _MEDUSA_63, PRESETS, Preset, TreeConfig


def _markov_step(table):
    def step(f):
        return table[torch.arange(table.shape[0])[:, None], f.tokens], None  # [B, k, V]

    return step


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name):
    preset = PRESETS[name]
    assert isinstance(preset, Preset)
    assert isinstance(preset.description, str) and len(preset.description.strip()) > 20
    config = TreeConfig.preset(name)
    assert config is preset.config
    assert config.max_tree_tokens == config.num_nodes + 1
    g = torch.Generator().manual_seed(0)
    V = 16
    root = torch.randn(2, V, generator=g).log_softmax(-1)
    table = torch.randn(2, V, V, generator=g).log_softmax(-1)
    trees = build_trees(torch.tensor([1, 2]), root, _markov_step(table), config)
    for tree in trees:
        assert tree.num_drafted == config.num_nodes
        assert tree.max_depth <= config.depth
        assert tree.tokens is not None and tree.scores is not None
    if config.kind == "static":
        shape = config.static_tree()
        assert shape.num_drafted == config.num_nodes and shape.max_depth == config.depth
        assert int(shape.children_count().max()) == config.top_k
        assert config.describe().startswith("chain(" if config.is_chain else "static(")
    elif config.auto:
        rule = "" if config.objective == "step" else f", objective={config.objective}"
        assert config.describe() == (
            f"auto(max_depth={config.depth}, top_k={config.top_k}, max_nodes={config.num_nodes}{rule})"
        )
    else:
        assert config.describe() == (
            f"dynamic(depth={config.depth}, top_k={config.top_k}, num_nodes={config.num_nodes})"
        )


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.config.kind == "static"])
def test_static_presets_round_trip_through_vllm(name):
    config = PRESETS[name].config
    text = config.to_vllm()
    assert isinstance(text, str) and text.startswith("[(0,)")
    back = TreeConfig.from_vllm(text)
    assert back == config
    assert torch.equal(back.static_tree().parents, config.static_tree().parents)


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.config.kind == "dynamic"])
def test_dynamic_presets_have_no_vllm_shape(name):
    config = PRESETS[name].config
    with pytest.raises(ValueError, match="auto TreeConfig chooses" if config.auto else "dynamic TreeConfig has none"):
        config.to_vllm()
    with pytest.raises(ValueError, match="no fixed shape"):
        config.static_tree()


@pytest.mark.parametrize("k", range(1, 9))
def test_chain_presets_are_chains(k):
    config = PRESETS[f"chain-{k}"].config
    assert config.is_chain and config.kind == "static"
    assert (config.depth, config.top_k, config.num_nodes) == (k, 1, k)
    assert config.static_tree().parents.tolist() == list(range(-1, k))
    assert config.describe() == f"chain({k})"
    assert config == TreeConfig.chain(k)


def test_eagle1_and_medusa_sizes():
    eagle1 = PRESETS["eagle1"].config
    assert (eagle1.num_nodes, eagle1.depth, eagle1.top_k) == (25, 5, 4)
    assert eagle1.static_tree().num_drafted == 25 and eagle1.static_tree().max_depth == 5
    assert not eagle1.is_chain
    medusa = PRESETS["medusa-63"].config
    assert medusa.num_nodes == 63 and medusa.static_tree().num_drafted == 63
    assert (medusa.depth, medusa.top_k) == (4, 10)
    # The presets hold the published lists, every path kept.
    assert set(eagle1.paths) == {tuple(p) for p in _EAGLE1_TREE}
    assert set(medusa.paths) == {tuple(p) for p in _MEDUSA_63}


def test_from_medusa_choices_reads_string_and_list():
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    from_list = TreeConfig.from_medusa_choices(choices)
    from_lists = TreeConfig.from_medusa_choices([list(c) for c in choices])
    from_str = TreeConfig.from_medusa_choices(repr(choices))
    assert from_list == from_lists == from_str
    assert (from_str.num_nodes, from_str.depth, from_str.top_k) == (6, 3, 2)
    # Given order does not matter: the paths are stored breadth-first.
    shuffled = TreeConfig.from_medusa_choices(list(reversed(choices)))
    assert shuffled == from_list
    assert from_list.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert from_list.to_vllm() == "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6))
def test_dynamic_pool_bound(depth, k):
    pool = k + (depth - 1) * k * k
    config = TreeConfig.dynamic(depth, k, pool)  # the largest allowed
    assert config.max_tree_tokens == pool + 1
    with pytest.raises(ValueError, match=rf"num_nodes={pool + 1} exceeds the candidate pool .*\({pool} = top_k"):
        TreeConfig.dynamic(depth, k, pool + 1)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 4, 4), r"depth must be >= 1, got 0"),
        ((3, 0, 4), r"top_k must be >= 1, got 0"),
        ((3, 4, 0), r"num_nodes must be >= 1, got 0"),
        ((-2, 4, 4), r"depth must be >= 1, got -2"),
        ((3, 4, 2.0), r"num_nodes must be an int"),
        ((True, 4, 2), r"depth must be an int"),
        ((2, 2, 7), r"exceeds the candidate pool"),
    ],
)
def test_invalid_dynamic_configs_raise(args, match):
    with pytest.raises(ValueError, match=match):
        TreeConfig.dynamic(*args)


def test_invalid_configs_raise():
    with pytest.raises(ValueError, match=r"unknown tree preset 'nope'; known presets: chain-1"):
        TreeConfig.preset("nope")
    with pytest.raises(ValueError, match=r"kind must be 'dynamic' or 'static'"):
        TreeConfig("tree", 1, 1, 1)
    with pytest.raises(ValueError, match=r"static TreeConfig needs paths"):
        TreeConfig("static", 1, 1, 1)
    with pytest.raises(ValueError, match=r"a chain needs k >= 1"):
        TreeConfig.chain(0)
    with pytest.raises(ValueError, match=r"cannot parse Medusa choices"):
        TreeConfig.from_medusa_choices("[(0,), (1,")
    with pytest.raises(ValueError, match=r"prefix \[1\] is missing"):
        TreeConfig.from_vllm("[(0,), (1, 0)]")
    with pytest.raises(ValueError, match=r"elder sibling \[0\] is missing"):
        TreeConfig.from_vllm("[(1,)]")  # a Tree keeps no ranks: this would become [(0,)]


@pytest.mark.parametrize(
    "name, eagle",  # EAGLE's (total_token, depth, top_k), from the preset's source
    [("eagle2", (60, 5, 10)), ("eagle2-deep", (60, 7, 10)), ("eagle2-qwen3", (32, 8, 4))],
)
def test_eagle_presets_follow_eagle_arguments(name, eagle):
    # EAGLE drafts total_token - 1 nodes (its Model sets self.total_tokens = total_token - 1)
    # over depth + 1 levels; verify runs total_token tokens, the root included.
    total_token, depth, top_k = eagle
    config = PRESETS[name].config
    assert config.max_tree_tokens == total_token
    assert (config.num_nodes, config.depth, config.top_k) == (total_token - 1, depth + 1, top_k)
