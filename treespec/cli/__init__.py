"""The ``treespec`` command line.

    treespec generate [--model M] [--draft D] [--tree T] [--prompt TEXT | --chat TEXT] [--system TEXT] ...
    treespec chat [--model M] [--draft D] [--tree T] [--system TEXT] [--max-new-tokens N] ...
    treespec bench [--dataset gsm8k] [--draft D ...] [--tree T ...] [--out results.json] ...
    treespec tree show PRESET|TREE.json [--prompt TEXT --model M --draft D] --out tree.png
    treespec train-eagle --model M --out DIR [--budget 2h] | --data DATA.jsonl | --captured DIR ...
    treespec capture --data NAME[,NAME...] --out DIR [--max-examples N] [--sample-share 0.2] ...
    treespec make-prompts [--model M] --n N --work DIR --out DIR | --follow-ups CAPTURE[,...] | --templated
    treespec export --to vllm|sglang|eagle [--draft D] [--tree T] [--model M]
    treespec tune [--model M] [--draft D] [--dataset gsm8k] --out PROFILE.json [--plot-dir DIR]

A draft ``D`` is a shipped head name (``treespec.assets.DRAFTS``), an EAGLE head directory,
``ngram`` (prompt lookup, no model), ``layers:K`` (the target's first K layers),
``model:NAME_OR_PATH`` (an independent small LM) or ``none`` (no speculation: one token per
target forward through treespec's runner); a model drafter with ``+lookup`` appended also
grafts prompt lookup onto its trees. A tree ``T`` is a preset name (``treespec.PRESETS``),
``chain-K`` or a JSON file: a list of child-rank paths (``[[0], [1], [0, 0]]``),
``{"paths": [...]}`` or ``{"depth": 5, "top_k": 4, "num_nodes": 16}`` for a dynamic tree.

One module per subcommand, named in :data:`COMMANDS` with its one-line help; each has
``add_arguments(parser)`` and ``run(args)``. A command's module is imported only once the
command is chosen, and imports torch, transformers and the models only inside ``run``, so
``--help`` and usage errors answer before any of them load.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import warnings

__all__ = ["main", "build_parser", "COMMANDS"]

#: command -> its one-line help, in the order ``treespec --help`` lists them; the arguments
#: are declared by the module ``treespec.cli.<command, "-" as "_">``
COMMANDS = {
    "generate": "generate text with tree speculation, streamed to stdout",
    "chat": "chat with the model in the terminal, each answer streamed as it is decoded",
    "bench": "benchmark HF generate, HF prompt lookup and treespec side by side",
    "tree": "look at tree shapes",
    "train-eagle": "train an EAGLE draft head for a target model",
    "capture": "capture the target's own answers and features in resumable shards, for train-eagle",
    "make-prompts": "write training prompts: the target's own user turns (or follow-ups), or the templated sets",
    "export": "print how to serve an EAGLE-3 head with vLLM, SGLang or the EAGLE reference",
    "tune": "learn an auto-tree profile (cost curve, calibration) for a model/draft pair",
}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``treespec: error: ...``), exit code 2."""

    def error(self, message):
        self.exit(2, f"treespec: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each option's default, unless its help says it already or there is none
    (None, a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


class _LazyCommands(argparse._SubParsersAction):
    """Subcommands whose arguments their module declares when the command is chosen: the
    top-level ``--help`` needs only the table's help lines."""

    def __call__(self, parser, namespace, values, option_string=None):
        sub = self._name_parser_map.get(values[0])
        if sub is not None and not sub.get_default("func"):
            module = importlib.import_module(f"{__name__}.{values[0].replace('-', '_')}")
            module.add_arguments(sub)
            sub.set_defaults(func=module.run)
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="treespec", description="tree-attention speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--version", action="version", version=f"treespec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, action=_LazyCommands)
    for name, help in COMMANDS.items():
        command = sub.add_parser(name, help=help, formatter_class=_Help)
        # -v after the command too; SUPPRESS keeps one given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log progress details")
    return parser


def _version() -> str:
    """The installed treespec's version, read without importing treespec (and torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("treespec")
    except PackageNotFoundError:
        return "(not installed)"


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


def _import_torch() -> None:
    """Import torch and transformers, which every command but ``--help`` runs on, with Ctrl-C
    exiting 130 at once (its one line) while they load. Their imports are not interrupt-safe:
    a KeyboardInterrupt raised inside them can be swallowed (the command then ran on as if
    never interrupted), leave numpy half-loaded, or abort the process from C++ (pybind11's
    ``terminate``). Nothing has been written yet, so exiting loses nothing; afterwards Ctrl-C
    is a KeyboardInterrupt again (chat stops an answer with it)."""
    with _interrupts_exit_inside_imports():
        import torch  # noqa: F401
        import transformers  # noqa: F401


@contextlib.contextmanager
def _interrupts_exit_inside_imports():
    """While active, a SIGINT that lands inside an import exits 130 with its one line; one
    elsewhere raises KeyboardInterrupt as usual."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield  # not ours to change: SIGINT ignored (a background job) or handled by the caller
        return
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _on_interrupt(signum, frame):
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            with contextlib.suppress(Exception):  # a write the signal cut short may refuse a flush
                sys.stdout.flush()
            try:
                os.write(sys.stderr.fileno(), b"treespec: interrupted\n")
            except (OSError, ValueError, AttributeError):  # stderr replaced (a test's capture)
                print("treespec: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        frame = frame.f_back
    raise KeyboardInterrupt


def _main(argv) -> int:
    from .common import UserError, check_early

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed as one line)
        return e.code if isinstance(e.code, int) else 0
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # What a first run waits on is said, -v or not: auto measuring this machine's verify costs,
    # --compile compiling, the width of --weights X+dense, and the packing choice when it is measured
    # (-v: also the cached one it read).
    for name in ("treespec.costs", "treespec.fixed_shape", "treespec.split_choice"):
        logging.getLogger(name).setLevel(logging.INFO)
    logging.getLogger("treespec.pack_choice").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        check_early(args)  # mistakes that need no torch answer at once
        _import_torch()
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args) or 0
    except (UserError, FileNotFoundError, ValueError) as e:
        # The library's keywords, as the command line spells them.
        print(f"treespec: error: {e}".replace("allow_past_context=True", "--allow-past-context"), file=sys.stderr)
        return 2


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """treespec's own warnings (misuse the library runs anyway) as one line; others as Python
    shows them."""
    from ..warn import TreespecWarning

    if issubclass(category, TreespecWarning):
        text = str(message).replace("allow_past_context=True", "--allow-past-context")
        print(f"treespec: warning: {text}", file=file or sys.stderr)
    else:
        warnings._showwarning_orig(message, category, filename, lineno, file, line)
