#!/usr/bin/env bash
# Predicted vs measured tables for executor/README.md, from the real CLI: for each model shape and
# schedule, `flatpeak plan` at 8 x H200, 64K context, then `flatpeak verify --scale auto
# --component vocab` (the table's loss and gradient columns are then the vocab component's).
#   tools/verify_tables.sh build/verify/tools/flatpeak > table.md
set -euo pipefail
FLATPEAK=${1:-build/verify/tools/flatpeak}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| model | schedule | component | phase | predicted B | measured B | rel. error | max abs dloss | max abs dgrad |"
echo "|---|---|---|---|---:|---:|---:|---:|---:|"
for model in gpt-oss-120b Qwen3-30B-A3B DeepSeek-V3; do
  for schedule in baseline practice flatpeak; do
    "$FLATPEAK" plan --model "$model" --gpu H200 --gpus 8 --context 64K --schedule "$schedule" --format json \
      > "$tmp/plan.json" || true   # exit 3 (does not fit) still writes the plan
    "$FLATPEAK" verify "$tmp/plan.json" --scale auto --component vocab --format json > "$tmp/verify.json" || true
    python3 - "$model" "$schedule" "$tmp/verify.json" <<'PY'
import json, sys
model, schedule, path = sys.argv[1:4]
r = json.load(open(path))
for row in r["results"]:
    print(f"| {model} | {schedule} | {row['component']} | {row['phase']} | {row['predicted_bytes']} | "
          f"{row['measured_bytes']} | {100 * row['relative_error']:+.2f}% | {r['max_abs_dloss']:.3g} | {r['max_abs_dgrad']:.3g} |")
PY
  done
done
