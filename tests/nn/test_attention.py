"""topk_attention and TopKAttention: SDPA / MultiheadAttention at k = S, the hard limit, masks
honoured exactly, k clamped per query, gradients, and the Module's round trips and checks."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from softops.nn import TopKAttention, topk_attention, topk_attention_weights
from tests._helpers import seeded

F64 = torch.float64


def _qkv(n=2, h=3, lq=5, s=7, e=4, ev=3, dtype=F64, seed=0, grad=False):
    g = seeded(seed)
    q = torch.randn(n, h, lq, e, generator=g, dtype=F64).to(dtype)
    k = torch.randn(n, h, s, e, generator=g, dtype=F64).to(dtype)
    v = torch.randn(n, h, s, ev, generator=g, dtype=F64).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _hard(q, k, v, kk, mode, allowed=None, scale=None):
    """Hard top-k attention written out: keep the kk best valid keys (all if fewer)."""
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    order = s.argsort(-1, descending=True)
    n_valid = (s > -math.inf).sum(-1, keepdim=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1]).expand_as(s))
    keep = (rank < kk) & (rank < n_valid)
    if mode == "mean":
        w = keep.to(s.dtype) / keep.sum(-1, keepdim=True).clamp(min=1)
    else:
        w = torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
    return w @ v


# ------------------------------------------------------------------- SDPA at k = S, hard limit


@pytest.mark.parametrize("k", [7, 9.5])
def test_k_at_least_the_keys_is_sdpa(k):
    q, kk, v = _qkv()
    torch.testing.assert_close(
        topk_attention(q, kk, v, k), F.scaled_dot_product_attention(q, kk, v)
    )


def test_sdpa_masks_at_k_equal_s():
    q, kk, v = _qkv()
    g = seeded(3)
    bool_mask = torch.rand(5, 7, generator=g) > 0.3
    bool_mask[:, 0] = True  # every query keeps a key (SDPA is NaN otherwise)
    float_mask = torch.randn(2, 3, 5, 7, generator=g, dtype=F64)
    float_mask[..., 1] = -math.inf
    for kw in ({"attn_mask": bool_mask}, {"attn_mask": float_mask}, {"is_causal": True}):
        got = topk_attention(q, kk, v, 7, **kw)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, kk, v, **kw))


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_small_epsilon_is_hard_topk_attention(mode):
    q, kk, v = _qkv(seed=1)
    got = topk_attention(q, kk, v, 3, epsilon=1e-6, mode=mode)
    torch.testing.assert_close(got, _hard(q, kk, v, 3, mode), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_hard_is_straight_through(mode):
    q, kk, v = _qkv(seed=2, grad=True)
    out = topk_attention(q, kk, v, 3, epsilon=0.5, mode=mode, hard=True)
    torch.testing.assert_close(out, _hard(q, kk, v, 3, mode), rtol=0, atol=1e-12)
    ct = torch.randn(out.shape, generator=seeded(4), dtype=F64)
    g_hard = torch.autograd.grad((out * ct).sum(), (q, kk))
    soft = topk_attention(q, kk, v, 3, epsilon=0.5, mode=mode)
    g_soft = torch.autograd.grad((soft * ct).sum(), (q, kk))
    for a, b in zip(g_hard, g_soft, strict=True):  # through q and k: the soft weights' gradient
        torch.testing.assert_close(a, b)


def test_mean_mode_is_the_soft_mask_over_k():
    q, kk, _ = _qkv(seed=5)
    w = topk_attention_weights(q, kk, 2.5, epsilon=0.3, mode="mean")
    torch.testing.assert_close(w.weights, w.mask / 2.5)
    torch.testing.assert_close(w.mask.sum(-1), torch.full((2, 3, 5), 2.5, dtype=F64))


def test_softmax_mode_formula():
    q, kk, _ = _qkv(seed=6)
    w = topk_attention_weights(q, kk, 3, epsilon=0.2)
    s = q @ kk.transpose(-2, -1) / 2
    want = w.mask * s.exp() / (w.mask * s.exp()).sum(-1, keepdim=True)
    torch.testing.assert_close(w.weights, want)


# ------------------------------------------------------------------ masks, clamped k, NaN rows


def test_masked_keys_get_weight_and_gradient_exactly_zero():
    q, kk, v = _qkv(seed=7, grad=True)
    pad = torch.zeros(2, 7, dtype=torch.bool)  # True: padding, as in nn.MultiheadAttention
    pad[0, 2:5] = True
    for mode in ("softmax", "mean"):
        w = topk_attention_weights(q, kk, 3, epsilon=0.3, key_padding_mask=pad, mode=mode)
        assert (w.weights[0][..., 2:5] == 0).all() and (w.mask[0][..., 2:5] == 0).all()
        out = topk_attention(q, kk, v, 3, epsilon=0.3, key_padding_mask=pad, mode=mode)
        gk, gv = torch.autograd.grad(out.sum(), (kk, v))
        assert (gk[0, :, 2:5] == 0).all() and (gv[0, :, 2:5] == 0).all()
        assert gk[0, :, :2].abs().sum() > 0


def test_causal_mask_is_honoured_exactly():
    q, kk, _ = _qkv(lq=7, seed=8)
    w = topk_attention_weights(q, kk, 3, epsilon=0.3, is_causal=True).weights
    assert (w.triu(1) == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7, dtype=F64))


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_fewer_valid_keys_than_k_uses_them_all_and_none_gives_zeros(mode):
    q, kk, v = _qkv(lq=7, s=7, seed=9, grad=True)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1] = True  # batch 1: no key at all
    w = topk_attention_weights(
        q, kk, 4, epsilon=0.2, is_causal=True, key_padding_mask=pad, mode=mode
    )
    n_valid = torch.arange(1, 8, dtype=F64).clamp(max=4)
    torch.testing.assert_close(w.mask[0].sum(-1), n_valid.expand(3, 7))
    torch.testing.assert_close(w.weights[0].sum(-1), torch.ones(3, 7, dtype=F64))
    assert (w.weights[1] == 0).all() and (w.mask[1] == 0).all()
    out = topk_attention(q, kk, v, 4, epsilon=0.2, is_causal=True, key_padding_mask=pad, mode=mode)
    assert (out[1] == 0).all() and not out.isnan().any()
    # the first query sees one key: its output is that key's value
    torch.testing.assert_close(out[0, :, 0], v[0, :, 0].detach())
    grads = torch.autograd.grad(out.sum(), (q, kk, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][1] == 0).all()
    want = _hard(q, kk, v, 4, mode, allowed=torch.ones(7, 7).tril().bool() & ~pad[:, None, None])
    hard = topk_attention(
        q, kk, v, 4, epsilon=1e-7, is_causal=True, key_padding_mask=pad, mode=mode
    )
    torch.testing.assert_close(hard, want, rtol=1e-6, atol=1e-6)


def test_nan_in_one_query_stays_in_its_row():
    q, kk, v = _qkv(seed=10)
    q[0, 1, 2, 0] = math.nan
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 0] = True
    out = topk_attention(q, kk, v, 3, epsilon=0.3, key_padding_mask=pad)
    assert out[0, 1, 2].isnan().all()
    bad = torch.zeros(out.shape, dtype=torch.bool)
    bad[0, 1, 2] = True
    assert not out[~bad].isnan().any()


def test_batch_equals_a_loop_and_float32_matches_float64():
    q, kk, v = _qkv(seed=11)
    pad = torch.rand(2, 7, generator=seeded(12)) <= 0.4
    out = topk_attention(q, kk, v, 2, epsilon=0.2, key_padding_mask=pad, is_causal=True)
    for b in range(2):
        one = topk_attention(
            q[b], kk[b], v[b], 2, epsilon=0.2, key_padding_mask=pad[b], is_causal=True
        )
        torch.testing.assert_close(out[b], one)
    out32 = topk_attention(
        q.float(), kk.float(), v.float(), 2, epsilon=0.2, key_padding_mask=pad, is_causal=True
    )
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_gradcheck(mode):
    q, kk, v = _qkv(n=1, h=2, lq=4, s=6, e=3, ev=2, seed=13, grad=True)
    pad = torch.tensor([[False, False, True, False, False, False]])

    def fn(q, kk, v):
        return topk_attention(
            q, kk, v, 2.5, epsilon=0.3, key_padding_mask=pad, is_causal=True, mode=mode
        )

    assert torch.autograd.gradcheck(fn, (q, kk, v))
    assert torch.autograd.gradgradcheck(fn, (q, kk, v))


def test_gradient_matches_central_differences_near_hard():
    q, kk, v = _qkv(n=1, h=1, lq=3, s=6, e=3, seed=14)
    ct = torch.randn(1, 1, 3, 3, generator=seeded(15), dtype=F64)
    dq = torch.randn(q.shape, generator=seeded(16), dtype=F64)

    def f(qq):
        return (topk_attention(qq, kk, v, 2, epsilon=0.02) * ct).sum()

    qg = q.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(qg), qg)
    h = 1e-6
    fd = (f(q + h * dq) - f(q - h * dq)) / (2 * h)
    torch.testing.assert_close((g * dq).sum(), fd, rtol=1e-5, atol=1e-7)


def test_module_gradients_reach_every_projection():
    torch.manual_seed(0)
    layer = TopKAttention(8, 2, 3, batch_first=True).double()
    x = torch.randn(2, 6, 8, dtype=F64)
    out, _ = layer(x, x, x)
    out.square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------------- Module


def _mha_pair(batch_first, bias=True, kdim=None, vdim=None, seed=1):
    """A float64 MultiheadAttention and the TopKAttention converted from it at k = S = 6."""
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(
        8, 2, bias=bias, batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=F64
    )
    return mha, TopKAttention.from_multihead_attention(mha, k=6)


def _inputs(batch_first, kdim=8, vdim=8, seed=5):
    g = seeded(seed)

    def draw(n, e):
        return torch.randn((3, n, e) if batch_first else (n, 3, e), generator=g, dtype=F64)

    return draw(6, 8), draw(6, kdim), draw(6, vdim)


MHA_MASKS = {
    "none": lambda pad, causal, fl: {},
    "padding": lambda pad, causal, fl: {"key_padding_mask": pad},
    "causal": lambda pad, causal, fl: {"attn_mask": causal},
    "both": lambda pad, causal, fl: {
        "attn_mask": causal,
        "key_padding_mask": pad,
        "average_attn_weights": False,
    },
    "float": lambda pad, causal, fl: {"attn_mask": fl},
    "float padding": lambda pad, causal, fl: {
        "attn_mask": fl,
        "key_padding_mask": torch.zeros(pad.shape, dtype=F64).masked_fill(pad, -math.inf),
    },
    "heads": lambda pad, causal, fl: {"attn_mask": causal.repeat(6, 1, 1)},
}


def _masks():
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True  # MultiheadAttention's convention: True is padding
    pad[2, 1] = True
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True: may not attend
    fl = torch.randn(6, 6, generator=seeded(3), dtype=F64)
    fl[causal] = -math.inf
    return pad, causal, fl


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dims", [(None, None), (5, 7)])  # packed in_proj_weight, or three
@pytest.mark.parametrize("mask", list(MHA_MASKS))
def test_module_equals_multihead_attention_at_k_equal_s(batch_first, bias, dims, mask):
    # converted from a MultiheadAttention, at k = the number of keys: its outputs, weights and
    # gradients (in the inputs and every weight), for self attention (one packed projection),
    # a shared key and value (two) and three inputs
    mha, layer = _mha_pair(batch_first, bias, *dims)
    q, kx, vx = _inputs(batch_first, *(d or 8 for d in dims))
    kw = MHA_MASKS[mask](*_masks())
    cases = {"three": (q, kx, vx)}
    if dims == (None, None):
        cases |= {"self": (q, q, q), "key is value": (q, kx, kx)}
    for inputs in cases.values():
        outs = []
        for module in (layer, mha):
            xs = [x.clone().requires_grad_() for x in dict.fromkeys(inputs)]
            by_id = dict(zip(dict.fromkeys(inputs), xs, strict=True))
            out, w = module(*(by_id[x] for x in inputs), **kw)
            params = list(module.parameters())
            grads = torch.autograd.grad((out * torch.cos(out)).sum(), [*xs, *params])
            outs.append((out, w, *grads))
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("batch_first", [False, True])
def test_module_equals_multihead_attention_unbatched(batch_first):
    mha, layer = _mha_pair(batch_first)
    x, kv, _ = _inputs(False)
    x, kv = x[:, 0], kv[:, 0]  # (L, E): batch_first does not apply
    pad = torch.zeros(6, dtype=torch.bool)
    pad[4:] = True
    for kw in ({}, {"key_padding_mask": pad}, {"attn_mask": _masks()[1]}):
        got, gw = layer(x, kv, kv, **kw)
        want, ww = mha(x, kv, kv, **kw)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gw, ww)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dims", [(None, None), (5, 7)])
def test_module_loads_multihead_attention_checkpoints_and_starts_as_it(bias, dims):
    # the same parameters (names, shapes, order), the same initial weights under one seed, and
    # MultiheadAttention's state dict loads as is
    torch.manual_seed(7)
    mha = torch.nn.MultiheadAttention(8, 2, bias=bias, kdim=dims[0], vdim=dims[1])
    torch.manual_seed(7)
    layer = TopKAttention(8, 2, 3, bias=bias, kdim=dims[0], vdim=dims[1])
    want = mha.state_dict()
    got = layer.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    other = torch.nn.MultiheadAttention(8, 2, bias=bias, kdim=dims[0], vdim=dims[1])
    assert layer.load_state_dict(other.state_dict()) is not None
    for name, value in other.state_dict().items():
        assert torch.equal(layer.state_dict()[name], value), name


def _old_layout(layer: TopKAttention) -> dict:
    """The layer's weights in the earlier layout of TopKAttention: q_proj, k_proj and v_proj
    Linear layers."""
    state = {}
    if layer.in_proj_weight is not None:
        weights = layer.in_proj_weight.detach().chunk(3)
    else:
        weights = [
            p.detach() for p in (layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight)
        ]
    biases = [None] * 3 if layer.in_proj_bias is None else layer.in_proj_bias.detach().chunk(3)
    for name, w, b in zip("qkv", weights, biases, strict=True):
        state[f"{name}_proj.weight"] = w.clone()
        if b is not None:
            state[f"{name}_proj.bias"] = b.clone()
    for name, value in layer.out_proj.state_dict().items():
        state[f"out_proj.{name}"] = value.clone()
    return state


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dims", [(None, None), (5, 7)])
def test_state_dicts_of_the_earlier_layout_still_load(bias, dims):
    torch.manual_seed(8)
    source = TopKAttention(8, 2, 3, bias=bias, kdim=dims[0], vdim=dims[1], batch_first=True)
    layer = TopKAttention(8, 2, 3, bias=bias, kdim=dims[0], vdim=dims[1], batch_first=True)
    layer.load_state_dict(_old_layout(source))
    for name, value in source.state_dict().items():
        assert torch.equal(layer.state_dict()[name], value), name
    # inside a model too (the keys carry a prefix)
    model = torch.nn.Sequential(TopKAttention(8, 2, 3, bias=bias, kdim=dims[0], vdim=dims[1]))
    model.load_state_dict({f"0.{key}": value for key, value in _old_layout(source).items()})
    assert torch.equal(model[0].out_proj.weight, source.out_proj.weight)
    # an incomplete one is refused by name
    partial = _old_layout(source)
    del partial["v_proj.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .*proj_weight"):
        TopKAttention(8, 2, 3, bias=bias, kdim=dims[0], vdim=dims[1]).load_state_dict(partial)


def test_from_multihead_attention_copies_options_and_refuses_what_it_cannot_hold():
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.25, bias=False, batch_first=True, vdim=5)
    mha.eval()
    layer = TopKAttention.from_multihead_attention(
        mha, k=2, epsilon=0.3, mode="mean", method="sparse", hard=True
    )
    assert (layer.dropout, layer.in_proj_bias, layer.out_proj.bias) == (0.25, None, None)
    assert (layer.batch_first, layer.kdim, layer.vdim, layer.training) == (True, 8, 5, False)
    assert (layer.k, layer.epsilon, layer.mode, layer.method, layer.hard) == (
        2,
        0.3,
        "mean",
        "sparse",
        True,
    )
    assert layer.q_proj_weight is not mha.q_proj_weight  # a copy
    assert torch.equal(layer.q_proj_weight, mha.q_proj_weight)
    with pytest.raises(TypeError, match=r"from_multihead_attention: expected a torch.nn.Multi"):
        TopKAttention.from_multihead_attention(torch.nn.Linear(8, 8), k=2)
    for kw in ({"add_bias_kv": True}, {"add_zero_attn": True}):
        other = torch.nn.MultiheadAttention(8, 2, **kw)
        with pytest.raises(ValueError, match=r"without add_bias_kv and add_zero_attn"):
            TopKAttention.from_multihead_attention(other, k=2)
    biased = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(RuntimeError, match=r"holds `bias_k`, a MultiheadAttention with add_bias"):
        TopKAttention(8, 2, 3).load_state_dict(biased.state_dict())
    with pytest.raises(ValueError, match=r"k=-1"):
        TopKAttention.from_multihead_attention(mha, k=-1)


def test_function_key_padding_mask_is_multihead_attentions_true_is_padding():
    """topk_attention's key_padding_mask follows nn.MultiheadAttention (True = padding); its
    attn_mask keeps SDPA's (bool True = may attend): at k = S both equal SDPA with the padding
    as a "may attend" mask ``~pad``, and ``key_padding_mask=pad`` equals ``attn_mask=~pad``."""
    q, kk, v = _qkv(seed=30)
    pad = torch.rand(2, 7, generator=seeded(31)) > 0.6
    pad[:, 0] = False  # every query keeps a key (SDPA is NaN otherwise)
    may = ~pad[:, None, None, :]
    want = F.scaled_dot_product_attention(q, kk, v, attn_mask=may)
    torch.testing.assert_close(topk_attention(q, kk, v, 7, key_padding_mask=pad), want)
    for k in (2, 3.5):
        torch.testing.assert_close(
            topk_attention(q, kk, v, k, epsilon=0.2, key_padding_mask=pad),
            topk_attention(q, kk, v, k, epsilon=0.2, attn_mask=may),
        )
    w = topk_attention_weights(q, kk, 3, epsilon=0.2, key_padding_mask=pad).weights
    assert bool((w.masked_select(pad[:, None, None, :].expand(w.shape)) == 0).all())


def _module_by_the_function(layer, x, kv, key_padding_mask, attn_mask, is_causal):
    """TopKAttention's forward (batch_first) written with topk_attention on its projections,
    the masks given to the function in its own conventions: key_padding_mask as is (both take
    MultiheadAttention's), a bool attn_mask inverted (SDPA's), a float one as is."""
    N, L, E = x.shape
    S, H = kv.shape[1], layer.num_heads

    def heads(t, length):
        return t.reshape(N, length, H, E // H).transpose(1, 2)

    wq, wk, wv = layer.in_proj_weight.chunk(3)
    bq, bk, bv = layer.in_proj_bias.chunk(3)
    q, kk = heads(F.linear(x, wq, bq), L), heads(F.linear(kv, wk, bk), S)
    v = heads(F.linear(kv, wv, bv), S)
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.reshape(N, H, L, S)
        attn_mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
    out = topk_attention(
        q,
        kk,
        v,
        layer.k,
        epsilon=layer.epsilon,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        mode=layer.mode,
        hard=layer.hard,
        method=layer.method,
    )
    return layer.out_proj(out.transpose(1, 2).reshape(N, L, E))


@pytest.mark.parametrize(
    ("mode", "method", "hard"),
    [("softmax", "ot", False), ("mean", "sparse", False), ("softmax", "ot", True)],
)
def test_function_and_module_agree_for_the_same_masks(mode, method, hard):
    torch.manual_seed(32)
    layer = TopKAttention(
        8, 2, 3, epsilon=0.3, mode=mode, method=method, hard=hard, batch_first=True
    ).double()
    g = seeded(33)
    x = torch.randn(3, 5, 8, generator=g, dtype=F64)
    kv = torch.randn(3, 6, 8, generator=g, dtype=F64)
    pad = torch.rand(3, 6, generator=g) > 0.6
    pad[:, 1] = False
    pad[2] = True  # a batch with no key: zeros
    bool_mask = torch.rand(5, 6, generator=g) > 0.7  # MultiheadAttention's: True = masked
    heads_mask = torch.rand(6, 5, 6, generator=g) > 0.7
    float_mask = torch.randn(5, 6, generator=g, dtype=F64)
    float_mask[bool_mask] = -math.inf
    for key_padding_mask in (None, pad):
        for attn_mask in (None, bool_mask, heads_mask, float_mask):
            for is_causal in (False, True):
                got, _ = layer(
                    x,
                    kv,
                    kv,
                    key_padding_mask=key_padding_mask,
                    attn_mask=attn_mask,
                    is_causal=is_causal,
                )
                want = _module_by_the_function(layer, x, kv, key_padding_mask, attn_mask, is_causal)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert bool((layer(x, kv, kv, key_padding_mask=pad)[1][2] == 0).all())


def test_module_is_causal_applies_the_mask_and_need_weights():
    torch.manual_seed(2)
    layer = TopKAttention(4, 1, 2, batch_first=True)
    x = torch.randn(2, 5, 4)
    out, w = layer(x, x, x, is_causal=True)
    assert (w.triu(1) == 0).all()
    out2, none = layer(x, x, x, is_causal=True, need_weights=False)
    assert none is None
    torch.testing.assert_close(out, out2)


def test_module_round_trips():
    torch.manual_seed(3)
    layer = TopKAttention(8, 2, 3, epsilon=0.2, mode="mean", dropout=0.1, batch_first=True)
    layer.eval()
    x = torch.randn(2, 5, 8)
    want = layer(x, x, x)[0]
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        torch.testing.assert_close(other(x, x, x)[0], want)
    fresh = TopKAttention(8, 2, 3, epsilon=0.2, mode="mean", dropout=0.1, batch_first=True).eval()
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    torch.testing.assert_close(fresh(x, x, x)[0], want)
    assert repr(layer).startswith(
        "TopKAttention(\n  embed_dim=8, num_heads=2, k=3, epsilon=0.2, mode='mean', method='ot', "
        "hard=False, dropout=0.1, batch_first=True\n"
    )


def test_dropout_only_in_training():
    torch.manual_seed(4)
    layer = TopKAttention(4, 1, 2, dropout=0.5, batch_first=True)
    x = torch.randn(1, 6, 4)
    layer.eval()
    a, b = layer(x, x, x)[0], layer(x, x, x)[0]
    torch.testing.assert_close(a, b)
    layer.train()
    assert not torch.allclose(layer(x, x, x)[0], layer(x, x, x)[0])


# ------------------------------------------------------------------------------------- errors

ERRORS = [
    (lambda: TopKAttention(6, 4, 2), ValueError, r"TopKAttention: expected `embed_dim` divisible"),
    (
        lambda: TopKAttention(0, 1, 2),
        ValueError,
        r"TopKAttention: expected `embed_dim` to be an int",
    ),
    (lambda: TopKAttention(4, 1, -1), ValueError, r"TopKAttention: expected `k` >= 0 .*k=-1"),
    (lambda: TopKAttention(4, 1, "2"), TypeError, r"TopKAttention: expected `k` to be a number"),
    (lambda: TopKAttention(4, 1, 2.5, hard=True), ValueError, r"an integer `k` with hard=True"),
    (
        lambda: TopKAttention(4, 1, 2, epsilon=0),
        ValueError,
        r"TopKAttention: expected `epsilon` > 0",
    ),
    (lambda: TopKAttention(4, 1, 2, mode="max"), ValueError, r"`mode` to be one of"),
    (lambda: TopKAttention(4, 1, 2, method="softkmax"), ValueError, r"`method` to be one of"),
    (lambda: TopKAttention(4, 1, 2, dropout=1.0), ValueError, r"expected 0 <= `dropout` < 1"),
    (lambda: TopKAttention(4, 1, 2, batch_first=1), TypeError, r"`batch_first` to be a bool"),
    (lambda: TopKAttention(4, 1, 2, kdim=0), ValueError, r"`kdim` to be None or an int >= 1"),
    (lambda: TopKAttention(4, 1, 2, vdim=2.0), ValueError, r"`vdim` to be None or an int >= 1"),
]


@pytest.mark.parametrize(("build", "error", "match"), ERRORS)
def test_module_checks_at_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_function_errors():
    q, kk, v = _qkv()
    cases = [
        ({"k": -1}, ValueError, r"topk_attention: expected `k` >= 0 and finite; got k=-1"),
        ({"epsilon": -1.0}, ValueError, r"topk_attention: expected `epsilon` > 0"),
        ({"mode": "x"}, ValueError, r"topk_attention: expected `mode` to be one of"),
        ({"attn_mask": torch.ones(5, 7, dtype=torch.int64)}, TypeError, r"bool or floating"),
        ({"key_padding_mask": torch.ones(2, 6, dtype=torch.bool)}, ValueError, r"S = 7 keys"),
        ({"key_padding_mask": torch.ones(2, 7)}, TypeError, r"`key_padding_mask` to be a bool"),
        ({"dropout_p": 1.5}, ValueError, r"expected 0 <= `dropout_p` < 1"),
        ({"hard": True, "k": 1.5}, ValueError, r"an integer `k` with hard=True"),
    ]
    for kw, error, match in cases:
        args = {"k": 2, **kw}
        k = args.pop("k")
        with pytest.raises(error, match=match):
            topk_attention(q, kk, v, k, **args)
    with pytest.raises(TypeError, match=r"topk_attention: expected `query` to have a real float"):
        topk_attention(q.long(), kk, v, 2)
    with pytest.raises(ValueError, match=r"same last dim E; got 4 and 3"):
        topk_attention(q, kk[..., :3], v, 2)
    with pytest.raises(
        ValueError, match=r"`value` of shape \(\.\.\., S, Ev\) with the keys' S = 7"
    ):
        topk_attention(q, kk, v[..., :6, :], 2)
    layer = TopKAttention(4, 1, 2)
    x = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match=r"TopKAttention: expected `key_padding_mask` of shape"):
        layer(x, x, x, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"TopKAttention: expected `attn_mask` of shape \(5, 5\)"):
        layer(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_hard_weights_have_exactly_k_nonzero_entries_and_k0_gives_zeros(mode):
    q, kk, v = _qkv(seed=17)
    w = topk_attention_weights(q, kk, 3, epsilon=0.3, mode=mode, hard=True).weights
    assert ((w > 0).sum(-1) == 3).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5, dtype=F64))
    out = topk_attention(q.requires_grad_(), kk, v, 0, epsilon=0.3, mode=mode)
    assert (out == 0).all()
    (g,) = torch.autograd.grad(out.sum(), q)
    assert (g == 0).all()


# ---------------------------------------------------------------------- method="sparse"


@pytest.mark.parametrize("mode", ["softmax", "mean"])
def test_sparse_method_gives_exact_zeros(mode):
    q, kk, v = _qkv(seed=11, grad=True)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    w = topk_attention_weights(
        q, kk, 2, epsilon=0.05, key_padding_mask=pad, mode=mode, method="sparse"
    )
    torch.testing.assert_close(w.mask.sum(-1), torch.full(w.mask.shape[:-1], 2.0, dtype=q.dtype))
    assert (w.weights == 0).sum(-1).min() >= 4  # of 7 keys, at least 4 are skipped exactly
    assert (w.weights[1][..., 5:] == 0).all()
    torch.testing.assert_close(w.weights.sum(-1), torch.ones(w.weights.shape[:-1], dtype=q.dtype))
    out = topk_attention(
        q, kk, v, 2, epsilon=0.05, key_padding_mask=pad, mode=mode, method="sparse"
    )
    (gv,) = torch.autograd.grad(out.sum(), (v,))
    # a value whose key gets weight 0 in every query receives no gradient
    unused = (w.weights == 0).all(-2)
    assert (gv.abs().sum(-1)[unused] == 0).all()


def test_sparse_method_module():
    layer = TopKAttention(8, 2, 3, epsilon=0.1, method="sparse", batch_first=True).double()
    x = torch.randn(2, 5, 8, generator=seeded(3), dtype=torch.float64)
    out, _ = layer(x, x, x)
    assert out.shape == (2, 5, 8) and torch.isfinite(out).all()


def test_masked_softmax_exact_zeros_and_empty_rows():
    from softops.nn.attention import masked_softmax

    s = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0], [1.0, 1.0, 1.0]], dtype=F64)
    A = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.3, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    A.requires_grad_(True)
    s.requires_grad_(True)
    w = masked_softmax(s, A)
    want = A * s.exp() / (A * s.exp()).sum(-1, keepdim=True)
    torch.testing.assert_close(w[:2], want[:2])
    assert w[0, 1] == 0 and w[1, 2] == 0 and (w[2] == 0).all()  # exact zeros, an empty row
    gs, ga = torch.autograd.grad((w * torch.arange(3.0, dtype=F64)).sum(), (s, A))
    assert torch.isfinite(gs).all() and torch.isfinite(ga).all()
    assert (gs[2] == 0).all() and (ga[2] == 0).all()


def test_masked_softmax_product_form_is_the_log_form():
    # A p / sum(A p) (p = softmax(s)) against softmax(s + log A): values and gradients, with
    # masked keys (-inf scores, A = 0), a row without any A > 0, and a row whose selected
    # probabilities underflow (the log form then)
    from softops.nn.attention import masked_softmax

    g = torch.Generator().manual_seed(5)
    s = torch.randn(5, 9, generator=g, dtype=torch.float64)
    s[0, 6:] = -math.inf
    s[4] = torch.tensor([900.0, 0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.float64)
    A = torch.rand(5, 9, generator=g, dtype=torch.float64)
    A[0, 6:] = 0
    A[2] = 0
    A[4, 0] = 0
    s.requires_grad_()

    def log_form(s, A):
        log_a = torch.where(A > 0, torch.log(A.clamp(min=1e-300)), -math.inf)
        none = A.amax(-1, keepdim=True) <= 0
        return torch.softmax((s + log_a).masked_fill(none, 0.0), -1).masked_fill(none, 0.0)

    got, want = masked_softmax(s, A), log_form(s, A)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[0, 6:], torch.zeros(3, dtype=torch.float64)) and not got[2].any()
    w = torch.randn(5, 9, generator=g, dtype=torch.float64)
    (gs,) = torch.autograd.grad((got * w).sum(), s)
    (ref,) = torch.autograd.grad((want * w).sum(), s)
    torch.testing.assert_close(gs, ref)
    # rows without an underflow take the product form: its gradient in A too
    At = A[:2].clone().requires_grad_()
    torch.autograd.gradcheck(lambda a: masked_softmax(s[:2].detach(), a), (At,))
