"""A tour of the operators on one small vector, each next to the hard operator it relaxes.

The soft top-k mask for several epsilon and its gradient, the sorted soft top-k, and the soft
sort and rank. Larger ``epsilon`` means smoother; as it shrinks, each relaxation approaches its
hard operator, and unlike the hard one it has a useful gradient.

    python examples/tour.py
"""

import torch

import softops


def show(label: str, values: torch.Tensor) -> None:
    print(f"  {label:<26}" + " ".join(f"{v:7.3f}" for v in values.tolist()))


x = torch.tensor([5.0, 2.0, 3.0, 4.0, 1.0, 6.0])
k = 3
print(f"x = {x.tolist()}\n")

print(f"The top-{k} mask (each row sums to {k}):")
show("torch.topk", torch.zeros_like(x).scatter(0, x.topk(k).indices, 1.0))
for eps in (2.0, 0.5, 0.1, 0.01):
    mask = softops.soft_topk_mask(x, k, epsilon=eps)
    show(f"epsilon={eps:g} (sum {mask.sum():.3f})", mask)

x_grad = x.clone().requires_grad_(True)
softops.soft_topk_mask(x_grad, k, epsilon=0.5)[1:4].sum().backward()
assert x_grad.grad is not None
print("\nThe gradient of mask[1:4].sum() at epsilon=0.5 (the hard mask has none):")
show("d/dx", x_grad.grad)
print(f"  It sums to {abs(x_grad.grad.sum()):.0e}, since the mask always sums to k.")

print(f"\nThe sorted top-{k} values:")
show("torch.topk", x.topk(k).values)
show("soft_topk, epsilon=0.5", softops.soft_topk(x, k, epsilon=0.5).values)

print("\nSort and rank (rank 1 is the smallest):")
show("torch.sort", x.sort().values)
show("soft_sort, epsilon=0.1", softops.soft_sort(x, epsilon=0.1))
show("soft_sort, epsilon=2", softops.soft_sort(x, epsilon=2.0))
show("hard rank", x.argsort().argsort() + 1.0)
show("soft_rank, epsilon=0.1", softops.soft_rank(x, epsilon=0.1))
show("soft_rank, epsilon=2", softops.soft_rank(x, epsilon=2.0))
