#!/usr/bin/python3
"""Gradient compression: bytes on the wire and what it costs in accuracy, against f32.

    /usr/bin/python3 bench/compression.py [--epochs 2] [--gpt-steps 300] [--only mlp|gpt]

1. The Fashion-MNIST MLP 784-1024-1024-10 with --dp 4, the same global batch (256), seed and
   epochs, once per --compress: none, bf16, fp16, int8, int4, powersgd:4. Reports test
   accuracy (and its difference to none) and the wire bytes per step this rank sent against
   what f32 would have sent (the trainer's counts).
2. The GPT (width 128, 4 layers, sequence 64) on the fortunes corpus with --dp 4, the same
   steps, for none, bf16 and int8: validation loss and its relative difference to none.
Targets (issue 7): wire bytes fall 3.5x (int8), 7x (int4), 20x (powersgd:4); accuracy within
0.5 points for bf16/fp16/int8 and 1.0 for int4/powersgd; GPT validation loss within 2% for
bf16 and int8. Results: bench/results/compression.json.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP_CODECS = ["none", "bf16", "fp16", "int8", "int4", "powersgd:4"]
GPT_CODECS = ["none", "bf16", "int8"]
LIMITS = {"bf16": 0.5, "fp16": 0.5, "int8": 0.5, "int4": 1.0, "powersgd:4": 1.0}
RATIOS = {"int8": 3.5, "int4": 7.0, "powersgd:4": 20.0}


def final_record(cmd, metrics, name, env=None):
    """Runs cmd (which writes JSON-lines metrics to `metrics`) and returns its last record."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        sys.exit(f"{name} failed ({p.returncode}):\n{p.stdout[-3000:]}")
    with open(metrics) as f:
        return [json.loads(x) for x in f if x.strip()][-1]


def train(args, tmp, name, extra):
    metrics = os.path.join(tmp, name + ".jsonl")
    cmd = [args.dtrain, "train", "--dp", "4", "--progress=false", "--log-every", "1000", "--metrics", metrics] + extra
    return final_record(cmd, metrics, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build/release/dtrain"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--gpt-steps", type=int, default=300)
    ap.add_argument("--only", choices=["mlp", "gpt"])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/compression.json"))
    args = ap.parse_args()
    out = {"mlp": [], "gpt": []}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "gpt":
            base = None
            for c in MLP_CODECS:
                r = train(args, tmp, "mlp-" + c.replace(":", ""),
                          ["--model", "mlp", "--hidden", "1024,1024", "--batch-size", "256", "--epochs", str(args.epochs),
                           "--optimizer", "adamw", "--lr", "1e-3", "--seed", "0", "--compress", c])
                acc = 100.0 * r["test_accuracy"]
                base = acc if c == "none" else base
                ratio = r["compression_ratio"]
                row = {"compress": c, "test_accuracy": acc, "delta_points": acc - base, "ratio": ratio,
                       "wire_bytes_per_step": r["wire_bytes_per_step"], "f32_bytes_per_step": r["f32_bytes_per_step"],
                       "samples_per_s": r.get("samples_per_s")}
                row["ok"] = c == "none" or (abs(acc - base) <= LIMITS[c] and ratio >= RATIOS.get(c, 1.0))
                ok = ok and row["ok"]
                out["mlp"].append(row)
                print(f"mlp {c:11s} test accuracy {acc:6.2f}%  ({acc - base:+.2f} points)  wire {ratio:6.2f}x fewer "
                      f"bytes ({r['wire_bytes_per_step'] / 1e6:.3f} MB/step vs {r['f32_bytes_per_step'] / 1e6:.3f})  "
                      f"{'ok' if row['ok'] else 'MISSED'}", flush=True)
        if args.only != "mlp":
            base = None
            for c in GPT_CODECS:
                r = train(args, tmp, "gpt-" + c,
                          ["--model", "gpt", "--width", "128", "--layers", "4", "--heads", "4", "--seq-len", "64",
                           "--batch-size", "32", "--steps", str(args.gpt_steps), "--eval-batches", "50", "--seed", "0",
                           "--compress", c])
                loss = r["val_loss"]
                base = loss if c == "none" else base
                rel = (loss - base) / base
                row = {"compress": c, "val_loss": loss, "relative": rel, "ratio": r["compression_ratio"],
                       "ok": c == "none" or abs(rel) <= 0.02}
                ok = ok and row["ok"]
                out["gpt"].append(row)
                print(f"gpt {c:11s} validation loss {loss:.4f}  ({100 * rel:+.2f}%)  wire {r['compression_ratio']:.2f}x "
                      f"fewer bytes  {'ok' if row['ok'] else 'MISSED'}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
