#!/usr/bin/env bash
# Wall time of whole `flatpeak plan` CLI calls (process start, card loading, knob search, the plan
# with its baseline, printing), as a user sees it. Target (issue 4): <= 20 ms per call.
#   tools/bench/cli_latency.sh [path/to/flatpeak] [runs]      # default build/dev/tools/flatpeak, 50
# Prints the mean per call for each command, and `flatpeak --version` as the floor a process start
# costs on this machine. Pin it to one core (taskset -c 0 tools/bench/cli_latency.sh ...) to match
# the targets' machine.
set -eu
binary=${1:-build/dev/tools/flatpeak}
runs=${2:-50}
if [ ! -x "$binary" ]; then
  echo "cli_latency.sh: no flatpeak binary at $binary (build it, or pass its path)" >&2
  exit 2
fi

commands=(
  "--version"
  "plan --model gpt-oss-120b --gpu H200 --gpus 64 --context 1M --schedule flatpeak"
  "plan --model DeepSeek-V3 --gpu H200 --gpus 64 --context 1M --schedule flatpeak --cp auto --format json"
  "plan --model Qwen3-235B-A22B --gpu H100-80GB --gpus 32 --context 128K --schedule baseline"
)

for cmd in "${commands[@]}"; do
  # shellcheck disable=SC2086  # the command's words are meant to split
  "$binary" $cmd >/dev/null 2>&1 || true  # warm the page cache
  start=$(date +%s%N)
  for ((i = 0; i < runs; ++i)); do
    # shellcheck disable=SC2086
    "$binary" $cmd >/dev/null 2>&1 || true
  done
  end=$(date +%s%N)
  awk -v ns=$((end - start)) -v n="$runs" -v c="$cmd" 'BEGIN { printf "%7.2f ms per call (%d calls)  flatpeak %s\n", ns / n / 1e6, n, c }'
done
