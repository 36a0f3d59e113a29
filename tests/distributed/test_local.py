"""softops.distributed in this process: without a process group (a world of one), in a gloo
group of one (in-process, over a HashStore), and the errors of the group set-up."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import softops
import softops.distributed as sd

F64 = torch.float64


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a world of one")

    monkeypatch.setattr(dist, "all_reduce", refuse)


@pytest.fixture
def group_of_one():
    """The default process group, gloo, world size 1, in this process (torn down after)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 9, generator=g, dtype=F64)
    x[1, 2] = math.inf
    x[2, 4] = -math.inf
    return x


@pytest.mark.parametrize("method", ["ot", "sparse"])
def test_without_a_group_it_is_the_single_process_op(method, no_collectives, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = _inputs()
    for k, eps in ((0, 0.1), (3, 0.1), (2.5, 1.0), (9, 0.3), (4, 1e-4)):
        want = softops.soft_topk_mask(x, k, epsilon=eps, method=method)
        got = sd.soft_topk_mask(x, k, epsilon=eps, method=method)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    hard = sd.soft_topk_mask(x, 3, epsilon=0.1, method=method, hard=True)
    torch.testing.assert_close(hard, softops.soft_topk_mask(x, 3, hard=True, method=method))


def test_without_a_group_a_launcher_world_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError) as info:
        sd.soft_topk_mask(torch.randn(2, 5), 2)
    assert str(info.value) == (
        "distributed.soft_topk_mask: expected torch.distributed to be initialised "
        "(torch.distributed.init_process_group) or a `group`, since WORLD_SIZE=4 says this "
        "process is one of several; got no process group."
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    sd.soft_topk_mask(torch.randn(2, 5), 2)


def test_group_must_be_a_process_group():
    with pytest.raises(TypeError, match=r"expected `group` to be a torch.distributed ProcessGroup"):
        sd.topk(torch.randn(2, 5), 2, group=object())
    with pytest.raises(ValueError, match="does not include it"):
        sd.soft_topk_mask(torch.randn(2, 5), 2, group=dist.GroupMember.NON_GROUP_MEMBER)


def test_empty_batch_and_empty_result(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = torch.randn(0, 4, requires_grad=True)
    out = sd.soft_topk_mask(x, 2)
    assert out.shape == (0, 4) and out.requires_grad
    res = sd.topk(torch.randn(2, 4), 0)
    assert res.values.shape == (2, 0) and res.indices.dtype == torch.int64


def test_double_backward_raises(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = torch.randn(2, 6, dtype=F64, requires_grad=True)
    for method in ("ot", "sparse"):
        A = sd.soft_topk_mask(x, 2, method=method)
        with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not"):
            torch.autograd.grad(A, x, torch.randn_like(A), create_graph=True)


@pytest.mark.parametrize("method", ["ot", "sparse"])
def test_gradcheck_in_a_group_of_one(method, group_of_one):
    x = torch.randn(2, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()
    k = torch.tensor(2.5, dtype=F64, requires_grad=True)
    eps = torch.tensor([0.4, 0.9], dtype=F64, requires_grad=True)

    def f(x, k, eps):
        return sd.soft_topk_mask(x, k, epsilon=eps, method=method, group=group_of_one)

    assert torch.autograd.gradcheck(f, (x, k, eps))
    kr = torch.tensor([1.5, 3.5], dtype=F64, requires_grad=True)  # (sparse: S never empty)
    assert torch.autograd.gradcheck(lambda x, k: f(x, k, 0.3), (x, kr))


def test_group_of_one_matches_the_single_process_op(group_of_one):
    x = _inputs(1).requires_grad_()
    k = torch.tensor(3.0, dtype=F64, requires_grad=True)
    want = softops.soft_topk_mask(x, k, epsilon=0.2)
    got = sd.soft_topk_mask(x, k, epsilon=0.2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad(got, [x, k], g), torch.autograd.grad(want, [x, k], g), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    res = sd.topk_threshold(x.detach(), 3, 0.2)
    ref = softops.solvers.topk_threshold(x.detach(), 3, 0.2)
    torch.testing.assert_close(res.threshold, ref.threshold, rtol=1e-12, atol=1e-12)
    assert res.converged.all() and res.iterations <= 8


@pytest.mark.parametrize("largest", [True, False])
def test_topk_threshold_at_the_limits_without_a_group(largest, no_collectives, monkeypatch):
    # softops.solvers.topk_threshold's contract: +inf at k -> 0, -inf at k -> n (swapped with
    # largest=False), 0 without a finite entry, NaN where k cannot be met
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    inf, nan = math.inf, math.nan
    sign = 1.0 if largest else -1.0
    x = torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(4))
    x[1, 0] = sign * inf
    x[3] = torch.tensor([inf, -inf, inf, -inf, -inf]) * sign
    x[4, 2] = nan
    x[5, 4] = -sign * inf
    k = torch.tensor([0.0, 1.0, 5.0, 2.0, 2.0, 4.0], dtype=F64)
    got = sd.topk_threshold(x, k, 0.3, largest=largest)
    want = softops.solvers.topk_threshold(x, k, 0.3, largest=largest)
    expected = torch.tensor([inf, inf, -inf, 0.0, nan, -inf], dtype=F64) * sign
    torch.testing.assert_close(got.threshold, expected, equal_nan=True)
    torch.testing.assert_close(want.threshold, expected, equal_nan=True)
    assert got.converged.tolist() == [True, True, True, True, False, True]
    assert got.residual[[0, 1, 2, 3, 5]].eq(0).all() and got.residual[4].isnan()
    assert torch.equal(got.converged, want.converged)
