#!/usr/bin/python3
"""Peak resident memory and step time with AdamW's state offloaded to disk (--offload DIR), side by side.

    /usr/bin/python3 bench/offload.py [--repeats 1] [--steps 6] [--dir /var/tmp]

Trains one GPT (default 4 layers of width 512: about 13M parameters, so that AdamW's f32 state is
about 100 MiB) a few steps four ways, one thread each, no checkpoints: f32 state in memory, f32
state offloaded, int8 state in memory, int8 state offloaded. Prints per way the peak RSS
(wait4's, of the whole process), the optimizer state's bytes and the mean step time, and checks
issue 25's bound for offload: the peak RSS offloaded is at most the peak in memory minus the
state plus the chunks a step holds at once (kOffloadChunk = 2^18 elements of each state tensor
being stepped, plus 8 MiB of slack for allocator and page-table noise). The offload directory
should be on a disk, not tmpfs (on tmpfs the page cache is memory). See bench/README.md.
"""
import argparse
import json
import os
import sys
import tempfile
import time

from compare_torch import fmt, last_json, run, summary

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHUNK = 1 << 18
WAYS = [("f32", False), ("f32", True), ("int8", False), ("int8", True)]


def train(a, state, offload, log):
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        metrics = os.path.join(d, "metrics.jsonl")
        cmd = [a.dtrain, "train", "--model", "gpt", "--layers", str(a.layers), "--width", str(a.width), "--heads",
               str(a.width // 64), "--seq-len", "64", "--batch-size", "4", "--steps", str(a.steps),
               "--eval-batches", "1", "--threads", "1", "--optimizer-state", state, "--progress=false",
               "--metrics", metrics]
        if offload:
            cmd += ["--offload", os.path.join(d, "state")]
        _, rss, wall = run(cmd, log)
        with open(metrics) as f:
            rec = last_json(f.read())
    assert rec.get("event") == "final" and rec.get("offload") == offload, rec
    rec["wait4_peak_rss_bytes"], rec["wall_s"] = rss, wall
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--dir", default="/var/tmp", help="where the offloaded state goes (a disk, not tmpfs)")
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "release", "dtrain"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "offload.json"))
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    if not os.access(a.dtrain, os.X_OK):
        sys.exit(f"{a.dtrain}: not built (make build)")
    started = time.perf_counter()
    runs = {f"{s}{' offload' if o else ''}": [] for s, o in WAYS}
    for r in range(a.repeats):
        for state, offload in (WAYS if r % 2 == 0 else WAYS[::-1]):
            runs[f"{state}{' offload' if offload else ''}"].append(train(a, state, offload, not a.quiet))
    print(f"dtrain GPT {a.layers} x {a.width}, {a.steps} steps, one thread, {a.repeats} repeat(s); "
          f"offload dir {a.dir}")
    header = ["way", "peak RSS MiB", "state MiB", "step s", "bound MiB", "check"]
    rows = [header]
    result = {}
    for state, offload in WAYS:
        name = f"{state}{' offload' if offload else ''}"
        rss = summary([rec["wait4_peak_rss_bytes"] / 2**20 for rec in runs[name]])
        st = summary([rec["optimizer_state_bytes"] / 2**20 for rec in runs[name]])
        step = summary([rec["train_time_s"] / rec["steps"] for rec in runs[name]])
        bound, check = None, "-"
        if offload:
            mem = summary([rec["wait4_peak_rss_bytes"] / 2**20 for rec in runs[state]])
            per_elem = 8 if state == "f32" else 2 + 8 / 256
            bound = mem["median"] - st["median"] + CHUNK * per_elem / 2**20 + 8
            check = "ok" if rss["median"] <= bound else "FAIL"
        result[name] = {"peak_rss_MiB": rss, "state_MiB": st, "step_s": step, "bound_MiB": bound, "check": check}
        rows.append([name, fmt(rss, 1), fmt(st, 1), fmt(step, 3), f"{bound:.1f}" if bound else "-", check])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for state in ("f32", "int8"):
        cost = result[f"{state} offload"]["step_s"]["median"] / result[state]["step_s"]["median"]
        print(f"{state}: offloaded step time / in memory = {cost:.3f}")
    elapsed = time.perf_counter() - started
    print(f"took {elapsed:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": elapsed,
                   "result": result, "runs": runs}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
