#!/usr/bin/python3
"""PyTorch on a CPU cluster: torch.distributed's "dtrain" and "gloo" backends across hosts, side by
side. The hosts are network namespaces on this machine (scripts/netns-cluster: addresses of their
own, links rate-limited by tc), the jobs start the way a cluster starts them (`torchrun --nnodes
H --node_rank ... --master_addr ...`), and nothing tells dtrain which address to use (gloo is
told GLOO_SOCKET_IFNAME=eth0: in a namespace the host name resolves to loopback). Needs root.

    /usr/bin/python3 bench/torch_hosts_compare.py [--hosts 2] [--per-host 1] [--rates 1gbit,10gbit]
                                                  [--repeats 3] [--parts coll,ddp]

coll: torch.distributed.all_reduce (float32, sum, in place) from 4 KiB to --max-bytes (16 MiB):
      the time per call of batches of back-to-back calls (about 50 ms a batch; the slowest
      rank's), p50 over --batches (7) batches; busbw = bytes / time x 2(n-1)/n.
ddp:  bench/torch_reference.py --launched --dp N: the MLP 784-1024-1024-10 (64 per rank, SGD,
      one thread per process, about 7.5 MB of gradients a step) under DistributedDataParallel:
      samples/s after warm-up, on dtrain and gloo, each also with torch's fp16_compress_hook,
      and dtrain with dtrain_torch.compression_hook("int8") (error feedback; half fp16's bytes,
      lossy). Rows with a hook also give the ratio to the same hook on gloo.
Each repeat runs every configuration once, the backends alternating which goes first; cells are
medians over the repeats [min-max], ratios dtrain / gloo of the medians. Results:
bench/results/torch_hosts_compare.json (--out). `--worker` is this script's own rank program.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER = os.path.join(ROOT, "scripts", "netns-cluster")


def worker(a):
    """One rank of the coll part (started by torchrun): rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist
    if a.worker == "dtrain":
        sys.path.insert(0, a.dtrain_python)
        import dtrain_torch  # noqa: F401  registers "dtrain"
    torch.set_num_threads(1)
    dist.init_process_group(a.worker)
    rank, n = dist.get_rank(), dist.get_world_size()

    def slowest(seconds):
        """The largest of every rank's `seconds`."""
        x = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x.item()

    rows = []
    size = 4096
    while size <= a.max_bytes:
        t = torch.full((size // 4,), float(rank + 1))
        dist.all_reduce(t)
        if not torch.equal(t, torch.full_like(t, n * (n + 1) / 2)):  # small integers: exact sums
            raise SystemExit(f"{a.worker}: wrong all_reduce result at {size} bytes: {t[:4]}")
        # Back to back, as nccl-tests times: a call after a barrier would find the link's token
        # bucket refilled by however long the barrier took (gloo's take ~0.6 ms, dtrain's ~0.05),
        # which measures the barrier, not the all_reduce. `k` calls (at least 3) make a batch of
        # about 50 ms (the first call's time, the slowest rank's, sets it); a batch's time per
        # call is the slowest rank's; p50 over --batches batches.
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        k = max(3, min(200, int(0.05 / max(slowest(time.perf_counter() - t0), 1e-6))))
        times = []
        for _ in range(a.batches):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                dist.all_reduce(t)
            times.append(slowest((time.perf_counter() - t0) / k))
        p50 = statistics.median(times)
        rows.append({"bytes": size, "p50_us": p50 * 1e6, "busbw_gbs": size / p50 * 2 * (n - 1) / n / 1e9})
        size *= 4
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def on_cluster(a, rate, line, env):
    """Runs shell `line` once per namespace host; returns rank 0's output."""
    cmd = ["timeout", "-k", "5", str(a.timeout), CLUSTER, "--hosts", str(a.hosts), "--rate", rate,
           "--name", f"tb{os.getpid() % 100000}", "--", "sh", "-c", line]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout + 30)
    if p.returncode != 0:
        raise RuntimeError(f"exited {p.returncode}: {line}\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout


def torchrun(a, script_args):
    # --redirects/--tee 2: the workers' stderr in files and on the console (Python 3.11 reads their
    # default "0" as None under torch 1.13); stdout stays the console's.
    return (f"{sys.executable} -m torch.distributed.run --redirects 2 --tee 2 --nnodes {a.hosts} "
            f"--nproc_per_node {a.per_host} --node_rank $HOST --master_addr $MASTER_ADDR --master_port 29500 "
            f"{script_args}")


def env_for(backend):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DTRAIN_SECRET", "DTRAIN_STORE_HOSTED", "DTRAIN_BIND_ADDR", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    return env


def coll(a, rate, backend):
    out = on_cluster(a, rate, torchrun(a, f"{os.path.abspath(__file__)} --worker {backend} --max-bytes "
                                          f"{a.max_bytes} --batches {a.batches} --dtrain-python {a.dtrain_python}"),
                     env_for(backend))
    line = next(x for x in out.splitlines() if "RESULT " in x)
    return json.loads(line.split("RESULT ", 1)[1])


DDP = {  # name: (backend, hook); a hook's row is also compared with the same hook on gloo
    "dtrain": ("dtrain", "none"),
    "gloo": ("gloo", "none"),
    "dtrain+fp16": ("dtrain", "torch-fp16"),
    "gloo+fp16": ("gloo", "torch-fp16"),
    "dtrain+int8": ("dtrain", "int8"),
}


def ddp(a, rate, name, seed):
    backend, hook = DDP[name]
    n = a.hosts * a.per_host
    script = (f"{os.path.join(HERE, 'torch_reference.py')} --model mlp --hidden 1024,1024 --launched --dp {n} "
              f"--batch-size {64 * n} --steps {a.ddp_steps} --warmup {a.ddp_warmup} --optimizer sgd --threads 1 "
              f"--seed {seed} --backend {backend} --comm-hook {hook} --dtrain-python {a.dtrain_python}")
    out = on_cluster(a, rate, torchrun(a, script), env_for(backend))
    line = [x for x in out.splitlines() if '{"' in x][-1]  # rank 0's record, after netns-cluster's [h0]
    rec = json.loads(line[line.index("{"):])
    return {"samples_per_s": rec["samples_per_s_after_warmup"], "final_loss": rec["losses"][-1]}


def cell(values, digits):
    m = statistics.median(values)
    return f"{m:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=1)
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", default="coll,ddp")
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--batches", type=int, default=7, help="timed batches of back-to-back all_reduces per size")
    p.add_argument("--ddp-steps", type=int, default=40)
    p.add_argument("--ddp-warmup", type=int, default=5)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--dtrain-python", default=os.environ.get("DTRAIN_TORCH_PATH",
                                                             os.path.join(ROOT, "build", "release", "python")))
    p.add_argument("--out", default=os.path.join(HERE, "results", "torch_hosts_compare.json"))
    p.add_argument("--worker", choices=["dtrain", "gloo"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if os.geteuid() != 0:
        sys.exit("torch_hosts_compare: network namespaces need root")
    parts = a.parts.split(",")
    n = a.hosts * a.per_host
    model = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"# {model}; {a.hosts} hosts (network namespaces) x {a.per_host} process(es), one thread each; "
          f"{a.repeats} repeat(s); load {os.getloadavg()[0]:.1f}", flush=True)
    results = {"hosts": a.hosts, "per_host": a.per_host, "cpu": model, "rates": {}}
    for rate in a.rates.split(","):
        res = results["rates"][rate] = {"coll": {"dtrain": [], "gloo": []}, "ddp": {k: [] for k in DDP}}
        for r in range(a.repeats):
            order = ["dtrain", "gloo"] if r % 2 == 0 else ["gloo", "dtrain"]
            if "coll" in parts:
                for b in order:
                    res["coll"][b].append(coll(a, rate, b))
            if "ddp" in parts:
                names = list(DDP) if r % 2 == 0 else list(DDP)[::-1]
                for name in names:
                    res["ddp"][name].append(ddp(a, rate, name, seed=r))
            print(f"{rate}: repeat {r + 1} of {a.repeats} done", flush=True)
        print(f"\n## {rate} links, {n} ranks")
        if "coll" in parts:
            print(f"{'bytes':>9}  {'dtrain p50 us':>22}  {'gloo p50 us':>22}  {'ratio':>6}  "
                  f"{'dtrain busbw GB/s':>22}  {'gloo busbw GB/s':>22}  {'ratio':>6}")
            for i, row in enumerate(res["coll"]["dtrain"][0]):
                d = [rep[i] for rep in res["coll"]["dtrain"]]
                g = [rep[i] for rep in res["coll"]["gloo"]]
                lat = statistics.median(x["p50_us"] for x in d) / statistics.median(x["p50_us"] for x in g)
                bw = statistics.median(x["busbw_gbs"] for x in d) / statistics.median(x["busbw_gbs"] for x in g)
                print(f"{row['bytes']:>9}  {cell([x['p50_us'] for x in d], 1):>22}  {cell([x['p50_us'] for x in g], 1):>22}"
                      f"  {lat:>6.3f}  {cell([x['busbw_gbs'] for x in d], 3):>22}  "
                      f"{cell([x['busbw_gbs'] for x in g], 3):>22}  {bw:>6.2f}")
        if "ddp" in parts:
            print(f"\nDDP MLP 784-1024-1024-10, 64 per rank, SGD: samples/s after {a.ddp_warmup} warm-up steps")
            rate = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in res["ddp"].items()}
            for name in DDP:
                v = [x["samples_per_s"] for x in res["ddp"][name]]
                loss = statistics.median(x["final_loss"] for x in res["ddp"][name])
                same = name.replace("dtrain", "gloo")
                beside = f"  {rate[name] / rate[same]:5.2f}x {same}" if "+" in name and same in rate else ""
                print(f"  {name:<12} {cell(v, 0):>24}  {rate[name] / rate['gloo']:5.2f}x gloo{beside:<20}  "
                      f"final loss {loss:.6f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
