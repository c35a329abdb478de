#!/usr/bin/python3
"""dtrain plan against dtrain train: predicted and measured step time of the same configurations.

    /usr/bin/python3 bench/plan_validate.py [--only NAME,...] [--steps 12] [--tolerance 0.2]

Per configuration: `dtrain plan ... --calibrate --json` (this machine's kernels for the
configuration's blocks, alpha/beta of shared memory and TCP by ping-pong) predicts the step; then
`dtrain train` runs it, across hosts as network namespaces joined by rate-limited links
(scripts/netns-cluster, needs root) when the configuration has more than one host. Measured step
time: the median over the steps after the first --warmup of the per-step times that the trainer's
metrics give (--log-every 1: each record's cumulative samples/s gives the training time so far).
Prints config | predicted ms | measured ms | error % and exits 1 when any error exceeds
--tolerance. Results: bench/results/plan_validate.json.
"""
import argparse
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPT = "--model gpt --layers 4 --width 128 --heads 4 --seq-len 128"
MLP = "--model mlp --hidden 1024,1024"

# name, hosts, link (netns-cluster rate, None: one host, shared memory), Gbit/s for plan, train flags.
CONFIGS = [
    ("gpt-w1", 1, None, 0, f"{GPT} --batch-size 16"),
    ("mlp-dp2-2h-1g", 2, "1gbit", 1, f"{MLP} --dp 2 --batch-size 128"),
    ("mlp-dp2-2h-10g", 2, "10gbit", 10, f"{MLP} --dp 2 --batch-size 128"),
    ("gpt-dp4-4h-100m", 4, "100mbit", 0.1, f"{GPT} --dp 4 --batch-size 16"),
    ("gpt-pp4-2h-1g", 2, "1gbit", 1, f"{GPT} --pp 4 --micro-batches 8 --batch-size 16"),
    ("gpt-tp4-1h", 1, None, 0, f"{GPT} --tp 4 --batch-size 16"),
    ("gpt-tp2-1h", 1, None, 0, f"{GPT} --tp 2 --batch-size 16"),
    ("gpt-dp2-1h", 1, None, 0, f"{GPT} --dp 2 --batch-size 16"),
    ("gpt-dp4-1h", 1, None, 0, f"{GPT} --dp 4 --batch-size 16"),
    ("gpt-dp2tp2-2h-10g", 2, "10gbit", 10, f"{GPT} --dp 2 --tp 2 --batch-size 16"),
    ("gpt-dp2pp2tp2-2h-1g", 2, "1gbit", 1, f"{GPT} --dp 2 --pp 2 --tp 2 --micro-batches 4 --batch-size 16"),
    ("mlp-dp4pp2-4h-10g", 4, "10gbit", 10, f"{MLP} --dp 4 --pp 2 --micro-batches 4 --batch-size 256"),
    ("gpt-dp2pp2z1-2h-100m", 2, "100mbit", 0.1, f"{GPT} --dp 2 --pp 2 --zero 1 --micro-batches 4 --batch-size 16"),
]


def world_of(args):
    w = 1
    toks = args.split()
    for flag in ("--dp", "--pp", "--tp"):
        if flag in toks:
            w *= int(toks[toks.index(flag) + 1])
    return w


def busy_fraction(seconds=1.0):
    """Fraction of the machine's CPU time that was busy over `seconds` (/proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


class OtherWork:
    """CPU time that processes other than ours used on this shared machine while we measured."""

    def __init__(self):
        self.t0, self.busy0, self.mine0 = time.time(), self.busy(), self.mine()

    @staticmethod
    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1] + v[2]) / os.sysconf("SC_CLK_TCK")  # user, nice, system

    @staticmethod
    def mine():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def fraction(self):
        """Of the machine's capacity over the interval."""
        wall = max(1e-3, time.time() - self.t0)
        others = (self.busy() - self.busy0) - (self.mine() - self.mine0)
        return max(0.0, others) / (wall * os.cpu_count())


def wait_quiet(limit_s, threshold=0.15):
    """The machine is shared: wait until other work leaves it (nearly) idle; the busy fraction seen."""
    deadline = time.time() + limit_s
    busy = busy_fraction()
    while busy > threshold and time.time() < deadline:
        print(f"  (machine {busy * 100:.0f}% busy with other work; waiting)", flush=True)
        time.sleep(5)
        busy = busy_fraction()
    return busy


# One TCP stream between two namespaced hosts: the machine's CPU time per byte (all cores,
# kernel included: the emulated hosts share this machine's cores with their network path).
STREAM = r"""
import os, socket, sys, time
mode, addr, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(1)
    c, _ = s.accept(); buf = bytearray(1 << 20); view = memoryview(buf); got = 0
    while got < n:
        k = c.recv_into(view)
        if k == 0: break
        got += k
    c.sendall(b"k")
else:
    def busy():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return (sum(v[:3]) + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port)); break
        except OSError:
            time.sleep(0.05)
    data = b"x" * (1 << 20); b0 = busy(); t0 = time.time(); sent = 0
    while sent < n:
        c.sendall(data); sent += len(data)
    c.recv(1); b1 = busy(); t = time.time() - t0
    print(f"cpu_ns_per_byte {(b1 - b0) / sent * 1e9:.4f} gbps {sent * 8 / t / 1e9:.4f}")
"""


def probe_link(args, tmp, rate, gbps):
    """Median over 3 streams of the CPU time per byte between two hosts over a `rate` link."""
    script = os.path.join(tmp, "stream.py")
    with open(script, "w") as f:
        f.write(STREAM)
    n = int(gbps * 1e9 / 8 * 1.5)  # about 1.5 s of traffic
    cpu, speed = [], []
    for k in range(3):
        wait_quiet(args.wait_quiet)
        cmd = [os.path.join(ROOT, "scripts/netns-cluster"), "--hosts", "2", "--rate", rate, "--name",
               f"pp{os.getpid() % 10000}", "--", "sh", "-c",
               f"if [ $HOST = 1 ]; then python3 {script} recv $HOST_ADDR 29799 {n}; "
               f"else python3 {script} send 10.77.0.2 29799 {n}; fi"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        words = r.stdout.split()
        if r.returncode != 0 or "cpu_ns_per_byte" not in words:
            sys.exit(f"link probe at {rate} failed:\n{r.stdout}{r.stderr}")
        cpu.append(float(words[words.index("cpu_ns_per_byte") + 1]))
        speed.append(float(words[words.index("gbps") + 1]))
    return statistics.median(cpu), statistics.median(speed)


def predict(args, name, hosts, gbps, train_args, cal, link_cpu):
    cmd = [args.dtrain, "plan"] + shlex.split(train_args) + ["--hosts", str(hosts), "--calibrate",
                                                              "--calibration", cal, "--json"]
    if gbps:
        cmd += ["--link-gbps", str(gbps)]
    if link_cpu is not None:
        cmd += ["--link-cpu-ns-per-byte", f"{link_cpu:.4f}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"{name}: dtrain plan failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return json.loads(r.stdout), cmd


def step_times(metrics):
    """Per-step seconds from the log records' cumulative rates."""
    recs = [json.loads(line) for line in open(metrics)]
    final = recs[-1]
    logs = [r for r in recs if r.get("event") == "log"]
    text = "tokens_per_s" in logs[0]
    per_sample = final["tokens_per_s"] / final["samples_per_s"] if text else 1.0
    steps, prev = [], 0.0
    for r in logs:
        rate = r["tokens_per_s" if text else "samples_per_s"]
        t = r["step"] * final["batch_size"] * per_sample / rate
        steps.append(t - prev)
        prev = t
    return steps


def measure(args, name, hosts, rate, train_args, tmp, port):
    metrics = os.path.join(tmp, f"{name}.jsonl")
    world = world_of(train_args)
    train = [args.dtrain, "train"] + shlex.split(train_args) + [
        "--steps", str(args.steps), "--log-every", "1", "--progress=false", "--eval-batches", "1",
        "--metrics", metrics]
    if hosts == 1:
        cmd = train
        env = os.environ
    else:
        launch = [args.dtrain, "launch", "--nnodes", str(hosts), "--node-rank", "$HOST", "--master-addr",
                  "$MASTER_ADDR", "--master-port", str(port), "-n", str(world // hosts), "--"] + train
        cmd = [os.path.join(ROOT, "scripts/netns-cluster"), "--hosts", str(hosts), "--rate", rate, "--name",
               f"pv{os.getpid() % 10000}", "--", "sh", "-c", " ".join(launch)]
        env = dict(os.environ, DTRAIN_SECRET=secrets.token_hex(32))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        sys.exit(f"{name}: training failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    steps = step_times(metrics)
    return statistics.median(steps[args.warmup:]), steps, cmd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=3, help="predictions and runs per configuration (medians)")
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--max-other", type=float, default=0.1,
                    help="measure again when other processes used more than this fraction of the CPUs")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--wait-quiet", type=float, default=300,
                    help="seconds to wait for other work on this shared machine to stop before each configuration")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/plan_validate.json"))
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    configs = [c for c in CONFIGS if not only or c[0] in only]
    if any(c[1] > 1 for c in configs) and os.geteuid() != 0:
        sys.exit("plan_validate: the multi-host configurations need root (network namespaces)")
    rows = []
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        cal = os.path.join(tmp, "calibration.json")
        # The links' CPU cost per byte, once per rate (the planner's default is TCP on loopback).
        link_cpu = {}
        for (_, hosts, rate, gbps, _) in configs:
            if hosts > 1 and rate not in link_cpu:
                link_cpu[rate], speed = probe_link(args, tmp, rate, gbps)
                print(f"link {rate}: {link_cpu[rate]:.3f} ns of CPU per byte, one stream {speed:.3f} Gbit/s",
                      flush=True)
        for k, (name, hosts, rate, gbps, train_args) in enumerate(configs):
            # --rounds of (calibrate and predict, run): this machine's speed drifts by 10-30% over
            # minutes, so each prediction is made just before its run and both sides take the median.
            # A round is done again while other work took more than --max-other of the machine.
            preds, meas, all_steps, others = [], [], [], []
            for rnd in range(args.rounds):
                for attempt in range(args.attempts):
                    wait_quiet(args.wait_quiet)
                    other = OtherWork()
                    pred, plan_cmd = predict(args, name, hosts, gbps, train_args, cal, link_cpu.get(rate))
                    measured, steps, train_cmd = measure(args, name, hosts, rate, train_args, tmp, 29700 + k)
                    other_fraction = other.fraction()
                    if other_fraction <= args.max_other:
                        break
                    print(f"  ({name}: other work took {other_fraction * 100:.0f}% of the machine; measuring again)",
                          flush=True)
                preds.append(pred)
                meas.append(measured)
                all_steps.append(steps)
                others.append(other_fraction)
            pred = sorted(preds, key=lambda p: p["step_ms"])[len(preds) // 2]
            measured = statistics.median(meas)
            other_fraction = max(others)
            steps = all_steps[-1]
            err = (pred["step_ms"] / 1e3 - measured) / measured
            rows.append({"config": name, "hosts": hosts, "link": rate or "shm", "train": train_args,
                         "predicted_ms": pred["step_ms"], "measured_ms": measured * 1e3, "error": err,
                         "rounds_predicted_ms": [p["step_ms"] for p in preds],
                         "rounds_measured_ms": [m * 1e3 for m in meas], "other_work": others,
                         "steps_ms": [[s * 1e3 for s in st] for st in all_steps],
                         "compute_ms": pred["compute_ms"], "exposed_comm_ms": pred["exposed_comm_ms"],
                         "bubble_ms": pred["bubble_ms"], "plan": " ".join(plan_cmd), "run": " ".join(train_cmd)})
            print(f"{name:24s} {pred['step_ms']:10.1f} {measured * 1e3:10.1f} {err * 100:+7.1f}%   "
                  f"(compute {pred['compute_ms']:.1f}, comm {pred['exposed_comm_ms']:.1f}, bubble "
                  f"{pred['bubble_ms']:.1f}; other work {other_fraction * 100:.0f}%)", flush=True)
            if args.verbose:
                print("   rounds: predicted", " ".join(f"{p['step_ms']:.1f}" for p in preds), " measured",
                      " ".join(f"{m * 1e3:.1f}" for m in meas))
                print("   steps ms (last round):", " ".join(f"{x * 1e3:.1f}" for x in steps))
                for st in pred["stages"]:
                    print("   stage", {k: round(v, 2) if isinstance(v, float) else v for k, v in st.items()
                                      if k != "memory"})
    print()
    print(f"{'config':24s} | {'predicted ms':>12s} | {'measured ms':>11s} | {'error %':>7s}")
    for r in rows:
        print(f"{r['config']:24s} | {r['predicted_ms']:12.1f} | {r['measured_ms']:11.1f} | {r['error'] * 100:+7.1f}")
    bad = [r for r in rows if abs(r["error"]) > args.tolerance]
    print(f"{len(rows) - len(bad)} of {len(rows)} within {args.tolerance * 100:.0f}%; {time.time() - t_start:.0f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tolerance": args.tolerance, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                   "link_cpu_ns_per_byte": link_cpu, "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
