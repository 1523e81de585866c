"""``treespec chat``: a conversation in the terminal, each answer streamed as steps commit it.

Each turn encodes the whole conversation (``--system`` first) through the chat template and
decodes it with the flags' draft, tree and sampling, as ``treespec generate --chat`` decodes one
message. A line starting with ``/`` is a command (:data:`HELP`). stdin need not be a terminal:
piped lines are turns and commands alike; answers, /stats and /help go to stdout, notes to stderr.

Ctrl-C during an answer stops it, and what was shown stays in the conversation as the
assistant's reply: it is what the user read and may refer to next (an answer stopped before any
text drops its message too). Ctrl-C at the prompt, end of input (Ctrl-D) and /exit end the
session, with one line on stderr and exit status 0.

An ``auto`` tree's costs are measured once, before the conversation, and one profile learns
from every turn; log lines stay out of the conversation (:mod:`.notes`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

from .common import UserError, add_auto_profile, add_model, add_pair, add_runtime, add_sampling
from .notes import held_notes
from .prompt_source import add_system, check_system

PROMPT = ">>> "
HELP = """\
/stats   each answer of the session (/reset keeps them): prompt tokens, of them served by the
         prefix cache (hit), new tokens, time to first token, tokens/s after it, tau (mean tokens
         committed per target forward)
/reset   forget the conversation (the system prompt stays)
/help    this list
/exit    end the session (or /quit, Ctrl-D, Ctrl-C at the prompt)
Ctrl-C during an answer stops it; what was shown stays in the conversation."""

LEGEND = ("hit: prompt tokens the prefix cache served ('-': no cache); ttft: time to first token; tok/s: after the "
          "first token; tau: tokens per target forward")


def add_arguments(p):
    p.description = ("Chat with the model: each answer streams as tree speculation decodes it, the conversation "
                     "so far (through the chat template) is every turn's prompt. Commands: /stats, /reset, /help, "
                     "/exit. Reads lines from stdin when it is not a terminal (answers on stdout).")
    add_model(p)
    add_pair(p)
    add_system(p, "/reset keeps it")
    p.add_argument("--prefix-cache-mb", type=int, default=512, metavar="MB",
                   help="memory for the prefix cache, which keeps the conversation's K/V from turn to turn so that "
                        "a turn prefills only its new tokens (0: off)")
    add_sampling(p)
    p.set_defaults(max_new_tokens=512)  # per answer
    add_runtime(p, compile=True)
    add_auto_profile(p)
    p.add_argument("--log-file", metavar="FILE", help="what is logged during the conversation goes to FILE (default: "
                   "held back and shown when the session ends; -v shows it as it comes)")


def run(args):
    from ..prefix_cache import PrefixCache
    from .loading import check, load, stream_options

    sp, trees = check(args, [args.tree], [args.draft], then=[lambda: check_system(args)])
    cfg, tree_name = trees[args.tree]
    options = stream_options(args, sp, cfg)
    loaded = load(args, [args.draft])
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise UserError(f"{args.model} has no chat template, which treespec chat needs (treespec generate --prompt "
                        "continues plain text)")
    drafter, draft_name = loaded.drafters[args.draft]
    cache = PrefixCache(max_bytes=args.prefix_cache_mb << 20) if args.prefix_cache_mb > 0 else None
    chat = Chat(loaded, drafter, cfg, options, args.system, cache)
    with loaded.packed():
        chat.warm_up()
        print(f"treespec: chat with {args.model} (draft {draft_name}, tree {tree_name}); /help lists the commands, "
              "Ctrl-D or /exit ends", file=sys.stderr, flush=True)
        with held_notes(args.verbose, args.log_file):
            why = chat.loop()
    print(f"treespec: chat ended ({why})", file=sys.stderr, flush=True)
    return 0


@dataclass
class Turn:
    """One answer's figures, as /stats shows them."""

    prompt: int  # tokens of the conversation the answer followed
    hits: int | None  # of them, served by the prefix cache (None: no cache)
    tokens: int  # new tokens
    ttft: float  # seconds from the request to the first token
    rate: float | None  # tokens/s after the first token (None: one token)
    tau: float | None  # mean tokens committed per target forward (None: no forward after prefill)
    stopped: bool  # by Ctrl-C
    ended: bool = False  # by an EOS (not by the token budget or Ctrl-C)


class Chat:
    """The session: the conversation as (user turn, answer) pairs, the figures of every answer,
    and the loop that reads lines and answers them."""

    def __init__(self, loaded, drafter, cfg, options: dict, system: str | None, cache):
        """``cache``: the session's :class:`treespec.PrefixCache`, or None (--prefix-cache-mb 0)."""
        self.model, self.tokenizer, self.drafter, self.cfg = loaded.model, loaded.tokenizer, drafter, cfg
        self.options, self.system, self.cache = options, system, cache
        self.history: list[tuple[str, str]] = []  # one append per turn: a Ctrl-C cannot leave half of one
        self.stats: list[Turn] = []
        self.tty = sys.stdin.isatty()
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        from ..engine.request import eos_set as _eos_set

        self.eos = _eos_set(self.model, None)  # the model's, as the engine reads it

    def warm_up(self) -> None:
        """For an auto tree: the session's profile (what one turn learns serves the next) and its
        cost curve, measured or read before the conversation, not inside the first answer."""
        from ..auto import AutoProfile
        from ..engine import stream
        from ..prompts import encode_conversation

        if self.cfg.auto:
            profile = self.options["auto_profile"] = self.options["auto_profile"] or AutoProfile.starting(self.drafter)
            ids = encode_conversation(self.tokenizer, ["Hi"], [], chat=True, system=self.system)
            for _ in stream(self.model, self.drafter, self.cfg, ids, max_new_tokens=1,  # outside the prefix cache
                            attention_backend=self.options["attention_backend"], auto_profile=profile):
                pass

    def loop(self) -> str:
        """Lines until the session ends; returns why it ended."""
        if self.tty:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (input() gains line editing and history)
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                return self.end("Ctrl-C")
            if line is None:
                return self.end("end of input")
            line = line.strip()
            try:
                if line in ("/exit", "/quit"):
                    return line
                if line.startswith("/"):
                    self.command(line)
                elif line:
                    self.say(line)
            except KeyboardInterrupt:  # outside the answer's stream (encoding, a note): the turn is not kept
                print("\ntreespec: stopped", file=sys.stderr, flush=True)

    def read(self) -> str | None:
        """The next line, None at end of input."""
        if not self.tty:
            return sys.stdin.readline() or None
        try:
            return input(PROMPT)
        except EOFError:
            return None

    def end(self, why: str) -> str:
        if self.tty:  # the cursor is still on the prompt's line
            print(flush=True)
        return why

    def command(self, line: str) -> None:
        if line == "/reset":
            self.history = []
            print("treespec: conversation cleared", file=sys.stderr, flush=True)
        elif line == "/stats":
            print(stats_table(self.stats), flush=True)
        elif line == "/help":
            print(HELP, flush=True)
        else:
            print(f"treespec: unknown command {line.split()[0]} (/help lists them)", file=sys.stderr, flush=True)

    def say(self, text: str) -> None:
        """One user turn: the conversation so far and ``text`` as the prompt, the answer streamed."""
        from ..prompts import encode_conversation

        turns, answers = [t for t, _ in self.history], [a for _, a in self.history]
        ids = encode_conversation(self.tokenizer, [*turns, text], answers, chat=True, system=self.system)
        wanted = self.options["max_new_tokens"]
        budget = min(wanted, self.context - len(ids)) if self.context else wanted
        if budget < 1:
            print(f"treespec: the conversation fills the model's context of {self.context} tokens: /reset starts "
                  "a new one", file=sys.stderr, flush=True)
            return
        answer, turn, stopped = self.answer(ids, budget)
        if turn is not None:
            self.stats.append(turn)
        if stopped:
            print("treespec: answer stopped; " + ("what was shown stays in the conversation" if answer else
                                                  "nothing was shown, so the message is dropped"),
                  file=sys.stderr, flush=True)
        elif budget < wanted and turn.tokens == budget:
            print(f"treespec: the answer reached the model's context of {self.context} tokens: /reset starts a new "
                  "conversation", file=sys.stderr, flush=True)
        elif turn.tokens == wanted and not turn.ended:
            print(f"treespec: the answer was cut at --max-new-tokens ({wanted}); it stays in the conversation as shown",
                  file=sys.stderr, flush=True)
        if answer or not stopped:
            self.history.append((text, answer))

    def answer(self, ids: list[int], budget: int) -> tuple[str, Turn | None, bool]:
        """Stream the answer to ``ids`` to stdout; returns its text, its figures (None when it
        was stopped before the first token) and whether Ctrl-C stopped it."""
        from ..engine import stream
        from ..text import TextStream

        shown = TextStream(self.tokenizer, sys.stdout)
        options = {**self.options, "max_new_tokens": budget, "prefix_cache": self.cache}
        metrics, ttft, stopped, last = None, 0.0, False, None
        start = time.perf_counter()
        steps = stream(self.model, self.drafter, self.cfg, ids, tokenizer=self.tokenizer, **options)
        try:
            with contextlib.closing(steps):  # a stop between steps still ends the loop's contexts
                for out in steps:
                    if metrics is None:
                        ttft = time.perf_counter() - start
                    metrics = out.metrics
                    shown.push(out.tokens[0])
                    last = out.tokens[0][-1] if out.tokens[0] else last
            shown.push([], final=True)
        except KeyboardInterrupt:
            stopped = True
        sys.stdout.write("\n\n" if self.tty and not stopped else "\n")
        sys.stdout.flush()
        answer = shown.text.strip()  # what was shown: a stop can leave a character's first bytes unshown
        if metrics is None:
            return answer, None, stopped
        r = metrics.requests[0]
        hits = None if self.cache is None else r.hit_tokens
        return answer, Turn(len(ids), hits, r.num_generated, ttft,
                            metrics.decode_tokens_per_second if r.num_generated > 1 else None,
                            r.mean_accepted_length if r.accepted else None, stopped, last in self.eos), stopped


def stats_table(stats: list[Turn]) -> str:
    if not stats:
        return "no answers yet"

    def cell(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    rows = [f"{'turn':>4} {'prompt':>7} {'hit':>7} {'tokens':>7} {'ttft s':>7} {'tok/s':>7} {'tau':>5}"]
    rows += [f"{n:>4} {t.prompt:>7} {cell(t.hits, 'd'):>7} {t.tokens:>7} {t.ttft:>7.2f} {cell(t.rate, '.1f'):>7} "
             f"{cell(t.tau, '.2f'):>5}" + ("  stopped" if t.stopped else "") for n, t in enumerate(stats, 1)]
    return "\n".join([*rows, LEGEND])
