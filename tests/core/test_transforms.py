"""softops._core.transforms: detecting an active torch.func transform."""

from __future__ import annotations

import pytest
import torch
from torch import func

from softops._core.transforms import under_functorch


def test_under_functorch_only_inside_a_transform():
    assert not under_functorch()
    seen = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(under_functorch())
        return t.sum()

    func.grad(probe)(torch.ones(3))
    func.vmap(probe)(torch.ones(2, 3))
    assert seen == [True, True]
    assert not under_functorch()


def test_unreadable_marks_batched_meta_and_traced_tensors_only():
    from softops._core.transforms import unreadable

    plain_k = torch.tensor(2.0)
    assert not unreadable(plain_k)
    assert unreadable(torch.empty(3, device="meta"))
    seen = {}

    def probe(x):
        seen["batched"] = unreadable(x)
        seen["closed_over"] = unreadable(plain_k)  # a plain tensor inside the transform
        return x

    func.vmap(probe)(torch.ones(4, 2))
    assert seen == {"batched": True, "closed_over": False}
    func.grad(lambda x: (probe(x) * 1.0).sum())(torch.ones(3))
    assert seen == {"batched": False, "closed_over": False}  # grad wrappers stay readable
    func.vmap(lambda x: func.grad(lambda y: probe(y).sum())(x))(torch.ones(2, 3))
    assert seen["batched"] is True  # batched under a grad level


def test_apply_function_equals_function_apply_eagerly_and_under_transforms():
    from softops._core.transforms import apply_function

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(x, scale):
            return x * x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * ctx.scale * grad, None

    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = apply_function(Square, x, 2.0)
    torch.testing.assert_close(y, Square.apply(x, 2.0))
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, 4 * x.detach())
    # under torch.func it goes through Function.apply (which torch.func needs)
    gf = torch.func.grad(lambda t: apply_function(Square, t, 2.0).sum())(x.detach())
    torch.testing.assert_close(gf, 4 * x.detach())


class _RowScale(torch.autograd.Function):
    """A row-wise Function with its own jvp and vmap rule: y = x * w (w per row)."""

    @staticmethod
    def forward(x, w):
        return x * w[:, None]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w[:, None], None

    @staticmethod
    def jvp(ctx, dx, dw):
        raise AssertionError("the custom jvp must not run")

    @staticmethod
    def vmap(info, in_dims, x, w):
        from softops._core.transforms import vmap_rows

        return vmap_rows(_RowScale, info, in_dims, x, w)


def test_without_jvp_keeps_forward_backward_and_vmap_and_drops_the_custom_jvp():
    from softops._core.transforms import without_jvp

    traced = without_jvp(_RowScale)
    assert traced.__name__ == "_RowScaleTraced" and issubclass(traced, _RowScale)
    assert traced.jvp is torch.autograd.Function.jvp  # the base rule: dynamo accepts it
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = traced.apply(x, w)
    torch.testing.assert_close(y, x * w[:, None], rtol=0, atol=0)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, w[:, None].expand(3, 4), rtol=0, atol=0)
    # its vmap rule is its own (rows merged into B), not the base class's
    xs = torch.randn(5, 3, 4, dtype=torch.float64)
    ys = func.vmap(lambda t: traced.apply(t, w.repeat(1)), in_dims=0)(xs)
    torch.testing.assert_close(ys, xs * w[:, None], rtol=0, atol=0)
    with pytest.raises(RuntimeError):  # the base jvp: forward mode is refused, not wrong
        func.jvp(lambda t: traced.apply(t, w), (x.detach(),), (torch.ones_like(x),))
