#!/usr/bin/python3
"""dtrain sweep across hosts: HOSTS hosts as network namespaces (scripts/netns-cluster), one sweep
rank per host (`dtrain launch --nnodes HOSTS -n 1 -- dtrain sweep ...`: rank 0 coordinates, every
rank runs trials), the sweep directory on the file system they share.

    /usr/bin/python3 bench/netns_sweep.py [--hosts 3] [--rate 1gbit] [--trials 8]

same   the asha sweep across the hosts against the same sweep on one host: results.jsonl equal
       bit for bit (wall times left out), and every host ran trials (hosts.json).
lost   the same sweep, and every process of the last host killed (kill -9: its launcher, its sweep
       rank and its trial) as soon as it trains a trial; after --host-timeout the host is lost, its
       trial runs again on another host from its checkpoint, and the results are still the one-host
       sweep's.
Prints one line per check and exits non-zero when one fails. Needs root.
"""
import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results(path):
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            r.pop("time_s", None)
            rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args()
    search = (f"sweep --strategy asha --param lr=0.0003,0.001,0.003,0.01 --param weight-decay=0,0.001 "
              f"--trials {args.trials} --eta 2 --min-steps 10 --max-steps 40").split()
    train = "-- --hidden 32 --batch-size 32".split()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        t0 = time.monotonic()
        ref = subprocess.run([args.dtrain] + search + ["--parallel", "1", "--dir", f"{tmp}/ref"] + train,
                             capture_output=True, text=True)
        if ref.returncode != 0:
            sys.exit(f"the one-host sweep failed:\n{ref.stdout[-2000:]}{ref.stderr[-2000:]}")
        print(f"one host: {time.monotonic() - t0:.1f} s")
        want = results(f"{tmp}/ref/results.jsonl")
        victim = args.hosts - 1
        for check in ("same", "lost"):
            d = f"{tmp}/{check}"
            sweep = " ".join([args.dtrain] + search + ["--parallel", "1", "--host-timeout", "5", "--dir", d] + train)
            launch = (f"{args.dtrain} launch --nnodes {args.hosts} --node-rank $HOST --master-addr $MASTER_ADDR "
                      f"--master-port 29630 -n 1 -- {sweep}")
            cmd = [os.path.join(ROOT, "scripts/netns-cluster"), "--hosts", str(args.hosts), "--rate", args.rate,
                   "--name", "dsw", "--", "sh", "-c", launch]
            env = dict(os.environ, DTRAIN_SECRET=secrets.token_hex(32))
            t0, wall0 = time.monotonic(), time.time()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            lines, killed = [], False
            for line in p.stdout:
                lines.append(line)
                if check == "lost" and not killed and f"started on rank {victim} " in line:
                    pids = subprocess.run(["ip", "netns", "pids", f"dsw-h{victim}"], capture_output=True,
                                          text=True).stdout.split()
                    subprocess.run(["kill", "-9"] + pids)
                    killed = True
                    print(f"killed host {victim}: {len(pids)} processes", flush=True)
            p.wait()
            seconds = time.monotonic() - t0
            out = "".join(lines)
            got = results(f"{d}/results.jsonl") if os.path.exists(f"{d}/results.jsonl") else None
            # The sweep's own time (its results written), apart from the launchers' end: node 0's waits up to
            # 60 s for every node to finish, and a dead one never does.
            swept = os.path.getmtime(f"{d}/results.jsonl") - wall0 if got is not None else float("nan")
            hosts = json.load(open(f"{d}/hosts.json")) if os.path.exists(f"{d}/hosts.json") else []
            jobs = ", ".join(f"rank {h['rank']}: {h['jobs']} jobs" + (" (lost)" if "lost" in h else "") for h in hosts)
            if check == "same":
                good = got == want and len(hosts) == args.hosts and all(h["jobs"] > 0 for h in hosts)
            else:
                good = (got == want and killed and "lost" in hosts[victim] and "was lost" in out)
            print(f"{check}: {'ok' if good else 'FAILED'}: results {'equal' if got == want else 'differ'} to the "
                  f"one host's; {jobs}; results after {swept:.1f} s, the launchers ended after {seconds:.1f} s")
            if not good:
                print(out[-4000:])
            ok = ok and good
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
