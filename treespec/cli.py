"""The ``treespec`` command line.

    treespec generate [--model M] [--draft D] [--tree T] [--prompt TEXT | --chat TEXT] ...
    treespec bench [--dataset gsm8k] [--draft D ...] [--tree T ...] [--out results.json] ...
    treespec tree show PRESET|TREE.json [--prompt TEXT --model M --draft D] --out tree.png
    treespec train-eagle --data DATA.jsonl --out DIR ...
    treespec capture --data NAME[,NAME...] --out DIR [--max-examples N] [--sample-share 0.2] ...
    treespec export --to vllm|sglang|eagle [--draft D] [--tree T] [--model M]
    treespec tune [--model M] [--draft D] [--dataset gsm8k] --out PROFILE.json [--plot-dir DIR]

A draft ``D`` is a shipped head name (``treespec.assets.DRAFTS``), an EAGLE head directory,
``ngram`` (prompt lookup, no model), ``model:NAME_OR_PATH`` (an independent small LM) or
``none`` (no speculation: one token per target forward through treespec's runner). A
tree ``T`` is a preset name (``treespec.PRESETS``) or a JSON file: a list of child-rank
paths (``[[0], [1], [0, 0]]``), ``{"paths": [...]}`` or ``{"depth": 5, "top_k": 4,
"num_nodes": 16}`` for a dynamic tree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import shlex
import sys
import textwrap
from pathlib import Path

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-instruct-eagle"
# generate's draft and tree, and bench's configurations, when none is asked for: the shipped
# head with prompt lookup grafted on and auto trees, the fastest measured with the head that
# ships (docs/benchmarks.md, bf16 on packed weights: HumanEval-20 2.83x, chat-12 2.57x,
# GSM8K-50 3.00x against the same drafter's chain-3 at 3.11x; the head alone with auto 1.76x,
# 1.83x and 2.56x); bench runs the hybrid's chain-3 and the head alone with auto beside it.
DEFAULT_SPEC = f"{DEFAULT_DRAFT}+lookup"
DEFAULT_TREE = "auto"
DEFAULT_BENCH_CONFIGS = (f"{DEFAULT_SPEC}@auto", f"{DEFAULT_SPEC}@chain-3", f"{DEFAULT_DRAFT}@auto")
# A GSM8K-style word problem (GSM8K train, first record): the shipped head trained on them.
DEFAULT_CHAT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?"
)


class UserError(Exception):
    """A mistake the user can fix: printed as one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``treespec: error: ...``), exit code 2."""

    def error(self, message):
        self.exit(2, f"treespec: error: {message} (see {self.prog} --help)\n")


# ---- shared pieces ----------------------------------------------------------------------


class _LoadProgress:
    """A first load's slow steps on stderr: one line saying what is downloaded or converted,
    and where, then a byte bar for the download (on a terminal)."""

    def __init__(self):
        self.started, self.bar = set(), None

    def __call__(self, p):
        if p.stage not in self.started:
            self.started.add(p.stage)
            print(f"treespec: {p.message}", file=sys.stderr, flush=True)
            if p.stage == "download":
                from tqdm import tqdm

                self.bar = tqdm(total=p.total, unit="B", unit_scale=True, dynamic_ncols=True, leave=False,
                                disable=not sys.stderr.isatty())
        if p.stage == "download" and self.bar is not None:
            self.bar.update(p.done - self.bar.n)
            if p.done >= p.total:
                self.bar.close()
                self.bar = None


def _load_model(name, dtype=None):
    from . import models

    try:
        return models.load(name, progress=_LoadProgress(), **({"dtype": dtype} if dtype is not None else {}))
    except models.ModelUnavailableError as e:
        raise UserError(str(e)) from None
    except OSError as e:  # a folder transformers cannot read
        raise UserError(f"cannot load the model {name!r}: {e}".splitlines()[0]) from None


def _tree(spec: str):
    """``(TreeConfig, short name)`` of a preset name or a JSON tree file."""
    from .config import PRESETS, TreeConfig

    if spec in PRESETS:
        return PRESETS[spec].config, spec
    if re.fullmatch(r"chain-[1-9][0-9]*", spec):  # chains longer than the presets' 8
        return TreeConfig.chain(int(spec[len("chain-"):])), spec
    path = Path(spec).expanduser()
    if not (path.suffix.lower() == ".json" or path.exists() or "/" in spec):
        raise UserError(f"unknown tree preset {spec!r}; known presets: {', '.join(PRESETS)} "
                        f"(or give a JSON file of paths)")
    if not path.is_file():
        raise UserError(f"no tree file at {spec}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{spec} is not valid JSON: {e}") from None
    hint = ('expected a list of child-rank paths like [[0], [1], [0, 0]], {"paths": [...]} or '
            '{"depth": 5, "top_k": 4, "num_nodes": 16}')
    try:
        if isinstance(data, dict) and set(data) == {"paths"}:
            data = data["paths"]
        if isinstance(data, dict) and set(data) == {"depth", "top_k", "num_nodes"}:
            return TreeConfig.dynamic(data["depth"], data["top_k"], data["num_nodes"]), path.stem
        if not (isinstance(data, list) and all(isinstance(p, list) and all(isinstance(r, int) and not isinstance(r, bool)
                                                                            for r in p) for p in data)):
            raise ValueError(hint)
        return TreeConfig.static(data), path.stem
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise UserError(f"bad tree in {spec}: {msg}" + ("" if msg == hint else f"; {hint}")) from None


LOOKUP_SUFFIX = "+lookup"


def _check_draft_spec(spec: str) -> None:
    """Fail before loading any model when a draft head is missing."""
    from .assets import DRAFTS, resolve_draft

    if spec.endswith(LOOKUP_SUFFIX):
        primary = spec[: -len(LOOKUP_SUFFIX)]
        if primary in ("ngram", "none", ""):
            raise UserError(f"--draft {spec}: '{LOOKUP_SUFFIX}' grafts prompt lookup onto a model drafter "
                            "(a head, layers:K or model:NAME), e.g. smollm2-135m-instruct-eagle+lookup")
        return _check_draft_spec(primary)

    if spec.startswith("layers:"):
        if not spec[len("layers:"):].isdigit():
            raise UserError(f"--draft {spec}: give a layer count, e.g. layers:6 (the target's first 6 layers)")
        return
    if spec in ("ngram", "none") or spec.startswith("model:"):
        if spec == "model:":
            raise UserError("--draft model: needs a model name or path, e.g. model:stories260k")
        return
    try:
        resolve_draft(spec)
    except FileNotFoundError as e:
        if spec in DRAFTS:
            raise UserError(f"the shipped draft {spec!r} is missing ({DRAFTS[spec][0]} has no config.json); "
                            f"use --draft ngram, or train one with treespec train-eagle") from None
        raise UserError(f"{e}; or use --draft ngram or --draft model:NAME") from None


def _drafter(spec: str, model, tokenizer, backend: str):
    """``(Drafter, short name)`` for a draft spec, checked against ``model``."""
    from .drafters import ModelDrafter, NgramDrafter, load_draft

    _check_draft_spec(spec)
    if spec.endswith(LOOKUP_SUFFIX):
        from .drafters import HybridDrafter

        primary, name = _drafter(spec[: -len(LOOKUP_SUFFIX)], model, tokenizer, backend)
        try:
            return HybridDrafter(primary), name + LOOKUP_SUFFIX
        except ValueError as e:
            raise UserError(str(e)) from None
    if spec == "ngram":
        return NgramDrafter(), "ngram"
    if spec == "none":
        from .drafters import NoDrafter

        return NoDrafter(), "none"
    if spec.startswith("layers:"):
        from .models import truncated_draft

        try:
            return ModelDrafter(truncated_draft(model, int(spec[len("layers:"):])), attention_backend=backend), spec
        except ValueError as e:
            raise UserError(str(e)) from None
    if spec.startswith("model:"):
        p = next(model.parameters())
        dmodel, dtok = _load_model(spec[len("model:"):], p.dtype)
        dmodel = dmodel.to(p.device)
        if tokenizer is not None and dtok is not None and dtok.get_vocab() != tokenizer.get_vocab():
            log.warning("the draft model's tokenizer differs from the target's: drafts will rarely be accepted")
        drafter, name = ModelDrafter(dmodel, attention_backend=backend), spec
    else:
        drafter = load_draft(spec, model, attention_backend=backend)
        name = spec if "/" not in spec else Path(spec).name
    drafter.check_compatible(model)  # vocabulary mismatches surface here, as ValueError
    return drafter, name


def _sampling(args):
    from .sampling import SamplingParams

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    except ValueError as e:
        raise UserError(f"bad sampling values: {e}") from None


def _prompt_ids(tokenizer, args, model_name: str) -> list[int]:
    from .prompts import encode_prompt

    has_template = bool(getattr(tokenizer, "chat_template", None))
    if args.prompt is not None:
        ids = encode_prompt(tokenizer, args.prompt, chat=False)
        if not ids:
            raise UserError(f"--prompt {args.prompt!r} encodes to no tokens with {model_name}'s tokenizer")
        return ids
    if args.chat is not None:
        if not has_template:
            raise UserError(f"{model_name} has no chat template: use --prompt TEXT")
        return encode_prompt(tokenizer, args.chat, chat=True)
    if not has_template:
        log.warning("%s has no chat template: the built-in message is used as plain text", model_name)
    return encode_prompt(tokenizer, DEFAULT_CHAT, chat=has_template)


def _add_sampling(p, seed=None):
    g = p.add_argument_group("sampling (temperature 0: greedy, the default)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=seed,
                   help="sampling seed" + (" (prompt i uses seed + i; default: %(default)s)" if seed is not None else ""))


def _add_runtime(p):
    p.add_argument("--backend", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="tree attention backend (auto: FlashInfer on CUDA when installed)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per physical core available; on a machine whose cores "
                        "other processes keep busy, fewer is much faster, often 1: see README, Threads)")
    p.add_argument("--device", default="auto", help="where the model runs: auto (cuda when available), cpu, "
                                                     "cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weights and activations of the target and draft (probabilities and verification stay "
                        "fp32). auto: bfloat16 on a GPU or a CPU with native bf16 (AVX512-BF16/AMX), else float32")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model's linear layers on oneDNN-packed weights (CPU; about 0.5 s to pack, doubles "
                        "the linear weights' memory). Default: on for a CPU model whose dtype oneDNN packs here (fp32 "
                        "always; bf16 with AVX512 or AVX-NE-CONVERT). In bench, HF generate is also run with "
                        "packed weights, beside plain HF generate")


def _check_early(args):
    """Checks that need no model and no torch, so that these mistakes answer at once."""
    for flag, verb in (("prompt", "continue"), ("chat", "answer")):
        text = getattr(args, flag, None)
        if text is not None and not text.strip():
            raise UserError(f"--{flag} is empty: give the text to {verb}")
    if getattr(args, "max_new_tokens", 1) < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    device = getattr(args, "device", "auto")
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise UserError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")


def _device(args) -> str:
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: torch sees no CUDA GPU here (use --device cpu)")
    return args.device


def _dtype(args):
    import torch

    from .packing import default_dtype

    if args.dtype == "auto":
        return default_dtype(_device(args))
    return getattr(torch, args.dtype)


def _load_target(args):
    """The target model and tokenizer per --model, --device and --dtype."""
    model, tok = _load_model(args.model, _dtype(args))
    device = _device(args)
    return (model.to(device) if device != "cpu" else model), tok


def _fast_path(args, model, drafters=()):
    """The packed-weights context for ``model`` and the drafters' modules, or None, per --pack."""
    import torch

    from .packing import PackedLinears, onednn_packs, packing_supported

    if args.pack is False:
        return None
    if args.pack is None and not packing_supported(model):
        p = next(model.parameters())
        if p.device.type == "cpu" and p.dtype == torch.bfloat16 and onednn_packs(torch.float32):
            log.warning("weights not packed: oneDNN cannot pack bfloat16 on this CPU, so the model runs on plain "
                        "weights (--dtype float32 or auto packs; --pack makes this an error)")
        return None
    try:
        return PackedLinears(model, *(m for d in drafters for m in d.modules()))
    except ValueError as e:
        raise UserError(f"--pack: {e}") from None


def _setup_threads(args):
    """torch's threads: --threads, else one per physical core available to this process, with
    a warning when other processes keep those cores busy (the threads then wait on each other)."""
    import torch

    from .threads import busy_warning, default_threads

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    if args.threads is None:
        warning = busy_warning(threads)
        if warning:
            log.warning(warning)


# ---- generate ---------------------------------------------------------------------------


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text with tree speculation, streamed to stdout",
                       description="Generate with tree speculation: the text streams to stdout as it is "
                                   "committed, a summary line goes to stderr.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: a treespec name, HF id or path")
    p.add_argument("--draft", default=DEFAULT_SPEC,
                   help="a shipped head name, an EAGLE head directory, 'ngram', 'layers:K' (the target's first K layers as a draft model) or 'model:NAME_OR_PATH'; "
                        "any model drafter with '+lookup' appended also grafts prompt lookup onto its trees "
                        "(default: %(default)s, the shipped head with prompt lookup)")
    p.add_argument("--tree", default=DEFAULT_TREE,
                   help="a preset name or a JSON tree file (default: %(default)s: each step verifies the tree that "
                        "pays most from this machine's measured verify costs and the draft's calibrated scores; "
                        "the fastest beside every fixed preset with the shipped head, docs/benchmarks.md)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="plain text to continue")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    _add_sampling(p)
    _add_runtime(p)
    _add_auto_profile(p)
    p.set_defaults(func=_generate)


class _TextStream:
    """Writes decoded text as tokens arrive: decodes all generated ids each time (so
    multi-token characters and tokenizer spacing come out right) and writes the new suffix."""

    def __init__(self, tokenizer, out):
        self.tok, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = ""

    def push(self, tokens, final: bool = False):
        self.ids.extend(tokens)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return  # the last character's bytes are not all there yet
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


def _generate(args):
    _check_early(args)  # before the imports below, which take seconds
    from .engine import stream

    sp = _sampling(args)
    cfg, tree_name = _tree(args.tree)
    _check_draft_spec(args.draft)
    _setup_threads(args)
    model, tok = _load_target(args)
    drafter, draft_name = _drafter(args.draft, model, tok, args.backend)
    ids = _prompt_ids(tok, args, args.model)
    fast = _fast_path(args, model, [drafter])
    profile = _auto_profile(args) if cfg.auto else None

    text = _TextStream(tok, sys.stdout)
    metrics = None
    try:
        with fast if fast is not None else contextlib.nullcontext():
            for out in stream(model, drafter, cfg, ids, max_new_tokens=args.max_new_tokens,
                              temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                              seed=args.seed, attention_backend=args.backend, auto_profile=profile):
                text.push(out.tokens[0])
                metrics = out.metrics
    except KeyboardInterrupt:
        if text.printed:
            print(flush=True)  # end the streamed line, so the interruption note starts its own
        raise
    text.push([], final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    m = metrics
    print(f"[treespec] {m.num_generated} tokens in {m.total_seconds:.2f} s: {m.tokens_per_second:.1f} tokens/s, "
          f"mean accepted length {m.mean_accepted_length:.2f}, {m.num_steps} steps "
          f"(draft {draft_name}, tree {tree_name}"
          + (f", mean tree size {m.mean_tree_size:.1f} nodes" if cfg.auto else "") + ")", file=sys.stderr)


# ---- bench ------------------------------------------------------------------------------


def _add_bench(sub):
    p = sub.add_parser(
        "bench", help="benchmark HF generate, HF prompt lookup and treespec side by side",
        description="Run HF generate, HF prompt lookup and treespec configurations side by side on the same "
                    "prompts (all configurations on prompt i before prompt i+1). Greedy outputs are checked "
                    "token for token against HF generate; a difference is judged in fp32 at its first token "
                    "(a rounding near-tie, possible in bf16, or unexplained) and an unexplained treespec "
                    "difference exits with status 1. With packed weights (--pack, the CPU default) HF generate "
                    "and treespec without speculation (treespec-ar) also run on the packed weights.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: a treespec name, HF id or path")
    p.add_argument("--draft", action="append", default=None,
                   help="draft to run (repeatable): a shipped head name, head directory, 'ngram' or "
                        f"'model:NAME', with '+lookup' grafting prompt lookup onto a model drafter's trees "
                        f"(default: {DEFAULT_SPEC})")
    p.add_argument("--tree", action="append", default=None,
                   help=f"tree to run with each draft (repeatable): preset or JSON file (default: {DEFAULT_TREE})")
    p.add_argument("--chain", type=int, default=None, metavar="K",
                   help="also run each draft with a chain of K (default: 3 for ngram, 2 for others; 0: none)")
    p.add_argument("--config", action="append", default=None, metavar="DRAFT@TREE",
                   help="run exactly these draft/tree pairs instead of --draft x (chain + --tree) (repeatable). "
                        "With none of --config, --draft, --tree, --chain: "
                        + ", ".join(DEFAULT_BENCH_CONFIGS) + " (the fastest on a 2-core CPU, docs/benchmarks.md)")
    p.add_argument("--lookup-tokens", type=int, default=3, metavar="K",
                   help="HF prompt lookup's prompt_lookup_num_tokens (default: %(default)s, as ngram's chain-3)")
    p.add_argument("--no-hf-lookup", action="store_true", help="skip HF prompt lookup")
    p.add_argument("--no-treespec-ar", action="store_true",
                   help="skip the treespec-ar baseline (treespec without a draft on packed weights); "
                        "HF generate on packed weights stays the same-advantage baseline")
    p.add_argument("--hf-compile", action="store_true",
                   help="also run HF generate with a static cache and torch.compile (compiles for a minute or more "
                        "first; on the CPUs measured it was slower than plain HF generate, docs/benchmarks.md)")
    p.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval or a .jsonl file (default: %(default)s)")
    p.add_argument("--prompt-field", default=None, help="JSONL field holding the prompt (default: question for "
                   "gsm8k, prompt otherwise)")
    p.add_argument("--raw", action="store_true", help="use the prompts as plain text, without the chat template")
    p.add_argument("--num-prompts", type=int, default=10)
    _add_sampling(p, seed=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed generate per configuration first (default: on)")
    _add_runtime(p)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots into this folder")
    p.add_argument("--plot-prefix", default=None,
                   help="file name prefix of the PNGs (default: the --out file's name and '-', e.g. r- for r.json; "
                        "else bench-)")
    _add_auto_profile(p)
    p.set_defaults(func=_bench)


def _portable(arg: str) -> str:
    """An absolute path as it reads from here (relative under the working folder, ``~`` under
    home), so that recorded commands hold no machine's folders; other arguments unchanged."""
    import os

    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("--"):
        return f"{flag}={_portable(value)}"
    if not os.path.isabs(arg):
        return arg
    path, cwd, home = Path(arg), Path.cwd(), Path.home()
    if path.is_relative_to(cwd):
        return path.relative_to(cwd).as_posix() or "."
    if path.is_relative_to(home):
        return "~/" + path.relative_to(home).as_posix()
    return arg


def _bench_pairs(args) -> list[tuple[str, str]]:
    """The treespec (draft spec, tree spec) pairs to run, in order."""
    if args.config:
        if args.draft or args.tree or args.chain is not None:
            raise UserError("--config gives the exact draft/tree pairs: drop --draft, --tree and --chain")
        pairs = []
        for c in args.config:
            draft, sep, tree = c.rpartition("@")
            if not sep or not draft or not tree:
                raise UserError(f"--config {c!r} must look like DRAFT@TREE, e.g. ngram@chain-3")
            pairs.append((draft, tree))
        return pairs
    if not (args.draft or args.tree or args.chain is not None):
        return [tuple(c.rsplit("@", 1)) for c in DEFAULT_BENCH_CONFIGS]
    drafts = args.draft or [DEFAULT_SPEC]
    trees = args.tree or [DEFAULT_TREE]
    pairs = []
    for d in drafts:
        k = args.chain if args.chain is not None else (3 if d == "ngram" else 2)
        if k < 0:
            raise UserError(f"--chain must be >= 0, got {k}")
        for t in ([f"chain-{k}"] if k else []) + trees:
            if (d, t) not in pairs:
                pairs.append((d, t))
    return pairs


def _bench(args):
    _check_early(args)  # before the imports below, which take seconds
    from tqdm import tqdm

    from .bench import BenchConfig, format_table, run_bench, save_plots, to_json
    from .prompts import dataset_file, load_prompts

    sp = _sampling(args)
    if args.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.lookup_tokens < 1:
        raise UserError(f"--lookup-tokens must be >= 1, got {args.lookup_tokens}")
    pairs = _bench_pairs(args)
    trees = {t: _tree(t) for t in dict.fromkeys(t for _, t in pairs)}
    dataset_file(args.dataset)  # missing data and heads fail before the model loads
    for d in dict.fromkeys(d for d, _ in pairs):
        _check_draft_spec(d)
    _setup_threads(args)

    model, tok = _load_target(args)
    prompts, fmt = load_prompts(args.dataset, tok, args.num_prompts, prompt_field=args.prompt_field, raw=args.raw)
    drafters = {d: _drafter(d, model, tok, args.backend) for d in dict.fromkeys(d for d, _ in pairs)}
    fast = _fast_path(args, model, [d for d, _ in drafters.values()])
    configs = [BenchConfig.hf_generate()]
    if fast is not None:
        # The same advantage without speculation: HF generate and treespec's own
        # one-token decoding, both on the packed weights.
        configs += [BenchConfig.hf_generate(fast=True)] + ([] if args.no_treespec_ar else [BenchConfig.treespec_ar()])
    if args.hf_compile:
        configs.append(BenchConfig.hf_generate_compiled())
    if not args.no_hf_lookup:
        configs.append(BenchConfig.hf_lookup(args.lookup_tokens))
    for d, t in pairs:
        drafter, dname = drafters[d]
        cfg, tname = trees[t]
        configs.append(BenchConfig.treespec(drafter, cfg, dname, tname))

    bars = {}

    def progress(p):
        bar = bars.get(p.stage)
        if bar is None:
            # disable=None: no bars when stderr is not a terminal, so a redirected log stays readable
            bar = bars[p.stage] = tqdm(total=p.total, desc=p.stage, unit="prompt" if p.stage == "prompts" else "config",
                                       dynamic_ncols=True, leave=p.stage == "prompts", disable=None)
        bar.n = p.done
        bar.set_postfix_str(p.config or "", refresh=False)
        bar.refresh()
        if p.done == p.total and (p.stage == "warmup" or p.config is None):
            bar.close()

    res = run_bench(model, prompts, configs, max_new_tokens=args.max_new_tokens, temperature=sp.temperature,
                    top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=args.seed, warmup=args.warmup,
                    attention_backend=args.backend, callback=progress, fast_path=fast,
                    auto_profile=_auto_profile(args))
    for bar in bars.values():
        bar.close()
    data = to_json(res, command="treespec " + shlex.join(_portable(a) for a in args.argv), model=args.model,
                   dataset=_portable(args.dataset), prompt_format=fmt)
    report = "\n".join([
        f"{args.model} on {data['dataset']} ({fmt} prompts): {len(prompts)} prompt(s), {args.max_new_tokens} new tokens, "
        + ("greedy" if sp.greedy else f"temperature {sp.temperature}")
        + "; tok/s: total tokens / total seconds, med: median over prompts, tau: mean accepted length",
        format_table(data),
        *(f"note: {note}" for note in data["notes"]),
    ]) + "\n"
    sys.stdout.write(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")
        # The table as printed, beside the JSON: a clean text record (no progress bars).
        out.with_suffix(".txt").write_text(f"$ {data['command']}\n{report}")
        print(f"wrote {out} and {out.with_suffix('.txt').name}")
    if args.plot_dir:
        prefix = args.plot_prefix if args.plot_prefix is not None else f"{Path(args.out).stem}-" if args.out else "bench-"
        for path in save_plots(data, args.plot_dir, prefix):
            print(f"wrote {path}")
    bad = [c for c in data["configs"] if c["kind"] == "treespec" and c.get("unexplained")]
    if bad:
        print("treespec: error: greedy output differs from HF generate other than at a rounding near-tie: "
              + "; ".join(f"{c['name']} on {c['unexplained']} prompt(s)" for c in bad), file=sys.stderr)
        return 1
    return 0


# ---- tree show --------------------------------------------------------------------------


def _add_tree(sub):
    p = sub.add_parser("tree", help="look at tree shapes")
    tsub = p.add_subparsers(dest="tree_command", required=True)
    s = tsub.add_parser(
        "show", help="draw a tree preset, or the tree a draft proposes on a prompt",
        description="Draw a preset's (or JSON file's) shape. With --prompt or --chat: load the model and draft, "
                    "draw the tree the draft proposes at the first step, labelled with decoded tokens, and "
                    "highlight the path the model accepts (greedy).",
    )
    s.add_argument("tree", metavar="PRESET|CONFIG.json")
    s.add_argument("--out", required=True, help="PNG file to write")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="plain text prompt: draw the tree drafted for it")
    src.add_argument("--chat", help="a user message (chat template applied): draw the tree drafted for it")
    s.add_argument("--model", default=DEFAULT_MODEL, help="target, with --prompt/--chat (default: %(default)s)")
    s.add_argument("--draft", default=DEFAULT_DRAFT, help="draft, with --prompt/--chat (default: %(default)s)")
    s.add_argument("--dpi", type=int, default=100)
    _add_runtime(s)
    s.set_defaults(func=_tree_show)


def _wrap(text: str, width: int = 80) -> str:
    return "\n".join(textwrap.wrap(text, width))


def _example_dynamic(cfg):
    """A dynamic config's tree drafted by a seeded random Markov draft: one example of the
    shapes it takes (the real shape follows the draft's scores each step)."""
    import torch

    from .builder import build_dynamic_trees

    V = max(cfg.top_k * 3, 12)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g).mul(2.5).log_softmax(-1)  # [V, V]
    (tree,) = build_dynamic_trees(torch.tensor([0]), table[0][None], lambda f: (table[f.tokens], None), cfg)
    return tree


def _token_label(tok, t: int) -> str:
    s = tok.decode([t])
    piece = tok.convert_ids_to_tokens(t)
    if isinstance(piece, str) and piece[:1] in ("\u2581", "\u0120") and not s.startswith(" "):
        s = " " + s  # SentencePiece drops a lone token's leading space; it starts a word
    s = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)  # \n, \x0e: no font draws those
    return s.replace(" ", "·") if s.strip() else repr(s)


def _recording(inner):
    """``inner`` wrapped so that the trees its sessions propose are kept, with the
    ``max_depth`` the engine asked for: ``drafter.trees == [(trees, max_depth), ...]``."""
    from .drafters.base import Drafter, DraftSession

    class Session(DraftSession):
        def __init__(self, session, trees):
            self.session, self.trees = session, trees

        def propose(self, requests, roots, max_depth):
            trees = self.session.propose(requests, roots, max_depth)
            self.trees.append((trees, list(max_depth)))
            return trees

        def commit(self, requests, tokens, features):
            self.session.commit(requests, tokens, features)

        def finish(self, request):
            self.session.finish(request)

    class Recording(Drafter):
        feature_layers, samples, extra_nodes = inner.feature_layers, inner.samples, inner.extra_nodes

        def __init__(self):
            self.trees = []

        def check_compatible(self, model):
            inner.check_compatible(model)

        def features_for(self, model):
            return inner.features_for(model)

        def start(self, model, ctx):
            return Session(inner.start(model, ctx), self.trees)

    return Recording()


def _tree_show(args):
    _check_early(args)  # before the imports below, which take seconds
    from .config import PRESETS
    from .viz import save_tree_png

    cfg, name = _tree(args.tree)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    about = PRESETS[name].description if name in PRESETS and args.tree == name else str(args.tree)
    if args.prompt is None and args.chat is None:
        if cfg.kind == "static":
            tree = cfg.static_tree()
            title = f"{name}: {cfg.describe()}\n" + _wrap(about) + "\nnode labels are indices"
        else:
            tree = _example_dynamic(cfg)
            title = (f"{name}: {cfg.describe()}\nan example: the shape is chosen each step from the draft's "
                     f"scores\n(here a seeded random draft); use --prompt to draw a real one")
        save_tree_png(tree, out, title=title, dpi=args.dpi)
        print(f"wrote {out} ({tree.num_drafted} drafted nodes, depth {tree.max_depth})")
        return 0

    from .engine import stream

    _check_draft_spec(args.draft)
    _setup_threads(args)
    model, tok = _load_model(args.model)
    drafter, draft_name = _drafter(args.draft, model, tok, args.backend)
    ids = _prompt_ids(tok, args, args.model)
    rec = _recording(drafter)
    tokens = {}
    gen = stream(model, rec, cfg, ids, max_new_tokens=cfg.depth + 2, attention_backend=args.backend)
    try:
        for step in gen:
            tokens[step.step] = step.tokens[0]
            if step.step == 1 or step.finished[0]:
                break
    finally:
        gen.close()
    if not rec.trees or 1 not in tokens:
        raise UserError(f"{args.model} ended its reply at the first token: there is no tree to draw")
    (tree,), (depth,) = rec.trees[0]
    tree = tree.prune(max_depth=depth, max_nodes=cfg.num_nodes + drafter.extra_nodes)  # as the engine verified it
    # The committed tokens are the accepted drafts then the bonus: follow them down the tree.
    path, node = [0], 0
    children = {}
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(p, []).append(i)
    for t in tokens[1][:-1]:
        node = next(c for c in children.get(node, []) if int(tree.tokens[c]) == t)
        path.append(node)
    labels = [_token_label(tok, int(t)) for t in tree.tokens.tolist()]
    shown = args.prompt if args.prompt is not None else args.chat
    title = (f"{name} ({cfg.describe()}) drafted by {draft_name} at the first step\n"
             f"prompt: {shown[:60]!r}{'...' if len(shown) > 60 else ''}\n"
             f"highlighted: the path {args.model} accepts greedily ({len(path) - 1} of {tree.num_drafted} drafted "
             f"tokens, then bonus {_token_label(tok, tokens[1][-1])})")
    save_tree_png(tree, out, labels=labels, highlight=path, title=title, dpi=args.dpi)
    print(f"wrote {out} ({tree.num_drafted} drafted nodes, {len(path) - 1} accepted)")
    if tree.num_drafted == 0:
        print(f"{draft_name} proposed no tokens at the first step on this prompt")
    return 0


# ---- train-eagle ------------------------------------------------------------------------


def _add_train(sub):
    p = sub.add_parser("train-eagle", help="train an EAGLE draft head for a target model")
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: a treespec name, HF id or path")
    p.add_argument("--data", default=None, help="JSONL with question/answer, prompt/completion, messages or text, "
                   "or a packaged dataset: gsm8k-train (GSM8K train, shipped with treespec); not with --captured")
    p.add_argument("--captured", default=None, metavar="DIR",
                   help="train on a treespec capture folder (its first --max-examples conversations) instead of --data")
    p.add_argument("--val-captured", default=None, metavar="DIR",
                   help="validate on this capture folder (greedy answers) instead of a share of the training data")
    p.add_argument("--out", required=True, help="output directory (resumes if it holds a run)")
    p.add_argument("--arch", choices=["eagle3", "eagle1"], default="eagle3")
    p.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE-3 draft vocabulary (0: full)")
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="self-distil: replace the answers of the first N examples by the target's own (-1: all)")
    p.add_argument("--regen-max-new-tokens", type=int, default=256)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--soft-labels", action="store_true",
                   help="train on the target's whole next-token distribution over the draft vocabulary "
                        "(from the captured final state, as EAGLE-3 trains) instead of its one token; "
                        "needs --captured with features 'both'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype of training (bf16 autocast; weights and optimiser state stay fp32). "
                        "auto: bf16 on a GPU or a CPU with native bf16, else float32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per physical core available, as generate and bench)")
    p.set_defaults(func=_train)


def _train(args):
    from tqdm import tqdm

    from .train import TrainConfig, train_eagle

    if (args.data is None) == (args.captured is None):
        raise UserError("give --data (capture, then train) or --captured DIR (train on a treespec capture)")
    cfg = TrainConfig(
        data=args.data or "", out_dir=args.out, eagle3=args.arch == "eagle3", captured=args.captured,
        val_captured=args.val_captured,
        draft_vocab_size=args.draft_vocab or None, max_examples=args.max_examples,
        max_length=args.max_length, regenerate=args.regenerate != 0,
        regenerate_count=None if args.regenerate < 0 else args.regenerate,
        regen_max_new_tokens=args.regen_max_new_tokens, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps, seed=args.seed,
        dtype=args.dtype, soft_labels=args.soft_labels,
    )
    _setup_threads(args)
    model, tok = _load_model(args.model)
    bars = {}

    def progress(p):
        bar = bars.get(p.stage)
        if bar is None:
            bar = bars[p.stage] = tqdm(total=p.total, desc=p.stage, dynamic_ncols=True)
        bar.n = p.done
        if p.info:
            bar.set_postfix(loss=f"{p.info['loss']:.3f}", acc=",".join(f"{a:.2f}" for a in p.info["acc"]),
                            tok_s=f"{p.info['tok/s']:.0f}", refresh=False)
        bar.refresh()

    train_eagle(model, tok, cfg, callback=progress)
    for bar in bars.values():
        bar.close()
    print(f"saved the head to {args.out}/head")


# ---- capture ----------------------------------------------------------------------------


def _add_capture(sub):
    p = sub.add_parser(
        "capture", help="capture the target's own answers and features in resumable shards, for train-eagle",
        description="Self-distillation at scale: the target answers every prompt (batched through treespec's "
                    "engine, greedy or a sampled share), and its features are kept, in shards of --shard-size "
                    "conversations. Run the same command again to resume; train with train-eagle --captured DIR. "
                    "See docs/training.md.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: a treespec name, HF id or path")
    p.add_argument("--data", required=True, help="comma-separated datasets (packaged names or JSONL files), each "
                   "optionally sliced: 'gsm8k-train[:7000],stdlib-code,chat-train'")
    p.add_argument("--mix", default=None, help="comma-separated weights, one per dataset (default: their sizes); "
                   "every prefix of the capture keeps these proportions")
    p.add_argument("--out", required=True, help="capture folder (resumes if it holds shards)")
    p.add_argument("--max-examples", type=int, default=None, help="capture the first N conversations of the mix")
    p.add_argument("--answers", choices=["target", "reference"], default="target",
                   help="target: the target writes every answer (self-distillation); reference: the data's answers")
    p.add_argument("--sample-share", type=float, default=0.0, help="share of answers sampled instead of greedy")
    p.add_argument("--sample-temperature", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-length", type=int, default=512, help="prompt + answer tokens")
    p.add_argument("--batch-size", type=int, default=64,
                   help="requests decoded together, greedy and sampled alike (free to change when resuming)")
    p.add_argument("--shard-size", type=int, default=64, help="conversations per shard file")
    p.add_argument("--features", choices=["both", "eagle3", "eagle1"], default="both",
                   help="features kept: both layouts (default, trains either) or one")
    p.add_argument("--seed", type=int, default=0)
    _add_runtime(p)
    p.set_defaults(func=_capture)


def _capture(args):
    _check_early(args)
    from tqdm import tqdm

    from .train.capture import CaptureConfig, capture_shards

    try:
        mix = tuple(float(w) for w in args.mix.split(",")) if args.mix else None
        cfg = CaptureConfig(
            data=args.data, out_dir=args.out, mix=mix, max_examples=args.max_examples, max_length=args.max_length,
            max_new_tokens=args.max_new_tokens, answers=args.answers, sample_share=args.sample_share,
            sample_temperature=args.sample_temperature, seed=args.seed, shard_size=args.shard_size,
            batch_size=args.batch_size, features=args.features, model=args.model, dtype=args.dtype,
            attention_backend=args.backend)
    except ValueError as e:
        raise UserError(f"capture: {e}") from None
    _setup_threads(args)
    model, tok = _load_target(args)
    fast = _fast_path(args, model)
    bar = tqdm(desc="capture", unit="conv", dynamic_ncols=True, disable=None)

    def progress(p):
        bar.total = p.total
        bar.n = p.done
        bar.set_postfix(gen_tok_s=f"{p.info['tok/s']:.1f}", refresh=False)
        bar.refresh()

    with fast if fast is not None else contextlib.nullcontext():
        s = capture_shards(model, tok, cfg, callback=progress)
    bar.close()
    rebuilt = f" ({s['rebuilt']} rebuilt from answers files)" if s["rebuilt"] else ""
    print(f"{args.out}: {s['written']} shard(s) written{rebuilt}, {s['skipped']} already there, of {s['shards']}; "
          f"{s['conversations']} conversations, {s['generated_tokens']} generated tokens in {s['seconds']:.0f} s "
          f"({s['tokens_per_second']:.1f} tok/s)" + (f"; {s['too_long']} too long, skipped" if s["too_long"] else ""))
    return 0


# ---- export -----------------------------------------------------------------------------


# treespec.export.ENGINES, spelled out: importing export loads torch, and the parser is built
# for every command, --help included (tests/test_cli_startup.py checks the two agree).
EXPORT_ENGINES = ("vllm", "sglang", "eagle")


def _add_export(sub):
    p = sub.add_parser(
        "export", help="print how to serve an EAGLE-3 head with vLLM, SGLang or the EAGLE reference",
        description="Check that the engine reads the head folder correctly (its loading rules, "
                    "treespec/export.py), then print its command line (vLLM, SGLang) or Python call (EAGLE "
                    "reference) with the tree mapped to the engine's parameters. See docs/serving.md.",
    )
    p.add_argument("--to", required=True, choices=EXPORT_ENGINES, help="the serving engine")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="EAGLE-3 head: shipped name or folder (default: %(default)s)")
    p.add_argument("--tree", default="chain-2", metavar="PRESET|TREE.json",
                   help="tree preset or JSON tree file (default: %(default)s, which every engine runs)")
    p.add_argument("--model", default=None,
                   help="the target as the engine loads it, HF id or folder (default: the shipped head's target)")
    p.set_defaults(func=_export)


def _export(args):
    from .export import export_head

    if args.tree == "auto":
        raise UserError("--tree auto chooses each step's tree at run time from this machine's costs; a serving "
                        "engine takes one fixed tree: give a preset or a JSON tree file")
    _check_draft_spec(args.draft)
    cfg, _ = _tree(args.tree)
    out = export_head(args.to, args.draft, cfg, model=args.model)
    print(out.command)
    for note in out.notes:
        print(f"# {note}")
    return 0


# ---- tune -------------------------------------------------------------------------------


def _add_auto_profile(p):
    p.add_argument("--auto-profile", default=None, metavar="PROFILE.json",
                   help="for the auto tree: start from this profile (cost curve and calibration, from treespec tune) "
                        "instead of the disk-cached cost curve and the draft's own calibration (a head directory's "
                        "auto-profile.json, else the prior)")


def _auto_profile(args):
    """The --auto-profile file as an AutoProfile, or None."""
    if not getattr(args, "auto_profile", None):
        return None
    from .auto import AutoProfile

    path = Path(args.auto_profile).expanduser()
    if not path.is_file():
        raise UserError(f"no auto profile at {args.auto_profile} (write one with treespec tune --out)")
    try:
        return AutoProfile.load(path)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"bad auto profile {args.auto_profile}: {e}") from None


def _add_tune(sub):
    p = sub.add_parser(
        "tune", help="learn an auto-tree profile (cost curve, calibration) for a model/draft pair",
        description="Run the pair with the auto tree on sample prompts, learning the calibration of draft scores "
                    "online; write the profile (cost curve, calibrations, machine and model keys) as JSON for "
                    "generate/bench --auto-profile, and optionally pictures of the cost curve, the calibration and "
                    "the tree sizes chosen. See docs/trees.md, auto.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: a treespec name, HF id or path")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft spec as for generate (default: %(default)s)")
    p.add_argument("--tree", default="auto", help="an auto tree: 'auto' or a JSON file (default: %(default)s)")
    p.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval or a .jsonl file (default: %(default)s)")
    p.add_argument("--prompt-field", default=None, help="JSONL field holding the prompt")
    p.add_argument("--raw", action="store_true", help="use the prompts as plain text, without the chat template")
    p.add_argument("--num-prompts", type=int, default=10)
    _add_sampling(p, seed=0)
    _add_runtime(p)
    p.add_argument("--auto-profile", default=None, metavar="PROFILE.json", help="start from this profile")
    p.add_argument("--refresh-costs", action="store_true", help="measure the cost curve again (else the disk cache's)")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--plot-dir", default=None, help="write cost_curve, calibration and tree_sizes PNGs here")
    p.set_defaults(func=_tune)


def _tune(args):
    _check_early(args)  # before the imports below, which take seconds
    from .machine import machine_info
    from .prompts import dataset_file, load_prompts
    from .tune import save_tune_plots, tune

    sp = _sampling(args)
    if args.num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    cfg, tree_name = _tree(args.tree)
    if not cfg.auto:
        raise UserError(f"--tree {args.tree} is not an auto tree: tune learns the profile auto trees decide from")
    dataset_file(args.dataset)
    _check_draft_spec(args.draft)
    profile = _auto_profile(args)
    _setup_threads(args)
    model, tok = _load_target(args)
    prompts, fmt = load_prompts(args.dataset, tok, args.num_prompts, prompt_field=args.prompt_field, raw=args.raw)
    drafter, draft_name = _drafter(args.draft, model, tok, args.backend)
    fast = _fast_path(args, model, [drafter])
    from tqdm import tqdm

    bar = tqdm(total=len(prompts), desc="tune", unit="prompt", dynamic_ncols=True, disable=None)
    with fast if fast is not None else contextlib.nullcontext():
        res = tune(model, drafter, prompts, cfg, max_new_tokens=args.max_new_tokens, temperature=sp.temperature,
                   top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=args.seed, attention_backend=args.backend,
                   profile=profile, refresh_costs=args.refresh_costs, callback=lambda done, total: bar.update(1))
    bar.close()
    p = res.profile
    p.keys.update(model=args.model, draft=draft_name, dataset=_portable(args.dataset), prompt_format=fmt,
                  machine=machine_info(), command="treespec " + shlex.join(_portable(a) for a in args.argv))
    out = p.save(args.out)
    mean = sum(res.tree_sizes) / max(len(res.tree_sizes), 1)
    print(f"{args.model} + {draft_name}, {len(prompts)} prompt(s): {res.num_generated} tokens, "
          f"{res.num_generated / res.seconds if res.seconds else 0:.1f} tok/s, mean tree size {mean:.1f} nodes "
          f"({'greedy' if sp.greedy else 'sampling'} calibration: {p.calibration(sp.greedy).num_observed} nodes)")
    print(f"wrote {out}")
    if args.plot_dir:
        for path in save_tune_plots(p, res.tree_sizes, args.plot_dir, f"{Path(args.out).stem}-",
                                    title=f"{args.model} + {draft_name}"):
            print(f"wrote {path}")
    return 0


# ---- entry point ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="treespec", description="tree-attention speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_tree(sub)
    _add_train(sub)
    _add_capture(sub)
    _add_export(sub)
    _add_tune(sub)
    return parser


def main(argv=None) -> int:
    """Run one ``treespec`` command; Ctrl-C at any moment (parsing, imports, loading,
    generating) exits 130 with one line."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if argv is None:  # the process exits next: a second Ctrl-C must not print a traceback
            import signal

            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("treespec: interrupted", file=sys.stderr)
        return 130


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed as one line)
        return e.code if isinstance(e.code, int) else 0
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"treespec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
