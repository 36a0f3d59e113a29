"""The C++ kernel of the sorted SOFT top-k (softops/topk/_sorted_kernel.cpp: the operators
``softops::sorted_topk_solve`` and ``softops::sorted_topk_vjp``) against the torch code it stands
in for (the candidate set chosen and solved in torch, :func:`softops._kernels.backend`
``"reference"``): values, weights and gradients in x and epsilon on adversarial rows, the rows it
leaves to the torch code, and the operators' registrations.

The kernel is built ahead of time (``python -m softops._kernels``). Where it is not built these
tests skip, unless ``SOFTOPS_REQUIRE_KERNELS=1`` (CI sets it), where they fail."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops._kernels import backend
from softops.topk import _sorted
from tests._helpers import built_ops, seeded

F64 = torch.float64
F32 = torch.float32

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def ops():
    """The kernel's operators (``torch.ops.softops_sorted``)."""
    return built_ops(_sorted.KERNEL)


def _run(x, k, eps, largest=True, seed=0):
    """values, weights and the gradients in x and (a tensor) epsilon of one loss on both."""
    x = x.detach().clone().requires_grad_()
    e = eps.detach().clone().requires_grad_() if isinstance(eps, torch.Tensor) else eps
    out = softops.soft_topk(x, k, epsilon=e, largest=largest)
    g = seeded(seed)
    gv = torch.randn(out.values.shape, generator=g, dtype=x.dtype)
    gw = torch.randn(out.weights.shape, generator=g, dtype=x.dtype)
    finite_v = torch.where(torch.isfinite(out.values), out.values, 0)
    finite_w = torch.where(torch.isfinite(out.weights), out.weights, 0)
    loss = (finite_v * gv).sum() + (finite_w * gw).sum()
    inputs = [x] + ([e] if isinstance(e, torch.Tensor) else [])
    grads = torch.autograd.grad(loss, inputs)
    return (out.values.detach(), out.weights.detach(), *grads)


def _both(x, k, eps, largest=True, tol=None):
    with backend("kernel"):
        assert _sorted._path(x, k, x.shape[-1], 1e-6, True, True) == "kernel"
        fast = _run(x, k, eps, largest)
    with backend("reference"):
        ref = _run(x, k, eps, largest)
    if tol is None:
        tol = 1e-9 if x.dtype == F64 else 2e-4
    # the gradients to a relative tolerance (a sum of many terms at a small epsilon)
    gtol = max(tol, 1e-7) if x.dtype == F64 else tol
    for i, (a, b) in enumerate(zip(fast, ref, strict=True)):
        t = tol if i < 2 else gtol
        torch.testing.assert_close(a, b, rtol=t, atol=tol, equal_nan=True)
    return fast


def _rows(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = seeded(seed)
    x = torch.randn(4, n, generator=g, dtype=F64)
    if kind == "ties":
        x = (x * 2).round() / 2
    elif kind == "constant":
        x = torch.full((4, n), 0.7, dtype=F64)
    elif kind == "spread":  # far apart: nearly one-hot at epsilon 0.1
        x = x * 50
    elif kind == "logits":
        x = torch.log_softmax(3 * x, -1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "spread", "logits"])
@pytest.mark.parametrize(("n", "k"), [(8, 8), (9, 1), (40, 8), (40, 31), (70, 32), (600, 5)])
def test_the_kernel_equals_the_torch_code(ops, dtype, kind, n, k) -> None:
    x = _rows(kind, n, dtype, seed=n + k)
    eps = torch.tensor([0.02, 0.1, 1.0, 30.0], dtype=dtype)
    _both(x, k, eps)
    _both(x, k, 0.1, largest=False)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("eps", [1e-4, 1e4])
def test_tiny_and_huge_epsilon(ops, dtype, eps) -> None:
    x = _rows("normal", 50, dtype, seed=3)
    tol = 1e-7 if dtype == F64 else 2e-3
    _both(x, 4, eps, tol=tol)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_long_rows_whose_far_entries_stop_short_of_the_top_targets(ops, dtype) -> None:
    # The rest's entries far below the boundary form only the targets next to the rest (their
    # plan is below min(2^-60, tau 2^-20 / m) on the others); normal rows, a row of candidates
    # only (every entry within the candidate bound, most of them deep) and a spread row, against
    # the torch code.
    x = torch.randn(4, 3000, generator=seeded(11), dtype=F64)
    x[1, :300] = -torch.linspace(0.0, 3.0, 300, dtype=F64)
    x[1, 300:] = -10.0  # (outside the candidate set)
    x[2] = x[2] * 3
    x = x.to(dtype)
    eps = torch.tensor([0.1, 0.1, 0.3, 0.05], dtype=dtype)
    values, weights = _both(x, 8, eps)[:2]
    _both(x, 8, 0.1, largest=False)
    # each target's weights sum to 1, and the deep entries of row 1 carry none on the top target
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(values), rtol=0, atol=1e-6)
    assert float(weights[1, 0, 200:300].abs().max()) == 0.0
    # rows of candidates only (no entry outside the set: the weights not formed are written 0)
    short = torch.stack((-torch.linspace(0.0, 3.0, 300), torch.linspace(-1.0, 1.0, 300) ** 3))
    with backend("kernel"):
        status = _sorted.SOLVE_OP(
            short.to(dtype), torch.full((2,), 0.1, dtype=dtype), 8, True, 2000, 1e-6
        )[3]
    assert status.tolist() == [0, 0]
    weights = _both(short.to(dtype), 8, 0.1)[1]
    assert float(weights[0, 0, 200:].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [F64, F32])
def test_rows_with_infinities_or_nan_are_solved_in_full(ops, dtype) -> None:
    x = _rows("normal", 30, dtype, seed=5)
    x[1, 3] = math.inf
    x[2, 7] = math.nan
    x[3, :20] = -math.inf
    values, weights = _both(x, 3, 0.2)[:2]
    assert float(values[1, 0]) == math.inf and bool(values[2].isnan().all())
    assert bool(torch.isfinite(weights[[0, 1, 3]]).all())
    status = _sorted.SOLVE_OP(x, torch.full((4,), 0.2, dtype=dtype), 3, True, 2000, 1e-6)[3]
    assert status.tolist() == [0, 2, 2, 2]


def test_an_empty_batch(ops) -> None:
    x = torch.empty(0, 12, dtype=F64, requires_grad=True)
    out = softops.soft_topk(x, 3)
    assert out.values.shape == (0, 3) and out.weights.shape == (0, 3, 12)
    out.values.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 12)
    for op_out in _sorted.SOLVE_OP(x.detach(), torch.ones(0, dtype=F64), 3, True, 100, 1e-9):
        assert op_out.shape[0] == 0


@pytest.mark.parametrize("dtype", [F64, F32])
def test_the_candidate_set_bounds_the_error_of_the_full_solve(ops, dtype) -> None:
    # docs/math.md §2.4: every weight within tau of the full problem's
    x = torch.randn(3, 2000, generator=seeded(6), dtype=dtype)
    out = _sorted._soft_topk(x, 8, epsilon=0.1, tol=1e-13 if dtype == F64 else 1e-7)
    full = _sorted._soft_topk(x, 8, epsilon=0.1, reduce=False, tol=1e-13, max_iter=100_000)
    tau = _sorted._candidate_tolerance(dtype)
    slack = 1e-12 if dtype == F64 else 2e-6  # (the solves' own tolerances)
    assert float((out.weights - full.weights).abs().max()) <= tau + slack
    assert bool((out.weights == 0).any())  # (the set dropped entries)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("n", [20, 63, 64, 71, 1000, 4099])
def test_the_kernel_s_candidates_are_the_torch_rule_s(ops, dtype, largest, n) -> None:
    # the kernel's one-pass bins and in-place cut (vector code from 64 entries, a scalar tail)
    # keep exactly the entries of the torch rule (_select_rows), at epsilons where the cut falls
    # inside the row, at its end and beyond it; ties at the boundary and a row of logits
    x = torch.randn(6, n, generator=seeded(n), dtype=F64)
    x[1] = (x[1] * 2).round() / 2
    x[2] = torch.log_softmax(3 * x[2], -1)
    x = x.to(dtype)
    for eps in (0.003, 0.05, 0.3, 3.0):
        e = torch.full((6,), eps, dtype=F64)
        out = _sorted.SOLVE_OP(x, e, 8, largest, 2000, 1e-9 if dtype == F64 else 1e-6)
        state, status = out[4], out[3]
        cand, count, _ = _sorted._select_rows(x, e, 8, largest)
        assert bool((status == 0).all())
        assert state[:, 10].long().tolist() == count.tolist(), eps  # (the state's count)
        support = out[0].abs().sum(1) > 0
        for r in range(6):
            kept = torch.zeros(n, dtype=torch.bool)
            kept[cand[r, : int(count[r])]] = True
            assert bool((support[r] <= kept).all()), (eps, r)  # no weight off the candidates


def test_rows_the_kernel_leaves_and_singular_systems_take_the_torch_code(ops, monkeypatch) -> None:
    x = torch.randn(4, 300, generator=seeded(8), dtype=F64)
    ref = _both(x, 5, 0.1)
    monkeypatch.setattr(_sorted, "_KERNEL_STEPS", 0)  # no Newton step: every row is left over
    calls = []

    def spy(name):
        real = getattr(_sorted, name)

        def wrapped(x2, *args):
            calls.append((name, x2.shape[0]))
            return real(x2, *args)

        monkeypatch.setattr(_sorted, name, wrapped)

    spy("_candidate_rows")
    spy("_candidate_vjp")
    with backend("kernel"):
        out = _run(x, 5, 0.1)
    # the forward and the backward, every row in torch
    assert calls == [("_candidate_rows", 4), ("_candidate_vjp", 4)]
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_a_singular_row_is_redone_in_torch(ops) -> None:
    # a column with no coupling left (epsilon far below the gaps): the kernel's VJP is not safe
    x = torch.tensor([[40.0, 20.0, 0.0, -20.0, 1.0], [0.3, -0.1, 0.8, 0.5, 0.0]], dtype=F64)
    eps = torch.tensor([0.02, 0.3], dtype=F64)
    solve = _sorted.SOLVE_OP(x, eps, 2, True, 2000, 1e-9)
    status, state = solve[3], solve[4]
    gv = torch.ones(2, 2, dtype=F64)
    assert status.tolist() == [0, 0]
    gx, _, safe = ops.vjp_rows(
        x,
        eps,
        True,
        2,
        _sorted._BINS_PER_UNIT,
        200,
        state,
        status,
        gv,
        x.new_empty(0),
        True,
        _sorted.DET_MIN,
    )
    assert safe.tolist() == [False, True]
    assert float(gx[0].abs().max()) == 0.0 and bool(torch.isfinite(gx).all())
    _both(x, 2, eps, tol=1e-8)


def test_gradcheck_and_gradgradcheck_through_the_kernel(ops) -> None:
    x = torch.randn(3, 11, generator=seeded(12), dtype=F64, requires_grad=True)
    eps = torch.tensor([0.05, 0.3, 2.0], dtype=F64, requires_grad=True)

    def fn(t, e):
        res = softops.soft_topk(t, 3, epsilon=e)
        return res.values, res.weights

    with backend("kernel"):
        assert torch.autograd.gradcheck(fn, (x, eps))
        assert torch.autograd.gradgradcheck(fn, (x, eps))


@pytest.mark.parametrize("back_end", ["kernel", "reference"])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_the_operators_pass_opcheck_on_either_back_end(ops, back_end, dtype) -> None:
    x = torch.randn(3, 20, generator=seeded(13), dtype=dtype)
    x[2, 4] = math.nan  # a row left to the caller
    eps = torch.tensor([0.1, 0.5, 0.1], dtype=dtype)
    gv = torch.randn(3, 4, generator=seeded(14), dtype=dtype)
    gw = torch.randn(3, 4, 20, generator=seeded(15), dtype=dtype)
    with backend(back_end):
        for k in (4, 20):
            args = (x, eps, k, True, 2000, 1e-6)
            torch.library.opcheck(_sorted.SOLVE_OP.overload, args)
            _, _, _, status, state, _ = _sorted.SOLVE_OP(*args)
            grads = (gv[:, :k] if k == 4 else None, gw if k == 4 else None)
            vjp = (x, eps, state, status, *grads, k, True, 2000, 1e-6, True)
            torch.library.opcheck(_sorted.VJP_OP.overload, vjp)
    # vmap: the vmapped dimension folds into the rows
    with backend(back_end):
        xb = x[:2].unsqueeze(0).expand(2, 2, 20)
        out = torch.func.vmap(lambda r: _sorted.SOLVE_OP(r, eps[:2], 4, True, 2000, 1e-6)[1])(xb)
        one = _sorted.SOLVE_OP(x[:2], eps[:2], 4, True, 2000, 1e-6)[1]
        torch.testing.assert_close(out, one.expand(2, 2, 4))


def _mixed_rows(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """19 rows (not a multiple of any lane width) of every kind, and epsilons from tiny to huge:
    rows the kernel solves a vector at a time among rows it solves one at a time (ties, constant,
    nearly one-hot, far apart, huge and tiny scales) and rows it leaves to the caller (±inf,
    NaN)."""
    g = seeded(seed)
    x = torch.randn(19, n, generator=g, dtype=F64)
    x[1] = (x[1] * 2).round() / 2  # ties
    x[2] = 0.7  # constant
    x[3] *= 50  # nearly one-hot
    x[4] = torch.log_softmax(3 * x[4], -1)
    x[5] *= 1e4
    x[6] *= 1e-6
    x[7] = torch.arange(n, dtype=F64) * 1e3
    x[8, 1] = math.inf
    x[9, 2] = math.nan
    x[10, : n // 2] = -math.inf
    x[11] = (x[11] * 4).round()
    eps = torch.tensor([0.1, 0.02, 1.0, 30.0, 0.3, 0.05, 3.0], dtype=F64).repeat(3)[:19]
    return x.to(dtype), eps.to(dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(
    ("n", "k"), [(8, 8), (8, 3), (8, 1), (12, 12), (20, 11), (20, 12), (40, 8), (90, 8)]
)
def test_batches_mixing_lane_rows_and_scalar_rows_equal_the_torch_code(ops, dtype, n, k) -> None:
    x, eps = _mixed_rows(n, dtype, seed=100 + n + k)
    _both(x, k, eps, tol=1e-8 if dtype == F64 else 2e-4)
    _both(x[:13], k, 0.1, largest=False)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("eps", [1e-4, 1e4])
@pytest.mark.parametrize("n", [8, 32])
def test_lane_rows_at_tiny_and_huge_epsilon(ops, dtype, eps, n) -> None:
    x = torch.randn(11, n, generator=seeded(n), dtype=dtype)
    tol = 1e-7 if dtype == F64 else 2e-3
    _both(x, min(8, n), eps, tol=tol)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(("n", "k"), [(8, 8), (8, 4), (33, 8), (60, 12)])
def test_a_row_solved_in_the_lanes_equals_the_row_solved_alone(ops, dtype, n, k) -> None:
    # a batch's rows share vectors of rows; a batch of one row takes the one-row code: the same
    # flags, and the same results up to rounding
    x, eps = _mixed_rows(n, dtype, seed=200 + n + k)
    gv = torch.randn(19, k, generator=seeded(7), dtype=dtype)
    gw = torch.randn(19, k, n, generator=seeded(8), dtype=dtype)
    with backend("kernel"):
        batch = _sorted.SOLVE_OP(x, eps, k, True, 2000, 1e-9)
        bgrad = _sorted.VJP_OP(x, eps, batch[4], batch[3], gv, gw, k, True, 2000, 1e-9, True)
        for r in range(19):
            one = _sorted.SOLVE_OP(x[r : r + 1], eps[r : r + 1], k, True, 2000, 1e-9)
            assert one[3].tolist() == batch[3][r : r + 1].tolist()
            for a, b in zip(one[:2], batch[:2], strict=True):
                torch.testing.assert_close(a, b[r : r + 1], rtol=1e-9, atol=1e-12, equal_nan=True)
            args = (one[4], one[3], gv[r : r + 1], gw[r : r + 1], k, True, 2000, 1e-9, True)
            grad = _sorted.VJP_OP(x[r : r + 1], eps[r : r + 1], *args)
            for a, b in zip(grad, bgrad, strict=True):
                torch.testing.assert_close(a, b[r : r + 1], rtol=1e-7, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_groups_of_ranked_rows_write_what_the_row_alone_writes(ops, dtype, n) -> None:
    # rows of k = n distinct entries fill whole groups of lanes, whose weights and values are
    # written for the group at once (each row's plan put back in the row's order): the same as
    # the one-row code's, entry by entry, at every place of the row, in both orientations
    g = seeded(300 + n)
    x = torch.randn(21, n, generator=g, dtype=dtype)
    x[3] = x[3].flip(-1).sort().values  # (already ascending)
    x[4] = torch.randperm(n, generator=g).to(dtype) * 0.3
    eps = torch.full((21,), 0.1, dtype=dtype)
    eps[5:9] = 0.5
    for largest in (True, False):
        with backend("kernel"):
            batch = _sorted.SOLVE_OP(x, eps, n, largest, 2000, 1e-9)
            assert batch[3].tolist() == [0] * 21
            for r in range(21):
                one = _sorted.SOLVE_OP(x[r : r + 1], eps[r : r + 1], n, largest, 2000, 1e-9)
                for a, b in zip(one[:2], batch[:2], strict=True):
                    torch.testing.assert_close(a, b[r : r + 1], rtol=1e-9, atol=1e-12)
        # each entry's weights sum to 1 over the targets and each target's over the entries, to
        # the solve's tolerance (relative L1: tol n) and the weights' rounding
        w = batch[0].double()
        tol = (1e-9 * n) if dtype == F64 else (1e-6 * n + 1e-6)
        torch.testing.assert_close(w.sum(-2), torch.ones(21, n, dtype=F64), atol=tol, rtol=0)
        torch.testing.assert_close(w.sum(-1), torch.ones(21, n, dtype=F64), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("n", [4, 5, 8])
def test_rows_prepared_a_vector_at_a_time_are_the_rows_prepared_one_at_a_time(
    ops, dtype, n
) -> None:
    # eight rows of k = n entries are sorted, checked and given their factors a vector of rows
    # at a time; fewer than eight take the one-row preparation into the same lanes. Both give the
    # rows the same numbers, bit for bit: weights, values, residuals, states, indices and
    # gradients. A tie among eight rows sends them to the one-row preparation, which keeps equal
    # scores in the order of the row, as the vectors' sort does.
    g = seeded(400 + n)
    x = torch.randn(8, n, generator=g, dtype=dtype)
    x[2, 1] = x[2, 0] - 1e-3  # (close neighbours)
    x[5] *= 20  # (nearly one-hot)
    eps = torch.full((8,), 0.1, dtype=dtype)
    eps[3] = 0.7
    gv = torch.randn(8, n, generator=seeded(401), dtype=dtype)
    gw = torch.randn(8, n, n, generator=seeded(402), dtype=dtype)
    for largest in (True, False):
        args = (n, largest, 2000, 1e-9)
        with backend("kernel"):
            block = _sorted.SOLVE_OP(x, eps, *args)
            rows = _sorted.SOLVE_OP(x[:7], eps[:7], *args)
            assert block[3].tolist() == [0] * 8
            for a, b in zip(block, rows, strict=True):
                assert torch.equal(a[:7], b)
            for cw in (None, gw):  # (the values' cotangent alone, and the weights' beside it)
                gb = _sorted.VJP_OP(x, eps, block[4], block[3], gv, cw, *args, True)
                cr = None if cw is None else cw[:7]
                gr = _sorted.VJP_OP(x[:7], eps[:7], rows[4], rows[3], gv[:7], cr, *args, True)
                for a, b in zip(gb, gr, strict=True):
                    assert torch.equal(a[:7], b)
            tied = x.clone()
            tied[6, 1] = tied[6, 0]
            out = _sorted.SOLVE_OP(tied, eps, *args)
            order = torch.sort(tied, dim=-1, descending=largest, stable=True).indices
            assert torch.equal(out[5], order)
            assert torch.equal(
                block[5], torch.sort(x, dim=-1, descending=largest, stable=True).indices
            )


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(("n", "eps"), [(128, 0.1), (100, 0.05), (64, 0.2)])
def test_lane_rows_whose_far_entries_leave_columns_unformed_equal_the_row_alone(
    ops, dtype, n, eps
) -> None:
    # rows of many candidates (solved in the lanes in a batch, by the one-row code alone): a
    # rest entry far below the k-th score has its plan's first columns below the drop bound,
    # not formed (its weight there exactly 0) in either, the lanes forming a column at a slot
    # wherever one of its rows does; the flags, values, weights and gradients agree
    k = 8
    g = seeded(300 + n)
    x = torch.randn(21, n, generator=g, dtype=F64)
    x[::4] *= 2.5  # (wider rows: more entries far below)
    x = x.to(dtype)
    e = torch.full((21,), eps, dtype=dtype)
    gv = torch.randn(21, k, generator=seeded(9), dtype=dtype)
    gw = torch.randn(21, k, n, generator=seeded(10), dtype=dtype)
    with backend("kernel"):
        batch = _sorted.SOLVE_OP(x, e, k, True, 2000, 1e-9)
        bgrad = _sorted.VJP_OP(x, e, batch[4], batch[3], gv, gw, k, True, 2000, 1e-9, True)
        bgrad_v = _sorted.VJP_OP(x, e, batch[4], batch[3], gv, None, k, True, 2000, 1e-9, True)
        assert (batch[3] == 0).all()
        if dtype == F64:  # (in float32 an entry below 2^-60 rounds to 0 either way)
            w = batch[0]
            cut = (w[:, 0] == 0) & (w[:, k - 1] > 0)  # formed in column k - 1, not in column 0
            assert cut.sum(-1).min() > 0
        for r in range(21):
            one = _sorted.SOLVE_OP(x[r : r + 1], e[r : r + 1], k, True, 2000, 1e-9)
            assert one[3].tolist() == batch[3][r : r + 1].tolist()
            for a, b in zip(one[:2], batch[:2], strict=True):
                torch.testing.assert_close(a, b[r : r + 1], rtol=1e-9, atol=1e-12)
            for cot, want in ((gw[r : r + 1], bgrad), (None, bgrad_v)):
                args = (one[4], one[3], gv[r : r + 1], cot, k, True, 2000, 1e-9, True)
                grad = _sorted.VJP_OP(x[r : r + 1], e[r : r + 1], *args)
                for a, b in zip(grad, want, strict=True):
                    torch.testing.assert_close(a, b[r : r + 1], rtol=1e-7, atol=1e-9)


def _stable_top(row: list[float], k: int, largest: bool) -> list[int]:
    """The indices of the k largest (smallest) of row, ties by index, NaN above every number:
    Python's stable sort, independent of torch."""

    def key(i: int) -> tuple[int, float]:
        v = row[i]
        if math.isnan(v):
            return (0 if largest else 1, 0.0)
        return (1 if largest else 0, -v if largest else v)

    return sorted(range(len(row)), key=key)[:k]


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("back_end", ["kernel", "reference"])
@pytest.mark.parametrize(("n", "k"), [(8, 8), (9, 3), (40, 8), (1500, 5)])
def test_indices_are_topk_s_with_ties_in_the_order_of_the_row(ops, back_end, largest, n, k):
    g = seeded(n + k)
    x = torch.randn(6, n, generator=g)
    x[0] = torch.randint(0, 3, (n,), generator=g).float()  # many ties across the boundary
    x[1] = 0.25  # all tied
    x[2, ::2] = -0.0  # -0.0 and 0.0 are equal
    x[2, 1::2] = 0.0
    x[3, 1] = x[3, n - 1] = math.nan  # NaN rows: above every number, as torch.topk
    x[4, 2] = math.inf
    x[4, 0] = -math.inf
    with backend(back_end):
        got = softops.soft_topk(x, k, largest=largest).indices
    want = [_stable_top(r, k, largest) for r in x.tolist()]
    assert got.tolist() == want
    distinct = torch.randn(3, n, generator=g)
    with backend(back_end):
        got = softops.soft_topk(distinct, k, largest=largest).indices
    assert torch.equal(got, torch.topk(distinct, k, -1, largest, sorted=True).indices)


def _on_one_and_two_threads(x, gv):
    """soft_topk(x, 8)'s values, weights, indices and gradient of (values * gv).sum() by the
    kernel, on one thread, then on two (the one_thread fixture restores the count)."""

    def run() -> tuple[torch.Tensor, ...]:
        xs = x.clone().requires_grad_()
        out = softops.soft_topk(xs, 8)
        (grad,) = torch.autograd.grad((out.values * gv).sum(), xs)
        return out.values, out.weights, out.indices, grad

    with backend("kernel"):
        one = run()
        torch.set_num_threads(2)
        two = run()
    return one, two


def test_a_batch_on_two_threads_equals_the_batch_on_one(ops) -> None:
    # weights of 8 MiB or more are advised onto huge pages and, where the rows spread over
    # threads, first touched in the calling thread: every entry is still written by its row's
    # solve, and the rows (independent) come out bit for bit as on one thread, gradients too
    x = torch.randn(1100, 1000, generator=seeded(11))
    x[3, 5] = math.nan  # (a row the caller solves in full)
    x[7] = 0.5  # (every entry tied: a row of candidates only)
    gv = torch.randn(1100, 8, generator=seeded(12))
    assert x.numel() * 8 * x.element_size() >= 16 * 2**21  # (35 MB of weights)
    one, two = _on_one_and_two_threads(x, gv)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    w = one[1][torch.arange(1100) != 3]
    torch.testing.assert_close(w.sum(-1), torch.ones(1099, 8), rtol=0, atol=1e-5)


def test_short_rows_spread_over_two_threads_equal_one_thread(ops) -> None:
    # rows of 8, k = 8: a row's own work counts in the rows per task (row_grain: 564), so 1500
    # rows spread over both threads (750 each, each ending on a part-filled group of lanes: 750 =
    # 93 * 8 + 6); bit for bit as on one thread
    x = torch.randn(1500, 8, generator=seeded(31))
    x[10] = 0.25  # (ties: the row is not ranked)
    gv = torch.randn(1500, 8, generator=seeded(32))
    one, two = _on_one_and_two_threads(x, gv)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "regime", ["plain", "near ties", "eps far below the gaps", "eps far above", "large |x|/eps"]
)
@pytest.mark.parametrize("n, k", [(8, 8), (8, 4), (100, 8)])
def test_lane_rows_gradients_match_central_differences(ops, regime, n, k) -> None:
    """The lanes' backward (a factor without jitter wherever its pivots are positive, one
    refinement against the exact residual below 1e-2) against float64 central differences of
    the values and the weights, where the couplings of a row differ by orders of magnitude."""
    from tests._helpers import fd_gap

    g = seeded(3)
    x = torch.randn(64 if n == 8 else 32, n, generator=g, dtype=torch.float64)
    eps, h = 0.1, 1e-6
    if regime == "near ties":
        x[:, 1], x[:, 3], h = x[:, 0] + 1e-9, x[:, 2], 1e-7
    elif regime == "eps far below the gaps":
        x, eps = x * 50, 0.3
    elif regime == "eps far above":
        eps, h = 50.0, 1e-5
    elif regime == "large |x|/eps":
        x, eps, h = x * 1e3 + 1e4, 1.0, 1e-5

    def both(t: torch.Tensor) -> torch.Tensor:
        out = softops.soft_topk(t, k, epsilon=eps)
        return torch.cat([out.values.flatten(), out.weights.flatten()])

    with backend("kernel"):
        assert fd_gap(both, x, h, g) < 1e-8


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize(("n", "k"), [(8, 8), (8, 4), (40, 8), (601, 5), (1000, 8)])
def test_the_values_alone_backward_equals_the_general_one_and_the_torch_code(ops, dtype, n, k):
    """A cotangent of the values alone (the scalar rows form u = gv_t x_i where they read it,
    the lanes from the scores) against a zero cotangent of the weights beside it (the general
    code, which forms the cotangent's arrays) and against the torch code, with epsilon's
    gradient; rows of every kind, n not a multiple of the vector width (the weights' rows off
    the output's alignment)."""
    x, eps = _mixed_rows(n, dtype, seed=300 + n + k)
    gv = torch.randn(19, k, generator=seeded(9), dtype=dtype)
    zero = torch.zeros(19, k, n, dtype=dtype)
    with backend("kernel"):
        _, _, _, status, state, _ = _sorted.SOLVE_OP(x, eps, k, True, 2000, 1e-9)
        args = (k, True, 2000, 1e-9, True)
        alone = _sorted.VJP_OP(x, eps, state, status, gv, None, *args)
        general = _sorted.VJP_OP(x, eps, state, status, gv, zero, *args)
    rtol = 1e-10 if dtype == F64 else 1e-5
    for a, b in zip(alone, general, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))
    # the whole op, values only, against the torch code (values, gradients in x and epsilon)
    e = eps.clone().requires_grad_()

    def run(back_end: str) -> tuple[torch.Tensor, ...]:
        xs = x.clone().requires_grad_()
        with backend(back_end):
            out = softops.soft_topk(xs, k, epsilon=e)
            keep = torch.isfinite(out.values)
            loss = (torch.where(keep, out.values, 0) * gv).sum()
            return (out.values.detach(), *torch.autograd.grad(loss, (xs, e)))

    tol = 1e-8 if dtype == F64 else 2e-4
    for a, b in zip(run("kernel"), run("reference"), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("eps", [1e-4, 0.1, 1e4])
def test_rows_of_k_equal_to_n_ranked_or_not_equal_the_torch_code(ops, eps) -> None:
    """k = n rows are prepared from their ranks (the home of rank r is r) where every midpoint
    lies strictly between its two scores, else by the general code: distinct rows, rows with a
    pair of equal scores, and float64 rows with neighbours one unit of rounding apart (whose
    midpoint rounds onto one of them), near ties at either end, against the torch code (values,
    weights, float64 gradients in x and epsilon), and the gradients against central
    differences."""
    x = torch.randn(13, 8, generator=seeded(21), dtype=F64)
    x[1, 3] = x[1, 5]  # equal scores
    x[2, 2] = torch.nextafter(x[2, 6], torch.tensor(math.inf, dtype=F64))  # one ulp apart
    x[3, 0] = x[3, 1] + 1e-12  # near ties
    x[4, :2] = x[4, :2].max() + torch.tensor([0.0, 1e-13], dtype=F64)  # at the top
    x[5] = torch.arange(8, dtype=F64) * 50  # far apart
    x[6] = 0.3  # all tied
    _both(x, 8, eps, tol=1e-7 if eps < 1e-3 else 1e-9)
    _both(x, 8, torch.full((13,), eps, dtype=F64), largest=False, tol=1e-7 if eps < 1e-3 else 1e-9)
    if eps == 0.1:
        from tests._helpers import fd_gap

        def values(t: torch.Tensor) -> torch.Tensor:
            return softops.soft_topk(t, 8, epsilon=eps).values

        with backend("kernel"):
            assert fd_gap(values, x[[0, 3, 5]], 1e-6, seeded(22)) < 1e-8


def test_a_k_equal_to_n_state_not_the_forward_s_is_redone_in_torch(ops) -> None:
    # for k = n the state holds the rows' rank indices; indices out of range (not a state of the
    # forward) leave the row to the torch code, which gives the torch code's gradient
    x = torch.randn(3, 8, generator=seeded(23), dtype=F64)
    eps = torch.full((3,), 0.1, dtype=F64)
    gv = torch.randn(3, 8, generator=seeded(24), dtype=F64)
    with backend("kernel"):
        _, _, _, status, state, _ = _sorted.SOLVE_OP(x, eps, 8, True, 2000, 1e-9)
        good = _sorted.VJP_OP(x, eps, state, status, gv, None, 8, True, 2000, 1e-9, False)
        bad_state = state.clone()
        bad_state[1, 0] = 99.0
        bad = _sorted.VJP_OP(x, eps, bad_state, status, gv, None, 8, True, 2000, 1e-9, False)
    torch.testing.assert_close(bad[0], good[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n", [57, 1000, 1013])
def test_long_rows_top_scores_with_the_top_in_one_block_or_the_tail(ops, n) -> None:
    # the k + 1 largest found from a floor set by the blocks' maxima: the largest entries packed
    # into one block, into the tail past the last whole block, equal block maxima, -0.0 and 0.0
    g = seeded(n)
    x = torch.randn(5, n, generator=g)
    x[0, 32:48] = torch.arange(16.0) + 10  # one block holds them all
    x[1, n - 5 :] = torch.arange(5.0) + 10  # the tail
    x[2] = torch.randint(0, 2, (n,), generator=g).float()  # every block's maximum equal
    x[3, ::2] = -0.0
    x[3, 1::2] = 0.0
    x[4, -1] = 100.0
    for largest in (True, False):
        with backend("kernel"):
            got = softops.soft_topk(x, 8, largest=largest).indices
        assert got.tolist() == [_stable_top(r, 8, largest) for r in x.tolist()]


def test_weights_streamed_to_a_large_output_equal_those_written_in_place(ops) -> None:
    # weights of 8 MiB or more are formed in a scratch and streamed to the output (the others
    # written in place): the same rows, bit for bit, with their zeros off the candidates
    x = torch.randn(1100, 1001, generator=seeded(31))  # (rows off the vector alignment)
    x[4] = 0.5  # (a row of candidates only)
    with backend("kernel"):
        big = softops.soft_topk(x, 8)
        small = softops.soft_topk(x[:6], 8)
    assert big.weights.numel() * big.weights.element_size() >= 2**23
    for a, b in zip(small, big, strict=True):
        torch.testing.assert_close(a, b[:6], rtol=0, atol=0)
    assert int((big.weights[:6] == 0).sum()) > 0


@pytest.mark.parametrize("dtype", [F64, F32])
def test_calls_leave_nothing_in_the_kept_scratch(ops, dtype) -> None:
    # each thread keeps its scratch between calls (released past a size): rows solved after
    # calls that left other rows, targets, lanes and candidate counts in it come out bit for
    # bit as before, values, weights and gradients (nothing read that the call did not write)
    g = seeded(41)
    x = torch.randn(24, 128, generator=g, dtype=dtype)
    x[5] = 0.25  # (a row of candidates only)
    x[9, :64] = x[9, 64:]  # (ties)
    gv = torch.randn(24, 8, generator=g, dtype=dtype)

    def run(rows: torch.Tensor, k: int, cot: torch.Tensor | None = None) -> tuple:
        xs = rows.clone().requires_grad_()
        out = softops.soft_topk(xs, k, epsilon=0.05)
        cot = torch.ones_like(out.values) if cot is None else cot
        (grad,) = torch.autograd.grad((out.values * cot).sum() + out.weights.sum() ** 2, xs)
        return out.values, out.weights, grad

    others = [  # (rows, k): longer rows, fewer and more targets, a row past the kept size
        (torch.randn(40, 1000, generator=g, dtype=dtype) * 3, 8),
        (torch.randn(9, 60, generator=g, dtype=dtype), 3),
        (torch.randn(17, 40, generator=g, dtype=dtype), 31),
        (torch.randn(1, 1_000_000, generator=g, dtype=dtype), 8),
        (torch.randn(33, 8, generator=g, dtype=dtype), 8),
    ]
    with backend("kernel"):
        first = run(x, 8, gv)
        for rows, k in others:
            run(rows, k)
            again = run(x, 8, gv)
            for a, b in zip(first, again, strict=True):
                assert torch.equal(a, b)


def test_operand_layouts_give_the_same_bits(ops) -> None:
    # epsilon and the values' cotangent are read as doubles: float32 converted in the kernel's
    # buffer, float64 in place, others (strided) by torch; each the same to the bit, as are the
    # values written in x's dtype and those of the float64 solve rounded once
    x = torch.randn(40, 8, generator=seeded(21), dtype=F32)
    eps32 = torch.full((40,), 0.1, dtype=F32)
    args = (8, True, 2000, 1e-6)
    out = _sorted.SOLVE_OP(x, eps32, *args)
    out64 = _sorted.SOLVE_OP(x, eps32.double(), *args)
    for a, b in zip(out, out64, strict=True):
        assert torch.equal(a, b)
    assert out[1].dtype == F32
    with backend("reference"):
        ref = _sorted.SOLVE_OP(x, eps32, *args)
    torch.testing.assert_close(out[1], ref[1], atol=1e-5, rtol=1e-5)
    status, state = out[3], out[4]
    assert status.tolist() == [0] * 40
    gv = torch.randn(40, 8, generator=seeded(22), dtype=F32)
    vjp = (8, True, 2000, 1e-6, True)
    base = _sorted.VJP_OP(x, eps32, state, status, gv, None, *vjp)
    strided = torch.randn(40, 16, generator=seeded(23), dtype=F32)[:, ::2].copy_(gv)
    for e, g in ((eps32.double(), gv.double()), (eps32.expand(40), strided), (eps32, gv)):
        again = _sorted.VJP_OP(x, e, state, status, g, None, *vjp)
        assert torch.equal(again[0], base[0]) and torch.equal(again[1], base[1])
    # a second call with fewer rows reads only its own (the buffers persist, larger)
    small = _sorted.VJP_OP(x[:3], eps32[:3], state[:3], status[:3], gv[:3], None, *vjp)
    assert torch.equal(small[0], base[0][:3]) and torch.equal(small[1], base[1][:3])


def test_short_rows_of_a_tiny_backward_pivot_leave_the_lanes() -> None:
    # rows of 8 at epsilon 0.01 whose backward system has a squared pivot far below 1e-8 (a gap
    # near epsilon beside far ones; a tie): solved with their group in the lanes, one refinement
    # of the factor without jitter left gradients of 5e3 and 4e10 where the torch code has 1
    rows = [
        [
            1.0988796772314697,
            1.4115692256474852,
            -1.8174778497551405,
            -0.7816475554371833,
            -0.8496658577197065,
            0.239084217983149,
            1.498881736685639,
            -0.11533551656582346,
        ],
        [0.1, -0.2, 1.5, -1.8, 0.2, -0.9, 0.9, -0.9],
        [0.3, -1.1, 0.7, 2.0, -0.4, 1.2, -2.2, 0.05],
    ]
    x = torch.tensor(rows, dtype=F64)
    gv = torch.randn(3, 8, generator=seeded(31), dtype=F64)
    grads = []
    for kernel in (True, False):
        xx = x.clone().requires_grad_()
        out = _sorted._soft_topk(xx, 8, epsilon=0.01, kernel=kernel)
        grads.append(torch.autograd.grad((out.values * gv).sum(), xx)[0])
    assert float(grads[1].abs().max()) < 10
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-8, atol=1e-8)
