#!/usr/bin/python3
"""A whole host dies: every process of one namespaced host is killed (kill -9) mid-run, and the
elastic job goes on with the hosts that remain, from the last checkpoint.

    /usr/bin/python3 bench/netns_host_kill.py [--hosts 3] [--rate 1gbit] [--steps 60]

Hosts are network namespaces (scripts/netns-cluster) with one worker each and an elastic agent
each (`dtrain launch --nnodes 2:HOSTS`), a checkpoint directory on the shared file system. Rank
0 is held at step 20 (DTRAIN_FAULT delay) so that the kill lands at a known point; then every
process in the last host's namespace gets SIGKILL (agent and worker: nothing can report it).
The others find the dead peer, the next round has HOSTS-1 nodes, the workers resume as fewer
data-parallel replicas with the same global batch (SGD), and the final parameters are compared
with the fault-free run of the full world (`dtrain diff`, target 1e-5 relative). Needs root.
"""
import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    victim = args.hosts - 1
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        train = [args.dtrain, "train", "--model", "mlp", "--hidden", "256,256", "--batch-size", "48", "--optimizer", "sgd",
                 "--lr", "0.05", "--steps", str(args.steps), "--progress=false", "--log-every", "10"]
        ref = subprocess.run(train + ["--dp", str(args.hosts), "--save", os.path.join(tmp, "ref.dtm")],
                             capture_output=True, text=True)
        if ref.returncode != 0:
            sys.exit(f"reference run failed:\n{ref.stdout[-2000:]}{ref.stderr[-2000:]}")
        work = train + ["--dp", str(args.hosts), "--min-workers", "1", "--checkpoint-dir", os.path.join(tmp, "ck"),
                        "--checkpoint-every", "5", "--save", os.path.join(tmp, "out.dtm")]
        launch = [args.dtrain, "launch", "--nnodes", f"2:{args.hosts}", "-n", "1", "--node-rank", "$HOST",
                  "--master-addr", "$MASTER_ADDR", "--master-port", "29620", "--last-call", "2", "--max-restarts", "2",
                  "--"] + work
        env = dict(os.environ, DTRAIN_SECRET=secrets.token_hex(32),
                   DTRAIN_FAULT="delay:rank=0:step=20:ms=60000:attempt=0")
        cmd = [os.path.join(ROOT, "scripts/netns-cluster"), "--hosts", str(args.hosts), "--rate", args.rate, "--name",
               "dhk", "--", "sh", "-c", " ".join(launch)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines, killed_at = [], None
        for line in p.stdout:
            lines.append(line)
            if killed_at is None and "delaying this rank by 60000 ms at step 20" in line:
                pids = subprocess.run(["ip", "netns", "pids", f"dhk-h{victim}"], capture_output=True, text=True).stdout.split()
                killed_at = time.monotonic()
                subprocess.run(["kill", "-9"] + pids)
                print(f"killed host {victim}: {len(pids)} processes (its agent and its worker)", flush=True)
        p.wait()
        end = time.monotonic()
        out = "".join(lines)
        rounds = re.findall(r"\[h0\] dtrain launch: (round \d+: \d+ nodes? \(node ranks [0-9,]+\))", out)
        print("node 0's rounds: " + "; ".join(rounds))
        resumed = re.findall(r"\[h0\] \[rank 0\] .*resumed from .*?/step-(\d+)", out)
        print(f"resumed from step {', '.join(resumed) or '-'}; run ended {end - killed_at:.1f} s after the kill"
              if killed_at else "the kill never happened")
        d = subprocess.run([args.dtrain, "diff", os.path.join(tmp, "ref.dtm"), os.path.join(tmp, "out.dtm"), "--quiet"],
                           capture_output=True, text=True)
        print(d.stdout.strip())
        rel = re.search(r"max_rel ([0-9.e+-]+)", d.stdout)
        ok = killed_at is not None and rel is not None and float(rel.group(1)) <= 1e-5
        if not ok:
            print(out[-4000:])
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
