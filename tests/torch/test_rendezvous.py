"""torch.distributed.init_process_group("dtrain") meets every way torch's ranks meet:
under `dtrain launch` (env://, through dtrain launch's authenticated store), under torchrun
(env://, torch's TCPStore), and with init_method tcp:// and file://. gloo under dtrain launch
works too (same store)."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

import util

WORKER = os.path.join(util.HERE, "rendezvous_worker.py")


def expect_ok(proc, n, backend, what, dtrain_store):
    out = proc.stdout + proc.stderr
    util.check(proc.returncode == 0, what, "exited", proc.returncode, out[-3000:])
    for r in range(n):
        line = f"ok rank {r} of {n} backend {backend}"
        util.check(line in out, what, "no line", repr(line), out[-3000:])
    util.check(f"dtrain-store {dtrain_store}" in out, what, "store", out[-2000:])
    print(f"{what}: {n} ranks met", flush=True)


def tiny(rank, n):
    x = torch.ones(3) * rank
    dist.all_reduce(x)
    util.check(torch.equal(x, torch.ones(3) * (n * (n - 1) / 2)), "all_reduce", x)


def main():
    for backend in ("dtrain", "gloo"):
        expect_ok(util.launch(3, [WORKER, backend]), 3, backend, f"dtrain launch -n 3 ({backend})", True)
    env = {k: v for k, v in os.environ.items() if k not in ("DTRAIN_STORE_HOSTED", "DTRAIN_SECRET")}
    env["OMP_NUM_THREADS"] = "1"
    for attempt in range(3):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", str(util.free_port()),
                    # Python 3.11 reads the default "0" of --redirects and --tee as None (torch 1.13): ask
                    # for stdout in files and on the console instead.
                    "--redirects", "1", "--tee", "1",
                    WORKER, "dtrain"]
        proc = subprocess.run(torchrun, capture_output=True, text=True, timeout=240, env=env)
        # The port found free was taken before torchrun's agent bound it (a test beside this one
        # under ctest -j): try another one, as util.run_world does.
        if proc.returncode == 0 or util.PORT_TAKEN not in proc.stdout + proc.stderr or attempt == 2:
            break
        print("torchrun: --master_port taken before it was bound; again on another port", flush=True)
    expect_ok(proc, 2, "dtrain", "torchrun", False)
    for init in ("tcp", "file"):
        util.run_world(tiny, 2, init=init)
        print(f"init_method {init}://: 2 ranks met", flush=True)


if __name__ == "__main__":
    sys.exit(main())
