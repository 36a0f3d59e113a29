"""softops.sort._limits: rows with ±inf taken to their limits around any backend with the one
signature (grouping by the number of finite entries, the rank offset, m = 0, NaN rows)."""

from __future__ import annotations

import math

import pytest
import torch

import softops
from softops.sort import _neuralsort, _ot, _softsort
from softops.sort._limits import with_limits
from softops.sort._options import MethodOptions

F64 = torch.float64
INF = math.inf
OPTS = MethodOptions(tol=1e-12)
BACKENDS = {"softsort": _softsort, "neuralsort": _neuralsort, "ot": _ot}


def _rows() -> torch.Tensor:
    x = torch.randn(5, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    x[1, 2] = INF  # m = 5
    x[2, 0], x[2, 4] = -INF, INF  # m = 4
    x[3, 5] = -INF  # m = 5
    x[4] = INF  # m = 0
    return x


def test_groups_rows_by_their_number_of_finite_entries():
    calls = []

    def fake(x2, eps, descending, opts, offset=None):
        calls.append((tuple(x2.shape), None if offset is None else offset.tolist()))
        return x2 * 0 + 7.0

    x = _rows()
    eps = torch.ones(5, dtype=F64)
    out = with_limits(fake, "rank", x, eps, False, OPTS)
    # one call for the plain row, one per distinct m > 0 (the m = 0 row needs none); the offset
    # is the number of -inf entries before the finite block
    assert calls == [((1, 6), None), ((1, 4), [1.0]), ((2, 5), [0.0, 1.0])]
    assert (out[0] == 7).all()
    assert out[1, 2] == 6 and out[3, 5] == 1  # a single +inf is last, a single -inf first
    assert (out[4] == 3.5).all()  # all tied at +inf: the mean position


def test_no_infinity_is_one_plain_call():
    calls = []

    def fake(x2, eps, descending, opts, offset=None):
        calls.append(x2.shape)
        return x2

    x = torch.randn(3, 4, dtype=F64)
    x[1, 1] = math.nan  # NaN rows are not taken to a limit: NaN by contract
    x[1, 2] = INF
    assert with_limits(fake, "sort", x, torch.ones(3, dtype=F64), False, OPTS) is x
    assert calls == [(3, 4)]


@pytest.mark.parametrize("method", sorted(BACKENDS))
@pytest.mark.parametrize("descending", [False, True])
def test_limit_is_the_method_on_the_finite_entries(method, descending):
    backend = BACKENDS[method]
    x = torch.tensor([[0.3, INF, -1.2, 2.0, -INF, 0.7]], dtype=F64)
    fin = torch.tensor([[0.3, -1.2, 2.0, 0.7]], dtype=F64)
    eps = torch.full((1,), 0.4, dtype=F64)
    sort = with_limits(backend.sort, "sort", x, eps, descending, OPTS)
    s_fin = backend.sort(fin, eps, descending, OPTS)
    ends = [INF, -INF] if descending else [-INF, INF]
    torch.testing.assert_close(sort[0, [0, -1]], torch.tensor(ends, dtype=F64))
    torch.testing.assert_close(sort[:, 1:-1], s_fin)
    rank = with_limits(backend.rank, "rank", x, eps, descending, OPTS)
    r_fin = backend.rank(fin, eps, descending, OPTS, torch.ones(1, dtype=F64))
    torch.testing.assert_close(rank[:, [0, 2, 3, 5]], r_fin)
    assert rank[0, 1].item() == (1.0 if descending else 6.0)
    p = with_limits(backend.argsort, "argsort", x, eps, descending, OPTS)
    assert p.shape == (1, 6, 6)
    p_fin = backend.argsort(fin, eps, descending, OPTS)
    torch.testing.assert_close(p[:, 1:-1][:, :, [0, 2, 3, 5]], p_fin)
    assert (p[:, 1:-1][:, :, [1, 4]] == 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(1, 6, dtype=F64))


def test_infinite_entries_get_a_zero_gradient():
    x = torch.tensor([[0.3, INF, -1.2, 2.0]], dtype=F64, requires_grad=True)
    eps = torch.full((1,), 0.5, dtype=F64, requires_grad=True)
    r = with_limits(_softsort.rank, "rank", x, eps, False, MethodOptions())
    gx, ge = torch.autograd.grad(r.sum() + (r * torch.arange(4.0)).sum(), (x, eps))
    assert gx[0, 1] == 0 and torch.isfinite(gx).all() and torch.isfinite(ge).all()


@pytest.mark.parametrize("method", ["softsort", "neuralsort", "ot"])
@pytest.mark.parametrize("op", ["soft_sort", "soft_rank", "soft_argsort"])
def test_all_infinite_rows_stay_on_the_graph(method, op):
    import softops

    x = torch.tensor([[math.inf, -math.inf, math.inf], [-math.inf] * 3], dtype=F64)
    x.requires_grad_(True)
    y = getattr(softops, op)(x, epsilon=0.5, method=method)
    assert y.requires_grad
    torch.where(torch.isfinite(y), y, 0.0).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=0, rtol=0)


_VMAP_ROWS = [
    [math.inf, 1.0, -math.inf, 0.5, 2.0, math.inf],
    [0.3, -1.0, 2.0, 1.0, 1.5, 0.0],
    [-math.inf] * 6,
    [1.0, math.inf, 3.0, -math.inf, -math.inf, 2.0],
    [1e6, math.inf, 1.0, 1.0, -3.0, 2.0],
]


@pytest.mark.parametrize(
    ("method", "kw"), [("softsort", {}), ("softsort", {"distance": "l2"}), ("neuralsort", {})]
)
@pytest.mark.parametrize("op", ["soft_sort", "soft_rank", "soft_argsort"])
@pytest.mark.parametrize("descending", [False, True])
def test_vmap_takes_infinities_to_the_same_limit_as_the_loop(method, kw, op, descending):
    import softops

    def f(x):
        return getattr(softops, op)(x, epsilon=0.7, method=method, descending=descending, **kw)

    def loss(x):
        y = f(x)
        return torch.where(torch.isfinite(y), y, 0.0).square().sum()

    x = torch.tensor(_VMAP_ROWS, dtype=F64)
    loop = torch.stack([f(row) for row in x])
    torch.testing.assert_close(torch.func.vmap(f)(x), loop, atol=1e-13, rtol=1e-12)
    grads = []
    for row in x:
        r = row.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(loss(r), r)[0])
    g = torch.func.vmap(torch.func.grad(loss))(x)
    torch.testing.assert_close(g, torch.stack(grads), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("method", ["softsort", "neuralsort"])
def test_vmap_keeps_nan_rows_nan(method):
    import softops

    x = torch.tensor([[1.0, math.nan, math.inf], [1.0, 2.0, math.inf]], dtype=F64)
    out = torch.func.vmap(lambda r: softops.soft_rank(r, epsilon=0.5, method=method))(x)
    assert torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1], softops.soft_rank(x[1], epsilon=0.5, method=method))


@pytest.mark.parametrize("method", ["softsort", "neuralsort"])
@pytest.mark.parametrize("op", ["soft_sort", "soft_rank", "soft_argsort"])
def test_meta_tensors_give_the_shape(op, method):
    # shape inference: no data to branch on, so the masked limit path runs
    x = torch.empty(3, 7, device="meta")
    out = getattr(softops, op)(x, method=method)
    want = (3, 7, 7) if op == "soft_argsort" else (3, 7)
    assert out.device.type == "meta" and out.shape == want


def test_limit_group_relaxes_the_finite_entries_among_themselves():
    from softops.sort._limits import limit_group

    opts = MethodOptions()
    inf = math.inf
    xg = torch.tensor([[inf, 0.3, -inf, 1.2, 0.7], [-inf, 2.0, inf, 0.1, 0.5]], dtype=torch.float64)
    eg = torch.tensor([0.4, 0.4], dtype=torch.float64)
    out = limit_group(_softsort.sort, "sort", xg, eg, False, opts, 3)
    for row, fin in zip(out, xg, strict=True):
        alone = _softsort.sort(fin[torch.isfinite(fin)][None], eg[:1], False, opts)[0]
        assert row[0] == -inf and row[-1] == inf
        torch.testing.assert_close(row[1:4], alone)
    ranks = limit_group(_softsort.rank, "rank", xg, eg, False, opts, 3)
    assert ranks[0, 0] == 5.0 and ranks[0, 2] == 1.0 and ranks[1, 0] == 1.0 and ranks[1, 2] == 5.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_infinity_kind_is_the_sign_of_the_infinities_only(dtype):
    from softops.sort._limits import infinity_kind

    t = torch.tensor([-math.inf, -1e30, -0.0, 0.0, 2.5, math.inf, math.nan], dtype=dtype)
    kind = infinity_kind(t)
    assert kind.dtype == dtype
    # finite values (huge, signed zeros) and NaN are 0: only the infinities carry a sign
    assert kind.tolist() == [-1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_limit_logits_pair_each_infinite_row_with_the_columns_of_its_own_infinity():
    from softops.sort._limits import infinity_kind, limit_logits

    cols = torch.tensor([[-math.inf, 1.0, math.inf, 3.0, math.inf]])  # (B=1, n=5)
    rows = torch.tensor([1.0, math.inf, -math.inf, 2.0])  # (b=4,)
    finite = torch.arange(20, dtype=torch.float32).view(1, 4, 5)
    out = limit_logits(infinity_kind(rows), infinity_kind(cols), finite)
    assert out.shape == (1, 4, 5)
    ninf = -math.inf
    want = torch.tensor(
        [
            [ninf, 1.0, ninf, 3.0, ninf],  # a finite row: `finite` on the finite columns
            [ninf, ninf, 0.0, ninf, 0.0],  # +inf: uniform over the +inf columns
            [0.0, ninf, ninf, ninf, ninf],  # -inf: the -inf column only
            [ninf, 16.0, ninf, 18.0, ninf],  # (`finite` row r holds 5 r .. 5 r + 4)
        ]
    )
    torch.testing.assert_close(out, want.view(1, 4, 5), rtol=0, atol=0)
    # a softmax over the columns is the limit's weights: each row sums to 1
    torch.testing.assert_close(out.softmax(-1).sum(-1), torch.ones(1, 4))
    # rows may carry the batch dim too
    out2 = limit_logits(infinity_kind(rows)[None], infinity_kind(cols), finite)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
