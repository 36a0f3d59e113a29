"""Thin ``torch.nn.Module`` wrappers over the functional ops; they hold arguments, no math."""

from .smooth import SmoothMax, SmoothMin, SoftArgmax, SoftArgmaxOneHot, SoftArgmin, SoftKMax
from .sort import SoftArgsort, SoftQuantile, SoftRank, SoftSort
from .topk import SoftTopK, SoftTopKMask

__all__ = [
    "SmoothMax",
    "SmoothMin",
    "SoftArgmax",
    "SoftArgmaxOneHot",
    "SoftArgmin",
    "SoftArgsort",
    "SoftKMax",
    "SoftQuantile",
    "SoftRank",
    "SoftSort",
    "SoftTopK",
    "SoftTopKMask",
]
