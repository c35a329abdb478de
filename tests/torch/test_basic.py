"""The dtrain backend's first contract: `import dtrain_torch` registers "dtrain", and
all_reduce, broadcast, all_gather and barrier through torch.distributed equal gloo's results
on worlds of 2 and 3 processes (integer-valued floats: exact whatever the summation order)."""

import sys

import util


def worker(rank, n):
    import torch
    import torch.distributed as dist

    util.check(dist.get_backend() == "dtrain", "backend", dist.get_backend())
    gloo = dist.new_group(backend="gloo")
    for count in (0, 1, 7, 1000, 100003):
        x = (torch.arange(count, dtype=torch.float32) % 97) * (rank + 1) - rank
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        util.check(torch.equal(a, b), "all_reduce", count, a[:5], b[:5])
        want = (torch.arange(count, dtype=torch.float32) % 97) * (n * (n + 1) / 2) - n * (n - 1) / 2
        util.check(torch.equal(a, want), "all_reduce vs formula", count)

        for root in range(n):
            a, b = x.clone(), x.clone()
            dist.broadcast(a, root)
            dist.broadcast(b, root, group=gloo)
            util.check(torch.equal(a, b), "broadcast", count, root)

        outs_a = [torch.empty_like(x) for _ in range(n)]
        outs_b = [(torch.arange(count, dtype=torch.float32) % 97) * (r + 1) - r for r in range(n)]
        dist.all_gather(outs_a, x)
        if count > 0:  # gloo's all_gather of empty tensors dies of SIGFPE (torch 1.13)
            dist.all_gather(outs_b, x, group=gloo)
        for r in range(n):
            util.check(torch.equal(outs_a[r], outs_b[r]), "all_gather", count, r)
        dist.barrier()


def main():
    for n in (2, 3):
        util.run_world(worker, n)
        print(f"world {n}: all_reduce, broadcast, all_gather, barrier equal gloo's")


if __name__ == "__main__":
    sys.exit(main())
