#!/usr/bin/python3
"""dtrain plan at scale: the recommended layout, step time, memory and scaling efficiency of
GPT-like models on 64..4096 devices, as a Markdown table (docs/plan.md).

    /usr/bin/python3 bench/plan_scale.py [--devices 64,256,1024,4096] [--models 1.3e9,7e9,70e9]
                                         [--devices-per-host 1] [--link-gbps 400] [--batch-size 1024]

Each row is one `dtrain plan --model gpt --params P --devices N --device-flops F --link-gbps L
--memory M --json` (printed above the table), its best layout under the memory limit.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--models", default="1.3e9,7e9,70e9")
    ap.add_argument("--devices", default="64,256,1024,4096")
    ap.add_argument("--device-flops", default="9.9e14")
    ap.add_argument("--memory", default="80e9")
    ap.add_argument("--link-gbps", default="400")
    ap.add_argument("--devices-per-host", default="1")
    ap.add_argument("--batch-size", default="1024")
    ap.add_argument("--extra", default="", help="more dtrain plan flags, e.g. '--intra-gbps 7200'")
    args = ap.parse_args()
    rows = []
    for p in args.models.split(","):
        for n in args.devices.split(","):
            cmd = [args.dtrain, "plan", "--model", "gpt", "--params", p, "--devices", n, "--device-flops",
                   args.device_flops, "--memory", args.memory, "--link-gbps", args.link_gbps, "--devices-per-host",
                   args.devices_per_host, "--batch-size", args.batch_size, "--top", "1", "--json"] + args.extra.split()
            print("$ " + " ".join(os.path.relpath(c, ROOT) if c == args.dtrain else c for c in cmd), file=sys.stderr)
            r = subprocess.run(cmd, capture_output=True, text=True)
            j = json.loads(r.stdout) if r.stdout.strip() else {}
            if r.returncode != 0 or not j.get("ranked"):
                rows.append((p, n, "does not fit", "", "", "", "", "", j.get("too_big", "?"), j.get("considered", "?")))
                continue
            b = j["ranked"][0]
            rows.append((p, n, b["layout"], f"{b['step_ms'] / 1e3:.3f}", f"{b['tokens_per_s'] / 1e6:.2f}",
                         f"{b['memory']['total'] / 1e9:.1f}", f"{b['efficiency']:.2f}",
                         f"{b['compute_ms'] / 1e3:.3f} / {b['exposed_comm_ms'] / 1e3:.3f} / {b['bubble_ms'] / 1e3:.3f}",
                         j["too_big"], j["considered"]))
    print("| model | devices | best layout | step s | M tokens/s | GB/device | E | compute / comm / bubble s "
          "| layouts over memory / simulated |")
    print("|---|---:|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {float(r[0]) / 1e9:g}B | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]} | {r[7]} | "
              f"{r[8]} / {r[9]} |")


if __name__ == "__main__":
    main()
