"""softops.apps.beam: the beam step, the search loop, the prefix costs and the search loss."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch

from softops.apps import (
    BEAM_METHODS,
    beam_search,
    beam_search_loss,
    beam_step,
    prefix_costs,
)
from tests._helpers import seeded

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small problems: one thread (the machine is shared)."""


def _log_probs(b: int, k: int, v: int, seed: int = 0, scale: float = 1.0, dtype=F64):
    return torch.log_softmax(scale * torch.randn(b, k, v, generator=seeded(seed), dtype=dtype), -1)


class _Table:
    """A fixed random model: the log-probabilities depend on the step and the last token."""

    def __init__(self, v: int, steps: int, seed: int, scale: float = 2.0) -> None:
        g = seeded(seed)
        self.logits = scale * torch.randn(steps, v + 1, v, generator=g, dtype=F64)

    def __call__(self, tokens, state, t):
        return torch.log_softmax(self.logits[t, tokens], -1), state


def _reference_search(table: _Table, b: int, k: int, steps: int, bos: int, eos: int | None):
    """Plain beam search on one sequence at a time, written out with Python lists."""
    v = table.logits.shape[-1]
    out = []
    for _ in range(b):
        beams = [((), 0.0, False)]  # (tokens, score, finished)
        for t in range(steps):
            cands = []
            for toks, score, done in beams:
                if done:
                    cands.append(((*toks, eos), score, True))
                    continue
                last = toks[-1] if toks else bos
                lp = torch.log_softmax(table.logits[t, last], -1)
                for tok in range(v):
                    cands.append(((*toks, tok), score + float(lp[tok]), tok == eos))
            # torch.topk order: by score, the lower index first among ties (none: random floats)
            cands.sort(key=lambda c: -c[1])
            beams = cands[:k]
            if eos is not None and all(c[2] for c in beams):
                break
        out.append(beams)
    return out


# ----------------------------------------------------------------------------------------------
# beam_step


@pytest.mark.parametrize("method", BEAM_METHODS)
def test_step_hard_part_is_torch_topk_over_the_candidates(method):
    scores = torch.randn(5, 3, generator=seeded(1), dtype=F64)
    lp = _log_probs(5, 3, 7, seed=2)
    out = beam_step(scores, lp, epsilon=0.3, method=method)
    cand = (scores[:, :, None] + lp).reshape(5, 21)
    top = torch.topk(cand, 3, dim=-1)
    torch.testing.assert_close(out.candidates, cand, rtol=0, atol=0)
    torch.testing.assert_close(out.scores, top.values, rtol=0, atol=0)
    assert torch.equal(out.parents * 7 + out.tokens, top.indices)
    assert torch.equal(out.parents, top.indices // 7) and torch.equal(out.tokens, top.indices % 7)
    assert out.weights.shape == (5, 3, 21)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(5, 3, dtype=F64))
    assert bool((out.weights >= 0).all())


@pytest.mark.parametrize("eps", [1e-2, 1e-3])
def test_soft_weights_tend_to_the_one_hots_of_the_selection(eps):
    # gaps between the candidate scores of at least 0.5 (scores 0.5 apart, shuffled)
    g = seeded(3)
    cand = torch.stack([torch.randperm(12, generator=g) for _ in range(4)]).to(F64) * 0.5
    scores, lp = torch.zeros(4, 2, dtype=F64), cand.reshape(4, 2, 6)
    out = beam_step(scores, lp, epsilon=eps)
    hard = beam_step(scores, lp, method="hard")
    want = torch.nn.functional.one_hot(torch.topk(cand, 2).indices, 12).to(F64)
    assert torch.equal(hard.weights, want)
    assert float((out.weights - want).abs().max()) < 1e-6


def test_softmax_weights_are_the_softmax_of_the_candidates_in_every_row():
    scores = torch.randn(3, 2, generator=seeded(4), dtype=F64)
    lp = _log_probs(3, 2, 5, seed=5)
    out = beam_step(scores, lp, epsilon=0.7, method="softmax")
    sm = torch.softmax(out.candidates / 0.7, -1)
    torch.testing.assert_close(out.weights, sm[:, None].expand(3, 2, 10), rtol=0, atol=1e-15)


def test_step_never_selects_minus_inf_candidates_and_gives_them_no_weight():
    scores = torch.tensor([[0.0, -torch.inf]], dtype=F64)  # beam 1 not live
    lp = _log_probs(1, 2, 4, seed=6)
    for method in BEAM_METHODS:
        out = beam_step(scores, lp, epsilon=0.5, method=method)
        assert bool((out.parents == 0).all()), method
        assert float(out.weights[..., 4:].abs().max()) == 0.0, method
        assert torch.isfinite(out.weights).all(), method


def test_nan_in_one_row_stays_in_that_row():
    scores = torch.zeros(3, 2, dtype=F64)
    lp = _log_probs(3, 2, 4, seed=7)
    lp[1, 0, 2] = torch.nan
    out = beam_step(scores, lp, epsilon=0.5)
    assert bool(torch.isnan(out.weights[1]).all())
    clean = beam_step(scores[[0, 2]], lp[[0, 2]], epsilon=0.5)
    torch.testing.assert_close(out.weights[[0, 2]], clean.weights, rtol=0, atol=0)


def _step_loss(lp, scores, cost, eps):
    w = beam_step(scores, lp, epsilon=eps).weights
    return (w * cost[:, None]).sum()


@pytest.mark.parametrize(("scale", "eps"), [(1.0, 0.5), (4.0, 0.05), (8.0, 0.02)])
def test_step_gradient_matches_central_differences_near_one_hot(scale, eps):
    """Beam search lives where the weights are nearly one-hot: gaps far above epsilon."""
    b, k, v = 3, 2, 5
    scores = torch.tensor([[0.0, -0.7], [0.0, -2.0], [0.0, -0.1]], dtype=F64)
    lp = _log_probs(b, k, v, seed=8, scale=scale).requires_grad_(True)
    cost = torch.rand(b, k * v, generator=seeded(9), dtype=F64)
    loss = _step_loss(lp, scores, cost, eps)
    (grad,) = torch.autograd.grad(loss, lp)
    d = torch.randn(lp.shape, generator=seeded(10), dtype=F64)
    # soft_topk drops candidates whose weight is below 1e-14 (float64): the loss may step by
    # that much between x + h d and x - h d, so h keeps that step far below the atol of fd
    h = 1e-4 * eps
    with torch.no_grad():
        fd = _step_loss(lp + h * d, scores, cost, eps) - _step_loss(lp - h * d, scores, cost, eps)
        fd = fd / (2 * h)
    torch.testing.assert_close((grad * d).sum(), fd, rtol=1e-5, atol=1e-8)
    assert bool(torch.isfinite(grad).all()) and float(grad.abs().max()) > 0


def test_step_under_torch_func_grad_and_vmap():
    scores = torch.randn(3, 2, generator=seeded(13), dtype=F64)
    lp = _log_probs(3, 2, 4, seed=14)
    cost = torch.rand(3, 8, generator=seeded(15), dtype=F64)

    def loss(p):
        return _step_loss(p, scores, cost, 0.3)

    x = lp.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(torch.func.grad(loss)(lp), want, rtol=1e-12, atol=1e-14)
    batched = torch.func.vmap(lambda s, p: beam_step(s, p, epsilon=0.3).weights)(
        scores.unsqueeze(1), lp.unsqueeze(1)
    )
    torch.testing.assert_close(batched.squeeze(1), beam_step(scores, lp, epsilon=0.3).weights)


def test_step_gradcheck():
    scores = torch.randn(2, 2, generator=seeded(11), dtype=F64, requires_grad=True)
    lp = _log_probs(2, 2, 3, seed=12).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda s, p: beam_step(s, p, epsilon=0.4).weights, (scores, lp), atol=1e-7
    )


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"epsilon": 0.0}, ValueError, "epsilon"),
        ({"method": "mixed"}, ValueError, "method"),
        ({"log_probs": torch.zeros(2, 3, 4)}, ValueError, r"\(B, K, V\)"),
        ({"log_probs": torch.zeros(2, 2)}, ValueError, "3 dims"),
        ({"beam_scores": torch.zeros(2, 2, dtype=torch.long)}, TypeError, "floating"),
        ({"beam_scores": [[0.0, 0.0]]}, TypeError, "to be a torch.Tensor"),
        ({"beam_scores": torch.tensor([[0.0, -torch.inf]] * 2)}, ValueError, "row 0 has 1"),
    ],
)
def test_step_rejects_bad_input(kwargs, err, match):
    args = {"beam_scores": torch.zeros(2, 2), "log_probs": torch.zeros(2, 2, 1), **kwargs}
    with pytest.raises(err, match=match):
        beam_step(args.pop("beam_scores"), args.pop("log_probs"), **args)


# ----------------------------------------------------------------------------------------------
# beam_search


@pytest.mark.parametrize(("k", "eos"), [(1, None), (2, None), (3, 4), (4, 0)])
def test_search_equals_plain_beam_search(k, eos):
    b, v, steps = 4, 5, 6
    table = _Table(v, steps, seed=13 + k)
    out = beam_search(table, None, batch_size=b, beam_size=k, max_len=steps, bos=v, eos=eos,
                      method="hard")  # fmt: skip
    ref = _reference_search(table, b, k, steps, bos=v, eos=eos)
    for i, beams in enumerate(ref):
        for j, (toks, score, done) in enumerate(beams):
            assert out.sequences[i, j].tolist() == list(toks), (i, j)
            assert float(out.scores[i, j]) == pytest.approx(score, abs=1e-12)
            assert bool(out.finished[i, j]) == done
            length = toks.index(eos) + 1 if done else len(toks)
            assert int(out.lengths[i, j]) == length


@pytest.mark.parametrize("method", ["soft_topk", "softmax"])
def test_search_path_does_not_depend_on_the_method(method):
    table = _Table(6, 5, seed=20)
    kw = {"batch_size": 3, "beam_size": 3, "max_len": 5, "bos": 6, "eos": 1}
    hard = beam_search(table, None, method="hard", **kw)
    soft = beam_search(table, None, method=method, epsilon=0.3, **kw)
    for name in ("sequences", "lengths", "finished", "parents", "tokens"):
        assert torch.equal(getattr(hard, name), getattr(soft, name)), name
    torch.testing.assert_close(hard.scores, soft.scores, rtol=0, atol=0)
    torch.testing.assert_close(soft.weights.sum(-1), torch.ones_like(soft.weights[..., 0]))


def test_search_stops_once_every_hypothesis_is_finished_and_pads_after_eos():
    v, eos, pad = 4, 3, 0

    def step(tokens, state, t):  # step 0: 1 or EOS; then 2; then EOS
        logits = torch.full((tokens.shape[0], v), -5.0, dtype=F64)
        logits[:, (1, 2, eos)[t]] = 5.0
        if t == 0:
            logits[:, eos] = 4.0
        return torch.log_softmax(logits, -1), state

    out = beam_search(step, None, batch_size=2, beam_size=2, max_len=10, bos=0, eos=eos, pad=pad)
    assert out.sequences.shape[-1] == 3 and out.weights.shape[0] == 3  # stopped after 3 steps
    assert bool(out.finished.all())
    assert out.sequences[0].tolist() == [[1, 2, eos], [eos, pad, pad]]
    assert out.lengths[0].tolist() == [3, 1]
    # the finished hypothesis keeps its score: pad has log-probability 0
    first = torch.log_softmax(torch.tensor([-5.0, 5.0, -5.0, 4.0], dtype=F64), -1)
    assert float(out.scores[0, 1]) == pytest.approx(float(first[eos]), abs=1e-12)
    for i, j in itertools.product(range(2), range(2)):
        seq = out.sequences[i, j].tolist()
        n = int(out.lengths[i, j])
        assert seq[n - 1] == eos and all(tok == pad for tok in seq[n:])


class _State(NamedTuple):
    fed: torch.Tensor
    extra: dict


@pytest.mark.parametrize("nested", [False, True])
def test_search_state_follows_its_beam(nested):
    """The state is reordered with the beams: a state that stores the fed tokens holds, after
    the search, each kept hypothesis' fed tokens (bos, then its tokens but the last)."""
    v, steps, bos = 5, 5, 5
    table = _Table(v, steps, seed=22)
    record = {}

    def step(tokens, state, t):
        if nested:
            fed = torch.cat((state.fed, tokens[:, None]), 1)
            state = _State(fed, {"copy": [fed.clone()], "none": None})
        else:
            state = fed = torch.cat((state, tokens[:, None]), 1)
        record["fed"] = fed
        return table(tokens, None, t)[0], state

    s0 = torch.zeros(3, 0, dtype=torch.long)
    state = _State(s0, {"copy": [s0], "none": None}) if nested else s0
    out = beam_search(step, state, batch_size=3, beam_size=3, max_len=steps, bos=bos)
    # the last call's state is reordered by the last parents after it returned
    fed = record["fed"].reshape(3, 3, steps)
    fed = fed.gather(1, out.parents[-1][:, :, None].expand(3, 3, steps))
    assert torch.equal(fed[:, :, 0], torch.full((3, 3), bos))
    assert torch.equal(fed[:, :, 1:], out.sequences[:, :, :-1])


def test_search_gradients_reach_the_model():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 4).double()
    head = torch.nn.Linear(4, 5).double()

    def step(tokens, state, t):
        return torch.log_softmax(head(emb(tokens)), -1), state

    out = beam_search(step, None, batch_size=4, beam_size=2, max_len=4, bos=5, eos=4, epsilon=0.5)
    target = torch.randint(0, 4, (4, 4), generator=seeded(23))
    loss = beam_search_loss(out, target)
    loss.backward()
    assert emb.weight.grad is not None and float(emb.weight.grad.abs().sum()) > 0
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"beam_size": 0}, ValueError, "beam_size"),
        ({"max_len": 0}, ValueError, "max_len"),
        ({"batch_size": 1.5}, TypeError, "batch_size"),
        ({"beam_size": 6}, ValueError, "V >= beam_size"),
        ({"eos": 7}, ValueError, "eos and pad"),
        ({"state": {1, 2}}, TypeError, "state"),
        ({"method": "mixed"}, ValueError, "method"),
    ],
)
def test_search_rejects_bad_input(kwargs, err, match):
    table = _Table(5, 3, seed=24)
    kw = {"batch_size": 2, "beam_size": 2, "max_len": 3, "bos": 5, "state": None, **kwargs}
    state = kw.pop("state")
    with pytest.raises(err, match=match):
        beam_search(table, state, **kw)


def test_search_rejects_log_probs_of_the_wrong_shape():
    def step(tokens, state, t):
        return torch.zeros(tokens.shape[0] + 1, 4), state

    with pytest.raises(ValueError, match=r"\(B\*K, V\)"):
        beam_search(step, None, batch_size=2, beam_size=2, max_len=3, bos=0)


# ----------------------------------------------------------------------------------------------
# prefix_costs and beam_search_loss


def _walk_prefix(out, t: int, i: int, c: int) -> list[int]:
    """The tokens of candidate c at step t, found by walking the parents back."""
    v = out.candidates.shape[-1] // out.parents.shape[-1]
    toks = [c % v]
    beam = c // v
    for s in range(t - 1, -1, -1):
        toks.append(int(out.tokens[s, i, beam]))
        beam = int(out.parents[s, i, beam])
    return toks[::-1]


def test_prefix_costs_are_the_hamming_distances_of_the_candidates_prefixes():
    table = _Table(4, 5, seed=25)
    out = beam_search(table, None, batch_size=2, beam_size=2, max_len=5, bos=4, method="hard")
    target = torch.randint(0, 4, (2, 3), generator=seeded(26))
    costs = prefix_costs(out, target, pad=0)
    padded = torch.cat((target, torch.zeros(2, 2, dtype=torch.long)), 1)
    for t, i, c in itertools.product(range(5), range(2), range(8)):
        prefix = _walk_prefix(out, t, i, c)
        want = sum(a != b for a, b in zip(prefix, padded[i, : t + 1].tolist(), strict=True))
        assert float(costs[t, i, c]) == want, (t, i, c)


def test_beam_search_loss_is_its_formula():
    table = _Table(4, 3, seed=27)
    out = beam_search(table, None, batch_size=2, beam_size=2, max_len=3, bos=4, epsilon=0.5)
    target = torch.randint(0, 4, (2, 3), generator=seeded(28))
    costs = prefix_costs(out, target)
    want = 0.0
    for t, i in itertools.product(range(3), range(2)):
        w = out.weights[t, i]
        want += float(0.7 * (w @ costs[t, i]).mean() + 0.3 * (w[0] @ costs[t, i]))
    got = beam_search_loss(out, target, first=0.3, whole=0.7)
    assert float(got) == pytest.approx(want / 6, rel=1e-12)
    again = beam_search_loss(out, costs=costs, first=0.3, whole=0.7)
    assert float(again) == pytest.approx(float(got), rel=1e-15)


def test_beam_search_loss_is_zero_for_a_certain_right_search():
    """A model that puts all its mass on the target at every step, with the beam full of
    zero-cost candidates, has loss 0 (epsilon far below the gaps)."""
    target = torch.tensor([[1, 2, 0]])

    def step(tokens, state, t):
        logits = torch.full((tokens.shape[0], 3), -40.0, dtype=F64)
        logits[:, int(target[0, t])] = 0.0
        return torch.log_softmax(logits, -1), state

    out = beam_search(step, None, batch_size=1, beam_size=1, max_len=3, bos=0, epsilon=0.01)
    assert out.sequences[0, 0].tolist() == [1, 2, 0]
    assert float(beam_search_loss(out, target)) < 1e-12


def test_loss_and_costs_reject_bad_input():
    table = _Table(4, 3, seed=29)
    out = beam_search(table, None, batch_size=2, beam_size=2, max_len=3, bos=4)
    target = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one"):
        beam_search_loss(out)
    with pytest.raises(ValueError, match="exactly one"):
        beam_search_loss(out, target, costs=torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match="first"):
        beam_search_loss(out, target, first=-1.0)
    with pytest.raises(ValueError, match="whole"):
        beam_search_loss(out, target, whole=float("nan"))
    with pytest.raises(ValueError, match="costs of shape"):
        beam_search_loss(out, costs=torch.zeros(3, 2, 7))
    with pytest.raises(ValueError, match="pass pad"):
        prefix_costs(out, target[:, :2])
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        prefix_costs(out, target[:1])
    with pytest.raises(TypeError, match="integer"):
        prefix_costs(out, target.double())


def test_beam_step_refuses_rows_with_fewer_than_k_live_candidates():
    """A row with fewer than K candidates above -inf cannot fill its beams: the error names it."""
    beams = torch.zeros(2, 2)
    log_probs = torch.zeros(2, 2, 3)
    log_probs[1] = -torch.inf
    log_probs[1, 0, 0] = 0.0
    with pytest.raises(ValueError, match=r"at least 2 \(K = 2\) candidates .*; row 1 has 1\.$"):
        beam_step(beams, log_probs)
