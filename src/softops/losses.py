r"""Losses built on the soft metrics and the soft sort family: 1 - (soft metric).

:func:`accuracy_loss`, :func:`topk_accuracy_loss` and :func:`topk_cross_entropy` (Petersen et
al. 2022) are per sample, with ``reduction``; :func:`f1_loss` is ``1 - soft_f1``, a statistic of
the whole batch (no ``reduction``); :func:`spearman_loss` and :func:`ndcg_loss` rank with the
soft ranks of the predictions (Blondel et al. 2020, §6), per row.

Conventions for the classification losses (``input``, ``target``, ``average``,
``from_logits``, ``epsilon``) are those of :mod:`softops.metrics`; ``reduction`` is ``"mean"``
(default), ``"sum"`` or ``"none"`` (per sample, or per row for the ranking losses).

The ranking losses take any number of batch dims and work along ``dim``. A float or tensor
``epsilon`` (broadcastable to the batch shape; it receives a gradient) is passed on to
:func:`softops.soft_rank` (and :func:`softops.soft_topk_mask`) unchanged, in the units of
``input`` with "pav". The default None is relative to each row, ``3 * std(row) / n``
(population std, kept in the graph), so the loss is scale-free (``loss(c*x, t) == loss(x, t)``,
c > 0) and stays a rank loss at every n: with "pav" the soft ranks are exactly hard where every
gap between sorted neighbours exceeds ``epsilon`` and exactly affine where every gap is below it
(the site's "Choosing epsilon" page says how the default was chosen).

References:
    Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking. ICML 2020.
    arXiv:2002.08871.
    Xie et al. Differentiable Top-k Operator with Optimal Transport. NeurIPS 2020.
    arXiv:2002.06504.
    Järvelin and Kekäläinen. Cumulated Gain-Based Evaluation of IR Techniques. ACM TOIS 2002.
    Petersen, Kuehne, Borgelt and Deussen. Differentiable Top-k Classification Learning.
    ICML 2022. arXiv:2206.07290.
    Berrada, Zisserman and Kumar. Smooth Loss Functions for Deep Top-k Classification.
    ICLR 2018. arXiv:1802.07595.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from softops._core.dims import flatten_to_2d, row_param
from softops._core.validation import (
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_nonempty,
    check_real,
    compute_dtype,
)
from softops.metrics import (
    GAINS,
    average_ranks,
    check_classification,
    check_optional_int,
    check_relevance,
    check_topk_classification,
    checked_confusion,
    f1_from_counts,
    gain_of,
    pearson_terms,
    true_class_probability,
    true_class_topk_membership,
)
from softops.sort import SORT_METHODS, soft_rank
from softops.topk import soft_topk_mask

__all__ = [
    "accuracy_loss",
    "f1_loss",
    "ndcg_loss",
    "spearman_loss",
    "topk_accuracy_loss",
    "topk_cross_entropy",
]

REDUCTIONS = ("mean", "sum", "none")


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


# ------------------------------------------------------------------------------ classification


def accuracy_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Soft 0-1 loss: one minus the probability given to the true class, per sample.

    The hard loss is ``(input.argmax(-1) != target).float()``; the soft one is

    .. math::

        \ell_n = 1 - p_{n, t_n}, \qquad
        \text{binary: } p_{n, t_n} = p_n \text{ if } t_n = 1 \text{ else } 1 - p_n,

    the per-sample ``1 - soft_accuracy``. Unlike cross-entropy it is bounded, so confidently wrong
    samples do not dominate.

    Args:
        input: (N, C) class probabilities or (N,) binary ones; logits with ``from_logits``.
        target: integer labels (N,), in [0, C).
        from_logits: ``input`` holds logits (``softmax(input / epsilon)``).
        epsilon: the softmax temperature, with ``from_logits`` only (:mod:`softops.metrics`).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (shape (N,)).

    Returns:
        A 0-dim tensor, or shape (N,) for ``reduction="none"``, in the dtype of ``input``.

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> accuracy_loss(p, torch.tensor([0, 1, 0]), reduction="none")
        tensor([0.3000, 0.2000, 0.7000])
    """
    op = "accuracy_loss"
    epsilon = check_classification(input, target, from_logits, epsilon, op)
    check_choice(reduction, REDUCTIONS, op, "reduction")
    loss = 1 - true_class_probability(input, target, from_logits, epsilon)
    return _reduce(loss, reduction).to(input.dtype)


def topk_accuracy_loss(
    scores: torch.Tensor,
    target: torch.Tensor,
    k: int,
    *,
    epsilon: float | torch.Tensor = 0.1,
    method: str = "ot",
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Soft top-k 0-1 loss: one minus the soft membership of the true class in the top k.

    The hard loss is ``1 - (scores.topk(k, -1).indices == target[:, None]).any(-1).float()``;
    the soft one reads the true class off the soft top-k mask :math:`A`
    (:func:`softops.soft_topk_mask`):

    .. math::

        \ell_n = 1 - A_{n, t_n}, \qquad
        A_{nc} = \sigma\!\left(\frac{s_{nc} - \tau_n}{\varepsilon}\right), \quad
        \sum_c A_{nc} = k .

    The loss only asks the true class to be among the k best, not to be the best, which suits
    ambiguous labels (Berrada et al. 2018).

    Args:
        scores: raw scores, (N, C), floating dtype.
        target: integer labels, (N,), in [0, C).
        k: an int in [1, C].
        epsilon: the mask's temperature, in the units of the scores (a float, or a tensor
            broadcastable to (N,)).
        method: the mask's method, as for :func:`softops.metrics.soft_topk_accuracy`.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (shape (N,)).

    Returns:
        A 0-dim tensor, or shape (N,) for ``reduction="none"``, in the dtype of ``scores``.

    Example:
        >>> s = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
        >>> topk_accuracy_loss(s, torch.tensor([1, 2]), 2, reduction="none", epsilon=0.01)
        tensor([0., 0.])
    """
    op = "topk_accuracy_loss"
    k, epsilon = check_topk_classification(scores, target, k, epsilon, method, op)
    check_choice(reduction, REDUCTIONS, op, "reduction")
    loss = 1 - true_class_topk_membership(scores, target, k, epsilon, method, False)
    return _reduce(loss, reduction).to(scores.dtype)


def topk_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    p_k: Sequence[float],
    *,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "ot",
    m: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Top-k cross-entropy (Petersen et al. 2022): ``-log`` of the probability, weighted over k
    by ``p_k``, that the true class is among the k best.

    With :math:`P_K = (p_1, \dots, p_K)` a distribution over k, the softmax for the top-1 term
    and the soft top-k mask :math:`A^{(k)}` (:func:`softops.soft_topk_mask`) for the others:

    .. math::

        \ell_n = -\log\Big( p_1\, \mathrm{softmax}(s_n)_{t_n}
            + \sum_{k \ge 2} p_k\, A^{(k)}_{n, t_n} \Big).

    ``p_k = [1]`` is exactly ``F.cross_entropy(logits, target)``. As ``epsilon -> 0`` the
    membership :math:`A^{(k)}_{n,t_n}` becomes the hard ``t_n in logits[n].topk(k).indices``. A
    ``p_k`` such as ``[0.5, 0, 0, 0, 0.5]`` trains for top-1 and top-5 accuracy at once.

    Args:
        logits: raw scores, (N, C), floating dtype.
        target: integer labels, (N,), in [0, C).
        p_k: the weights of k = 1, 2, ..., len(p_k) <= C: non-negative, summing to 1.
        epsilon: the masks' temperature, in the units of the logits (a float, or a tensor
            broadcastable to (N,)).
        method: the masks' method: ``"ot"`` (default; one batched solve for every k),
            ``"sinkhorn"`` or ``"perturbed"``.
        m: None (all classes) or ``len(p_k) <= m <= C``: the masks see only the m largest
            logits of each row (the true class replacing the m-th when not among them).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (shape (N,)).

    Returns:
        A 0-dim tensor, or shape (N,) for ``reduction="none"``, in the dtype of ``logits``.

    Example:
        >>> s = torch.tensor([[3.0, 2.0, 0.0], [0.0, 3.0, 1.0]])
        >>> t = torch.tensor([1, 2])
        >>> topk_cross_entropy(s, t, [1.0]), torch.nn.functional.cross_entropy(s, t)
        (tensor(1.7594), tensor(1.7594))
        >>> topk_cross_entropy(s, t, [0.0, 1.0], epsilon=0.01)  # both are in their top 2
        tensor(0.)
    """
    op = "topk_cross_entropy"
    weights = check_p_k(p_k, op)
    kmax = len(weights)
    _, epsilon = check_topk_classification(logits, target, kmax, epsilon, method, op)
    check_choice(reduction, REDUCTIONS, op, "reduction")
    n_classes = logits.shape[1]
    check_optional_int(m, op, "m")
    if m is not None and not kmax <= m <= n_classes:
        raise ValueError(
            f"{op}: expected len(p_k) (= {kmax}) <= `m` <= C (= {n_classes}); got m={m}."
        )
    x = logits.to(compute_dtype(logits.dtype))
    t = target.long()
    log_p = torch.log_softmax(x, -1).gather(1, t[:, None])[:, 0]
    total = log_p + math.log(weights[0]) if weights[0] > 0 else torch.full_like(log_p, -math.inf)
    ks = [k for k in range(2, kmax + 1) if weights[k - 1] > 0]
    if ks:
        cols, pos = x, t
        if m is not None and m < n_classes:
            top = x.topk(m, -1).indices
            hit = top == t[:, None]
            found = hit.any(-1)
            # the true class takes the m-th place when it is not among the m best
            top = torch.where(found[:, None], top, torch.cat([top[:, :-1], t[:, None]], 1))
            cols = x.gather(1, top)
            pos = torch.where(found, hit.int().argmax(-1), m - 1)
        rows = cols.shape[0]
        eps_rows = epsilon
        if isinstance(epsilon, torch.Tensor) and epsilon.dim() > 0:
            eps_rows = epsilon.expand(rows).repeat(len(ks))
        if method == "ot":  # one solve over every k: rows repeated, a per-row k
            k_rows = torch.tensor(ks, dtype=cols.dtype, device=cols.device).repeat_interleave(rows)
            masks = soft_topk_mask(cols.repeat(len(ks), 1), k_rows, epsilon=eps_rows)
            masks = masks.reshape(len(ks), rows, -1)
        else:
            masks = torch.stack(
                [soft_topk_mask(cols, k, epsilon=epsilon, method=method) for k in ks]
            )
        member = masks.gather(2, pos[None, :, None].expand(len(ks), rows, 1))[..., 0]
        w = torch.tensor([weights[k - 1] for k in ks], dtype=cols.dtype, device=cols.device)
        mix = (w[:, None] * member).sum(0)
        tiny = torch.finfo(mix.dtype).tiny
        log_mix = torch.where(mix > 0, torch.log(mix.clamp(min=tiny)), -math.inf)
        total = torch.logaddexp(total, log_mix)
    return _reduce(-total, reduction).to(logits.dtype)


def check_p_k(p_k: Any, op: str) -> list[float]:
    """``p_k`` as a list of non-negative floats summing to 1, or raise."""
    if isinstance(p_k, torch.Tensor):
        p_k = p_k.detach().flatten().tolist()
    if isinstance(p_k, (str, bytes)) or not isinstance(p_k, Sequence) or not p_k:
        raise TypeError(f"{op}: expected `p_k` to be a non-empty sequence of floats; got {p_k!r}.")
    try:
        weights = [float(v) for v in p_k]
    except (TypeError, ValueError):
        raise TypeError(f"{op}: expected `p_k` to be a sequence of floats; got {p_k!r}.") from None
    if any(not (v >= 0 and math.isfinite(v)) for v in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(
            f"{op}: expected `p_k` of non-negative weights summing to 1; got p_k={p_k!r}."
        )
    return weights


def f1_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    average: str | None = None,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft F1 loss: ``1 - soft_f1(input, target)``, a statistic of the whole batch.

    .. math::

        \mathcal L = 1 - F1, \qquad F1_c = \frac{2\,TP_c}{P_c + T_c}
        = \frac{2 \sum_n p_{nc} [t_n = c]}{\sum_n \big(p_{nc} + [t_n = c]\big)},

    averaged as :func:`softops.metrics.soft_f1` does. F1 does not decompose over samples, so
    there is no ``reduction``; on a minibatch it is biased (:mod:`softops.metrics`), and with
    ``"macro"`` a class absent from the batch adds a constant 1/C and no gradient.

    Args:
        input: (N, C) class probabilities or (N,) binary ones; logits with ``from_logits``.
        target: integer labels (N,), in [0, C).
        average: ``"binary"``, ``"micro"``, ``"macro"`` or None, as for ``soft_f1``.
        from_logits: ``input`` holds logits (``softmax(input / epsilon)``).
        epsilon: the softmax temperature, with ``from_logits`` only (:mod:`softops.metrics`).

    Returns:
        A 0-dim tensor in the dtype of ``input``.

    Example:
        >>> p = torch.tensor([0.9, 0.2, 0.6, 0.3])
        >>> f1_loss(p, torch.tensor([1, 0, 1, 1]))
        tensor(0.2800)
    """
    counts = checked_confusion(input, target, average, from_logits, epsilon, "f1_loss")
    return 1 - f1_from_counts(counts).to(input.dtype)


# ------------------------------------------------------------------------------------- ranking


def _check_ranking(
    input: Any,
    target: Any,
    dim: Any,
    epsilon: Any,
    reduction: Any,
    op: str,
) -> tuple[int, int, float | torch.Tensor | None]:
    """Common checks of spearman_loss and ndcg_loss; returns (dim, n, epsilon)."""
    check_floating(input, op, "input")
    check_real(target, op, "target")
    if target.shape != input.shape:
        raise ValueError(
            f"{op}: expected `target` of the shape of input {tuple(input.shape)}; "
            f"got shape {tuple(target.shape)}."
        )
    d = check_dim(input, dim, op)
    n = check_nonempty(input, d, op)
    if input.numel() == 0:
        raise ValueError(
            f"{op}: expected a non-empty batch; got `input` of shape {tuple(input.shape)}."
        )
    check_choice(reduction, REDUCTIONS, op, "reduction")
    if epsilon is None:  # relative to each row: computed by the loss, with x
        return d, n, None
    epsilon = check_epsilon(epsilon, op, dtype=input.dtype)
    if isinstance(epsilon, torch.Tensor):  # checked here so that errors name this op
        batch_shape = input.movedim(d, -1).shape[:-1]
        row_param(epsilon, batch_shape, op, "epsilon", epsilon.dtype, epsilon.device)
    return d, n, epsilon


def _row_epsilon(x: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """``3 * std / n`` of each row along d; 1 where not positive and finite (degenerate rows)."""
    eps = 3.0 * x.std(dim=d, correction=0) / n
    good = torch.isfinite(eps) & (eps > 0)
    return torch.where(good, eps, torch.ones_like(eps))


def spearman_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    dim: int = -1,
    epsilon: float | torch.Tensor | None = None,
    method: str = "pav",
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Soft Spearman loss: 1 - the correlation of the soft ranks of ``input`` with ``target``'s.

    The hard loss is ``1 - scipy.stats.spearmanr(input_row, target_row).statistic`` per row.
    The soft one replaces the ranks of ``input`` by :func:`softops.soft_rank` (ascending) and
    keeps the hard ranks :math:`h` of ``target``, ties sharing their mean rank as in
    ``scipy.stats.rankdata``:

    .. math::

        \ell = 1 - \frac{\sum_i (r_i - \bar r)(h_i - \bar h)}
        {\sqrt{\sum_i (r_i - \bar r)^2}\sqrt{\sum_i (h_i - \bar h)^2}} \in [0, 2],
        \qquad r = \mathrm{soft\_rank}(x; \varepsilon).

    A constant row (of ``input`` or ``target``) has correlation 0: loss 1, zero gradient. A row
    holding a NaN gives NaN.

    Args:
        input: predictions, any shape, floating dtype; ranked along ``dim``.
        target: the shape of ``input``, real dtype; only its ranks matter.
        dim: the dimension to rank along; every other dim is a batch dim.
        epsilon: the soft ranks' smoothing strength; None (default): relative to each row (the
            module docstring).
        method: the soft-rank method: ``"pav"`` (default), ``"softsort"``, ``"neuralsort"`` or
            ``"ot"``.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (the batch shape).

    Returns:
        A tensor in the dtype of ``input``: 0-dim, or the batch shape for ``reduction="none"``.

    Example:
        >>> x = torch.tensor([[0.1, 0.4, 0.3, 0.9], [1.0, 2.0, 3.0, 4.0]])
        >>> t = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
        >>> spearman_loss(x, t, epsilon=0.01, reduction="none")
        tensor([0.2000, 2.0000])
        >>> spearman_loss(x, t, epsilon=10.0, reduction="none").round(decimals=4)
        tensor([0.1276, 2.0000])
    """
    op = "spearman_loss"
    d, n, epsilon = _check_ranking(input, target, dim, epsilon, reduction, op)
    check_choice(method, SORT_METHODS, op, "method")
    cd = compute_dtype(input.dtype)
    x = input.to(cd)
    eps = _row_epsilon(x, d, n) if epsilon is None else epsilon
    r = soft_rank(x, dim=d, epsilon=eps, method=method)
    r2, restore = flatten_to_2d(r, d)
    x2, _ = flatten_to_2d(x, d)
    t2, _ = flatten_to_2d(target.to(cd), d)
    cov, var = pearson_terms(r2, average_ranks(t2))
    # A constant row: correlation 0 (decided on the data, not on round-off of the soft ranks).
    x_const = (x2.amax(-1) == x2.amin(-1)) & ~torch.isnan(x2).any(-1)
    degenerate = x_const | (var == 0)
    den = torch.sqrt(torch.where(degenerate, 1.0, var))  # no 0 * inf in the backward
    corr = torch.where(degenerate, 0.0, cov / den)
    loss = restore((1 - corr).unsqueeze(-1)).squeeze(d)
    return _reduce(loss, reduction).to(input.dtype)


def ndcg_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    dim: int = -1,
    k: int | None = None,
    epsilon: float | torch.Tensor | None = None,
    gain: str = "linear",
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Soft NDCG loss: 1 - the NDCG of the ranking of ``input``, with soft ranks.

    The hard loss is ``1 - sklearn.metrics.ndcg_score(target, input, k=k)`` per row (on scores
    without ties). The soft one takes the descending soft ranks
    :math:`r = \mathrm{soft\_rank}(x, \text{descending=True})` (rank 1 for the highest score;
    method "pav", so :math:`1 \le r_i \le n`) and, with ``k``, the soft top-k mask
    :math:`m = \mathrm{soft\_topk\_mask}(x, k)` as the soft indicator of :math:`r_i \le k`:

    .. math::

        \mathrm{DCG} = \sum_i \frac{g(y_i)\, m_i}{\log_2(1 + r_i)}, \qquad
        \mathrm{IDCG} = \sum_{j=1}^{\min(k, n)} \frac{g(y_{[j]})}{\log_2(1 + j)}, \qquad
        \ell = 1 - \frac{\mathrm{DCG}}{\mathrm{IDCG}},

    with :math:`y_{[j]}` the j-th largest relevance (the ideal ordering, hard), :math:`m = 1`
    without ``k``, and the gain :math:`g(y) = y` ("linear", scikit-learn's ``ndcg_score``) or
    :math:`2^y - 1` ("exp"). A row with IDCG = 0 (no relevant entry) has loss 0 and a zero
    gradient: every ordering of it is ideal. A row holding a NaN gives NaN.

    Args:
        input: scores, any shape, floating dtype; higher ranks first along ``dim``.
        target: the relevance of each entry, the shape of ``input``, non-negative.
        dim: the dimension to rank along; every other dim is a batch dim.
        k: None (default; all n positions count) or an int in [1, n]: NDCG@k.
        epsilon: one smoothing strength for the soft ranks ("pav") and the top-k mask; None
            (default): relative to each row (the module docstring).
        gain: ``"linear"`` (default) or ``"exp"``.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (the batch shape).

    Returns:
        A tensor in the dtype of ``input``: 0-dim, or the batch shape for ``reduction="none"``.

    Example:
        >>> x = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
        >>> y = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
        >>> ndcg_loss(x, y, epsilon=0.1, reduction="none")
        tensor([0.0000, 0.3801])
        >>> ndcg_loss(x, y, k=1, epsilon=0.01, reduction="none")
        tensor([0., 1.])
    """
    op = "ndcg_loss"
    d, n, epsilon = _check_ranking(input, target, dim, epsilon, reduction, op)
    check_choice(gain, GAINS, op, "gain")
    check_optional_int(k, op, "k")
    if k is not None and not 1 <= k <= n:
        raise ValueError(f"{op}: expected 1 <= `k` <= input.shape[dim] (= {n}) or None; got k={k}.")
    check_relevance(target, op, "`target` (relevance)")
    cd = compute_dtype(input.dtype)
    x = input.to(cd)
    eps = _row_epsilon(x, d, n) if epsilon is None else epsilon
    r = soft_rank(x, dim=d, descending=True, epsilon=eps)
    discount = 1 / torch.log2(1 + r)
    if k is not None and k < n:
        discount = discount * soft_topk_mask(x, k, dim=d, epsilon=eps)
    g = gain_of(target.to(cd), gain)
    dcg = (g * discount).sum(d)
    g2, _ = flatten_to_2d(g, d)
    m = n if k is None else k
    ideal = g2.sort(dim=-1, descending=True).values[:, :m]
    positions = torch.arange(2, m + 2, dtype=cd, device=x.device)
    idcg = (ideal / torch.log2(positions)).sum(-1).reshape(dcg.shape)
    zero = idcg == 0
    loss = torch.where(zero, 0.0, 1 - dcg / torch.where(zero, 1.0, idcg))
    return _reduce(loss, reduction).to(input.dtype)
