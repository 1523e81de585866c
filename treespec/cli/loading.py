"""The set-up chain generate, bench, tune, capture and tree show run, written once:

    check:  flags -> sampling -> tree specs -> (a dataset file) -> draft specs
    load:   threads -> target -> (prompts) -> drafters -> packed weights (where they pay)

Every mistake a user can make in a flag answers in ``check``, before seconds of loading; ``load``
then reads the prompts before any drafter, so a bad prompt field fails before a draft model
loads. Tree specs (a preset, ``chain-K`` or a JSON file) and draft specs are read by :mod:`.specs`.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .bars import Bars
from .common import DEFAULT_DRAFT, DEFAULT_SPEC, UserError, auto_profile, check_early, generation_options, log
from .common import fixed_shapes_of, sampling, split_rows
from .specs import LOOKUP_SUFFIX, HeadForAnotherModel, check_draft_spec, tree

__all__ = ["LOOKUP_SUFFIX", "check_draft_spec", "tree", "check", "stream_options", "load", "load_model", "drafter",
           "setup_threads"]


def check(args, trees: Iterable[str] = (), drafts: Iterable[str] = (), then: Iterable[Callable] = ()):
    """``(SamplingParams or None, {tree spec: (TreeConfig, name)})`` once every check that
    needs no model has passed; ``then`` runs between the trees and the drafts."""
    check_early(args)
    sp = sampling(args)
    parsed = {t: tree(t) for t in dict.fromkeys(trees)}
    for step in then:
        step()
    for d in dict.fromkeys(drafts):
        check_draft_spec(d)
    return sp, parsed


def stream_options(args, sp, cfg) -> dict:
    """``treespec.stream``'s keywords as the sampling, generation and runtime flags set them
    (generate's and chat's); --auto-profile is read here, so before any model loads."""
    if not cfg.auto and args.auto_profile:
        log.warning("--auto-profile is for the auto tree: --tree %s does not use it", args.tree)
    return dict(max_new_tokens=args.max_new_tokens, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                min_p=sp.min_p, seed=args.seed, attention_backend=args.backend, auto_profile=auto_profile(args)
                if cfg.auto else None, fixed_shapes=fixed_shapes_of(args), **generation_options(args))


# ---- loading -----------------------------------------------------------------------------


def load_progress() -> Bars:
    """A first load's slow steps on stderr: one line saying what is downloaded or converted,
    and where, then a byte bar for the download (on a terminal)."""
    return Bars("B", leave=False, say=True, only=("download",))


def load_model(name, dtype=None, weights: str = "dense"):
    from .. import models

    try:
        return models.load(name, progress=load_progress(), weights=weights,
                           **({"dtype": dtype} if dtype is not None else {}))
    except models.ModelUnavailableError as e:
        raise UserError(str(e)) from None
    except ValueError as e:
        if weights == "dense":
            raise
        raise UserError(f"--weights {weights}: {e}") from None  # a format this model cannot take
    except OSError as e:  # a folder transformers cannot read
        raise UserError(f"cannot load the model {name!r}: {e}".splitlines()[0]) from None


def device(args) -> str:
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: torch sees no CUDA GPU here (use --device cpu)")
    return args.device


def dtype(args):
    import torch

    from ..packing import default_dtype

    return default_dtype(device(args)) if args.dtype == "auto" else getattr(torch, args.dtype)


def load_target(args):
    """The target model and tokenizer per --model, --device, --dtype and --weights."""
    weights, where = getattr(args, "weights", "dense"), device(args)
    if weights != "dense" and where != "cpu":
        raise UserError(f"--weights {weights} runs on torch's CPU kernels: use --device cpu, or dense weights on "
                        f"{where}")
    model, tok = load_model(args.model, dtype(args), weights)
    return (model.to(where) if where != "cpu" else model), tok


def drafter(spec: str, model, tokenizer, backend: str, head_kw: dict | None = None):
    """``(Drafter, short name)`` for a draft spec, checked against ``model``; ``head_kw``: an EAGLE head's."""
    from ..drafters import ModelDrafter, NgramDrafter, load_draft

    check_draft_spec(spec)
    head_kw = head_kw or {}
    if head_kw.get("cuda_graphs") and (spec in ("ngram", "none") or spec.startswith(("layers:", "model:"))) \
            and not spec.endswith(LOOKUP_SUFFIX):  # a graft's primary is checked on its own
        log.warning("--cuda-graphs replays the verify forward and EAGLE heads: the %s drafter runs eagerly", spec)
    if spec.endswith(LOOKUP_SUFFIX):
        from ..drafters import HybridDrafter

        primary, name = drafter(spec[: -len(LOOKUP_SUFFIX)], model, tokenizer, backend, head_kw)
        try:
            return HybridDrafter(primary), name + LOOKUP_SUFFIX
        except ValueError as e:
            raise UserError(str(e)) from None
    if spec == "ngram":
        return NgramDrafter(), "ngram"
    if spec == "none":
        from ..drafters import NoDrafter

        return NoDrafter(), "none"
    if spec.startswith("layers:"):
        from ..models import truncated_draft

        k, total = int(spec[len("layers:"):]), model.config.num_hidden_layers
        if not 1 <= k < total:  # the flag's words, not truncated_draft's num_layers
            raise UserError(f"--draft layers:K: K must be in 1..{total - 1} (the target has {total} layers), got {k}")
        return ModelDrafter(truncated_draft(model, k), attention_backend=backend), spec
    if spec.startswith("model:"):
        p = next(model.parameters())
        dmodel, dtok = load_model(spec[len("model:"):], p.dtype)
        dmodel = dmodel.to(p.device)
        if tokenizer is not None and dtok is not None and dtok.get_vocab() != tokenizer.get_vocab():
            log.warning("the draft model's tokenizer differs from the target's: drafts will rarely be accepted")
        d, name = ModelDrafter(dmodel, attention_backend=backend), spec
        d.check_compatible(model)  # vocabulary mismatches surface here, as ValueError
    else:
        name = spec if "/" not in spec else Path(spec).name
        try:
            d = load_draft(spec, model, attention_backend=backend, **head_kw)
            d.check_compatible(model)
        except ValueError as e:  # a head made for another model (vocabulary, hidden size)
            raise HeadForAnotherModel(
                f"{e}: --draft {spec} is an EAGLE head for another model. Use --draft ngram (prompt lookup, no "
                "model), --draft layers:K (the target's first K layers) or a head trained for this model: treespec "
                "train-eagle --model ... --out DIR (it writes its own training data: docs/own-model.md)") from None
    return d, name


def _drafters(args, specs: Iterable[str], model, tok, head_kw: dict) -> dict:
    """:func:`drafter` of each spec; the default draft (the shipped head, not given by --draft or
    --config) on a model it was not made for falls back to prompt lookup, said in one line."""
    given = any(a.split("=")[0] in ("--draft", "--config") for a in getattr(args, "argv", ()))
    out, fallback = {}, None
    for spec in dict.fromkeys(specs):
        try:
            out[spec] = drafter(spec, model, tok, args.backend, head_kw)
        except HeadForAnotherModel:
            if spec not in (DEFAULT_SPEC, DEFAULT_DRAFT) or given:
                raise
            if fallback is None:  # one drafter for both defaults: bench runs it once per tree
                fallback = drafter("ngram", model, tok, args.backend)
                print(f"treespec: {args.model} has no EAGLE head: drafting by prompt lookup (--draft ngram); train one "
                      f"with: treespec train-eagle --model {args.model} --out DIR (docs/own-model.md)", file=sys.stderr)
            out[spec] = fallback
    return out


def setup_threads(args, warn: bool = True) -> str | None:
    """torch's threads: --threads, else :func:`treespec.threads.choose_threads` (one per
    physical core available to this process, fewer when other processes keep those cores busy),
    with its one line saying so logged, or returned with ``warn=False``."""
    import torch

    from ..threads import choose_threads

    threads, note = (args.threads, None) if args.threads else choose_threads()
    torch.set_num_threads(threads)
    if note and warn:
        log.warning(note)
    return note


def fast_path(args, model, drafters=(), keep: bool = False):
    """``(packed weights or None, PackingChoice)`` for ``model`` and the drafters' modules, per
    --pack: forced on (an error where oneDNN cannot pack), off, or by default whichever runs
    the target faster here, measured once and cached (:func:`treespec.pack_choice.choose_packing`).
    ``keep``: the packed weights also where treespec runs plain (bench's packed HF baseline)."""
    import torch

    from ..pack_choice import PackingChoice, choose_packing
    from ..packing import PackedLinears, onednn_packs, packing_supported

    if args.pack is False:
        return None, PackingChoice(False, "given")
    if args.pack is None and not packing_supported(model):
        p = next(model.parameters())
        if p.device.type == "cpu" and p.dtype == torch.bfloat16 and onednn_packs(torch.float32):
            log.warning("weights not packed: oneDNN cannot pack bfloat16 on this CPU, so the model runs on plain "
                        "weights (--dtype float32 or auto packs; --pack makes this an error)")
        return None, PackingChoice(False, "unsupported")
    modules = [m for d in drafters for m in d.modules()]
    try:
        if args.pack:
            return PackedLinears(model, *modules), PackingChoice(True, "given")
        choice, packed = choose_packing(model, *modules, keep=keep)
    except ValueError as e:
        raise UserError(f"--pack: {e}") from None
    return packed, choice


@dataclass
class Loaded:
    """What a command runs on: the target, what ``prompts`` made of its tokenizer, the
    drafters by spec as ``(Drafter, short name)``, the packed weights or None, and the
    :class:`~treespec.pack_choice.PackingChoice` saying whether treespec runs on them."""

    model: Any
    tokenizer: Any
    prompts: Any = None
    drafters: dict = field(default_factory=dict)
    fast: Any = None
    packing: Any = None

    def packed(self):
        """The packed weights' context where treespec runs on them, else one that changes nothing."""
        use = self.fast is not None and (self.packing is None or self.packing.pack)
        return self.fast if use else contextlib.nullcontext()


def load(args, drafts: Iterable[str] = (), prompts: Callable | None = None, keep_packed: bool = False) -> Loaded:
    """Threads, the target, ``prompts(tokenizer)``, the drafters, then packed weights for all
    (``keep_packed``: also where treespec runs plain, for a packed baseline)."""
    busy = setup_threads(args, warn=False)
    model, tok = load_target(args)  # a name that is no model fails in one line, no advice first
    if busy:
        log.warning(busy)
    out = Loaded(model, tok, prompts(tok) if prompts is not None else None)
    head_kw = {"cuda_graphs": getattr(args, "cuda_graphs", False), "compile_passes": getattr(args, "compiled", False)}
    if head_kw["cuda_graphs"] and next(model.parameters()).device.type != "cuda":
        raise UserError("--cuda-graphs needs the model on a CUDA GPU (--device cuda)")
    out.drafters = _drafters(args, drafts, model, tok, head_kw)
    out.fast, out.packing = fast_path(args, model, [d for d, _ in out.drafters.values()], keep=keep_packed)
    return split_rows(out)  # --weights X+dense: up to which width X runs
