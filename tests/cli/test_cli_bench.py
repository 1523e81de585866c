"""``treespec bench`` end to end on a tiny model: the greedy JSON, table and plots, Spec-Bench's
leaderboard, a mismatch that fails the run, sampling, a log's line per prompt and the report's
default paths, Ctrl-C and the command that resumes, bf16 where oneDNN cannot pack it, the
packing choice in the header, and generation options given to every configuration alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers.cli import PNG, error_line, pack_timings, run_cli
from helpers.references import hf_greedy_text
from treespec import cli
from treespec.bench import format_table

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- bench ------------------------------------------------------------------------------


@pytest.fixture
def tiny_dataset(tmp_path):
    f = tmp_path / "stories.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Once upon a time", "Tom and Lily and Tom"]))
    return f


def test_bench_greedy_json_and_plots(capsys, tmp_path, tiny_dataset, lm_dir):
    out = tmp_path / "r.json"
    rc, stdout, err = run_cli(
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
    rc, stdout, err = run_cli(capsys, "bench", "--model", chat_lm_dir, "--dataset", "spec-bench", "--num-prompts", "1",
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
    rc, stdout, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
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
    rc, _, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
                     "text", "--num-prompts", "2", "--max-new-tokens", "4", "--config", "ngram@chain-2",
                     "--no-warmup", "--no-hf-lookup", "--no-pack")
    assert rc == 1
    assert "differs from HF generate" in err and "ngram/chain-2 on 2 prompt(s)" in err


def test_bench_sampling_skips_prompt_lookup(capsys, tmp_path, tiny_dataset, lm_dir):
    out = tmp_path / "s.json"
    rc, stdout, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset),
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
    rc, stdout, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
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
    rc, _, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text",
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
    rc, stdout, err = run_cli(capsys, *command[1:])
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
        rc, _, err = run_cli(capsys, *args, "--out", str(out))
    assert rc == 0, err
    assert any("cannot pack bfloat16" in r.getMessage() for r in caplog.records)
    data = json.loads(out.read_text())
    assert data["settings"]["fast_path"] is None
    assert [c["name"] for c in data["configs"]] == ["hf-generate", "ngram/chain-2"]  # no packed baselines
    rc, _, err = run_cli(capsys, *args, "--pack")
    assert rc != 0
    assert "cannot pack bfloat16" in error_line(err) and "--dtype float32" in err


def test_bench_header_states_the_packing_choice(capsys, monkeypatch, tmp_path, tiny_dataset, lm_dir):
    """Where plain weights run treespec faster: bench says so above the table (and in the
    JSON), runs treespec plain and HF generate both ways, and names the faster HF generate."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = pack_timings(monkeypatch, (30, 40), (40, 55))
    out = tmp_path / "r.json"
    rc, stdout, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field",
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
    rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "cpu",
                       "--prompt", "Once upon a time", "--max-new-tokens", "16", *flags)
    assert rc == 0, err
    assert out.startswith(expected)
    import re

    stop = re.findall(r"[A-Za-z]{2,}", expected)[0]  # plain letters: the random model writes odd bytes too
    rc, out, err = run_cli(capsys, "generate", "--model", lm_dir, "--draft", "ngram", "--tree", "cpu",
                       "--prompt", "Once upon a time", "--max-new-tokens", "16", *flags, "--stop", stop)
    assert rc == 0, err
    assert out.rstrip("\n").endswith(stop) and len(out.rstrip("\n")) < len(expected)
    res = tmp_path / "r.json"
    rc, _, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text",
                     "--num-prompts", "2", "--max-new-tokens", "8", "--draft", "ngram", "--tree", "cpu",
                     "--out", str(res), *flags)
    assert rc == 0, err
    data = json.loads(res.read_text())
    assert data["mismatches"] == 0 and any("repetition_penalty=1.5" in n for n in data["notes"])


def test_bench_compile_adds_a_compiled_twin_of_each_treespec_configuration(capsys, lm_dir, tmp_path, tiny_dataset):
    """--compile runs each treespec configuration again with its verify forward compiled on
    fixed shapes (named NAME+compile, marked compiled), after the eager ones; its greedy output
    is HF generate's like theirs."""
    res = tmp_path / "r.json"
    rc, _, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(tiny_dataset), "--prompt-field", "text",
                         "--num-prompts", "1", "--max-new-tokens", "8", "--config", "ngram@chain-2", "--no-hf-lookup",
                         "--no-treespec-ar", "--compile", "--out", str(res))
    assert rc == 0, err
    data = json.loads(res.read_text())
    names = [c["name"] for c in data["configs"]]
    assert names[-2:] == ["ngram/chain-2", "ngram/chain-2+compile"], names
    assert data["configs"][-1]["compiled"] is True and "compiled" not in data["configs"][-2]
    assert data["mismatches"] == 0
    assert all(c["warmup_seconds"] > 0 for c in data["configs"])
    text = res.with_suffix(".txt").read_text()
    assert "compiled: the untimed warm-up compiled for" in text and "s (ngram/chain-2+compile)" in text
    assert "and inside the timed calls (rows or trees the warm-up did not reach; counted in tok/s): none" in text
    assert data["configs"][-1]["compile_seconds"] == 0.0
