"""kNN over a datastore sharded across processes, its query encoder trained through the top-k.

Two gloo processes each hold half of the digits datastore (scikit-learn). A query is scored
against every shard where the shard lives; softops.distributed.soft_topk_mask selects its k
neighbours over the whole datastore with a few all-reduces of per-row sums, and the loss, minus
the soft fraction of neighbours that share the query's label, trains a shared linear encoder.

    python examples/sharded_knn.py
"""

import tempfile

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel

import softops.distributed as sd

WORLD, K = 2, 10
F = torch.nn.functional


def embed(enc, v):
    return F.normalize(enc(v), dim=-1)  # cosine scores: epsilon keeps one meaning


def accuracy(enc, store, labels, x, y):
    """Hard kNN vote: each rank counts the votes of its own neighbours, then one all-reduce."""
    mask = sd.soft_topk_mask(embed(enc, x) @ embed(enc, store).T, K, hard=True)  # k ones a row
    votes = mask @ F.one_hot(labels, 10).float()
    dist.all_reduce(votes)
    return (votes.argmax(-1) == y).float().mean().item()


def main(rank, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init, rank=rank, world_size=WORLD)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    shard = slice(rank * 600, (rank + 1) * 600)  # the datastore: the first 1200 digits
    store, labels, test_x, test_y = x[:1200][shard], y[:1200][shard], x[1200:], y[1200:]
    torch.manual_seed(0)  # the same encoder and query batches on every rank
    enc = DistributedDataParallel(torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(enc.parameters(), lr=0.01)
    with torch.no_grad():
        before = accuracy(enc, store, labels, test_x, test_y)
    for _ in range(150):
        idx = torch.randint(0, 1200, (64,))
        scores = embed(enc, x[idx]) @ embed(enc, store).T  # (64, this shard)
        mine = idx[:, None] == torch.arange(1200)[shard]  # a query is not its own neighbour
        mask = sd.soft_topk_mask(scores.masked_fill(mine, -torch.inf), K, epsilon=0.02)
        same = (y[idx][:, None] == labels).float()
        loss = -(mask * same).sum() / (64 * K)  # this shard's part of the loss
        opt.zero_grad()
        (loss * WORLD).backward()  # DDP averages the ranks' gradients: their sum is the gradient
        opt.step()
    with torch.no_grad():
        after = accuracy(enc, store, labels, test_x, test_y)
    if rank == 0:
        print(f"kNN accuracy (k={K}, {WORLD} shards): {before:.1%} before, {after:.1%} after")
    del enc, opt  # DDP before its process group (its destructor can wait on it otherwise)
    dist.barrier()  # every rank done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # the processes meet in a file (no port to pick)
        torch.multiprocessing.spawn(main, args=(f"file://{tmp}/store",), nprocs=WORLD)
