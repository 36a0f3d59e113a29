r"""Batched pool-adjacent-violators (PAV) for decreasing isotonic regression, L2 and KL.

Both problems are solved row by row, on rows that the caller has already sorted:

.. math::

    v_{L2}(y) = \arg\min_{v_1 \ge \dots \ge v_n} \tfrac12 \|v - y\|^2, \qquad
    v_{KL}(s, w) = \arg\min_{v_1 \ge \dots \ge v_n} \langle e^{s - v}, 1\rangle
        + \langle e^{w}, v\rangle .

The solution is constant on contiguous blocks B, with the value ``mean(y_B)`` (L2) or
``logsumexp(s_B) - logsumexp(w_B)`` (KL), found by a stack PAV in O(n) per row; the Jacobian is
block diagonal, so the block ids are all a backward pass needs (docs/math.md §5).

Back ends: each entry point is an operator of torch's registry (:mod:`softops._kernels`):
``softops::isotonic_permutahedron`` and ``softops::isotonic_l2_vjp``. On CPU tensors of float32
and float64 they run the C++ kernels of ``_isotonic_kernel.cpp`` (rows spread over torch's
intra-op threads), built ahead of time by ``python -m softops._kernels``; their reference,
registered for every device, is the torch code of this module (the same answers, far more
slowly). The reference runs where the kernels are not built (after one ``RuntimeWarning``) and on
the reference back end (:func:`softops._kernels.backend`, ``SOFTOPS_KERNELS=0``). Tensors on
another device make a round trip through host memory to the CPU kernel while it is available
(which synchronises the stream); the torch reference runs on their device otherwise. Meta tensors
get outputs of the right shapes and dtypes, without a kernel.

:func:`permutahedron` returns the projection ``z - v`` itself (never ``v``), formed relative to
each block's first entry from the gaps of z: exact at any scale, block values accumulated in
float64, with whether every row was finite. An infinite entry of z pools only with its equal
infinities, whose block gets the limit (the mean of w, or its log-mean-exp); for KL, a row whose z
holds an infinity while w holds one too (or spans beyond the dtype) gives NaN. Rows above
``max / (8 n**2)`` are solved scaled by a power of two (exact: the projection is homogeneous).
:func:`l2_vjp_host_scaled` is the L2 VJP in one pass of the kernel, for a backward that is not
differentiated again, with the derivative along a scaling of z (the soft sort's and rank's
epsilon).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from softops._kernels import Kernel, define, kernels_enabled, plain_eager

__all__ = [
    "KERNEL",
    "block_max",
    "block_mean",
    "block_softmax",
    "block_sum",
    "eager_ops",
    "l2_vjp_host_scaled",
    "permutahedron",
    "scale_factor",
]


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


def _sub(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p - q, and 0 where p == q (also for equal infinities)."""
    return torch.where(p == q, torch.zeros_like(p), p - q)


# --------------------------------------------------------------------------- the operators

KERNEL = Kernel("softops_isotonic", Path(__file__).with_name("_isotonic_kernel.cpp"))
"""The CPU kernels of PAV (``torch.ops.softops_isotonic``)."""


def _host_ops() -> Any:
    """The kernel's operators while the kernel back end is on and the kernel is built, else None:
    for the calls on another device (a round trip through host memory) and the fused VJP."""
    return KERNEL.ops() if kernels_enabled() else None


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


_KERNEL_DTYPES = (torch.float32, torch.float64)
"""The dtypes the kernels are built for; the others (float16, bfloat16) take the reference."""


# The modes of ``permutahedron`` (bits; ``Mode`` in ``_isotonic_kernel.cpp``).
MODE_KL, MODE_SORT_Z, MODE_SORT_W, MODE_EXP, MODE_NEGATE, MODE_INV, MODE_FLIP = (
    1 << i for i in range(7)
)


def _rank_frame(q: torch.Tensor, f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The gaps of z = u / f (B, n) in sorted coordinates, ``d[:, i] = z[:, i - 1] - z[:, i]``
    (``d[:, 0] = 0``), from q, the sorted u (B, n), f (B, 1) and t, the sorted w (B, n), as
    doubles that cannot overflow: ``d_i = min((q_(i-1) - q_i) (1 / f), G)``, 0 between equal
    entries, with ``G = 2 (t_0 - t_(n-1)) + 2 n`` a bound that no block crosses (docs/math.md §5).
    ``rank_frame`` in ``_isotonic_kernel.cpp`` does the same operations in the same order.
    """
    n = q.shape[-1]
    G = 2.0 * (t[:, :1] - t[:, -1:]) + 2.0 * n
    r = 1.0 / f  # (differences times 1 / f, as the kernel forms them)
    a, b = q[:, :-1], q[:, 1:]
    g = torch.where(a == b, 0.0, (a - b) * r)
    g = torch.where(g > G, G, g)
    return torch.cat((torch.zeros_like(q[:, :1]), g), -1)


def _gap_scale(d: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(B, 1): 1, or the power of two that brings a row's largest finite magnitude (of t and
    of the gaps d) below ``max / (8 n**2)``, where no sum of gaps or cross-multiplied comparison
    can overflow (``l2_limit`` in ``_isotonic_kernel.cpp``)."""
    n = t.shape[-1]
    big = torch.maximum(
        torch.where(torch.isfinite(d), d, 0).amax(-1, keepdim=True),
        torch.where(torch.isfinite(t), t.abs(), 0).amax(-1, keepdim=True),
    )
    limit = torch.finfo(t.dtype).max / (8.0 * n * n)
    shift = int(math.frexp(limit)[1]) - torch.frexp(big).exponent - 1
    return torch.where(big > limit, torch.ldexp(torch.ones_like(big), shift), 1.0)


def _block_offsets(d: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The sum of the gaps d from each position's block's first entry (``first``) to it (B, n),
    accumulated entry by entry, restarting at each block (as the kernel)."""
    off = torch.zeros_like(d)
    for j in range(1, d.shape[-1]):
        off[:, j] = torch.where(first[:, j] == j, 0.0, off[:, j - 1] + d[:, j])
    return off


def _torch_project_gaps(
    q: torch.Tensor, d: torch.Tensor, t: torch.Tensor, kl: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """P(z, t) row by row from the gaps d of z (:func:`_rank_frame`; q the sorted u it came from,
    for the rows' non-finite entries) and t (B, n), sorted, all in the accumulation dtype: PAV on
    the gaps, each block keeping its statistics relative to its first entry and its z-span
    (docs/math.md §5; ``project_gaps_row`` in ``_isotonic_kernel.cpp``). Rows holding a NaN, and
    L2 rows with an infinite t, are filled with their limits; rows of huge magnitude are solved
    scaled by a power of two (:func:`_gap_scale`). Returns ``(p, block, bad)``, bad the number of
    rows that held a non-finite entry."""
    B, n = d.shape
    dev, acc_dt = d.device, d.dtype
    nan = (torch.isnan(q) | torch.isnan(t)).any(-1, keepdim=True)
    bad = int((~(torch.isfinite(q) & torch.isfinite(t)).all(-1)).sum())
    finite = bad == 0
    fill = torch.where(nan, math.nan, 0.0)
    special = nan
    if not kl:
        pos, neg = (t == math.inf).any(-1, keepdim=True), (t == -math.inf).any(-1, keepdim=True)
        fill = torch.where(pos & neg, math.nan, torch.where(pos, math.inf, -math.inf))
        fill = torch.where(nan, math.nan, fill)
        special = nan | pos | neg
    if not finite:  # the filled rows run on zeros
        d, t = d.masked_fill(special, 0.0), t.masked_fill(special, 0.0)
    scale = _gap_scale(d, t)
    d0, t0 = d, t  # the row's own frame (where scaled, the output is formed there)
    d, t = d * scale, t * scale
    inv = 1.0 / scale
    c_row, inv_row = scale.view(-1), inv.view(-1)
    rows = torch.arange(B, device=dev)
    ref = torch.zeros(B, n, dtype=torch.int64, device=dev)
    cnt = torch.zeros(B, n, dtype=torch.int64, device=dev)
    acc = torch.zeros(B, n, dtype=acc_dt, device=dev)
    aux = torch.zeros(B, n, dtype=acc_dt, device=dev)
    span = torch.zeros(B, n, dtype=acc_dt, device=dev)
    top = torch.full((B,), -1, dtype=torch.int64, device=dev)

    def gaps(r: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z_P - z_T at the first entries of the blocks k - 1 (P) and k (T), and t_T - t_P."""
        p, c = ref[r, k - 1], ref[r, k]
        zg = span[r, k - 1] + d[r, c]
        dw = _sub(t[r, c], t[r, p]) if kl else -(t[r, p] - t[r, c])
        return zg, -zg, dw

    def violated(k: torch.Tensor) -> torch.Tensor:
        kc = k.clamp(min=1, max=max(n - 1, 0))
        zg, ds, dw = gaps(rows, kc)
        if kl:  # (times c: the comparison in the scaled frame)
            score = (aux[rows, kc] - aux[rows, kc - 1]) - (acc[rows, kc] - acc[rows, kc - 1])
            score = score * c_row + dw - ds
        else:
            cp, ct = cnt[rows, kc - 1].to(acc_dt), cnt[rows, kc].to(acc_dt)
            gap = zg + dw  # (z_P - z_T) - (t_P - t_T)
            score = gap * cp * ct + acc[rows, kc - 1] * ct - acc[rows, kc] * cp
        return (k > 0) & ~(score > 0)  # (a NaN score pools, as in the kernel)

    for i in range(n):
        top += 1
        ref[rows, top] = i
        cnt[rows, top] = 1
        acc[rows, top] = 0.0
        aux[rows, top] = 0.0
        span[rows, top] = 0.0
        need = violated(top)
        while bool(need.any()):
            r, k = rows[need], top[need]
            zg, ds, dw = gaps(r, k)
            if kl:  # (the log-sums in the row's own units)
                acc[r, k - 1] = torch.logaddexp(acc[r, k - 1], acc[r, k] + ds * inv_row[r])
                aux[r, k - 1] = torch.logaddexp(aux[r, k - 1], aux[r, k] + dw * inv_row[r])
            else:
                acc[r, k - 1] += acc[r, k] - cnt[r, k].to(acc_dt) * (zg + dw)
            span[r, k - 1] = zg + span[r, k]
            cnt[r, k - 1] += cnt[r, k]
            top -= need.long()
            need = violated(top)
    blk = _blocks_from_counts(cnt, top)
    first = ref.gather(1, blk)
    if kl:
        rel = (aux - acc).gather(1, blk)
        shift = rel * scale + t.gather(1, first)
    else:
        mean = (acc / cnt.clamp(min=1).to(acc_dt)).gather(1, blk)
        shift = t.gather(1, first) - mean
    p = (0.0 - _block_offsets(d, first)) + shift
    p = p if kl else p / scale
    if bool((scale != 1).any()):
        # Scaled rows: the output formed in the row's own frame, (0 - off_j) - mean_B / c + t_r
        # (L2; t_r itself for a singleton block) or (0 - off_j) + shift (KL), and scaled where
        # that is not finite
        off0 = 0.0 - _block_offsets(d0, first)
        if kl:
            own = off0 + (rel + t0.gather(1, first))
            p = torch.where((scale == 1) | ~torch.isfinite(own), p * inv, own)
        else:
            own = (off0 - mean / scale) + t0.gather(1, first)
            p = torch.where((scale == 1) | ~torch.isfinite(own), p, own)
    if not finite:
        p = torch.where(special, fill, p)
        blk = blk.masked_fill(special, 0)
    return p, blk, bad


def _permutahedron_reference(
    u: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, mode: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _on_host(u) and u.dtype in _KERNEL_DTYPES:  # (another device: the kernel, through host)
        dev = u.device
        p, pz, pw, block, bad = _host_ops().permutahedron(u.cpu(), w.cpu(), eps.cpu(), mode)
        return p.to(dev), pz.to(dev), pw.to(dev), block.to(dev), torch.tensor(bad, device=dev)
    n = u.shape[-1]
    f = (-eps if mode & MODE_FLIP else eps).unsqueeze(1)  # z = u / f (the sort's u * (1 / eps))
    u = u.expand(eps.shape[0], n)
    # z's order is u's (-u's with the flip); its gaps are formed from the sorted u by _rank_frame
    key = -u if mode & MODE_FLIP else u
    if mode & MODE_NEGATE:
        w = -w
    if mode & MODE_EXP:
        w = w.log()
    pz = key.new_empty((key.shape[0], 0), dtype=torch.int64)
    s = u
    if mode & MODE_SORT_Z:
        key, pz = torch.sort(key, dim=-1, descending=True, stable=True)
        s = u.gather(1, pz)
    t, pw = (  # (a single row of w is sorted once)
        torch.sort(w, dim=-1, descending=True, stable=True)
        if mode & MODE_SORT_W
        else (w, w.new_empty((w.shape[0], 0), dtype=torch.int64))
    )
    t = t.expand(eps.shape[0], n)
    acc = _acc_dtype(u)  # in the accumulation dtype, cast back (as the kernel)
    ta, qa = t.to(acc), s.to(acc)
    p, block, bad = _torch_project_gaps(
        qa, _rank_frame(qa, f.to(acc), ta), ta, bool(mode & MODE_KL)
    )
    p = p.to(u.dtype)
    p = p.exp_() if mode & MODE_EXP else p
    if mode & MODE_NEGATE:
        p = torch.rsub(p, 0.0)
    if mode & MODE_SORT_Z:
        p = torch.empty_like(p).scatter(1, pz, p)
    return p, pz, pw, block, torch.tensor(bad, device=u.device)


def _permutahedron_fake(
    u: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, mode: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, n = eps.shape[0], u.shape[-1]
    return (
        u.new_empty((B, n)),
        u.new_empty((B, n if mode & MODE_SORT_Z else 0), dtype=torch.int64),
        u.new_empty((w.shape[0], n if mode & MODE_SORT_W else 0), dtype=torch.int64),
        u.new_empty((B, n), dtype=torch.int64),
        u.new_empty((), dtype=torch.int64),
    )


def _permutahedron_kernel(
    ops: Any, u: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, mode: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if u.dtype not in _KERNEL_DTYPES:
        return _permutahedron_reference(u, w, eps, mode)
    p, pz, pw, block, bad = ops.permutahedron(u, w, eps, mode)  # (bad: an int there)
    return p, pz, pw, block, torch.tensor(bad)


PERMUTAHEDRON_OP = define(
    "softops::isotonic_permutahedron",
    "(Tensor u, Tensor w, Tensor eps, int mode) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    reference=_permutahedron_reference,
    fake=_permutahedron_fake,
    cpu=_permutahedron_kernel,
    kernel=KERNEL,
)
"""The projection of z onto the permutahedron of w, sorts and scaling included
(:func:`permutahedron`)."""


def eager_ops(x: torch.Tensor, eps: torch.Tensor) -> Any:
    """The kernel's operators (``torch.ops.softops_isotonic``) where a call on the rows x (B, n)
    and eps (B,) may run them directly, as :func:`permutahedron` would through its operator: a
    plain eager call (:func:`softops._kernels.plain_eager`; eps a plain tensor too) on non-empty
    CPU rows of a dtype the kernels are built for, with the kernel back end on and the kernel
    built. Else None."""
    if (
        x.is_cpu
        and x.dtype in _KERNEL_DTYPES
        and type(eps) is torch.Tensor
        and x.numel() > 0
        and kernels_enabled()
        and plain_eager(x)
    ):
        return KERNEL.ops()
    return None


def permutahedron(
    u: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, mode: int, read: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, bool]:
    """``P(z, w)`` for each row, in z's order. No autograd.

    z is ``u * (1/eps)`` (``MODE_INV``, the sort: the same z as ``u / eps``) or ``u / eps``
    (``u / -eps`` with ``MODE_FLIP``), taken as its gaps (``_rank_frame``, in double, never
    beyond its range: PAV runs on them, ``_torch_project_gaps``); ``MODE_NEGATE`` gives
    ``-P(z, -w)`` (as ``0 - p``), ``MODE_EXP`` with ``MODE_KL`` ``exp P_E(z, log w)``;
    ``MODE_SORT_Z`` / ``MODE_SORT_W`` sort z / w here
    (descending, stably; else they come sorted descending). One pass of the C++ kernel per row
    on the CPU, the sorts included.

    Args:
        u: (B or 1, n).
        w: (B or 1, n), u's dtype.
        eps: (B,), u's dtype.
        mode: a sum of the ``MODE_*`` bits.
        read: read the count of non-finite rows on the host (False while tracing: ``finite``
            is then False, "not known").

    Returns:
        ``(p, pz, pw, block, finite)``: p (B, n) in z's order; the permutations that sort z
        (B, n) and w (as many rows as w; None where not sorted here); the block ids in sorted
        coordinates; whether every row is known to be finite (True on meta tensors, which
        hold no entry to mark).
    """
    B, n = eps.shape[0], u.shape[-1]
    if u.is_meta or n == 0 or B == 0:
        p, pz, pw, block, _ = (
            _permutahedron_fake(u, w, eps, mode)
            if u.is_meta
            else _permutahedron_reference(u, w, eps, mode)
        )
        finite = True
    else:
        # (on another device the reference runs there, its projection through host memory)
        p, pz, pw, block, bad = PERMUTAHEDRON_OP(_detached(u), _detached(w), _detached(eps), mode)
        finite = read and not bad
    keep_z, keep_w = mode & MODE_SORT_Z, mode & MODE_SORT_W
    return p, pz if keep_z else None, pw if keep_w else None, block, finite


def _l2_vjp_reference(
    g: torch.Tensor,
    pz: torch.Tensor | None,
    pw: torch.Tensor | None,
    block: torch.Tensor,
    want_z: bool,
    want_w: bool,
    u: torch.Tensor | None,
    eps: torch.Tensor | None,
    mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, n = g.shape
    acc = _acc_dtype(g)
    gs = (g if pz is None else g.gather(1, pz)).to(acc)
    mean = block_mean(gs, block)
    f = None
    if eps is not None:
        f = scale_factor(eps, n, mode)
    gz = g.new_empty((B, 0))
    if want_z:
        gz = (gs - mean).to(g.dtype)
        gz = gz if pz is None else torch.empty_like(gz).scatter(1, pz, gz)
        if f is not None:  # through z = u * f or u / f (and the negation)
            gz = -gz if mode & MODE_NEGATE else gz
            gz = gz * f[:, None] if mode & MODE_INV else gz / f[:, None]
    gw = g.new_empty((B, 0))
    if want_w:
        gw = mean.to(g.dtype)
        gw = gw if pw is None else torch.empty_like(gw).scatter(1, pw, gw)
    r = g.new_empty((0,))
    if u is not None and eps is not None and f is not None:
        us = u.expand(B, n).to(acc)
        us = us if pz is None else us.gather(1, pz)
        positions = torch.arange(n, device=g.device).expand(B, n)
        first = torch.full_like(block, n).scatter_reduce(1, block, positions, "amin")
        total = ((gs - mean) * (us - us.gather(1, first.gather(1, block)))).sum(-1)
        rel = (total * f.to(acc) if mode & MODE_INV else total / f.to(acc)).to(g.dtype)
        r = rel / (eps if mode & MODE_NEGATE else -eps)
    return gz, gw, r


def scale_factor(eps: torch.Tensor, n: int, mode: int) -> torch.Tensor:
    """f (B,) with :func:`permutahedron`'s z = u * f (``MODE_INV``: f = 1 / eps, finite for
    every epsilon the ops take, a normal number) or z = u / f (f = +-eps), for the backward: z
    itself is never formed. ``n`` is unused (one signature for every mode)."""
    del n
    if mode & MODE_INV:
        return eps.reciprocal()
    return -eps if mode & MODE_FLIP else eps


def _l2_vjp_fake(g: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, n = g.shape
    want_z, want_w, u, eps = args[3:7]
    return (
        g.new_empty((B, n if want_z else 0)),
        g.new_empty((B, n if want_w else 0)),
        g.new_empty((B if u is not None and eps is not None else 0,)),
    )


L2_VJP_OP = define(
    "softops::isotonic_l2_vjp",
    "(Tensor g, Tensor? pz, Tensor? pw, Tensor block, bool want_z, bool want_w, Tensor? u, "
    "Tensor? eps, int mode) -> (Tensor, Tensor, Tensor)",
    reference=_l2_vjp_reference,
    fake=_l2_vjp_fake,
    cpu=lambda ops, g, *args: (
        ops.l2_vjp(g, *args) if g.dtype in _KERNEL_DTYPES else _l2_vjp_reference(g, *args)
    ),
    kernel=KERNEL,
)
"""The L2 VJP in one pass (:func:`l2_vjp_host_scaled`): ``(gz, gw, ge)``, each empty where not
wanted (gz, gw: (B, 0); ge: (0,))."""


# ---------------------------------------------------------------------------- entry points


def _on_host(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` (not on the CPU) goes through host memory to the CPU kernel."""
    return not t.is_cpu and _host_ops() is not None


def l2_vjp_host_scaled(
    g: torch.Tensor,
    pz: torch.Tensor | None,
    pw: torch.Tensor | None,
    block: torch.Tensor,
    want_z: bool,
    want_w: bool,
    u: torch.Tensor | None,
    eps: torch.Tensor | None,
    mode: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None:
    """The VJP of the L2 projection ``P_Q(z, w)`` in one pass of the kernel (``l2_vjp``), for a
    backward whose gradient is not differentiated again.

    ``g`` (B, n) is the cotangent in z's order; ``pz`` / ``pw`` (B, n) sort z / w descending (None:
    already sorted); ``block`` the block ids in sorted coordinates. With m the block mean of
    ``g[pz]``: ``gz[pz] = g[pz] - m`` and ``gw[pw] = m``. With ``eps`` (B,) (``mode`` as in
    :func:`permutahedron`), gz is taken through z = u * f or u / f (and the negation), and with u
    (B or 1 rows, finite, in z's order) also the gradient in eps (B,): the derivative along a
    scaling of z, ``<J_z^T g, z - z_ref> / -eps`` (``/ eps`` with ``MODE_NEGATE``), z_ref the
    first entry of each block, on the block-relative differences of u (no cancellation, no
    overflow). Returns ``(gz, gw, ge)`` (None where not wanted; ge None without u and eps), or
    None when the kernel is not in use or ``g`` is not on the CPU (the caller then uses the torch
    form).
    """
    if not g.is_cpu or _host_ops() is None:
        return None
    if eps is not None:
        eps = _detached(eps if eps.dtype == g.dtype else eps.to(g.dtype))
        if u is not None:
            u = _detached(u if u.dtype == g.dtype else u.to(g.dtype))
    else:
        u = None
    pw = pw if want_w else None  # (only gw needs it)
    gz, gw, ge = L2_VJP_OP(_detached(g), pz, pw, block, want_z, want_w, u, eps, mode)
    return gz if want_z else None, gw if want_w else None, None if u is None else ge


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
