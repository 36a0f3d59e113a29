r"""Fast soft sort and rank by projection onto the permutahedron (Blondel et al. 2020).

With :math:`\rho = (n, \dots, 1)` and :math:`P_Q(z, w)` / :math:`P_E(z, w)` the Euclidean / KL
projection of z onto the permutahedron of w (Blondel et al. 2020, §4; docs/math.md §5):

.. math::

    \mathrm{rank}(\theta) = P_Q(\theta/\varepsilon, \rho), \qquad
    \mathrm{sort}_\downarrow(\theta) = P_Q(\rho/\varepsilon, \theta), \qquad
    \mathrm{rank}_{KL}(\theta) = \exp P_E(\theta/\varepsilon, \log\rho), \qquad
    \mathrm{sort}_{\downarrow, KL}(\theta) = P_E(\rho/\varepsilon, \theta),

each reduced to PAV isotonic regression on sorted coordinates (``softops._core.isotonic``).
Conventions: ranks ascending (rank n is the largest), ``soft_sort`` ascending, ``descending=True``
the same maps on ``-x``; epsilon is torchsort's ``regularization_strength``, and the weights are
:math:`\rho/\varepsilon` as derived (not the reference numpy code's ``arange(n)[::-1] +
1/epsilon``, a precedence slip that makes its sort ignore epsilon).

One autograd ``Function``, ``_Permutahedron``, computes :math:`P(z, w)` with the scaling, the sorts,
the isotonic step, the un-sort and the limits in one node (one operator, one kernel pass per row on
the CPU: ``softops._core.isotonic.permutahedron``). Contract:

- exact at every scale: P is formed block by block relative to each block's first entry, and z
  (``x / eps`` or ``rho / eps``) is never formed: PAV runs on its gaps, in double (gaps wider than
  the span of w, which no block crosses, cut to a bound; a block's span of z is at most the span
  of w, and rows of huge magnitude are solved scaled by a power of two), so nothing overflows:
  ranks stay in [1, n] with the sum n(n+1)/2, and a sort or rank at an epsilon below every gap is
  the hard one, bit for bit, at any span of x (docs/math.md §5; KD22, KD24, KD25).
- limits at non-finite entries (reported by the kernel, so that the node marks them only then):
  a NaN makes its row NaN; for L2 a row of w holding +inf and -inf is NaN and one infinity in w
  pulls the row to it; an infinite z sits in a block of equal infinities whose value is the
  block's mean of w (L2) or its log-mean-exp (KL). Those entries get a zero derivative.
- derivatives: the VJP and JVP are explicit in sorted coordinates (L2: the cotangent minus its
  block mean in z, the block mean in w; KL: the block softmaxes of z and w), written in
  differentiable torch ops, so second derivatives are exact (zero a.e. for L2). The derivative
  in epsilon is :math:`-\langle J_z^\top \bar p, z - z_{\mathrm{ref}}\rangle / \varepsilon` with
  :math:`z_{\mathrm{ref}}` each block's first entry (``_sorted_rel``): small block-relative
  differences, one division, finite wherever the derivative is (docs/math.md §5).

Fast paths: a plain eager CPU call runs the kernel directly (``_PermutahedronEager``, the same
saved tensors and backward); an L2 gradient that is not itself differentiated is one compiled
pass (``softops._core.isotonic.l2_vjp_host_scaled``); ``torch.compile`` takes
``_PermutahedronTraced``; ``torch.func.vmap`` folds the vmapped dim into the rows. Meta tensors
get shapes only.

Reference: Blondel, Teboul, Berthet and Djolonga. Fast Differentiable Sorting and Ranking.
ICML 2020. arXiv:2002.08871.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.autograd import forward_ad

from softops._core.isotonic import (
    MODE_EXP,
    MODE_FLIP,
    MODE_INV,
    MODE_KL,
    MODE_NEGATE,
    MODE_SORT_W,
    MODE_SORT_Z,
    block_mean,
    block_softmax,
    block_sum,
    eager_ops,
    l2_vjp_host_scaled,
    permutahedron,
    scale_factor,
)
from softops._core.transforms import apply_function
from softops._kernels import plain_eager
from softops.sort._options import MethodOptions

__all__ = ["rank", "sort"]

Tensor = torch.Tensor


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


def _frozen(s: Tensor, t: Tensor, kl: bool) -> Tensor:
    """The entries whose derivatives are zero (module docstring): the infinite entries of s
    (sorted), at the projection's limit, and every entry of a NaN row (for L2 also of a row of t
    holding both +inf and -inf). Called only where the kernel met a non-finite row, or where that
    is not known (traced code, meta tensors)."""
    bad = torch.isnan(s).any(-1, keepdim=True) | torch.isnan(t).any(-1, keepdim=True)
    if not kl:
        mixed = (t == torch.inf).any(-1, keepdim=True) & (t == -torch.inf).any(-1, keepdim=True)
        bad = bad | mixed
    return torch.isinf(s) | bad


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
        inv: z is ``u * (1/eps)`` (the sort: u = rho), else ``u / eps`` (the rank); the kernel
            forms both in the same frame (module docstring), never beyond the dtype.
        flip: z is ``u / -eps`` (the descending rank).
    """

    kl: bool
    sort_z: bool
    sort_w: bool
    exp_space: bool = False
    negate: bool = False
    inv: bool = False
    flip: bool = False

    @property
    def bits(self) -> int:
        """The mode of :func:`softops._core.isotonic.permutahedron`."""
        return (
            MODE_KL * self.kl
            | MODE_SORT_Z * self.sort_z
            | MODE_SORT_W * self.sort_w
            | MODE_EXP * self.exp_space
            | MODE_NEGATE * self.negate
            | MODE_INV * self.inv
            | MODE_FLIP * self.flip
        )


def _factor(eps: Tensor, n: int, mode: _Mode) -> Tensor:
    """(B, 1): f with z = u * f (the sort, ``mode.inv``) or z = u / f (the rank), as the
    projection's operator forms it (:func:`softops._core.isotonic.scale_factor`)."""
    return scale_factor(eps, n, mode.bits).unsqueeze(1)


def _through(u: Tensor, f: Tensor, mode: _Mode) -> Tensor:
    """z (B, n) from u (B or 1, n) and the factor f (B, 1) of ``_factor``."""
    return u * f if mode.inv else u / f


def _sorted_rel(
    u: Tensor, f: Tensor, pz: Tensor | None, block: Tensor, frozen: Tensor | None, mode: _Mode
) -> Tensor:
    """z - z_ref in sorted coordinates (B, n), z_ref the first entry of each block, for the
    derivative in epsilon and the KL Jacobian: J_z z = J_z (z - z_ref), taken on these small
    differences of u, then scaled, so that it is finite wherever the blocks are (docs/math.md §5).
    0 where frozen, masked in u before the scaling (no 0 * inf in the second derivative); u_ref
    is detached (its derivative multiplies the block sum of dL/dz, which is 0)."""
    us = _gather(u.expand(f.shape[0], -1), pz)
    if frozen is not None:
        us = us.masked_fill(frozen, 0.0)
    n = us.shape[-1]
    positions = torch.arange(n, device=us.device).expand_as(block)
    first = torch.full_like(block, n).scatter_reduce(1, block, positions, "amin").gather(1, block)
    return _through(us - us.detach().gather(1, first), f, mode)


def _limits(
    u: Tensor, w: Tensor, eps: Tensor, pz: Tensor | None, pw: Tensor | None, mode: _Mode
) -> Tensor:
    """The entries where the kernel gave the projection's limits, whose derivatives are zero
    (``_frozen``), for a forward that met a non-finite row."""
    n = u.shape[-1]  # (z = u / f or u * f is infinite or NaN where u is: f > 0 finite; z
    # itself may be beyond the dtype, where u is not, and is never formed)
    us = u.expand(eps.shape[0], n)
    t = (-w if mode.negate else w).expand(eps.shape[0], n)
    return _frozen(_gather(us, pz), _gather(t, pw), mode.kl)


def _save(
    ctx: Any,
    u: Tensor,
    w: Tensor,
    eps: Tensor,
    mode: _Mode,
    out: Tensor,
    pz: Tensor | None,
    pw: Tensor | None,
    block: Tensor,
    frozen: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """What the backward reads, saved on ctx (and returned): u and eps (z is recomputed where
    needed: KL, epsilon), w only where the Jacobian depends on it (KL: the block softmaxes), the
    output only in exp space (d exp(p) = exp(p) dp)."""
    saved = (u, w if mode.kl else None, eps, pz, pw, block, frozen, out if mode.exp_space else None)
    ctx.save_for_backward(*saved)
    ctx.mode, ctx.w_rows, ctx.u_rows = mode, w.shape[0], u.shape[0]
    return saved


def _fused_backward(ctx: Any, gp: Tensor, vjp: Any) -> tuple[Tensor | None, ...] | None:
    """``_Permutahedron.backward`` for L2 in one pass of the kernel, the epsilon term included
    (``vjp``: :func:`softops._core.isotonic.l2_vjp_host_scaled`, or the kernel's ``l2_vjp``
    itself), or None where that does not apply: rows at their limits (``frozen``), one row of w
    for several rows, or no kernel. (The caller has ruled out KL, a gradient whose own graph is
    wanted, which takes the differentiable torch form, and ``torch.func``.)"""
    u, _, eps, pz, pw, block, frozen, _ = ctx.saved_tensors
    want_u, want_w, want_e = ctx.needs_input_grad[:3]
    if frozen is not None or (want_w and ctx.w_rows != gp.shape[0]):
        return None
    pw, u = pw if want_w else None, u if want_e else None
    fused = vjp(gp, pz, pw, block, want_u, want_w, u, eps, ctx.mode.bits)
    if fused is None:
        return None
    gz, gw, ge = fused
    gz = _rows_like(gz, ctx.u_rows) if want_u else None
    return gz, gw if want_w else None, ge if want_e else None, None


class _Permutahedron(torch.autograd.Function):
    """p = P(z, w) per row: the projection of z onto the permutahedron of w (``_Mode`` says which
    projection, which of z and w to sort, and how z comes from u and epsilon), in z's order. u is
    (B or 1, n), w (B or 1, n), eps (B,).

    Returns (p, perm_z, perm_w, block, frozen): the permutations (None where not sorted here),
    the block ids in sorted coordinates and the entries set to a limit (None when none is), all
    non-differentiable.
    """

    @staticmethod
    def forward(
        u: Tensor, w: Tensor, eps: Tensor, mode: _Mode
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor | None]:
        traced = torch.compiler.is_compiling()
        p, pz, pw, block, finite = permutahedron(u, w, eps, mode.bits, read=not traced)
        # (traced code cannot branch on the kernel's count: the mask is formed, all False on
        # finite rows)
        frozen = _limits(u, w, eps, pz, pw, mode) if traced or not finite else None
        return p, pz, pw, block, frozen

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        u, w, eps, mode = inputs
        out, pz, pw, block, frozen = output
        ctx.mark_non_differentiable(*(o for o in output[1:] if o is not None))
        ctx.set_materialize_grads(False)  # (no zero gradients filled in for the index outputs)
        saved = _save(ctx, u, w, eps, mode, out, pz, pw, block, frozen)
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            ctx.save_for_forward(*saved)  # (only forward mode reads them: jvp)

    @staticmethod
    def backward(ctx: Any, gp: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
        if gp is None:
            return None, None, None, None
        if (
            not ctx.mode.kl
            and not torch.is_grad_enabled()  # (create_graph: the torch form below)
            and not torch._C._are_functorch_transforms_active()
        ):  # the formulas below, the epsilon term too, in one pass
            fused = _fused_backward(ctx, gp, l2_vjp_host_scaled)
            if fused is not None:
                return fused
        u, w, eps, pz, pw, block, frozen, out = ctx.saved_tensors
        mode: _Mode = ctx.mode
        want_u, want_w, want_e = ctx.needs_input_grad[:3]
        sign = -1.0 if mode.negate else 1.0  # p = -P(z, -w): dp/dz = -P_z, dp/dw = P_w
        gz = gw = ge = None
        f = _factor(eps, gp.shape[-1], mode)
        if mode.negate:
            gp = -gp
        gs = _gather(gp if out is None else gp * out, pz)
        if frozen is not None:  # also where the output is NaN: no NaN * 0 from the frozen rows
            gs = gs.masked_fill(frozen, 0.0)
        # z - z_ref in sorted coordinates, where the Jacobian depends on it (KL) or for epsilon
        rel = None
        if mode.kl or want_e:
            rel = _sorted_rel(u, f, pz, block, frozen, mode)
        if mode.kl:  # dp/ds = I - 1 softmax(s_B)^T, dp/dw = 1 softmax(w_B)^T on each block
            total = block_sum(gs, block)
            gs_z = gs - block_softmax(cast(Tensor, rel), block, torch.zeros_like(gs)) * total
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
        if want_u:
            gz = _scatter(gs_z, pz)
            gz = _rows_like(gz * f if mode.inv else gz / f, ctx.u_rows)
        if want_w:
            gw = _scatter(_rows_like(gs_w, ctx.w_rows), pw)
            if mode.negate:  # through w -> -w
                gw = -gw
        if want_e:
            ge = (gs_z * cast(Tensor, rel)).sum(-1) / -eps  # dz/deps = -z / eps
        return gz, gw, ge, None

    @staticmethod
    def jvp(ctx: Any, du: Tensor | None, dw: Tensor | None, de: Tensor | None, _: Any) -> Any:
        # The same Jacobian from the other side (for KL it is not symmetric).
        u, w, eps, pz, pw, block, frozen, out = ctx.saved_tensors
        mode: _Mode = ctx.mode
        sign = -1.0 if mode.negate else 1.0
        rows = block.shape
        f = _factor(eps, rows[-1], mode)
        rel = None
        if mode.kl or de is not None:
            rel = _sorted_rel(u, f, pz, block, frozen, mode)
        ds = None
        if du is not None:
            ds = _gather((du * f if mode.inv else du / f).expand(rows), pz)
        if de is not None:  # dz = -z deps / eps, on the block-relative z (``_sorted_rel``)
            dse = cast(Tensor, rel) * (de / -eps)[:, None]
            ds = dse if ds is None else ds + dse
        terms = []
        if ds is not None:
            if frozen is not None:
                ds = ds.masked_fill(frozen, 0.0)
            if mode.kl:
                soft = block_softmax(cast(Tensor, rel), block, torch.zeros_like(ds))
                terms.append(ds - block_sum(soft * ds, block))
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
        info: Any, in_dims: tuple[Any, ...], u: Tensor, w: Tensor, eps: Tensor, mode: _Mode
    ) -> tuple[Any, Any]:
        # Rows are independent: broadcast the per-sample shapes, put the vmapped dim first and
        # fold it into the rows (a single row of u or w, if any, is repeated for every row).
        moved = [
            t.movedim(d, 0) if d is not None else t.unsqueeze(0)
            for t, d in zip((u, w, eps), in_dims[:3], strict=True)
        ]
        sample = torch.broadcast_shapes(*(t.shape[1:] for t in moved[:2]), (*moved[2].shape[1:], 1))
        shape = (info.batch_size, *sample)
        u, w = (
            t.reshape(t.shape[0], *[1] * (len(sample) + 1 - t.dim()), *t.shape[1:]).expand(shape)
            for t in moved[:2]
        )
        n = shape[-1]
        e = moved[2].expand(shape[:-1]).reshape(-1)
        out = _Permutahedron.apply(u.reshape(-1, n), w.reshape(-1, n), e, mode)
        return (
            tuple(None if o is None else o.reshape(shape) for o in out),
            tuple(None if o is None else 0 for o in out),
        )


class _PermutahedronTraced(_Permutahedron):
    """The same Function for traced code: torch 2.13's dynamo rejects a custom ``jvp``."""

    jvp = torch.autograd.Function.jvp  # type: ignore[assignment]


class _PermutahedronEager(torch.autograd.Function):
    """The same node for a plain eager CPU call outside forward mode (fixed costs are a small
    call's time): a classic ``forward`` that runs the kernel directly (``ops``:
    :func:`softops._core.isotonic.eager_ops`) with one output (the permutations and block ids
    stay on ctx), the same saved tensors and backward, its fused L2 pass in the kernel too."""

    @staticmethod
    def forward(ctx: Any, u: Tensor, w: Tensor, eps: Tensor, mode: _Mode, ops: Any) -> Tensor:
        p, pz, pw, block, bad = ops.permutahedron(u, w, eps, mode.bits)
        pz = pz if mode.sort_z else None
        pw = pw if mode.sort_w else None
        frozen = _limits(u, w, eps, pz, pw, mode) if bad else None
        _save(ctx, u, w, eps, mode, p, pz, pw, block, frozen)
        ctx.vjp = None if mode.kl else ops.l2_vjp
        return p

    @staticmethod
    def backward(ctx: Any, gp: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.vjp is not None and not torch.is_grad_enabled() and plain_eager(gp):
            fused = _fused_backward(ctx, gp, ctx.vjp)
            if fused is not None:
                return (*fused, None)
        return (*_Permutahedron.backward(ctx, gp), None)


def _apply(x2: Tensor, eps: Tensor, mode: _Mode) -> Tensor:
    """P for the rows x2, with rho = (n, ..., 1) as the other argument (the rank: u = x2, w = rho;
    the sort: u = rho, w = x2; ``mode.sort_z`` tells them apart): ``_Permutahedron`` applied, its
    eager twin where the kernel runs directly, its traced twin under ``torch.compile``."""
    ops = eager_ops(x2, eps)
    if ops is not None and forward_ad._current_level < 0:
        rho = _rho_row(x2.shape[-1], x2.dtype, x2.device)
        u, w = (x2, rho) if mode.sort_z else (rho, x2)
        return _apply_eager(u, w, eps, mode, ops)
    rho = _rho(x2)
    u, w = (x2, rho) if mode.sort_z else (rho, x2)
    if torch.compiler.is_compiling():
        return _PermutahedronTraced.apply(u, w, eps, mode)[0]
    return apply_function(_Permutahedron, u, w, eps, mode)[0]


_apply_eager = super(torch.autograd.Function, _PermutahedronEager).apply
"""``_PermutahedronEager.apply`` without its per-call signature binding (``apply_function``)."""


_RANK = {  # (kl, descending): L2 P_Q(z, rho); KL exp P_E(z, log rho)
    (kl, down): _Mode(kl, sort_z=True, sort_w=False, exp_space=kl, flip=down)
    for kl in (False, True)
    for down in (False, True)
}
_SORT = {  # (kl, ascending)
    (kl, up): _Mode(kl, sort_z=False, sort_w=True, negate=up, inv=True)
    for kl in (False, True)
    for up in (False, True)
}


def _rho(x2: Tensor) -> Tensor:
    """rho = (n, ..., 1), one row (1, n); in eager calls one tensor per (n, dtype, device), made
    once (a fill costs as much as the rest of a short call)."""
    n = x2.shape[-1]
    if not (isinstance(n, int) and plain_eager(x2)):
        return torch.arange(n, 0, -1, dtype=x2.dtype, device=x2.device)[None]
    return _rho_row(n, x2.dtype, x2.device)


@functools.lru_cache(maxsize=64)
def _rho_row(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    with torch.inference_mode(False):  # (an inference tensor could not be saved for backward)
        return torch.arange(n, 0, -1, dtype=dtype, device=device)[None]


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
    mode = _RANK[opts.regularization == "kl", descending]
    return _apply(x2, eps, mode)


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
    # descending: P(a, x); ascending: -P(a, -x), the descending sort of -x, negated; with
    # a = rho / eps, formed by the node in the frame that cannot overflow (module docstring)
    mode = _SORT[opts.regularization == "kl", not descending]
    return _apply(x2, eps, mode)
