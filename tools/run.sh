#!/usr/bin/env bash
# The main job on a fresh Debian machine: install dependencies, build, and print the plan for
# the default scenario. Extra arguments replace the default scenario's flatpeak arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh
cmake --preset dev -DFLATPEAK_TESTS=OFF -DFLATPEAK_BENCH=OFF >/dev/null
cmake --build --preset dev -j "$(nproc)" --target flatpeak >/dev/null
if [ $# -eq 0 ]; then
  # The default scenario: gpt-oss-120b at a 1M-token context on 64 H200s, all four techniques.
  set -- plan --model gpt-oss-120b --gpu H200 --gpus 64 --context 1M --schedule flatpeak
fi
exec build/dev/tools/flatpeak "$@"
