"""softops: differentiable relaxations of discrete operators for PyTorch."""

__version__ = "0.1.0.dev0"
