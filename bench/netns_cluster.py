#!/usr/bin/python3
"""Beyond one machine, on one machine: 4 hosts as network namespaces (scripts/netns-cluster),
2 processes per host, 1 Gbit/s links. Needs root.

    /usr/bin/python3 bench/netns_cluster.py [--hosts 4] [--per-host 2] [--rate 1gbit]
                                            [--repeat 3] [--only train|mpi|allreduce|speed]

train      the MLP (AdamW) and the GPT (SGD) with DP and DP x PP across the hosts (TCP between
           hosts, shared memory within one), each compared with the same job on one host by
           `dtrain diff` (same global batch and steps; limit 1e-5 relative). The sums differ only
           in their order; AdamW turns that rounding into steps of +-lr for weights whose
           gradient is near zero (the GPT: 2e-4 after 20 steps with AdamW), hence SGD there.
mpi        the same jobs under `mpirun -np 8 dtrain train --backend mpi` on one host, each
           against the launcher's run.
allreduce  `dtrain bench collectives --op allreduce --algo ring,hier` across the hosts, --repeat
           times; per size the median p50 of the flat ring and of the hierarchical all_reduce,
           and their ratio.
speed      the MLP 784-1024-1024-10, --dp 8 across the hosts, flat ring (DTRAIN_ALGO=ring)
           against the default (hierarchical), alternated --repeat times: median samples/s.
Results: bench/results/netns_cluster.json.
"""
import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = "/usr/share/games/fortunes/fortunes"

JOBS = {
    "mlp_dp": "--model mlp --hidden 256,256 --batch-size 128 --steps 30 --dp {world}",
    "mlp_dpxpp": "--model mlp --hidden 256,256 --batch-size 128 --steps 30 --dp {half} --pp 2 --micro-batches 2",
    "gpt_dp": f"--model gpt --data text:{CORPUS} --layers 4 --width 64 --heads 4 --seq-len 32 --batch-size 16 "
              "--steps 20 --optimizer sgd --lr 0.1 --dp {world}",
    "gpt_dpxpp": f"--model gpt --data text:{CORPUS} --layers 4 --width 64 --heads 4 --seq-len 32 --batch-size 16 "
                 "--steps 20 --optimizer sgd --lr 0.1 --dp {half} --pp 2 --micro-batches 2",
}


def sh(cmd, env=None, timeout=1800):
    p = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=timeout)
    return p.returncode, p.stdout


def cluster(args, worker, port):
    """Runs `worker` (a dtrain command line after `dtrain launch ... --`) on every host."""
    launch = (f"{args.dtrain} launch --nnodes {args.hosts} --node-rank $HOST --master-addr $MASTER_ADDR "
              f"--master-port {port} -n {args.per_host} -- {worker}")
    return f"{ROOT}/scripts/netns-cluster --hosts {args.hosts} --rate {args.rate} -- sh -c '{launch}'"


def env(extra=None):
    e = dict(os.environ, DTRAIN_SECRET=secrets.token_hex(32))
    e.update(extra or {})
    return e


def compare(args, tmp, kind, how, distributed):
    """Each job on one host with dtrain's launcher against `distributed(job, save_path)` (a
    shell command and its environment), compared by `dtrain diff` with the 1e-5 limit."""
    world = args.hosts * args.per_host
    rows = []
    for name, job in JOBS.items():
        job = job.format(world=world, half=world // 2)
        ref, dist = os.path.join(tmp, name + "-one.dtm"), os.path.join(tmp, f"{name}-{kind}.dtm")
        rc, out = sh(f"{args.dtrain} train {job} --progress=false --save {ref}")
        if rc != 0:
            sys.exit(f"{name} on one host failed:\n{out[-3000:]}")
        cmd, cmd_env = distributed(job, dist)
        rc, out = sh(cmd, cmd_env)
        if rc != 0:
            sys.exit(f"{name} ({how}) failed:\n{out[-3000:]}")
        rc, out = sh(f"{args.dtrain} diff --quiet --tol 1e-5 {ref} {dist}")
        max_rel = float(out.strip().splitlines()[-1].split("max_rel")[1].split()[0])
        rows.append({"job": name, "args": job, "max_rel": max_rel, "within": rc == 0})
        print(f"{kind:5s} {name:10s} {how} vs one host: max_rel {max_rel:.3e} {'WITHIN' if rc == 0 else 'EXCEEDS'} "
              "1e-5", flush=True)
    return rows


def train(args, tmp):
    return compare(args, tmp, "hosts", f"{args.hosts} hosts x {args.per_host}", lambda job, dist: (
        cluster(args, f"{args.dtrain} train {job} --progress=false --save {dist}", 29631), env()))


def mpi(args, tmp):
    """The same jobs started by mpirun with --backend mpi (one host: mpirun cannot reach into
    the namespaces)."""
    world = args.hosts * args.per_host
    mpirun = "mpirun --allow-run-as-root --oversubscribe --bind-to none"
    return compare(args, tmp, "mpi", f"mpirun -np {world} --backend mpi", lambda job, dist: (
        f"{mpirun} -np {world} {args.dtrain} train --backend mpi {job} --progress=false --save {dist}", None))


def allreduce(args, tmp):
    times = {}  # (algo, bytes) -> [p50 us]
    for k in range(args.repeat):
        out_json = os.path.join(tmp, f"ar{k}.json")
        worker = (f"{args.dtrain} bench collectives --op allreduce --algo ring,hier -b 8 -e {args.max_bytes} "
                  f"-i 5 -w 2 --json {out_json}")
        rc, out = sh(cluster(args, worker, 29632), env())
        if rc != 0:
            sys.exit(f"allreduce sweep failed:\n{out[-3000:]}")
        with open(out_json) as f:
            doc = json.load(f)
        for r in doc["rows"]:
            times.setdefault((r["algo"], r["bytes"]), []).append(r["p50_us"])
        print(f"allreduce round {k + 1} done", flush=True)
    rows = []
    sizes = sorted({b for (_, b) in times})
    print(f"{'bytes':>10} {'ring_us':>10} {'hier_us':>10} {'ring/hier':>9}")
    for b in sizes:
        ring, hier = statistics.median(times[("ring", b)]), statistics.median(times[("hier", b)])
        rows.append({"bytes": b, "ring_p50_us": ring, "hier_p50_us": hier, "speedup": ring / hier})
        print(f"{b:10d} {ring:10.1f} {hier:10.1f} {ring / hier:9.2f}")
    return rows


def speed(args, tmp):
    world = args.hosts * args.per_host
    samples = {"ring": [], "hier": []}
    for k in range(args.repeat):
        for algo in ("ring", "hier"):
            metrics = os.path.join(tmp, f"speed-{algo}-{k}.jsonl")
            worker = (f"{args.dtrain} train --model mlp --hidden 1024,1024 --batch-size {64 * world} --steps 30 "
                      f"--dp {world} --progress=false --log-every 1000 --metrics {metrics}")
            rc, out = sh(cluster(args, worker, 29633), env({"DTRAIN_ALGO": algo}))
            if rc != 0:
                sys.exit(f"speed run ({algo}) failed:\n{out[-3000:]}")
            with open(metrics) as f:
                last = [json.loads(x) for x in f if x.strip()][-1]
            samples[algo].append(last["samples_per_s"])
            print(f"speed round {k + 1}: {algo:4s} {last['samples_per_s']:8.1f} samples/s", flush=True)
    ring, hier = statistics.median(samples["ring"]), statistics.median(samples["hier"])
    print(f"MLP 784-1024-1024-10 --dp {world}: ring {ring:.1f}, hier {hier:.1f} samples/s (median), "
          f"hier/ring {hier / ring:.2f}x")
    return {"ring": samples["ring"], "hier": samples["hier"], "ring_median": ring, "hier_median": hier,
            "speedup": hier / ring}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--only", choices=["train", "mpi", "allreduce", "speed"])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/netns_cluster.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("netns_cluster: needs root (network namespaces)")
    result = {"hosts": args.hosts, "per_host": args.per_host, "rate": args.rate}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        if args.only in (None, "train"):
            result["train"] = train(args, tmp)
            ok = ok and all(r["within"] for r in result["train"])
        if args.only in (None, "mpi"):
            result["mpi"] = mpi(args, tmp)
            ok = ok and all(r["within"] for r in result["mpi"])
        if args.only in (None, "allreduce"):
            result["allreduce"] = allreduce(args, tmp)
        if args.only in (None, "speed"):
            result["speed"] = speed(args, tmp)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
