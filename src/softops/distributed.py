r"""Sharded soft top-k over ``torch.distributed``: rows split along ``dim`` across the ranks.

Each rank holds a shard ``x_r`` of every row (shards of any length, empty ones included); the
row is their concatenation in rank order, :math:`x = (x_0, \dots, x_{P-1})`, of length
:math:`n = \sum_r n_r`. The SOFT top-k mask of the row is a sigmoid with one threshold per row
(``softops.soft_topk_mask``, method "ot"; docs/math.md §1),

.. math::

    A_i = \sigma\big((x_i - t)/\varepsilon\big), \qquad
    F(t) = \sum_r \sum_{i \in r} \sigma\big((x_i - t)/\varepsilon\big) - k = 0,

so the only thing the ranks must agree on is t, a scalar per row. Every quantity the solver
needs is a sum over the row, hence a sum over ranks of a sum over each shard, and the sharded
op *is* the single-process solver with another reduction: the evaluations of
``softops.topk._ot`` (and of ``softops.topk._sparse``, method "sparse", :math:`a_i =
\mathrm{clip}((x_i - t)/\varepsilon, 0, 1)`, the capped-simplex projection) take their row
sums through a reduction (``softops.topk._ot.Reduce``), the identity in one process and here
one all-reduce of the stack of per-row shard sums, and their preparation takes the rows'
statistics and order statistics, which here come from one all-gather. No rank ever sees
another rank's entries. This module keeps no copy of the evaluation, the fill rules or the
constants; it holds the communication, the sharded candidates of the start, the sharded
backward and the sharded hard top-k.

Collectives per call (B rows, P ranks; "all-reduce" below is ``torch.distributed.all_reduce``
with SUM, the one collective this module calls, so every backend runs it on every device):

* one all-reduce of a fixed 18-float header per rank (the shard lengths, which give n and each
  rank's offset, and the options and batch shape, which every rank checks against every other
  rank's, so that inconsistent calls raise the same error everywhere instead of hanging);
* one all-gather, as an all-reduce of zero-padded per-rank slots, of the per-row shard
  statistics (counts of finite, ``+inf`` and NaN entries, finite min, max and sum) with
  candidates for the start: each rank's ``floor(k) + 1`` largest entries where the whole group
  sends at most ``max(SAMPLE_SIZE, n // EXACT_SHARE)`` of them per row and they are under half
  the row (the bracket is then the single-process op's exact one: 2 to 4 evaluations), and
  else each rank's part of a global strided subsample of about ``SAMPLE_SIZE`` entries per
  row, whose quantile centres the row (3 to 7 evaluations, as the single-process op's long
  rows, whose start it is);
* one all-reduce of (5, B) per evaluation ("ot": 2 to 6 typical, ``max_iter`` at most; its
  residual, slope, curvature and tolerance are formed from the all-reduced sums, in float64);
  "sparse": one of (6, B) per evaluation, then two, of (4, B) and (1, B), for its closed-form
  polish;
* "ot" only, and only where a row is near the hard limit (``softops.topk._ot.polish``): one or
  two all-gathers of (6, B) per rank for the log-domain polish of its threshold;
* backward: one all-reduce of (2, B), ``[sum_i s_i, <s, g>]`` ("sparse": (3, B), ``[|S|,
  sum_S g, #NaN]``); with gradients in k or epsilon instead one all-gather of (9, B) or (13,
  B) per rank (log-domain partial sums of each side of t, below; "sparse": an all-reduce of
  (5, B)).

So a forward costs ``2 + iterations`` collectives of O(B) ("sparse": ``4 + iterations``; the
second O(B SAMPLE_SIZE / P) per rank), whatever n is, and a backward one. Ranks take the same
steps: the iterate, the bracket and the stop test are functions of all-reduced sums only,
which every rank receives bit for bit, and the host test of "all rows done" is made on those
(ranks of one kind of device compute them identically). The iteration is capped, so a call
always returns. The result equals the single-process op's up to the order of the reductions
(and the start, where the candidates are the subsample): to rounding. In a world of one the
reduction is the identity.

The numerics are those of ``softops.topk._ot`` (docs/math.md §1.3): the row is centred on an
estimate ``m`` of the threshold, the bracket is exact where the candidates are (``[min x, max
x] - eps logit(k / n)`` over the finite entries on the sampled path), the residual is formed
without cancellation (the count of ``z > 0`` less k first; all-reduced sums are float64), the
steps are Halley's, Newton's, regula falsi or bisection (:mod:`softops._core.rootfind`), rows
near the hard limit are polished in the log domain (each rank sums its side terms shifted by
its own nearest distance, and one all-gather per step combines them), infinities need no
special case (rows holding a NaN on any rank, or whose k the finite entries cannot meet, come
out NaN on every rank, their row only; rows that select exactly their ``+inf`` entries, or all
their non ``-inf`` ones, are filled), and rows whose epsilon is within ``2**SCALE_BITS`` of
``finfo.max`` are solved on ``(x c, eps c)`` for a power of two c computed from the
all-gathered span.

Backward (implicit function theorem, as ``_SoftTopKMaskOT``; ``s = A (1 - A)/eps``):

.. math::

    \bar x = s \odot \Big(\bar A - \frac{\langle s, \bar A\rangle}{\sum_i s_i}\Big), \quad
    \bar k = \langle w, \bar A\rangle, \quad
    \bar\varepsilon = -\sum_i \bar A_i s_i \big(z_i - \langle w, z\rangle\big),
    \quad w = s / \textstyle\sum_i s_i .

The two row sums are global (one all-reduce of (2, B)); everything else is local. For k and
epsilon the weights w are normalised in the log domain so that a row whose every ``s`` underflows
(the hard limit) still gets the limit's weights: each rank shifts its log-weights by its own
smallest ``|x - t|`` (taken off before dividing by epsilon), and the ranks' partial sums are
combined with the factors ``exp(-(near_r - near)/eps)``, which needs every rank's shift: the
partial sums are all-gathered (one collective) instead of all-reduced.

**Gradient semantics.** The backward returns, on each rank, the gradient of the *sum over ranks*
of the losses computed from the shards, ``L = sum_r L_r(A_r)`` (each rank's upstream gradient
enters the global ``<s, g>``): for ``x_local`` it is this rank's slice of the single-process
gradient of L; for k and epsilon, which every rank holds, it is the full single-process
gradient, on every rank. Parameters that feed ``x_local`` through a replicated model (a query
encoder) receive on each rank the part of the gradient that flows through its shard: sum them
over ranks (``all_reduce``), or use ``DistributedDataParallel`` with the loss multiplied by the
world size (DDP averages).

``hard=True`` (straight-through) returns the exact hard top-k mask of the concatenated row. Ties
at the k-th value are broken by the global position in the concatenated row, lower first
(rank order, then the local index): the entries strictly above the k-th largest value v are
selected, and of the entries equal to v the first ``k - #{x > v}`` in global order. It costs no
extra collective when the candidates are exact, and the all-gather of k candidates per rank
(appended to the start's) otherwise: v and each rank's ties come from the candidates (a rank
that shows fewer ties than it holds shows at least as many as are needed).

Without a process group: with ``group=None`` and torch.distributed not initialised, the op runs
as a world of one (no collective) unless the environment says the process was launched as one of
several (``WORLD_SIZE`` > 1, as torchrun sets it), which raises: a script that forgot
``init_process_group`` would otherwise compute each shard's mask on its own, silently.

Not supported: double backward (the backward's collectives are not differentiated; it raises),
forward mode, ``torch.func`` transforms and ``torch.compile`` tracing of the call (the solve tests
convergence on the host between collectives).
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from softops._core.convergence import THRESHOLD_MAX_ITER, warn_not_converged
from softops._core.dims import flatten_to_2d, row_param
from softops._core.rootfind import SolverState, iterate, result
from softops._core.straight_through import straight_through
from softops._core.validation import (
    check_bool,
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_max_iter,
    check_tol,
    check_unused,
    compute_dtype,
)
from softops.solvers import ThresholdResult
from softops.topk._options import check_mask_k
from softops.topk._ot import (
    BLOCK,
    SAMPLE_SIZE,
    _evaluate,
    _evaluate_t,
    _near_rows,
    _polish_rows,
    _Prep,
    _row_counts,
    _sample_centre,
    _scale_of,
    _scaling_limit,
    _special_rows,
    _start_exact,
    _start_sampled,
)
from softops.topk._sparse import _ranked_pair
from softops.topk._sparse import _solve_rows as _solve_sparse_rows

__all__ = [
    "METHODS",
    "SAMPLE_SIZE",
    "ShardedTopK",
    "ThresholdResult",
    "soft_topk_mask",
    "topk",
    "topk_threshold",
]

METHODS = ("ot", "sparse")
"""The methods of :func:`soft_topk_mask` (the single-process op's with a per-row k)."""
EXACT_SHARE = 64
"""The exact candidates may be up to ``1 / EXACT_SHARE`` of the row: a shard's top-k costs
less than one evaluation, and the exact bracket saves two to four (measured: B=64, n=1e6,
k=1000, 4 ranks: 7 evaluations from the subsample, 3 from the candidates). Otherwise the whole
group sends a strided subsample of about ``SAMPLE_SIZE`` entries per row (the single-process
solver's, ``softops.topk._ot.SAMPLE_SIZE``)."""
_HEADER = 18
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_MASK = "distributed.soft_topk_mask"
_THRESHOLD = "distributed.topk_threshold"
_TOPK = "distributed.topk"


# ------------------------------------------------------------------------------ communication


class _Comm:
    """The process group of a call: this rank, the world size, and the two collectives.

    Both collectives are ``all_reduce`` (SUM) on the tensors' own device, so that every backend
    (gloo on CPU, NCCL on CUDA, ...) runs them; an all-gather is an all-reduce of zero-padded
    per-rank slots (``x + 0`` is ``x`` for every float, infinities and NaN included).
    """

    __slots__ = ("group", "rank", "size")

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks (``t`` must be a fresh tensor: reduced in place)."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def reduce(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The sums over the ranks of the (B,) partial sums ``parts``, in float64, by one
        all-reduce: the reduction of the single-process solvers' evaluations
        (``softops.topk._ot.Reduce``)."""
        return self.sum(torch.stack([p.to(torch.float64) for p in parts])).unbind(0)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t``, stacked: shape ``(P, *t.shape)``."""
        if self.size == 1:
            return t.unsqueeze(0)
        slots = t.new_zeros((self.size, *t.shape))
        slots[self.rank] = t
        dist.all_reduce(slots, group=self.group)
        return slots


def _resolve_group(group: Any, op: str) -> _Comm:
    """The :class:`_Comm` of ``group`` (None: the default group, or a world of one when none is
    initialised and the environment names no larger world)."""
    if group is not None:
        if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"{op}: expected a `group` that this process belongs to; got a group that "
                "does not include it (torch.distributed.new_group returns that object to "
                "non-members)."
            )
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(
                f"{op}: expected `group` to be a torch.distributed ProcessGroup or None; "
                f"got {group!r}."
            )
        return _Comm(group, dist.get_rank(group), dist.get_world_size(group))
    if dist.is_available() and dist.is_initialized():
        return _Comm(None, dist.get_rank(), dist.get_world_size())
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world not in ("", "1"):
        raise ValueError(
            f"{op}: expected torch.distributed to be initialised "
            "(torch.distributed.init_process_group) or a `group`, since WORLD_SIZE="
            f"{world} says this process is one of several; got no process group."
        )
    return _Comm(None, 0, 1)


def _comm_device(comm: _Comm, x: Any) -> torch.device:
    """Where this call's collectives run: x's device, or the backend's when x is unusable."""
    if isinstance(x, torch.Tensor) and not _wrong_device(comm, x):
        return x.device
    if comm.size > 1 and dist.get_backend(comm.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wrong_device(comm: _Comm, x: torch.Tensor) -> bool:
    return comm.size > 1 and x.device.type != "cuda" and dist.get_backend(comm.group) == "nccl"


# -------------------------------------------------------------------------------- validation


class _Local(NamedTuple):
    """One rank's canonical input: rows (B, n_r) in the compute dtype, k and epsilon per row."""

    x2: torch.Tensor
    k_row: torch.Tensor
    eps_row: torch.Tensor
    k: float | torch.Tensor
    k_scalar: float | None
    restore: Any
    batch_shape: torch.Size
    max_iter: int
    tol: float


class _Plan(NamedTuple):
    """What every rank knows after the header: the group, the shard lengths and the options."""

    op: str
    comm: _Comm
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    n: int
    k_scalar: float | None
    k_max: float
    eps_max: float
    max_iter: int
    tol: float
    hard: bool


def _validate(
    op: str,
    comm: _Comm,
    x: Any,
    k: Any,
    dim: Any,
    epsilon: Any,
    method: Any,
    largest: Any,
    hard: Any,
    max_iter: Any,
    tol: Any,
) -> _Local:
    """Every check that needs this rank's arguments only (the single-process op's, but for the
    range of k, which needs the global n, and a shard that may be empty)."""
    check_choice(method, METHODS, op, "method")
    check_bool(largest, op, "largest")
    check_bool(hard, op, "hard")
    cap = check_max_iter(max_iter, THRESHOLD_MAX_ITER, op)
    if method == "sparse":
        check_unused(op, method, tol=tol)
        tolerance = 0.0
    else:
        tolerance = check_tol(tol, 0.0, op)
    check_floating(x, op, "x_local")
    if _wrong_device(comm, x):
        raise ValueError(
            f"{op}: expected `x_local` on a CUDA device with the NCCL backend; got x_local on "
            f"{x.device}."
        )
    d = check_dim(x, dim, op)
    epsilon = check_epsilon(epsilon, op, dtype=x.dtype)
    k, k_scalar = check_mask_k(op, k, None, method, hard=hard, epsilon=epsilon)
    cd = compute_dtype(x.dtype)
    x2, restore = flatten_to_2d(x, d)
    batch_shape = torch.Size(x.shape[:d] + x.shape[d + 1 :])
    fi = torch.finfo(cd)
    if isinstance(epsilon, torch.Tensor):
        eps = row_param(epsilon, batch_shape, op, "epsilon", cd, x.device).clamp(fi.tiny, fi.max)
    else:
        value = min(max(epsilon, fi.tiny), fi.max)
        eps = torch.full((x2.shape[0],), value, dtype=cd, device=x.device)
    k_row = row_param(k, batch_shape, op, "k", cd, x.device)
    if k_scalar is not None and cd == torch.float32:
        # the value the rows hold (2.99999999 of n = 3 rounds to 3 in float32)
        k_scalar = struct.unpack("f", struct.pack("f", k_scalar))[0]
    x2 = x2.to(cd)
    if not largest:
        x2 = -x2
    return _Local(x2, k_row, eps, k, k_scalar, restore, batch_shape, cap, tolerance)


def _header(local: _Local | None, method: str, largest: bool, hard: bool) -> list[Any]:
    """This rank's 18 header entries (Python floats and 0-dim tensors); zeros but the error flag
    when its own validation failed."""
    if local is None:
        return [1.0] + [0.0] * (_HEADER - 1)
    x2, k_row, eps = local.x2, local.k_row.detach(), local.eps_row.detach()
    B = x2.shape[0]
    if B and isinstance(local.k, torch.Tensor):
        k_stats: list[Any] = [1.0, k_row.sum(dtype=torch.float64), k_row.amax(), k_row.amin()]
    elif isinstance(local.k, torch.Tensor):
        k_stats = [1.0, 0.0, 0.0, 0.0]
    else:
        k_stats = [0.0, float(local.k), float(local.k), float(local.k)]
    if B:
        eps_stats: list[Any] = [eps.sum(dtype=torch.float64), eps.amax(), eps.amin()]
    else:
        eps_stats = [0.0, 0.0, 0.0]
    return [
        0.0,
        float(x2.shape[1]),
        float(B),
        float(len(local.batch_shape)),
        float(METHODS.index(method)),
        float(largest),
        float(hard),
        float(local.max_iter),
        local.tol,
        float(_DTYPES.index(x2.dtype)),
        *k_stats,
        *eps_stats,
        float(hash(tuple(local.batch_shape)) % (1 << 40)),
    ]


_FIELDS = (
    (2, "number of rows (the batch size)"),
    (3, "batch ndim"),
    (17, "batch shape"),
    (4, "method"),
    (5, "largest"),
    (6, "hard"),
    (7, "max_iter"),
    (8, "tol"),
    (9, "dtype"),
    (10, "kind of k (number or tensor)"),
    (12, "k (its largest value)"),
    (13, "k (its smallest value)"),
    (11, "k (the sum of its rows' values)"),
    (15, "epsilon (its largest value)"),
    (16, "epsilon (its smallest value)"),
    (14, "epsilon (the sum of its rows' values)"),
)


def _exchange(
    op: str,
    comm: _Comm,
    x: Any,
    local: _Local | None,
    error: Exception | None,
    method: str,
    largest: bool,
    hard: bool,
) -> _Plan:
    """One all-reduce of every rank's header; every rank then raises the same error, or none.

    A rank whose own arguments failed validation still takes part (with its error flag set), so
    that the others raise instead of waiting for it in the next collective.
    """
    if comm.size == 1 and error is not None:
        raise error
    device = _comm_device(comm, x)
    entries = _header(local, method, largest, hard)
    row = torch.stack(
        [torch.as_tensor(e, dtype=torch.float64, device=device).reshape(()) for e in entries]
    )
    table = comm.gather(row).tolist()  # (P, 18): the one host read of the header
    failed = [r for r, h in enumerate(table) if h[0] != 0]
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"{op}: expected valid arguments on every rank of the group; got invalid ones on "
            f"rank(s) {failed} (the error is raised there)."
        )
    first = table[0]
    for r, h in enumerate(table[1:], start=1):
        for index, what in _FIELDS:
            if h[index] != first[index]:
                raise ValueError(
                    f"{op}: expected the same {what} on every rank of the group (the shards of "
                    f"one batch of rows); got {first[index]:g} on rank 0 and {h[index]:g} on "
                    f"rank {r}."
                )
    assert local is not None  # (no error anywhere)
    sizes = tuple(int(h[1]) for h in table)
    starts = tuple(sum(sizes[:r]) for r in range(len(sizes)))
    n = sum(sizes)
    if n == 0:
        raise ValueError(
            f"{op}: expected a non-empty `dim` over the group; got x_local.shape[dim] = 0 on "
            f"every one of the {comm.size} ranks."
        )
    k_max, k_min = first[12], first[13]
    number = first[10] == 0  # (a tensor k of an empty batch has no values to check)
    if (number or first[2]) and not 0 <= k_min <= k_max <= n:
        bad = k_max if k_max > n else k_min
        shown = repr(local.k) if not isinstance(local.k, torch.Tensor) else f"{bad:g}"
        raise ValueError(
            f"{op}: expected 0 <= `k` <= n (= {n}, the length of `dim` summed over the "
            f"{comm.size} rank{'s' if comm.size > 1 else ''} of the group); got k={shown}."
        )
    return _Plan(
        op,
        comm,
        sizes,
        starts,
        n,
        local.k_scalar,
        k_max,
        first[15],
        local.max_iter,
        local.tol,
        hard,
    )


def _prepare(
    op: str,
    group: Any,
    x: Any,
    k: Any,
    dim: Any,
    epsilon: Any,
    method: Any,
    largest: Any,
    hard: Any,
    max_iter: Any,
    tol: Any,
) -> tuple[_Local, _Plan]:
    """Validate locally, then exchange the header (one collective): the canonical input."""
    comm = _resolve_group(group, op)
    local: _Local | None = None
    error: Exception | None = None
    try:
        local = _validate(op, comm, x, k, dim, epsilon, method, largest, hard, max_iter, tol)
    except (TypeError, ValueError) as err:
        error = err
    plan = _exchange(op, comm, x, local, error, method, largest, hard)
    assert local is not None
    return local, plan


# ----------------------------------------------------------------------------- the row start
#
# The solvers are the single-process ones (softops.topk._ot and softops.topk._sparse): their
# preparation takes the rows' statistics and order statistics, which here come from one
# all-gather of every shard's (below), and their evaluations take their row sums through a
# reduction, which here is one all-reduce (_Comm.reduce). Nothing else is sharded.


def _local_top(x: torch.Tensor, depth: int) -> torch.Tensor:
    """The ``depth`` largest entries of each row of the shard, sorted, padded with ``-inf``."""
    B, n_r = x.shape
    out = torch.full((B, depth), -math.inf, dtype=x.dtype, device=x.device)
    if n_r and depth:
        d = min(depth, n_r)
        out[:, :d] = x.topk(d, dim=-1).values
    return out


def _shard_stats(x: torch.Tensor) -> torch.Tensor:
    """(B, 6) float64: the single-process solver's row statistics of the shard
    (:func:`softops.topk._ot._row_counts`: counts of finite, ``+inf`` and NaN entries, finite
    min, sum of the finite entries) and its finite max, in the order n_fin, n_pinf, n_nan, max,
    min, sum (an empty shard: 0, 0, 0, -inf, inf, 0)."""
    B, n_r = x.shape
    if not n_r:
        empty = torch.tensor([0.0, 0.0, 0.0, -math.inf, math.inf, 0.0], device=x.device)
        return empty.to(torch.float64).expand(B, 6)
    n_fin, n_pinf, n_nan, bottom, total = _row_counts(x)
    top = torch.where(torch.isfinite(x), x, -math.inf).amax(-1)
    return torch.stack((n_fin, n_pinf, n_nan, top, bottom, total), -1).to(torch.float64)


def _sample_layout(plan: _Plan) -> tuple[int, list[int], list[int]]:
    """The global stride of the subsample, and each rank's first local index and count in it:
    the entries at global positions 0, stride, 2 stride, ... (those of ``x[:, ::stride]``)."""
    stride = max(plan.n // SAMPLE_SIZE, 2)
    offsets, counts = [], []
    for size, start in zip(plan.sizes, plan.starts, strict=True):
        off = (-start) % stride
        offsets.append(off)
        counts.append(max(0, -(-(size - off) // stride)) if size > off else 0)
    return stride, offsets, counts


class _Rows(NamedTuple):
    """The rows' global statistics and start candidates, replicated on every rank (float64)."""

    n_fin: torch.Tensor
    n_pinf: torch.Tensor
    n_nan: torch.Tensor
    top: torch.Tensor  # the largest finite entry (-inf: none)
    bottom: torch.Tensor  # the smallest finite entry (inf: none)
    total: torch.Tensor  # the sum of the finite entries
    cand: torch.Tensor  # (B, P W): every rank's candidates, -inf padded
    exact: bool  # cand holds each rank's ``depth`` largest (else the strided subsample)
    depth: int
    ns: int  # the subsample's size (sampled path)
    hard_cand: torch.Tensor | None  # (P, B, max k): every rank's largest, for hard=True

    def stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """n_fin, n_pinf, n_nan, max, min and sum in ``dtype``, the single-process solvers'."""
        return tuple(
            v.to(dtype)
            for v in (self.n_fin, self.n_pinf, self.n_nan, self.top, self.bottom, self.total)
        )

    def sample_top(self, plan: _Plan) -> int:
        """The depth of the subsample's order statistics (``softops.topk._ot._sample_centre``)."""
        ns = self.ns
        return min(max(round(plan.k_max * ns / plan.n), 1), ns - 1) + 1 if ns > 1 else 1


def _gather_rows(plan: _Plan, x: torch.Tensor) -> _Rows:
    """The start's one collective: every rank's shard statistics and candidates, all-gathered.

    The candidates are each rank's ``floor(max k) + 1`` largest entries (which hold the row's)
    where the group sends at most ``max(SAMPLE_SIZE, n // EXACT_SHARE)`` of them per row and
    under half the row, else
    its part of the strided subsample ``x[:, ::stride]`` of the concatenated row; with
    ``hard=True`` also its ``max k`` largest (the same ones on the exact path).
    """
    comm, n = plan.comm, plan.n
    B = x.shape[0]
    f64 = torch.float64
    depth = max(min(math.floor(plan.k_max) + 1, n), 1)
    budget = max(SAMPLE_SIZE, n // EXACT_SHARE)
    exact = comm.size * depth <= budget and 2 * depth <= n
    hard_w = int(plan.k_max) if plan.hard else 0
    parts = [_shard_stats(x)]
    ns = 0
    if exact:
        parts.append(_local_top(x, depth).to(f64))
        width = depth
    else:
        stride, offsets, counts = _sample_layout(plan)
        ns = sum(counts)
        width = max(max(counts), 1)
        sample = torch.full((B, width), -math.inf, dtype=f64, device=x.device)
        mine = counts[comm.rank]
        if mine:
            sample[:, :mine] = x[:, offsets[comm.rank] :: stride].to(f64)
        parts.append(sample)
        if hard_w:
            parts.append(_local_top(x, hard_w).to(f64))
    everything = comm.gather(torch.cat(parts, -1))  # (P, B, 6 + W)
    st = everything[..., :6]
    hard_cand = None
    if hard_w:
        hc = everything[..., 6 : 6 + depth] if exact else everything[..., 6 + width :]
        hard_cand = hc[..., :hard_w].to(x.dtype)
    return _Rows(
        st[..., 0].sum(0),
        st[..., 1].sum(0),
        st[..., 2].sum(0),
        st[..., 3].amax(0),
        st[..., 4].amin(0),
        st[..., 5].sum(0),
        everything[..., 6 : 6 + width].permute(1, 0, 2).reshape(B, -1),
        exact,
        depth,
        ns,
        hard_cand,
    )


def _scaled(
    plan: _Plan, rows: _Rows, x: torch.Tensor, eps: torch.Tensor
) -> tuple[_Rows, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows whose epsilon is within ``2**SCALE_BITS`` of ``finfo.max`` on ``(x c, eps c)``, c
    the power of two of the single-process solver (``softops.topk._ot._scale``) from the rows'
    finite span; their statistics with them (exact)."""
    if plan.eps_max <= _scaling_limit(x.dtype):
        return rows, x, eps, None
    scale = _scale_of(rows.top.to(x.dtype), rows.bottom.to(x.dtype), eps)
    c = scale.to(torch.float64)
    rows = rows._replace(
        top=rows.top * c,
        bottom=rows.bottom * c,
        total=rows.total * c,
        cand=rows.cand * c[:, None],
    )
    return rows, x * scale[:, None], eps * scale, scale


def _start_ot(
    plan: _Plan, rows: _Rows, k: torch.Tensor, eps: torch.Tensor, dtype: torch.dtype
) -> tuple[_Prep, SolverState]:
    """The single-process solver's preparation (centre, classes, bracket and start) of every
    row, from the gathered statistics and candidates."""
    n_fin, n_pinf, n_nan, top, bottom, total = rows.stats(dtype)
    if rows.exact:
        topv = rows.cand.topk(rows.depth, dim=-1).values.to(dtype)  # the row's largest, sorted
        return _start_exact(k, eps, topv, n_fin, n_pinf, n_nan, bottom, total)
    counts = (n_fin, n_pinf, n_nan)
    sample, q_top = rows.cand.to(dtype), rows.sample_top(plan)
    return _start_sampled(k, eps, plan.n, sample, rows.ns, q_top, bottom, top, total, counts)


# ----------------------------------------------------------------------------- the iteration


class _Solution(NamedTuple):
    """The sharded solve: this shard's mask and backward weights, and the replicated rows."""

    A: torch.Tensor  # (B, n_r)
    s: torch.Tensor  # (B, n_r), in the caller's units
    aux: torch.Tensor  # (B, 2): the centre m and the threshold t less m (solve units)
    edge: torch.Tensor  # (B,) int8: +1 rows at k' = 0, -1 rows at k' = n_fin, 0 else
    ext: torch.Tensor  # (B, 3): finite max, finite min, finite count (solve units)
    scale: torch.Tensor | None
    converged: torch.Tensor  # (B,) bool: filled rows have, rows that cannot be solved have not
    residual: torch.Tensor
    iterations: int
    hard: torch.Tensor | None
    sel_none: torch.Tensor  # (B,) bool: the rows at k' = 0 (as softops.topk._ot.ThresholdState)
    sel_all: torch.Tensor  # ... at k' = n_fin (a row without a finite entry is at both)
    invalid: torch.Tensor  # ... that cannot be solved (NaN)


def _solve_ot(plan: _Plan, x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor) -> _Solution:
    """Solve the threshold of every row of the sharded (B, n_r) ``x``, largest first: the
    single-process solver of ``softops.topk._ot`` (:func:`~softops.topk._ot._evaluate` with its
    row sums all-reduced, :func:`~softops.topk._ot._polish_rows` with its balance all-gathered)."""
    comm = plan.comm
    reduce = comm.reduce if comm.size > 1 else None
    gather = comm.gather if comm.size > 1 else None
    rows = _gather_rows(plan, x)
    rows, xs, es, scale = _scaled(plan, rows, x, eps)
    prep, state = _start_ot(plan, rows, k, es, x.dtype)
    block = 1 if x.device.type == "cpu" else BLOCK
    args = (xs, prep.m2, es[:, None], prep.k_total, plan.tol, reduce, plan.n)
    state, evaluations = iterate(_evaluate_t, state, args, max_iter=plan.max_iter, block=block)
    converged = result(state, evaluations).converged
    t = state.t_eval
    if state.extra:
        A, s, den = state.extra[:3]
        near = _near_rows(state, prep, es)
        if bool(near.any()):  # (the host test that every rank makes alike)
            t = _polish_rows(xs, prep, es, state, near, gather)
            # this shard's mask and weights at the new t (the sums of the pass are unused)
            A, s = _evaluate(xs, prep.m2, t[:, None], es[:, None], prep.k_total, plan.tol)[4:6]
    else:  # every row is filled: nothing was evaluated
        A, s = torch.zeros_like(xs), torch.zeros_like(xs)
        den = torch.full_like(t, math.inf)
    A, s, _, residual, converged = _special_rows(prep, xs, A, s, den, state.residual, converged)
    if scale is not None:  # s = A (1 - A) / eps in the caller's units
        s = s * scale[:, None]
    sel_none, sel_all, invalid = prep.sel_none, prep.sel_all, prep.invalid
    edge = sel_none.to(torch.int8) - (sel_all & ~sel_none).to(torch.int8)
    m = prep.m2.squeeze(-1)
    aux = torch.stack((m, t), -1)
    ext = torch.stack((rows.top, rows.bottom, rows.n_fin), -1).to(x.dtype)
    hard = _hard(plan, x, k, rows)
    return _Solution(
        A,
        s,
        aux,
        edge,
        ext,
        scale,
        converged,
        residual,
        evaluations,
        hard,
        sel_none,
        sel_all,
        invalid,
    )


def _hard(plan: _Plan, x: torch.Tensor, k: torch.Tensor, rows: _Rows) -> torch.Tensor | None:
    """The sharded hard mask when ``hard=True`` (None otherwise)."""
    if not plan.hard:
        return None
    if rows.hard_cand is None:  # k = 0 on every row
        return torch.zeros_like(x)
    return _hard_mask(plan, x, k, rows.hard_cand)


def _no_double_backward(op: str) -> None:
    """Raise where the backward is itself differentiated (``create_graph=True``): its
    collectives are not, and a silently constant gradient would drop a term of a gradient
    penalty."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: double backward (create_graph=True) is not supported across ranks; "
            "compute the gradient without create_graph, or use softops.soft_topk_mask on one "
            "process."
        )


# ---------------------------------------------------------------------------- method "sparse"


def _solve_sparse(
    plan: _Plan, x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sharded "sparse" mask: the single-process solver of ``softops.topk._sparse`` with
    its row sums all-reduced, from the gathered statistics; its bracket is the exact one of the
    single-process op where the candidates are exact, else the finite range around the
    subsample's centre. Returns the mask, the rows' convergence and the hard mask (or None)."""
    comm = plan.comm
    dtype = x.dtype
    rows = _gather_rows(plan, x)
    stats = rows.stats(dtype)
    if rows.exact:
        topv = rows.cand.topk(rows.depth, dim=-1).values.to(dtype)
        centre, x_lo = _ranked_pair(topv, k, plan.n)
    else:
        bounds = (stats[4], stats[3])
        sample, q_top = rows.cand.to(dtype), rows.sample_top(plan)
        centre, x_lo = _sample_centre(sample, k, plan.n, rows.ns, q_top, bounds), None
    reduce = comm.reduce if comm.size > 1 else None
    a, converged = _solve_sparse_rows(x, k, eps, plan.max_iter, stats, centre, x_lo, reduce)
    if converged is None:
        converged = torch.ones_like(k, dtype=torch.bool)
    return a, converged, _hard(plan, x, k, rows)


class _ShardedMaskSparse(torch.autograd.Function):
    """This shard of ``a = clip((x - t)/eps, 0, 1)``, ``sum a = k`` over the concatenated row;
    the closed-form backward on the free entries S, with ``|S|`` and the sums over S
    all-reduced (one (3, B) all-reduce; (5, B) with a gradient in epsilon)."""

    @staticmethod
    def forward(
        x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, plan: _Plan
    ) -> tuple[Any, ...]:
        return _solve_sparse(plan, x.detach(), k.detach(), eps.detach())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, _, eps, plan = inputs
        a, converged, hard = output
        ctx.mark_non_differentiable(*(t for t in (converged, hard) if t is not None))
        ctx.set_materialize_grads(False)
        ctx.comm = plan.comm
        ctx.save_for_backward(a, eps)

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
        r"""``da_i/dx_j = (delta_ij - 1/|S|)/eps``, ``da_i/dk = 1/|S|``, ``da_i/deps = -(a_i -
        mean_S a)/eps`` on S (0 elsewhere, and everywhere when S is empty)."""
        if ga is None:
            return None, None, None, None
        _no_double_backward(_MASK)
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        a, eps = ctx.saved_tensors
        comm: _Comm = ctx.comm
        free = ((a > 0) & (a < 1)).to(a.dtype)
        g = ga * free
        parts = [free.sum(-1), g.sum(-1), (a != a).sum(-1).to(a.dtype)]
        if need_eps:
            af = torch.where(free > 0, a, 0)
            parts += [(g * af).sum(-1), af.sum(-1)]
        glob = comm.sum(torch.stack(parts))
        size = glob[0]
        inv = torch.where(size > 0, 1 / size.clamp(min=1), 0).masked_fill(glob[2] > 0, math.nan)
        mean_g = glob[1] * inv
        e = eps[:, None]
        gx = free * (ga - mean_g[:, None]) / e if need_x else None
        gk = mean_g if need_k else None
        geps = -(glob[3] - mean_g * glob[4]) / eps if need_eps else None
        return gx, gk, geps, None


# ------------------------------------------------------------------------------- hard top-k


def _first_ties(eq: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """The first ``take`` (B,) True entries of each row of ``eq`` (B, n_r), by local index."""
    return eq & (eq.cumsum(-1) <= take[:, None])


def _hard_mask(plan: _Plan, x: torch.Tensor, k: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The 0/1 mask of the k largest entries of the concatenated rows, on this shard; ties at
    the k-th value v broken by the global position (lower first).

    ``cand`` (P, B, W), W >= max k, holds every rank's W largest entries (``-inf`` padded): they
    hold every entry above v (fewer than k), and each rank's ties at v as far as they can matter
    (a rank whose W candidates end in ties shows at least k - #{x > v} >= the ties needed)."""
    P, B, W = cand.shape
    kk = k.long()
    merged = cand.permute(1, 0, 2).reshape(B, P * W).topk(W, dim=-1).values
    v = merged.gather(-1, (kk - 1).clamp(0, W - 1)[:, None])  # (B, 1)
    above = (cand > v[None]).sum(-1)  # (P, B)
    ties = (cand == v[None]).sum(-1)
    need = kk - above.sum(0)
    before = ties.cumsum(0) - ties  # the ties of the ranks before each rank
    take = (need - before[plan.comm.rank]).clamp(min=0)
    take = torch.where(kk > 0, take, 0)
    sel = ((x > v) & (kk > 0)[:, None]) | _first_ties(x == v, take)
    return sel.to(x.dtype)


# ------------------------------------------------------------------------------- autograd


class _ShardedMaskOT(torch.autograd.Function):
    """This shard of ``A = sigmoid((x - t)/eps)``, ``sum A = k`` over the concatenated row; the
    implicit backward with its row sums all-reduced.

    Inputs: x (B, n_r) in the compute dtype, k (B,), eps (B,), and the call's :class:`_Plan`.
    Outputs: A, then tensors that carry no gradient: the convergence flags, the hard mask (or
    None) and the solve's diagnostics (t, residual).
    """

    @staticmethod
    def forward(
        x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, plan: _Plan
    ) -> tuple[Any, ...]:
        sol = _solve_ot(plan, x.detach(), k.detach(), eps.detach())
        converged = sol.converged | sol.invalid  # (NaN rows are NaN by contract: no warning)
        return sol.A, converged, sol.hard, sol.s, sol.aux, sol.edge, sol.ext, sol.scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, k, eps, plan = inputs
        _, converged, hard, s, aux, edge, ext, scale = output
        extras = (converged, hard, s, aux, edge, ext, scale)
        ctx.mark_non_differentiable(*(t for t in extras if t is not None))
        ctx.set_materialize_grads(False)
        ctx.comm = plan.comm
        ctx.save_for_backward(s, aux, eps, x, edge, ext, scale, k)

    @staticmethod
    def backward(ctx: Any, gA: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
        if gA is None:
            return None, None, None, None
        _no_double_backward(_MASK)
        need_x, need_k, need_eps = ctx.needs_input_grad[:3]
        s, aux, eps, x, edge, ext, scale, k = ctx.saved_tensors
        comm: _Comm = ctx.comm
        if not (need_k or need_eps):
            local = torch.stack((s.sum(-1), torch.linalg.vecdot(s, gA)))
            ss, sg = comm.sum(local).unbind(0)
            ratio = torch.where(ss > 0, sg / torch.where(ss > 0, ss, 1), 0)
            return s * (gA - ratio[:, None]), None, None, None
        e = eps[:, None] if scale is None else (eps * scale)[:, None]
        xs = x if scale is None else x * scale[:, None]
        off = (xs - aux[:, :1]) - aux[:, 1:2]
        ratio, mean, g1, g2 = _weighted_sums(comm, off, xs, e, s, gA, edge, ext, k, need_eps)
        gx = s * (gA - ratio[:, None]) if need_x else None
        gk = ratio if need_k else None
        geps = -(g1 - mean * g2) / e.squeeze(-1) if need_eps else None
        return gx, gk, geps, None


def _weighted_sums(
    comm: _Comm,
    off: torch.Tensor,
    xs: torch.Tensor,
    e: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor,
    edge: torch.Tensor,
    ext: torch.Tensor,
    k: torch.Tensor,
    need_eps: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``<w, g>``, ``<w, off>``, ``sum_live g s off`` and ``sum_live g s`` over the row (live:
    ``s > 0``), with ``w = s / sum s`` normalised in the log domain, from one all-gather.

    As in the single-process op (``softops.topk._ot._k_weights``): ``log w_i = -|z_i| - 2 log(1
    + e^{-|z_i|})`` up to a constant, ``z = off / eps``, each side of t (``off <= 0``, ``off >
    0``) shifted by its nearest entry. Each rank takes off its own nearest ``|off|`` on each
    side, ``near_r``, before dividing by epsilon, and sends it with its partial sums; a side's
    sums are ``sum_r exp(-(near_r - near)/eps)`` times the rank's (``near = min_r near_r``), so
    they hold where every ``s`` underflows. The sides weigh against each other by
    ``e^{-(near_side - nearest)/eps}``, or, where the row's count above t is k, by ``1 / Us``
    (``Us`` the side's shifted sum of u): the root's condition ``U_a = U_b`` makes that exact
    whatever t. Rows at k' = 0 (``edge`` +1) or k' = n_fin (-1) take the one-sided limits
    ``softmax(+-x/eps)`` over the finite entries, shifted by the row's global max or min (one
    side, no per-rank shift); rows with no finite entry get 0.
    """
    B, n_r = off.shape
    a = off.abs()
    fin_a = torch.isfinite(a)
    side = edge[:, None]
    below = fin_a & ((off <= 0) | (side != 0))  # (edge rows: one side)
    finite = torch.isfinite(xs)
    xf = torch.where(finite, xs, 0)
    top, bottom = ext[:, :1].nan_to_num(0, 0, 0), ext[:, 1:2].nan_to_num(0, 0, 0)
    up = torch.where(finite, (xf - top) / e, -math.inf)
    down = torch.where(finite, (bottom - xf) / e, -math.inf)
    live = s > 0
    gs = g * s  # (NaN where s is: a NaN row's gradient in epsilon is NaN)
    parts = []
    for here in (below, fin_a & ~below):
        if n_r:
            near = torch.where(here, a, math.inf).amin(-1, keepdim=True)
        else:
            near = torch.full((B, 1), math.inf, dtype=off.dtype, device=off.device)
        near = torch.where(side != 0, 0, near)
        shift = torch.where(torch.isfinite(near), near, 0)
        af = torch.where(here, a, shift)
        inner = -((af - shift) / e)
        sp = torch.nn.functional.softplus(-(af / e))
        logw = torch.where(side > 0, up, torch.where(side < 0, down, inner - 2 * sp))
        w = torch.where(here, torch.exp(logw), 0)
        u = torch.where(here, torch.exp(inner - sp), 0)
        parts += [near.squeeze(-1), w.sum(-1), torch.linalg.vecdot(w, g), u.sum(-1)]
        if need_eps:
            parts.append(torch.linalg.vecdot(w, torch.where(w > 0, off, 0)))
    parts.append((off > 0).sum(-1, dtype=off.dtype))
    if need_eps:
        parts += [(gs * torch.where(live, off, 0)).sum(-1), (gs * live).sum(-1)]
    allp = comm.gather(torch.stack(parts))  # (P, c, B)
    es = e.squeeze(-1)
    c = 5 if need_eps else 4
    sides = []
    for i in (0, c):
        nears = allp[:, i]
        lowest = nears.amin(0)
        factor = torch.where(torch.isfinite(nears), torch.exp(-(nears - lowest) / es), 0)
        sums = [(factor * allp[:, i + j]).sum(0) for j in range(1, c)]
        sides.append((lowest, *sums))
    (near_b, w_b, wg_b, u_b, *wo_b), (near_a, w_a, wg_a, u_a, *wo_a) = sides
    count = allp[:, 2 * c].sum(0)
    nearest = torch.minimum(near_b, near_a)
    balanced = (count == k) & (u_b > 0) & (u_a > 0) & (edge == 0)
    fac_b = torch.where(balanced, 1 / u_b, torch.exp(-(near_b - nearest) / es))
    fac_a = torch.where(balanced, 1 / u_a, torch.exp(-(near_a - nearest) / es))
    fac_b = torch.where(torch.isfinite(near_b) & (w_b > 0), fac_b, 0)
    fac_a = torch.where(torch.isfinite(near_a) & (w_a > 0), fac_a, 0)
    w0 = fac_b * w_b + fac_a * w_a
    some = (ext[:, 2] > 0) | (edge == 0)
    ratio = torch.where(some, (fac_b * wg_b + fac_a * wg_a) / w0, 0)
    if not need_eps:
        return ratio, ratio, ratio, ratio
    mean = torch.where(some, (fac_b * wo_b[0] + fac_a * wo_a[0]) / w0, 0)
    return ratio, mean, allp[:, 2 * c + 1].sum(0), allp[:, 2 * c + 2].sum(0)


# ------------------------------------------------------------------------------ public ops


def soft_topk_mask(
    x_local: torch.Tensor,
    k: int | float | torch.Tensor,
    *,
    group: Any = None,
    dim: int = -1,
    largest: bool = True,
    epsilon: float | torch.Tensor = 0.1,
    method: str = "ot",
    max_iter: int | None = None,
    tol: float | None = None,
    hard: bool = False,
) -> torch.Tensor:
    r"""This rank's part of the soft top-k mask of rows sharded along ``dim`` across a group.

    The hard operator, on the concatenated row ``x = torch.cat(shards, dim)`` (shards in rank
    order), is::

        torch.zeros_like(x).scatter(dim, x.topk(k, dim, largest).indices, 1)

    and the result equals ``softops.soft_topk_mask(x, k, ...)`` on the concatenated row,
    restricted to this rank's shard (to rounding: 1e-12 in float64, gradients included):

    .. math::

        A_i = \sigma\!\left(\frac{x_i - t}{\varepsilon}\right), \qquad
        \sum_{r} \sum_{i \in \text{shard } r} A_i = k .

    No rank sees another's entries: the threshold t is solved by bracketed Halley steps whose
    every evaluation all-reduces the O(B) row sums it needs (the module docstring lists every
    collective: ``2 + iterations`` per forward, one per backward). Call it on every rank of the
    group, with the same k, epsilon and options and the shards of the same rows.

    Args:
        x_local: this rank's shard: any shape, floating dtype; ``x_local.shape[dim]`` may differ
            across ranks and may be 0; every other dim must agree. float16 and bfloat16 are
            computed in float32.
        k: the global number to select, in [0, n] with n the length of ``dim`` summed over the
            group: an int or float, a 0-dim tensor (which receives a gradient), or a tensor
            broadcastable to the batch shape for a per-row k, as in the single-process op.
            The same on every rank.
        group: the process group (None: the default group). Without one, see the module
            docstring: a world of one unless ``WORLD_SIZE`` says otherwise.
        dim: the sharded dimension to select along.
        largest: select the largest (default) or the smallest entries.
        epsilon: the temperature, in the units of x (a float, or a tensor broadcastable to the
            batch shape, which receives a gradient), as in the single-process op.
        method: ``"ot"`` (default): the SOFT top-k sigmoid above. ``"sparse"``: the Euclidean
            projection ``clip((x - t)/epsilon, 0, 1)`` (exact zeros and ones), solved by the
            same finite Newton method as the single-process "sparse" on all-reduced counts.
        max_iter: cap on evaluations of the row sums (None: 100; each is one all-reduce).
        tol: "ot" only: extra absolute tolerance on ``|sum A - k|`` (None: machine precision).
        hard: straight-through: the exact hard top-k mask of the concatenated row (ties at
            the k-th value broken by the global position, lower rank first, then lower local
            index), with the soft mask's gradient. Needs an integer k.

    Returns:
        This rank's part of the mask: the shape, dtype and device of ``x_local``.

    Gradients: the backward returns the gradient of the sum over ranks of what each rank
    computes from its part of the mask: this rank's slice of the single-process gradient in x,
    and the full single-process gradient in k and epsilon on every rank (module docstring).

    Example:
        >>> x = torch.tensor([[5.0, 2.0, 3.0]])  # one rank: the whole row
        >>> soft_topk_mask(x, 1, epsilon=1e-3)
        tensor([[1., 0., 0.]])

    References:
        Xie et al. Differentiable Top-k Operator with Optimal Transport. NeurIPS 2020.
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking. ICML
        2020 (the capped-simplex projection, "sparse").
    """
    op = _MASK
    local, plan = _prepare(
        op, group, x_local, k, dim, epsilon, method, largest, hard, max_iter, tol
    )
    if local.x2.shape[0] == 0:
        return x_local * 0
    if method == "sparse":
        out = _ShardedMaskSparse.apply(local.x2, local.k_row, local.eps_row, plan)
        A, converged, hard_mask = out
    else:
        out = _ShardedMaskOT.apply(local.x2, local.k_row, local.eps_row, plan)
        A, converged, hard_mask = out[0], out[1], out[2]
    warn_not_converged(op, converged, plan.max_iter)
    if hard_mask is not None:
        A = straight_through(hard_mask, A)
    return local.restore(A).to(x_local.dtype)


def topk_threshold(
    x_local: torch.Tensor,
    k: int | float | torch.Tensor,
    epsilon: float | torch.Tensor,
    *,
    group: Any = None,
    dim: int = -1,
    largest: bool = True,
    max_iter: int | None = None,
    tol: float | None = None,
) -> ThresholdResult:
    r"""The threshold t of :func:`soft_topk_mask` (method "ot") of each sharded row, with the
    solver's diagnostics: the sharded :func:`softops.solvers.topk_threshold`.

    Solves :math:`\sum_r \sum_{i \in r} \sigma((x_i - t)/\varepsilon) = k`; every rank returns
    the same result. ``iterations`` is the number of evaluations, each one all-reduce; the call
    makes ``2 + iterations`` collectives. Not differentiable.

    Args:
        x_local: this rank's shard, as in :func:`soft_topk_mask`.
        k: the global number to select.
        epsilon: the temperature, in the units of x.
        group: the process group (None: the default group).
        dim: the sharded dimension.
        largest: select the largest (default) or the smallest.
        max_iter: cap on evaluations (None: 100).
        tol: extra absolute tolerance on ``|sum A - k|`` (None: machine precision only).

    Returns:
        A :class:`softops.solvers.ThresholdResult` (threshold in the units of x), with the
        contract of :func:`softops.solvers.topk_threshold` at the limits: ``+inf`` on rows at
        k -> 0 (k, less the entries at ``+inf``, is 0 in the compute dtype), ``-inf`` on rows
        at k -> n (k is the count of entries not at ``-inf``), the two swapped with
        ``largest=False``; 0 on rows without a finite entry; all of these with
        ``converged=True`` and residual 0. Rows whose k cannot be met (a NaN on any rank, more
        entries at the first infinity than k, fewer entries not at the other one) have a NaN
        threshold, a NaN residual and ``converged=False``.

    Example:
        >>> res = topk_threshold(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, 0.1)
        >>> res.threshold, bool(res.converged)
        (tensor(1.5000), True)
    """
    op = _THRESHOLD
    local, plan = _prepare(op, group, x_local, k, dim, epsilon, "ot", largest, False, max_iter, tol)
    shape = local.batch_shape
    if local.x2.shape[0] == 0:
        empty = torch.zeros(shape, dtype=x_local.dtype, device=x_local.device)
        return ThresholdResult(empty, empty.bool(), 0, empty)
    sol = _solve_ot(plan, local.x2.detach(), local.k_row.detach(), local.eps_row.detach())
    t = sol.aux[:, 0] + sol.aux[:, 1]
    if sol.scale is not None:
        t = t / sol.scale
    # the rows that are not solved: the limits' thresholds, as softops.solvers.topk_threshold
    inf = torch.full_like(t, math.inf)
    t = torch.where(sol.sel_none, inf, torch.where(sol.sel_all, -inf, t))
    t = torch.where(sol.sel_none & sol.sel_all, 0.0, t)  # no finite entry: any finite t
    t = t.masked_fill(sol.invalid, math.nan)
    t = t if largest else -t
    return ThresholdResult(
        t.reshape(shape).to(x_local.dtype),
        sol.converged.reshape(shape),
        sol.iterations,
        sol.residual.reshape(shape).to(x_local.dtype),
    )


class ShardedTopK(NamedTuple):
    """The global top-k of sharded rows, on every rank: x.shape with ``dim`` replaced by k.

    Attributes:
        values: the k largest (or smallest) entries of each concatenated row, sorted.
        indices: their positions in the concatenated row (int64).
        ranks: the rank that holds each (int64).
        local_indices: their positions in that rank's shard (int64).
    """

    values: torch.Tensor
    indices: torch.Tensor
    ranks: torch.Tensor
    local_indices: torch.Tensor


def topk(
    x_local: torch.Tensor,
    k: int,
    *,
    group: Any = None,
    dim: int = -1,
    largest: bool = True,
) -> ShardedTopK:
    r"""``torch.topk`` of rows sharded along ``dim``: the global k best, with their owners.

    The hard operator, on the concatenated row ``x = torch.cat(shards, dim)``, is
    ``x.topk(k, dim, largest, sorted=True)``; ties are broken by the global position (lower
    first), which ``torch.topk`` leaves unspecified. Each rank selects its own k best (ties by
    local index: they contain every entry of the global k best that it holds) and one all-gather
    of those k values and positions per rank gives every rank the same result: two collectives
    in all (the header and the gather), ``P k`` values per row. NaN counts as the largest, as in
    ``torch.topk``.

    Args:
        x_local: this rank's shard (any shape, floating dtype; its ``dim`` may be empty).
        k: an int in [0, n], n the length of ``dim`` summed over the group.
        group: the process group (None: the default group).
        dim: the sharded dimension.
        largest: the largest (default) or the smallest entries.

    Returns:
        A :class:`ShardedTopK`, identical on every rank. ``values`` is differentiable: each rank
        passes the gradient it receives to the entries it holds (no communication), which is
        the gradient of a loss that every rank computes alike from the values; sum parameter
        gradients over ranks, as for :func:`soft_topk_mask`.

    Example:
        >>> topk(torch.tensor([[5.0, 2.0, 6.0]]), 2)
        ShardedTopK(values=tensor([[6., 5.]]), indices=tensor([[2, 0]]), ranks=tensor([[0, 0]]), local_indices=tensor([[2, 0]]))
    """  # noqa: E501
    op = _TOPK
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: expected `k` to be an int; got {k!r}.")
    local, plan = _prepare(op, group, x_local, k, dim, 1.0, "ot", largest, False, None, None)
    x2 = local.x2
    values, index, owner, where = _sharded_topk(plan, x2.detach(), k, largest)
    if x2.requires_grad and k:
        values = _Route.apply(x2, values, owner == plan.comm.rank, where)
    values = values if largest else -values
    restore = local.restore
    return ShardedTopK(
        restore(values).to(x_local.dtype),
        restore(index),
        restore(owner),
        restore(where),
    )


def _sharded_topk(
    plan: _Plan, x: torch.Tensor, k: int, nan_first: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, k) values, global indices, owners and local indices of the global top-k, from one
    all-gather of each rank's own top-k: the order is NaN first (``nan_first``) or last, then
    value descending, then global position ascending."""
    comm = plan.comm
    B, n_r = x.shape
    P = comm.size
    f64 = torch.float64
    dev = x.device
    w = min(k, n_r)
    local_idx = torch.full((B, k), -1, dtype=torch.long, device=dev)
    vals = torch.full((B, k), -math.inf, dtype=f64, device=dev)
    if w:
        sel = _local_topk(x, w, nan_first)
        pos = torch.arange(n_r, device=dev).expand(B, n_r)
        chosen = torch.where(sel, pos, n_r + pos).topk(w, dim=-1, largest=False).values
        local_idx[:, :w] = chosen
        vals[:, :w] = x.gather(-1, chosen).to(f64)
    gidx = torch.where(local_idx >= 0, local_idx + plan.starts[comm.rank], -1).to(f64)
    allp = comm.gather(torch.stack((vals, gidx)))  # (P, 2, B, k)
    cv = allp[:, 0].permute(1, 0, 2).reshape(B, P * k)
    ci = allp[:, 1].permute(1, 0, 2).reshape(B, P * k)
    src = torch.arange(P, device=dev).repeat_interleave(k).expand(B, P * k)
    # lexicographic by stable sorts, the least significant key first: global index, value
    # (NaN as -inf), NaN first or last, the real candidates before the padding
    for key in ("index", "value", "nan", "padding"):
        if key == "index":
            order = ci.argsort(dim=-1, stable=True)
        elif key == "value":
            order = cv.nan_to_num(nan=-math.inf).argsort(dim=-1, descending=True, stable=True)
        elif key == "nan":
            order = (cv != cv).to(torch.int8).argsort(dim=-1, descending=nan_first, stable=True)
        else:
            order = (ci < 0).to(torch.int8).argsort(dim=-1, stable=True)
        cv, ci, src = cv.gather(-1, order), ci.gather(-1, order), src.gather(-1, order)
    gi = ci[:, :k].long()
    owner = src[:, :k]
    starts = torch.tensor(plan.starts, device=dev)
    return cv[:, :k].to(x.dtype), gi, owner, gi - starts[owner]


def _local_topk(x: torch.Tensor, w: int, nan_first: bool) -> torch.Tensor:
    """The mask of the ``w <= n_r`` first entries of each row of the shard in the order of
    :func:`_sharded_topk` (NaN first or last, value descending, index ascending)."""
    nan = x != x
    xm = torch.where(nan, -math.inf, x)
    ranked = xm.topk(w, dim=-1).values  # (NaN as -inf)
    if nan_first:
        sel_nan = _first_ties(nan, torch.full_like(ranked[:, 0], w, dtype=torch.long))
        left = w - sel_nan.sum(-1)  # the non-NaN entries to take
    else:
        sel_nan = torch.zeros_like(nan)
        left = torch.full_like(ranked[:, 0], w, dtype=torch.long)
    v = ranked.gather(-1, (left - 1).clamp(min=0)[:, None])
    above = ~nan & (xm > v) & (left > 0)[:, None]
    ties = ~nan & (xm == v) & (left > 0)[:, None]
    sel = sel_nan | above | _first_ties(ties, left - above.sum(-1))
    if not nan_first:  # NaN fill what the real entries cannot
        sel = sel | _first_ties(nan, w - sel.sum(-1))
    return sel


class _Route(torch.autograd.Function):
    """``values`` with a backward that passes each value's gradient to this shard's entry when
    this rank holds it (a scatter-add, no communication)."""

    @staticmethod
    def forward(
        x: torch.Tensor, values: torch.Tensor, mine: torch.Tensor, where: torch.Tensor
    ) -> torch.Tensor:
        return values.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, _, mine, where = inputs
        ctx.save_for_backward(mine, where)
        ctx.shape = x.shape

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mine, where = ctx.saved_tensors
        gx = g.new_zeros(ctx.shape)
        if gx.shape[-1]:  # (an empty shard holds none of them)
            gx.scatter_add_(-1, torch.where(mine, where, 0), torch.where(mine, g, 0))
        return gx, None, None, None
