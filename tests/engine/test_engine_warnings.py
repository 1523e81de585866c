"""Clear words for inputs the engine can run but should not run silently, and for inputs it
cannot run: a prompt past the model's context (refused unless asked for), a request whose
answer may run past it, a draft whose tokens are never accepted (a head trained for another
model), and text where token ids belong. Misuse warns through :mod:`warnings`
(``TreespecWarning``), which reaches a Python user whose logging is not configured."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import treespec
from helpers.tiny import tiny_model
from treespec import TreespecWarning
from treespec.drafters.model import ModelDrafter
from treespec.drafters.ngram import NgramDrafter
from treespec.engine.loop import _AcceptanceWatch

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0)  # max_position_embeddings 256, vocabulary 64


def shifted_twin(model):
    """The target with its output rows rolled by one: its greedy token is always the
    target's plus one (mod V), so every drafted token is rejected, deterministically."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight.copy_(torch.roll(model.lm_head.weight, 1, dims=0))
    return draft


def quiet(fn, *args, **kw):
    """``fn``'s result, failing on any TreespecWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TreespecWarning)
        return fn(*args, **kw)


# ---- past the model's context -----------------------------------------------------------


def test_prompt_longer_than_the_context_is_refused(model):
    prompt = [(7 * i) % 64 for i in range(300)]  # 300 > 256 positions
    with pytest.raises(ValueError, match="a prompt of 300 tokens is longer than the model's context of 256 "
                                         r"positions .*allow_past_context=True"):
        treespec.generate(model, NgramDrafter(), "chain-2", prompt, max_new_tokens=1)
    with pytest.raises(ValueError, match="300 tokens"):  # the stream refuses it at its first step
        next(treespec.stream(model, NgramDrafter(), "chain-2", [[1, 2], prompt], max_new_tokens=1))
    out = quiet(treespec.generate, model, NgramDrafter(), "chain-2", prompt, max_new_tokens=3, allow_past_context=True)
    assert len(out.sequences[0]) == 3  # asked for: it runs, without a word


def test_generation_running_past_the_context_warns(model):
    with pytest.warns(TreespecWarning, match="10 tokens plus max_new_tokens=250 reaches past the model's context "
                                             "of 256") as caught:
        gen = treespec.stream(model, NgramDrafter(), "chain-2", list(range(10)), max_new_tokens=250)
        next(gen)
        gen.close()
    assert caught[0].filename == __file__  # the user's line, not treespec's
    quiet(treespec.generate, model, NgramDrafter(), "chain-2", list(range(10)), max_new_tokens=250,
          allow_past_context=True)


def test_within_the_context_no_warning(model):
    out = quiet(treespec.generate, model, NgramDrafter(), "chain-2", [list(range(10)), [i % 64 for i in range(200)]],
                max_new_tokens=56)  # 200 + 56 = 256: the last position is still inside
    assert [len(s) for s in out.sequences] == [56, 56]  # and both requests ran to their end


def test_a_python_user_sees_the_warning_without_configuring_logging():
    """The library logs to a NullHandler: a warning logged there never reached a plain script
    (issue 31); ``warnings`` does, on stderr, naming the script's line."""
    root = Path(__file__).resolve().parents[2]
    script = ("import torch, treespec; from helpers.tiny import tiny_model; "
              "from treespec.drafters.ngram import NgramDrafter\ntorch.set_num_threads(1)\n"
              "treespec.generate(tiny_model('llama', 0), NgramDrafter(), 'chain-2', list(range(10)), "
              "max_new_tokens=250)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert "<string>:3: TreespecWarning: a prompt of 10 tokens plus max_new_tokens=250" in p.stderr


# ---- a draft that is never accepted -----------------------------------------------------


def test_draft_never_accepted_warns_once(model):
    drafter = ModelDrafter(shifted_twin(model))
    with pytest.warns(TreespecWarning) as caught:
        out = treespec.generate(model, drafter, "chain-2", [[1, 2, 3], [4, 5]], max_new_tokens=40)
    assert out.metrics.mean_accepted_length == 1.0  # the premise: nothing was accepted
    (msg,) = [str(w.message) for w in caught]  # once per generation, though every step rejected everything
    assert "accepted none of the" in msg and "ModelDrafter" in msg
    assert "is this draft (head) trained for this model?" in msg


def test_draft_never_accepted_short_run_stays_quiet(model):
    """Fewer verify steps than the watch needs: too little evidence to judge the draft."""
    drafter = ModelDrafter(shifted_twin(model))
    out = quiet(treespec.generate, model, drafter, "chain-2", [1, 2, 3], max_new_tokens=12)
    assert 8 <= out.metrics.num_steps < _AcceptanceWatch.STEPS  # past the old 8-step bar, short of the new one


def test_good_draft_no_warning(model):
    twin = tiny_model("llama", 0)  # the target's weights, its own config object
    out = quiet(treespec.generate, model, ModelDrafter(twin), "chain-2", [1, 2, 3], max_new_tokens=40)
    assert out.metrics.mean_accepted_length > 2.5


def test_prompt_lookup_is_not_judged(model):
    """Prompt lookup drafts only where the text repeats; rejections there are no mismatch."""
    prompt = [1, 2, 3, 4] * 8  # repeats, so lookup drafts at every step
    out = quiet(treespec.generate, model, NgramDrafter(), "chain-2", prompt, max_new_tokens=80)
    assert out.metrics.num_steps >= _AcceptanceWatch.STEPS


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
