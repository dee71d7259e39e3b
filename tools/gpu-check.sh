#!/usr/bin/env bash
# The one GPU check (issue 7, item 5): on a machine with one NVIDIA GPU and the CUDA toolkit but
# without Debian's packages or network, build the CUDA backend and its CPU-vs-CUDA tests for
# sm_90 only, run them, and print one summary table with the device and the date. Budget: under
# 5 minutes, so that a second run fits in the same lease. Then the technique benchmark
# (tools/bench/cuda_techniques.cu: vocab, dispatch, offload figures of issue 7) under its own time
# limit (FLATPEAK_TECHNIQUES_TIMEOUT, default 150 s; FLATPEAK_TECHNIQUES_ARGS passes flags), its
# figures as rows of the same table.
#
# Needs: bash, a C++17 host compiler (g++ or $CXX), the CUDA toolkit (nvcc, cudart, cuBLAS) under
# $CUDA_HOME (default /usr/local/cuda); cuBLAS may instead come from a Python package
# (site-packages/nvidia/cublas/lib). Eigen (header-only) for the CPU reference ops: found in
# third_party/eigen, third_party/eigen3, $EIGEN_INCLUDE_DIR or /usr/include/eigen3; without it
# the op tests are reported as skipped (the allocator and device tests still run).
# Does NOT need CMake, nlohmann-json, fmt, CLI11 or GoogleTest: it compiles only executor/memory,
# executor/cpu, executor/cuda, executor/schedules/vocab_schedule.cpp (the CPU twin
# schedules_cuda_test compares with), tests/cuda and tools/bench/cuda_techniques.cu, which
# include none of them.
#
# Usage: tools/gpu-check.sh [OUT_DIR]   (default build/gpu-check; logs and summary.txt there)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-build/gpu-check}"
mkdir -p "$out_dir/obj" "$out_dir/bin" "$out_dir/logs"
start_s=$(date +%s)
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
nvcc="$cuda_home/bin/nvcc"
cxx="${CXX:-g++}"
jobs=$(nproc 2>/dev/null || echo 4)
arch=sm_90
summary=()  # rows "name|result|seconds|detail"

note() { echo "gpu-check: $*"; }
elapsed() { echo $(( $(date +%s) - start_s )); }

if [ ! -x "$nvcc" ]; then
  note "nvcc not found at $nvcc (set CUDA_HOME); nothing can be built"
  exit 2
fi

# ---- libraries -------------------------------------------------------------------------------
cublas_flags=(-L"$cuda_home/lib64" -lcublas)
lib_path="$cuda_home/lib64"
if ! ls "$cuda_home"/lib64/libcublas.so* >/dev/null 2>&1; then
  py_cublas=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
  so=$(ls "$py_cublas"/libcublas.so.* 2>/dev/null | head -1)
  if [ -n "$so" ]; then
    note "cuBLAS from the Python package: $so"
    lt=$(ls "$py_cublas"/libcublasLt.so.* 2>/dev/null | head -1)
    cublas_flags=(-L"$py_cublas" "-l:$(basename "$so")")
    [ -n "$lt" ] && cublas_flags+=("-l:$(basename "$lt")")
    lib_path="$py_cublas:$lib_path"
  else
    note "cuBLAS not found in $cuda_home/lib64 nor in a Python nvidia-cublas package"
    exit 2
  fi
fi
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# NCCL (the nccl communicator's one-rank smoke test): beside the toolkit or from a Python package.
nccl_flags=()
for d in "$cuda_home/lib" "$cuda_home/lib64" $(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null); do
  so=$(ls "$d"/libnccl.so* 2>/dev/null | head -1)
  if [ -n "$so" ] && { [ -f "$cuda_home/include/nccl.h" ] || [ -f "$d/../include/nccl.h" ]; }; then
    nccl_flags=(-L"$d" "-l:$(basename "$so")")
    [ -f "$d/../include/nccl.h" ] && nccl_flags+=(-I"$d/../include")
    lib_path="$d:$lib_path"
    break
  fi
done
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

eigen_dir=""
for d in third_party/eigen third_party/eigen3 "${EIGEN_INCLUDE_DIR:-}" /usr/include/eigen3 /usr/local/include/eigen3; do
  if [ -n "$d" ] && [ -f "$d/Eigen/Core" ]; then eigen_dir="$d"; break; fi
done

# ---- compile ---------------------------------------------------------------------------------
host_flags=(-std=c++17 -O2 -fno-math-errno -I. -Iplanner -isystem "$cuda_home/include")
nvcc_flags=(-std=c++17 -O2 -arch="$arch" -I. -Iplanner -Xcompiler=-Wall,-Wextra)
for f in "${nccl_flags[@]}"; do case "$f" in -I*) host_flags+=("$f"); nvcc_flags+=("$f") ;; esac; done
objects=()
compile_pids=()
compile_logs=()
compile() {  # compile SRC with nvcc or the host compiler, in the background
  local src="$1" obj="$out_dir/obj/$(echo "$1" | tr '/' '_').o" log="$out_dir/logs/$(echo "$1" | tr '/' '_').log"
  objects+=("$obj")
  compile_logs+=("$log")
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 0.2; done
  case "$src" in
    *.cu) "$nvcc" "${nvcc_flags[@]}" -c "$src" -o "$obj" >"$log" 2>&1 & ;;
    *) "$cxx" "${host_flags[@]}" ${eigen_dir:+-isystem "$eigen_dir"} -c "$src" -o "$obj" >"$log" 2>&1 & ;;
  esac
  compile_pids+=($!)
}
wait_compiles() {  # 0 when every background compile succeeded; failing logs are printed
  local failed=0 i
  for i in "${!compile_pids[@]}"; do
    if ! wait "${compile_pids[$i]}"; then failed=1; note "compile failed: ${compile_logs[$i]}"; tail -20 "${compile_logs[$i]}"; fi
  done
  compile_pids=()
  compile_logs=()
  return $failed
}

note "building for $arch with $("$nvcc" --version | tail -1), $jobs jobs; Eigen: ${eigen_dir:-not found}"
lib_sources=(executor/memory/tensor.cpp executor/memory/tracking_allocator.cpp executor/cuda/*.cpp executor/cuda/*.cu
             executor/comm/communicator.cpp executor/comm/threads_comm.cpp planner/spec/errors.cpp)
if [ ${#nccl_flags[@]} -gt 0 ]; then lib_sources+=(executor/cuda/nccl/nccl_comm.cpp); fi
if [ -n "$eigen_dir" ]; then lib_sources+=(executor/cpu/*.cpp executor/schedules/vocab_schedule.cpp); fi
for src in "${lib_sources[@]}"; do compile "$src"; done
test_sources=()
for src in tests/cuda/*_test.cu; do
  case "$(basename "$src")" in
    nccl_*) if [ ${#nccl_flags[@]} -eq 0 ]; then summary+=("$(basename "$src" .cu)|skipped|0|NCCL not found"); continue; fi ;;
  esac
  test_sources+=("$src")
done
lib_objects=("${objects[@]}")
objects=()
for src in "${test_sources[@]}"; do compile "$src"; done
test_objects=("${objects[@]}")
# The technique benchmark calls the CPU twins (workspace sizes, the CPU AdamW): only with Eigen.
objects=()
[ -n "$eigen_dir" ] && compile tools/bench/cuda_techniques.cu
bench_objects=("${objects[@]}")
if ! wait_compiles; then
  note "build failed after $(elapsed) s"
  exit 1
fi
ar rcs "$out_dir/libflatpeak_gpu_check.a" "${lib_objects[@]}"
build_s=$(elapsed)
summary+=("build ($arch)|ok|$build_s|${#lib_sources[@]} library sources, ${#test_sources[@]} tests")

# ---- run -------------------------------------------------------------------------------------
needs_cpu_ops() { grep -q -e 'executor/cuda/ops_cuda.h' -e 'executor/schedules/' "$1"; }
failures=0
for i in "${!test_sources[@]}"; do
  src="${test_sources[$i]}"
  name=$(basename "$src" .cu)
  if [ -z "$eigen_dir" ] && needs_cpu_ops "$src"; then
    summary+=("$name|skipped|0|Eigen not found: the CPU reference ops cannot be built")
    continue
  fi
  t0=$(date +%s)
  if ! "$nvcc" -arch="$arch" "${test_objects[$i]}" "$out_dir/libflatpeak_gpu_check.a" \
        "${cublas_flags[@]}" "${nccl_flags[@]}" -lpthread -ldl -o "$out_dir/bin/$name" >"$out_dir/logs/$name.link.log" 2>&1; then
    summary+=("$name|FAIL|0|link failed: $out_dir/logs/$name.link.log")
    failures=$((failures + 1))
    continue
  fi
  timeout 120 "$out_dir/bin/$name" >"$out_dir/logs/$name.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  checks=$(grep -E '^[0-9]+ of [0-9]+ checks failed' "$out_dir/logs/$name.log" | tail -1)
  case $rc in
    0) result=ok ;;
    77) result=skipped; checks=$(head -1 "$out_dir/logs/$name.log") ;;
    124) result=FAIL; checks="timed out after 120 s"; failures=$((failures + 1)) ;;
    *) result=FAIL; checks="exit $rc; ${checks:-$(tail -1 "$out_dir/logs/$name.log")}"; failures=$((failures + 1)) ;;
  esac
  summary+=("$name|$result|$seconds|$checks")
  grep -E '^(FAIL|ok  )' "$out_dir/logs/$name.log" | sed "s/^/  [$name] /"
done

# ---- calibration: the runtime overhead terms of the hardware card ----------------------------
t0=$(date +%s)
cal_defs=()
[ ${#nccl_flags[@]} -gt 0 ] && cal_defs=(-DFLATPEAK_HAVE_NCCL)
if "$nvcc" "${nvcc_flags[@]}" "${cal_defs[@]}" tools/calibrate/calibrate_overhead.cu "$out_dir/libflatpeak_gpu_check.a" \
     "${cublas_flags[@]}" "${nccl_flags[@]}" -lpthread -ldl -o "$out_dir/bin/flatpeak_calibrate" >"$out_dir/logs/calibrate.build.log" 2>&1 &&
   "$out_dir/bin/flatpeak_calibrate" >"$out_dir/calibration.json" 2>"$out_dir/logs/calibrate.log"; then
  overhead=$(sed -n 's/.*"runtime_overhead_bytes": \([0-9]*\).*/\1/p' "$out_dir/calibration.json")
  source=$(sed -n 's/.*"overhead_source": "\(.*\)".*/\1/p' "$out_dir/calibration.json")
  detail="runtime_overhead_bytes $overhead by $source ($out_dir/calibration.json)"
  # A calibrated copy of the card (python3 when present; the card itself is left as it is).
  gpu_name=$(sed -n 's/.*"device": "\(.*\)".*/\1/p' "$out_dir/calibration.json")
  case "$gpu_name" in *H200*) card=models/hardware/H200.json ;; *H100*) card=models/hardware/H100-80GB.json ;; *) card="" ;; esac
  if [ -n "$card" ] && command -v python3 >/dev/null 2>&1; then
    python3 - "$card" "$out_dir/calibration.json" "$out_dir/$(basename "$card" .json).calibrated.json" <<'PY'
import json, sys
card, cal = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
card["runtime_overhead_bytes"] = cal["runtime_overhead_bytes"]
card["overhead_calibrated"] = True
card.setdefault("notes", {})["runtime_overhead_bytes"] = (
    "measured by flatpeak_calibrate on %s, %s: CUDA context %d + cuBLAS %d + workspace %d + NCCL %s bytes (%s)"
    % (cal["device"], cal["date"], cal["cuda_context_bytes"], cal["cublas_bytes"], cal["cublas_workspace_bytes"], cal["nccl_bytes"],
       cal["overhead_source"]))
json.dump(card, open(sys.argv[3], "w"), indent=2)
PY
    detail="$detail; calibrated card: $out_dir/$(basename "$card" .json).calibrated.json"
  fi
  summary+=("calibrate overhead|ok|$(( $(date +%s) - t0 ))|$detail")
elif grep -q "no CUDA device" "$out_dir/logs/calibrate.log" 2>/dev/null; then
  summary+=("calibrate overhead|skipped|$(( $(date +%s) - t0 ))|no CUDA device (the tool built)")
else
  summary+=("calibrate overhead|FAIL|$(( $(date +%s) - t0 ))|$(cat "$out_dir/logs/calibrate.log" "$out_dir/logs/calibrate.build.log" 2>/dev/null | tail -1)")
  failures=$((failures + 1))
fi

summary+=("verify (fixed plans)|not yet available|0|flatpeak verify has no CUDA backend yet, and the CLI needs nlohmann-json, fmt and CLI11")
# ---- technique benchmarks (tools/bench/cuda_techniques.cu): one row per figure it prints ------
# Its own time limit keeps the script under 5 minutes; rows printed before a timeout are kept.
t0=$(date +%s)
tech_limit="${FLATPEAK_TECHNIQUES_TIMEOUT:-150}"
tech_log="$out_dir/logs/cuda_techniques.log"
if [ ${#bench_objects[@]} -eq 0 ]; then
  summary+=("technique benchmarks|skipped|0|Eigen not found: the CPU twins the schedules call cannot be built")
elif ! "$nvcc" -arch="$arch" "${bench_objects[0]}" "$out_dir/libflatpeak_gpu_check.a" "${cublas_flags[@]}" \
        -lpthread -ldl -o "$out_dir/bin/cuda_techniques" >"$out_dir/logs/cuda_techniques.link.log" 2>&1; then
  summary+=("technique benchmarks|FAIL|0|link failed: $out_dir/logs/cuda_techniques.link.log")
  failures=$((failures + 1))
else
  # FLATPEAK_TECHNIQUES_ARGS: extra flags, e.g. "--only vocab --big 262144".
  # shellcheck disable=SC2086
  timeout "$tech_limit" "$out_dir/bin/cuda_techniques" ${FLATPEAK_TECHNIQUES_ARGS:-} >"$tech_log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  while IFS='|' read -r _ c r d; do summary+=("$c|$r|-|$d"); done < <(grep '^summary|' "$tech_log")
  case $rc in
    0) summary+=("technique benchmarks|ok|$seconds|figures above; full output: $tech_log") ;;
    77) summary+=("technique benchmarks|skipped|$seconds|$(head -1 "$tech_log")") ;;
    124) summary+=("technique benchmarks|FAIL|$seconds|timed out after $tech_limit s (rows above: the figures printed before)"); failures=$((failures + 1)) ;;
    *) summary+=("technique benchmarks|FAIL|$seconds|exit $rc; $(grep -v '^summary|' "$tech_log" | tail -1)"); failures=$((failures + 1)) ;;
  esac
  grep -v '^summary|' "$tech_log" | sed 's/^/  [cuda_techniques] /'
fi

# ---- summary ---------------------------------------------------------------------------------
device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
[ -z "$device" ] && device=$(grep -h '^device 0:' "$out_dir"/logs/*_test.log 2>/dev/null | head -1)
{
  echo
  echo "flatpeak gpu-check  $(date -u '+%Y-%m-%d %H:%M UTC')  commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "device: ${device:-none found}   toolkit: $("$nvcc" --version | tail -1)   arch: $arch"
  printf '%-28s %-18s %6s  %s\n' "check" "result" "sec" "detail"
  for row in "${summary[@]}"; do
    IFS='|' read -r c r s d <<<"$row"
    printf '%-28s %-18s %6s  %s\n' "$c" "$r" "$s" "$d"
  done
  echo "total: $(elapsed) s; $failures failed"
} | tee "$out_dir/summary.txt"
[ "$failures" -eq 0 ]
