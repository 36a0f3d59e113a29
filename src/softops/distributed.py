r"""Sharded soft top-k over ``torch.distributed``: rows split along ``dim`` across the ranks.

Each rank holds a shard ``x_r`` of every row (shards of any length, empty ones included); the
row is their concatenation in rank order, :math:`x = (x_0, \dots, x_{P-1})`, of length
:math:`n = \sum_r n_r`. The SOFT top-k mask of the row is a sigmoid with one threshold per row
(``softops.soft_topk_mask``, method "ot"; docs/math.md §1),

.. math::

    A_i = \sigma\big((x_i - t)/\varepsilon\big), \qquad
    F(t) = \sum_r \sum_{i \in r} \sigma\big((x_i - t)/\varepsilon\big) - k = 0,

so the only thing the ranks must agree on is t, a scalar per row. Every quantity the solver
needs is a sum over the row, hence a sum over ranks of a sum over each shard: each evaluation
of F all-reduces the (5, B) stack of per-row shard sums it needs, and no rank ever sees another
rank's entries. Method "sparse", :math:`a_i = \mathrm{clip}((x_i - t)/\varepsilon, 0, 1)`
(the capped-simplex projection), is a sum of the same kind.

Collectives per call (B rows, P ranks; "all-reduce" below is ``torch.distributed.all_reduce``
with SUM, the one collective this module calls, so every backend runs it on every device):

* one all-reduce of a fixed 18-float header per rank (the shard lengths, which give n and each
  rank's offset, and the options and batch shape, which every rank checks against every other
  rank's, so that inconsistent calls raise the same error everywhere instead of hanging);
* one all-gather, as an all-reduce of zero-padded per-rank slots, of the per-row shard
  statistics (counts of finite, ``+inf`` and NaN entries, finite min, max and sum) with
  candidates for the start: each rank's ``floor(k) + 1`` largest entries where the whole group
  sends at most ``max(SAMPLE_SIZE, n // EXACT_SHARE)`` of them per row and they are under half
  the row (the bracket is then exact, as in the single-process op: 2 to 4 evaluations), and
  else each rank's part of a global strided subsample of about ``SAMPLE_SIZE`` entries per
  row, whose quantile centres the row (3 to 7 evaluations, as the single-process op's long
  rows);
* one all-reduce of (5, B) per evaluation of F ("ot": 2 to 6 typical, ``max_iter`` at most);
  "sparse": one of (6, B) per evaluation (its closed-form polish rides along);
* "ot" only, and only where a row is near the hard limit (below): one or two all-gathers of
  (6, B) per rank for the log-domain polish of its threshold;
* backward: one all-reduce of (2, B), ``[sum_i s_i, <s, g>]`` ("sparse": (3, B), ``[|S|,
  sum_S g, #NaN]``); with gradients in k or epsilon instead one all-gather of (9, B) or (13,
  B) per rank (log-domain partial sums of each side of t, below; "sparse": an all-reduce of
  (5, B)).

So a forward costs ``2 + iterations`` collectives of O(B) (the second O(B SAMPLE_SIZE / P)
per rank), whatever n is, and a backward one. Ranks take the same steps: the iterate, the
bracket and the stop test are functions of all-reduced sums only, which every rank receives
bit for bit, and the host test of "all rows done" is made on those (ranks of one kind of device
compute them identically). The iteration is capped, so a call always returns.

Numerics (the pitfalls of ``softops.topk._ot``, in their sharded form):

* **Centring.** t is solved as an offset from a centre ``m`` near the threshold, ``z = ((x -
  m) - t)/eps``, so that t is small and finely resolved even in float32 at a tiny epsilon.
  ``m`` is the midpoint of the k-th and (k+1)-th largest entries of the row when the candidates
  are exact (the largest ``floor(k) + 1`` of each shard hold the row's), and of the sample's
  corresponding order statistics otherwise.
* **Bracket.** Exact path: ``[x_(j) - eps log(k / (j - k)), x_(j') - eps log((k - j' + 1) /
  (n - k))]``, ``j = floor(k) + 1``, ``j' = ceil(k)`` (the lemma of docs/math.md §1.3). Sampled
  path: ``[min x, max x] - eps logit(k / n)`` over the finite entries, from the all-gathered
  shard minima and maxima (always valid: at its lower end every entry is at least ``k / n``).
* **Residual without cancellation.** Each shard sums ``u = min(A, 1 - A) = sigmoid(-|z|)`` with
  the sign of z, and counts ``z > 0`` exactly (an integer, converted to float64); the count
  less k is formed first, in float64, then the signed sum added: ``F = (#{z > 0} - k) +
  sum_{z <= 0} u - sum_{z > 0} u``. All-reduced sums are float64, so a count over a row longer
  than 2**24 stays exact in float32 too.
* **Steps.** Halley where ``|F F''/F'^2| <= 1``, Newton elsewhere, regula falsi (Illinois) or
  bisection when a step leaves the bracket (:mod:`softops._core.rootfind`); the curvature
  ``F''/F' = -<1 - 2A, d>/(eps sum d)``, ``d = u(1 - u)``, is one more shard sum in the same
  pass. The tolerance on ``|F|`` is the rounding of the sums, one ulp of t, and the flush of
  the sigmoid, as in the single-process op.
* **Near the hard limit.** Where every ``u`` is tiny, F's tolerance (its floor, ``32 em``)
  holds over a stretch of the gap between the entries next to t (all of it once ``|z|``
  overflows), yet the gradients in k and epsilon weigh the entries by ``s ~ exp(-|z|)``, which
  depends on where t is. Those rows (``sum u(1 - u) < 32 sqrt(em)``) are polished as in the
  single-process op (:func:`softops.topk._ot.polish`): Newton steps inside the gap on ``G =
  log(U_b + c_b) - log(U_a + c_a)``, ``U_b`` and ``U_a`` the sums of u below and above t and
  ``c`` the count's offset from k; each rank sums its side terms shifted by its own nearest
  distance (no underflow), and one all-gather per step combines them. In the hard limit G is
  linear in t, so one step is exact.
* **Infinities.** ``+inf`` entries count as selected and ``-inf`` as not with no special case in
  the residual; rows whose k the finite entries cannot meet, or holding a NaN on any rank, are
  flagged from the all-gathered counts and come out NaN on every rank (their row only); rows
  that select exactly their ``+inf`` entries, or all their non ``-inf`` ones, are filled.
* **Overflowing offsets.** Rows whose epsilon is within ``2**SCALE_BITS`` of ``finfo.max`` are
  solved on ``(x c, eps c)`` for a power of two c (exact; the mask is invariant), computed from
  the all-gathered span; elsewhere an overflowing offset is the exact limit.

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
from softops._core.rootfind import SolverState, iterate, result, start_state
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
from softops.topk._ot import balance_parts, near_hard, polish

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
SAMPLE_SIZE = 2048
"""Entries per row the whole group sends for the start: the exact candidates where they fit in
``max(SAMPLE_SIZE, n // EXACT_SHARE)`` (and are under half the row), else a strided subsample
of about ``SAMPLE_SIZE``."""
EXACT_SHARE = 64
"""The exact candidates may be up to ``1 / EXACT_SHARE`` of the row: a shard's top-k costs
less than one evaluation, and the exact bracket saves two to four (measured: B=64, n=1e6,
k=1000, 4 ranks: 7 evaluations from the subsample, 3 from the candidates)."""
SCALE_BITS = 40
"""Rows whose epsilon exceeds ``finfo.max / 2**SCALE_BITS`` are solved on ``(x c, eps c)``."""
SMOOTH_START = 8
"""Start from the large-epsilon guess where ``SMOOTH_START * eps >= max x - min x``."""
BLOCK = 2
"""Evaluations between two host tests of "all rows done" off the CPU (one on the CPU)."""
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
    epsilon = check_epsilon(epsilon, op)
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


def _local_top(x: torch.Tensor, depth: int) -> torch.Tensor:
    """The ``depth`` largest entries of each row of the shard, sorted, padded with ``-inf``."""
    B, n_r = x.shape
    out = torch.full((B, depth), -math.inf, dtype=x.dtype, device=x.device)
    if n_r and depth:
        d = min(depth, n_r)
        out[:, :d] = x.topk(d, dim=-1).values
    return out


def _shard_stats(x: torch.Tensor) -> torch.Tensor:
    """(B, 6) float64: counts of finite, ``+inf`` and NaN entries, finite max, finite min, sum
    of the finite entries (an empty shard: 0, 0, 0, -inf, inf, 0)."""
    B, n_r = x.shape
    f64 = torch.float64
    finite = torch.isfinite(x)
    if n_r:
        top = torch.where(finite, x, -math.inf).amax(-1).to(f64)
        bottom = torch.where(finite, x, math.inf).amin(-1).to(f64)
    else:
        top = torch.full((B,), -math.inf, dtype=f64, device=x.device)
        bottom = torch.full((B,), math.inf, dtype=f64, device=x.device)
    return torch.stack(
        (
            finite.sum(-1).to(f64),
            (x == math.inf).sum(-1).to(f64),
            (x != x).sum(-1).to(f64),
            top,
            bottom,
            torch.where(finite, x, 0).sum(-1, dtype=f64),
        ),
        -1,
    )


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


class _Classes(NamedTuple):
    """Which rows are solved, filled or NaN, and their effective k (float64, (B,) each)."""

    kk: torch.Tensor  # k less the +inf count on solved rows; half the finite count elsewhere
    k_total: torch.Tensor  # kk with the +inf entries counted: the residual's target
    solve_rows: torch.Tensor
    sel_none: torch.Tensor
    sel_all: torch.Tensor
    invalid: torch.Tensor


def _classify(rows: _Rows, k: torch.Tensor) -> _Classes:
    """Rows with a NaN on any rank, or whose k the finite entries cannot meet, are NaN; rows
    that select exactly their ``+inf`` entries (k' = 0) or all but their ``-inf`` ones (k' =
    n_fin) are filled; the rest are solved."""
    k_eff = k.to(torch.float64) - rows.n_pinf
    invalid = (rows.n_nan > 0) | (k_eff < 0) | (k_eff > rows.n_fin)
    sel_none = ~invalid & (k_eff <= 0)
    sel_all = ~invalid & (k_eff >= rows.n_fin)
    solve_rows = ~(invalid | sel_none | sel_all)
    kk = torch.where(solve_rows, k_eff, 0.5 * rows.n_fin.clamp(min=1))
    return _Classes(kk, kk + rows.n_pinf, solve_rows, sel_none, sel_all, invalid)


def _sample_centre(rows: _Rows, cls: _Classes, plan: _Plan, dtype: torch.dtype) -> torch.Tensor:
    """The midpoint of the subsample's q-th and (q+1)-th largest, q ~ k ns / n: an estimate of
    the threshold, clamped to the finite range (0 on rows that are not solved)."""
    ns, n = rows.ns, plan.n
    q_top = min(max(round(plan.k_max * ns / n), 1), ns - 1) + 1 if ns > 1 else 1
    q = (cls.k_total * (ns / n)).round().long().clamp(1, max(q_top - 1, 1))
    topv = rows.cand.topk(min(q_top, rows.cand.shape[-1]), dim=-1).values.to(dtype)
    last = topv.shape[-1] - 1
    at, nxt = (q - 1).clamp(max=last)[:, None], q.clamp(max=last)[:, None]
    m = torch.add(0.5 * topv.gather(-1, at), topv.gather(-1, nxt), alpha=0.5).squeeze(-1)
    m = torch.nan_to_num(m, nan=0.0, posinf=math.inf, neginf=-math.inf)
    m = torch.minimum(torch.maximum(m, rows.bottom.to(dtype)), rows.top.to(dtype))
    return torch.where(cls.solve_rows, m, 0)


def _scaled(
    plan: _Plan, rows: _Rows, x: torch.Tensor, eps: torch.Tensor
) -> tuple[_Rows, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows whose epsilon is within ``2**SCALE_BITS`` of ``finfo.max`` on ``(x c, eps c)``, c
    the largest power of two that brings epsilon and the half span below that limit (exact)."""
    limit = torch.finfo(x.dtype).max * 2.0**-SCALE_BITS
    if plan.eps_max <= limit:
        return rows, x, eps, None
    top, bottom = rows.top, rows.bottom
    half = torch.where(top >= bottom, 0.5 * top - 0.5 * bottom, 0).nan_to_num(0.0)
    size = torch.maximum(half, eps.to(torch.float64))
    exponent = torch.frexp(size / limit).exponent.clamp(min=0)
    scale = torch.where(eps > limit, torch.ldexp(torch.ones_like(eps), -exponent), 1)
    c = scale.to(torch.float64)
    rows = rows._replace(
        top=top * c, bottom=bottom * c, total=rows.total * c, cand=rows.cand * c[:, None]
    )
    return rows, x * scale[:, None], eps * scale, scale


def _start_ot(
    plan: _Plan, rows: _Rows, cls: _Classes, eps: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, SolverState]:
    """The centre m and the solver's start (bracket, iterate, residual bounds) of every row."""
    kk, nn_ = cls.kk.to(dtype), rows.n_fin.clamp(min=1).to(dtype)
    solve_rows = cls.solve_rows
    bottom, top = rows.bottom.to(dtype), rows.top.to(dtype)
    zeros = torch.zeros_like(kk)
    logit = torch.log(kk) - torch.log(nn_ - kk)
    if rows.exact:
        depth = rows.depth
        topv = rows.cand.topk(depth, dim=-1).values.to(dtype)  # the row's largest, sorted
        n_pinf = rows.n_pinf.to(dtype)

        def entry(j: torch.Tensor) -> torch.Tensor:
            index = (n_pinf + j - 1).clamp(0, depth - 1).long()
            return topv.gather(-1, index[:, None]).squeeze(-1)

        j_hi = torch.ceil(kk).clamp(min=1)
        j_lo = torch.minimum(torch.floor(kk) + 1, nn_).clamp(min=1)
        x_hi, x_lo = entry(j_hi), entry(j_lo)
        m = torch.where(solve_rows, torch.add(0.5 * x_hi, x_lo, alpha=0.5), zeros)
        # logs of the numerator and denominator apart (a ratio with a subnormal k rounds to 0)
        lo = (x_lo - m) - eps * (torch.log(kk) - torch.log(j_lo - kk))
        hi = (x_hi - m) - eps * (torch.log(kk - (j_hi - 1)) - torch.log(nn_ - kk))
        spread = entry(torch.ones_like(kk)) - bottom
    else:
        m = _sample_centre(rows, cls, plan, dtype)
        lo, hi = (bottom - m) - eps * logit, (top - m) - eps * logit
        spread = top - bottom
    fi = torch.finfo(dtype)
    lo, hi = torch.where(solve_rows, lo, zeros), torch.where(solve_rows, hi, zeros)
    # a few ulps of the scale, within the finite range (an infinite end has no midpoint)
    pad = 4 * fi.eps * (lo.abs() + hi.abs() + eps)
    lo, hi = (lo - pad).clamp(min=-fi.max), (hi + pad).clamp(max=fi.max)
    # The start: the centre, or the large-epsilon guess where epsilon is large for the row.
    xmean = (rows.total / rows.n_fin.clamp(min=1)).to(dtype)
    t_large = torch.nan_to_num(xmean - m - eps * logit, nan=0.0)
    t_large = torch.minimum(torch.maximum(t_large, lo), hi)
    t_mid = torch.minimum(torch.maximum(zeros, lo), hi)
    if rows.exact:
        t0 = torch.where(SMOOTH_START * eps >= spread, t_large, t_mid)
    else:  # the better of the two on the subsample (the same on every rank)
        share = rows.ns / plan.n
        samp = rows.cand.to(dtype)[:, None, :]
        t2 = torch.stack((t_mid, t_large), -1)
        z = ((samp - m[:, None, None]) - t2[..., None]) / eps[:, None, None]
        F2 = torch.sigmoid(z).sum(-1) - (cls.k_total * share).to(dtype)[:, None]
        t0 = t2.gather(-1, F2.abs().argmin(-1, keepdim=True)).squeeze(-1)
    t0 = torch.where(solve_rows, t0, zeros)
    return m, start_state(t0, lo, hi, f_lo=nn_ - kk, f_hi=-kk, done=~solve_rows)


# ----------------------------------------------------------------------------- the iteration


def _shard_pass(
    x: torch.Tensor, m2: torch.Tensor, t2: torch.Tensor, e2: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One pass over the shard at the iterate: its five row sums (signed ``u``, the count of
    ``z > 0``, ``d = u(1 - u)``, the signed ``(1 - 2u) d``, ``u``), the mask and ``s = d/eps``."""
    inv = 1 / e2
    z = ((x - m2) - t2) * inv
    u = torch.sigmoid(-z.abs())
    pos = z > 0
    d = u * (1 - u)
    c = (1 - 2 * u) * d
    sums = (
        torch.where(pos, -u, u).sum(-1),
        pos.sum(-1),
        d.sum(-1),
        torch.where(pos, -c, c).sum(-1),
        u.sum(-1),
    )
    return (*sums, torch.where(pos, 1 - u, u), d * inv)


def _evaluate(
    t: torch.Tensor,
    x: torch.Tensor,
    m2: torch.Tensor,
    e2: torch.Tensor,
    k_total: torch.Tensor,
    tol: float,
    n: int,
    comm: _Comm,
) -> tuple[torch.Tensor, ...]:
    """``F = sum A - k``, ``dF/dt``, the tolerance on ``|F|``, ``F''/F'``, and the by-products
    ``A`` and ``s`` (this shard) and the row's count of ``z > 0``, ``sum u`` and ``sum u(1 -
    u)`` (global, float64): the
    shard's five sums, all-reduced once (float64), and the row's formulas on them."""
    dtype = x.dtype
    f64 = torch.float64
    em = torch.finfo(dtype).eps
    out = _shard_pass(x, m2, t[:, None], e2)
    local = torch.stack([v.to(f64) for v in out[:5]])
    s1, count, d_sum, c_sum, u_sum = comm.sum(local).unbind(0)
    e = e2.squeeze(-1).to(f64)
    F = (count - k_total) + s1  # the count less k first: no cancellation
    slope = d_sum / e
    curv = -(c_sum / d_sum) / e
    floor = torch.minimum(k_total, n - k_total).clamp(0, 1)
    bound = 32 * em * torch.maximum(u_sum, floor) + 2 * em * slope * t.to(f64).abs()
    bound = bound + n / torch.finfo(dtype).max + tol
    return (
        F.to(dtype),
        (-slope).to(dtype),
        bound.to(dtype),
        curv.to(dtype),
        out[5],
        out[6],
        count,
        u_sum,
        d_sum,
    )


def _polish(
    comm: _Comm,
    x: torch.Tensor,
    m2: torch.Tensor,
    e2: torch.Tensor,
    state: SolverState,
    rows: torch.Tensor,
    gap: torch.Tensor,
) -> torch.Tensor | None:
    """:func:`softops.topk._ot.polish` of the near-hard rows of the sharded ``x``: each step
    all-gathers every rank's :func:`~softops.topk._ot.balance_parts` (P, 6, B); ``gap`` is the
    row's count above t less k (global, constant while t stays in its gap). Returns the new
    iterate, or None when no row needs it (then no collective)."""
    if not bool(rows.any()):
        return None

    def balance(t: torch.Tensor) -> torch.Tensor:
        return comm.gather(balance_parts((x - m2) - t[:, None], e2))

    return polish(balance, state.t_eval, state.lo, state.hi, e2.squeeze(-1), rows, gap)


class _Solution(NamedTuple):
    """The sharded solve: this shard's mask and backward weights, and the replicated rows."""

    A: torch.Tensor  # (B, n_r)
    s: torch.Tensor  # (B, n_r), in the caller's units
    aux: torch.Tensor  # (B, 2): the centre m and the threshold t less m (solve units)
    edge: torch.Tensor  # (B,) int8: +1 rows at k' = 0, -1 rows at k' = n_fin, 0 else
    ext: torch.Tensor  # (B, 3): finite max, finite min, finite count (solve units)
    scale: torch.Tensor | None
    converged: torch.Tensor  # (B,) bool (NaN rows and filled rows count as converged)
    residual: torch.Tensor
    iterations: int
    hard: torch.Tensor | None


def _solve_ot(plan: _Plan, x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor) -> _Solution:
    """Solve the threshold of every row of the sharded (B, n_r) ``x``, largest first."""
    rows = _gather_rows(plan, x)
    rows, xs, es, scale = _scaled(plan, rows, x, eps)
    cls = _classify(rows, k)
    m, state = _start_ot(plan, rows, cls, es, x.dtype)
    solve_rows, sel_none, sel_all, invalid = cls[2:]
    block = 1 if x.device.type == "cpu" else BLOCK
    args = (xs, m[:, None], es[:, None], cls.k_total, plan.tol, plan.n, plan.comm)
    state, evaluations = iterate(_evaluate, state, args, max_iter=plan.max_iter, block=block)
    converged = result(state, evaluations).converged | ~solve_rows
    t = state.t_eval
    if state.extra:
        A, s, count, _, d_sum = state.extra
        # the floor of the tolerance (1) leaves t uncertain by 32 em eps / sum u(1 - u): more
        # than sqrt(em) eps there (the weights in k and epsilon go as exp(-|z|))
        near = solve_rows & state.done & near_hard(d_sum, x.dtype)
        gap = count - cls.k_total
        polished = _polish(plan.comm, xs, m[:, None], es[:, None], state, near, gap)
        if polished is not None:
            t = polished
            A, s = _shard_pass(xs, m[:, None], t[:, None], es[:, None])[5:]
    else:  # every row is filled: nothing was evaluated
        A, s = torch.zeros_like(xs), torch.zeros_like(xs)
    A = _fill(A, xs, cls)
    s = torch.where(solve_rows[:, None], s, 0).masked_fill(invalid[:, None], math.nan)
    if scale is not None:  # s = A (1 - A) / eps in the caller's units
        s = s * scale[:, None]
    residual = torch.where(solve_rows, state.residual, 0).masked_fill(invalid, math.nan)
    edge = sel_none.to(torch.int8) - (sel_all & ~sel_none).to(torch.int8)
    aux = torch.stack((m, t), -1)
    ext = torch.stack((rows.top, rows.bottom, rows.n_fin), -1).to(x.dtype)
    return _Solution(
        A, s, aux, edge, ext, scale, converged, residual, evaluations, _hard(plan, x, k, rows)
    )


def _fill(A: torch.Tensor, x: torch.Tensor, cls: _Classes) -> torch.Tensor:
    """The rows that are not solved, exactly: their +inf entries, all but -inf, or NaN."""
    A = torch.where(cls.sel_none[:, None], (x == math.inf).to(x.dtype), A)
    A = torch.where(cls.sel_all[:, None], (x > -math.inf).to(x.dtype), A)
    return A.masked_fill(cls.invalid[:, None], math.nan)


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


def _sparse_pass(
    x: torch.Tensor, m2: torch.Tensor, u2: torch.Tensor, inv2: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The shard's sums at ``u`` (the threshold ``t = m + eps u`` in units of epsilon): ``sum
    a``, the counts of ``z > 0``, ``z >= 0``, ``z >= 1``, ``z > 1`` (``z = y - u``, ``y = (x -
    m)/eps``) and ``sum y`` over the free entries ``0 < z < 1`` (for the closed-form polish)."""
    y = (x - m2) * inv2
    z = y - u2
    free = (z > 0) & (z < 1)
    return (
        z.clamp(0, 1).sum(-1),
        (z > 0).sum(-1),
        (z >= 0).sum(-1),
        (z >= 1).sum(-1),
        (z > 1).sum(-1),
        torch.where(free, y, 0).sum(-1),
    )


def _start_sparse(
    plan: _Plan, rows: _Rows, cls: _Classes, eps: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Centre m, bracket ``[lo, hi]`` on u with residual bounds, and the start u, per row.

    Exact candidates: m is the ``ceil(k)``-th largest entry and the bracket the exact local one
    of the single-process "sparse" (``[(x_(j) - m)/eps - 1, 0]``, ``j = floor(k) + 1``);
    sampled: m is the subsample's estimate and the bracket ``[(min x - m)/eps - 1, (max x -
    m)/eps]`` over the finite entries (every one at 1 at its lower end, at 0 at its upper)."""
    kk = cls.kk.to(dtype)
    solve_rows = cls.solve_rows
    n_fin = rows.n_fin.clamp(min=1).to(dtype)
    zeros = torch.zeros_like(kk)
    inv = 1 / eps
    big = torch.finfo(dtype).max
    j_hi = torch.ceil(kk).clamp(min=1)
    j_lo = torch.floor(kk) + 1
    bottom, top = rows.bottom.to(dtype), rows.top.to(dtype)
    if rows.exact:
        topv = rows.cand.topk(rows.depth, dim=-1).values.to(dtype)
        kt = cls.k_total.to(dtype)
        ranks = torch.stack((torch.ceil(kt), torch.floor(kt) + 1), -1).clamp(1, plan.n)
        pair = topv.gather(-1, (ranks - 1).clamp(0, rows.depth - 1).long())
        m = torch.where(solve_rows, pair[:, 0], zeros)
        y_lo = torch.where(solve_rows, (pair[:, 1] - m) * inv, zeros)
        hi = zeros
        r_lo = torch.where(solve_rows, j_lo - kk, 1)
        r_hi = torch.where(solve_rows, (j_hi - 1) - kk, -1)
    else:
        m = _sample_centre(rows, cls, plan, dtype)
        y_lo = torch.where(solve_rows, (bottom - m) * inv, zeros)
        hi = torch.where(solve_rows, ((top - m) * inv).clamp(max=big), zeros)
        r_lo = torch.where(solve_rows, n_fin - kk, 1)
        r_hi = torch.where(solve_rows, -kk, -1)
    lo = torch.nextafter(y_lo - 1, torch.full_like(y_lo, -math.inf)).clamp(min=-big)
    xmean = (rows.total / rows.n_fin.clamp(min=1)).to(dtype)
    u_large = ((xmean - m) * inv - kk / n_fin).nan_to_num(0.0)
    u_small = (j_hi - 1) - kk
    u = torch.where(SMOOTH_START * eps >= top - bottom, u_large, u_small)
    u = torch.where(solve_rows, torch.minimum(torch.maximum(u, lo), hi), zeros)
    return m, lo, hi, r_lo, r_hi, u


def _solve_sparse(
    plan: _Plan, x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """The sharded "sparse" mask: the finite Newton method of ``softops.topk._sparse`` with its
    five row sums all-reduced per evaluation (and the sum of y over the free entries, for the
    polish, in the same all-reduce). Returns the mask, the rows' convergence, the hard mask
    (or None) and the number of evaluations."""
    comm = plan.comm
    dtype = x.dtype
    rows = _gather_rows(plan, x)
    cls = _classify(rows, k)
    m, lo, hi, r_lo, r_hi, u = _start_sparse(plan, rows, cls, eps, dtype)
    solve_rows = cls.solve_rows
    k_total = cls.k_total
    m2, inv2 = m[:, None], (1 / eps)[:, None]
    done = ~solve_rows
    newton = torch.zeros_like(done)
    exact = torch.zeros_like(done)
    side = torch.zeros_like(u)
    want_pos = want_one = torch.zeros_like(u)
    block = 1 if x.device.type == "cpu" else BLOCK
    sums = _sparse_pass
    size = ones = sum_y = torch.zeros_like(u)
    evaluations = 0
    while not bool(done.all()) or evaluations == 0:
        local = torch.stack([v.to(torch.float64) for v in sums(x, m2, u[:, None], inv2)])
        a_sum, pos, pos0, one, one1, sy = comm.sum(local).unbind(0)
        evaluations += 1
        r = (a_sum - k_total).to(dtype)
        pos, pos0, one, one1 = (v.to(dtype) for v in (pos, pos0, one, one1))
        size, ones, sum_y = pos - one, one, sy.to(dtype)
        # Exact stop: the step's piece was right (the iterate is its root), or r is 0.
        exact = exact | (~done & ((newton & (pos == want_pos) & (one == want_one)) | (r == 0)))
        done = done | exact
        if evaluations >= plan.max_iter or (evaluations % block == 0 and bool(done.all())):
            break
        up = r > 0
        # the linear piece on the side of the step: entries at a breakpoint join it
        want_pos = torch.where(up, pos, pos0)
        want_one = torch.where(up, one1, one)
        free = want_pos - want_one
        below, above = up & ~done, (r < 0) & ~done
        # Illinois: the end that stays twice in a row has its residual halved
        r_lo = torch.where(below, r, torch.where(above & (side < 0), 0.5 * r_lo, r_lo))
        r_hi = torch.where(above, r, torch.where(below & (side > 0), 0.5 * r_hi, r_hi))
        lo = torch.where(below, u, lo)
        hi = torch.where(above, u, hi)
        side = torch.where(below, 1.0, torch.where(above, -1.0, side))
        step = u + r / free.clamp(min=1)  # the piece's root: its slope is -|S| (units of eps)
        newton = (free > 0) & (step > lo) & (step < hi)
        secant = lo + (hi - lo) * (r_lo / (r_lo - r_hi))
        mid = 0.5 * lo + 0.5 * hi
        secant = torch.where((secant > lo) & (secant < hi), secant, mid)
        u_new = torch.where(newton, step, secant)
        # no representable point left between the ends: u is as close as the dtype allows
        done = done | (u_new == u) | (u_new <= lo) | (u_new >= hi)
        u = torch.where(done, u, u_new)
    # Polish the rows stopped on the root's piece: u in closed form on that piece, u = mean_S y
    # - (k - |U|)/|S|, from the last evaluation's sums (so an entry at a breakpoint is exact).
    take = solve_rows & exact & (size > 0)
    u_p = sum_y / size.clamp(min=1) - (k_total.to(dtype) - ones) / size.clamp(min=1)
    u = torch.where(take, u_p, u)
    a = (((x - m2) * inv2) - u[:, None]).clamp(0, 1)
    a = _fill(a, x, cls)
    return a, done | ~solve_rows, _hard(plan, x, k, rows), evaluations


class _ShardedMaskSparse(torch.autograd.Function):
    """This shard of ``a = clip((x - t)/eps, 0, 1)``, ``sum a = k`` over the concatenated row;
    the closed-form backward on the free entries S, with ``|S|`` and the sums over S
    all-reduced (one (3, B) all-reduce; (5, B) with a gradient in epsilon)."""

    @staticmethod
    def forward(
        x: torch.Tensor, k: torch.Tensor, eps: torch.Tensor, plan: _Plan
    ) -> tuple[Any, ...]:
        a, converged, hard, _ = _solve_sparse(plan, x.detach(), k.detach(), eps.detach())
        return a, converged, hard

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
        return sol.A, sol.converged, sol.hard, sol.s, sol.aux, sol.edge, sol.ext, sol.scale

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
        A :class:`softops.solvers.ThresholdResult` (threshold in the units of x; rows that
        select exactly their ``+inf`` or all their non ``-inf`` entries report 0, rows that
        cannot be solved a NaN residual and ``converged=False``).

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
    unsolved = sol.edge != 0
    t = torch.where(unsolved, 0, t)
    t = t if largest else -t
    nan_rows = sol.residual != sol.residual
    return ThresholdResult(
        t.reshape(shape).to(x_local.dtype),
        (sol.converged & ~nan_rows).reshape(shape),
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
