"""Top-k attention and top-k routing in small character-level language models on real text.

**The corpus.** The standard library of the Python that runs the study: every top-level module
``<stdlib>/*.py`` (not the packages), sorted by file name, read as bytes (the files are almost
all ASCII, so a byte is a character; bits per byte are reported as bits per character). Every
tenth file in that order (index 0, 10, 20, ...) is held out for testing; the others are the
training text. The same Python version gives the same files: the results record the version,
the file counts, the byte counts and a SHA-256 of each split, so that anyone can rebuild it.

**The models.** A pre-LayerNorm decoder of ``LAYERS`` blocks (width ``D``, ``HEADS`` heads,
sinusoidal positions so that a model trained on 128 characters can be run on 512), a byte
embedding and a linear read-out, trained by AdamW on random windows of the training text.

**The arms.**

- ``attention`` study (the feed-forward is a dense MLP in every arm): ``mha``
  (``nn.MultiheadAttention``, causal) against ``softops.nn.TopKAttention`` at k in {8, 16}:
  ``soft`` (the SOFT top-k's masked softmax), ``hard`` (``hard=True``: exactly k keys forward,
  the soft gradient backward) and ``sparse`` (``method="sparse"``);
- ``routing`` study (attention is ``nn.MultiheadAttention`` in every arm): a mixture-of-experts
  feed-forward of ``EXPERTS`` MLPs, top-2, dispatched sparsely, routed by
  ``softops.nn.TopKRouter`` (``router``) or by a plain softmax top-2 router (``plain``: the
  renormalised softmax of the two largest logits), both with the Switch Transformer
  load-balancing loss at weight 0.01.

**The protocol.** Every run trains for the same budget of time on one torch thread, counted as
the thread's CPU time (``time.thread_time``: on an idle core it is the wall-clock time, and other
processes sharing the machine do not shorten a run's training; two runs side by side with
``--jobs 2``), with a learning rate warmed up over the first 5 %
of the budget and then cosine-decayed. Reported per arm, over the seeds: held-out bits per
character at context 128 (the training length) and at 512 (length generalisation), training
time per token, inference time per token (context 128, no gradient), the steps taken; for the
routing study also the load balance (the entropy of the experts' share of the held-out tokens'
slots over log E: 1 is uniform) and the dead experts (under 1/(10 E) of the slots).

Run::

    python benchmarks/lm_study.py                     # both studies, 3 seeds, 60 s per run
    python benchmarks/lm_study.py --study attention --budget 30 --seeds 0
    python benchmarks/lm_study.py --quick             # the smoke test: seconds, no files

It writes ``lm-attention.{md,json,png}`` and ``lm-routing.{md,json,png}`` under ``--out``
(default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from softops.nn import TopKAttention, TopKRouter

RESULTS = Path(__file__).resolve().parent / "results"
D, HEADS, LAYERS, CONTEXT, LONG, BATCH = 128, 4, 2, 128, 512, 16
EXPERTS, ROUTE_K, AUX_WEIGHT = 4, 2, 0.01
ATTENTION_ARMS = (
    "mha",
    *(f"{kind}-k{k}" for k in (8, 16) for kind in ("soft", "hard", "sparse")),
)
ROUTING_ARMS = ("plain", "router")
EVAL_WINDOWS, LONG_WINDOWS = 256, 64


# ------------------------------------------------------------------------------------------
# the corpus


def corpus() -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The training and held-out bytes of the standard library's top-level modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if len(files) < 20:
        raise SystemExit(f"lm_study: expected the standard library's modules in {root}")
    test = [f for i, f in enumerate(files) if i % 10 == 0]
    train = [f for i, f in enumerate(files) if i % 10 != 0]

    def read(paths: list[Path]) -> bytes:
        return b"\n".join(p.read_bytes() for p in paths)

    tr, te = read(train), read(test)
    info = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "files": {"train": len(train), "test": len(test)},
        "bytes": {"train": len(tr), "test": len(te)},
        "sha256": {
            "train": hashlib.sha256(tr).hexdigest(),
            "test": hashlib.sha256(te).hexdigest(),
        },
        "test_files": [p.name for p in test],
    }

    def as_tensor(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).long()

    return as_tensor(tr), as_tensor(te), info


def windows(text: torch.Tensor, length: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length + 1`` bytes (inputs and their next bytes)."""
    start = torch.randint(0, len(text) - length - 1, (count,), generator=gen)
    return text[start[:, None] + torch.arange(length + 1)]


# ------------------------------------------------------------------------------------------
# the models


def positions(length: int, dim: int) -> torch.Tensor:
    """Sinusoidal position codes (length, dim)."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
    out = torch.zeros(length, dim)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)
    return out


def mlp(d: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


class PlainRouter(nn.Module):
    """The usual router: the renormalised softmax of the two largest logits."""

    def __init__(self, d: int, experts: int, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, experts)
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.proj(x)
        top, idx = logits.topk(self.k, dim=-1)
        weights = torch.zeros_like(logits).scatter(-1, idx, top.softmax(-1))
        probs = logits.softmax(-1)
        load = F.one_hot(idx, logits.shape[-1]).float().mean((0, 1))  # share of the k slots
        aux = logits.shape[-1] * (load * probs.mean(0)).sum()
        return weights, idx, aux


class MoE(nn.Module):
    """``EXPERTS`` MLPs; each token goes to the k experts its router picks (gather/scatter)."""

    def __init__(self, d: int, router: str) -> None:
        super().__init__()
        self.experts = nn.ModuleList(mlp(d, 2 * d) for _ in range(EXPERTS))
        self.kind = router
        if router == "router":
            self.router: nn.Module = TopKRouter(d, EXPERTS, ROUTE_K)
        else:
            self.router = PlainRouter(d, EXPERTS, ROUTE_K)
        self.aux = torch.zeros(())
        self.slots = torch.zeros(EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.kind == "router":
            out = self.router(flat)
            weights, idx, aux = out.weights, out.indices, out.aux_loss
        else:
            weights, idx, aux = self.router(flat)
        self.aux = aux
        self.slots = torch.bincount(idx.reshape(-1), minlength=EXPERTS).detach().float()
        y = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token = (idx == e).any(-1).nonzero().squeeze(-1)
            if token.numel():
                y = y.index_add(0, token, expert(flat[token]) * weights[token, e, None])
        return y.reshape(shape)


class Block(nn.Module):
    def __init__(self, attention: str, feed_forward: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.kind = attention
        if attention == "mha":
            self.attn: nn.Module = nn.MultiheadAttention(D, HEADS, batch_first=True)
        else:
            kind, k = attention.split("-k")
            options: dict[str, Any] = {"hard": kind == "hard"}
            if kind == "sparse":
                options["method"] = "sparse"
            self.attn = TopKAttention(D, HEADS, k=int(k), batch_first=True, **options)
        self.ff = mlp(D, 4 * D) if feed_forward == "dense" else MoE(D, feed_forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        if self.kind == "mha":
            causal = nn.Transformer.generate_square_subsequent_mask(
                x.shape[1], device=x.device, dtype=torch.bool
            )
            a, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False, is_causal=True)
        else:
            a, _ = self.attn(h, h, h, need_weights=False, is_causal=True)
        x = x + a
        return x + self.ff(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, attention: str, feed_forward: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, D)
        self.blocks = nn.ModuleList(Block(attention, feed_forward) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + positions(tokens.shape[1], D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def aux_loss(self) -> torch.Tensor:
        return sum((b.ff.aux for b in self.blocks if isinstance(b.ff, MoE)), torch.zeros(()))


# ------------------------------------------------------------------------------------------
# one run


@dataclass
class Run:
    study: str
    arm: str
    seed: int
    budget: float
    steps: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    bpc: float = float("nan")
    bpc_long: float = float("nan")
    train_us_per_token: float = float("nan")
    infer_us_per_token: float = float("nan")
    balance: float = float("nan")
    dead_experts: int = 0
    curve: list[dict[str, float]] = field(default_factory=list)


@torch.no_grad()
def bits_per_char(model: CharLM, batches: torch.Tensor) -> tuple[float, float]:
    """Mean bits per held-out byte, and the forward's seconds per token."""
    model.eval()
    total, count, seconds = 0.0, 0, 0.0
    for chunk in batches.split(BATCH):
        t0 = time.thread_time()
        logits = model(chunk[:, :-1])
        seconds += time.thread_time() - t0
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        count += chunk[:, 1:].numel()
    model.train()
    return float(total) / count / math.log(2), seconds / count


def run(spec: tuple[str, str, int, float, bool]) -> Run:
    study, arm, seed, budget, quick = spec
    torch.set_num_threads(1)
    train, test, _ = corpus()
    if quick:
        train, test = train[:200_000], test[:50_000]
    gen = torch.Generator().manual_seed(1234)  # the same held-out windows for every run
    held = windows(test, CONTEXT, 32 if quick else EVAL_WINDOWS, gen)
    held_long = windows(test, LONG, 4 if quick else LONG_WINDOWS, gen)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    attention, ff = (arm, "dense") if study == "attention" else ("mha", arm)
    model = CharLM(attention, ff)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    result = Run(study, arm, seed, budget)
    next_eval = 0.0
    while result.train_seconds < budget:
        fraction = result.train_seconds / budget
        lr = 3e-3 * min(1.0, fraction / 0.05) * 0.5 * (1 + math.cos(math.pi * fraction))
        for group in opt.param_groups:
            group["lr"] = max(lr, 3e-5)
        batch = windows(train, CONTEXT, BATCH, gen)
        t0 = time.thread_time()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        total = loss + AUX_WEIGHT * model.aux_loss()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        result.train_seconds += time.thread_time() - t0
        result.steps += 1
        result.tokens += batch[:, 1:].numel()
        if result.train_seconds >= next_eval:
            next_eval += budget / 6
            result.curve.append(
                {
                    "seconds": result.train_seconds,
                    "loss_bpc": float(loss.detach()) / math.log(2),
                    "held_out_bpc": bits_per_char(model, held[: 4 * BATCH])[0],
                }
            )
    result.bpc, infer = bits_per_char(model, held)
    result.bpc_long, _ = bits_per_char(model, held_long)
    result.train_us_per_token = 1e6 * result.train_seconds / result.tokens
    result.infer_us_per_token = 1e6 * infer
    if study == "routing":
        slots = torch.zeros(EXPERTS)
        with torch.no_grad():
            model.eval()
            for chunk in held.split(BATCH):
                model(chunk[:, :-1])
                slots += sum(b.ff.slots for b in model.blocks if isinstance(b.ff, MoE))
        share = slots / slots.sum()
        entropy = -(share * share.clamp(min=1e-12).log()).sum()
        result.balance = float(entropy / math.log(EXPERTS))
        result.dead_experts = int((share < 1 / (10 * EXPERTS)).sum())
    return result


# ------------------------------------------------------------------------------------------
# the report


def summary(runs: list[Run], arms: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for arm in arms:
        rs = [r for r in runs if r.arm == arm]
        if not rs:
            continue

        def stat(key: str, rs: list[Run] = rs) -> tuple[float, float, float]:
            vals = [getattr(r, key) for r in rs]
            return sum(vals) / len(vals), min(vals), max(vals)

        rows.append(
            {
                "arm": arm,
                "seeds": len(rs),
                **{
                    key: stat(key)
                    for key in (
                        "bpc",
                        "bpc_long",
                        "train_us_per_token",
                        "infer_us_per_token",
                        "steps",
                        "balance",
                        "dead_experts",
                    )
                },
            }
        )
    return rows


def markdown(study: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    def cell(v: tuple[float, float, float], digits: int = 3) -> str:
        mean, lo, hi = v
        return f"{mean:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"

    lines = [
        f"# Character-level language models on the standard library's source: {study}",
        "",
        f"`{meta['command']}`: {meta['date']}, torch {torch.__version__}, Python "
        f"{meta['corpus']['python']}, {meta['budget']:.0f} s of training (thread CPU time) per "
        f"run on one thread, {meta['jobs']} run(s) at a time, seeds {meta['seeds']}; 1-min load "
        f"average {meta['load'][0]:.2f} at the start, {meta['load'][1]:.2f} at the end.",
        "",
        f"Corpus: {meta['corpus']['files']['train']} training files "
        f"({meta['corpus']['bytes']['train']:,} bytes), {meta['corpus']['files']['test']} "
        f"held-out files ({meta['corpus']['bytes']['test']:,} bytes); model: {LAYERS} blocks, "
        f"width {D}, {HEADS} heads, context {CONTEXT}, batch {BATCH}. Cells: the mean over "
        "seeds (min-max). Lower bits per character is better.",
        "",
    ]
    head = ["arm", "held-out bpc @128", "bpc @512", "train µs/token", "infer µs/token", "steps"]
    keys = ["bpc", "bpc_long", "train_us_per_token", "infer_us_per_token", "steps"]
    digits = [3, 3, 1, 1, 0]
    if study == "routing":
        head += ["load balance", "dead experts"]
        keys += ["balance", "dead_experts"]
        digits += [3, 1]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append(
            f"| {row['arm']} | "
            + " | ".join(cell(row[k], d) for k, d in zip(keys, digits, strict=True))
            + " |"
        )
    return [*lines, ""]


def plot(path: Path, study: str, runs: list[Run], arms: tuple[str, ...]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (curves, final) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    colors = plt.get_cmap("tab10")
    for i, arm in enumerate(arms):
        for j, r in enumerate(x for x in runs if x.arm == arm):
            xs = [p["seconds"] for p in r.curve]
            ys = [p["held_out_bpc"] for p in r.curve]
            curves.plot(xs, ys, color=colors(i % 10), lw=1, label=arm if j == 0 else None)
        pts = [r for r in runs if r.arm == arm]
        final.scatter([i] * len(pts), [r.bpc for r in pts], color=colors(i % 10), marker="o")
        final.scatter(
            [i + 0.25] * len(pts), [r.bpc_long for r in pts], color=colors(i % 10), marker="x"
        )
    curves.set_xlabel("training time (s, thread CPU time)")
    curves.set_ylabel("held-out bits per character (a 64-window sample)")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    final.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
    final.set_ylabel("held-out bits per character (o: context 128, x: 512)")
    final.grid(alpha=0.3)
    fig.suptitle(f"{study}: one point per seed", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=("attention", "routing", "both"), default="both")
    parser.add_argument("--budget", type=float, default=60.0, help="training seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the study's arms")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a smoke test: seconds, no files")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget, args.seeds, args.jobs = 1.0, [0], 1
    studies = ("attention", "routing") if args.study == "both" else (args.study,)
    _, _, info = corpus()
    for study in studies:
        arms = ATTENTION_ARMS if study == "attention" else ROUTING_ARMS
        if args.arms:
            arms = tuple(a for a in arms if a in args.arms)
        if args.quick:
            arms = arms[:2]
        specs = [(study, a, s, args.budget, args.quick) for s in args.seeds for a in arms]
        load0 = os.getloadavg()[0]
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                runs = list(pool.map(run, specs))
        else:
            runs = [run(s) for s in specs]
        rows = summary(runs, arms)
        meta = {
            "command": "python benchmarks/lm_study.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "budget": args.budget,
            "jobs": args.jobs,
            "seeds": args.seeds,
            "load": (load0, os.getloadavg()[0]),
            "corpus": info,
        }
        lines = markdown(study, rows, meta)
        print("\n".join(lines))
        if args.quick:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        record = {
            **meta,
            "torch": torch.__version__,
            "summary": rows,
            "runs": [asdict(r) for r in runs],
        }
        (args.out / f"lm-{study}.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / f"lm-{study}.md").write_text("\n".join(lines))
        plot(args.out / f"lm-{study}.png", study, runs, arms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
