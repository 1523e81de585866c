"""``benchmarks/figures/gpu_check.sh`` (run here through ``benchmarks/gpu_check.sh``, the path
issue 29 names, which hands on its arguments) assembles without a GPU: ``--dry-run`` passes (its Python
scripts import, the CUDA tests it names are collected, what a run carries fits in 64 MiB) and
fails when the carried size is over its limit; and the whole script, rehearsed on a CPU with a
tiny model, runs every step and writes its results. ``benchmarks/figures/gpu_e2e.sh`` (it needs
a GPU and the model's GGUF) is at least checked to parse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def gpu_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_dry_run_passes_and_prints_the_carried_size():
    run = gpu_check("--dry-run")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "ok: benchmarks/micro/verify_cost_gpu.py imports" in out
    assert "ok: benchmarks/micro/draft_step_gpu.py imports" in out
    named = ("tests/gpu/test_cuda_graphs.py tests/gpu/test_cuda.py tests/model/test_backends.py "
             "tests/model/test_split_attention.py")
    collected = re.search(rf"ok: {named}: (\d+) CUDA tests collected", out)
    assert collected and int(collected.group(1)) >= 5, out
    size = re.search(r"carried: ([\d.]+) MiB in (\d+) files .*limit 64 MiB", out)
    assert size and 0 < float(size.group(1)) <= 64 and int(size.group(2)) > 100, out
    assert out.rstrip().endswith("dry run: ok")


def test_dry_run_fails_over_the_carry_limit():
    run = gpu_check("--dry-run", CARRY_LIMIT_MIB="1")
    assert run.returncode != 0
    assert "is over the 1 MiB that can be brought to the GPU machine" in run.stdout
    assert run.stdout.rstrip().endswith("dry run: FAILED")


def test_rehearsal_on_a_cpu_runs_every_step(tmp_path):
    """The GPU run's own code path, on a CPU: a tiny model instead of Llama-3.1-8B's shape, the
    CUDA tests collected and skipped; the end-to-end step given pieces that are not the GGUF's
    refuses them (the one step that fails)."""
    parts = tmp_path / "parts" / "p1"
    parts.mkdir(parents=True)
    (parts / "SmolLM2-135M-Instruct.Q4_1.gguf.part-aa").write_bytes(b"not the model")
    out = tmp_path / "out"
    run = gpu_check(DEVICE="cpu", SHAPE="tiny", PREFIX="40", SIZES="1,5", REPEATS="1", DRAFT_REPEATS="2",
                    OUT=str(out), GGUF_PARTS=str(tmp_path / "parts"),
                    COST_LIMIT="300", DRAFT_LIMIT="300")  # the GPU's limits are not a 2-core CPU's
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "do not join into the file of benchmarks/figures/smollm2-gguf.sha256" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "cuda-tests.txt", "draft_step.json", "draft_step.txt", "gpu_check.json", "verify_cost.json", "verify_cost.txt"]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["environment"]["device"] == "cpu" and summary["environment"]["flex"] == "runs"
    assert [(s["name"], s["exit"], s["timed_out"]) for s in summary["steps"]] == [
        ("verify_cost", 0, False), ("draft_step", 0, False), ("cuda_tests", 0, False), ("e2e", 1, False)]
    cost = json.loads((out / "verify_cost.json").read_text())
    assert cost["backends"] == ["torch", "split", "flex", "fixed"] and cost["ok"] and cost["rounds_done"] == 1
    assert [r["q"] for r in cost["rows"]] == [1, 5]
    assert all(r["split_ok"] and r["flex_ok"] and r["fixed_ok"] and r["torch_ms"] > 0 and r["split_ms"] > 0
               and r["flex_ms"] > 0 and r["fixed_ms"] > 0 for r in cost["rows"])
    assert "fixed_32_over_1" not in cost  # no 32 among the sizes: no ratio
    row = cost["rows"][1]  # the wrong mask errs far more than bf16 does: the check can fail
    assert row["wrong_mask_max_abs_error"] > 5 * row["torch_max_abs_error"] and cost["reference"] == "fp32"
    assert all(r.get("hf_ms", 0) > 0 for r in cost["rows"]), "the HF forward timing was skipped: " + run.stdout[-2000:]
    assert all(r["bound_catches_wrong_mask"] for r in cost["rows"])
    draft = json.loads((out / "draft_step.json").read_text())
    assert draft["ok"] and [r["k"] for r in draft["rows"]] == [1, 4, 8]
    assert all(r["eager_ms"] > 0 and "graph_ms" not in r for r in draft["rows"])  # a CPU has no graphs
    assert [r["variant"] for r in draft["session"]] == ["eager", "static"]  # treespec's drafter, no graphs here
    assert all(r["propose_ms"] > 0 and r["commit_ms"] > 0 and r["nodes"] > 1 for r in draft["session"])
    assert "skipped" in (out / "cuda-tests.txt").read_text()


def test_the_end_to_end_and_staging_scripts_parse():
    for name in ("gpu_e2e.sh", "gpu_stage.sh"):
        run = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "figures" / name)], capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr
