"""Shared fixtures. The test run uses the back ends a user gets out of the box (the compiled
kernels where they are built); tests of the reference choose it with
``softops._kernels.backend("reference")``."""

from __future__ import annotations

import pytest
import torch

from softops import _kernels


@pytest.fixture(autouse=True)
def _seed_and_back_end():
    """A seeded generator, and the back end restored after the test (a test may choose one for
    its whole body with ``softops._kernels.set_default_backend``)."""
    torch.manual_seed(0)
    before = _kernels._state["backend"]
    yield
    _kernels.set_default_backend(before)


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
