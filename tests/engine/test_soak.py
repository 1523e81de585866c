"""The soak (tests/engine/soak.py) as a test: a short run with every check of the long one.

The long soak stays a script (``python tests/engine/soak.py --requests 1000``, tens of minutes;
docs/benchmarks.md, "Soak"); this runs it on a few batches, with each fault injected once
(at the end of the run), on the session's copy of the real model, with a prefix cache of 4 MB
(about 90 tokens of SmolLM2's K/V in fp32: it evicts).
"""

from __future__ import annotations

import json

import pytest
import soak


@pytest.mark.slow
def test_short_soak_passes(smollm2, one_thread, monkeypatch, tmp_path):
    monkeypatch.setattr(soak, "load", lambda name, **kwargs: smollm2)
    out = tmp_path / "soak.json"
    argv = ["--requests", "12", "--max-batch", "3", "--min-new", "4", "--max-new", "12",
            "--fault-every", "1000", "--warmup-batches", "2", "--prefix-cache-mb", "4", "--out", str(out)]
    assert soak.main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["failures"] == []
    assert summary["requests"] == 12 and summary["greedy_requests"] + summary["sampled_requests"] == 12
    assert summary["faults_injected"] == {"exception": 1, "interrupt_inside": 1, "interrupt_consumer": 1}
    assert summary["kv_cache"]["alive_after_run"] == 0
    cache = summary["prefix_cache"]  # every third batch asked earlier prompts again: some hit
    assert cache["pages_in_use"] == 0 and cache["bytes"] <= cache["max_bytes"] and cache["hit_tokens_in_batches"] > 0
    assert summary["command"].startswith("python tests/engine/soak.py ")
