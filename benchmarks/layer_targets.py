"""The layers at the shapes of the kernel-layer targets, against their plain counterparts.

    python benchmarks/layer_targets.py            # writes benchmarks/results/layer_targets.md

- a causal ``TopKAttention`` (B=16, L=64, d=64, 4 heads, k=8) against ``nn.MultiheadAttention``
  with the same shapes and mask (target: 2x);
- ``TopKRouter`` (4096 tokens, d=64, 8 experts, k=2) with its auxiliary loss against a plain
  softmax top-2 router with the same loss (target: 2x);
- ``softops.apps.beam_step`` at (B=64, K=2, V=9) (target: 1 ms).

Forward+backward of ``(out * g).sum()`` (plus the auxiliary loss for the routers), one torch
thread, interleaved: three rounds of 60 timed calls each after a warm-up, the best round's median
of each. A call's time is the CPU time of the calling thread (``time.thread_time``: with one torch
thread all of its work runs there), so that the other processes of a loaded machine, which
preempt it, do not count; cache and memory contention with them still does. One process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from softops.apps import beam_step
from softops.nn import TopKAttention, TopKRouter


def _median_ms(fn: Callable[[], None], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def _pair(a: Callable[[], None], b: Callable[[], None], calls: int) -> tuple[float, float]:
    for _ in range(5):
        a()
        b()
    rounds = [(_median_ms(a, calls), _median_ms(b, calls)) for _ in range(3)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


def attention(calls: int) -> tuple[float, float]:
    B, L, d, heads, k = 16, 64, 64, 4, 8
    x = torch.randn(B, L, d, requires_grad=True)
    g = torch.randn(B, L, d)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    mha = nn.MultiheadAttention(d, heads, batch_first=True)
    topk = TopKAttention(d, heads, k=k, batch_first=True)

    def run(layer: nn.Module) -> Callable[[], None]:
        def step() -> None:
            out, _ = layer(x, x, x, attn_mask=causal, need_weights=False, is_causal=True)
            (out * g).sum().backward()

        return step

    return _pair(run(mha), run(topk), calls)


def router(calls: int) -> tuple[float, float]:
    T, d, E, k = 4096, 64, 8, 2
    x = torch.randn(T, d, requires_grad=True)
    g = torch.randn(T, E)
    gate = nn.Linear(d, E)
    soft = TopKRouter(d, E, k)

    def plain() -> None:
        p = torch.softmax(gate(x), -1)
        top, idx = p.topk(k, -1)
        weights = torch.zeros_like(p).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        load = torch.zeros_like(p).scatter(-1, idx, 1.0).mean(0) / k
        aux = E * (load * p.mean(0)).sum()
        ((weights * g).sum() + aux).backward()

    def routed() -> None:
        out = soft(x)
        ((out.weights * g).sum() + out.aux_loss).backward()

    return _pair(plain, routed, calls)


def beam(calls: int) -> float:
    B, K, V = 64, 2, 9
    scores = torch.randn(B, K)
    log_probs = torch.log_softmax(torch.randn(B, K, V), -1).requires_grad_()

    def step() -> None:
        out = beam_step(scores, log_probs, epsilon=0.5)
        (out.weights * torch.ones_like(out.weights)).sum().backward()

    for _ in range(20):
        step()
    return min(_median_ms(step, calls * 5) for _ in range(3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/layer_targets.py", description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/layer_targets.md")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    mha, topk = attention(args.calls)
    plain, routed = router(args.calls)
    beam_ms = beam(args.calls)
    rows = [
        ("causal TopKAttention / nn.MultiheadAttention", topk, mha, topk / mha, "2x"),
        ("TopKRouter / softmax top-2 router", routed, plain, routed / plain, "2x"),
    ]
    lines = [
        "# The layers at the kernel-layer targets",
        "",
        f"`python benchmarks/layer_targets.py`: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{torch.__version__}, 1 thread, 1-min load average {load:.2f} at the start.",
        "",
        "| layer | softops ms | plain ms | ratio | target |",
        "|---|---:|---:|---:|---:|",
        *(f"| {n} | {a:.3f} | {b:.3f} | {r:.2f}x | ≤ {t} |" for n, a, b, r, t in rows),
        f"| `beam_step` (B=64, K=2, V=9) | {beam_ms:.3f} | | | ≤ 1 ms |",
        "",
        (__doc__ or "").split("\n\n", 2)[2].strip(),
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines[4:9]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
