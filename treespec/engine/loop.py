"""The decoding loop: prefill, then draft tree -> tree forward -> accept -> commit until every
request ends.

Read top to bottom, this module is one step in order: :class:`Request` (one record per request
row, as vLLM's ``CachedRequestState``), :func:`decode` (the loop, one call per stage), then the
stages as the loop calls them: ``_prefill`` (each prompt through the target, its first token);
``_draft_limits`` and ``_draft`` (propose, prune to the options' rules and to the budget, size
with ``auto``); ``_tree_forward`` (the target's logits at every node, on fixed shapes when the
runner asks); ``_verify`` (each
request's verdict, ``treespec/accept.py``'s rule); ``_commit`` (the tokens and K/V kept);
``_finish`` (requests that ended let go). Last, the small machinery the loop holds: the prefix
cache's use, the ``auto`` controller (a no-op one for a fixed tree, so both make the same
calls), the stage timer and the acceptance watch.

Letters: B requests, n tree nodes (root included), L committed tokens, V vocabulary, F features.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from ..accept import RequestDecoding, Verdict, accept, target_choices
from ..auto import AutoController, AutoProfile
from ..constraints import DraftRules
from ..device_sampling import row_warp
from ..drafters.base import DraftStart, Drafter
from ..fixed_shape import Accepted, FixedShapeVerify, fixed_row_tokens
from ..mask import causal_mask
from ..prefix_cache import PrefixCache, PrefixUse
from ..runner import ModelRunner
from ..tree import Tree
from ..warn import warn
from .outputs import RequestMetrics, SpecMetrics, StepOutput
from .request import Run

__all__ = ["Request", "decode"]


@dataclass(eq=False)
class Request:
    """One request's state in the loop; the stages take these rows.

    Attributes:
        index:     its row in the batch: its place in every ``StepOutput`` list, and its id for
                   the draft session, the metrics and the prefix cache.
        prompt:    its prompt, token ids.
        decoding:  its processors, seed and stopping criteria.
        cache_seq: its sequence in the paged KV cache.
        sequence:  the prompt and every token committed since: what its processors, draft rules
                   and stop strings read (grown in place).
        rules:     what its options forbid a draft after ``sequence`` (None: nothing).
        done:      it has ended (an EOS, a stopping criterion, or its budget).
    """

    index: int
    prompt: list[int]
    decoding: RequestDecoding
    cache_seq: int
    sequence: list[int] = field(init=False)
    rules: DraftRules | None = field(init=False)
    done: bool = False

    def __post_init__(self):
        self.sequence = list(self.prompt)
        self.rules = DraftRules.from_processors(self.decoding.processor.processors, self.sequence)

    @property
    def num_generated(self) -> int:
        """Tokens committed after the prompt (the first, from prefill, included)."""
        return len(self.sequence) - len(self.prompt)

    @property
    def root(self) -> int:
        """The newest committed token: the next tree's root."""
        return self.sequence[-1]

    def first_end(self, new: list[int], eos: frozenset[int]) -> int | None:
        """Index in ``new`` (tokens after ``sequence``) of the first that ends the request: an
        EOS, or the token that completes a stop string (the sequence is built only when there
        are some)."""
        stop = self.decoding.stop is not None
        for j, t in enumerate(new):
            if t in eos or (stop and self.decoding.stops(self.sequence + new[: j + 1])):
                return j
        return None


def decode(run: Run) -> Iterator[StepOutput]:
    """The loop ``stream`` runs: a :class:`StepOutput` for prefill's first tokens (step 0), then
    one per verify step, until every request has ended."""
    runner, drafter, B = run.runner, run.drafter, len(run.prompts)
    metrics = SpecMetrics(requests=[RequestMetrics(prompt_tokens=len(p)) for p in run.prompts])
    watch = _AcceptanceWatch(drafter)
    # Nodes per step: the tree's, plus what the drafter grafts on top (prompt lookup).
    max_nodes = run.tree_cfg.num_nodes + drafter.extra_nodes
    with runner.attached(), contextlib.closing(_prefix_use(run.prefix_cache, runner, drafter)) as prefix_use, \
            contextlib.ExitStack() as ends_with:  # the draft session's close, however the loop ends
        timer = _StepTimer(metrics)
        cache, cache_seqs, fixed, auto = _set_up(run, max_nodes, metrics, timer)
        ends_with.callback(runner.release_cache, cache)  # its storage serves the next call's cache
        rows = [Request(b, list(p), d, s) for b, (p, d, s) in enumerate(zip(run.prompts, run.decodings, cache_seqs))]
        with timer("prefill"):
            features, scores = _prefill(run, rows, cache, prefix_use)
        metrics.record_first_tokens(prefix_use.hits, timer.total().total_seconds)
        yield StepOutput(0, [[r.root] for r in rows], [r.done for r in rows], metrics, scores)
        with timer("draft"):
            session = drafter.start(runner.model, DraftStart(
                prompts=[list(r.prompt) for r in rows], first_tokens=[r.root for r in rows], features=features,
                max_new_tokens=run.max_new_tokens, tree_cfg=run.tree_cfg, stop=auto.stop, candidates=auto.candidates,
                rules=[r.rules for r in rows], prefix=prefix_use.draft_prefixes()))
            ends_with.callback(session.close)  # what the drafter lent it (a CUDA-graphed row) goes back
            metrics.compile_seconds += session.compile_seconds
            timer.discount(session.compile_seconds, stage="draft")
            _finish([r for r in rows if r.done], session, prefix_use, cache)

        step = 0
        while not all(r.done for r in rows):
            step += 1
            active = [r for r in rows if not r.done]
            ids = [r.index for r in active]
            cached = [cache.seq_lens[r.cache_seq] for r in active]  # committed K/V: each tree's first position
            limits = _draft_limits(run, active, cached, cache, max_nodes)
            with timer("draft"):
                trees = _draft(run, session, auto, timer, active, limits)
            with timer("verify"):
                out = _tree_forward(runner, fixed, cache, active, trees, cached)
                verdicts, scores = _verify(trees, out, active, run.output_scores)
                tokens, kept, scores = _commit(run, active, verdicts, out, scores, cache)
                prefix_use.record(ids, cached, kept)
                auto.learn(trees, [v.path for v in verdicts])
                metrics.record_step(ids, trees, tokens)
                watch.record(trees, sum(len(t) - 1 for t in tokens))
            with timer("draft"):
                session.commit(ids, tokens, kept)
                _finish([r for r in active if r.done], session, prefix_use, cache)
            auto.end_step(sum(t.num_nodes for t in trees), timer.since("verify"))
            yield StepOutput(step, _by_request(tokens, active, B), [r.done for r in rows], timer.total(),
                             _by_request(scores, active, B, idle=lambda: torch.empty(0, runner.vocab_size)))
    timer.total()


def _prefill(run: Run, rows: list[Request], cache, prefix_use: PrefixUse):
    """Each prompt through the target, its K/V committed: first each prompt's prefix cache hit
    (``h_b`` tokens) is copied into its row, then the rest runs in one forward, its positions
    from ``h_b`` on. Each request's first token (the choice at its prompt's last logits) is
    committed to its row. Returns the target features of the positions run (``[L_b - h_b, F]``,
    None when the drafter reads none) and, with ``output_scores``, the processed logits the
    first tokens came from (``[1, V]`` each; else None)."""
    hits = prefix_use.load(cache, [r.cache_seq for r in rows], [r.prompt for r in rows])
    rest = [r.prompt[h:] for r, h in zip(rows, hits)]
    out = run.runner.forward(
        cache, [r.cache_seq for r in rows], [torch.tensor(x) for x in rest],
        [torch.arange(h, h + len(x)) for x, h in zip(rest, hits)], [causal_mask(len(x)) for x in rest],
        logits_rows=[[len(x) - 1] for x in rest], capture=bool(run.runner.feature_layers),
    )
    for r, h in zip(rows, hits):
        cache.commit(r.cache_seq, range(h, len(r.prompt)))
    prefix_use.record(range(len(rows)), hits, out.features)
    scores = [r.decoding.processed_scores(r.prompt, logits) for r, logits in zip(rows, out.logits)]
    for r, x in zip(rows, scores):
        first = int(r.decoding.choose_from_scores(x, len(r.prompt))[0])
        r.done = r.first_end([first], run.eos) is not None or run.max_new_tokens == 1
        r.sequence.append(first)
    return out.features, ([x.float() for x in scores] if run.output_scores else None)


def _draft_limits(run: Run, active: list[Request], cached: list[int], cache,
                  max_nodes: int) -> tuple[list[int], list[int]]:
    """Per active request, the deepest node and the most nodes worth drafting: committing
    depth+1 tokens must fit the token budget, positions must stay below the model's maximum,
    and the nodes must fit the tree size and the KV room left."""
    depths, nodes = [], []
    for r, L in zip(active, cached):
        d = run.max_new_tokens - r.num_generated - 1
        if run.runner.max_positions is not None:
            d = min(d, run.runner.max_positions - 1 - L)
        depths.append(max(d, 0))
        nodes.append(min(max_nodes, cache.capacity(r.cache_seq) - L - 1))
    return depths, nodes


def _draft(run: Run, session, auto, timer: _StepTimer, active: list[Request],
           limits: tuple[list[int], list[int]]) -> list[Tree]:
    """This step's trees: proposed, rid of nodes the options forbid (each request's ``rules``),
    cut to each request's ``limits`` (depth, nodes), then sized (``auto``)."""
    max_depth, max_nodes = limits
    roots = [r.root for r in active]
    auto.begin_step()
    trees = session.propose([r.index for r in active], roots, max_depth)
    propose_seconds = timer.since("draft")
    trees = [t if r.rules is None else r.rules.prune(t) for t, r in zip(trees, active)]
    trees = [t.prune(max_depth=d, max_nodes=n) for t, d, n in zip(trees, max_depth, max_nodes)]
    trees = auto.choose(trees, propose_seconds)
    for t, root in zip(trees, roots):
        if t.tokens is None or int(t.tokens[0]) != root:
            raise RuntimeError(f"{type(run.drafter).__name__} proposed a tree whose root is not the last committed "
                               "token")
    return trees


def _set_up(run: Run, max_nodes: int, metrics: SpecMetrics, timer: "_StepTimer"):
    """``(cache, its sequences, fixed-shape verify or None, auto controller)`` for the loop.
    One row of the cache per request, each long enough for the longest: a batch's K/V are then
    read as a view of the cache, not gathered (PagedKVCache.add_sequences). Compiling, and
    measuring what a forward costs (once a process), are left out of the timer's time."""
    runner = run.runner
    longest = max(len(p) for p in run.prompts) + run.max_new_tokens
    row_tokens = (fixed_row_tokens(longest, max_nodes + 1, runner.fixed_shapes) if runner.fixed_shapes
                  else longest + max_nodes + 1)
    cache, cache_seqs = runner.new_rows_cache(len(run.prompts), row_tokens, run.page_size)
    accept, sampling = _device_rule(run, cache_seqs)
    fixed = _fixed_verify(runner, cache, cache_seqs, max_nodes, metrics, accept, sampling)
    sizing = time.perf_counter()
    auto = _controller(run, max_nodes, fixed if runner.fixed_shapes in ("compile", "graphs") else None)
    timer.discount(metrics.compile_seconds + time.perf_counter() - sizing)
    return cache, cache_seqs, fixed, auto


def _device_rule(run: Run, seqs) -> tuple[bool, dict | None]:
    """Whether the acceptance rule runs on the device, after the fixed-shape forward, and for
    which sequences it samples there (seq -> decoding; None: all greedy). Greedy requests with
    nothing to apply at a node always; sampled ones whose processors are warpers of the scores
    alone (``treespec/device_sampling.py``) where the forward is captured, or compiled on CUDA:
    on a CPU the host's rule, which processes only the nodes it reaches, costs less. Never with
    ``output_scores`` (every node's processed scores go back to the host)."""
    if run.output_scores:
        return False, None
    if all(d.greedy and not d.processor for d in run.decodings):
        return True, None
    runner = run.runner
    if runner.fixed_shapes == "graphs" or (runner.fixed_shapes == "compile" and runner.device.type == "cuda"):
        if all(row_warp(d) is not None for d in run.decodings):
            return True, {s: d for s, d in zip(seqs, run.decodings) if not d.greedy}
    return False, None


def _fixed_verify(runner: ModelRunner, cache, seqs, max_nodes: int, metrics: SpecMetrics,
                  accept: bool, sampling: dict | None) -> FixedShapeVerify | None:
    """The verify forward on fixed shapes, when asked (its buffers live as long as the rows),
    with ``accept`` the acceptance rule and the K/V's compaction inside it (sampling for the
    sequences ``sampling`` names); compiled or
    captured, every bucket a tree can take is compiled or captured here, before the prompts' K/V
    go in (the seconds in ``metrics.compile_seconds``)."""
    if not runner.fixed_shapes:
        return None
    fixed = FixedShapeVerify(runner, cache, seqs, compile=runner.fixed_shapes == "compile", accept=accept,
                             graphs=runner.fixed_shapes == "graphs", sampling=sampling)
    metrics.compile_seconds += fixed.precompile(max_nodes + 1, capture=bool(runner.feature_layers))
    return fixed


def _tree_forward(runner: ModelRunner, fixed: FixedShapeVerify | None, cache, active: list[Request],
                  trees: list[Tree], cached: list[int]):
    """The target's logits (and features) at every node of every request's tree, in one
    forward over the committed K/V (``cached[i]`` tokens of request i): on fixed shapes when
    ``fixed`` is given (the trees padded to a bucket, ``treespec/fixed_shape.py``)."""
    if fixed is not None:
        return fixed.forward([r.cache_seq for r in active], trees, cached, capture=bool(runner.feature_layers))
    return runner.forward(
        cache, [r.cache_seq for r in active], [t.tokens for t in trees],
        [t.position_ids(L) for t, L in zip(trees, cached)], [t.attention_mask() for t in trees],
        capture=bool(runner.feature_layers),
    )


def _verify(trees: list[Tree], out, active: list[Request], keep_scores: bool):
    """Each request's verdict on its tree: the target's choice at each node (its argmax, or its
    sample at that position, after the request's processors with the node's own history), then
    the acceptance rule: a child is accepted exactly when it carries its parent's choice, so
    greedy and sampled requests share one rule (``treespec/accept.py``). ``out``: the tree
    forward's logits (float ``[n_b, V]`` per request), or its verdicts when the fixed-shape
    forward accepted on the device (:class:`~treespec.fixed_shape.Accepted`). Returns the
    verdicts, and with ``keep_scores`` the processed logits at every node (``[n_b, V]``; else
    None)."""
    if isinstance(out, Accepted):
        return out.verdicts, None
    choices, scores = target_choices(trees, out.logits, [r.decoding for r in active], [r.sequence for r in active],
                                     keep_scores)
    return accept(trees, choices), scores


def _commit(run: Run, active: list[Request], verdicts: list[Verdict], out, node_scores: list[torch.Tensor] | None,
            cache):
    """Keep each verdict's tokens up to the budget and the first end, commit the K/V of the root
    and accepted nodes they came from, extend each request's ``sequence``, and mark the requests
    that ended. Returns the tokens per active request; when the tree forward ``out`` captured
    features, each one's features at those nodes (``[len(tokens_i), F]``, for the drafter), else
    None; and with ``node_scores`` (the processed logits at every node), those at the same
    nodes, else None. A forward that accepted on the device (:class:`~treespec.fixed_shape.Accepted`)
    moved the path's K/V and features into place already: its first positions are kept."""
    features, moved = out.features, isinstance(out, Accepted)
    tokens, kept, scores = [], [], []
    for i, (r, v) in enumerate(zip(active, verdicts)):
        toks = v.tokens[: run.max_new_tokens - r.num_generated]
        end = r.first_end(toks, run.eos)
        if end is not None:
            toks = toks[: end + 1]
        path = range(len(toks)) if moved else v.path[: len(toks)]  # the nodes whose K/V is kept (host ints)
        L = cache.seq_lens[r.cache_seq]
        cache.commit(r.cache_seq, [L + j for j in path])
        r.sequence.extend(toks)
        r.done = end is not None or r.num_generated >= run.max_new_tokens
        tokens.append(toks)
        if features is not None:
            kept.append(features[i][: len(toks)] if moved else features[i][path])
        if node_scores is not None:
            scores.append(node_scores[i][path].float())
    return tokens, (kept if features is not None else None), (scores if node_scores is not None else None)


def _finish(ended: list[Request], session, prefix_use: PrefixUse, cache) -> None:
    """Requests that ended: filed in the prefix cache (their committed pages, with the
    drafter's rows), then their draft state and K/V let go."""
    for r in ended:
        prefix_use.file(r.index, cache, r.cache_seq, r.sequence, functools.partial(session.prefix_state, r.index))
        session.finish(r.index)
        cache.free_sequence(r.cache_seq)


def _by_request(values: list | None, active: list[Request], batch: int, idle=list) -> list | None:
    """The active requests' values spread over the whole batch (an idle request's: ``idle()``)."""
    if values is None:
        return None
    out = [idle() for _ in range(batch)]
    for r, v in zip(active, values):
        out[r.index] = v
    return out


# ---- what the loop holds: the prefix cache's use, the auto controller, the timer, the watch ----

def _prefix_use(cache: PrefixCache | None, runner: ModelRunner, drafter: Drafter) -> PrefixUse:
    """This generation's use of ``cache`` (None: hits of 0, nothing filed)."""
    if cache is None:
        return PrefixUse(None)
    key = drafter.prefix_key(runner.model)
    features = bool(runner.feature_layers)
    return PrefixUse(cache, key, lookup=key is not None or not features, features=features)


def _controller(run: Run, max_nodes: int, fixed: FixedShapeVerify | None) -> AutoController | _NoAuto:
    """An :class:`AutoController` for an ``auto`` tree (its cost curve read or measured first:
    ``fixed``'s buckets when given, the compiled or captured verify), else the no-op one."""
    cfg, batch = run.tree_cfg, len(run.prompts)
    if not cfg.auto:
        return _NoAuto()
    profile = run.auto_profile if run.auto_profile is not None else AutoProfile.starting(run.drafter)
    # The batch's trees are verified in one forward: cover up to B trees (capped).
    profile.prepare(run.runner, min(batch * (max_nodes + 1), max(max_nodes + 1, 128)), fixed=fixed)
    return AutoController(profile, cfg.num_nodes, cfg.top_k, run.decodings[0].greedy, cfg.objective)


class _NoAuto:
    """The :class:`AutoController` of a fixed tree: the loop makes the same calls whatever the
    tree, and here they draft every level, keep every tree and learn nothing."""

    stop = None  # DraftStart.stop: no early stop, the builder drafts every level
    candidates = None  # DraftStart.candidates: no early stop to weigh a second drafter's nodes

    def begin_step(self) -> None:
        pass

    def choose(self, trees: list[Tree], propose_seconds: float) -> list[Tree]:
        return trees

    def learn(self, trees: Sequence[Tree], paths: Sequence[Sequence[int]]) -> None:
        pass

    def end_step(self, tokens: int, seconds: float) -> None:
        pass


class _StepTimer:
    """Wall time per stage: ``with timer("draft"):`` adds the block's seconds to the metrics'
    ``draft_seconds`` (likewise ``prefill``, ``verify``); :meth:`total` stamps
    ``total_seconds``, counted from the timer's creation."""

    def __init__(self, metrics: SpecMetrics):
        self.metrics = metrics
        self.began = {"start": time.perf_counter()}  # when each stage last began

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t0 = self.began[stage] = time.perf_counter()
        yield
        name = f"{stage}_seconds"
        setattr(self.metrics, name, getattr(self.metrics, name) + (time.perf_counter() - t0))

    def discount(self, seconds: float, stage: str | None = None) -> None:
        """Leave ``seconds`` just spent (compiling) out of the total and, given, ``stage``'s time."""
        self.began["start"] += seconds
        if stage is not None:
            name = f"{stage}_seconds"
            setattr(self.metrics, name, getattr(self.metrics, name) - seconds)

    def since(self, stage: str) -> float:
        """Seconds since ``stage`` last began."""
        return time.perf_counter() - self.began[stage]

    def total(self) -> SpecMetrics:
        self.metrics.total_seconds = self.since("start")
        return self.metrics


class _AcceptanceWatch:
    """Warns once when the draft's first steps accept nothing at all: a head trained for
    another model of the same shapes runs losslessly but at tau 1.0, slower than the model
    alone, and would otherwise say nothing."""

    # Verify steps that drafted something, across the batch, before judging: the shipped head
    # met 8 straight steps of nothing on 2 of ~200 Spec-Bench questions (a text it could not
    # predict), while a head for another model accepts nothing on any text.
    STEPS = 16

    def __init__(self, drafter: Drafter):
        from ..drafters.ngram import NgramDrafter

        self.name = type(drafter).__name__
        # Prompt lookup drafts only on repeated text: rejections there say nothing of a mismatch.
        self.steps = None if isinstance(drafter, NgramDrafter) else 0
        self.drafted = self.accepted = 0

    def record(self, trees: list[Tree], accepted: int) -> None:
        """A verify step's trees and the drafted tokens it accepted, across the batch."""
        if self.steps is None:  # judged already, or never judged (prompt lookup)
            return
        drafted = sum(t.num_drafted for t in trees)
        if drafted == 0:
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if self.steps == self.STEPS:
            if self.accepted == 0:
                warn(f"the model accepted none of the {self.drafted} tokens {self.name} drafted over the first "
                     f"{self.STEPS} steps: is this draft (head) trained for this model? (A draft that is usually "
                     "accepted can also meet text it cannot predict.) The output stays exact, but no faster than the "
                     "model alone")
            self.steps = None
