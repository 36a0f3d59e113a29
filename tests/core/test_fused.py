"""The torch.compile switch and the size threshold of the fused paths (softops._core.fused)."""

from __future__ import annotations

import pytest
import torch

import softops
from softops._core import fused


def test_fused_switch_and_threshold():
    softops.set_compile(True)
    assert fused.compile_enabled()
    small = torch.zeros(4, 4)
    assert fused.maybe_fused(torch.sin, small) is torch.sin  # below FUSED_MIN_NUMEL: eager
    assert fused.maybe_fused(torch.sin, torch.zeros(fused.FUSED_MIN_NUMEL), False) is torch.sin
    softops.set_compile(False)
    assert not fused.compile_enabled()
    assert fused.maybe_fused(torch.sin, torch.zeros(fused.FUSED_MIN_NUMEL)) is torch.sin
    with pytest.raises(TypeError, match=r"set_compile: expected a bool; got 1"):
        softops.set_compile(1)


def test_kernel_module_imports_once_and_gives_none_when_it_cannot():
    pytest.importorskip("numba")
    first = fused.kernel_module("softops.topk._ot_numba")
    assert first is not None and callable(first.threshold_rows)
    assert fused.kernel_module("softops.topk._ot_numba") is first
    assert fused.kernel_module("softops._no_such_kernels") is None
    assert fused._state["modules"]["softops._no_such_kernels"] is None
