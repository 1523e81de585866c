"""Self-generated user turns (treespec.train.magpie): the template is cut where a user turn
starts, sampling is seeded per message, the filters drop what they name and keep order, and
no training prompt of the project overlaps an evaluation set (Spec-Bench above all)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from helpers.tiny import CHATML, save_tiny_lm
from treespec import data
from treespec.cli import main as cli_main
from treespec.train.magpie import (EvalOverlap, _chunk_done, captured_conversations, filter_follow_ups,
                                   filter_user_turns, generate_user_turns, normalise, user_turn_prefix)


def test_prefix_ends_where_the_user_writes(chat_lm):
    _, tok = chat_lm
    assert tok.decode(user_turn_prefix(tok)) == "<|im_start|>user\n"
    history = [{"role": "user", "content": "Lily"}, {"role": "assistant", "content": "a ball"}]
    assert tok.decode(user_turn_prefix(tok, history)).endswith("a ball<|im_end|>\n<|im_start|>user\n")
    tok2 = type(tok).from_pretrained(tok.name_or_path) if tok.name_or_path else None
    if tok2 is not None:
        tok2.chat_template = None
        with pytest.raises(ValueError, match="chat template"):
            user_turn_prefix(tok2)


def test_sampling_is_seeded_per_message_and_chunk(chat_lm):
    model, tok = chat_lm
    torch.set_num_threads(1)
    a = generate_user_turns(model, tok, 6, seed=3, batch_size=3, max_new_tokens=8)
    assert a == generate_user_turns(model, tok, 6, seed=3, batch_size=3, max_new_tokens=8)
    # The second chunk alone is the second chunk of the whole run: resumable chunk by chunk.
    assert generate_user_turns(model, tok, 3, seed=3, chunk=1, batch_size=3, max_new_tokens=8) == a[3:]
    assert [r["chunk"] for r in a] == [0, 0, 0, 1, 1, 1]
    assert a != generate_user_turns(model, tok, 6, seed=4, batch_size=3, max_new_tokens=8)
    with pytest.raises(ValueError, match="temperature"):
        generate_user_turns(model, tok, 1, temperature=0)


def test_filters_name_what_they_drop_and_keep_order():
    spec = data.load_dataset("spec-bench")
    qa = next(r["turns"][0] for r in spec if r["category"] == "qa")
    long_q = next(r["turns"][0] for r in spec if r["category"] == "summarization")
    good = ["How do I keep basil alive on a windowsill in winter?",
            "Write a short poem about a lighthouse keeper who cannot sleep.",
            "Can you explain what a hash map is, with a small Python example?"]
    near = "Write a short poem about a lighthouse keeper who cannot sleep at all."
    rows = [{"prompt": p, "ended": True} for p in [
        good[0], "Hi?", "Wie kann ich meinen Garten im Winter schützen? Über die Pflanzen.",
        "I want to know I want to know I want to know what it is", good[1], qa.upper() + "!!",
        "Please summarise: " + " ".join(long_q.split()[:40]), good[0].lower(), near, good[2],
        "Can you help me plan a trip to", "aaaaaaaaaaaaaaaaaaaaaaaa, what is this",
    ]]
    rows[10]["ended"] = False
    kept, why = filter_user_turns(rows, EvalOverlap.packaged())
    assert [r["prompt"] for r in kept] == good
    assert why == {"length": 1, "not English": 1, "repetition": 2, "overlaps an evaluation set": 2,
                   "duplicate": 1, "near-duplicate": 1, "cut off": 1}


def test_overlap_catches_copied_runs_not_common_phrases():
    o = EvalOverlap.of(["The quick brown fox jumps over the lazy dog near the river bank."])
    assert o.hits("the QUICK brown fox, jumps over the lazy dog!")  # the same words
    assert o.hits("Tell me why the quick brown fox jumps over the lazy dog near a tree")  # 8 words shared
    assert not o.hits("Why does the quick brown fox jump?")
    assert normalise("Café, naïve — déjà vu!") == "cafe naive deja vu"


def test_no_training_prompt_overlaps_an_evaluation_set():
    overlap = EvalOverlap.packaged()
    generated = [n for n in ("magpie-chat", "magpie-chat2", "chat-train", "stdlib-code") if n in data.DATASETS]
    hits = [(n, t) for n in generated for r in data.load_dataset(n)
            for t in ([m["content"] for m in r["messages"] if m["role"] == "user"] if "messages" in r else [r["prompt"]])
            if overlap.hits(t)]
    assert not hits, hits[:5]
    # GSM8K train is upstream's split: exact questions only (its test split shares phrasing).
    spec_texts = {normalise(t) for r in data.load_dataset("spec-bench") for t in r["turns"]}
    assert not [r for r in data.load_dataset("gsm8k-train") if normalise(r["question"]) in spec_texts]


# ---- second turns --------------------------------------------------------------------------------


def write_capture(folder, tok, prompts_file, rows):
    """A capture folder as ``treespec capture`` leaves it: answers files of (source, answer ids)."""
    folder.mkdir()
    with gzip.open(folder / "answers-000000-000064.jsonl.gz", "wt") as f:
        for i, (src, ids) in enumerate(rows):
            f.write(json.dumps({"index": i, "source": f"{prompts_file}:{src}", "sampled": False, "prompt_len": 5,
                                "answer": ids}) + "\n")


def test_captured_conversations_follow_the_answers_files(chat_lm, tmp_path):
    _, tok = chat_lm
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(4)))
    eos = tok.eos_token_id
    say = tok("a fine answer", add_special_tokens=False)["input_ids"]
    cut = tok("a cut ans", add_special_tokens=False)["input_ids"]  # ran into the capture's token limit
    write_capture(tmp_path / "a", tok, prompts, [(2, say + [eos]), (0, cut)])
    write_capture(tmp_path / "b", tok, prompts, [(1, say + [eos]), (3, [eos])])  # an empty answer: no turn
    convs = captured_conversations([tmp_path / "a", tmp_path / "b"], tok)
    assert [c["source"] for c in convs] == [f"{prompts}:2", f"{prompts}:0", f"{prompts}:1"]
    assert convs[0]["messages"] == [{"role": "user", "content": "question 2"},
                                    {"role": "assistant", "content": "a fine answer"}]
    assert convs[1]["messages"][1]["content"] == "a cut ans"
    with pytest.raises(FileNotFoundError, match="answers files"):
        captured_conversations([tmp_path], tok)


def test_follow_ups_that_repeat_the_first_turn_are_dropped():
    first = [{"role": "user", "content": "How do I keep basil alive on a windowsill in winter?"},
             {"role": "assistant", "content": "Water it sparingly."}]
    rows = [{"prompt": p, "ended": True, "messages": first} for p in [
        "How do I keep basil alive on a windowsill in winter??",
        "And what about mint, does it need more light than basil?",
        "how do i keep basil alive on a windowsill in winter",
        "Thanks! Could you give me a watering schedule for it?",
    ]]
    kept, why = filter_follow_ups(rows, EvalOverlap.packaged())
    assert [r["prompt"] for r in kept] == [rows[1]["prompt"], rows[3]["prompt"]]
    assert why == {"repeats the first turn": 2}


def test_follow_ups_end_to_end_are_seeded_and_written_as_conversations(tmp_path, monkeypatch):
    folder = save_tiny_lm(tmp_path / "lm", chat_template=CHATML)
    from treespec.models import load

    model, tok = load(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    say = tok("a fine answer", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    write_capture(tmp_path / "cap", tok, prompts, [(0, say), (1, say), (2, say)])
    torch.set_num_threads(1)
    argv = ["make-prompts", "--model", str(folder), "--follow-ups", str(tmp_path / "cap"), "--batch-size", "2",
            "--work", str(tmp_path / "w"), "--out", str(tmp_path), "--dtype", "float32"]
    assert cli_main(argv) == 0
    raw = [json.loads(x) for c in (0, 1) for x in (tmp_path / "w" / f"chunk-{c:05d}.jsonl").read_text().splitlines()]
    assert [r["source"] for r in raw] == [f"{prompts}:{i}" for i in range(3)]
    assert [r["chunk"] for r in raw] == [0, 0, 1] and {r["seed"] for r in raw} == {1}
    # Each follow-up is the target's continuation of its own conversation, seeded per chunk.
    convs = captured_conversations([tmp_path / "cap"], tok)
    again = generate_user_turns(model, tok, 1, 1, chunk=1, batch_size=2, history=[convs[2]["messages"]])
    assert again[0]["prompt"] == raw[2]["prompt"]
    # Filtering keeps what it keeps as three-turn conversations; a re-run reuses the chunks.
    # (U+2029, written raw as the sampler writes it, ends no line.)
    (tmp_path / "w" / "chunk-00000.jsonl").write_text(
        "".join(json.dumps({**r, "prompt": p, "ended": True}, ensure_ascii=False) + "\n" for r, p in zip(raw[:2], [
            "Could you say more about why that works, with an example?\u2029Thanks", "question 1"])), encoding="utf-8")
    monkeypatch.setattr("treespec.train.magpie.generate_user_turns", None)  # nothing left to sample
    assert cli_main(argv) == 0
    rows = [json.loads(x) for x in gzip.open(tmp_path / "magpie_chat2.jsonl.gz", "rt")]
    assert rows[0]["messages"] == [*convs[0]["messages"], {
        "role": "user", "content": "Could you say more about why that works, with an example?\u2029Thanks"}]
    assert rows[0]["source"] == f"{prompts}:0" and all(r["source"] != f"{prompts}:1" for r in rows)


def test_a_follow_up_chunk_is_done_only_for_the_same_conversations(tmp_path):
    chunk = tmp_path / "chunk-00000.jsonl"
    assert not _chunk_done(chunk, None)
    chunk.write_text("".join(json.dumps({"prompt": "x\u2028y", "source": s}, ensure_ascii=False) + "\n"
                             for s in ("a:0", "a:1")), encoding="utf-8")
    assert _chunk_done(chunk, None)  # first turns: there is all it takes
    assert _chunk_done(chunk, [{"source": "a:0"}, {"source": "a:1"}])
    assert not _chunk_done(chunk, [{"source": "a:0"}, {"source": "a:1"}, {"source": "a:2"}])  # the capture grew
