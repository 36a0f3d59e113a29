r"""Method "n3" of ``soft_topk_mask``: the continuous deterministic relaxation of kNN selection of
Plötz & Roth (2018), the selection inside their neural nearest neighbors block (N3).

With logits :math:`z^{(1)} = x / \varepsilon`, repeat k times

.. math::

    w^{(t)} = \mathrm{softmax}(z^{(t)}), \qquad A \leftarrow A + w^{(t)}, \qquad
    z^{(t+1)} = z^{(t)} + \log\big(1 - w^{(t)}\big),

and return :math:`A = \sum_t w^{(t)}`: each round takes a soft arg max and lowers the logit of
what it took by :math:`\log(1 - w)`. Equivalently :math:`w^{(t+1)} \propto w^{(t)} \odot (1 -
w^{(t)})`: after the first softmax the rounds are a map of the simplex in which epsilon does not
appear. Plain autograd through the rounds; from k = 16 on, segments of about sqrt(k) rounds are
checkpointed.

Deviations from the paper's notation: x are scores (the paper's negative distances -d),
epsilon is its temperature t, in the units of x, and the result is the sum of the k weight
vectors (the paper keeps them apart, as k "neighbour volumes").

Properties: every round is a probability vector, so ``A >= 0`` and ``sum(A) = k`` (to rounding);
A is invariant to adding a constant to x (softmax and ``log(1 - w)`` see only differences of z),
equivariant to permutations, and obeys the scaling law ``x -> c x, epsilon -> c epsilon``.
Input ranges beyond the dtype's (``(x - max x) / epsilon`` below ``-finfo.max``) saturate there,
and entries that saturate tie.

**Not clipped.** Entries can exceed 1: with n = k = 2, :math:`w^{(2)} = (1/2, 1/2)` whatever x,
so :math:`A = (a + 1/2, 3/2 - a)` with :math:`a = \sigma((x_1 - x_2)/\varepsilon)`.

**Its small-epsilon limit is not the hard top-k mask** (for k >= 2). In exact arithmetic
:math:`\log(1 - w_i) = \mathrm{lse}_{j \ne i}(z_j) - \mathrm{lse}(z)`, so the logit of the entry a
round selected falls to about the log-sum-exp of the others, level with the runner-up, not to
:math:`-\infty`. On distinct entries, as epsilon -> 0, :math:`w^{(1)}` tends to the one-hot of the
largest entry and every later round to half on the largest and half on the second (the third's
weight only doubles per round), so A tends to (k + 1)/2 on the largest entry, (k - 1)/2 on the
second and 0 elsewhere; k = 1 gives the hard arg max. At moderate epsilon the mass leans the
same way: for ``x = [5, 2, 3, 4, 1, 6]``, k = 3 and epsilon = 0.5, A is (0.984, 0.004, 0.027,
0.189, 0.0005, 1.796), where "ot" gives (0.953, 0.047, 0.269, 0.731, 0.007, 0.993). An
implementation that forms ``log(1 - w)`` from a rounded w (``log1p(-w)``, or ``log1mexp`` of the
rounded log-softmax, as the authors' code does) removes an entry outright once ``1 - w`` rounds
to 0, at gaps beyond about 17 epsilon in float32 and 37 in float64: that mimics the hard mask
there, by a jump in the forward pass. This one does not round w away (below), so it is the
relaxation of the equations at every epsilon.

Precision of ``log(1 - w)``: each round first shifts the row's largest logit to exactly 0 (A
does not see a constant shift), so the entries near the top keep their differences to the last
bit however large ``|x| / epsilon`` is. With the log-softmax :math:`a = z - \mathrm{lse}(z) \le
0`, ``log1mexp(a)`` is ``log1p(-exp(a)) = log1p(-w)`` for :math:`a \le -\ln 2` (w <= 1/2:
every entry of a row but its largest), accurate there. Its other branch, ``log(-expm1(a))``,
needs a to more digits than ``z - lse(z)`` carries: a rounds to 0 once ``1 - w`` is below the
dtype's epsilon, and gives ``-inf``. So the largest entry (z = 0), when its w exceeds 1/2,
takes :math:`\log(1 - w) = \log\sigma(r)` with :math:`r = \mathrm{lse}_{j \ne i}(z_j)` the
log-sum-exp of the row without it (:math:`1 - w = e^r / (1 + e^r)`), which keeps ``1 - w`` to
full relative precision however close w is to 1. Neither form divides by ``1 - w``; a double
``where`` keeps the input of the form not taken finite, so no ``0 * inf`` reaches the backward.

Conditioning: the Jacobian of one round's logit update :math:`z \mapsto z + \log(1 - w)` is
:math:`I + J` with

.. math::

    J_{ij} = \frac{\partial \log(1 - w_i)}{\partial z_j} = -\frac{w_i(\delta_{ij} - w_j)}{1 - w_i}:
    \qquad J_{ii} = -w_i, \qquad J_{ij} = \frac{w_i w_j}{1 - w_i} \;(i \ne j),

bounded because :math:`\sum_{j \ne i} w_j = 1 - w_i`: the off-diagonal entries of row i sum to
:math:`w_i`, so :math:`I + J` is a non-negative matrix whose rows sum to 1 (a stochastic matrix,
:math:`\lVert I + J \rVert_\infty = 1`) at every epsilon and however close :math:`w_i` is to 1.
With the softmax's Jacobian :math:`\mathrm{diag}(w) - w w^\top` (:math:`\infty`-norm
:math:`\max_i 2 w_i (1 - w_i) \le 1/2`) this bounds the whole Jacobian:
:math:`\lVert \partial A / \partial x \rVert_\infty \le k / (2 \varepsilon)`. Method
"softkmax" instead feeds each round's mass back through :math:`x' / \varepsilon`, a gain of
about :math:`\max x' / (4 \varepsilon)` per round. The backward's rounding error is a fraction
of the order of the dtype's epsilon of this bound: at an epsilon far below the gaps, where the
true derivative vanishes, a gradient can read about ``finfo.eps * k / (2 epsilon)`` (and the
one of epsilon, a factor ``span / epsilon`` larger, overflow to ``inf`` once that exceeds the
dtype's range).

Infinities follow the convention of method "softkmax" (:mod:`softops.topk._softkmax`): a
``+inf`` entry is 1 and uses one of the k rounds, a ``-inf`` entry is 0 and takes no part, and
the other rounds run over the finite entries; a row with a NaN, more than k entries at ``+inf``
or fewer than k above ``-inf`` is NaN, with a zero gradient. (A convention, not the limit: an
entry tending to ``+inf`` takes the first round whole and then shares the others with the
runner-up, as above.)

References:
    Plötz and Roth. Neural Nearest Neighbors Networks. NeurIPS 2018. arXiv:1810.12575.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from softops._core.transforms import under_functorch
from softops.topk._options import unreachable_rows
from softops.topk._softkmax import _inverse, _scaled_difference

__all__ = ["n3_mask_rows"]

_N3_CHECKPOINT_MIN = 16  # from this k on, the backward recomputes segments of rounds


def n3_mask_rows(x2: torch.Tensor, k: int, eps: torch.Tensor) -> torch.Tensor:
    """The N3 recursion on each row of x2 (B, n); returns A (B, n).

    ``x2`` is in the compute dtype (float32 or float64), ``k`` an int in [0, n] (validated by
    the caller), ``eps`` a (B,) tensor that may require grad. Plain autograd: the backward saves
    about four (B, n) tensors per round, O(k B n) in all, for k < 16; from k = 16 on, segments
    of about sqrt(k) rounds are checkpointed (recomputed in the backward), O(sqrt(k) B n).

    Infinities and unreachable rows as in :func:`softops.topk._softkmax.soft_kmax_rows`.
    """
    finite = torch.isfinite(x2)
    pinf = x2 == math.inf
    bad = unreachable_rows(x2, k)
    ok = finite & ~bad[:, None]  # the entries that run the recursion
    # Double where: entries that are not `ok` never reach an arithmetic op with a gradient.
    xs = torch.where(ok, x2, 0)
    # The row maximum, as a constant: A is invariant to the shift, so its gradient is exact.
    mx = torch.where(ok, xs, -math.inf).amax(-1, keepdim=True).detach()
    mx = torch.where(torch.isfinite(mx), mx, 0)
    # z = (x - max x)/eps <= 0, formed so that the backward never meets an inf; beyond the
    # dtype's range it saturates at -finfo.max (a weight of exactly 0, as its limit)
    z = torch.where(ok, _scaled_difference(xs, mx, _inverse(eps)[:, None]), 0)
    z = z.clamp(min=-torch.finfo(z.dtype).max)
    A = z * 0  # zeros, on the graph (k = 0 still has a (zero) gradient)
    # Exclude the entries that are not `ok`, except in rows with none (they run no round, and
    # an all -inf softmax would be NaN).
    excluded = ~ok & ok.any(-1, keepdim=True)
    z = z + torch.zeros_like(z).masked_fill_(excluded, -math.inf)  # additive: saves nothing
    steps = torch.where(bad, 0, k - pinf.sum(-1))  # rounds per row
    # torch.func transforms refuse checkpointing (its saved-tensor hooks): plain autograd there
    plain = not (torch.is_grad_enabled() and z.requires_grad) or under_functorch()
    if k < _N3_CHECKPOINT_MIN or plain:
        A, z = _n3_rounds(z, A, steps, 0, k, k)
    else:
        # Segments of about sqrt(k) rounds, recomputed in the backward: the backward keeps
        # O(sqrt(k)) (B, n) tensors instead of O(k), for one more forward pass.
        size = math.isqrt(k - 1) + 1
        for t0 in range(0, k, size):
            A, z = checkpoint(
                _n3_rounds, z, A, steps, t0, min(k, t0 + size), k, use_reentrant=False
            )
    A = torch.where(pinf, 1.0, A)
    return torch.where(bad[:, None], math.nan, A)


def _n3_rounds(
    z: torch.Tensor, A: torch.Tensor, steps: torch.Tensor, t0: int, t1: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds t0..t1-1 of k; a row runs only its first ``steps`` rounds (its z then stays)."""
    for t in range(t0, t1):
        # Shift the largest logit to exactly 0 (A does not see the shift, so a constant shift
        # keeps the gradient exact): z then never drifts, and the entries near the top keep
        # their differences to the last bit however large |x|/eps is.
        z = z - z.amax(-1, keepdim=True).detach()
        w = torch.softmax(z, -1)
        A = A + torch.where((t < steps)[:, None], w, 0)
        if t + 1 < k:  # the last round needs no next logits
            z = torch.where((t + 1 < steps)[:, None], z + _log1m_softmax(z, w), z)
    return A, z


def _log1m_softmax(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``log(1 - w)`` for ``w = softmax(z)``, ``max z = 0``, without rounding w away.

    ``log1p(-w)`` where w <= 1/2; for the row's largest entry (z = 0) where its w > 1/2 (at
    most one), ``log(1 - w) = logsigmoid(r - z_top)`` with r the log-sum-exp of the row
    without it (``1 - w = e^r / (e^z_top + e^r)``). A row whose largest entry is its only one
    above -inf gets ``-inf`` there (w = 1 exactly): the caller never runs a round after it.
    """
    n = z.shape[-1]
    first = torch.arange(n, device=z.device) == z.argmax(-1, keepdim=True)
    top = first & (w > 0.5)  # one entry at most, even with ties
    rest = torch.where(top, -math.inf, z)
    has_rest = (rest > -math.inf).any(-1, keepdim=True)
    r = torch.logsumexp(torch.where(has_rest, rest, 0), -1, keepdim=True)
    # z_top is 0 in value, but it carries the gradient that log(1 - w_top) has in it
    z_top = torch.where(top, z, 0).sum(-1, keepdim=True)
    log1m_top = torch.where(has_rest, torch.nn.functional.logsigmoid(r - z_top), -math.inf)
    return torch.where(top, log1m_top, torch.log1p(-torch.where(top, 0, w)))
