#!/usr/bin/python3
"""Model parallelism: same math, pipeline bubble, activation memory, and layouts side by side.

    /usr/bin/python3 bench/model_parallel.py [--parts same,bubble,memory,layouts] [--repeats 3]

same     the GPT trained --steps (30) steps with --pp 2 and --pp 4 (gpipe and 1f1b), --tp 2,
         --tp 2 --pp 2 and --dp 2 --pp 2 against one process with the same global batch: `dtrain
         diff`'s max relative difference. SGD against the plain single process (only the order of
         float sums differs); AdamW also against one process accumulating the same micro-batches
         (--accumulate M), which a pipeline must match bit for bit, because AdamW divides by
         sqrt(v) and so magnifies rounding in gradients near zero.
bubble   each stage's idle fraction (1 - compute / step time, from the final metrics) for
         P = 2, 4 and M = 4, 8, 16 with 1f1b, next to (P-1)/(M+P-1). The GPT has P x 2 layers
         and the stages are cut by hand so that each holds two transformer blocks (the embedding
         joins the first, the head the last).
memory   each stage's peak activation bytes with 1f1b and gpipe at M = 16 (P = 2, 4), and their
         ratio against P/M; peak RSS per rank.
layouts  tokens/s of 1 process and of DP, PP, TP and mixed layouts on 4 processes, medians of
         --repeats runs, with each layout's measured compute/idle split.
Results: bench/results/model_parallel.json.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout=1800):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode not in (0, 1):
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}")
    return p.stdout


def final(metrics):
    with open(metrics) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return [x for x in lines if x.get("event") == "final"][-1]


def max_rel(dtrain, a, b):
    out = run([dtrain, "diff", a, b, "--quiet"], 60)
    m = re.search(r"max_rel ([0-9.e+-]+)", out)
    return float(m.group(1))


def train(args, tmp, name, extra, save=False):
    metrics = os.path.join(tmp, name + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [args.dtrain, "train", "--model", "gpt", "--progress=false", "--log-every", "1000", "--metrics", metrics,
           "--seed", "1", "--eval-batches", "1"] + extra
    if save:
        cmd += ["--save", os.path.join(tmp, name + ".dtm")]
    run(cmd)
    return final(metrics)


def part_same(args, tmp, out):
    base = ["--steps", str(args.steps), "--batch-size", "16"]
    layouts = [("pp2-gpipe", "--pp 2 --micro-batches 4 --schedule gpipe"), ("pp2-1f1b", "--pp 2 --micro-batches 4"),
               ("pp4-gpipe", "--pp 4 --micro-batches 4 --schedule gpipe"), ("pp4-1f1b", "--pp 4 --micro-batches 4"),
               ("tp2", "--tp 2"), ("tp2-pp2", "--tp 2 --pp 2 --micro-batches 4"),
               ("dp2-pp2", "--dp 2 --pp 2 --micro-batches 2")]
    rows = []
    for opt, lr in (("sgd", "0.1"), ("adamw", "3e-4")):
        o = base + ["--optimizer", opt, "--lr", lr]
        train(args, tmp, f"one-{opt}", o, save=True)
        train(args, tmp, f"acc4-{opt}", o + ["--accumulate", "4"], save=True)
        for name, flags in layouts:
            train(args, tmp, f"{name}-{opt}", o + flags.split(), save=True)
            row = {"layout": name, "optimizer": opt,
                   "vs_one_process": max_rel(args.dtrain, os.path.join(tmp, f"one-{opt}.dtm"),
                                             os.path.join(tmp, f"{name}-{opt}.dtm"))}
            if name.startswith("pp"):
                row["vs_same_micro_batches"] = max_rel(args.dtrain, os.path.join(tmp, f"acc4-{opt}.dtm"),
                                                       os.path.join(tmp, f"{name}-{opt}.dtm"))
            print(f"same  {opt:6s} {name:10s} " + "  ".join(f"{k} {v:.3e}" for k, v in row.items() if k.startswith("vs")),
                  flush=True)
            rows.append(row)
    out["same"] = rows


def stage_flags(P):
    # 2 P layers: blocks 0 (embed), 1..2P (layers), 2P+1 (head); two layers per stage.
    cuts, start = [], 0
    for s in range(P):
        end = 2 * s + 2 + (1 if s == P - 1 else 0)
        cuts.append(f"{start}-{end}")
        start = end + 1
    return ["--layers", str(2 * P), "--pp", str(P), "--stages", ",".join(cuts)]


def part_bubble(args, tmp, out):
    rows = []
    for P in (2, 4):
        for M in (4, 8, 16):
            bubbles = []
            for rep in range(args.repeats):
                f = train(args, tmp, f"bubble-{P}-{M}", ["--steps", str(args.bubble_steps), "--batch-size", str(2 * M),
                                                        "--micro-batches", str(M)] + stage_flags(P))
                bubbles.append(f["stage_bubble"])
            per_stage = [statistics.median(b[s] for b in bubbles) for s in range(P)]
            theory = (P - 1) / (M + P - 1)
            mean = statistics.mean(per_stage)
            rows.append({"P": P, "M": M, "stage_bubble": per_stage, "mean": mean, "theory": theory,
                         "relative_error": (mean - theory) / theory})
            print(f"bubble P {P} M {M:2d}  stages " + " ".join(f"{b:.3f}" for b in per_stage) +
                  f"  mean {mean:.3f}  theory {theory:.3f}  ({100 * (mean - theory) / theory:+.1f}%)", flush=True)
    out["bubble"] = rows


def part_memory(args, tmp, out):
    rows = []
    M = 16
    for P in (2, 4):
        f = {}
        for sched in ("gpipe", "1f1b"):
            f[sched] = train(args, tmp, f"mem-{P}-{sched}", ["--steps", "3", "--batch-size", str(2 * M), "--micro-batches",
                                                             str(M), "--schedule", sched] + stage_flags(P))
        ratios = [a / g for a, g in zip(f["1f1b"]["stage_activation_peak_bytes"], f["gpipe"]["stage_activation_peak_bytes"])]
        rows.append({"P": P, "M": M, "gpipe": f["gpipe"]["stage_activation_peak_bytes"],
                     "1f1b": f["1f1b"]["stage_activation_peak_bytes"], "ratio": ratios, "bound": P / M * 1.1,
                     "in_flight_1f1b": f["1f1b"]["stage_max_in_flight"],
                     "peak_rss_1f1b": f["1f1b"]["peak_rss_bytes_per_rank"],
                     "peak_rss_gpipe": f["gpipe"]["peak_rss_bytes_per_rank"]})
        print(f"memory P {P} M {M}: activation MiB gpipe " +
              " ".join(f"{b / 2**20:.1f}" for b in f["gpipe"]["stage_activation_peak_bytes"]) + "  1f1b " +
              " ".join(f"{b / 2**20:.1f}" for b in f["1f1b"]["stage_activation_peak_bytes"]) + "  ratio " +
              " ".join(f"{r:.3f}" for r in ratios) + f"  (P/M = {P / M:.3f}, +10% {P / M * 1.1:.3f})  peak RSS MiB 1f1b " +
              " ".join(f"{b / 2**20:.0f}" for b in f["1f1b"]["peak_rss_bytes_per_rank"]) + "  gpipe " +
              " ".join(f"{b / 2**20:.0f}" for b in f["gpipe"]["peak_rss_bytes_per_rank"]), flush=True)
    out["memory"] = rows


def part_layouts(args, tmp, out):
    base = ["--steps", str(args.layout_steps), "--batch-size", "32", "--layers", "4"]
    layouts = [("1 process", ""), ("dp4", "--dp 4"), ("dp4 zero1", "--dp 4 --zero 1"),
               ("pp4 1f1b M8", "--pp 4 --micro-batches 8"), ("tp4", "--tp 4"),
               ("dp2 pp2 M8", "--dp 2 --pp 2 --micro-batches 8"), ("dp2 tp2", "--dp 2 --tp 2"),
               ("tp2 pp2 M8", "--tp 2 --pp 2 --micro-batches 8"), ("dp2", "--dp 2"), ("pp2 M8", "--pp 2 --micro-batches 8"),
               ("tp2", "--tp 2")]
    rows = []
    for rep in range(args.repeats):  # interleaved, so drifts hit every layout alike
        for name, flags in layouts:
            f = train(args, tmp, "layout", base + flags.split())
            rows.append({"layout": name, "tokens_per_s": f["tokens_per_s"], "compute_s": f.get("compute_s"),
                         "train_time_s": f["train_time_s"], "world": f["world"]})
    summary = []
    one = statistics.median(r["tokens_per_s"] for r in rows if r["layout"] == "1 process")
    for name, _ in layouts:
        rs = [r for r in rows if r["layout"] == name]
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        summary.append({"layout": name, "world": rs[0]["world"], "tokens_per_s": tps, "vs_one_process": tps / one,
                        "runs": [r["tokens_per_s"] for r in rs],
                        "compute_fraction": statistics.median(r["compute_s"] / r["train_time_s"] for r in rs)})
        print(f"layout {name:12s} world {rs[0]['world']}  {tps:8.0f} tok/s  x{tps / one:.2f} of one process  "
              f"compute {100 * summary[-1]['compute_fraction']:.0f}% of the step  runs " +
              " ".join(f"{r['tokens_per_s']:.0f}" for r in rs), flush=True)
    out["layouts"] = summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--parts", default="same,bubble,memory,layouts")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--bubble-steps", type=int, default=8)
    ap.add_argument("--layout-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/model_parallel.json"))
    args = ap.parse_args()
    out = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            {"same": part_same, "bubble": part_bubble, "memory": part_memory, "layouts": part_layouts}[part](args, tmp, out)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
