"""Thin ``torch.nn.Module`` wrappers over the functional ops; they hold arguments, no math."""

from .sort import SoftArgsort, SoftQuantile, SoftRank, SoftSort
from .topk import SoftTopK, SoftTopKMask

__all__ = [
    "SoftArgsort",
    "SoftQuantile",
    "SoftRank",
    "SoftSort",
    "SoftTopK",
    "SoftTopKMask",
]
