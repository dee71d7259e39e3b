#!/usr/bin/env bash
# Every test on a fresh Debian machine: install dependencies; build and run the ci preset
# (warnings as errors) and the asan preset (unit + golden under ASan/UBSan); compile the CUDA
# code for sm_90 when nvcc is present and run its tests (skipped, exit 77, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh
jobs=$(nproc)

echo "== ci preset: build and test"
cmake --preset ci >/dev/null
cmake --build --preset ci -j "$jobs"
ctest --preset ci -j "$jobs"

echo "== asan preset: unit and golden tests under ASan/UBSan"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --preset asan -j "$jobs"

if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then
  echo "== cuda preset: compile for sm_90; GPU tests report skipped without a device"
  cmake --preset cuda >/dev/null
  cmake --build --preset cuda -j "$jobs" --target flatpeak_cuda_tests
  ctest --preset cuda -j "$jobs" -L cuda
else
  echo "== cuda preset: nvcc not found, CUDA build not exercised"
fi
