r"""A mixture-of-experts router whose top-k selection has a gradient.

A router scores E experts per token, :math:`s = W x + b`, and sends each token to k of them.
Through a hard ``torch.topk`` the experts that were not selected get no gradient. Here the
selection is the SOFT top-k mask :math:`A = A_k(s)` of :func:`softops.soft_topk_mask`, and the
combine weights are

.. math::

    g_e = \frac{A_e\, e^{s_e}}{\sum_j A_j\, e^{s_j}} \quad(\text{"softmax"}), \qquad
    g_e = \frac{A_e}{k} \quad(\text{"mean"}).

With ``hard=True`` (the default) the forward is the usual router (exactly k experts, the
renormalised softmax of their logits) and the backward that of the soft weights, so every
expert's logit receives a gradient.

The load statistics are Switch Transformer's: the fraction :math:`f_e` of the tokens' k slots
sent to expert e, the mean router probability :math:`P_e`, and the auxiliary loss
:math:`E \sum_e f_e P_e` (1 for a uniform router). The ST-MoE z-loss is
:math:`\mathrm{mean}_t \big(\log \sum_e e^{s_{te}}\big)^2` over the logits before the training
noise. Both are returned, not added: the caller weighs them (Switch: 0.01, ST-MoE: 0.001).

References:
    Xie, Y., Dai, H., Chen, M., et al. (2020). Differentiable top-k with optimal transport.
    NeurIPS 33.
    Fedus, W., Zoph, B., Shazeer, N. (2022). Switch Transformers. JMLR 23 (the load-balancing
    loss).
    Zoph, B., Bello, I., Kumar, S., et al. (2022). ST-MoE: Designing Stable and Transferable
    Sparse Expert Models. arXiv:2202.08906 (the router z-loss).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import nn

from softops._core.validation import check_bool, check_choice, check_epsilon
from softops.nn._module import ArgsModule
from softops.nn.attention import mask_weights
from softops.topk import soft_topk_mask

__all__ = ["ROUTER_METHODS", "ROUTER_MODES", "RouterOutput", "TopKRouter"]

ROUTER_MODES = ("softmax", "mean")
ROUTER_METHODS = ("ot", "sinkhorn", "softkmax", "perturbed", "sparse")


class RouterOutput(NamedTuple):
    """What :class:`TopKRouter` returns for tokens of shape ``(*, d_model)``, with E experts."""

    weights: torch.Tensor
    """``(*, E)``: the combine weights g, summing to 1 per token (k non-zero with ``hard``)."""
    indices: torch.Tensor
    """``(*, k)``, int64: the k experts with the largest logits per token, best first."""
    mask: torch.Tensor
    """``(*, E)``: the soft top-k mask A (the hard 0/1 selection forward with ``hard``)."""
    load: torch.Tensor
    """``(E,)``: f_e, the fraction of the tokens' k slots sent to each expert (no gradient)."""
    importance: torch.Tensor
    """``(E,)``: P_e, the mean router probability ``softmax(logits)`` of each expert."""
    aux_loss: torch.Tensor
    """``()``: the Switch Transformer load-balancing loss ``E * sum_e f_e P_e``."""
    logits: torch.Tensor
    """``(*, E)``: the gate's logits ``W x + b``, before the training noise."""
    z_loss: torch.Tensor
    """``()``: the ST-MoE router z-loss, the mean over tokens of ``logsumexp(logits)**2``."""


class TopKRouter(ArgsModule):
    r"""Route each token to k of ``num_experts`` experts through the SOFT top-k (module docstring).

    Args:
        d_model: the token features.
        num_experts: E.
        k: the experts per token, an int in [1, E].
        epsilon: the top-k's temperature, in the units of the logits.
        mode: ``"softmax"`` (default) or ``"mean"`` (the module docstring).
        method: the top-k method of :func:`softops.soft_topk_mask` ("ot" by default;
            ``"sparse"`` gives exact zeros even with ``hard=False``).
        hard: exactly k experts per token forward, soft gradients (default True).
        noise_std: in training, Gaussian noise of this standard deviation on the logits before
            the selection (Shazeer et al. 2017's noisy top-k gating); 0 by default.
        bias: a bias on the router's linear layer.

    Shape:
        - input: ``(*, d_model)``; the outputs: :class:`RouterOutput`.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> router = TopKRouter(16, 8, k=2)
        >>> out = router(torch.randn(5, 16))
        >>> out.weights.shape, out.indices.shape, (out.weights > 0).sum(-1).tolist()
        (torch.Size([5, 8]), torch.Size([5, 2]), [2, 2, 2, 2, 2])
        >>> out.weights.sum(-1).allclose(torch.ones(5)), float(out.load.sum())
        (True, 1.0)
    """

    _fields = ("d_model", "num_experts", "k", "epsilon", "mode", "method", "hard", "noise_std")
    _optional = (("noise_std", 0.0),)
    gate: nn.Linear

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int = 2,
        *,
        epsilon: float = 0.1,
        mode: str = "softmax",
        method: str = "ot",
        hard: bool = True,
        noise_std: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        op = type(self).__name__
        for name, v in (("d_model", d_model), ("num_experts", num_experts), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{op}: expected `{name}` to be an int >= 1; got {name}={v!r}.")
        if k > num_experts:
            raise ValueError(
                f"{op}: expected 1 <= `k` <= num_experts (= {num_experts}); got k={k}."
            )
        if isinstance(epsilon, torch.Tensor):
            raise TypeError(f"{op}: expected `epsilon` to be a float; got a tensor.")
        check_epsilon(epsilon, op)
        check_choice(mode, ROUTER_MODES, op, "mode")
        check_choice(method, ROUTER_METHODS, op, "method")
        check_bool(hard, op, "hard")
        check_bool(bias, op, "bias")
        if isinstance(noise_std, bool) or not isinstance(noise_std, numbers.Real):
            raise TypeError(f"{op}: expected `noise_std` to be a float >= 0; got {noise_std!r}.")
        if not noise_std >= 0:
            raise ValueError(f"{op}: expected `noise_std` >= 0; got noise_std={noise_std!r}.")
        super().__init__()
        self.d_model: int = d_model
        self.num_experts: int = num_experts
        self.k: int = k
        self.epsilon: float = float(epsilon)
        self.mode: str = mode
        self.method: str = method
        self.hard: bool = hard
        self.noise_std: float = float(noise_std)
        self.gate = nn.Linear(d_model, num_experts, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route the tokens ``x``.

        Args:
            x: (*, d_model), in the dtype of the router's parameters (or under autocast).

        Returns:
            A :class:`RouterOutput`.
        """
        op = type(self).__name__
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            what = f"dtype={x.dtype}" if isinstance(x, torch.Tensor) else repr(x)
            raise TypeError(f"{op}: expected a floating tensor of tokens; got {what}.")
        own = self.gate.weight.dtype
        if x.dtype != own and not _autocast(x):
            raise TypeError(
                f"{op}: expected tokens in the dtype of the router's parameters ({own}; convert "
                f"one of them with .to(dtype)); got dtype={x.dtype}."
            )
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"{op}: expected tokens of shape (*, d_model = {self.d_model}); got shape "
                f"{tuple(x.shape)}."
            )
        logits = self.gate(x)
        if self.training and self.noise_std > 0:
            noisy = logits + self.noise_std * torch.randn_like(logits)
            out = route(noisy, self.k, self.epsilon, self.mode, self.method, self.hard)
            return out._replace(logits=logits, z_loss=z_loss(logits))
        return route(logits, self.k, self.epsilon, self.mode, self.method, self.hard)


def _autocast(x: torch.Tensor) -> bool:
    """Whether autocast is on for x's device (where it picks the gate's dtype itself)."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except (RuntimeError, ValueError, TypeError):  # a device autocast does not know; torch < 2.4
        return torch.is_autocast_enabled() if x.device.type == "cuda" else False


def route(
    logits: torch.Tensor, k: int, epsilon: float, mode: str, method: str, hard: bool
) -> RouterOutput:
    """The router's selection and statistics on ``logits`` (*, E) (the module docstring)."""
    E = logits.shape[-1]
    A = soft_topk_mask(logits, k, epsilon=epsilon, method=method)
    probs = torch.softmax(logits, -1)  # (one softmax: the weights' and the importance's)
    weights = mask_weights(logits, A, k, mode, probs)
    indices = logits.detach().topk(k, -1).indices
    hard_mask = torch.zeros_like(logits).scatter(-1, indices, 1.0)
    if hard:
        w_hard = mask_weights(logits.detach(), hard_mask, k, mode, probs.detach())
        weights = w_hard + (weights - weights.detach())  # straight-through
        A = hard_mask + (A - A.detach())
    flat = hard_mask.reshape(-1, E)
    tokens = max(flat.shape[0], 1)
    load = flat.sum(0) / (tokens * k)
    importance = probs.reshape(-1, E).sum(0) / tokens
    aux = E * (load * importance).sum()
    return RouterOutput(weights, indices, A, load, importance, aux, logits, z_loss(logits))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The ST-MoE router z-loss of ``logits`` (*, E): the mean of ``logsumexp(s)**2``."""
    return torch.logsumexp(logits, -1).square().mean()
