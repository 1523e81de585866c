"""Training from captures: the shards in either layout, several capture folders and a head to
start from, the bf16 autocast step against fp32, soft labels as the target's distribution;
``treespec capture`` resumed and read by ``train-eagle``; the ablation runner on a tiny capture.
On the tests' tiny model folder (``helpers.tiny.save_tiny_lm``)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers.captures import capture_config, capture_data
from helpers.tiny import save_tiny_lm
from treespec import models
from treespec.train import TrainConfig, train_eagle
from treespec.train.capture import CaptureConfig, capture_shards, load_shards, shard_files

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- training from captures -------------------------------------------------------------------


def test_reference_answers_and_training_from_shards_in_both_layouts(lm, tmp_path):
    model, tok = lm
    data = capture_data(tmp_path)
    cap = tmp_path / "cap"
    capture_shards(model, tok, capture_config(data, cap))
    ref = tmp_path / "ref"
    capture_shards(model, tok, CaptureConfig(data=f"{data}[:8]", out_dir=str(ref), answers="reference",
                                             max_length=80, shard_size=4))
    recs = load_shards(ref)
    assert len(recs) == 8 and recs[0]["tokens"].numel() > recs[0]["prompt_len"]
    e3 = tmp_path / "e3"
    capture_shards(model, tok, CaptureConfig(data=f"{data}[:1]", out_dir=str(e3), answers="reference",
                                             features="eagle3"))
    with pytest.raises(ValueError, match="none for EAGLE-1/2"):
        load_shards(e3, eagle3=False)
    for arch_eagle3 in (True, False):
        out = tmp_path / f"run-{arch_eagle3}"
        cfg = TrainConfig(data="", out_dir=str(out), captured=str(cap), val_captured=str(ref), eagle3=arch_eagle3,
                          draft_vocab_size=64 if arch_eagle3 else None, epochs=1, batch_size=4, warmup_steps=1,
                          max_examples=6)
        head = train_eagle(model, tok, cfg)
        assert head.config.eagle3 == arch_eagle3 and (out / "head" / "model.safetensors").exists()
        assert not (out / "captured.pt").exists()  # read from the shards, not captured again
        assert (out / "validation.txt").read_text().startswith("loss ")


def test_training_on_several_capture_folders_and_from_a_head(lm, tmp_path):
    """``captured`` takes folders in order (``max_examples`` counts across them), and ``init``
    fine-tunes a head: its draft vocabulary kept, its weights the start,
    a layout or vocabulary that does not match refused."""
    from treespec.drafters.eagle_head import load_head
    from treespec.train.trainer import _new_head, _training_records

    model, tok = lm
    data = capture_data(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    capture_shards(model, tok, CaptureConfig(data=f"{data}[:4]", out_dir=str(a), answers="reference", shard_size=2))
    capture_shards(model, tok, CaptureConfig(data=f"{data}[4:10]", out_dir=str(b), answers="reference", shard_size=2))
    both = f"{a},{b}"
    recs = _training_records(model, tok, TrainConfig(data="", out_dir=str(tmp_path / "r"), captured=both), tmp_path, None)
    assert [r["tokens"].tolist() for r in recs] == [r["tokens"].tolist() for r in load_shards(a) + load_shards(b)]
    six = _training_records(model, tok, TrainConfig(data="", out_dir=str(tmp_path / "r"), captured=both,
                                                    max_examples=6), tmp_path, None)
    assert len(six) == 6 and six[5]["tokens"].tolist() == load_shards(b)[1]["tokens"].tolist()
    base = tmp_path / "base"
    train_eagle(model, tok, TrainConfig(data="", out_dir=str(base), captured=str(a), draft_vocab_size=64,
                                        epochs=1, batch_size=2, warmup_steps=1))
    start = load_head(base / "head", model)
    same, _ = _new_head(model, tok, TrainConfig(data="", out_dir="", init=str(base / "head"), draft_vocab_size=64),
                        recs)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in same.parameters())
    for (k, v), w in zip(start.state_dict().items(), same.state_dict().values()):
        torch.testing.assert_close(w.float(), v.float(), msg=k)
    tuned = train_eagle(model, tok, TrainConfig(data="", out_dir=str(tmp_path / "tuned"), captured=str(b),
                                                init=str(base / "head"), draft_vocab_size=64, epochs=1,
                                                batch_size=2, warmup_steps=1))
    assert torch.equal(tuned.d2t, start.d2t)  # b's labels would give another vocabulary
    assert not torch.equal(tuned.fc.weight.float(), start.fc.weight.float())
    with pytest.raises(ValueError, match="draft vocabulary of 64"):
        train_eagle(model, tok, TrainConfig(data="", out_dir=str(tmp_path / "v"), captured=str(b),
                                            init=str(base / "head"), draft_vocab_size=32))
    with pytest.raises(ValueError, match="--arch"):
        train_eagle(model, tok, TrainConfig(data="", out_dir=str(tmp_path / "e1"), captured=str(b),
                                            init=str(base / "head"), eagle3=False))


def test_bf16_autocast_training_step_matches_float32(lm, tmp_path):
    """The bf16-autocast TTT step (the trainer's default on a CPU with native bf16) computes the
    loss and gradients of the fp32 step up to bf16 rounding: a wrong cast (a mask or a
    softmax in bf16 gone bad, labels misaligned) would move them far more."""
    from treespec.drafters.eagle import EagleHead
    from treespec.train.trainer import _autocast_dtype, _collate, ttt_loss

    model, tok = lm
    cap = tmp_path / "cap"
    capture_shards(model, tok, capture_config(capture_data(tmp_path), cap))
    recs = load_shards(cap)
    torch.manual_seed(0)
    head = EagleHead.for_target(model, eagle3=True, draft_vocab_size=None).float()
    batch = _collate(recs, list(range(len(recs))))
    grads, losses = [], []
    for amp in (False, True):
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = ttt_loss(head, batch, 3)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([q.grad.reshape(-1) for q in head.parameters() if q.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.98
    assert _autocast_dtype("float32", "cpu") is None
    assert _autocast_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="auto, bfloat16 or float32"):
        _autocast_dtype("fp16", "cpu")


def test_soft_labels_are_the_targets_distribution(lm, tmp_path):
    """Soft labels: the target's distribution recomputed from the captured final state sits at
    the entry of its label (the target's argmax there is the greedy label), a one-hot one
    gives the hard loss exactly, and training on them runs and needs a capture folder."""
    from treespec.drafters.eagle import EagleHead
    from treespec.train.trainer import _collate, target_probs, ttt_loss

    model, tok = lm
    cap = tmp_path / "cap"
    capture_shards(model, tok, capture_config(capture_data(tmp_path), cap))
    recs = load_shards(cap, greedy_only=True, final=True)
    assert "final" not in load_shards(cap)[0]
    W = model.get_output_embeddings().weight
    keep = torch.arange(0, W.shape[0], 2)  # a draft vocabulary of every other token
    probs = target_probs(recs[0]["final"], W[keep])
    want = torch.softmax(model.get_output_embeddings()(recs[0]["final"].float())[:, keep].float(), -1)
    torch.testing.assert_close(probs, want, rtol=1e-4, atol=1e-6)
    # Alignment: with the full vocabulary, the argmax of each entry's target distribution is
    # its label (the target's greedy token), up to fp16-stored states at near-ties.
    batch = _collate(recs, range(len(recs)), W.detach())
    sel = batch["labels"] >= 0
    agree = (batch["target_probs"].argmax(-1)[sel] == batch["labels"][sel]).float().mean()
    assert agree > 0.95, agree
    shifted = (batch["target_probs"][:, 1:].argmax(-1)[sel[:, :-1]] == batch["labels"][:, :-1][sel[:, :-1]])
    assert shifted.float().mean() < 0.5  # one entry off would not agree
    head = EagleHead.for_target(model, eagle3=True, draft_vocab_size=None).float()
    with torch.no_grad():
        hard, _ = ttt_loss(head, {k: v for k, v in batch.items() if k != "target_probs"}, 3)
        onehot = torch.nn.functional.one_hot(batch["labels"].clamp(min=0), W.shape[0]).float()
        as_soft, _ = ttt_loss(head, dict(batch, target_probs=onehot), 3)
    assert float(as_soft) == pytest.approx(float(hard), rel=1e-5)
    out = tmp_path / "soft"
    cfg = TrainConfig(data="", out_dir=str(out), captured=str(cap), val_captured=str(cap), draft_vocab_size=64,
                      epochs=1, batch_size=4, warmup_steps=1, soft_labels=True)
    assert train_eagle(model, tok, cfg).config.eagle3 and (out / "validation.txt").exists()
    with pytest.raises(ValueError, match="soft labels need a capture folder"):
        train_eagle(model, tok, TrainConfig(data=capture_data(tmp_path), out_dir=str(tmp_path / "x"), soft_labels=True))


# ---- command line -----------------------------------------------------------------------------


def test_keep_freed_memory_applies_on_glibc():
    import platform
    import sys

    from treespec.train import keep_freed_memory

    if not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"):
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True


def test_cli_capture_resumes_and_train_eagle_reads_it(tmp_path, capsys, monkeypatch):
    from treespec import cli

    kept = []  # train-eagle keeps freed memory for the next step (process-wide, so the CLI's call)
    monkeypatch.setattr("treespec.train.keep_freed_memory", lambda: kept.append(True) or True)

    lm = str(save_tiny_lm(tmp_path / "lm"))
    data = capture_data(tmp_path)
    cap = str(tmp_path / "cap")
    argv = ["capture", "--model", lm, "--data", f"{data}[:6],{data}[6:]", "--mix", "1,1", "--out", cap,
            "--max-examples", "5", "--max-new-tokens", "6", "--max-length", "80", "--shard-size", "2",
            "--batch-size", "2", "--sample-share", "0.3", "--dtype", "float32", "--threads", "1"]
    assert cli.main(argv) == 0
    assert "3 shard(s) written, 0 already there, of 3" in capsys.readouterr().out
    assert cli.main(argv[:argv.index("--max-examples") + 1] + ["7"] + argv[argv.index("--max-examples") + 2:]) == 0
    # Growing the capture: the two full shards stay, the partial third one is superseded.
    assert "2 shard(s) written, 2 already there, of 4" in capsys.readouterr().out
    assert [p.name for p in shard_files(cap)] == ["shard-000000-000002.pt", "shard-000002-000004.pt",
                                                  "shard-000004-000006.pt", "shard-000006-000007.pt"]
    out = str(tmp_path / "run")
    assert cli.main(["train-eagle", "--model", lm, "--captured", cap, "--out", out, "--epochs", "1",
                     "--batch-size", "4", "--draft-vocab", "64"]) == 0
    assert (tmp_path / "run" / "head" / "config.json").exists() and kept == [True]
    # No data: the target would write its prompts (issue 50), which needs a chat template.
    assert cli.main(["train-eagle", "--model", lm, "--out", str(tmp_path / "own")]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert cli.main(["capture", "--model", lm, "--data", data, "--out", cap, "--mix", "1,2"]) == 2
    assert "one non-negative weight per dataset" in capsys.readouterr().err
    pen = tmp_path / "pen"  # generation options reach the capture and its manifest
    assert cli.main(["capture", "--model", lm, "--data", f"{data}[:2]", "--out", str(pen), "--max-new-tokens", "4",
                     "--max-length", "80", "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "3",
                     "--dtype", "float32", "--threads", "1"]) == 0
    assert json.loads((pen / "capture.json").read_text())["options"] == {"no_repeat_ngram_size": 3,
                                                                        "repetition_penalty": 1.3}
    assert cli.main(["capture", "--model", lm, "--data", data, "--out", str(pen), "--answers", "reference",
                     "--repetition-penalty", "1.3"]) == 2
    assert "need answers='target'" in capsys.readouterr().err


# ---- ablation runner --------------------------------------------------------------------------


def test_ablation_runner_on_a_tiny_capture(tmp_path, capsys):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "training"))
    import ablate_head

    lm = save_tiny_lm(tmp_path / "lm")
    model, tok = models.load(lm)
    data = capture_data(tmp_path)
    for name, kw in (("cap", {"data": f"{data}[:8]"}), ("ref", {"data": f"{data}[:8]", "answers": "reference"}),
                     ("val", {"data": f"{data}[7:9]"})):
        capture_shards(model, tok, CaptureConfig(out_dir=str(tmp_path / name), max_new_tokens=8, max_length=80,
                                                 shard_size=4, **kw))
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Once upon a time", "Tom and Lily")) + "\n")
    argv = ["--model", str(lm), "--capture", str(tmp_path / "cap"), "--reference-capture", str(tmp_path / "ref"),
            "--val-capture", str(tmp_path / "val"), "--out", str(tmp_path / "abl"), "--sizes", "3,all", "--base-examples", "6",
            "--gsm8k-examples", "4", "--answers-source", data, "--vocabs", "64,128,256", "--epochs", "1", "--batch-size", "4",
            "--eval", f"{prompts}:2", "--trees", "chain-3,cpu-tiny", "--max-new-tokens", "8", "--dtype", "float32"]
    assert ablate_head.main(argv + ["--only", "base,data-3,data-all,ttt-1,eagle1,gsm8k-target,gsm8k-reference,"
                                             "vocab-128"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "abl" / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["base", "data-3", "data-all", "vocab-128", "ttt-1", "eagle1", "gsm8k-target",
                                         "gsm8k-reference"]
    sizes = [r["train"]["max_examples"] for r in rows]
    assert sizes[:5] == [6, 3, None, 6, 6] and sizes[6:] == [4, 4]  # the base's size, unless the row varies it
    rows.pop(2)
    assert all(set(r["tau"]) == {"eval@chain-3", "eval@cpu-tiny"} and r["tau"]["eval@chain-3"] >= 1.0 for r in rows)
    assert len(rows[3]["top1_by_step"]) == 1 and len(rows[0]["top1_by_step"]) == 3
    assert rows[-1]["captured"].endswith("ref")
    md = (tmp_path / "abl" / "results.md").read_text()
    assert md.count("\n| ") == 8 and "tau eval@chain-3" in md
    # A row already there is skipped; a head trained elsewhere is validated and measured alike.
    assert ablate_head.main(argv + ["--only", "base", "--existing", f"again={tmp_path / 'abl' / 'base' / 'head'}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "abl" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 9 and rows[-1]["name"] == "again" and rows[-1]["train_seconds"] is None
    assert rows[-1]["tau"] == rows[0]["tau"]  # the same head on the same prompts, greedy
    assert rows[-1]["top1_by_step"] == pytest.approx(rows[0]["top1_by_step"], abs=0.05)
