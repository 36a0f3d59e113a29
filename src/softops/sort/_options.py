"""The options every sort backend receives (apart from ``_dispatch.py``, which imports the
backends, so that they can import it without a cycle)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MethodOptions"]


class MethodOptions(NamedTuple):
    """The options of a sort method, checked once by :func:`check_options`.

    Attributes:
        regularization: "pav": "l2" or "kl".
        distance: "softsort": "l1" or "l2".
        max_iter: "ot": the Sinkhorn iteration cap; None means ``SINKHORN_MAX_ITER``.
        tol: "ot": the relative L1 marginal tolerance; None means ``default_tol`` of the compute
            dtype; 0 runs exactly ``max_iter`` iterations.
        op: the public op, which names itself in warnings (the OT backend's convergence warning).
    """

    regularization: str = "l2"
    distance: str = "l1"
    max_iter: int | None = None
    tol: float | None = None
    op: str = "softops.sort"
