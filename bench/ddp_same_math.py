#!/usr/bin/python3
"""Same math: data-parallel runs against one process with the same global batch.

    /usr/bin/python3 bench/ddp_same_math.py [--models mlp,gpt] [--steps 50] [--optimizers adamw,sgd]

For each model and optimizer, trains with `dtrain train` on 1 process and with --dp 2, 3, 4,
--dp 4 --zero 1, --dp 4 --zero 2, and --dp 2 --accumulate 2 (against --dp 4), all with the same
global batch, seed and steps, saves every model and prints `dtrain diff`'s max relative
difference (max|a-b| / max|a| per tensor, the largest over tensors) against the reference.
A second reference, one process accumulating the same micro-batches as the data-parallel run
(--accumulate N), separates the data-parallel machinery (which must match it exactly) from the
floating-point effect of splitting a batch (which AdamW amplifies for gradients near its eps).
Results go to bench/results/ddp_same_math.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode not in (0, 1):
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}")
    return p.stdout


def max_rel(dtrain, a, b):
    out = run([dtrain, "diff", a, b, "--quiet"], 60)
    m = re.search(r"max_rel ([0-9.e+-]+)", out)
    if not m:
        sys.exit(f"cannot parse dtrain diff output:\n{out}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--optimizers", default="adamw,sgd")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/ddp_same_math.json"))
    args = ap.parse_args()
    # Global batches that 1, 2, 3, 4 ranks and 2 x 2 micro-steps all divide.
    batch = {"mlp": 48, "gpt": 24}
    lr = {("mlp", "adamw"): "1e-3", ("mlp", "sgd"): "0.05", ("gpt", "adamw"): "3e-4", ("gpt", "sgd"): "0.1"}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for opt in args.optimizers.split(","):
                base = [args.dtrain, "train", "--model", model, "--steps", str(args.steps), "--batch-size",
                        str(batch[model]), "--optimizer", opt, "--lr", lr[(model, opt)], "--progress=false",
                        "--seed", "1"]

                def train(name, extra):
                    path = os.path.join(tmp, f"{model}-{opt}-{name}.dtm")
                    run(base + extra + ["--save", path], args.timeout)
                    return path

                ref = train("ref", [])
                rows = []
                for name, extra, same_micro in [
                    ("dp2", ["--dp", "2"], ["--accumulate", "2"]),
                    ("dp3", ["--dp", "3"], ["--accumulate", "3"]),
                    ("dp4", ["--dp", "4"], ["--accumulate", "4"]),
                    ("dp4 zero1", ["--dp", "4", "--zero", "1"], ["--accumulate", "4"]),
                    ("dp4 zero2", ["--dp", "4", "--zero", "2"], ["--accumulate", "4"]),
                ]:
                    path = train(name.replace(" ", "-"), extra)
                    micro_ref = train("acc" + same_micro[1], same_micro)
                    rows.append({"run": name, "vs_one_process": max_rel(args.dtrain, ref, path),
                                 "vs_same_micro_batches": max_rel(args.dtrain, micro_ref, path)})
                dp4 = os.path.join(tmp, f"{model}-{opt}-dp4.dtm")
                acc = train("dp2-acc2", ["--dp", "2", "--accumulate", "2"])
                rows.append({"run": "dp2 x acc2 vs dp4", "vs_one_process": max_rel(args.dtrain, ref, acc),
                             "vs_same_micro_batches": max_rel(args.dtrain, dp4, acc)})
                print(f"\n{model}, {opt}, {args.steps} steps, global batch {batch[model]}")
                print(f"{'run':20s} {'max_rel vs 1 process':>22s} {'vs same micro-batches':>22s}")
                for r in rows:
                    print(f"{r['run']:20s} {r['vs_one_process']:22.3e} {r['vs_same_micro_batches']:22.3e}")
                    results.append({"model": model, "optimizer": opt, **r})
                sys.stdout.flush()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "batch": batch, "rows": results}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
