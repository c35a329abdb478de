#!/usr/bin/python3
"""dtrain's AdamW with 8-bit optimizer state against f32 state, side by side in one run, one thread each.

    /usr/bin/python3 bench/optimizer_state.py [--repeats 1] [--gpt-steps 1000] [--mlp-epochs 1]

Each repeat trains the GPT and the MLP once with `--optimizer-state f32` and once with
`--optimizer-state int8` (same seed, the order alternating between repeats), then prints medians
[min-max] and the ratios int8/f32 against issue 25's goals for 8-bit state: optimizer bytes at
least 3.9x fewer (`optimizer_state_bytes` of the final record: what the optimizer holds), GPT
validation loss within 1% after 1000 steps, MLP test accuracy within 0.3 points. Speed
(tokens/s, samples/s) is printed for the cost of (de)quantizing, without a goal. See
bench/README.md.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import compare_torch  # bench/, next to this script
from compare_torch import fmt, last_json, run, summary

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FORMATS = ("f32", "int8")


def job_args(job, a, seed):
    if job == "mlp":
        return ["--model", "mlp", "--hidden", "1024,1024", "--batch-size", "64", "--optimizer", "adamw", "--lr", "1e-3",
                "--epochs", str(a.mlp_epochs), "--threads", "1", "--seed", str(seed)]
    return ["--model", "gpt", "--layers", "4", "--heads", "4", "--width", "128", "--seq-len", "128", "--batch-size",
            "16", "--optimizer", "adamw", "--lr", "3e-4", "--steps", str(a.gpt_steps), "--eval-batches",
            str(a.eval_batches), "--threads", "1", "--seed", str(seed)]


def train(a, job, state, seed, log):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "metrics.jsonl")
        cmd = [a.dtrain, "train"] + job_args(job, a, seed) + ["--optimizer-state", state, "--progress=false",
                                                              "--metrics", metrics]
        _, rss, wall = run(cmd, log)
        with open(metrics) as f:
            rec = last_json(f.read())
    assert rec.get("event") == "final", rec
    assert rec.get("optimizer_state") == state, rec
    rec["wait4_peak_rss_bytes"], rec["wall_s"] = rss, wall
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gpt-steps", type=int, default=1000)
    p.add_argument("--mlp-epochs", type=int, default=1)
    p.add_argument("--eval-batches", type=int, default=0, help="GPT validation batches (0 = whole split)")
    p.add_argument("--jobs", default="gpt,mlp")
    p.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r (the same for both formats)")
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "release", "dtrain"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "optimizer_state.json"))
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    if not os.access(a.dtrain, os.X_OK):
        sys.exit(f"{a.dtrain}: not built (make build)")
    jobs = [j for j in a.jobs.split(",") if j]
    log = not a.quiet
    started = time.perf_counter()
    runs = {j: {s: [] for s in FORMATS} for j in jobs}
    for r in range(a.repeats):
        order = FORMATS if r % 2 == 0 else FORMATS[::-1]
        for j in jobs:
            for state in order:
                runs[j][state].append(train(a, j, state, a.seed + r, log))

    model, vector = compare_torch.cpu_info()
    print(f"dtrain --optimizer-state int8 against f32 (AdamW), one thread, {a.repeats} repeat(s), alternating order; "
          f"gpt {a.gpt_steps} steps, mlp {a.mlp_epochs} epoch(s)")
    print(f"CPU: {model} [{' '.join(vector)}]")
    rows = []

    def add(job, metric, key, digits, goal=None):
        s = {st: summary([key(rec) for rec in runs[job][st]]) for st in FORMATS}
        ratio = s["int8"]["median"] / s["f32"]["median"] if s["f32"] and s["f32"]["median"] else None
        diff = s["int8"]["median"] - s["f32"]["median"] if s["f32"] and s["int8"] else None
        check = "-"
        if goal is not None and ratio is not None:
            kind, v = goal
            ok = (ratio <= v if kind == "ratio<=" else abs(ratio - 1) <= v if kind == "within" else abs(diff) <= v)
            check = "ok" if ok else "FAIL"
        rows.append({"job": job, "metric": metric, "f32": s["f32"], "int8": s["int8"], "ratio": ratio,
                     "difference": diff, "check": check, "digits": digits})

    for j in jobs:
        add(j, "optimizer_state_bytes", lambda rec: rec["optimizer_state_bytes"], 0, ("ratio<=", 1 / 3.9))
        if j == "gpt":
            add(j, "val_loss", lambda rec: rec["val_loss"], 4, ("within", 0.01) if a.gpt_steps >= 1000 else None)
            add(j, "tokens_per_s", lambda rec: rec["tokens_per_s"], 0)
        else:
            add(j, "test_accuracy_%", lambda rec: 100 * rec["test_accuracy"], 2, ("points", 0.3))
            add(j, "samples_per_s", lambda rec: rec["samples_per_s"], 0)
        add(j, "train_loss", lambda rec: rec["train_loss"], 4)
        add(j, "peak_rss_MiB", lambda rec: rec["wait4_peak_rss_bytes"] / 2**20, 1)

    header = ["job", "metric", "f32 median [min-max]", "int8 median [min-max]", "int8/f32", "int8-f32", "goal"]
    table = [header] + [[r["job"], r["metric"], fmt(r["f32"], r["digits"]), fmt(r["int8"], r["digits"]),
                         f"{r['ratio']:.4f}" if r["ratio"] is not None else "-",
                         f"{r['difference']:+.{r['digits']}f}" if r["difference"] is not None else "-", r["check"]]
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    elapsed = time.perf_counter() - started
    print("goals: optimizer bytes int8/f32 <= 1/3.9; gpt val loss within 1% (checked with --gpt-steps >= 1000); "
          "mlp test accuracy within 0.3 points")
    print(f"took {elapsed:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": model,
                   "cpu_vector_flags": vector, "elapsed_s": elapsed,
                   "rows": [{k: v for k, v in r.items() if k != "digits"} for r in rows], "runs": runs}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
