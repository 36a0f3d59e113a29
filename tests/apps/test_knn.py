"""softops.apps.knn: the relaxed kNN mask and loss, the hard classifier and the Module."""

from __future__ import annotations

import pickle

import pytest
import torch

import softops
from softops.apps import (
    KNN_METHODS,
    DifferentiableKNN,
    knn_loss,
    knn_mask,
    knn_predict,
    squared_distances,
)
from softops.apps.models import ConvNet
from tests._helpers import seeded

F64 = torch.float64
SOFT = ("ot", "sinkhorn", "softkmax", "neuralsort")  # deterministic methods


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small problems: one thread (the machine is shared)."""


def _emb(b: int, m: int, d: int = 5, seed: int = 0, dtype=F64):
    g = seeded(seed)
    return torch.randn(b, d, generator=g, dtype=dtype), torch.randn(m, d, generator=g, dtype=dtype)


def _hard_mask(q: torch.Tensor, c: torch.Tensor, k: int) -> torch.Tensor:
    """The hard operator of the knn_mask docstring, written as there."""
    D = torch.cdist(q, c) ** 2
    return torch.zeros_like(D).scatter(1, D.topk(k, dim=1, largest=False).indices, 1)


def _gap_epsilon(q: torch.Tensor, c: torch.Tensor, k: int, exclude_self: bool = False) -> float:
    """An epsilon far below every row's gap between its k-th and (k+1)-th smallest distance."""
    D = torch.cdist(q, c) ** 2
    if exclude_self:
        D = D + torch.diag(torch.full((D.shape[0],), float("inf"), dtype=D.dtype))
    s = D.sort(1).values
    gap = float((s[:, k] - s[:, k - 1]).min())
    assert gap > 1e-4  # the fixture's seeds keep the rows separable
    return gap / 200


# ----------------------------------------------------------------------------------------------
# Shapes and the formula


@pytest.mark.parametrize("method", KNN_METHODS)
def test_shapes(method: str) -> None:
    q, c = _emb(4, 7, dtype=torch.float32)
    kw = {"n_samples": 8, "generator": seeded(1)} if method == "perturbed" else {}
    A = knn_mask(q, c, 3, method=method, **kw)
    assert A.shape == (4, 7) and A.dtype == torch.float32
    kw = {"n_samples": 8, "generator": seeded(1)} if method == "perturbed" else {}
    A = knn_mask(c, c, 3, method=method, exclude_self=True, **kw)
    assert A.shape == (7, 7)
    assert torch.equal(A.diagonal(), torch.zeros(7))
    y_q, y_c = torch.arange(4) % 2, torch.arange(7) % 2
    kw = {"n_samples": 8, "generator": seeded(1)} if method == "perturbed" else {}
    loss = knn_loss(q, c, y_q, y_c, 3, method=method, **kw)
    assert loss.shape == () and loss.dtype == torch.float32
    assert knn_predict(c, y_c, q, 3).shape == (4,)


@pytest.mark.parametrize("method", (*SOFT, "perturbed"))
@pytest.mark.parametrize("exclude_self", [False, True])
def test_loss_equals_the_formula(method: str, exclude_self: bool) -> None:
    """-(1/B) sum_i (1/k) sum_j A_ij [y_i = y_j], with A the relaxation of the distances."""
    k, eps = 3, 0.7
    q, c = _emb(6, 6 if exclude_self else 9, seed=2)
    if exclude_self:
        q = c
    y_q = torch.tensor([0, 1, 2, 0, 1, 2])[: q.shape[0]]
    y_c = torch.tensor([0, 1, 2, 2, 1, 0, 0, 1, 2])[: c.shape[0]]
    kw = {"n_samples": 16, "generator": seeded(3)} if method == "perturbed" else {}
    loss = knn_loss(q, c, y_q, y_c, k, epsilon=eps, method=method, exclude_self=exclude_self, **kw)

    total = torch.zeros((), dtype=F64)
    g = seeded(3)
    for i in range(q.shape[0]):
        js = [j for j in range(c.shape[0]) if not (exclude_self and j == i)]
        d = torch.stack([((q[i] - c[j]) ** 2).sum() for j in js])
        if method == "neuralsort":
            a = softops.soft_argsort(d, epsilon=eps, method="neuralsort")[:k].sum(0)
        elif method == "perturbed":
            continue  # one draw per batch, not per row: compared through the batch below
        else:
            a = softops.soft_topk_mask(d, k, largest=False, epsilon=eps, method=method)
        same = torch.tensor([float(y_q[i] == y_c[j]) for j in js], dtype=F64)
        total = total + (a * same).sum() / k
    if method == "perturbed":
        D = torch.cdist(q, c) ** 2
        if exclude_self:
            keep = ~torch.eye(6, dtype=torch.bool)
            D = D[keep].view(6, 5)
        A = softops.soft_topk_mask(
            D, k, largest=False, epsilon=eps, method="perturbed", n_samples=16, generator=g
        )
        same = (y_q[:, None] == y_c[None, :]).to(F64)
        if exclude_self:
            same = same[~torch.eye(6, dtype=torch.bool)].view(6, 5)
        total = (A * same).sum() / k
    torch.testing.assert_close(loss, -total / q.shape[0])


def test_loss_of_the_hard_mask_is_minus_the_neighbour_agreement() -> None:
    q, c = _emb(5, 12, seed=4)
    y_q, y_c = torch.arange(5) % 3, torch.arange(12) % 3
    k = 4
    loss = knn_loss(q, c, y_q, y_c, k, epsilon=_gap_epsilon(q, c, k))
    D = torch.cdist(q, c) ** 2
    same = (y_q[:, None] == y_c[None, :]).to(F64)
    hard = -same.gather(1, D.topk(k, dim=1, largest=False).indices).mean()
    torch.testing.assert_close(loss, hard, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# The hard limit


@pytest.mark.parametrize("method", ("ot", "softkmax", "neuralsort", "perturbed"))
def test_small_epsilon_gives_the_hard_knn_mask(method: str) -> None:
    q, c = _emb(6, 15, seed=5)
    k = 4
    eps = _gap_epsilon(q, c, k)
    if method == "softkmax":
        eps /= 10  # its recursion needs a wider margin (its bias is O(eps))
    kw = {"n_samples": 4, "generator": seeded(0)} if method == "perturbed" else {}
    A = knn_mask(q, c, k, epsilon=eps / 10 if method == "perturbed" else eps, method=method, **kw)
    torch.testing.assert_close(A, _hard_mask(q, c, k), atol=1e-4, rtol=0)


def test_sinkhorn_equals_ot() -> None:
    """The same problem solved by Sinkhorn (its small-epsilon limit is that of "ot", slowly)."""
    q, c = _emb(6, 15, seed=5)
    for eps in (0.3, 3.0):
        torch.testing.assert_close(
            knn_mask(q, c, 4, epsilon=eps, method="sinkhorn"),
            knn_mask(q, c, 4, epsilon=eps, method="ot"),
            atol=1e-6,
            rtol=0,
        )


@pytest.mark.parametrize("method", ("ot", "neuralsort"))
def test_small_epsilon_exclude_self_is_the_hard_mask_without_the_query(method: str) -> None:
    _, c = _emb(1, 10, seed=6)
    k = 3
    A = knn_mask(c, c, k, epsilon=_gap_epsilon(c, c, k, True), method=method, exclude_self=True)
    D = torch.cdist(c, c) ** 2 + torch.diag(torch.full((10,), float("inf"), dtype=F64))
    hard = torch.zeros_like(D).scatter(1, D.topk(k, dim=1, largest=False).indices, 1)
    torch.testing.assert_close(A, hard, atol=1e-4, rtol=0)


def test_epsilon_scaling_law() -> None:
    """Embeddings times c, epsilon times c**2: the same mask."""
    q, c = _emb(3, 8, seed=7)
    A = knn_mask(q, c, 3, epsilon=0.5)
    torch.testing.assert_close(knn_mask(3 * q, 3 * c, 3, epsilon=4.5), A)


def test_squared_distances() -> None:
    a, b = _emb(4, 6, seed=8)
    torch.testing.assert_close(squared_distances(a, b), torch.cdist(a, b) ** 2)
    assert (squared_distances(a, a).diagonal() >= 0).all()


# ----------------------------------------------------------------------------------------------
# Gradients reach the embedding network


@pytest.mark.parametrize("method", KNN_METHODS)
def test_gradients_reach_the_embedding_network(method: str) -> None:
    torch.manual_seed(0)
    net = ConvNet(1, 8, embedding_dim=16)
    kw = {"n_samples": 32} if method == "perturbed" else {}
    model = DifferentiableKNN(net, k=3, epsilon=1.0, method=method, **kw)
    g = seeded(9)
    x = torch.rand(20, 1, 8, 8, generator=g)
    y = torch.arange(20) % 4
    loss = model(x[:10], x[10:], y[:10], y[10:], generator=seeded(2) if kw else None)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert float(net.conv1.weight.grad.abs().sum()) > 0  # the first layer receives a gradient


def test_epsilon_tensor_receives_a_gradient() -> None:
    q, c = _emb(3, 8, seed=10)
    eps = torch.tensor(0.5, dtype=F64, requires_grad=True)
    knn_loss(q, c, torch.arange(3), torch.arange(8) % 3, 2, epsilon=eps).backward()
    assert eps.grad is not None and torch.isfinite(eps.grad)


def test_training_reduces_the_loss() -> None:
    """A few steps of Adam on two Gaussian blobs: the kNN loss goes down."""
    torch.manual_seed(0)
    g = seeded(11)
    x = torch.cat([torch.randn(40, 4, generator=g) + 1.0, torch.randn(40, 4, generator=g) - 1.0])
    y = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(40, dtype=torch.long)])
    model = DifferentiableKNN(torch.nn.Linear(4, 3), k=5)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    first = None
    for _ in range(30):
        perm = torch.randperm(80, generator=g)
        loss = model(x[perm[:40]], x[perm[40:]], y[perm[:40]], y[perm[40:]])
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first - 0.05


# ----------------------------------------------------------------------------------------------
# knn_predict


def test_knn_predict_equals_scikit_learn() -> None:
    neighbors = pytest.importorskip("sklearn.neighbors")
    g = seeded(12)
    train = torch.randn(300, 6, generator=g, dtype=F64)
    train_y = torch.randint(0, 4, (300,), generator=g)
    query = torch.randn(200, 6, generator=g, dtype=F64)
    for k in (1, 5, 8):
        ours = knn_predict(train, train_y, query, k, chunk_size=64, train_chunk_size=50)
        sk = neighbors.KNeighborsClassifier(n_neighbors=k, algorithm="brute")
        theirs = torch.as_tensor(sk.fit(train.numpy(), train_y.numpy()).predict(query.numpy()))
        # scikit-learn breaks a tied vote to the smallest label, we to the nearest neighbour's
        idx = torch.cdist(query, train).topk(k, largest=False).indices
        votes = torch.nn.functional.one_hot(train_y[idx], 4).sum(1)
        unique = (votes == votes.amax(1, keepdim=True)).sum(1) == 1
        assert int(unique.sum()) > 100
        assert torch.equal(ours[unique], theirs[unique])
        assert torch.equal(ours, knn_predict(train, train_y, query, k))  # chunking is invisible


def test_knn_predict_breaks_ties_to_the_nearest() -> None:
    train = torch.tensor([[0.0], [1.0], [-2.0], [3.0]])
    train_y = torch.tensor([1, 0, 0, 1])
    # neighbours of 0.4: 0.0 (label 1), 1.0 (0), -2.0 (0), 3.0 (1); of 0.6: 1.0 (0), 0.0 (1),
    # 3.0 (1), -2.0 (0). k = 2 and k = 4 tie: the nearest neighbour's label wins.
    q = torch.tensor([[0.4], [0.6]])
    assert knn_predict(train, train_y, q, 2).tolist() == [1, 0]
    assert knn_predict(train, train_y, q, 4).tolist() == [1, 0]
    assert knn_predict(train, train_y, q, 3).tolist() == [0, 1]  # no ties: the majority


def test_knn_predict_bounded_chunks_and_empty_queries() -> None:
    train, query = _emb(50, 7, seed=13)
    y = torch.arange(50) % 5
    full = knn_predict(train, y, query, 3)
    for chunk, train_chunk in ((1, 1), (3, 7), (7, 100)):
        assert torch.equal(knn_predict(train, y, query, 3, chunk_size=chunk,
                                       train_chunk_size=train_chunk), full)  # fmt: skip
    assert knn_predict(train, y, query[:0], 3).shape == (0,)


# ----------------------------------------------------------------------------------------------
# The Module and the errors


def test_module_equals_the_function_and_pickles() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    model = DifferentiableKNN(net, k=2, epsilon=0.5, method="softkmax")
    assert "DifferentiableKNN(\n  k=2, epsilon=0.5, method='softkmax'\n" in repr(model)
    x, y = torch.randn(10, 4), torch.arange(10) % 2
    expected = knn_loss(net(x[:4]), net(x[4:]), y[:4], y[4:], 2, epsilon=0.5, method="softkmax")
    torch.testing.assert_close(model(x[:4], x[4:], y[:4], y[4:]), expected)
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(clone(x[:4], x[4:], y[:4], y[4:]), expected)
    model.train()
    pred = model.predict(x, y, x[:3], batch_size=3)
    assert model.training
    assert torch.equal(pred, knn_predict(net(x).detach(), y, net(x[:3]).detach(), 2))


def test_errors() -> None:
    q, c = _emb(3, 5)
    y_q, y_c = torch.arange(3), torch.arange(5)
    with pytest.raises(ValueError, match=r"knn_mask: expected `k` <= the number of candidates"):
        knn_mask(q, c, 6)
    with pytest.raises(ValueError, match=r"expected `k` <= the number of other candidates"):
        knn_mask(c, c, 5, exclude_self=True)
    with pytest.raises(ValueError, match=r"as many queries as candidates .* got 3 and 5"):
        knn_mask(q, c, 2, exclude_self=True)
    with pytest.raises(TypeError, match=r"knn_mask: expected an integer `k`; got k=2.0"):
        knn_mask(q, c, 2.0)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"knn_mask: expected `method` to be one of .*; got method='soft'"
    ):
        knn_mask(q, c, 2, method="soft")
    with pytest.raises(
        ValueError, match=r"knn_mask: expected `epsilon` > 0 and finite; got epsilon=0"
    ):
        knn_mask(q, c, 2, epsilon=0)
    with pytest.raises(ValueError, match=r"`n_samples` and `generator` only with .*'ot'"):
        knn_mask(q, c, 2, n_samples=3)
    with pytest.raises(ValueError, match=r"the same embedding size; got 5 and 4"):
        knn_mask(q, c[:, :4], 2)
    with pytest.raises(ValueError, match=r"expected `query_emb` of shape \(N, d\); got shape"):
        knn_mask(q[0], c, 2)
    with pytest.raises(ValueError, match=r"knn_loss: expected `cand_y` of shape \(5,\); got"):
        knn_loss(q, c, y_q, y_c[:4], 2)
    with pytest.raises(TypeError, match=r"expected integer labels `query_y`; got dtype"):
        knn_loss(q, c, y_q.double(), y_c, 2)
    with pytest.raises(ValueError, match=r"knn_predict: expected `k` <= the number of training"):
        knn_predict(c, y_c, q, 6)
    with pytest.raises(ValueError, match=r"expected a positive integer `chunk_size`; got 0"):
        knn_predict(c, y_c, q, 2, chunk_size=0)
    with pytest.raises(ValueError, match=r"DifferentiableKNN: expected `k` >= 1; got k=0"):
        DifferentiableKNN(torch.nn.Identity(), 0)
    with pytest.raises(TypeError, match=r"DifferentiableKNN: expected `embedding` to be a"):
        DifferentiableKNN(lambda x: x, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`n_samples` only with method='perturbed'"):
        DifferentiableKNN(torch.nn.Identity(), 2, n_samples=4)
