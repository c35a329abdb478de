#!/usr/bin/env bash
# `make bench`: the side-by-side benchmarks of bench/README.md, each against its reference in
# one run (PyTorch, PyTorch DDP over Gloo, Open MPI and Gloo). Tables go to stdout, raw results
# to bench/results/. QUICK=1 runs one repeat of shorter jobs (a smoke run, not a measurement).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=/usr/bin/python3  # Debian's python3-torch; the python3 first on PATH has no torch
quick=()
if [[ "${QUICK:-0}" == "1" ]]; then quick=(--repeats 1); fi
lscpu | grep -E "^Model name|^Flags" | sed 's/^/cpu: /' | cut -c1-400

echo "== single process: dtrain vs PyTorch (bench/compare_torch.py)"
$PY bench/compare_torch.py "${quick[@]}"
echo "== data parallel: dtrain vs PyTorch DDP over Gloo (bench/ddp_compare.py)"
$PY bench/ddp_compare.py "${quick[@]}"
echo "== collectives: dtrain vs Open MPI vs Gloo (bench/collectives_compare.py)"
$PY bench/collectives_compare.py "${quick[@]}"
