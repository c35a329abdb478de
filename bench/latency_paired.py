#!/usr/bin/python3
"""Small-message all_reduce latency, dtrain against Open MPI, measured in the same processes.

    /usr/bin/python3 bench/latency_paired.py [--worlds 2,4] [--max-bytes 8K] [--repeats 5]

Runs build/release/paired_allreduce (bench/paired_allreduce.cpp) under mpirun: every rank
times dtrain's all_reduce and MPI_Allreduce iteration by iteration in alternation (f32 sum, in
place, each after its own library's barrier, refilled untimed, every result checked). Why: on a
virtual machine the host moves the two vCPUs between cores that share a cache and cores far
apart from one second to the next, and a message between far cores takes 4-5x longer; separate
runs of the two libraries, even back to back, meet different placements, and a median over a
few runs falls whichever way most of them fell (bench/README.md, "Placement").

Per repeat, Open MPI runs in the settings of bench/collectives_compare.py --mpi-settings best
(ranks <= cores: mpi_yield_when_idle 0 and 1; oversubscribed: yield, with and without CMA
single copy), one paired run each; a size's p50 for each library is the lower of those runs.
Prints per world size the medians over the repeats, the dtrain/Open MPI ratio, its range over
the repeats, and the target (p50 at every size no worse than Open MPI's); writes JSON (--out).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from collectives_compare import MPI_BASE, MPI_MCA, human, mpi_binding, mpi_variants, parse_bytes  # noqa: E402


def run_paired(a, n, variant):
    """One paired run; returns ({bytes: row}, command) or raises RuntimeError naming the command."""
    store = tempfile.mkdtemp(prefix="paired-store-")
    try:
        mca = dict(MPI_MCA)
        mca.update(variant)
        cmd = [a.mpirun] + MPI_BASE + mpi_binding(n, a.cores) + ["-np", str(n)]
        for k, v in mca.items():
            cmd += ["--mca", k, v]
        # The ranks are bound to one core each; dtrain's shm transport is told how many the job
        # has, as `dtrain launch` does, so that it knows whether the ranks outnumber the cores.
        cmd += ["-x", f"DTRAIN_JOB_CPUS={a.cores}", a.exe, "--store", store, "--min-bytes", str(a.min_bytes),
                "--max-bytes", str(a.max_bytes), "--iters", str(a.iters), "--warmup", str(a.warmup)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {a.timeout:.0f} s: {' '.join(cmd)}")
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-2000:]}")
        rows = {}
        for line in r.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
                rows[row["bytes"]] = row
        want = []
        b = a.min_bytes
        while b <= a.max_bytes:
            want.append(b)
            b *= 2
        if sorted(rows) != want:
            raise RuntimeError(f"sizes {sorted(rows)} do not match {want}: {' '.join(cmd)}")
        return rows, cmd
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=8 * 1024)
    p.add_argument("--iters", type=int, default=2000, help="timed rounds per size (each library once per round)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--exe", default=os.path.join(ROOT, "build", "release", "paired_allreduce"))
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--mpi-settings", choices=["best", "default"], default="best")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(HERE, "results", "latency_paired.json"))
    a = p.parse_args()
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes or a.min_bytes & (a.min_bytes - 1) or a.repeats < 1:
        p.error("need 4 <= min-bytes <= max-bytes, min-bytes a power of two, repeats >= 1")
    if a.max_bytes > 64 * 1024:
        # Alternating the libraries evicts each one's buffers and staging memory between its own
        # iterations: past the caches that measures something else than back-to-back calls
        # (2 ranks, 4 MiB: dtrain 3.9-5.7 GB/s here against 9.4-10.1 on its own).
        p.error("--max-bytes is at most 64K: for bandwidth use bench/collectives_compare.py")
    if not os.access(a.exe, os.X_OK):
        sys.exit(f"{a.exe}: not built (cmake builds it when Open MPI is installed: scripts/install-deps)")
    t0 = time.perf_counter()
    results, verdicts, errors, wrong = {}, [], [], {"dtrain": 0, "openmpi": 0}
    for n in [int(w) for w in a.worlds.split(",") if w]:
        repeats = []
        for r in range(a.repeats):
            variants = mpi_variants(a, n)
            if r % 2:
                variants = variants[::-1]
            per_variant = []
            for v in variants:
                try:
                    rows, cmd = run_paired(a, n, v)
                except RuntimeError as e:
                    errors.append(str(e))
                    print(f"ERROR: world {n}, repeat {r + 1}: {e}", file=sys.stderr, flush=True)
                    continue
                print(f"world {n}, repeat {r + 1}/{a.repeats}, {','.join(f'{k}={x}' for k, x in v.items()) or 'defaults'}: "
                      + " ".join(f"{human(b)} {row['dtrain_p50_us']:.2f}/{row['openmpi_p50_us']:.2f}"
                                 for b, row in sorted(rows.items())), flush=True)
                per_variant.append({"mca": v, "rows": rows, "cmd": cmd})
                for row in rows.values():
                    for t in ("dtrain", "openmpi"):
                        wrong[t] += row[f"{t}_wrong"]
            if not per_variant:
                continue  # every run of this repeat failed (reported above)
            best = {}
            for b in per_variant[0]["rows"]:
                best[b] = {t: min(pv["rows"][b][f"{t}_p50_us"] for pv in per_variant) for t in ("dtrain", "openmpi")}
            repeats.append({"variants": per_variant, "best": best})
        if not repeats:
            print(f"\nall_reduce world {n}: no successful run")
            continue
        print(f"\nall_reduce f32 sum, world {n}: p50 in us, medians over {len(repeats)} repeats "
              f"(each the lower of the runs in Open MPI's settings), both timed in the same processes")
        print(f"{'size':>7s}  {'dtrain':>7s}  {'openmpi':>7s}  {'ratio':>6s}  per repeat")
        table, worst = {}, None
        for b in sorted(repeats[0]["best"]):
            d = statistics.median(rep["best"][b]["dtrain"] for rep in repeats)
            o = statistics.median(rep["best"][b]["openmpi"] for rep in repeats)
            per = [rep["best"][b]["dtrain"] / rep["best"][b]["openmpi"] for rep in repeats]
            table[str(b)] = {"dtrain_p50_us": d, "openmpi_p50_us": o, "ratio": d / o, "per_repeat": per}
            if worst is None or d / o > worst[0]:
                worst = (d / o, b, per)
            print(f"{human(b):>7s}  {d:7.2f}  {o:7.2f}  {d / o:6.2f}  {min(per):.2f}-{max(per):.2f}")
        ok = worst[0] <= 1.0
        print(f"target, world {n}: p50 <= {human(a.max_bytes)} no worse than openmpi: {'ok' if ok else 'FAIL'}, "
              f"worst {worst[0]:.2f} at {human(worst[1])} (per repeat {min(worst[2]):.2f}-{max(worst[2]):.2f})\n")
        verdicts.append({"world": n, "ok": ok, "worst_ratio": worst[0], "worst_bytes": worst[1]})
        results[str(n)] = {"repeats": repeats, "table": table}
    for t, w in wrong.items():
        if w:
            print(f"!!! {t}: {w} WRONG result elements !!!")
    if errors:
        print(f"!!! {len(errors)} run(s) FAILED; see the errors above (stderr)")
    print(f"targets: {sum(v['ok'] for v in verdicts)}/{len(verdicts)} met; total {time.perf_counter() - t0:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "targets": verdicts,
                   "wrong": wrong, "errors": errors, "worlds": results}, f, indent=1)
    print(f"wrote {a.out}")
    # Non-zero for wrong results or failed runs; a missed target is a finding, printed above.
    sys.exit(1 if any(wrong.values()) or errors else 0)


if __name__ == "__main__":
    main()
