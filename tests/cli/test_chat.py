"""``treespec chat``: a session in a pseudo-terminal (two turns, /stats, Ctrl-C during an
answer, a turn after it, Ctrl-D), the same commands piped, the conversation each turn
encodes (the stopped answer kept, --system first), the model's context, and the one place
chat meets the prefix cache. On a tiny random llama with a ChatML template that the tests
save (``tiny.save_tiny_lm``); its answers are random bytes, so a screen is checked by its
prompts, notes and table, and the piped answers against HF generate."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import treespec
import treespec.engine
from helpers.references import hf_greedy_text
from helpers.tiny import CHATML, save_tiny_lm
from treespec import cli, models
from treespec.cli import chat as cli_chat
from treespec.prompts import encode_conversation, encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
FLAGS = ["--draft", "ngram", "--tree", "chain-2", "--dtype", "float32", "--threads", "1"]
STATS_ROW = re.compile(r"^ +(\d+) +(\d+) +(\S+) +(\d+) +([0-9.]+) +(\S+) +(\S+)( +stopped)?$")


def stats_rows(text: str) -> list[tuple]:
    """/stats' rows as (turn, prompt, hit, tokens, stopped)."""
    rows = [STATS_ROW.match(ln.rstrip("\r")) for ln in text.splitlines()]
    return [(int(m[1]), int(m[2]), m[3], int(m[4]), bool(m[8])) for m in rows if m]


# ---- in a terminal -----------------------------------------------------------------------


class Terminal:
    """A command on a pseudo-terminal, its controlling terminal, so that ``\\x03`` is a SIGINT
    and ``\\x04`` at the line's start an end of input, as from a keyboard."""

    def __init__(self, argv: list[str]):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the command at once
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # as from a terminal, also under a background job
                os.execve(sys.executable, [sys.executable, *argv], ENV)
            finally:
                os._exit(127)
        self.raw = b""

    @property
    def screen(self) -> str:
        return self.raw.decode("utf-8", "replace")

    def read(self, timeout: float) -> bool:
        """More output, False at the command's end."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return True
        try:
            data = os.read(self.fd, 1 << 16)
        except OSError:  # EIO: the command closed the terminal
            return False
        self.raw += data
        return bool(data)

    def expect(self, text: str, after: int = 0, timeout: float = 120) -> int:
        """The screen's position just past ``text``'s first appearance after ``after``."""
        deadline = time.monotonic() + timeout
        while (i := self.screen.find(text, after)) < 0:
            assert time.monotonic() < deadline and self.read(0.2), f"no {text!r} on the screen: {self.screen!r}"
        return i + len(text)

    def type(self, keys: str):
        os.write(self.fd, keys.encode())

    def close(self, timeout: float = 60) -> int:
        """Read to the end; the exit status (-9: the command was still running, and killed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.read(0.2):
            pass
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:  # still running
            os.kill(self.pid, signal.SIGKILL)
            _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def test_chat_in_a_terminal(chat_lm_dir):
    n = 300  # new tokens per answer: seconds with one token per forward, so Ctrl-C lands inside one
    t = Terminal(["-m", "treespec.cli", "chat", "--model", chat_lm_dir, "--draft", "none", "--tree", "chain-1",
                  "--dtype", "float32", "--threads", "1", "--max-new-tokens", str(n)])
    try:
        pos = t.expect("/help lists the commands, Ctrl-D or /exit ends")
        pos = t.expect(">>> ", pos)
        for line in ("Once upon a time", "The dog ran to the park"):
            t.type(line + "\r")
            pos = t.expect(">>> ", t.expect(line + "\r\n", pos))  # echoed, answered, asked again
        t.type("/stats\r")
        pos = t.expect(">>> ", pos)
        assert [(r[0], r[3], r[4]) for r in stats_rows(t.screen[:pos])] == [(1, n, False), (2, n, False)]

        t.type("Tell me a long story\r")
        pos = t.expect("Tell me a long story\r\n", pos)
        while len(t.screen) <= pos + 8:  # the answer is streaming
            assert t.read(0.2)
        t.type("\x03")
        pos = t.expect("treespec: answer stopped; what was shown stays in the conversation", pos)
        pos = t.expect(">>> ", pos)  # the session goes on
        t.type("And then?\r")
        echo = t.expect("And then?\r\n", pos)
        pos = t.expect(">>> ", echo)
        assert len(t.screen[echo:pos].strip()) > 0  # answered
        t.type("/stats\r")
        pos = t.expect(">>> ", pos)
        rows = stats_rows(t.screen[t.screen.rfind("turn  prompt"):pos])
        assert [r[0] for r in rows] == [1, 2, 3, 4]
        assert rows[2][4] and 0 < rows[2][3] < n  # stopped part-way
        assert rows[3][3] == n and not rows[3][4]
        assert rows[0][2] == "0" and all(int(r[2]) > 0 for r in rows[1:])  # later turns read earlier ones from the cache

        t.type("\x04")
        t.expect("treespec: chat ended (end of input)", pos)
    finally:
        rc = t.close()
    assert rc == 0, t.screen
    assert "Traceback" not in t.screen


def test_ctrl_c_at_the_prompt_ends_the_session(chat_lm_dir):
    t = Terminal(["-m", "treespec.cli", "chat", "--model", chat_lm_dir, *FLAGS])
    try:
        t.expect(">>> ")
        # Not at once: a SIGINT between input() printing the prompt and readline waiting for keys
        # waits for the next key (CPython's readline checks signals when its wait is interrupted).
        time.sleep(0.5)
        t.type("\x03")
        t.expect("treespec: chat ended (Ctrl-C)")
    finally:
        rc = t.close()
    assert rc == 0, t.screen


# ---- piped -------------------------------------------------------------------------------


def test_chat_piped_answers_the_conversation(chat_lm, chat_lm_dir):
    """Each turn answers the whole conversation through the template, as HF generate does."""
    model, tok = chat_lm
    n, u1, u2 = 12, "Once upon a time", "The dog ran"
    lines = [u1, "/stats", u2, "/nonsense", "/reset", u1, "/stats", "/help"]
    p = subprocess.run([sys.executable, "-m", "treespec.cli", "chat", "--model", chat_lm_dir, *FLAGS,
                        "--max-new-tokens", str(n)], input="".join(ln + "\n" for ln in lines),
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    first = encode_conversation(tok, [u1], [], chat=True)
    a1 = hf_greedy_text(model, tok, first, n)
    second = encode_conversation(tok, [u1, u2], [a1.strip()], chat=True)
    a2 = hf_greedy_text(model, tok, second, n)
    assert p.stdout.startswith(a1 + "\n" + "turn  prompt")  # no prompt echoed off a terminal
    after_stats = p.stdout.index("tau: tokens per target forward\n") + len("tau: tokens per target forward\n")
    assert p.stdout[after_stats:].startswith(a2 + "\n" + a1 + "\n")  # /reset: the first question again
    rows = stats_rows(p.stdout)[-3:]
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [(1, len(first), n, False), (2, len(second), n, False),
                                                        (3, len(first), n, False)]
    # The prefix cache: the first turn finds nothing; the second reads the first's pages, and the
    # first question asked again after /reset reads its own (whole pages, the last token recomputed).
    assert rows[0][2] == "0" and 0 < int(rows[1][2]) < len(second) and 0 < int(rows[2][2]) < len(first)
    assert p.stdout.rstrip().endswith(cli_chat.HELP.rstrip())
    cut = f"treespec: the answer was cut at --max-new-tokens ({n}); it stays in the conversation as shown"
    notes = p.stderr.splitlines()
    assert notes.count(cut) == 3  # each answer ran to the budget (no EOS)
    assert [x for x in notes if x != cut][-3:] == ["treespec: unknown command /nonsense (/help lists them)",
                                                   "treespec: conversation cleared",
                                                   "treespec: chat ended (end of input)"]


# ---- in process: what each turn encodes ----------------------------------------------------


def run_chat(capsys, monkeypatch, lines: list[str], *argv):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(ln + "\n" for ln in lines)))
    rc = cli.main(["chat", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def encoded(monkeypatch):
    """Every conversation chat encodes, as (turns, answers, system)."""
    calls = []

    def record(tok, turns, answers, chat, system=None):
        calls.append((list(turns), list(answers), system))
        return encode_conversation(tok, turns, answers, chat, system)

    monkeypatch.setattr("treespec.prompts.encode_conversation", record)
    return calls


@pytest.mark.parametrize("steps_shown", [3, 0])
def test_a_stopped_answer_stays_in_the_conversation(capsys, monkeypatch, encoded, chat_lm_dir, steps_shown):
    """Ctrl-C after some text keeps that text as the reply; before any, the message goes too."""
    real, calls = treespec.engine.stream, []

    def stopped_once(*a, **kw):
        calls.append(1)
        for k, out in enumerate(real(*a, **kw)):
            if len(calls) == 1 and k == steps_shown:
                raise KeyboardInterrupt
            yield out

    monkeypatch.setattr("treespec.engine.stream", stopped_once)
    rc, out, err = run_chat(capsys, monkeypatch, ["first", "second"], "--model", chat_lm_dir, *FLAGS,
                            "--system", "Be brief.", "--max-new-tokens", "20")
    assert rc == 0
    if steps_shown:
        assert "treespec: answer stopped; what was shown stays in the conversation" in err
        turns, (partial,), system = encoded[1]
        assert turns == ["first", "second"] and system == "Be brief."
        assert partial and out.lstrip().startswith(partial)
    else:
        assert "treespec: answer stopped; nothing was shown, so the message is dropped" in err
        assert encoded[1] == (["second"], [], "Be brief.")
    assert err.rstrip().endswith("treespec: chat ended (end of input)")


def test_the_context_bounds_each_answer(capsys, monkeypatch, chat_lm, tmp_path):
    """An answer stops at the model's context, and a conversation that fills it asks for /reset."""
    tok = chat_lm[1]
    room = 6
    small = save_tiny_lm(tmp_path / "small", chat_template=CHATML,
                         max_position_embeddings=len(encode_prompt(tok, "Once", chat=True)) + room)
    rc, out, err = run_chat(capsys, monkeypatch, ["Once", "again", "/stats"], "--model", str(small), *FLAGS)
    assert rc == 0
    assert "treespec: the answer reached the model's context of" in err
    assert "treespec: the conversation fills the model's context of" in err
    assert [r[3] for r in stats_rows(out)] == [room]  # the second turn was not asked


def test_the_prefix_cache_serves_the_second_turn_and_changes_no_answer(capsys, monkeypatch, chat_lm_dir):
    """The session's PrefixCache (issue 28): the second turn reads the first from the cache
    (hit tokens in /stats), and the answers are those of a chat without a cache."""
    turns = ["one", "two", "/stats"]
    rc, cached, _ = run_chat(capsys, monkeypatch, turns, "--model", chat_lm_dir, *FLAGS, "--prefix-cache-mb", "64",
                             "--max-new-tokens", "8")
    assert rc == 0
    rc, plain, _ = run_chat(capsys, monkeypatch, turns, "--model", chat_lm_dir, *FLAGS, "--prefix-cache-mb", "0",
                            "--max-new-tokens", "8")
    assert rc == 0
    def answers(out):  # everything but /stats' rows (its header is the same either way)
        return [ln for ln in out.splitlines() if not STATS_ROW.match(ln.rstrip("\r"))]

    assert answers(cached) == answers(plain)
    hits = [r[2] for r in stats_rows(cached)]
    assert hits[0] == "0" and int(hits[1]) > 0
    assert [r[2] for r in stats_rows(plain)] == ["-", "-"]


# ---- --system and the checks before loading -----------------------------------------------


def test_system_prompt_comes_first(chat_lm):
    tok = chat_lm[1]
    ids = encode_conversation(tok, ["hi", "more"], ["hello"], chat=True, system="Be brief.")
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                               "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert tok.decode(encode_prompt(tok, "hi", chat=False, system="Be brief."), skip_special_tokens=True) \
        == "Be brief.\n\nhi"


def test_generate_chat_with_a_system_prompt(capsys, chat_lm, chat_lm_dir):
    rc = cli.main(["generate", "--model", chat_lm_dir, *FLAGS, "--chat", "Hi", "--system", "Be brief.",
                   "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out == hf_greedy_text(*chat_lm, encode_prompt(chat_lm[1], "Hi", chat=True, system="Be brief."), 8) + "\n"


@pytest.mark.parametrize("argv, expect", [
    (["chat", "--system", " "], "--system is empty"),
    (["chat", "--prefix-cache-mb", "-1"], "--prefix-cache-mb must be >= 0"),
    (["chat", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "Hi", "--system", "Be brief."], "--system goes before a chat message"),
])
def test_chat_flags_checked_before_loading(capsys, monkeypatch, argv, expect):
    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", load)
    assert cli.main(argv + ["--draft", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treespec: error: ") and expect in err and "\n" not in err


def test_chat_needs_a_chat_template(capsys, monkeypatch, tmp_path):
    plain = save_tiny_lm(tmp_path / "plain")
    rc, _, err = run_chat(capsys, monkeypatch, ["hi"], "--model", str(plain), *FLAGS)
    assert rc == 2 and "has no chat template, which treespec chat needs" in err


# ---- one cost measurement a session, and no log line inside the conversation (issue 50) ----

NOISY_CHAT = """
import logging, sys
import treespec.costs as costs, treespec.engine as engine
from treespec.cli import main

measured = []
def noisy(runner, max_tokens):  # as on a busy machine: not written to the disk cache
    measured.append(max_tokens)
    return costs.CostCurve((1, max_tokens), (1e-5, 2e-5), spread=float("inf"))

real = engine.stream
def stream(*a, **k):  # a library note on every call: the warm-up's, then one a turn
    logging.getLogger("treespec.engine").warning("a note from call %d", len(calls))
    calls.append(1)
    yield from real(*a, **k)

calls = []
costs.measure_cost_curve, engine.stream = noisy, stream
code = main(sys.argv[1:])
print("MEASURED", len(measured), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("log_file", [False, True])
def test_a_chat_measures_once_and_keeps_log_lines_out_of_the_conversation(chat_lm_dir, tmp_path, log_file):
    """Issue 50: chat measured the verify cost again on every turn (a noisy curve is not cached
    on disk) and printed the log block into the conversation each time."""
    log = tmp_path / "chat.log"
    argv = ["chat", "--model", chat_lm_dir, "--draft", "ngram", "--tree", "auto", "--dtype", "float32", "--threads", "1",
            "--max-new-tokens", "6", "--prefix-cache-mb", "0", *(["--log-file", str(log)] if log_file else [])]
    p = subprocess.run([sys.executable, "-c", NOISY_CHAT, *argv], input="Once upon a time\nThe dog ran\n/stats\n",
                       capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    err = p.stderr.splitlines()
    assert "MEASURED 1" in err  # the warm-up's, reused by both turns
    banner = next(i for i, ln in enumerate(err) if ln.startswith("treespec: chat with"))
    assert any("mostly noise" in ln for ln in err[:banner])  # said before the conversation
    assert any("a note from call 0" in ln for ln in err[:banner])  # the warm-up's note, also before it
    ended = err.index("treespec: chat ended (end of input)")
    inside = err[banner + 1:ended]
    held = [i for i, ln in enumerate(inside) if ln.startswith("treespec: log lines held back")]
    conversation = inside[:held[0]] if held else inside
    assert not [ln for ln in conversation if ln.startswith(("WARNING", "INFO"))], p.stderr
    assert "WARNING" not in p.stdout and len(stats_rows(p.stdout)) == 2
    notes = ["WARNING treespec.engine: a note from call 1", "WARNING treespec.engine: a note from call 2"]
    if log_file:
        assert not held
        assert [ln.split(" ", 2)[2] for ln in log.read_text().splitlines()] == notes  # after the time stamp
    else:
        assert inside[held[0] + 1:] == notes
