"""A bench report read back redraws its printed report byte for byte, and
benchmarks/peers/run.py adds another engine's rows to it: the request the engine is given
(the bench's own prompt ids, budget, threads; a conversation's later turn after that
configuration's own answer), and a faked engine's answers merged into the report (rows,
speedups over the report's baselines, per category, equality with HF generate and the
engine's plain run, the table's lines and legend, the plots). No llama.cpp needed."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from helpers.cli import PNG, run_cli
from treespec.bench import format_report
from treespec.prompts import load_bench_prompts

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers import run as peers  # noqa: E402
from benchmarks.peers.peer_rows import PeerRun, PeerSettings, llama_request, merge_peers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

PLAIN, LOOKUP = "peer:llama.cpp", "peer:llama.cpp+lookup"


@pytest.fixture(scope="module")
def spec_bench_report(tmp_path_factory, chat_lm_dir):
    """A greedy Spec-Bench report of the tiny chat model (one question a category, the
    conversation's two turns), its journal kept."""
    import torch

    out = tmp_path_factory.mktemp("bench") / "sb.json"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from treespec import cli

        rc = cli.main(["bench", "--model", chat_lm_dir, "--dataset", "spec-bench", "--num-prompts", "1",
                       "--max-new-tokens", "6", "--config", "ngram@chain-3", "--no-warmup", "--threads", "1",
                       "--no-pack", "--journal", str(out.with_suffix(".journal.jsonl")), "--out", str(out)])
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    return out


def test_a_report_redraws_byte_for_byte(spec_bench_report, capsys, tmp_path, lm_dir):
    data = json.loads(spec_bench_report.read_text())
    assert spec_bench_report.with_suffix(".txt").read_text() == f"$ {data['command']}\n" + format_report(data)
    # and a plain dataset's report (no categories, one turn each), printed wide
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Once upon a time", "Tom and Lily"]))
    out = tmp_path / "r.json"
    rc, stdout, err = run_cli(capsys, "bench", "--model", lm_dir, "--dataset", str(f), "--prompt-field", "text",
                              "--num-prompts", "2", "--max-new-tokens", "5", "--config", "ngram@cpu", "--wide",
                              "--no-warmup", "--out", str(out))
    assert rc == 0, err
    data = json.loads(out.read_text())
    assert out.with_suffix(".txt").read_text() == f"$ {data['command']}\n" + format_report(data, wide=True)
    assert format_report(data, wide=True) in stdout


def test_request_holds_the_bench_budget_threads_and_each_configurations_ids():
    s = PeerSettings(max_new_tokens=128, threads=2, eos_token_ids=(2,), lookup_tokens=3)
    req = llama_request("m.gguf", s, {0: {PLAIN: [5, 6, 7], LOOKUP: [5, 6, 7]}, 3: {PLAIN: [1, 2], LOOKUP: [1, 9]}},
                        warmup_ids=list(range(40)))
    assert json.loads(json.dumps(req)) == req  # plain JSON
    assert req["gguf"] == "m.gguf" and req["threads"] == 2 and req["max_new_tokens"] == 128
    assert req["eos_token_ids"] == [2] and req["repack"] is False
    assert req["configs"] == [{"name": PLAIN, "lookup_tokens": None}, {"name": LOOKUP, "lookup_tokens": 3}]
    assert req["warmup"] == {"ids": list(range(16)), "max_new_tokens": 16}  # as run_bench warms up
    assert req["prompts"] == [{"index": 0, "ids": {PLAIN: [5, 6, 7], LOOKUP: [5, 6, 7]}},
                              {"index": 3, "ids": {PLAIN: [1, 2], LOOKUP: [1, 9]}}]
    plain_only = llama_request("m.gguf", PeerSettings(8, 1, (), lookup_tokens=0, warmup=False), {0: {PLAIN: [1]}},
                               [1])
    assert [c["name"] for c in plain_only["configs"]] == [PLAIN] and plain_only["warmup"] is None


class FakeLlama:
    """The engine, faked: plain answers each turn as the journal's HF generate did; lookup the
    same but for prompt 1, whose first token it changes; 0.5 s a turn plain, 0.25 s lookup.
    Every request is kept."""

    def __init__(self, journal: Path):
        rows = [json.loads(x) for x in journal.read_text().splitlines()[1:]]
        self.hf = [r["runs"]["hf-generate"] for r in rows]
        self.requests = []

    def turn(self, i: int, t: int) -> list[int]:
        start = sum(self.hf[i]["turn_lengths"][:t])
        return self.hf[i]["tokens"][start:start + self.hf[i]["turn_lengths"][t]]

    def __call__(self, req: dict) -> dict:
        t = len(self.requests)
        self.requests.append(req)
        runs = {c["name"]: [] for c in req["configs"]}
        for p in req["prompts"]:
            i = p["index"]
            runs[PLAIN].append({"index": i, "tokens": self.turn(i, t), "seconds": 0.5})
            tokens = self.turn(i, t)
            if i == 1 and t == 0:
                tokens = [tokens[0] + 1] + tokens[1:]
            if LOOKUP in runs:
                runs[LOOKUP].append({"index": i, "tokens": tokens, "seconds": 0.25})
        return {"engine": "llama.cpp", "version": "llama-cpp-python 0.0.0", "system_info": "AVX = 1",
                "repack": "off", "threads": req["threads"], "runs": runs}


def test_peer_rows_merged_into_a_report(spec_bench_report, chat_lm_dir, tmp_path, capsys):
    data = json.loads(spec_bench_report.read_text())
    fake = FakeLlama(spec_bench_report.with_suffix(".journal.jsonl"))
    out = tmp_path / "with-peers.json"
    rc = peers.main(["--bench", str(spec_bench_report), "--out", str(out), "--gguf", str(spec_bench_report),
                     "--plot-dir", str(tmp_path / "plots")], run_peer=fake)
    assert rc == 0
    merged = json.loads(out.read_text())

    # the requests: the bench's prompts, budget and threads; the conversation's second turn alone
    # in a second request, after each configuration's own first answer
    from treespec.models import load

    _, tok = load(chat_lm_dir)
    prompts, _ = load_bench_prompts("spec-bench", tok, 1)
    first, second = fake.requests
    assert first["max_new_tokens"] == 6 and first["threads"] == 1
    assert [p["ids"][PLAIN] for p in first["prompts"]] == [list(p.ids) for p in prompts]
    assert [p["index"] for p in second["prompts"]] == [0] and prompts[0].num_turns == 2
    assert second["prompts"][0]["ids"][PLAIN] == prompts[0].next_turn(tok, [fake.turn(0, 0)])

    # the rows: figured from the runs against the report's own baselines
    rows = {c["name"]: c for c in merged["configs"]}
    assert [c["name"] for c in merged["configs"]] == [c["name"] for c in data["configs"]] + [PLAIN, LOOKUP]
    hf = rows["hf-generate"]
    turns = [p.num_turns for p in prompts]
    for name, per_turn in ((PLAIN, 0.5), (LOOKUP, 0.25)):
        row = rows[name]
        assert row["kind"] == "peer" and row["engine"] == "llama.cpp" and row["version"] == "llama-cpp-python 0.0.0"
        assert row["total_tokens"] == hf["total_tokens"] and row["total_seconds"] == pytest.approx(per_turn * sum(turns))
        assert row["tokens_per_second"] == pytest.approx(hf["total_tokens"] / (per_turn * sum(turns)))
        assert row["speedup"] == pytest.approx(row["tokens_per_second"] / hf["tokens_per_second"])
        best = rows[merged["best_baseline"]]["tokens_per_second"]
        assert row["speedup_vs_best_baseline"] == pytest.approx(row["tokens_per_second"] / best)
        ratios = [p["results"][name]["speedup"] for p in merged["prompts"]]
        assert row["median_speedup"] == pytest.approx(statistics.median(ratios))
        qa = merged["categories"].index("qa")
        assert row["categories"]["qa"]["speedup"] == pytest.approx(merged["prompts"][qa]["results"][name]["speedup"])
        assert row["overall_speedup"] == pytest.approx(sum(v["speedup"] for v in row["categories"].values()) / 6)
    assert rows[PLAIN]["mismatches"] == 0 and rows[LOOKUP]["mismatches"] == 1 and rows[LOOKUP]["first_mismatch"] == 1
    assert rows[LOOKUP]["differs_from_plain"] == 1 and rows[PLAIN]["differs_from_plain"] is None
    p1 = merged["prompts"][1]["results"]
    assert p1[PLAIN]["matches_hf_generate"] and not p1[LOOKUP]["matches_hf_generate"]
    assert p1[LOOKUP]["first_differing_token"] == 0 and p1[LOOKUP]["matches_plain"] is False
    assert merged["prompts"][0]["results"][PLAIN]["turn_lengths"] == fake.hf[0]["turn_lengths"]
    assert any(n.startswith(f"{LOOKUP}: output equal to hf-generate's on 5 of 6") for n in merged["notes"])

    # the table: a line per peer, the mismatch column counted not judged, the legend saying what they are
    text = out.with_suffix(".txt").read_text()
    assert text == f"$ {merged['command']}\n" + format_report(merged)
    for name in (PLAIN, LOOKUP):  # a row in the leaderboard and one in the details
        assert sum(ln.startswith(name + " ") for ln in text.splitlines()) == 2
    details = [ln.split() for ln in text.splitlines() if ln.startswith(LOOKUP + " ") and "differ" in ln]
    assert len(details) == 1 and details[0][-2:] == ["1", "differ"]
    assert details[0][1:3] == [f"{rows[LOOKUP]['tokens_per_second']:.1f}", f"{rows[LOOKUP]['speedup']:.2f}x"]
    flat = " ".join(text.split())
    assert "peer:ENGINE: another engine" in flat and "not judged" in flat and "llama-cpp-python 0.0.0" in flat
    for name in ("with-peers-tokens_per_second.png", "with-peers-speedup_by_category.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG

    # run again on its own output: the rows replaced, not added twice
    assert peers.main(["--bench", str(out), "--gguf", str(spec_bench_report)], run_peer=FakeLlama(
        spec_bench_report.with_suffix(".journal.jsonl"))) == 0
    again = json.loads(out.read_text())
    assert [c["name"] for c in again["configs"]] == [c["name"] for c in merged["configs"]]
    assert sum(n.startswith("peer rows added by: ") for n in again["notes"]) == 1
    capsys.readouterr()


def test_without_a_journal_hf_generate_runs_again_and_other_prompts_are_refused(spec_bench_report, tmp_path,
                                                                                  capsys):
    data = json.loads(spec_bench_report.read_text())
    data["command"] = re.sub(r" --journal \S+", "", data["command"])
    bench = tmp_path / "nojournal.json"
    bench.write_text(json.dumps(data))
    fake = FakeLlama(spec_bench_report.with_suffix(".journal.jsonl"))
    assert peers.main(["--bench", str(bench), "--gguf", str(bench), "--lookup-tokens", "0"], run_peer=fake) == 0
    merged = json.loads(bench.read_text())
    assert merged["configs"][-1]["name"] == PLAIN and merged["configs"][-1]["mismatches"] == 0  # HF's own tokens
    assert "running HF generate again" in capsys.readouterr().err

    data["prompts"][2]["prompt_tokens"] += 1
    bench.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="not the report's .* first difference at prompt 2"):
        peers.main(["--bench", str(bench), "--gguf", str(bench)], run_peer=fake)


def test_merge_refuses_what_is_not_a_peer_row_of_every_prompt():
    data = {"settings": {"temperature": 0}, "prompts": [{}, {}], "configs": [], "notes": []}
    with pytest.raises(ValueError, match="one run for each of 2 prompts"):
        merge_peers(data, {}, {PLAIN: [PeerRun([1], 1.0, [1])]}, None)
    with pytest.raises(ValueError, match="starting with 'peer:'"):
        merge_peers(data, {}, {"llama.cpp": [PeerRun([1], 1.0, [1])] * 2}, None)
    with pytest.raises(ValueError, match="greedy"):
        merge_peers({**data, "settings": {"temperature": 1.0}}, {}, {}, None)


def test_without_hf_tokens_the_rows_say_not_compared(spec_bench_report):
    from treespec.bench import format_table

    data = json.loads(spec_bench_report.read_text())
    runs = [PeerRun([1, 2], 0.5, [2]) for _ in data["prompts"]]
    engine = {"engine": "llama.cpp", "version": "v", "descriptions": {PLAIN: "plain"}}
    merged = merge_peers(data, engine, {PLAIN: runs}, None)
    row = merged["configs"][-1]
    assert row["mismatches"] is None and "matches_hf_generate" not in merged["prompts"][0]["results"][PLAIN]
    assert row["tokens_per_second"] == pytest.approx(4.0)  # 2 tokens in 0.5 s a prompt
    line = next(ln for ln in format_table(merged, legend=False).splitlines()[::-1] if ln.startswith(PLAIN))
    assert line.split()[-1] == "-"
    assert f"{PLAIN}: output not compared (no HF generate tokens)" in merged["notes"]
