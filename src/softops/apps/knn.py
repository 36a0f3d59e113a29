r"""Differentiable k-nearest-neighbour classification (Xie et al. 2020, §4.1).

The protocol is NeuralSort's differentiable kNN (Grover et al. 2019), which Xie et al. follow:
each step embeds a batch of queries and a disjoint batch of m candidates, takes the squared
distances :math:`D_{ij} = \lVert f(x_i) - f(c_j) \rVert^2`, relaxes the mask :math:`A` of each
query's k *smallest* distances, and minimises minus the soft fraction of same-label neighbours,

.. math::

    \mathcal{L} = -\frac{1}{B}\sum_{i=1}^{B} \frac{1}{k} \sum_{j=1}^{m} A_{ij}\,[y_i = y_j].

At test time the classifier is the hard kNN over the whole training set (:func:`knn_predict`).
The relaxation is any top-k method of :func:`softops.soft_topk_mask` (``largest=False``) or
NeuralSort's first k rows (``"neuralsort"``).

**Epsilon** is in the units of D, squared distances in the embedding space (NeuralSort's tau for
"neuralsort"). Scaling the embeddings by c scales D by c², so the network chooses its own
sharpness and a fixed ``epsilon = 1`` works. **Never divide D by a detached per-row maximum**:
every step then pushes the embeddings outwards.

References:
    Xie, Dai, Chen, Dai, Zhao, Zha, Wei and Pfister. Differentiable Top-k Operator with Optimal
    Transport. NeurIPS 2020. arXiv:2002.06504.
    Grover, Wang, Zweig and Ermon. Stochastic Optimization of Sorting Networks via Continuous
    Relaxations. ICLR 2019. arXiv:1903.08850.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

import softops
from softops._core.validation import check_choice, check_epsilon, check_floating

__all__ = [
    "KNN_METHODS",
    "DifferentiableKNN",
    "knn_loss",
    "knn_mask",
    "knn_predict",
    "squared_distances",
]

KNN_METHODS = ("ot", "sinkhorn", "perturbed", "softkmax", "neuralsort")
"""The relaxations of the neighbour mask that :func:`knn_mask` accepts."""


# -------------------------------- argument checks (method and epsilon: the library's shared checks)


def _check_k(op: str, k: object, limit: int | None = None, what: str = "") -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"{op}: expected an integer `k`; got k={k!r}.")
    k = int(k)
    if k < 1:
        raise ValueError(f"{op}: expected `k` >= 1; got k={k}.")
    if limit is not None and k > limit:
        raise ValueError(f"{op}: expected `k` <= {what} (= {limit}); got k={k}.")
    return k


def _check_embeddings(op: str, a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> None:
    for name, t in zip(names, (a, b), strict=True):
        if check_floating(t, op, name).dim() != 2:
            raise ValueError(
                f"{op}: expected `{name}` of shape (N, d); got shape {tuple(t.shape)}."
            )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"{op}: expected `{names[0]}` and `{names[1]}` with the same embedding size; got "
            f"{a.shape[1]} and {b.shape[1]}."
        )


def _check_labels(op: str, y: torch.Tensor, n: int, name: str) -> None:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{op}: expected `{name}` to be a tensor; got {type(y).__name__}.")
    if y.shape != (n,):
        raise ValueError(f"{op}: expected `{name}` of shape ({n},); got shape {tuple(y.shape)}.")
    if torch.is_floating_point(y) or torch.is_complex(y):
        raise TypeError(f"{op}: expected integer labels `{name}`; got dtype {y.dtype}.")


# ---------------------------------------------------------------------------- the functional pieces


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r"""Pairwise squared Euclidean distances, :math:`D_{ij} = \lVert a_i - b_j \rVert^2`.

    One matrix product, clamped at 0 against rounding: (N, d) and (M, d) give (N, M).

    Example:
        >>> squared_distances(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0], [1.0, 0.0]]))
        tensor([[25.,  1.]])
    """
    a2 = a.pow(2).sum(-1, keepdim=True)
    b2 = b.pow(2).sum(-1)
    return torch.addmm(a2 + b2, a, b.T, alpha=-2).clamp_min(0)


def knn_mask(
    query_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    k: int,
    *,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "ot",
    exclude_self: bool = False,
    n_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""The relaxed mask of each query's k nearest candidates (the k smallest squared distances).

    :func:`softops.soft_topk_mask` of each row of D with ``largest=False``, or the sum of the
    first k rows of NeuralSort's relaxed permutation matrix (``"neuralsort"``):

    .. math::

        A_{ij} = \sigma\!\left(\frac{t_i - D_{ij}}{\varepsilon}\right), \qquad
        \sum_j A_{ij} = k \quad \text{("ot")}.

    Args:
        query_emb: (B, d) query embeddings.
        cand_emb: (m, d) candidate embeddings.
        k: neighbours per query, in [1, m] (in [1, m - 1] with ``exclude_self``).
        epsilon: the temperature, in squared-distance units; a float or a tensor.
        method: one of :data:`KNN_METHODS`.
        exclude_self: the queries are the candidates (B = m); A's diagonal is 0.
        n_samples, generator: "perturbed" only: noise draws (None: 100) and their generator.

    Returns:
        A, a (B, m) tensor with rows summing to k ("softkmax" only approximately).

    Example:
        >>> q = torch.tensor([[0.0], [10.0]])
        >>> c = torch.tensor([[1.0], [9.0], [0.5], [20.0]])
        >>> knn_mask(q, c, 2, epsilon=0.01)
        tensor([[1., 0., 1., 0.],
                [1., 1., 0., 0.]])
    """
    op = "knn_mask"
    _check_embeddings(op, query_emb, cand_emb, ("query_emb", "cand_emb"))
    method = check_choice(method, KNN_METHODS, op, "method")
    check_epsilon(epsilon, op)
    if not isinstance(exclude_self, bool):
        raise TypeError(f"{op}: expected a bool `exclude_self`; got {exclude_self!r}.")
    if method != "perturbed" and (n_samples is not None or generator is not None):
        raise ValueError(
            f"{op}: expected `n_samples` and `generator` only with method='perturbed'; got "
            f"method={method!r}."
        )
    m = cand_emb.shape[0]
    if exclude_self:
        if query_emb.shape[0] != m:
            raise ValueError(
                f"{op}: expected as many queries as candidates with exclude_self=True; got "
                f"{query_emb.shape[0]} and {m}."
            )
        k = _check_k(op, k, m - 1, "the number of other candidates")
    else:
        k = _check_k(op, k, m, "the number of candidates")

    D = squared_distances(query_emb, cand_emb)
    if exclude_self:  # (m, m) -> (m, m - 1): each row without its diagonal entry
        off_diagonal = ~torch.eye(m, dtype=torch.bool, device=D.device)
        D = D[off_diagonal].view(m, m - 1)
    if method == "neuralsort":
        P = softops.soft_argsort(D, epsilon=epsilon, method="neuralsort")  # ascending
        A = P[:, :k, :].sum(1)
    else:  # (n_samples and generator are None but with "perturbed": checked above)
        A = softops.soft_topk_mask(
            D,
            k,
            largest=False,
            epsilon=epsilon,
            method=method,
            n_samples=n_samples,
            generator=generator,
        )
    # the diagonal back, as zeros
    return A.new_zeros(m, m).masked_scatter(off_diagonal, A) if exclude_self else A


def knn_loss(
    query_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    query_y: torch.Tensor,
    cand_y: torch.Tensor,
    k: int,
    *,
    epsilon: float | torch.Tensor = 1.0,
    method: str = "ot",
    exclude_self: bool = False,
    n_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""The differentiable kNN loss: minus the soft fraction of same-label neighbours.

    .. math::

        \mathcal{L} = -\frac{1}{B}\sum_{i=1}^{B} \frac{1}{k} \sum_{j=1}^{m} A_{ij}\,[y_i = y_j],

    where A is :func:`knn_mask`; a 0-dim tensor in [-1, 0] ("softkmax" can leave it slightly).
    ``query_y`` (B,) and ``cand_y`` (m,) are integer labels; the other arguments are those of
    :func:`knn_mask`.

    Example:
        >>> q = torch.tensor([[0.0], [10.0]])
        >>> c = torch.tensor([[1.0], [9.0], [0.5], [20.0]])
        >>> knn_loss(q, c, torch.tensor([0, 1]), torch.tensor([0, 1, 0, 1]), 2, epsilon=0.01)
        tensor(-0.7500)
    """
    op = "knn_loss"
    _check_embeddings(op, query_emb, cand_emb, ("query_emb", "cand_emb"))
    _check_labels(op, query_y, query_emb.shape[0], "query_y")
    _check_labels(op, cand_y, cand_emb.shape[0], "cand_y")
    A = knn_mask(
        query_emb,
        cand_emb,
        k,
        epsilon=epsilon,
        method=method,
        exclude_self=exclude_self,
        n_samples=n_samples,
        generator=generator,
    )
    same = (query_y[:, None] == cand_y[None, :]).to(A.dtype)
    return -(A * same).sum(1).mean() / k


@torch.no_grad()
def knn_predict(
    train_emb: torch.Tensor,
    train_y: torch.Tensor,
    query_emb: torch.Tensor,
    k: int,
    *,
    num_classes: int | None = None,
    chunk_size: int = 1024,
    train_chunk_size: int = 16384,
) -> torch.Tensor:
    r"""Hard kNN classification by majority vote over the k nearest training embeddings.

    A tie between classes goes to the class of the nearest neighbour among them; elsewhere this
    equals scikit-learn's ``KNeighborsClassifier(k, algorithm="brute")``. At most ``chunk_size x
    train_chunk_size`` distances exist at once (a running top-k over blocks).

    ``train_emb`` (N, d) with labels ``train_y`` (N,) in [0, num_classes) (None:
    ``train_y.max() + 1``) classify ``query_emb`` (Q, d) into (Q,) int64 labels; k in [1, N].

    Example:
        >>> train = torch.tensor([[0.0], [1.0], [10.0], [11.0], [12.0]])
        >>> knn_predict(train, torch.tensor([0, 0, 1, 1, 1]), torch.tensor([[0.4], [9.0]]), 3)
        tensor([0, 1])
    """
    op = "knn_predict"
    _check_embeddings(op, train_emb, query_emb, ("train_emb", "query_emb"))
    _check_labels(op, train_y, train_emb.shape[0], "train_y")
    k = _check_k(op, k, train_emb.shape[0], "the number of training points")
    for name, value in (("chunk_size", chunk_size), ("train_chunk_size", train_chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{op}: expected a positive integer `{name}`; got {value!r}.")
    train_y = train_y.to(device=train_emb.device, dtype=torch.int64)
    if num_classes is None:
        num_classes = int(train_y.max()) + 1 if train_y.numel() else 1
    dtype = torch.promote_types(train_emb.dtype, query_emb.dtype)
    train = train_emb.to(dtype)
    train_sq = train.pow(2).sum(-1)
    out = []
    for queries in query_emb.to(device=train.device, dtype=dtype).split(chunk_size):
        best_d = queries.new_full((queries.shape[0], 0), float("inf"))
        best_i = torch.empty(queries.shape[0], 0, dtype=torch.int64, device=train.device)
        for start in range(0, train.shape[0], train_chunk_size):
            block = train[start : start + train_chunk_size]
            # ||q||^2 is the same for every candidate of a query: left out of the ranking.
            d = torch.addmm(train_sq[start : start + train_chunk_size], queries, block.T, alpha=-2)
            kk = min(k, d.shape[1])
            d, i = d.topk(kk, dim=1, largest=False)
            best_d = torch.cat([best_d, d], 1)
            best_i = torch.cat([best_i, i + start], 1)
            if best_d.shape[1] > k:
                best_d, pos = best_d.topk(k, dim=1, largest=False)
                best_i = best_i.gather(1, pos)
        order = best_d.argsort(dim=1, stable=True)  # nearest first
        labels = train_y[best_i.gather(1, order)]  # (q, k)
        votes = torch.zeros(labels.shape[0], num_classes, device=labels.device)
        votes.scatter_add_(1, labels, torch.ones_like(labels, dtype=votes.dtype))
        tied = votes == votes.amax(1, keepdim=True)  # (q, C): the classes with the most votes
        first = tied.gather(1, labels).to(torch.int8).argmax(1)  # nearest vote for a tied class
        out.append(labels.gather(1, first[:, None]).squeeze(1))
    if not out:
        return torch.empty(0, dtype=torch.int64, device=train.device)
    return torch.cat(out)


# --------------------------------------------------------------------------------------- the Module


class DifferentiableKNN(nn.Module):
    r"""An embedding network trained through a relaxed kNN: embedding, relaxation and loss.

    ``forward(query_x, cand_x, query_y, cand_y)`` returns :func:`knn_loss` of the embeddings;
    :meth:`predict` is :func:`knn_predict`. ``embedding`` maps inputs to (N, d); ``k``,
    ``epsilon``, ``method`` and ``n_samples`` are those of :func:`knn_mask`.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = DifferentiableKNN(torch.nn.Linear(4, 3), k=2)
        >>> x, y = torch.randn(10, 4), torch.tensor([0, 1] * 5)
        >>> loss = model(x[:5], x[5:], y[:5], y[5:])
        >>> loss.backward()
        >>> model.predict(x, y, x[:3]).shape
        torch.Size([3])
    """

    def __init__(
        self,
        embedding: nn.Module,
        k: int,
        *,
        epsilon: float = 1.0,
        method: str = "ot",
        n_samples: int | None = None,
    ) -> None:
        super().__init__()
        op = "DifferentiableKNN"
        if not isinstance(embedding, nn.Module):
            raise TypeError(
                f"{op}: expected `embedding` to be a torch.nn.Module; got "
                f"{type(embedding).__name__}."
            )
        self.embedding = embedding
        self.k = _check_k(op, k)
        self.epsilon = float(check_epsilon(epsilon, op))
        self.method = check_choice(method, KNN_METHODS, op, "method")
        if n_samples is not None and method != "perturbed":
            raise ValueError(
                f"{op}: expected `n_samples` only with method='perturbed'; got method={method!r}."
            )
        self.n_samples = n_samples

    def extra_repr(self) -> str:
        extra = f", n_samples={self.n_samples}" if self.n_samples is not None else ""
        return f"k={self.k}, epsilon={self.epsilon}, method={self.method!r}{extra}"

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings of a batch, (N, d)."""
        return self.embedding(x)

    def forward(
        self,
        query_x: torch.Tensor,
        cand_x: torch.Tensor,
        query_y: torch.Tensor,
        cand_y: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """The loss of :func:`knn_loss` on one batch of queries and one of candidates."""
        emb = self.embedding(torch.cat([query_x, cand_x]))
        q, c = emb[: query_x.shape[0]], emb[query_x.shape[0] :]
        return knn_loss(
            q,
            c,
            query_y,
            cand_y,
            self.k,
            epsilon=self.epsilon,
            method=self.method,
            n_samples=self.n_samples,
            generator=generator,
        )

    @torch.no_grad()
    def predict(
        self,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        query_x: torch.Tensor,
        *,
        batch_size: int = 1000,
        num_classes: int | None = None,
    ) -> torch.Tensor:
        """Hard kNN labels of ``query_x`` against the embedded ``train_x`` (:func:`knn_predict`),
        embedded ``batch_size`` at a time in eval mode."""
        was_training = self.training
        self.eval()
        try:
            train = torch.cat([self.embedding(b) for b in train_x.split(batch_size)])
            query = torch.cat([self.embedding(b) for b in query_x.split(batch_size)])
        finally:
            self.train(was_training)
        return knn_predict(train, train_y, query, self.k, num_classes=num_classes)
