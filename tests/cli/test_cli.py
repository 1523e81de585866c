"""The ``treespec`` command line: argument handling and one-line errors, bench's configurations
from its flags, paths recorded portably, the packing flags against the measured choice, text
streamed in whole characters, and help that names every option and default.

Tiny random llamas with a byte-level tokenizer that the tests build and save
(``helpers.tiny.save_tiny_lm``; no download, no shared/ folder)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from helpers.cli import error_line, pack_timings, run_cli
from treespec import cli
from treespec.assets import DRAFTS
from treespec.cli.bench import bench_pairs as _bench_pairs
from treespec.cli.common import portable as _portable
from treespec.text import TextStream

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

SHIPPED = "smollm2-135m-instruct-eagle"


# ---- argument handling ------------------------------------------------------------------


@pytest.mark.parametrize("sub", [[], ["generate"], ["chat"], ["bench"], ["tree"], ["tree", "show"], ["train-eagle"]])
def test_help_exits_zero(capsys, sub):
    rc, out, _ = run_cli(capsys, *sub, "--help")
    assert rc == 0
    assert "usage: treespec" in out


def test_unknown_preset_names_it_and_lists_known(capsys):
    rc, _, err = run_cli(capsys, "generate", "--tree", "bushy-9")
    assert rc == 2
    line = error_line(err)
    assert "'bushy-9'" in line
    for known in ("chain-3", "cpu", "cpu-tiny", "eagle1", "medusa-63"):
        assert known in line


def test_missing_tree_file(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "tree", "show", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.png"))
    assert rc == 2
    assert "no tree file" in error_line(err)
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("text, expect", [
    ("{[", "not valid JSON"),
    ('{"a": 1}', "list of child-rank paths"),
    ("[[0], [1, 1]]", "prefix [1] is missing"),  # a rank-1 child of a node that is not there
    ('[[0], ["x"]]', "list of child-rank paths"),
])
def test_bad_tree_json(capsys, tmp_path, text, expect):
    f = tmp_path / "t.json"
    f.write_text(text)
    rc, _, err = run_cli(capsys, "tree", "show", str(f), "--out", str(tmp_path / "x.png"))
    assert rc == 2
    assert expect in error_line(err)


@pytest.mark.parametrize("flags, expect", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "1", "--top-p", "1.5"], "top_p"),
    (["--top-k", "5"], "top_k"),  # top-k without sampling would be silently ignored
    (["--temperature", "abc"], "--temperature"),  # argparse's own error, also one line
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bad_sampling_values(capsys, flags, expect):
    for sub in ("generate", "bench"):
        rc, _, err = run_cli(capsys, sub, *flags)
        assert rc == 2
        assert expect in error_line(err)


def test_missing_shipped_head_says_use_ngram(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(DRAFTS, SHIPPED, (tmp_path / "absent", "not there"))
    rc, _, err = run_cli(capsys, "generate")
    assert rc == 2
    line = error_line(err)
    assert SHIPPED in line and "--draft ngram" in line


def test_missing_head_directory(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "--draft", str(tmp_path / "nohead"))
    assert rc == 2
    assert "no draft head" in error_line(err)


@pytest.mark.parametrize("flags, expect", [
    (["--draft", "ngram", "--dataset", "squad"], "unknown dataset 'squad'"),
    (["--draft", "ngram", "--dataset", "missing.jsonl"], "no dataset file"),
    (["--draft", "ngram", "--dataset", "spec-bench:poetry"], "unknown Spec-Bench category 'poetry'"),
    (["--config", "ngram"], "DRAFT@TREE"),
    (["--config", "ngram@cpu", "--draft", "ngram"], "--config"),
    (["--config", "ngram@nope"], "unknown tree preset 'nope'"),
])
def test_bench_user_errors(capsys, flags, expect):
    rc, _, err = run_cli(capsys, "bench", "--model", "smollm2-135m-instruct", *flags)
    assert rc == 2
    assert expect in error_line(err)


def bench_pairs(*argv):
    return _bench_pairs(cli.build_parser().parse_args(["bench", *argv]))


def test_bench_default_configs_are_generates_default_chain_3_and_the_head_alone():
    """The shipped head with prompt lookup grafted on and auto first (generate's default
    draft and tree), its chain-3 (the fastest fixed tree, level with auto,
    docs/benchmarks.md), and the head alone with auto."""
    hybrid = f"{SHIPPED}+lookup"
    assert bench_pairs() == [(hybrid, "auto"), (hybrid, "chain-3"), (SHIPPED, "auto")]
    args = cli.build_parser().parse_args(["generate"])
    assert (args.draft, args.tree) == (hybrid, "auto")
    readme = (Path(cli.__file__).parents[2] / "README.md").read_text()
    assert f"--config {hybrid}@auto" in readme and "--tree chain-3" in readme  # the default, the alternative


def test_bench_pairs_from_flags():
    assert bench_pairs("--draft", "ngram") == [("ngram", "chain-3"), ("ngram", "auto")]
    hybrid = f"{SHIPPED}+lookup"
    assert bench_pairs("--tree", "cpu") == [(hybrid, "chain-2"), (hybrid, "cpu")]
    assert bench_pairs("--chain", "0", "--tree", "eagle1") == [(hybrid, "eagle1")]
    assert bench_pairs("--config", "ngram@chain-3", "--config", f"{SHIPPED}@cpu") == [
        ("ngram", "chain-3"), (SHIPPED, "cpu")]


def test_bench_datasets_are_packaged(capsys, monkeypatch, tmp_path):
    """gsm8k and humaneval ship with treespec: no shared/ folder needed. A missing head
    directory makes the command stop right after the dataset check, before any model loads."""
    monkeypatch.setenv("TREESPEC_SHARED", str(tmp_path))  # a shared/ without data/
    for name in ("gsm8k", "humaneval"):
        rc, _, err = run_cli(capsys, "bench", "--dataset", name, "--draft", str(tmp_path / "no-head"))
        assert rc == 2
        line = error_line(err)
        assert "no draft head" in line and "shared" not in line


def test_recorded_paths_are_portable(monkeypatch, tmp_path):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _portable(str(tmp_path / "work" / "results" / "r.json")) == "results/r.json"
    assert _portable(f"--out={tmp_path / 'work' / 'r.json'}") == "--out=r.json"
    assert _portable(str(tmp_path / "home" / "d.jsonl")) == "~/d.jsonl"
    assert _portable("/elsewhere/d.jsonl") == "/elsewhere/d.jsonl"
    assert _portable("--num-prompts") == "--num-prompts" and _portable("gsm8k") == "gsm8k"


def test_text_stream_waits_for_whole_characters(lm):
    """Byte-level tokens of one character arrive one by one: nothing half-decoded is written."""
    import io

    _, tok = lm
    ids = tok("Zoë 🐶 ok", add_special_tokens=False)["input_ids"]
    buf = io.StringIO()
    s = TextStream(tok, buf)
    for t in ids:
        s.push([t])
        assert "\ufffd" not in buf.getvalue()
    s.push([], final=True)
    assert buf.getvalue() == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > len("Zoë 🐶 ok".split())  # the test really crossed token boundaries


def test_text_stream_returns_pieces_without_an_output(lm):
    _, tok = lm
    ids = tok("Zoë ok", add_special_tokens=False)["input_ids"]
    s = TextStream(tok)
    pieces = [s.push([t]) for t in ids] + [s.push([], final=True)]
    assert "".join(pieces) == s.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("flag, pack, measured", [(None, True, 1), (True, True, 0), (False, False, 0)])
def test_pack_flags_override_the_measured_choice(monkeypatch, tmp_path, lm, flag, pack, measured):
    """Default: measured (the injected timings decide, then the cached ones); --pack and
    --no-pack decide without measuring."""
    import argparse

    from treespec.cli.loading import Loaded, fast_path
    from treespec.packing import PackedLinears

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = pack_timings(monkeypatch, (30, 50), (40, 45))  # Intel fp32: tree faster packed, decode plain
    model, tok = lm
    fast, choice = fast_path(argparse.Namespace(pack=flag), model)
    assert choice.pack is pack and len(calls) == measured
    assert choice.source == ("measured" if flag is None else "given")
    assert isinstance(fast, PackedLinears) if pack else fast is None
    assert (choice.decode_packed is False) if flag is None else choice.decode_packed is None
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "elsewhere"))
    calls = pack_timings(monkeypatch, (30, 40), (40, 55))  # packing slows both
    fast_path(argparse.Namespace(pack=flag), model)  # measured, by default, and cached
    fast, choice = fast_path(argparse.Namespace(pack=flag), model, keep=True)
    assert choice.source == ("cached" if flag is None else "given") and len(calls) == measured
    assert choice.pack is (pack if flag is not None else False)
    ctx = Loaded(model, tok, fast=fast, packing=choice).packed()
    if flag is None:  # kept for bench's packed HF generate, yet treespec runs plain
        assert isinstance(fast, PackedLinears) and not choice.pack and isinstance(ctx, contextlib.nullcontext)
    else:
        assert ctx is fast if pack else isinstance(ctx, contextlib.nullcontext)


# ---- help -------------------------------------------------------------------------------


def command_parser(name):
    """The parser of ``treespec NAME``, its arguments declared (the table is lazy)."""
    import importlib

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    importlib.import_module(f"treespec.cli.{name.replace('-', '_')}").add_arguments(sub)
    if name == "tree":
        sub = next(a for a in sub._actions if a.dest == "tree_command").choices["show"]
    return sub


@pytest.mark.parametrize("name", ["generate", "chat", "train-eagle", "capture", "tune", "tree", "export"])
def test_every_option_has_help(name):
    """Issue 31: most of train-eagle's options had no help text."""
    bare = [a.option_strings[0] for a in command_parser(name)._actions
            if a.option_strings and a.help is None]
    assert not bare, f"{name}: {bare}"


@pytest.mark.parametrize("argv, shown", [
    (["generate", "--help"], ["--max-new-tokens MAX_NEW_TOKENS", "(default: 128)", "(default: 0.0)"]),
    (["chat", "--help"], ["--max-new-tokens MAX_NEW_TOKENS the most tokens to generate per prompt (default: 512)",
                          "(0: off) (default: 512)"]),
    (["train-eagle", "--help"], ["(default: 3)", "(default: 0.001)", "(default: eagle3)", "(default: 512)"]),
    (["capture", "--help"], ["(default: 0.8)", "(default: 64)"]),
    (["tree", "show", "--help"], ["(default: 100)"]),
])
def test_help_shows_defaults(capsys, argv, shown):
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0
    text = " ".join(out.split())  # argparse wraps lines
    for s in shown:
        assert s in text, s
    assert "(default: None)" not in text and "(default: False)" not in text
