"""The options of :func:`~treespec.stream` and :func:`~treespec.generate`, declared once.

Both take ``(model, draft, tree_cfg, input_ids, **options)``: each field of
:class:`GenerationOptions` is a keyword of both, with its default and its doc below; any other
keyword is a field of transformers' ``GenerationConfig`` (``repetition_penalty=1.1``, ...), and
a name that is neither is a TypeError that names it and lists the valid ones. The two functions'
signatures (``inspect.signature``, ``help``) and the argument part of their docstrings are made
from these fields (:func:`declares_options`).
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Sequence

from transformers import GenerationConfig

from ..processing import ELSEWHERE

__all__ = ["GenerationOptions", "declares_options"]


def _option(default, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class GenerationOptions:
    """treespec's own options of ``stream`` and ``generate``; each field's ``metadata["doc"]``
    is its documentation."""

    max_new_tokens: int | None = _option(None, """
        per request (default: with a ``generation_config``, its or the model's generation
        config's; else ``max_length``, the keyword or theirs, less the longest prompt; else 128);
        EOS (``eos_token_id``, else the generation config's or the model's) ends a request early
        and is kept.""")
    temperature: float | Sequence[float] = _option(0.0, """
        sampling temperature (``temperature=0`` is greedy). One value per request is allowed
        (0: that request is greedy; top_k/top_p/min_p apply to the sampled ones), as a batch
        of greedy and sampled answers does (``treespec capture``); not with an ``auto`` tree,
        which calibrates the two modes apart.""")
    top_k: int | None = _option(None, "sampling: keep the k most probable tokens.")
    top_p: float | None = _option(None, "sampling: keep the smallest set of tokens holding this much probability.")
    min_p: float | None = _option(None, "sampling: drop tokens below this fraction of the most probable one's.")
    seed: int | Sequence[int] | None = _option(None, """
        int (request i uses ``seed + i``) or one per request. It fixes the sampled output
        whatever the tree, the drafter, ``auto``'s choices and the batch (on one machine, dtype
        and thread count): each position's sample is drawn by the Gumbel-max trick with noise
        keyed by (seed, position). None: seeds drawn from torch's global generator
        (``torch.manual_seed`` repeats a run).""")
    eos_token_id: int | Sequence[int] | None = _option(None, """
        the token(s) that end a request (kept in the output); default the generation config's
        or the model's.""")
    attention_backend: str = _option("auto", """
        ``"auto"`` (FlashInfer on CUDA when installed and the model is fp16/bf16 with a head size of
        64, 128 or 256, else torch), ``"torch"``, ``"split"`` (the prefix without a mask, the tree
        block masked, merged by log-sum-exp), ``"flex"`` (PyTorch's flex_attention) or
        ``"flashinfer"``.""")
    page_size: int = _option(16, """
        tokens per page of the paged KV cache; a ``prefix_cache`` keeps the page size of its
        first use (another is a ValueError).""")
    auto_profile: object = _option(None, """
        for an ``auto`` tree (``"auto"``, ``TreeConfig.auto(...)``): the
        :class:`~treespec.auto.AutoProfile` (cost curve and calibrations) to decide from and
        keep learning into; pass the same one to later calls to reuse what it learned. None: a
        fresh one, its cost curve from the disk cache or measured (a few seconds, once per
        machine and model), its calibrations the draft's own (a head directory's
        ``auto-profile.json``) or else the prior. Ignored otherwise.""")
    generation_config: GenerationConfig | None = _option(None, """
        a transformers ``GenerationConfig``, read as ``model.generate`` reads it (the model's
        generation config and transformers' defaults under it, so ``do_sample=True`` brings
        ``top_k=50``); then give no temperature/top_k/top_p/min_p here. Every processor
        transformers builds from it runs at every tree node with that node's own history
        (docs/generation.md).""")
    logits_processor: object = _option(None, """
        a ``LogitsProcessorList`` of your own, run after transformers' at every node; each must
        be a pure function of ``(input_ids, scores)``: it is called on candidate histories that
        may never be committed, one reached node at a time during verification (the root, then
        each accepted node), or once per tree depth on a batch of them when ``output_scores``
        asks for every node.""")
    stopping_criteria: object = _option(None, """
        transformers ``StoppingCriteria``, asked after every committed token with
        ``scores=None`` (``max_time`` likewise, counted from the call, set-up included).""")
    tokenizer: object = _option(None, "for ``stop_strings`` (transformers needs it too).")
    output_scores: bool = _option(False, """
        also return, per request, the processed logits each generated token was chosen from
        (``GenerateOutput.scores``, float ``[T, V]``; per step in ``StepOutput.scores``), as
        ``generate(output_scores=True)`` gives them.""")
    allow_past_context: bool = _option(False, """
        a prompt longer than the model's context (``max_position_embeddings``) raises a
        ValueError, and one whose answer may run past it warns
        (:class:`~treespec.warn.TreespecWarning`); True generates past it silently (the model
        was not trained there: the text degrades).""")
    prefix_cache: object = _option(None, """
        a :class:`~treespec.PrefixCache` kept across calls: each prompt's longest cached prefix
        (whole pages, one token short of the prompt at least) is copied instead of recomputed,
        for the target and the drafter, and each request's prompt and output are filed when it
        ends. The output is the same with or without it; ``RequestMetrics.hit_tokens`` counts
        what it served (docs/runtime.md, "Prefix caching").""")
    fixed_shapes: bool | str = _option(False, """
        the verify forward on fixed shapes: each step's trees padded to a bucket of 1, 4, 8, 16,
        32 or 64 tokens, read from buffers that live as long as the request's cache row, each layer
        attending over the row's whole length (docs/runtime.md, "Fixed-shape verify");
        ``"compile"``: the same through ``torch.compile``, once per bucket and row length, every
        bucket the tree can take compiled before the prefill (seconds to minutes each; the
        seconds in ``metrics.compile_seconds``); ``"graphs"`` (the model on a CUDA device): the
        same captured in a CUDA graph a bucket before the prefill and replayed, the graphs kept
        for the model's later calls. The tokens are those of the default, False (each step's own
        shapes, up to rounding near-ties in bf16).""")

    @classmethod
    def split(cls, caller: str, keywords: dict) -> tuple["GenerationOptions", dict]:
        """``keywords`` as ``(treespec's options, GenerationConfig fields)``; TypeError on a
        name that is neither (names another library uses, and ``do_sample``/``attention_mask``,
        pass on to the ValueError that says what to use instead)."""
        ours = {f.name for f in dataclasses.fields(cls)}
        known = GenerationConfig().to_dict().keys() | ELSEWHERE.keys() | {"attention_mask"}
        for name in keywords:
            if name not in ours and name not in known:
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {name!r}: not an option of treespec "
                    f"({', '.join(sorted(ours))}) nor a field of transformers' GenerationConfig "
                    "(repetition_penalty, no_repeat_ngram_size, min_new_tokens, stop_strings, ...)")
        return cls(**{k: v for k, v in keywords.items() if k in ours}), \
            {k: v for k, v in keywords.items() if k not in ours}


_POSITIONAL = (("model", """
        a transformers causal LM (llama, qwen2, qwen3, mistral families), used as is; its
        attention implementation is restored before this returns."""), ("draft", """
        a :class:`~treespec.drafters.base.Drafter` (``ModelDrafter``, ``NgramDrafter``,
        ``EagleDrafter``, ``Eagle3Drafter``), ``"ngram"`` or ``"none"`` (no speculation:
        autoregressive decoding through treespec's runner)."""), ("tree_cfg", """
        a :class:`TreeConfig` or a preset name (``treespec.PRESETS``)."""), ("input_ids", """
        one prompt (1-D tensor or list of ints) or a list of prompts of any lengths."""))

_GENERATION_FIELDS = """
        fields of ``GenerationConfig`` (``repetition_penalty=1.1``, ``no_repeat_ngram_size=4``,
        ``min_new_tokens``, ``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``,
        ``typical_p``, ``max_time``, ...): exactly those given, as the sampling arguments are.
        Options that cannot be exact on trees (beam search, guidance, ...) raise a ValueError
        that names them."""


def _args_doc() -> str:
    def entry(name: str, doc: str) -> str:
        return f"    {name}:\n" + textwrap.indent(textwrap.dedent(doc).strip(), " " * 8)

    fields = [(f.name, f.metadata["doc"]) for f in dataclasses.fields(GenerationOptions)]
    return "\n".join(["Args:", *(entry(n, d) for n, d in (*_POSITIONAL, *fields, ("**options", _GENERATION_FIELDS)))])


def declares_options(fn):
    """``fn(model, draft, tree_cfg, input_ids, **options)`` with the signature and argument docs
    of :class:`GenerationOptions`: every field a keyword-only parameter with its default, and its
    doc under ``Args``."""
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name, _ in _POSITIONAL]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in dataclasses.fields(GenerationOptions)]
    params.append(inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD))
    fn.__signature__ = inspect.signature(fn).replace(parameters=params)
    doc, returns, tail = inspect.cleandoc(fn.__doc__ or "").partition("\nReturns:")
    fn.__doc__ = doc.rstrip() + "\n\n" + _args_doc() + ("\n" + returns + tail if returns else "")
    return fn
