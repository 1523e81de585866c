"""Where ``generate``'s prompt comes from: --prompt (plain text), --chat (a user message),
--prompt-file or text piped to stdin (a message), else the built-in message, said on stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import UserError, log

# A GSM8K-style word problem (GSM8K train, first record): the shipped head trained on them.
DEFAULT_CHAT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?"
)


def add_prompt_source(p, prompt_help: str, chat_help: str):
    """--prompt and --chat, one or the other; returns the group, for a command's own sources."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=prompt_help)
    src.add_argument("--chat", help=chat_help)
    return src


def add_system(p, where: str):
    p.add_argument("--system", metavar="TEXT", help=f"a system prompt before the conversation ({where}; default: "
                   "the chat template's own, if it has one)")


def check_system(args) -> None:
    """--system's mistakes, before any model loads."""
    system = getattr(args, "system", None)
    if system is not None and not system.strip():
        raise UserError("--system is empty: give the system prompt, or leave the flag out")
    if system is not None and getattr(args, "prompt", None) is not None:
        raise UserError("--system goes before a chat message: use --chat TEXT, not --prompt (plain text)")


def read_message(args) -> None:
    """Without --prompt or --chat: the message of --prompt-file, else of stdin when it is piped
    (``echo "Tell me about Paris" | treespec generate``), as ``args.message`` with
    ``args.message_from`` naming where it came from; None (the built-in message) otherwise.
    Read before any model loads, so that a missing file answers at once."""
    check_system(args)
    args.message = args.message_from = None
    if args.prompt is not None or args.chat is not None:
        return
    path = getattr(args, "prompt_file", None)
    if path is not None:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"--prompt-file {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--prompt-file {path}: cannot read it as UTF-8 text ({e})") from None
        if not text.strip():
            raise UserError(f"--prompt-file {path} is empty: give the text to answer")
        args.message, args.message_from = text, f"--prompt-file {path}"
        return
    stdin = sys.stdin
    if stdin is None or stdin.isatty() or not stdin.readable():
        return
    try:
        text = stdin.read()
    except OSError:  # a stdin that cannot be read (closed, or a test runner's)
        return
    if text.strip():  # an empty pipe (< /dev/null, a cron job) means no prompt: the built-in one
        args.message, args.message_from = text, "stdin"


def prompt_ids(tokenizer, args, model_name: str) -> list[int]:
    """--prompt as plain text, --chat through the chat template; else the message read from
    --prompt-file or stdin (:func:`read_message`), through the chat template when the model has
    one; else the built-in message, shown on stderr so that nobody mistakes it for theirs."""
    from ..prompts import encode_prompt

    has_template = bool(getattr(tokenizer, "chat_template", None))
    system = getattr(args, "system", None)
    if system is not None and not has_template:
        raise UserError(f"{model_name} has no chat template: --system needs one")
    message = getattr(args, "message", None)
    if message is not None:
        text = message.strip() if has_template else message.rstrip("\n")
        print(f"treespec: the prompt from {args.message_from} ({len(text)} characters), "
              + ("as a chat message" if has_template else "as plain text (the model has no chat template)"),
              file=sys.stderr)
        ids = encode_prompt(tokenizer, text, chat=has_template, system=system)
        if not ids:
            raise UserError(f"the prompt from {args.message_from} encodes to no tokens with {model_name}'s tokenizer")
        return ids
    if args.prompt is not None:
        ids = encode_prompt(tokenizer, args.prompt, chat=False)
        if not ids:
            raise UserError(f"--prompt {args.prompt!r} encodes to no tokens with {model_name}'s tokenizer")
        return ids
    if args.chat is not None:
        if not has_template:
            raise UserError(f"{model_name} has no chat template: use --prompt TEXT")
        return encode_prompt(tokenizer, args.chat, chat=True, system=system)
    if not has_template:
        log.warning("%s has no chat template: the built-in message is used as plain text", model_name)
    print(f"treespec: no prompt given (--chat TEXT, --prompt TEXT, --prompt-file FILE or text on stdin), so the "
          f"built-in one: {DEFAULT_CHAT!r}", file=sys.stderr)
    return encode_prompt(tokenizer, DEFAULT_CHAT, chat=has_template, system=system)
