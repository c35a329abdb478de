#!/usr/bin/python3
"""A libtorch model trained with dtrain's DistributedDataParallel against the same model in
Python PyTorch DistributedDataParallel over gloo, side by side (issue 23, measurement 2).

    make examples                                  # installs into build/prefix, builds build/examples
    /usr/bin/python3 bench/libtorch_ddp_compare.py [--per-rank-batch 8,32] [--repeats 5] [--steps 30]

dtrain:  build/prefix/bin/dtrain launch -n N -- build/examples/torch_cnn --bench STEPS
         --batch-size N*B (examples/torch_cnn.cpp: the CNN in libtorch's C++ frontend)
gloo:    N processes of bench/torch_cnn_gloo.py (the same CNN, data, batch and SGD in Python)

N is 1 and 2, one thread per process, B the per-rank batch. --bind same (default): dtrain
launch binds its workers to CPUs (--bind auto), and each gloo rank gets the same CPUs;
--bind none: nobody is bound (on a machine others use, a bound rank waits for its busy core). Each reports samples/s over STEPS
steps after 5 warm-up steps. Every repeat runs the four configurations back to back in an order
that rotates between repeats, so that load from elsewhere on the machine hits them alike. Cells
are medians over the repeats [min-max]. Printed: dtrain(2) / gloo(2) (target >= 1.5) and
E(2) = dtrain(2) / (2 x dtrain(1)) (target >= 0.90), gloo's E(2) beside, the CPU and the load
average. JSON in bench/results/libtorch_ddp_compare.json (--out).
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
TARGET_RATIO, TARGET_E2 = 1.5, 0.90


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return {k: fields[k].strip() for k in ("Model name", "CPU(s)", "Flags") if k in fields}
    except OSError:
        return {"Model name": platform.processor()}


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cell(s):
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def last_json(text):
    for line in reversed(text.splitlines()):
        if "{" in line:
            return json.loads(line[line.index("{"):])
    raise RuntimeError("no JSON line in:\n" + text[-2000:])


def environment(a):
    env = dict(os.environ, **ONE_THREAD)
    if a.malloc_threshold > 0:  # glibc: keep big blocks in the heap instead of mmap/munmap per step
        env.update(MALLOC_MMAP_THRESHOLD_=str(a.malloc_threshold), MALLOC_TRIM_THRESHOLD_=str(2 * a.malloc_threshold))
    return env


def gloo_cpus(rank, n):
    """The CPUs `dtrain launch --bind auto` gives local worker `rank` of n when there are at
    least n CPUs (equal contiguous slices), so that both sides run on the same placement."""
    cpus = sorted(os.sched_getaffinity(0))
    if n > len(cpus):
        return None
    per = len(cpus) // n
    return set(cpus[rank * per:(rank + 1) * per])


def run_dtrain(a, n, per_rank):
    cmd = [a.dtrain, "launch", "-n", str(n), "--bind", "auto" if a.bind == "same" else "none", "--", a.example,
           "--bench", str(a.steps), "--batch-size", str(per_rank * n), "--threads", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=environment(a))
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return last_json(p.stdout)["samples_per_s"]


def run_gloo(a, n, per_rank):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(n):
        env = dict(environment(a), RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cpus = gloo_cpus(r, n) if a.bind == "same" else None
        procs.append(subprocess.Popen([a.python, os.path.join(HERE, "torch_cnn_gloo.py"), "--bench", str(a.steps),
                                       "--batch-size", str(per_rank * n)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if cpus else None))
    outs = [p.communicate(timeout=a.timeout) for p in procs]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"gloo rank {r} of {n} exited {p.returncode}:\n{outs[r][1][-2000:]}")
    return last_json(outs[0][0])["samples_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-rank-batch", default="8,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--example", default=os.path.join(ROOT, "build/examples/torch_cnn"))
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/prefix/bin/dtrain"))
    ap.add_argument("--python", default="/usr/bin/python3", help="a Python with PyTorch")
    ap.add_argument("--bind", choices=["same", "none"], default="same",
                    help="same: dtrain launch's CPU binding (--bind auto) and the same CPUs for the gloo ranks; "
                         "none: nobody is bound (--bind none)")
    ap.add_argument("--malloc-threshold", type=int, default=0,
                    help="bytes; > 0: glibc's MALLOC_MMAP_THRESHOLD_ (and twice it as MALLOC_TRIM_THRESHOLD_) for both "
                         "sides: without it the per-step activations of a batch of 32 are mmap'd and faulted in "
                         "again every step (glibc's dynamic threshold), a fifth of a step's time here")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=os.path.join(HERE, "results/libtorch_ddp_compare.json"))
    a = ap.parse_args()
    for path, what in ((a.example, "--example"), (a.dtrain, "--dtrain")):
        if not os.access(path, os.X_OK):
            sys.exit(f"{what} {path}: not an executable (run `make examples` first)")

    configs = [("dtrain", 1), ("dtrain", 2), ("gloo", 1), ("gloo", 2)]
    results = {"cpu": cpu_model(), "load_before": os.getloadavg(), "steps": a.steps, "repeats": a.repeats,
               "bind": a.bind, "malloc_threshold": a.malloc_threshold, "batches": {}}
    for per_rank in [int(b) for b in a.per_rank_batch.split(",")]:
        samples = {c: [] for c in configs}
        for rep in range(a.repeats):
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for tool, n in order:
                rate = run_dtrain(a, n, per_rank) if tool == "dtrain" else run_gloo(a, n, per_rank)
                samples[(tool, n)].append(rate)
                print(f"batch {per_rank}/rank, repeat {rep + 1}: {tool} x{n}: {rate:.1f} samples/s", file=sys.stderr,
                      flush=True)
        s = {f"{tool}{n}": summary(v) for (tool, n), v in samples.items()}
        d1, d2, g1, g2 = (s[k]["median"] for k in ("dtrain1", "dtrain2", "gloo1", "gloo2"))
        results["batches"][per_rank] = {"samples_per_s": s, "ratio_2": d2 / g2, "ratio_1": d1 / g1,
                                        "e2_dtrain": d2 / (2 * d1), "e2_gloo": g2 / (2 * g1)}
    results["load_after"] = os.getloadavg()

    print(f"CPU: {results['cpu'].get('Model name', '?')}, {results['cpu'].get('CPU(s)', '?')} CPUs; "
          f"load average {results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after")
    print(f"samples/s, medians of {a.repeats} [min-max], {a.steps} steps after 5 warm-up, one thread per process, "
          f"binding: {a.bind}, malloc threshold: {a.malloc_threshold or 'glibc default'}")
    print(f"{'batch/rank':>10} {'dtrain x1':>22} {'dtrain x2':>22} {'gloo x1':>22} {'gloo x2':>22} "
          f"{'x2 ratio':>9} {'E(2) dtrain':>11} {'E(2) gloo':>9}")
    for per_rank, r in results["batches"].items():
        s = r["samples_per_s"]
        print(f"{per_rank:>10} {cell(s['dtrain1']):>22} {cell(s['dtrain2']):>22} {cell(s['gloo1']):>22} "
              f"{cell(s['gloo2']):>22} {r['ratio_2']:>9.2f} {r['e2_dtrain']:>11.2f} {r['e2_gloo']:>9.2f}")
    for per_rank, r in results["batches"].items():
        ok = r["ratio_2"] >= TARGET_RATIO and r["e2_dtrain"] >= TARGET_E2
        print(f"batch {per_rank}/rank: dtrain(2)/gloo(2) {r['ratio_2']:.2f} (target >= {TARGET_RATIO}), "
              f"E(2) {r['e2_dtrain']:.2f} (target >= {TARGET_E2}): {'met' if ok else 'NOT met'}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"JSON: {a.out}")


if __name__ == "__main__":
    main()
