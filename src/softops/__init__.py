"""softops: differentiable relaxations of discrete operators for PyTorch.

The flat functional API lives here; see the README for the table of ops.
"""

from ._core.fused import set_compile
from .topk import soft_topk_mask, topk_selection_matrix

__version__ = "0.1.0.dev0"

__all__ = [
    "__version__",
    "set_compile",
    "soft_topk_mask",
    "topk_selection_matrix",
]
