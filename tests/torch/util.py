"""Helpers of the torch backend's tests: worlds of processes, started three ways.

run_world(fn, n, ...) forks n processes that each call fn(rank, n, *args) after
init_process_group(backend, init_method=...), and raises naming every rank that failed.
launch(n, script, ...) runs a script under `dtrain launch -n N` (DTRAIN_BINARY).
"""

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

# Imported before the fork, so that each rank does not import them again (seconds each).
import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

import dtrain_torch  # noqa: E402,F401  registers "dtrain"

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, n, backend, init_method, timeout_s, args, errors):
    try:
        import torch
        import torch.distributed as dist

        import dtrain_torch  # noqa: F401  registers "dtrain"

        torch.set_num_threads(1)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=n, timeout=timedelta(seconds=timeout_s)
        )
        fn(rank, n, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  reported to the parent
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the queue's feeder thread writes it before _exit
        os._exit(1)
    os._exit(0)


# What a TCPStore says when the port run_world found free was taken before rank 0 bound it (another
# test running beside this one under ctest -j): a race of the harness, not of the code under test.
PORT_TAKEN = "Address already in use"


def run_world(fn, n, *args, backend="dtrain", init="file", timeout_s=60, join_s=240, expect_codes=None):
    """Runs fn(rank, n, *args) on n forked processes, each in a world of `backend` met through
    init_method file:// (a FileStore in a fresh temporary directory) or tcp:// (rank 0 serves a
    TCPStore on a port found free just before: if another program takes it in between, the world is
    started again on another port, at most 3 times); raises AssertionError with every failing rank's
    traceback. expect_codes: {rank: exit code} for ranks meant to end otherwise (-9: killed)."""
    if init not in ("tcp", "file"):
        raise ValueError(init)
    for attempt in range(3):
        try:
            return _run_world_once(fn, n, args, backend, init, timeout_s, join_s, expect_codes)
        except AssertionError as e:
            if init != "tcp" or PORT_TAKEN not in str(e) or attempt == 2:
                raise
            print(f"run_world: tcp:// port taken before rank 0 bound it; again on another port ({e})"[:400],
                  file=sys.stderr, flush=True)


def _run_world_once(fn, n, args, backend, init, timeout_s, join_s, expect_codes):
    with tempfile.TemporaryDirectory(prefix="dtrain-torch-") as tmp:
        init_method = f"tcp://127.0.0.1:{free_port()}" if init == "tcp" else f"file://{tmp}/rendezvous"
        ctx = mp.get_context("fork")
        errors = ctx.Queue()
        procs = [
            ctx.Process(target=_child, args=(fn, r, n, backend, init_method, timeout_s, args, errors))
            for r in range(n)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_s
        failed = []
        for p in procs:
            # Joined a second at a time: a rank 0 that could not bind the tcp:// port leaves the others
            # waiting on whatever took it, so that failure ends the world at once (run_world retries).
            while p.is_alive() and time.monotonic() < deadline:
                p.join(min(1.0, max(0.0, deadline - time.monotonic())))
                while not errors.empty():
                    failed.append(errors.get())
                if any(PORT_TAKEN in e for _, e in failed):
                    deadline = time.monotonic()
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                if (expect_codes or {}).get(r) != -9:  # -9: a rank meant to be killed (or stopped, then killed here)
                    failed.append((r, f"still running after {join_s} s"))
        while not errors.empty():
            failed.append(errors.get())
        codes = [p.exitcode for p in procs]
        want = [(expect_codes or {}).get(r, 0) for r in range(n)]
        if failed or codes != want:
            text = "\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(failed))
            raise AssertionError(f"world of {n} failed (exit codes {codes}, expected {want}):\n{text}")


def dtrain_binary():
    path = os.environ.get("DTRAIN_BINARY") or os.path.join(REPO, "build", "release", "dtrain")
    if not os.path.exists(path):
        raise RuntimeError(f"dtrain binary not found at {path} (set DTRAIN_BINARY)")
    return path


def launch(n, argv, timeout_s=240, env=None):
    """Runs argv (after /usr/bin/python3) under dtrain launch -n N; returns CompletedProcess."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    cmd = [dtrain_binary(), "launch", "-n", str(n), "--", sys.executable] + list(argv)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env)


def check(cond, *msg):
    if not cond:
        raise AssertionError(" ".join(str(m) for m in msg))
