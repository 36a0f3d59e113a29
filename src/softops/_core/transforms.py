"""Whether a ``torch.func`` transform (vmap, grad, jacrev, jvp, ...) is active.

Under a transform, data-dependent Python branches are impossible (a batched tensor has no single
value to branch on) and saved-tensor hooks, hence ``torch.utils.checkpoint``, are refused. The
ops ask here and take their transform-safe path: a masked formulation instead of a branch, plain
autograd instead of recomputed blocks.
"""

from __future__ import annotations

import torch

__all__ = ["under_functorch"]


def under_functorch() -> bool:
    """True inside a ``torch.func`` transform."""
    return torch._C._functorch.maybe_current_level() is not None
