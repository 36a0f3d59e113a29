"""Modules for the sort family; each stores its arguments and calls the functional op."""

from __future__ import annotations

import torch

from softops.sort import soft_argsort, soft_quantile, soft_rank, soft_sort

__all__ = ["SoftArgsort", "SoftQuantile", "SoftRank", "SoftSort"]


class _SortLike(torch.nn.Module):
    def __init__(
        self,
        *,
        dim: int = -1,
        descending: bool = False,
        epsilon: float = 1.0,
        method: str = "pav",
        regularization: str = "l2",
        distance: str = "l1",
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.descending, self.epsilon, self.method = dim, descending, epsilon, method
        self.regularization, self.distance = regularization, distance
        self.max_iter, self.tol = max_iter, tol

    def _kwargs(self) -> dict:
        return {
            "dim": self.dim,
            "descending": self.descending,
            "epsilon": self.epsilon,
            "method": self.method,
            "regularization": self.regularization,
            "distance": self.distance,
            "max_iter": self.max_iter,
            "tol": self.tol,
        }

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, descending={self.descending}, epsilon={self.epsilon}, "
            f"method={self.method!r}"
        )


class SoftSort(_SortLike):
    r"""Module form of :func:`softops.soft_sort`; the arguments are stored, not learned.

    The hard operator is ``torch.sort(x, dim, descending).values``. For "pav" (Blondel et al.):

    .. math::

        \mathrm{sort}_\downarrow(\theta) = P_Q(\rho/\varepsilon, \theta),\qquad
        \rho = (n, \dots, 1).

    Args:
        dim: the dimension to work along (negative values count from the end).
        descending: descending order (rank 1 for the largest).
        epsilon: the smoothing strength, larger is smoother; its units and scaling law depend
            on ``method`` (see the functional op).
        method: "pav" (default), "softsort", "neuralsort" or "ot".
        regularization: "pav" only: "l2" or "kl".
        distance: "softsort" only: "l1" or "l2".
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default).

    An argument the method does not use raises ``ValueError`` on the forward call when it differs
    from its default.

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Example:
        >>> SoftSort(epsilon=0.1)(torch.tensor([[3.0, 1.0, 2.0]]))
        tensor([[1., 2., 3.]])

    References:
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
        ICML 2020. arXiv:2002.08871.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_sort(x, **self._kwargs())


class SoftRank(_SortLike):
    r"""Module form of :func:`softops.soft_rank`; the arguments are stored, not learned.

    The hard operator is ``x.argsort(dim, descending).argsort(dim) + 1`` (1-based). For "pav"
    (Blondel et al.):

    .. math::

        \mathrm{rank}(\theta) = P_Q(\theta/\varepsilon, \rho),\qquad \rho = (n, \dots, 1).

    Args:
        dim: the dimension to work along (negative values count from the end).
        descending: descending order (rank 1 for the largest).
        epsilon: the smoothing strength, larger is smoother; its units and scaling law depend
            on ``method`` (see the functional op).
        method: "pav" (default), "softsort", "neuralsort" or "ot".
        regularization: "pav" only: "l2" or "kl".
        distance: "softsort" only: "l1" or "l2".
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default).

    An argument the method does not use raises ``ValueError`` on the forward call when it differs
    from its default.

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: the same.

    Example:
        >>> SoftRank(epsilon=0.1)(torch.tensor([[3.0, 1.0, 2.0]]))
        tensor([[3., 1., 2.]])

    References:
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
        ICML 2020. arXiv:2002.08871.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_rank(x, **self._kwargs())


class SoftArgsort(torch.nn.Module):
    r"""Module form of :func:`softops.soft_argsort`; the arguments are stored, not learned.

    The hard operator is ``torch.nn.functional.one_hot(torch.argsort(x, dim, descending), n)``
    (one-hot axis last). For "softsort" (Prillo and Eisenschlos):

    .. math::

        P_{ij} = \mathrm{softmax}_j\big(-d(x_{[i]}, x_j)/\varepsilon\big).

    Args:
        dim: the dimension to sort along.
        descending: rows of P in descending order of x.
        epsilon: the temperature, larger is smoother (units of x for "softsort" l1 and
            "neuralsort", of x² for "softsort" l2 and "ot").
        method: "softsort" (default), "neuralsort" or "ot".
        distance: "softsort" only: "l1" or "l2".
        hard: straight-through: the hard permutation matrix forward, the soft gradient backward.
        max_iter: "ot" only: the iteration cap (None: its default).
        tol: "ot" only: the stopping tolerance (None: its default).

    Shape:
        - input: :math:`(*, n, *)` with n at ``dim``; output: :math:`(*, n, *, n)`.

    Example:
        >>> SoftArgsort(hard=True)(torch.tensor([3.0, 1.0, 2.0]))
        tensor([[0., 1., 0.],
                [0., 0., 1.],
                [1., 0., 0.]])

    References:
        Prillo and Eisenschlos. SoftSort: A Continuous Relaxation for the argsort Operator.
        ICML 2020. arXiv:2006.16038.
    """

    def __init__(
        self,
        *,
        dim: int = -1,
        descending: bool = False,
        epsilon: float = 1.0,
        method: str = "softsort",
        distance: str = "l1",
        hard: bool = False,
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.descending, self.epsilon, self.method = dim, descending, epsilon, method
        self.distance, self.hard, self.max_iter, self.tol = distance, hard, max_iter, tol

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_argsort(
            x,
            dim=self.dim,
            descending=self.descending,
            epsilon=self.epsilon,
            method=self.method,
            distance=self.distance,
            hard=self.hard,
            max_iter=self.max_iter,
            tol=self.tol,
        )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, descending={self.descending}, epsilon={self.epsilon}, "
            f"method={self.method!r}, hard={self.hard}"
        )


class SoftQuantile(torch.nn.Module):
    r"""Module form of :func:`softops.soft_quantile`; ``q`` is stored (a float or a 1-D tensor).

    The hard operator is ``torch.quantile(x, q, dim, keepdim)``: with :math:`s` the soft sort
    and :math:`p = q(n - 1)`,

    .. math::

        Q_q = s_{\lfloor p \rfloor} + (p - \lfloor p \rfloor)
              (s_{\lfloor p \rfloor + 1} - s_{\lfloor p \rfloor}).

    Args:
        q: a float in [0, 1] or a 1-D tensor of them.
        dim: the dimension to reduce.
        epsilon: the smoothing strength, as for :class:`SoftSort` with the same method.
        method: "pav" (default) or "ot".
        keepdim: keep the reduced dimension with size 1.

    Shape:
        - input: :math:`(*, n, *)`; output: without ``dim`` (a 1-D q adds a leading dim).

    Example:
        >>> SoftQuantile(0.5, epsilon=0.01)(torch.tensor([[3.0, 1.0, 2.0, 4.0]]))
        tensor([2.5000])

    References:
        Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
        ICML 2020. arXiv:2002.08871.
    """

    def __init__(
        self,
        q: float | torch.Tensor,
        *,
        dim: int = -1,
        epsilon: float = 1.0,
        method: str = "pav",
        keepdim: bool = False,
    ) -> None:
        super().__init__()
        self.q, self.dim, self.epsilon, self.method, self.keepdim = q, dim, epsilon, method, keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_quantile(
            x, self.q, dim=self.dim, epsilon=self.epsilon, method=self.method, keepdim=self.keepdim
        )

    def extra_repr(self) -> str:
        return f"q={self.q}, dim={self.dim}, epsilon={self.epsilon}, method={self.method!r}"
