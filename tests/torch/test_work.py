"""Asynchronous Work on the dtrain backend: wait(), isCompleted(), getFuture() (then-chains,
as DDP's communication hooks use them), wait(timeout), works nobody waits for (isend, a
dropped async all_reduce), and ranks that interleave a dtrain collective with a gloo one in
different orders (which deferred collectives must not deadlock). The ranks coordinate
through torch's store, never through sleeps."""

import gc
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import util


def store():
    return dist.distributed_c10d._get_default_store()


def semantics(rank, n):
    s = store()
    want = torch.full((1000,), n * (n + 1) / 2.0)

    # wait(), is_completed(), is_success(), result()
    x = torch.full((1000,), float(rank + 1))
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    util.check(w.is_completed() and w.is_success(), "completed after wait")
    util.check(torch.equal(x, want) and torch.equal(w.result()[0], want), "async all_reduce result")

    # is_completed() is False while a peer has not joined (it starts the collective).
    x = torch.full((1000,), float(rank + 1))
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
        util.check(not w.is_completed(), "completed before rank 1 joined")
        s.set("joined-0", "1")
        while not w.is_completed():
            time.sleep(0.001)
        util.check(torch.equal(x, want), "polled all_reduce result")
    else:
        s.wait(["joined-0"])
        dist.all_reduce(x)

    # get_future() and then-chains, completed by the backend's thread.
    x = torch.full((1000,), float(rank + 1))
    fut = dist.all_reduce(x, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    util.check(torch.equal(doubled.wait(), want * 2), "then-chain value")
    util.check(torch.equal(fut.value()[0], want), "future value")
    futs = [dist.broadcast(torch.full((10,), float(rank)), r, async_op=True).get_future() for r in range(n)]
    torch.futures.wait_all(futs)
    for r, f in enumerate(futs):
        util.check(torch.equal(f.value()[0], torch.full((10,), float(r))), "broadcast future", r)

    # A future's callbacks run on the backend's futures thread, never on a thread that waits for
    # the Work: a callback takes the GIL, and a waiting thread may hold the backend's lock (c71ca55:
    # one rank stopped that way while the GIL's holder waited for that lock). Rank 0 attaches a
    # callback before any peer joins, then waits; the peers join once it has said so.
    x = torch.full((1000,), float(rank + 1))
    if rank == 0:
        ran_on = []
        w = dist.all_reduce(x, async_op=True)
        chained = w.get_future().then(lambda f: ran_on.append(threading.get_ident()))
        s.set("waiting-0", "1")
        w.wait()
        chained.wait()
        util.check(len(ran_on) == 1 and ran_on[0] != threading.get_ident(),
                   "the callback ran on the waiting thread", ran_on, threading.get_ident())
    else:
        s.wait(["waiting-0"])
        dist.all_reduce(x)
    util.check(torch.equal(x, want), "all_reduce with a callback")

    # A dropped async all_reduce still runs (the flusher starts it): rank 1 waits for it.
    x = torch.full((1000,), float(rank + 1))
    if rank == 0:
        dist.all_reduce(x, async_op=True)  # nobody waits for this Work
        gc.collect()
        s.wait(["done-1"])
    else:
        dist.all_reduce(x)
        s.set("done-1", "1")
    dist.barrier()  # after the all_reduce on every rank
    util.check(torch.equal(x, want), "dropped all_reduce result")

    # Fire-and-forget isend: the tensor stays alive until dtrain is done with it.
    if rank == 0:
        dist.isend(torch.arange(100000, dtype=torch.float64), 1)
        gc.collect()
    elif rank == 1:
        got = torch.empty(100000, dtype=torch.float64)
        dist.recv(got, 0)
        util.check(torch.equal(got, torch.arange(100000, dtype=torch.float64)), "isend data")

    # A dtrain collective and a gloo one, issued in different orders on different ranks.
    gloo = dist.new_group(backend="gloo")
    x, y = torch.full((10,), float(rank + 1)), torch.ones(10)
    w = dist.all_reduce(x, async_op=True)
    if rank == 0:
        dist.all_reduce(y, group=gloo)
        w.wait()
    else:
        w.wait()
        dist.all_reduce(y, group=gloo)
    util.check(torch.equal(x, torch.full((10,), n * (n + 1) / 2.0)) and torch.equal(y, torch.full((10,), float(n))),
               "interleaved with gloo")


def timeout(rank, n):
    """wait(timeout) raises after the timeout and breaks the group: rank 0's next call raises at
    once, and rank 1's raises naming rank 0's abort. (Rank 1's first all_reduce may still
    complete: rank 0's input was already staged when it gave up.)"""
    s = store()
    x = torch.ones(1000)
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
        t0 = time.monotonic()
        try:
            w.wait(timedelta(milliseconds=300))
            raise AssertionError("wait(300 ms) returned while rank 1 never joined")
        except RuntimeError as e:
            took = time.monotonic() - t0
            util.check(0.29 <= took < 10, "timed out after", took)
            util.check("not complete after 300 ms" in str(e) and "all_reduce" in str(e), "message", e)
        util.check(w.is_completed() and not w.is_success(), "a timed-out work is completed, not successful")
        s.set("timed-out", "1")
    else:
        s.wait(["timed-out"])
    error = None
    for _ in range(2):
        t0 = time.monotonic()
        try:
            dist.all_reduce(x)
        except RuntimeError as e:
            error = str(e)
            util.check(time.monotonic() - t0 < 10, "broken group took", time.monotonic() - t0)
            break
    util.check(error is not None, "rank", rank, "never saw the broken group")
    util.check("aborted by rank 0" in error or "broken" in error, "broken-group message", error)
    print(f"rank {rank}: {error.splitlines()[0][:200]}", flush=True)


def run(fn, n):
    util.run_world(fn, n)


def main():
    for n in (2, 3):
        run(semantics, n)
        print(f"world {n}: wait, is_completed, get_future, dropped works, interleaving with gloo", flush=True)
    # The broken group cannot be torn down cleanly: the ranks leave without destroying it.
    # file://: the store outlives rank 0, which leaves first (tcp:// has it serve the store).
    util.run_world(timeout_world, 2, init="file")
    print("wait(timeout) raises on time and breaks the group on both ranks", flush=True)


def timeout_world(rank, n):
    timeout(rank, n)
    import os

    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
