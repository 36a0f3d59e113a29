"""The cases run inside a spawned gloo group (see ``_harness.py``): ``CASES[name](rank, world)``.

Every rank builds the same full rows from a fixed seed, computes the single-process
``softops.soft_topk_mask`` on them (the reference), runs ``softops.distributed`` on its own
shard, and compares its slice. Each case makes all of its collective calls before it asserts.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import softops
import softops.distributed as sd

F64 = torch.float64
INF = math.inf
CASES: dict[str, Callable[[int, int], None]] = {}
WORLDS: dict[str, tuple[int, ...]] = {}
GROUP: dist.ProcessGroup | None = None
"""The group the cases run in (set by the harness): None, the default group of all the spawned
processes, or a subgroup of the first ones."""


def mask(*args, **kwargs):
    return sd.soft_topk_mask(*args, group=GROUP, **kwargs)


def threshold(*args, **kwargs):
    return sd.topk_threshold(*args, group=GROUP, **kwargs)


def topk(*args, **kwargs):
    return sd.topk(*args, group=GROUP, **kwargs)


def case(*worlds: int) -> Callable:
    """Register a case for the given world sizes (default 2 and 4)."""

    def register(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
        CASES[fn.__name__] = fn
        WORLDS[fn.__name__] = worlds or (2, 4)
        return fn

    return register


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sizes_for(n: int, world: int, kind: str) -> list[int]:
    """Shard lengths summing to n: "even", "uneven" (1 : 2 : 3 : ...), "empty" (every other
    rank empty, the first one included)."""
    if kind == "even":
        return [n // world + (r < n % world) for r in range(world)]
    if kind == "uneven":
        w = [r + 1 for r in range(world)]
        sizes = [n * v // sum(w) for v in w]
        sizes[-1] += n - sum(sizes)
        return sizes
    live = [r for r in range(world) if r % 2 == 1]
    sizes = [0] * world
    for i, r in enumerate(live):
        sizes[r] = n // len(live) + (i < n % len(live))
    return sizes


def shard(t: torch.Tensor, sizes: list[int], rank: int, dim: int = -1) -> torch.Tensor:
    return torch.split(t, sizes, dim)[rank]


def close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    torch.testing.assert_close(
        a, b, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )


class Run:
    """The reference and the sharded result of one call, with gradients in x, k and epsilon.

    The mask and its gradients are compared with the single-process op on the concatenated
    rows (whose own gradients in k and epsilon are checked against an exact-root reference in
    tests/topk/test_ot_extremes.py).
    """

    def __init__(
        self,
        rank: int,
        x: torch.Tensor,
        k: float | torch.Tensor,
        sizes: list[int],
        *,
        epsilon: float | torch.Tensor = 0.1,
        dim: int = -1,
        grads: str = "xke",
        seed: int = 1,
        **kw,
    ) -> None:
        self.rank, self.sizes, self.dim = rank, sizes, dim
        kt = torch.as_tensor(k, dtype=F64).clone() if "k" in grads else k
        et = torch.as_tensor(epsilon, dtype=F64).clone() if "e" in grads else epsilon
        xr = x.clone().requires_grad_("x" in grads)
        if isinstance(kt, torch.Tensor) and "k" in grads:
            kt.requires_grad_()
        if isinstance(et, torch.Tensor) and "e" in grads:
            et.requires_grad_()
        A = softops.soft_topk_mask(xr, kt, epsilon=et, dim=dim, **kw)
        leaves = [("x", xr), ("k", kt), ("e", et)]
        wrt = [(n, t) for n, t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        g = torch.randn(A.shape, generator=gen(seed), dtype=F64).to(x.dtype)
        self.ref = A.detach()
        grads_ref = torch.autograd.grad(A, [t for _, t in wrt], g) if wrt else ()
        self.ref_grads = dict(zip([n for n, _ in wrt], grads_ref, strict=True))
        # the sharded call, on copies of the same leaves
        xl = shard(x, sizes, rank, dim).clone().requires_grad_("x" in grads)
        kl = (
            kt.detach().clone().requires_grad_(kt.requires_grad)
            if isinstance(kt, torch.Tensor)
            else kt
        )
        el = (
            et.detach().clone().requires_grad_(et.requires_grad)
            if isinstance(et, torch.Tensor)
            else et
        )
        out = mask(xl, kl, epsilon=el, dim=dim, **kw)
        mine = [
            (n, t)
            for n, t in (("x", xl), ("k", kl), ("e", el))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        self.out = out.detach()
        got = (
            torch.autograd.grad(out, [t for _, t in mine], shard(g, sizes, rank, dim))
            if mine
            else ()
        )
        self.grads = dict(zip([n for n, _ in mine], got, strict=True))

    def check(self, tol: float = 1e-8, what: str = "", skip: str = "") -> None:
        close(self.out, shard(self.ref, self.sizes, self.rank, self.dim), tol, f"{what} mask")
        for name, got in self.grads.items():
            if name in skip:
                continue
            want = self.ref_grads[name]
            if name == "x":
                want = shard(want, self.sizes, self.rank, self.dim)
            close(got, want, tol, f"{what} grad {name}")


def rows(B: int, n: int, seed: int = 0, dtype=F64) -> torch.Tensor:
    return torch.randn(B, n, generator=gen(seed), dtype=F64).to(dtype)


# ----------------------------------------------------------------------- forward and backward


@case()
def uneven_shards_match_the_single_process_op(rank: int, world: int) -> None:
    runs = []
    for kind in ("even", "uneven", "empty"):
        for method in ("ot", "sparse"):
            for k, eps in ((3, 0.1), (10, 1e-3), (7.5, 1.0), (1, 0.5)):
                x = rows(3, 23, seed=len(runs))
                sizes = sizes_for(23, world, kind)
                runs.append(
                    (
                        f"{kind} {method} k={k} eps={eps}",
                        Run(rank, x, k, sizes, epsilon=eps, method=method),
                    )
                )
    for what, r in runs:
        r.check(what=what)


@case()
def plain_backward_in_x_matches(rank: int, world: int) -> None:
    runs = []
    for method in ("ot", "sparse"):
        x = rows(4, 31, seed=5)
        runs.append(
            Run(rank, x, 6, sizes_for(31, world, "uneven"), epsilon=0.2, grads="x", method=method)
        )
    for r in runs:
        r.check(what="x only")


@case()
def a_shard_holding_none_of_the_topk(rank: int, world: int) -> None:
    n = 20
    sizes = sizes_for(n, world, "even")
    x = rows(2, n, seed=3)
    # rank 0's entries are far below every other: none of the top 4 is there
    x[:, : sizes[0]] -= 100
    runs = [
        Run(rank, x, 4, sizes, epsilon=eps, method=m)
        for eps in (0.05, 1.0)
        for m in ("ot", "sparse")
    ]
    for r in runs:
        r.check()
    assert runs[0].ref[:, : sizes[0]].max() < 1e-100


@case()
def k_at_zero_and_n_and_real_k(rank: int, world: int) -> None:
    n = 17
    sizes = sizes_for(n, world, "uneven")
    x = rows(3, n, seed=4)
    runs = [
        (f"k={k} {m}", Run(rank, x, k, sizes, epsilon=0.3, method=m))
        for k in (0, n, 0.25, 2.5, n - 0.5, 16.999)
        for m in ("ot", "sparse")
    ]
    for what, r in runs:
        r.check(what=what)
    assert (runs[0][1].out == 0).all() and (runs[2][1].out == 1).all()


@case()
def per_row_k_matches(rank: int, world: int) -> None:
    n = 19
    sizes = sizes_for(n, world, "uneven")
    x = rows(4, n, seed=6)
    k = torch.tensor([0.0, 3.0, 7.5, 19.0], dtype=F64)
    runs = [Run(rank, x, k, sizes, epsilon=0.2, method=m) for m in ("ot", "sparse")]
    for r in runs:
        r.check()


@case()
def nan_in_one_row_is_nan_in_that_row_only_on_every_rank(rank: int, world: int) -> None:
    n = 16
    sizes = sizes_for(n, world, "even")
    x = rows(3, n, seed=7)
    x[1, n - 1] = math.nan  # on the last rank only
    runs = [Run(rank, x, 5, sizes, epsilon=0.2, method=m) for m in ("ot", "sparse")]
    for r in runs:
        r.check()
        assert r.out[1].isnan().all(), r.out
        assert not r.out[[0, 2]].isnan().any()
        gx = r.grads["x"]
        assert gx[1].isnan().all() and not gx[[0, 2]].isnan().any()


@case()
def infinities_behave_as_in_the_single_process_op(rank: int, world: int) -> None:
    n = 12
    sizes = sizes_for(n, world, "uneven")
    x = rows(6, n, seed=8)
    x[0, [0, n - 1]] = INF  # +inf on the first and last rank: always selected
    x[1, 1:9] = -INF  # never selected; k = 4 still reachable
    x[2, :] = -INF
    x[2, [2, n - 2]] = 1.0  # k = 4 unreachable: NaN
    x[3, :5] = INF  # more +inf than k: NaN
    x[4, :4] = INF  # exactly k +inf entries: they alone
    x[5, 4:] = -INF  # exactly k entries above -inf: all of them
    runs = [Run(rank, x, 4, sizes, epsilon=0.5, method=m) for m in ("ot", "sparse")]
    runs += [Run(rank, x, 4, sizes, epsilon=1e-3, method="ot")]
    for r in runs:
        r.check()
        assert r.out[2].isnan().all() and r.out[3].isnan().all()
        assert not r.out[[0, 1, 4, 5]].isnan().any()


@case()
def float32_matches(rank: int, world: int) -> None:
    n = 40
    sizes = sizes_for(n, world, "uneven")
    x = rows(3, n, seed=9, dtype=torch.float32)
    runs = [
        Run(rank, x, k, sizes, epsilon=eps, method=m)
        for k, eps in ((5, 0.1), (20, 1e-3), (2.5, 2.0))
        for m in ("ot", "sparse")
    ]
    for r in runs:
        r.check(tol=2e-4)
        assert r.out.dtype == torch.float32
    half = Run(rank, x.half(), 5, sizes, epsilon=0.5, grads="")
    half.check(tol=2e-3)
    assert half.out.dtype == torch.float16


@case()
def other_dims_and_smallest(rank: int, world: int) -> None:
    n = 13
    sizes = sizes_for(n, world, "uneven")
    x = torch.randn(n, 2, 3, generator=gen(10), dtype=F64)
    runs = [
        Run(rank, x, 4, sizes, dim=0, largest=largest, epsilon=0.2) for largest in (True, False)
    ]
    runs.append(
        Run(
            rank,
            x.transpose(0, 1).contiguous(),
            4,
            sizes,
            dim=-2,
            largest=False,
            epsilon=0.2,
            method="sparse",
        )
    )
    for r in runs:
        r.check()


@case()
def long_rows_take_the_sampled_start_and_still_match(rank: int, world: int) -> None:
    # n = 3000 with k = 1500 (over the budget of exact candidates: the strided subsample) and k = 10
    # (exact candidates); the single-process op brackets exactly at this n
    n = 3000
    sizes = sizes_for(n, world, "uneven")
    x = rows(2, n, seed=11)
    x[1] = x[1] ** 3  # a skewed row
    runs = [
        (f"k={k} eps={eps} {m}", Run(rank, x, k, sizes, epsilon=eps, method=m))
        for k, eps in ((1500, 1e-3), (1500, 0.5), (10, 1e-2), (2999, 0.1))
        for m in ("ot", "sparse")
    ]
    for what, r in runs:
        r.check(what=what)


@case()
def extreme_epsilons_and_magnitudes(rank: int, world: int) -> None:
    n = 10
    sizes = sizes_for(n, world, "uneven")
    x = rows(2, n, seed=12)
    big = x.clone()
    big[0] *= 1e300
    runs = [
        ("eps 1e300", Run(rank, x, 3, sizes, epsilon=1e300)),
        ("rows near max", Run(rank, big, 3, sizes, epsilon=1e299)),
        ("hard limit", Run(rank, x, 3, sizes, epsilon=1e-30)),
        ("near hard", Run(rank, x, 3, sizes, epsilon=2e-3)),
        ("tiny eps sparse", Run(rank, x, 3, sizes, epsilon=1e-30, method="sparse")),
    ]
    for what, r in runs:
        # where every |z| overflows too: the weights in k are the exact root's in both
        r.check(what=what)
    # ... the exact root's: half the upstream gradient at each of the k-th and (k+1)-th entries
    # (their u are equal at the root, and every other entry's is 0 beside them)
    hard = runs[2][1]
    xs = x.sort(-1, descending=True)
    g = torch.randn(x.shape, generator=gen(1), dtype=F64)
    g_k, g_k1 = g.gather(-1, xs.indices[:, 2:3]), g.gather(-1, xs.indices[:, 3:4])
    gk = float(hard.grads["k"])
    assert abs(gk - float((0.5 * g_k + 0.5 * g_k1).sum())) <= 1e-12, gk


@case()
def threshold_follows_the_single_process_contract(rank: int, world: int) -> None:
    """softops.solvers.topk_threshold's contract at the limits, on rows whose infinities and NaN
    lie on different ranks: +inf at k -> 0, -inf at k -> n (swapped with largest=False), 0 on
    rows without a finite entry, NaN where k cannot be met; converged and residual as there;
    the other rows' thresholds equal the single-process ones."""
    inf, nan = math.inf, math.nan
    n = 7
    runs = []
    for dtype in (torch.float32, F64):
        for largest in (True, False):
            sign = 1.0 if largest else -1.0  # the first infinity (always selected)
            base = rows(10, n, seed=30)
            base[2, 1] = base[3, 0] = base[4, 5] = sign * inf
            base[3, 6] = -sign * inf
            base[5] = torch.tensor([inf, -inf, inf, -inf, -inf, inf, inf]) * sign
            base[6, 4] = nan
            base[7, :3] = sign * inf
            base[9, 6] = -sign * inf
            # 0 tiny k (0 in float32), 1 k just below n (n in float32), 2 k = #first-infinity,
            # 3 the same with the other infinity, 4 k = n - #other (none), 5 no finite entry, 6
            # NaN, 7 k below #first-infinity, 8 ordinary, 9 k = n - #other-infinity
            tiny = 1.2960526166650304e-67 if dtype == torch.float32 else 0.0
            k = torch.tensor([tiny, n - 1e-9, 1, 1, 7, 4, 2, 2, 2.5, 6], dtype=F64).to(dtype)
            x = base.to(dtype)
            for kind in ("uneven", "empty"):
                sizes = sizes_for(n, world, kind)
                got = threshold(shard(x, sizes, rank), k, 0.3, largest=largest)
                want = softops.solvers.topk_threshold(x, k, 0.3, largest=largest)
                runs.append((f"{dtype} largest={largest} {kind}", got, want))
    # the same on a batch of rows along dim 0 (the transposed layout) and a scalar k at n
    x = rows(4, n, seed=31)
    sizes = sizes_for(n, world, "even")  # (an empty shard along dim 0 fails in flatten_to_2d)
    got_t = threshold(shard(x.T, sizes, rank, 0), n, 0.2, dim=0)
    runs.append(("k = n", got_t, softops.solvers.topk_threshold(x.T, n, 0.2, dim=0)))
    got_0 = threshold(shard(x, sizes, rank), 0, 0.2, largest=False)
    runs.append(("k = 0", got_0, softops.solvers.topk_threshold(x, 0, 0.2, largest=False)))
    for what, got, want in runs:
        limits = ~torch.isfinite(want.threshold) | (want.threshold == 0)
        assert got.threshold.dtype == want.threshold.dtype, what
        assert torch.equal(got.threshold[limits].isnan(), want.threshold[limits].isnan()), what
        keep = limits & ~want.threshold.isnan()
        assert torch.equal(got.threshold[keep], want.threshold[keep]), (what, got, want)
        tol = 1e-5 if got.threshold.dtype == torch.float32 else 1e-10
        close(got.threshold[~limits], want.threshold[~limits], tol, what)
        assert torch.equal(got.converged, want.converged), (what, got, want)
        nan_rows = want.residual.isnan()
        assert torch.equal(got.residual.isnan(), nan_rows), (what, got, want)
        assert bool((got.residual[limits & ~nan_rows] == 0).all()), (what, got)
    # the contract's rows, by name (largest=True, uneven shards; k = n - 1e-9 is n in float32)
    for index, dtype in ((0, torch.float32), (4, F64)):
        t = runs[index][1].threshold
        assert t[0] == inf and t[2] == inf and t[3] == inf and t[4] == -inf, t
        assert t[5] == 0 and t[6] != t[6] and t[7] != t[7] and t[9] == -inf, t
        assert math.isfinite(t[8]) and (t[1] == -inf) == (dtype == torch.float32), t


@case()
def hard_is_the_exact_topk_with_ties_by_global_position(rank: int, world: int) -> None:
    n = 14
    sizes = sizes_for(n, world, "uneven")
    x = rows(3, n, seed=13)
    r1 = Run(rank, x, 5, sizes, epsilon=0.3, hard=True, grads="xe")
    ties = torch.tensor(
        [[1.0, 2.0, 2.0, 0.0, 2.0, 2.0, 3.0, 2.0, 2.0, 1.0, 2.0, 0.0, 2.0, 2.0]] * 2, dtype=F64
    )
    ties[1] = 0.0  # every entry tied
    got = {}
    for k in (0, 1, 3, 6, 14):
        got[k] = mask(shard(ties, sizes, rank), k, hard=True)
    k_row = torch.tensor([2.0, 9.0], dtype=F64)
    got["rows"] = mask(shard(ties, sizes, rank), k_row, hard=True)
    long = rows(1, 3000, seed=14)  # sampled start: the hard candidates ride along
    long_sizes = sizes_for(3000, world, "uneven")
    long_out = mask(shard(long, long_sizes, rank), 1600, hard=True)
    r1.check()

    def stable(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        order = v.argsort(dim=-1, descending=True, stable=True)
        rank_of = torch.empty_like(order).scatter_(
            -1, order, torch.arange(v.shape[-1]).expand_as(order)
        )
        return (rank_of < k[:, None]).to(v.dtype)

    for k in (0, 1, 3, 6, 14):
        want = stable(ties, torch.full((2,), float(k)))
        close(got[k], shard(want, sizes, rank), 0, f"ties k={k}")
    close(got["rows"], shard(stable(ties, k_row), sizes, rank), 0, "ties per-row k")
    close(long_out, shard(stable(long, torch.tensor([1600.0])), long_sizes, rank), 0, "long")


@case()
def topk_helper_returns_the_global_topk_and_owners(rank: int, world: int) -> None:
    n = 15
    sizes = sizes_for(n, world, "empty")
    x = rows(3, n, seed=15)
    x[2, 3] = math.nan
    starts = [sum(sizes[:r]) for r in range(world)]
    xl = shard(x, sizes, rank).clone().requires_grad_()
    res = topk(xl, 4)
    smallest = topk(shard(x, sizes, rank), 3, largest=False)
    ties = torch.zeros(1, n, dtype=F64)
    tied = topk(shard(ties, sizes, rank), 5)
    (gx,) = torch.autograd.grad(res.values.sum(), xl)
    want = x.topk(4)
    close(res.values, want.values, 0, "values")
    assert torch.equal(res.indices, want.indices), (res.indices, want.indices)
    owner = torch.tensor(
        [
            [
                next(r for r in range(world) if starts[r] <= int(i) < starts[r] + sizes[r])
                for i in row
            ]
            for row in want.indices
        ]
    )
    assert torch.equal(res.ranks, owner)
    assert torch.equal(res.local_indices, want.indices - torch.tensor(starts)[owner])
    close(smallest.values, x.topk(3, largest=False).values, 0, "smallest")
    assert torch.equal(smallest.indices, x.topk(3, largest=False).indices)
    assert tied.indices.tolist() == [[0, 1, 2, 3, 4]]
    # the gradient of sum(values) reaches each selected entry on the rank that holds it
    mine = torch.zeros_like(x).scatter(-1, want.indices, 1.0)
    close(gx, shard(mine, sizes, rank), 0, "routed gradient")


# ---------------------------------------------------------------------- collectives, errors


class Counter:
    """Counts ``torch.distributed.all_reduce`` calls (the only collective the module makes),
    with their shapes."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __enter__(self) -> Counter:
        self.original = dist.all_reduce

        def counting(t, *args, **kwargs):
            self.shapes.append(tuple(t.shape))
            return self.original(t, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.original


@case()
def collectives_are_counted_and_bounded(rank: int, world: int) -> None:
    B, n = 3, 40
    sizes = sizes_for(n, world, "uneven")
    counts = {}
    for label, k, eps in (("exact", 5, 0.1), ("tiny eps", 5, 1e-4), ("sampled", 30, 0.1)):
        x = rows(B, n, seed=16)
        xl = shard(x, sizes, rank).clone().requires_grad_()
        res = threshold(xl.detach(), k, eps)
        with Counter() as fwd:
            A = mask(xl, k, epsilon=eps)
        with Counter() as bwd:
            A.backward(torch.ones_like(A))
        kt = torch.tensor(float(k), dtype=F64, requires_grad=True)
        A2 = mask(xl.detach(), kt, epsilon=eps)
        with Counter() as bwd_k:
            A2.sum().backward()
        with Counter() as hard:
            mask(xl.detach(), k, epsilon=eps, hard=True)
        with Counter() as capped:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mask(xl.detach(), k, epsilon=eps, max_iter=1)
        with Counter() as sparse:
            a = mask(xl, k, epsilon=eps, method="sparse")
        with Counter() as sparse_bwd:
            a.sum().backward()
        counts[label] = (
            res.iterations,
            fwd.shapes,
            bwd.shapes,
            bwd_k.shapes,
            hard.shapes,
            capped.shapes,
            sparse.shapes,
            sparse_bwd.shapes,
        )
    with Counter() as top:
        topk(shard(rows(B, n), sizes, rank), 4)
    for label, (it, f, b, bk, h, c, s, sb) in counts.items():
        assert 1 <= it <= 8, (label, it)
        # the header, the start, one per evaluation, and (near-hard rows only) the polish
        polish = len(f) - 2 - it
        assert f[0] == (world, 18) and f[2 : 2 + it] == [(5, B)] * it, (label, f)
        assert f[1][:2] == (world, B), (label, f)
        assert f[2 + it :] == [(world, 6, B)] * polish, (label, f)
        assert polish == (1 if label == "tiny eps" else 0), (label, f)
        assert b == [(2, B)], (label, b)
        assert bk == [(world, 9, B)], (label, bk)
        # no extra collective for hard=True (on the sampled path its candidates ride along)
        assert len(h) == len(f) and h[0] == f[0] and h[2:] == f[2:], (label, h, f)
        assert c[:3] == [*f[:2], (5, B)] and c[3:] == [(world, 6, B)] * (len(c) - 3), (label, c)
        # "sparse": one per evaluation (its five sums and that of y over the free entries, for
        # the closed-form step), then the two of its closed-form polish
        polished = [(6, B)] * (len(s) - 4) + [(4, B), (1, B)]
        assert 5 <= len(s) <= 4 + 13 and s[2:] == polished, (label, s)
        assert sb == [(3, B)], (label, sb)
    assert len(top.shapes) == 2


@case()
def errors_are_raised_on_every_rank_with_their_messages(rank: int, world: int) -> None:
    n = 8
    sizes = sizes_for(n, world, "even")
    x = rows(2, n, seed=17)
    xl = shard(x, sizes, rank)
    op = "distributed.soft_topk_mask"
    raised = {}

    def attempt(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            raised[name] = None
        except (TypeError, ValueError) as err:
            raised[name] = (type(err), str(err))

    attempt("k > n", lambda: mask(xl, n + 1))
    attempt("k tensor > n", lambda: mask(xl, torch.tensor([1.0, n + 2.0], dtype=F64)))
    attempt("k differs", lambda: mask(xl, 2 + rank))
    attempt("eps differs", lambda: mask(xl, 2, epsilon=0.1 * (rank + 1)))
    attempt("rows differ", lambda: mask(shard(rows(2 + rank, n), sizes, rank), 2))
    attempt("options differ", lambda: mask(xl, 2, largest=rank == 0))
    attempt("bad on one rank", lambda: mask(xl, 2, epsilon=-1.0 if rank == 1 else 0.1))
    attempt("not a tensor on one rank", lambda: mask(xl if rank else [1.0], 2))
    attempt("empty everywhere", lambda: mask(xl[:, :0], 0))
    attempt("method", lambda: mask(xl, 2, method="sinkhorn"))
    attempt("hard real k", lambda: mask(xl, 2.5, hard=True))
    attempt("tol sparse", lambda: mask(xl, 2, method="sparse", tol=1e-3))
    attempt("k type", lambda: mask(xl, "2"))
    attempt("int x", lambda: mask(xl.long(), 2))
    attempt("group type", lambda: sd.soft_topk_mask(xl, 2, group="world"))
    attempt("topk k", lambda: topk(xl, n + 1))
    after = mask(xl, 2)  # the group is still in step
    span = f"the length of `dim` summed over the {world} ranks of the group"
    rng = f"{op}: expected 0 <= `k` <= n (= {n}, {span}); got k="
    same = "on every rank of the group (the shards of one batch of rows); got"
    want = {
        "k > n": (ValueError, f"{rng}{n + 1}."),
        "k tensor > n": (ValueError, f"{rng}{n + 2}."),
        "k differs": (
            ValueError,
            f"{op}: expected the same k (its largest value) {same} 2 on rank 0 and 3 on rank 1.",
        ),
        "eps differs": (
            ValueError,
            f"{op}: expected the same epsilon (its largest value) {same} 0.1 on rank 0 and 0.2 "
            "on rank 1.",
        ),
        "rows differ": (
            ValueError,
            f"{op}: expected the same number of rows (the batch size) {same} 2 on rank 0 and 3 "
            "on rank 1.",
        ),
        "options differ": (
            ValueError,
            f"{op}: expected the same largest {same} 1 on rank 0 and 0 on rank 1.",
        ),
        "empty everywhere": (
            ValueError,
            f"{op}: expected a non-empty `dim` over the group; got x_local.shape[dim] = 0 on "
            f"every one of the {world} ranks.",
        ),
        "method": (
            ValueError,
            f"{op}: expected `method` to be one of ('ot', 'sparse'); got method='sinkhorn'.",
        ),
        "hard real k": (ValueError, f"{op}: hard=True needs an integer k; got k=2.5."),
        "tol sparse": (
            ValueError,
            f"{op}: expected `tol` to be left at its default None (method='sparse' does not use "
            "it); got tol=0.001.",
        ),
        "k type": (TypeError, f"{op}: expected `k` to be a number; got '2'."),
        "int x": (
            TypeError,
            f"{op}: expected `x_local` to have a real floating dtype (float16, bfloat16, float32 "
            "or float64); got dtype=torch.int64.",
        ),
        "group type": (
            TypeError,
            f"{op}: expected `group` to be a torch.distributed ProcessGroup or None; got 'world'.",
        ),
        "topk k": (ValueError, rng.replace(op, "distributed.topk") + f"{n + 1}."),
    }
    for name, expected in want.items():
        assert raised[name] == expected, (name, raised[name], expected)
    if rank == 1:
        assert raised["bad on one rank"] == (
            ValueError,
            f"{op}: expected `epsilon` > 0 and finite; got epsilon=-1.0.",
        ), raised
    else:
        assert raised["bad on one rank"] == (
            ValueError,
            f"{op}: expected valid arguments on every rank of the group; got invalid ones on "
            "rank(s) [1] (the error is raised there).",
        ), raised
    if rank == 0:
        assert raised["not a tensor on one rank"] == (
            TypeError,
            f"{op}: expected `x_local` to be a torch.Tensor; got list.",
        ), raised
    else:
        assert raised["not a tensor on one rank"][1].endswith(
            "got invalid ones on rank(s) [0] (the error is raised there)."
        ), raised
    assert after.shape == xl.shape


@case()
def non_convergence_warns_on_every_rank(rank: int, world: int) -> None:
    n = 30
    sizes = sizes_for(n, world, "uneven")
    x = rows(2, n, seed=18)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mask(shard(x, sizes, rank), 7.3, epsilon=0.5, max_iter=1)
    messages = [str(w.message) for w in caught]
    assert any(
        "distributed.soft_topk_mask: 2 of 2 rows did not converge within max_iter=1" in m
        for m in messages
    ), messages


# ------------------------------------------------------------------------ gradcheck and DDP


class _Scatter(torch.autograd.Function):
    """The full row, replicated on every rank -> this rank's shard; backward: the all-reduce of
    the zero-padded shard gradients (every rank then holds the full gradient)."""

    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.lo, ctx.hi, ctx.n = lo, hi, x.shape[-1]
        return x[..., lo:hi].clone()

    @staticmethod
    def backward(ctx, g):
        full = g.new_zeros((*g.shape[:-1], ctx.n))
        full[..., ctx.lo : ctx.hi] = g
        dist.all_reduce(full, group=GROUP)
        return full, None, None


class _Gather(torch.autograd.Function):
    """This rank's part -> the full mask on every rank; backward: this rank's part of the
    gradient (every rank computes the same loss of the full mask)."""

    @staticmethod
    def forward(ctx, part, lo, hi, n):
        ctx.lo, ctx.hi = lo, hi
        full = part.new_zeros((*part.shape[:-1], n))
        full[..., lo:hi] = part
        dist.all_reduce(full, group=GROUP)
        return full

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.lo : ctx.hi], None, None, None


@case(2)
def gradcheck_in_the_group(rank: int, world: int) -> None:
    """float64 gradcheck of the sharded op as a replicated function of the full row, k and
    epsilon: every rank perturbs the same entries, so the collectives stay in step."""
    n = 7
    sizes = sizes_for(n, world, "uneven")
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    x = rows(2, n, seed=19).requires_grad_()
    k = torch.tensor(2.5, dtype=F64, requires_grad=True)
    eps = torch.tensor([0.3, 0.7], dtype=F64, requires_grad=True)
    results = []
    for method, kw in (("ot", {}), ("ot", {"hard": False}), ("sparse", {})):

        def f(x, k, eps, method=method, kw=kw):
            part = mask(_Scatter.apply(x, lo, hi), k, epsilon=eps, method=method, **kw)
            return _Gather.apply(part, lo, hi, n)

        results.append(torch.autograd.gradcheck(f, (x, k, eps), raise_exception=False))
    # the hard limit: saturated rows, gradient in k only
    xt = (rows(1, n, seed=20) * 10).requires_grad_(False)
    k1 = torch.tensor(3.0, dtype=F64, requires_grad=True)

    def g(k):
        return _Gather.apply(mask(_Scatter.apply(xt, lo, hi), k, epsilon=1e-3), lo, hi, n)

    results.append(torch.autograd.gradcheck(g, (k1,), raise_exception=False))
    assert all(results), results


@case(2)
def ddp_gives_the_single_process_gradients(rank: int, world: int) -> None:
    """A scorer trained through the sharded mask under DistributedDataParallel: each rank scores
    its shard of the items; DDP averages, so each rank's loss is its part times the world size."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    B, n, d, k = 4, 21, 5, 6
    sizes = sizes_for(n, world, "uneven")
    feats = torch.randn(B, n, d, generator=gen(21), dtype=F64)
    value = torch.randn(B, n, generator=gen(22), dtype=F64)
    torch.manual_seed(3)
    single = torch.nn.Linear(d, 1).double()
    model = torch.nn.Linear(d, 1).double()
    model.load_state_dict(single.state_dict())
    ddp = DDP(model, process_group=GROUP)
    opt_s = torch.optim.SGD(single.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for _ in range(3):
        full_mask = softops.soft_topk_mask(single(feats).squeeze(-1), k, epsilon=0.3)
        loss = -(full_mask * value).sum() / B
        opt_s.zero_grad()
        loss.backward()
        part = mask(ddp(shard(feats, sizes, rank, 1)).squeeze(-1), k, epsilon=0.3)
        local = -(part * shard(value, sizes, rank)).sum() / B
        opt_d.zero_grad()
        (local * world).backward()
        grads.append(
            [
                (p.grad.clone(), q.grad.clone())
                for p, q in zip(single.parameters(), model.parameters(), strict=True)
            ]
        )
        opt_s.step()
        opt_d.step()
    for step in grads:
        for want, got in step:
            close(got, want, 1e-10, "DDP gradient")
    for p, q in zip(single.parameters(), model.parameters(), strict=True):
        close(q.detach(), p.detach(), 1e-10, "parameters after 3 steps")
