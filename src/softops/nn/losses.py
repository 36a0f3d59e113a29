"""Modules for the losses of :mod:`softops.losses`: ``forward(input, target)`` is the function
with the stored arguments (the wrappers' contract: :mod:`softops.nn`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from softops._core.validation import check_choice, check_dim, check_epsilon
from softops.losses import (
    REDUCTIONS,
    accuracy_loss,
    check_p_k,
    f1_loss,
    ndcg_loss,
    spearman_loss,
    topk_accuracy_loss,
    topk_cross_entropy,
)
from softops.metrics import (
    AVERAGES,
    GAINS,
    TOPK_METHODS,
    check_logits_epsilon,
    check_optional_int,
)
from softops.nn._module import ArgsModule
from softops.sort import SORT_METHODS

__all__ = [
    "AccuracyLoss",
    "F1Loss",
    "NDCGLoss",
    "SpearmanLoss",
    "TopKAccuracyLoss",
    "TopKCrossEntropy",
]


class AccuracyLoss(ArgsModule):
    """:func:`softops.losses.accuracy_loss` as a Module: ``forward(input, target)``.

    Args:
        from_logits, epsilon, reduction: as for the function.

    Example:
        >>> loss = AccuracyLoss(reduction="none")
        >>> loss(torch.tensor([[0.7, 0.3], [0.4, 0.6]]), torch.tensor([0, 0]))
        tensor([0.3000, 0.6000])
    """

    _fields = ("from_logits", "epsilon", "reduction")

    def __init__(
        self,
        *,
        from_logits: bool = False,
        epsilon: float | torch.Tensor = 1.0,
        reduction: str = "mean",
    ) -> None:
        op = type(self).__name__
        check_logits_epsilon(from_logits, epsilon, op)
        check_choice(reduction, REDUCTIONS, op, "reduction")
        super().__init__()
        self.from_logits, self.epsilon, self.reduction = from_logits, epsilon, reduction

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return accuracy_loss(input, target, **self._kwargs())


class TopKAccuracyLoss(ArgsModule):
    """:func:`softops.losses.topk_accuracy_loss` as a Module: ``forward(scores, target)``.

    Args:
        k: an int >= 1 (at most the number of classes, checked on the forward call).
        epsilon, method, reduction: as for the function.

    Example:
        >>> loss = TopKAccuracyLoss(2, epsilon=0.01, reduction="none")
        >>> loss(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), torch.tensor([1, 0]))
        tensor([0., 1.])
    """

    _fields = ("k", "epsilon", "method", "reduction")
    _args = ("k",)

    def __init__(
        self,
        k: int,
        *,
        epsilon: float | torch.Tensor = 0.1,
        method: str = "ot",
        reduction: str = "mean",
    ) -> None:
        op = type(self).__name__
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"{op}: expected `k` to be an int; got k={k!r}.")
        if k < 1:
            raise ValueError(f"{op}: expected `k` >= 1; got k={k}.")
        check_epsilon(epsilon, op)
        check_choice(method, TOPK_METHODS, op, "method")
        check_choice(reduction, REDUCTIONS, op, "reduction")
        super().__init__()
        self.k, self.epsilon, self.method, self.reduction = k, epsilon, method, reduction

    def forward(self, scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return topk_accuracy_loss(scores, target, self.k, **self._kwargs())


class TopKCrossEntropy(ArgsModule):
    """:func:`softops.losses.topk_cross_entropy` as a Module: ``forward(logits, target)``.

    Args:
        p_k: the weights of k = 1, ..., len(p_k): non-negative, summing to 1 (kept as a tuple
            of floats).
        epsilon, method, m, reduction: as for the function (``m`` >= len(p_k) here, at most
            the number of classes on the forward call).

    Example:
        >>> loss = TopKCrossEntropy([1.0])  # the cross-entropy
        >>> s, t = torch.tensor([[3.0, 2.0, 0.0]]), torch.tensor([1])
        >>> loss(s, t), torch.nn.functional.cross_entropy(s, t)
        (tensor(1.3490), tensor(1.3490))
    """

    _fields = ("p_k", "epsilon", "method", "m", "reduction")
    _args = ("p_k",)
    _optional = (("m", None),)

    def __init__(
        self,
        p_k: Sequence[float],
        *,
        epsilon: float | torch.Tensor = 1.0,
        method: str = "ot",
        m: int | None = None,
        reduction: str = "mean",
    ) -> None:
        op = type(self).__name__
        weights = check_p_k(p_k, op)
        check_epsilon(epsilon, op)
        check_choice(method, TOPK_METHODS, op, "method")
        check_optional_int(m, op, "m", len(weights))
        check_choice(reduction, REDUCTIONS, op, "reduction")
        super().__init__()
        self.p_k: tuple[float, ...] = tuple(weights)
        self.epsilon, self.method, self.m, self.reduction = epsilon, method, m, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return topk_cross_entropy(logits, target, self.p_k, **self._kwargs())


class F1Loss(ArgsModule):
    """:func:`softops.losses.f1_loss` as a Module: ``forward(input, target)``, a statistic of
    the whole batch (no ``reduction``).

    Args:
        average, from_logits, epsilon: as for the function.

    Example:
        >>> F1Loss()(torch.tensor([0.9, 0.2, 0.6, 0.3]), torch.tensor([1, 0, 1, 1]))
        tensor(0.2800)
    """

    _fields = ("average", "from_logits", "epsilon")

    def __init__(
        self,
        *,
        average: str | None = None,
        from_logits: bool = False,
        epsilon: float | torch.Tensor = 1.0,
    ) -> None:
        op = type(self).__name__
        if average is not None:
            check_choice(average, AVERAGES, op, "average")
        check_logits_epsilon(from_logits, epsilon, op)
        super().__init__()
        self.average, self.from_logits, self.epsilon = average, from_logits, epsilon

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return f1_loss(input, target, **self._kwargs())


class SpearmanLoss(ArgsModule):
    """:func:`softops.losses.spearman_loss` as a Module: ``forward(input, target)``.

    Args:
        dim, epsilon, method, reduction: as for the function (``epsilon=None``: relative to
            each row).

    Example:
        >>> loss = SpearmanLoss(epsilon=0.01, reduction="none")
        >>> loss(torch.tensor([[0.1, 0.4, 0.3, 0.9]]), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        tensor([0.2000])
    """

    _fields = ("dim", "epsilon", "method", "reduction")

    def __init__(
        self,
        *,
        dim: int = -1,
        epsilon: float | torch.Tensor | None = None,
        method: str = "pav",
        reduction: str = "mean",
    ) -> None:
        op = type(self).__name__
        check_dim(None, dim, op)
        if epsilon is not None:
            check_epsilon(epsilon, op)
        check_choice(method, SORT_METHODS, op, "method")
        check_choice(reduction, REDUCTIONS, op, "reduction")
        super().__init__()
        self.dim, self.epsilon, self.method, self.reduction = dim, epsilon, method, reduction

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return spearman_loss(input, target, **self._kwargs())


class NDCGLoss(ArgsModule):
    """:func:`softops.losses.ndcg_loss` as a Module: ``forward(input, target)``.

    Args:
        k: None (all places) or an int >= 1 (at most ``input.shape[dim]``, checked on the
            forward call): NDCG@k.
        dim, epsilon, gain, reduction: as for the function (``epsilon=None``: relative to each
            row).

    Example:
        >>> loss = NDCGLoss(k=1, epsilon=0.01, reduction="none")
        >>> x = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
        >>> loss(x, torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]))
        tensor([0., 1.])
    """

    _fields = ("k", "dim", "epsilon", "gain", "reduction")

    def __init__(
        self,
        k: int | None = None,
        *,
        dim: int = -1,
        epsilon: float | torch.Tensor | None = None,
        gain: str = "linear",
        reduction: str = "mean",
    ) -> None:
        op = type(self).__name__
        check_optional_int(k, op, "k", 1)
        check_dim(None, dim, op)
        if epsilon is not None:
            check_epsilon(epsilon, op)
        check_choice(gain, GAINS, op, "gain")
        check_choice(reduction, REDUCTIONS, op, "reduction")
        super().__init__()
        self.k, self.dim, self.epsilon = k, dim, epsilon
        self.gain, self.reduction = gain, reduction

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ndcg_loss(input, target, **self._kwargs())
