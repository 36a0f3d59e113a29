"""Training and evaluation for ``softops knn``: one run per method and seed, on a fixed budget.

A run trains an embedding network for a budget of training wall-clock time (``minutes``) or of
epochs, with Adam and a cosine decay, validates it along the way and tests the best-validation
checkpoint. The kNN methods minimise :func:`softops.apps.knn_loss` on ``queries`` +
``candidates`` shifted training images per step and are evaluated by the hard kNN against the
training split; "ce" trains a linear head by cross-entropy, and "pretrained" is the kNN on the
CE network's embeddings. Seeds fix everything: an ``epochs`` run on CPU is reproducible exactly.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from softops.apps.data import ImageDataset
from softops.apps.knn import knn_loss, knn_predict
from softops.apps.models import embedding_network, random_shift

__all__ = [
    "ALL_ROWS",
    "METHODS",
    "KNNConfig",
    "RunResult",
    "check_device",
    "measure_step",
    "train_rows",
]

#: The methods of ``softops knn --method``; "soft" is SOFT top-k, method "ot" of knn_loss.
METHODS = ("soft", "sinkhorn", "perturbed", "softkmax", "neuralsort", "ce", "pretrained")
#: The rows of Xie et al.'s Table 1 that ``--all`` runs, in the paper's order.
ALL_ROWS = ("pretrained", "ce", "softkmax", "neuralsort", "soft")
_LOSS_METHOD = {"soft": "ot", "sinkhorn": "sinkhorn", "perturbed": "perturbed"}  # knn_loss's
_LOSS_METHOD |= {"softkmax": "softkmax", "neuralsort": "neuralsort"}
_DEFAULT_SHIFT = {"mnist": 2, "mnist-idx": 2, "digits": 0, "cifar10": 4}


@dataclass(frozen=True)
class KNNConfig:
    """Everything a run depends on (the defaults are those of ``softops knn``)."""

    dataset: str = "digits"
    method: str = "soft"
    k: int = 9
    epsilon: float = 1.0
    minutes: float | None = None
    epochs: float | None = None
    seed: int = 0
    device: str = "cpu"
    queries: int = 100
    candidates: int = 100
    lr: float = 1e-3
    shift: int | None = None  # None: 2 pixels for MNIST, 0 for digits, 4 for CIFAR-10
    evals: int = 6
    n_samples: int | None = None  # "perturbed": noise draws per step (None: 100)

    def budget_label(self) -> str:
        """'3min', '0.5min', '30ep', ... (used in file names and tables)."""
        if self.minutes is not None:
            return f"{self.minutes:g}min"
        return f"{self.epochs:g}ep"

    def resolved_shift(self) -> int:
        return _DEFAULT_SHIFT.get(self.dataset, 0) if self.shift is None else self.shift


@dataclass
class RunResult:
    """One row of one seed: what it reached, and what it cost."""

    method: str
    seed: int
    steps: int
    train_seconds: float
    step_seconds: float  # train_seconds / steps (sampling, augmentation, forward, backward, Adam)
    best_val: float  # accuracy in percent
    best_step: int
    best_seconds: float
    test: float  # of the best-validation checkpoint, percent
    eval_seconds: float  # one full test evaluation (embed train + test, predict)
    curve: list[dict[str, float]] = field(default_factory=list)  # seconds, step, val, loss
    projection: torch.Tensor | None = None  # (n, 2) PCA of test embeddings, for the plot
    projection_labels: torch.Tensor | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("projection")}


def check_device(device: str) -> str | None:
    """An error message when ``device`` is not a usable torch device, else None."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        return f"softops knn: expected a torch device such as cpu or cuda; got {device!r} ({err})."
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"softops knn: expected an available device; got {device!r}, but CUDA is not."
    if dev.type == "mps" and not torch.backends.mps.is_available():
        return f"softops knn: expected an available device; got {device!r}, but MPS is not."
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Model(nn.Module):
    """The embedding network, and a linear head for the CE objective."""

    def __init__(self, data: ImageDataset, with_head: bool) -> None:
        super().__init__()
        x = data.train_x  # per-channel statistics for the Standardize layer
        mean, std = x.mean((0, 2, 3)).tolist(), x.std((0, 2, 3)).clamp_min(1e-6).tolist()
        self.net, dim = embedding_network(data.image_shape, mean, std)
        self.head = nn.Linear(dim, data.num_classes) if with_head else None


def _setup(
    config: KNNConfig, data: ImageDataset
) -> tuple[torch.device, _Model, Callable[..., torch.Tensor], torch.Generator]:
    """A run's device, fresh seeded model (channels-last), step and batch and shift generator."""
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    model = _Model(data, config.method in ("ce", "pretrained")).to(device)
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    step_fn = _step_fn(config, model, device)
    return device, model, step_fn, torch.Generator().manual_seed(config.seed)


@torch.no_grad()
def _embed(net: nn.Module, x: torch.Tensor, device: torch.device, batch: int) -> torch.Tensor:
    out = []
    for chunk in x.split(batch):
        chunk = chunk.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        out.append(net(chunk))
    return torch.cat(out) if out else torch.empty(0, device=device)


@torch.no_grad()
def _accuracy(
    model: _Model,
    row: str,
    data: ImageDataset,
    split: str,
    k: int,
    device: torch.device,
    cache: dict[str, torch.Tensor],
) -> float:
    """Accuracy (percent) on the "val" or "test" split: of the head for row "ce", else of the
    kNN against the training split. ``cache`` keeps the embeddings across rows."""
    model.eval()
    query_x, query_y = (data.val_x, data.val_y) if split == "val" else (data.test_x, data.test_y)
    if "query" not in cache:
        cache["query"] = _embed(model.net, query_x, device, 1000)
    q = cache["query"]
    if row == "ce":
        assert model.head is not None
        pred = model.head(q).argmax(1)
    else:
        if "ref" not in cache:
            cache["ref"] = _embed(model.net, data.train_x, device, 1000)
        train_y = data.train_y.to(device)
        pred = knn_predict(cache["ref"], train_y, q, k, num_classes=data.num_classes)
    model.train()
    return 100.0 * float((pred.cpu() == query_y).double().mean())


def _projection(emb: torch.Tensor, labels: torch.Tensor, n: int = 2000) -> tuple[Any, Any]:
    """A 2-D PCA of the first ``n`` embeddings (for the plot)."""
    e = emb[:n].double().cpu()
    e = e - e.mean(0)
    _, _, v = torch.linalg.svd(e, full_matrices=False)
    return (e @ v[:2].T).float(), labels[:n].clone()


Progress = Callable[[dict[str, Any]], None]


def _step_fn(config: KNNConfig, model: _Model, device: torch.device) -> Callable[..., torch.Tensor]:
    """One optimisation step on a batch (queries first, then candidates); returns the loss."""
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    noise = torch.Generator(device=device).manual_seed(config.seed + 1)
    loss_method = _LOSS_METHOD.get(config.method)
    perturbed = loss_method == "perturbed"
    q = config.queries

    def step(x: torch.Tensor, y: torch.Tensor, lr: float = config.lr) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = lr
        emb = model.net(x.contiguous(memory_format=torch.channels_last))
        if model.head is not None:
            loss = F.cross_entropy(model.head(emb), y)
        else:
            assert loss_method is not None
            loss = knn_loss(
                emb[:q],
                emb[q:],
                y[:q],
                y[q:],
                config.k,
                epsilon=config.epsilon,
                method=loss_method,
                n_samples=config.n_samples if perturbed else None,
                generator=noise if perturbed else None,
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def train_rows(
    config: KNNConfig,
    data: ImageDataset,
    rows: Sequence[str] | None = None,
    *,
    progress: Progress | None = None,
) -> list[RunResult]:
    """Train one network on ``config`` and return one :class:`RunResult` per row.

    ``config.method`` picks the objective (cross-entropy for "ce" and "pretrained", which one
    training reports both, each from its own best-validation checkpoint). ``progress`` gets a
    dict (``step``, ``seconds``, ``fraction``, ``loss``, ``val``, ``steps_per_s``, ``done``)
    every few steps.
    """
    rows = tuple(rows or (config.method,))
    ce = config.method in ("ce", "pretrained")
    if any((r in ("ce", "pretrained")) != ce for r in rows):
        raise ValueError(f"train_rows: expected rows of one objective; got {rows} for {config}.")
    if (config.minutes is None) == (config.epochs is None):
        raise ValueError("train_rows: expected exactly one of `minutes` and `epochs`.")
    per_step = config.queries + config.candidates
    n_train = data.train_x.shape[0]
    if per_step > n_train:
        raise ValueError(
            f"train_rows: expected queries + candidates <= the training split (= {n_train}); "
            f"got {per_step}."
        )
    if not ce and config.k > config.candidates:
        raise ValueError(
            f"train_rows: expected k <= candidates (= {config.candidates}); got k={config.k}."
        )

    device, model, step_fn, gen = _setup(config, data)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    shift = config.resolved_shift()

    epochs, minutes = config.epochs, config.minutes  # exactly one is set
    total_steps = None if epochs is None else max(1, round(epochs * (n_train // per_step)))
    budget_s = None if minutes is None else float(minutes) * 60.0
    evals = max(1, config.evals)

    best: dict[str, tuple[float, int, float, dict[str, Any]]] = {}
    curve: dict[str, list[dict[str, float]]] = {r: [] for r in rows}

    def validate(step: int, seconds: float, loss: float) -> dict[str, float]:
        cache: dict[str, torch.Tensor] = {}
        accs = {}
        for r in rows:
            accs[r] = acc = _accuracy(model, r, data, "val", config.k, device, cache)
            curve[r].append({"seconds": seconds, "step": step, "val": acc, "loss": loss})
            if r not in best or acc >= best[r][0]:  # ties: the later, more trained one
                best[r] = (acc, step, seconds, copy.deepcopy(model.state_dict()))
        return accs

    order = torch.randperm(n_train, generator=gen)
    pos = 0
    step = 0
    train_s = 0.0
    next_eval = 1
    last_loss = float("nan")
    last_val: dict[str, float] = {}
    t_report = time.perf_counter()

    def done_fraction() -> float:
        return step / total_steps if total_steps else train_s / budget_s if budget_s else 1

    def report(fraction: float, done: bool) -> None:
        if progress is not None:
            rate = step / train_s if train_s > 0 else 0.0
            progress(
                {"step": step, "seconds": train_s, "fraction": min(fraction, 1.0), "done": done}
                | {"loss": last_loss, "val": dict(last_val), "steps_per_s": rate}
            )

    while (fraction := done_fraction()) < 1:
        t0 = time.perf_counter()
        if pos + per_step > n_train:
            order = torch.randperm(n_train, generator=gen)
            pos = 0
        idx = order[pos : pos + per_step].to(device)
        pos += per_step
        lr = config.lr * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0)))
        loss_t = step_fn(random_shift(train_x[idx], shift, gen), train_y[idx], lr)
        step += 1
        if device.type == "cpu" or step % 10 == 0:  # an accelerator: every 10 steps
            _sync(device)
        train_s += time.perf_counter() - t0
        fraction = done_fraction()
        due = fraction >= next_eval / evals or fraction >= 1
        if due or step % 10 == 0:
            last_loss = float(loss_t.detach())
        if due:
            while next_eval / evals <= fraction and next_eval <= evals:
                next_eval += 1
            last_val = validate(step, train_s, last_loss)
        if due or time.perf_counter() - t_report > 0.5:
            t_report = time.perf_counter()
            report(fraction, False)
    if not curve[rows[0]] or curve[rows[0]][-1]["step"] != step:
        last_val = validate(step, train_s, last_loss)

    results = []
    for r in rows:
        acc, best_step, best_s, state = best[r]
        model.load_state_dict(state)
        t0 = time.perf_counter()
        cache: dict[str, torch.Tensor] = {}
        test = _accuracy(model, r, data, "test", config.k, device, cache)
        _sync(device)
        eval_s = time.perf_counter() - t0
        proj, labels = _projection(cache["query"], data.test_y)
        results.append(
            RunResult(
                method=r,
                seed=config.seed,
                steps=step,
                train_seconds=train_s,
                step_seconds=train_s / max(step, 1),
                best_val=acc,
                best_step=best_step,
                best_seconds=best_s,
                test=test,
                eval_seconds=eval_s,
                curve=curve[r],
                projection=proj,
                projection_labels=labels,
            )
        )
    report(1.0, True)
    return results


def measure_step(
    config: KNNConfig, data: ImageDataset, *, steps: int = 30, warmup: int = 5
) -> dict[str, float]:
    """Seconds per training step (median) and per full test evaluation, for ``config``.

    A step is what :func:`train_rows` times: sampling ``queries + candidates`` images,
    augmentation, the forward and backward passes and the Adam update. The full evaluation embeds
    the training and test splits and classifies the test split by the hard kNN.
    """
    cfg = replace(config, epochs=None, minutes=1e9, evals=10**9)
    device, model, step_fn, gen = _setup(cfg, data)
    per_step = cfg.queries + cfg.candidates
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, data.train_x.shape[0], (per_step,), generator=gen)
        x = random_shift(data.train_x[idx].to(device), cfg.resolved_shift(), gen)
        step_fn(x, data.train_y[idx].to(device))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    cache: dict[str, torch.Tensor] = {}
    _accuracy(model, "knn", data, "test", cfg.k, device, cache)
    _sync(device)
    eval_s = time.perf_counter() - t0
    times.sort()
    return {
        "step_seconds": times[len(times) // 2],
        "step_seconds_min": times[0],
        "eval_seconds": eval_s,
        "eval_train": float(data.train_x.shape[0]),
        "eval_test": float(data.test_x.shape[0]),
    }
