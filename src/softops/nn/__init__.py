"""``torch.nn.Module`` wrappers over the functional ops (they hold arguments, no math), and the
layers built on them: :class:`TopKAttention` with its functional form :func:`topk_attention`,
and the mixture-of-experts router :class:`TopKRouter`."""

from softops.nn.attention import TopKAttention, topk_attention, topk_attention_weights
from softops.nn.router import RouterOutput, TopKRouter
from softops.nn.smooth import (
    SmoothMax,
    SmoothMin,
    SoftArgmax,
    SoftArgmaxOneHot,
    SoftArgmin,
    SoftKMax,
)
from softops.nn.sort import SoftArgsort, SoftQuantile, SoftRank, SoftSort
from softops.nn.topk import SoftTopK, SoftTopKMask

__all__ = [
    "RouterOutput",
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
    "TopKAttention",
    "TopKRouter",
    "topk_attention",
    "topk_attention_weights",
]
