"""The EAGLE trainer: data handling, the training-time-test masks, the packaged training
prompts, and a short end-to-end run (self-distilled and teacher-forced examples), resume
and the saved head loading back into a lossless drafter, on a tiny model folder the tests
build (``tiny.save_tiny_lm``)."""

from __future__ import annotations

import json

import pytest
import torch

import treespec
from treespec import models
from treespec.train import TrainConfig, train_eagle
from treespec.train.data import DataStats, read_jsonl
from treespec.train.trainer import _ttt_masks, draft_vocabulary

from tiny import save_tiny_lm


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_jsonl_shapes_and_bad_lines(tmp_path):
    f = write(tmp_path / "d.jsonl", [
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
        read_jsonl(write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="question/answer"):
        read_jsonl(write(tmp_path / "bad.jsonl", ['{"x": 1}', "oops"]))


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
    data = write(tmp_path / "d.jsonl", [json.dumps({"question": "Tom had a ball.", "answer": "He liked it a lot."}),
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
