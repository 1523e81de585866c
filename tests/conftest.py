"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and tests then leave the other core alone."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
