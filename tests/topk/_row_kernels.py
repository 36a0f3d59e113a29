"""What the tests of the "ot" row kernel share: a batch of rows, most of which the kernel must
leave to the torch code, the check that a merged solve is the torch code's, and the one that
``torch.func`` transforms agree with the plain call's results."""

from __future__ import annotations

import math

import torch

import softops
from tests._helpers import seeded

F64 = torch.float64


def flagged_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, k, epsilon) of 7 rows of 40, float64: special rows (an infinity, a NaN, k at the
    count of finite entries, a huge epsilon: the scaled solve, and k = 0) among two regular ones,
    a clean row (0) and a near-hard one (5, which the "ot" kernel polishes as the torch code
    does). The "ot" kernel leaves rows 1, 2 and 4 to the torch code and fills rows 3 and 6 at
    their limits."""
    x = torch.randn(7, 40, generator=seeded(9), dtype=F64)
    x[1, 3] = math.inf
    x[2, 5] = math.nan
    x[3, :5] = -math.inf
    x[5] *= 50
    k = torch.tensor([3.0, 3.0, 3.0, 35.0, 3.0, 20.0, 0.0], dtype=F64)
    eps = torch.tensor([0.3, 0.3, 0.3, 0.3, 1e300, 1e-3, 0.3], dtype=F64)
    return x, k, eps


def assert_merged_solve(got: tuple, want: tuple) -> None:
    """A kernel's merged ``_solve`` result equals the torch code's (``want``)."""
    torch.testing.assert_close(got[1], want[1], equal_nan=True, atol=1e-14, rtol=0)
    torch.testing.assert_close(got[3], want[3], equal_nan=True, atol=1e-12, rtol=0)
    for name in ("m", "t", "residual"):
        torch.testing.assert_close(
            getattr(got[0], name), getattr(want[0], name), equal_nan=True, atol=1e-12, rtol=0
        )
    for name in ("converged", "sel_none", "sel_all", "invalid", "scale"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    assert not got[4]


def assert_transforms_agree(x: torch.Tensor) -> None:
    """vmap and ``torch.func.grad`` of the mask of ``x`` equal the plain call and autograd."""
    batched = torch.func.vmap(lambda r: softops.soft_topk_mask(r, 4, epsilon=0.2))(x)
    torch.testing.assert_close(
        batched, softops.soft_topk_mask(x, 4, epsilon=0.2), atol=1e-14, rtol=0
    )
    g = torch.func.grad(lambda r: (softops.soft_topk_mask(r, 4, epsilon=0.2) ** 2).sum())(x)
    xt = x.clone().requires_grad_()
    (want,) = torch.autograd.grad((softops.soft_topk_mask(xt, 4, epsilon=0.2) ** 2).sum(), xt)
    torch.testing.assert_close(g, want, atol=1e-13, rtol=0)
