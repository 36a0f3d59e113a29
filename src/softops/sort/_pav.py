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

Only the projection step has a custom autograd ``Function`` (the compiled kernel cannot be
traced). It returns :math:`P(z, w) = z - v` itself, formed block by block relative to each block's
first entry, never as the difference of two large numbers: a rank at tiny epsilon (|z| ~ 1e16) or a
sort at huge epsilon stays exact (``softops._core.isotonic.project_l2``). Its VJP is explicit: in
z, the cotangent minus its block mean (L2) or minus the block softmax of z times the block sum
(KL); in w, the block mean (L2) or the block softmax of w times the block sum (KL). Its JVP
(forward mode: ``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) applies the same
Jacobian to the tangent: the L2 block mean is symmetric, so dp = ds - mean_B(ds) + mean_B(dw);
the KL Jacobian, :math:`I - 1\,\mathrm{softmax}(s_B)^\top` in s and
:math:`1\,\mathrm{softmax}(w_B)^\top` in w, is not, so
dp = ds - <softmax(s_B), ds_B> + <softmax(w_B), dw_B>, broadcast over the block. Sorting,
scaling and un-permuting are plain autograd, so gradients in ``epsilon`` and second derivatives
come for free. On meta tensors the projection returns its shapes only (``project_l2``).

Reference: Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
ICML 2020. arXiv:2002.08871.
"""

from __future__ import annotations

from typing import Any

import torch

from softops._core.isotonic import block_mean, block_softmax, block_sum, project_kl, project_l2
from softops._core.transforms import under_functorch
from softops.sort._options import MethodOptions

__all__ = ["rank", "sort"]


def _vmap_rows(
    fn: Any, info: Any, in_dims: tuple[Any, ...], s: torch.Tensor, w: torch.Tensor
) -> tuple[Any, Any]:
    """Rows are independent: broadcast the per-sample shapes, put the vmapped dim first and fold
    it into the batch of rows."""
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
    p, block = fn.apply(s.reshape(-1, shape[-1]), w.reshape(-1, shape[-1]))
    return (p.reshape(shape), block.reshape(shape)), (0, 0)


def _like(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A (B, n) gradient summed down to w's rows ((B, n) or (1, n))."""
    return g.sum(0, keepdim=True) if w.shape[0] != g.shape[0] else g


class _ProjectL2(torch.autograd.Function):
    """p = P_Q(s, w) = s - v_Q(s, w) per row of s (B, n), w (B or 1, n); returns (p, block)."""

    @staticmethod
    def forward(s: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        res = project_l2(s, w)
        return res.p, res.block

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, w = inputs
        _, block = output
        ctx.mark_non_differentiable(block)
        ctx.save_for_backward(block)
        ctx.save_for_forward(block)
        ctx.w_rows = w.shape[0]

    @staticmethod
    def backward(ctx: Any, gp: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        # dp/ds = I - J, dp/dw = J, with J the block mean (docs/math.md §5)
        (block,) = ctx.saved_tensors
        mean = block_mean(gp, block)
        gs = gp - mean if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = mean.sum(0, keepdim=True) if ctx.w_rows != gp.shape[0] else mean
        return gs, gw

    @staticmethod
    def jvp(ctx: Any, ds: torch.Tensor | None, dw: torch.Tensor | None) -> tuple[Any, None]:
        # J is symmetric, so the tangent map is the VJP's: dp = ds - J ds + J dw
        (block,) = ctx.saved_tensors
        dp = torch.zeros((), dtype=_tangent_dtype(ds, dw), device=block.device)
        if ds is not None:
            dp = ds - block_mean(ds, block)
        if dw is not None:
            dp = dp + block_mean(dw.expand(block.shape), block)
        return dp.expand(block.shape), None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], s: torch.Tensor, w: torch.Tensor
    ) -> tuple[Any, Any]:
        return _vmap_rows(_ProjectL2, info, in_dims, s, w)


class _ProjectKL(torch.autograd.Function):
    """p = P_E(s, w) = s - v_E(s, w), v_B = logsumexp(s_B) - logsumexp(w_B); returns (p, block)."""

    @staticmethod
    def forward(s: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        res = project_kl(s, w)
        return res.p, res.block

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        s, w = inputs
        _, block = output
        ctx.mark_non_differentiable(block)
        ctx.save_for_backward(s, w, block)
        ctx.save_for_forward(s, w, block)

    @staticmethod
    def backward(ctx: Any, gp: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        # dp/ds = I - 1 softmax(s_B)^T, dp/dw = 1 softmax(w_B)^T on each block
        s, w, block = ctx.saved_tensors
        total = block_sum(gp, block)
        gs = gp - block_softmax(s, block) * total if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = _like(block_softmax(w.expand_as(gp), block) * total, w)
        return gs, gw

    @staticmethod
    def jvp(ctx: Any, ds: torch.Tensor | None, dw: torch.Tensor | None) -> tuple[Any, None]:
        # The same Jacobian from the other side (it is not symmetric): on each block,
        # dp = ds - 1 <softmax(s_B), ds_B> + 1 <softmax(w_B), dw_B>
        s, w, block = ctx.saved_tensors
        dp = torch.zeros((), dtype=_tangent_dtype(ds, dw), device=block.device)
        if ds is not None:
            dp = ds - block_sum(block_softmax(s.expand(block.shape), block) * ds, block)
        if dw is not None:
            soft_w = block_softmax(w.expand(block.shape), block)
            dp = dp + block_sum(soft_w * dw.expand(block.shape), block)
        return dp.expand(block.shape), None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], s: torch.Tensor, w: torch.Tensor
    ) -> tuple[Any, Any]:
        return _vmap_rows(_ProjectKL, info, in_dims, s, w)


def _tangent_dtype(*tangents: torch.Tensor | None) -> torch.dtype:
    return next(t.dtype for t in tangents if t is not None)


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
        r, block = _ProjectL2.apply(s, rho[None])
    else:
        p, block = _ProjectKL.apply(s, rho.log()[None])
        r = torch.exp(p)
    # An infinite entry sits in a block of equal infinities; its limit is that block's mean of rho
    # (the formula gives inf - inf). Checked once per call, not in a loop; under torch.func
    # (no data to branch on under vmap) and on meta tensors the masked form always runs.
    if s.is_meta or under_functorch() or not bool(torch.isfinite(s).all()):
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
    # rho / eps, saturated so that the largest entry stays below a quarter of the dtype's range:
    # at an epsilon that small the sort is already at its hard limit (every gap of the scores is
    # far below 1/epsilon), and rho / eps would otherwise overflow to inf (inf - inf = NaN).
    inv = (1 / eps).clamp(max=torch.finfo(x2.dtype).max / (4 * x2.shape[-1]))
    a = _rho(x2) * inv[:, None]
    project = _ProjectL2 if regularization == "l2" else _ProjectKL
    p, _ = project.apply(a, theta)  # a - v, formed without v
    out = _nan_rows(x2, p if descending else 0.0 - p)  # 0 - p: a zero stays +0, not -0
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
