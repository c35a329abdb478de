"""Compares two parameter files that torch_cnn --save wrote (torch.load reads them).

    compare_params.py RUN.pt REFERENCE.pt --max-rel 1e-5 [--min-rel 1e-3]

Prints the largest relative difference over the tensors, max|a - b| / max|b| per tensor, and
exits 1 when it is above --max-rel (the runs should agree) or below --min-rel (the runs should
differ, e.g. a trained model against the untrained one), or when the names or shapes differ.
"""
import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("reference")
    ap.add_argument("--max-rel", type=float, default=None)
    ap.add_argument("--min-rel", type=float, default=None)
    args = ap.parse_args()
    a, b = torch.load(args.run), torch.load(args.reference)
    if sorted(a) != sorted(b):
        print(f"compare_params: {args.run} has tensors {sorted(a)}, {args.reference} has {sorted(b)}")
        return 1
    worst, where = 0.0, ""
    for name in sorted(b):
        if a[name].shape != b[name].shape:
            print(f"compare_params: '{name}' is {tuple(a[name].shape)} in {args.run}, {tuple(b[name].shape)} in "
                  f"{args.reference}")
            return 1
        scale = b[name].abs().max().item()
        rel = (a[name] - b[name]).abs().max().item() / max(scale, 1e-30)
        if rel >= worst:
            worst, where = rel, name
    print(f"compare_params: {args.run} vs {args.reference}: largest relative difference {worst:.3e} ('{where}'), "
          f"{len(b)} tensors, {sum(t.numel() for t in b.values())} parameters")
    if args.max_rel is not None and worst > args.max_rel:
        print(f"compare_params: FAILED: above {args.max_rel:g}")
        return 1
    if args.min_rel is not None and worst < args.min_rel:
        print(f"compare_params: FAILED: below {args.min_rel:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
