"""Clear words for inputs the engine can run but should not run silently, and for inputs it
cannot run: a request past the model's context, a draft whose tokens are never accepted
(a head trained for another model), and text where token ids belong."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import treespec
from tiny import tiny_model
from treespec.drafters.model import ModelDrafter
from treespec.drafters.ngram import NgramDrafter

ENGINE = "treespec.engine"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0)  # max_position_embeddings 256, vocabulary 64


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ENGINE and r.levelno == logging.WARNING]


def shifted_twin(model):
    """The target with its output rows rolled by one: its greedy token is always the
    target's plus one (mod V), so every drafted token is rejected, deterministically."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight.copy_(torch.roll(model.lm_head.weight, 1, dims=0))
    return draft


# ---- past the model's context -----------------------------------------------------------


def test_prompt_longer_than_the_context_warns(model, caplog):
    prompt = [(7 * i) % 64 for i in range(300)]  # 300 > 256 positions
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        treespec.generate(model, NgramDrafter(), "chain-2", prompt, max_new_tokens=1)
    (msg,) = warnings(caplog)
    assert "300 tokens is longer than the model's context of 256" in msg


def test_generation_running_past_the_context_warns(model, caplog):
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        gen = treespec.stream(model, NgramDrafter(), "chain-2", list(range(10)), max_new_tokens=250)
        next(gen)
        gen.close()
    (msg,) = warnings(caplog)
    assert "10 tokens plus max_new_tokens=250 reaches past the model's context of 256" in msg


def test_within_the_context_no_warning(model, caplog):
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        treespec.generate(model, NgramDrafter(), "chain-2", [list(range(10)), [i % 64 for i in range(200)]],
                          max_new_tokens=56)  # 200 + 56 = 256: the last position is still inside
    assert warnings(caplog) == []


# ---- a draft that is never accepted -----------------------------------------------------


def test_draft_never_accepted_warns_once(model, caplog):
    drafter = ModelDrafter(shifted_twin(model))
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        out = treespec.generate(model, drafter, "chain-2", [[1, 2, 3], [4, 5]], max_new_tokens=40)
    assert out.metrics.mean_accepted_length == 1.0  # the premise: nothing was accepted
    (msg,) = warnings(caplog)  # once per generation, though every step rejected everything
    assert "accepted none of the" in msg and "ModelDrafter" in msg
    assert "is this draft (head) trained for this model?" in msg


def test_draft_never_accepted_short_run_stays_quiet(model, caplog):
    """Fewer verify steps than the watch needs: too little evidence to judge the draft."""
    drafter = ModelDrafter(shifted_twin(model))
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        out = treespec.generate(model, drafter, "chain-2", [1, 2, 3], max_new_tokens=5)
    assert out.metrics.num_steps < 8
    assert warnings(caplog) == []


def test_good_draft_no_warning(model, caplog):
    twin = tiny_model("llama", 0)  # the target's weights, its own config object
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        out = treespec.generate(model, ModelDrafter(twin), "chain-2", [1, 2, 3], max_new_tokens=40)
    assert out.metrics.mean_accepted_length > 2.5
    assert warnings(caplog) == []


def test_prompt_lookup_is_not_judged(model, caplog):
    """Prompt lookup drafts only where the text repeats; rejections there are no mismatch."""
    prompt = [1, 2, 3, 4] * 8  # repeats, so lookup drafts at every step
    with caplog.at_level(logging.WARNING, logger=ENGINE):
        out = treespec.generate(model, NgramDrafter(), "chain-2", prompt, max_new_tokens=40)
    assert out.metrics.num_steps >= 8
    assert warnings(caplog) == []


# ---- text where token ids belong --------------------------------------------------------


@pytest.mark.parametrize("input_ids", [
    "What is 12 * 7?",
    ["What is 12 * 7?"],
    ["What", "is"],
    [1, 2, "3"],
    [[1, 2], "What is"],
    [b"bytes"],
])
def test_text_as_ids_says_tokenize_first(model, input_ids):
    with pytest.raises(ValueError, match=r"input_ids must be token ids, not text: tokenize the text first"):
        treespec.generate(model, NgramDrafter(), "chain-2", input_ids, max_new_tokens=2)


@pytest.mark.parametrize("input_ids, expect", [
    ([1.5, 2], "must be ints, got float 1.5"),
    ([[1, 2], [3, None]], "must be ints, got NoneType None"),
    ([[1, 2], 3], "a prompt must be a list of token ids or a 1-D tensor, got int"),
])
def test_other_non_ids_are_named(model, input_ids, expect):
    with pytest.raises(ValueError, match=expect):
        treespec.generate(model, NgramDrafter(), "chain-2", input_ids, max_new_tokens=2)


def test_integer_like_ids_still_work(model):
    import numpy as np

    a = treespec.generate(model, NgramDrafter(), "chain-2", [1, 2, 3], max_new_tokens=4).sequences
    b = treespec.generate(model, NgramDrafter(), "chain-2", [np.int64(1), torch.tensor(2), 3],
                          max_new_tokens=4).sequences
    assert a == b
