"""PyTorch across hosts: two hosts as network namespaces (scripts/netns-cluster, 1 Gbit/s links,
addresses of their own), two processes on each, the way a CPU cluster runs them:
`torchrun --nnodes 2` with backend "dtrain" and with "gloo", and `dtrain launch --nnodes 2`
with "dtrain". Nothing tells dtrain which address to publish (no DTRAIN_BIND_ADDR): each rank
finds the interface that routes to the store's host. gloo is told (GLOO_SOCKET_IFNAME=eth0): it
takes the host name's address, which is not eth0's here. Each job trains the same DDP MLP;
dtrain's losses and parameters equal gloo's within 1e-5 relative (both sum in another order),
and the two dtrain jobs equal each other bit for bit (the same ranks on the same hosts, the same
collectives). Needs root (network namespaces): exits 77 (skipped) without it."""

import json
import os
import subprocess
import sys
import tempfile

import util

WORKER = os.path.join(util.HERE, "hosts_worker.py")
CLUSTER = os.path.join(util.REPO, "scripts", "netns-cluster")


def cluster(name, command, env, timeout_s=250):
    """Runs `command` (a shell line) once on each of 2 namespace hosts; the CompletedProcess."""
    cmd = ["timeout", "-k", "5", str(timeout_s), CLUSTER, "--hosts", "2", "--rate", "1gbit", "--name", name,
           "--", "sh", "-c", command]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s + 30)


def job(name, launcher, backend, out, env, tmp):
    worker = f"{WORKER} {backend} {out}"  # torchrun runs it with its own Python
    if launcher == "torchrun":
        # --redirects/--tee 2: stderr to files and the console (Python 3.11 reads their default "0" as None
        # under torch 1.13).
        line = (f"{sys.executable} -m torch.distributed.run --redirects 2 --tee 2 --nnodes 2 --nproc_per_node 2 "
                f"--node_rank $HOST --master_addr $MASTER_ADDR --master_port 29500 --log_dir {tmp}/torchrun-{backend} "
                f"{worker}")
    else:
        line = (f"{util.dtrain_binary()} launch --nnodes 2 --node-rank $HOST --master-addr $MASTER_ADDR "
                f"--master-port 29500 -n 2 -- {sys.executable} {worker}")
    proc = cluster(name, line, env)
    what = f"{launcher} --nnodes 2, 2 per host, {backend}"
    text = proc.stdout + proc.stderr
    # The workers' own lines (torchrun prefixes them [defaultN]:, dtrain launch [rank N]), not the
    # agents' tracebacks around them.
    workers = "\n".join(line for line in text.splitlines() if "[default" in line or "[rank" in line)
    shown = (workers or text)[-4000:]
    util.check(proc.returncode == 0, what, "exited", proc.returncode, shown)
    for r in range(4):
        util.check(f"ok rank {r} of 4 backend {backend}" in text, what, "no line for rank", r, shown)
    with open(out) as f:
        rec = json.load(f)
    util.check(rec["world"] == 4, what, rec["world"])
    print(f"{what}: transport {rec['transport']}, final loss {rec['losses'][-1]:.6f}", flush=True)
    return rec


def close(a, b, tol):
    """Equal within `tol` relative, with an absolute floor for values near zero."""
    return len(a) == len(b) and all(abs(x - y) <= tol * max(abs(x), abs(y)) + 1e-7 for x, y in zip(a, b))


def main():
    if os.geteuid() != 0:
        print("skipped: network namespaces need root", flush=True)
        return 77
    env = {k: v for k, v in os.environ.items()
           if k not in ("DTRAIN_STORE_HOSTED", "DTRAIN_SECRET", "DTRAIN_BIND_ADDR", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    name = f"th{os.getpid() % 100000}"  # this run's namespaces only
    with tempfile.TemporaryDirectory(prefix="dtrain-hosts-") as tmp:
        run = job(name, "torchrun", "dtrain", os.path.join(tmp, "torchrun-dtrain.json"), env, tmp)
        util.check(run["transport"] == "tcp", "dtrain across hosts took transport", run["transport"])
        gloo = job(name, "torchrun", "gloo", os.path.join(tmp, "torchrun-gloo.json"),
                   dict(env, GLOO_SOCKET_IFNAME="eth0"), tmp)
        launched = job(name, "dtrain-launch", "dtrain", os.path.join(tmp, "launch-dtrain.json"),
                       dict(env, DTRAIN_SECRET=os.urandom(32).hex()), tmp)
    util.check(close(run["losses"], gloo["losses"], 1e-5), "losses: dtrain", run["losses"], "gloo", gloo["losses"])
    util.check(close(run["params"], gloo["params"], 1e-5), "parameters: dtrain and gloo differ beyond 1e-5 relative")
    util.check(run["losses"] == launched["losses"] and run["params"] == launched["params"],
               "dtrain under torchrun and under dtrain launch differ", run["losses"], launched["losses"])
    print(f"dtrain equals gloo within 1e-5 over 20 steps (final loss {run['losses'][-1]:.6f} against "
          f"{gloo['losses'][-1]:.6f}); torchrun and dtrain launch equal bit for bit", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
