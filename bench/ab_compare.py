#!/usr/bin/python3
"""Two variants of a dtrain run side by side: two binaries, or one binary with two sets of flags or
environment, alternating in one run, one thread each.

    /usr/bin/python3 bench/ab_compare.py --a BINARY_A --b BINARY_B [--repeats 5] -- train --model gpt --steps 30
    /usr/bin/python3 bench/ab_compare.py --b-env DTRAIN_GEMM=onednn --repeats 5 -- train --model mlp --steps 300

Each repeat runs A then B (B then A on odd repeats) with the same arguments plus --metrics, and the
table gives medians [min-max] of the final record's rate (tokens/s or samples/s), of the rate per
CPU-second of training (train_cpu_s: what a run would reach with the core to itself, the steadier
figure on a shared machine), the MFU, losses and params digest, and the ratio B/A of medians.

--together runs A and B at the same time instead, each pinned to its own CPU (the two CPUs
swapped every repeat), and adds the ratio B/A within each repeat: on a VM whose speed drifts from
minute to minute both variants then see the same drift, so that a difference of 1-3% shows where
alternating runs scatter by more. Both run a little slower than alone (they share the cache and
memory); compare them with each other, not with figures from runs alone.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def start(binary, args, env_extra, metrics_dir, i, cpu=None):
    """Starts one run (pinned to `cpu` when given); finish() waits for it and reads its record."""
    metrics = os.path.join(metrics_dir, f"m{i}.jsonl")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.update(env_extra)
    cmd = [binary] + args + ["--progress=false", "--metrics", metrics]
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pin)
    return proc, cmd, metrics


def finish(started):
    proc, cmd, metrics = started
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{stdout[-2000:]}\n{stderr[-3000:]}")
    with open(metrics) as f:
        rec = [json.loads(line) for line in f if line.strip()][-1]
    unit = "tokens_per_s" if "tokens_per_s" in rec else "samples_per_s"
    rate = rec[unit]
    rec["rate"] = rate
    rec["rate_per_cpu_s"] = rate * rec["train_time_s"] / rec["train_cpu_s"] if rec.get("train_cpu_s") else None
    rec["unit"] = unit
    return rec


def fmt(values, digits):
    v = [x for x in values if x is not None]
    if not v:
        return "-", None
    m = statistics.median(v)
    return f"{m:.{digits}f} [{min(v):.{digits}f}-{max(v):.{digits}f}]", m


def parse_env(items):
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = v
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = os.path.join(ROOT, "build", "release", "dtrain")
    p.add_argument("--a", default=default, help="binary A")
    p.add_argument("--b", default=None, help="binary B (default: A)")
    p.add_argument("--a-args", default="", help="more arguments for A")
    p.add_argument("--b-args", default="", help="more arguments for B")
    p.add_argument("--a-env", action="append", default=[], help="VAR=VALUE for A (repeatable)")
    p.add_argument("--b-env", action="append", default=[], help="VAR=VALUE for B (repeatable)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--together", action="store_true",
                   help="run A and B at the same time, one CPU each (swapped every repeat), and report B/A per repeat")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the dtrain arguments of both")
    a = p.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    variants = {"A": (a.a, args + a.a_args.split(), parse_env(a.a_env)),
                "B": (a.b or a.a, args + a.b_args.split(), parse_env(a.b_env))}
    recs = {"A": [], "B": []}
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if a.together and len(cpus) < 2:
        sys.exit(f"--together needs two CPUs to pin the runs to; this process may use {cpus}")
    with tempfile.TemporaryDirectory() as d:
        i = 0
        for r in range(a.repeats):
            order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
            if a.together:  # order[k] on cpus[k]: each variant on each CPU every other repeat
                started = {name: start(*variants[name], d, i + k, cpus[k]) for k, name in enumerate(order)}
                for name in order:
                    recs[name].append(finish(started[name]))
                i += 2
                continue
            for name in order:
                recs[name].append(finish(start(*variants[name], d, i)))
                i += 1
    unit = recs["A"][0]["unit"]
    print(f"A: {variants['A'][0]} {' '.join(variants['A'][1])} {variants['A'][2] or ''}")
    print(f"B: {variants['B'][0]} {' '.join(variants['B'][1])} {variants['B'][2] or ''}")
    how = f"run together on CPUs {cpus[0]} and {cpus[1]}, swapped every repeat" if a.together else "alternating"
    print(f"{a.repeats} repeats, {how}; medians [min-max]")
    for key, digits in ((("rate", 0), ("rate_per_cpu_s", 0), ("mfu", 4), ("train_loss", 4), ("val_loss", 4),
                         ("test_accuracy", 4))):
        sa, ma = fmt([x.get(key) for x in recs["A"]], digits)
        sb, mb = fmt([x.get(key) for x in recs["B"]], digits)
        if ma is None and mb is None:
            continue
        name = {"rate": unit, "rate_per_cpu_s": unit + " per CPU-s"}.get(key, key)
        ratio = f"{mb / ma:.3f}" if ma and mb is not None else "-"
        print(f"  {name:<26} A {sa:<28} B {sb:<28} B/A {ratio}")
    if a.together:
        paired, _ = fmt([b["rate"] / x["rate"] for x, b in zip(recs["A"], recs["B"])], 3)
        print(f"  {unit + ' B/A per repeat':<26} {paired}")
    for name in ("A", "B"):
        print(f"  params digests {name}: {sorted(set(x.get('params_digest', '?')[:16] for x in recs[name]))}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"variants": {k: [v[0], v[1], v[2]] for k, v in variants.items()}, "runs": recs}, f, indent=1)


if __name__ == "__main__":
    main()
