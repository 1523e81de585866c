"""Broader training data and the sharded capture: the generated prompt sets are the shipped
ones and share nothing with the evaluation sets; a capture killed mid-way and resumed equals
an uninterrupted one; the sampled share is honoured; training reads the shards (either
layout from one capture). On the tests' tiny model folder (``tiny.save_tiny_lm``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from treespec import data, models
from treespec.train import TrainConfig, train_eagle
from treespec.train.capture import (
    CaptureConfig, _by_tokens, _interleave, _sampled, _write_answers, answers_of, capture_plan, capture_shards,
    load_shards, parse_data_spec, shard_files,
)
from treespec.train.data import read_jsonl as read_examples
from treespec.train.data import tokenize_example
from treespec.train.generated_prompts import EVAL_TEMPLATES, EVAL_TOPICS, chat_prompts, stdlib_code_prompts

from helpers.tiny import save_tiny_lm


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# ---- prompt sets ------------------------------------------------------------------------------


def test_chat_prompts_are_the_shipped_ones_and_the_eval_set_is_held_out():
    for split, name in (("train", "chat-train"), ("eval", "chat-eval")):
        assert chat_prompts(split) == chat_prompts(split) == data.load_dataset(name)
    train = data.load_dataset("chat-train")
    assert len(train) == 3808 and len(data.load_dataset("chat-eval")) == 48
    assert not {r["topic"] for r in train} & set(EVAL_TOPICS)
    assert not any(t.split("{topic}")[0] in r["prompt"] for t in EVAL_TEMPLATES for r in train)


ELSEWHERE = "/opt/a-much-longer-folder-than-any-ci-uses/user-venv/bin/python3"


def test_stdlib_code_prompts_are_the_shipped_ones(monkeypatch):
    """Built as a user's venv whose interpreter lives elsewhere builds them: the shipped set
    carried the path of the interpreter that made it (``architecture(executable=...)``), so the
    test passed only on that interpreter (issue 31)."""
    import platform

    shipped = data.load_dataset("stdlib-code")
    assert len(shipped) == 3168 and {r["kind"] for r in shipped} == {"write", "howto", "explain"}
    if shipped[0]["python"] != "%d.%d.%d" % sys.version_info[:3]:
        pytest.skip(f"the shipped set was made with Python {shipped[0]['python']}: docstrings differ by version")
    monkeypatch.setattr(sys, "executable", ELSEWHERE)
    monkeypatch.setattr(platform.architecture, "__defaults__", (ELSEWHERE, "", ""))  # bound at import
    assert stdlib_code_prompts() == shipped
    (row,) = [r for r in shipped if r["source"] == "platform.architecture" and r["kind"] == "write"]
    assert "`architecture(executable=sys.executable, bits='', linkage='')`" in row["prompt"]


@pytest.mark.parametrize("default, shown", [
    (ELSEWHERE, "sys.executable"),
    ("/srv/someone/data/file.txt", "..."),
    ("C:\\Users\\someone\\x.ini", "..."),
    ("~/notes.txt", "..."),
    ("/", "'/'"),  # a separator, not a machine's folder
    ("utf-8", "'utf-8'"),
])
def test_signature_defaults_that_name_a_machines_folders_are_replaced(monkeypatch, default, shown):
    from treespec.train.generated_prompts import _signature

    monkeypatch.setattr(sys, "executable", ELSEWHERE)

    def f(path=default, n=1):
        pass

    assert _signature(f) == f"(path={shown}, n=1)"


def test_training_prompts_share_no_text_with_the_evaluation_sets():
    train = [r["prompt"] for n in ("stdlib-code", "chat-train") for r in data.load_dataset(n)]
    train += [r["question"] for r in data.load_dataset("gsm8k-train")]
    evals = ([r["prompt"] for r in data.load_dataset("humaneval")] + [r["question"] for r in data.load_dataset("gsm8k-test")]
             + [r["prompt"] for r in data.load_dataset("chat-eval")])
    assert not set(train) & set(evals)
    # No HumanEval docstring line and no GSM8K-test question sentence inside a generated prompt
    # (GSM8K's own train and test splits share a few sentences: that is upstream's split).
    joined = "\n".join(r["prompt"] for n in ("stdlib-code", "chat-train") for r in data.load_dataset(n))
    lines = {ln.strip() for r in data.load_dataset("humaneval") for ln in r["prompt"].splitlines() if len(ln.strip()) >= 40}
    lines |= {s.strip() for r in data.load_dataset("gsm8k-test") for s in r["question"].split(". ") if len(s.strip()) >= 60}
    assert not [ln for ln in lines if ln in joined]


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


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return models.load(save_tiny_lm(tmp_path_factory.mktemp("lm") / "lm"))


def _data(tmp_path):
    lines = [json.dumps({"question": q, "answer": "He liked it a lot."}) for q in (
        "Tom had a ball.", "The sun was hot.", "Lily saw a dog.", "One day, a big dog ran.", "She saw a red ball.",
        "Once upon a time.", "Tom and Lily played.", "The dog ran to the park.")]
    lines.append(json.dumps({"text": "Once upon a time there was a little girl named Lily."}))
    lines.append(json.dumps({"question": "x" * 400, "answer": "too long"}))
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def _cfg(data, out, **kw):
    return CaptureConfig(data=data, out_dir=str(out), max_new_tokens=10, max_length=80, shard_size=3, batch_size=2,
                         sample_share=0.5, sample_temperature=0.9, seed=1, **kw)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["source"] == y["source"] and x["sampled"] == y["sampled"] and x["prompt_len"] == y["prompt_len"]
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["labels"], y["labels"])
        assert torch.equal(x["features"], y["features"])


def test_capture_resumes_after_a_kill_with_the_same_result(tiny_lm, tmp_path):
    model, tok = tiny_lm
    data = _data(tmp_path)
    whole = capture_shards(model, tok, _cfg(data, tmp_path / "a"))
    assert whole["shards"] == 4 and whole["written"] == 4 and whole["too_long"] == 1

    seen = []

    def kill_in_second_shard(p):
        seen.append(p)
        if p.done > 0:
            raise KeyboardInterrupt  # stands for a kill after the first shard

    b = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        capture_shards(model, tok, _cfg(data, b), callback=kill_in_second_shard)
    (b / "shard-000003-000006.pt.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    assert [p.name for p in shard_files(b)] == ["shard-000000-000003.pt"]
    rest = capture_shards(model, tok, _cfg(data, b))
    assert (rest["skipped"], rest["written"]) == (1, 3)
    assert [p.name for p in shard_files(b)] == [p.name for p in shard_files(tmp_path / "a")]
    _same(load_shards(b, mmap=False), load_shards(tmp_path / "a", mmap=False))
    again = capture_shards(model, tok, _cfg(data, b))
    assert (again["skipped"], again["written"]) == (4, 0)
    with pytest.raises(ValueError, match="other settings.*sample_share"):
        capture_shards(model, tok, CaptureConfig(data=data, out_dir=str(b), max_new_tokens=10, max_length=80,
                                                 shard_size=3, batch_size=2, seed=1, sample_temperature=0.9))

    records = load_shards(b)
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # 9 (too long) skipped, no duplicate
    keys = [f"{data}:{i}" for i in range(8)]
    assert [r["sampled"] for r in records[:8]] == [_sampled(_cfg(data, b), k)[0] for k in keys]
    assert not records[8]["sampled"] and records[8]["prompt_len"] == 0  # plain text: teacher-forced
    H = model.config.hidden_size
    assert records[0]["features"].shape[1] == 3 * H  # EAGLE-3 view of the 4H stored
    assert load_shards(b, eagle3=False)[0]["features"].shape[1] == H
    assert len(load_shards(b, limit=4)) == 4 and all(not r["sampled"] for r in load_shards(b, greedy_only=True))
    for r in records[:8]:  # target answers: the labels are the answer tokens themselves
        plen = r["prompt_len"]
        assert torch.equal(r["labels"][plen - 1:-1], r["tokens"][plen:])


def test_lost_shards_are_rebuilt_from_their_answers_files(tiny_lm, tmp_path):
    """The answers files are the costly part of a capture: with the shards deleted, the same
    command rebuilds them from the answers (a teacher-forced forward, no decoding) with the
    same conversations, tokens, labels and sampled flags, and features equal to the decoded
    ones up to rounding. A shard without its answers file gets one; a foreign one is refused."""
    model, tok = tiny_lm
    data = _data(tmp_path)
    a = tmp_path / "a"
    first = capture_shards(model, tok, _cfg(data, a))
    assert first["rebuilt"] == 0 and first["generated_tokens"] > 0
    answers = sorted(p.name for p in a.glob("answers-*.jsonl.gz"))
    assert answers == [p.name.replace("shard", "answers").replace(".pt", ".jsonl.gz") for p in shard_files(a)]
    decoded = load_shards(a, mmap=False)

    b = tmp_path / "b"  # what git keeps: the manifest and the answers files, no shard
    b.mkdir()
    for name in ["capture.json", *answers]:
        (b / name).write_bytes((a / name).read_bytes())
    again = capture_shards(model, tok, _cfg(data, b))
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
    mixed = capture_shards(model, tok, _cfg(data, d), callback=lambda p: order.append(p.info["shard"]))
    assert (mixed["written"], mixed["rebuilt"]) == (4, 2) and mixed["generated_tokens"] > 0
    shards = [n.replace("answers", "shard").replace(".jsonl.gz", ".pt") for n in answers]
    assert order == [None, shards[1], shards[3], shards[0], shards[2]]

    # A shard written before answers files existed gets its file on the next run.
    (a / answers[1]).unlink()
    assert capture_shards(model, tok, _cfg(data, a))["written"] == 0
    assert (a / answers[1]).read_bytes() == (b / answers[1]).read_bytes()

    # An answers file from another plan, or a damaged one, is refused with what to do.
    c = tmp_path / "c"
    c.mkdir()
    (c / "capture.json").write_bytes((a / "capture.json").read_bytes())
    (c / answers[0]).write_bytes((a / answers[1]).read_bytes())
    with pytest.raises(ValueError, match="does not match the plan at conversation 0.*delete it"):
        capture_shards(model, tok, _cfg(data, c))
    (c / answers[0]).write_bytes((a / answers[0]).read_bytes()[:40])  # what a cut copy leaves
    with pytest.raises(ValueError, match="not a readable answers file.*delete it"):
        capture_shards(model, tok, _cfg(data, c))

    # A reference capture keeps no answers files: the target wrote nothing.
    ref = tmp_path / "ref"
    capture_shards(model, tok, CaptureConfig(data=f"{data}[:4]", out_dir=str(ref), answers="reference",
                                             max_length=80, shard_size=3))
    assert shard_files(ref) and not list(ref.glob("answers-*"))


def test_a_capture_of_other_data_reuses_the_answers_a_folder_holds(tiny_lm, tmp_path):
    """``answers_from``: a capture of a subset of data captured before takes the target's
    answers from that folder (matched by source key, whatever their place in its plan) and
    decodes only what it lacks; its records equal a capture decoded from scratch."""
    model, tok = tiny_lm
    data = _data(tmp_path)
    capture_shards(model, tok, _cfg(data, tmp_path / "all", model="tiny"))
    reference = {r["source"]: r for r in load_shards(tmp_path / "all", mmap=False)}

    # data[4:] (shard_size 3: [4, 7) and [7, 10), the latter with a text record to teacher-force
    # and a prompt too long to answer) lies within the first capture: nothing decoded.
    sub = capture_shards(model, tok, _cfg(f"{data}[4:]", tmp_path / "sub", model="tiny"),
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
    capture_shards(model, tok, _cfg(f"{data}[:5]", tmp_path / "first5", model="tiny"))
    mixed = capture_shards(model, tok, _cfg(f"{data}[3:9]", tmp_path / "mixed", model="tiny"),
                           answers_from=[tmp_path / "first5"])
    assert (mixed["written"], mixed["rebuilt"]) == (2, 0) and mixed["generated_tokens"] > 0  # 5..8 unanswered
    mixed2 = capture_shards(model, tok, _cfg(f"{data}[2:8]", tmp_path / "mixed2", model="tiny"),
                            answers_from=[tmp_path / "first5"])
    assert (mixed2["written"], mixed2["rebuilt"]) == (2, 1) and mixed2["generated_tokens"] > 0  # [2, 5) reused
    scratch = capture_shards(model, tok, _cfg(f"{data}[2:8]", tmp_path / "scratch", model="tiny"))
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
    mine = _cfg("d.jsonl", tmp_path / "new", model="tiny")
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
    mine = _cfg("d.jsonl", tmp_path / "new", model="tiny")
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
        answers_of(_cfg("d.jsonl", tmp_path / "new"), [src])
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


def test_an_answer_does_not_depend_on_the_batch_it_was_decoded_in(tiny_lm, tmp_path):
    """Each answer's limit is its own (max_new_tokens, max_length less its prompt): a prompt
    that leaves little room does not cut the answers decoded beside it (so a resumed capture
    with another batch size, or answers borrowed into another mix, stay what they were)."""
    model, tok = tiny_lm
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


def test_capture_with_generation_options_answers_as_generate_with_them(tiny_lm, tmp_path):
    """A capture decoded with generation options holds what HF ``generate`` writes with the
    same options, prompt by prompt; the options are part of the folder's identity; soft
    labels (the unprocessed distribution) are refused on it, and so are options that a
    reference capture or the capture's own settings would contradict."""
    model, tok = tiny_lm
    data = _data(tmp_path)
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


@pytest.mark.parametrize("folder", sorted(p.name for p in (Path(__file__).parent.parent / "benchmarks" / "data" / "captures")
                                            .iterdir() if p.is_dir()))
def test_kept_answers_match_their_plan(folder):
    """The answers kept in git (benchmarks/data/captures) belong to the plan of their manifest:
    every row is the conversation its file's range and the packaged data say it is."""
    import gzip

    d = Path(__file__).parent.parent / "benchmarks" / "data" / "captures" / folder
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


def test_reference_answers_and_training_from_shards_in_both_layouts(tiny_lm, tmp_path):
    model, tok = tiny_lm
    data = _data(tmp_path)
    cap = tmp_path / "cap"
    capture_shards(model, tok, _cfg(data, cap))
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


def test_training_on_several_capture_folders_and_from_a_head(tiny_lm, tmp_path):
    """``captured`` takes folders in order (``max_examples`` counts across them), and ``init``
    fine-tunes a head: its draft vocabulary kept, its weights the start,
    a layout or vocabulary that does not match refused."""
    from treespec.drafters.eagle_head import load_head
    from treespec.train.trainer import _new_head, _training_records

    model, tok = tiny_lm
    data = _data(tmp_path)
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


def test_bf16_autocast_training_step_matches_float32(tiny_lm, tmp_path):
    """The bf16-autocast TTT step (the trainer's default on a CPU with native bf16) computes the
    loss and gradients of the fp32 step up to bf16 rounding: a wrong cast (a mask or a
    softmax in bf16 gone bad, labels misaligned) would move them far more."""
    from treespec.drafters.eagle import EagleHead
    from treespec.train.trainer import _autocast_dtype, _collate, ttt_loss

    model, tok = tiny_lm
    cap = tmp_path / "cap"
    capture_shards(model, tok, _cfg(_data(tmp_path), cap))
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


def test_soft_labels_are_the_targets_distribution(tiny_lm, tmp_path):
    """Soft labels: the target's distribution recomputed from the captured final state sits at
    the entry of its label (the target's argmax there is the greedy label), a one-hot one
    gives the hard loss exactly, and training on them runs and needs a capture folder."""
    from treespec.drafters.eagle import EagleHead
    from treespec.train.trainer import _collate, target_probs, ttt_loss

    model, tok = tiny_lm
    cap = tmp_path / "cap"
    capture_shards(model, tok, _cfg(_data(tmp_path), cap))
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
        train_eagle(model, tok, TrainConfig(data=_data(tmp_path), out_dir=str(tmp_path / "x"), soft_labels=True))


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
    data = _data(tmp_path)
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
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "training"))
    import ablate_head

    lm = save_tiny_lm(tmp_path / "lm")
    model, tok = models.load(lm)
    data = _data(tmp_path)
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


def test_make_prompts_templated_writes_the_shipped_chat_files(tmp_path, capsys):
    """``treespec make-prompts --templated`` (was ``python -m treespec.train.prompts``) writes
    the shipped files byte for byte (the chat sets depend on nothing but treespec)."""
    from treespec.cli import main

    assert main(["make-prompts", "--templated", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name, n in (("chat_train", 3808), ("chat_eval", 48)):
        assert f"{name}.jsonl.gz: {n} prompts" in out
        assert (tmp_path / f"{name}.jsonl.gz").read_bytes() == data.dataset_path(name.replace("_", "-")).read_bytes()
    assert (tmp_path / "stdlib_code.jsonl.gz").exists()
    assert main(["make-prompts", "--templated", "--n", "5", "--out", str(tmp_path)]) == 2
