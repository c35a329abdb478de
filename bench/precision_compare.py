#!/usr/bin/python3
"""dtrain with bf16 products against dtrain in f32, side by side in one run, one thread each.

    /usr/bin/python3 bench/precision_compare.py [--repeats 3] [--gpt-steps 1000] [--mlp-epochs 1]

Each repeat trains the GPT and the MLP once with `--precision f32` and once with `--precision
bf16` (same seed, the order alternating between repeats), then prints medians [min-max] and the
ratios bf16/f32 of tokens/s and samples/s, validation loss and test accuracy, against issue 21's
goals: GPT tokens/s at least 1.6x, validation loss within 2% (after 1000 steps), MLP test accuracy
within 0.3 points. The header names the CPU and the route bf16 products took (`bf16_route` of
dtrain's final record). See bench/README.md.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import compare_torch  # bench/, next to this script
from compare_torch import fmt, last_json, run, summary

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def job_args(job, a, seed):
    if job == "mlp":
        return ["--model", "mlp", "--hidden", "1024,1024", "--batch-size", "64", "--optimizer", "adamw", "--lr", "1e-3",
                "--epochs", str(a.mlp_epochs), "--threads", "1", "--seed", str(seed)]
    return ["--model", "gpt", "--layers", "4", "--heads", "4", "--width", "128", "--seq-len", "128", "--batch-size",
            "16", "--optimizer", "adamw", "--lr", "3e-4", "--steps", str(a.gpt_steps), "--eval-batches",
            str(a.eval_batches), "--threads", "1", "--seed", str(seed)]


def train(a, job, precision, seed, log):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "metrics.jsonl")
        cmd = [a.dtrain, "train"] + job_args(job, a, seed) + ["--precision", precision, "--progress=false",
                                                              "--metrics", metrics]
        run(cmd, log)
        with open(metrics) as f:
            rec = last_json(f.read())
    assert rec.get("event") == "final", rec
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpt-steps", type=int, default=1000)
    p.add_argument("--mlp-epochs", type=int, default=1)
    p.add_argument("--eval-batches", type=int, default=0, help="GPT validation batches (0 = whole split)")
    p.add_argument("--jobs", default="gpt,mlp")
    p.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r (the same for both precisions)")
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "release", "dtrain"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "precision_compare.json"))
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    if not os.access(a.dtrain, os.X_OK):
        sys.exit(f"{a.dtrain}: not built (make build)")
    jobs = [j for j in a.jobs.split(",") if j]
    log = not a.quiet
    runs = {j: {"f32": [], "bf16": []} for j in jobs}
    for r in range(a.repeats):
        order = ["f32", "bf16"] if r % 2 == 0 else ["bf16", "f32"]
        for j in jobs:
            for precision in order:
                runs[j][precision].append(train(a, j, precision, a.seed + r, log))

    model, vector = compare_torch.cpu_info()
    route = next((rec.get("bf16_route") for j in jobs for rec in runs[j]["bf16"]), "?")
    print(f"dtrain --precision bf16 against f32, one thread, {a.repeats} repeat(s), alternating order; "
          f"gpt {a.gpt_steps} steps, mlp {a.mlp_epochs} epoch(s)")
    print(f"CPU: {model} [{' '.join(vector)}]")
    print(f"bf16 route: {route}")
    rows = []

    def add(job, metric, key, digits, goal=None):
        s = {pr: summary([key(rec) for rec in runs[job][pr]]) for pr in ("f32", "bf16")}
        ratio = s["bf16"]["median"] / s["f32"]["median"] if s["f32"] and s["f32"]["median"] else None
        diff = s["bf16"]["median"] - s["f32"]["median"] if s["f32"] and s["bf16"] else None
        check = "-"
        if goal is not None and ratio is not None:
            kind, v = goal
            ok = ratio >= v if kind == "ratio>=" else abs(ratio - 1) <= v if kind == "within" else abs(diff) <= v
            check = "ok" if ok else "FAIL"
        rows.append({"job": job, "metric": metric, "f32": s["f32"], "bf16": s["bf16"], "ratio": ratio,
                     "difference": diff, "check": check, "digits": digits})

    for j in jobs:
        if j == "gpt":
            add(j, "tokens_per_s", lambda rec: rec["tokens_per_s"], 0, ("ratio>=", 1.6))
            add(j, "val_loss", lambda rec: rec["val_loss"], 4, ("within", 0.02) if a.gpt_steps >= 1000 else None)
            add(j, "mfu_%", lambda rec: 100 * rec["mfu"], 1)
        else:
            add(j, "samples_per_s", lambda rec: rec["samples_per_s"], 0)
            add(j, "test_accuracy_%", lambda rec: 100 * rec["test_accuracy"], 2, ("points", 0.3))
        add(j, "train_loss", lambda rec: rec["train_loss"], 4)

    header = ["job", "metric", "f32 median [min-max]", "bf16 median [min-max]", "bf16/f32", "bf16-f32", "goal"]
    table = [header] + [[r["job"], r["metric"], fmt(r["f32"], r["digits"]), fmt(r["bf16"], r["digits"]),
                         f"{r['ratio']:.3f}" if r["ratio"] is not None else "-",
                         f"{r['difference']:+.{r['digits']}f}" if r["difference"] is not None else "-", r["check"]]
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("goals: gpt tokens/s bf16/f32 >= 1.6; val loss within 2% (checked with --gpt-steps >= 1000); "
          "mlp test accuracy within 0.3 points")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": model,
                   "cpu_vector_flags": vector, "bf16_route": route,
                   "rows": [{k: v for k, v in r.items() if k != "digits"} for r in rows], "runs": runs}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
