r"""Method "perturbed" of ``soft_topk_mask``: the perturbed optimizer of Berthet et al. (2020).

The hard top-k mask :math:`y(x)` is smoothed by Gaussian noise, and its Jacobian estimated on
the **same** N draws per row (docs/math.md §1.6):

.. math::

    \hat y = \frac1N \sum_s y(x + \varepsilon Z_s), \qquad
    \widehat{g^\top J} = \frac{1}{\varepsilon N} \sum_s \langle g - \bar g\mathbf 1,
    y(x + \varepsilon Z_s) \rangle\, Z_s, \qquad Z_s \sim \mathcal{N}(0, I_n),

with :math:`\bar g` the mean of g over the row's finite entries (an exact control variate).
epsilon is the noise's standard deviation in the units of x (scaling law ``mask(c x, c e) ~
mask(x, e)``); forward mode applies the same estimated Jacobian, so ``jacfwd`` equals ``jacrev``.

Contract: draw s is one (B, n) ``torch.randn`` in x's dtype, **not stored**: the backward
regenerates it from a snapshot of the generator (``generator=None`` seeds a private one from the
global generator). ``+inf`` entries are always selected and ``-inf`` never, without derivative;
NaN or unreachable-k rows are NaN; k = 0 and k = n draw nothing. Under ``vmap`` the
``randomness`` flag holds. Once-differentiable.

References:
    Berthet, Blondel, Teboul, Cuturi, Vert and Bach. Learning with Differentiable Perturbed
    Optimizers. NeurIPS 2020. arXiv:2002.08676.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from softops._core.transforms import plain, under_functorch, vmap_rows
from softops._kernels import define
from softops.topk._options import MaskOptions, unreachable_rows

__all__ = ["mask", "perturbed_topk_mask"]

# Work-buffer budget in elements: a chunk of c samples uses c*B*n <= this (c >= 1).
_CHUNK_ELEMENTS = 2**22

_OP = "soft_topk_mask(method='perturbed')"

# The vmapped sizes folded into the rows, outermost first, each with whether its slices share
# their draws (randomness="same", or x and epsilon constant along it). () outside vmap.
Layout = tuple[tuple[int, bool], ...]


@dataclass(frozen=True)
class _Snapshot:
    """A generator state, kept out of autograd's and torch.func's view (replayed, not
    differentiated)."""

    state: torch.Tensor | None


def _chunk_size(B: int, n: int, n_samples: int) -> int:
    return max(1, min(n_samples, _CHUNK_ELEMENTS // max(1, B * n)))


def _fold(info: Any, layout: Layout, varies: bool) -> Layout:
    """The layout after folding one vmap level into the rows. ``varies``: x or epsilon is batched
    at that level (otherwise the forward never saw it, and its slices share the draws)."""
    if varies and info.randomness == "error":
        raise RuntimeError(
            f"{_OP}: vmap: called random operation while in randomness error mode. Please "
            "either use the 'same' or 'different' randomness flags on vmap or perform the "
            "randomness operation out of vmap."
        )
    return ((info.batch_size, not varies or info.randomness == "same"), *layout)


def _draws(
    x: torch.Tensor,
    eps: torch.Tensor,
    k: int,
    n_samples: int,
    generator: torch.Generator | None,
    layout: Layout,
    keep_noise: bool,
):
    """The draws of the forward, chunk by chunk: ``(z, idx)``, z (m, R, n) the noise of each row
    (None unless ``keep_noise``) and idx (m, R, k) the top-k of x + eps z. Sample s draws one
    (D, n) tensor, D the rows that do not share their draws, spread over the rows of ``layout``.
    """
    R, n = x.shape
    sizes = [size for size, _ in layout]
    base = R // math.prod(sizes)
    draw_shape = [1 if same else size for size, same in layout]
    spread = any(same for _, same in layout)
    c = _chunk_size(R, n, n_samples)
    z_buf = torch.empty((c, math.prod(draw_shape) * base, n), dtype=x.dtype, device=x.device)
    p_buf = torch.empty((c, R, n), dtype=x.dtype, device=x.device) if keep_noise else None
    e = eps[:, None]
    for start in range(0, n_samples, c):
        m = min(c, n_samples - start)
        z = z_buf[:m]
        for j in range(m):
            z[j].normal_(generator=generator)
        if spread:  # the same draw for every slice of the shared levels: a copy
            z = z.view(m, *draw_shape, base, n).expand(m, *sizes, base, n).contiguous()
            z = z.view(m, R, n)
        # x + eps Z, rounded alike in the forward, the backward and the tangent
        pert = z.mul_(e) if p_buf is None else torch.mul(z, e, out=p_buf[:m])
        idx = pert.add_(x).topk(k, dim=-1, sorted=False).indices
        yield (z if keep_noise else None), idx


def _centre(t: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """C_F t: t minus its mean over the finite entries F of its row, and 0 off F."""
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(finite, t, 0.0).sum(-1, keepdim=True) / count
    return torch.where(finite, t - mean, 0.0)


class _PerturbedTopKMask(torch.autograd.Function):
    """Mean of hard top-k masks of x + eps Z over N draws (canonical rows; ``snapshot`` the
    generator's state before sampling); Berthet's estimator as the VJP and the JVP."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        eps: torch.Tensor,
        k: int,
        n_samples: int,
        generator: torch.Generator | None,
        snapshot: _Snapshot,
        layout: Layout,
    ) -> torch.Tensor:
        B, n = x.shape
        bad = unreachable_rows(x, k)
        if k == 0 or k == n:
            A = torch.full_like(x, 0.0 if k == 0 else 1.0)
            return A.masked_fill_(bad[:, None], math.nan)
        if x.is_meta:  # shape inference: nothing to draw
            return torch.empty_like(x)
        counts = torch.zeros_like(x)
        ones = torch.ones((), dtype=x.dtype, device=x.device)
        for _, idx in _draws(x, eps, k, n_samples, generator, layout, keep_noise=False):
            idx = idx.permute(1, 0, 2).reshape(B, -1)  # (B, m k)
            counts.scatter_add_(-1, idx, ones.expand(idx.shape))
        A = counts / n_samples
        return A.masked_fill_(bad[:, None], math.nan)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, eps, k, n_samples, _, snapshot, layout = inputs
        ctx.k, ctx.n_samples, ctx.snapshot, ctx.layout = k, n_samples, snapshot, layout
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, eps)
        ctx.save_for_forward(x, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gx = None
        if ctx.needs_input_grad[0]:
            x, eps = ctx.saved_tensors
            gx = _Estimate.apply(x, eps, g, ctx.k, ctx.n_samples, ctx.snapshot, ctx.layout, True)
        return gx, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, dx: torch.Tensor | None, *_: Any) -> torch.Tensor:
        x, eps = ctx.saved_tensors
        if dx is None:  # epsilon carries no derivative
            return torch.zeros_like(x)
        return _Estimate.apply(x, eps, dx, ctx.k, ctx.n_samples, ctx.snapshot, ctx.layout, False)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        *head, layout = args
        return vmap_rows(_PerturbedTopKMask, info, in_dims, *head, _fold(info, layout, True))


class _Estimate(torch.autograd.Function):
    """The estimated Jacobian of the forward's draws applied to t (B, n): the VJP with
    ``transpose``, else the JVP. A Function so that it runs below every functorch level."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        eps: torch.Tensor,
        t: torch.Tensor,
        k: int,
        n_samples: int,
        snapshot: _Snapshot,
        layout: Layout,
        transpose: bool,
    ) -> torch.Tensor:
        B, n = x.shape
        if x.is_meta:
            return torch.empty_like(x)
        out = torch.zeros_like(x)
        if 0 < k < n and snapshot.state is not None:  # (the forward drew: it has a state)
            generator = torch.Generator(device=x.device)
            generator.set_state(snapshot.state)
            finite = torch.isfinite(x)
            # transpose: the centred cotangent C_F g; forward: the finite entries' tangent
            t = _centre(t.to(x.dtype), finite) if transpose else torch.where(finite, t, 0.0)
            for z, idx in _draws(x, eps, k, n_samples, generator, layout, keep_noise=True):
                if transpose:  # sum_s <C_F g, y_s> Z_s
                    w = t.expand(z.shape).gather(-1, idx).sum(-1)  # (m, B)
                    out.add_(z.mul_(w[..., None]).sum(0))
                else:  # sum_s y_s <Z_s, dx>
                    c = (z * t).sum(-1)  # (m, B)
                    cols = idx.permute(1, 0, 2).reshape(B, -1)  # (B, m k)
                    out.scatter_add_(-1, cols, c.T.repeat_interleave(k, dim=-1))
            out.div_(eps[:, None] * n_samples)
            out = torch.where(finite, out, 0.0) if transpose else _centre(out, finite)
        return out.masked_fill_(unreachable_rows(x, k)[:, None], math.nan)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - once_differentiable
        raise RuntimeError(f"{_OP}: the gradient estimator is not differentiable.")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        *head, layout, transpose = args
        varies = in_dims[0] is not None or in_dims[1] is not None
        layout = _fold(info, layout, varies)
        return vmap_rows(_Estimate, info, in_dims, *head, layout, transpose)


# ------------------------------------------------------------------------------- traced code
# dynamo can neither make nor carry a torch.Generator: traced, the draws come from a seed drawn
# in the graph, and the sampling runs inside two operators (opaque to dynamo) that seed their own.


def _seeded(x: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Generator, _Snapshot]:
    generator = torch.Generator(device=x.device)
    generator.manual_seed(int(seed))
    return generator, _Snapshot(generator.get_state())


def _mask_reference(
    x: torch.Tensor, eps: torch.Tensor, k: int, n_samples: int, seed: torch.Tensor
) -> torch.Tensor:
    return _PerturbedTopKMask.forward(x, eps, k, n_samples, *_seeded(x, seed), ())


def _estimate_reference(
    x: torch.Tensor,
    eps: torch.Tensor,
    t: torch.Tensor,
    k: int,
    n_samples: int,
    seed: torch.Tensor,
    transpose: bool,
) -> torch.Tensor:
    return _Estimate.forward(x, eps, t, k, n_samples, _seeded(x, seed)[1], (), transpose)


MASK_OP = define(
    "softops::perturbed_topk_mask",
    "(Tensor x, Tensor eps, int k, int n_samples, Tensor seed) -> Tensor",
    reference=_mask_reference,
    fake=lambda x, *_: torch.empty_like(x),
)
"""The forward of :class:`_PerturbedTopKMask` with a generator seeded by ``seed`` (an int64
0-dim tensor), for traced code; not differentiable."""

ESTIMATE_OP = define(
    "softops::perturbed_estimate",
    "(Tensor x, Tensor eps, Tensor t, int k, int n_samples, Tensor seed, bool transpose) -> Tensor",
    reference=_estimate_reference,
    fake=lambda x, *_: torch.empty_like(x),
)
""":class:`_Estimate` of the draws of :data:`MASK_OP` with the same seed, for traced code."""


class _PerturbedTopKMaskTraced(torch.autograd.Function):
    """:class:`_PerturbedTopKMask` for traced code, on a seed: :data:`MASK_OP`, and the VJP by
    :data:`ESTIMATE_OP` on the same draws."""

    @staticmethod
    def forward(
        x: torch.Tensor, eps: torch.Tensor, k: int, n_samples: int, seed: torch.Tensor
    ) -> torch.Tensor:
        return MASK_OP(x, eps, k, n_samples, seed)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, eps, k, n_samples, seed = inputs
        ctx.k, ctx.n_samples = k, n_samples
        ctx.save_for_backward(x, eps, seed)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, eps, seed = ctx.saved_tensors
        gx = ESTIMATE_OP(x, eps, g, ctx.k, ctx.n_samples, seed, True)
        return gx, None, None, None, None


def _follow_randomness(x: torch.Tensor) -> torch.Tensor:
    """x, made to vary along every vmap level whose randomness is "different": ``x + 0 * r``
    with r one normal draw taken under the active transforms."""
    try:
        r = torch.randn(
            (), generator=torch.Generator(device=x.device), dtype=x.dtype, device=x.device
        )
    except RuntimeError as err:
        raise RuntimeError(f"{_OP}: {err}") from err
    return x + 0.0 * r


def mask(
    x2: torch.Tensor, k_row: torch.Tensor, eps: torch.Tensor, opts: MaskOptions
) -> torch.Tensor:
    """The backend entry of ``soft_topk_mask`` (no gradient in k or epsilon)."""
    return perturbed_topk_mask(x2, opts.k_int, eps.detach(), opts.n_samples, opts.generator)


def perturbed_topk_mask(
    x: torch.Tensor,
    k: int,
    eps: torch.Tensor,
    n_samples: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Perturbed top-k mask of each row of ``x`` (B, n), the mean of the hard masks of the k
    largest of ``x + eps Z_s`` over N = ``n_samples`` draws; differentiable in x only.

    Example:
        >>> x = torch.tensor([[5.0, 2.0, 3.0, 4.0, 1.0, 6.0]])
        >>> eps = torch.tensor([1e-3])
        >>> perturbed_topk_mask(x, 3, eps, 8, torch.Generator().manual_seed(0))
        tensor([[1., 0., 0., 1., 0., 1.]])
    """
    if torch.compiler.is_compiling() and generator is None:
        # the seed drawn in the graph, as below (none where nothing is drawn)
        if 0 < k < x.shape[-1]:
            drawn = torch.randint(2**62, (), dtype=torch.int64)
        else:
            drawn = torch.zeros((), dtype=torch.int64)
        return _PerturbedTopKMaskTraced.apply(x, eps.detach(), k, n_samples, drawn)
    if plain(x).numel() == 0:
        # no row at all (maybe a vmapped dim of size 0): nothing to draw, no generator advanced
        return x * 0.0
    if not 0 < k < x.shape[-1] or x.is_meta:  # no sampling: no generator made or advanced
        generator, snapshot = None, _Snapshot(None)
    else:
        if under_functorch():
            x = _follow_randomness(x)
        if generator is None:
            # a seed from the global generator (torch.manual_seed makes it reproducible), drawn
            # outside the transforms
            with torch._C._DisableFuncTorch():
                seed = int(torch.randint(2**62, ()))
            generator = torch.Generator(device=x.device)
            generator.manual_seed(seed)
        snapshot = _Snapshot(generator.get_state())
    return _PerturbedTopKMask.apply(x, eps.detach(), k, n_samples, generator, snapshot, ())
