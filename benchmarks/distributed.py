"""Time softops.distributed.soft_topk_mask against all-gathering the rows, per world size.

For each world size P (gloo processes on this machine, 1 thread each), B rows of n entries in
total are split evenly over the ranks, and two ways of computing each rank's part of the mask
are timed, forward and forward+backward (the backward of ``(out * g).sum()`` for a fixed g):

* ``sharded``: ``softops.distributed.soft_topk_mask(x_local, k)``, all-reducing O(B) per-row
  sums (``2 + iterations`` collectives forward, 1 backward);
* ``all-gather``: ``torch.distributed.all_gather`` of the whole rows to every rank, the
  single-process ``softops.soft_topk_mask`` on them, and this rank's slice; its backward
  all-gathers the upstream gradient too (the mask couples the whole row) and runs the
  single-process backward on every rank.

Every call starts after a barrier; the time of a call is the slowest rank's; medians over
interleaved repeats after one warm-up. The collectives of each call are counted (and the bytes
each rank hands them). Writes ``distributed.jsonl`` and ``distributed.md`` under ``--out``.
Usage::

    python benchmarks/distributed.py                       # B=64, n=1e6, k=1000, P = 1, 2, 4
    python benchmarks/distributed.py --n 4096 --repeats 1 --out /tmp/d   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = ("sharded", "all-gather")


class Counter:
    """Counts the collectives this process calls (all_reduce, all_gather) and their bytes."""

    NAMES = ("all_reduce", "all_gather")

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0
        self.originals = {name: getattr(dist, name) for name in self.NAMES}

    def install(self) -> None:
        for name, original in self.originals.items():

            def counted(tensor_or_list, *args, _original=original, **kwargs):
                t = args[0] if isinstance(tensor_or_list, list) else tensor_or_list
                self.calls += 1
                self.bytes += t.numel() * t.element_size()
                return _original(tensor_or_list, *args, **kwargs)

            setattr(dist, name, counted)

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.bytes)
        self.calls, self.bytes = 0, 0
        return out


def _worker(rank: int, world: int, init: str, args: dict, out: str) -> None:
    from softops.testing import backend

    torch.set_num_threads(1)
    with backend("kernel" if args["kernels"] else "reference"):
        _measure(rank, world, init, args, out)


def _measure(rank: int, world: int, init: str, args: dict, out: str) -> None:
    import softops
    import softops.distributed as sd

    dist.init_process_group("gloo", init, rank=rank, world_size=world)
    B, n, k, eps = args["B"], args["n"], args["k"], args["epsilon"]
    dtype = getattr(torch, args["dtype"])
    size = n // world
    lo = rank * size
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own shard
    x_local = torch.randn(B, size, generator=gen).to(dtype)
    g_local = torch.randn(B, size, generator=gen).to(dtype)

    def sharded(backward: bool) -> torch.Tensor:
        x = x_local.detach().requires_grad_(backward)
        out = sd.soft_topk_mask(x, k, epsilon=eps)
        if backward:
            (out * g_local).sum().backward()
        return out.detach()

    def gathered(backward: bool) -> torch.Tensor:
        parts = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(parts, x_local)
        full = torch.cat(parts, -1).requires_grad_(backward)
        A = softops.soft_topk_mask(full, k, epsilon=eps)
        mine = A[:, lo : lo + size]
        if backward:
            gs = [torch.empty_like(g_local) for _ in range(world)]
            dist.all_gather(gs, g_local)  # the mask couples the row: every rank needs all of g
            A.backward(torch.cat(gs, -1))
            assert full.grad is not None
            _ = full.grad[:, lo : lo + size]
        return mine.detach()

    calls = {"sharded": sharded, "all-gather": gathered}
    counter = Counter()
    counter.install()
    iterations = sd.topk_threshold(x_local, k, eps).iterations
    counter.take()
    # agreement of the two (max |difference| over this rank's part), and the warm-up
    diff = (sharded(False) - gathered(False)).abs().max().item()
    samples: dict[str, dict[str, list[float]]] = {c: {"fwd": [], "fwdbwd": []} for c in CASES}
    counts: dict[str, dict[str, tuple[int, int]]] = {c: {} for c in CASES}
    for rep in range(args["repeats"] + 1):
        order = CASES if rep % 2 == 0 else CASES[::-1]
        for mode in ("fwd", "fwdbwd"):
            for case in order:
                dist.barrier()
                counter.take()
                start = time.perf_counter()
                calls[case](mode == "fwdbwd")
                elapsed = time.perf_counter() - start
                counts[case][mode] = counter.take()
                slowest = torch.tensor([elapsed], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                counter.take()
                if rep:  # (the first round is the warm-up)
                    samples[case][mode].append(float(slowest))
    if rank == 0:
        records = []
        for case in CASES:
            rec = {
                "suite": "distributed",
                "world": world,
                "case": case,
                "B": B,
                "n": n,
                "k": k,
                "epsilon": eps,
                "dtype": args["dtype"],
                "threads": 1,
                "kernels": args["kernels"],
                "iterations": iterations,
                "max_abs_diff": diff,
                "repeats": args["repeats"],
            }
            for mode in ("fwd", "fwdbwd"):
                rec[f"{mode}_ms"] = 1e3 * statistics.median(samples[case][mode])
                rec[f"{mode}_ms_samples"] = [round(1e3 * s, 3) for s in samples[case][mode]]
                rec[f"{mode}_collectives"], rec[f"{mode}_bytes"] = counts[case][mode]
            records.append(rec)
        Path(out, f"world{world}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


def run_world(world: int, args: dict) -> list[dict]:
    """Spawn ``world`` processes (gloo over a file store) and return rank 0's records."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world, f"file://{tmp}/store", args, tmp),
            nprocs=world,
            start_method="spawn",
        )
        return json.loads(Path(tmp, f"world{world}.json").read_text())


def markdown(records: list[dict], command: str) -> str:
    r0 = records[0]
    when = datetime.now(UTC).isoformat(timespec="seconds")
    lines = [
        "# softops.distributed: sharded soft top-k against all-gathering the rows",
        "",
        f"torch {torch.__version__} · {platform.machine()} CPU, {os.cpu_count()} cores · gloo · "
        f"1 thread per process · {r0['dtype']} · {when}",
        "",
        f"Reproduce with `{command}`.",
        "",
        f"B={r0['B']} rows of n={r0['n']} entries in total, split evenly over P processes; "
        f"k={r0['k']}, epsilon={r0['epsilon']} (x ~ N(0, 1)); the single-process op's kernels "
        f"{'on' if r0['kernels'] else 'off'}. *sharded*: `softops.distributed.soft_topk_mask` "
        "on each rank's shard; *all-gather*: `all_gather` of the rows, the single-process "
        "`softops.soft_topk_mask` on every rank, and the rank's slice (its backward gathers "
        "the upstream gradient as well). Time: the slowest rank's, median of interleaved "
        "repeats after a warm-up. Collectives: per call, with the bytes each rank hands them. "
        "*max diff*: the largest difference between the two on a rank's part. *load*: the "
        "machine's 1-minute load average before and after the world's run (other jobs share "
        "it). "
        "The processes share the machine's cores: with P above the core count they time-share, "
        "so the times are those of this machine, not of P devices.",
        "",
        "| P | method | fwd ms | fwd+bwd ms | collectives fwd / bwd | MB per rank fwd / bwd |"
        " Newton evaluations | max diff | load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        bwd_calls = r["fwdbwd_collectives"] - r["fwd_collectives"]
        fwd_mb = r["fwd_bytes"] / 2**20
        bwd_mb = (r["fwdbwd_bytes"] - r["fwd_bytes"]) / 2**20
        lines.append(
            f"| {r['world']} | {r['case']} | {r['fwd_ms']:.0f} | {r['fwdbwd_ms']:.0f} | "
            f"{r['fwd_collectives']} / {bwd_calls} | {fwd_mb:.3g} / {bwd_mb:.3g} | "
            f"{r['iterations'] if r['case'] == 'sharded' else '-'} | {r['max_abs_diff']:.1e} | "
            f"{r['load_before']:.1f}-{r['load_after']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Parse the arguments, run every world size, write the records and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--n", type=int, default=1_000_000, help="entries per row, in total")
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument(
        "--reference", action="store_true", help="the torch reference instead of the kernels"
    )
    parser.add_argument("--out", default="benchmarks/results")
    ns = parser.parse_args(argv)
    if any(ns.n % w for w in ns.worlds):
        parser.error(f"--n ({ns.n}) must be a multiple of every world size {ns.worlds}")
    args = {k: getattr(ns, k) for k in ("B", "n", "k", "epsilon", "repeats", "dtype")}
    args["kernels"] = not ns.reference
    records = []
    for world in ns.worlds:
        load = os.getloadavg()[0]
        for rec in run_world(world, args):
            records.append({**rec, "load_before": load, "load_after": os.getloadavg()[0]})
        print(f"P={world} done", file=sys.stderr)
    command = "python benchmarks/distributed.py " + " ".join(argv or sys.argv[1:])
    table = markdown(records, command.strip())
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distributed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "distributed.md").write_text(table)
    print(table)
    return {"records": records, "markdown": table, "out": out}


if __name__ == "__main__":
    main()
