r"""Top-k attention: each query attends to the soft top-k of its keys.

With scores :math:`s_j = \langle q, k_j \rangle \cdot \text{scale}` and the SOFT top-k mask
:math:`A = A_k(s)` of :func:`softops.soft_topk_mask` (values in [0, 1], summing to k), two modes
weight the values:

.. math::

    \text{"softmax"}:\quad w_j = \frac{A_j\, e^{s_j}}{\sum_l A_l\, e^{s_l}}
        = \mathrm{softmax}(s + \log A)_j, \qquad
    \text{"mean"}:\quad w_j = \frac{A_j}{k}.

"softmax" is the masked softmax of the paper's top-k attention (Xie et al. 2020, §4.3): at
``k`` = the number of keys it is exactly ``scaled_dot_product_attention``. "mean" is the soft
top-k mean of the values: as ``epsilon -> 0`` it is the plain mean of the values of the k best
keys. Both reach hard top-k attention as ``epsilon -> 0``.

Masks follow the torch functions their arguments come from: :func:`topk_attention`'s
``attn_mask`` is ``scaled_dot_product_attention``'s (bool True = *may* attend, float = added)
and its ``key_padding_mask`` ``nn.MultiheadAttention``'s (True = padding);
:class:`TopKAttention` follows ``nn.MultiheadAttention`` for both (bool True = may *not*
attend). A masked key gets weight and gradient exactly 0 (masks are added as -inf, so a NaN or
``+inf`` score makes its query's row NaN, masked or not). A query with fewer valid keys than
``k`` attends to all of them, and one with none gets zeros (SDPA gives NaN). With
``method="sparse"`` keys beyond a query's soft top-k get weight exactly 0.

References:
    Xie, Y., Dai, H., Chen, M., et al. (2020). Differentiable top-k with optimal transport.
    NeurIPS 33, section 4.3 (top-k attention).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from softops._core.transforms import cannot_branch
from softops._core.validation import check_bool, check_choice, check_epsilon, check_floating
from softops.topk import soft_topk_mask

__all__ = [
    "ATTENTION_METHODS",
    "ATTENTION_MODES",
    "TopKAttention",
    "TopKAttentionWeights",
    "topk_attention",
    "topk_attention_weights",
]

#: the weightings of the values by the soft mask (the module docstring)
ATTENTION_MODES = ("softmax", "mean")
#: the top-k methods that take a per-query k (needed to clamp k to the valid keys)
ATTENTION_METHODS = ("ot", "sparse")


class TopKAttentionWeights(NamedTuple):
    """What :func:`topk_attention_weights` returns."""

    weights: torch.Tensor  # (..., L, S): the attention weights, rows sum to 1 (or 0)
    mask: torch.Tensor  # (..., L, S): the soft top-k mask A, rows sum to the clamped k


def _check_k(op: str, k: Any, hard: bool) -> float:
    if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.requires_grad:
        k = k.item()
    if isinstance(k, bool) or not isinstance(k, numbers.Real):
        raise TypeError(f"{op}: expected `k` to be a number >= 0; got k={k!r}.")
    if not (float(k) >= 0 and math.isfinite(float(k))):
        raise ValueError(f"{op}: expected `k` >= 0 and finite; got k={k!r}.")
    if hard and not float(k).is_integer():
        raise ValueError(f"{op}: expected an integer `k` with hard=True; got k={k!r}.")
    return float(k)


def _check_dropout(op: str, name: str, p: Any) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{op}: expected `{name}` to be a float in [0, 1); got {p!r}.")
    if not 0 <= float(p) < 1:
        raise ValueError(f"{op}: expected 0 <= `{name}` < 1; got {name}={p!r}.")
    return float(p)


def _check_attention_options(
    op: str, k: Any, epsilon: Any, mode: Any, method: Any, hard: Any
) -> tuple[float, float | torch.Tensor]:
    check_bool(hard, op, "hard")
    kf = _check_k(op, k, hard)
    eps = check_epsilon(epsilon, op)
    check_choice(mode, ATTENTION_MODES, op, "mode")
    check_choice(method, ATTENTION_METHODS, op, "method")
    return kf, eps


def _allowed(
    op: str,
    scores: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores with float masks added, and the boolean "may attend" mask (None: all keys)."""
    L, S = scores.shape[-2:]
    allowed: list[torch.Tensor] = []  # the masks of the keys a query may attend to
    if is_causal:
        allowed.append(torch.ones(L, S, dtype=torch.bool, device=scores.device).tril())
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"{op}: expected `attn_mask` to be a tensor; got {attn_mask!r}.")
        if attn_mask.dtype == torch.bool:
            allowed.append(attn_mask)
        elif attn_mask.dtype.is_floating_point:
            scores = scores + attn_mask.to(scores.dtype)
        else:
            raise TypeError(
                f"{op}: expected a bool or floating `attn_mask`; got dtype={attn_mask.dtype}."
            )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"{op}: expected `key_padding_mask` to be a bool tensor (True: a padding key, to "
                f"ignore); got {key_padding_mask!r}."
            )
        if key_padding_mask.shape[-1] != S:
            raise ValueError(
                f"{op}: expected `key_padding_mask` of shape (N, S) with S = {S} keys; got "
                f"shape {tuple(key_padding_mask.shape)}."
            )
        if key_padding_mask.dim() == 2:  # (N, S) against (N, *, L, S)
            pad = key_padding_mask[(slice(None),) + (None,) * (scores.dim() - 2)]
        elif key_padding_mask.dim() == 1:  # unbatched
            pad = key_padding_mask
        else:
            raise ValueError(
                f"{op}: expected `key_padding_mask` of shape (N, S) or (S,); got shape "
                f"{tuple(key_padding_mask.shape)}."
            )
        allowed.append(~pad)  # nn.MultiheadAttention's convention: True is padding
    if attn_mask is not None and attn_mask.dtype.is_floating_point:
        allowed.append(scores != -math.inf)  # its -inf entries (NaN scores stay: NaN rows)
    return scores, functools.reduce(operator.and_, allowed) if allowed else None


def topk_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    k: int | float,
    *,
    epsilon: float | torch.Tensor = 0.1,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    mode: str = "softmax",
    hard: bool = False,
    scale: float | None = None,
    method: str = "ot",
) -> TopKAttentionWeights:
    r"""The weights of :func:`topk_attention` (and the soft top-k mask behind them).

    Args: as :func:`topk_attention` (without ``value`` and ``dropout_p``).

    Returns:
        A :class:`TopKAttentionWeights` ``(weights, mask)``, each ``(..., L, S)``: the weights
        sum to 1 over the keys (0 without a valid key), the mask to ``min(k, valid keys)``.
    """
    op = "topk_attention"
    kf, eps = _check_attention_options(op, k, epsilon, mode, method, hard)
    for name, t in (("query", query), ("key", key)):
        check_floating(t, op, name)
        if t.dim() < 2:
            raise ValueError(
                f"{op}: expected `{name}` of shape (..., {'L' if name == 'query' else 'S'}, E); "
                f"got shape {tuple(t.shape)}."
            )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"{op}: expected query and key with the same last dim E; got {query.shape[-1]} and "
            f"{key.shape[-1]}."
        )
    # epsilon against the dtype of the scores (their compute dtype's smallest normal number)
    eps = check_epsilon(eps, op, dtype=torch.promote_types(query.dtype, key.dtype))
    check_bool(is_causal, op, "is_causal")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if query.shape[-1] <= key.shape[-2]:  # scale the smaller of the query and the scores
        scores = torch.matmul(query * scale, key.transpose(-2, -1))
    else:
        scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    scores, allowed = _allowed(op, scores, attn_mask, key_padding_mask, is_causal)
    S = scores.shape[-1]
    k_top = min(kf, float(S))
    if allowed is None:
        k_row: float | torch.Tensor = k_top
        masked = scores
    else:
        # The masks, in their own broadcast shape, are added as -inf (as SDPA does): a masked
        # key's A, weight and gradient are exactly 0.
        bias = torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device)
        masked = scores + bias.masked_fill_(~allowed, -math.inf)
        n_valid = allowed.sum(-1).expand(scores.shape[:-1])
        # the top-k of the valid keys, k clamped per query; a query with none selects nothing
        # (its scores are replaced by zeros so that the solver sees a finite row)
        k_row = n_valid.clamp(max=k_top).to(scores.dtype)
        empty = n_valid == 0
        if cannot_branch(empty) or bool(empty.any()):
            masked = masked.masked_fill(empty[..., None], 0.0)
    A = soft_topk_mask(masked, k_row, epsilon=eps, method=method)
    weights = mask_weights(masked, A, k_row, mode)
    if hard:
        A_hard = _hard_mask(masked.detach(), k_row, int(k_top))
        w_hard = mask_weights(masked.detach(), A_hard, k_row, mode)
        weights = w_hard + (weights - weights.detach())  # straight-through
        A = A_hard + (A - A.detach())
    return TopKAttentionWeights(weights, A)


def mask_weights(
    scores: torch.Tensor,
    A: torch.Tensor,
    k_row: float | torch.Tensor,
    mode: str,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weights of ``mode`` from the mask A, exactly 0 where A is (probs: softmax(scores))."""
    if mode == "mean":
        if isinstance(k_row, torch.Tensor):
            return A / k_row.clamp(min=1e-30)[..., None]  # k_row = 0: A = 0, so w = 0
        return A / k_row if k_row > 0 else A * 0
    return masked_softmax(scores, A, probs)


def masked_softmax(
    scores: torch.Tensor, A: torch.Tensor, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(scores + log A)`` on the last dim, exactly 0 where A is 0: ``A p / sum(A p)``
    (``p`` = ``probs`` or ``softmax(scores)``), or the log-domain form for zero rows and traces."""
    if not cannot_branch(A):
        p = torch.softmax(scores, -1) if probs is None else probs
        weighted = A * p
        total = weighted.sum(-1, keepdim=True)
        if bool((total > 0).all()):
            return weighted * total.reciprocal()
    tiny = torch.finfo(A.dtype).tiny
    # log A is -inf where A = 0 (the where keeps that entry's gradient 0, not 0 * inf)
    log_a = torch.where(A > 0, torch.log(A.clamp(min=tiny)), -math.inf)
    logits = scores + log_a  # (a masked key's score is -inf, and its A 0: -inf either way)
    none = A.amax(-1, keepdim=True) <= 0  # (A >= 0; a NaN row stays NaN)
    return torch.softmax(logits.masked_fill(none, 0.0), -1).masked_fill(none, 0.0)


def _hard_mask(scores: torch.Tensor, k_row: float | torch.Tensor, k_max: int) -> torch.Tensor:
    """The 0/1 mask of the k_row best keys of each query (k_row <= k_max, whole numbers)."""
    out = torch.zeros_like(scores)
    if k_max == 0:
        return out
    idx = scores.topk(k_max, -1).indices
    take = torch.ones(idx.shape, dtype=scores.dtype, device=scores.device)
    if isinstance(k_row, torch.Tensor):
        rank = torch.arange(k_max, device=scores.device)
        take = (rank < k_row[..., None]).to(scores.dtype).expand(idx.shape)
    return out.scatter(-1, idx, take)


def topk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k: int | float,
    *,
    epsilon: float | torch.Tensor = 0.1,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    mode: str = "softmax",
    hard: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    method: str = "ot",
) -> torch.Tensor:
    r"""Scaled dot-product attention restricted to the soft top-k keys of each query.

    The values weighted by ``mode`` (the module's formulas) from the mask
    :math:`A = A_k(s)` of :func:`softops.soft_topk_mask`; at ``k`` >= the number of keys,
    "softmax" equals :func:`torch.nn.functional.scaled_dot_product_attention`.

    Args:
        query, key, value: ``(..., L, E)``, ``(..., S, E)`` and ``(..., S, Ev)``.
        k: the keys each query attends to, a number >= 0 (an integer with ``hard``).
        epsilon: the temperature in units of the scaled scores; a float or a ``(..., L)`` tensor.
        attn_mask, key_padding_mask, is_causal: SDPA's and ``nn.MultiheadAttention``'s masks.
        mode: one of :data:`ATTENTION_MODES`; ``method``: one of :data:`ATTENTION_METHODS`.
        hard: straight-through: the hard top-k attention forward, the soft gradient backward.
        scale, dropout_p: the factor on the scores (None: ``1 / sqrt(E)``) and SDPA's dropout.

    Returns:
        ``(..., L, Ev)``; zeros for a query with no valid key.

    Example:
        >>> q = torch.tensor([[1.0, 0.0]])
        >>> keys = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
        >>> values = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
        >>> topk_attention(q, keys, values, 2, epsilon=0.01, mode="mean", scale=1.0)
        tensor([[1.5000]])
    """
    op = "topk_attention"
    check_floating(value, op, "value")
    if value.dim() < 2 or value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"{op}: expected `value` of shape (..., S, Ev) with the keys' S = {key.shape[-2]}; "
            f"got shape {tuple(value.shape)}."
        )
    _check_dropout(op, "dropout_p", dropout_p)
    w = topk_attention_weights(
        query,
        key,
        k,
        epsilon=epsilon,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        mode=mode,
        hard=hard,
        scale=scale,
        method=method,
    ).weights
    if dropout_p > 0:
        w = F.dropout(w, dropout_p)
    return torch.matmul(w, value)


class TopKAttention(nn.Module):
    r"""Multi-head attention over the soft top-k keys of each query.

    The constructor, parameters, ``forward``, masks and state dict are those of
    :class:`torch.nn.MultiheadAttention`, initialised as it does (the same seed gives the same
    weights), with the top-k arguments after ``num_heads``; each head runs
    :func:`topk_attention`. ``load_state_dict(mha.state_dict())`` loads a MultiheadAttention
    checkpoint (``add_bias_kv`` and ``add_zero_attn`` have no counterpart), and at ``k`` >= the
    number of keys the outputs and weights are MultiheadAttention's.

    Args:
        embed_dim, num_heads, dropout, bias, batch_first, kdim, vdim: as for
            ``nn.MultiheadAttention``.
        k, epsilon, mode, method, hard: as for :func:`topk_attention`, per head.

    Shapes are MultiheadAttention's (``(L, N, E)`` inputs, ``(N, L, S)`` weights).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> layer = TopKAttention(8, 2, k=3, batch_first=True)
        >>> layer.extra_repr()
        "embed_dim=8, num_heads=2, k=3, epsilon=0.1, mode='softmax', method='ot', hard=False, batch_first=True"
        >>> x = torch.randn(4, 10, 8)
        >>> out, w = layer(x, x, x)
        >>> out.shape, w.shape, w.sum(-1).allclose(torch.ones(4, 10))
        (torch.Size([4, 10, 8]), torch.Size([4, 10, 10]), True)
    """  # noqa: E501

    in_proj_weight: nn.Parameter | None
    q_proj_weight: nn.Parameter | None
    k_proj_weight: nn.Parameter | None
    v_proj_weight: nn.Parameter | None
    in_proj_bias: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        k: int | float,
        *,
        epsilon: float = 0.1,
        mode: str = "softmax",
        method: str = "ot",
        hard: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        op = type(self).__name__
        for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{op}: expected `{name}` to be an int >= 1; got {name}={v!r}.")
        if embed_dim % num_heads:
            raise ValueError(
                f"{op}: expected `embed_dim` divisible by `num_heads`; got embed_dim={embed_dim}, "
                f"num_heads={num_heads}."
            )
        for name, dim in (("kdim", kdim), ("vdim", vdim)):
            if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
                raise ValueError(
                    f"{op}: expected `{name}` to be None or an int >= 1; got {name}={dim!r}."
                )
        kf, _ = _check_attention_options(op, k, epsilon, mode, method, hard)
        if isinstance(epsilon, torch.Tensor):
            raise TypeError(f"{op}: expected `epsilon` to be a float; got a tensor.")
        _check_dropout(op, "dropout", dropout)
        check_bool(bias, op, "bias")
        check_bool(batch_first, op, "batch_first")
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim: int = embed_dim
        self.num_heads: int = num_heads
        self.head_dim: int = embed_dim // num_heads
        self.kdim: int = embed_dim if kdim is None else kdim
        self.vdim: int = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim: bool = self.kdim == embed_dim and self.vdim == embed_dim
        self.k: int | float = int(kf) if kf.is_integer() else kf
        self.epsilon: float = float(epsilon)
        self.mode: str = mode
        self.method: str = method
        self.hard: bool = hard
        self.dropout: float = float(dropout)
        self.batch_first: bool = batch_first
        # MultiheadAttention's parameters, in its state dict's order (None where not used)
        E, packed = embed_dim, self._qkv_same_embed_dim

        def weight(*shape: int, used: bool) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(*shape, **kw)) if used else None

        self.register_parameter("in_proj_weight", weight(3 * E, E, used=packed))
        for name, dim in (("q", E), ("k", self.kdim), ("v", self.vdim)):
            self.register_parameter(f"{name}_proj_weight", weight(E, dim, used=not packed))
        self.register_parameter("in_proj_bias", weight(3 * E, used=bias))
        self.out_proj: nn.Linear = nn.Linear(E, E, bias=bias, **kw)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """MultiheadAttention's initialisation, in its order (the same seed, the same weights)."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        for b in (self.in_proj_bias, self.out_proj.bias):
            if b is not None:
                nn.init.zeros_(b)

    @classmethod
    def from_multihead_attention(
        cls,
        mha: nn.MultiheadAttention,
        k: int | float,
        *,
        epsilon: float = 0.1,
        mode: str = "softmax",
        method: str = "ot",
        hard: bool = False,
    ) -> TopKAttention:
        """A TopKAttention with the options, device, dtype, training mode and a copy of the
        weights of ``mha`` (a :class:`torch.nn.MultiheadAttention`); the top-k arguments as in
        the constructor."""
        op = f"{cls.__name__}.from_multihead_attention"
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"{op}: expected a torch.nn.MultiheadAttention; got {mha!r}.")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                f"{op}: expected a MultiheadAttention without add_bias_kv and add_zero_attn "
                f"(TopKAttention has neither); got add_bias_kv={mha.bias_k is not None}, "
                f"add_zero_attn={mha.add_zero_attn}."
            )
        weight = mha.out_proj.weight
        layer = cls(
            mha.embed_dim,
            mha.num_heads,
            k,
            epsilon=epsilon,
            mode=mode,
            method=method,
            hard=hard,
            dropout=float(mha.dropout),
            bias=mha.in_proj_bias is not None,
            batch_first=mha.batch_first,
            kdim=mha.kdim,
            vdim=mha.vdim,
            device=weight.device,
            dtype=weight.dtype,
        )
        layer.load_state_dict(mha.state_dict())
        return layer.train(mha.training)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Converts the earlier layout (``q/k/v_proj`` Linears); refuses ``bias_k``/``bias_v``."""
        old = [f"{prefix}{name}_proj.weight" for name in "qkv"]
        if all(key in state_dict for key in old):
            weights = [state_dict.pop(key) for key in old]
            if self._qkv_same_embed_dim and all(w.shape == weights[0].shape for w in weights):
                state_dict[f"{prefix}in_proj_weight"] = torch.cat(weights)
            else:
                for name, w in zip("qkv", weights, strict=True):
                    state_dict[f"{prefix}{name}_proj_weight"] = w
            biases = [f"{prefix}{name}_proj.bias" for name in "qkv"]
            if all(key in state_dict for key in biases):
                state_dict[f"{prefix}in_proj_bias"] = torch.cat([state_dict.pop(b) for b in biases])
        for name in ("bias_k", "bias_v"):
            if state_dict.get(f"{prefix}{name}") is not None:
                error_msgs.append(
                    f"{type(self).__name__}: the state dict holds `{prefix}{name}`, a "
                    "MultiheadAttention with add_bias_kv=True, which TopKAttention does not "
                    "have; convert one without it."
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        dims = ""
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            dims = f", kdim={self.kdim}, vdim={self.vdim}"
        drop = f", dropout={self.dropout}" if self.dropout else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, k={self.k}, "
            f"epsilon={self.epsilon}, mode={self.mode!r}, method={self.method!r}, "
            f"hard={self.hard}{drop}, batch_first={self.batch_first}{dims}"
        )

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections, one matmul per distinct tensor among query, key and value."""
        E, w, b = self.embed_dim, self.in_proj_weight, self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if w is None:  # kdim or vdim != embed_dim: three matrices
            wq, wk, wv = (
                torch.empty(0) if p is None else p
                for p in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            )
            return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
        if query is key and key is value:
            q, k, v = F.linear(query, w, b).split(E, -1)
            return q, k, v
        wq, wkv = w.split((E, 2 * E))
        q = F.linear(query, wq, bq)
        if key is value:
            k, v = F.linear(key, wkv, None if b is None else b[E:]).split(E, -1)
            return q, k, v
        wk, wv = wkv.chunk(2)
        return q, F.linear(key, wk, bk), F.linear(value, wv, bv)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend; returns ``(output, weights)`` (weights None unless ``need_weights``).

        ``is_causal=True`` applies the causal mask (not only a hint, as in MultiheadAttention).
        """
        op = type(self).__name__
        dims = (query.dim(), key.dim(), value.dim())
        if dims not in ((3, 3, 3), (2, 2, 2)):
            raise ValueError(
                f"{op}: expected query, key and value of 3 dims (2 unbatched); got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
            )
        unbatched = dims[0] == 2
        if unbatched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]
        # the batch's dim in the inputs (and the output), and the sequences'
        batch, seq = (0, 1) if self.batch_first and not unbatched else (1, 0)
        q, kk, v = self._project(query, key, value)
        if unbatched:
            q, kk, v = q[:, None], kk[:, None], v[:, None]
        L, N, S = q.shape[seq], q.shape[batch], kk.shape[seq]
        if kk.shape[batch] != N or v.shape[batch] != N or v.shape[seq] != S:
            raise ValueError(
                f"{op}: expected query, key and value of one batch size and key and value of one "
                f"length; got shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}."
            )
        H, hd = self.num_heads, self.head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:  # -> (N, H, len, hd), a view
            t = t.unflatten(-1, (H, hd))
            return t.permute(0, 2, 1, 3) if batch == 0 else t.permute(1, 2, 0, 3)

        mask, padding = self._masks(op, attn_mask, key_padding_mask, N, L, S, q.dtype)
        weights = topk_attention_weights(
            heads(q),
            heads(kk),
            self.k,
            epsilon=self.epsilon,
            attn_mask=mask,
            key_padding_mask=padding,
            is_causal=is_causal,
            mode=self.mode,
            hard=self.hard,
            method=self.method,
        ).weights
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout else weights
        out = torch.matmul(dropped, heads(v))  # (N, H, L, hd)
        # back to the inputs' layout, heads side by side
        out = out.permute(0, 2, 1, 3) if batch == 0 else out.permute(2, 0, 1, 3)
        out = self.out_proj(out.flatten(-2))
        if unbatched:
            out = out[:, 0]
        if not need_weights:
            return out, None
        w = weights.mean(1) if average_attn_weights else weights
        return out, (w[0] if unbatched else w)

    def _masks(
        self,
        op: str,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        N: int,
        L: int,
        S: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """MultiheadAttention's masks in :func:`topk_attention`'s conventions: bool masks stay
        bool (attn_mask inverted); a float one makes one additive float mask of both."""
        parts: list[torch.Tensor] = []
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if m is None:
                continue
            if not torch.is_tensor(m) or not (m.dtype == torch.bool or m.is_floating_point()):
                raise TypeError(f"{op}: expected `{name}` to be a bool or float tensor; got {m!r}.")
            if name == "key_padding_mask":
                if tuple(m.shape) != (N, S):
                    raise ValueError(
                        f"{op}: expected `{name}` of shape {(N, S)}; got {tuple(m.shape)}."
                    )
                parts.append(m[:, None, None, :])
            elif m.dim() == 2 and tuple(m.shape) == (L, S):
                parts.append(m)
            elif m.dim() == 3 and tuple(m.shape) == (N * self.num_heads, L, S):
                parts.append(m.reshape(N, self.num_heads, L, S))
            else:
                raise ValueError(
                    f"{op}: expected `attn_mask` of shape ({L}, {S}) or "
                    f"({N * self.num_heads}, {L}, {S}); got {tuple(m.shape)}."
                )
        if all(m.dtype == torch.bool for m in parts):
            mask = None if attn_mask is None else ~parts[0]
            return mask, key_padding_mask
        # to one additive float mask: True (masked) -> -inf
        floats = [
            torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, -math.inf)
            if m.dtype == torch.bool
            else m.to(dtype)
            for m in parts
        ]
        return (floats[0] if len(floats) == 1 else floats[0] + floats[1]), None
