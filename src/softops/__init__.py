"""softops: differentiable relaxations of discrete operators for PyTorch.

The flat functional API lives here; see the README for the table of ops. ``softops.solvers`` holds
the solvers with their diagnostics and ``softops.nn`` the Module wrappers.
"""

from . import nn, solvers
from ._core.fused import set_compile
from .sort import soft_argsort, soft_quantile, soft_rank, soft_sort
from .topk import TopK, soft_topk, soft_topk_mask, topk_selection_matrix

__version__ = "0.1.0.dev0"

__all__ = [
    "TopK",
    "__version__",
    "nn",
    "set_compile",
    "soft_argsort",
    "soft_quantile",
    "soft_rank",
    "soft_sort",
    "soft_topk",
    "soft_topk_mask",
    "solvers",
    "topk_selection_matrix",
]
