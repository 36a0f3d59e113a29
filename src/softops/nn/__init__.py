"""``torch.nn.Module`` wrappers over the functional ops (they hold arguments, no math), and the
layers built on them: :class:`TopKAttention` with its functional form :func:`topk_attention`,
the mixture-of-experts router :class:`TopKRouter` and block :class:`TopKMoE`, and a Module for
every loss of :mod:`softops.losses`.

A wrapper checks its arguments at construction, under its own name (what needs the data, such
as ``k <= n``, on the forward call), and stores them as given, not learned (a tensor
``epsilon``, or an ``nn.Parameter`` to learn it, is kept); an argument the method does not use
must stay at its default. Its function (:func:`softops.soft_sort`, ...) has the math, the
arguments, the shapes and the units of ``epsilon``, and ``forward`` equals it.
"""

from softops.nn.attention import TopKAttention, topk_attention, topk_attention_weights
from softops.nn.losses import (
    AccuracyLoss,
    F1Loss,
    NDCGLoss,
    SpearmanLoss,
    TopKAccuracyLoss,
    TopKCrossEntropy,
)
from softops.nn.moe import MoEOutput, TopKMoE
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
    "AccuracyLoss",
    "F1Loss",
    "MoEOutput",
    "NDCGLoss",
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
    "SpearmanLoss",
    "TopKAccuracyLoss",
    "TopKAttention",
    "TopKCrossEntropy",
    "TopKMoE",
    "TopKRouter",
    "topk_attention",
    "topk_attention_weights",
]
