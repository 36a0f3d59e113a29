r"""A mixture-of-experts block: :class:`TopKRouter` and sparse dispatch to E experts,
:math:`y_t = \sum_{e \in S_t} g_{te}\, f_e(x_t)` with :math:`S_t` the experts of non-zero weight
(with ``hard=True``, the k the router selected). Each expert runs once, on its tokens only, so a
token costs k experts, not E.

**Gradients.** Those of the dense sum (every expert on every token, weighted by ``g``), except
for the weights of the experts that were not run (their gradient would need the expert's
output); the router's logits all receive one through the straight-through weights.

**Capacity.** With ``capacity_factor`` c an expert takes at most
:math:`C = \lceil c \cdot k\, T / E \rceil` of the T tokens (GShard), first choices before second
ones, in token order; an assignment beyond C is dropped (its term left out, the weights not
renormalised), so use the block in a residual connection (``x + moe(x).output``).

References:
    Shazeer, N., Mirhoseini, A., Maziarz, K., et al. (2017). Outrageously Large Neural
    Networks: The Sparsely-Gated Mixture-of-Experts Layer. ICLR.
    Lepikhin, D., Lee, H., Xu, Y., et al. (2021). GShard. ICLR (the capacity and its order).
    Fedus, W., Zoph, B., Shazeer, N. (2022). Switch Transformers. JMLR 23.
    Zoph, B., Bello, I., Kumar, S., et al. (2022). ST-MoE. arXiv:2202.08906 (the z-loss).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from softops.nn._module import ArgsModule
from softops.nn.router import RouterOutput, TopKRouter

__all__ = ["MoEOutput", "TopKMoE"]


class MoEOutput(NamedTuple):
    """What :class:`TopKMoE` returns for tokens of shape ``(*, d_model)``."""

    output: torch.Tensor
    """``(*, d_model)``: the weighted sum of each token's experts' outputs."""
    aux_loss: torch.Tensor
    """``()``: the router's Switch Transformer load-balancing loss (:class:`RouterOutput`)."""
    z_loss: torch.Tensor
    """``()``: the router's ST-MoE z-loss, the mean of ``logsumexp(logits)**2``."""
    dropped: torch.Tensor
    """``()``: the fraction of the token-expert assignments dropped for capacity."""
    router: RouterOutput
    """The router's full output: weights, indices, load per expert, logits."""


def _feed_forward(
    d_model: int, device: torch.device | str | None, dtype: torch.dtype | None
) -> nn.Module:
    """The default expert: ``Linear(d_model, 4 d_model)``, GELU, and back."""
    return nn.Sequential(
        nn.Linear(d_model, 4 * d_model, device=device, dtype=dtype),
        nn.GELU(),
        nn.Linear(4 * d_model, d_model, device=device, dtype=dtype),
    )


class TopKMoE(ArgsModule):
    r"""A mixture-of-experts block: route each token to k experts, run them sparsely, combine.

    See the module docstring for the math, the gradients and the capacity rule.

    Args:
        d_model: the token features; every expert maps ``(n, d_model)`` to ``(n, d_model)``.
        num_experts, k: as for :class:`TopKRouter`.
        expert_factory: a callable with no argument that returns a new expert (called E times);
            None (and no ``experts``): ``Linear(d_model, 4 d_model)``, GELU, and back.
        experts: the E experts themselves (instead of ``expert_factory``).
        capacity_factor: None (default: no limit) or c > 0 (module docstring).
        epsilon, mode, method, hard, noise_std, bias: the router's (with ``hard=False`` a token
            runs every expert of non-zero weight).
        device, dtype: of the router and of the default experts.

    Shape:
        - input: ``(*, d_model)``; output ``(*, d_model)``, the losses scalars.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> moe = TopKMoE(16, num_experts=4, k=2, capacity_factor=1.25)
        >>> out = moe(torch.randn(2, 10, 16))
        >>> out.output.shape, out.router.indices.shape, float(out.router.load.sum())
        (torch.Size([2, 10, 16]), torch.Size([2, 10, 2]), 1.0)
        >>> loss = out.output.square().mean() + 0.01 * out.aux_loss + 0.001 * out.z_loss
        >>> loss.backward()
    """

    _fields = ("d_model", "num_experts", "k", "capacity_factor")
    _optional = (("capacity_factor", None),)

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int = 2,
        *,
        expert_factory: Callable[[], nn.Module] | None = None,
        experts: Sequence[nn.Module] | None = None,
        capacity_factor: float | None = None,
        epsilon: float = 0.1,
        mode: str = "softmax",
        method: str = "ot",
        hard: bool = True,
        noise_std: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        op = type(self).__name__
        if capacity_factor is not None:
            if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
                raise TypeError(
                    f"{op}: expected `capacity_factor` to be a positive number or None; got "
                    f"capacity_factor={capacity_factor!r}."
                )
            if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
                raise ValueError(
                    f"{op}: expected `capacity_factor` > 0 and finite; got "
                    f"capacity_factor={capacity_factor!r}."
                )
        if expert_factory is not None and experts is not None:
            raise ValueError(f"{op}: expected `expert_factory` or `experts`, not both.")
        if expert_factory is not None and not callable(expert_factory):
            raise TypeError(
                f"{op}: expected `expert_factory` to be a callable that returns a Module; got "
                f"{expert_factory!r}."
            )
        try:
            router = TopKRouter(
                d_model,
                num_experts,
                k,
                epsilon=epsilon,
                mode=mode,
                method=method,
                hard=hard,
                noise_std=noise_std,
                bias=bias,
                device=device,
                dtype=dtype,
            )
        except (TypeError, ValueError) as err:  # the router's checks, under this block's name
            raise type(err)(str(err).replace("TopKRouter:", f"{op}:", 1)) from None
        if experts is None:
            make = expert_factory or functools.partial(_feed_forward, d_model, device, dtype)
            experts = [make() for _ in range(num_experts)]
        elif isinstance(experts, nn.Module) and not isinstance(experts, nn.ModuleList):
            raise TypeError(
                f"{op}: expected `experts` to be a sequence of Modules; got one Module."
            )
        experts = list(experts)
        if len(experts) != num_experts:
            raise ValueError(
                f"{op}: expected `experts` to hold num_experts (= {num_experts}) Modules; got "
                f"{len(experts)}."
            )
        for i, e in enumerate(experts):
            if not isinstance(e, nn.Module):
                raise TypeError(
                    f"{op}: expected every expert to be a torch.nn.Module; got "
                    f"{type(e).__name__} at index {i}."
                )
        super().__init__()
        self.d_model: int = d_model
        self.num_experts: int = num_experts
        self.k: int = k
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.router: TopKRouter = router
        self.experts: nn.ModuleList = nn.ModuleList(experts)

    def capacity(self, tokens: int) -> int | None:
        """The most tokens an expert takes in a call on ``tokens`` tokens (None: no limit)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.k * tokens / self.num_experts)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        """Route the tokens ``x`` (*, d_model) and combine their experts' outputs (an expert must
        keep its input's shape); returns a :class:`MoEOutput`."""
        routed = self.router(x)
        flat = x.reshape(-1, self.d_model)
        T = flat.shape[0]
        weights = routed.weights.reshape(T, self.num_experts)
        if self.router.hard:  # the k selected experts, by preference
            ranked = routed.indices.reshape(T, self.k)
        else:  # every expert, by weight (those with weight 0 are left out below)
            ranked = weights.detach().argsort(dim=-1, descending=True, stable=True)
        m = ranked.shape[1]
        # one assignment per (preference, token): preference-major, so that a stable sort by
        # expert keeps first choices before second ones, each in token order
        expert = ranked.t().reshape(-1)
        token = torch.arange(T, device=x.device).repeat(m)
        w = weights.gather(1, ranked).t().reshape(-1)
        if not self.router.hard:
            keep = w != 0
            expert, token, w = expert[keep], token[keep], w[keep]
        assigned = expert.numel()
        expert, order = expert.sort(stable=True)
        token, w = token[order], w[order]
        counts = torch.bincount(expert, minlength=self.num_experts)
        cap = self.capacity(T)
        if cap is not None:  # the first `cap` assignments of each expert
            start = counts.cumsum(0) - counts
            keep = torch.arange(expert.numel(), device=x.device) - start[expert] < cap
            expert, token, w = expert[keep], token[keep], w[keep]
            counts = counts.clamp(max=cap)
        fraction = (assigned - expert.numel()) / max(assigned, 1)
        dropped = torch.tensor(fraction, dtype=x.dtype, device=x.device)
        parts = []
        offset = 0
        for e, n in enumerate(counts.tolist()):  # a host sync: the experts' batch sizes
            if n == 0:
                continue
            y = self.experts[e](flat[token[offset : offset + n]])
            if y.shape != (n, self.d_model):
                raise ValueError(
                    f"{type(self).__name__}: expected expert {e} to return shape ({n}, "
                    f"{self.d_model}) for its input of shape ({n}, {self.d_model}); got shape "
                    f"{tuple(y.shape)}."
                )
            parts.append(y * w[offset : offset + n, None].to(y.dtype))
            offset += n
        out = flat.new_zeros(T, self.d_model)
        if parts:  # one scatter-add of every weighted output back to its token
            out = out.index_add(0, token, torch.cat(parts).to(out.dtype))
        return MoEOutput(out.reshape(x.shape), routed.aux_loss, routed.z_loss, dropped, routed)
