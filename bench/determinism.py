#!/usr/bin/python3
"""--deterministic and --audit (docs/determinism.md): the digest table, the audit's catch rate and
the cost, side by side with the settings of bench/ddp_compare.py.

    /usr/bin/python3 bench/determinism.py [--only table,flips,elastic,mpi,netns,cost] [--repeats 3]
                                          [--mlp-steps 60] [--gpt-steps 20] [--flips 10]
                                          [--before OLD_BUILD/dtrain] [--audit-every 100]
                                          [--dp 2,4] [--models mlp,gpt]

table  the params digest of the MLP (784-1024-1024-10) and the GPT (4 x 128, T 128) with
       --deterministic on every layout of one global batch and micro-batch: --dp 1,2,3,4,6,8 x
       the matching --accumulate (dp x accumulate = 24), ZeRO 0/1/2, the GPT also --pp 2 and 4
       (and dp 2 x pp 2), TCP instead of shared memory, a checkpoint resumed in another layout,
       and an elastic run that loses a worker (dp 4 -> 3; kill fault, --min-workers). Every
       digest must equal one process's: exit 1 otherwise.
flips  --flips runs with DTRAIN_FAULT=bitflip at different ranks and steps, --audit 1: each must
       stop, naming the rank, the step and the tensor the fault flipped.
cost   throughput with and without --deterministic (and with --audit K, --audit-every), ddp_compare.py's jobs:
       the same models, AdamW, per-rank batch 64 (mlp) / 16 (gpt), one thread per process,
       --zero 1, worlds 2 and 4; every repeat runs every configuration once, alternating the
       order, so background load hits all alike. Cell: median samples/s (tokens/s) and the
       ratio to the plain run; the issue's limits: 5% (gpt), 10% (mlp), audit 2%. --before PATH
       adds a --deterministic run of another build (e.g. main's) to every repeat.
elastic  four node agents (dtrain launch --nnodes 3:4, one worker each): one leaves while the job
       runs and comes back; the digest must be the unchanged run's.
mpi    the table's MLP job under `mpirun -np 4 dtrain train --backend mpi` (if built with MPI).
netns  the MLP job on 2 namespaced hosts, 2 processes each (scripts/netns-cluster; root).
Results: bench/results/determinism.json.
"""
import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTRAIN = os.path.join(ROOT, "build", "release", "dtrain")
CORPUS = "/usr/share/games/fortunes"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

MLP = "--model mlp --batch-size 48 --steps 4 --lr 1e-3"
GPT = f"--model gpt --data text:{CORPUS} --batch-size 24 --steps 2"
DP_ACC = [(1, 24), (2, 12), (3, 8), (4, 6), (6, 4), (8, 3)]


def env(extra=None):
    e = dict(os.environ)
    e.update(ONE_THREAD)
    e.pop("DTRAIN_FAULT", None)
    if extra:
        e.update(extra)
    return e


def run(args, tmp, name, extra_env=None, timeout=900, prefix=None, check=True, binary=DTRAIN):
    """Runs dtrain train ARGS with --metrics; returns (final record or None, output)."""
    metrics = os.path.join(tmp, name + ".jsonl")
    cmd = (prefix or []) + [binary, "train"] + args.split() + ["--progress=false", "--metrics", metrics]
    p = subprocess.run(cmd, env=env(extra_env), capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        if check:
            print(f"FAILED ({p.returncode}): {' '.join(cmd)}\n{out[-3000:]}", file=sys.stderr)
        return None, out
    with open(metrics) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[-1], out


def digest_of(record):
    return record["params_digest"] if record else "FAILED"


# ------------------------------------------------------------------------------------- table

def table(tmp, results):
    rows = []
    ok = True
    for model, base in (("mlp", MLP), ("gpt", GPT)):
        layouts = [f"--dp {dp} --accumulate {acc}" + (f" --zero {z}" if z else "")
                   for dp, acc in DP_ACC for z in ((0, 1, 2) if dp > 1 else (0,))]
        layouts.append("--dp 3 --accumulate 8 --backend tcp")
        if model == "gpt":
            layouts += ["--pp 2 --micro-batches 24", "--pp 4 --micro-batches 24 --schedule gpipe",
                        "--dp 2 --pp 2 --micro-batches 12", "--dp 2 --pp 2 --micro-batches 6 --accumulate 2 --zero 1"]
        ref = None
        for i, layout in enumerate(layouts):
            rec, _ = run(f"{base} --deterministic {layout}", tmp, f"{model}{i}")
            d = digest_of(rec)
            ref = ref or d
            rows.append({"model": model, "layout": layout, "digest": d, "same": d == ref})
            ok &= d == ref
            print(f"{model:4} {layout:58} {d[:16]}  {'same' if d == ref else 'DIFFERENT'}", flush=True)
        # Without --deterministic the layouts differ (the problem the option solves).
        plain = [digest_of(run(f"{base} {layout}", tmp, f"{model}plain{i}")[0])
                 for i, layout in enumerate(["--dp 2 --accumulate 12", "--dp 4 --accumulate 6"])]
        print(f"{model:4} without --deterministic, dp 2 x 12 vs dp 4 x 6: "
              f"{'same' if plain[0] == plain[1] else 'different'} ({plain[0][:16]}, {plain[1][:16]})", flush=True)
        # Resume: dp 2 writes a checkpoint at the half, dp 3 (ZeRO 1) finishes it.
        steps = int(base.split("--steps ")[1].split()[0])
        ck = os.path.join(tmp, model + "-ck")
        first = base.replace(f"--steps {steps}", f"--steps {steps // 2}")
        run(f"{first} --deterministic --dp 2 --accumulate 12 --checkpoint-dir {ck} --checkpoint-every 1", tmp,
            model + "-first")
        rec, _ = run(f"{base} --deterministic --dp 3 --accumulate 8 --zero 1 --checkpoint-dir {ck}", tmp,
                     model + "-resumed")
        d = digest_of(rec)
        rows.append({"model": model, "layout": "dp 2 x 12, resumed as dp 3 x 8 zero 1", "digest": d, "same": d == ref})
        ok &= d == ref
        print(f"{model:4} {'resumed: dp 2 x 12 -> dp 3 x 8 zero 1':58} {d[:16]}  {'same' if d == ref else 'DIFFERENT'}",
              flush=True)
        # Elastic: rank 3 dies on every start from step 2; the job goes on as 3 replicas x 8.
        el = os.path.join(tmp, model + "-el")
        rec, out = run(f"{base} --deterministic --dp 4 --accumulate 6 --checkpoint-dir {el} --checkpoint-every 1 "
                       "--max-restarts 3 --min-workers 2", tmp, model + "-elastic",
                       extra_env={"DTRAIN_FAULT": "kill:rank=3:step=2:attempt=any"})
        d = digest_of(rec)
        shrunk = "--accumulate 8 instead of 6" in out
        rows.append({"model": model, "layout": "elastic dp 4 x 6 -> 3 x 8", "digest": d, "same": d == ref,
                     "shrunk": shrunk})
        ok &= d == ref and shrunk
        print(f"{model:4} {'elastic: dp 4 x 6 -> 3 x 8 (a worker lost)':58} {d[:16]}  "
              f"{'same' if d == ref else 'DIFFERENT'}{'' if shrunk else ' (did not shrink)'}", flush=True)
    results["table"] = rows
    return ok


# ------------------------------------------------------------------------------------- flips

def flips(tmp, results, count):
    base = "--model mlp --hidden 256 --batch-size 24 --steps 6 --dp 4 --accumulate 2 --deterministic --audit 1"
    plan = [(r, s) for s in range(1, 7) for r in range(4)]
    plan = plan[:: max(1, len(plan) // count)][:count]
    caught = 0
    rows = []
    for rank, step in plan:
        _, out = run(base, tmp, f"flip{rank}-{step}", extra_env={"DTRAIN_FAULT": f"bitflip:rank={rank}:step={step}"},
                     check=False)
        marker = "of the gradient of '"
        at = out.find(marker)
        tensor = out[at + len(marker):out.find("'", at + len(marker))] if at >= 0 else "?"
        named = f"--audit: at step {step} the gradient of '{tensor}' that rank {rank} computed" in out
        caught += named
        rows.append({"rank": rank, "step": step, "tensor": tensor, "caught_and_named": named})
        print(f"bitflip rank {rank} step {step} ({tensor}): {'caught and named' if named else 'MISSED'}", flush=True)
    print(f"audit caught {caught} of {len(plan)} flips", flush=True)
    results["flips"] = {"caught": caught, "injected": len(plan), "runs": rows}
    return caught == len(plan)


# -------------------------------------------------------------------------------------- cost

def cost(tmp, results, repeats, mlp_steps, gpt_steps, before=None, audit_every=100, worlds=(2, 4), models=("mlp", "gpt")):
    jobs = {
        "mlp": f"--model mlp --optimizer adamw --lr 1e-3 --steps {mlp_steps}",
        "gpt": f"--model gpt --data text:{CORPUS} --optimizer adamw --lr 3e-4 --steps {gpt_steps}",
    }
    jobs = {m: j for m, j in jobs.items() if m in models}
    per_rank = {"mlp": 64, "gpt": 16}
    unit = {"mlp": "samples_per_s", "gpt": "tokens_per_s"}
    audit = f"audit{audit_every}"
    variants = {"plain": "", "deterministic": "--deterministic"}
    if audit_every > 0:  # 0: no --audit variant
        variants[audit] = f"--deterministic --audit {audit_every}"
    steps = {"mlp": mlp_steps, "gpt": gpt_steps}
    if before:
        variants["before"] = "--deterministic"  # run by the --before binary
    cells = {}
    for rep in range(repeats):
        order = [(m, w, v) for m in jobs for w in worlds for v in variants]
        if rep % 2:
            order.reverse()
        for model, world, variant in order:
            args = f"{jobs[model]} --dp {world} --zero 1 --batch-size {per_rank[model] * world} {variants[variant]}"
            rec, _ = run(args, tmp, f"cost-{model}-{world}-{variant}",
                         binary=before if variant == "before" else DTRAIN)
            if rec:
                cells.setdefault((model, world, variant), []).append(rec[unit[model]])
    rows = []
    limit = {"mlp": 0.10, "gpt": 0.05}
    ok = True
    for model in jobs:
        for world in worlds:
            plain = statistics.median(cells.get((model, world, "plain"), [0]))
            for variant in [v for v in variants if v != "plain"]:
                v = statistics.median(cells.get((model, world, variant), [0]))
                slower = 1 - v / plain if plain else float("nan")
                rows.append({"model": model, "world": world, "variant": variant, "plain": plain, "value": v,
                             "slower": slower})
                note = ""
                if variant == audit:
                    # The audit's own cost, against --deterministic alone; it grows as 1/K, so at
                    # K = 100 it is (K / 100) of the cost at K.
                    det = statistics.median(cells.get((model, world, "deterministic"), [0]))
                    own = 1 - v / det if det else float("nan")
                    audits = steps[model] // audit_every
                    note = (f" ({audits} audits, {own:+.1%} against --deterministic; at --audit 100: "
                            f"{own * audit_every / 100:+.1%})" if audits else
                            " (no audit ran: fewer steps than --audit-every)")
                print(f"{model} dp {world} {variant:13} {v:12.1f} vs {plain:12.1f} {unit[model]}: "
                      f"{100 * slower:+.1f}% slower (limit {100 * limit[model]:.0f}%){note}", flush=True)
                if variant == "deterministic":
                    ok &= slower <= limit[model]
            if before:
                det = statistics.median(cells.get((model, world, "deterministic"), [0]))
                old = statistics.median(cells.get((model, world, "before"), [0]))
                if old:
                    print(f"{model} dp {world} --deterministic now / --before: {det / old:.2f}x", flush=True)
    results["cost"] = rows
    return ok


# ----------------------------------------------------------------------------------- elastic

def wait_text(path, text, seconds):
    import time
    until = time.time() + seconds
    while time.time() < until:
        try:
            with open(path) as f:
                if text in f.read():
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def elastic(tmp, results):
    """Four node agents of one worker each (dtrain launch --nnodes 3:4): node 3 leaves while the
    job runs (3 replicas accumulating 8 micro-batches), then returns (4 x 6 again); the digest
    must be the one of the run that never changed."""
    import signal
    import socket
    job = "--model mlp --hidden 256,256 --batch-size 48 --steps 12 --lr 1e-3"
    ref = digest_of(run(f"{job} --deterministic --dp 4 --accumulate 6", tmp, "elastic-ref")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ck, metrics = os.path.join(tmp, "elastic-ck"), os.path.join(tmp, "elastic.jsonl")
    work = (f"-- {DTRAIN} train {job} --deterministic --dp 4 --accumulate 6 --min-workers 3 --checkpoint-dir {ck} "
            f"--checkpoint-every 1 --progress=false --metrics {metrics}")
    e = env({"DTRAIN_SECRET": secrets.token_hex(32),
             "DTRAIN_FAULT": "delay:rank=0:step=4:ms=60000:attempt=0,delay:rank=0:step=8:ms=60000:attempt=1"})

    def agent(node, log):
        cmd = (f"{DTRAIN} launch --nnodes 3:4 -n 1 --master-port {port} --last-call 1 --max-restarts 4 "
               f"--node-rank {node} {work}")
        return subprocess.Popen(cmd.split(), env=e, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    logs = [os.path.join(tmp, f"agent{n}.log") for n in range(4)]
    agents = [agent(n, logs[n]) for n in range(4)]
    shrunk = grew = False
    try:
        if wait_text(logs[0], "delaying this rank by 60000 ms at step 4", 300):
            os.killpg(agents[3].pid, signal.SIGTERM)  # node 3 leaves
            agents[3].wait(timeout=60)
            shrunk = wait_text(logs[0], "delaying this rank by 60000 ms at step 8", 300)
            if shrunk:
                agents[3] = agent(3, os.path.join(tmp, "agent3b.log"))  # and comes back
                grew = True
        for a in agents[:3] + [agents[3]]:
            a.wait(timeout=600)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    d = "FAILED"
    if os.path.exists(metrics):
        with open(metrics) as f:
            finals = [json.loads(line) for line in f if '"final"' in line]
        d = finals[-1]["params_digest"] if finals else d
    with open(logs[0]) as f:
        log0 = f.read()
    three = "--accumulate 8 instead of 6" in log0
    same = d == ref and shrunk and grew and three
    print(f"elastic 4 -> 3 -> 4 node agents: shrunk {shrunk} (3 x 8: {three}), grew {grew}, digest {d[:16]} vs "
          f"{ref[:16]}: {'same' if d == ref else 'DIFFERENT'}", flush=True)
    if not same:
        print(log0[-4000:], file=sys.stderr)
    results["elastic"] = {"digest": d, "reference": ref, "shrunk": shrunk and three, "grew": grew, "same": same}
    return same


# ------------------------------------------------------------------------------ mpi and netns

def mpi(tmp, results):
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("mpi: no mpirun", flush=True)
        return True
    job = f"{MLP} --deterministic --dp 4 --accumulate 6"
    ref = digest_of(run(f"{MLP} --deterministic --accumulate 24", tmp, "mpi-ref")[0])
    rec, _ = run(f"{job} --backend mpi", tmp, "mpi",
                 prefix=[mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4"])
    d = digest_of(rec)
    print(f"mpi  mpirun -np 4 --backend mpi (dp 4 x 6) {d[:16]} vs one process {ref[:16]}: "
          f"{'same' if d == ref else 'DIFFERENT'}", flush=True)
    results["mpi"] = {"digest": d, "reference": ref, "same": d == ref}
    return d == ref


def netns(tmp, results):
    if os.geteuid() != 0:
        print("netns: needs root", flush=True)
        return True
    ref = digest_of(run(f"{MLP} --deterministic --accumulate 24", tmp, "netns-ref")[0])
    metrics = os.path.join(tmp, "netns.jsonl")
    work = (f"{DTRAIN} train {MLP} --deterministic --dp 4 --accumulate 6 --progress=false --metrics {metrics}")
    launch = (f"{DTRAIN} launch --nnodes 2 --node-rank $HOST --master-addr $MASTER_ADDR --master-port 29617 -n 2 "
              f"-- {work}")
    cmd = [os.path.join(ROOT, "scripts", "netns-cluster"), "--hosts", "2", "--rate", "1gbit", "--name",
           f"det{os.getpid() % 10000}", "--", "sh", "-c", launch]
    p = subprocess.run(cmd, env=env({"DTRAIN_SECRET": secrets.token_hex(32)}), capture_output=True, text=True,
                       timeout=900)
    d = "FAILED"
    if p.returncode == 0 and os.path.exists(metrics):
        with open(metrics) as f:
            d = [json.loads(line) for line in f if line.strip()][-1]["params_digest"]
    else:
        print((p.stdout + p.stderr)[-3000:], file=sys.stderr)
    print(f"netns 2 hosts x 2 processes (TCP between, shm within) {d[:16]} vs one process {ref[:16]}: "
          f"{'same' if d == ref else 'DIFFERENT'}", flush=True)
    results["netns"] = {"digest": d, "reference": ref, "same": d == ref}
    return d == ref


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="table,flips,elastic,mpi,netns,cost")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mlp-steps", type=int, default=60)
    ap.add_argument("--gpt-steps", type=int, default=20)
    ap.add_argument("--flips", type=int, default=10)
    ap.add_argument("--audit-every", type=int, default=100,
                    help="cost: K of the --audit variant, 0 for none (below 100 it runs within fewer steps; the cost is then "
                    "also shown scaled to K = 100)")
    ap.add_argument("--dp", default="2,4", help="cost: the data-parallel worlds to measure, e.g. 4")
    ap.add_argument("--models", default="mlp,gpt", help="cost: the models to measure, e.g. mlp")
    ap.add_argument("--before", help="cost: also run --deterministic with this dtrain binary (an older build), "
                    "side by side")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    results = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if "table" in parts:
            ok &= table(tmp, results)
        if "flips" in parts:
            ok &= flips(tmp, results, a.flips)
        if "elastic" in parts:
            ok &= elastic(tmp, results)
        if "mpi" in parts:
            ok &= mpi(tmp, results)
        if "netns" in parts:
            ok &= netns(tmp, results)
        if "cost" in parts:
            ok &= cost(tmp, results, a.repeats, a.mlp_steps, a.gpt_steps, a.before, a.audit_every,
                       tuple(int(w) for w in a.dp.split(",")), tuple(a.models.split(",")))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "determinism.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
