"""``treespec tree show``: presets, tree files and a prompt's drafts as pictures, the accepted
path highlighted, prompt lookup grafted on, the recording drafter's calibration, the runtime
flags honoured. One test needs real text (prompt lookup must find a repeat in the target's own
continuation) and runs on stories260K, from the project's shared/ folder where there is one."""

from __future__ import annotations

import re

import pytest
import torch

from helpers.cli import PNG, error_line, run_cli
from helpers.tiny import STORIES260K_MISSING, stories260k_gguf
from treespec import cli
from treespec.drafters import RecordingDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

needs_stories = pytest.mark.skipif(stories260k_gguf() is None, reason=STORIES260K_MISSING)


# ---- tree show --------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["cpu", "eagle1"])
def test_tree_show_preset(capsys, tmp_path, preset):
    png = tmp_path / "x.png"
    rc, out, err = run_cli(capsys, "tree", "show", preset, "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    assert "drafted nodes" in out


def test_tree_show_json_file(capsys, tmp_path):
    f = tmp_path / "mine.json"
    f.write_text("[[0], [1], [0, 0]]")
    rc, out, _ = run_cli(capsys, "tree", "show", str(f), "--out", str(tmp_path / "m.png"))
    assert rc == 0
    assert "3 drafted nodes, depth 2" in out


@needs_stories
def test_tree_show_prompt_ngram(capsys, tmp_path):
    png = tmp_path / "e.png"
    # The target's first token (" b") continues an earlier "a big": ngram has a run to propose.
    rc, out, err = run_cli(capsys, "tree", "show", "eagle1", "--prompt", "She saw a big red ball. She saw a big",
                       "--model", str(stories260k_gguf()), "--draft", "ngram", "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    drafted = int(re.search(r"\((\d+) drafted nodes", out).group(1))
    assert 1 <= drafted <= 25


def test_tree_show_prompt_highlights_the_accepted_path(capsys, tmp_path, lm_dir):
    """An identical copy of the target as the draft: its top-1 branch is the target's greedy
    continuation, so the whole depth of the tree is accepted."""
    png = tmp_path / "c.png"
    rc, out, err = run_cli(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time", "--model", lm_dir,
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
    rc, out, err = run_cli(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time, once upon a time, once upon a",
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
    rc, out, err = run_cli(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time", "--model", lm_dir,
                       "--draft", f"model:{lm_dir}", "--dtype", "bfloat16", "--out", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == PNG
    if not torch.cuda.is_available():
        rc, _, err = run_cli(capsys, "tree", "show", "cpu", "--prompt", "Once upon a time", "--model", lm_dir,
                         "--draft", "ngram", "--device", "cuda", "--out", str(tmp_path / "c.png"))
        assert rc == 2
        assert "no CUDA GPU" in error_line(err)
