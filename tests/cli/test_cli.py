"""The ``treespec`` command line: argument handling, one-line errors, and short end-to-end
runs of ``generate``, ``bench`` and ``tree show`` on a tiny random llama with a byte-level
tokenizer that the tests build and save (``tiny.save_tiny_lm``; no download, no shared/
folder). One test needs real text (prompt lookup must find a repeat in the target's own
continuation) and runs on stories260K, from the project's shared/ folder where there is one."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

from treespec import cli
from treespec.assets import DRAFTS
from treespec.bench import format_table
from treespec.cli.bench import bench_pairs as _bench_pairs
from treespec.cli.common import portable as _portable
from treespec.drafters import RecordingDrafter
from treespec.text import TextStream

from helpers.references import hf_greedy_text
from helpers.tiny import STORIES260K_MISSING, stories260k_gguf, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

PNG = b"\x89PNG\r\n\x1a\n"
SHIPPED = "smollm2-135m-instruct-eagle"

needs_stories = pytest.mark.skipif(stories260k_gguf() is None, reason=STORIES260K_MISSING)


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(err: str) -> str:
    """The single ``treespec: error:`` line of a failed command (progress bars aside)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one error line, got {lines}"
    assert lines[0].startswith("treespec: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


# ---- argument handling ------------------------------------------------------------------


@pytest.mark.parametrize("sub", [[], ["generate"], ["chat"], ["bench"], ["tree"], ["tree", "show"], ["train-eagle"]])
def test_help_exits_zero(capsys, sub):
    rc, out, _ = run(capsys, *sub, "--help")
    assert rc == 0
    assert "usage: treespec" in out


def test_unknown_preset_names_it_and_lists_known(capsys):
    rc, _, err = run(capsys, "generate", "--tree", "bushy-9")
    assert rc == 2
    line = error_line(err)
    assert "'bushy-9'" in line
    for known in ("chain-3", "cpu", "cpu-tiny", "eagle1", "medusa-63"):
        assert known in line


def test_missing_tree_file(capsys, tmp_path):
    rc, _, err = run(capsys, "tree", "show", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.png"))
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
    rc, _, err = run(capsys, "tree", "show", str(f), "--out", str(tmp_path / "x.png"))
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
        rc, _, err = run(capsys, sub, *flags)
        assert rc == 2
        assert expect in error_line(err)


def test_missing_shipped_head_says_use_ngram(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(DRAFTS, SHIPPED, (tmp_path / "absent", "not there"))
    rc, _, err = run(capsys, "generate")
    assert rc == 2
    line = error_line(err)
    assert SHIPPED in line and "--draft ngram" in line


def test_missing_head_directory(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--draft", str(tmp_path / "nohead"))
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
    rc, _, err = run(capsys, "bench", "--model", "smollm2-135m-instruct", *flags)
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
        rc, _, err = run(capsys, "bench", "--dataset", name, "--draft", str(tmp_path / "no-head"))
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


# ---- generate ---------------------------------------------------------------------------


def test_generate_ngram_streams_the_greedy_continuation(capsys, caplog, monkeypatch, lm, lm_dir, tmp_path):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))  # an auto tree measures a cost curve
    rc, out, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "auto",
                       "--prompt", "Once upon a time", "--max-new-tokens", "16")
    assert rc == 0
    expected = hf_greedy_text(*lm, "Once upon a time", 16)
    assert len(expected) > 10
    assert out.startswith(expected)
    summary = [ln for ln in err.splitlines() if "tokens/s" in ln]
    assert len(summary) == 1
    assert "16 tokens" in summary[0] and "mean accepted length" in summary[0] and "steps" in summary[0]
    # decoding's rate apart from the prompt's prefill (issue 31: a long prompt's prefill sank the rate)
    n = len(lm[1]("Once upon a time")["input_ids"])
    assert re.search(r"decoding [0-9.]+ tokens/s \(15 tokens in [0-9.]+ s\), prefill [0-9]+ tokens/s "
                     rf"\({n} prompt tokens", summary[0]), summary[0]
    # what a first auto run waits on is said without -v (the command line shows treespec.costs at INFO)
    said = [r.getMessage() for r in caplog.records if r.name == "treespec.costs"]
    assert said and said[0].startswith("measuring what a verify forward of 1 to")


def test_generate_refuses_a_prompt_past_the_context_unless_asked(capsys, lm_dir):
    long = "Once upon a time " * 80  # past the tiny model's 256 positions
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                     "--prompt", long, "--max-new-tokens", "4")
    assert rc == 2
    line = error_line(err)
    assert "longer than the model's context of 256 positions" in line and "--allow-past-context" in line
    rc, out, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                       "--prompt", long, "--max-new-tokens", "4", "--allow-past-context")
    assert rc == 0, err
    assert "decoding" in err and "warning" not in err


def test_generate_warns_in_one_line_when_the_answer_may_run_past_the_context(capsys, lm_dir):
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                     "--prompt", "Once upon a time " * 10, "--max-new-tokens", "200")
    assert rc == 0, err
    (line,) = [ln for ln in err.splitlines() if "warning" in ln]
    assert line.startswith("treespec: warning: a prompt of ") and line.endswith("pass --allow-past-context to go past it without this warning")


def test_generate_reads_a_piped_prompt(lm, lm_dir):
    """``echo "Tell me about Paris" | treespec generate`` answered the built-in prompt (issue 31)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "treespec.cli", "generate", "--model", lm_dir, "--draft", "ngram",
                        "--tree", "chain-2", "--max-new-tokens", "8"], input="Once upon a time\n",
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(hf_greedy_text(*lm, "Once upon a time", 8))  # no chat template: plain text
    assert "the prompt from stdin (16 characters), as plain text" in p.stderr


def test_generate_prompt_file_and_the_built_in_prompt_said(capsys, monkeypatch, lm, lm_dir, tmp_path):
    import io

    f = tmp_path / "p.txt"
    f.write_text("Once upon a time\n")
    rc, out, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                       "--max-new-tokens", "8", "--prompt-file", str(f))
    assert rc == 0, err
    assert out.startswith(hf_greedy_text(*lm, "Once upon a time", 8))
    assert f"the prompt from --prompt-file {f}" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # an empty pipe (< /dev/null): no prompt given
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "chain-2",
                     "--max-new-tokens", "2")
    assert rc == 0, err
    assert "no prompt given" in err and "built-in one: 'Natalia sold clips" in err
    rc, _, err = run(capsys, "generate", "--prompt-file", str(tmp_path / "absent.txt"))
    assert rc == 2 and "no such file" in error_line(err)
    rc, _, err = run(capsys, "generate", "--prompt-file", str(f), "--chat", "Hi")
    assert rc == 2 and "not allowed with" in error_line(err)


def test_generate_with_head_directory_and_model_draft(capsys, lm, lm_dir, tmp_path):
    """A (random) EAGLE-3 head directory and an independent draft model: still the greedy text."""
    from treespec.drafters import EagleHead

    model, _ = lm
    torch.manual_seed(0)
    EagleHead.for_target(model, eagle3=True).save_pretrained(tmp_path / "head")
    expected = hf_greedy_text(*lm, "Once upon a time", 12)
    for draft in (str(tmp_path / "head"), f"model:{lm_dir}"):
        rc, out, err = run(capsys, "generate", "--model", lm_dir, "--draft", draft, "--tree", "cpu-tiny",
                           "--prompt", "Once upon a time", "--max-new-tokens", "12")
        assert rc == 0, err
        assert out.startswith(expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_graphs_on_a_cpu_are_refused_in_one_line(capsys, lm_dir):
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--cuda-graphs", "--device", "cpu",
                     "--prompt", "Once upon a time", "--max-new-tokens", "4")
    assert rc == 2
    assert "--cuda-graphs needs the model on a CUDA GPU" in error_line(err)


def test_capture_has_no_cuda_graphs_flag(capsys):  # it runs the target alone: the flag would do nothing
    argv = ["capture", "--data", "gsm8k-train", "--out", "x"]
    assert cli.build_parser().parse_args(argv).data
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv + ["--cuda-graphs"])
    assert "unrecognized arguments: --cuda-graphs" in capsys.readouterr().err


def test_generate_vocabulary_mismatch(capsys, lm_dir, tmp_path):
    from treespec.drafters import EagleHead

    EagleHead.for_target(tiny_model(vocab=64), eagle3=True).save_pretrained(tmp_path / "head64")
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", str(tmp_path / "head64"),
                     "--prompt", "Hi")
    assert rc == 2
    assert "vocabulary mismatch" in error_line(err) and "--draft ngram" in err


def test_generate_head_for_another_model_says_what_to_do(capsys, lm, lm_dir, tmp_path):
    """--model of one's own with an EAGLE head of another size: the error says what works
    (issue 31: "expects target hidden size 576, the target has 64" and nothing more)."""
    from treespec.drafters import EagleHead

    other = tiny_model(vocab=lm[0].config.vocab_size, hidden=64, layers=5)  # the same vocabulary, wider
    EagleHead.for_target(other, eagle3=True).save_pretrained(tmp_path / "wide-head")
    capsys.readouterr()
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", str(tmp_path / "wide-head"), "--prompt", "Hi")
    assert rc == 2
    line = error_line(err)
    assert "expects target hidden size 64, the target has 32" in line
    for hint in ("--draft ngram", "--draft layers:K", "treespec train-eagle"):
        assert hint in line


def test_draft_model_without_a_tokenizer(capsys, lm, lm_dir, tmp_path):
    lm[0].save_pretrained(tmp_path / "no-tokenizer")
    capsys.readouterr()
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", f"model:{tmp_path / 'no-tokenizer'}",
                     "--prompt", "Hi")
    assert rc == 2
    line = error_line(err)
    assert "has a model but no tokenizer" in line and "tokenizer.save_pretrained" in line
    assert "sentencepiece" not in line


def test_unknown_model_name_answers_at_once_in_one_line(capsys, monkeypatch):
    """Offline, an unknown name took 27-37 s and 22 retry warnings (issue 31): the hub is asked
    only when it answers, and the error is one line."""
    import time

    import treespec.models.loading as model_loading

    def never(*a, **k):
        raise AssertionError("transformers was asked for a name the hub cannot give")

    t0 = time.perf_counter()
    rc, _, err = run(capsys, "generate", "--model", "no-such-model-xyz", "--draft", "ngram", "--prompt", "Hi")
    assert rc == 2 and time.perf_counter() - t0 < 15  # this machine as it is: offline here
    assert "'no-such-model-xyz' is not a known name (smollm2-135m-instruct)" in error_line(err)
    monkeypatch.setattr(model_loading, "hub_reachable", lambda timeout=2.0: False)
    monkeypatch.setattr(model_loading, "from_transformers", never)
    rc, _, err = run(capsys, "generate", "--model", "no-such-model-xyz", "--draft", "ngram", "--prompt", "Hi")
    assert rc == 2 and "the hub (huggingface.co) cannot be reached from here" in error_line(err)
    rc, _, err = run(capsys, "generate", "--model", "no such model", "--draft", "ngram", "--prompt", "Hi")
    assert rc == 2 and error_line(err).endswith("or a Hugging Face hub id")


def test_generate_chat_needs_a_template(capsys, lm_dir):
    rc, _, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--chat", "Hi")
    assert rc == 2
    assert "no chat template" in error_line(err)


# ---- bench ------------------------------------------------------------------------------


@pytest.fixture
def tiny_dataset(tmp_path):
    f = tmp_path / "stories.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Once upon a time", "Tom and Lily and Tom"]))
    return f


def test_bench_greedy_json_and_plots(capsys, tmp_path, tiny_dataset, lm_dir):
    out = tmp_path / "r.json"
    rc, stdout, err = run(
        capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text",
        "--num-prompts", "2", "--max-new-tokens", "8", "--draft", "ngram", "--tree", "cpu",
        "--out", str(out), "--plot-dir", str(tmp_path / "plots"),
    )
    assert rc == 0, err
    data = json.loads(out.read_text())
    for key in ("command", "machine", "settings", "configs", "prompts", "mismatches", "notes"):
        assert key in data
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["torch"] == torch.__version__
    assert data["command"].startswith("treespec bench --model ")
    names = [c["name"] for c in data["configs"]]
    # CPU default: packed weights, so HF generate and treespec without a draft run on them too
    assert names == ["hf-generate", "hf-generate+fast", "treespec-ar", "hf-prompt-lookup-3", "ngram/chain-3",
                     "ngram/cpu"]
    assert data["settings"]["fast_path"] == "oneDNN-packed linear weights"
    assert data["best_baseline"] in names[:3]
    assert data["mismatches"] == 0 and data["unexplained_mismatches"] == 0
    assert all(c["mismatches"] == 0 for c in data["configs"])
    base = data["configs"][0]
    assert base["speedup"] == pytest.approx(1.0) and base["total_tokens"] == 16
    for c in data["configs"][4:]:
        assert c["total_tokens"] == 16 and c["tokens_per_second"] > 0
        assert 1.0 <= c["mean_accepted_length"] <= 1 + c["tree_tokens_per_verify"]
        rates = c["acceptance_rate_by_position"]
        assert len(rates) >= 1 and all(a >= b for a, b in zip(rates, rates[1:]))  # never grows with depth
        assert set(c["time_split"]) == {"prefill", "draft", "verify"}
    assert len(data["prompts"]) == 2
    assert data["prompts"][1]["results"]["ngram/cpu"]["matches_hf_generate"] is True
    for name in ("r-acceptance_by_position.png", "r-tokens_per_second.png"):  # prefix: the --out stem
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG
    assert "ngram/cpu" in stdout and "speedup" in stdout  # the table
    text = (tmp_path / "r.txt").read_text()  # the same table beside the JSON, without progress bars
    assert text.startswith(f"$ {data['command']}\n") and "ngram/cpu" in text
    assert "\r" not in text and "%|" not in text and text.splitlines()[1] in stdout


def table_blocks(text: str) -> list[list[str]]:
    """The column heads of each table in ``text`` (a heads line is followed by a rule)."""
    lines = text.splitlines()
    return [re.split(r"\s{2,}", lines[k - 1].strip()) for k, ln in enumerate(lines) if k and set(ln) == {"-"}]


def test_bench_spec_bench_leaderboard_table_legend_json_and_png(capsys, tmp_path, chat_lm_dir):
    """--dataset spec-bench: one question per category (--num-prompts is per category), the
    conversation's two turns; the leaderboard's table and the details, within 100 columns, a
    legend naming every column; per-category JSON; the grouped-bar PNG."""
    out = tmp_path / "sb.json"
    rc, stdout, err = run(capsys, "bench", "--model", chat_lm_dir, "--dataset", "spec-bench", "--num-prompts", "1",
                          "--max-new-tokens", "4", "--config", "ngram@cpu-tiny", "--no-warmup",
                          "--out", str(out), "--plot-dir", str(tmp_path / "plots"))
    assert rc == 0, err
    data = json.loads(out.read_text())
    cats = ["conversation", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert data["categories"] == cats and data["settings"]["num_prompts"] == 6
    # packed fp32 weights may round a long prompt's logits to a near-tie; nothing else may differ
    assert data["prompts"][0]["turns"] == 2 and data["unexplained_mismatches"] == 0
    for c in data["configs"]:
        assert list(c["categories"]) == cats
        assert c["overall_speedup"] == pytest.approx(sum(c["categories"][k]["speedup"] for k in cats) / 6)
    assert (tmp_path / "plots" / "sb-speedup_by_category.png").read_bytes()[:8] == PNG
    assert "6 prompt(s), 1 per category, 4 new tokens a turn" in " ".join(stdout.split())
    assert max(len(ln) for ln in stdout.splitlines() if chat_lm_dir not in ln and not ln.startswith("wrote ")) <= 100
    table, legend = stdout.split("greedy\n", 1)[1].rsplit("\n\nconfig ", 1)  # the legend comes last
    leaderboard, details = table_blocks(table)
    assert leaderboard == ["config", "conv", "transl", "summ", "qa", "math", "rag", "tau", "overall",
                           "SB overall"]
    assert details == ["config", "tok/s", "speedup", "vs best", "tau", "nodes", "draft", "verify", "mismatch"]
    legend = "config " + legend
    keys = {re.split(r"\s{2,}|: ", ln, maxsplit=1)[0] for ln in legend.splitlines() if not ln.startswith(" ")}
    keys |= {k for key in keys for k in key.split(", ")}  # the categories share one entry
    assert set(leaderboard + details) <= keys  # every column explained
    for term in ("hf-generate:", "+fast:", "treespec-ar:", "hf-prompt-lookup-K:", "DRAFT/TREE:", "near-tie",
                 "unexplained", "Overall"):
        assert term in legend
    wide = format_table(data, wide=True)
    assert max(map(len, wide.splitlines())) > max(map(len, table.splitlines()))
    assert table_blocks(wide)[0][1:7] == cats


@pytest.fixture
def in_tmp_dir(tmp_path, monkeypatch):
    """The test's own folder as the current one: a bench run without --out writes its report
    (and journal) under it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_bench_wide_shows_every_column(capsys, in_tmp_dir, tiny_dataset, lm_dir):
    rc, stdout, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
                          "text", "--num-prompts", "1", "--max-new-tokens", "4", "--config", "ngram@chain-2",
                          "--no-warmup", "--no-hf-lookup", "--wide")
    assert rc == 0, err
    assert table_blocks(stdout)[0] == ["config", "tok/s", "med tok/s", "speedup", "med speedup", "vs best", "tau",
                                       "nodes", "accept by position", "draft", "verify", "mismatch"]
    assert "med tok/s" in stdout.split("\n\n")[1]  # and the legend explains the wide columns too


def test_bench_mismatch_exits_nonzero(capsys, monkeypatch, in_tmp_dir, tiny_dataset, lm_dir):
    import treespec.bench.running as bench

    real = bench.ts_generate

    def off_by_one(*a, **kw):
        out = real(*a, **kw)
        out.sequences[0][-1] = (out.sequences[0][-1] + 1) % 320  # the tiny vocabulary
        return out

    monkeypatch.setattr(bench, "ts_generate", off_by_one)
    rc, _, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
                     "text", "--num-prompts", "2", "--max-new-tokens", "4", "--config", "ngram@chain-2",
                     "--no-warmup", "--no-hf-lookup", "--no-pack")
    assert rc == 1
    assert "differs from HF generate" in err and "ngram/chain-2 on 2 prompt(s)" in err


def test_bench_sampling_skips_prompt_lookup(capsys, tmp_path, tiny_dataset, lm_dir):
    out = tmp_path / "s.json"
    rc, stdout, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset),
                          "--prompt-field", "text", "--num-prompts", "1", "--max-new-tokens", "4",
                          "--config", "ngram@cpu-tiny", "--temperature", "0.7", "--no-warmup", "--out", str(out))
    assert rc == 0, err
    data = json.loads(out.read_text())
    lookup = next(c for c in data["configs"] if c["kind"] == "hf-prompt-lookup")
    assert "skipped" in lookup
    assert any("skipped" in n for n in data["notes"]) and "skipped" in stdout


def test_bench_in_a_log_says_each_prompt_and_writes_its_report_by_default(capsys, in_tmp_dir, tiny_dataset,
                                                                         lm_dir):
    """stderr no terminal (captured here): the journal's path first, a line once warm, one per
    finished prompt; without --out the report goes under ./treespec-bench/ and its paths are
    printed; the default journal is gone once the report is written."""
    rc, stdout, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
                          "text", "--num-prompts", "2", "--max-new-tokens", "4", "--config", "ngram@chain-2",
                          "--no-hf-lookup", "--no-pack")
    assert rc == 0, err
    said = [ln.removeprefix("treespec: ") for ln in err.splitlines() if ln.startswith("treespec: ")]
    journal = re.fullmatch(r"journal (treespec-bench/\d{8}-\d{6}\.jsonl): a stopped run resumes from it with "
                           r"--journal \1; removed once the report is written", said[0])
    assert journal, said[0]
    assert said[1].startswith("warm-up done: 2 configuration(s) in ")
    assert [ln.split(":")[0] for ln in said[2:]] == ["prompt 1/2", "prompt 2/2"]
    assert re.fullmatch(r"prompt 1/2: hf-generate [\d.]+ tok/s; ngram/chain-2 [\d.]+ \([\d.]+x, tau [\d.]+\) "
                        r"\[\d+s, about \d+s left\]", said[2]), said[2]
    report = Path(journal[1]).with_suffix(".json")
    assert stdout.splitlines()[-1] == f"wrote {report} and {report.with_suffix('.txt')}"
    data = json.loads((in_tmp_dir / report).read_text())
    assert len(data["prompts"]) == 2 and (in_tmp_dir / report.with_suffix(".txt")).exists()
    assert not (in_tmp_dir / journal[1]).exists()


def test_bench_ctrl_c_prints_the_command_that_resumes(capsys, monkeypatch, in_tmp_dir, tiny_dataset, lm_dir):
    """Ctrl-C in the second prompt: the first is kept in the journal, and the command printed
    runs the second alone and reports both."""
    import shlex

    import treespec.bench.running as bench

    real, calls = bench.ts_generate, []

    def stop_in_prompt_two(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(bench, "ts_generate", stop_in_prompt_two)
    rc, _, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text",
                     "--num-prompts", "2", "--max-new-tokens", "4", "--config", "ngram@chain-2", "--no-warmup",
                     "--no-hf-lookup", "--no-pack", "--out", "r.json")
    assert rc == 130
    lines = err.splitlines()
    at = next(k for k, ln in enumerate(lines) if ln.startswith("treespec: stopped"))
    assert lines[at] == "treespec: stopped with 1 of 2 prompt(s) done, kept in r.jsonl; to resume:"
    command = shlex.split(lines[at + 1])
    assert command[:2] == ["treespec", "bench"] and command[-2:] == ["--journal", "r.jsonl"]
    assert lines[-1] == "treespec: interrupted"

    calls.clear()
    rc, stdout, err = run(capsys, *command[1:])
    assert rc == 0, err
    assert len(calls) == 1  # prompt 2 alone ran
    said = [ln for ln in err.splitlines() if ln.startswith("treespec: ")]
    assert said[1:] == ["treespec: 1 prompt(s) read back from the journal", next(
        ln for ln in said if ln.startswith("treespec: prompt 2/2: "))]
    data = json.loads((in_tmp_dir / "r.json").read_text())
    assert len(data["prompts"]) == 2 and any(n.startswith("resumed: the first 1 prompt(s)") for n in data["notes"])
    assert len((in_tmp_dir / "r.jsonl").read_text().splitlines()) == 1 + 2  # given by --journal: kept


def test_bench_progress_lines_estimate_the_time_left():
    """A fake clock: prompts read back from a journal are one line; each prompt run after them
    says its rates, the time so far and what is left at that pace."""
    import io

    from treespec.bench import BenchProgress, RunRecord
    from treespec.cli.bench_progress import PromptLines

    now = [100.0]
    stream = io.StringIO()
    lines = PromptLines(stream, clock=lambda: now[0])
    runs = {"hf-generate": RunRecord([1] * 10, 2.0), "ngram/chain-3": RunRecord([1] * 10, 0.5,
                                                                                 {"mean_accepted_length": 2.5})}
    for done in (1, 2):
        lines(BenchProgress("prompts", done, 5, None, runs=runs, resumed=True))
    for done, t in ((3, 130.0), (4, 160.0), (5, 250.0)):
        lines(BenchProgress("prompts", done - 1, 5, "hf-generate"))
        now[0] = t
        lines(BenchProgress("prompts", done, 5, None, runs=runs))
    assert stream.getvalue().splitlines() == [
        "treespec: 2 prompt(s) read back from the journal",
        "treespec: prompt 3/5: hf-generate 5.0 tok/s; ngram/chain-3 20.0 (4.00x, tau 2.50) [30s, about 1m00s left]",
        "treespec: prompt 4/5: hf-generate 5.0 tok/s; ngram/chain-3 20.0 (4.00x, tau 2.50) [1m00s, about 30s left]",
        "treespec: prompt 5/5: hf-generate 5.0 tok/s; ngram/chain-3 20.0 (4.00x, tau 2.50) [2m30s]",
    ]


def test_bench_output_paths(in_tmp_dir):
    from treespec.cli.bench import output_paths

    now = 1767225600.0
    stamp = __import__("time").strftime("%Y%m%d-%H%M%S", __import__("time").localtime(now))
    args = cli.build_parser().parse_args(["bench"])
    assert output_paths(args, now) == (Path(f"treespec-bench/{stamp}.json"), Path(f"treespec-bench/{stamp}.jsonl"))
    (in_tmp_dir / "treespec-bench").mkdir()
    (in_tmp_dir / "treespec-bench" / f"{stamp}.txt").write_text("an earlier run's\n")
    assert output_paths(args, now)[0] == Path(f"treespec-bench/{stamp}-2.json")  # never over another run's
    args = cli.build_parser().parse_args(["bench", "--out", "res/r.json"])
    assert output_paths(args) == (Path("res/r.json"), Path("res/r.jsonl"))
    args = cli.build_parser().parse_args(["bench", "--out", "r.jsonl", "--journal", "j.jsonl"])
    assert output_paths(args) == (Path("r.jsonl"), Path("j.jsonl"))


# ---- tree show --------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["cpu", "eagle1"])
def test_tree_show_preset(capsys, tmp_path, preset):
    png = tmp_path / "x.png"
    rc, out, err = run(capsys, "tree", "show", preset, "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    assert "drafted nodes" in out


def test_tree_show_json_file(capsys, tmp_path):
    f = tmp_path / "mine.json"
    f.write_text("[[0], [1], [0, 0]]")
    rc, out, _ = run(capsys, "tree", "show", str(f), "--out", str(tmp_path / "m.png"))
    assert rc == 0
    assert "3 drafted nodes, depth 2" in out


@needs_stories
def test_tree_show_prompt_ngram(capsys, tmp_path):
    png = tmp_path / "e.png"
    # The target's first token (" b") continues an earlier "a big": ngram has a run to propose.
    rc, out, err = run(capsys, "tree", "show", "eagle1", "--prompt", "She saw a big red ball. She saw a big",
                       "--model", str(stories260k_gguf()), "--draft", "ngram", "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    drafted = int(re.search(r"\((\d+) drafted nodes", out).group(1))
    assert 1 <= drafted <= 25


def test_tree_show_prompt_highlights_the_accepted_path(capsys, tmp_path, lm_dir):
    """An identical copy of the target as the draft: its top-1 branch is the target's greedy
    continuation, so the whole depth of the tree is accepted."""
    png = tmp_path / "c.png"
    rc, out, err = run(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time", "--model", lm_dir,
                       "--draft", f"model:{lm_dir}", "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    assert "16 drafted nodes, 5 accepted" in out


def test_tree_show_with_lookup_grafted(capsys, tmp_path, lm_dir):
    """A hybrid's tree is drawn as the engine verified it: the lookup's nodes on top of the
    preset's budget (the recording wrapper keeps ``extra_nodes``)."""
    from treespec.drafters import Drafter, HybridDrafter

    class Fake(Drafter):  # a bare drafter standing in for a model drafter
        def start(self, model, ctx):
            raise AssertionError

    assert RecordingDrafter(HybridDrafter(Fake())).extra_nodes == 10
    png = tmp_path / "h.png"
    rc, out, err = run(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time, once upon a time, once upon a",
                       "--model", lm_dir, "--draft", f"model:{lm_dir}+lookup", "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    assert 16 <= int(re.search(r"\((\d+) drafted nodes", out).group(1)) <= 16 + 10


def test_recording_drafter_carries_the_calibration():
    """tree show --prompt wraps the drafter to see its trees; an auto tree must still start
    from the drafter's own calibration (its head's auto-profile.json), not the prior: the
    command line's former copy of the wrapper dropped it."""
    import numpy as np

    from treespec.auto import AutoProfile
    from treespec.drafters import Drafter

    learnt = AutoProfile()
    learnt.greedy.observe(np.full(50, -0.1), np.zeros(50, dtype=bool))  # never accepted at a high score

    class Head(Drafter):
        auto_calibration = learnt

        def start(self, model, ctx):
            raise AssertionError

    start = AutoProfile.starting(RecordingDrafter(Head()))
    assert start.greedy.num_observed == 50
    assert start.greedy(np.array([-0.1]))[0] < AutoProfile().greedy(np.array([-0.1]))[0]


def test_tree_show_honours_the_runtime_flags(capsys, tmp_path, lm_dir):
    """--device, --dtype and --pack were accepted and ignored by tree show; they are honoured
    now, with the defaults it always drew with (cpu, float32, plain weights)."""
    args = cli.build_parser().parse_args(["tree", "show", "cpu", "--out", "x.png"])
    assert (args.device, args.dtype, args.pack) == ("cpu", "float32", False)
    png = tmp_path / "b.png"
    rc, out, err = run(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time", "--model", lm_dir,
                       "--draft", f"model:{lm_dir}", "--dtype", "bfloat16", "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    if not torch.cuda.is_available():
        rc, _, err = run(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time", "--model", lm_dir,
                         "--draft", "ngram", "--device", "cuda", "--out", str(tmp_path / "c.png"))
        assert rc == 2
        assert "no CUDA GPU" in error_line(err)


def test_text_stream_returns_pieces_without_an_output(lm):
    _, tok = lm
    ids = tok("Zoë ok", add_special_tokens=False)["input_ids"]
    s = TextStream(tok)
    pieces = [s.push([t]) for t in ids] + [s.push([], final=True)]
    assert "".join(pieces) == s.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_bench_bf16_where_onednn_cannot_pack_it(capsys, caplog, monkeypatch, tmp_path, tiny_dataset, lm_dir):
    """On a CPU whose oneDNN packs fp32 but not bf16 (AMD Zen 3): the default --pack runs bf16 on
    plain weights and says so; an explicit --pack is an error that says what to do."""
    import treespec.packing as packing

    monkeypatch.setattr(packing, "onednn_packs", lambda dtype: dtype == torch.float32)
    args = ["bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text", "--num-prompts",
            "1", "--max-new-tokens", "4", "--config", "ngram@chain-2", "--no-warmup", "--no-hf-lookup",
            "--dtype", "bfloat16"]
    out = tmp_path / "r.json"
    with caplog.at_level("WARNING", logger="treespec.cli"):
        rc, _, err = run(capsys, *args, "--out", str(out))
    assert rc == 0, err
    assert any("cannot pack bfloat16" in r.getMessage() for r in caplog.records)
    data = json.loads(out.read_text())
    assert data["settings"]["fast_path"] is None
    assert [c["name"] for c in data["configs"]] == ["hf-generate", "ngram/chain-2"]  # no packed baselines
    rc, _, err = run(capsys, *args, "--pack")
    assert rc != 0
    assert "cannot pack bfloat16" in error_line(err) and "--dtype float32" in err


def _pack_timings(monkeypatch, plain_ms, packed_ms):
    """The start-up timing of plain against packed weights, injected: (1-token, 16-token) ms
    each way; the list of measurements made."""
    import treespec.pack_choice as pc

    calls = []

    def measure(runner, packed):
        calls.append(1)
        return pc.PackingTimes((1, 16), tuple(t / 1e3 for t in plain_ms), tuple(t / 1e3 for t in packed_ms),
                               spread=0.02)

    monkeypatch.setattr(pc, "measure_packing", measure)
    return calls


@pytest.mark.parametrize("flag, pack, measured", [(None, True, 1), (True, True, 0), (False, False, 0)])
def test_pack_flags_override_the_measured_choice(monkeypatch, tmp_path, lm, flag, pack, measured):
    """Default: measured (the injected timings decide, then the cached ones); --pack and
    --no-pack decide without measuring."""
    import argparse

    from treespec.cli.loading import Loaded, fast_path
    from treespec.packing import PackedLinears

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = _pack_timings(monkeypatch, (30, 50), (40, 45))  # Intel fp32: tree faster packed, decode plain
    model, tok = lm
    fast, choice = fast_path(argparse.Namespace(pack=flag), model)
    assert choice.pack is pack and len(calls) == measured
    assert choice.source == ("measured" if flag is None else "given")
    assert isinstance(fast, PackedLinears) if pack else fast is None
    assert (choice.decode_packed is False) if flag is None else choice.decode_packed is None
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "elsewhere"))
    calls = _pack_timings(monkeypatch, (30, 40), (40, 55))  # packing slows both
    fast_path(argparse.Namespace(pack=flag), model)  # measured, by default, and cached
    fast, choice = fast_path(argparse.Namespace(pack=flag), model, keep=True)
    assert choice.source == ("cached" if flag is None else "given") and len(calls) == measured
    assert choice.pack is (pack if flag is not None else False)
    ctx = Loaded(model, tok, fast=fast, packing=choice).packed()
    if flag is None:  # kept for bench's packed HF generate, yet treespec runs plain
        assert isinstance(fast, PackedLinears) and not choice.pack and isinstance(ctx, contextlib.nullcontext)
    else:
        assert ctx is fast if pack else isinstance(ctx, contextlib.nullcontext)


def test_bench_header_states_the_packing_choice(capsys, monkeypatch, tmp_path, tiny_dataset, lm_dir):
    """Where plain weights run treespec faster: bench says so above the table (and in the
    JSON), runs treespec plain and HF generate both ways, and names the faster HF generate."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = _pack_timings(monkeypatch, (30, 40), (40, 55))
    out = tmp_path / "r.json"
    rc, stdout, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
                          "text", "--num-prompts", "1", "--max-new-tokens", "4", "--config", "ngram@chain-2",
                          "--no-warmup", "--no-hf-lookup", "--out", str(out))
    assert rc == 0, err
    data = json.loads(out.read_text())
    assert calls == [1] and data["settings"]["packing"]["treespec"] == "plain"
    assert [c["name"] for c in data["configs"]] == ["hf-generate", "hf-generate+fast", "treespec-ar", "ngram/chain-2"]
    head = " ".join(stdout.split("\n\n")[0].split())  # the lines above the table
    assert ("packing: treespec on plain weights: a 16-token forward (a verify tree) took 55.0 ms packed, 40.0 ms "
            "plain; a 1-token forward (a decode step, as in HF generate) 40.0 ms packed, 30.0 ms plain, faster "
            "plain (measured now)") in head
    assert f"same-path baseline: {data['same_path_baseline']}, HF generate on" in head
    assert data["same_path_baseline"] in ("hf-generate", "hf-generate+fast")
    for c in data["configs"]:
        assert c["speedup_vs_same_path"] > 0


def test_generation_option_flags_reach_generate_and_every_bench_configuration(capsys, lm, lm_dir, tmp_path,
                                                                               tiny_dataset):
    """--repetition-penalty, --no-repeat-ngram-size and --stop change the text as HF's options
    do, in generate; bench gives HF's baselines the same settings, so nothing mismatches."""
    model, tok = lm
    ids = torch.tensor([tok("Once upon a time")["input_ids"]])
    flags = ["--repetition-penalty", "1.5", "--no-repeat-ngram-size", "2"]
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                        repetition_penalty=1.5, no_repeat_ngram_size=2)
    expected = tok.decode(hf[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected != hf_greedy_text(model, tok, "Once upon a time", 16)  # the options matter here
    rc, out, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "cpu",
                       "--prompt", "Once upon a time", "--max-new-tokens", "16", *flags)
    assert rc == 0, err
    assert out.startswith(expected)
    import re

    stop = re.findall(r"[A-Za-z]{2,}", expected)[0]  # plain letters: the random model writes odd bytes too
    rc, out, err = run(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "cpu",
                       "--prompt", "Once upon a time", "--max-new-tokens", "16", *flags, "--stop", stop)
    assert rc == 0, err
    assert out.rstrip("\n").endswith(stop) and len(out.rstrip("\n")) < len(expected)
    res = tmp_path / "r.json"
    rc, _, err = run(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text",
                     "--num-prompts", "2", "--max-new-tokens", "8", "--draft", "ngram", "--tree", "cpu",
                     "--out", str(res), *flags)
    assert rc == 0, err
    data = json.loads(res.read_text())
    assert data["mismatches"] == 0 and any("repetition_penalty=1.5" in n for n in data["notes"])


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
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    text = " ".join(out.split())  # argparse wraps lines
    for s in shown:
        assert s in text, s
    assert "(default: None)" not in text and "(default: False)" not in text
