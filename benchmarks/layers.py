"""The layers suite: TopKAttention and TopKRouter against their dense counterparts.

Two groups of configurations, forward and forward+backward (through the layer's parameters and
its input), float32:

* ``attention``: self-attention over N = 4 sequences of S tokens (E = 64, 4 heads, k = 16), for
  S in :data:`ATTENTION_SIZES`. The floor is ``torch.nn.MultiheadAttention`` with the same
  shapes (its fused scaled-dot-product path). The cases are :class:`softops.nn.TopKAttention`
  in its two modes and with ``hard=True``.
* ``router``: T tokens of d = 64 routed to 2 of E = 64 experts, for T in :data:`ROUTER_SIZES`.
  The floor is the usual hard router: a linear layer, ``torch.topk`` of the logits and the
  softmax of the two selected logits, scattered to (T, E). The cases are
  :class:`softops.nn.TopKRouter` with ``hard=True`` (the default) and ``hard=False``.
* ``beam``: one step of beam search over B = 64 sequences, K beams and V tokens, for (K, V) in
  :data:`BEAM_SIZES`; the input is the (B, K, V) log-probabilities. The floor is the hard step
  (``torch.topk`` of the K V candidate scores and their values); the cases are
  :func:`softops.apps.beam_step` with the sorted SOFT top-k weights (epsilon 0.5) and with the
  softmax surrogate. A beam search calls it once per token.

The layers are built once per configuration from a fixed seed. The harness
(:mod:`benchmarks.harness`) times them interleaved, with medians and the ratio to the floor.
The softops cases are flagged ``compiled``: at these sizes the "ot" mask takes its fused
(torch.compile) path, whose first call compiles (about 20 s on CPU) before the timed calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import torch

from benchmarks.harness import (
    Case,
    Config,
    QuickDefaults,
    RunExtras,
    make_options,
    run_and_write,
    thread_runs,
)
from softops.apps.beam import beam_step
from softops.nn import TopKAttention, TopKRouter

__all__ = [
    "ATTENTION_SIZES",
    "BEAM_SIZES",
    "GROUPS",
    "QUICK",
    "ROUTER_SIZES",
    "SUITE",
    "LayersSuite",
    "build_configs",
]

ATTENTION_SIZES = (128, 512, 1024)
ROUTER_SIZES = (1024, 8192, 65536)
BEAM_SIZES = ((2, 9), (4, 9), (4, 64))
BEAM_BATCH, BEAM_EPSILON = 64, 0.5
QUICK: QuickDefaults = {"sizes": (64,), "batch": 2, "repeats": 3, "time_budget": 2.0}
N, E, HEADS, K_KEYS = 4, 64, 4, 16
D_MODEL, EXPERTS, K_EXPERTS = 64, 64, 2
_MHA = "nn.MultiheadAttention"
_HARD_ROUTER = "torch.topk router"
_HARD_STEP = "torch.topk beam step"


class _HardRouter(torch.nn.Module):
    """The usual router: the softmax of the k best logits, as (T, E) weights."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(D_MODEL, EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.gate(x).topk(K_EXPERTS, -1)
        w = torch.softmax(top.values, -1)
        return torch.zeros(x.shape[0], EXPERTS, device=x.device, dtype=w.dtype).scatter(
            -1, top.indices, w
        )


def _attention(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return layer(x, x, x, need_weights=False)[0]

    return fn


def _beam_scores(config: Config) -> torch.Tensor:
    """Fixed scores of the K beams (sorted, as after a step), from the configuration's seed."""
    p = config.params
    g = torch.Generator().manual_seed(p["K"] * 1000 + p["V"])
    return -torch.rand(p["B"], p["K"], generator=g).cumsum(-1)


def _like(scores: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``scores`` on the device and in the dtype of a given tensor, copied once per pair (so the
    timed calls do not include a host-to-device copy)."""
    cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(t: torch.Tensor) -> torch.Tensor:
        key = (t.device, t.dtype)
        if key not in cache:
            cache[key] = scores.to(t)
        return cache[key]

    return get


def _hard_step(scores: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    like = _like(scores)

    def fn(log_probs: torch.Tensor) -> torch.Tensor:
        cand = (like(log_probs).unsqueeze(-1) + log_probs).flatten(-2)
        return cand.topk(scores.shape[-1], -1).values

    return fn


def _soft_step(scores: torch.Tensor, method: str) -> Callable[[torch.Tensor], torch.Tensor]:
    like = _like(scores)

    def fn(log_probs: torch.Tensor) -> torch.Tensor:
        return beam_step(like(log_probs), log_probs, epsilon=BEAM_EPSILON, method=method).weights

    return fn


def _weights(router: TopKRouter) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return router(x).weights

    return fn


class LayersSuite:
    """The layers suite (see the module docstring); ``SUITE`` is its instance."""

    ref = "benchmarks.layers:SUITE"
    name = "layers"
    floor_label = "the dense counterpart"
    plot_group = "attention"
    plot_x = "S"

    def make_input(
        self,
        config: Config,
        *,
        device: torch.device,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Tokens: (N, S, E) for attention, (T, d) for the router; log-probabilities (B, K, V)
        of a model with logits of standard deviation 2 for the beam step."""
        p = config.params
        if config.group == "beam":
            shape3 = (p["B"], p["K"], p["V"])
            logits = 2 * torch.randn(*shape3, generator=generator, device=device, dtype=dtype)
            return torch.log_softmax(logits, -1)
        shape = (p["N"], p["S"], E) if config.group == "attention" else (p["T"], D_MODEL)
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    def make_cases(self, config: Config) -> list[Case]:
        """The floor and the softops layers of one configuration."""
        torch.manual_seed(0)
        if config.group == "attention":
            mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
            cases = [Case(_MHA, _attention(mha), floor=True)]
            for label, kw in (
                ("TopKAttention softmax", {}),
                ("TopKAttention mean", {"mode": "mean"}),
                ("TopKAttention softmax hard", {"hard": True}),
            ):
                layer = TopKAttention(E, HEADS, K_KEYS, batch_first=True, **kw)
                cases.append(Case(label, _attention(layer), compiled=True))
            return cases
        if config.group == "beam":
            scores = _beam_scores(config)
            return [
                Case(_HARD_STEP, _hard_step(scores), floor=True),
                Case("beam_step soft_topk", _soft_step(scores, "soft_topk")),
                Case("beam_step softmax", _soft_step(scores, "softmax")),
            ]
        hard = _HardRouter()
        routers = {
            "TopKRouter hard": TopKRouter(D_MODEL, EXPERTS, K_EXPERTS),
            "TopKRouter soft": TopKRouter(D_MODEL, EXPERTS, K_EXPERTS, hard=False),
        }
        cases = [Case(_HARD_ROUTER, hard, floor=True)]
        for label, router in routers.items():
            cases.append(Case(label, _weights(router), compiled=True))
        return cases

    def compare(self, config: Config, outputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Nothing to compare: the layers have their own weights."""
        return {}

    def summary(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """How to read the table."""
        return [
            "The attention rows are self-attention with N = 4, E = 64, 4 heads and k = 16 keys "
            "per query; the router rows route T tokens of d = 64 to 2 of 64 experts; the beam "
            f"rows are one beam-search step over B = {BEAM_BATCH} sequences, K beams and V "
            f"tokens (epsilon {BEAM_EPSILON}). Every time is divided by the counterpart's "
            "forward (MultiheadAttention, the hard torch.topk router, or the hard beam step).",
        ]


SUITE = LayersSuite()


GROUPS = ("attention", "router", "beam")


def build_configs(
    *,
    sizes: Sequence[int] | None = None,
    quick: bool = False,
    groups: Sequence[str] = GROUPS,
) -> list[Config]:
    """The attention configurations over ``sizes`` (S), then the router's and the beam step's;
    only those of ``groups``."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"bench layers: unknown groups {sorted(unknown)}; expected {GROUPS}.")
    s_values = tuple(sizes) if sizes else (QUICK["sizes"] if quick else ATTENTION_SIZES)
    t_values = (256,) if quick else ROUTER_SIZES
    n = QUICK["batch"] if quick else N
    configs = [Config("attention", {"N": n, "S": int(s)}) for s in s_values]
    configs += [Config("router", {"T": int(t)}) for t in t_values]
    beams = BEAM_SIZES[:1] if quick else BEAM_SIZES
    configs += [Config("beam", {"B": BEAM_BATCH, "K": kk, "V": v}) for kk, v in beams]
    return [c for c in configs if c.group in groups]


def run(
    *,
    quick: bool = False,
    out: str | Path = "benchmarks/results",
    threads: int | Sequence[int | None] | None = 1,
    device: str = "cpu",
    repeats: int | None = None,
    sizes: Sequence[int] | None = None,
    groups: Sequence[str] = GROUPS,
    memory: bool = True,
    command: str | None = None,
    log: Callable[[str], None] = print,
    **extras: Unpack[RunExtras],
) -> tuple[str, dict[str, Path]]:
    """Run the layers suite and write ``layers.{jsonl,md,png}`` (``layers-quick.*``) under out;
    for a subset of the groups, ``layers-<groups>.*``. ``threads`` is a count, ``None`` (out of
    the box) or a sequence of them, one run each into the same files; ``extras`` go to
    :func:`~benchmarks.harness.make_options`."""
    options = make_options(
        QUICK,
        quick=quick,
        device=device,
        dtype="float32",
        threads=1,
        repeats=repeats,
        time_budget=None,
        memory=memory,
        first_call=False,
        seed=0,
        command=command,
        **extras,
    )
    configs = build_configs(sizes=sizes, quick=quick, groups=groups)
    stem = "layers" if tuple(groups) == GROUPS else "-".join(("layers", *groups))
    return run_and_write(
        SUITE,
        configs,
        thread_runs(options, threads),
        out,
        f"{stem}-quick" if quick else stem,
        command,
        log,
    )
