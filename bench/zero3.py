#!/usr/bin/python3
"""--zero 3 against --zero 1: throughput side by side, and the memory each holds per rank.

    /usr/bin/python3 bench/zero3.py [--runs 5] [--steps 60] [--dp 2 4] [--model gpt|mlp]

For each data-parallel size, runs the same job with --zero 1 and --zero 3 alternately (A B A B
...), so the two share the machine's state; reports the median tokens/s (or samples/s) of each,
min-max, and the median of the per-pair ratios zero3 / zero1. Also the parameters + gradients +
optimizer bytes per rank each reports, and ZeRO 3's transient peak of gathered blocks.
Target (issue 25): ratio >= 0.85 on 2 and 4 processes. Results: bench/results/zero3.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def final_record(cmd, metrics, name):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    if p.returncode != 0:
        sys.exit(f"{name} failed ({p.returncode}):\n{p.stdout[-3000:]}")
    with open(metrics) as f:
        return [json.loads(x) for x in f if x.strip()][-1]


def job(args):
    if args.model == "gpt":
        return ["--model", "gpt", "--layers", "4", "--width", "128", "--heads", "4", "--seq-len", "64",
                "--batch-size", "16", "--optimizer", "adamw", "--eval-batches", "1"]
    return ["--model", "mlp", "--hidden", "1024,1024", "--batch-size", "256", "--optimizer", "adamw"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/zero3.json"))
    args = ap.parse_args()
    rate_key = "tokens_per_s" if args.model == "gpt" else "samples_per_s"
    out = {"model": args.model, "steps": args.steps, "runs": args.runs, "dp": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            rates = {1: [], 3: []}
            last = {}
            for run in range(args.runs):
                for zero in (1, 3):
                    name = f"dp{dp}-z{zero}-{run}"
                    metrics = os.path.join(tmp, name + ".jsonl")
                    cmd = [args.dtrain, "train", "--dp", str(dp), "--zero", str(zero), "--steps", str(args.steps),
                           "--progress=false", "--log-every", "1000", "--metrics", metrics] + job(args)
                    r = final_record(cmd, metrics, name)
                    rates[zero].append(r[rate_key])
                    last[zero] = r
            ratios = [b / a for a, b in zip(rates[1], rates[3])]
            mem = {z: last[z]["param_bytes_per_rank"] + last[z]["grad_bytes_per_rank"] +
                   last[z]["optimizer_bytes_per_rank"] for z in (1, 3)}
            row = {
                "zero1_" + rate_key: rates[1], "zero3_" + rate_key: rates[3], "ratios": ratios,
                "median_ratio": statistics.median(ratios),
                "state_bytes_per_rank": {"zero1": mem[1], "zero3": mem[3]},
                "gathered_param_peak_bytes": last[3].get("gathered_param_peak_bytes"),
            }
            out["dp"][str(dp)] = row
            print(f"dp {dp}: zero1 {statistics.median(rates[1]):.0f} ({min(rates[1]):.0f}-{max(rates[1]):.0f}) "
                  f"zero3 {statistics.median(rates[3]):.0f} ({min(rates[3]):.0f}-{max(rates[3]):.0f}) {rate_key}; "
                  f"ratio median {row['median_ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
                  f"state per rank zero1 {mem[1] / 2**20:.1f} MiB, zero3 {mem[3] / 2**20:.1f} MiB "
                  f"(+ gathered blocks peak {row['gathered_param_peak_bytes'] / 2**20:.1f} MiB)", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
