"""What bench/precision_compare.py and bench/optimizer_state.py share: dtrain's GPT and MLP trained
once per value of one flag (same seed, the order alternating between repeats, one thread each),
and a table of medians [min-max], ratio and difference between the two values, against goals.

A goal is (kind, value): ("ratio>=", v) or ("ratio<=", v) on the ratio of medians, ("within", v)
for |ratio - 1| <= v, ("points", v) for |difference| <= v. Beside the ratio of medians, the table
shows the ratio within each repeat (its two runs back to back), median [min-max]: on a machine
whose speed drifts between runs it is the steadier figure, but the goals stay on the former.
"""
import argparse
import json
import os
import sys
import time

import compare_torch  # bench/, next to this script
from compare_torch import fmt, summary, train_final


def parse(doc, repeats, out_name):
    """The options both benches take; exits when dtrain is not built."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--gpt-steps", type=int, default=1000)
    p.add_argument("--mlp-epochs", type=int, default=1)
    p.add_argument("--eval-batches", type=int, default=0, help="GPT validation batches (0 = whole split)")
    p.add_argument("--jobs", default="gpt,mlp")
    p.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r (the same for both values)")
    p.add_argument("--dtrain", default=os.path.join(os.path.dirname(here), "build", "release", "dtrain"))
    p.add_argument("--out", default=os.path.join(here, "results", out_name))
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="dtrain's runs with --profile (time per op kind in each final record)")
    a = p.parse_args()
    if not os.access(a.dtrain, os.X_OK):
        sys.exit(f"{a.dtrain}: not built (make build)")
    a.job_list = [j for j in a.jobs.split(",") if j]
    return a


def job_args(job, a, seed):
    """The two jobs: the Fashion-MNIST MLP (a.mlp_epochs) and the byte GPT (a.gpt_steps, a.eval_batches)."""
    if job == "mlp":
        return ["--model", "mlp", "--hidden", "1024,1024", "--batch-size", "64", "--optimizer", "adamw", "--lr", "1e-3",
                "--epochs", str(a.mlp_epochs), "--threads", "1", "--seed", str(seed)]
    return ["--model", "gpt", "--layers", "4", "--heads", "4", "--width", "128", "--seq-len", "128", "--batch-size",
            "16", "--optimizer", "adamw", "--lr", "3e-4", "--steps", str(a.gpt_steps), "--eval-batches",
            str(a.eval_batches), "--threads", "1", "--seed", str(seed)]


def train(a, job, flag, value, seed, log):
    """One run of `job` with `flag value`: its final metrics record, with wait4's peak RSS and the wall time."""
    return train_final(a.dtrain, job_args(job, a, seed) + [flag, value] + (["--profile"] if a.profile else []), log)


def alternate(a, jobs, flag, values, log):
    """runs[job][value]: a.repeats records each, repeat r with seed a.seed + r, the order reversed on odd repeats."""
    runs = {j: {v: [] for v in values} for j in jobs}
    for r in range(a.repeats):
        order = values if r % 2 == 0 else values[::-1]
        for j in jobs:
            for v in order:
                runs[j][v].append(train(a, j, flag, v, a.seed + r, log))
    return runs


class Table:
    """Rows of one metric of one job: `base` and `other`'s medians, other/base and other-base, the goal."""

    def __init__(self, runs, base, other, ratio_digits=3):
        self.runs, self.base, self.other, self.ratio_digits = runs, base, other, ratio_digits
        self.rows = []

    def add(self, job, metric, key, digits, goal=None):
        s = {v: summary([key(rec) for rec in self.runs[job][v]]) for v in (self.base, self.other)}
        b, o = s[self.base], s[self.other]
        ratio = o["median"] / b["median"] if b and b["median"] else None
        diff = o["median"] - b["median"] if b and o else None
        check = "-"
        if goal is not None and ratio is not None:
            kind, v = goal
            ok = {"ratio>=": lambda: ratio >= v, "ratio<=": lambda: ratio <= v, "within": lambda: abs(ratio - 1) <= v,
                  "points": lambda: abs(diff) <= v}[kind]()
            check = "ok" if ok else "FAIL"
        # Each repeat's two runs ran one after the other: their ratio cancels the slow and fast
        # phases of a shared machine that the ratio of medians keeps (shown beside it, not judged).
        pairs = [(key(o_rec), key(b_rec)) for b_rec, o_rec in zip(self.runs[job][self.base], self.runs[job][self.other])]
        pairs = [x / y for x, y in pairs if x is not None and y]
        self.rows.append({"job": job, "metric": metric, self.base: b, self.other: o, "ratio": ratio,
                          "ratio_per_repeat": summary(pairs) if pairs else None, "difference": diff, "check": check,
                          "digits": digits})

    def print(self):
        header = ["job", "metric", f"{self.base} median [min-max]", f"{self.other} median [min-max]",
                  f"{self.other}/{self.base}", "ratio per repeat", f"{self.other}-{self.base}", "goal"]
        table = [header] + [[r["job"], r["metric"], fmt(r[self.base], r["digits"]), fmt(r[self.other], r["digits"]),
                             f"{r['ratio']:.{self.ratio_digits}f}" if r["ratio"] is not None else "-",
                             fmt(r["ratio_per_repeat"], self.ratio_digits) if r["ratio_per_repeat"] else "-",
                             f"{r['difference']:+.{r['digits']}f}" if r["difference"] is not None else "-",
                             r["check"]]
                            for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for i, row in enumerate(table):
            print("  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
            if i == 0:
                print("  ".join("-" * w for w in widths))


def cpu():
    """(model, vector flags), printed as the header's CPU line."""
    model, vector = compare_torch.cpu_info()
    print(f"CPU: {model} [{' '.join(vector)}]")
    return model, vector


def write(a, model, vector, table, runs, **extra):
    """The JSON of the run: config, time, CPU, rows (without print digits), every record, and `extra`."""
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": {k: v for k, v in vars(a).items() if k != "job_list"}, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": model,
                   "cpu_vector_flags": vector, **extra,
                   "rows": [{k: v for k, v in r.items() if k != "digits"} for r in table.rows], "runs": runs}, f,
                  indent=1)
    print(f"wrote {a.out}")
