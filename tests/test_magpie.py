"""Self-generated user turns (treespec.train.magpie): the template is cut where a user turn
starts, sampling is seeded per message, the filters drop what they name and keep order, and
no training prompt of the project overlaps an evaluation set (Spec-Bench above all)."""

from __future__ import annotations

import pytest
import torch

from treespec import data
from treespec.train.magpie import EvalOverlap, filter_user_turns, generate_user_turns, normalise, user_turn_prefix

from tiny import save_tiny_lm

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_lm(tmp_path_factory):
    from treespec.models import load

    model, tok = load(save_tiny_lm(tmp_path_factory.mktemp("tiny")))
    tok.chat_template = CHATML
    return model, tok


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
    generated = [n for n in ("magpie-chat", "chat-train", "stdlib-code") if n in data.DATASETS]
    hits = [(n, r["prompt"]) for n in generated for r in data.load_dataset(n) if overlap.hits(r["prompt"])]
    assert not hits, hits[:5]
    # GSM8K train is upstream's split: exact questions only (its test split shares phrasing).
    spec_texts = {normalise(t) for r in data.load_dataset("spec-bench") for t in r["turns"]}
    assert not [r for r in data.load_dataset("gsm8k-train") if normalise(r["question"]) in spec_texts]
