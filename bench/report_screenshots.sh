#!/usr/bin/env bash
# The screenshots of `dtrain report` in docs/: three runs (the demo's job, a 2 x 2 pipeline, a
# run with a fault and a restart) and an asha sweep, their pages, and headless Chromium's
# pictures of them.
# Usage: bench/report_screenshots.sh [OUT_DIR]   (default: out/report-shots; PNGs go to docs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-out/report-shots}"
dtrain=build/release/dtrain
mkdir -p "$out" docs
rm -rf "$out/ckpt" "$out"/*.jsonl "$out/sweep"
export DTRAIN_FLIGHT_DIR="$out"
"$dtrain" train --dp 2 --zero 1 --model mlp --hidden 1024,1024 --epochs 1 --batch-size 64 --optimizer adamw \
  --lr 1e-3 --lr-schedule cosine --min-lr 1e-5 --seed 0 --log-every 20 --progress=false \
  --metrics "$out/demo.jsonl" --trace "$out/demo-trace.json"
"$dtrain" train --dp 2 --pp 2 --model mlp --hidden 512,512 --micro-batches 4 --steps 200 --batch-size 64 \
  --log-every 10 --progress=false --metrics "$out/pipeline.jsonl" --trace "$out/pipeline-trace.json"
DTRAIN_FAULT=kill:rank=1:step=130 "$dtrain" train --dp 2 --model mlp --hidden 256,256 --steps 300 --batch-size 64 \
  --log-every 10 --progress=false --checkpoint-dir "$out/ckpt" --checkpoint-every 50 --max-restarts 1 \
  --metrics "$out/fault.jsonl" --trace "$out/fault-trace.json"
for run in demo pipeline fault; do
  "$dtrain" report "$out/$run.jsonl" -o "$out/$run.html" --title "dtrain report: $run"
done
"$dtrain" report "$out/demo.jsonl" "$out/fault.jsonl" -o "$out/overlay.html" --title "dtrain report: two runs"
"$dtrain" sweep --dir "$out/sweep" --strategy asha --param lr=log:1e-4:3e-2:6 --param weight-decay=0,0.01 --trials 12 \
  --eta 2 --min-steps 25 --max-steps 200 --parallel 2 -- --hidden 32 --batch-size 32 >/dev/null
"$dtrain" report "$out/sweep" -o "$out/sweep.html" --title "dtrain report: an asha sweep"
shot() {  # shot PAGE SECTIONS PNG HEIGHT
  local profile
  profile="$(mktemp -d)"
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$profile" --hide-scrollbars \
    --window-size=1280,"$4" --screenshot="$3" "file://$PWD/$1#only=$2" 2>/dev/null
  rm -rf "$profile"
  echo "$3: $(stat -c %s "$3") bytes"
}
shot "$out/overlay.html" summary,loss,throughput docs/report-curves.png 900
shot "$out/pipeline.html" split,gantt docs/report-pipeline.png 820
shot "$out/fault.html" loss,timeline docs/report-fault.png 860
shot "$out/sweep.html" sweep docs/report-sweep.png 900
