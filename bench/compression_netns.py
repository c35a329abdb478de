#!/usr/bin/python3
"""Compressed gradients where bandwidth is scarce: hosts as network namespaces joined by
rate-limited links (scripts/netns-cluster), side by side in one run.

    /usr/bin/python3 bench/compression_netns.py [--hosts 2] [--rate 1gbit] [--steps 40]
                                               [--codecs none,int8,int4,powersgd:4] [--repeat 3]

Per codec: the Fashion-MNIST MLP 784-1024-1024-10 with one worker per host (--dp HOSTS, TCP
between hosts), the same global batch and steps; the runs alternate codecs --repeat times and
the median samples/s (after the first step) is reported with its ratio to none. Needs root.
Results: bench/results/compression_netns.json.
"""
import argparse
import json
import os
import secrets
import statistics
import tempfile

from compression import final_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, tmp, codec, k):
    metrics = os.path.join(tmp, f"{codec.replace(':', '')}-{k}.jsonl")
    train = [args.dtrain, "train", "--model", "mlp", "--hidden", "1024,1024", "--dp", str(args.hosts), "--batch-size",
             str(64 * args.hosts), "--steps", str(args.steps), "--progress=false", "--log-every", "1000",
             "--compress", codec, "--metrics", metrics]
    launch = [args.dtrain, "launch", "--nnodes", str(args.hosts), "--node-rank", "$HOST", "--master-addr",
              "$MASTER_ADDR", "--master-port", "29611", "-n", "1", "--"] + train
    cmd = [os.path.join(ROOT, "scripts/netns-cluster"), "--hosts", str(args.hosts), "--rate", args.rate, "--", "sh",
           "-c", " ".join(launch)]
    return final_record(cmd, metrics, codec, env=dict(os.environ, DTRAIN_SECRET=secrets.token_hex(32)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--codecs", default="none,int8,int4,powersgd:4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/compression_netns.json"))
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    samples = {c: [] for c in codecs}
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        for k in range(args.repeat):
            for c in codecs:
                r = run(args, tmp, c, k)
                samples[c].append(r["samples_per_s"])
                ratios[c] = r["compression_ratio"]
                print(f"round {k + 1}: {c:11s} {r['samples_per_s']:8.1f} samples/s  wire {r['compression_ratio']:.2f}x "
                      f"fewer bytes", flush=True)
    base = statistics.median(samples["none"]) if "none" in samples else None
    rows = []
    for c in codecs:
        med = statistics.median(samples[c])
        rows.append({"compress": c, "median_samples_per_s": med, "runs": samples[c], "speedup": med / base if base else None,
                     "wire_ratio": ratios[c]})
        print(f"{c:11s} median {med:8.1f} samples/s  {med / base if base else float('nan'):.2f}x none  "
              f"({args.hosts} hosts, {args.rate} links)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"hosts": args.hosts, "rate": args.rate, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
