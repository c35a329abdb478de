"""Bad input to the dtrain backend gets a clear Python exception, never a crash or a hang:
tensors not on the CPU (meta; CUDA where this PyTorch has it), sparse tensors, dtypes dtrain
cannot reduce, reduce ops it does not have, wrong list lengths, bad roots and peers. Each of
those is refused on the rank that made it, before anything reaches dtrain, so the group stays
usable. Sizes that differ between ranks are caught by dtrain on every rank (and break the
group)."""

import sys
import time

import torch
import torch.distributed as dist

import util

R = dist.ReduceOp


def refused(what, fn, *needles, kind=(RuntimeError, ValueError, TypeError)):
    try:
        fn()
    except kind as e:
        text = str(e)
        for needle in needles:
            util.check(needle in text, what, ": message", repr(text[:400]), "does not say", repr(needle))
        return text.splitlines()[0]
    raise AssertionError(f"{what}: no exception")


def local_errors(rank, n):
    x = torch.ones(4)
    seen = [
        # torch refuses it before the backend sees it ("Could not run c10d::allreduce_ ... Meta backend").
        refused("meta tensor", lambda: dist.all_reduce(torch.empty(4, device="meta")), "Meta"),
        refused("sparse tensor", lambda: dist.all_reduce(torch.eye(3).to_sparse()), "dtrain", "layout"),
        refused("int16 all_reduce", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), "Short",
                "cannot reduce", kind=TypeError),
        refused("complex max (torch refuses it)",
                lambda: dist.all_reduce(torch.ones(3, dtype=torch.complex64), R.MAX), "complex"),
        refused("int16 reduce_scatter", lambda: dist.reduce_scatter(torch.empty(2, dtype=torch.int16),
                                                                    [torch.ones(2, dtype=torch.int16)] * n),
                "Short", kind=TypeError),
        refused("BAND on float32", lambda: dist.all_reduce(x, R.BAND), "BAND", "not supported", kind=ValueError),
        refused("AVG on bool", lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), R.AVG), "AVG", "bool",
                kind=ValueError),
        refused("all_gather with too few outputs", lambda: dist.all_gather([torch.empty(4)] * (n + 1), x),
                f"for a group of {n}", kind=ValueError),
        refused("all_gather output of the wrong size", lambda: dist.all_gather([torch.empty(5)] * n, x),
                "5 elements, expected 4", kind=ValueError),
        refused("all_gather output of the wrong dtype (torch checks it first)",
                lambda: dist.all_gather([torch.empty(4, dtype=torch.float64)] * n, x), "float64"),
        refused("_allgather_base output of the wrong dtype",
                lambda: dist.all_gather_into_tensor(torch.empty(4 * n, dtype=torch.float64), x), "Double",
                kind=TypeError),
        refused("all_gather_into_tensor of the wrong size",
                lambda: dist.all_gather_into_tensor(torch.empty(4 * n + 1), x), "expected", kind=ValueError),
        refused("broadcast from a rank outside the group", lambda: dist.broadcast(x, n + 3)),
        refused("recv from any source", lambda: dist.recv(x), "any source"),
        refused("all_to_all_single, splits that do not add up",
                lambda: dist.all_to_all_single(torch.empty(4), x, [4] * n, [1] * n), "add up", kind=ValueError),
    ]
    if n > 1:
        seen.append(refused("send with a negative tag", lambda: dist.send(x, (rank + 1) % n, tag=-1), "tag"))
    if torch.cuda.is_available():
        seen.append(refused("CUDA tensor", lambda: dist.all_reduce(torch.ones(3, device="cuda")), "cuda", "CPU"))
    # complex sums travel as their real view (torch's view_as_real), which dtrain reduces.
    z = torch.full((3,), complex(rank + 1, -1), dtype=torch.complex64)
    dist.all_reduce(z)
    util.check(torch.equal(z, torch.full((3,), complex(n * (n + 1) / 2, -n), dtype=torch.complex64)), "complex sum", z)
    # None of it reached dtrain: the group works on.
    y = torch.full((4,), float(rank + 1))
    dist.all_reduce(y)
    util.check(torch.equal(y, torch.full((4,), n * (n + 1) / 2.0)), "all_reduce after the refusals", y)
    if rank == 0:
        for line in seen:
            print("  " + line[:160], flush=True)


def mismatched_sizes(rank, n):
    import os

    t0 = time.monotonic()
    message = refused("mismatched sizes", lambda: dist.all_reduce(torch.ones(1000 if rank == 0 else 2000)),
                      "1000", "2000")
    util.check(time.monotonic() - t0 < 30, "took", time.monotonic() - t0)
    print(f"  rank {rank}: {message[:200]}", flush=True)
    os._exit(0)  # the group is broken


def main():
    for n in (1, 2):
        print(f"world {n}, refused locally:", flush=True)
        util.run_world(local_errors, n)
    print("world 2, all_reduce of 1000 elements on rank 0 and 2000 on rank 1:", flush=True)
    util.run_world(mismatched_sizes, 2)


if __name__ == "__main__":
    sys.exit(main())
