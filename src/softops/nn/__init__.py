"""Thin ``torch.nn.Module`` wrappers over the functional ops; they hold arguments, no math."""

from .topk import SoftTopK, SoftTopKMask

__all__ = ["SoftTopK", "SoftTopKMask"]
