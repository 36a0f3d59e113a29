"""Learn to rank with a differentiable Spearman loss (softops.losses.spearman_loss).

Queries hold 20 documents with 10 features each; the relevance of a document is a noisy,
non-linear function of its features. A small MLP scores the documents and is trained on
1 - Spearman(scores, relevance), computed through the soft ranks of softops.soft_rank (the
permutahedron projection of Blondel et al. 2020). Evaluation uses the hard Spearman correlation.

    python examples/learn_to_rank.py
"""

import torch

from softops import losses

torch.manual_seed(0)
n_docs, n_features = 20, 10
w = torch.randn(n_features)


def queries(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    feats = torch.randn(batch, n_docs, n_features)
    relevance = (
        torch.tanh(feats @ w)
        + 0.5 * (feats[..., 0] * feats[..., 1])
        + 0.1 * torch.randn(batch, n_docs)
    )
    return feats, relevance


def hard_spearman(scores: torch.Tensor, target: torch.Tensor) -> float:
    def rank(t: torch.Tensor) -> torch.Tensor:
        return t.argsort(-1).argsort(-1).float()

    rs, rt = rank(scores), rank(target)
    rs, rt = rs - rs.mean(-1, keepdim=True), rt - rt.mean(-1, keepdim=True)
    return float(((rs * rt).sum(-1) / (rs.norm(dim=-1) * rt.norm(dim=-1))).mean())


model = torch.nn.Sequential(
    torch.nn.Linear(n_features, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
test_feats, test_rel = queries(500)
with torch.no_grad():
    print(f"Spearman before training: {hard_spearman(model(test_feats).squeeze(-1), test_rel):.3f}")

for _ in range(300):
    feats, relevance = queries(64)
    scores = model(feats).squeeze(-1)
    loss = losses.spearman_loss(scores, relevance, epsilon=0.1)  # mean over the 64 queries
    opt.zero_grad()
    loss.backward()
    opt.step()

with torch.no_grad():
    print(f"Spearman after training:  {hard_spearman(model(test_feats).squeeze(-1), test_rel):.3f}")
