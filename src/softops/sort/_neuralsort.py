r"""NeuralSort backend: the unimodal row-stochastic relaxation of Grover et al.

Reference: A. Grover, E. Wang, A. Zweig and S. Ermon, *Stochastic Optimization of Sorting
Networks via Continuous Relaxations*, ICLR 2019 (arXiv 1903.08850).

Private backend of :mod:`softops.sort`, with the one backend signature
``sort/rank/argsort(x2, eps, descending, opts, offset=None)`` (``softops.sort._dispatch``):
canonical tensors ``x2`` (B, n) of dtype float32 or float64 and ``eps`` (B,) positive (it may
require grad); NeuralSort has no options, so ``opts`` is unused; no validation.

Deviations from the paper's notation (Grover et al. 2019, §3, where the relaxation is
:math:`\hat P_{\max}`):

* The paper's temperature :math:`\tau` is ``epsilon``, in units of x (the logits are linear in
  x). Scaling law: ``sort(c x, c e) = c sort(x, e)`` for c > 0; ranks and P are unchanged. The
  operator is shift-invariant, which is used to centre x (by a detached constant) before the
  O(n)-magnitude logits are formed.
* The paper's :math:`\hat P_{\max}` sorts in **descending** order: its row i uses the coefficient
  :math:`n + 1 - 2i`. That is ``descending=True`` here. ``descending=False`` (the default of the
  public API) uses the row coefficient :math:`2i - n - 1`, i.e. the paper's rows in reverse order,
  so ``P @ x`` is ascending.
* Soft ranks use the estimator :math:`r_j = \sum_i i\,P_{ij}` (1-based positions in the output
  order), which is not confined to [1, n].

Algorithm: :math:`(A_x 1)_j = \sum_l |x_j - x_l|` is computed exactly in O(n log n) from one sort
and prefix sums in float64: at the k-th smallest value :math:`u_k` (1-based),
:math:`(A 1)_k = (2k - n) u_k - 2 S_k + S_n` with :math:`S_k = \sum_{l \le k} u_l`. Only the final
softmax is O(n²); it is row-chunked with checkpointing (see
:func:`softops.sort._chunked.chunked_rows` and its ``BLOCK_ELEMENTS``), so autograd keeps O(n)
per block instead of O(n²). The reference implementation's ``A_s @ (1 1^T)`` (an O(n³) matmul) is
not used. At exact ties :math:`|x_j - x_l|` is at its kink; the prefix-sum formula and the dense
``abs().sum(-1)`` pick different subgradients there and agree everywhere else.

Extremes: the logits are formed from the centred row over a power of two s
(``softops.sort._softsort.row_scale``), less their row maximum, times one factor ``s / eps``
(``scaled_inverse``), so neither pass forms ``eps**2`` nor overflows before the derivative does.
``(A 1)`` is read at the boundaries of each run of tied values, so tied entries get identical
logits, columns of P and ranks.

Non-finite inputs: a NaN gives NaN in its own row only; rows with ``±inf`` give NaN here, and the
public layer (:mod:`softops.sort`) takes them to their limits before calling this backend.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from softops.sort._chunked import chunked_rows
from softops.sort._options import MethodOptions
from softops.sort._softsort import row_scale, scaled_inverse

__all__ = ["argsort", "rank", "sort"]


def _abs_row_sums(x2: Tensor) -> Tensor:
    """``(A 1)_j = sum_l |x_j - x_l|`` in O(n log n), float64, plain autograd."""
    n = x2.shape[-1]
    u, perm = torch.sort(x2.double(), dim=-1)
    zero = torch.zeros(x2.shape[0], 1, dtype=torch.long, device=x2.device)
    sorted_sums = _sorted_abs_sums(u, zero, zero + n)
    return torch.zeros_like(sorted_sums).scatter(-1, perm, sorted_sums)


def _sorted_abs_sums(u: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """``sum_l |u_k - u_l|`` over ``l`` in ``[lo, hi)``, at each sorted position k in it, for
    ascending rows u (B, n) whose entries outside ``[lo, hi)`` (B, 1) are 0.

    At a position in a run of equal values at k0..k1 it is
    ``(k0 - lo) u - S_{k0-1} + (S_{n-1} - S_{k1}) - (hi - 1 - k1) u``, with S the prefix sums:
    the run's boundaries only, so tied entries get bit-identical sums (hence identical logits,
    columns of P and ranks) whatever the rounding of the prefix sums. 0 outside ``[lo, hi)``.
    """
    n = u.shape[-1]
    s = u.cumsum(-1)
    idx = torch.arange(n, device=u.device).expand_as(u)
    edge = torch.ones_like(u[:, :1], dtype=torch.bool)
    differs = u[:, 1:] != u[:, :-1]
    new_run = torch.cat((edge, differs), -1) | (idx == lo)  # runs never cross lo nor hi
    end_run = torch.cat((differs, edge), -1) | (idx == hi - 1) | (idx == lo - 1)
    k0 = torch.where(new_run, idx, 0).cummax(-1).values  # the first position of the run
    k1 = torch.where(end_run, idx, n - 1).flip(-1).cummin(-1).values.flip(-1)  # its last
    before = torch.where(k0 > 0, s.gather(-1, (k0 - 1).clamp(min=0)), 0.0)  # S_{k0-1}
    after = s[:, -1:] - s.gather(-1, k1)  # S_{n-1} - S_{k1}
    sums = (k0 - lo).to(u.dtype) * u - before + after - (hi - 1 - k1).to(u.dtype) * u
    return torch.where((idx >= lo) & (idx < hi), sums, 0.0)


def _frame(xc: Tensor, eps: Tensor) -> Tensor:
    """The detached power-of-two scale s >= 1 (B, 1) of the centred rows
    (:func:`softops.sort._softsort.row_scale`): the logits ``c_i x_j - (A 1)_j`` of ``xc / s``
    are at most ``3 n max|xc| / s``, and ``s / eps`` takes the scale back."""
    return row_scale(xc, eps, 1.0, 3.0 * xc.shape[-1])


def _logits(coef: Tensor, xs: Tensor, a1: Tensor, ratio: Tensor) -> Tensor:
    """(B, b, n) NeuralSort logits ``(c_i x_j - (A 1)_j) / epsilon`` for the rows with coef c,
    from the row-scaled ``xs = xc/s`` and ``a1 = (A 1)(xs)`` and ``ratio = s/eps``."""
    t = coef.unsqueeze(-1) * xs.unsqueeze(1) - a1.unsqueeze(1)
    return _shifted(t, ratio, None)


def _shifted(t: Tensor, ratio: Tensor, valid: Tensor | None) -> Tensor:
    """``(t - max_j t) * ratio`` over the ``valid`` entries (all if None; 0 elsewhere).

    Each row's maximum (detached; the softmax does not change) is taken off before the factor
    s/eps: the logits are <= 0, so none overflows to ``+inf`` (which the softmax makes NaN), and
    ``0 * inf`` never enters the backward.
    """
    with torch.no_grad():
        top = (t if valid is None else torch.where(valid, t, -math.inf)).amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
    if valid is not None:
        t = torch.where(valid, t, top)
    return (t - top) * ratio.view(-1, 1, 1)


def _run(
    x2: Tensor,
    epsilon: Tensor,
    descending: bool,
    *,
    values: bool = False,
    ranks: bool = False,
    matrix: bool = False,
    offset: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    n = x2.shape[-1]
    with torch.no_grad():
        centre = 0.5 * x2.amax(-1, keepdim=True) + 0.5 * x2.amin(-1, keepdim=True)
        centre = torch.where(torch.isfinite(centre), centre, 0.0)
    xc = x2 - centre  # shift-invariant: same P
    # logits of xc / s (no overflow, hence no inf in the backward), s put back into s/eps
    eps = epsilon.to(x2.dtype)
    scale = _frame(xc, eps)
    xs = xc / scale  # exact (a power of two)
    a1 = _abs_row_sums(xs).to(x2.dtype)
    i = torch.arange(1, n + 1, dtype=x2.dtype, device=x2.device)
    coef = 2 * i - n - 1  # ascending rows (row i = i-th smallest); chunked_rows flips if needed
    ratio = scaled_inverse(eps, scale, 1)
    return chunked_rows(
        _logits,
        coef,
        x2,
        (xs, a1, ratio),
        descending,
        values=values,
        ranks=ranks,
        matrix=matrix,
        offset=offset,
    )


def _masked_logits(rp: Tensor, xcz: Tensor, a1: Tensor, ratio: Tensor, kind_x: Tensor) -> Tensor:
    """Logits of the limit with infinities (rows and columns carry a kind -1, 0, +1 for -inf,
    finite, +inf): the compacted NeuralSort logits between finite rows and columns, an infinite
    row uniform over its own infinity, -inf elsewhere."""
    coef, kind_r = rp[0], rp[1]
    k_row, k_col = kind_r.unsqueeze(-1), kind_x.unsqueeze(1)
    inner = torch.where(k_row == k_col, 0.0, -math.inf).to(xcz.dtype)
    both = (k_row == 0) & (k_col == 0)
    t = coef.unsqueeze(-1) * xcz.unsqueeze(1) - a1.unsqueeze(1)
    return torch.where(both, _shifted(t, ratio, both), inner)


def masked(kind: str, x2: Tensor, eps: Tensor, descending: bool, opts: MethodOptions) -> Tensor:
    """``kind`` ("sort", "rank", "argsort") of rows that may hold ``±inf``, at their limit
    (``softops.sort._limits``), by masks alone (no data-dependent control flow, so it runs under
    ``torch.func.vmap``). The finite entries of a row, m of them after ``n_neg`` at -inf, get the
    compacted row's logits: ``(A 1)`` over the finite entries only and the row coefficient
    ``2 i' - m - 1`` at the i'-th finite output position; positions stay those of the full row
    (the limit's offset). Rows with a NaN are not special-cased here."""
    n = x2.shape[-1]
    dt = x2.dtype
    xd = x2.detach()
    kind_x = torch.where(torch.isinf(xd), torch.sign(xd), 0.0).to(dt)
    fin = kind_x == 0
    n_neg = (kind_x < 0).sum(-1, keepdim=True)
    m = fin.sum(-1, keepdim=True)
    with torch.no_grad():
        lo = torch.where(fin, xd, math.inf).amin(-1, keepdim=True)
        hi = torch.where(fin, xd, -math.inf).amax(-1, keepdim=True)
        centre = torch.where(m > 0, 0.5 * lo + 0.5 * hi, 0.0)
    scale = _frame(torch.where(fin, xd - centre, 0.0), eps.to(dt))  # over the finite entries
    xcz = torch.where(fin, (x2 - centre) / scale, 0.0)
    # (A 1) over the finite entries: sorted, they sit at positions n_neg .. n_neg + m - 1 (the
    # -inf ones first), with 0 at the infinite positions
    u, perm = torch.sort(torch.where(fin, x2, xd).double(), dim=-1)
    fin_u = torch.isfinite(u)
    uc = torch.where(fin_u, (u - centre.double()) / scale.double(), 0.0)
    sorted_sums = _sorted_abs_sums(uc, n_neg, n_neg + m)
    a1 = torch.zeros_like(sorted_sums).scatter(-1, perm, sorted_sums).to(dt)
    i = torch.arange(1, n + 1, dtype=dt, device=x2.device)  # ascending output positions
    coef = 2 * (i - n_neg.to(dt)) - m.to(dt) - 1
    kind_r = torch.where(i <= n_neg.to(dt), -1.0, torch.where(i > (n_neg + m).to(dt), 1.0, 0.0))
    coef = torch.where(kind_r == 0, coef, 0.0)
    v, r, p = chunked_rows(
        _masked_logits,
        torch.stack((coef, kind_r.to(dt))),
        torch.where(fin, x2, 0.0),
        (xcz, a1, scaled_inverse(eps.to(dt), scale, 1), kind_x),
        descending,
        values=kind == "sort",
        ranks=kind == "rank",
        matrix=kind == "argsort",
    )
    if kind == "sort":
        srt = torch.sort(xd, dim=-1, descending=descending).values
        return torch.where(torch.isinf(srt), srt, cast(Tensor, v))
    return cast(Tensor, r if kind == "rank" else p)


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""NeuralSort values ``P @ x``: a relaxation of ``torch.sort(x, -1, descending).values``.

    .. math::

        P_{ij} = \operatorname{softmax}_j\!\Big(\frac{c_i x_j - \sum_l |x_j - x_l|}
                 {\varepsilon}\Big),\qquad
        c_i = \begin{cases} 2i - n - 1 & \text{ascending}\\ n + 1 - 2i & \text{descending}
              \end{cases},\qquad v = P x.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x.
        descending: sort in descending order (the paper's orientation).
        opts: unused (NeuralSort has no options).
        offset: unused (the one backend signature).

    Returns:
        (B, n) soft-sorted values, in x2's dtype; the hard sorted values as epsilon -> 0.

    References:
        A. Grover, E. Wang, A. Zweig, S. Ermon. Stochastic Optimization of Sorting Networks via
        Continuous Relaxations. ICLR 2019. arXiv:1903.08850.
    """
    return cast(Tensor, _run(x2, eps, descending, values=True)[0])


def rank(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""NeuralSort ranks: a relaxation of the 1-based ``argsort(argsort(x, -1, descending)) + 1``.

    .. math::

        r_j = \sum_{i=1}^n i\, P_{ij},

    with P as in :func:`sort` (rank 1 is the smallest when ``descending=False``). Not confined to
    [1, n]; the hard ranks as epsilon -> 0 for distinct values.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x.
        descending: rank 1 for the largest instead of the smallest.
        opts: unused (NeuralSort has no options).
        offset: optional (B,) shift of the positions i (used by the public layer for infinities).

    Returns:
        (B, n) soft ranks, in x2's dtype.

    References:
        A. Grover, E. Wang, A. Zweig, S. Ermon. Stochastic Optimization of Sorting Networks via
        Continuous Relaxations. ICLR 2019. arXiv:1903.08850.
    """
    return cast(Tensor, _run(x2, eps, descending, ranks=True, offset=offset)[1])


def argsort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    r"""The NeuralSort matrix P: row i relaxes ``one_hot(argsort(x, -1, descending)[i])``.

    .. math::

        P_{ij} = \operatorname{softmax}_j\!\Big(\frac{c_i x_j - (A_x 1)_j}{\varepsilon}\Big),
        \qquad (A_x)_{jl} = |x_j - x_l|.

    P is unimodal and row-stochastic; ``P @ x`` equals :func:`sort`.

    Args:
        x2: (B, n) float32 or float64 input.
        eps: (B,) temperature :math:`\tau` > 0, in units of x.
        descending: rows in descending order of x (the paper's :math:`\hat P_{\max}`).
        opts: unused (NeuralSort has no options).
        offset: unused (the one backend signature).

    Returns:
        (B, n, n) row-stochastic P, in x2's dtype.

    References:
        A. Grover, E. Wang, A. Zweig, S. Ermon. Stochastic Optimization of Sorting Networks via
        Continuous Relaxations. ICLR 2019. arXiv:1903.08850.
    """
    return cast(Tensor, _run(x2, eps, descending, matrix=True)[2])
