#!/usr/bin/python3
"""PyTorch gloo all_reduce sweep in the shape of `dtrain bench collectives --op allreduce --json FILE`.

    /usr/bin/python3 bench/gloo_allreduce.py -n 4 --min-bytes 8 --max-bytes 256M \
        --iters 20 --warmup 5 --check --json out.json

Launches N worker processes (this file with --rank), which join a torch.distributed process
group (backend gloo, init tcp://127.0.0.1:<free port>, TCP loopback, one thread each:
torch.set_num_threads(1)). Measured exactly as bench/mpi_allreduce.c does:
  - every iteration (warm-up and timed) refills the tensor with the rank's pattern (untimed),
    then dist.barrier(), then times one in-place dist.all_reduce(SUM) with time.perf_counter;
  - an iteration's time is the maximum over ranks; p50/p99 are percentiles (linear interpolation,
    as numpy and dtrain) of those maxima over the --iters timed iterations; algbw = bytes / p50, busbw = algbw * 2(n-1)/n;
  - --check compares every element of every iteration's result with the exact sum (rank r holds
    ((i + 3r) mod 17) - 8); "wrong" is the largest number, over iterations, of wrong elements
    summed over ranks.
Rank 0 measures single-core memcpy bandwidth (bytes copied / time, tensor.copy_ of 64 MiB, median
of 7) while the other ranks wait in a barrier, and writes the JSON file. Called by bench/collectives_compare.py.
"""
import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

PATTERN = 17


def parse_bytes(s):
    s = s.strip()
    mul = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:].lower(), 1)
    return int(float(s[:-1] if mul > 1 else s) * mul)


def percentile(sorted_v, q):
    """q in [0, 1], linear interpolation between closest ranks (numpy's default; the rule of
    mpi_allreduce.c and `dtrain bench collectives`)."""
    pos = q * (len(sorted_v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_v) - 1)
    return sorted_v[lo] + (sorted_v[hi] - sorted_v[lo]) * (pos - lo)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memcpy_gbs(torch):
    n = 64 << 20
    a = torch.ones(n, dtype=torch.uint8)
    b = torch.zeros(n, dtype=torch.uint8)
    t = []
    for _ in range(7):
        t0 = time.perf_counter()
        b.copy_(a)
        t.append(time.perf_counter() - t0)
    return n / sorted(t)[3] / 1e9


def worker(a):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = a.rank, a.n
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.op_timeout))
    # memcpy on rank 0 while the others sleep in the barrier (gloo blocks in recv, no polling)
    memcpy = memcpy_gbs(torch) if rank == 0 else 0.0
    dist.barrier()

    max_count = a.max_bytes // 4
    buf = torch.empty(max_count, dtype=torch.float32)
    # rank r's element i is ((i + 3r) mod 17) - 8: the period rotated by 3r, repeated
    base = torch.arange(PATTERN, dtype=torch.float32) - 8
    shift = (3 * rank) % PATTERN
    period = torch.cat([base[shift:], base[:shift]])
    src = period.repeat(max_count // PATTERN + 1)[:max_count].contiguous()  # rank's pristine data
    expect_period = sum(torch.cat([base[(3 * r) % PATTERN:], base[:(3 * r) % PATTERN]]) for r in range(world))
    expect = expect_period.repeat(max_count // PATTERN + 1)[:max_count].contiguous() if a.check else None

    rows = []
    if rank == 0:
        print(f"# gloo allreduce  world {world}  f32 sum  in-place  iters {a.iters} warmup {a.warmup}  "
              f"memcpy {memcpy:.2f} GB/s  torch {torch.__version__}", flush=True)
        print("#%11s %12s %6s %6s %10s %10s %10s %10s %10s %8s" % ("size", "count", "type", "redop", "algo",
              "p50_us", "p99_us", "algbw_GBs", "busbw_GBs", "wrong"), flush=True)
    nbytes = a.min_bytes
    while nbytes <= a.max_bytes:
        count = nbytes // 4
        x = buf[:count]
        times = torch.zeros(a.iters, dtype=torch.float64)
        wrong_max = 0
        for it in range(-a.warmup, a.iters):
            x.copy_(src[:count])
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            dt = time.perf_counter() - t0
            if it >= 0:
                times[it] = dt
            if a.check:
                w = torch.tensor([int((x != expect[:count]).sum())], dtype=torch.int64)
                dist.all_reduce(w, op=dist.ReduceOp.SUM)
                wrong_max = max(wrong_max, int(w))
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            t = sorted(times.tolist())
            p50, p99 = percentile(t, 0.50), percentile(t, 0.99)
            algbw = nbytes / p50 / 1e9
            busbw = algbw * 2 * (world - 1) / world
            row = {"bytes": nbytes, "count": count, "type": "f32", "redop": "sum", "algo": "ring",
                   "p50_us": round(p50 * 1e6, 3), "p99_us": round(p99 * 1e6, 3), "algbw_GBs": round(algbw, 6),
                   "busbw_GBs": round(busbw, 6), "wrong": wrong_max}
            rows.append(row)
            print("%12d %12d %6s %6s %10s %10.2f %10.2f %10.3f %10.3f %8d" % (
                nbytes, count, "f32", "sum", "ring", p50 * 1e6, p99 * 1e6, algbw, busbw, wrong_max), flush=True)
        nbytes *= 2
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"tool": "gloo", "op": "allreduce", "world": world, "transport": "tcp", "dtype": "f32",
                       "memcpy_GBs": round(memcpy, 4), "library": f"torch {torch.__version__} gloo",
                       "iters": a.iters, "warmup": a.warmup, "rows": rows}, f, indent=0)
    dist.barrier()
    dist.destroy_process_group()


def launch(a):
    """Starts N workers (one thread each, GLOO_SOCKET_IFNAME=lo) and waits for all of them."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo")
    base = [sys.executable, os.path.abspath(__file__), "-n", str(a.n), "--port", str(port),
            "--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes), "--iters", str(a.iters),
            "--warmup", str(a.warmup), "--op-timeout", str(a.op_timeout)] + (["--check"] if a.check else []) + \
           (["--json", a.json] if a.json else [])
    def stop(signum, frame):
        raise SystemExit(128 + signum)  # runs the finally below: kill and reap the workers

    signal.signal(signal.SIGTERM, stop)
    procs = []
    for r in range(a.n):
        procs.append(subprocess.Popen(base + ["--rank", str(r)], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    deadline = time.monotonic() + a.timeout if a.timeout else None
    rc = 0
    try:
        for p in procs:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.1)
            r = p.wait(timeout=left)
            if r != 0 and rc == 0:
                rc = r
                print(f"gloo_allreduce: a worker exited with status {r}; stopping the others", file=sys.stderr)
                for q in procs:
                    if q.poll() is None:
                        q.kill()
    except subprocess.TimeoutExpired:
        print(f"gloo_allreduce: timed out after {a.timeout} s", file=sys.stderr)
        rc = 124
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    return rc


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2, help="world size")
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check", action="store_true")
    p.add_argument("--json", help="rank 0 writes the result here")
    p.add_argument("--timeout", type=float, default=0, help="launcher: kill the workers after this many s (0: none)")
    p.add_argument("--op-timeout", type=float, default=600, help="gloo timeout of one collective, s")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes or a.iters < 1 or a.warmup < 0:
        p.error("bad sizes or counts")
    if a.json:
        a.json = os.path.abspath(a.json)
    if a.rank is None:
        sys.exit(launch(a))
    worker(a)


if __name__ == "__main__":
    main()
