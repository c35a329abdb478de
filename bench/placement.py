"""Where the host runs this machine's first two CPUs, for benchmarks whose ranks talk through
memory: bench/core_latency.c passes a cache line between them and reports the round trip.

On the 2-vCPU virtual machines these benchmarks run on, the round trip moves between about
100 ns (cores that share a cache) and 450-550 ns (far apart) from one minute, at times one
second, to the next, and every transfer between ranks pays it (bench/README.md, Placement).
collectives_compare.py and ddp_compare.py measure it before and after each multi-rank run.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def build_probe(cc, say=None):
    """bench/core_latency.c built with `cc` into bench/results/; None when it cannot be built
    (the runs then go without it)."""
    exe = os.path.join(HERE, "results", "core_latency")
    src = os.path.join(HERE, "core_latency.c")
    if os.path.exists(exe) and os.path.getmtime(exe) >= os.path.getmtime(src):
        return exe
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    cmd = [cc, "-O2", "-pthread", "-o", exe, src]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"WARNING: {' '.join(cmd)}: {e}; running without the core-to-core probe", file=sys.stderr)
        return None
    if r.returncode != 0:
        print(f"WARNING: {' '.join(cmd)} failed; running without the core-to-core probe\n{r.stderr}",
              file=sys.stderr)
        return None
    if say:
        say(f"built {os.path.relpath(exe, os.path.dirname(HERE))}")
    return exe


def probe(exe):
    """The core-to-core round trip in ns now (None without the probe or when it fails)."""
    if not exe:
        return None
    try:
        r = subprocess.run([exe], capture_output=True, text=True, timeout=30)
        return json.loads(r.stdout).get("round_trip_ns") if r.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


# Cores that share a cache pass a line in about 100 ns here; a session that only ever met the
# far placement must not take its own fastest round trip for near.
NEAR_NS = 150.0


def near_ns(fastest):
    """The round trip that stands for near in a session whose fastest was `fastest`."""
    return min(fastest, NEAR_NS)


def is_far(trips, fastest):
    """A run met a far placement when a round trip around it was over twice the fastest seen
    (or than NEAR_NS, when even the fastest of the session was slower than that)."""
    return bool(trips) and max(trips) > 2 * near_ns(fastest)
