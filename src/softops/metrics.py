r"""Soft classification metrics (accuracy, precision, recall, F1, top-k accuracy) and hard
ranking metrics (:func:`ndcg`, :func:`spearman`) to report beside the soft ranking losses.

Each metric replaces the hard prediction (the argmax, or membership in the top k) by a
probability, so the confusion counts become sums of probabilities. With the class probabilities
:math:`p_{nc}` of N samples and their labels :math:`t_n`, the soft counts of class c are

.. math::

    TP_c = \sum_n p_{nc}\,[t_n = c], \qquad P_c = \sum_n p_{nc}, \qquad T_c = \sum_n [t_n = c],

and precision, recall and F1 are :math:`TP_c / P_c`, :math:`TP_c / T_c` and
:math:`2\,TP_c / (P_c + T_c)`. On one-hot probabilities every metric equals scikit-learn's
(``labels=range(C)``, ``zero_division=0``); with ``from_logits=True`` and ``epsilon -> 0`` it
tends to scikit-learn's metric of the argmax.

**Inputs.** ``input`` is (N, C), classes last: probabilities (used as given, not checked), or
logits with ``from_logits=True`` (``softmax(input / epsilon)``); a binary (N,) input is the
probability of class 1 (``sigmoid(input / epsilon)``). ``target``: integer labels (N,) in [0, C)
({0, 1} for a 1-D input).

**Epsilon** is the softmax temperature, in the units of the logits (larger is smoother), a
positive float or a 0-dim tensor (which receives a gradient); it is used only with
``from_logits=True`` and must stay at its default 1.0 otherwise. Scaling law: logits ``c * z``
with ``epsilon = c * e`` give the value of ``z`` with ``e``; as ``epsilon -> 0`` a metric tends
to its hard value at the argmax (on logits without ties for the max).

**Average.** None means ``"binary"`` for 1-D input and ``"macro"`` otherwise. ``"binary"``:
the positive class (class 1 of an (N, 2) input); ``"micro"``: counts summed over the classes
(for probabilities summing to 1, micro precision, recall and F1 equal :func:`soft_accuracy`);
``"macro"``: the mean over all C classes, absent ones included. A zero denominator, or a class
without a true member in precision and F1, scores 0 with a zero gradient.

**Batch bias and counts.** Precision, recall and F1 are ratios of sums over the batch, so a
minibatch value is a biased estimate of the dataset's (the bias shrinks like 1/N, worst for rare
classes). :func:`soft_confusion` (the update) returns counts that add up over batches, and
:func:`precision_from_counts`, :func:`recall_from_counts` and :func:`f1_from_counts` (the
compute) score them once, as in torchmetrics; ``soft_f1(input, target)`` is
``f1_from_counts(soft_confusion(input, target))``. To train for F1, train with cross-entropy,
then fine-tune with :func:`softops.losses.f1_loss` on large batches (Su 2019).

Every metric returns a 0-dim tensor in the dtype of ``input`` (float16 and bfloat16 computed in
float32), differentiable in ``input`` and a tensor ``epsilon``.

References:
    Su Jianlin. 函数光滑化杂谈：不可导函数的可导逼近 (On smoothing: differentiable approximations
    of non-differentiable functions), section "正确率" (accuracy). Blog post, kexue.fm, 2019.
    Jansche. Maximum Expected F-Measure Training of Logistic Regression Models. HLT/EMNLP 2005.
    Bénédict, Koops, Odijk and de Rijke. sigmoidF1: A Smooth F1 Score Surrogate Loss for
    Multilabel Classification. arXiv:2108.10566.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from softops._core.transforms import cannot_branch
from softops._core.validation import (
    check_bool,
    check_choice,
    check_dim,
    check_epsilon,
    check_floating,
    check_real,
    compute_dtype,
)
from softops.topk import MASK_METHODS, soft_topk_mask

__all__ = [
    "SoftConfusion",
    "f1_from_counts",
    "ndcg",
    "precision_from_counts",
    "recall_from_counts",
    "soft_accuracy",
    "soft_confusion",
    "soft_f1",
    "soft_precision",
    "soft_recall",
    "soft_topk_accuracy",
    "spearman",
]

AVERAGES = ("binary", "micro", "macro")
GAINS = ("linear", "exp")
# "softkmax" is left out: its mask is not clipped, so the "probability" of a hit could exceed 1
# ("sparse" is clipped: it is in).
TOPK_METHODS = tuple(m for m in MASK_METHODS if m != "softkmax")


class SoftConfusion(NamedTuple):
    r"""Soft confusion counts, as returned by :func:`soft_confusion`.

    Each field is 0-dim ("binary", "micro") or (C,) ("macro"). ``a + b`` adds field by field
    (not a tuple concatenation) and ``sum(counts)`` works: a dataset's counts are its batches' sum.

    Attributes:
        tp: the true-positive mass :math:`TP = \sum_n p_n [t_n = c]`.
        predicted: the predicted mass :math:`P = \sum_n p_n`.
        true: the true count :math:`T = \sum_n [t_n = c]`.
    """

    tp: torch.Tensor
    predicted: torch.Tensor
    true: torch.Tensor

    def __add__(self, other: object) -> SoftConfusion:
        if not isinstance(other, SoftConfusion):
            return NotImplemented
        if self.tp.shape != other.tp.shape:
            raise ValueError(
                "SoftConfusion: expected counts of one shape (made with one `average`) to add; "
                f"got shapes {tuple(self.tp.shape)} and {tuple(other.tp.shape)}."
            )
        return SoftConfusion(*(a + b for a, b in zip(self, other, strict=True)))

    def __radd__(self, other: object) -> SoftConfusion:
        # ``sum(...)`` starts from the int 0.
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented


# ------------------------------------------------------------------------------------ validation


def _check_target(target: Any, n: int, n_classes: int, input_shape: torch.Size, op: str) -> None:
    """Integer labels (n,) in [0, n_classes); the range checked eagerly only (one host sync)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{op}: expected `target` to be a torch.Tensor; got {type(target).__name__}."
        )
    if target.dtype.is_floating_point or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(
            f"{op}: expected `target` to have an integer dtype (class labels); "
            f"got dtype={target.dtype}."
        )
    if tuple(target.shape) != (n,):
        raise ValueError(
            f"{op}: expected `target` of shape ({n},) to match input of shape "
            f"{tuple(input_shape)}; got shape {tuple(target.shape)}."
        )
    if cannot_branch(target):
        return
    bad = (target < 0) | (target >= n_classes)
    if bool(bad.any()):
        value = int(target[bad][0])
        what = "in {0, 1}" if len(input_shape) == 1 else f"in [0, C) = [0, {n_classes})"
        raise ValueError(f"{op}: expected `target` values {what}; got {value}.")


def _check_input(input: Any, op: str, name: str = "input", binary: bool = True) -> None:
    """Predictions of shape (N, C), or (N,) where ``binary``, floating, non-empty."""
    shape = tuple(check_floating(input, op, name).shape)
    if input.dim() != 2 and not (binary and input.dim() == 1):
        shapes = "(N,) (binary) or (N, C)" if binary else "(N, C)"
        raise ValueError(f"{op}: expected `{name}` of shape {shapes}; got shape {shape}.")
    if input.numel() == 0:
        raise ValueError(f"{op}: expected a non-empty batch; got `{name}` of shape {shape}.")


def check_logits_epsilon(
    from_logits: Any, epsilon: Any, op: str, dtype: torch.dtype | None = None
) -> float | torch.Tensor:
    """``from_logits`` and its ``epsilon`` (left at 1.0 without it); shared with softops.nn."""
    check_bool(from_logits, op, "from_logits")
    if not from_logits:
        if isinstance(epsilon, torch.Tensor) or epsilon != 1.0:
            raise ValueError(
                f"{op}: expected `epsilon` to be left at its default 1.0 (it is used only with "
                f"from_logits=True); got epsilon={epsilon!r}."
            )
        return 1.0
    return check_epsilon(epsilon, op, dtype=dtype)


def check_classification(
    input: Any, target: Any, from_logits: Any, epsilon: Any, op: str
) -> float | torch.Tensor:
    """The checks of every classification metric and loss; returns ``epsilon`` checked."""
    _check_input(input, op)
    n_classes = 2 if input.dim() == 1 else input.shape[1]
    _check_target(target, input.shape[0], n_classes, input.shape, op)
    epsilon = check_logits_epsilon(from_logits, epsilon, op, input.dtype)
    if isinstance(epsilon, torch.Tensor) and epsilon.dim() != 0:
        raise ValueError(
            f"{op}: expected `epsilon` to be a float or a 0-dim tensor; "
            f"got a tensor of shape {tuple(epsilon.shape)}."
        )
    return epsilon


def check_average(average: Any, input: torch.Tensor, op: str) -> str:
    """Resolve ``average`` (None: "binary" for 1-D input, "macro" otherwise) or raise."""
    if average is None:
        return "binary" if input.dim() == 1 else "macro"
    check_choice(average, AVERAGES, op, "average")
    if average == "binary" and input.dim() == 2 and input.shape[1] != 2:
        raise ValueError(
            f"{op}: expected input of shape (N,) or (N, 2) for average='binary' (use 'micro' or "
            f"'macro' for more classes); got shape {tuple(input.shape)}."
        )
    return average


# ----------------------------------------------------------------------------------- the counts


def _logits_scale(x: torch.Tensor, epsilon: float | torch.Tensor) -> torch.Tensor:
    if isinstance(epsilon, torch.Tensor):
        return x / epsilon.to(x.dtype)
    return x if epsilon == 1.0 else x / epsilon


def _class_probabilities(
    input: torch.Tensor, from_logits: bool, epsilon: float | torch.Tensor
) -> torch.Tensor:
    """(N, C) probabilities in the compute dtype; a 1-D input becomes (N, 2) = [1 - p, p]."""
    x = input.to(compute_dtype(input.dtype))
    if from_logits:
        z = _logits_scale(x, epsilon)
        if x.dim() == 1:
            return torch.stack([torch.sigmoid(-z), torch.sigmoid(z)], dim=-1)
        return torch.softmax(z, dim=-1)
    return torch.stack([1 - x, x], dim=-1) if x.dim() == 1 else x


def true_class_probability(
    input: torch.Tensor,
    target: torch.Tensor,
    from_logits: bool,
    epsilon: float | torch.Tensor,
) -> torch.Tensor:
    """(N,) probability of the true class (the soft 0/1 hit), compute dtype; unchecked."""
    p = _class_probabilities(input, from_logits, epsilon)
    return p.gather(1, target.long().unsqueeze(1)).squeeze(1)


def _safe_divide(
    num: torch.Tensor, den: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """``num / den``, and 0 (with a zero gradient, no NaN) where ``den == 0`` or ``zero``."""
    zero = den == 0 if zero is None else zero | (den == 0)
    den = torch.where(zero, 1.0, den)
    # Both scaled by the power of two c (two factors: 2**149 is beyond float32) that brings den
    # into [1/2, 1): the backward's den**2 would underflow where den is subnormal.
    e = -torch.frexp(den.detach()).exponent
    c1 = torch.ldexp(torch.ones_like(den), e // 2)
    c2 = torch.ldexp(torch.ones_like(den), e - e // 2)
    return torch.where(zero, 0.0, (num * c1 * c2) / (den * c1 * c2))


def _confusion(
    input: torch.Tensor,
    target: torch.Tensor,
    average: str,
    from_logits: bool,
    epsilon: float | torch.Tensor,
) -> SoftConfusion:
    """Soft (TP, P, T), unchecked: 0-dim for "binary" and "micro", shape (C,) for "macro"."""
    p = _class_probabilities(input, from_logits, epsilon)
    if average == "binary":
        p = p[:, 1]
        t = (target == 1).to(p.dtype)
        return SoftConfusion((p * t).sum(), p.sum(), t.sum())
    t = target.long()
    if average == "micro":
        tp = p.gather(1, t.unsqueeze(1)).sum()
        true = torch.tensor(float(t.numel()), dtype=p.dtype, device=p.device)
        return SoftConfusion(tp, p.sum(), true)
    onehot = torch.nn.functional.one_hot(t, p.shape[1]).to(p.dtype)
    return SoftConfusion((p * onehot).sum(0), p.sum(0), onehot.sum(0))


def checked_confusion(
    input: Any, target: Any, average: Any, from_logits: Any, epsilon: Any, op: str
) -> SoftConfusion:
    """The update step with its checks, errors named after ``op`` (shared with f1_loss)."""
    epsilon = check_classification(input, target, from_logits, epsilon, op)
    average = check_average(average, input, op)
    return _confusion(input, target, average, from_logits, epsilon)


def _check_counts(counts: Any, op: str) -> SoftConfusion:
    if not (
        isinstance(counts, tuple)
        and len(counts) == 3
        and all(isinstance(c, torch.Tensor) for c in counts)
    ):
        raise TypeError(
            f"{op}: expected `counts` to be a SoftConfusion (tp, predicted, true) of tensors, as "
            f"returned by soft_confusion; got {type(counts).__name__}."
        )
    shapes = [tuple(c.shape) for c in counts]
    if len(set(shapes)) != 1 or len(shapes[0]) > 1 or shapes[0] == (0,):
        raise ValueError(
            f"{op}: expected `counts` whose three tensors share one shape, () or (C,) with "
            f"C >= 1; got shapes {shapes}."
        )
    return SoftConfusion(*counts)


def _class_mean(score: torch.Tensor) -> torch.Tensor:
    """The macro average: the mean over the classes of per-class counts."""
    return score.mean() if score.dim() == 1 else score


# --------------------------------------------------------------------- update and compute


def soft_confusion(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    average: str | None = None,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> SoftConfusion:
    r"""Soft confusion counts of one batch: the update step of precision, recall and F1.

    The hard counts of ``pred = input.argmax(-1)`` (``input > 0.5`` for a 1-D input) are
    ``((pred == c) & (target == c)).sum()``, ``(pred == c).sum()`` and ``(target == c).sum()``;
    the soft ones replace ``pred == c`` by :math:`p_{nc}` (:math:`TP_c, P_c, T_c` of the module
    docstring). Counts of batches add up; accumulate under ``torch.no_grad()`` to evaluate.

    Args:
        input: (N, C) class probabilities or (N,) binary ones; logits with ``from_logits``.
        target: integer labels (N,), in [0, C).
        average: ``"binary"``, ``"micro"`` (0-dim counts) or ``"macro"`` (per class, (C,)); None:
            "binary" for a 1-D input, else "macro".
        from_logits: ``input`` holds logits (``softmax(input / epsilon)``).
        epsilon: the softmax temperature (module docstring), with ``from_logits`` only.

    Shape:
        - input: :math:`(N, C)` or :math:`(N,)`; target: :math:`(N,)`; each count: :math:`()`
          ("binary", "micro") or :math:`(C,)` ("macro").

    Returns:
        ``SoftConfusion(tp, predicted, true)`` in the compute dtype of ``input`` (float32 for
        float16 and bfloat16, so that sums keep their precision); differentiable.

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> counts = soft_confusion(p, t)
        >>> counts.tp, counts.predicted, counts.true
        (tensor([1.0000, 0.8000, 0.0000]), tensor([1.1000, 1.3000, 0.6000]), tensor([2., 1., 0.]))
    """
    return checked_confusion(input, target, average, from_logits, epsilon, "soft_confusion")


def precision_from_counts(counts: SoftConfusion) -> torch.Tensor:
    r"""Soft precision from soft counts, :math:`TP / P`: the compute step of :func:`soft_precision`.

    Args:
        counts: a :class:`SoftConfusion` (or a sum of them); counts (C,) give the mean of the
            per-class ratios.

    Returns:
        A 0-dim tensor in the dtype of the counts (zero denominators: module docstring).

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> precision_from_counts(soft_confusion(p, t)).round(decimals=4)
        tensor(0.5082)
    """
    tp, predicted, true = _check_counts(counts, "precision_from_counts")
    # true == 0: TP is identically 0, and its gradient times 1 / P (inf for a subnormal P) NaN
    return _class_mean(_safe_divide(tp, predicted, true == 0))


def recall_from_counts(counts: SoftConfusion) -> torch.Tensor:
    r"""Soft recall from soft counts, :math:`TP / T`: the compute step of :func:`soft_recall`.

    Args:
        counts: as for :func:`precision_from_counts`.

    Returns:
        A 0-dim tensor in the dtype of the counts.

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> recall_from_counts(soft_confusion(p, t))
        tensor(0.4333)
    """
    tp, _, true = _check_counts(counts, "recall_from_counts")
    return _class_mean(_safe_divide(tp, true))


def f1_from_counts(counts: SoftConfusion) -> torch.Tensor:
    r"""Soft F1 from soft counts, :math:`2\,TP / (P + T)`: the compute step of :func:`soft_f1`.

    Args:
        counts: as for :func:`precision_from_counts`.

    Returns:
        A 0-dim tensor in the dtype of the counts.

    Example:
        Counts summed over the batches of a dataset give the F1 of the dataset:

        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> counts = sum(soft_confusion(p[i : i + 2], t[i : i + 2]) for i in (0, 2))
        >>> f1_from_counts(counts).round(decimals=4)  # = soft_f1(p, t)
        tensor(0.4469)
    """
    tp, predicted, true = _check_counts(counts, "f1_from_counts")
    return _class_mean(_safe_divide(2 * tp, predicted + true, true == 0))


# --------------------------------------------------------------------------------- the metrics


def soft_accuracy(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft accuracy: the mean probability given to the true class.

    The hard metric is::

        (input.argmax(-1) == target).float().mean()     # (N, C) input
        ((input > 0.5).long() == target).float().mean()  # (N,) binary input

    and the soft one replaces the 0/1 hit by the probability of the true class:

    .. math::

        \mathrm{acc} = \frac1N \sum_n p_{n, t_n}, \qquad
        \text{binary: } p_{n, t_n} = p_n \text{ if } t_n = 1 \text{ else } 1 - p_n .

    Args:
        input: (N, C) class probabilities or (N,) binary ones; logits with ``from_logits``.
        target: integer labels (N,), in [0, C).
        from_logits: ``input`` holds logits (``softmax(input / epsilon)``).
        epsilon: the softmax temperature (module docstring), with ``from_logits`` only.

    Shape:
        - input: :math:`(N, C)` or :math:`(N,)`; target: :math:`(N,)`; output: :math:`()`.

    Returns:
        A 0-dim tensor in the dtype of ``input``; ``sklearn.metrics.accuracy_score`` on one-hots.

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> soft_accuracy(p, torch.tensor([0, 1, 0]))
        tensor(0.6000)
    """
    op = "soft_accuracy"
    epsilon = check_classification(input, target, from_logits, epsilon, op)
    return true_class_probability(input, target, from_logits, epsilon).mean().to(input.dtype)


_COMMON_ARGS = r"""
    Args:
        input: (N, C) class probabilities or (N,) binary ones; logits with ``from_logits``.
        target: integer labels (N,), in [0, C).
        average: ``"binary"``, ``"micro"`` or ``"macro"`` (module docstring); None: "binary"
            for a 1-D input, else "macro".
        from_logits: ``input`` holds logits (``softmax(input / epsilon)``).
        epsilon: the softmax temperature (module docstring), with ``from_logits`` only.

    Shape:
        - input: :math:`(N, C)` or :math:`(N,)`; target: :math:`(N,)`; output: :math:`()`.

    Returns:
        A 0-dim tensor in the dtype of ``input``; scikit-learn's metric on one-hots.

"""


def soft_precision(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    average: str | None = None,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft precision: true-positive mass over predicted mass.

    The hard metric is ``sklearn.metrics.precision_score(target, pred, labels=range(C),
    average=average, zero_division=0)`` with ``pred = input.argmax(-1)``; the soft one:

    .. math::

        \mathrm{precision}_c = \frac{TP_c}{P_c}
        = \frac{\sum_n p_{nc} [t_n = c]}{\sum_n p_{nc}} .

    With ``from_logits=True`` it is formed in log space (a finite gradient where :math:`P_c` is
    subnormal).
    {args}
    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> soft_precision(p, t).round(decimals=4)
        tensor(0.5082)
    """
    op = "soft_precision"
    epsilon = check_classification(input, target, from_logits, epsilon, op)
    average = check_average(average, input, op)
    if from_logits and average != "micro":  # (micro: P = N)
        return _class_mean(_precision_from_logits(input, target, average, epsilon)).to(input.dtype)
    counts = _confusion(input, target, average, from_logits, epsilon)
    return precision_from_counts(counts).to(input.dtype)


def _precision_from_logits(
    input: torch.Tensor, target: torch.Tensor, average: str, epsilon: float | torch.Tensor
) -> torch.Tensor:
    """Per-class precision of logits, ``sum_n [t_n = c] softmax_n(log p_nc)``; 0 where P_c = 0."""
    z = _logits_scale(input.to(compute_dtype(input.dtype)), epsilon)
    if z.dim() == 1:
        f = torch.nn.functional.logsigmoid
        log_p = torch.stack([f(-z), f(z)], dim=-1)
    else:
        log_p = torch.log_softmax(z, dim=-1)
    if average == "binary":
        log_p, t = log_p[:, 1:2], (target == 1).unsqueeze(1)
    else:
        t = torch.nn.functional.one_hot(target.long(), log_p.shape[1]).bool()
    empty = (log_p.detach().exp().sum(0) == 0).unsqueeze(0)  # P_c == 0
    w = torch.softmax(torch.where(empty, 0.0, log_p), dim=0)
    return torch.where(empty, 0.0, torch.where(t, w, 0.0)).sum(0)


def soft_recall(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    average: str | None = None,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft recall: true-positive mass over the number of true members.

    The hard metric is ``sklearn.metrics.recall_score(target, pred, labels=range(C),
    average=average, zero_division=0)`` with ``pred = input.argmax(-1)``; the soft one:

    .. math::

        \mathrm{recall}_c = \frac{TP_c}{T_c} = \frac{\sum_n p_{nc} [t_n = c]}{\sum_n [t_n = c]} .
    {args}
    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> soft_recall(p, t)
        tensor(0.4333)
    """
    counts = checked_confusion(input, target, average, from_logits, epsilon, "soft_recall")
    return recall_from_counts(counts).to(input.dtype)


def soft_f1(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    average: str | None = None,
    from_logits: bool = False,
    epsilon: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    r"""Soft F1: the harmonic mean of soft precision and soft recall.

    The hard metric is ``sklearn.metrics.f1_score(target, pred, labels=range(C),
    average=average, zero_division=0)`` with ``pred = input.argmax(-1)``; the soft one (Su 2019):

    .. math::

        F1_c = \frac{2\,TP_c}{P_c + T_c}
        = \frac{2 \sum_n p_{nc} [t_n = c]}{\sum_n \big(p_{nc} + [t_n = c]\big)}.

    A minibatch value is biased (module docstring): over a dataset, sum the counts and score once.
    {args}
    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
        >>> t = torch.tensor([0, 1, 0])
        >>> soft_f1(p, t).round(decimals=4)
        tensor(0.4469)
    """
    counts = checked_confusion(input, target, average, from_logits, epsilon, "soft_f1")
    return f1_from_counts(counts).to(input.dtype)


for _fn in (soft_precision, soft_recall, soft_f1):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("    {args}\n", _COMMON_ARGS)


def check_topk_classification(
    scores: Any, target: Any, k: Any, epsilon: Any, method: Any, op: str
) -> tuple[int, float | torch.Tensor]:
    """The checks of the top-k accuracy metric and losses; returns ``(k, epsilon)`` checked."""
    _check_input(scores, op, "scores", binary=False)
    n, n_classes = scores.shape
    _check_target(target, n, n_classes, scores.shape, op)
    if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.dtype.is_floating_point:
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: expected `k` to be an int; got k={k!r}.")
    if not 1 <= k <= n_classes:
        raise ValueError(
            f"{op}: expected 1 <= `k` <= C (= {n_classes}) for scores of shape "
            f"{tuple(scores.shape)}; got k={k}."
        )
    check_choice(method, TOPK_METHODS, op, "method")
    epsilon = check_epsilon(epsilon, op, dtype=scores.dtype)
    if method not in ("ot", "sparse") and torch.is_tensor(epsilon) and epsilon.requires_grad:
        raise ValueError(
            f"{op}: expected an `epsilon` that does not require grad with method={method!r} "
            "(only methods 'ot' and 'sparse' differentiate with respect to epsilon); got one "
            "that does."
        )
    return k, epsilon


def true_class_topk_membership(
    scores: torch.Tensor,
    target: torch.Tensor,
    k: int,
    epsilon: float | torch.Tensor,
    method: str,
    hard: bool,
) -> torch.Tensor:
    """(N,) soft membership of the true class in the top k, compute dtype; unchecked."""
    x = scores.to(compute_dtype(scores.dtype))
    mask = soft_topk_mask(x, k, epsilon=epsilon, method=method, hard=hard)
    return mask.gather(1, target.long().unsqueeze(1)).squeeze(1)


def soft_topk_accuracy(
    scores: torch.Tensor,
    target: torch.Tensor,
    k: int,
    *,
    epsilon: float | torch.Tensor = 0.1,
    method: str = "ot",
    hard: bool = False,
) -> torch.Tensor:
    r"""Soft top-k accuracy: the mean soft membership of the true class in the top k.

    The hard metric is::

        (scores.topk(k, -1).indices == target[:, None]).any(-1).float().mean()

    (scikit-learn's ``top_k_accuracy_score``). The soft one reads the true class off the soft
    top-k mask (:func:`softops.soft_topk_mask`):

    .. math::

        \mathrm{acc}@k = \frac1N \sum_n A_{n, t_n}, \qquad
        A_{nc} = \sigma\!\left(\frac{s_{nc} - \tau_n}{\varepsilon}\right), \quad
        \sum_c A_{nc} = k .

    Args:
        scores: raw scores (not probabilities), (N, C), floating dtype.
        target: integer labels, (N,), in [0, C).
        k: an int in [1, C].
        epsilon: the mask's temperature, in the units of the scores (a float, or a tensor
            broadcastable to (N,)); as for :func:`softops.soft_topk_mask`.
        method: the mask's method: "ot" (default), "sinkhorn", "perturbed" or "sparse" (not
            "softkmax", whose mask is not clipped to [0, 1]).
        hard: straight-through: the hard value forward, the soft gradient backward.

    Shape:
        - scores: :math:`(N, C)`; target: :math:`(N,)`; output: :math:`()`.

    Returns:
        A 0-dim tensor in the dtype of ``scores``.

    Example:
        >>> s = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
        >>> t = torch.tensor([1, 2])
        >>> soft_topk_accuracy(s, t, 1, epsilon=0.5).round(decimals=4)
        tensor(0.1796)
    """
    op = "soft_topk_accuracy"
    k, epsilon = check_topk_classification(scores, target, k, epsilon, method, op)
    check_bool(hard, op, "hard")
    hits = true_class_topk_membership(scores, target, k, epsilon, method, hard)
    return hits.mean().to(scores.dtype)


# -------------------------------------------------------------------------- hard ranking metrics


def _check_pair(a: Any, b: Any, dim: Any, op: str, names: tuple[str, str]) -> int:
    """Two real tensors of one shape with a valid ``dim``; returns dim, non-negative."""
    for name, t in zip(names, (a, b), strict=True):
        check_real(t, op, name)
    if a.shape != b.shape:
        raise ValueError(
            f"{op}: expected `{names[1]}` of the shape of {names[0]} {tuple(a.shape)}; got shape "
            f"{tuple(b.shape)}."
        )
    d = check_dim(a, dim, op)
    if a.shape[d] == 0:
        raise ValueError(
            f"{op}: expected a non-empty `dim`; got {names[0]}.shape[{d}] = 0 "
            f"({names[0]}.shape={tuple(a.shape)})."
        )
    return d


def _metric_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The floating dtype of the inputs (the default dtype for two integer tensors)."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def check_optional_int(value: Any, op: str, name: str, low: int | None = None) -> None:
    """An int or None (``TypeError``), at least ``low`` when given (``ValueError``)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: expected `{name}` to be an int or None; got {name}={value!r}.")
    if low is not None and value < low:
        raise ValueError(f"{op}: expected `{name}` >= {low} or None; got {name}={value}.")


def gain_of(relevance: torch.Tensor, gain: str) -> torch.Tensor:
    """The NDCG gain: ``y`` ("linear") or ``2**y - 1`` ("exp")."""
    return relevance if gain == "linear" else torch.expm1(relevance * math.log(2.0))


def check_relevance(relevance: torch.Tensor, op: str, name: str) -> None:
    """Non-negative relevance, checked eagerly only (one host sync)."""
    if not cannot_branch(relevance) and bool((relevance < 0).any()):
        value = relevance[relevance < 0].flatten()[0].item()
        raise ValueError(f"{op}: expected non-negative {name}; got {value}.")


def average_ranks(t: torch.Tensor) -> torch.Tensor:
    """1-based ranks along the last dim, ties sharing their mean (scipy rankdata); NaN rows NaN."""
    t = t.contiguous()
    s = t.sort(dim=-1).values
    lo = torch.searchsorted(s, t, right=False)
    hi = torch.searchsorted(s, t, right=True)
    dtype = t.dtype if t.dtype.is_floating_point else torch.get_default_dtype()
    ranks = (lo + hi + 1).to(dtype) / 2
    if not t.dtype.is_floating_point:
        return ranks
    return torch.where(torch.isnan(t).any(-1, keepdim=True), math.nan, ranks)


def spearman(pred: torch.Tensor, target: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
    r"""Spearman's rank correlation of ``pred`` and ``target`` along ``dim``, per row.

    Each row's value is ``scipy.stats.spearmanr(pred_row, target_row).statistic``: the Pearson
    correlation of the ranks, ties sharing their mean rank (``scipy.stats.rankdata``):

    .. math::

        \rho = \frac{\sum_i (a_i - \bar a)(b_i - \bar b)}
        {\sqrt{\sum_i (a_i - \bar a)^2}\sqrt{\sum_i (b_i - \bar b)^2}}, \qquad
        a = \mathrm{rank}(\text{pred}), \; b = \mathrm{rank}(\text{target}).

    A constant row gives NaN, as in scipy, and so does a row holding a NaN. The metric is hard
    (a zero gradient); train with :func:`softops.losses.spearman_loss`.

    Args:
        pred: predictions, any shape, real dtype; ranked along ``dim``.
        target: the shape of ``pred``, real dtype.
        dim: the dimension to rank along; every other dim is a batch dim.

    Returns:
        The correlations, of the shape of ``pred`` without ``dim``, in the floating dtype of the
        inputs (the default dtype for integer ones).

    Example:
        >>> pred = torch.tensor([[0.1, 0.4, 0.3, 0.9], [1.0, 2.0, 3.0, 4.0]])
        >>> target = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 3.0, 1.0]])
        >>> spearman(pred, target)
        tensor([ 0.8000, -0.9487])
    """
    op = "spearman"
    d = _check_pair(pred, target, dim, op, ("pred", "target"))
    dtype = _metric_dtype(pred, target)
    cd = compute_dtype(dtype)
    a = average_ranks(pred.movedim(d, -1).to(cd))
    b = average_ranks(target.movedim(d, -1).to(cd))
    cov, var = pearson_terms(a, b)
    return (cov / torch.sqrt(var)).clamp(-1, 1).to(dtype)


def pearson_terms(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cov, var)``, the Pearson correlation of the rows of a and b being ``cov / sqrt(var)``."""
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1), (a * a).sum(-1) * (b * b).sum(-1)


def ndcg(
    scores: torch.Tensor,
    relevance: torch.Tensor,
    k: int | None = None,
    *,
    dim: int = -1,
    gain: str = "linear",
) -> torch.Tensor:
    r"""The normalised discounted cumulative gain of the ranking by ``scores``, per row.

    Each row's value is ``sklearn.metrics.ndcg_score(relevance_row[None], scores_row[None],
    k=k)``, tie handling included: entries with tied scores share their places, each getting
    the mean gain of the tie over the sum of the places' discounts (scikit-learn's default,
    ``ignore_ties=False``). With the entries sorted by decreasing score and the discount
    :math:`D(j) = 1/\log_2(1 + j)` for places :math:`j \le k` (0 beyond):

    .. math::

        \mathrm{DCG} = \sum_{\text{ties } T} \Big(\frac{1}{|T|}\sum_{i \in T} g(y_i)\Big)
        \sum_{j \in \text{places}(T)} D(j), \qquad
        \mathrm{NDCG} = \frac{\mathrm{DCG}}{\mathrm{IDCG}},

    with :math:`\mathrm{IDCG}` the DCG of the ideal ordering and the gain :math:`g(y) = y`
    ("linear") or :math:`2^y - 1` ("exp"). A row with IDCG = 0 scores 0, as in scikit-learn; a
    row holding a NaN gives NaN. The metric is hard (a zero gradient); train with
    :func:`softops.losses.ndcg_loss`.

    Args:
        scores: predicted scores, any shape, real dtype; higher ranks first along ``dim``.
        relevance: the relevance of each entry, the shape of ``scores``, non-negative.
        k: None (default: every place) or an int >= 1: NDCG@k.
        dim: the dimension to rank along; every other dim is a batch dim.
        gain: ``"linear"`` (default, scikit-learn's) or ``"exp"``.

    Returns:
        The NDCG of each row, of the shape of ``scores`` without ``dim``, in the floating dtype
        of the inputs (the default dtype for integer ones).

    Example:
        >>> relevance = torch.tensor([[3.0, 2.0, 0.0, 1.0]])
        >>> ndcg(torch.tensor([[0.9, 0.8, 0.1, 0.5]]), relevance)  # the ideal order
        tensor([1.])
        >>> ndcg(torch.tensor([[0.1, 0.8, 0.9, 0.5]]), relevance).round(decimals=4)
        tensor([0.6413])
    """
    op = "ndcg"
    d = _check_pair(scores, relevance, dim, op, ("scores", "relevance"))
    check_optional_int(k, op, "k", 1)
    check_choice(gain, GAINS, op, "gain")
    check_relevance(relevance, op, "`relevance`")
    dtype = _metric_dtype(scores, relevance)
    cd = compute_dtype(dtype)
    x = scores.movedim(d, -1).to(cd).contiguous()
    g = gain_of(relevance.movedim(d, -1).to(cd), gain)
    n = x.shape[-1]
    discount = 1 / torch.log2(torch.arange(2, n + 2, dtype=cd, device=x.device))
    if k is not None and k < n:
        discount[k:] = 0
    cumulative = torch.cat([discount.new_zeros(1), discount.cumsum(0)])
    # the places [first, last) of each entry's tie, in the order of decreasing score
    ascending = x.sort(-1).values
    first = n - torch.searchsorted(ascending, x, right=True)
    last = n - torch.searchsorted(ascending, x, right=False)
    share = (cumulative[last] - cumulative[first]) / (last - first).clamp(min=1).to(cd)
    dcg = (g * share).sum(-1)
    idcg = (g.sort(-1, descending=True).values * discount).sum(-1)
    score = torch.where(idcg > 0, dcg / torch.where(idcg > 0, idcg, 1.0), 0.0)
    nan = torch.isnan(x).any(-1) | torch.isnan(g).any(-1)
    return torch.where(nan, math.nan, score).to(dtype)
