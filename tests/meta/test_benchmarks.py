"""The benchmarks folder holds together: every script path the docs, scripts and tests name
exists, benchmarks/README.md maps every script, and the shared timing helpers time what
they say."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*/*") if p.suffix in (".py", ".sh"))
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCH.rglob("*.md")),
         *SCRIPTS, *sorted((ROOT / "tests").rglob("*.py"))]
PATH = re.compile(r"(?:benchmarks|tests)/[\w./-]*\w")


def test_scripts_are_in_subfolders():
    assert SCRIPTS, "no benchmark scripts found"
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["__init__.py", "timing.py"]
    # One exception: the path issue 29 names for the GPU check, a two-line hand-on to figures/.
    assert [p.name for p in BENCH.glob("*.sh")] == ["gpu_check.sh"]
    assert "exec bash" in (BENCH / "gpu_check.sh").read_text() and len((BENCH / "gpu_check.sh").read_text()) < 600


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_scripts_and_folders_exist(text):
    """Every benchmarks/ or tests/ script or folder a file names is there (results are
    outputs: a command may name one it is about to write)."""
    missing = []
    for m in PATH.finditer(text.read_text()):
        path = m.group(0)
        if path.startswith("benchmarks/results/") or "$" in path:
            continue
        if path.endswith((".py", ".sh", ".md")) or path.rstrip("/").count("/") <= 2:
            if not (ROOT / path).exists():
                missing.append(path)
    assert not missing, f"{text.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


def test_readme_maps_every_script():
    readme = (BENCH / "README.md").read_text()
    unmapped = [p.relative_to(BENCH).as_posix() for p in SCRIPTS if f"`{p.name}`" not in readme]
    assert not unmapped, f"benchmarks/README.md does not name {unmapped}"


def test_timing_counts_warmup_and_measures_a_block():
    sys.path.insert(0, str(ROOT))
    from benchmarks.timing import Timer, call_times, command, median_ms

    calls = []
    times = call_times(lambda: calls.append(1), repeats=5, warmup=3)
    assert len(times) == 5 and len(calls) == 8 and all(t >= 0 for t in times)
    counted = []
    assert median_ms(lambda: counted.append(1), repeats=3) >= 0 and len(counted) >= 3  # every repeat ran
    synced = []
    with Timer(lambda: synced.append(1)) as t:
        sum(range(1000))
    assert synced == [1, 1] and t.seconds > 0 and t.ms == pytest.approx(1000 * t.seconds)
    assert command(str(BENCH / "micro" / "forward_cost.py"), ["--dtype", "bfloat16"]) == \
        "python benchmarks/micro/forward_cost.py --dtype bfloat16"


def test_journal_summary_and_spec_bench_formula_compute_what_they_say(tmp_path):
    """Per category: pooled speedups over plain HF generate and over the faster HF baseline,
    Spec-Bench's ratio (the mean of per-question tokens/s over the baseline's); overall: the mean
    of the six and Spec-Bench's over every question. The report script agrees on a report."""
    import json

    sys.path.insert(0, str(BENCH / "figures"))
    import journal_summary
    import spec_bench_formula

    from treespec.prompts import spec_bench_questions

    questions = spec_bench_questions("spec-bench", 2)  # two a category, the first of each first
    names = ["hf-generate", "hf-generate+fast", "ts"]
    # per question: (tokens, seconds) of each configuration; plain HF generate is the faster baseline
    runs = [{"hf-generate": (10 + i, 1.0), "hf-generate+fast": (10 + i, 2.0), "ts": (40 + 7 * i, 1.0 + i % 3)}
            for i in range(len(questions))]
    head = {"key": {"configs": [{"name": n, "kind": "treespec" if n == "ts" else "hf-generate"} for n in names],
                    "prompts": f"{len(questions)} prompts, sha256 x", "machine": {"cpu": "test"}}}
    rows = [{"prompt": i, "divergences": {},
             "runs": {n: {"tokens": [1] * t, "seconds": s, "metrics": None} for n, (t, s) in r.items()}}
            for i, r in enumerate(runs)]
    journal = tmp_path / "j.jsonl"
    journal.write_text("\n".join(json.dumps(x) for x in [head, *rows]) + "\n")
    out = journal_summary.summarise(journal, 2)
    rate = lambda t, s: t / s  # noqa: E731
    for cat, c in out["categories"].items():
        idx = [i for i, q in enumerate(questions) if q["category"] == cat]
        mine = [rate(*runs[i]["ts"]) for i in idx]
        base = [rate(*runs[i]["hf-generate"]) for i in idx]
        pooled = sum(runs[i]["ts"][0] for i in idx) / sum(runs[i]["ts"][1] for i in idx)
        plain = sum(runs[i]["hf-generate"][0] for i in idx) / sum(runs[i]["hf-generate"][1] for i in idx)
        f = c["configs"]["ts"]
        assert f["spec_bench_speedup"] == pytest.approx(sum(mine) / sum(base), abs=1e-4)
        assert f["speedup"] == pytest.approx(pooled / plain, abs=1e-4)
        assert f["over_same_path"] == f["speedup"]  # plain HF generate was the faster baseline here
    cats = list(out["categories"].values())
    assert out["overall"]["ts"]["speedup"] == pytest.approx(sum(c["configs"]["ts"]["speedup"] for c in cats) / 6,
                                                            abs=1e-3)
    every = sum(rate(*r["ts"]) for r in runs) / sum(rate(*r["hf-generate"]) for r in runs)
    assert out["overall"]["ts"]["spec_bench_speedup"] == pytest.approx(every, abs=1e-4)
    report = {"configs": [{"name": n, "overall_speedup": out["overall"][n]["speedup"]} for n in names],
              "prompts": [{"category": q["category"],
                           "results": {n: {"new_tokens": runs[i][n][0], "seconds": runs[i][n][1],
                                           "tokens_per_second": rate(*runs[i][n])} for n in names}}
                          for i, q in enumerate(questions)]}
    got = spec_bench_formula.formula(report)["ts"]
    assert got["overall"]["spec_bench"] == pytest.approx(every, abs=1e-3)
    assert all(got[cat]["spec_bench"] == pytest.approx(c["configs"]["ts"]["spec_bench_speedup"], abs=1e-3)
               for cat, c in out["categories"].items())


def test_cpu_id_tells_cpus_of_one_name_apart(tmp_path, monkeypatch):
    """Two /proc/cpuinfo blocks with one model name but other families or flags give other ids."""
    import builtins

    from treespec.machine import cpu_id

    def info(family, flags):
        return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 17\n"
                f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: {flags}\n\nprocessor\t: 1\n")

    real_open = builtins.open
    ids = []
    for family, flags in ((25, "fpu avx512f avx512_bf16"), (25, "avx512_bf16 fpu avx512f"), (23, "fpu avx2"),
                          (25, "fpu avx2")):
        path = tmp_path / f"cpuinfo-{len(ids)}"
        path.write_text(info(family, flags))
        monkeypatch.setattr(builtins, "open", lambda f, *a, p=path, **k: real_open(p if f == "/proc/cpuinfo" else f,
                                                                                   *a, **k))
        ids.append(cpu_id())
    monkeypatch.setattr(builtins, "open", real_open)
    assert ids[0] == ids[1] and ids[0].startswith("cpu family 25, model 17, stepping 1, flags ")  # flag order aside
    assert len({ids[0], ids[2], ids[3]}) == 3
    arm = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
           "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {}\nCPU revision\t: 1\n\n")
    arm_ids = []
    for part in ("0xd0c", "0xd40"):  # Neoverse N1 and V1
        path = tmp_path / f"arm-{part}"
        path.write_text(arm.format(part))
        monkeypatch.setattr(builtins, "open", lambda f, *a, p=path, **k: real_open(p if f == "/proc/cpuinfo" else f,
                                                                                   *a, **k))
        arm_ids.append(cpu_id())
    monkeypatch.setattr(builtins, "open", real_open)
    assert arm_ids[0] != arm_ids[1] and "CPU part 0xd0c" in arm_ids[0]
