r"""Batched pool-adjacent-violators (PAV) for decreasing isotonic regression, L2 and KL.

Both problems are solved row by row, on rows that the caller has already sorted:

.. math::

    v_{L2}(y) = \arg\min_{v_1 \ge \dots \ge v_n} \tfrac12 \|v - y\|^2, \qquad
    v_{KL}(s, w) = \arg\min_{v_1 \ge \dots \ge v_n} \langle e^{s - v}, 1\rangle
        + \langle e^{w}, v\rangle .

The solution is constant on contiguous blocks B, with the value ``mean(y_B)`` (L2) or
``logsumexp(s_B) - logsumexp(w_B)`` (KL). The stack algorithm pushes one block per entry and pools
the top two blocks while they violate the order (``value(prev) <= value(top)``), so it costs O(n)
per row. The block id of every position is returned too: the Jacobian is block diagonal, which is
all a backward pass needs (docs/math.md §5).

Backends:

- ``"numba"``: compiled kernels (``_isotonic_numba.py``, ``cache=True``, imported on first use),
  serial below ``PARALLEL_MIN_WORK`` entries and ``prange`` over the rows above it, on at most
  ``torch.get_num_threads()`` threads; before numba's first parallel launch the workqueue
  threading layer is selected (unless the user chose one), since OpenMP workers spin after each
  region and slow torch's own threads down. One parallel launch runs at a time; a concurrent
  call runs serially. They are used when numba is installed (``pip install softops[pav]``) and
  the kernel back end is on (the default; ``SOFTOPS_KERNELS=0`` turns it off). The first call in a
  fresh environment compiles the kernel for its dtype (a few seconds); numba caches it on disk.
  Tensors on another device (CUDA) make a round trip through host memory, which synchronises
  the stream (a GPU kernel is out of scope).
- ``"torch"``: the reference, in plain torch on the tensor's own device, vectorised over the batch
  and looping over n in Python. It gives the same answers, far more slowly. It is used when numba
  is missing (a ``RuntimeWarning`` is raised once per process, on a CPU) or the fused paths are
  turned off (the reference back end, :func:`softops._kernels.backend`).

The projection kernels also report whether every row was finite (``Projection.finite``), so that a
caller applies the limits of non-finite entries only when there are some, without a pass of its
own; :func:`l2_vjp_host` is the L2 VJP in one compiled pass (gather, block mean, scatter), for a
backward whose gradient is not differentiated again (the torch form, with the helpers at the end
of this module, is the reference and serves every other case); :func:`l2_vjp_host_scaled` adds,
in the same pass, the derivative along a scaling of z (the soft sort's and rank's epsilon).

Meta tensors (shape inference) get outputs of the right shapes and dtypes from every entry point,
without a backend: there are no values to pool.

Block values are accumulated in float64 (on devices that have it) whatever the input dtype, and
cast back. :func:`project_l2` and :func:`project_kl` return the projection ``s - v`` itself,
formed relative to each block's first entry (what the soft sort and rank need, exact at any
scale), infinities included: an infinite entry of s is an infinite gap to its finite neighbours,
so it pools only with its equal infinities, whose block gets the limit (the mean of w, or its
log-mean-exp), and the finite entries beside it keep the exact frame (there is no s - (s - w) to
cancel). L2 rows of huge magnitude (above ``max / (8 n**2)``, where a gap or a comparison could
overflow) are solved scaled by a power of two, which is exact: the projection is homogeneous.
:func:`isotonic_l2` and :func:`isotonic_kl` return ``v``.
"""

from __future__ import annotations

import importlib.util
import math
import threading
import warnings
from types import ModuleType
from typing import Any, NamedTuple

import torch

from softops._kernels import kernels_enabled

__all__ = [
    "HAVE_NUMBA",
    "IsotonicResult",
    "Projection",
    "block_max",
    "block_mean",
    "block_softmax",
    "block_sum",
    "isotonic_kl",
    "isotonic_l2",
    "l2_vjp_host",
    "l2_vjp_host_scaled",
    "project_kl",
    "project_l2",
]

# numba is an optional dependency (the `pav` extra); it is imported on first use, not here.
HAVE_NUMBA = importlib.util.find_spec("numba") is not None

_BACKENDS = ("numba", "torch")
_state: dict = {"warned": False}


class IsotonicResult(NamedTuple):
    """The solution ``v`` (B, n) and the block id of each position (B, n), int64, from 0."""

    v: torch.Tensor
    block: torch.Tensor


class Projection(NamedTuple):
    """The projection ``p = s - v`` (B, n), the block id of each position (B, n), int64, and
    whether every row of s and w was finite (False: some row held an infinity or a NaN, where p
    is the projection's limit, and the caller may want to mark those entries; also False on meta
    tensors, where it is unknown)."""

    p: torch.Tensor
    block: torch.Tensor
    finite: bool


# Rows times columns below which the numba kernels run serially: a parallel launch costs more than
# it saves there, and numba's worker threads then compete with torch's (and other processes') for
# the cores. At 64 x 1e3 the serial kernel takes about 0.4 ms against a 5 ms fwd+bwd soft_rank.
PARALLEL_MIN_WORK = 1 << 18
_PARALLEL_LOCK = threading.Lock()


# ----------------------------------------------------------------------------- numba kernels


def _kernels() -> ModuleType | None:
    """The compiled kernels (``_isotonic_numba``), or None when numba cannot be imported."""
    if "kernels" not in _state:
        kernels: ModuleType | None
        try:
            from softops._core import _isotonic_numba as kernels
        except ImportError as err:  # installed but broken (e.g. an incompatible numpy)
            warnings.warn(
                f"softops: numba could not be imported ({err}); PAV uses its torch fallback.",
                RuntimeWarning,
                stacklevel=4,
            )
            kernels = None
        _state["kernels"] = kernels
    return _state["kernels"]


def _compiled() -> ModuleType:
    """The kernels, for the numba backend (chosen only when they import)."""
    kernels = _kernels()
    if kernels is None:  # pragma: no cover - the backend choice rules this out
        raise RuntimeError("softops: the numba PAV kernels are not available.")
    return kernels


def _numba_l2(y: torch.Tensor) -> IsotonicResult:
    import numpy as np

    yc = y.detach().cpu().contiguous().numpy()
    B, n = yc.shape
    v = np.empty_like(yc)
    block = np.empty((B, n), dtype=np.int64)
    _compiled().pav_l2(yc, v, block, np.empty((B, n)), np.empty((B, n), dtype=np.int64))
    return IsotonicResult(torch.from_numpy(v).to(y.device), torch.from_numpy(block).to(y.device))


def _numba_kl(s: torch.Tensor, w: torch.Tensor) -> IsotonicResult:
    import numpy as np

    sc = s.detach().cpu().contiguous().numpy()
    wc = w.detach().cpu().to(s.dtype).contiguous().numpy()
    B, n = sc.shape
    v = np.empty_like(sc)
    block = np.empty((B, n), dtype=np.int64)
    work = (np.empty((B, n)), np.empty((B, n)), np.empty((B, n), dtype=np.int64))
    _compiled().pav_kl(sc, wc, v, block, *work)
    return IsotonicResult(torch.from_numpy(v).to(s.device), torch.from_numpy(block).to(s.device))


def _numba_threads(work: int, rows: int) -> int:
    """How many numba threads a kernel over ``rows`` rows and ``work`` entries gets: 1 (serial)
    below ``PARALLEL_MIN_WORK``, else at most torch's own thread count (and numba's maximum)."""
    if work < PARALLEL_MIN_WORK or rows < 2:
        return 1
    import numba

    most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    return max(1, min(torch.get_num_threads(), most, rows))


def _configure_threading() -> None:
    """Before numba's first parallel launch: pick a threading layer whose idle workers sleep.

    numba's default order tries TBB, then OpenMP, whose workers spin after each parallel region
    (GNU OpenMP's default wait policy) and slow torch's own threads down. The workqueue layer
    ships with numba and parks its workers. A layer the user chose (``NUMBA_THREADING_LAYER``,
    or ``numba.config.THREADING_LAYER`` set before the first call) is left alone.
    """
    if _state.get("threading"):
        return
    _state["threading"] = True
    import os

    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":  # type: ignore[attr-defined]
        numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]


def _host(t: torch.Tensor, dtype: torch.dtype) -> Any:
    """t as a C-contiguous numpy array of ``dtype`` (no copy when it already is one on the CPU:
    a small call is dominated by such per-op costs)."""
    t = t.detach()
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        t = t.to("cpu", dtype).contiguous()
    return t.numpy()


def _numba_project(s: torch.Tensor, w: torch.Tensor, kl: bool) -> Projection:
    import numpy as np

    sc, wc = _host(s, s.dtype), _host(w, s.dtype)
    B, n = max(sc.shape[0], wc.shape[0]), sc.shape[1]
    out = np.empty((B, n), dtype=sc.dtype)
    block = np.empty((B, n), dtype=np.int64)
    kernels = _compiled()
    threads = _numba_threads(B * n, B)
    # One parallel launch at a time (the workqueue layer must not be entered from two threads at
    # once); a call that finds it busy runs serially rather than wait.
    if threads > 1 and _PARALLEL_LOCK.acquire(blocking=False):
        try:
            import numba

            _configure_threading()
            kernel = kernels.proj_kl_parallel if kl else kernels.proj_l2_parallel
            previous = numba.get_num_threads()
            numba.set_num_threads(threads)
            try:
                bad = kernel(sc, wc, out, block)
            finally:
                numba.set_num_threads(previous)
        finally:
            _PARALLEL_LOCK.release()
    else:
        kernel = kernels.proj_kl_serial if kl else kernels.proj_l2_serial
        bad = kernel(sc, wc, out, block)
    p, blocks = torch.from_numpy(out), torch.from_numpy(block)
    if s.device.type != "cpu":
        p, blocks = p.to(s.device), blocks.to(s.device)
    return Projection(p, blocks, bad == 0)


# ------------------------------------------------------------------------- torch reference


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.device.type == "mps" else torch.float64


def _blocks_from_counts(cnt: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Block id per position from the stack's counts (B, n) and top index (B,)."""
    B, n = cnt.shape
    live = torch.arange(n, device=cnt.device) <= top[:, None]
    ends = torch.where(live, cnt, 0).cumsum(-1)  # ends[k] = one past the last position of block k
    positions = torch.arange(n, device=cnt.device).expand(B, n).contiguous()
    return torch.searchsorted(ends, positions, right=True)


def _torch_pav(
    s: torch.Tensor, w: torch.Tensor | None, sub: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack PAV over all rows at once; ``w is None`` selects L2 (on ``s - sub``, or ``s``), else
    KL."""
    if w is None and sub is not None:
        s = s.detach().to(_acc_dtype(s)) - sub.detach().to(_acc_dtype(s))
    B, n = s.shape
    dev, acc = s.device, _acc_dtype(s)
    kl = w is not None
    a = torch.zeros(B, n, dtype=acc, device=dev)  # L2: block sums; KL: logsumexp(s_B)
    c = torch.zeros(B, n, dtype=acc, device=dev)  # L2: block counts; KL: logsumexp(w_B)
    cnt = torch.zeros(B, n, dtype=torch.int64, device=dev)
    top = torch.full((B,), -1, dtype=torch.int64, device=dev)
    rows = torch.arange(B, device=dev)
    s_acc = s.detach().to(acc)
    w_acc = w.detach().to(acc) if w is not None else torch.ones_like(s_acc)
    ones = torch.ones(B, dtype=torch.int64, device=dev)

    def violated(t: torch.Tensor) -> torch.Tensor:
        p = (t - 1).clamp(min=0)
        if kl:
            return (t > 0) & (a[rows, p] - c[rows, p] <= a[rows, t] - c[rows, t])
        return (t > 0) & (a[rows, p] * c[rows, t] <= a[rows, t] * c[rows, p])

    for i in range(n):
        top += 1
        a[rows, top] = s_acc[:, i]
        c[rows, top] = w_acc[:, i]
        cnt[rows, top] = ones
        need = violated(top)
        while bool(need.any()):
            r, t = rows[need], top[need]
            if kl:
                a[r, t - 1] = torch.logaddexp(a[r, t - 1], a[r, t])
                c[r, t - 1] = torch.logaddexp(c[r, t - 1], c[r, t])
            else:
                a[r, t - 1] += a[r, t]
                c[r, t - 1] += c[r, t]
            cnt[r, t - 1] += cnt[r, t]
            top -= need.long()
            need = violated(top)
    block = _blocks_from_counts(cnt, top)
    value = a - c if kl else a / c
    return value.gather(1, block).to(s.dtype), block


def _sub(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p - q, and 0 where p == q (also for equal infinities)."""
    return torch.where(p == q, torch.zeros_like(p), p - q)


def _l2_scale(sa: torch.Tensor, wa: torch.Tensor) -> torch.Tensor:
    """(B, 1): 1, or the power of two that brings a row's largest finite magnitude below
    ``max / (8 n**2)``, where the L2 frame's gaps and cross-multiplied comparisons cannot overflow
    (``_isotonic_numba._l2_limit``)."""
    n = sa.shape[-1]
    big = torch.maximum(
        torch.where(torch.isfinite(sa), sa.abs(), 0).amax(-1, keepdim=True),
        torch.where(torch.isfinite(wa), wa.abs(), 0).amax(-1, keepdim=True),
    )
    limit = torch.finfo(sa.dtype).max / (8.0 * n * n)
    shift = int(math.frexp(limit)[1]) - torch.frexp(big).exponent - 1
    return torch.where(big > limit, torch.ldexp(torch.ones_like(big), shift), 1.0)


def _torch_project(s: torch.Tensor, w: torch.Tensor, kl: bool) -> Projection:
    """``p = s - v(s, w)`` row by row, in the frame of the numba kernels (``_isotonic_numba``):
    blocks keep their statistics relative to their first position, and adjacent blocks are
    compared through gaps of the sorted inputs, formed by ``_sub`` (0 between equal infinities),
    so that infinities of s (and, for KL, of w) take the same formulas. Rows holding a NaN, and
    L2 rows with an infinite w, are filled with their limits (NaN, or that infinity)."""
    B, n = s.shape
    dev, acc_dt = s.device, _acc_dtype(s)
    sa, wa = s.detach().to(acc_dt), w.detach().to(acc_dt)
    nan = (torch.isnan(sa) | torch.isnan(wa)).any(-1, keepdim=True)
    finite = bool((torch.isfinite(sa) & torch.isfinite(wa)).all())
    fill = torch.where(nan, math.nan, 0.0)
    special = nan
    if not kl:
        pos, neg = (wa == math.inf).any(-1, keepdim=True), (wa == -math.inf).any(-1, keepdim=True)
        fill = torch.where(pos & neg, math.nan, torch.where(pos, math.inf, -math.inf))
        fill = torch.where(nan, math.nan, fill)
        special = nan | pos | neg
    if not finite:  # the filled rows run on zeros
        sa, wa = sa.masked_fill(special, 0.0), wa.masked_fill(special, 0.0)
    scale = _l2_scale(sa, wa) if not kl else None
    if scale is not None:
        sa, wa = sa * scale, wa * scale
    rows = torch.arange(B, device=dev)
    ref = torch.zeros(B, n, dtype=torch.int64, device=dev)
    cnt = torch.zeros(B, n, dtype=torch.int64, device=dev)
    acc = torch.zeros(B, n, dtype=acc_dt, device=dev)
    aux = torch.zeros(B, n, dtype=acc_dt, device=dev)
    top = torch.full((B,), -1, dtype=torch.int64, device=dev)

    def gaps(r: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, q = ref[r, t - 1], ref[r, t]
        return _sub(sa[r, q], sa[r, p]), _sub(wa[r, q], wa[r, p])  # s_t - s_p, w_t - w_p

    def violated(t: torch.Tensor) -> torch.Tensor:
        tc = t.clamp(min=1, max=max(n - 1, 0))
        ds, dw = gaps(rows, tc)
        if kl:
            score = (aux[rows, tc] - aux[rows, tc - 1]) - (acc[rows, tc] - acc[rows, tc - 1])
            score = score + dw - ds
        else:
            cp, ct = cnt[rows, tc - 1].to(acc_dt), cnt[rows, tc].to(acc_dt)
            score = (dw - ds) * cp * ct + acc[rows, tc - 1] * ct - acc[rows, tc] * cp
        return (t > 0) & (score <= 0)

    for i in range(n):
        top += 1
        ref[rows, top] = i
        cnt[rows, top] = 1
        acc[rows, top] = 0.0
        aux[rows, top] = 0.0
        need = violated(top)
        while bool(need.any()):
            r, t = rows[need], top[need]
            ds, dw = gaps(r, t)
            if kl:
                acc[r, t - 1] = torch.logaddexp(acc[r, t - 1], acc[r, t] + ds)
                aux[r, t - 1] = torch.logaddexp(aux[r, t - 1], aux[r, t] + dw)
            else:
                acc[r, t - 1] += acc[r, t] - cnt[r, t].to(acc_dt) * (dw - ds)
            cnt[r, t - 1] += cnt[r, t]
            top -= need.long()
            need = violated(top)
    blk = _blocks_from_counts(cnt, top)
    first = ref.gather(1, blk)
    w_ref = wa.gather(1, first)
    if kl:
        shift = (aux - acc).gather(1, blk) + w_ref
    else:
        shift = w_ref - (acc / cnt.clamp(min=1).to(acc_dt)).gather(1, blk)
    p = _sub(sa, sa.gather(1, first)) + shift
    if scale is not None:
        p = p / scale
    if not finite:
        p = torch.where(special, fill, p)
        blk = blk.masked_fill(special, 0)
    return Projection(p.to(s.dtype), blk, finite)


def _warn_fallback(device: torch.device) -> None:
    if device.type == "cpu" and kernels_enabled() and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            "softops: numba is not installed, so PAV (the soft sort/rank method 'pav') runs on "
            "its pure-torch fallback, which loops over n in Python and is much slower. Install "
            "the extra: pip install 'softops[pav]'.",
            RuntimeWarning,
            stacklevel=4,
        )


def _backend(backend: str | None) -> str:
    if backend is None:
        return "numba" if kernels_enabled() and HAVE_NUMBA and _kernels() is not None else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"isotonic: expected `backend` in {_BACKENDS} or None; got {backend!r}.")
    if backend == "numba" and not (HAVE_NUMBA and _kernels() is not None):
        raise ValueError("isotonic: backend='numba' needs numba; pip install 'softops[pav]'.")
    return backend


def isotonic_l2(y: torch.Tensor, *, backend: str | None = None) -> IsotonicResult:
    """Decreasing L2 isotonic regression of each row of ``y`` (B, n). No autograd.

    Args:
        y: a (B, n) floating tensor.
        backend: ``"numba"``, ``"torch"`` or None (numba when available and enabled).

    Returns:
        ``IsotonicResult(v, block)``: ``v`` has the dtype and device of ``y``.
    """
    if y.shape[-1] == 0 or y.shape[0] == 0 or y.is_meta:
        return IsotonicResult(y.detach().clone(), torch.zeros_like(y, dtype=torch.int64))
    if _backend(backend) == "numba":
        return _numba_l2(y)
    if backend is None:
        _warn_fallback(y.device)
    return IsotonicResult(*_torch_pav(y, None))


def isotonic_kl(s: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> IsotonicResult:
    """Decreasing KL isotonic regression ``v_KL(s, w)`` of each row (B, n). No autograd.

    Args:
        s: a (B, n) floating tensor.
        w: a tensor broadcastable to ``s``.
        backend: ``"numba"``, ``"torch"`` or None (numba when available and enabled).

    Returns:
        ``IsotonicResult(v, block)``: ``v`` has the dtype and device of ``s``.
    """
    w = w.to(s.dtype).expand_as(s)
    if s.shape[-1] == 0 or s.shape[0] == 0 or s.is_meta or w.is_meta:
        return IsotonicResult(s.detach().clone(), torch.zeros_like(s, dtype=torch.int64))
    if _backend(backend) == "numba":
        return _numba_kl(s, w)
    if backend is None:
        _warn_fallback(s.device)
    return IsotonicResult(*_torch_pav(s, w))


def _project(s: torch.Tensor, w: torch.Tensor, kl: bool, backend: str | None) -> Projection:
    B = max(s.shape[0], w.shape[0])
    n = s.shape[-1]
    if s.is_meta or w.is_meta:  # shape inference (meta tensors): no data to pool, shapes only
        meta = torch.device("meta")
        return Projection(
            torch.empty(B, n, dtype=s.dtype, device=meta),
            torch.empty(B, n, dtype=torch.int64, device=meta),
            False,
        )
    if n == 0 or B == 0:
        empty = s.detach().expand(B, n).clone()
        return Projection(empty, torch.zeros(B, n, dtype=torch.int64, device=s.device), True)
    if _backend(backend) == "numba":
        return _numba_project(s, w, kl)
    if backend is None:
        _warn_fallback(s.device)
    return _torch_project(s.expand(B, n), w.to(s.dtype).expand(B, n), kl)


def project_l2(s: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> Projection:
    r"""The Euclidean projection ``P_Q(s, w) = s - v_Q(s, w)`` of each row (B, n). No autograd.

    ``s`` and ``w`` are (B, n) or (1, n) (one row for every row), each sorted descending; ``v_Q``
    is the decreasing isotonic fit of ``s - w``. The result is formed without ``v`` (which can be
    far larger than it): a singleton block gives ``w_i`` exactly, at any scale of ``s``.

    Args:
        s: a floating tensor, rows sorted descending.
        w: a tensor with rows sorted descending, cast to ``s``'s dtype.
        backend: ``"numba"``, ``"torch"`` or None (numba when available and enabled).

    Returns:
        ``Projection(p, block, finite)``: ``p`` has the dtype and device of ``s``.

    Example:
        >>> s = torch.tensor([[3e8, 2e8, 1e8]])
        >>> project_l2(s, torch.tensor([[3.0, 2.0, 1.0]]), backend="torch").p
        tensor([[3., 2., 1.]])
    """
    return _project(s, w, False, backend)


def project_kl(s: torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> Projection:
    r"""The KL projection ``P_E(s, w) = s - v_E(s, w)`` of each row (B, n). No autograd.

    Shapes and order as for :func:`project_l2`; ``v_E`` has the block values
    ``logsumexp(s_B) - logsumexp(w_B)``, formed relative to each block's first position.
    """
    return _project(s, w, True, backend)


def l2_vjp_host(
    g: torch.Tensor,
    pz: torch.Tensor | None,
    pw: torch.Tensor | None,
    block: torch.Tensor,
    want_z: bool,
    want_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """The VJP of the L2 projection ``P_Q(z, w)`` in one compiled pass (``_isotonic_numba.l2_vjp``).

    ``g`` (B, n) is the cotangent in z's order; ``pz`` / ``pw`` (B, n) sort z / w descending (None:
    already sorted); ``block`` the block ids in sorted coordinates. Returns ``(gz, gw)`` (None
    where not wanted), with m the block mean of ``g[pz]``: ``gz[pz] = g[pz] - m`` and
    ``gw[pw] = m``, or None when the numba kernels are not in use or ``g`` is not on the CPU
    (the caller then uses the torch form, which is also the one to use when the gradient itself
    is to be differentiated: this pass is not).
    """
    res = l2_vjp_host_scaled(g, pz, pw, block, want_z, want_w, None, None, False)
    return None if res is None else res[:2]


def l2_vjp_host_scaled(
    g: torch.Tensor,
    pz: torch.Tensor | None,
    pw: torch.Tensor | None,
    block: torch.Tensor,
    want_z: bool,
    want_w: bool,
    u: torch.Tensor | None,
    f: torch.Tensor | None,
    inv: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None:
    """:func:`l2_vjp_host`, and with z = u * f (``inv``) or u / f (u: B or 1 rows, finite, in z's
    order; f: B, one per row) also, in the same pass, ``r`` (B,)
    ``= sum_j (g[pz]_j - m_j) (s_j - s_ref(j))``, s = z[pz] and s_ref the first entry of j's
    block: ``<J_z^T g, z>``, the derivative along a scaling of z, taken on the block-relative
    differences of u (no cancellation of |z| >> its gaps, no overflow of z). Returns
    ``(gz, gw, r)`` (r None without u), or None as :func:`l2_vjp_host` does.
    """
    if g.device.type != "cpu" or _backend(None) != "numba":
        return None
    import numpy as np

    B, n = g.shape
    none = np.empty((B, 0), dtype=np.int64)
    gc = _host(g, g.dtype)
    gz = np.empty((B, n if want_z else 0), dtype=gc.dtype)
    gw = np.empty((B, n if want_w else 0), dtype=gc.dtype)
    perm_z = none if pz is None else _host(pz, torch.int64)
    perm_w = none if pw is None else _host(pw, torch.int64)
    blocks = _host(block, torch.int64)
    r = None
    if u is None or f is None:
        _compiled().l2_vjp(gc, perm_z, perm_w, blocks, gz, gw)
    else:
        r = np.empty(B, dtype=gc.dtype)
        uc, fc = _host(u, g.dtype), _host(f.reshape(-1), g.dtype)
        _compiled().l2_vjp_scaled(gc, perm_z, perm_w, blocks, gz, gw, uc, fc, inv, r)
    return (
        torch.from_numpy(gz) if want_z else None,
        torch.from_numpy(gw) if want_w else None,
        None if r is None else torch.from_numpy(r),
    )


# --------------------------------------------------------------------- blockwise helpers (VJP)


def block_sum(g: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The sum of ``g`` over each position's block, at every position (differentiable in g)."""
    return torch.zeros_like(g).scatter_add(1, block, g).gather(1, block)


def block_mean(g: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The mean of ``g`` over each position's block, at every position (differentiable in g)."""
    count = torch.zeros_like(g).scatter_add(1, block, torch.ones_like(g)).gather(1, block)
    return block_sum(g, block) / count


def block_max(s: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The largest entry of ``s`` over each position's block, at every position (detached)."""
    m = torch.full_like(s, -math.inf).scatter_reduce(1, block, s.detach(), "amax")
    return m.gather(1, block)


def block_softmax(
    s: torch.Tensor, block: torch.Tensor, m: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(s_B)`` within each block, at every position (differentiable in s); ``m`` is
    ``block_max(s, block)`` when the caller has it."""
    m = block_max(s, block) if m is None else m
    finite = torch.isfinite(m)
    # A block whose largest entry is infinite: its mass sits on the entries equal to that
    # infinity (all of the block when it is all -inf); s - m would be inf - inf there.
    d = torch.where(finite, s - torch.where(finite, m, 0), torch.where(s == m, 0.0, -math.inf))
    e = torch.exp(d)
    return e / block_sum(e, block)
