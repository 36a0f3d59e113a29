"""Embedding networks for the kNN application, and the light augmentation it trains with.

:class:`ConvNet` is the small MNIST ConvNet of NeuralSort's kNN experiments (Grover et al.
2019), which Xie et al. (2020) reuse; :class:`ResNet18` the CIFAR ResNet-18 (He et al. 2016) of
the papers' CIFAR-10 runs, its 512-d pooled features the embedding. Both start with a fixed
:class:`Standardize` layer holding the training set's per-channel mean and standard deviation,
so that the data stay in [0, 1] (where zero padding is black) and the augmentation
(:func:`random_shift`) works on raw pixels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ConvNet", "ResNet18", "Standardize", "embedding_network", "random_shift"]


class Standardize(nn.Module):
    """``(x - mean) / std`` per channel, with fixed (buffer) statistics."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(list(mean)).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std)).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class ConvNet(nn.Module):
    """conv5(20)-pool-relu, conv5(50)-pool-relu, fc to a ``embedding_dim`` ReLU embedding.

    Below ``image_size`` 28 the convolutions are padded by 2 (an 8x8 digit keeps a 2x2 map).
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, embedding_dim: int = 500):
        super().__init__()
        pad = 0 if image_size >= 28 else 2
        self.conv1 = nn.Conv2d(in_channels, 20, 5, padding=pad)
        self.conv2 = nn.Conv2d(20, 50, 5, padding=pad)
        side = image_size
        for _ in range(2):
            side = (side + 2 * pad - 4) // 2
        if side < 1:
            raise ValueError(f"ConvNet: expected image_size >= 8; got image_size={image_size}.")
        self.fc = nn.Linear(50 * side * side, embedding_dim)
        self.embedding_dim = embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # max-pooling before the ReLU equals it after (ReLU is monotone) and is cheaper.
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.relu(self.fc(x.flatten(1)))


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # a strided 1x1 projection
            project = nn.Conv2d(c_in, c_out, 1, stride, bias=False)
            self.skip = nn.Sequential(project, nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images; the embedding is the 512-d global-average-pooled feature."""

    def __init__(self, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c_in = 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Block(c_in, c_out, stride), _Block(c_out, c_out, 1)]
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.embedding_dim = 512

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.stem(x)).mean((2, 3))


def embedding_network(
    image_shape: tuple[int, int, int], mean: Sequence[float], std: Sequence[float]
) -> tuple[nn.Module, int]:
    """The embedding network for images of ``image_shape`` (C, H, W), and its embedding size.

    3-channel 32x32 images (CIFAR-10) get :class:`ResNet18`, everything else :class:`ConvNet`;
    both behind :class:`Standardize`.
    """
    c, h, w = image_shape
    if h != w:
        raise ValueError(f"embedding_network: expected square images; got {h}x{w}.")
    body: ConvNet | ResNet18 = ResNet18(c) if (c, h) == (3, 32) else ConvNet(c, h)
    return nn.Sequential(Standardize(mean, std), body), body.embedding_dim


def random_shift(
    x: torch.Tensor, max_shift: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Translate each image of ``x`` (N, C, H, W) by its own random offset in
    [-max_shift, max_shift]^2, zero-filled (``generator``: a CPU generator for the offsets)."""
    if max_shift <= 0:
        return x
    n, c, h, w = x.shape
    s = max_shift
    padded = F.pad(x, (s, s, s, s))
    offsets = torch.randint(0, 2 * s + 1, (2, n), generator=generator).to(x.device)
    rows = (offsets[0][:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (offsets[1][:, None] + torch.arange(w, device=x.device))[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, chan, rows, cols]
