r"""SoftSort backend: ``P = softmax(-d(sort(x), x) / epsilon)`` row-wise.

Reference: S. Prillo and J. Eisenschlos, *SoftSort: A Continuous Relaxation for the argsort
Operator*, ICML 2020 (arXiv 2006.16038).

Private backend of :mod:`softops.sort`, with the one backend signature
``sort/rank/argsort(x2, eps, descending, opts, offset=None)`` (``softops.sort._dispatch``):
canonical tensors ``x2`` (B, n) of dtype float32 or float64 and ``eps`` (B,) positive (it may
require grad), ``opts.distance`` "l1" or "l2"; no validation.

Deviations from the paper's notation (Prillo & Eisenschlos 2020, §3, where
:math:`\mathrm{SoftSort}^d_\tau(s) = \mathrm{softmax}(-d(\mathrm{sort}(s)\,1^\top,
1\,s^\top)/\tau)`):

* The paper's temperature :math:`\tau` is ``epsilon``, in the units of x for ``distance="l1"``
  and of x² for ``distance="l2"``. Scaling laws: ``sort(c x, c e) = c sort(x, e)`` (l1) and
  ``sort(c x, c² e) = c sort(x, e)`` (l2), for c > 0; ranks and P are unchanged.
* The paper sorts in descending order. Here ``descending=False`` (the default of the public API)
  uses ``sort(x)`` ascending, so ``P @ x`` is ascending; ``descending=True`` flips the rows of P.
* Soft ranks use the estimator :math:`r_j = \sum_i i\,P_{ij}` (1-based positions i of the output
  order; rank 1 is the smallest when ``descending=False``). P is row-stochastic only, so the
  column weights :math:`\sum_i P_{ij}` are not 1 and r is **not confined to** [1, n], nor do the
  ranks sum to n(n+1)/2. As epsilon -> 0 (distinct values) r tends to the hard 1-based ranks.

Algorithms:

* **l1, values and ranks: exact O(n log n) time, O(n) memory** (not in the paper, which forms
  the n x n matrix). The Laplace kernel :math:`k_{ij} = e^{-|u_i-u_j|/\varepsilon}` on the sorted
  points u is semiseparable: with the decays :math:`d_i = e^{-(u_i - u_{i-1})/\varepsilon} \in
  [0, 1]` (:math:`d_0 = 0`), the left sums :math:`L_i = \sum_{j \le i} w_j k_{ij}` obey the linear
  recurrence :math:`L_i = w_i + d_i L_{i-1}`, and the right sums its mirror. Each sum is kept
  in the local frame of its own point, so every operation adds or multiplies non-negative
  numbers: nothing cancels and nothing overflows, at any span / epsilon. The normalisers are
  :math:`Z_i = L_i + R_i` (``w = 1``, R exclusive); the values are
  :math:`v_i = u_i + (M^R_i - M^L_i)/Z_i` with the first moments
  :math:`M^L_i = \sum_{j<i} k_{ij}(u_i - u_j) = d_i(\delta_i L_{i-1} + M^L_{i-1})`,
  :math:`\delta_i = u_i - u_{i-1}`, and the mirror :math:`M^R`; the ranks are the same kernel
  sums with weights ``pos_i / Z_i`` at the points u, un-sorted. Values are a mean, so they are
  clamped to [min x, max x] against rounding; tied entries get equal values and ranks to a few
  ulps; every gap above 800 epsilon decouples exactly (``exp(-800) == 0`` in float64, where the
  scans run). The recurrences are a log-depth two-level parallel scan (:func:`linear_recurrence`)
  with an adjoint-recurrence backward written in the same scan, so autograd keeps O(n), and
  second derivatives and forward mode work. At exact ties SoftSort is not differentiable (|.| at
  its kink); this path and the dense formula pick different subgradients there, and agree
  everywhere else.
* **l2 values and ranks, and the full P** (``argsort``, any distance): rows of P are processed
  in checkpointed blocks by :func:`softops.sort._chunked.chunked_rows` (at most
  ``BLOCK_ELEMENTS`` entries at once), so the peak extra memory is O(B n block) instead of
  O(B n²) (besides the (B, n, n) output of ``argsort`` itself).

* **Extremes.** The dense kernels work on ``x / s`` (s a power of two, :func:`row_scale`) and
  take the scale back in one factor ``s / eps**p = exp(log s - p log eps)``
  (:func:`scaled_inverse`); the l1 scans use ``1/eps = exp(-log eps)`` (:func:`inverse`). So
  neither the forward nor the backward forms ``eps**2`` or a distance beyond the dtype: the
  gradients are finite at an epsilon far below the gaps (0 there, the hard limit) and at spans
  up to the dtype's largest value, wherever the derivative itself is.

Non-finite inputs: a NaN gives NaN in its own row only. Rows containing ``±inf`` give NaN here
(an infinite sorted value has no finite distance to itself); the public layer
(:mod:`softops.sort`) takes them to their limits before calling this backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from softops.sort._chunked import chunked_rows, positions
from softops.sort._options import MethodOptions

__all__ = ["argsort", "inverse", "rank", "row_scale", "scaled_inverse", "sort"]

_SCAN_BLOCK = 32
"""Steps per block of the two-level scan (:func:`_scan_forward`)."""

_GAP_CAP = 800.0
"""exp(-800) == 0 in float64: gaps beyond 800 epsilon decouple exactly."""


def _strands(t: Tensor, nb: int, blk: int) -> Tensor:
    """(..., n) -> (..., blk, nb) contiguous, row j holding step j of every block of ``blk``;
    zero after the end (a = b = 0 there changes nothing before it). One copy."""
    n = t.shape[-1]
    full = n // blk
    out = t.new_zeros(*t.shape[:-1], blk, nb)
    view = out.transpose(-1, -2)  # (..., nb, blk)
    view[..., :full, :] = t[..., : full * blk].unflatten(-1, (full, blk))
    if n > full * blk:
        view[..., full, : n - full * blk] = t[..., full * blk :]
    return out


def _scan_forward(a: Tensor, b: Tensor) -> Tensor:
    """``h_i = a_i h_{i-1} + b_i`` along the last dim (``h_{-1} = 0``), without a graph.

    Two-level: the row is cut into ``_SCAN_BLOCK`` interleaved strands (step j of every block
    side by side, so each operation is one contiguous vector over the blocks); the recurrence and
    the products of ``a`` run along the ``_SCAN_BLOCK`` steps of each block; the values at the
    block ends are the same recurrence over the blocks (recursively: log depth in n); one fix-up
    ``h_i = b_i + (prod a) H`` adds the value H from before the block. O(n) work; every
    operation adds or multiplies non-negative numbers when ``a`` in [0, 1] and ``b >= 0``.
    """
    n = a.shape[-1]
    blk = _SCAN_BLOCK
    if n <= blk:
        h = b.clone()
        for j in range(1, n):  # in place on views: no temporaries, no write-back copies
            h[..., j].addcmul_(a[..., j], h[..., j - 1])
        return h
    nb = -(-n // blk)
    h, prod = _strands(b, nb, blk), _strands(a, nb, blk)
    for j in range(1, blk):  # in place on views: no temporaries, no write-back copies
        h[..., j, :].addcmul_(prod[..., j, :], h[..., j - 1, :])
        prod[..., j, :].mul_(prod[..., j - 1, :])
    ends = _scan_forward(prod[..., -1, :], h[..., -1, :])  # h at the end of every block
    h.addcmul_(prod, _shift_right(ends).unsqueeze(-2))
    return h.transpose(-1, -2).flatten(-2)[..., :n]


def _shift_right(t: Tensor) -> Tensor:
    """``t_{i-1}`` at i (0 at i = 0)."""
    return torch.nn.functional.pad(t[..., :-1], (1, 0))


def _shift_left(t: Tensor) -> Tensor:
    """``t_{i+1}`` at i (0 at i = n - 1)."""
    return torch.nn.functional.pad(t[..., 1:], (0, 1))


class _Recurrence(torch.autograd.Function):
    """``h_i = a_i h_{i-1} + b_i`` (``h_{-1} = 0``) with the adjoint recurrence as backward.

    Backward: ``lam_i = g_i + a_{i+1} lam_{i+1}`` (the same recurrence, reversed), then
    ``db = lam`` and ``da_i = lam_i h_{i-1}``. It is written with this Function itself, so it is
    differentiable again (double backward). Autograd keeps ``a`` and ``h``: O(n). This class has
    no forward mode, so ``torch.compile`` traces it; :class:`_LinearRecurrence` adds it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return _scan_forward(a, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        a, _ = inputs
        ctx.save_for_backward(a, output)
        ctx.save_for_forward(a, output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        a, h = ctx.saved_tensors
        lam = linear_recurrence(_shift_left(a).flip(-1), grad.flip(-1)).flip(-1)
        return lam * _shift_right(h), lam


class _LinearRecurrence(_Recurrence):
    """:class:`_Recurrence` with forward mode: ``h'_i = a_i h'_{i-1} + (a'_i h_{i-1} + b'_i)``."""

    @staticmethod
    def jvp(ctx: Any, a_t: Tensor | None, b_t: Tensor | None) -> Tensor:
        a, h = ctx.saved_tensors
        src = torch.zeros_like(h)
        if a_t is not None:
            src = src + a_t * _shift_right(h)
        if b_t is not None:
            src = src + b_t
        return linear_recurrence(a, src)


def linear_recurrence(a: Tensor, b: Tensor) -> Tensor:
    """``h_i = a_i h_{i-1} + b_i`` along the last dim, ``h_{-1} = 0`` (``a_0`` is unused).

    Stable for ``a`` in [0, 1] and ``b >= 0``: every operation adds or multiplies non-negative
    numbers, so the relative error is a few ulps per step and nothing cancels. Log depth
    (``ceil(log2 n)`` vectorised steps), O(n) autograd memory, differentiable any number of times.
    Under ``torch.compile``, which cannot trace a Function with a custom forward mode, the
    Function without one runs (forward mode is not available in compiled code anyway).
    """
    if torch.compiler.is_compiling():
        return cast(Tensor, _Recurrence.apply(a, b))
    return cast(Tensor, _LinearRecurrence.apply(a, b))


def _l1_scan(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    values: bool,
    ranks: bool,
    offset: Tensor | None = None,
    masked: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Values and/or ranks of l1 SoftSort by local-frame recurrences (float64; module doc).

    ``masked``: rows may hold ``±inf``, taken to their limit without data-dependent control flow
    (``softops.sort._limits``): the decay across the boundary of a block of equal infinities is
    0 and inside it 1, so the finite entries are relaxed among themselves with their full-row
    positions (the offset of the limit), and each infinite block is uniform over itself.
    """
    n = x2.shape[-1]
    u, perm = torch.sort(x2.double(), dim=-1)
    # The scans run on u / s (row_scale): gaps, moments and their gradients stay the size of
    # x / s, and s / eps (one factor, exp-log) takes the scale back.
    eps = epsilon.double()
    scale = row_scale(u, eps, 1.0, 2.0)  # over the finite entries
    q = scaled_inverse(eps, scale, 1.0).unsqueeze(-1)  # s / eps
    cap = _GAP_CAP * torch.exp(torch.log(eps).unsqueeze(-1) - torch.log(scale))  # 800 eps / s
    if masked:
        fin = torch.isfinite(u)
        u_inf = u
        u = torch.where(fin, u, 0.0)
        us = u / scale
        raw = us[:, 1:] - us[:, :-1]
        fin2 = fin[:, 1:] & fin[:, :-1]
        same = u_inf[:, 1:] == u_inf[:, :-1]
        raw = torch.where(fin2, raw, torch.where(same, 0.0, cap))
    else:
        us = u / scale
        raw = us[:, 1:] - us[:, :-1]
    # gaps >= 0, capped where exp(-gap/eps) is 0 in float64 anyway (finite gradients there)
    gap = torch.minimum(raw, cap)
    # in [0, 1]: the kernel's decay from one point to the next (gap / eps <= 800)
    dec = torch.exp(-gap * q)
    a_fwd = torch.nn.functional.pad(dec, (1, 0))  # d_i, i = 0..n-1 (d_0 = 0)
    a_rev = torch.nn.functional.pad(dec.flip(-1), (1, 0))  # the same, right to left
    a2 = torch.stack((a_fwd, a_rev))

    def both(b_left: Tensor, b_right: Tensor) -> tuple[Tensor, Tensor]:
        """Inclusive left and right sums: h_i = b_i + d_i h_{i-1}, and its mirror."""
        h = linear_recurrence(a2, torch.stack((b_left, b_right.flip(-1))))
        return h[0], h[1].flip(-1)

    ones = torch.ones_like(u)
    left, right_inc = both(ones, ones)  # sum_{j<=i} k_ij, sum_{j>=i} k_ij
    right = _shift_left(right_inc) * torch.nn.functional.pad(dec, (0, 1))  # sum_{j>i} k_ij
    z = left + right  # >= 1
    out_v = out_r = None
    if values:
        # first moments sum_{j<i} k_ij (u_i - u_j) and sum_{j>i} k_ij (u_j - u_i), by
        # M^L_i = d_i (gap_i L_{i-1} + M^L_{i-1}) and its mirror (in the units of u / s)
        w = dec * gap
        m_left, m_right = both(
            torch.nn.functional.pad(w * left[:, :-1], (1, 0)),
            torch.nn.functional.pad(w * right_inc[:, 1:], (0, 1)),
        )
        v = (us + (m_right - m_left) / z) * scale
        if masked:  # the finite ones are a mean of the finite entries; infinities stay
            lo = torch.where(fin, u, math.inf).amin(-1, keepdim=True)
            hi = torch.where(fin, u, -math.inf).amax(-1, keepdim=True)
            v = torch.where(fin, torch.minimum(torch.maximum(v, lo), hi), u_inf)
        else:
            v = torch.minimum(torch.maximum(v, u[:, :1]), u[:, -1:])  # a mean: rounding only
        out_v = (v.flip(-1) if descending else v).to(x2.dtype)
    if ranks:
        pos = positions(n, descending, torch.float64, x2.device)
        if offset is not None:
            pos = pos + offset.double().unsqueeze(-1)
        wts = pos / z  # column sums sum_i (pos_i / Z_i) k_ij, evaluated at the points u_j
        c_left, c_right_inc = both(wts, wts)
        r_sorted = c_left + _shift_left(c_right_inc) * torch.nn.functional.pad(dec, (0, 1))
        if not masked:  # a row of one NaN has no gap to carry it: NaN rows stay NaN
            r_sorted = r_sorted + u[:, :1] * 0
        r = torch.zeros_like(r_sorted).scatter(-1, perm, r_sorted)
        out_r = r.to(x2.dtype)
    return out_v, out_r


def inverse(eps: Tensor) -> Tensor:
    """``1/eps`` as ``exp(-log eps)``: the same value, but a backward that never squares eps.

    The backward of ``z / eps`` forms ``(z/eps)/eps``, which overflows at an epsilon far below
    the gaps and turns the zero gradient of a saturated softmax into ``0 * inf = NaN``; here the
    chain is ``grad * inv`` then ``/ eps``, finite whenever the true derivative is (eps is in
    its dtype's normal range: ``prepare_rows`` refuses it below ``finfo.tiny`` and clamps it to
    ``finfo.max``, so ``1/eps`` is finite).
    """
    return torch.exp(-torch.log(eps))


def row_scale(x2: Tensor, eps: Tensor, power: float, spread: float) -> Tensor:
    """A detached power of two s >= 1 (B, 1) per row of x2 (B, n): the kernels work on
    ``x / s`` (exact) and take the scale back in one factor ``s / eps**power``
    (:func:`scaled_inverse`).

    The backward of a softmax reduction forms ``g (x_j - v_i)``, of the size of x: with ``x``
    and ``1/eps`` kept apart the gradients then pass ``|x|**2`` (the factor's gradient) and
    ``|x| / eps`` (the distances'), each of which overflows long before the derivative does
    (at |x| = 1e20 in float32). In the frame of ``x / s`` they are ``|x|**2 / s`` and
    ``|x| s / eps**power``, so s is as large as ``max|x|`` (over the finite entries) where
    that keeps the second below ``finfo.max / 2**10 / n``, and at least ``4 spread max|x| /
    finfo.max`` (``spread`` bounds the kernel's sums of ``x / s``: nothing in the forward
    overflows) and 1 (below it, dividing by s would put ``1/s`` into the backward). s = 1, so
    ``x / s`` is x, for every row with ``max|x| <= 1``. NaN and infinite entries are left out.
    """
    with torch.no_grad():
        xd = x2.detach()
        fmax = torch.finfo(xd.dtype).max
        mag = torch.where(torch.isfinite(xd), xd.abs(), 0.0).amax(-1, keepdim=True).double()
        e = eps.detach().double().view(-1, 1)
        # in log2, where nothing overflows: low (the forward), high (the backward), mag
        low = torch.log2(mag.clamp(min=1.0)) + math.log2(4.0 * spread / fmax)
        high = (
            math.log2(fmax / (2.0**10 * xd.shape[-1]))
            + power * torch.log2(e)
            - torch.log2(mag.clamp(min=1.0))
        )
        want = torch.minimum(torch.log2(mag.clamp(min=1.0)), high).clamp(min=0.0)
        want = torch.maximum(want, low)
        top = math.frexp(fmax)[1] - 1  # the dtype's largest power of two
        exponent = torch.ceil(want).clamp(max=top)
    return torch.exp2(exponent).to(xd.dtype)


def scaled_inverse(eps: Tensor, scale: Tensor, power: float = 1.0) -> Tensor:
    """``scale / eps**power`` (B,) for eps (B,) and scale (B, 1), as ``exp(log s - p log eps)``
    (no ``eps**2`` in the backward), saturated just below the dtype's largest finite value.

    It saturates only where ``max|x| / eps**p`` exceeds that value; the distances it then
    scales wrongly are those below ``finfo.tiny * s`` in the frame of ``x / s``, where the
    dtype has lost their digits anyway (denormals).
    """
    top = math.log(torch.finfo(eps.dtype).max) - 1e-3  # exp(top) < finfo.max, by 0.1%
    log_ratio = torch.log(scale.view(-1).to(eps.dtype)) - power * torch.log(eps)
    return torch.exp(log_ratio.clamp(max=top))


def _distance_logits(distance: str) -> Callable[..., Tensor]:
    def logits(u_blk: Tensor, xs: Tensor, q: Tensor) -> Tensor:
        """``-d(u, x)/eps`` from the row-scaled ``u/s, x/s`` (:func:`row_scale`, at most 1)
        and ``q = s/eps`` (l1) or ``s/sqrt(eps)`` (l2): ``-|u - x| q`` or ``-((u - x) q)^2``.
        Nothing here overflows but the l1 logit (to -inf); ``(u - x) q`` is clipped at
        ``sqrt(finfo.max)`` (beyond it the weight is ``exp(-finfo.max) = 0`` either way), so the
        backward (``2 (u - x) q``) sees no inf."""
        diff = u_blk.unsqueeze(-1) - xs.unsqueeze(1)  # (B, b, n)
        qv = q.view(-1, 1, 1)
        if distance == "l1":
            return diff.abs() * -qv
        root = math.sqrt(torch.finfo(diff.dtype).max)
        return (diff * qv).clamp(-root, root).square().neg()

    return logits


def _power(distance: str) -> float:
    """The power of eps in q (:func:`_distance_logits`)."""
    return 1.0 if distance == "l1" else 0.5


def _masked_logits(distance: str) -> Callable[..., Tensor]:
    """Logits of the limit with infinities: rows and columns carry a kind (-1, 0, +1 for
    -inf, finite, +inf); finite rows see the finite columns only, an infinite row its own
    infinity only (uniform there)."""
    base = _distance_logits(distance)

    def logits(rp: Tensor, xz: Tensor, q: Tensor, kind_x: Tensor) -> Tensor:
        u_blk, kind_u = rp[0], rp[1]
        k_row, k_col = kind_u.unsqueeze(-1), kind_x.unsqueeze(1)
        inner = torch.where(k_row == k_col, 0.0, -math.inf).to(xz.dtype)
        return torch.where((k_row == 0) & (k_col == 0), base(u_blk, xz, q), inner)

    return logits


def _blocked(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    distance: str,
    *,
    values: bool = False,
    ranks: bool = False,
    matrix: bool = False,
    offset: Tensor | None = None,
    masked: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if masked:
        return _blocked_masked(
            x2, epsilon, descending, distance, values=values, ranks=ranks, matrix=matrix
        )
    # The sorted values by a gather, not ``torch.sort(x2).values``: the same gradient, but
    # torch.compile (torch 2.13, inductor) gets the gradient of the latter wrong when x2 also
    # enters the graph directly, as it does here (the slow torch.compile test of the contract).
    u = x2.gather(-1, torch.sort(x2.detach(), dim=-1).indices)
    # distances of x / s (no overflow, hence no inf in the backward), with s put back into q
    eps = epsilon.to(x2.dtype)
    scale = row_scale(x2, eps, _power(distance), 2.0)
    q = scaled_inverse(eps, scale, _power(distance))
    return chunked_rows(
        _distance_logits(distance),
        u / scale,
        x2,
        (x2 / scale, q),
        descending,
        values=values,
        ranks=ranks,
        matrix=matrix,
        offset=offset,
    )


def _kind(t: Tensor) -> Tensor:
    """-1, 0, +1 for -inf, finite, +inf (in t's dtype)."""
    return torch.where(torch.isinf(t), torch.sign(t), 0.0).to(t.dtype)


def _blocked_masked(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    distance: str,
    *,
    values: bool,
    ranks: bool,
    matrix: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_blocked` for rows that may hold ``±inf``, at their limit, by masks alone."""
    u = x2.gather(-1, torch.sort(x2.detach(), dim=-1).indices)
    kind_u, kind_x = _kind(u.detach()), _kind(x2.detach())
    eps = epsilon.to(x2.dtype)
    scale = row_scale(x2, eps, _power(distance), 2.0)  # over the finite entries
    uz = torch.where(kind_u == 0, u / scale, 0.0)
    xz = torch.where(kind_x == 0, x2, 0.0)
    q = scaled_inverse(eps, scale, _power(distance))
    v, r, p = chunked_rows(
        _masked_logits(distance),
        torch.stack((uz, kind_u)),
        xz,
        (torch.where(kind_x == 0, x2 / scale, 0.0), q, kind_x),
        descending,
        values=values,
        ranks=ranks,
        matrix=matrix,
    )
    if v is not None:
        srt = torch.sort(x2.detach(), dim=-1, descending=descending).values
        v = torch.where(torch.isinf(srt), srt, v)
    return v, r, p


def masked(kind: str, x2: Tensor, eps: Tensor, descending: bool, opts: MethodOptions) -> Tensor:
    """``kind`` ("sort", "rank", "argsort") of rows that may hold ``±inf``, at their limit
    (``softops.sort._limits``), by masks alone: no host sync and no data-dependent control flow,
    so it runs under ``torch.func.vmap``. Rows with a NaN are not special-cased here."""
    if kind != "argsort" and opts.distance == "l1":
        v, r = _l1_scan(x2, eps, descending, kind == "sort", kind == "rank", masked=True)
        return cast(Tensor, v if kind == "sort" else r)
    v, r, p = _blocked(
        x2,
        eps,
        descending,
        opts.distance,
        values=kind == "sort",
        ranks=kind == "rank",
        matrix=kind == "argsort",
        masked=True,
    )
    return cast(Tensor, {"sort": v, "rank": r, "argsort": p}[kind])


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""SoftSort values ``P @ x``: a relaxation of ``torch.sort(x, -1, descending).values``.

    .. math::

        P_{ij} = \frac{\exp(-d(\hat x_i, x_j)/\varepsilon)}
                      {\sum_l \exp(-d(\hat x_i, x_l)/\varepsilon)},\qquad
        v_i = \sum_j P_{ij} x_j,

    with :math:`\hat x = \mathrm{sort}(x)` (ascending unless ``descending``) and
    :math:`d(a, b) = |a - b|` ("l1") or :math:`(a - b)^2` ("l2"). l1 is exact in O(n log n) time
    and O(n) memory (local-frame recurrences in float64); l2 is row-chunked with checkpointing.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x (l1) or x² (l2).
        descending: sort in descending order.
        opts: ``opts.distance`` is "l1" or "l2".
        offset: unused (the one backend signature).

    Returns:
        (B, n) soft-sorted values, in x2's dtype. They tend to the hard sorted values as
        epsilon -> 0 and to the row mean as epsilon -> inf.

    References:
        S. Prillo, J. Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """
    if opts.distance == "l1":
        v, _ = _l1_scan(x2, eps, descending, values=True, ranks=False)
    else:
        v, _, _ = _blocked(x2, eps, descending, opts.distance, values=True)
    return cast(Tensor, v)


def rank(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""SoftSort ranks: a relaxation of the 1-based ``argsort(argsort(x, -1, descending)) + 1``.

    .. math::

        r_j = \sum_{i=1}^n i\, P_{ij},\qquad
        P_{ij} = \operatorname{softmax}_j\!\big(-d(\hat x_i, x_j)/\varepsilon\big),

    where :math:`\hat x` is ``sort(x)`` in the requested order (rank 1 is the smallest when
    ``descending=False``). This column-weighted estimator is not confined to [1, n] (P is only
    row-stochastic); it tends to the hard ranks as epsilon -> 0 for distinct values.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x (l1) or x² (l2).
        descending: rank 1 for the largest instead of the smallest.
        opts: ``opts.distance`` is "l1" (exact O(n log n)) or "l2" (row-chunked, O(n²) time).
        offset: optional (B,) shift of the positions i (the public layer uses it for the entries
            that precede a row's finite ones when it takes infinities to their limits).

    Returns:
        (B, n) soft ranks, in x2's dtype.

    References:
        S. Prillo, J. Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """
    if opts.distance == "l1":
        _, r = _l1_scan(x2, eps, descending, values=False, ranks=True, offset=offset)
    else:
        _, r, _ = _blocked(x2, eps, descending, opts.distance, ranks=True, offset=offset)
    return cast(Tensor, r)


def argsort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""The SoftSort matrix P: row i relaxes ``one_hot(argsort(x, -1, descending)[i])``.

    .. math::

        P_{ij} = \frac{\exp(-d(\hat x_i, x_j)/\varepsilon)}
                      {\sum_l \exp(-d(\hat x_i, x_l)/\varepsilon)}.

    P is row-stochastic and ``P @ x`` equals :func:`sort`. Computed row-chunked with
    checkpointing, so besides the (B, n, n) output autograd keeps O(B n) per block.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x (l1) or x² (l2).
        descending: rows in descending order of x.
        opts: ``opts.distance`` is "l1" or "l2".
        offset: unused (the one backend signature).

    Returns:
        (B, n, n) row-stochastic P, in x2's dtype.

    References:
        S. Prillo, J. Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """
    _, _, p = _blocked(x2, eps, descending, opts.distance, matrix=True)
    return cast(Tensor, p)
