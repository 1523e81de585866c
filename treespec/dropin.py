"""treespec inside ``model.generate``: transformers' entry for custom decoding methods.

    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=128, repetition_penalty=1.1,
                         custom_generate=treespec.custom_generate(draft, "auto"))

transformers resolves the GenerationConfig, builds the logits processors and stopping
criteria for the (left-padded) batch, then hands them to the callable given as
``custom_generate`` in place of its own decoding loop. This module's callable decodes with
tree speculation and returns what ``generate`` returns: the padded batch with the new
tokens appended, right-padded with ``pad_token_id`` where a row ended early.

Exact, as ``generate`` is: each row is decoded as its prompt alone, with transformers' own
processors built from the same GenerationConfig, at every tree node with the node's own
history; greedy rows equal plain ``generate``'s, sampled rows follow its distribution
(treespec's Gumbel-max sampling: ``torch.manual_seed`` before the call fixes them, whatever
the tree or drafter). Where plain ``generate`` lets the left padding count (``min_length``
counts it as length, ``no_repeat_ngram_size`` sees n-grams of pad tokens), a padded row here
follows its prompt alone.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from transformers.generation.logits_process import LogitsProcessorList, PrefixConstrainedLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .accept import RequestDecoding
from .engine import loop
from .engine.options import GenerationOptions
from .engine.request import describe_run, request_seeds
from .processing import NodeProcessor, check_generation_config, row_config

__all__ = ["custom_generate"]

# What plain generate can return that treespec does not compute: refused, not ignored.
_NOT_RETURNED = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def custom_generate(draft, tree_cfg="auto", *, attention_backend: str = "auto", auto_profile=None) -> Callable:
    """A decoding method for ``model.generate(..., custom_generate=...)`` that speculates with
    ``draft`` (a treespec Drafter, ``"ngram"`` or ``"none"``) over ``tree_cfg`` trees."""

    def decode(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
               synced_gpus: bool = False, streamer=None, **model_kwargs):
        gc = generation_config
        # beam search and the rest that cannot be exact: refused, as treespec.generate does
        check_generation_config(model, gc)
        for name in _NOT_RETURNED:
            if getattr(gc, name, False):
                raise ValueError(f"{name}=True: treespec's decoding returns sequences only")
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask
        pads = [int(n) for n in (mask == 0).sum(-1)]
        rows = input_ids.tolist()
        if any(m != [0] * p + [1] * (len(m) - p) for m, p in zip(mask.tolist(), pads)):
            raise ValueError("custom_generate needs left padding (padding_side='left'), as decoder-only generate does")
        prompts = [r[p:] for r, p in zip(rows, pads)]
        width = input_ids.shape[1]
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - width
        run = describe_run(model, draft, tree_cfg, prompts, GenerationOptions(
            max_new_tokens=max_new, eos_token_id=gc.eos_token_id, attention_backend=attention_backend,
            auto_profile=auto_profile), {})
        prompts, max_new = run.prompts, run.max_new_tokens
        seeds = request_seeds(None, len(prompts)) if gc.do_sample else [None] * len(prompts)
        # The processors transformers built hold this batch's shape (a minimum length counts the
        # padding): each of its own is rebuilt per row from the same config, in its place.
        own = model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=width, encoder_input_ids=input_ids,
            prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=input_ids.device,
            model_kwargs=model_kwargs)
        slots = _config_slots(logits_processor, own)
        if len(prompts) > 1 and any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor):
            raise ValueError("prefix_allowed_tokens_fn is called with each row's batch index: custom_generate "
                             "decodes row by row, so give it one prompt at a time")
        # The budget and the config's EOS end rows in the loop; every other criterion (stop
        # strings, max_time, the user's) is asked after each committed token, on the row with
        # its padding, as generate asks it.
        asked = StoppingCriteriaList(c for c in stopping_criteria if not _config_ends(c, gc))
        decodings = []
        for b, (p, s) in enumerate(zip(prompts, seeds)):
            # (generate set max_length and min_length from the padded width)
            procs = _row_processors(model, row_config(gc, len(p), max_new), len(p), logits_processor, slots, own)
            stop = _PaddedRow(asked, input_ids[b: b + 1, : pads[b]]) if asked else None
            decodings.append(RequestDecoding(NodeProcessor.of(procs), s, stop))
        if streamer is not None:  # transformers 5 hands the callable none (docs/generation.md); a caller may
            streamer.put(input_ids.cpu())
        new = [[] for _ in prompts]
        for out in loop.decode(dataclasses.replace(run, decodings=tuple(decodings))):
            for n, t in zip(new, out.tokens):
                n.extend(t)
            if streamer is not None and out.tokens[0]:
                streamer.put(torch.tensor(out.tokens[0]))
        if streamer is not None:
            streamer.end()
        return _appended(input_ids, new, gc)

    return decode


def _appended(input_ids: torch.Tensor, new: list[list[int]], config):
    """What ``generate`` returns: the padded batch with each row's ``new`` tokens appended,
    right-padded with the config's pad id (0 without one) where a row ended early."""
    pad = config._pad_token_tensor
    pad = int(pad) if pad is not None else 0
    longest = max(map(len, new))
    tail = torch.tensor([n + [pad] * (longest - len(n)) for n in new], dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, tail.to(input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _config_slots(merged, own) -> list[int | None]:
    """For each processor of ``merged`` (what ``generate`` built, the user's merged in), the
    index of the one of ``own`` (built from the config alone) it equals, or None: the user's.
    A user's processor that replaced one of the config's (transformers' merge) is kept as the
    user's unless it is parameterised as the config's, and then either serves."""
    used: set[int] = set()
    slots = []
    for m in merged:
        i = next((i for i, o in enumerate(own) if i not in used and type(m) is type(o) and _same(m, o)), None)
        if i is not None:
            used.add(i)
        slots.append(i)
    return slots


def _row_processors(model, row_cfg, prompt_len: int, merged, slots, own) -> LogitsProcessorList:
    """``merged`` for one row: each of the config's processors rebuilt from ``row_cfg`` for the
    row alone, the user's as given, in ``merged``'s order."""
    row_own = model._get_logits_processor(
        generation_config=row_cfg, input_ids_seq_length=prompt_len, encoder_input_ids=None,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(),
        device=str(next(model.parameters()).device), model_kwargs={})
    if [type(p) for p in row_own] != [type(p) for p in own]:  # the row's config adds or drops none of them
        raise RuntimeError(f"custom_generate: a row's processors {[type(p).__name__ for p in row_own]} are not "
                           f"the batch's {[type(p).__name__ for p in own]}")
    return LogitsProcessorList(m if i is None else row_own[i] for m, i in zip(merged, slots))


def _config_ends(criterion, config) -> bool:
    """Whether ``criterion`` is one ``generate`` built from ``config`` for what treespec's loop
    ends a row on by itself: the token budget (``max_length``) or the config's EOS."""
    if type(criterion) is MaxLengthCriteria:
        return criterion.max_length == config.max_length
    if type(criterion) is EosTokenCriteria and config._eos_token_tensor is not None:
        mine = criterion.eos_token_id
        return torch.equal(mine.reshape(-1).cpu(), config._eos_token_tensor.reshape(-1).cpu())
    return False


class _PaddedRow:
    """A batch row's stopping criteria, asked on the row with its left padding (int64
    ``[1, pads]``) in front, as ``generate`` asks them of the padded batch."""

    def __init__(self, criteria: StoppingCriteriaList, padding: torch.Tensor):
        self.criteria, self.padding = criteria, padding

    def __call__(self, input_ids: torch.Tensor, scores) -> torch.Tensor:
        return self.criteria(torch.cat([self.padding, input_ids.to(self.padding)], dim=1), scores)


def _same(a, b) -> bool:
    """Whether two processors of one type hold equal parameters (tensors compared by value)."""
    va, vb = vars(a), vars(b)
    if va.keys() != vb.keys():
        return False
    for k, x in va.items():
        y = vb[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and torch.equal(x.cpu(), y.cpu())):
                return False
            continue
        try:
            if not bool(x == y):
                return False
        except (TypeError, ValueError, RuntimeError):  # values with no plain equality
            return False
    return True
