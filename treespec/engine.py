"""The decoding loop: prefill, then draft tree -> verify -> commit until every request ends.

    stream(...)    a generator of per-step commits (the one loop)
    generate(...)  runs stream to the end and collects sequences and metrics

``_loop`` makes one call per stage: ``_prefill``; then each step ``_draft`` (propose, cut
to the budget, sized by ``auto``), ``_tree_forward`` and ``_verify`` (the target's logits at
every node, then each request's verdict), ``_commit`` (the tokens and K/V kept), and the
drafter's own commit. A fixed tree makes the same calls as an ``auto`` one, to a no-op
controller; ``_StepTimer`` adds each stage's time to the metrics.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import operator
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (MaxTimeCriteria, StoppingCriteria, StoppingCriteriaList,
                                                       StopStringCriteria)

from .auto import AutoController, AutoProfile
from .config import TreeConfig
from .drafters.base import DraftStart, Drafter
from .mask import causal_mask
from .prefix_cache import PrefixCache, PrefixUse
from .runner import ModelRunner
from .constraints import DraftRules
from .processing import (NodeProcessor, RequestDecoding, exact_generation_config, resolve_generation_config,
                         row_config)
from .sampling import SamplingParams
from .tree import Tree
from .verify import Verdict, verify_greedy
from .warn import warn

__all__ = ["generate", "stream", "GenerateOutput", "SpecMetrics", "RequestMetrics", "StepOutput"]

log = logging.getLogger(__name__)


@dataclass
class RequestMetrics:
    num_steps: int = 0  # verify forwards this request took part in
    num_generated: int = 0  # tokens generated (prefill's first token included)
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step
    prompt_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens whose K/V (and draft state) a PrefixCache supplied, not recomputed
    first_token_seconds: float = 0.0  # time to first token: from decoding's start through prefill (batch-wide)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify forward, the bonus included (tau)."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the prefill ran through the target: the prompt less the cache's hit."""
        return self.prompt_tokens - self.hit_tokens


@dataclass
class SpecMetrics:
    """Counters of one generation.

    ``mean_accepted_length`` (tau) is the mean over (request, verify step) pairs of the
    tokens committed, bonus included; the first token, produced by prefill, is not part
    of it. ``acceptance_counts[d-1]`` counts the (request, step) pairs that accepted at
    least ``d`` drafted tokens; dividing by ``num_request_steps`` gives the acceptance rate
    by draft position.
    """

    num_steps: int = 0
    num_generated: int = 0
    num_request_steps: int = 0
    acceptance_counts: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    tree_tokens: int = 0  # tokens run through verify forwards (roots included)
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified, per request-step
    requests: list[RequestMetrics] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        acc = [a for r in self.requests for a in r.accepted]
        return (sum(acc) + len(acc)) / max(len(acc), 1)

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        return [c / max(self.num_request_steps, 1) for c in self.acceptance_counts]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        """Wall time after prefill: drafting, verifying and committing."""
        return max(self.total_seconds - self.prefill_seconds, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each request's first (prefill makes it) per decode second: the rate
        speculation changes, whatever the prompt's length."""
        decoded = self.num_generated - len(self.requests)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Drafted nodes verified per request-step (what an ``auto`` tree chose)."""
        return sum(self.tree_sizes) / max(len(self.tree_sizes), 1)

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens a PrefixCache supplied (their prefill was not run): the prefill work
        the cache saved, in tokens. Its time is not measured here (it would take the prefill
        run both ways; ``benchmarks/micro/prefix_cache.py`` does)."""
        return sum(r.hit_tokens for r in self.requests)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens run through the target at prefill."""
        return sum(r.prefill_tokens for r in self.requests)

    def record_first_tokens(self, hits: Sequence[int], seconds: float) -> None:
        """Prefill produced each request's first token, ``seconds`` after decoding began;
        ``hits[b]``: request b's prompt tokens that came from a prefix cache."""
        for r, hit in zip(self.requests, hits):
            r.num_generated = 1
            r.hit_tokens = hit
            r.first_token_seconds = seconds
        self.num_generated = len(self.requests)

    def record_step(self, requests: Sequence[int], trees: Sequence[Tree], tokens: Sequence[list[int]]) -> None:
        """One verify forward: ``requests[i]`` verified ``trees[i]`` and committed ``tokens[i]``
        (its accepted drafts, then the bonus)."""
        for b, toks in zip(requests, tokens):
            r, accepted = self.requests[b], len(toks) - 1
            r.num_steps += 1
            r.accepted.append(accepted)
            r.num_generated += len(toks)
            self.num_generated += len(toks)
            self.num_request_steps += 1
            while len(self.acceptance_counts) < accepted:
                self.acceptance_counts.append(0)
            for d in range(accepted):
                self.acceptance_counts[d] += 1
        self.num_steps += 1
        self.tree_tokens += sum(t.num_nodes for t in trees)
        self.tree_sizes.extend(t.num_drafted for t in trees)

    def summary(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_generated": self.num_generated,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate_by_position": self.acceptance_rate_by_position,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "tokens_per_second": self.tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "mean_tree_size": self.mean_tree_size,
            "prefill_tokens": self.prefill_tokens,
            "hit_tokens": self.hit_tokens,
        }


@dataclass
class StepOutput:
    """Tokens committed in one step: ``tokens[i]`` for request i (empty if it was idle),
    ``finished[i]`` once request i has ended. ``metrics`` is the live counter object.
    ``scores[i]``: with ``output_scores``, float ``[len(tokens[i]), V]``, the processed logits
    each of those tokens was chosen from (as ``generate``'s ``output_scores``); else None."""

    step: int
    tokens: list[list[int]]
    finished: list[bool]
    metrics: SpecMetrics
    scores: list[torch.Tensor] | None = None


@dataclass
class GenerateOutput:
    """``sequences[i]``: request i's generated ids (prompt excluded, EOS kept if produced).
    ``scores[i]``: with ``output_scores``, float ``[len(sequences[i]), V]``, the processed logits
    of every generated position; else None."""

    sequences: list[list[int]]
    metrics: SpecMetrics
    scores: list[torch.Tensor] | None = None

    def __getitem__(self, i):
        return self.sequences[i]


_TEXT_NOT_IDS = ("input_ids must be token ids, not text: tokenize the text first, e.g. "
                 "tokenizer(text)['input_ids'] or tokenizer.apply_chat_template(messages, add_generation_prompt=True)")


def _prompts(input_ids) -> tuple[list[list[int]], bool]:
    def one(x):
        if isinstance(x, (str, bytes)):
            raise ValueError(_TEXT_NOT_IDS)
        if isinstance(x, Mapping):
            rows = _prompts(x)[0]
            if len(rows) != 1:
                raise ValueError("a prompt in a list must hold one sequence, got a batch")
            return rows[0]
        if isinstance(x, torch.Tensor):
            if x.dim() == 2 and x.shape[0] == 1:
                x = x[0]
            if x.dim() != 1:
                raise ValueError(f"a prompt tensor must be 1-D token ids, got shape {tuple(x.shape)}")
            if x.dtype.is_floating_point or x.dtype == torch.bool:
                raise ValueError(f"prompt token ids must be integers, got {x.dtype}")
            return [int(t) for t in x.tolist()]
        if isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind in "iu":
            return [int(t) for t in x.tolist()]
        if not isinstance(x, (list, tuple)):
            raise ValueError(f"a prompt must be a list of token ids or a 1-D tensor, got {type(x).__name__}")
        ids = []
        for t in x:
            if isinstance(t, (str, bytes)):
                raise ValueError(_TEXT_NOT_IDS)
            try:
                ids.append(operator.index(t))  # unlike int(), refuses 1.5 and "7"
            except TypeError:
                raise ValueError(f"prompt token ids must be ints, got {type(t).__name__} {t!r}") from None
        return ids

    if isinstance(input_ids, np.ndarray):
        if input_ids.dtype.kind not in "iu":
            raise ValueError(f"prompt token ids must be integers, got a numpy array of {input_ids.dtype}")
        input_ids = torch.from_numpy(input_ids)
    if isinstance(input_ids, Mapping):  # a tokenizer's BatchEncoding
        if "input_ids" not in input_ids:
            raise ValueError("input_ids is a mapping without an 'input_ids' entry")
        ids, mask = input_ids["input_ids"], input_ids.get("attention_mask")
        if mask is not None:
            ids = [[t for t, m in zip(row, mrow) if int(m)] for row, mrow in zip(_rows(ids), _rows(mask))]
            return (ids, False) if len(ids) > 1 or _is_batch(input_ids["input_ids"]) else (ids, True)
        return _prompts(ids)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] > 1:
            return [one(r) for r in input_ids], False
        return [one(input_ids)], True
    if isinstance(input_ids, (str, bytes)):
        raise ValueError(_TEXT_NOT_IDS)
    if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
        raise ValueError("input_ids must be a non-empty list of ints, a 1-D tensor, or a list of those")
    if any(isinstance(t, (str, bytes)) for t in input_ids):
        raise ValueError(_TEXT_NOT_IDS)
    if not any(isinstance(t, (list, tuple, Mapping)) or (isinstance(t, (torch.Tensor, np.ndarray)) and t.ndim > 0)
               for t in input_ids):
        # One prompt of scalars; one() names an entry that is not a token id.
        if not input_ids:
            raise ValueError("input_ids is empty")
        return [one(input_ids)], True
    return [one(p) for p in input_ids], False


def _is_batch(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() == 2
    return isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], (list, tuple, torch.Tensor))


def _rows(x) -> list[list[int]]:
    """Token rows of a 1-D/2-D tensor or (nested) list."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return [list(r) for r in x] if _is_batch(x) else [list(x)]


def _eos_set(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _resolve_draft(draft) -> Drafter:
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str) and draft == "ngram":
        from .drafters.ngram import NgramDrafter

        return NgramDrafter()
    if isinstance(draft, str) and draft == "none":
        from .drafters.none import NoDrafter

        return NoDrafter()
    got = repr(draft) if isinstance(draft, str) else type(draft).__name__
    raise ValueError(
        f"draft must be a treespec Drafter (ModelDrafter, NgramDrafter, EagleDrafter, ...), "
        f"'ngram' or 'none', got {got}"
    )


def _seeds(seed, n: int) -> list[int]:
    """Each request's sampling seed: ``seed + i``, one given per request, or (None) drawn from
    torch's global generator, so that ``torch.manual_seed`` makes a run repeatable."""
    if seed is None:
        return torch.randint(0, 2**62, (n,)).tolist()
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        seeds = [int(seed) + i for i in range(n)]
    elif isinstance(seed, (str, bytes, bool)) or not hasattr(seed, "__iter__"):
        raise ValueError(f"seed must be an int or one int per request, got {seed!r}")
    else:
        seeds = [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"seed gives {len(seeds)} seeds for {n} requests")
    return seeds


def _decodings(model, prompts: list[list[int]], eos: set[int], max_new: int, temperature, top_k, top_p, min_p, seed,
               resolved: GenerationConfig | None, logits_processor, stopping_criteria, tokenizer,
               options: dict) -> list[RequestDecoding]:
    """Each request's processors, stopping criteria and seed, from treespec's keyword
    arguments (exactly the options given) or from a ``resolved`` generation config
    (transformers' semantics: :func:`resolve_generation_config`)."""
    n = len(prompts)
    if resolved is not None:
        configs = [resolved] * n
    else:
        for name in ("do_sample", "attention_mask"):
            if name in options:
                raise ValueError(f"{name} is not an option of treespec.generate: "
                                 + ("temperature > 0 samples" if name == "do_sample" else
                                    "give the prompts unpadded, as a list of token lists"))
        params = _sampling_params(temperature, top_k, top_p, min_p, n)
        fields = {}
        for p in set(params):
            warpers = {} if p.greedy else dict(do_sample=True, temperature=float(p.temperature), top_k=p.top_k or 0,
                                               top_p=1.0 if p.top_p is None else p.top_p, min_p=p.min_p)
            fields[p] = exact_generation_config(model, eos_token_id=sorted(eos) or None, **warpers, **options)
        configs = [fields[p] for p in params]
    seeds = _seeds(seed, n)
    stop = _stopping(configs[0], stopping_criteria, tokenizer)
    out = []
    for c, p, s in zip(configs, prompts, seeds):
        c = row_config(c, len(p), max_new)
        out.append(RequestDecoding(NodeProcessor.build(model, c, len(p), logits_processor),
                                   s if c.do_sample else None, stop))
    return out


def _stopping(config: GenerationConfig, criteria, tokenizer) -> StoppingCriteriaList | None:
    """What ends a request besides EOS and the token budget, as ``generate`` builds it: stop
    strings, ``max_time`` (counted from now) and the user's own ``stopping_criteria``; each is
    asked after every committed token, with that token's sequence (``scores`` None)."""
    out = StoppingCriteriaList()
    if config.max_time is not None:
        out.append(MaxTimeCriteria(config.max_time))
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer (tokenizer=...), as model.generate does")
        out.append(StopStringCriteria(tokenizer, config.stop_strings))
    for c in criteria or ():
        if not isinstance(c, StoppingCriteria):
            raise ValueError(f"stopping_criteria holds transformers StoppingCriteria, got {type(c).__name__}")
        out.append(c)
    return out or None


def _budget(model, prompts: list[list[int]], max_new_tokens, generation_config, options: dict) -> int:
    """New tokens per request, as ``model.generate`` counts them: ``max_new_tokens`` (the
    argument, else a generation config's), else ``max_length`` less the longest prompt (the
    width of the padded batch ``generate`` would see), else 128. The generation configs (the
    user's, then the model's) count only with a ``generation_config``, as for every option."""
    if max_new_tokens is None:
        sources = [options] + ([generation_config.to_dict(), model.generation_config.to_dict()]
                               if generation_config is not None else [])

        def first(name):  # ``options`` holds no max_new_tokens: it is an argument of its own
            return next((s[name] for s in sources if s.get(name) is not None), None)

        max_new_tokens, limit = first("max_new_tokens"), first("max_length")
        if max_new_tokens is None and limit is not None:
            longest = max(map(len, prompts))
            if limit - longest < 1:
                raise ValueError(f"max_length={limit} leaves no room for a new token after a prompt of {longest} "
                                 "tokens: raise it, or give max_new_tokens")
            max_new_tokens = limit - longest
    if max_new_tokens is None:
        max_new_tokens = 128
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return max_new_tokens


def _sampling_params(temperature, top_k, top_p, min_p, n: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per request. ``temperature`` is one number for the batch or
    one per request; a request at 0 decodes greedily, and top_k/top_p/min_p apply to the
    sampled requests (with none sampled, setting them is an error, as for one request)."""
    if isinstance(temperature, numbers.Real):
        return [SamplingParams(temperature, top_k, top_p, min_p)] * n
    temps = list(temperature)
    if len(temps) != n:
        raise ValueError(f"temperature gives {len(temps)} values for {n} requests: give one number or one per request")
    if not any(isinstance(t, numbers.Real) and t > 0 for t in temps):
        SamplingParams(0.0, top_k, top_p, min_p)  # all greedy: refuses sampling options
    return [SamplingParams(t, top_k, top_p, min_p) if isinstance(t, numbers.Real) and t > 0 else SamplingParams(t)
            for t in temps]


def stream(
    model,
    draft,
    tree_cfg,
    input_ids,
    *,
    max_new_tokens: int | None = None,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_backend: str = "auto",
    page_size: int = 16,
    auto_profile=None,
    generation_config=None,
    logits_processor=None,
    tokenizer=None,
    output_scores: bool = False,
    allow_past_context: bool = False,
    prefix_cache: PrefixCache | None = None,
    **options,
) -> Iterator[StepOutput]:
    """Decode with tree speculation, yielding the tokens each step commits.

    The output is what ``model`` alone produces: identical tokens under greedy decoding
    (``temperature=0``), the same distribution under sampling (temperature, top_k, top_p,
    min_p, applied at every tree node). Exactly the options given are applied: unlike
    ``model.generate(do_sample=True)``, nothing is taken from the model's generation
    config but the EOS id, and there is no implicit ``top_k=50``; pass ``top_k=50`` to
    sample as transformers does by default. See :func:`generate` for the arguments.
    ``seed`` is an int (request i uses ``seed + i``) or one seed per request: it fixes each
    request's tokens whatever the tree, drafter and batch, and ``stream`` gives what
    ``generate`` gives. Further options (``generation_config``, ``logits_processor``,
    ``repetition_penalty=...`` and the other GenerationConfig fields): see :func:`generate`.
    """
    run, max_new = _checked_run(model, draft, tree_cfg, input_ids, max_new_tokens, temperature, top_k, top_p, min_p,
                                seed, eos_token_id, attention_backend, auto_profile, generation_config,
                                logits_processor, tokenizer, allow_past_context, options, prefix_cache, page_size)
    output_scores = output_scores or bool(getattr(generation_config, "output_scores", False))
    yield from _loop(*run, max_new=max_new, page_size=page_size, auto_profile=auto_profile, output_scores=output_scores,
                     prefix_cache=prefix_cache)


def _checked_run(model, draft, tree_cfg, input_ids, max_new_tokens, temperature, top_k, top_p, min_p, seed,
                 eos_token_id, attention_backend, auto_profile, generation_config, logits_processor, tokenizer,
                 allow_past_context: bool, options: dict, prefix_cache=None, page_size: int = 16):
    """Every argument check of :func:`stream`, in the order a user meets them; returns what
    the loop runs on, ``(runner, drafter, cfg, prompts, decodings, eos)``, and the token budget."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    cfg = TreeConfig.preset(tree_cfg) if isinstance(tree_cfg, str) else tree_cfg
    if not isinstance(cfg, TreeConfig):
        raise ValueError(f"tree_cfg must be a TreeConfig or a preset name, got {type(tree_cfg).__name__}")
    drafter = _resolve_draft(draft)
    prompts, _ = _prompts(input_ids)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    options = dict(options)
    criteria = options.pop("stopping_criteria", None)
    max_new_tokens = _budget(model, prompts, max_new_tokens, generation_config, options)
    resolved = None
    if generation_config is not None:
        if not (isinstance(temperature, numbers.Real) and temperature == 0) or any(
                v is not None for v in (top_k, top_p, min_p)):
            raise ValueError("with generation_config, set do_sample, temperature, top_k, top_p and min_p in it")
        if eos_token_id is not None:  # as generate(generation_config=..., eos_token_id=...) takes it
            options["eos_token_id"] = eos_token_id
        resolved = resolve_generation_config(model, generation_config, **options)
        eos_token_id = resolved.eos_token_id
    eos = _eos_set(model, eos_token_id)
    decodings = _decodings(model, prompts, eos, max_new_tokens, temperature, top_k, top_p, min_p, seed, resolved,
                           logits_processor, criteria, tokenizer, options)
    if cfg.auto and len({d.greedy for d in decodings}) > 1:
        raise ValueError(
            "an auto tree calibrates greedy and sampled acceptance separately: give one batch one "
            "decoding mode (all temperatures 0 or all > 0), or use a fixed tree"
        )
    drafter.check_compatible(model)
    runner = ModelRunner(model, attention_backend, feature_layers=drafter.features_for(model))
    vocab = runner.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    _check_context(prompts, max_new_tokens, runner.max_positions, allow_past_context)
    if auto_profile is not None and not isinstance(auto_profile, AutoProfile):
        raise ValueError(f"auto_profile must be a treespec.AutoProfile, got {type(auto_profile).__name__}")
    if prefix_cache is not None:
        _check_prefix_cache(prefix_cache, model, drafter, runner, page_size)
    return (runner, drafter, cfg, prompts, decodings, eos), max_new_tokens


def _check_prefix_cache(cache, model, drafter: Drafter, runner: ModelRunner, page_size: int) -> None:
    """Binds ``cache`` to the model (a ValueError when it serves another); warns when the
    drafter makes its hits unusable."""
    if not isinstance(cache, PrefixCache):
        raise ValueError(f"prefix_cache must be a treespec.PrefixCache, got {type(cache).__name__}")
    cache.bind(model, page_size, runner.kv_layout())
    if runner.feature_layers and drafter.prefix_key(model) is None:
        warn(f"prefix_cache serves no hits with {type(drafter).__name__}: it reads the target's features and "
             "cannot start from a cached prefix (it defines no prefix_key), so every prompt is prefilled whole; "
             "requests are still filed")


def _prefix_use(cache: PrefixCache | None, runner: ModelRunner, drafter: Drafter) -> PrefixUse:
    """This generation's use of ``cache`` (None: hits of 0, nothing filed)."""
    if cache is None:
        return PrefixUse(None)
    key = drafter.prefix_key(runner.model)
    features = bool(runner.feature_layers)
    return PrefixUse(cache, key, lookup=key is not None or not features, features=features)


def _check_context(prompts: list[list[int]], max_new: int, max_pos: int | None, allow: bool) -> None:
    """A prompt longer than the model's positions is refused, and one whose answer may run past
    them warned of, unless ``allow``: the model was not trained there (the text degrades), and
    no tree is drafted past them (one token a step)."""
    if max_pos is None:
        return
    longest = max(len(p) for p in prompts)
    if allow:
        if longest + max_new > max_pos:
            log.info("allow_past_context: generating past the model's %d positions", max_pos)
        return
    if longest > max_pos:
        raise ValueError(f"a prompt of {longest} tokens is longer than the model's context of {max_pos} positions "
                         "(max_position_embeddings): shorten it, or pass allow_past_context=True to generate past "
                         "the context anyway (the output degrades there)")
    if longest + max_new > max_pos:
        warn(f"a prompt of {longest} tokens plus max_new_tokens={max_new} reaches past the model's context of "
             f"{max_pos} positions (max_position_embeddings): past it the output may degrade, and no tree is "
             "drafted (one token per step). Generating anyway; lower max_new_tokens to stay inside it, or pass "
             "allow_past_context=True to go past it without this warning")


class _AcceptanceWatch:
    """Warns once when the draft's first steps accept nothing at all: a head trained for
    another model of the same shapes runs losslessly but at tau 1.0, slower than the model
    alone, and would otherwise say nothing."""

    # Verify steps that drafted something, across the batch, before judging: the shipped head
    # met 8 straight steps of nothing on 2 of ~200 Spec-Bench questions (a text it could not
    # predict), while a head for another model accepts nothing on any text.
    STEPS = 16

    def __init__(self, drafter: Drafter):
        from .drafters.ngram import NgramDrafter

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


def _controller(runner: ModelRunner, drafter: Drafter, cfg: TreeConfig, greedy: bool, batch: int,
                max_nodes: int, profile: AutoProfile | None) -> AutoController | _NoAuto:
    """An :class:`AutoController` for an ``auto`` tree (its cost curve read or measured first),
    else the no-op one."""
    if not cfg.auto:
        return _NoAuto()
    profile = profile if profile is not None else AutoProfile.starting(drafter)
    # The batch's trees are verified in one forward: cover up to B trees (capped).
    profile.prepare(runner, min(batch * (max_nodes + 1), max(max_nodes + 1, 128)))
    return AutoController(profile, cfg.num_nodes, cfg.top_k, greedy, cfg.objective)


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

    def since(self, stage: str) -> float:
        """Seconds since ``stage`` last began."""
        return time.perf_counter() - self.began[stage]

    def total(self) -> SpecMetrics:
        self.metrics.total_seconds = self.since("start")
        return self.metrics


def _loop(runner: ModelRunner, drafter: Drafter, cfg: TreeConfig, prompts: list[list[int]],
          decodings: list[RequestDecoding], eos: set[int], *, max_new: int, page_size: int,
          auto_profile: AutoProfile | None = None, output_scores: bool = False,
          prefix_cache: PrefixCache | None = None) -> Iterator[StepOutput]:
    B = len(prompts)
    metrics = SpecMetrics(requests=[RequestMetrics(prompt_tokens=len(p)) for p in prompts])
    watch = _AcceptanceWatch(drafter)
    # Nodes per step: the tree's, plus what the drafter grafts on top (prompt lookup).
    max_nodes = cfg.num_nodes + drafter.extra_nodes
    with runner.attached(), contextlib.closing(_prefix_use(prefix_cache, runner, drafter)) as prefixes, \
            contextlib.ExitStack() as ends_with:  # the draft session's close, however the loop ends
        auto = _controller(runner, drafter, cfg, decodings[0].greedy, B, max_nodes, auto_profile)
        timer = _StepTimer(metrics)
        # One row of the cache per request, each long enough for the longest: a batch's K/V
        # are then read as a view of the cache, not gathered (PagedKVCache.add_sequences).
        cache, seqs = runner.new_rows_cache(B, max(len(p) for p in prompts) + max_new + max_nodes + 1, page_size)
        with timer("prefill"):
            first, features, scores = _prefill(runner, cache, seqs, prompts, decodings, output_scores, prefixes)
        ends = functools.partial(_first_end, decodings, eos)  # (b, history, new) -> index of the first end
        generated = [[t] for t in first]
        done = [ends(b, p, [t]) is not None or max_new == 1 for b, (p, t) in enumerate(zip(prompts, first))]
        sequences = [p + [t] for p, t in zip(prompts, first)]  # what the processors and stop strings read
        rules = [DraftRules.from_processors(d.processor.processors, s) for d, s in zip(decodings, sequences)]
        metrics.record_first_tokens(prefixes.hits, timer.total().total_seconds)
        yield StepOutput(0, [[t] for t in first], list(done), metrics, scores)
        with timer("draft"):
            session = drafter.start(runner.model, DraftStart(
                prompts=[list(p) for p in prompts], first_tokens=first, features=features, max_new_tokens=max_new,
                tree_cfg=cfg, stop=auto.stop, candidates=auto.candidates, rules=rules,
                prefix=prefixes.draft_prefixes()))
            ends_with.callback(session.close)  # what the drafter lent it (a CUDA-graphed row) goes back
            _finish([b for b in range(B) if done[b]], session, prefixes, cache, seqs, sequences)

        step = 0
        while not all(done):
            step += 1
            active = [b for b in range(B) if not done[b]]
            roots, prefix = [generated[b][-1] for b in active], [cache.seq_lens[seqs[b]] for b in active]
            depth, room = _budgets(active, prefix, generated, cache, seqs, max_new, runner.max_positions, max_nodes)
            with timer("draft"):
                trees = _draft(drafter, session, auto, timer, active, roots, depth, room, [rules[b] for b in active])
            with timer("verify"):
                out = _tree_forward(runner, cache, [seqs[b] for b in active], trees, prefix)
                verdicts, scores = _verify(trees, out.logits, [decodings[b] for b in active],
                                           [sequences[b] for b in active], output_scores)
                tokens, kept, scores = _commit(verdicts, out.features, active, cache, seqs, sequences, generated, done,
                                               ends, max_new, scores)
                prefixes.record(active, prefix, kept)
                auto.learn(trees, [v.path for v in verdicts])
                metrics.record_step(active, trees, tokens)
                watch.record(trees, sum(len(t) - 1 for t in tokens))
            with timer("draft"):
                session.commit(active, tokens, kept)
                _finish([b for b in active if done[b]], session, prefixes, cache, seqs, sequences)
            auto.end_step(sum(t.num_nodes for t in trees), timer.since("verify"))
            yield StepOutput(step, _by_request(tokens, active, B), list(done), timer.total(),
                             _by_request(scores, active, B, idle=lambda: torch.empty(0, runner.vocab_size)))
    timer.total()


def _prefill(runner: ModelRunner, cache, seqs: list[int], prompts: list[list[int]],
             decodings: list[RequestDecoding], keep_scores: bool, prefixes: PrefixUse):
    """Each prompt through the target, its K/V committed: first each prompt's prefix cache hit
    (``h_b`` tokens) is copied into its row, then the rest runs in one forward, its positions
    from ``h_b`` on. Returns each request's first token (picked from the prompt's last logits),
    the target features of the positions run (``[L_b - h_b, F]``, None when the drafter reads
    none) and, with ``keep_scores``, the processed logits the first tokens came from (``[1, V]``
    each; else None)."""
    hits = prefixes.load(cache, seqs, prompts)
    rest = [p[h:] for p, h in zip(prompts, hits)]
    out = runner.forward(
        cache, seqs, [torch.tensor(r) for r in rest], [torch.arange(h, h + len(r)) for r, h in zip(rest, hits)],
        [causal_mask(len(r)) for r in rest], logits_rows=[[len(r) - 1] for r in rest],
        capture=bool(runner.feature_layers),
    )
    for s, p, h in zip(seqs, prompts, hits):
        cache.commit(s, torch.arange(h, len(p)))
    prefixes.record(range(len(seqs)), hits, out.features)
    scores = [d.scores(p, logits) for d, p, logits in zip(decodings, prompts, out.logits)]
    first = [int(d.pick(x, len(p))[0]) for d, p, x in zip(decodings, prompts, scores)]
    return first, out.features, ([x.float() for x in scores] if keep_scores else None)


def _finish(requests: list[int], session, prefixes: PrefixUse, cache, seqs: list[int],
            sequences: list[list[int]]) -> None:
    """Requests that ended: filed in the prefix cache (their committed pages, with the
    drafter's rows), then their draft state and K/V let go."""
    for b in requests:
        prefixes.file(b, cache, seqs[b], sequences[b], functools.partial(session.prefix_state, b))
        session.finish(b)
        cache.free_sequence(seqs[b])


def _budgets(active: list[int], prefix: list[int], generated: list[list[int]], cache, seqs: list[int],
             max_new: int, max_pos: int | None, max_nodes: int) -> tuple[list[int], list[int]]:
    """Per active request, the deepest node and the most nodes worth drafting: committing
    depth+1 tokens must fit the token budget, positions must stay below the model's maximum,
    and the nodes must fit the tree size and the KV room left."""
    depths, nodes = [], []
    for b, L in zip(active, prefix):
        d = max_new - len(generated[b]) - 1
        if max_pos is not None:
            d = min(d, max_pos - 1 - L)
        depths.append(max(d, 0))
        nodes.append(min(max_nodes, cache.capacity(seqs[b]) - L - 1))
    return depths, nodes


def _draft(drafter: Drafter, session, auto, timer: _StepTimer, active: list[int], roots: list[int],
           max_depth: list[int], max_nodes: list[int], rules: list[DraftRules | None]) -> list[Tree]:
    """This step's trees: proposed, rid of nodes the options forbid (``rules``), cut to each
    request's budget, then sized (``auto``)."""
    auto.begin_step()
    trees = session.propose(active, roots, max_depth)
    propose_seconds = timer.since("draft")
    trees = [t if r is None else r.prune(t) for t, r in zip(trees, rules)]
    trees = [t.prune(max_depth=d, max_nodes=n) for t, d, n in zip(trees, max_depth, max_nodes)]
    trees = auto.choose(trees, propose_seconds)
    for t, root in zip(trees, roots):
        if t.tokens is None or int(t.tokens[0]) != root:
            raise RuntimeError(f"{type(drafter).__name__} proposed a tree whose root is not the last committed token")
    return trees


def _tree_forward(runner: ModelRunner, cache, seqs: list[int], trees: list[Tree], prefix: list[int]):
    """The target's logits (and features) at every node of every request's tree, in one
    forward over the committed prefixes."""
    return runner.forward(
        cache, seqs, [t.tokens for t in trees], [t.position_ids(L) for t, L in zip(trees, prefix)],
        [t.attention_mask() for t in trees], capture=bool(runner.feature_layers),
    )


def _commit(verdicts: list[Verdict], features: list[torch.Tensor] | None, active: list[int], cache,
            seqs: list[int], sequences: list[list[int]], generated: list[list[int]], done: list[bool],
            ends, max_new: int, node_scores: list[torch.Tensor] | None = None):
    """Keep each verdict's tokens up to the budget and the first end (``ends(b, history, new)``:
    the index of the first ending token, or None), commit the K/V of
    the root and accepted nodes they came from, and mark the requests that ended. Returns the
    tokens per active request; when ``features`` were captured, each one's features at those
    nodes (``[len(tokens_i), F]``, for the drafter), else None; and with ``node_scores`` (the
    processed logits at every node), those at the same nodes, else None. ``sequences``: each
    request's prompt and output so far, extended here."""
    tokens, kept, scores = [], [], []
    for i, (b, v) in enumerate(zip(active, verdicts)):
        toks = v.tokens[: max_new - len(generated[b])]
        hit = ends(b, sequences[b], toks)
        if hit is not None:
            toks = toks[: hit + 1]
        path = torch.tensor(v.path[: len(toks)])  # the root and the accepted nodes whose KV is kept
        cache.commit(seqs[b], cache.seq_lens[seqs[b]] + path)
        generated[b].extend(toks)
        sequences[b].extend(toks)
        done[b] = hit is not None or len(generated[b]) >= max_new
        tokens.append(toks)
        if features is not None:
            kept.append(features[i][path])
        if node_scores is not None:
            scores.append(node_scores[i][path].float())
    return tokens, (kept if features is not None else None), (scores if node_scores is not None else None)


def _first_end(decodings: Sequence[RequestDecoding], eos: set[int], b: int, history: list[int],
               new: list[int]) -> int | None:
    """Index in ``new`` (tokens after ``history``) of the first that ends request ``b``: an EOS, or
    the token that completes a stop string (the sequence is built only when there are some)."""
    decoding = decodings[b]
    for j, t in enumerate(new):
        if t in eos or (decoding.stop is not None and decoding.stops(history + new[: j + 1])):
            return j
    return None


def _by_request(values: list | None, active: list[int], batch: int, idle=list) -> list | None:
    """The active requests' values spread over the whole batch (an idle request's: ``idle()``)."""
    if values is None:
        return None
    out = [idle() for _ in range(batch)]
    for b, t in zip(active, values):
        out[b] = t
    return out


def _verify(trees: list[Tree], logits: list[torch.Tensor], decodings: Sequence[RequestDecoding],
            histories: Sequence[list[int]], keep_scores: bool = False):
    """The verification stage: each request's verdict on its tree. The target's choice at each
    node (its argmax, or its sample at that position, after the request's processors with the
    node's own history) decides; a child is accepted exactly when it carries its parent's
    choice, so greedy and sampled requests share one rule (treespec.processing).

    Args:
        trees:     one per active request, ``n_b`` nodes.
        logits:    float ``[n_b, V]`` per request: the target's logits at each node of its tree.
        decodings: each request's processors and seed.
        histories: each request's committed tokens, the tree's root last.
        keep_scores: also return each request's processed logits at every node (``[n_b, V]``).
    Returns:
        the verdicts, and the processed logits (None without ``keep_scores``).
    """
    n = max(t.num_nodes for t in trees)
    choice = torch.zeros(len(trees), n, dtype=torch.int64, device=logits[0].device)
    kept = [] if keep_scores else None
    for i, (t, l, d, h) in enumerate(zip(trees, logits, decodings, histories)):
        # Processing costs per node, and on a CPU so does a plain argmax: the path's alone. (On
        # a GPU one argmax over the tree is cheaper than a host sync per node of the path.)
        if kept is None and (d.processor or not d.greedy or l.device.type == "cpu"):
            choice[i, : l.shape[0]] = d.walk(h, l, t)
            continue
        scores = d.scores(h, l, t)
        choice[i, : l.shape[0]] = d.pick(scores, len(h), t)
        if kept is not None:
            kept.append(scores)
    return verify_greedy(trees, choice), kept


def generate(
    model,
    draft,
    tree_cfg,
    input_ids,
    *,
    max_new_tokens: int | None = None,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_backend: str = "auto",
    auto_profile=None,
    generation_config=None,
    logits_processor=None,
    tokenizer=None,
    output_scores: bool = False,
    allow_past_context: bool = False,
    prefix_cache: PrefixCache | None = None,
    **options,
) -> GenerateOutput:
    """Generate with tree speculation; same output as ``model`` alone.

    Args:
        model:      a transformers causal LM (llama, qwen2, qwen3, mistral families), used as
                    is; its attention implementation is restored before this returns.
        draft:      a :class:`~treespec.drafters.base.Drafter` (``ModelDrafter``,
                    ``NgramDrafter``, ``EagleDrafter``, ``Eagle3Drafter``), ``"ngram"`` or ``"none"``
                    (no speculation: autoregressive decoding through treespec's runner).
        tree_cfg:   a :class:`TreeConfig` or a preset name (``treespec.PRESETS``).
        input_ids:  one prompt (1-D tensor or list of ints) or a list of prompts of any lengths.
        max_new_tokens: per request (default: with a ``generation_config``, its or the model's
                    generation config's; else ``max_length``, the keyword or theirs, less the
                    longest prompt; else 128); EOS (``eos_token_id``, else the generation
                    config's or the model's) ends a request early and is kept.
        temperature, top_k, top_p, min_p: sampling (``temperature=0`` is greedy).
                    ``temperature`` may give one value per request (0: that request is
                    greedy; top_k/top_p/min_p apply to the sampled ones), as a batch of
                    greedy and sampled answers does (``treespec capture``); not with an
                    ``auto`` tree, which calibrates the two modes apart.
        seed:       int (request i uses ``seed + i``) or one per request. It fixes the sampled
                    output whatever the tree, the drafter, ``auto``'s choices and the batch
                    (on one machine, dtype and thread count): each position's sample is drawn
                    by the Gumbel-max trick with noise keyed by (seed, position). None: seeds
                    drawn from torch's global generator (``torch.manual_seed`` repeats a run).
        attention_backend: ``"auto"`` (FlashInfer on CUDA when installed, else torch),
                    ``"torch"``, ``"flex"`` (PyTorch's flex_attention) or ``"flashinfer"``.
        auto_profile: for an ``auto`` tree (``"auto"``, ``TreeConfig.auto(...)``): the
                    :class:`~treespec.auto.AutoProfile` (cost curve and calibrations) to decide
                    from and keep learning into; pass the same one to later calls to reuse
                    what it learned. None: a fresh one, its cost curve from the disk cache or
                    measured (a few seconds, once per machine and model), its calibrations
                    the draft's own (a head directory's ``auto-profile.json``) or else the
                    prior. Ignored otherwise.
        generation_config: a transformers ``GenerationConfig``, read as ``model.generate`` reads
                    it (the model's generation config and transformers' defaults under it, so
                    ``do_sample=True`` brings ``top_k=50``); then give no temperature/top_k/
                    top_p/min_p here. Every processor transformers builds from it runs at every
                    tree node with that node's own history (docs/generation.md).
        logits_processor: a ``LogitsProcessorList`` of your own, run after transformers' at
                    every node; each must be a pure function of ``(input_ids, scores)``: it is
                    called on candidate histories that may never be committed, one reached node
                    at a time during verification (the root, then each accepted node), or once
                    per tree depth on a batch of them when ``output_scores`` asks for every node.
        tokenizer:  for ``stop_strings`` (transformers needs it too).
        output_scores: also return, per request, the processed logits each generated token
                    was chosen from (``GenerateOutput.scores``, float ``[T, V]``; per step in
                    :func:`stream`), as ``generate(output_scores=True)`` gives them.
        allow_past_context: a prompt longer than the model's context (``max_position_embeddings``)
                    raises a ValueError, and one whose answer may run past it warns
                    (:class:`~treespec.warn.TreespecWarning`); True generates past it silently
                    (the model was not trained there: the text degrades).
        prefix_cache: a :class:`~treespec.PrefixCache` kept across calls: each prompt's longest
                    cached prefix (whole pages, one token short of the prompt at least) is
                    copied instead of recomputed, for the target and the drafter, and each
                    request's prompt and output are filed when it ends. The output is the same
                    with or without it; ``RequestMetrics.hit_tokens`` counts what it served
                    (docs/runtime.md, "Prefix caching").
        **options:  fields of ``GenerationConfig`` (``repetition_penalty=1.1``,
                    ``no_repeat_ngram_size=4``, ``min_new_tokens``, ``bad_words_ids``,
                    ``sequence_bias``, ``suppress_tokens``, ``typical_p``, ``max_time``, ...):
                    exactly those given, as the sampling arguments are; and
                    ``stopping_criteria``, transformers ``StoppingCriteria`` asked after every
                    committed token with ``scores=None`` (``max_time`` counts from the call, set-up
                    included). Options that cannot be exact on trees (beam search, guidance, ...)
                    raise a ValueError that names them.
    Returns:
        :class:`GenerateOutput` with ``sequences`` and ``metrics``.
    """
    # long: the docstring is the argument reference of the library's main call; the code is ten lines
    prompts, _ = _prompts(input_ids)
    seqs = [[] for _ in prompts]
    scores = [[] for _ in prompts]
    metrics = None
    for out in stream(
        model, draft, tree_cfg, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, eos_token_id=eos_token_id,
        attention_backend=attention_backend, auto_profile=auto_profile, generation_config=generation_config,
        logits_processor=logits_processor, tokenizer=tokenizer, output_scores=output_scores,
        allow_past_context=allow_past_context, prefix_cache=prefix_cache, **options,
    ):
        for s, t in zip(seqs, out.tokens):
            s.extend(t)
        for s, x in zip(scores, out.scores or []):
            s.append(x)
        metrics = out.metrics
    return GenerateOutput(seqs, metrics, [torch.cat(x) for x in scores] if any(scores) else None)
