"""One call of ``stream``, checked and resolved into a :class:`Run`: the prompts as token
lists, the token budget, each request's decoding (processors, seed, stopping criteria), the
drafter, the runner and the constants of the loop.

:func:`describe_run` makes every argument check, in the order a user meets them; the loop
(``engine/loop.py``) takes the :class:`Run` and checks nothing.
"""

from __future__ import annotations

import logging
import numbers
import operator
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (MaxTimeCriteria, StoppingCriteria, StoppingCriteriaList,
                                                       StopStringCriteria)

from ..accept import RequestDecoding
from ..auto import AutoProfile
from ..config import TreeConfig
from ..drafters.base import Drafter
from ..prefix_cache import PrefixCache
from ..processing import NodeProcessor, exact_generation_config, resolve_generation_config, row_config
from ..runner import ModelRunner
from ..sampling_args import SamplingParams
from ..warn import warn
from .options import GenerationOptions

__all__ = ["Run", "describe_run", "read_prompts", "eos_set", "resolve_draft", "request_seeds"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """What the loop runs on: one call of ``stream``, checked.

    Attributes:
        runner:         the target, attached to treespec's attention while the loop runs.
        drafter:        who proposes the trees.
        tree_cfg:       the tree configuration (a preset name resolved).
        prompts:        each request's prompt, token ids.
        decodings:      each request's processors, seed and stopping criteria.
        eos:            the token ids that end a request (kept in its output).
        max_new_tokens: each request's token budget.
        page_size:      tokens per page of the paged KV cache.
        auto_profile:   an ``auto`` tree's profile (None: a fresh one; ignored for fixed trees).
        output_scores:  whether each step returns the processed logits of its tokens.
        prefix_cache:   the prefix cache served from and filed into, or None.
    """

    runner: ModelRunner
    drafter: Drafter
    tree_cfg: TreeConfig
    prompts: tuple[list[int], ...]
    decodings: tuple[RequestDecoding, ...]
    eos: frozenset[int]
    max_new_tokens: int
    page_size: int = 16
    auto_profile: AutoProfile | None = None
    output_scores: bool = False
    prefix_cache: PrefixCache | None = None


def describe_run(model, draft, tree_cfg, input_ids, options: GenerationOptions, fields: dict) -> Run:
    """Every argument check of ``stream``, in the order a user meets them, and what the loop
    runs on. ``fields``: the keywords that are ``GenerationConfig`` fields
    (:meth:`GenerationOptions.split`)."""
    o = options
    if o.generation_config is not None and not isinstance(o.generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got "
                         f"{type(o.generation_config).__name__}")
    cfg = TreeConfig.preset(tree_cfg) if isinstance(tree_cfg, str) else tree_cfg
    if not isinstance(cfg, TreeConfig):
        raise ValueError(f"tree_cfg must be a TreeConfig or a preset name, got {type(tree_cfg).__name__}")
    drafter = resolve_draft(draft)
    prompts, _ = read_prompts(input_ids)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    fields = dict(fields)
    max_new_tokens = resolve_max_new_tokens(model, prompts, o.max_new_tokens, o.generation_config, fields)
    resolved, eos_token_id = None, o.eos_token_id
    if o.generation_config is not None:
        if not (isinstance(o.temperature, numbers.Real) and o.temperature == 0) or any(
                v is not None for v in (o.top_k, o.top_p, o.min_p)):
            raise ValueError("with generation_config, set do_sample, temperature, top_k, top_p and min_p in it")
        if eos_token_id is not None:  # as generate(generation_config=..., eos_token_id=...) takes it
            fields["eos_token_id"] = eos_token_id
        resolved = resolve_generation_config(model, o.generation_config, **fields)
        eos_token_id = resolved.eos_token_id
    eos = eos_set(model, eos_token_id)
    decodings = _decodings(model, prompts, eos, max_new_tokens, o, resolved, fields)
    if cfg.auto and len({d.greedy for d in decodings}) > 1:
        raise ValueError(
            "an auto tree calibrates greedy and sampled acceptance separately: give one batch one "
            "decoding mode (all temperatures 0 or all > 0), or use a fixed tree"
        )
    drafter.check_compatible(model)
    runner = ModelRunner(model, o.attention_backend, feature_layers=drafter.features_for(model),
                         fixed_shapes=o.fixed_shapes)
    vocab = runner.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    _check_context(prompts, max_new_tokens, runner.max_positions, o.allow_past_context)
    if o.auto_profile is not None and not isinstance(o.auto_profile, AutoProfile):
        raise ValueError(f"auto_profile must be a treespec.AutoProfile, got {type(o.auto_profile).__name__}")
    if o.prefix_cache is not None:
        _check_prefix_cache(o.prefix_cache, model, drafter, runner, o.page_size)
    output_scores = o.output_scores or bool(getattr(o.generation_config, "output_scores", False))
    return Run(runner, drafter, cfg, tuple(prompts), tuple(decodings), frozenset(eos), max_new_tokens, o.page_size,
               o.auto_profile, output_scores, o.prefix_cache)


_TEXT_NOT_IDS = ("input_ids must be token ids, not text: tokenize the text first, e.g. "
                 "tokenizer(text)['input_ids'] or tokenizer.apply_chat_template(messages, add_generation_prompt=True)")


def read_prompts(input_ids) -> tuple[list[list[int]], bool]:
    """``input_ids`` as token lists, one per prompt, and whether it was one prompt (not a
    batch): a list of ints, a 1-D or 2-D tensor or array, a tokenizer's ``BatchEncoding`` (its
    attention mask drops the padding), or a list of any of these."""
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
        return read_prompts(ids)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] > 1:
            return [_one_prompt(r) for r in input_ids], False
        return [_one_prompt(input_ids)], True
    if isinstance(input_ids, (str, bytes)):
        raise ValueError(_TEXT_NOT_IDS)
    if not isinstance(input_ids, (list, tuple)) or len(input_ids) == 0:
        raise ValueError("input_ids must be a non-empty list of ints, a 1-D tensor, or a list of those")
    if any(isinstance(t, (str, bytes)) for t in input_ids):
        raise ValueError(_TEXT_NOT_IDS)
    if not any(isinstance(t, (list, tuple, Mapping)) or (isinstance(t, (torch.Tensor, np.ndarray)) and t.ndim > 0)
               for t in input_ids):
        # One prompt of scalars; _one_prompt() names an entry that is not a token id.
        if not input_ids:
            raise ValueError("input_ids is empty")
        return [_one_prompt(input_ids)], True
    return [_one_prompt(p) for p in input_ids], False


def _one_prompt(x) -> list[int]:
    """One prompt's token ids, from any form :func:`read_prompts` takes for one."""
    if isinstance(x, (str, bytes)):
        raise ValueError(_TEXT_NOT_IDS)
    if isinstance(x, Mapping):
        rows = read_prompts(x)[0]
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


def _is_batch(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() == 2
    return isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], (list, tuple, torch.Tensor))


def _rows(x) -> list[list[int]]:
    """Token rows of a 1-D/2-D tensor or (nested) list."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return [list(r) for r in x] if _is_batch(x) else [list(x)]


def resolve_max_new_tokens(model, prompts: list[list[int]], max_new_tokens, generation_config, fields: dict) -> int:
    """New tokens per request, as ``model.generate`` counts them: ``max_new_tokens`` (the
    argument, else a generation config's), else ``max_length`` less the longest prompt (the
    width of the padded batch ``generate`` would see), else 128. The generation configs (the
    user's, then the model's) count only with a ``generation_config``, as for every option."""
    if max_new_tokens is None:
        sources = [fields] + ([generation_config.to_dict(), model.generation_config.to_dict()]
                               if generation_config is not None else [])

        def first(name):  # ``fields`` holds no max_new_tokens: it is an argument of its own
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


def eos_set(model, eos_token_id) -> set[int]:
    """The ids that end a request: ``eos_token_id`` (an int or several), else the model's generation config's."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _decodings(model, prompts: list[list[int]], eos: set[int], max_new: int, options: GenerationOptions,
               resolved: GenerationConfig | None, fields: dict) -> list[RequestDecoding]:
    """Each request's processors, stopping criteria and seed, from treespec's options and the
    ``GenerationConfig`` ``fields`` given (exactly those) or from a ``resolved`` generation
    config (transformers' semantics: :func:`resolve_generation_config`)."""
    n, o = len(prompts), options
    if resolved is not None:
        configs = [resolved] * n
    else:
        for name in ("do_sample", "attention_mask"):
            if name in fields:
                raise ValueError(f"{name} is not an option of treespec.generate: "
                                 + ("temperature > 0 samples" if name == "do_sample" else
                                    "give the prompts unpadded, as a list of token lists"))
        params = _sampling_params(o.temperature, o.top_k, o.top_p, o.min_p, n)
        by_params = {}
        for p in set(params):
            warpers = {} if p.greedy else dict(do_sample=True, temperature=float(p.temperature), top_k=p.top_k or 0,
                                               top_p=1.0 if p.top_p is None else p.top_p, min_p=p.min_p)
            by_params[p] = exact_generation_config(model, eos_token_id=sorted(eos) or None, **warpers, **fields)
        configs = [by_params[p] for p in params]
    seeds = request_seeds(o.seed, n)
    stop = _stopping(configs[0], o.stopping_criteria, o.tokenizer)
    out = []
    for c, p, s in zip(configs, prompts, seeds):
        c = row_config(c, len(p), max_new)
        out.append(RequestDecoding(NodeProcessor.build(model, c, len(p), o.logits_processor),
                                   s if c.do_sample else None, stop))
    return out


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


def request_seeds(seed, n: int) -> list[int]:
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


def resolve_draft(draft) -> Drafter:
    """``draft`` as a Drafter: one given, or the one a name stands for."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str) and draft == "ngram":
        from ..drafters.ngram import NgramDrafter

        return NgramDrafter()
    if isinstance(draft, str) and draft == "none":
        from ..drafters.none import NoDrafter

        return NoDrafter()
    got = repr(draft) if isinstance(draft, str) else type(draft).__name__
    raise ValueError(
        f"draft must be a treespec Drafter (ModelDrafter, NgramDrafter, EagleDrafter, ...), "
        f"'ngram' or 'none', got {got}"
    )


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
