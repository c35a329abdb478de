"""A worker of test_hosts: one rank of a job across network-namespace hosts. Joins with env:// as
its launcher (torchrun or dtrain launch) started it, checks an all_reduce of integers exactly,
trains a small MLP under DistributedDataParallel with SGD for a few steps (each rank its own slice
of every global batch), and rank 0 writes the losses and what it saw as JSON to OUT.

    hosts_worker.py BACKEND OUT
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import dtrain_torch

backend, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group(backend)
rank, n = dist.get_rank(), dist.get_world_size()

x = torch.arange(1000, dtype=torch.int64) + rank
dist.all_reduce(x)
assert torch.equal(x, torch.arange(1000, dtype=torch.int64) * n + n * (n - 1) // 2), x[:4]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1)
losses = []
per_rank = 8
for step in range(20):
    xs = torch.randn(n * per_rank, 32, generator=data)
    ys = torch.randint(0, 10, (n * per_rank,), generator=data)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss = torch.nn.functional.cross_entropy(ddp(xs[mine]), ys[mine])
    opt.zero_grad()
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / n)

pg = dist.distributed_c10d._get_default_group()
transport = pg.transport if isinstance(pg, dtrain_torch.ProcessGroupDtrain) else "-"
if rank == 0:
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    with open(out, "w") as f:
        json.dump({"world": n, "backend": dist.get_backend(), "transport": transport, "losses": losses,
                   "params": params.tolist(), "host": os.environ.get("HOST")}, f)
print(f"ok rank {rank} of {n} backend {dist.get_backend()} transport {transport} host {os.environ.get('HOST')}",
      flush=True)
dist.destroy_process_group()
