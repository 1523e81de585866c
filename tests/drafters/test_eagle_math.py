"""EAGLE heads' arithmetic: the head math against :class:`DenseHead`, a dense float64
implementation written from the definitions; draft extend (the head re-run on each step's
accepted tokens) against a fresh head prefill of the whole committed sequence; generation
against Hugging Face greedy decoding; the target features the runner records against HF's
hidden states.

Checkpoints are written by hand in the published layouts (``helpers/eagle_heads.py``). Random
heads rarely draft right, so one hand-set EAGLE-1 head on a near-bigram target ("informed") gets
runs of accepted drafts and multi-token commits. Sizes: target vocabulary V = 64, hidden H = 32;
EAGLE-3 draft vocabulary Vd = 40.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from helpers.eagle_heads import H, V, VD, eagle_target, hf_features, start_session, stored
from helpers.references import hf_greedy
from helpers.tiny import dynamic_configs, tiny_model
from treespec import TreeConfig
from treespec.drafters.base import DraftStart
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


def draft_len(session, r: int) -> int:
    return session.cache.seq_lens[session.seq[r]]


# ---- the head math --------------------------------------------------------------------------

# Low-peak targets keep the EAGLE-1 logits (the target's lm_head) small, so the fp32 head and
# the fp64 reference agree to well under 1e-4 in log-probability.
MATH_PROMPTS = [[5, 9, 9, 2, 17, 40, 3, 3, 11], [60, 1]]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_root_logprobs_match_dense_reference(eagle_ckpts, kind):
    """After start, the root's draft log-probs are the reference's last row: entries
    (f_i, prompt[i+1]) for i < L-1 and (f_{L-1}, first token), positions 0..L-1."""
    model = eagle_target(kind, peak=4.0)
    path, config, state = eagle_ckpts(kind)
    drafter = treespec.load_draft(path, model)
    ref = DenseHead(config, stored(state), model)
    first = [13, 2]
    session = start_session(drafter, model, MATH_PROMPTS, first)
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
def test_tree_scores_match_dense_reference(eagle_ckpts, kind, cfg):
    """A drafted node's score is the reference's log-prob of its path: a tree path is the
    committed entries followed by (parent's draft output, node token) entries at the next
    positions, each seeing only its own ancestors."""
    cfg = TreeConfig.preset(cfg) if isinstance(cfg, str) else cfg
    model = eagle_target(kind, peak=4.0)
    path, config, state = eagle_ckpts(kind)
    drafter = treespec.load_draft(path, model)
    ref = DenseHead(config, stored(state), model)
    first = [13, 2]
    session = start_session(drafter, model, MATH_PROMPTS, first, cfg)
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
def test_draft_extend_equals_fresh_prefill(eagle_ckpts, kind):
    """Session level, with commits of several tokens: after each commit the draft holds one
    entry per committed position (prompt + generated - 1: the newest token is the root and
    has no target feature yet), and its root log-probs equal a fresh head started from the
    whole sequence. Trees drafted in between leave no trace."""
    model = eagle_target(kind, peak=4.0)
    drafter = treespec.load_draft(eagle_ckpts(kind)[0], model)
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
            fresh = start_session(drafter, model, [full[r][: pos[r]]], [full[r][pos[r]]], cfg)
            torch.testing.assert_close(session.root_logp[r], fresh.root_logp[0], atol=1e-4, rtol=0)


def recording(drafter):
    """The drafter, with every session it starts appended to the returned list."""
    sessions = []
    plain = drafter.start
    drafter.start = lambda model, ctx: sessions.append(plain(model, ctx)) or sessions[-1]
    return drafter, sessions


@pytest.mark.parametrize("kind", ["informed", "eagle3"])
def test_generate_draft_extend_equals_fresh_prefill(eagle_ckpts, kind):
    """Engine level: after every step (features from the tree-verify forward), the draft
    cache holds prompt + generated - 1 entries and the root's draft log-probs equal a fresh
    head prefill on the committed sequence with the target's features recomputed from
    scratch; the output is HF's greedy output."""
    model = eagle_target(kind, peak=8.0)
    drafter, sessions = recording(treespec.load_draft(eagle_ckpts(kind)[0], model))
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
        fresh = start_session(drafter, model, [seq[:-1]], [seq[-1]])
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
def test_greedy_equals_hf_generate(eagle_ckpts, kind, seed, family, prompts, tree_cfg, max_new, fmt):
    model = eagle_target(kind, seed, family)
    drafter = treespec.load_draft(eagle_ckpts(kind, seed, fmt)[0], model)
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
