"""EAGLE draft heads: the published checkpoint layouts, the head math, the shift by one.

Checkpoints are written by hand under the key names of the published heads, as SafeAILab/EAGLE
(``eagle/model/cnets.py``) reads them: EAGLE-1/2 ``fc`` and ``layers.0.*``; EAGLE-3 ``fc``,
``midlayer.*`` (vLLM's ``layers.0.*``), ``norm``, ``lm_head``, ``d2t`` and ``t2d``. Never
with ``EagleHead.save_pretrained``, so a loader that only reads its own writer's files fails
here. The head math is checked against :class:`DenseHead`, a dense float64 implementation
written from the definitions; draft extend (the head re-run on each step's accepted tokens)
against a fresh head prefill of the whole committed sequence; generation against Hugging
Face greedy decoding. Random heads rarely draft right, so one hand-set EAGLE-1 head on a
near-bigram target ("informed") gets runs of accepted drafts and multi-token commits.

Sizes: target vocabulary V = 64, hidden H = 32; EAGLE-3 draft vocabulary Vd = 40.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import treespec
from helpers.eagle_heads import (E3_LAYERS, H, V, VD, draft_vocab, eagle1_checkpoint, eagle3_checkpoint, eagle_target,
                                 hf_features, informed_eagle1_checkpoint, stored, write_head)
from helpers.references import hf_greedy
from helpers.tiny import assert_sessions_draft_alike, dynamic_configs, tiny_model
from treespec import TreeConfig
from treespec.drafters.base import DraftStart
from treespec.drafters.eagle import Eagle3Drafter, EagleDrafter
from treespec.drafters.eagle_head import EagleHead, eagle3_feature_layers
from treespec.drafters.eagle_passes import PackedPasses, RowPasses, StaticRowPasses
from treespec.mask import causal_mask
from treespec.runner import FINAL_NORM, ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the reference --------------------------------------------------------------------------


class DenseHead:
    """An EAGLE head from its definition, in float64, with no treespec code.

    EAGLE-1/2: ``x = fc(cat(embed(tok), hidden))``, one Llama layer without input norm
    (residual x), logits by the target's lm_head. EAGLE-3: ``x = cat(input_layernorm(embed),
    hidden_norm(hidden))``, residual ``hidden``, logits ``lm_head(norm(h))`` over the draft
    vocabulary. Attention is causal over the given entries, RoPE at ``positions``.
    """

    def __init__(self, config: dict, state: dict, target):
        self.eagle3 = "draft_vocab_size" in config
        prefix = "layers.0." if any(k.startswith("layers.0.") for k in state) else "midlayer."
        self.w = {k.removeprefix(prefix): v.double() for k, v in state.items() if v.is_floating_point()}
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.eps = config["rms_norm_eps"]
        self.theta = config["rope_theta"]
        self.embed_w = target.get_input_embeddings().weight.detach().double()
        self.target_lm_head = target.get_output_embeddings().weight.detach().double()
        if self.eagle3:
            self.d2t = state["d2t"]
            self.draft_id = {int(d + self.d2t[d]): d for d in range(len(self.d2t))}

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x, positions):  # x [T, h, D]; rotate_half convention, as Llama
        D = x.shape[-1]
        inv = 1.0 / self.theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = positions.double()[:, None] * inv[None]  # [T, D/2]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def project(self, features):
        """Target features -> the ``hidden`` input of :meth:`run` (EAGLE-3: fc)."""
        return features.double() @ self.w["fc.weight"].T if self.eagle3 else features.double()

    def run(self, tokens, hidden, positions=None):
        """Outputs ``[T, H]`` of entries (tokens[i], hidden[i]), causal in order."""
        w, T = self.w, len(tokens)
        positions = torch.arange(T) if positions is None else positions
        e = self.embed_w[torch.as_tensor(tokens)]
        if self.eagle3:
            x = torch.cat([self.rms(e, "input_layernorm.weight"), self.rms(hidden, "hidden_norm.weight")], -1)
            residual = hidden
        else:
            x = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
            residual = x
        D = self.head_dim
        q = (x @ w["self_attn.q_proj.weight"].T).view(T, self.heads, D)
        k = (x @ w["self_attn.k_proj.weight"].T).view(T, self.kv_heads, D)
        v = (x @ w["self_attn.v_proj.weight"].T).view(T, self.kv_heads, D)
        q, k = self.rope(q, positions), self.rope(k, positions)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)  # [heads, T, T]
        s = s.masked_fill(~causal_mask(T), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, self.heads * D)
        h = residual + o @ w["self_attn.o_proj.weight"].T
        m = self.rms(h, "post_attention_layernorm.weight")
        gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
        return h + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T

    def logp(self, h):
        if self.eagle3:
            return (self.rms(h, "norm.weight") @ self.w["lm_head.weight"].T).log_softmax(-1)
        return (h @ self.target_lm_head.T).log_softmax(-1)


def start(drafter, model, prompts, first, cfg=TreeConfig.chain(2), max_new=32):
    """An EagleSession as the engine starts it, with features computed from scratch."""
    layers = drafter.features_for(model)
    feats = [hf_features(model, p, layers) for p in prompts]
    return drafter.start(model, DraftStart([list(p) for p in prompts], list(first), feats, max_new, cfg))


def draft_len(session, r: int) -> int:
    return session.cache.seq_lens[session.seq[r]]


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Hand-written checkpoints, one directory per (layout, seed, file format)."""
    root = tmp_path_factory.mktemp("eagle")
    made: dict = {}

    def get(kind: str, seed: int = 0, fmt: str = "safetensors"):
        key = (kind, seed, fmt)
        if key not in made:
            config, state = {
                "eagle1": lambda: eagle1_checkpoint(seed),
                "eagle3": lambda: eagle3_checkpoint(seed),
                "eagle3-vllm": lambda: eagle3_checkpoint(seed, vllm=True),
                "informed": lambda: informed_eagle1_checkpoint(seed + 11),
            }[kind]()
            made[key] = (write_head(root / f"{kind}-{seed}-{fmt}", config, state, fmt), config, state)
        return made[key]

    return get


# ---- loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "eagle3-vllm"])
def test_load_published_layout(ckpts, kind, fmt):
    """load_draft detects the format; the weights land where the published names say."""
    model = eagle_target(kind)
    path, config, state = ckpts(kind, 0, fmt)
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
def test_from_pretrained_refuses_the_other_format(ckpts, kind):
    model = eagle_target(kind)
    path = ckpts(kind)[0]
    right, wrong = (EagleDrafter, Eagle3Drafter) if kind == "eagle1" else (Eagle3Drafter, EagleDrafter)
    assert type(right.from_pretrained(path, model)) is right
    with pytest.raises(ValueError, match="EAGLE-3 checkpoint: use Eagle3Drafter" if kind != "eagle1"
                       else "EAGLE-1/2 checkpoint: use EagleDrafter"):
        wrong.from_pretrained(path, model)


def test_vllm_spelling_loads_the_same_head(ckpts):
    """``layers.0.`` (vLLM) and ``midlayer.`` (EAGLE) of the same weights draft the same."""
    model = eagle_target("eagle3")
    a = treespec.load_draft(ckpts("eagle3")[0], model)
    b = treespec.load_draft(ckpts("eagle3-vllm")[0], model)
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


def test_head_loaded_for_another_target_is_refused(ckpts):
    drafter = treespec.load_draft(ckpts("eagle1")[0], eagle_target("eagle1", 0))
    with pytest.raises(ValueError, match="loaded for another target"):
        treespec.generate(eagle_target("eagle1", 1), drafter, "chain-2", [1, 2, 3], max_new_tokens=4)


# ---- the head math --------------------------------------------------------------------------

# Low-peak targets keep the EAGLE-1 logits (the target's lm_head) small, so the fp32 head and
# the fp64 reference agree to well under 1e-4 in log-probability.
MATH_PROMPTS = [[5, 9, 9, 2, 17, 40, 3, 3, 11], [60, 1]]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_root_logprobs_match_dense_reference(ckpts, kind):
    """After start, the root's draft log-probs are the reference's last row: entries
    (f_i, prompt[i+1]) for i < L-1 and (f_{L-1}, first token), positions 0..L-1."""
    model = eagle_target(kind, peak=4.0)
    path, config, state = ckpts(kind)
    drafter = treespec.load_draft(path, model)
    ref = DenseHead(config, stored(state), model)
    first = [13, 2]
    session = start(drafter, model, MATH_PROMPTS, first)
    for r, (prompt, t0) in enumerate(zip(MATH_PROMPTS, first)):
        feats = hf_features(model, prompt, drafter.features_for(model))
        h = ref.run(prompt[1:] + [t0], ref.project(feats))
        want = ref.logp(h[-1])
        assert session.root_logp[r].shape == ((VD,) if kind == "eagle3" else (V,))
        torch.testing.assert_close(session.root_logp[r].double(), want, atol=1e-4, rtol=0)
        assert draft_len(session, r) == len(prompt)
    # Teeth: the reference without the shift (f_i paired with prompt[i]) is far off.
    prompt = MATH_PROMPTS[0]
    feats = hf_features(model, prompt, drafter.features_for(model))
    unshifted = ref.logp(ref.run(prompt, ref.project(feats))[-1])
    assert (session.root_logp[0].double() - unshifted).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("cfg", [TreeConfig.dynamic(depth=4, top_k=3, num_nodes=14), "eagle1"],
                         ids=["dynamic", "eagle1"])
def test_tree_scores_match_dense_reference(ckpts, kind, cfg):
    """A drafted node's score is the reference's log-prob of its path: a tree path is the
    committed entries followed by (parent's draft output, node token) entries at the next
    positions, each seeing only its own ancestors."""
    cfg = TreeConfig.preset(cfg) if isinstance(cfg, str) else cfg
    model = eagle_target(kind, peak=4.0)
    path, config, state = ckpts(kind)
    drafter = treespec.load_draft(path, model)
    ref = DenseHead(config, stored(state), model)
    first = [13, 2]
    session = start(drafter, model, MATH_PROMPTS, first, cfg)
    trees = session.propose([0, 1], first, [10, 10])
    for r, (prompt, t0, tree) in enumerate(zip(MATH_PROMPTS, first, trees)):
        assert draft_len(session, r) == len(prompt)  # tree entries were dropped again
        assert int(tree.tokens[0]) == t0 and tree.num_drafted == cfg.num_nodes
        feats = hf_features(model, prompt, drafter.features_for(model))
        tokens0, hidden0 = prompt[1:] + [t0], ref.project(feats)
        for node in range(1, tree.num_nodes):
            tokens, hidden, score = list(tokens0), hidden0, 0.0
            h = ref.run(tokens, hidden)
            for a in tree.ancestors(node)[1:]:
                tok = int(tree.tokens[a])
                score += float(ref.logp(h[-1])[ref.draft_id[tok] if ref.eagle3 else tok])
                tokens.append(tok)
                hidden = torch.cat([hidden, h[-1:]])  # the parent's draft output
                h = ref.run(tokens, hidden)
            assert abs(float(tree.scores[node]) - score) < 1e-4, (r, node)
        if ref.eagle3:
            assert all(int(t) in ref.draft_id for t in tree.tokens[1:])  # target ids via d2t


# ---- the shift by one and draft extend ------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_draft_extend_equals_fresh_prefill(ckpts, kind):
    """Session level, with commits of several tokens: after each commit the draft holds one
    entry per committed position (prompt + generated - 1: the newest token is the root and
    has no target feature yet), and its root log-probs equal a fresh head started from the
    whole sequence. Trees drafted in between leave no trace."""
    model = eagle_target(kind, peak=4.0)
    drafter = treespec.load_draft(ckpts(kind)[0], model)
    layers = drafter.features_for(model)
    g = torch.Generator().manual_seed(3)
    full = [torch.randint(0, V, (n,), generator=g).tolist() for n in (16, 13)]
    L = [5, 1]  # prompt lengths; full[r][L[r]] is the first token
    cfg = TreeConfig.dynamic(depth=3, top_k=2, num_nodes=5)
    feats = [hf_features(model, s, layers) for s in full]
    session = drafter.start(model, DraftStart([s[:n] for s, n in zip(full, L)], [s[n] for s, n in zip(full, L)],
                                              [f[:n] for f, n in zip(feats, L)], 32, cfg))
    pos = list(L)  # index of each request's root in full
    for step, commits in enumerate([(3, 1), (1, 4), (2, 2), (4, 3)]):
        live = [r for r in (0, 1) if not (step == 2 and r == 1)]  # request 1 sits one step out
        session.propose(live, [full[r][pos[r]] for r in live], [5] * len(live))
        session.commit(live, [full[r][pos[r] + 1: pos[r] + 1 + commits[r]] for r in live],
                       [feats[r][pos[r]: pos[r] + commits[r]] for r in live])  # (f_root.., accepted..)
        for r in live:
            pos[r] += commits[r]
        for r in (0, 1):
            assert draft_len(session, r) == pos[r]
            fresh = start(drafter, model, [full[r][: pos[r]]], [full[r][pos[r]]], cfg)
            torch.testing.assert_close(session.root_logp[r], fresh.root_logp[0], atol=1e-4, rtol=0)


def recording(drafter):
    """The drafter, with every session it starts appended to the returned list."""
    sessions = []
    plain = drafter.start
    drafter.start = lambda model, ctx: sessions.append(plain(model, ctx)) or sessions[-1]
    return drafter, sessions


@pytest.mark.parametrize("kind", ["informed", "eagle3"])
def test_generate_draft_extend_equals_fresh_prefill(ckpts, kind):
    """Engine level: after every step (features from the tree-verify forward), the draft
    cache holds prompt + generated - 1 entries and the root's draft log-probs equal a fresh
    head prefill on the committed sequence with the target's features recomputed from
    scratch; the output is HF's greedy output."""
    model = eagle_target(kind, peak=8.0)
    drafter, sessions = recording(treespec.load_draft(ckpts(kind)[0], model))
    prompts = [[4, 8, 15, 16, 23, 42], [7], [1, 2, 3, 1, 2]]
    generated = [[] for _ in prompts]
    snaps = []  # (request, committed sequence, draft entries, root log-probs)
    longest = 0
    for out in treespec.stream(model, drafter, "cpu", prompts, max_new_tokens=18):
        for r, toks in enumerate(out.tokens):
            generated[r].extend(toks)
            longest = max(longest, len(toks)) if out.step else longest
        if out.step == 0:
            continue
        (session,) = sessions
        for r in range(len(prompts)):
            if not out.finished[r]:
                snaps.append((r, prompts[r] + generated[r], draft_len(session, r), session.root_logp[r].clone()))
    for r, p in enumerate(prompts):
        assert generated[r] == hf_greedy(model, p, 18)
    assert len(snaps) >= 6
    if kind == "informed":
        assert longest >= 3  # some steps committed accepted drafts, not just the bonus
    for r, seq, n_entries, root_logp in snaps:
        assert n_entries == len(seq) - 1
        fresh = start(drafter, model, [seq[:-1]], [seq[-1]])
        torch.testing.assert_close(root_logp, fresh.root_logp[0], atol=1e-4, rtol=0)


# ---- greedy equality ------------------------------------------------------------------------


@settings(max_examples=16, **SETTINGS)
@given(
    kind=st.sampled_from(["eagle1", "informed", "eagle3", "eagle3-vllm"]),
    seed=st.integers(0, 2),
    family=st.sampled_from(["llama", "qwen2"]),
    prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=12), min_size=1, max_size=3),
    tree_cfg=st.one_of(st.sampled_from(["chain-2", "cpu", "eagle1"]), dynamic_configs(max_top_k=4, max_nodes=16)),
    max_new=st.integers(1, 20),
    fmt=st.sampled_from(["safetensors", "bin"]),
)
def test_greedy_equals_hf_generate(ckpts, kind, seed, family, prompts, tree_cfg, max_new, fmt):
    model = eagle_target(kind, seed, family)
    drafter = treespec.load_draft(ckpts(kind, seed, fmt)[0], model)
    out = treespec.generate(model, drafter, tree_cfg, prompts, max_new_tokens=max_new)
    for p, seq in zip(prompts, out.sequences):
        assert seq == hf_greedy(model, p, max_new)


# ---- feature capture ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_runner_features_are_hf_hidden_states(family):
    """FINAL_NORM is ``hidden_states[-1]``, layer i is ``hidden_states[i]`` (the state
    entering layer i), concatenated in the order asked; also for tokens after a cached
    prefix and for a ragged batch packed into one row."""
    model = tiny_model(family, 2, vocab=V, hidden=H, layers=4)
    fids = (FINAL_NORM, 0, 3, 1)
    runner = ModelRunner(model, "torch", feature_layers=fids)
    seqs_tokens = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2]]
    split = [5, 2]  # prefill this many, then the rest after the cached prefix
    with runner.attached():
        cache = runner.new_cache([len(s) for s in seqs_tokens])
        seqs = [cache.add_sequence() for _ in seqs_tokens]
        got = [[] for _ in seqs_tokens]
        for part in range(2):
            chunks = [s[:n] if part == 0 else s[n:] for s, n in zip(seqs_tokens, split)]
            start_pos = [0 if part == 0 else n for n in split]
            out = runner.forward(cache, seqs, [torch.tensor(c) for c in chunks],
                                 [torch.arange(p, p + len(c)) for p, c in zip(start_pos, chunks)],
                                 [causal_mask(len(c)) for c in chunks], capture=True)
            for b, (s, c) in enumerate(zip(seqs, chunks)):
                cache.commit(s, torch.arange(cache.seq_lens[s], cache.seq_lens[s] + len(c)))
                got[b].append(out.features[b])
    for b, toks in enumerate(seqs_tokens):
        feats = torch.cat(got[b])  # [T, 4H]
        assert feats.shape == (len(toks), 4 * H)
        want = hf_features(model, toks, fids)
        torch.testing.assert_close(feats, want, atol=1e-5, rtol=0)
        # Teeth: the state entering layer 3 is not the one leaving it (nor the final state).
        assert (feats[:, 2 * H: 3 * H] - hf_features(model, toks, (FINAL_NORM,))).abs().max() > 1e-2


# ---- the lean single-request pass ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_lean_single_request_pass_drafts_the_general_trees(ckpts, kind, dtype, seed, data):
    """One request on a CPU runs the head through :class:`RowPasses` (RoPE from a table, fp32
    SDPA over the request's row, no batch plan). It must draft exactly the trees the packed
    pass through the torch backend drafts, tokens and scores bit for bit, through proposals, multi-token commits
    and a tree config drawn at random, in fp32 and bf16."""
    model = copy.deepcopy(eagle_target(kind, peak=4.0)).to(dtype)  # a copy: the module's targets stay fp32
    drafter = treespec.load_draft(ckpts(kind)[0], model)
    drafter.head.to(dtype)
    cfg = data.draw(dynamic_configs(max_top_k=4, max_nodes=16))
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, V, (40,), generator=g).tolist()
    n = data.draw(st.integers(1, 12))
    feats = hf_features(model, full, drafter.features_for(model)).to(dtype)
    sessions = []
    for lean in (True, False):
        s = drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, cfg))
        assert type(s.passes) is RowPasses  # one request, torch backend, CPU
        if not lean:
            s.passes = s.passes.fallback
            assert type(s.passes) is PackedPasses
        sessions.append(s)
    commits = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    assert_sessions_draft_alike(sessions, full, feats, n, commits, cfg.depth)


def test_the_session_picks_its_passes_at_start(ckpts):
    """The strategy that runs the head is decided when a session starts: on a CPU with the torch
    backend (or flex, which reads K/V as it does) the lean row pass over the packed pass (which
    takes batches), whether it starts with one request or several; with the drafter's graphed
    row its static passes over the lean pass, until the session closes. (The packed pass alone
    runs on a GPU without graphs.) Every session of a head attends through one backend object,
    built once for the head."""
    from treespec.attention import FlexBackend, TorchBackend, backend_for
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    path = ckpts("eagle3")[0]
    drafter = treespec.load_draft(path, model)
    one = start(drafter, model, [[1, 2, 3]], [4])
    two = start(drafter, model, [[1, 2, 3], [5, 6]], [4, 7])
    assert type(one.passes) is RowPasses and type(two.passes) is RowPasses and one.static is None
    backend = one.passes.fallback.backend
    assert type(backend) is TorchBackend and two.passes.fallback.backend is backend
    assert backend_for(drafter.head, "torch", "cpu") is backend
    flex = start(treespec.load_draft(path, model, attention_backend="flex"), model, [[1, 2, 3]], [4])
    assert type(flex.passes) is RowPasses and type(flex.passes.fallback.backend) is FlexBackend
    graphed = treespec.load_draft(path, model, cuda_graphs=True)
    graphed.graphed_row = GraphedRow(capture=False)
    s = start(graphed, model, [[1, 2, 3]], [4])
    assert type(s.passes) is StaticRowPasses and type(s.passes.fallback) is RowPasses
    assert s.static is graphed.graphed_row.passes
    s.close()
    assert type(s.passes) is RowPasses and s.static is None


# ---- static head passes (the shapes CUDA graphs capture) -----------------------------------------


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_static_passes_draft_the_lean_trees(ckpts, kind, seed, data):
    """The static passes (:mod:`treespec.drafters.graphs`, run eagerly here: capturing needs
    CUDA) attend over the request's whole row with the keys past the pass masked out, and read
    their inputs from fixed buffers. Masked keys add exact zeros, so in fp32 they draft the
    lean pass's trees: the same tokens and parents, scores and root log-probabilities within
    rounding (the attention kernel sums a longer row in another order: about 1e-7 apart here),
    through proposals, multi-token commits and a random tree config. A wrong mask, slot or
    position moves the scores by far more (each fails this test)."""
    model = eagle_target(kind, peak=4.0)
    drafter = treespec.load_draft(ckpts(kind)[0], model)
    cfg = data.draw(dynamic_configs(max_top_k=4, max_nodes=16))
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, V, (40,), generator=g).tolist()
    n = data.draw(st.integers(1, 12))
    feats = hf_features(model, full, drafter.features_for(model))
    sessions = [drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, cfg)) for _ in range(2)]
    sessions[1].use_static_passes(capture=False)
    calls = []
    run = sessions[1].static.run
    sessions[1].static.run = lambda *a: calls.append(a[3].shape) or run(*a)
    pos = n
    for commit in data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)):
        trees = [s.propose([0], [full[pos]], [cfg.depth]) for s in sessions]
        assert torch.equal(trees[0][0].tokens, trees[1][0].tokens)
        assert torch.equal(trees[0][0].parents, trees[1][0].parents)
        torch.testing.assert_close(trees[0][0].scores, trees[1][0].scores, atol=1e-5, rtol=0)
        for s in sessions:
            s.commit([0], [full[pos + 1: pos + 1 + commit]], [feats[pos: pos + commit]])
        pos += commit
        torch.testing.assert_close(sessions[0].root_logp[0], sessions[1].root_logp[0], atol=1e-5, rtol=0)
    assert calls  # the commits (and levels past the first) went through the static passes


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), data=st.data())
def test_a_static_pass_computes_the_lean_pass(ckpts, kind, dtype, seed, data):
    """One pass of a random tree level (k entries seeing a random ancestor-closed part of m
    tree entries) after a random prefix, static and lean on the same cache: the same states
    and log-probabilities up to the attention's summation order, which in bf16 may round an
    element of the attention's output to the neighbouring bf16 value (hence bf16's
    tolerances; trees are compared in fp32 above)."""
    model = copy.deepcopy(eagle_target(kind, peak=4.0)).to(dtype)
    drafter = treespec.load_draft(ckpts(kind)[0], model)
    drafter.head.to(dtype)
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, V, (40,), generator=g).tolist()
    n = data.draw(st.integers(1, 20))
    feats = hf_features(model, full, drafter.features_for(model)).to(dtype)
    s = drafter.start(model, DraftStart([full[:n]], [full[n]], [feats[:n]], 24, TreeConfig.chain(4)))
    s.use_static_passes(capture=False)
    k, earlier = data.draw(st.integers(1, 4)), data.draw(st.integers(0, 8))
    m = earlier + k
    mask = torch.zeros(k, m, dtype=torch.bool)
    mask[:, earlier:] = torch.eye(k, dtype=torch.bool)
    mask[:, :earlier] = torch.rand(k, earlier, generator=g) < 0.5
    tokens = torch.randint(0, V, (k,), generator=g)
    hidden = torch.randn(k, H, generator=g).to(dtype)
    positions = n - 1 + torch.randint(1, 6, (k,), generator=g)
    static_states, static_logp = s.static.run(tokens, hidden, positions, mask, s.cache.seq_lens[s.seq[0]])
    assert type(s.passes) is StaticRowPasses and type(s.passes.fallback) is RowPasses
    lean_states = s.passes.fallback.run_one(s.seq[0], tokens, hidden, positions, mask)  # the same K/V, slots
    with torch.inference_mode():
        lean_logp = drafter.head.logits(lean_states).float().log_softmax(-1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(static_states.float(), lean_states.float(), **tol)
    torch.testing.assert_close(static_logp, lean_logp, **({"atol": 1e-5, "rtol": 0} if dtype == torch.float32
                                                          else {"atol": 5e-2, "rtol": 0}))


def test_static_passes_refuse_ids_of_another_dtype(ckpts):
    """The buffers a graph replays are int64: int32 ids (or float positions) are refused with a
    TypeError, not reinterpreted."""
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(ckpts("eagle3")[0], model)
    s = drafter.start(model, DraftStart([[1, 2, 3]], [4], [hf_features(model, [1, 2, 3, 4],
                                                                        drafter.features_for(model))[:3]], 8,
                                        TreeConfig.chain(3)))
    s.use_static_passes(capture=False)
    hidden = torch.zeros(2, H)
    mask = torch.ones(2, 2, dtype=torch.bool).tril()
    with pytest.raises(TypeError, match="tokens must be int64"):
        s.static.run(torch.tensor([1, 2], dtype=torch.int32), hidden, torch.tensor([3, 4]), mask, 3)
    with pytest.raises(TypeError, match="positions must be int64"):
        s.static.run(torch.tensor([1, 2]), hidden, torch.tensor([3.0, 4.0]), mask, 3)
    states, logp = s.static.run(torch.tensor([1, 2]), hidden, torch.tensor([3, 4]), mask, 3)
    assert states.shape == (2, H) and logp.shape == (2, VD)


def test_cuda_graphs_need_a_cuda_head(ckpts):
    model = eagle_target("eagle3")
    drafter = treespec.load_draft(ckpts("eagle3")[0], model, cuda_graphs=True)
    start = DraftStart([[1, 2, 3]], [4], [hf_features(model, [1, 2, 3, 4], drafter.features_for(model))[:3]], 8,
                       TreeConfig.chain(3))
    with pytest.raises(ValueError, match="needs the draft head on a CUDA device"):
        drafter.start(model, start)


@pytest.mark.parametrize("tree", ["chain-3", "cpu", "eagle2"])
def test_graphed_row_through_the_engine_equals_hf_generate(ckpts, tree):
    """``cuda_graphs=True`` with the drafter's row uncaptured (a CPU cannot capture): static,
    dynamic and chain trees, the head alone and with prompt lookup grafted on, give HF
    generate's greedy output; the passes ran and each request found the row (and its passes)
    the previous one left, emptied, until a longer request needed a longer row."""
    from treespec.drafters import HybridDrafter
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    drafter = treespec.load_draft(ckpts("eagle3")[0], model, cuda_graphs=True)
    drafter.graphed_row = GraphedRow(capture=False)
    rows = []
    for draft in (drafter, HybridDrafter(drafter)):
        for p in ([1, 5, 9, 3, 7, 5, 9, 3, 7], list(range(20, 45))):
            out = treespec.generate(model, draft, tree, [p], max_new_tokens=20)
            assert out.sequences == [hf_greedy(model, p, 20)]
            rows.append(drafter.graphed_row.passes)
    assert rows[0].passes  # levels and commits ran on static passes
    assert len({id(r) for r in rows}) <= 2  # the same row for all, or a second once a longer one was needed
    long = treespec.generate(model, drafter, tree, [list(range(1, 60)) * 2], max_new_tokens=20)
    assert long.sequences == [hf_greedy(model, list(range(1, 60)) * 2, 20)]
    assert drafter.graphed_row.passes is not rows[-1]  # 118 prompt tokens need a longer row


def test_graphed_row_is_lent_to_one_session_at_a_time(ckpts, caplog):
    """A second live session drafts eagerly, with a warning; the row returns on finish, or when
    its session is dropped unfinished."""
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    drafter = treespec.load_draft(ckpts("eagle3")[0], model, cuda_graphs=True)
    drafter.graphed_row = GraphedRow(capture=False)
    def session():
        return start(drafter, model, [[1, 2, 3]], [4], TreeConfig.chain(3))

    first = session()
    assert first.static is drafter.graphed_row.passes
    with caplog.at_level("WARNING", logger="treespec.drafters.eagle"):
        second = session()
    assert second.static is None and "another session holds this drafter's graphs" in caplog.text
    first.finish(0)
    third = session()
    assert third.static is drafter.graphed_row.passes
    del third  # dropped without finish: the row is free again
    assert session().static is drafter.graphed_row.passes


def test_graphed_row_returns_when_a_stream_is_closed_early_and_comes_back_zeroed(ckpts):
    """The engine closes its draft session however generation ends: a stream closed after two
    steps gives the row back, and the next request finds it zeroed (each pass reads the whole
    row, so a non-finite entry left behind would turn its softmax to NaN)."""
    from treespec.drafters.graphs import GraphedRow

    model = eagle_target("eagle3")
    drafter = treespec.load_draft(ckpts("eagle3")[0], model, cuda_graphs=True)
    drafter.graphed_row = GraphedRow(capture=False)
    p = [1, 5, 9, 3, 7, 5, 9, 3, 7]
    steps = treespec.stream(model, drafter, "eagle2", [p], max_new_tokens=30)
    next(steps), next(steps), next(steps)
    row = drafter.graphed_row.passes
    row.keys[-1] = float("nan")  # what a diverged head could leave in a tree slot
    steps.close()
    out = treespec.generate(model, drafter, "eagle2", [p], max_new_tokens=20)
    assert drafter.graphed_row.passes is row  # returned on close, lent again
    assert out.sequences == [hf_greedy(model, p, 20)]
    assert torch.isfinite(row.keys).all()
    assert all(torch.isfinite(q.logp).all() for q in row.passes.values())
