"""The process group of a sharded call, and its header: the one exchange in which every rank
checks every other rank's arguments, so that inconsistent calls raise the same error everywhere
instead of hanging."""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from softops._core.dims import flatten_to_2d, row_param
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
from softops.topk import THRESHOLD_MAX_ITER, check_mask_k

METHODS = ("ot", "sparse")
"""The methods of :func:`softops.distributed.soft_topk_mask`."""
_HEADER = 18
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_MASK = "distributed.soft_topk_mask"
_THRESHOLD = "distributed.topk_threshold"
_TOPK = "distributed.topk"


class _Comm:
    """The process group of a call: this rank, the world size, and the two collectives, both
    ``all_reduce`` (SUM) so that every backend runs them (a gather sums zero-padded slots)."""

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
        all-reduce (the solvers' ``Reduce``)."""
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
    """One all-reduce of every rank's header (a rank whose own validation failed takes part with
    its error flag set); every rank then raises the same error, or none."""
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
