"""The sharded capture (``treespec.train.capture``): the plan mixes packaged sets and slices; a
capture killed mid-way and resumed equals an uninterrupted one; lost shards are rebuilt from
their answers files, another capture's answers are reused where they fit and refused where they
do not; an answer does not depend on its batch; generation options answer as generate does; the
sampled share is honoured. On the tests' tiny model folder (``helpers.tiny.save_tiny_lm``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.captures import capture_config, capture_data
from treespec.train.capture import (
    CaptureConfig, _by_tokens, _interleave, _sampled, _write_answers, answers_of, capture_plan, capture_shards,
    load_shards, parse_data_spec, shard_files,
)
from treespec.train.data import read_jsonl as read_examples
from treespec.train.data import tokenize_example

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


# ---- plan -------------------------------------------------------------------------------------


def test_parse_data_spec_and_interleave_prefixes_follow_the_mix():
    assert parse_data_spec("a[:100], b[5:],c") == [("a", None, 100), ("b", 5, None), ("c", None, None)]
    order = _interleave([6, 3], [2.0, 1.0])
    assert [d for d, _ in order] == [0, 1, 0, 0, 1, 0, 0, 1, 0]  # every prefix close to 2:1
    assert [i for d, i in order if d == 0] == list(range(6))  # each dataset in its own order
    assert [d for d, _ in _interleave([1, 4], [1.0, 1.0])] == [0, 1, 1, 1, 1]  # an exhausted set drops out


def test_capture_plan_mixes_packaged_sets_with_slices(tmp_path):
    cfg = CaptureConfig(data="gsm8k-train[:10],stdlib-code[:5],chat-train[-3:]", out_dir=str(tmp_path),
                        mix=(2, 1, 1))
    plan = capture_plan(cfg)
    keys = [k for k, _ in plan]
    assert len(plan) == 18 and keys[:4] == ["gsm8k-train:0", "stdlib-code:0", "chat-train:3805", "gsm8k-train:1"]
    assert len(capture_plan(CaptureConfig(data=cfg.data, out_dir=str(tmp_path), max_examples=7))) == 7
    with pytest.raises(ValueError, match="one non-negative weight per dataset"):
        CaptureConfig(data="gsm8k-train,chat-train", out_dir=str(tmp_path), mix=(1,))


# ---- capture ----------------------------------------------------------------------------------


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["source"] == y["source"] and x["sampled"] == y["sampled"] and x["prompt_len"] == y["prompt_len"]
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"], y["labels"])
        assert torch.equal(x["features"], y["features"])


def test_capture_resumes_after_a_kill_with_the_same_result(lm, tmp_path):
    model, tok = lm
    data = capture_data(tmp_path)
    whole = capture_shards(model, tok, capture_config(data, tmp_path / "a"))
    assert whole["shards"] == 4 and whole["written"] == 4 and whole["too_long"] == 1

    seen = []

    def kill_in_second_shard(p):
        seen.append(p)
        if p.done > 0:
            raise KeyboardInterrupt  # stands for a kill after the first shard

    b = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        capture_shards(model, tok, capture_config(data, b), callback=kill_in_second_shard)
    (b / "shard-000003-000006.pt.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    assert [p.name for p in shard_files(b)] == ["shard-000000-000003.pt"]
    rest = capture_shards(model, tok, capture_config(data, b))
    assert (rest["skipped"], rest["written"]) == (1, 3)
    assert [p.name for p in shard_files(b)] == [p.name for p in shard_files(tmp_path / "a")]
    _same(load_shards(b, mmap=False), load_shards(tmp_path / "a", mmap=False))
    again = capture_shards(model, tok, capture_config(data, b))
    assert (again["skipped"], again["written"]) == (4, 0)
    with pytest.raises(ValueError, match="other settings.*sample_share"):
        capture_shards(model, tok, CaptureConfig(data=data, out_dir=str(b), max_new_tokens=10, max_length=80,
                                                 shard_size=3, batch_size=2, seed=1, sample_temperature=0.9))

    records = load_shards(b)
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # 9 (too long) skipped, no duplicate
    keys = [f"{data}:{i}" for i in range(8)]
    assert [r["sampled"] for r in records[:8]] == [_sampled(capture_config(data, b), k)[0] for k in keys]
    assert not records[8]["sampled"] and records[8]["prompt_len"] == 0  # plain text: teacher-forced
    H = model.config.hidden_size
    assert records[0]["features"].shape[1] == 3 * H  # EAGLE-3 view of the 4H stored
    assert load_shards(b, eagle3=False)[0]["features"].shape[1] == H
    assert len(load_shards(b, limit=4)) == 4 and all(not r["sampled"] for r in load_shards(b, greedy_only=True))
    for r in records[:8]:  # target answers: the labels are the answer tokens themselves
        plen = r["prompt_len"]
        assert torch.equal(r["labels"][plen - 1:-1], r["tokens"][plen:])


def test_lost_shards_are_rebuilt_from_their_answers_files(lm, tmp_path):
    """The answers files are the costly part of a capture: with the shards deleted, the same
    command rebuilds them from the answers (a teacher-forced forward, no decoding) with the
    same conversations, tokens, labels and sampled flags, and features equal to the decoded
    ones up to rounding. A shard without its answers file gets one; a foreign one is refused."""
    model, tok = lm
    data = capture_data(tmp_path)
    a = tmp_path / "a"
    first = capture_shards(model, tok, capture_config(data, a))
    assert first["rebuilt"] == 0 and first["generated_tokens"] > 0
    answers = sorted(p.name for p in a.glob("answers-*.jsonl.gz"))
    assert answers == [p.name.replace("shard", "answers").replace(".pt", ".jsonl.gz") for p in shard_files(a)]
    decoded = load_shards(a, mmap=False)

    b = tmp_path / "b"  # what git keeps: the manifest and the answers files, no shard
    b.mkdir()
    for name in ["capture.json", *answers]:
        (b / name).write_bytes((a / name).read_bytes())
    again = capture_shards(model, tok, capture_config(data, b))
    assert (again["written"], again["rebuilt"], again["generated_tokens"]) == (4, 4, 0)
    rebuilt = load_shards(b, mmap=False)
    assert len(rebuilt) == len(decoded)
    for x, y in zip(decoded, rebuilt):
        assert (x["index"], x["source"], x["sampled"], x["prompt_len"]) == (y["index"], y["source"], y["sampled"],
                                                                             y["prompt_len"])
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"], y["labels"])
        torch.testing.assert_close(x["features"].float(), y["features"].float(), atol=2e-2, rtol=1e-2)
    # The answers files are byte-identical whoever writes them (no timestamp in the gzip).
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in answers)

    # Decoding comes first: with the answers of every other shard kept, the shards that must
    # be decoded are written before those rebuilt (a run stopped early loses only replays).
    d = tmp_path / "d"
    d.mkdir()
    for name in ["capture.json", *answers[::2]]:
        (d / name).write_bytes((a / name).read_bytes())
    order = []
    mixed = capture_shards(model, tok, capture_config(data, d), callback=lambda p: order.append(p.info["shard"]))
    assert (mixed["written"], mixed["rebuilt"]) == (4, 2) and mixed["generated_tokens"] > 0
    shards = [n.replace("answers", "shard").replace(".jsonl.gz", ".pt") for n in answers]
    assert order == [None, shards[1], shards[3], shards[0], shards[2]]

    # A shard written before answers files existed gets its file on the next run.
    (a / answers[1]).unlink()
    assert capture_shards(model, tok, capture_config(data, a))["written"] == 0
    assert (a / answers[1]).read_bytes() == (b / answers[1]).read_bytes()

    # An answers file from another plan, or a damaged one, is refused with what to do.
    c = tmp_path / "c"
    c.mkdir()
    (c / "capture.json").write_bytes((a / "capture.json").read_bytes())
    (c / answers[0]).write_bytes((a / answers[1]).read_bytes())
    with pytest.raises(ValueError, match="does not match the plan at conversation 0.*delete it"):
        capture_shards(model, tok, capture_config(data, c))
    (c / answers[0]).write_bytes((a / answers[0]).read_bytes()[:40])  # what a cut copy leaves
    with pytest.raises(ValueError, match="not a readable answers file.*delete it"):
        capture_shards(model, tok, capture_config(data, c))

    # A reference capture keeps no answers files: the target wrote nothing.
    ref = tmp_path / "ref"
    capture_shards(model, tok, CaptureConfig(data=f"{data}[:4]", out_dir=str(ref), answers="reference",
                                             max_length=80, shard_size=3))
    assert shard_files(ref) and not list(ref.glob("answers-*"))


def test_a_capture_of_other_data_reuses_the_answers_a_folder_holds(lm, tmp_path):
    """``answers_from``: a capture of a subset of data captured before takes the target's
    answers from that folder (matched by source key, whatever their place in its plan) and
    decodes only what it lacks; its records equal a capture decoded from scratch."""
    model, tok = lm
    data = capture_data(tmp_path)
    capture_shards(model, tok, capture_config(data, tmp_path / "all", model="tiny"))
    reference = {r["source"]: r for r in load_shards(tmp_path / "all", mmap=False)}

    # data[4:] (shard_size 3: [4, 7) and [7, 10), the latter with a text record to teacher-force
    # and a prompt too long to answer) lies within the first capture: nothing decoded.
    sub = capture_shards(model, tok, capture_config(f"{data}[4:]", tmp_path / "sub", model="tiny"),
                         answers_from=str(tmp_path / "all"))
    assert (sub["written"], sub["rebuilt"], sub["generated_tokens"], sub["too_long"]) == (2, 2, 0, 1)
    records = load_shards(tmp_path / "sub", mmap=False)
    assert [r["source"] for r in records] == [f"{data}:{i}" for i in range(4, 9)]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        x = reference[r["source"]]
        assert (r["sampled"], r["prompt_len"]) == (x["sampled"], x["prompt_len"])
        assert torch.equal(r["tokens"], x["tokens"]) and torch.equal(r["labels"], x["labels"])
        torch.testing.assert_close(r["features"].float(), x["features"].float(), atol=2e-2, rtol=1e-2)

    # A range with a conversation no folder answered is decoded whole; the others are rebuilt.
    capture_shards(model, tok, capture_config(f"{data}[:5]", tmp_path / "first5", model="tiny"))
    mixed = capture_shards(model, tok, capture_config(f"{data}[3:9]", tmp_path / "mixed", model="tiny"),
                           answers_from=[tmp_path / "first5"])
    assert (mixed["written"], mixed["rebuilt"]) == (2, 0) and mixed["generated_tokens"] > 0  # 5..8 unanswered
    mixed2 = capture_shards(model, tok, capture_config(f"{data}[2:8]", tmp_path / "mixed2", model="tiny"),
                            answers_from=[tmp_path / "first5"])
    assert (mixed2["written"], mixed2["rebuilt"]) == (2, 1) and mixed2["generated_tokens"] > 0  # [2, 5) reused
    scratch = capture_shards(model, tok, capture_config(f"{data}[2:8]", tmp_path / "scratch", model="tiny"))
    assert scratch["generated_tokens"] > mixed2["generated_tokens"]
    for x, y in zip(load_shards(tmp_path / "mixed2", mmap=False), load_shards(tmp_path / "scratch", mmap=False),
                    strict=True):
        assert (x["source"], x["sampled"]) == (y["source"], y["sampled"])
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"], y["labels"])


@pytest.mark.parametrize("setting, value", [
    ("model", "another"), ("dtype", "bfloat16"), ("max_length", 96), ("max_new_tokens", 12), ("sample_share", 0.25),
    ("sample_temperature", 0.7), ("seed", 2), ("options", {"repetition_penalty": 1.1})])
def test_answers_from_a_capture_with_other_answer_settings_are_refused(tmp_path, setting, value):
    """Every setting that shapes what the target writes must agree, else the borrowed answers
    are not what this capture would write: refused, naming it, before any work."""
    src = tmp_path / "src"
    src.mkdir()
    mine = capture_config("d.jsonl", tmp_path / "new", model="tiny")
    (src / "capture.json").write_text(json.dumps(dict(
        {k: getattr(mine, k) for k in ("model", "dtype", "max_length", "max_new_tokens", "sample_share",
                                       "sample_temperature", "seed", "options")}, answers="target", **{setting: value})))
    (src / "answers-000000-000003.jsonl.gz").write_bytes(b"")
    with pytest.raises(ValueError, match=f"other settings \\({setting} "):
        answers_of(mine, [src])
    with pytest.raises(ValueError, match=f"other settings \\({setting} "):
        capture_shards(None, None, mine, answers_from=[src])
    assert not (tmp_path / "new").exists()


def test_answers_from_refuses_what_it_cannot_use(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    mine = capture_config("d.jsonl", tmp_path / "new", model="tiny")
    with pytest.raises(ValueError, match="no capture.json there"):
        answers_of(mine, [src])
    fields = {k: getattr(mine, k) for k in ("model", "dtype", "max_length", "max_new_tokens", "sample_share",
                                            "sample_temperature", "seed", "options")}
    (src / "capture.json").write_text(json.dumps(dict(fields, answers="target")))
    with pytest.raises(ValueError, match="holds no answers files"):
        answers_of(mine, [src])
    (src / "answers-000000-000003.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="answers from .*src.*not a readable answers file.*leave that folder out"):
        answers_of(mine, [src])
    with pytest.raises(ValueError, match="needs? CaptureConfig.model"):
        answers_of(capture_config("d.jsonl", tmp_path / "new"), [src])
    with pytest.raises(ValueError, match="answers='target'"):
        answers_of(CaptureConfig(data="d.jsonl", out_dir=str(tmp_path / "new"), answers="reference", model="tiny"),
                   [src])
    # With nothing sampled, the sampling settings shape nothing and need not agree.
    greedy = CaptureConfig(data="d.jsonl", out_dir=str(tmp_path / "g"), model="tiny", max_new_tokens=10,
                           max_length=80, shard_size=3)
    (src / "capture.json").write_text(json.dumps(dict(fields, answers="target", sample_share=0.0, seed=7,
                                                      sample_temperature=0.3)))
    (src / "answers-000000-000003.jsonl.gz").unlink()
    _write_answers(src / "answers-000000-000003.jsonl.gz", [
        {"index": 0, "source": "d.jsonl:0", "sampled": False, "prompt_len": 5, "answer": [1, 2]}])
    assert set(answers_of(greedy, [src])) == {"d.jsonl:0"}


def test_an_answer_does_not_depend_on_the_batch_it_was_decoded_in(lm, tmp_path):
    """Each answer's limit is its own (max_new_tokens, max_length less its prompt): a prompt
    that leaves little room does not cut the answers decoded beside it (so a resumed capture
    with another batch size, or answers borrowed into another mix, stay what they were)."""
    model, tok = lm
    f = tmp_path / "d.jsonl"

    def write(questions):
        f.write_text("\n".join(json.dumps({"question": q}) for q in questions) + "\n")
        return [tokenize_example(tok, ex, answer="")[1] for ex in read_examples(str(f))]

    base = "Tom had a ball and the sun was hot."
    long_q = base
    while write([long_q + " " + base])[0] + 2 <= 80 - 4:
        long_q += " " + base
    plen = write(["Lily saw a dog.", long_q, "The sun was hot."])[1]
    assert 80 - plen < 10  # its own limit is below max_new_tokens
    kw = dict(data=str(f), max_new_tokens=10, max_length=80, shard_size=3)
    capture_shards(model, tok, CaptureConfig(out_dir=str(tmp_path / "b3"), batch_size=3, **kw))
    capture_shards(model, tok, CaptureConfig(out_dir=str(tmp_path / "b1"), batch_size=1, **kw))
    together, alone = load_shards(tmp_path / "b3", mmap=False), load_shards(tmp_path / "b1", mmap=False)
    for x, y in zip(together, alone, strict=True):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"], y["labels"])
    lengths = [len(r["tokens"]) - r["prompt_len"] for r in together]
    assert lengths[1] <= 80 - plen and max(lengths[0], lengths[2]) > 80 - plen


def test_capture_with_generation_options_answers_as_generate_with_them(lm, tmp_path):
    """A capture decoded with generation options holds what HF ``generate`` writes with the
    same options, prompt by prompt; the options are part of the folder's identity; soft
    labels (the unprocessed distribution) are refused on it, and so are options that a
    reference capture or the capture's own settings would contradict."""
    model, tok = lm
    data = capture_data(tmp_path)
    options = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}

    def cfg(out, **kw):
        return CaptureConfig(data=f"{data}[:8]", out_dir=str(out), max_new_tokens=12, max_length=80, shard_size=4,
                             batch_size=3, **kw)

    capture_shards(model, tok, cfg(tmp_path / "opt", options=options))
    capture_shards(model, tok, cfg(tmp_path / "plain"))
    with_opts, plain = load_shards(tmp_path / "opt", mmap=False), load_shards(tmp_path / "plain", mmap=False)
    assert len(with_opts) == len(plain) == 8
    for r in with_opts:
        plen = r["prompt_len"]
        prompt = r["tokens"][:plen][None]
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, **options)[0]
        ref = ref[: (ref[plen:] == tok.eos_token_id).nonzero()[0].item() + plen + 1] \
            if (ref[plen:] == tok.eos_token_id).any() else ref
        assert r["tokens"].tolist() == ref.tolist()
    # The options changed what the target wrote (so the check above could fail).
    assert any(not torch.equal(a["tokens"], b["tokens"]) for a, b in zip(with_opts, plain))
    assert json.loads((tmp_path / "opt" / "capture.json").read_text())["options"] == options

    with pytest.raises(ValueError, match="other settings.*options"):
        capture_shards(model, tok, cfg(tmp_path / "opt", options={"repetition_penalty": 1.2}))
    with pytest.raises(ValueError, match="other settings.*options"):
        capture_shards(model, tok, cfg(tmp_path / "plain", options=options))
    assert capture_shards(model, tok, cfg(tmp_path / "opt", options=dict(reversed(options.items()))))["written"] == 0
    with pytest.raises(ValueError, match="soft labels.*without soft labels"):
        load_shards(tmp_path / "opt", final=True)
    assert load_shards(tmp_path / "plain", final=True)[0]["final"] is not None
    with pytest.raises(ValueError, match="answers='target'"):
        cfg(tmp_path / "r", answers="reference", options=options)
    with pytest.raises(ValueError, match=r"\['temperature'\] are set by the capture itself"):
        cfg(tmp_path / "t", options={"temperature": 0.5})
    with pytest.raises(TypeError, match="repetition_penalti"):
        capture_shards(model, tok, cfg(tmp_path / "typo", options={"repetition_penalti": 1.1}))
    assert not (tmp_path / "typo").exists() or not list((tmp_path / "typo").glob("*"))


def test_replay_batches_follow_the_token_budget():
    items = [(i, [0] * n) for i, n in enumerate([3, 3, 4, 5, 9, 20])]  # sorted by length
    batches = _by_tokens(items, max_batch=3, budget=12)
    # three of at most 4 tokens fill the budget; then max_batch cuts, then the budget, then 20 > 12 alone
    assert [[i for i, _ in b] for b in batches] == [[0, 1, 2], [3], [4], [5]]
    assert all(len(b) * max(len(x[1]) for x in b) <= 12 or len(b) == 1 for b in batches)
    assert [i for b in batches for i, _ in b] == list(range(6))  # every item once, in order
    assert _by_tokens([], max_batch=4, budget=8) == []


@pytest.mark.parametrize("folder", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "captures")
                                            .iterdir() if p.is_dir()))
def test_kept_answers_match_their_plan(folder):
    """The answers kept in git (benchmarks/data/captures) belong to the plan of their manifest:
    every row is the conversation its file's range and the packaged data say it is."""
    import gzip

    d = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "captures" / folder
    manifest = json.loads((d / "capture.json").read_text())
    fields = {k: manifest[k] for k in ("data", "mix", "max_examples", "answers", "sample_share", "sample_temperature",
                                       "seed", "shard_size")}
    cfg = CaptureConfig(out_dir=str(d), **fields)
    plan = capture_plan(cfg)
    files = sorted(d.glob("answers-*.jsonl.gz"))
    assert files, f"{d} keeps no answers"
    for f in files:
        a, b = (int(x) for x in f.name[len("answers-"):-len(".jsonl.gz")].split("-"))
        assert a % cfg.shard_size == 0 and b == min(a + cfg.shard_size, len(plan)), \
            f"{f} is not a range of the plan of {d / 'capture.json'} (a shard superseded when the capture grew?)"
        rows = [json.loads(line) for line in gzip.open(f, "rt")]
        assert len(rows) >= 0.9 * (b - a)  # only prompts too long to answer are missing
        for row in rows:
            assert a <= row["index"] < b and row["source"] == plan[row["index"]][0]
            assert row["answer"] and all(0 <= t < 49152 for t in row["answer"])
            assert row["sampled"] is False or cfg.sample_share > 0


def test_sample_share_is_honoured(tmp_path):
    keys = [f"d:{i}" for i in range(2000)]
    for share in (0.0, 0.2, 1.0):
        cfg = CaptureConfig(data="d", out_dir=str(tmp_path), sample_share=share)
        n = sum(_sampled(cfg, k)[0] for k in keys)
        assert abs(n - share * len(keys)) <= 0.03 * len(keys)
    cfg = CaptureConfig(data="d", out_dir=str(tmp_path), sample_share=0.5)
    assert [_sampled(cfg, k) for k in keys[:5]] == [_sampled(cfg, k) for k in keys[:5]]  # fixed per key
    with pytest.raises(ValueError, match="sample_share"):
        CaptureConfig(data="d", out_dir=str(tmp_path), sample_share=1.5)
