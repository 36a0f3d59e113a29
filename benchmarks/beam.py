"""Training through beam search with the sorted SOFT top-k, on a task where teacher forcing fails.

**The task: late disambiguation.** A target y_1..y_T (T = 8) of i.i.d. tokens in {0..7} is
followed by EOS (token 8). At step t a GRU decoder (hidden 64) sees the observation
o_t = (y_t mod 4, y_(t-1) div 4) and its own previous token: each token's high bit is unknown when
it is emitted and revealed one step later (o_(T+1) = (end, y_T div 4) asks for EOS). A
locally normalised model trained by teacher forcing has only ever seen right prefixes: it gives
each token consistent with the low bits probability 1/2, and nothing it learned tells it what
to do after a wrong prefix, so its beam search cannot rank the hypotheses (exact match at chance,
2^-8 = 0.4 %, however long it trains). A model that has met wrong prefixes can spread the mass of
their continuations, which ranks them below the right one: beam search with K = 2 can then be
exact.

**The arms** (the same model, optimiser, batch and budget):
- ``tf``: teacher forcing (cross-entropy on the right prefixes), tested with beam 2;
- ``soft_topk``: hard beams of size K, trained with :func:`softops.apps.beam_search_loss` on the
  sorted SOFT top-k weights of every step (the Hamming cost of each candidate's prefix);
- ``softmax``: the same search and loss with ``softmax(c / epsilon)`` as every rank's weights
  (the rank-blind surrogate).

- ``soft_topk_first``: ``soft_topk`` with the first rank's term only (``whole=0``).

**The second task** reveals each high bit two steps late: four hypotheses stay consistent
until then, all tied, so beam 4 is needed and the right one may sit at any of its places; the
whole beam's term of the loss is what keeps it in. ``soft_topk_first`` is the ablation.

Each search arm runs over the same epsilon grid. The budget is CPU time of the training process
on one torch thread (``time.process_time``), so it does not depend on the machine's other load;
the learning rate follows a cosine over it; the validation exact match is checked before
training and every ``--eval-every`` CPU seconds, a run stops early once it reaches 100 %, and
the test exact match is that of the best validation check's model. Reported: beam-K exact match
on 2000 test sequences, the CPU seconds to reach 90 % validation exact match (the first check at
or after it), and the training steps.

Run::

    python -m benchmarks.beam                  # 3 seeds, every arm, 5 CPU-minutes each
    python -m benchmarks.beam --beam 4 --delay 2 --arms soft_topk soft_topk_first softmax tf
                                               # the second task (see below)
    python -m benchmarks.beam --quick          # the smoke test's tiny run; writes no files

Seeds can run in separate processes (``--seeds 1 --seed-start S --out DIR_S``), then
``--merge DIR_0/beam-k2-d1.json DIR_1/...`` writes the combined table and plot.

It prints a Markdown table and writes ``beam-k<K>.{json,md}`` and a plot of the validation
curves under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.report import write_experiment
from softops.apps import beam_search, beam_search_loss

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("tf", "soft_topk", "softmax", "soft_topk_first")
T, LOW, EOS, BOS = 8, 4, 8, 9
VOCAB = 9  # 8 tokens and EOS
QUICK = {"seeds": 1, "budget": 1.5, "epsilons": (0.5,), "eval_every": 0.75, "n_test": 32}


def make_batch(gen: torch.Generator, bsz: int, delay: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(obs, target)``: obs (B, T+1) ids in [0, 45), target (B, T+1) = y and EOS.

    The observation at step t (0-based; t = T asks for EOS) is ``(low, h1, h2)``: low =
    ``y_t mod 4`` (4 at t = T), h1 = ``y_(t-delay) div 4`` (2 where there is none), and h2, at
    t = T with a delay of 2 only, ``y_(T-1) div 4`` (else 2), so that every high bit is revealed.
    """
    if delay not in (1, 2):
        raise ValueError(f"make_batch: expected a delay of 1 or 2; got {delay}.")
    y = torch.randint(0, 2 * LOW, (bsz, T), generator=gen)
    high = y // LOW
    low = torch.cat((y % LOW, torch.full((bsz, 1), LOW)), dim=1)
    none = torch.full((bsz, delay), 2)
    h1 = torch.cat((none, high), dim=1)[:, : T + 1]
    h2 = torch.full((bsz, T + 1), 2)
    if delay == 2:
        h2[:, T] = high[:, T - 1]
    obs = low * 9 + h1 * 3 + h2
    return obs, torch.cat((y, torch.full((bsz, 1), EOS)), dim=1)


class Decoder(nn.Module):
    """A GRU decoder: its input is its previous token and the step's observation."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.hidden = hidden
        self.tok = nn.Embedding(VOCAB + 1, 32)  # + BOS
        self.obs = nn.Embedding(5 * 3 * 3, 32)
        self.cell = nn.GRUCell(64, hidden)
        self.out = nn.Linear(hidden, VOCAB)

    def step(self, tokens: torch.Tensor, h: torch.Tensor, obs: torch.Tensor) -> tuple[Any, Any]:
        h = self.cell(torch.cat((self.tok(tokens), self.obs(obs)), dim=-1), h)
        return torch.log_softmax(self.out(h), dim=-1), h

    def teacher_forced(self, obs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        bsz = obs.shape[0]
        h = obs.new_zeros((bsz, self.hidden), dtype=torch.float32)
        prev = torch.full((bsz,), BOS)
        loss = obs.new_zeros((), dtype=torch.float32)
        for t in range(T + 1):
            logp, h = self.step(prev, h, obs[:, t])
            loss = loss + nn.functional.nll_loss(logp, target[:, t])
            prev = target[:, t]
        return loss / (T + 1)

    def search(self, obs: torch.Tensor, beam: int, epsilon: float, method: str) -> Any:
        bsz = obs.shape[0]
        obs_k = obs.repeat_interleave(beam, dim=0)

        def step(tokens: torch.Tensor, h: torch.Tensor, t: int) -> tuple[Any, Any]:
            return self.step(tokens, h, obs_k[:, t])

        h0 = torch.zeros((bsz, self.hidden))
        return beam_search(
            step, h0, batch_size=bsz, beam_size=beam, max_len=T + 1, bos=BOS, eos=EOS,
            epsilon=epsilon, method=method,
        )  # fmt: skip


def exact_match(model: Decoder, obs: torch.Tensor, target: torch.Tensor, beam: int) -> float:
    """Fraction of sequences whose best beam-``beam`` hypothesis is the target (EOS included)."""
    with torch.no_grad():
        seqs = model.search(obs, beam, 1.0, "hard").sequences[:, 0]
    if seqs.shape[1] < T + 1:  # every hypothesis ended early
        seqs = torch.cat((seqs, seqs.new_full((seqs.shape[0], T + 1 - seqs.shape[1]), EOS)), 1)
    return float((seqs == target).all(-1).float().mean())


def run_arm(
    arm: str, seed: int, epsilon: float, *, beam: int, delay: int, budget: float,
    eval_every: float, batch: int, lr: float, first: float, n_test: int,
) -> dict[str, Any]:  # fmt: skip
    """Train one arm for ``budget`` CPU seconds; return its record."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    val = make_batch(torch.Generator().manual_seed(10_000 + seed), n_test, delay)
    test = make_batch(torch.Generator().manual_seed(20_000 + seed), n_test, delay)
    model = Decoder()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    start, steps, next_eval = time.process_time(), 0, 0.0  # the first check: untrained
    wall = time.perf_counter()
    curve: list[tuple[float, int, float]] = []
    to90 = None
    best, best_state = -1.0, None
    while True:
        used = time.process_time() - start
        if used >= next_eval or used >= budget:
            em = exact_match(model, *val, beam)
            curve.append((round(used, 2), steps, em))
            if to90 is None and em >= 0.9:
                to90 = used
            if em > best:
                best, best_state = em, copy.deepcopy(model.state_dict())
            next_eval += eval_every
            if em >= 1.0 or used >= budget:
                break
        for group in opt.param_groups:  # cosine over the CPU budget
            group["lr"] = 0.5 * lr * (1 + math.cos(math.pi * min(used / budget, 1.0)))
        obs, target = make_batch(gen, batch, delay)
        if arm == "tf":
            loss = model.teacher_forced(obs, target)
        else:
            method = "soft_topk" if arm == "soft_topk_first" else arm
            whole = 0.0 if arm == "soft_topk_first" else 1.0
            result = model.search(obs, beam, epsilon, method)
            loss = beam_search_loss(result, target, first=first, whole=whole)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
    assert best_state is not None
    model.load_state_dict(best_state)
    return {
        "arm": arm,
        "seed": seed,
        "epsilon": None if arm == "tf" else epsilon,
        "test_exact_match": exact_match(model, *test, beam),
        "cpu_s": round(time.process_time() - start, 1),
        "wall_s": round(time.perf_counter() - wall, 1),
        "cpu_s_to_90": None if to90 is None else round(to90, 1),
        "steps": steps,
        "curve": curve,
    }


def _label(rec: dict[str, Any]) -> str:
    return rec["arm"] if rec["epsilon"] is None else f"{rec['arm']} eps={rec['epsilon']:g}"


def table(records: list[dict[str, Any]], beam: int, delay: int, budget: float) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(_label(rec), []).append(rec)
    lines = [
        f"Beam-{beam} exact match on the late-disambiguation task (T = {T}, high bits revealed "
        f"{delay} step{'s' if delay > 1 else ''} late), {budget:g} CPU seconds of training per "
        "run (1 thread).",
        "",
        "| arm | test exact match % (per seed) | mean % | CPU s to 90 % val (per seed) | steps |",
        "|---|---|---|---|---|",
    ]
    for label, recs in groups.items():
        ems = [100 * r["test_exact_match"] for r in recs]
        to90 = ["-" if r["cpu_s_to_90"] is None else f"{r['cpu_s_to_90']:.0f}" for r in recs]
        steps = ", ".join(str(r["steps"]) for r in recs)
        per = ", ".join(f"{e:.1f}" for e in ems)
        lines.append(
            f"| {label} | {per} | {sum(ems) / len(ems):.1f} | {', '.join(to90)} | {steps} |"
        )
    return [*lines, ""]


def plot(records: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    colours: dict[str, Any] = {}
    for rec in records:
        label = _label(rec)
        xs = [c[0] for c in rec["curve"]]
        ys = [100 * c[2] for c in rec["curve"]]
        line = ax.plot(xs, ys, color=colours.get(label), alpha=0.8, marker="o", markersize=3,
                       label=None if label in colours else label)  # fmt: skip
        colours.setdefault(label, line[0].get_color())
    ax.set_xlabel("training CPU seconds (1 thread)")
    ax.set_ylabel("validation exact match (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    """Combine the records of runs split over processes (the same settings, other seeds)."""
    import json

    parts = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    keys = ("beam", "delay", "budget_cpu_s", "batch", "lr", "first")
    if any(tuple(p[k] for k in keys) != tuple(parts[0][k] for k in keys) for p in parts):
        raise SystemExit("beam.py --merge: the records were run with different settings")
    record = {k: parts[0][k] for k in keys}
    record["runs"] = sorted((r for p in parts for r in p["runs"]), key=lambda r: r["seed"])
    order = {label: i for i, label in enumerate(dict.fromkeys(_label(r) for r in record["runs"]))}
    record["runs"].sort(key=lambda r: (order[_label(r)], r["seed"]))
    lines = table(record["runs"], record["beam"], record["delay"], record["budget_cpu_s"])
    print("\n".join(lines))
    stem = f"beam-k{record['beam']}-d{record['delay']}"
    write_experiment(out, stem, record, lines)
    plot(record["runs"], out / f"{stem}.png")
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed-start", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--merge", type=Path, nargs="+", default=None,
        help="JSON records of runs split over processes: write their combined table",
    )  # fmt: skip
    parser.add_argument("--beam", type=int, default=2)
    parser.add_argument("--delay", type=int, default=1, choices=(1, 2))
    parser.add_argument("--budget", type=float, default=300.0, help="CPU seconds per run")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument("--arms", nargs="+", default=list(ARMS[:3]), choices=ARMS)
    parser.add_argument("--eval-every", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--first", type=float, default=1.0, help="the first rank's weight")
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="a tiny run; writes no files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.seeds, args.budget, args.epsilons = QUICK["seeds"], QUICK["budget"], QUICK["epsilons"]
        args.eval_every, args.n_test = QUICK["eval_every"], QUICK["n_test"]
    if args.merge:
        return merge(args.merge, args.out)
    seeds = range(args.seed_start, args.seed_start + args.seeds)
    jobs = [(arm, seed, eps) for seed in seeds for arm in args.arms
            for eps in ((math.nan,) if arm == "tf" else args.epsilons)]  # fmt: skip
    records = []
    try:
        from tqdm import tqdm

        progress: Any = tqdm(jobs, desc="beam", file=sys.stderr)
    except ImportError:
        progress = jobs
    for arm, seed, eps in progress:
        rec = run_arm(
            arm, seed, eps, beam=args.beam, delay=args.delay, budget=args.budget,
            eval_every=args.eval_every, batch=args.batch, lr=args.lr, first=args.first,
            n_test=args.n_test,
        )  # fmt: skip
        records.append(rec)
        print(f"{_label(rec)} seed {seed}: {100 * rec['test_exact_match']:.1f} %", flush=True)
    lines = table(records, args.beam, args.delay, args.budget)
    print("\n".join(lines))
    record = {
        "beam": args.beam, "delay": args.delay, "budget_cpu_s": args.budget,
        "batch": args.batch, "lr": args.lr, "first": args.first, "runs": records,
    }  # fmt: skip
    if not args.quick:
        stem = f"beam-k{args.beam}-d{args.delay}"
        write_experiment(args.out, stem, record, lines)
        plot(records, args.out / f"{stem}.png")
    return record


if __name__ == "__main__":
    main()
