#!/usr/bin/python3
"""Kill the checkpoint writer at random points: a resume must always take the newest complete
checkpoint and end with exactly the parameters of a run that was never killed.

    /usr/bin/python3 bench/checkpoint_kill.py [--trials 20] [--seed 1]

The MLP 784-1024-1024-10 with AdamW (a 35 MB checkpoint per step) trains --steps steps with a
checkpoint after every step, so most of its time is spent writing checkpoints; each trial
SIGKILLs it after a random delay, then checks the directory independently of dtrain (the
newest step whose manifest lists files that all exist with the listed SHA-256), runs the same
command again (it resumes), and compares the step it resumed from and its final digest.
Results: bench/results/checkpoint_kill.json.
"""
import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def newest_complete(d):
    steps = sorted((int(n[5:]) for n in os.listdir(d) if re.fullmatch(r"step-\d{8}", n)), reverse=True)
    for s in steps:
        sd = os.path.join(d, f"step-{s:08d}")
        try:
            with open(os.path.join(sd, "manifest.json")) as f:
                m = json.load(f)
            ok = all(hashlib.sha256(open(os.path.join(sd, e["name"]), "rb").read()).hexdigest() == e["sha256"]
                     for e in m["files"])
        except (OSError, ValueError, KeyError):
            ok = False
        if ok:
            return s
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/checkpoint_kill.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = [args.dtrain, "train", "--model", "mlp", "--batch-size", "64", "--steps", str(args.steps),
                "--progress=false", "--log-every", "1000"]
        ref_m = os.path.join(tmp, "ref.jsonl")
        t0 = time.time()
        subprocess.run(base + ["--metrics", ref_m, "--checkpoint-dir", os.path.join(tmp, "refck"),
                               "--checkpoint-every", "1"], check=True, capture_output=True)
        full = time.time() - t0
        ref = json.loads(open(ref_m).read().splitlines()[-1])["params_digest"]
        print(f"reference: {args.steps} steps with a checkpoint after each in {full:.1f} s", flush=True)
        for i in range(args.trials):
            d = os.path.join(tmp, f"ck{i}")
            cmd = base + ["--checkpoint-dir", d, "--checkpoint-every", "1", "--keep", "2"]
            delay = rng.uniform(0.3, full * 0.9)
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)  # the random kill point (not synchronisation: any point is valid)
            p.send_signal(signal.SIGKILL)
            p.wait()
            expect = newest_complete(d) if os.path.isdir(d) else 0
            m = os.path.join(tmp, f"m{i}.jsonl")
            r = subprocess.run(cmd + ["--metrics", m], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"trial {i}: the resume failed:\n{r.stderr[-3000:]}")
            got = re.search(r"resumed from .*?/step-(\d+)", r.stderr)
            got = int(got.group(1)) if got else 0
            warned = len(re.findall(r"is not usable", r.stderr))
            digest = json.loads(open(m).read().splitlines()[-1])["params_digest"]
            row = {"kill_after_s": delay, "newest_complete": expect, "resumed_from": got,
                   "skipped_incomplete": warned, "equal": digest == ref and got == expect}
            rows.append(row)
            print(f"trial {i:2d}: killed after {delay:5.2f} s; newest complete step {expect:2d}, resumed from "
                  f"{got:2d} ({warned} newer incomplete skipped); final params "
                  f"{'EQUAL' if digest == ref else 'DIFFER'}", flush=True)
    good = sum(r["equal"] for r in rows)
    print(f"{good} of {len(rows)} trials resumed from the newest complete checkpoint and ended bitwise equal")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"trials": rows, "reference": ref}, f, indent=1)
    sys.exit(0 if good == len(rows) else 1)


if __name__ == "__main__":
    main()
