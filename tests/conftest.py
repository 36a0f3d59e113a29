"""Shared fixtures. The fused torch.compile paths are off by default in the test run (each graph
takes about 20 s to compile on 2 cores); the compile smoke tests turn them on explicitly."""

from __future__ import annotations

import pytest
import torch

import softops


@pytest.fixture(autouse=True)
def _seed_and_eager():
    torch.manual_seed(0)
    softops.set_compile(False)
    yield
    softops.set_compile(False)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny problems: avoid waking the intra-op pool (slow on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
