#!/usr/bin/python3
"""dtrain's all_reduce against Open MPI's MPI_Allreduce and PyTorch's gloo, side by side in one run.

    /usr/bin/python3 bench/collectives_compare.py [--worlds 2,4] [--max-bytes 256M] [--repeats 3]

For each world size, repeat and size (powers of two from --min-bytes to --max-bytes, f32 sum,
same --iters/--warmup, --check), runs every tool back to back, rotating which goes first, so
background load and the machine's state hit all alike (--interleave sweep: each tool's whole
sweep in turn). Then prints per world size a table of medians over
the repeats (p50 latency and busbw per size), dtrain/baseline ratios, busbw as a fraction of
the run's single-core memcpy bandwidth, and a check of the targets; everything goes to --out
as JSON. The tools:
  dtrain   `dtrain bench collectives -n N --op allreduce --inplace ... --json FILE` (--shared
           instead of --inplace with --dtrain-buffers shared)
  openmpi  bench/mpi_allreduce.c, built with mpicc into bench/results/, run by mpirun over
           shared memory (pml ob1, btl self,vader); with --mpi-settings best (default) it runs two
           variants (busy-poll/yield, or two single-copy mechanisms when oversubscribed) and keeps
           each size's faster (bench/README.md)
  gloo     bench/gloo_allreduce.py (torch.distributed, backend gloo, TCP loopback)
Before and after every sweep, bench/core_latency.c measures the core-to-core cache-line round
trip: on a virtual machine it tells which runs met CPUs that the host placed far apart.
See bench/README.md.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import placement  # bench/, next to this script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
KiB, MiB = 1 << 10, 1 << 20

# mpirun settings (see bench/README.md, "Open MPI settings", for how they were chosen).
MPI_BASE = ["--allow-run-as-root", "--oversubscribe"]


def mpi_binding(n, cores):
    """mpirun's own default binds ranks to cores when they fit (dtrain launch does the same);
    with more ranks than cores it must not bind."""
    return ["--bind-to", "core" if n <= cores else "none"]
MPI_MCA = {"pml": "ob1", "btl": "self,vader"}

# The targets, ratio = dtrain / baseline.
TARGETS = [
    # (name, baseline, metric, lo bytes, hi bytes, op, value)
    ("busbw 4 MiB..256 MiB >= 2x openmpi", "openmpi", "busbw", 4 * MiB, 256 * MiB, ">=", 2.0),
    ("busbw 4 MiB..256 MiB >= 3x gloo", "gloo", "busbw", 4 * MiB, 256 * MiB, ">=", 3.0),
    ("busbw 1 MiB >= 1x openmpi", "openmpi", "busbw", 1 * MiB, 1 * MiB, ">=", 1.0),
    ("p50 <= 8 KiB no worse than openmpi", "openmpi", "p50", 0, 8 * KiB, "<=", 1.0),
]


def parse_bytes(s):
    s = str(s).strip()
    mul = {"k": KiB, "m": MiB, "g": 1 << 30}.get(s[-1:].lower(), 1)
    return int(float(s[:-1] if mul > 1 else s) * mul)


def human(b):
    for unit, m in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if b >= m and b % m == 0:
            return f"{b // m} {unit}"
    return f"{b} B"


def sizes(lo, hi):
    out, b = [], lo
    while b <= hi:
        out.append(b)
        b *= 2
    return out


def log(a, msg):
    if not a.quiet:
        print(msg, file=sys.stderr, flush=True)


def run(cmd, timeout, what):
    """Runs cmd in its own session (so a timeout kills every process it started);
    returns (ok, message, stdout+stderr tail, seconds)."""
    env = dict(os.environ, **ONE_THREAD)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        try:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
        except OSError as e:
            return False, f"{what}: cannot start {cmd[0]}: {e}", "", 0.0
        try:
            rc = p.wait(timeout=timeout)
            msg = "" if rc == 0 else f"{what} failed with exit status {rc}"
        except subprocess.TimeoutExpired:
            msg = f"{what} timed out after {timeout:.0f} s (killed; raise --timeout?)"
            rc = None
        finally:
            if p.poll() is None:
                # SIGTERM to the leader first (mpirun and the gloo launcher stop and reap their
                # ranks), then SIGKILL to the whole session we created.
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    return msg == "", msg, text[-3000:], time.perf_counter() - t0


def build_mpi(a):
    exe = os.path.join(HERE, "results", "mpi_allreduce")
    src = os.path.join(HERE, "mpi_allreduce.c")
    if os.path.exists(exe) and os.path.getmtime(exe) >= os.path.getmtime(src):
        return exe
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    cmd = [a.mpicc, "-O2", "-o", exe, src]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        sys.exit(f"{a.mpicc} not found: run scripts/install-deps --bench (libopenmpi-dev, openmpi-bin)")
    except subprocess.TimeoutExpired:
        sys.exit(f"{' '.join(cmd)}: timed out")
    if r.returncode != 0:
        sys.exit(f"building the MPI benchmark failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    log(a, f"built {os.path.relpath(exe, ROOT)}")
    return exe


def build_probe(a):
    """The core-to-core probe (placement.py), built with --cc; None without it."""
    return placement.build_probe(a.cc, lambda msg: log(a, msg))


def probe(a):
    """The core-to-core round trip in ns now (None without the probe or when it fails)."""
    return placement.probe(a.probe_exe)


def mpi_mca(a):
    mca = dict(MPI_MCA)
    for kv in filter(None, a.mpi_mca.split(",") if a.mpi_mca else []):
        k, _, v = kv.partition("=")
        mca[k.strip()] = v.strip()
    return mca


def tool_cmd(a, tool, n, json_path, variant=None, span=None):
    lo, hi = span or (a.min_bytes, a.max_bytes)
    sweep = ["--min-bytes", str(lo), "--max-bytes", str(hi), "--iters", str(a.iters),
             "--warmup", str(a.warmup), "--check", "--json", json_path]
    if tool in ("dtrain", "dtrain-ref"):
        # in place, like MPI_IN_PLACE in mpi_allreduce.c and torch's all_reduce; --dtrain-buffers
        # shared: each rank's vector in memory every rank maps (all_reduce_shared, no staging)
        where = ["--shared"] if a.dtrain_buffers == "shared" else ["--inplace"]
        exe = a.dtrain if tool == "dtrain" else a.dtrain_ref
        return [exe, "bench", "collectives", "-n", str(n), "--op", "allreduce", "--dtype", "f32",
                "--algo", a.algo] + where + sweep
    if tool == "openmpi":
        mca = dict(mpi_mca(a))
        mca.update(variant or {})
        args = []
        for k, v in mca.items():
            args += ["--mca", k, v]
        return [a.mpirun] + MPI_BASE + mpi_binding(n, a.cores) + ["-np", str(n)] + args + [a.mpi_exe] + sweep
    if tool == "gloo":
        return [a.python, os.path.join(HERE, "gloo_allreduce.py"), "-n", str(n), "--op-timeout",
                str(int(a.timeout))] + sweep
    raise ValueError(tool)


def run_sweep(a, tool, n, variant=None, span=None):
    """One sweep of one tool over span (lo, hi) (default the whole sweep); returns (record or None,
    error message)."""
    label = tool if not variant else f"{tool} ({variant_name(variant)})"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{tool}.json")
        cmd = tool_cmd(a, tool, n, path, variant, span)
        before = probe(a)
        ok, msg, tail, wall = run(cmd, a.timeout, f"{label}, world {n}")
        after = probe(a)
        rt = "" if before is None or after is None else f" (core round trip {before:.0f}/{after:.0f} ns)"
        log(a, f"  [{wall:6.1f}s] {tool:8s} {'ok' if ok else 'FAILED'}{rt}: {' '.join(cmd)}")
        if not ok:
            return None, f"{msg}\n  command: {' '.join(cmd)}\n  output tail:\n{tail}"
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            return None, f"{label}, world {n}: wrote no readable JSON ({e})\n  command: {' '.join(cmd)}\n{tail}"
    problems = []
    if rec.get("tool") != ("dtrain" if tool == "dtrain-ref" else tool):
        problems.append(f"tool is {rec.get('tool')!r}")
    if rec.get("world") != n:
        problems.append(f"world is {rec.get('world')!r}")
    got = [r.get("bytes") for r in rec.get("rows", [])]
    if got != sizes(*(span or (a.min_bytes, a.max_bytes))):
        problems.append(f"sizes {got[:3]}..{got[-1:]} do not match the sweep")
    if problems:
        return None, f"{label}, world {n}: JSON: {'; '.join(problems)}"
    rec["wall_s"] = round(wall, 2)
    rec["core_round_trip_ns"] = [before, after]
    if tool == "openmpi":
        rec["mpirun"] = cmd[:cmd.index(a.mpi_exe)]
    return rec, ""


def variant_name(variant):
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "default"


def mpi_variants(a, n):
    """The mpirun --mca variants to run. 'best': when the ranks fit on the cores, busy-polling
    (mpi_yield_when_idle 0, Open MPI's default there) and yielding (1); oversubscribed, where
    busy-polling is 100-1000x slower, yielding with vader's CMA single copy (the default) and
    without (copy in/out). 'default': Open MPI's own choices (plus --mpi-mca)."""
    if a.mpi_settings == "default":
        return [{}]
    if n <= a.cores:
        return [{"mpi_yield_when_idle": "0"}, {"mpi_yield_when_idle": "1"}]
    return [{"mpi_yield_when_idle": "1", "btl_vader_single_copy_mechanism": "cma"},
            {"mpi_yield_when_idle": "1", "btl_vader_single_copy_mechanism": "none"}]


def run_tool(a, tool, n, repeat, span=None):
    """One repeat of one tool; for openmpi with several variants, per size the one with the lower p50."""
    if tool != "openmpi":
        return run_sweep(a, tool, n, span=span)
    variants = mpi_variants(a, n)
    if repeat % 2:
        variants = variants[::-1]  # alternate which variant goes first
    recs, errs = [], []
    for v in variants:
        rec, err = run_sweep(a, tool, n, v, span)
        if rec is None:
            errs.append(err)
        else:
            rec["variant"] = variant_name(v)
            recs.append(rec)
    if not recs:
        return None, "\n".join(errs)
    for e in errs:  # one variant failed: report it, use the others
        print(f"ERROR (using the other Open MPI variant): {e}", file=sys.stderr, flush=True)
    if len(recs) == 1:
        for row in recs[0]["rows"]:
            row["mpi_variant"] = recs[0]["variant"]
        return recs[0], ""
    merged = dict(recs[0])
    merged["variants"] = recs
    merged["rows"] = []
    for rows in zip(*(r["rows"] for r in recs)):
        best = min(range(len(rows)), key=lambda i: rows[i]["p50_us"])
        row = dict(rows[best])
        row["mpi_variant"] = recs[best]["variant"]
        row["wrong"] = max(int(r.get("wrong", 0)) for r in rows)
        merged["rows"].append(row)
    merged["memcpy_GBs"] = statistics.median(r["memcpy_GBs"] for r in recs)
    merged["wall_s"] = round(sum(r["wall_s"] for r in recs), 2)
    merged["core_round_trip_ns"] = [x for r in recs for x in r.get("core_round_trip_ns", [])]
    merged["variant"] = "best per size of " + " | ".join(r["variant"] for r in recs)
    return merged, ""


def merge_sizes(recs):
    """One record per tool and repeat from its runs over parts of the sweep (--interleave size:
    one per size; sweep: the one run)."""
    merged = dict(recs[0])
    merged["rows"] = [row for rec in recs for row in rec["rows"]]
    merged["memcpy_GBs"] = statistics.median(r["memcpy_GBs"] for r in recs if r.get("memcpy_GBs")) \
        if any(r.get("memcpy_GBs") for r in recs) else None
    merged["wall_s"] = round(sum(r["wall_s"] for r in recs), 2)
    merged["core_round_trip_ns"] = [x for r in recs for x in r.get("core_round_trip_ns", [])]
    merged["size_runs"] = len(recs)
    return merged


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s, digits, spread):
    if s is None:
        return "-"
    f = f"{{:.{digits}f}}"
    if not spread or s["n"] == 1:
        return f.format(s["median"])
    return f"{f.format(s['median'])} [{f.format(s['min'])}-{f.format(s['max'])}]"


def aggregate(a, runs):
    """runs[tool] = list of records (one per successful repeat) -> per size medians."""
    agg = {}
    for tool, recs in runs.items():
        rows = {}
        for b in sizes(a.min_bytes, a.max_bytes):
            rr = [next(r for r in rec["rows"] if r["bytes"] == b) for rec in recs]
            if not rr:
                continue
            algos = sorted({str(r.get("algo")) for r in rr})
            rows[b] = {"p50_us": summary([r["p50_us"] for r in rr]), "p99_us": summary([r["p99_us"] for r in rr]),
                       "busbw_GBs": summary([r["busbw_GBs"] for r in rr]),
                       "algbw_GBs": summary([r["algbw_GBs"] for r in rr]),
                       "busbw_per_memcpy": summary([r["busbw_GBs"] / rec["memcpy_GBs"] for r, rec in zip(rr, recs)
                                                    if rec.get("memcpy_GBs")]),
                       "wrong": max(int(r.get("wrong", 0)) for r in rr), "algo": "/".join(algos)}
        agg[tool] = {"rows": rows, "memcpy_GBs": summary([r.get("memcpy_GBs") for r in recs]), "n": len(recs)}
    return agg


def ratio_of(agg, tool, base, b, metric):
    """dtrain/baseline ratio of the medians: busbw (higher is better) or p50 (lower is better)."""
    try:
        d, o = agg[tool]["rows"][b], agg[base]["rows"][b]
    except KeyError:
        return None
    key = "busbw_GBs" if metric == "busbw" else "p50_us"
    if not d[key] or not o[key] or not o[key]["median"]:
        return None
    return d[key]["median"] / o[key]["median"]


def per_repeat_ratios(runs, tool, base, b, metric):
    """The same ratio within each repeat (tools ran back to back), for the min-max."""
    key = "busbw_GBs" if metric == "busbw" else "p50_us"
    out = []
    by_repeat = {ro["repeat"]: ro for ro in runs.get(base, [])}
    for rd in runs.get(tool, []):
        ro = by_repeat.get(rd["repeat"])
        if ro is None:
            continue
        x = next(r for r in rd["rows"] if r["bytes"] == b)[key]
        y = next(r for r in ro["rows"] if r["bytes"] == b)[key]
        if y:
            out.append(x / y)
    return out


def print_world(a, n, runs, agg):
    tools = [t for t in a.tools if t in agg and agg[t]["n"]]
    bases = [t for t in tools if t != "dtrain"] if "dtrain" in tools else []
    print()
    if not tools:
        print(f"all_reduce world {n}: no successful run")
        return
    mc = ", ".join(f"{t} {fmt(agg[t]['memcpy_GBs'], 2, a.spread)}" for t in tools)
    print(f"all_reduce f32 sum, world {n}: medians over {max((agg[t]['n'] for t in tools), default=0)} repeat(s), "
          f"iters {a.iters}, warmup {a.warmup}; memcpy GB/s: {mc}")
    if "dtrain" in tools:
        print("dtrain buffers: " + ("shared (all_reduce_shared on allocate_shared memory)"
                                    if a.dtrain_buffers == "shared" else "plain (the process's own memory)"))
    # busbw as a fraction of memcpy: dtrain's when it ran (the others' are in the JSON), else all
    frac_tools = ["dtrain"] if "dtrain" in tools else tools
    header = ["size"]
    for t in tools:
        header += [f"{t} p50_us", f"{t} busbw"] + ([f"{t} %memcpy"] if t in frac_tools else [])
    if "dtrain" in tools:
        header.insert(1, "dtrain algo")
    for b in bases:
        header.append(f"dtrain/{b}")
    table = [header]
    for b in sizes(a.min_bytes, a.max_bytes):
        row = [human(b)]
        if "dtrain" in tools:
            row.append(agg["dtrain"]["rows"][b]["algo"])
        for t in tools:
            r = agg[t]["rows"][b]
            frac = r["busbw_per_memcpy"]
            row += [fmt(r["p50_us"], 1, a.spread), fmt(r["busbw_GBs"], 3, a.spread)]
            if t in frac_tools:
                row.append(fmt(None if frac is None else {k: (v * 100 if k != "n" else v) for k, v in frac.items()},
                               1, a.spread))
        for base in bases:
            metric = "p50" if b <= 8 * KiB else "busbw"
            x = ratio_of(agg, "dtrain", base, b, metric)
            row.append("-" if x is None else f"{x:.2f} {'lat' if metric == 'p50' else 'bw'}")
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if bases:
        print("ratios: 'lat' = dtrain p50 / baseline p50 (<= 8 KiB, lower is better), "
              "'bw' = dtrain busbw / baseline busbw (higher is better); %memcpy = busbw / memcpy_GBs of the same run")
    if "openmpi" in tools:
        wins = {}
        for rec in runs["openmpi"]:
            for row in rec["rows"]:
                k = str(row.get("mpi_variant"))
                wins[k] = wins.get(k, 0) + 1
        print("openmpi settings that gave each size's p50 (sizes x repeats): " +
              "; ".join(f"{k}: {v}" for k, v in sorted(wins.items())))
    print_placement(runs, tools)
    for t in tools:
        for b, r in agg[t]["rows"].items():
            if r["wrong"]:
                msg = f"!!! WRONG RESULTS: {t}, world {n}, {human(b)}: {r['wrong']} wrong elements !!!"
                print(msg)
                print(msg, file=sys.stderr)


def print_placement(runs, tools):
    """Per tool, the core-to-core round trips measured around its runs, and how many runs met a
    far placement (a round trip over twice the fastest seen, or than placement.NEAR_NS when even
    that was slower: the host ran the CPUs far apart)."""
    trips = {t: [[x for x in rec.get("core_round_trip_ns", []) if x is not None] for rec in runs.get(t, [])]
             for t in tools}
    seen = [x for per in trips.values() for rec in per for x in rec]
    if not seen:
        return
    fast = min(seen)
    parts = []
    for t in tools:
        far = sum(1 for rec in trips[t] if placement.is_far(rec, fast))
        parts.append(f"{t} {far}/{len(trips[t])} [" + " ".join("/".join(f"{x:.0f}" for x in rec)
                                                             for rec in trips[t]) + "]")
    print(f"core-to-core round trip before/after each run, ns (bench/core_latency.c; runs over 2x "
          f"{placement.near_ns(fast):.0f} ns met a far placement and run slower): " + "; ".join(parts))


def check_targets(a, n, runs, agg):
    """Returns the target rows for this world size and prints them."""
    out = []
    if "dtrain" not in agg or not agg["dtrain"]["n"]:
        return out
    print(f"targets, world {n}:")
    for name, base, metric, lo, hi, op, value in TARGETS:
        if base not in agg or not agg[base]["n"]:
            print(f"  {name:40s} -     ({base} not run)")
            continue
        checked = [b for b in sizes(a.min_bytes, a.max_bytes) if lo <= b <= hi]
        if not checked:
            print(f"  {name:40s} -     (no size of the sweep in {human(lo)}..{human(hi)})")
            continue
        vals = {b: ratio_of(agg, "dtrain", base, b, metric) for b in checked}
        if any(v is None for v in vals.values()):
            print(f"  {name:40s} -     (missing data)")
            continue
        worst_b = min(vals, key=vals.get) if op == ">=" else max(vals, key=vals.get)
        worst = vals[worst_b]
        ok = worst >= value if op == ">=" else worst <= value
        rng = per_repeat_ratios(runs, "dtrain", base, worst_b, metric)
        rng_s = f", per-repeat {min(rng):.2f}-{max(rng):.2f}" if len(rng) > 1 else ""
        part = "" if (checked[0] == lo or lo == 0) and checked[-1] == hi else \
            f" [only {human(checked[0])}..{human(checked[-1])} in this sweep]"
        print(f"  {name:40s} {'ok  ' if ok else 'FAIL'}  worst {worst:.2f} at {human(worst_b)}{rng_s}{part}")
        out.append({"world": n, "target": name, "ok": ok, "worst_ratio": worst, "worst_bytes": worst_b,
                    "worst_per_repeat": rng, "ratios": {str(b): v for b, v in vals.items()}, "sizes_checked": checked})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=256 * MiB)
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (each tool)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (each tool)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interleave", choices=["size", "sweep"], default="size",
                   help="size: per repeat, every tool runs each size back to back (the tools of one size "
                   "run seconds apart); sweep: every tool runs its whole sweep in turn (fewer launches)")
    p.add_argument("--tools", default="dtrain,openmpi,gloo")
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "release", "dtrain"))
    p.add_argument("--dtrain-ref", default=None,
                   help="another dtrain binary (the build before a change) run as the tool dtrain-ref: "
                        "--tools dtrain,dtrain-ref prints new/old ratios")
    p.add_argument("--algo", default="auto", help="dtrain --algo")
    p.add_argument("--dtrain-buffers", choices=["plain", "shared"], default="plain",
                   help="plain: dtrain's all_reduce on the process's own memory, as the others; shared: "
                   "all_reduce_shared on Group::allocate_shared memory (how DDP's buckets can live; no "
                   "staging copies)")
    p.add_argument("--python", default="/usr/bin/python3", help="interpreter with PyTorch (gloo)")
    p.add_argument("--mpicc", default="mpicc")
    p.add_argument("--cc", default="cc", help="C compiler for the core-to-core probe (bench/core_latency.c)")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--mpi-mca", default="", help="extra/overriding mpirun --mca settings, e.g. "
                   "'mpi_yield_when_idle=0,btl_vader_single_copy_mechanism=none'")
    p.add_argument("--mpi-settings", choices=["best", "default"], default="best",
                   help="best: run Open MPI in two settings and keep each size's faster (N <= cores: "
                   "mpi_yield_when_idle 0 and 1; oversubscribed: yield with single copy cma and none); "
                   "default: Open MPI's own choices plus --mpi-mca")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores for --mpi-settings best (default: this process's CPU affinity, %(default)s)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for one tool's sweep")
    p.add_argument("--spread", action="store_true", help="show [min-max] over repeats in the table cells")
    p.add_argument("--out", default=os.path.join(HERE, "results", "collectives_compare.json"))
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    a.tools = [t for t in a.tools.split(",") if t]
    worlds = [int(w) for w in a.worlds.split(",") if w]
    bad = [t for t in a.tools if t not in ("dtrain", "dtrain-ref", "openmpi", "gloo")]
    if bad:
        p.error(f"unknown tools {bad} (dtrain, dtrain-ref, openmpi, gloo)")
    if "dtrain-ref" in a.tools and not (a.dtrain_ref and os.access(a.dtrain_ref, os.X_OK)):
        p.error("--tools dtrain-ref needs --dtrain-ref PATH (an executable dtrain)")
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes or a.min_bytes & (a.min_bytes - 1) or a.repeats < 1:
        p.error("need 4 <= min-bytes <= max-bytes, min-bytes a power of two, repeats >= 1")
    if "dtrain" in a.tools and not os.access(a.dtrain, os.X_OK):
        sys.exit(f"{a.dtrain}: not built (or pass --dtrain PATH, or --tools openmpi,gloo)")
    if "gloo" in a.tools and not os.access(a.python, os.X_OK):
        sys.exit(f"{a.python}: not found (the gloo side needs Debian's python3-torch: scripts/install-deps --bench)")
    a.mpi_exe = build_mpi(a) if "openmpi" in a.tools else None
    a.probe_exe = build_probe(a)

    results, errors, targets = {}, [], []
    t_start = time.perf_counter()
    for n in worlds:
        runs = {t: [] for t in a.tools}
        all_sizes = sizes(a.min_bytes, a.max_bytes)
        # --interleave size: one size at a time, every tool back to back, so that the tools of
        # one size run seconds apart (what the machine does changes from minute to minute);
        # sweep: every tool's whole sweep in turn.
        spans = [(b, b) for b in all_sizes] if a.interleave == "size" else [(a.min_bytes, a.max_bytes)]
        for r in range(a.repeats):
            log(a, f"world {n}, repeat {r + 1}/{a.repeats}" + (", size by size" if len(spans) > 1 else ""))
            per_tool = {t: [] for t in a.tools}
            for i, span in enumerate(spans):
                k = (r + i) % len(a.tools)  # rotate who goes first
                for tool in a.tools[k:] + a.tools[:k]:
                    rec, err = run_tool(a, tool, n, r, span)
                    if rec is None:
                        errors.append(err)
                        print(f"ERROR: {err}", file=sys.stderr, flush=True)
                        continue
                    per_tool[tool].append(rec)
            for tool, recs in per_tool.items():
                if len(recs) == len(spans):  # a tool with a failed size sits this repeat out
                    rec = merge_sizes(recs)
                    rec["repeat"] = r
                    runs[tool].append(rec)
        agg = aggregate(a, {t: v for t, v in runs.items() if v})
        print_world(a, n, runs, agg)
        targets += check_targets(a, n, runs, agg)
        results[str(n)] = {"runs": runs, "aggregate": {t: {"memcpy_GBs": v["memcpy_GBs"], "n": v["n"],
                                                           "rows": {str(b): r for b, r in v["rows"].items()}}
                                                       for t, v in agg.items()}}

    wrong = [(n, t, rec["repeat"], row["bytes"], row["wrong"]) for n, res in results.items()
             for t, recs in res["runs"].items() for rec in recs for row in rec["rows"] if row.get("wrong")]
    print()
    if wrong:
        print(f"!!! {len(wrong)} sweep rows had WRONG results (world, tool, repeat, bytes, wrong): {wrong[:10]}")
    if errors:
        print(f"!!! {len(errors)} run(s) FAILED; see the errors above (stderr)")
    if targets:
        print(f"targets: {sum(t['ok'] for t in targets)}/{len(targets)} met")
    mca = " ".join(f"--mca {k} {v}" for k, v in mpi_mca(a).items())
    print(f"openmpi: mpirun {' '.join(MPI_BASE)} --bind-to core (none when N > cores) -np N {mca}, settings {a.mpi_settings} "
          f"(cores {a.cores}); gloo: TCP loopback, 1 thread/process; "
          f"total {time.perf_counter() - t_start:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    cfg = {k: v for k, v in vars(a).items()}
    with open(a.out, "w") as f:
        json.dump({"config": cfg, "mpirun": {"base": MPI_BASE, "mca": mpi_mca(a)}, "env": ONE_THREAD,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "targets": targets, "errors": errors,
                   "wrong": wrong, "worlds": results}, f, indent=1)
    print(f"wrote {a.out}")
    sys.exit(1 if wrong or errors else 0)


if __name__ == "__main__":
    main()
