"""Top-k attention that generalises in the number of keys: a synthetic task, measured.

**The task.** n keys x_i ~ N(0, I_16), their values v_i ~ N(0, I_8) and a query q ~ N(0, I_16);
the target is the mean of the values of the 4 keys with the largest <q, x_i>. A one-head
attention layer learns W_q, W_k (16 x 16) and W_v (8 x 8) from scratch, trained at n = 32 keys
and tested at n = 32 ... 2048. The metric is the relative MSE,
``mean ||prediction - target||^2 / mean ||target||^2`` (predicting 0 scores 1).

**The arms** (one layer each, the same training):
- ``topk-mean``: ``softops.nn.topk_attention(..., k=4, mode="mean")``, the soft top-k mean of
  the values (the structure of the target);
- ``topk-softmax``: the same with ``mode="softmax"`` (the masked softmax, Xie et al. 2020);
- ``topk-mean-st``: ``topk-mean`` with ``hard=True`` (straight-through: exactly 4 keys forward);
- ``softmax``: plain softmax attention (``scaled_dot_product_attention``);
- ``entmax15``: entmax-1.5 attention (Peters et al. 2019; needs the optional ``entmax``);
- ``hard-topk``: the mean of the values of a hard ``torch.topk`` of the scores: no gradient
  reaches W_q or W_k, so the selection never learns.

Softmax attention cannot represent the target at every n: the weight it puts on the 4 best keys
depends on how many others compete. The soft top-k mean can (its mask sums to 4 whatever n).

Run::

    python -m benchmarks.attention            # 3 seeds, all arms: about 3 minutes on 1 thread
    python -m benchmarks.attention --quick    # the smoke test's tiny run; writes no files

It prints a Markdown table and writes ``attention.{json,md,png}`` under ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.report import write_experiment
from softops.nn import topk_attention

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("topk-mean", "topk-softmax", "topk-mean-st", "softmax", "entmax15", "hard-topk")
K, D_KEY, D_VALUE = 4, 16, 8
FULL = {"seeds": 3, "steps": 3000, "batch": 128, "train_n": 32, "test": 2000}
QUICK = {"seeds": 2, "steps": 30, "batch": 16, "train_n": 32, "test": 50}
TEST_NS = (32, 64, 128, 256, 512, 1024, 2048)


def _entmax15() -> Any:
    try:
        from entmax import entmax15
    except ImportError:
        return None
    return entmax15


def problems(b: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``b`` problems of ``n`` keys: (q (b, 1, 16), x (b, n, 16), v (b, n, 8), target (b, 8))."""
    q = torch.randn(b, 1, D_KEY, generator=g)
    x = torch.randn(b, n, D_KEY, generator=g)
    v = torch.randn(b, n, D_VALUE, generator=g)
    top = (q @ x.transpose(1, 2))[:, 0].topk(K, -1).indices
    target = v.gather(1, top[..., None].expand(-1, -1, D_VALUE)).mean(1)
    return q, x, v, target


class Layer(nn.Module):
    """One attention head with learned W_q, W_k and W_v, and the arm's weighting."""

    def __init__(self, arm: str, epsilon: float) -> None:
        super().__init__()
        self.arm, self.epsilon = arm, epsilon
        self.wq = nn.Linear(D_KEY, D_KEY, bias=False)
        self.wk = nn.Linear(D_KEY, D_KEY, bias=False)
        self.wv = nn.Linear(D_VALUE, D_VALUE, bias=False)

    def forward(self, q: torch.Tensor, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qq, kk, vv = self.wq(q), self.wk(x), self.wv(v)
        if self.arm.startswith("topk-"):
            mode = "softmax" if self.arm == "topk-softmax" else "mean"
            out = topk_attention(
                qq, kk, vv, K, epsilon=self.epsilon, mode=mode, hard=self.arm.endswith("-st")
            )
        elif self.arm == "softmax":
            out = F.scaled_dot_product_attention(qq, kk, vv)
        else:
            s = qq @ kk.transpose(-2, -1) / math.sqrt(D_KEY)
            if self.arm == "entmax15":
                w = _entmax15()(s, dim=-1)
            else:  # hard-topk: a constant selection as far as autograd is concerned
                idx = s.detach().topk(min(K, s.shape[-1]), -1).indices
                w = torch.zeros_like(s).scatter(-1, idx, 1.0 / K)
            out = w @ vv
        return out[:, 0]


def relative_mse(pred: torch.Tensor, target: torch.Tensor) -> float:
    return float((pred - target).square().sum(-1).mean() / target.square().sum(-1).mean())


def run_arm(arm: str, seed: int, cfg: dict[str, int], epsilon: float, lr: float) -> dict[str, Any]:
    torch.manual_seed(seed)
    layer = Layer(arm, epsilon)
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg["steps"])
    g = torch.Generator().manual_seed(1000 + seed)
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        q, x, v, target = problems(cfg["batch"], cfg["train_n"], g)
        loss = (layer(q, x, v) - target).square().sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    train_s = time.perf_counter() - t0
    test = {}
    gt = torch.Generator().manual_seed(10**6 + seed)  # the same test problems for every arm
    with torch.no_grad():
        for n in TEST_NS:
            q, x, v, target = problems(cfg["test"], n, gt)
            test[n] = relative_mse(layer(q, x, v), target)
    return {"arm": arm, "seed": seed, "train_seconds": train_s, "relative_mse": test}


def table(rows: list[dict[str, Any]], arms: list[str]) -> list[str]:
    lines = [
        "| arm | " + " | ".join(f"n = {n}" for n in TEST_NS) + " |",
        "|---|" + "---|" * len(TEST_NS),
    ]
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        cells = []
        for n in TEST_NS:
            vals = torch.tensor([r["relative_mse"][n] for r in mine])
            cells.append(f"{vals.mean():.3f} ± {vals.std(correction=0):.3f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict[str, Any]], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        mean = [sum(r["relative_mse"][n] for r in mine) / len(mine) for n in TEST_NS]
        ax.plot(TEST_NS, mean, marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("keys at test (trained at 32)")
    ax.set_ylabel("relative MSE (mean over seeds)")
    ax.set_title("Mean of the values of the top-4 keys")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run; writes no files")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--epsilon", type=float, default=0.1, help="top-k temperature (0.1)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (1e-2)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    if args.seeds is not None:
        cfg["seeds"] = args.seeds
    if args.steps is not None:
        cfg["steps"] = args.steps
    arms = [a for a in args.arms if a != "entmax15" or _entmax15() is not None]
    rows = []
    for arm in arms:
        for seed in range(cfg["seeds"]):
            rows.append(run_arm(arm, seed, cfg, args.epsilon, args.lr))
            print(f"{arm} seed {seed}: {rows[-1]['relative_mse']}", file=sys.stderr)
    command = "python -m benchmarks.attention " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    skipped = [a for a in args.arms if a not in arms]
    lines = [
        "## Top-k attention: the mean of the values of the 4 best keys",
        "",
        f"Relative MSE at test (mean ± std over {cfg['seeds']} seeds), trained at n = "
        f"{cfg['train_n']} keys for {cfg['steps']} Adam steps (lr {args.lr}, cosine decay) of "
        f"{cfg['batch']} problems; {cfg['test']} test problems per n; epsilon = {args.epsilon} "
        f"for the soft top-k arms; {args.threads} torch thread(s), torch {torch.__version__}.",
        "",
        *table(rows, arms),
        "",
    ]
    if skipped:
        lines += [f"Not run (optional dependency missing): {', '.join(skipped)}.", ""]
    secs = {a: sum(r["train_seconds"] for r in rows if r["arm"] == a) / cfg["seeds"] for a in arms}
    lines += [
        "Training seconds per seed: " + ", ".join(f"{a} {s:.0f}" for a, s in secs.items()) + ".",
        "",
        f"Reproduce with `{command.strip()}`.",
        "",
    ]
    print("\n".join(lines))
    result = {
        "command": command.strip(),
        "config": cfg,
        "epsilon": args.epsilon,
        "lr": args.lr,
        "rows": rows,
    }
    if not args.quick:
        paths = write_experiment(args.out, "attention", result, lines)
        plot(rows, arms, paths["md"].with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
