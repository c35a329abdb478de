#!/usr/bin/python3
"""Scheduled faults (kill -9, a hung rank, a lost network, a straggler) against a 4-process data-parallel run: nothing is lost.

    /usr/bin/python3 bench/fault_campaign.py [--steps 40] [--every 5]

Trains the MLP with --dp 4 once without faults, then once per scheduled fault (and once with
three faults on three successive starts) with --checkpoint-every, --max-restarts 3 and
DTRAIN_FAULT. Every faulty run must finish with exactly the fault-free run's parameters
(params_digest). Then an elastic run (SGD): rank 3 dies on every start, the launcher goes on
with 3 workers (--min-workers 2), and the result must be within 1e-5 of the fault-free run. Per fault it reports:
  detect_ms   from the killed rank's last log line to the launcher's "job failed" line (the
              launcher sees the death at once; the line comes after it stopped the other ranks)
  restart_s   from that line to the restarted job's start line (new processes, rendezvous,
              checkpoint load)
  lost_steps  optimizer steps done before the fault that the restart computes again
Results: bench/results/fault_campaign.json.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})"

FAULTS = [
    "kill:rank=1:step=7",
    "kill:rank=3:step=12:phase=allreduce",
    "kill:rank=0:step=10:phase=checkpoint",
    "kill:rank=2:step=23",
    "kill:rank=0:step=31:phase=allreduce",
    "kill:rank=3:step=20:phase=checkpoint",
    "kill:rank=1:step=36",
    "kill:rank=2:step=15:phase=allreduce",
    "kill:rank=0:step=4",
    "kill:rank=3:step=38",
    "kill:rank=1:step=9,kill:rank=2:step=18:phase=allreduce:attempt=1,kill:rank=0:step=30:phase=checkpoint:attempt=2",
    # A hung rank (SIGSTOP): nothing dies, only its missing heartbeats tell (--heartbeat-timeout).
    "stop:rank=2:step=14",
    "stop:rank=0:step=27:phase=allreduce",
    # A rank that loses its network (every socket shut down): on one host only its store
    # connection breaks, which its own heartbeat finds (tests/cli_test.cpp drops TCP peers).
    "drop:rank=1:step=19",
    # A straggler: slower, not failed; no restart.
    "delay:rank=3:step=8:ms=1500",
]
ENV = {}  # extra environment per fault
HEARTBEAT_S = 2


def t(s):
    return datetime.datetime.strptime(s, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def run(args, tmp, name, fault, extra=()):
    metrics = os.path.join(tmp, name + ".jsonl")
    ckpt = os.path.join(tmp, name + "-ckpt")
    cmd = [args.dtrain, "train", "--model", "mlp", "--hidden", "256,256", "--batch-size", "48", "--steps",
           str(args.steps), "--dp", "4", "--progress=false", "--log-every", "10", "--metrics", metrics,
           "--checkpoint-dir", ckpt, "--checkpoint-every", str(args.every), "--max-restarts", "3",
           "--heartbeat-timeout", str(HEARTBEAT_S), "--save", os.path.join(tmp, name + ".dtm")] + list(extra)
    env = dict(os.environ)
    env.pop("DTRAIN_FAULT", None)
    if fault:
        env["DTRAIN_FAULT"] = fault
        env.update(ENV.get(fault, {}))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    if p.returncode != 0:
        sys.exit(f"run {name} ({fault}) failed with {p.returncode}:\n{p.stdout[-3000:]}")
    with open(metrics) as f:
        final = [json.loads(x) for x in f if x.strip()][-1]
    return p.stdout, final


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/fault_campaign.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _, ref = run(args, tmp, "reference", None)
        print(f"reference: {args.steps} steps, digest {ref['params_digest'][:16]}...", flush=True)
        for i, fault in enumerate(FAULTS):
            out, final = run(args, tmp, f"fault{i}", fault)
            kills = [(t(m.group(1)), int(m.group(2))) for m in re.finditer(
                STAMP + r"\] \[warning\] DTRAIN_FAULT: (?:killing|stopping|dropping every connection of) this rank "
                r"\(pid \d+(?:, SIGSTOP)?\) at step (\d+)", out)]
            fails = [t(m.group(1)) for m in re.finditer(r"dtrain launch: \[" + STAMP + r"\] job failed", out)]
            resumed = [(t(m.group(1)), int(m.group(2))) for m in
                       re.finditer(STAMP + r"\] \[info\] resumed from .*?/step-(\d+)", out)]
            starts = [t(m.group(1)) for m in re.finditer(STAMP + r"\] \[info\] training ", out)]
            # Per restart: when the new job was up (its "training" line), and the step it resumed
            # from (0 when no checkpoint existed yet).
            resumes = []
            for f_t in fails:
                up = min((s_t for s_t in starts if s_t > f_t), default=float("nan"))
                step = max((st for r_t, st in resumed if f_t < r_t <= up), default=0)
                resumes.append((up, step))
            ok = final["params_digest"] == ref["params_digest"]
            for k, (kill_t, kill_step) in enumerate(kills):
                detect = (fails[k] - kill_t) * 1e3 if k < len(fails) else float("nan")
                restart = resumes[k][0] - fails[k] if k < len(resumes) and k < len(fails) else float("nan")
                done = kill_step if "phase=checkpoint" in fault.split(",")[k] else kill_step - 1
                # A dropped connection under shm goes unnoticed until the heartbeat; a stopped rank
                # until its heartbeat timeout: the survivors may finish a few steps meanwhile.
                lost = done - resumes[k][1] if k < len(resumes) else float("nan")
                row = {"fault": fault.split(",")[k], "detect_ms": detect, "restart_s": restart, "lost_steps": lost,
                       "resumed_from": resumes[k][1] if k < len(resumes) else None, "bitwise_equal": ok}
                rows.append(row)
                print(f"{row['fault']:52s} detect {detect:6.0f} ms  restart {restart:5.2f} s  resumed from step "
                      f"{row['resumed_from']}  lost {lost} steps  final params {'EQUAL' if ok else 'DIFFER'}",
                      flush=True)
            if fault.startswith("delay"):
                delayed = "delaying this rank by" in out
                row = {"fault": fault, "detect_ms": None, "restart_s": None, "lost_steps": 0, "restarts": len(fails),
                       "bitwise_equal": ok and delayed and not fails}
                rows.append(row)
                print(f"{fault:52s} {'delayed' if delayed else 'NOT DELAYED'}, {len(fails)} restarts, final params "
                      f"{'EQUAL' if ok else 'DIFFER'}", flush=True)
            elif len(kills) != sum(fault.count(k) for k in ("kill", "stop", "drop")):
                sys.exit(f"{fault}: {len(kills)} faults happened\n{out[-3000:]}")
        # Elastic: rank 3 dies on every start, the launcher goes on with 3 workers after two
        # starts, the dp 4 checkpoint resumes as 3 replicas (SGD: the float sums change, the math
        # does not; compared with `dtrain diff`).
        sgd = ["--optimizer", "sgd", "--lr", "0.05"]
        run(args, tmp, "sgd-reference", None, sgd)
        out, _ = run(args, tmp, "elastic", "kill:rank=3:step=12:attempt=any", sgd + ["--min-workers", "2"])
        d = subprocess.run([args.dtrain, "diff", os.path.join(tmp, "sgd-reference.dtm"), os.path.join(tmp, "elastic.dtm"),
                            "--quiet"], capture_output=True, text=True).stdout
        rel = float(re.search(r"max_rel ([0-9.e+-]+)", d).group(1))
        shrunk = "continuing with 3 workers" in out
        print(f"elastic: rank 3 lost for good, {'went on with 3 workers' if shrunk else 'DID NOT SHRINK'}; final "
              f"parameters vs the fault-free 4-worker run: max relative difference {rel:.3e}", flush=True)
    equal = sum(r["bitwise_equal"] for r in rows)
    print(f"{len(rows)} faults, {equal} runs ended bitwise equal to the fault-free run")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "every": args.every, "reference": ref["params_digest"], "faults": rows,
                   "elastic": {"shrunk": shrunk, "max_rel": rel}}, f, indent=1)
    sys.exit(0 if equal == len(rows) and shrunk and rel <= 1e-5 else 1)


if __name__ == "__main__":
    main()
