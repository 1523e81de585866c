"""The EAGLE trainer: data handling, the training-time-test masks, the packaged training
prompts, and a short end-to-end run (self-distilled and teacher-forced examples), resume
and the saved head loading back into a lossless drafter, on a tiny model folder the tests
build (``tiny.save_tiny_lm``); the self-generated run of ``treespec train-eagle --model M
--out DIR`` (its sizing to a budget, every stage, resuming) and its progress lines."""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.tiny import save_tiny_lm
import treespec
from treespec import models
from treespec.train import TrainConfig, train_eagle
from treespec.train.data import DataStats, read_jsonl
from treespec.train.trainer import _ttt_masks, draft_vocabulary

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


def write_lines(path, lines):
    """``lines`` as a text file at ``path``, one a line."""
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_jsonl_shapes_and_bad_lines(tmp_path):
    f = write_lines(tmp_path / "d.jsonl", [
        json.dumps({"question": "q1", "answer": "a1"}),
        "not json",
        json.dumps({"prompt": "p", "completion": "c"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"text": "plain"}),
        json.dumps({"nothing": 1}),
        json.dumps([1, 2]),
    ])
    stats = DataStats()
    ex = read_jsonl(f, stats=stats)
    assert [e.answer for e in ex] == ["a1", "c", "yo", None]
    assert ex[2].messages == [{"role": "user", "content": "hi"}] and ex[3].text == "plain"
    assert (stats.lines, stats.used, stats.skipped_bad_json, stats.skipped_no_fields) == (7, 4, 1, 2)


def test_read_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="no usable examples"):
        read_jsonl(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="question/answer"):
        read_jsonl(write_lines(tmp_path / "bad.jsonl", ['{"x": 1}', "oops"]))


def test_ttt_masks_follow_tree_ancestry():
    T, lengths = 6, torch.tensor([6])
    m1, m2, m3 = _ttt_masks(T, 3, lengths)
    assert torch.equal(m1[0], torch.ones(T, T, dtype=torch.bool).tril())  # step 1: causal
    # Step 3, entry 4 simulates a depth-2 node rooted at entry 2: real keys 0..2, its
    # depth-1 ancestor (step-2 key at 3) and itself (step-3 key at 4).
    row = m3[0, 4]
    assert row[:T].nonzero().flatten().tolist() == [0, 1, 2]
    assert row[T:2 * T].nonzero().flatten().tolist() == [3]
    assert row[2 * T:].nonzero().flatten().tolist() == [4]
    assert m2[0, 4, :T].nonzero().flatten().tolist() == [0, 1, 2, 3]
    short = _ttt_masks(T, 1, torch.tensor([3]))[0]
    assert not short[0, 2, 3:].any()  # real entries never see padding keys
    assert short[0, 5, 5] and short.any(-1).all()  # no row is empty (padding rows see themselves): no NaN


def test_draft_vocabulary_is_sorted_and_consistent():
    recs = [{"labels": torch.tensor([5, 5, 5, 9, 9, 2, -100])}]
    d2t, t2d = draft_vocabulary(recs, 12, 3, always=[11])
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [5, 9, 11]  # the two most frequent, plus the forced one, by id
    assert t2d.nonzero().flatten().tolist() == [5, 9, 11]


def test_read_jsonl_takes_a_packaged_dataset_name():
    stats = DataStats()
    examples = read_jsonl("gsm8k-train", limit=3, stats=stats)
    assert len(examples) == 3 and stats.used == 3
    assert examples[0].messages[0]["content"].startswith("Natalia sold clips")
    assert examples[0].answer.endswith("#### 72")
    with pytest.raises(FileNotFoundError, match="gsm8k-train"):
        read_jsonl("gsm8k-tran")


def test_train_end_to_end_resume_and_load(tmp_path):
    model, tok = models.load(save_tiny_lm(tmp_path / "lm"))
    data = write_lines(tmp_path / "d.jsonl", [json.dumps({"question": "Tom had a ball.", "answer": "He liked it a lot."}),
                                        json.dumps({"text": "Once upon a time there was a little girl named Lily."}),
                                        json.dumps({"text": "One day, a big dog ran to the park to play."}),
                                        json.dumps({"question": "The sun was hot.", "answer": "Lily went inside."}),
                                        json.dumps({"question": "x" * 3000, "answer": "too long"})])
    out = tmp_path / "run"
    cfg = TrainConfig(data=str(data), out_dir=str(out), draft_vocab_size=64, regenerate=True,
                      regenerate_count=2, regen_max_new_tokens=12, regen_batch_size=2, epochs=2,
                      batch_size=2, warmup_steps=1, max_length=96, checkpoint_every=1)
    seen = []
    head = train_eagle(model, tok, cfg, callback=seen.append)
    assert {p.stage for p in seen} >= {"regenerate", "capture", "train"}
    # Each stage reports 0 done before its work, so a bar's rate counts the work (issue 50: the
    # regeneration bar was first drawn once done, and finished at "578524 it/s").
    for stage in ("regenerate", "capture", "train"):
        assert next(p for p in seen if p.stage == stage).done == 0
    records = torch.load(out / "captured.pt", weights_only=False)
    assert len(records) == 4  # the over-long conversation was skipped, not fatal
    for r in records:
        assert r["features"].shape == (r["tokens"].numel() - 1, 3 * model.config.hidden_size)
    assert (out / "head" / "model.safetensors").exists() and (out / "checkpoint.pt").exists()
    assert head.config.eagle3 and head.config.draft_vocab_size == 64

    # Resume: capture is skipped (the file is reused) and training continues from the checkpoint.
    stamp = (out / "captured.pt").stat().st_mtime
    seen2 = []
    train_eagle(model, tok, cfg, callback=seen2.append)
    assert (out / "captured.pt").stat().st_mtime == stamp
    assert not any(p.stage in ("regenerate", "capture") for p in seen2)

    draft = treespec.load_draft(out / "head", model)
    prompt = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    ref = model.generate(torch.tensor([[1] + prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) + 1:]
    got = treespec.generate(model, draft, "cpu-tiny", [1] + prompt, max_new_tokens=16)
    assert got.sequences[0] == ref.tolist()


# ---- the self-generated run (treespec train-eagle --model M --out DIR) ------------------------


def test_size_plan_fills_the_budget_from_the_measured_rates():
    from treespec.train.budget import (MIN_PROMPTS, Plan, Rates, answer_tokens_for, format_duration, refit_epochs,
                                       size_plan, tune_size)

    rates = Rates(turn=0.5, keep=0.8, answer=1.2, train=0.2, tune=60)  # 0.625 + 1.2 + 2 x 0.2 = 2.225 s each
    plan = size_plan(7000, rates)
    assert plan == Plan(prompts=3119, answer_tokens=256, epochs=2.0)  # floor((7000 - 60) / 2.225)
    assert sum(plan.seconds(rates).values()) <= 7000 < sum(Plan(3120, 256, 2.0).seconds(rates).values())
    assert size_plan(7000, rates, prompts=100, epochs=3) == Plan(100, 256, 3)  # given amounts are kept
    assert size_plan(7000, rates, epochs=1).prompts == 3427  # fewer epochs: more data
    assert size_plan(30, rates).prompts == MIN_PROMPTS  # too short: the least that trains, said by the run
    # Once the answers are in: the epochs fit the time left, within [1, 3].
    assert refit_epochs(60 + 1000 * 0.2 * 2.5, rates, 1000, 2.0) == 2.5
    assert refit_epochs(100, rates, 1000, 2.0) == 1.0
    assert refit_epochs(1e6, rates, 1000, 2.0) == 3.0
    assert [answer_tokens_for(b) for b in (None, 7200, 600, 599, 180, 179)] == [256, 256, 256, 128, 128, 64]
    assert tune_size(7200) == (8, 128) and tune_size(600) == (4, 64) and tune_size(60) == (2, 32)
    assert [format_duration(s) for s in (45, 89.6, 600, 3900, 7200)] == ["45 s", "90 s", "10 min", "1 h 05 min",
                                                                         "2 h 00 min"]


@pytest.mark.parametrize("text, seconds", [("2h", 7200), ("30m", 1800), ("5m", 300), ("90s", 90), ("1h30m", 5400),
                                           ("45", 45), ("1.5h", 5400)])
def test_budget_durations(text, seconds):
    from treespec.cli.train_eagle import duration

    assert duration(text) == seconds


@pytest.mark.parametrize("argv, expect", [
    (["--budget", "2 hours"], "is not a duration"),
    (["--budget", "0s"], "more than 0"),
    (["--budget", "1h30"], "is not a duration"),
    (["--data", "gsm8k-train", "--budget", "2h"], "self-generated prompts"),
    (["--regenerate", "5"], "--regenerate is for --data"),
])
def test_train_eagle_mistakes_answer_in_one_line(capsys, tmp_path, argv, expect):
    from treespec.cli import main

    assert main(["train-eagle", "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0]


@pytest.fixture(scope="module")
def flat_chat_lm_dir(tmp_path_factory):
    """A tiny random chat llama whose next-token distributions are nearly flat (``peak=1``): the
    turns it samples end (EOS) and differ often enough for the filters to keep some (a tenth)."""
    from helpers.tiny import CHATML

    return save_tiny_lm(tmp_path_factory.mktemp("chat-lm") / "lm", chat_template=CHATML, peak=1.0,
                        max_position_embeddings=512)


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("treespec: [")]


def test_train_eagle_with_nothing_but_a_model_runs_every_stage_and_resumes(capsys, flat_chat_lm_dir, tmp_path):
    """Issue 50: ``train-eagle --model M --out D --budget ...`` writes its prompts, answers them,
    trains, validates and tunes; the head drafts the target's own greedy text; the same command
    again skips every stage, each said in one line."""
    from treespec.cli import main

    out = tmp_path / "run"
    argv = ["train-eagle", "--model", str(flat_chat_lm_dir), "--out", str(out), "--budget", "40s", "--threads", "1",
            "--draft-vocab", "64"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "plan for 40 s:" in err and "measured:" in err
    done = [line for line in _lines(err) if re.search(r" in (\d+ s|\d+ min|\d+ h \d\d min)$", line)]
    assert [line.split()[2].rstrip(":") for line in done] == ["prompts", "answers", "train", "tune"], err
    assert "held-out top-1 by step" in err and "left in all" in err
    for f in ("prompts.jsonl", "prompts-val.jsonl", "validation.txt", "head/model.safetensors",
              "head/auto-profile.json"):
        assert (out / f).exists(), f
    state = json.loads((out / "run.json").read_text())
    assert state["plan"]["prompts"] >= 16 and state["stages"]["prompts"]["kept"] > 0

    model, tok = models.load(flat_chat_lm_dir)
    draft = treespec.load_draft(out / "head", model)
    assert draft.auto_calibration is not None  # the tune stage's calibrations, read with the head
    prompt = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    got = treespec.generate(model, draft, "cpu-tiny", prompt, max_new_tokens=24)
    assert got.sequences[0] == ref.tolist()
    assert main(["generate", "--model", str(flat_chat_lm_dir), "--draft", str(out / "head"), "--tree", "chain-3",
                 "--prompt", "Once upon a time", "--max-new-tokens", "8", "--threads", "1"]) == 0
    capsys.readouterr()

    stamp = (out / "head" / "model.safetensors").stat().st_mtime
    assert main(argv[:-4] + ["--threads", "1", "--draft-vocab", "64"]) == 0  # --budget left out: the run's own
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 4 and all(line.endswith(": skipped") for line in lines), lines
    assert (out / "head" / "model.safetensors").stat().st_mtime == stamp


def test_a_run_stopped_mid_way_resumes_at_the_stage_it_stopped_in(flat_chat_lm_dir, tmp_path):
    """Stopped as training begins, the run resumes there: prompts and answers are not made again."""
    from dataclasses import replace

    from treespec.train.pipeline import OwnRun, PipelineConfig

    model, tok = models.load(flat_chat_lm_dir)
    cfg = PipelineConfig(str(tmp_path / "run"), budget=None, prompts=6, answer_tokens=16, epochs=1,
                         train=TrainConfig(data="", out_dir="", draft_vocab_size=64, batch_size=4), model="tiny")

    class Stop(Exception):
        pass

    def stop_at_train(p):
        if p.stage == "train" and "line" in p.info and "[3/4]" in p.info["line"]:
            raise Stop

    with pytest.raises(Stop):
        OwnRun(model, tok, cfg, callback=stop_at_train).run()
    answers = sorted((tmp_path / "run" / "capture").glob("shard-*.pt"))
    stamps = [f.stat().st_mtime for f in answers]
    seen = []
    OwnRun(model, tok, cfg, callback=seen.append).run()
    said = [p.info["line"] for p in seen if "line" in p.info]
    assert said[0].startswith("[1/4] prompts:") and said[0].endswith("skipped")
    assert said[1].startswith("[2/4] answers:") and said[1].endswith("skipped")
    assert any(line.startswith("[3/4] train: an EAGLE head, 1 epoch(s)") for line in said)
    assert [f.stat().st_mtime for f in answers] == stamps and answers
    assert not any(p.stage in ("prompts", "answers") and "line" not in p.info for p in seen)
    with pytest.raises(ValueError, match="other settings"):
        OwnRun(model, tok, PipelineConfig(cfg.out_dir, budget=None, prompts=7, train=cfg.train, model="tiny")).run()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "checkpoint.pt").touch()  # a run on --data or --captured: not resumed as this one
    with pytest.raises(ValueError, match="on other data"):
        OwnRun(model, tok, replace(cfg, out_dir=str(tmp_path / "old"))).run()


def test_progress_lines_off_a_terminal_come_every_tenth_with_the_time_left():
    import io
    from types import SimpleNamespace as P

    from treespec.cli.train_progress import TrainReport

    f = io.StringIO()
    report = TrainReport(tty=False, file=f)
    report(P(stage="answers", done=0, total=0, info={"line": "[2/4] answers: ..."}))
    for done in range(0, 41):
        report(P(stage="answers", done=done, total=40, info={"left": 600 - done}))
    lines = f.getvalue().splitlines()
    assert lines[0] == "treespec: [2/4] answers: ..."
    assert len(lines) == 12  # the line, then 0%, 10%, ..., 100%
    assert lines[1] == "treespec: answers: 0/40 convs (0%), about 10 min left in all"
    assert lines[-1] == "treespec: answers: 40/40 convs (100%), about 9 min left in all"
    # On a terminal a bar counts from where its stage starts (a resumed capture's done shards are
    # not this run's rate), and a new round of a stage gets a new bar.
    bars = TrainReport(tty=True, file=io.StringIO())
    bars(P(stage="capture", done=50, total=100, info={}))
    assert bars.bars["capture"].initial == 50
    bars(P(stage="capture", done=100, total=100, info={}))
    assert "capture" not in bars.bars
    bars(P(stage="capture", done=0, total=3, info={}))
    assert bars.bars["capture"].initial == 0 and bars.bars["capture"].total == 3
    bars.close()


# ---- a model without a head ---------------------------------------------------------------------


def test_a_model_without_a_head_drafts_by_prompt_lookup_with_a_notice(capsys, monkeypatch, flat_chat_lm_dir, tmp_path):
    """Issue 50: with another model, the default draft (the shipped head, made for SmolLM2) made
    generate, chat and bench exit 2; they now draft by prompt lookup and say so in one line,
    naming train-eagle. A head asked for by name still fails, with its advice."""
    import io

    from treespec.cli import main

    notice = f"treespec: {flat_chat_lm_dir} has no EAGLE head: drafting by prompt lookup (--draft ngram); train one with: " \
             f"treespec train-eagle --model {flat_chat_lm_dir} --out DIR (docs/own-model.md)"
    flags = ["--model", str(flat_chat_lm_dir), "--max-new-tokens", "6", "--threads", "1"]
    assert main(["generate", *flags, "--chat", "Once upon a time"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines().count(notice) == 1 and "(draft ngram, tree auto" in err

    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time\n"))
    assert main(["chat", *flags]) == 0
    assert capsys.readouterr().err.splitlines().count(notice) == 1

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    assert main(["bench", *flags, "--dataset", str(prompts), "--num-prompts", "1", "--no-hf-lookup",
                 "--no-treespec-ar", "--out", str(tmp_path / "bench.json")]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines().count(notice) == 1
    names = [c["name"] for c in json.loads((tmp_path / "bench.json").read_text())["configs"]]
    assert names.count("ngram/auto") == 1 and "ngram/chain-3" in names  # both default drafts fell back to one

    assert main(["generate", *flags, "--chat", "Hi", "--draft", "smollm2-135m-instruct-eagle"]) == 2
    err = capsys.readouterr().err
    assert notice not in err and "is an EAGLE head for another model" in err and "treespec train-eagle" in err
