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

One custom autograd ``Function``, ``_Permutahedron``, computes :math:`P(z, w)` for z in any
order and w in any order (the permutahedron of w does not depend on its order): the sorts that
the reduction needs, the isotonic step (a compiled kernel, which cannot be traced), the un-sort
and the limits at non-finite entries, in one autograd node. Only the scaling by epsilon is plain
autograd around it, so gradients in ``epsilon`` come for free. It returns
:math:`P(z, w) = z - v` itself, formed block by block relative to each block's first entry, never
as the difference of two large numbers: a rank at tiny epsilon (|z| ~ 1e16) or a sort at huge
epsilon stays exact (``softops._core.isotonic.project_l2``).

Its VJP is explicit, in sorted coordinates: in z, the cotangent minus its block mean (L2) or minus
the block softmax of z times the block sum (KL); in w, the block mean (L2) or the block softmax of
w times the block sum (KL); each is then un-sorted. Its JVP (forward mode: ``torch.func.jvp``,
``jacfwd``, ``torch.autograd.forward_ad``) applies the same Jacobian to the tangent: the L2 block
mean is symmetric, so dp = ds - mean_B(ds) + mean_B(dw); the KL Jacobian,
:math:`I - 1\,\mathrm{softmax}(s_B)^\top` in s and :math:`1\,\mathrm{softmax}(w_B)^\top` in w,
is not, so dp = ds - <softmax(s_B), ds_B> + <softmax(w_B), dw_B>, broadcast over the block. Both
are written in differentiable torch ops of the cotangent and of the saved inputs (the block
softmaxes are recomputed from z and w), so second derivatives are exact too (zero a.e. for L2).

The ascending sort, -P(rho/epsilon, -x), takes its two negations inside the node too
(``_Mode.negate``). Outside torch.func, ``_apply`` skips the per-call signature binding of
``Function.apply``; with numba in use and a gradient that is not itself differentiated, the L2
VJP is one compiled pass over each row (``softops._core.isotonic.l2_vjp_host``) instead of about
ten small torch ops. These fixed costs, not the O(n log n) work, set the time of a small call.

Limits (applied inside the node, and only when the kernel reports a non-finite row): a NaN anywhere
in a row of z or w makes the row NaN; for L2, a row of w holding both +inf and -inf is NaN (the
projection keeps the sum of w, inf - inf); an infinite entry of z sits in a block of equal
infinities, whose limit is the block's mean of w (L2) or its log-mean-exp (KL), where the formula
gives inf - inf. These entries get a zero derivative. On meta tensors the node gives shapes only.

Reference: Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
ICML 2020. arXiv:2002.08871.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from softops._core.isotonic import (
    block_mean,
    block_softmax,
    block_sum,
    l2_vjp_host,
    project_kl,
    project_l2,
)
from softops.sort._options import MethodOptions

__all__ = ["rank", "sort"]

Tensor = torch.Tensor


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, minus the signature binding that ``Function.apply`` runs on every call
    (``inspect.signature``: about a fifth of a small soft_rank) to fill in defaults, which these
    Functions do not have. Under torch.func transforms and torch.compile (which trace
    ``Function.apply`` itself) it is ``fn.apply``."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return super(torch.autograd.Function, fn).apply(*args)  # type: ignore[misc]


def _gather(t: Tensor, perm: Tensor | None) -> Tensor:
    """t in sorted order (perm None: t is sorted already; perm may be one row for all)."""
    if perm is None:
        return t
    return t.gather(1, perm if perm.shape[0] == t.shape[0] else perm.expand(t.shape[0], -1))


def _scatter(t: Tensor, perm: Tensor | None) -> Tensor:
    """t, sorted by perm, back in the original order."""
    if perm is None:
        return t
    return torch.empty_like(t).scatter(1, perm if perm.shape == t.shape else perm.expand_as(t), t)


def _rows_like(g: Tensor, rows: int) -> Tensor:
    """A (B, n) gradient summed down to ``rows`` rows (B, or 1: one row of w for every row)."""
    return g.sum(0, keepdim=True) if rows != g.shape[0] else g


def _limits(
    s: Tensor, t: Tensor, p: Tensor, block: Tensor, kl: bool, exp_space: bool
) -> tuple[Tensor, Tensor | None]:
    """p (sorted coordinates) with the projection's limits at non-finite entries (module
    docstring), and the mask of the entries they replaced. Only called when some row of s or
    t is not finite (the kernel says so), or on meta tensors."""
    bad = torch.isnan(s).any(-1, keepdim=True) | torch.isnan(t).any(-1, keepdim=True)
    if not kl:
        mixed = (t == torch.inf).any(-1, keepdim=True) & (t == -torch.inf).any(-1, keepdim=True)
        bad = bad | mixed
    inf = torch.isinf(s)
    tt = t.expand_as(s)
    if kl and not exp_space:  # log mean exp of w over the block, shifted by its largest entry
        top = torch.where(torch.isfinite(tt), tt, -torch.inf).amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
        limit = torch.log(block_mean(torch.exp(tt - top), block)) + top
    else:
        limit = block_mean(tt, block)
    p = torch.where(inf, limit, p).masked_fill_(bad, torch.nan)
    return p, inf | bad


@dataclass(frozen=True)
class _Mode:
    """What ``_Permutahedron`` computes (module docstring).

    Attributes:
        kl: the KL projection P_E (else the Euclidean P_Q).
        sort_z: z must still be sorted here (False: the caller passes it sorted descending, as
            rho / epsilon is).
        sort_w: w must still be sorted here.
        exp_space: with ``kl``, the KL rank: w holds positive weights and the result is
            exp P_E(z, log w), whose limit at an infinite z is the block mean of w itself (exact,
            as for L2).
        negate: the result is -P(z, -w) (the ascending sort), formed as ``0 - p`` so that a zero
            stays +0.
    """

    kl: bool
    sort_z: bool
    sort_w: bool
    exp_space: bool = False
    negate: bool = False


class _Permutahedron(torch.autograd.Function):
    """p = P(z, w) per row: the projection of z onto the permutahedron of w (``_Mode`` says which
    projection and which of z and w to sort), in z's order. z is (B, n), w (B or 1, n).

    Returns (p, perm_z, perm_w, block, frozen): the permutations (None where not sorted here),
    the block ids in sorted coordinates and the entries set to a limit (None when none is), all
    non-differentiable.
    """

    @staticmethod
    def forward(
        z: Tensor, w: Tensor, mode: _Mode
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor | None]:
        if mode.negate:
            w = -w
        s, pz = torch.sort(z, dim=-1, descending=True) if mode.sort_z else (z, None)
        t, pw = torch.sort(w, dim=-1, descending=True) if mode.sort_w else (w, None)
        if mode.kl:
            res = project_kl(s, t.log() if mode.exp_space else t)
        else:
            res = project_l2(s, t)
        p, frozen = res.p.exp_() if mode.exp_space else res.p, None
        if not res.finite:
            p, frozen = _limits(s, t, p, res.block, mode.kl, mode.exp_space)
        if mode.negate:
            p = torch.rsub(p, 0.0)
        return _scatter(p, pz), pz, pw, res.block, frozen

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        z, w, mode = inputs
        out, pz, pw, block, frozen = output
        ctx.mark_non_differentiable(*(o for o in output[1:] if o is not None))
        # z and w only where the Jacobian depends on them (KL: the block softmaxes), the output
        # only in exp space (d exp(p) = exp(p) dp)
        saved = (z, w) if mode.kl else (None, None)
        saved += (pz, pw, block, frozen, out if mode.exp_space else None)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.mode, ctx.w_rows = mode, w.shape[0]

    @staticmethod
    def backward(ctx: Any, gp: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        z, w, pz, pw, block, frozen, out = ctx.saved_tensors
        mode: _Mode = ctx.mode
        want_z, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sign = -1.0 if mode.negate else 1.0  # p = -P(z, -w): dp/dz = -P_z, dp/dw = P_w
        if (
            not mode.kl
            and frozen is None
            and not (want_w and ctx.w_rows != gp.shape[0])
            and not torch.is_grad_enabled()  # (create_graph: the torch form below)
            and not torch._C._are_functorch_transforms_active()
        ):
            fused = l2_vjp_host(gp, pz, pw, block, want_z, want_w)
            if fused is not None:  # the same formulas in one compiled pass over each row
                gz, gw = fused
                if mode.negate and gz is not None:
                    gz = gz.neg_()
                return gz, gw, None
        if mode.negate:
            gp = -gp
        gs = _gather(gp if out is None else gp * out, pz)
        if frozen is not None:  # also where the output is NaN: no NaN * 0 from the frozen rows
            gs = gs.masked_fill(frozen, 0.0)
        if mode.kl:  # dp/ds = I - 1 softmax(s_B)^T, dp/dw = 1 softmax(w_B)^T on each block
            total = block_sum(gs, block)
            gs_z = gs - block_softmax(_gather(z, pz), block) * total
            t = _gather(sign * w, pw).expand_as(gs)
            if out is None:
                gs_w = block_softmax(t, block) * total
            else:  # in w = e^(log w): softmax(log w_B) / w = 1 / sum(w_B)
                gs_w = total / block_sum(t, block)
            if frozen is not None:  # the softmax of a NaN row is NaN even where gs is 0
                gs_z, gs_w = gs_z.masked_fill(frozen, 0.0), gs_w.masked_fill(frozen, 0.0)
        else:  # dp/ds = I - J, dp/dw = J, with J the block mean (docs/math.md §5)
            gs_w = block_mean(gs, block)
            gs_z = gs - gs_w
        gz = _scatter(gs_z, pz) if want_z else None
        gw = _scatter(_rows_like(gs_w, ctx.w_rows), pw) if want_w else None
        if mode.negate and gw is not None:  # through w -> -w
            gw = -gw
        return gz, gw, None

    @staticmethod
    def jvp(ctx: Any, dz: Tensor | None, dw: Tensor | None, _: Any) -> tuple[Any, ...]:
        # The same Jacobian from the other side (for KL it is not symmetric).
        z, w, pz, pw, block, frozen, out = ctx.saved_tensors
        mode: _Mode = ctx.mode
        sign = -1.0 if mode.negate else 1.0
        rows = block.shape
        terms = []
        if dz is not None:
            ds = _gather(dz, pz)
            if mode.kl:
                terms.append(ds - block_sum(block_softmax(_gather(z, pz), block) * ds, block))
            else:
                terms.append(ds - block_mean(ds, block))
        if dw is not None:
            dt = _gather(sign * dw, pw).expand(rows)
            if not mode.kl:
                terms.append(block_mean(dt, block))
            else:
                t = _gather(sign * w, pw).expand(rows)
                if out is None:
                    terms.append(block_sum(block_softmax(t, block) * dt, block))
                else:  # exp space: d log w = dw / w
                    terms.append(block_sum(dt, block) / block_sum(t, block))
        dp = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        if out is not None:
            dp = dp * _gather(out, pz)
        if frozen is not None:
            dp = dp.masked_fill(frozen, 0.0)
        return _scatter(sign * dp, pz), None, None, None, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], z: Tensor, w: Tensor, mode: _Mode
    ) -> tuple[Any, Any]:
        # Rows are independent: broadcast the per-sample shapes, put the vmapped dim first and
        # fold it into the rows (w's single row, if any, is repeated for every row).
        moved = [
            t.movedim(d, 0) if d is not None else t.unsqueeze(0)
            for t, d in zip((z, w), in_dims[:2], strict=True)
        ]
        sample = torch.broadcast_shapes(*(t.shape[1:] for t in moved))
        shape = (info.batch_size, *sample)
        z, w = (
            t.reshape(t.shape[0], *[1] * (len(sample) + 1 - t.dim()), *t.shape[1:]).expand(shape)
            for t in moved
        )
        n = shape[-1]
        out = _Permutahedron.apply(z.reshape(-1, n), w.reshape(-1, n), mode)
        return (
            tuple(None if o is None else o.reshape(shape) for o in out),
            tuple(None if o is None else 0 for o in out),
        )


_RANK_L2 = _Mode(kl=False, sort_z=True, sort_w=False)
_RANK_KL = _Mode(kl=True, sort_z=True, sort_w=False, exp_space=True)  # exp P_E(z, log rho)
_SORT = {  # (kl, ascending)
    (kl, up): _Mode(kl, sort_z=False, sort_w=True, negate=up)
    for kl in (False, True)
    for up in (False, True)
}


def _rho(x2: Tensor) -> Tensor:
    n = x2.shape[-1]
    return torch.arange(n, 0, -1, dtype=x2.dtype, device=x2.device)


def rank(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    """Soft ranks (1-based; ascending unless ``descending``) of each row of x2 (B, n).

    ``opts.regularization`` is "l2" or "kl". ``offset`` must be None: PAV takes infinities to the
    projection's own limits, so no position shift is ever asked of it.
    """
    if offset is not None:
        raise ValueError("pav rank: expected `offset` to be None (PAV has its own limits).")
    kl = opts.regularization == "kl"
    z = x2 / (-eps if descending else eps)[:, None]
    rho = _rho(x2)[None]
    return _apply(_Permutahedron, z, rho, _RANK_KL if kl else _RANK_L2)[0]


def sort(
    x2: Tensor,
    eps: Tensor,
    descending: bool,
    opts: MethodOptions,
    offset: Tensor | None = None,
) -> Tensor:
    """Soft sorted values (ascending unless ``descending``) of each row of x2 (B, n).

    ``opts.regularization`` is "l2" or "kl"; ``offset`` is unused (the one backend signature).
    """
    # rho / eps, saturated so that the largest entry stays below a quarter of the dtype's range:
    # at an epsilon that small the sort is already at its hard limit (every gap of the scores is
    # far below 1/epsilon), and rho / eps would otherwise overflow to inf (inf - inf = NaN).
    inv = eps.reciprocal().clamp(max=torch.finfo(x2.dtype).max / (4 * x2.shape[-1]))
    a = _rho(x2) * inv[:, None]
    # descending: P(a, x); ascending: -P(a, -x), the descending sort of -x, negated
    return _apply(_Permutahedron, a, x2, _SORT[opts.regularization == "kl", not descending])[0]
