r"""Fast soft sort and rank by projection onto the permutahedron (Blondel et al. 2020).

With :math:`\rho = (n, \dots, 1)`, :math:`P_Q(z, w)` the Euclidean projection of z onto the
permutahedron of w (the convex hull of the permutations of w) and :math:`P_E` its KL analogue
(Blondel et al. 2020, §4):

.. math::

    \mathrm{rank}(\theta) = P_Q(\theta/\varepsilon, \rho), \qquad
    \mathrm{sort}_\downarrow(\theta) = P_Q(\rho/\varepsilon, \theta), \qquad
    \mathrm{rank}_{KL}(\theta) = \exp P_E(\theta/\varepsilon, \log\rho), \qquad
    \mathrm{sort}_{\downarrow, KL}(\theta) = P_E(\rho/\varepsilon, \theta).

Each projection reduces to isotonic regression on sorted coordinates (Blondel et al. 2020, §5):
:math:`P(z, w) = z - v(z_\sigma, w)_{\sigma^{-1}}`, with :math:`\sigma` the permutation that
sorts z in descending order and v solved by PAV (``softops._core.isotonic``).

Conventions (deviations from the paper's notation): ranks are ascending, so rank 1 is the
smallest and rank n the largest, and ``soft_sort`` is ascending; ``descending=True`` applies the
same maps to ``-x``. Both equal torchsort's ``soft_rank`` / ``soft_sort`` with
``regularization_strength = epsilon``. The weights are :math:`\rho/\varepsilon`, as derived, not
``arange(n)[::-1] + 1/epsilon`` (an operator-precedence slip in the reference numpy code that
makes its sort ignore epsilon).

Only the isotonic step has a custom autograd ``Function`` (the compiled kernel cannot be traced);
its VJP is explicit: the block mean of the incoming gradient for L2, the block softmax of the
inputs times the block sum of the gradient for KL. Sorting, scaling and un-permuting are plain
autograd, so gradients in ``epsilon`` and second derivatives come for free.

Reference: Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
ICML 2020. arXiv:2002.08871.
"""

from __future__ import annotations

from typing import Any

import torch

from softops._core.isotonic import block_mean, block_softmax, block_sum, isotonic_kl, isotonic_l2
from softops.sort._options import MethodOptions

__all__ = ["rank", "sort"]


class _IsotonicL2(torch.autograd.Function):
    """v = argmin_{v decreasing} ||v - y||^2 / 2 per row of y (B, n); returns (v, block)."""

    @staticmethod
    def forward(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        res = isotonic_l2(y)
        return res.v, res.block

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, block = output
        ctx.mark_non_differentiable(block)
        ctx.save_for_backward(block)

    @staticmethod
    def backward(ctx: Any, gv: torch.Tensor, _: Any) -> torch.Tensor:
        (block,) = ctx.saved_tensors
        return block_mean(gv, block)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], y: torch.Tensor) -> tuple[Any, Any]:
        # rows are independent: fold the vmapped dim into the batch of rows
        y = y.movedim(in_dims[0], 0)
        v, block = _IsotonicL2.apply(y.reshape(-1, y.shape[-1]))
        return (v.reshape(y.shape), block.reshape(y.shape)), (0, 0)


class _IsotonicKL(torch.autograd.Function):
    """v_B = logsumexp(s_B) - logsumexp(w_B) on PAV's blocks, per row; returns (v, block)."""

    @staticmethod
    def forward(s: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        res = isotonic_kl(s, w)
        return res.v, res.block

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        s, w = inputs
        _, block = output
        ctx.mark_non_differentiable(block)
        ctx.save_for_backward(s, w, block)

    @staticmethod
    def backward(ctx: Any, gv: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        s, w, block = ctx.saved_tensors
        total = block_sum(gv, block)
        gs = block_softmax(s, block) * total if ctx.needs_input_grad[0] else None
        gw = -block_softmax(w.expand_as(s), block) * total if ctx.needs_input_grad[1] else None
        return gs, gw

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], s: torch.Tensor, w: torch.Tensor
    ) -> tuple[Any, Any]:
        # Broadcast the per-sample shapes, put the vmapped dim first, and fold it into the rows.
        moved = [
            t.movedim(d, 0) if d is not None else t.unsqueeze(0)
            for t, d in zip((s, w), in_dims, strict=True)
        ]
        sample = torch.broadcast_shapes(*(t.shape[1:] for t in moved))
        shape = (info.batch_size, *sample)
        s, w = (
            t.reshape(t.shape[0], *[1] * (len(sample) + 1 - t.dim()), *t.shape[1:]).expand(shape)
            for t in moved
        )
        v, block = _IsotonicKL.apply(s.reshape(-1, shape[-1]), w.reshape(-1, shape[-1]))
        return (v.reshape(shape), block.reshape(shape)), (0, 0)


def _rho(x2: torch.Tensor) -> torch.Tensor:
    n = x2.shape[-1]
    return torch.arange(n, 0, -1, dtype=x2.dtype, device=x2.device)


def rank(
    x2: torch.Tensor,
    eps: torch.Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Soft ranks (1-based; ascending unless ``descending``) of each row of x2 (B, n).

    ``opts.regularization`` is "l2" or "kl". ``offset`` must be None: PAV takes infinities to the
    projection's own limits, so no position shift is ever asked of it.
    """
    if offset is not None:
        raise ValueError("pav rank: expected `offset` to be None (PAV has its own limits).")
    regularization = opts.regularization
    z = x2 / eps[:, None]
    if descending:
        z = -z
    s, perm = torch.sort(z, dim=-1, descending=True)
    rho = _rho(x2)
    if regularization == "l2":
        v, block = _IsotonicL2.apply(s - rho)
        r = s - v
    else:
        v, block = _IsotonicKL.apply(s, rho.log())
        r = torch.exp(s - v)
    # An infinite entry sits in a block of equal infinities; its limit is that block's mean of rho
    # (the formula gives inf - inf). Checked once per call, not in a loop.
    try:
        finite = bool(torch.isfinite(s).all())
    except RuntimeError:  # under torch.func.vmap: no data-dependent branch, take the safe one
        finite = False
    if not finite:
        r = torch.where(torch.isinf(s), block_mean(rho.expand_as(s), block), r)
    out = torch.empty_like(r).scatter(1, perm, r)
    return _nan_rows(x2, out)


def sort(
    x2: torch.Tensor,
    eps: torch.Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Soft sorted values (ascending unless ``descending``) of each row of x2 (B, n).

    ``opts.regularization`` is "l2" or "kl"; ``offset`` is unused (the one backend signature).
    """
    regularization = opts.regularization
    theta = torch.sort(x2 if descending else -x2, dim=-1, descending=True).values
    a = _rho(x2) / eps[:, None]
    if regularization == "l2":
        v, _ = _IsotonicL2.apply(a - theta)
    else:
        v, _ = _IsotonicKL.apply(a, theta)
    out = _nan_rows(x2, a - v if descending else v - a)
    if regularization == "l2":
        # The l2 sort keeps the row's mean: with both +inf and -inf the limit depends on their
        # rates, so the whole row is NaN (not only the positions where inf - inf appeared).
        mixed = (x2 == torch.inf).any(-1, keepdim=True) & (x2 == -torch.inf).any(-1, keepdim=True)
        out = torch.where(mixed, torch.full_like(out, torch.nan), out)
    return out


def _nan_rows(x2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A NaN anywhere in a row makes that whole row NaN (and leaves the other rows alone)."""
    nan_row = torch.isnan(x2).any(-1, keepdim=True)
    return torch.where(nan_row, torch.full_like(out, torch.nan), out)
