"""A worker of test_rendezvous: joins with the default init_method (env://) as a launcher
started it, runs an all_reduce and a barrier, and prints what it saw."""

import sys

import torch
import torch.distributed as dist

import dtrain_torch

backend = sys.argv[1] if len(sys.argv) > 1 else "dtrain"
dist.init_process_group(backend)
rank, n = dist.get_rank(), dist.get_world_size()
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full((1000,), n * (n + 1) / 2.0)), x[:4]
dist.barrier()
pg = dist.distributed_c10d._get_default_group()
transport = pg.transport if isinstance(pg, dtrain_torch.ProcessGroupDtrain) else "-"
print(f"ok rank {rank} of {n} backend {dist.get_backend()} transport {transport} "
      f"dtrain-store {dtrain_torch.under_dtrain_launch()}", flush=True)
dist.destroy_process_group()
