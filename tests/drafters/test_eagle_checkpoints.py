"""EAGLE heads from their checkpoints: the published layouts load (EAGLE-1/2, EAGLE-3 and vLLM's
spelling of it, safetensors or a pytorch .bin) with the weights where the published names put
them, a head saved by ``save_pretrained`` loads back, and a checkpoint that does not fit its
target (vocabulary, hidden size, fc, d2t, missing files, another target) is refused with words
that say what is wrong.

The checkpoints are written by hand (``helpers/eagle_heads.py``), never with
``EagleHead.save_pretrained``, so a loader that only reads its own writer's files fails here.
Sizes: target vocabulary V = 64, hidden H = 32; EAGLE-3 draft vocabulary Vd = 40.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import treespec
from helpers.eagle_heads import (E3_LAYERS, H, V, VD, draft_vocab, eagle1_checkpoint, eagle3_checkpoint, eagle_target,
                                 stored, write_head)
from treespec.drafters.eagle import Eagle3Drafter, EagleDrafter
from treespec.drafters.eagle_head import EagleHead, eagle3_feature_layers
from treespec.runner import FINAL_NORM

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "eagle3-vllm"])
def test_load_published_layout(eagle_ckpts, kind, fmt):
    """load_draft detects the format; the weights land where the published names say."""
    model = eagle_target(kind)
    path, config, state = eagle_ckpts(kind, 0, fmt)
    drafter = treespec.load_draft(path, model)
    eagle3 = kind != "eagle1"
    assert type(drafter) is (Eagle3Drafter if eagle3 else EagleDrafter)
    c = drafter.head.config
    assert (c.eagle3, c.hidden_size, c.vocab_size) == (eagle3, H, V)
    assert c.draft_vocab_size == (VD if eagle3 else V)
    assert c.head_dim == config.get("head_dim", H // config["num_attention_heads"])
    assert c.rope_theta == config["rope_theta"] and c.fc_bias == ("fc.bias" in state)
    loaded = drafter.head.public_state_dict()
    want = {k.replace("layers.0.", "midlayer.") if eagle3 else k: v for k, v in stored(state).items()}
    assert set(loaded) == set(want)
    for k, v in want.items():
        assert loaded[k].dtype == (v.dtype if not v.is_floating_point() else torch.float32), k
        assert torch.equal(loaded[k], v.to(loaded[k].dtype)), k
    assert drafter.features_for(model) == (eagle3_feature_layers(E3_LAYERS) if eagle3 else (FINAL_NORM,))
    assert drafter.head._embed[0] is model.get_input_embeddings()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "eagle3-vllm"])
def test_from_pretrained_refuses_the_other_format(eagle_ckpts, kind):
    model = eagle_target(kind)
    path = eagle_ckpts(kind)[0]
    right, wrong = (EagleDrafter, Eagle3Drafter) if kind == "eagle1" else (Eagle3Drafter, EagleDrafter)
    assert type(right.from_pretrained(path, model)) is right
    with pytest.raises(ValueError, match="EAGLE-3 checkpoint: use Eagle3Drafter" if kind != "eagle1"
                       else "EAGLE-1/2 checkpoint: use EagleDrafter"):
        wrong.from_pretrained(path, model)


def test_vllm_spelling_loads_the_same_head(eagle_ckpts):
    """``layers.0.`` (vLLM) and ``midlayer.`` (EAGLE) of the same weights draft the same."""
    model = eagle_target("eagle3")
    a = treespec.load_draft(eagle_ckpts("eagle3")[0], model)
    b = treespec.load_draft(eagle_ckpts("eagle3-vllm")[0], model)
    sa, sb = a.head.state_dict(), b.head.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_eagle1_checkpoint_may_carry_the_targets_embedding_and_lm_head(tmp_path):
    """Some EAGLE-1/2 checkpoints ship ``embed_tokens`` / ``lm_head``: the target's are used."""
    model = eagle_target("eagle1")
    config, state = eagle1_checkpoint(bias=False)
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    state["lm_head.weight"] = torch.zeros(V, H)  # if it were read, drafts would be all ties
    drafter = EagleDrafter.from_pretrained(write_head(tmp_path, config, state, "bin"), model)
    assert not drafter.head.config.fc_bias
    assert drafter.head._target_lm_head[0] is model.get_output_embeddings()
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in drafter.head.public_state_dict())


def test_eagle3_checkpoint_may_carry_the_targets_embedding(tmp_path):
    """vLLM accepts EAGLE-3 checkpoints with or without ``embed_tokens.weight``; the head
    always reads the target's embedding (EAGLE-3 trains with it frozen) and warns when the
    shipped copy differs."""
    import warnings

    model = eagle_target("eagle3")
    config, state = eagle3_checkpoint()
    emb = model.get_input_embeddings().weight.detach()
    state["embed_tokens.weight"] = emb.half().float()  # as an fp16 checkpoint stores it
    with warnings.catch_warnings():
        warnings.simplefilter("error", treespec.TreespecWarning)
        drafter = treespec.load_draft(write_head(tmp_path / "same", config, state), model)
    assert drafter.head._embed[0] is model.get_input_embeddings()
    assert "embed_tokens.weight" not in drafter.head.public_state_dict()
    state["embed_tokens.weight"] = emb + 1.0
    with pytest.warns(treespec.TreespecWarning) as caught:
        treespec.load_draft(write_head(tmp_path / "other", config, state), model)
    assert [str(w.message) for w in caught].count(
        f"{tmp_path / 'other'} ships an embed_tokens.weight that differs from the target's; "
        "the target's embedding is used") == 1


@pytest.mark.parametrize("eagle3", [False, True])
def test_save_pretrained_round_trip(tmp_path, eagle3):
    """save_pretrained writes exactly the published names in fp16; loading gives them back."""
    model = eagle_target("eagle3" if eagle3 else "eagle1")
    head = EagleHead.for_target(model, eagle3=eagle3, draft_vocab_size=VD if eagle3 else None)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if eagle3:
            head.d2t.copy_(draft_vocab(5)[0])
            head.t2d.copy_(draft_vocab(5)[1])
    head.save_pretrained(tmp_path)

    layer = "midlayer." if eagle3 else "layers.0."
    names = {layer + f"self_attn.{x}_proj.weight" for x in "qkvo"}
    names |= {layer + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    names |= {layer + "post_attention_layernorm.weight", "fc.weight"}
    if eagle3:
        names |= {layer + "hidden_norm.weight", layer + "input_layernorm.weight", "norm.weight",
                  "lm_head.weight", "d2t", "t2d"}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert set(saved) == names  # no rotary.*, no embed_tokens, no extra keys
    assert all(v.dtype == torch.float16 for k, v in saved.items() if k not in ("d2t", "t2d"))
    assert saved["fc.weight"].shape == (H, 3 * H if eagle3 else 2 * H)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and ("draft_vocab_size" in cfg) == eagle3

    loaded = treespec.load_draft(tmp_path, model)
    assert type(loaded) is (Eagle3Drafter if eagle3 else EagleDrafter)
    assert loaded.head.config == head.config
    a, b = head.public_state_dict(), loaded.head.public_state_dict()
    assert a.keys() == b.keys()
    for k in a:
        want = a[k].half().float() if a[k].is_floating_point() else a[k]
        assert b[k].dtype == want.dtype and torch.equal(b[k], want), k


# ---- mismatches -----------------------------------------------------------------------------


def _expect_value_error(tmp_path, kind, edit, match, loader=treespec.load_draft):
    model = eagle_target(kind)
    config, state = eagle1_checkpoint() if kind == "eagle1" else eagle3_checkpoint()
    edit(config, state)
    with pytest.raises(ValueError, match=match):
        loader(write_head(tmp_path, config, state), model)


def _set(**kw):
    return lambda config, state: config.update(kw)


def test_wrong_vocab_size(tmp_path):
    _expect_value_error(tmp_path / "a", "eagle1", _set(vocab_size=V + 1),
                        f"vocabulary mismatch: the EAGLE head was made for {V + 1} tokens, the target has {V}")
    _expect_value_error(tmp_path / "b", "eagle3", _set(vocab_size=V * 2), "vocabulary mismatch")


def test_wrong_hidden_size(tmp_path):
    def wider(config, state):  # a consistent head of hidden 48 for a hidden-32 target
        config.update(hidden_size=48)
        state["fc.weight"] = torch.zeros(48, 96)

    _expect_value_error(tmp_path / "a", "eagle1", wider, "hidden size 48 differs from the target's 32")
    _expect_value_error(tmp_path / "b", "eagle3", _set(hidden_size=48),
                        "expects target hidden size 48, the target has 32")

    def wider3(config, state):  # fc fits the target's 3 x 32 features, the layer is 48 wide
        config.update(hidden_size=48, target_hidden_size=32)
        state["fc.weight"] = torch.zeros(48, 96)

    _expect_value_error(tmp_path / "c", "eagle3", wider3, "hidden size differs from the target's embedding size")


def test_wrong_fc_shape(tmp_path):
    def fc(shape):
        return lambda config, state: state.update({"fc.weight": torch.zeros(*shape)})

    _expect_value_error(tmp_path / "a", "eagle1", fc((H, 3 * H)), r"fc.weight is \(32, 96\), expected \(32, 64\)")
    _expect_value_error(tmp_path / "b", "eagle3", fc((H, 2 * H)), r"fc.weight is \(32, 64\), expected \(32, 96\)")


@pytest.mark.parametrize("bad", ["collision", "out_of_range", "wrong_length"])
def test_bad_d2t(tmp_path, bad):
    def edit(config, state):
        d2t = state["d2t"].clone()
        if bad == "collision":  # draft ids 0 and 1 both map to target id d2t[0]
            d2t[1] = d2t[0] - 1
        elif bad == "out_of_range":
            d2t[-1] = V
        else:
            d2t = d2t[:-1]
        state["d2t"] = d2t

    _expect_value_error(tmp_path, "eagle3", edit, "d2t must map each draft id to a distinct target id")


def test_missing_files(tmp_path):
    model = eagle_target("eagle1")
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        treespec.load_draft(missing, model)
    with pytest.raises(FileNotFoundError, match="nowhere.*config.json is missing"):
        EagleDrafter.from_pretrained(missing, model)
    config, state = eagle1_checkpoint()
    no_config = write_head(tmp_path / "no-config", config, state)
    (no_config / "config.json").unlink()
    for load in (treespec.load_draft, EagleDrafter.from_pretrained, Eagle3Drafter.from_pretrained):
        with pytest.raises(FileNotFoundError, match="no-config: config.json is missing"):
            load(no_config, model)
    no_weights = write_head(tmp_path / "no-weights", config, state)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no-weights has neither model.safetensors nor pytorch_model.bin"):
        treespec.load_draft(no_weights, model)


def test_head_loaded_for_another_target_is_refused(eagle_ckpts):
    drafter = treespec.load_draft(eagle_ckpts("eagle1")[0], eagle_target("eagle1", 0))
    with pytest.raises(ValueError, match="loaded for another target"):
        treespec.generate(eagle_target("eagle1", 1), drafter, "chain-2", [1, 2, 3], max_new_tokens=4)
