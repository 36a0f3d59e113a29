r"""Differentiable beam search through the sorted SOFT top-k (Xie et al. 2020, §4.2).

Each step extends the K hypotheses by the V tokens and keeps the K best of the :math:`n = KV`
candidates :math:`c_{(p, v)} = s_p + \log \pi(v \mid p)`. That ``torch.topk(c, K)`` has no
useful gradient; the sorted SOFT top-k (:func:`softops.soft_topk`) relaxes it: its weights
:math:`W \in [0, 1]^{K \times n}` hold in row j a soft one-hot of the j-th best candidate and
tend to the one-hots of the selection as epsilon -> 0. A sequence-level loss weighted by W
(:func:`beam_search_loss`) trains the model *through* the search (docs/math.md §7). The kept
hypotheses and decoder states are exactly plain beam search's; only the ranking is relaxed.

**Methods** (:data:`BEAM_METHODS`): ``"soft_topk"`` (the default, above), ``"softmax"`` (every
row of W is ``softmax(c / epsilon)``, the usual rank-blind surrogate) and ``"hard"`` (the
one-hots of the selection; for inference). Epsilon is in the units of the candidate scores
(log-probabilities), not normalised: a float or a (B,) tensor. Candidates scoring ``-inf`` (a
beam not yet live, a finished hypothesis's other tokens, a masked token) are never selected and
get weight 0.

References:
    Xie, Dai, Chen, Dai, Zhao, Zha, Wei and Pfister. Differentiable Top-k Operator with Optimal
    Transport. NeurIPS 2020. arXiv:2002.06504.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

import softops
from softops._core.validation import (
    check_choice,
    check_epsilon,
    check_floating,
    check_positive_int,
    check_row_counts,
)

__all__ = [
    "BEAM_METHODS",
    "BeamSearchResult",
    "BeamStep",
    "beam_search",
    "beam_search_loss",
    "beam_step",
    "prefix_costs",
]

BEAM_METHODS = ("soft_topk", "softmax", "hard")
"""The relaxations of the beam's selection that :func:`beam_step` accepts."""

StepFn = Callable[[Tensor, Any, int], tuple[Tensor, Any]]


class BeamStep(NamedTuple):
    """Result of :func:`beam_step`.

    Attributes:
        scores: (B, K) the selected candidates' scores, best first (differentiable).
        parents: (B, K) int64, the beam each new beam extends.
        tokens: (B, K) int64, the token each new beam appends.
        weights: (B, K, K*V) row j: the relaxed one-hot of the j-th best candidate.
        candidates: (B, K*V) ``beam_scores[p] + log_probs[p, v]`` at index ``p * V + v``.
    """

    scores: Tensor
    parents: Tensor
    tokens: Tensor
    weights: Tensor
    candidates: Tensor


class BeamSearchResult(NamedTuple):
    """Result of :func:`beam_search` (B sequences, beam size K, T steps run, V tokens).

    Attributes:
        sequences: (B, K, T) int64 tokens of the final hypotheses, best first (``pad`` after EOS).
        scores: (B, K) their summed log-probabilities (differentiable).
        lengths, finished: (B, K) tokens up to and including EOS (T if none), and whether EOS came.
        weights, candidates, parents, tokens: the steps' :class:`BeamStep` fields, stacked (T, ...).
    """

    sequences: Tensor
    scores: Tensor
    lengths: Tensor
    finished: Tensor
    weights: Tensor
    candidates: Tensor
    parents: Tensor
    tokens: Tensor


def beam_step(
    beam_scores: Tensor,
    log_probs: Tensor,
    *,
    epsilon: float | Tensor = 0.1,
    method: str = "soft_topk",
    max_iter: int | None = None,
    tol: float | None = None,
) -> BeamStep:
    r"""One step of beam search with differentiable ranking weights.

    The K·V candidates ``c[p * V + v] = beam_scores[p] + log_probs[p, v]`` are ranked; the hard
    part (``parents``, ``tokens``, ``scores``) is exactly ``torch.topk(c, K)``, and ``weights``
    relaxes it by ``method`` (module docstring). A row needs at least K finite candidates.

    ``beam_scores`` (B, K) are the beams' scores (``-inf`` when unused), ``log_probs``
    (B, K, V) their next-token log-probabilities; ``max_iter`` and ``tol`` bound the Sinkhorn
    of ``"soft_topk"``.

    Example:
        >>> import torch
        >>> from softops.apps import beam_step
        >>> beams = torch.tensor([[0.0, -1.0]])
        >>> logp = torch.log(torch.tensor([[[0.6, 0.4], [0.9, 0.1]]]))
        >>> out = beam_step(beams, logp, epsilon=0.01)
        >>> out.parents, out.tokens
        (tensor([[0, 0]]), tensor([[0, 1]]))
        >>> out.weights.round(decimals=3)
        tensor([[[1., 0., 0., 0.],
                 [0., 1., 0., 0.]]])
    """
    op = "beam_step"
    method = check_choice(method, BEAM_METHODS, op, "method")
    eps = check_epsilon(epsilon, op)
    for name, t, nd in (("beam_scores", beam_scores, 2), ("log_probs", log_probs, 3)):
        check_floating(t, op, name)
        if t.dim() != nd:
            raise ValueError(f"{op}: expected {name} with {nd} dims; got shape {tuple(t.shape)}.")
    eps = check_epsilon(eps, op, dtype=torch.promote_types(beam_scores.dtype, log_probs.dtype))
    bsz, beam = beam_scores.shape
    if log_probs.shape[:2] != (bsz, beam) or log_probs.shape[2] == 0 or beam == 0:
        raise ValueError(
            f"{op}: expected log_probs of shape (B, K, V) = ({bsz}, {beam}, V >= 1) for "
            f"beam_scores of shape {tuple(beam_scores.shape)}; got {tuple(log_probs.shape)}."
        )
    vocab = log_probs.shape[2]
    cand = (beam_scores.unsqueeze(-1) + log_probs).flatten(-2)  # (B, K*V)
    cd = cand.detach()
    live = ((cd > -torch.inf) | torch.isnan(cd)).sum(-1)  # a NaN row is NaN, and only it
    # (Under vmap and on meta tensors the count cannot be read: such a row is then NaN, as in
    # soft_topk.)
    check_row_counts(live, beam, op, f"(K = {beam}) candidates with a score above -inf")
    if method == "soft_topk":
        out = softops.soft_topk(cand, beam, epsilon=eps, max_iter=max_iter, tol=tol)
        idx, weights = out.indices, out.weights
    else:
        idx = torch.topk(cand.detach(), beam, dim=-1, largest=True, sorted=True).indices
        if method == "softmax":
            e = eps if not isinstance(eps, Tensor) else eps.unsqueeze(-1)
            weights = torch.softmax(cand / e, dim=-1).unsqueeze(1).expand(bsz, beam, -1)
        else:
            weights = torch.zeros_like(cand).unsqueeze(1).repeat(1, beam, 1)
            weights.scatter_(-1, idx.unsqueeze(-1), 1.0)
    scores = cand.gather(-1, idx)
    return BeamStep(scores, idx // vocab, idx % vocab, weights, cand)


# ---------------------------------------------------------------------------------- the search loop


def _map_state(state: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor of a state made of tensors, tuples, lists, dicts and None."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return fn(state)
    if isinstance(state, tuple):
        mapped = [_map_state(s, fn) for s in state]
        return type(state)(*mapped) if hasattr(state, "_fields") else tuple(mapped)
    if isinstance(state, list):
        return [_map_state(s, fn) for s in state]
    if isinstance(state, dict):
        return {key: _map_state(value, fn) for key, value in state.items()}
    raise TypeError(
        "beam_search: expected a state made of tensors, tuples, lists, dicts and None; "
        f"got {type(state).__name__}."
    )


def _take_rows(index: Tensor, t: Tensor) -> Tensor:
    """``t``'s rows at ``index`` (on ``t``'s device)."""
    return t.index_select(0, index.to(t.device))


def _first_device(state: Any) -> torch.device:
    """The device of the first tensor in ``state`` (CPU if it holds none)."""
    found: list[torch.device] = []

    def note(t: Tensor) -> Tensor:
        found.append(t.device)
        return t

    _map_state(state, note)
    return found[0] if found else torch.device("cpu")


def beam_search(
    step_fn: StepFn,
    state: Any,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos: int,
    eos: int | None = None,
    pad: int | None = None,
    epsilon: float | Tensor = 0.1,
    method: str = "soft_topk",
    max_iter: int | None = None,
    tol: float | None = None,
    device: torch.device | str | None = None,
) -> BeamSearchResult:
    r"""Batched beam search over a user's decoder, with the ranking weights of every step.

    Each step calls ``log_probs, state = step_fn(tokens, state, t)`` on the B·K hypotheses'
    last tokens (``bos`` first; row ``b * K + j`` is beam j of sequence b), selects by
    :func:`beam_step` and reorders the state's rows to follow (the initial state's B rows are
    repeated K times). A finished hypothesis continues with ``pad`` at log-probability 0 and
    still competes for the K places; the search stops after ``max_len`` steps or when all end.

    Args:
        step_fn: ``(tokens, state, t) -> (log_probs, state)``, log_probs over V >= K tokens.
        state: tensors (first dim B) in tuples, lists and dicts, or None.
        batch_size, beam_size, max_len: B, K >= 1 and T_max >= 1 (EOS included).
        bos, eos, pad: the first token, the end token (None: run ``max_len`` steps) and the token
            a finished hypothesis emits (default ``eos``).
        epsilon, method, max_iter, tol: as for :func:`beam_step`.
        device: of the first tokens (None: that of the state's first tensor, else the CPU).

    Example:
        >>> import torch
        >>> from softops.apps import beam_search
        >>> table = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0],
        ...                                         [1.0, 0.0, 2.0]]), -1)
        >>> def step(tokens, state, t):  # a bigram model; token 2 is EOS
        ...     return table[tokens], state
        >>> out = beam_search(step, None, batch_size=1, beam_size=2, max_len=4, bos=0, eos=2)
        >>> out.sequences[0, 0].tolist(), out.lengths[0].tolist()
        ([0, 0, 0, 0], [4, 4])
    """
    op = "beam_search"
    bsz = check_positive_int(batch_size, op, "batch_size")
    beam = check_positive_int(beam_size, op, "beam_size")
    steps = check_positive_int(max_len, op, "max_len")
    method = check_choice(method, BEAM_METHODS, op, "method")
    check_epsilon(epsilon, op)
    pad_token = eos if pad is None else pad
    hyps = bsz * beam  # the rows of step_fn's batch
    state = _map_state(state, lambda t: t.repeat_interleave(beam, dim=0))
    tokens: Tensor | None = None
    seqs: Tensor | None = None
    outs: list[BeamStep] = []
    scores = finished = lengths = None
    if device is None:
        device = _first_device(state)
    for t in range(steps):
        if tokens is None:
            feed = torch.full((hyps,), bos, dtype=torch.long, device=device)
        else:
            feed = tokens.reshape(-1)
        log_probs, state = step_fn(feed, state, t)
        if not torch.is_tensor(log_probs) or log_probs.dim() != 2 or log_probs.shape[0] != hyps:
            shape = tuple(log_probs.shape) if isinstance(log_probs, Tensor) else type(log_probs)
            raise ValueError(
                f"{op}: expected step_fn to return log_probs of shape (B*K, V) = "
                f"({hyps}, V); got {shape}."
            )
        vocab = log_probs.shape[-1]
        if vocab < beam:
            raise ValueError(f"{op}: expected V >= beam_size = {beam} tokens; got V = {vocab}.")
        if pad_token is not None and not 0 <= pad_token < vocab:
            raise ValueError(f"{op}: expected eos and pad in [0, V = {vocab}); got {pad_token}.")
        if tokens is None:  # at t = 0 only beam 0 is live
            dev = log_probs.device
            scores = torch.full((bsz, beam), -torch.inf, dtype=log_probs.dtype, device=dev)
            scores[:, 0] = 0.0
            finished = torch.zeros((bsz, beam), dtype=torch.bool, device=dev)
            lengths = torch.zeros((bsz, beam), dtype=torch.long, device=dev)
        assert scores is not None and finished is not None and lengths is not None
        lp = log_probs.reshape(bsz, beam, vocab)
        if eos is not None and t > 0:  # no host read: finished rows take [0 at pad, -inf else]
            done = torch.full_like(lp[0, 0], -torch.inf)
            done[pad_token] = 0.0
            lp = torch.where(finished.unsqueeze(-1), done, lp)
        out = beam_step(scores, lp, epsilon=epsilon, method=method, max_iter=max_iter, tol=tol)
        parents = out.parents
        was_done = finished.gather(1, parents)
        lengths = lengths.gather(1, parents) + (~was_done).long()
        finished = was_done | (out.tokens == eos) if eos is not None else was_done
        tokens = out.tokens
        if seqs is None:
            seqs = tokens.unsqueeze(-1)
        else:  # the kept hypotheses' prefixes, then their new tokens
            prefix = seqs.gather(1, parents.unsqueeze(-1).expand(-1, -1, seqs.shape[-1]))
            seqs = torch.cat((prefix, tokens.unsqueeze(-1)), dim=-1)
        scores = out.scores
        flat = (parents + beam * torch.arange(bsz, device=parents.device).unsqueeze(1)).reshape(-1)
        state = _map_state(state, functools.partial(_take_rows, flat))
        outs.append(out)
        if eos is not None and bool(finished.all()):
            break
    assert seqs is not None and scores is not None and finished is not None and lengths is not None
    fields = ("weights", "candidates", "parents", "tokens")
    stacked = [torch.stack([getattr(o, name) for o in outs]) for name in fields]
    return BeamSearchResult(seqs, scores, lengths, finished, *stacked)


# -------------------------------------------------------------------------------- the training loss


def prefix_costs(result: BeamSearchResult, target: Tensor, *, pad: int | None = None) -> Tensor:
    r"""Hamming cost of every candidate of every step against the target sequences.

    Candidate ``p * V + v`` of step t extends beam p by token v; its cost is the number of
    positions ``s <= t`` where that prefix differs from ``target[:, s]``, ``target`` (B, L)
    padded with ``pad`` beyond L. Returns (T, B, K*V) costs, without gradient.
    """
    op = "prefix_costs"
    steps, bsz, n = result.candidates.shape
    beam = result.parents.shape[-1]
    vocab = n // beam
    if not isinstance(target, Tensor) or target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: expected an integer target tensor; got {target!r:.60}.")
    if target.dim() != 2 or target.shape[0] != bsz:
        raise ValueError(
            f"{op}: expected a target of shape (B, L) with B = {bsz}; got {tuple(target.shape)}."
        )
    if target.shape[1] < steps:
        if pad is None:
            raise ValueError(
                f"{op}: the target has {target.shape[1]} tokens for {steps} steps; pass pad."
            )
        fill = target.new_full((bsz, steps - target.shape[1]), pad)
        target = torch.cat((target, fill), dim=1)
    target = target.to(result.candidates.device)
    dtype = result.candidates.dtype
    mism = torch.zeros((bsz, beam), dtype=dtype, device=target.device)
    vs = torch.arange(vocab, device=target.device)
    costs = []
    for t in range(steps):
        wrong = (vs != target[:, t : t + 1]).to(dtype)  # (B, V)
        cost = mism.unsqueeze(-1) + wrong.unsqueeze(1)  # (B, K, V)
        costs.append(cost.reshape(bsz, n))
        sel = result.parents[t] * vocab + result.tokens[t]
        mism = cost.reshape(bsz, n).gather(1, sel)
    return torch.stack(costs)


def beam_search_loss(
    result: BeamSearchResult,
    target: Tensor | None = None,
    *,
    costs: Tensor | None = None,
    first: float = 1.0,
    whole: float = 1.0,
    pad: int | None = None,
) -> Tensor:
    r"""The expected cost of the beam under the ranking weights, plus a term for the first rank.

    With :math:`W^{(t)}` the weights of step t and :math:`\delta^{(t)}` the candidates' costs
    (by default the Hamming cost of each candidate's prefix, :func:`prefix_costs`),

    .. math::

        \mathcal{L} = \frac{1}{T B} \sum_{t, b} \Big( \frac{\mu}{K} \sum_{j<K} \sum_c
            W^{(t)}_{b j c}\, \delta^{(t)}_{b c}
            + \lambda \sum_c W^{(t)}_{b 0 c}\, \delta^{(t)}_{b c} \Big),

    :math:`\mu` = ``whole`` and :math:`\lambda` = ``first``: every place of the beam should hold
    a cheap candidate (the right prefix must stay in the beam), and the first the cheapest.

    Pass exactly one of ``target`` (B, L), for the Hamming costs (with ``pad``), and ``costs``
    (T, B, K*V). Returns the scalar loss; the gradient flows through ``result.weights``.
    """
    op = "beam_search_loss"
    if (target is None) == (costs is None):
        raise ValueError(f"{op}: pass exactly one of target and costs.")
    for name, value in (("first", first), ("whole", whole)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{op}: expected `{name}` >= 0; got {name}={value!r}.")
    if costs is None:
        assert target is not None
        costs = prefix_costs(result, target, pad=pad)
    elif costs.shape != result.candidates.shape:
        raise ValueError(
            f"{op}: expected costs of shape {tuple(result.candidates.shape)}; got "
            f"{tuple(costs.shape)}."
        )
    w = result.weights  # (T, B, K, n)
    beam = w.shape[2]
    per_rank = torch.linalg.vecdot(w, costs.unsqueeze(2).to(w.dtype))  # (T, B, K)
    return (whole * per_rank.sum(-1) / beam + first * per_rank[..., 0]).mean()
