#!/usr/bin/python3
"""dtrain's data parallelism against PyTorch DistributedDataParallel (gloo), side by side in one run.

    /usr/bin/python3 bench/ddp_compare.py [--repeats 3] [--mlp-steps 200] [--gpt-steps 60]
                                          [--jobs mlp,gpt] [--bucket-sweep on|off] [--trace on|off]

Same models, data, AdamW and PER-RANK batch for both (mlp 64, gpt 16 per rank; the global batch
is per-rank x world), one thread per process, worlds 1 and 2. dtrain's multi-rank runs use --zero 1
(--zero to change): on one host its parameters are one copy in shared memory, same bits as --zero 0. World 1 is the plain single-process
trainer of both (dtrain --dp 1, torch_reference.py --dp 1: no process group, no DDP wrapper).
Throughput (samples/s for mlp, tokens/s for gpt) counts only the steps after a warm-up; each cell
is the median [min-max] over the repeats, and every repeat runs every configuration once, the
order reversed on odd repeats, so background load hits both tools alike.

Scaling efficiency E(2) = T(2) / (2 T(1)) (medians; per-repeat range in brackets). The bucket
sweep runs dtrain at world 2 with several --bucket-mb and reports its throughput, E(2) and the
overlap of its metrics, overlap = (T_compute + T_comm - T_step) / T_comm. Around every multi-rank run
bench/core_latency.c measures the core-to-core round trip (placement.py: where the host runs the
two vCPUs), and E(n) is also given separately for the runs that met a near and a far placement.
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

import compare_torch  # bench/, next to this script
import placement
from compare_torch import summary

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "GLOO_SOCKET_IFNAME": "lo"}
PER_RANK_BATCH = {"mlp": 64, "gpt": 16}
LR = {"mlp": "1e-3", "gpt": "3e-4"}  # as compare_torch.py
UNIT = {"mlp": "samples_per_s", "gpt": "tokens_per_s"}

# The issue's targets at world 2.
TARGETS = {
    "mlp": {"ratio": 2.5, "efficiency": 0.80},
    "gpt": {"ratio": 1.3, "efficiency": 0.90},
}


class RunError(Exception):
    pass


# ------------------------------------------------------------------------------------ processes

def child_env():
    e = dict(os.environ)
    e.update(ONE_THREAD)
    return e


def cpu_busy_s():
    """Seconds of CPU time used by everything on the machine so far (all cores, /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + (fields[7] if len(fields) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def run(cmd, timeout, log):
    """Runs cmd in its own session with a timeout (the whole session is killed on expiry).

    Returns (stdout, stderr, info) with info = wall_s, cpu_s (the child and the descendants it
    waited for), bg_cpu_s (CPU time of everything else on the machine meanwhile), wait4 peak RSS.
    Raises RunError on a timeout or a non-zero exit status."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        busy0, load0 = cpu_busy_s(), os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(), cwd=ROOT, start_new_session=True)
        timed_out, status, usage = False, None, None
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                break
            if time.perf_counter() - t0 > timeout:
                timed_out = True
                for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
                    end = time.perf_counter() + grace
                    while time.perf_counter() < end:
                        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                        if pid == p.pid:
                            break
                        time.sleep(0.05)
                    if pid == p.pid:
                        break
                if pid != p.pid:
                    _, status, usage = os.wait4(p.pid, 0)
                try:  # stragglers of the session (e.g. workers whose parent died first)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        busy1 = cpu_busy_s()
        rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    cpu = usage.ru_utime + usage.ru_stime
    info = {"wall_s": wall, "cpu_s": cpu, "wait4_peak_rss_bytes": usage.ru_maxrss * 1024, "loadavg_1m": load0,
            "bg_cpu_s": max(0.0, busy1 - busy0 - cpu) if busy0 is not None and busy1 is not None else None}
    if log:
        state = "TIMEOUT" if timed_out else ("ok" if rc == 0 else f"exit {rc}")
        print(f"  [{wall:6.1f}s {state}, bg {info['bg_cpu_s'] or 0:.1f} cpu-s] {' '.join(cmd)}",
              file=sys.stderr, flush=True)
    if timed_out:
        raise RunError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{tail(stdout, stderr)}")
    if rc != 0:
        raise RunError(f"exit status {rc}: {' '.join(cmd)}\n{tail(stdout, stderr)}")
    return stdout, stderr, info


def tail(stdout, stderr, n=1500):
    s = ""
    if stdout.strip():
        s += "--- stdout (tail):\n" + stdout[-n:].rstrip() + "\n"
    if stderr.strip():
        s += "--- stderr (tail):\n" + stderr[-n:].rstrip() + "\n"
    return s


def json_lines(text):
    recs = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
    return recs


# ------------------------------------------------------------------------------------- the jobs

def common_args(job, a, world, seed):
    """Arguments both programs understand, with the GLOBAL batch (per-rank batch x world)."""
    args = ["--model", job, "--batch-size", str(PER_RANK_BATCH[job] * world), "--optimizer", "adamw",
            "--lr", LR[job], "--steps", str(steps(job, a)), "--threads", "1", "--seed", str(seed)]
    if job == "mlp":
        args += ["--hidden", "1024,1024"]
    else:
        args += ["--layers", str(a.layers), "--heads", str(a.heads), "--width", str(a.width),
                 "--seq-len", str(a.seq_len), "--eval-batches", str(a.eval_batches)]
    return args


def steps(job, a):
    return a.mlp_steps if job == "mlp" else a.gpt_steps


def warmup(job, a):
    return max(1, min(a.mlp_warmup if job == "mlp" else a.gpt_warmup, steps(job, a) - 1))


def units_per_step(job, a, world):
    return PER_RANK_BATCH[job] * world * (a.seq_len if job == "gpt" else 1)


def run_dtrain(job, a, world, seed, bucket_mb, log, exe=None):
    W, N = warmup(job, a), steps(job, a)
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "metrics.jsonl")
        trace = os.path.join(d, "trace.json")
        cmd = [exe or a.dtrain, "train"] + common_args(job, a, world, seed) + [
            "--dp", str(world), "--progress=false", "--metrics", metrics, "--log-every", str(W)]
        if world > 1:
            cmd += ["--bucket-mb", f"{bucket_mb:g}", "--zero", str(a.zero)]
        if a.trace and world > 1:
            cmd += ["--trace", trace]
        stdout, stderr, info = run(cmd, a.timeout, log)
        try:
            with open(metrics) as f:
                recs = json_lines(f.read())
        except OSError as e:
            raise RunError(f"no metrics file ({e}): {' '.join(cmd)}\n{tail(stdout, stderr)}")
        spans = None
        if a.trace and world > 1:
            try:
                with open(trace) as f:
                    spans = trace_breakdown(json.load(f), W)
            except (OSError, ValueError) as e:
                spans = {"error": f"trace unreadable: {e}"}
    final = [r for r in recs if r.get("event") == "final"]
    at_w = [r for r in recs if r.get("event") == "log" and r.get("step") == W]
    if not final or not at_w:
        raise RunError(f"metrics lack the final record or the step-{W} log record: {' '.join(cmd)}\n"
                       f"{tail(stdout, stderr)}")
    rec = dict(final[-1])
    # Log records carry the cumulative rate units * steps / train time so far: recover the time of
    # the first W steps and count only the steps after them.
    U = units_per_step(job, a, world)
    rate_w = at_w[-1][UNIT[job]]
    t_w = W * U / rate_w
    timed = rec["train_time_s"] - t_w
    rec["warmup"], rec["timed_steps"], rec["timed_s"] = W, N - W, timed
    rec["rate_after_warmup"] = (N - W) * U / timed if timed > 0 else None
    rec["bucket_mb"] = bucket_mb if world > 1 else None
    rec["cmd"] = cmd
    rec.update(info)
    if spans is not None:
        rec["trace"] = spans
    return rec


def run_torch(job, a, world, seed, log):
    cmd = [a.python, os.path.join(HERE, "torch_reference.py")] + common_args(job, a, world, seed) + [
        "--dp", str(world), "--warmup", str(warmup(job, a)), "--bucket-mb", f"{a.torch_bucket_mb:g}",
        "--pg-timeout", str(max(30, int(a.timeout)))]
    stdout, stderr, info = run(cmd, a.timeout, log)
    finals = [r for r in json_lines(stdout) if r.get("event") == "final"]
    if not finals:
        raise RunError(f"no final JSON record: {' '.join(cmd)}\n{tail(stdout, stderr)}")
    rec = dict(finals[-1])
    rec["rate_after_warmup"] = rec.get("tokens_per_s_after_warmup" if job == "gpt" else "samples_per_s_after_warmup")
    rec["cmd"] = cmd
    rec.update(info)
    return rec


def trace_breakdown(trace, warm):
    """Per rank, medians over the steps after the warm-up (ms): compute (forward + backward),
    communication (sum of bucket all_reduces), synchronize (waiting for them after backward),
    optimizer, step (start of one forward to the next), and the overlap of the median step."""
    by_rank = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        step = (e.get("args") or {}).get("step")
        if step is None or step <= warm:
            continue
        r = by_rank.setdefault(e.get("pid", 0), {})
        s = r.setdefault(step, {"forward": 0.0, "backward": 0.0, "comm": 0.0, "synchronize": 0.0,
                                "optimizer": 0.0, "start": None, "buckets": 0, "first_bucket_start": None,
                                "backward_end": None})
        name, dur, ts = e.get("name", ""), e.get("dur", 0.0) / 1000.0, e.get("ts", 0.0) / 1000.0
        if name.startswith("bucket"):
            s["comm"] += dur
            s["buckets"] += 1
            s["first_bucket_start"] = ts if s["first_bucket_start"] is None else min(s["first_bucket_start"], ts)
        elif name in s:
            s[name] += dur
            if name == "forward":
                s["start"] = ts if s["start"] is None else min(s["start"], ts)
            if name == "backward":
                s["backward_end"] = ts + dur
    out = {}
    for rank, st in sorted(by_rank.items()):
        keys = sorted(k for k in st if st[k]["start"] is not None)
        step_ms = [st[b]["start"] - st[a]["start"] for a, b in zip(keys, keys[1:]) if b == a + 1]
        med = lambda k: statistics.median(st[s][k] for s in keys) if keys else None  # noqa: E731
        early = [st[s]["backward_end"] - st[s]["first_bucket_start"] for s in keys
                 if st[s]["backward_end"] is not None and st[s]["first_bucket_start"] is not None]
        comp = (med("forward") or 0) + (med("backward") or 0)
        comm, wait = med("comm"), med("synchronize")
        out[f"rank{rank}"] = {
            "steps": len(keys), "compute_ms": comp, "forward_ms": med("forward"), "backward_ms": med("backward"),
            "comm_ms": comm, "sync_wait_ms": wait, "optimizer_ms": med("optimizer"),
            "step_ms": statistics.median(step_ms) if step_ms else None,
            "buckets": med("buckets"),
            # > 0: the first bucket's all_reduce started this long before backward ended
            "first_bucket_before_backward_end_ms": statistics.median(early) if early else None,
            "overlap": (comm - wait) / comm if comm else None,
        }
    return out


# ---------------------------------------------------------------------------------------- stats

def fmt(s, digits):
    return compare_torch.fmt(s, digits, missing="FAILED")


def num(v, digits):
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(header, rows, left=1):
    table = [header] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if k < left else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------------------- main

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="steps of every job (overrides the two below)")
    p.add_argument("--mlp-steps", type=int, default=200)
    p.add_argument("--gpt-steps", type=int, default=60)
    p.add_argument("--mlp-warmup", type=int, default=20, help="mlp steps left out of the throughput")
    p.add_argument("--gpt-warmup", type=int, default=5, help="gpt steps left out of the throughput")
    p.add_argument("--jobs", default="mlp,gpt")
    p.add_argument("--worlds", default="1,2", help="world sizes; E(n) is computed against world 1")
    p.add_argument("--bucket-sweep", choices=["on", "off"], default="on")
    p.add_argument("--buckets", default="1,4,25", help="dtrain --bucket-mb values of the sweep")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="dtrain --bucket-mb of the main comparison")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=1,
                   help="dtrain --zero of its multi-rank runs. 1 (ZeRO-1) on one host keeps one copy of the "
                        "parameters in shared memory and reduces gradients in place; it gives the same parameters "
                        "as 0 bit for bit (tests/ddp_test.cpp)")
    p.add_argument("--torch-bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (PyTorch's default 25)")
    p.add_argument("--trace", choices=["on", "off"], default="off",
                   help="dtrain --trace on its multi-rank runs: adds a per-rank step breakdown after the warm-up")
    p.add_argument("--eval-batches", type=int, default=2, help="gpt validation batches after training (0 = all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r (the same for both)")
    p.add_argument("--quiet-bg", type=float, default=0.2,
                   help="a run is quiet when other processes used at most this many CPUs meanwhile")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one training run (then killed)")
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "release", "dtrain"))
    p.add_argument("--dtrain-ref", default=None,
                   help="another dtrain binary (the build before a change): its main runs join every repeat "
                        "and a table of new/old ratios is printed")
    p.add_argument("--python", default="/usr/bin/python3", help="interpreter with PyTorch")
    p.add_argument("--cc", default="cc", help="C compiler for the core-to-core probe (bench/core_latency.c)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "ddp_compare.json"))
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="run nothing: print the tables of a saved --out file (its configuration wins)")
    a = p.parse_args()
    saved = None
    if a.report:
        with open(a.report) as f:
            saved = json.load(f)
        keep = {"report": a.report, "quiet_bg": a.quiet_bg}
        for k, v in saved["config"].items():
            setattr(a, k, v)
        for k, v in keep.items():
            setattr(a, k, v)
        a.steps = None
        a.trace = "on" if a.trace is True else "off" if a.trace is False else a.trace
    if a.steps is not None:
        a.mlp_steps = a.gpt_steps = a.steps
    a.trace = a.trace == "on"
    jobs = [j for j in a.jobs.split(",") if j]
    worlds = sorted({int(w) for w in a.worlds.split(",") if w})
    sweep = sorted({float(b) for b in a.buckets.split(",") if b}) if a.bucket_sweep == "on" else []
    bad = [j for j in jobs if j not in PER_RANK_BATCH]
    if bad:
        sys.exit(f"unknown job(s) {bad}: use mlp,gpt")
    if 1 not in worlds:
        sys.exit("--worlds must include 1 (the baseline of E(n))")
    if min(a.mlp_steps, a.gpt_steps) < 2:
        sys.exit("need at least 2 steps (one of warm-up)")
    if not saved and not os.access(a.dtrain, os.X_OK):
        sys.exit(f"{a.dtrain}: not built (make build)")
    if not saved and a.dtrain_ref and not os.access(a.dtrain_ref, os.X_OK):
        sys.exit(f"--dtrain-ref {a.dtrain_ref}: not an executable")
    log = not a.quiet
    wmax = max(worlds)

    # One repeat's runs: (job, tool, world, bucket_mb). The sweep reuses the main run's bucket size.
    plan = []
    for j in jobs:
        for w in worlds:
            plan.append((j, "dtrain", w, a.bucket_mb))
            plan.append((j, "torch", w, None))
            if a.dtrain_ref:
                plan.append((j, "dtrain-ref", w, a.bucket_mb))
        if wmax > 1:
            plan += [(j, "dtrain", wmax, b) for b in sweep if b != a.bucket_mb]

    runs = {}  # key "job/tool/world/bucket" -> list over repeats (None for a failed run)
    errors = []
    t_start = time.time()
    # Multi-rank runs exchange data between the CPUs: each records where the host ran them.
    say = (lambda msg: print(msg, file=sys.stderr)) if log else None
    probe_exe = None if saved else placement.build_probe(a.cc, say)
    if saved:
        runs, errors = saved["runs"], saved["errors"]
    for r in range(a.repeats if not saved else 0):
        seed = a.seed + r
        order = plan if r % 2 == 0 else plan[::-1]
        if log:
            print(f"repeat {r + 1}/{a.repeats} (seed {seed}, {'forward' if r % 2 == 0 else 'reversed'} order, "
                  f"{len(order)} runs)", file=sys.stderr, flush=True)
        for job, tool, world, bucket in order:
            key = f"{job}/{tool}/{world}/{bucket:g}" if tool != "torch" and world > 1 else f"{job}/{tool}/{world}"
            try:
                before = placement.probe(probe_exe) if world > 1 else None
                if tool == "torch":
                    rec = run_torch(job, a, world, seed, log)
                else:
                    rec = run_dtrain(job, a, world, seed, bucket, log, a.dtrain_ref if tool == "dtrain-ref" else None)
                rec["repeat"] = r
                if world > 1:
                    rec["core_round_trip_ns"] = [x for x in (before, placement.probe(probe_exe)) if x is not None]
            except RunError as e:
                rec = None
                errors.append({"repeat": r, "run": key, "error": str(e)})
                print(f"!!! FAILED {key} (repeat {r + 1}): {e}", file=sys.stderr, flush=True)
            runs.setdefault(key, [None] * a.repeats)[r] = rec

    def bg_of(rec):
        return rec["bg_cpu_s"] / rec["wall_s"] if rec.get("bg_cpu_s") is not None and rec.get("wall_s") else None

    def quiet(rec):
        b = bg_of(rec)
        return b is not None and b <= a.quiet_bg

    def rates(key, only_quiet=False):
        return [rec["rate_after_warmup"] if rec and (not only_quiet or quiet(rec)) else None
                for rec in runs.get(key, [])]

    def dkey(job, w, bucket=None):
        return f"{job}/dtrain/{w}/{(bucket if bucket is not None else a.bucket_mb):g}" if w > 1 else f"{job}/dtrain/1"

    def tkey(job, w):
        return f"{job}/torch/{w}"

    def efficiency(k_n, k_1, n):
        """(E from medians, summary of per-repeat E from runs of the same repeat)."""
        s_n, s_1 = summary(rates(k_n)), summary(rates(k_1))
        e = s_n["median"] / (n * s_1["median"]) if s_n and s_1 else None
        per = [x / (n * y) for x, y in zip(rates(k_n), rates(k_1)) if x and y]
        return e, summary(per)

    # ----------------------------------------------------------------------------- main table
    rows, results = [], {}
    for j in jobs:
        unit = "samples/s" if j == "mlp" else "tokens/s"
        res = results.setdefault(j, {})
        for w in worlds:
            sd, st = summary(rates(dkey(j, w))), summary(rates(tkey(j, w)))
            ratio = sd["median"] / st["median"] if sd and st else None
            per = [x / y for x, y in zip(rates(dkey(j, w)), rates(tkey(j, w))) if x and y]
            res[f"world{w}"] = {"dtrain": sd, "torch": st, "ratio": ratio, "ratio_per_repeat": summary(per)}
            digits = 0
            bgd = summary([bg_of(rec) for rec in runs.get(dkey(j, w), []) if rec])
            bgt = summary([bg_of(rec) for rec in runs.get(tkey(j, w), []) if rec])
            res[f"world{w}"]["bg_cpus"] = {"dtrain": bgd, "torch": bgt}
            rows.append([j, str(w), unit, fmt(sd, digits), fmt(st, digits), num(ratio, 2),
                         fmt(summary(per), 2) if len(per) > 1 else "-",
                         f"{num(bgd and bgd['median'], 2)} / {num(bgt and bgt['median'], 2)}"])
            # Peak resident memory of rank 0 as each program reports it (VmHWM / getrusage).
            md = summary([rec["peak_rss_bytes"] / 2**20 for rec in runs.get(dkey(j, w), []) if rec])
            mt = summary([rec["peak_rss_bytes"] / 2**20 for rec in runs.get(tkey(j, w), []) if rec])
            res[f"world{w}"]["peak_rss_MiB_rank0"] = {"dtrain": md, "torch": mt}
            rows.append([j, str(w), "peak RSS MiB/rank", fmt(md, 0), fmt(mt, 0),
                         num(md["median"] / mt["median"] if md and mt else None, 2), "-", "-"])
            pd = {rec.get("params") for rec in runs.get(dkey(j, w), []) if rec}
            pt = {rec.get("params") for rec in runs.get(tkey(j, w), []) if rec}
            if pd and pt and pd != pt:
                print(f"WARNING: {j} world {w}: dtrain has {sorted(pd)} parameters, torch {sorted(pt)}",
                      file=sys.stderr)
        for w in worlds:
            if w == 1:
                continue
            ed, ped = efficiency(dkey(j, w), dkey(j, 1), w)
            et, pet = efficiency(tkey(j, w), tkey(j, 1), w)
            res[f"E{w}"] = {"dtrain": ed, "dtrain_per_repeat": ped, "torch": et, "torch_per_repeat": pet}
            cell = lambda e, pe: "FAILED" if e is None else (  # noqa: E731
                f"{e:.3f}" + (f" [{pe['min']:.3f}-{pe['max']:.3f}]" if pe and pe["n"] > 1 else ""))
            rows.append([j, f"E({w})", "T(n)/(n T(1))", cell(ed, ped), cell(et, pet),
                         num(ed / et if ed and et else None, 2), "-", "-"])

    def mean_of(key, field):
        vals = [rec.get(field) for rec in runs.get(key, []) if rec and rec.get(field) is not None]
        return statistics.mean(vals) if vals else None

    tv = next((rec.get("torch_version") for k, v in runs.items() if "/torch/" in k for rec in v if rec), "?")
    print()
    print(f"dtrain --dp N vs PyTorch {tv} DistributedDataParallel (gloo), one thread per process, "
          f"{a.repeats} repeat(s); mlp {a.mlp_steps} steps (warm-up {warmup('mlp', a)}) x 64/rank, "
          f"gpt {a.gpt_steps} steps (warm-up {warmup('gpt', a)}) x 16/rank; dtrain --bucket-mb {a.bucket_mb:g} --zero {a.zero}, "
          f"DDP bucket_cap_mb {a.torch_bucket_mb:g}")
    print_table(["job", "world", "metric", "dtrain median [min-max]", "torch median [min-max]", "dtrain/torch",
                 "ratio per repeat", "bg CPUs d / t"], rows, left=3)

    # ------------------------------------------------------------------ by placement
    trips = [x for recs in runs.values() for rec in recs if rec for x in rec.get("core_round_trip_ns", [])]
    if trips and wmax > 1:
        fastest = min(trips)
        print()
        print(f"E(n) by placement (bench/core_latency.c round trip between the first two CPUs before and after each "
              f"multi-rank run; near: both within 2x {placement.near_ns(fastest):.0f} ns; far: the host ran the "
              f"CPUs far apart for some of the run); against the median of every world-1 run")
        prow = []
        for j in jobs:
            for w in worlds:
                if w == 1:
                    continue
                for tool, k_n, k_1 in (("dtrain", dkey(j, w), dkey(j, 1)), ("torch", tkey(j, w), tkey(j, 1))):
                    one = summary(rates(k_1))
                    cells = {}
                    placed = [rec for rec in runs.get(k_n, [])
                              if rec and rec.get("core_round_trip_ns") and rec.get("rate_after_warmup")]
                    for where in ("near", "far"):
                        sel = [rec for rec in placed
                               if placement.is_far(rec["core_round_trip_ns"], fastest) == (where == "far")]
                        e = (statistics.median(rec["rate_after_warmup"] for rec in sel) / (w * one["median"])
                             if sel and one else None)
                        cells[where] = {"E": e, "runs": len(sel),
                                        "round_trip_ns": [max(rec["core_round_trip_ns"]) for rec in sel]}
                    results[j].setdefault(f"E{w}_by_placement", {})[tool] = cells
                    prow.append([j, f"E({w})", tool] + [
                        f"{num(cells[x]['E'], 3)} ({cells[x]['runs']} runs"
                        + (f", {statistics.median(cells[x]['round_trip_ns']):.0f} ns)" if cells[x]["round_trip_ns"] else ")")
                        for x in ("near", "far")])
        print_table(["job", "E", "tool", "near", "far"], prow, left=3)

    # ------------------------------------------------------- this build against --dtrain-ref
    if a.dtrain_ref:
        def rkey(job, w):
            return f"{job}/dtrain-ref/{w}/{a.bucket_mb:g}" if w > 1 else f"{job}/dtrain-ref/1"
        ref_rows = []
        for j in jobs:
            for w in worlds:
                sn, so = summary(rates(dkey(j, w))), summary(rates(rkey(j, w)))
                per = [x / y for x, y in zip(rates(dkey(j, w)), rates(rkey(j, w))) if x and y]
                ratio = sn["median"] / so["median"] if sn and so else None
                results[j].setdefault(f"world{w}", {})["vs_ref"] = {"new": sn, "ref": so, "ratio": ratio,
                                                                   "ratio_per_repeat": summary(per)}
                ref_rows.append([j, str(w), fmt(sn, 0), fmt(so, 0), num(ratio, 3),
                                 fmt(summary(per), 3) if len(per) > 1 else "-"])
        print()
        print(f"this build ({a.dtrain}) against --dtrain-ref {a.dtrain_ref}, same runs interleaved")
        print_table(["job", "world", "new median [min-max]", "ref median [min-max]", "new/ref", "ratio per repeat"],
                    ref_rows, left=1)

    # ---------------------------------------------------------------------------- bucket sweep
    sweep_rows = []
    if sweep and wmax > 1:
        print()
        print(f"dtrain bucket sweep at world {wmax} (rates after warm-up; overlap, compute/comm/wait from "
              f"dtrain's metrics = rank 0, whole run, per step)")
        table = []
        for j in jobs:
            for b in sorted(set(sweep) | {a.bucket_mb}):
                k = dkey(j, wmax, b)
                if k not in runs:
                    continue
                s = summary(rates(k))
                e, pe = efficiency(k, dkey(j, 1), wmax)
                recs = [rec for rec in runs[k] if rec]
                n = recs[0]["steps"] if recs else 1
                per_step = lambda f: mean_of(k, f) * 1000 / n if mean_of(k, f) is not None else None  # noqa: E731
                ov = summary([rec.get("overlap") for rec in recs])
                row = {"job": j, "bucket_mb": b, "buckets": mean_of(k, "buckets"), "rate": s, "E": e,
                       "E_per_repeat": pe, "overlap": ov, "compute_ms_per_step": per_step("compute_s"),
                       "comm_ms_per_step": per_step("comm_s"), "sync_wait_ms_per_step": per_step("sync_wait_s"),
                       "train_ms_per_step": per_step("train_time_s")}
                sweep_rows.append(row)
                table.append([j, f"{b:g}", num(row["buckets"], 0), fmt(s, 0), num(e, 3), fmt(ov, 3),
                              num(row["train_ms_per_step"], 1), num(row["compute_ms_per_step"], 1),
                              num(row["comm_ms_per_step"], 1), num(row["sync_wait_ms_per_step"], 1)])
        print_table(["job", "bucket_mb", "buckets", "rate median [min-max]", f"E({wmax})", "overlap median [min-max]",
                     "step ms", "compute ms", "comm ms", "wait ms"], table, left=1)

    # -------------------------------------------------------- where dtrain's step time goes
    print()
    print("dtrain step breakdown (ms per step, mean over repeats; world 1 = train_time/steps; multi-rank from "
          "metrics: compute = batch+forward+backward, comm = bucket all_reduce time, wait = synchronize after "
          "backward, rest = optimizer etc.)")
    brk = []
    for j in jobs:
        k1 = dkey(j, 1)
        recs1 = [rec for rec in runs.get(k1, []) if rec]
        one = mean_of(k1, "timed_s") * 1000 / recs1[0]["timed_steps"] if recs1 else None
        brk.append([j, "1", "-", num(one, 1), "-", "-", "-", "-", "-"])
        for w in worlds:
            if w == 1:
                continue
            k = dkey(j, w)
            recs = [rec for rec in runs.get(k, []) if rec]
            if not recs:
                continue
            n = recs[0]["steps"]
            f = lambda fld: mean_of(k, fld) * 1000 / n if mean_of(k, fld) is not None else None  # noqa: E731
            step = mean_of(k, "timed_s") * 1000 / recs[0]["timed_steps"]
            comp, comm, wait, tot = f("compute_s"), f("comm_s"), f("sync_wait_s"), f("train_time_s")
            rest = tot - comp - wait if None not in (tot, comp, wait) else None
            brk.append([j, str(w), f"{a.bucket_mb:g}", num(step, 1), num(comp, 1), num(comm, 1), num(wait, 1),
                        num(rest, 1), num(comp / one if comp and one else None, 2)])
    print_table(["job", "world", "bucket_mb", "step (after warm-up)", "compute", "comm", "wait", "rest",
                 "compute / 1-rank step"], brk, left=1)
    if a.trace:
        print()
        print("dtrain trace, per rank, medians over the steps after the warm-up (ms)")
        trows = []
        for k, recs in runs.items():
            for rec in recs:
                if not rec or not isinstance(rec.get("trace"), dict):
                    continue
                for rk, t in rec["trace"].items():
                    if "error" in t if isinstance(t, dict) else True:
                        continue
                    trows.append([k, str(rec["repeat"] + 1), rk, num(t["step_ms"], 1), num(t["forward_ms"], 1),
                                  num(t["backward_ms"], 1), num(t["comm_ms"], 1), num(t["sync_wait_ms"], 1),
                                  num(t["optimizer_ms"], 1), num(t["first_bucket_before_backward_end_ms"], 1),
                                  num(t["overlap"], 2)])
        print_table(["run", "repeat", "rank", "step", "forward", "backward", "comm", "wait", "optimizer",
                     "1st bucket before bwd end", "overlap"], trows, left=3)

    # ------------------------------------------------------------------------------ background
    bg = []
    for k, recs in runs.items():
        for rec in recs:
            if rec and rec.get("bg_cpu_s") is not None and rec.get("wall_s"):
                bg.append(rec["bg_cpu_s"] / rec["wall_s"])
    if bg:
        print()
        print(f"background load while runs ran (CPU-seconds of other processes per second, {os.cpu_count()} "
              f"CPUs): median {statistics.median(bg):.2f}, max {max(bg):.2f}"
              + ("  <- other work competed for the cores; scaling numbers are pessimistic" if max(bg) > 0.3 else ""))

    # ---------------------------------------------------------------------------------- targets
    print()
    print(f"targets (world {wmax}):")
    checks, quiet_checks = [], []
    for j in jobs:
        if wmax == 1:
            break
        tgt = TARGETS[j]
        res = results[j]
        ratio, e = res[f"world{wmax}"]["ratio"], res.get(f"E{wmax}", {}).get("dtrain")
        unit = "samples/s" if j == "mlp" else "tokens/s"
        for name, val, goal in ((f"{j} dtrain/torch {unit} at world {wmax}", ratio, tgt["ratio"]),
                                (f"{j} dtrain E({wmax})", e, tgt["efficiency"])):
            ok = None if val is None else val >= goal
            checks.append({"check": name, "value": val, "target": goal, "ok": ok})
            print(f"  {name:<42} {num(val, 3):>7}  >= {goal:<4}  "
                  f"{'ok' if ok else 'MISSED' if ok is not None else 'FAILED (no data)'}")
        # The same from the quiet runs only (little CPU used by other processes meanwhile).
        qd2, qt2 = summary(rates(dkey(j, wmax), True)), summary(rates(tkey(j, wmax), True))
        qd1 = summary(rates(dkey(j, 1), True))
        q_ratio = qd2["median"] / qt2["median"] if qd2 and qt2 else None
        q_e = qd2["median"] / (wmax * qd1["median"]) if qd2 and qd1 else None
        n = lambda x: x["n"] if x else 0  # noqa: E731
        quiet_checks.append({"job": j, "ratio": q_ratio, "E": q_e, "runs_dtrain_world1": n(qd1),
                             "runs_dtrain": n(qd2), "runs_torch": n(qt2)})
        print(f"    quiet runs only (bg <= {a.quiet_bg:g}): dtrain/torch {num(q_ratio, 3)} "
              f"({n(qd2)} dtrain, {n(qt2)} torch runs), E({wmax}) {num(q_e, 3)} ({n(qd1)} world-1 runs)")
    if errors:
        print()
        print(f"{len(errors)} run(s) FAILED:")
        for e in errors:
            print(f"  repeat {e['repeat'] + 1} {e['run']}: {e['error'].splitlines()[0]}")

    if saved:
        sys.exit(1 if errors else 0)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "env": ONE_THREAD, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "elapsed_s": time.time() - t_start, "cpus": os.cpu_count(), "per_rank_batch": PER_RANK_BATCH,
                   "lr": LR, "targets": TARGETS, "results": results, "bucket_sweep": sweep_rows, "checks": checks,
                   "quiet_checks": quiet_checks,
                   "errors": errors, "runs": runs}, f, indent=1)
    print(f"wrote {a.out}")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
