#!/usr/bin/env bash
# Every test on a fresh Debian machine: install dependencies; compile the CUDA code for sm_90 when
# nvcc is present and run its tests (each reports Skipped, exit 77, without a GPU: never Passed);
# build and run the asan preset (unit + golden under ASan/UBSan); build and run the ci preset
# (warnings as errors, every test). A run with no tests is an error, never a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh
jobs=$(nproc)

if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then
  echo "== cuda preset: compile for sm_90; GPU tests report skipped without a device"
  cmake --preset cuda >/dev/null
  cmake --build --preset cuda -j "$jobs" --target flatpeak_cuda_tests
  ctest --preset cuda -j "$jobs" -L cuda --no-tests=error
else
  echo "== cuda preset: nvcc not found, CUDA build not exercised"
fi

echo "== asan preset: unit and golden tests under ASan/UBSan"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --preset asan -j "$jobs" --no-tests=error

echo "== ci preset: build and run every test (warnings as errors)"
cmake --preset ci >/dev/null
cmake --build --preset ci -j "$jobs"
ctest --preset ci -j "$jobs" --no-tests=error
