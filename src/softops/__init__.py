"""softops: differentiable relaxations of discrete operators for PyTorch.

The flat functional API lives here; docs/index.md has the table of ops. ``softops.solvers`` holds
the solvers with their diagnostics, ``softops.metrics`` and ``softops.losses`` the smooth metrics
and the losses built on the ops, and ``softops.nn`` the Module wrappers. Iterative solvers that
stop at ``max_iter`` warn with :class:`ConvergenceWarning`.
"""

from softops import losses, metrics, nn, solvers
from softops._core.convergence import ConvergenceWarning
from softops._kernels import set_compile
from softops.smooth import smooth_max, smooth_min, soft_argmax, soft_argmax_onehot, soft_argmin
from softops.sort import soft_argsort, soft_quantile, soft_rank, soft_sort
from softops.topk import TopK, soft_kmax, soft_topk, soft_topk_mask, topk_selection_matrix

__version__ = "0.1.0"

__all__ = [
    "ConvergenceWarning",
    "TopK",
    "__version__",
    "losses",
    "metrics",
    "nn",
    "set_compile",
    "smooth_max",
    "smooth_min",
    "soft_argmax",
    "soft_argmax_onehot",
    "soft_argmin",
    "soft_argsort",
    "soft_kmax",
    "soft_quantile",
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "soft_topk_mask",
    "solvers",
    "topk_selection_matrix",
]
