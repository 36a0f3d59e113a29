r"""Method "perturbed" of ``soft_topk_mask``: the perturbed optimizer of Berthet et al. (2020).

The hard top-k mask :math:`y(x) = \arg\max_{y \in \mathcal{C}} \langle y, x \rangle`, with
:math:`\mathcal{C}` the 0/1 vectors with k ones, is smoothed by Gaussian perturbation of its input:

.. math::

    y_\varepsilon(x) = \mathbb{E}_Z[y(x + \varepsilon Z)], \qquad Z \sim \mathcal{N}(0, I_n),

    J y_\varepsilon(x) = \tfrac{1}{\varepsilon}\,\mathbb{E}_Z[y(x + \varepsilon Z)\, Z^\top].

Both expectations are estimated on the **same** N draws :math:`Z_1, \dots, Z_N` (per row):

.. math::

    \hat y = \frac1N \sum_s y_s, \qquad
    \widehat{g^\top J} = \frac{1}{\varepsilon N} \sum_s \langle g - \bar g\mathbf 1, y_s \rangle\,
    Z_s, \qquad y_s = y(x + \varepsilon Z_s),

where :math:`y(\cdot)` is ``zeros_like(x).scatter(-1, x.topk(k).indices, 1)`` and
:math:`\bar g` the mean of the row of g. Centring g is Berthet et al.'s estimator applied to
:math:`g - \bar g \mathbf 1`, which has the same exact VJP (every :math:`y_s` sums to k, so
:math:`\mathbf 1^\top J = 0`): a control variate that keeps the estimate unbiased and removes
the noise that a common offset of g would add (``mask.sum().backward()`` gives exactly 0).

Variance. Each entry of :math:`\hat y` is a mean of N Bernoulli draws: its standard error is
:math:`\sqrt{p(1-p)/N} \le 0.5/\sqrt N`. The values are multiples of 1/N and every row sums to
k (exactly when N is a power of two; otherwise up to the rounding of ``count / N``; the counts
are exact for N < 2**24 in float32). Each entry of
the gradient estimate has standard error at most :math:`\|g\|_{(k)} / (\varepsilon \sqrt N)`,
with :math:`\|g\|_{(k)}` the sum of the k largest :math:`|g_j - \bar g|` of the row: it shrinks like
:math:`1/\sqrt N` and grows like :math:`1/\varepsilon`. The estimator is unbiased for the
Jacobian of :math:`y_\varepsilon`, not for that of the hard mask (which is 0 almost everywhere).

Epsilon. :math:`\varepsilon` is the standard deviation of the Gaussian noise, in the units of x.
Scaling law: ``mask(c*x, eps=c*e)`` has the same distribution as ``mask(x, eps=e)`` for c > 0
(with the same generator state the draws are identical, so the values agree up to rounding and
the gradient is divided by c). Shifting a row by a constant changes nothing (up to rounding).

Memory. The N samples are processed in chunks of ``max(1, 2**22 // (B*n))`` samples, so the
work buffers hold at most about :math:`2^{22}` elements (or one (B, n) sample when B*n is
larger): O(B n), never O(B n N). The noise is **not stored**: the backward pass rebuilds the
generator from a snapshot of its state and regenerates the identical draws, in the same order.
Backward keeps x, epsilon (through ``save_for_backward``) and the generator state (a few KiB,
on the autograd context), whatever N.

Draw order. Sample s draws one (B, n) standard normal tensor in the dtype of x, as
``torch.randn(B, n, generator=g, dtype=x.dtype, device=x.device)`` would, for s = 0, 1, ...,
N - 1; the chunking does not change the draws.

Reproducibility.

* ``generator=None``: a seed is drawn from the global default (CPU) generator and a private
  ``torch.Generator`` on x's device is seeded with it, so ``torch.manual_seed`` makes results
  reproducible; the backward uses a fresh generator with the same seed.
* a user ``generator``: its state is snapshotted before sampling; the forward advances it (two
  consecutive calls differ), and the backward uses a fresh generator set to the snapshot, so the
  gradient uses the forward's draws even if the user's generator has moved on since.

Special values. ``+inf`` entries stay infinite under the noise and are always selected, ``-inf``
never; their gradient is 0, and their noise never reaches the gradient of finite entries. A row
with a NaN, with more than k entries at ``+inf``, or with fewer than k entries above ``-inf``
gives NaN values and a NaN gradient in that row only. k = 0 gives zeros and k = n ones, with no
sampling (the generator is not advanced) and a zero gradient.

Cost. The forward draws N (B, n) Gaussian samples and runs one batched ``torch.topk`` per
chunk; the backward draws the same samples again (the price of not storing them). Drawing the
noise dominates on CPU (about half of forward+backward at B=64, n=1000, k=10, N=100).

The backward is marked once-differentiable (differentiating the gradient again raises): the
paper's second-order estimator is not implemented.

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

from softops.topk._options import unreachable_rows

__all__ = ["perturbed_topk_mask"]

# Work-buffer budget in elements: a chunk of c samples uses c*B*n <= this (c >= 1).
_CHUNK_ELEMENTS = 2**22


@dataclass(frozen=True)
class _Snapshot:
    """A generator state (a small CPU byte tensor), kept out of autograd's and torch.func's view:
    it is replayed, not differentiated, and its size does not depend on n_samples."""

    state: torch.Tensor | None


def _chunk_size(B: int, n: int, n_samples: int) -> int:
    return max(1, min(n_samples, _CHUNK_ELEMENTS // max(1, B * n)))


def _fill_normal(buf: torch.Tensor, generator: torch.Generator | None) -> None:
    """Fill ``buf`` (c, B, n) sample by sample, so that the draws do not depend on c."""
    for j in range(buf.shape[0]):
        buf[j].normal_(generator=generator)


class _PerturbedTopKMask(torch.autograd.Function):
    """Mean of hard top-k masks of x + eps Z over N draws; Berthet's estimator as the VJP.

    Inputs are canonical: x (B, n) float32/float64, eps (B,), k in [0, n], n_samples >= 1,
    ``generator`` (advanced by the forward) and ``snapshot``, its state before sampling.
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        eps: torch.Tensor,
        k: int,
        n_samples: int,
        generator: torch.Generator | None,
        snapshot: _Snapshot,
    ) -> torch.Tensor:
        B, n = x.shape
        bad = unreachable_rows(x, k)
        if k == 0 or k == n:
            A = torch.full_like(x, 0.0 if k == 0 else 1.0)
            return A.masked_fill_(bad[:, None], math.nan)
        e = eps[:, None]
        c = _chunk_size(B, n, n_samples)
        buf = torch.empty((c, B, n), dtype=x.dtype, device=x.device)
        counts = torch.zeros_like(x)
        ones = torch.ones((), dtype=x.dtype, device=x.device)
        for start in range(0, n_samples, c):
            m = min(c, n_samples - start)
            pert = buf[:m]
            _fill_normal(pert, generator)
            pert.mul_(e).add_(x)  # x + eps Z, rounded as in the backward
            idx = pert.topk(k, dim=-1, sorted=False).indices  # (m, B, k)
            idx = idx.permute(1, 0, 2).reshape(B, m * k)
            counts.scatter_add_(-1, idx, ones.expand(idx.shape))
        A = counts / n_samples
        return A.masked_fill_(bad[:, None], math.nan)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, eps, k, n_samples, _, snapshot = inputs
        ctx.k, ctx.n_samples, ctx.snapshot = k, n_samples, snapshot
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        x, eps = ctx.saved_tensors
        k, n_samples = ctx.k, ctx.n_samples
        B, n = x.shape
        bad = unreachable_rows(x, k)
        gx = torch.zeros_like(x)
        if 0 < k < n:
            generator = torch.Generator(device=x.device)
            generator.set_state(ctx.snapshot.state)
            e = eps[:, None]
            c = _chunk_size(B, n, n_samples)
            z_buf = torch.empty((c, B, n), dtype=x.dtype, device=x.device)
            p_buf = torch.empty_like(z_buf)
            # Every y_s sums to k, so 1^T J = 0 and g^T J = (g - c 1)^T J for any c: centring g
            # is an exact control variate. It keeps the estimate unbiased and removes the noise
            # k c Z_s / eps that a common offset of g would otherwise add.
            g = g.to(x.dtype)
            g = g - g.mean(-1, keepdim=True)
            for start in range(0, n_samples, c):
                m = min(c, n_samples - start)
                z, pert = z_buf[:m], p_buf[:m]
                _fill_normal(z, generator)
                torch.mul(z, e, out=pert).add_(x)  # the forward's x + eps Z, bit for bit
                idx = pert.topk(k, dim=-1, sorted=False).indices  # (m, B, k)
                w = g.expand(m, B, n).gather(-1, idx).sum(-1)  # <g, y_s>: (m, B)
                gx.add_(z.mul_(w[..., None]).sum(0))
            gx.div_(e * n_samples)
            # Entries at +-inf have gradient 0; their noise never enters the finite entries.
            gx = torch.where(torch.isfinite(x), gx, 0.0)
        return gx.masked_fill_(bad[:, None], math.nan), None, None, None, None, None


def perturbed_topk_mask(
    x: torch.Tensor,
    k: int,
    eps: torch.Tensor,
    n_samples: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Perturbed top-k mask of each row of ``x`` (B, n); differentiable with respect to x only.

    Args:
        x: (B, n) scores in float32 or float64 (the k **largest** are selected).
        k: an int in [0, n].
        eps: (B,) positive noise scales in the units of x (no gradient).
        n_samples: the number N of Gaussian draws, >= 1.
        generator: None, or a ``torch.Generator`` on x's device type (advanced by the call).

    Returns:
        (B, n): the mean of the hard masks of ``x + eps Z_s``, values in {0, 1/N, ..., 1}.

    Example:
        >>> x = torch.tensor([[5.0, 2.0, 3.0, 4.0, 1.0, 6.0]])
        >>> eps = torch.tensor([1e-3])
        >>> perturbed_topk_mask(x, 3, eps, 8, torch.Generator().manual_seed(0))
        tensor([[1., 0., 0., 1., 0., 1.]])
    """
    if not 0 < k < x.shape[-1]:  # zeros or ones: no sampling, no generator advanced
        generator, snapshot = None, _Snapshot(None)
    else:
        if generator is None:
            # A seed from the global generator, so that torch.manual_seed makes it reproducible.
            seed = int(torch.randint(2**62, ()))
            generator = torch.Generator(device=x.device)
            generator.manual_seed(seed)
        snapshot = _Snapshot(generator.get_state())
    return _PerturbedTopKMask.apply(x, eps.detach(), k, n_samples, generator, snapshot)
