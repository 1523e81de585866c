"""What the subcommands share and need no model for: defaults, argument groups (each flag
declared once), the checks that answer before torch loads, one-line errors and the one
progress adapter between the library's callbacks and the terminal. Nothing here imports torch
at module level: every subcommand module imports this one while the parser is built, ``--help``
included."""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__package__)  # "treespec.cli", the name -v and the tests know

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-instruct-eagle"
# generate's draft and tree when none is asked for: the shipped head with prompt lookup grafted on, auto trees.
DEFAULT_SPEC = f"{DEFAULT_DRAFT}+lookup"
DEFAULT_TREE = "auto"
MODEL_HELP = "target: a treespec name, HF id or path"
DRAFT_HELP = ("a shipped head name, an EAGLE head directory, 'ngram', 'layers:K' (the target's first K layers as a "
              "draft model) or 'model:NAME_OR_PATH'; any model drafter with '+lookup' appended also grafts prompt "
              "lookup onto its trees")


class UserError(Exception):
    """A mistake the user can fix: printed as one line, no traceback."""


# ---- argument groups ---------------------------------------------------------------------


def add_model(p, help: str = MODEL_HELP):
    p.add_argument("--model", default=DEFAULT_MODEL, help=help)


def add_pair(p):
    """--draft and --tree, one of each (generate, chat; bench takes several)."""
    p.add_argument("--draft", default=DEFAULT_SPEC,
                   help=DRAFT_HELP + " (default: %(default)s, the shipped head with prompt lookup)")
    p.add_argument("--tree", default=DEFAULT_TREE,
                   help="a preset name or a JSON tree file (default: %(default)s: each step verifies the tree that "
                        "pays most from this machine's measured verify costs and the draft's calibrated scores; "
                        "chain-3 is as fast, up to 5%% faster on chat with the shipped head, docs/benchmarks.md)")


def add_dataset(p):
    p.add_argument("--dataset", default="gsm8k",
                   help="gsm8k, humaneval, chat, spec-bench (Spec-Bench's six categories; one alone: "
                        "spec-bench:CATEGORY, e.g. spec-bench:qa) or a .jsonl file (default: %(default)s)")
    p.add_argument("--prompt-field", default=None, help="JSONL field holding the prompt (default: question for "
                   "gsm8k, prompt otherwise)")
    p.add_argument("--raw", action="store_true", help="use the prompts as plain text, without the chat template")
    p.add_argument("--num-prompts", type=int, default=10,
                   help="the first N prompts; for spec-bench N per category (default: %(default)s)")


def add_sampling(p, seed=None):
    g = p.add_argument_group("sampling (temperature 0: greedy, the default)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample at this temperature")
    g.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest tokens (off by default)")
    g.add_argument("--top-p", type=float, default=None,
                   help="sample among the likeliest tokens holding probability P, in (0, 1] (off by default)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than P times the likeliest one (off by default)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="the most tokens to generate per prompt")
    g.add_argument("--seed", type=int, default=seed,
                   help="sampling seed: fixes the output whatever the tree and drafter"
                        + (" (prompt i uses seed + i; default: %(default)s)" if seed is not None else ""))
    add_generation_options(p)


def add_generation_options(p):
    """--repetition-penalty, --no-repeat-ngram-size, --min-new-tokens, --stop (read back by generation_options)."""
    g = p.add_argument_group("generation options (transformers' semantics, exact at every tree node; "
                             "docs/generation.md)")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="X",
                   help="divide (multiply if negative) the logits of tokens already in the sequence by X")
    g.add_argument("--no-repeat-ngram-size", type=int, default=None, metavar="N",
                   help="never repeat an n-gram of N tokens")
    g.add_argument("--min-new-tokens", type=int, default=None, metavar="N", help="no EOS before N new tokens")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the answer when the text ends with TEXT (across token boundaries; repeatable)")


def generation_options(args) -> dict:
    """The generation-option flags that were given, as GenerationConfig fields."""
    fields = {"repetition_penalty": "repetition_penalty", "no_repeat_ngram_size": "no_repeat_ngram_size",
              "min_new_tokens": "min_new_tokens", "stop_strings": "stop"}
    return {k: getattr(args, flag) for k, flag in fields.items() if getattr(args, flag, None) is not None}


def fixed_shapes_of(args) -> bool | str:
    """The verify forward's ``fixed_shapes`` as the flags set it: compiled (--compile), captured
    in CUDA graphs with the head's passes (--cuda-graphs), else on each step's own shapes."""
    if getattr(args, "compiled", False):
        return "compile"
    return "graphs" if getattr(args, "cuda_graphs", False) else False


def add_runtime(p, *, device: str = "auto", dtype: str = "auto", pack: bool | None = None,
                graphs: bool = True, compile: bool = False):
    """--backend, --cuda-graphs (``graphs``: where a drafter runs), --compile (``compile``: generate
    and chat; bench has its own), --threads, --device, --dtype, --weights, --pack; ``tree show``
    passes cpu, float32 and no packing (what it always drew with), so its defaults stay."""
    def here(value, usual):
        return "" if value == usual else f" (default here: {value})"

    p.add_argument("--backend", choices=["auto", "torch", "split", "flex", "flashinfer"], default="auto",
                   help="tree attention backend (auto: FlashInfer on CUDA when installed and it takes the model's "
                        "dtype and head size, else torch; split: the prefix through a fused kernel without a mask, "
                        "the tree block masked, merged by log-sum-exp; flex: "
                        "PyTorch's flex_attention, compiled with triton on CUDA, nothing to install)")
    if graphs:  # not for capture, which runs the target alone
        p.add_argument("--cuda-graphs", action="store_true", help="on a CUDA GPU, replay the target's verify "
                       "forward (on fixed shapes, a graph a tree size) and the EAGLE head's passes (one request at a "
                       "time; other drafters run eagerly) from CUDA graphs")
    if compile:  # generate's and chat's; bench's --compile adds compiled twins instead
        p.add_argument("--compile", dest="compiled", action="store_true", help="compile the verify forward on fixed "
                       "shapes and an EAGLE head's passes (torch.compile; a process's first call compiles: up to 8 "
                       "minutes for the default's tree sizes on 2 cores, less in a later process from inductor's "
                       "on-disk cache, which dense weights cannot use; docs/runtime.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per physical core available; on a machine whose cores "
                        "other processes keep busy, fewer is much faster, often 1: see README, Threads)")
    p.add_argument("--device", default=device, help="where the model runs: auto (cuda when available), cpu, "
                                                     "cuda or cuda:N" + here(device, "auto"))
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=dtype,
                   help="weights and activations of the target and draft (probabilities and verification stay "
                        "fp32). auto: bfloat16 on a GPU or a CPU with native bf16 (AVX512-BF16/AMX), else float32"
                        + here(dtype, "auto"))
    p.add_argument("--weights", choices=["dense", "gguf", "int4", "int8", "gguf+dense", "int4+dense", "int8+dense"],
                   default="dense",
                   help="the target's linear layers: dense (in --dtype, the default); gguf, on the GGUF file's own "
                        "Q4_0/Q4_1/Q4_K/Q8_0 blocks (a .gguf model or a named one, as the default model is: exact to "
                        "the file's weights up to --dtype's rounding of their scales); int4 (groups of 32) or int8 "
                        "(a scale a row), quantized on load. Not dense: torch's CPU kernels, bfloat16 the fast "
                        "--dtype, the output head dense (gguf: on the file's blocks too), and the output that of the "
                        "model so quantized; X+dense: X for forwards up to the width where it measures faster, the "
                        "dense weights kept for wider ones (with --compile, X at every width; docs/runtime.md)")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=pack,
                   help="run the model's linear layers on oneDNN-packed weights (CPU; about 0.5 s to pack, doubles "
                        "the linear weights' memory); --no-pack: on plain weights. Default: whichever runs a verify "
                        "forward faster here, timed once at start-up per model, dtype, thread count and CPU (cached "
                        "with the cost curves; oneDNN packs fp32 always, bf16 with AVX512 or AVX-NE-CONVERT). In "
                        "bench, HF generate also runs on packed weights, and the faster of plain and packed is the "
                        "same-path baseline" + ("" if pack is None else " (default here: off)"))


def add_auto_profile(p):
    p.add_argument("--auto-profile", default=None, metavar="PROFILE.json",
                   help="for the auto tree: start from this profile (cost curve and calibration, from treespec tune) "
                        "instead of the disk-cached cost curve and the draft's own calibration (a head directory's "
                        "auto-profile.json, else the prior)")


# ---- checks that need no model --------------------------------------------------------------


def check_early(args):
    """Checks that need no model and no torch, so that these mistakes answer at once."""
    for flag, verb in (("prompt", "continue"), ("chat", "answer")):
        text = getattr(args, flag, None)
        if text is not None and not text.strip():
            raise UserError(f"--{flag} is empty: give the text to {verb}")
    for flag, least in (("max_new_tokens", 1), ("num_prompts", 1), ("lookup_tokens", 1), ("threads", 1),
                        ("prefix_cache_mb", 0)):
        value = getattr(args, flag, None)  # None: not this command's, or left to its default
        if value is not None and value < least:
            raise UserError(f"--{flag.replace('_', '-')} must be >= {least}, got {value}")
    if getattr(args, "compiled", False) and getattr(args, "cuda_graphs", False):
        raise UserError("--compile and --cuda-graphs both set how the EAGLE head's passes run: give one")
    device = getattr(args, "device", "auto")
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise UserError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")


def sampling(args):
    """The sampling flags as SamplingParams (after :func:`check_early`), or None for a command
    without them."""
    if not hasattr(args, "temperature"):
        return None
    from ..sampling_args import SamplingParams

    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    except ValueError as e:
        raise UserError(f"bad sampling values: {e}") from None


def auto_profile(args):
    """The --auto-profile file as an AutoProfile, or None."""
    if not getattr(args, "auto_profile", None):
        return None
    from ..auto import AutoProfile

    path = Path(args.auto_profile).expanduser()
    if not path.is_file():
        raise UserError(f"no auto profile at {args.auto_profile} (write one with treespec tune --out)")
    try:
        return AutoProfile.load(path)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"bad auto profile {args.auto_profile}: {e}") from None


def portable(arg: str) -> str:
    """An absolute path as it reads from here (relative under the working folder, ``~`` under
    home), so that recorded commands hold no machine's folders; other arguments unchanged."""
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("--"):
        return f"{flag}={portable(value)}"
    if not os.path.isabs(arg):
        return arg
    path, cwd, home = Path(arg), Path.cwd(), Path.home()
    if path.is_relative_to(cwd):
        return path.relative_to(cwd).as_posix() or "."
    if path.is_relative_to(home):
        return "~/" + path.relative_to(home).as_posix()
    return arg


def split_rows(loaded):
    """Where the target keeps dense copies beside quantized weights (``--weights X+dense``): up to
    which width the quantized ones run, measured under the weights treespec runs on
    (:func:`treespec.split_choice.choose_split_rows`, said in one line). Returns ``loaded``."""
    from ..models.quant import WidthSplitLinear

    if any(isinstance(m, WidthSplitLinear) for m in loaded.model.modules()):
        from ..split_choice import choose_split_rows

        with loaded.packed():
            choose_split_rows(loaded.model)
    return loaded
