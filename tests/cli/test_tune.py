"""``treespec tune`` end to end on a tiny model: it writes a profile and its pictures, ``bench
--auto-profile`` and ``generate --auto-profile`` read it, and a fixed tree is refused."""

from __future__ import annotations

import json

import pytest

from treespec import AutoProfile

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- command line ------------------------------------------------------------------------


def test_tune_writes_a_profile_and_pictures_and_bench_reads_it(capsys, monkeypatch, tmp_path, lm_dir):
    from treespec import cli

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Once upon a time", "Tom and Lily and Tom"]))
    prof = tmp_path / "prof.json"
    rc = cli.main(["tune", "--model", lm_dir, "--draft", f"model:{lm_dir}", "--dataset", str(data), "--prompt-field",
                   "text", "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(prof), "--plot-dir",
                   str(tmp_path / "plots"), "--no-pack", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    p = AutoProfile.load(prof)
    assert p.costs is not None and p.greedy.num_observed > 0 and p.sampling.num_observed == 0
    assert p.keys["model"] == lm_dir and p.keys["costs"]["dtype"] == "float32" and "cpu" in p.keys["machine"]
    for name in ("cost_curve", "calibration", "tree_sizes"):
        assert (tmp_path / "plots" / f"prof-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean tree size" in out

    res = tmp_path / "b.json"
    rc = cli.main(["bench", "--model", lm_dir, "--dataset", str(data), "--prompt-field", "text", "--num-prompts",
                   "2", "--max-new-tokens", "8", "--config", "ngram@auto", "--config", "ngram@chain-2",
                   "--auto-profile", str(prof), "--no-warmup", "--no-hf-lookup", "--no-pack", "--out", str(res)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    configs = {c["name"]: c for c in json.loads(res.read_text())["configs"]}
    auto = configs["ngram/auto"]
    assert auto["tree_config"].startswith("auto(") and auto["mismatches"] == 0
    assert 0 <= auto["mean_tree_size"] <= 32 and configs["ngram/chain-2"]["mean_tree_size"] <= 2
    header = next(ln for ln in out.splitlines() if "tok/s" in ln and "nodes" in ln)
    row = next(ln for ln in out.splitlines() if ln.startswith("ngram/auto"))
    at = header.index("nodes")
    assert row[at - 2: at + 5].strip() not in ("", "-")  # the table shows the mean nodes auto chose

    rc = cli.main(["generate", "--model", lm_dir, "--draft", "ngram", "--tree", "auto", "--prompt", "Tom and",
                   "--max-new-tokens", "6", "--auto-profile", str(prof), "--no-pack"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "mean tree size" in err
    rc = cli.main(["generate", "--model", lm_dir, "--draft", "ngram", "--tree", "auto", "--prompt", "Tom",
                   "--auto-profile", str(tmp_path / "missing.json")])
    _, err = capsys.readouterr()
    assert rc == 2 and "no auto profile" in err


def test_tune_refuses_a_fixed_tree(capsys, lm_dir, tmp_path):
    from treespec import cli

    assert cli.main(["tune", "--help"]) == 0 and "--refresh-costs" in capsys.readouterr().out
    rc = cli.main(["tune", "--model", lm_dir, "--tree", "cpu", "--out", str(tmp_path / "x.json")])
    _, err = capsys.readouterr()
    assert rc == 2 and "not an auto tree" in err
