"""EAGLE drafters: a draft head that reads the target's own hidden states, and its sessions.

:class:`EagleDrafter` (EAGLE-1/2) and :class:`Eagle3Drafter` (EAGLE-3) hold an
:class:`~treespec.drafters.eagle_head.EagleHead` (the module and its checkpoints, in
:mod:`treespec.drafters.eagle_head`); :func:`load_draft` reads either, detecting the format.
An :class:`EagleSession` drafts for one ``generate`` call on a paged KV cache of its own, its
head passes run by the strategy it picks at start (:mod:`treespec.drafters.eagle_passes`).

The shift by one: the draft's entry i pairs the target state at position i with the token
*after* it, so the entry for the last committed position pairs with the root token and
predicts the root's children. When a tree node of depth d is drafted, its "feature" is its
parent's draft output (the head's guess of the target state), its position is the root's
draft position + d. After each commit the head is re-run on the accepted tokens with the
target's real features ("draft extend"); its tree entries are dropped.
"""

from __future__ import annotations

import logging

import torch

from ..attention import TorchBackend, backend_for, kv_dtype
from ..builder import Frontier, build_trees
from ..kv_cache import PagedKVCache
from ..runner import FINAL_NORM
from ..tree import Tree
from .base import DraftSession, DraftStart, Drafter
from .eagle_head import EagleHead, HeadConfig, eagle3_feature_layers, load_head
from .eagle_passes import PackedPasses, RowPasses, StaticRowPasses
from .draft_graph import commit_pass_for, draft_graph_for
from .graphs import GraphedRow, StaticPasses

# EagleHead, HeadConfig and eagle3_feature_layers live in eagle_head; named here too, where
# code written before the split imports them from.
__all__ = ["EagleDrafter", "Eagle3Drafter", "EagleSession", "load_draft", "EagleHead", "HeadConfig",
           "eagle3_feature_layers"]

log = logging.getLogger(__name__)


class EagleDrafter(Drafter):
    """An EAGLE-1/2 head: ``EagleDrafter.from_pretrained(path, target_model)``.

    ``cuda_graphs``: on a CUDA device, run a single request's head passes (tree levels, commits)
    on fixed shapes and replay each shape from a CUDA graph captured on its first use and kept
    for the next requests (:mod:`treespec.drafters.graphs`); batches of several requests run
    eagerly. ``compile_passes``: the same fixed-shape passes through ``torch.compile`` instead
    (any device; two graphs serve every pass size, compiled before the first step; on a CPU the
    head's weights frozen into them, compiled again when they change).

    ``whole_draft``: on those fixed shapes, draft a dynamic tree's every level in one graph and
    commit in another (:mod:`treespec.drafters.draft_graph`: two launches and one read a step)
    instead of a pass a level; it drafts every level (``auto``'s early stop is not asked) and
    falls back to the level-by-level draft under generation rules (default: on; compiled on a
    2-core CPU with ``auto`` trees it ran 1.06x faster on GSM8K and 1.01x on 30 Spec-Bench
    questions than a pass a level with the early stop; docs/benchmarks.md).
    """

    def __init__(self, head: EagleHead, attention_backend: str = "auto", page_size: int = 16,
                 cuda_graphs: bool = False, compile_passes: bool = False, whole_draft: bool = True):
        if cuda_graphs and compile_passes:
            raise ValueError("an EAGLE drafter's passes run from CUDA graphs (cuda_graphs) or compiled "
                             "(compile_passes), not both")
        self.head = head
        self.attention_backend = attention_backend
        self.page_size = page_size
        self.cuda_graphs, self.compile_passes = cuda_graphs, compile_passes
        self.whole_draft = whole_draft
        # the static passes and their cache row, lent to one session at a time
        self.graphed_row = GraphedRow(capture=not compile_passes, compile=compile_passes)

    @classmethod
    def from_pretrained(cls, path, target_model, **kw):
        head = load_head(path, target_model)
        if head.config.eagle3 and cls is EagleDrafter:
            raise ValueError(f"{path} is an EAGLE-3 checkpoint: use Eagle3Drafter or treespec.load_draft")
        if not head.config.eagle3 and cls is Eagle3Drafter:
            raise ValueError(f"{path} is an EAGLE-1/2 checkpoint: use EagleDrafter or treespec.load_draft")
        return _with_calibration(cls(head, **kw), path)

    def with_compiled_passes(self) -> "EagleDrafter":
        """This drafter, its single request's head passes compiled (``compile_passes``): the
        same head (shared, not copied) and calibrations, a row of its own."""
        twin = type(self)(self.head, self.attention_backend, self.page_size, compile_passes=True,
                          whole_draft=self.whole_draft)
        twin.auto_calibration = self.auto_calibration
        return twin

    def modules(self):
        return (self.head,)

    def features_for(self, model):
        if self.head.config.eagle3:
            return eagle3_feature_layers(model.config.num_hidden_layers)
        return (FINAL_NORM,)

    def check_compatible(self, model) -> None:
        if self.head._embed[0] is not model.get_input_embeddings():
            raise ValueError("this EAGLE head was loaded for another target model: load it with this target")

    def prefix_key(self, model):
        p = next(self.head.parameters())
        return (self.head, "eagle", str(p.dtype), str(p.device), self.features_for(model))

    def start(self, model, ctx: DraftStart) -> "EagleSession":
        if ctx.features is None:
            raise RuntimeError("EAGLE drafters need target features")
        return EagleSession(self, ctx)

    def __repr__(self):
        c = self.head.config
        kind = "EAGLE-3" if c.eagle3 else "EAGLE-1/2"
        graphs = ", CUDA graphs" if self.cuda_graphs else ", compiled passes" if self.compile_passes else ""
        return f"{type(self).__name__}({kind}, hidden {c.hidden_size}, draft vocab {c.draft_vocab_size}{graphs})"


class Eagle3Drafter(EagleDrafter):
    """An EAGLE-3 head (fused features, reduced draft vocabulary)."""


def load_draft(path_or_name, target_model, **kw) -> EagleDrafter:
    """Load an EAGLE-1/2 or EAGLE-3 head from a directory or a shipped name; the format is
    detected from the checkpoint."""
    from ..assets import resolve_draft

    path = resolve_draft(path_or_name)
    head = load_head(path, target_model)
    return _with_calibration((Eagle3Drafter if head.config.eagle3 else EagleDrafter)(head, **kw), path)


def _with_calibration(drafter: EagleDrafter, path) -> EagleDrafter:
    """``auto`` starts from the head's own calibrations when its directory has them."""
    from ..auto import AutoProfile

    drafter.auto_calibration = AutoProfile.head_calibration(path)
    return drafter


class EagleSession(DraftSession):
    """One ``generate`` call's drafting with an EAGLE head: a one-layer paged KV cache of the
    head's entries (a row per request), and the strategy that runs the head's passes
    (:attr:`passes`), picked here once: the fixed-shape passes of the drafter's graphed row
    (``cuda_graphs=True``, one request), else the lean row pass (one request at a time on a
    CPU with the torch backend), else the packed pass through the attention backend."""

    def __init__(self, drafter: EagleDrafter, ctx: DraftStart):
        self.head = head = drafter.head
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cfg, self.stop, self.ctx = ctx.tree_cfg, ctx.stop, ctx
        self.to_draft = _draft_ids(head, ctx)  # target id -> draft id (-1: none), or None
        self.room = ctx.tree_cfg.depth * ctx.tree_cfg.top_k + ctx.tree_cfg.num_nodes + 2
        longest = max(len(pr) for pr in ctx.prompts) + ctx.max_new_tokens + self.room
        self._graphed: GraphedRow | None = None
        self.whole_draft = drafter.whole_draft and ctx.tree_cfg.kind == "dynamic"
        lent = self._borrow_row(drafter, len(ctx.prompts), longest)
        if lent is not None:
            self._graphed = drafter.graphed_row
            self.cache, seq, static = lent
            self.seq = [seq]
        else:
            self.cache, self.seq = self._rows(drafter, len(ctx.prompts), longest)
        self.root_logp: dict[int, torch.Tensor] = {}
        self.root_state: dict[int, torch.Tensor] = {}
        packed = PackedPasses(head, self.cache, backend_for(head, drafter.attention_backend, self.device))
        eager = packed
        if isinstance(packed.backend, TorchBackend) and self.device.type == "cpu":
            eager = RowPasses(packed, rope_length=self.cache.capacity(self.seq[0]))
        self.passes: StaticRowPasses | RowPasses | PackedPasses = (
            eager if lent is None else StaticRowPasses(static, eager))
        # The prompt's pass runs eagerly whatever the strategy: it has a shape of its own and
        # runs once, so a graph of it would never be replayed.
        self._extend(list(range(len(ctx.prompts))), *self._prompt_entries(ctx), passes=eager)

    def _rows(self, drafter: EagleDrafter, count: int, tokens: int) -> tuple[PagedKVCache, list[int]]:
        """A one-layer draft cache of ``count`` rows of ``tokens`` entries."""
        c = self.head.config
        return PagedKVCache.with_rows(1, c.num_kv_heads, c.head_dim, count, tokens, drafter.page_size,
                                      kv_dtype(self.dtype, self.device), self.device)

    def _borrow_row(self, drafter: EagleDrafter, count: int, longest: int):
        """With ``cuda_graphs`` or ``compile_passes``: ``(cache, seq, static passes)`` lent by the drafter's row
        for ``count == 1`` request, or None (several requests, or another session holds it)."""
        if not (drafter.cuda_graphs or drafter.compile_passes):
            return None
        if self.device.type != "cuda" and drafter.graphed_row.capture:
            raise ValueError(f"cuda_graphs=True needs the draft head on a CUDA device; it is on {self.device}")
        if count > 1:
            log.warning("static head passes (CUDA graphs, compiled) serve one request at a time: these %d requests "
                        "are drafted eagerly", count)
            return None
        prepare = self._precompile_whole if self.whole_draft else None
        lent = drafter.graphed_row.lend(self, self.head, longest, self.room,
                                        lambda tokens: self._rows(drafter, 1, tokens), prepare)
        if lent is None:
            log.warning("static head passes: another session holds this drafter's row; this one drafts eagerly")
        else:
            self.compile_seconds = drafter.graphed_row.compile_seconds
        return lent

    def _precompile_whole(self, static: StaticPasses) -> float:
        """Compiled: the whole draft and the commit passes (one entry, two or more) over the
        row, before any step."""
        return (draft_graph_for(static, self.cfg).precompile()
                + sum(commit_pass_for(static, n).precompile() for n in (1, 2) if n <= static.max_entries))

    def _prompt_entries(self, ctx: DraftStart) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Per request, the tokens and target features of its prompt's entries that the head has
        not yet read; a prefix cache hit's rows are loaded into the cache here."""
        tokens, features = [], []
        for r, (pr, t, f) in enumerate(zip(ctx.prompts, ctx.first_tokens, ctx.features)):
            hit = ctx.prefix[r] if ctx.prefix is not None else None
            if hit is None:
                tokens.append(pr[1:] + [t])
                features.append(f)
                continue
            # Entries 0..n-2 from the cache (row t holds entry t-1); entry n-1 pairs the
            # feature kept at n-1 with the first uncached token, as without the cache.
            self.cache.load(self.seq[r], hit.rows["kv"][1: hit.length])
            tokens.append(pr[hit.length:] + [t])
            features.append(torch.cat([hit.feature[None].to(f), f]))
        return tokens, features

    @property
    def static(self) -> StaticPasses | None:
        """The fixed-shape passes this session runs its lone request on, or None."""
        return self.passes.static if isinstance(self.passes, StaticRowPasses) else None

    def use_static_passes(self, capture: bool) -> None:
        """Run the one request's head passes on fixed shapes from now on (:class:`StaticPasses`
        over its row of this session's cache), each shape captured in a CUDA graph with
        ``capture`` (tests and benchmarks; ``cuda_graphs=True`` uses the drafter's
        :class:`GraphedRow` instead)."""
        if len(self.seq) != 1:
            raise ValueError(f"static passes serve one request; this session drafts {len(self.seq)}")
        eager = self.passes.fallback if isinstance(self.passes, StaticRowPasses) else self.passes
        self.passes = StaticRowPasses(StaticPasses.over_row(self.head, self.cache, self.seq[0], capture, self.room),
                                      eager)

    def _extend(self, requests, tokens, features, passes=None):
        """Draft extend: entries (f_i, token_i) for committed tokens, then the root's
        log-probs and state for the next tree. ``passes``: the strategy to run them on (None:
        the session's)."""
        if not requests or (passes is None and self._commit_whole(requests, tokens, features)):
            return
        from ..mask import causal_mask

        toks = [torch.tensor(t, dtype=torch.int64) for t in tokens]
        with torch.inference_mode():
            hid = [self.head.project(f.to(self.device, self.dtype)) for f in features]
        pos = [torch.arange(self.cache.seq_lens[self.seq[r]], self.cache.seq_lens[self.seq[r]] + len(t))
               for r, t in zip(requests, tokens)]
        out, logps = (passes or self.passes).run([self.seq[r] for r in requests], toks, hid, pos,
                                                 [causal_mask(len(t)) for t in tokens])
        with torch.inference_mode():
            for i, (r, t, h) in enumerate(zip(requests, tokens, out)):
                s = self.seq[r]
                L = self.cache.seq_lens[s]
                self.cache.commit(s, torch.arange(L, L + len(t)))
                last = h[-1:]
                self.root_state[r] = last
                self.root_logp[r] = (logps[i][-1] if logps is not None
                                     else self.head.logits(last)[0].float().log_softmax(-1))

    def propose(self, requests, roots, max_depth):
        requests = list(requests)
        whole = self._propose_whole(requests, roots)
        if whole is not None:
            return whole
        seqs = [self.seq[r] for r in requests]
        base = [self.cache.seq_lens[s] for s in seqs]  # the root's entry is at base - 1
        tree_pos = torch.zeros(0, dtype=torch.int64)
        head = self.head

        def step(f: Frontier):
            nonlocal tree_pos
            k = f.tokens.shape[1]
            pos = torch.full((k,), f.depth, dtype=torch.int64)
            tok = head.draft_to_target(f.tokens.to(self.device))
            out, logps = self.passes.run(
                seqs, list(tok), list(f.parent_state), [b - 1 + pos for b in base],
                list(f.ancestors.cpu()), extra_keys=[b - 1 + tree_pos for b in base],
            )
            tree_pos = torch.cat([tree_pos, pos])
            h = torch.stack(out)  # [B, k, H]
            if logps is not None:
                return torch.stack(logps), h
            with torch.inference_mode():
                logp = head.logits(h).float().log_softmax(-1)
            return logp, h

        root_logp = torch.stack([self.root_logp[r] for r in requests])
        root_state = torch.stack([self.root_state[r] for r in requests])  # [B, 1, H]
        # The builder works in draft ids; roots are target ids and are restored below.
        constrain = self.ctx.constrain_for(requests, lambda ids: head.draft_to_target(ids.to(self.device)).cpu(),
                                           self.to_draft)
        trees = build_trees(torch.zeros(len(requests), dtype=torch.int64), root_logp, step, self.cfg, root_state,
                            stop=self.stop, constrain=constrain)
        for s, b in zip(seqs, base):
            self.cache.truncate(s, b)
        out = []
        for t, root in zip(trees, roots):
            toks = head.draft_to_target(t.tokens.to(self.device)).cpu()
            toks[0] = root
            out.append(t.with_tokens(toks, t.scores))
        return out

    def _commit_whole(self, requests, tokens, features) -> bool:
        """With ``whole_draft``: the lone request's commit in one pass over its row, the root for
        the next draft left in the row's buffers (:class:`CommitPass`; also under generation rules,
        whose drafts go level by level and read the root from there); False where it cannot be: no
        fixed-shape passes, a batch, more entries than the passes take, past the row."""
        static = self.static
        if not self.whole_draft or static is None or len(requests) != 1:
            return False
        (r,), (t,), (f,) = requests, tokens, features
        seq, n = self.seq[r], len(t)
        L = self.cache.seq_lens[seq]
        if n > static.max_entries or L + n > static.capacity or self.cache.block_rows([seq], L + n) is None:
            return False
        self.cache.reserve(seq, L + n)
        self.root_logp[r], self.root_state[r] = commit_pass_for(static, n).run(torch.tensor(t), f, L)
        self.cache.commit(seq, range(L, L + n))
        return True

    def _propose_whole(self, requests, roots) -> list[Tree] | None:
        """The lone request's tree drafted whole, in one graph (``whole_draft``), or None where it
        cannot be: no fixed-shape passes, rules to mask by, a tree past the row."""
        static = self.static
        if not self.whole_draft or static is None or len(requests) != 1:
            return None
        (r,) = requests
        if self.ctx.rules is not None and self.ctx.rules[r] is not None:
            return None
        graph = draft_graph_for(static, self.cfg)
        seq = self.seq[r]
        L = self.cache.seq_lens[seq]
        if not graph.fits(L) or self.cache.block_rows([seq], L + graph.reach) is None:
            return None
        self.cache.reserve(seq, L + graph.reach)  # the frontiers' entries: written, never committed
        tree = graph.draft(self.root_logp[r], self.root_state[r], L, roots[0])
        self.cache.truncate(seq, L)
        return [tree]

    def commit(self, requests, tokens, features):
        self._extend(list(requests), [list(t) for t in tokens], features)

    def close(self):
        """Give the drafter's graphed row back (its one request finished, or generation ended);
        the session drafts no more."""
        if isinstance(self.passes, StaticRowPasses):
            self.passes = self.passes.fallback
        if self._graphed is not None:
            self._graphed.give_back(self)

    def prefix_state(self, request, start):
        """Row t: the head's entry t-1 (``kv`` ``[2, 1, Hkv, D]``), the entry that pairs
        position t-1 with token t, so a page's rows hold for whatever follows the page; row 0
        is empty."""
        s = self.seq[request]
        entries = self.cache.read(s, max(start - 1, 0), max(self.cache.seq_lens[s] - 1, 0))
        if start == 0:
            entries = torch.cat([entries.new_zeros((1, *entries.shape[1:])), entries])
        return {"kv": entries}

    def finish(self, request):
        if self._graphed is not None:  # the row stays with the drafter, for the next session
            self.close()
        else:
            self.cache.free_sequence(self.seq[request])
        self.root_logp.pop(request, None)
        self.root_state.pop(request, None)


def _draft_ids(head: EagleHead, ctx: DraftStart) -> torch.Tensor | None:
    """For a head with a vocabulary of its own whose requests have generation rules: int64
    ``[V]``, each target id's draft id (-1: none), for the builder to mask by; else None."""
    c = head.config
    if not (c.eagle3 and ctx.rules is not None and any(ctx.rules)):
        return None
    ids = torch.arange(c.draft_vocab_size, device=head.d2t.device)
    to_draft = torch.full((c.vocab_size,), -1, dtype=torch.int64)
    to_draft[head.draft_to_target(ids).cpu()] = ids.cpu()
    return to_draft
