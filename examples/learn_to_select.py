"""Train a scorer end to end through a top-k selection (softops.soft_topk_mask).

Each episode shows 50 items with 8 features; only the k = 5 items of highest (hidden) value
count. A linear scorer picks its top 5, and the reward is the total value of the picked items.
Through a hard ``torch.topk`` no gradient says which items to swap in; through the soft top-k
mask the reward trains the scorer directly.

    python examples/learn_to_select.py
"""

import torch

import softops

torch.manual_seed(0)
n_items, n_features, k = 50, 8, 5
w_true = torch.randn(n_features)


def episodes(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    feats = torch.randn(batch, n_items, n_features)
    value = feats @ w_true + 0.1 * torch.randn(batch, n_items)
    return feats, value


def overlap(scores: torch.Tensor, value: torch.Tensor) -> float:
    """Share of the truly best k items that the scorer's hard top-k picks."""
    picked = softops.soft_topk_mask(scores, k, hard=True)
    best = softops.soft_topk_mask(value, k, hard=True)
    return float((picked * best).sum(-1).mean() / k)


scorer = torch.nn.Linear(n_features, 1)
opt = torch.optim.Adam(scorer.parameters(), lr=0.05)
test_feats, test_value = episodes(500)
with torch.no_grad():
    print(
        f"before training: {overlap(scorer(test_feats).squeeze(-1), test_value):.0%} of the top {k}"
    )

for _ in range(300):
    feats, value = episodes(64)
    scores = scorer(feats).squeeze(-1)
    # Standardised scores, so that epsilon (in units of the scores) keeps one meaning.
    scores = (scores - scores.mean(-1, keepdim=True)) / scores.std(-1, keepdim=True)
    mask = softops.soft_topk_mask(scores, k, epsilon=0.1)  # (64, 50), sums to k per row
    loss = -(mask * value).sum(-1).mean()  # maximise the value of the selection
    opt.zero_grad()
    loss.backward()
    opt.step()

with torch.no_grad():
    print(
        f"after training:  {overlap(scorer(test_feats).squeeze(-1), test_value):.0%} of the top {k}"
    )
