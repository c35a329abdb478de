#!/usr/bin/python3
"""The same PyTorch programs on torch.distributed's "dtrain" and "gloo" backends, side by side.

    /usr/bin/python3 bench/torch_backend_compare.py [--repeats 3] [--worlds 2,4] [--parts coll,ddp]

coll: torch.distributed.all_reduce (float32, sum, in place) on N processes (forked, init
      tcp://127.0.0.1), one thread each: p50 latency at 8 B .. 8 KiB and busbw at 1 MiB .. 256 MiB.
      Each size: one verified run (small integers, exact sums), warm-up iterations, then timed
      iterations, each after a barrier; an iteration's time is the slowest rank's; busbw =
      bytes / p50 x 2(n-1)/n. From 1 MiB: about --bw-seconds (1 s) of timed calls per size, at
      least --bw-iters (10) and at most --bw-max-iters (200), the count agreed by the ranks.
ddp:  bench/torch_reference.py --dp N (DistributedDataParallel, SGD, one thread per process):
      the MLP 784-1024-1024-10 (64 per rank), the byte GPT (L4 C128 T128, 16 per rank) and
      torchvision's ResNet-18 on generated 32x32 images (16 per rank); samples/s after warm-up.
      --ceiling adds a third run of each job whose DDP hook communicates nothing: the samples/s
      that no backend can beat, so a target above it is out of any backend's reach; and, from
      the same run, "in step": the samples/s had its ranks waited for each other at every step
      (each step as long as its slowest rank's), what a backend that moves the gradients in no
      time still gets, since an all_reduce makes every rank wait for the last one.

Every repeat runs both backends for each configuration back to back, alternating which goes
first, so that load from elsewhere on the machine hits both alike. Cells are medians over the
repeats [min-max]; ratios are dtrain / gloo of the medians (latency: lower is better). On a
machine busy with other work (the load average is printed), a rank that yields its core while
it waits for a peer may get it back only after the other work's time slice: tens of
microseconds, more than dtrain's whole small all_reduce, so its latencies there are the
machine's, not dtrain's (bench/README.md). The
targets of issue 22 are checked at the end. Output: a table on stdout, JSON in
bench/results/torch_backend_compare.json (--out). Needs dtrain_torch (build/release/python,
or --dtrain-python).
"""
import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
LAT_SIZES = [8 << i for i in range(11)]            # 8 B .. 8 KiB
BW_SIZES = [(1 << 20) << i for i in range(9)]      # 1 MiB .. 256 MiB
DDP_JOBS = {
    "mlp": (["--model", "mlp", "--hidden", "1024,1024", "--lr", "0.01"], 64),
    "gpt": (["--model", "gpt", "--layers", "4", "--heads", "4", "--width", "128", "--seq-len", "128", "--lr", "0.1",
             "--eval-batches", "1"], 16),
    "resnet18": (["--model", "resnet18", "--image-size", "32", "--images", "1024", "--lr", "0.01"], 16),
}
TARGETS = {"busbw": 5.0, "latency": 0.1, "mlp": 1.5, "gpt": 1.1, "resnet18": 1.1}


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return {k: fields[k].strip() for k in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor",
                                               "L2 cache", "L3 cache") if k in fields}
    except OSError:
        return {"Model name": platform.processor()}


def percentile(v, q):
    v = sorted(v)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s, digits):
    f = f"{{:.{digits}f}}"
    if s["n"] == 1:
        return f.format(s["median"])
    return f"{f.format(s['median'])} [{f.format(s['min'])}-{f.format(s['max'])}]"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ all_reduce sweep

def coll_rank(rank, n, backend, port, a, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "dtrain":
        sys.path.insert(0, a.dtrain_python)
        import dtrain_torch  # noqa: F401
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    out = {}
    for nbytes in LAT_SIZES + BW_SIZES:
        if nbytes > a.max_bytes:
            continue
        count = nbytes // 4
        small = nbytes <= 8192
        iters, warm = (a.lat_iters, a.lat_warmup) if small else (a.bw_iters, a.bw_warmup)
        i = torch.arange(count, dtype=torch.int64)
        x = (((i + 3 * rank) % 17) - 8).to(torch.float32)
        dist.all_reduce(x)
        want = sum((((i + 3 * r) % 17) - 8) for r in range(n)).to(torch.float32)
        wrong = int((x != want).sum())
        x.zero_()
        t_warm = time.perf_counter()
        for _ in range(warm):
            dist.all_reduce(x)
        if not small and warm > 0 and a.bw_seconds > 0:
            # Enough timed calls for a stable median where a call is short: about bw_seconds of
            # them, at least bw_iters, at most bw_max_iters; every rank takes the largest count.
            per_call = (time.perf_counter() - t_warm) / warm
            want = torch.tensor([min(a.bw_max_iters, max(iters, math.ceil(a.bw_seconds / max(per_call, 1e-9))))],
                                dtype=torch.int64)
            dist.all_reduce(want, op=dist.ReduceOp.MAX)
            iters = int(want.item())
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out[nbytes] = {"times": times, "wrong": wrong}
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def coll_world(backend, n, a):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=coll_rank, args=(r, n, backend, port, a, q)) for r in range(n)]
    for p in procs:
        p.start()
    per_rank = dict(q.get(timeout=a.timeout) for _ in range(n))
    for p in procs:
        p.join(a.timeout)
        if p.exitcode != 0:
            raise RuntimeError(f"{backend} x{n}: a rank exited with {p.exitcode}")
    rows = {}
    for nbytes in per_rank[0]:
        iters = len(per_rank[0][nbytes]["times"])
        slowest = [max(per_rank[r][nbytes]["times"][k] for r in range(n)) for k in range(iters)]
        p50 = percentile(slowest, 0.5)
        rows[nbytes] = {"p50_us": p50 * 1e6, "busbw_GBs": nbytes / p50 * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0,
                        "wrong": sum(per_rank[r][nbytes]["wrong"] for r in range(n))}
    return rows


# ------------------------------------------------------------------------------------------- DDP

def ddp_run(job, backend, n, a, seed):
    """backend "ceiling": gloo's process group with a DDP hook that communicates nothing."""
    args, per_rank = DDP_JOBS[job]
    hook = []
    if backend == "ceiling":
        backend, hook = "gloo", ["--comm-hook", "noop"]
    steps = a.ddp_steps[job]
    cmd = [sys.executable, os.path.join(HERE, "torch_reference.py")] + args + [
        "--dp", str(n), "--batch-size", str(per_rank * n), "--steps", str(steps), "--warmup", str(a.ddp_warmup),
        "--optimizer", "sgd", "--threads", "1", "--seed", str(seed), "--backend", backend,
        "--dtrain-python", a.dtrain_python] + hook
    env = dict(os.environ, **ONE_THREAD)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{job} {backend} x{n} exited {p.returncode}:\n{p.stderr[-3000:]}")
    rec = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    return {"samples_per_s": rec["samples_per_s_after_warmup"], "final_loss": rec["losses"][-1],
            "lockstep": rec.get("samples_per_s_lockstep")}


# ------------------------------------------------------------------------------------------ main

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--parts", default="coll,ddp")
    p.add_argument("--jobs", default="mlp,gpt,resnet18")
    p.add_argument("--ddp-worlds", default="2", help="worlds of the DDP part")
    p.add_argument("--max-bytes", type=lambda s: int(float(s[:-1]) * (1 << 20)) if s.endswith("M") else int(s),
                   default=256 << 20, help="largest all_reduce (bytes, or with suffix M)")
    p.add_argument("--lat-iters", type=int, default=200)
    p.add_argument("--lat-warmup", type=int, default=20)
    p.add_argument("--bw-iters", type=int, default=10, help="fewest timed all_reduces per size from 1 MiB")
    p.add_argument("--bw-seconds", type=float, default=1.0,
                   help="from 1 MiB: time about this many seconds of all_reduces per size (more than --bw-iters "
                        "where calls are short: with 4 ranks on 2 cores a median of 10 calls of a few ms moves "
                        "by 20%% between runs); 0: exactly --bw-iters")
    p.add_argument("--bw-max-iters", type=int, default=200, help="most timed all_reduces per size from 1 MiB")
    p.add_argument("--bw-warmup", type=int, default=3)
    p.add_argument("--mlp-steps", type=int, default=110)
    p.add_argument("--gpt-steps", type=int, default=40)
    p.add_argument("--resnet18-steps", type=int, default=25)
    p.add_argument("--ddp-warmup", type=int, default=5)
    p.add_argument("--ceiling", action="store_true",
                   help="ddp: also run each job with a DDP hook that communicates nothing, the samples/s no "
                        "backend can beat, and print it as a ratio to gloo beside dtrain's")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--dtrain-python", default=os.environ.get("DTRAIN_TORCH_PATH",
                                                             os.path.join(ROOT, "build", "release", "python")))
    p.add_argument("--out", default=os.path.join(HERE, "results", "torch_backend_compare.json"))
    a = p.parse_args()
    a.ddp_steps = {"mlp": a.mlp_steps, "gpt": a.gpt_steps, "resnet18": a.resnet18_steps}
    worlds = [int(w) for w in a.worlds.split(",")]
    parts = a.parts.split(",")
    os.environ.update(ONE_THREAD)
    sys.path.insert(0, a.dtrain_python)
    import torch

    cpu = cpu_model()
    result = {"cpu": cpu, "torch": torch.__version__, "config": {k: v for k, v in vars(a).items()}, "coll": {},
              "ddp": {}}
    backends = ["dtrain", "gloo"]

    if "coll" in parts:
        raw = {(b, n): [] for b in backends for n in worlds}
        for r in range(a.repeats):
            for n in worlds:
                for b in (backends if r % 2 == 0 else backends[::-1]):
                    log(f"repeat {r + 1}/{a.repeats}: all_reduce sweep, {b} x{n}")
                    raw[(b, n)].append(coll_world(b, n, a))
        for n in worlds:
            rows = []
            for nbytes in raw[("dtrain", n)][0]:
                cell = {}
                for b in backends:
                    reps = [rep[nbytes] for rep in raw[(b, n)]]
                    cell[b] = {"p50_us": summary([x["p50_us"] for x in reps]),
                               "busbw_GBs": summary([x["busbw_GBs"] for x in reps]),
                               "wrong": max(x["wrong"] for x in reps)}
                rows.append({"bytes": nbytes, **cell})
            result["coll"][n] = rows

    if "ddp" in parts:
        jobs = a.jobs.split(",")
        ddp_worlds = [int(w) for w in a.ddp_worlds.split(",")]
        ddp_backends = backends + (["ceiling"] if a.ceiling else [])
        raw = {(j, b, n): [] for j in jobs for b in ddp_backends for n in ddp_worlds}
        for r in range(a.repeats):
            for j in jobs:
                for n in ddp_worlds:
                    for b in (ddp_backends if r % 2 == 0 else ddp_backends[::-1]):
                        log(f"repeat {r + 1}/{a.repeats}: DDP {j} {b} x{n}")
                        raw[(j, b, n)].append(ddp_run(j, b, n, a, seed=r))
        for j in jobs:
            for n in ddp_worlds:
                result["ddp"][f"{j} x{n}"] = {
                    b: {"samples_per_s": summary([x["samples_per_s"] for x in raw[(j, b, n)]]),
                        "final_loss": [x["final_loss"] for x in raw[(j, b, n)]],
                        "lockstep": summary([x["lockstep"] for x in raw[(j, b, n)]])
                        if all(x.get("lockstep") for x in raw[(j, b, n)]) else None} for b in ddp_backends}

    # ---- report
    print(f"dtrain vs gloo through torch.distributed (PyTorch {torch.__version__}), {a.repeats} repeats, "
          f"medians [min-max]")
    print(f"CPU: {cpu.get('Model name', '?')}, {cpu.get('CPU(s)', '?')} CPUs"
          f"{', ' + cpu['Hypervisor vendor'] + ' VM' if 'Hypervisor vendor' in cpu else ''}; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    checks = []
    for n, rows in result["coll"].items():
        print(f"\nall_reduce f32 sum in place, {n} processes")
        print(f"{'bytes':>10} {'dtrain p50 us':>22} {'gloo p50 us':>24} {'dtrain busbw GB/s':>22} "
              f"{'gloo busbw GB/s':>20} {'ratio':>8} wrong")
        worst_lat, worst_bw = None, None
        for row in rows:
            d, g = row["dtrain"], row["gloo"]
            if row["bytes"] <= 8192:
                ratio = d["p50_us"]["median"] / g["p50_us"]["median"]
                tag = f"{ratio:.3f}x"
                worst_lat = max(worst_lat or 0, ratio)
            else:
                ratio = d["busbw_GBs"]["median"] / g["busbw_GBs"]["median"]
                tag = f"{ratio:.1f}x"
                worst_bw = min(worst_bw or 1e9, ratio)
            row["ratio"] = ratio
            print(f"{row['bytes']:>10} {fmt(d['p50_us'], 1):>22} {fmt(g['p50_us'], 1):>24} "
                  f"{fmt(d['busbw_GBs'], 2):>22} {fmt(g['busbw_GBs'], 2):>20} {tag:>8} {d['wrong']}/{g['wrong']}")
        if worst_lat is not None:
            checks.append((f"p50 latency <= {TARGETS['latency']}x gloo up to 8 KiB, {n} processes (worst size)",
                           worst_lat, worst_lat <= TARGETS["latency"]))
        if worst_bw is not None:
            checks.append((f"busbw >= {TARGETS['busbw']}x gloo from 1 MiB, {n} processes (worst size)", worst_bw,
                           worst_bw >= TARGETS["busbw"]))
    if result["ddp"]:
        print("\nDDP (SGD, one thread per process): samples/s after warm-up")
        print(f"{'job':>14} {'dtrain':>26} {'gloo':>26} {'ratio':>7}  final losses (dtrain / gloo)")
        for name, cell in result["ddp"].items():
            d, g = cell["dtrain"], cell["gloo"]
            ratio = d["samples_per_s"]["median"] / g["samples_per_s"]["median"]
            cell["ratio"] = ratio
            print(f"{name:>14} {fmt(d['samples_per_s'], 1):>26} {fmt(g['samples_per_s'], 1):>26} {ratio:>6.2f}x  "
                  f"{d['final_loss'][0]:.6f} / {g['final_loss'][0]:.6f}")
            if "ceiling" in cell:
                c = cell["ceiling"]["samples_per_s"]
                cell["ceiling_ratio"] = c["median"] / g["samples_per_s"]["median"]
                print(f"{'no comm.':>14} {fmt(c, 1):>26} {'':>26} {cell['ceiling_ratio']:>6.2f}x  (a DDP hook that "
                      f"communicates nothing: no backend beats it; dtrain reaches "
                      f"{d['samples_per_s']['median'] / c['median']:.0%} of it)")
                ls = cell["ceiling"].get("lockstep")
                if ls:
                    cell["lockstep_ratio"] = ls["median"] / g["samples_per_s"]["median"]
                    print(f"{'  in step':>14} {fmt(ls, 1):>26} {'':>26} {cell['lockstep_ratio']:>6.2f}x  (the same "
                          f"steps had the ranks waited for each other at each: step k taking its slowest rank's "
                          f"time; dtrain reaches {d['samples_per_s']['median'] / ls['median']:.0%} of it)")
            job = name.split()[0]
            if name.endswith("x2"):
                checks.append((f"DDP {name} samples/s >= {TARGETS[job]}x gloo", ratio, ratio >= TARGETS[job]))
    print("\ntargets (issue 22)")
    for what, value, ok in checks:
        print(f"  {'ok  ' if ok else 'MISS'} {what}: {value:.3f}")
    result["checks"] = [{"what": w, "value": v, "ok": ok} for w, v, ok in checks]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nJSON: {a.out}")


if __name__ == "__main__":
    main()
