#!/usr/bin/env bash
# The one GPU check (issue 7, item 5): on a machine with one NVIDIA GPU, the CUDA toolkit and CMake
# but without Debian's -dev packages or network, build the whole tool with CMake (the `flatpeak`
# CLI, the CUDA backend, its CPU-vs-CUDA tests, flatpeak_calibrate, cuda_techniques) for sm_90
# only, run them, and print one summary table with the device and the date. Aim: under 5
# minutes on 16 cores, so that a second run fits in the same lease. On one H200 with 16 cores
# (2026-12-04): 163 s and 137 s in all, the build 44 s and 30 s of that.
# Stages, each with its own time limit:
#   build       configure build/gpu-check (Release, CUDA on, sm_90, MPI off, benchmarks off, tests
#               on) and build only the targets below, on every core
#   CUDA tests  each tests/cuda/*_test binary (the CPU-vs-CUDA ops, the schedules,
#               verify_cuda_test), one row each (120 s each)
#   calibrate   flatpeak_calibrate -> calibration.json and a calibrated copy of the card, with
#               runtime_overhead_terms, that flatpeak must load (60 s)
#   verify      `flatpeak plan --format json` for a fixed set of plans (on the calibrated H200
#               card when there is one, so that the device view is judged), then
#               `flatpeak verify PLAN --component C --backend cuda`, one row each: at --scale 1
#               C from FLATPEAK_VERIFY_COMPONENTS (default vocab), at --scale auto from
#               FLATPEAK_VERIFY_AUTO_COMPONENTS (default "vocab checkpoint dispatch") (FLATPEAK_VERIFY_TIMEOUT per run,
#               default 60 s; the stage starts no run after FLATPEAK_VERIFY_STAGE_TIMEOUT, 150 s)
#   techniques  tools/bench/cuda_techniques.cu (vocab, dispatch, attention, checkpoint, offload figures of issue
#               7), its figures as rows (FLATPEAK_TECHNIQUES_TIMEOUT, default 150 s;
#               FLATPEAK_TECHNIQUES_ARGS replaces its default `--only vocab,dispatch,attention,checkpoint,offload`)
#   dispatch-ep cuda_techniques --only dispatch-ep (4 EP ranks sharing the GPU, PipelinedLLEP vs
#               uncapped EP per-rank peak), its own limit so the stage above keeps its time
#               (FLATPEAK_DISPATCH_EP_TIMEOUT, default 120 s; FLATPEAK_DISPATCH_EP_ARGS adds flags)
#
# Dependencies: Debian's packages where installed, else the copies in third_party/ that
# tools/vendor-deps.sh makes on a machine that has them (cmake/FlatpeakDeps.cmake picks per
# package). CUDA toolkit under $CUDA_HOME (default /usr/local/cuda); cuBLAS and NCCL from the
# toolkit, else from the machine's Python packages (nvidia-cublas, nvidia-nccl-cu13): this script
# points CUBLAS_HOME / NCCL_HOME at them. Without NCCL the nccl test is skipped.
#
# On a lent GPU machine (the device tool of this workplace):
#   1. here, on a machine with Debian's packages, in the checkout the device tool sends (the
#      session's own, not a helper's worktree):  bash tools/vendor-deps.sh   (third_party/, ~10 MiB)
#   2. the device tool's `run` with command `bash tools/gpu-check.sh` and carry ["third_party"]
#      and timeout_s 600. Carry no build folder: CMake's tree records this checkout's absolute
#      paths and is rebuilt there from scratch anyway (ccache is not on that image)
#   3. the results come back from $OUT: summary.txt, calibration.json, the calibrated card
#      (<card>.calibrated.json) and logs.tar.gz (every log and the verify JSON); the table is also
#      at the end of the command's output.
#
# Stages: FLATPEAK_GPU_CHECK_STAGES (default "tests calibrate verify techniques dispatch-ep") names
# the stages after the build that run, so that a second command on the same machine (its build
# folder kept, the build then a no-op) can run what the first one's budget left out, e.g.
#   FLATPEAK_GPU_CHECK_STAGES="techniques dispatch-ep" bash tools/gpu-check.sh
# Without the calibrate stage, verify uses the calibrated card an earlier run left in BUILD_DIR.
#
# Time: the whole script stays within FLATPEAK_GPU_CHECK_BUDGET seconds (default 540, so that one
# 600 s device command always ends with its summary): every stage's limit is cut to what is left,
# and a stage with nothing left is a "skipped: budget spent" row. Each row is also appended to
# $OUT/rows-so-far.txt as it is made, so a run killed from outside still brings its rows back.
#
# Exit status: 0 every check ran and passed; 1 a check failed (or the build did); 2 it could not
# start (no nvcc or cmake, configure failed); 77 it built and nothing failed, but no CUDA device
# was seen, so every GPU row is skipped.
#
# Usage: tools/gpu-check.sh [BUILD_DIR]   (default build/gpu-check; logs/ and summary.txt there)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# The sources that ran, as one hash: a copied working tree may carry a stale .git (the device
# tool's does), so the commit line alone cannot say what was built. The same command here, on a
# checkout, gives the hash to match: FLATPEAK_GPU_CHECK_FINGERPRINT_ONLY=1 bash tools/gpu-check.sh
source_fingerprint() {
  find CMakeLists.txt CMakePresets.json cmake models planner executor tools tests -type f \
       -not -path 'tools/gpu-results/*' -not -name '*.pyc' -print0 2>/dev/null |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
if [ -n "${FLATPEAK_GPU_CHECK_FINGERPRINT_ONLY:-}" ]; then source_fingerprint; exit 0; fi
build_dir="${1:-build/gpu-check}"
logs="$build_dir/logs"
rm -rf "$logs"
mkdir -p "$logs"
start_s=$(date +%s)
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
nvcc="$cuda_home/bin/nvcc"
if [ ! -x "$nvcc" ] && [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  nvcc=$(command -v nvcc)  # a toolkit elsewhere, on PATH
  cuda_home=$(dirname "$(dirname "$nvcc")")
fi
jobs=$(nproc 2>/dev/null || echo 4)
arch=90
summary=()  # rows "name|result|seconds|detail"
failures=0
device_seen=unknown  # yes / no, from device_query_test

budget_s="${FLATPEAK_GPU_CHECK_BUDGET:-540}"
stages=" ${FLATPEAK_GPU_CHECK_STAGES:-tests calibrate verify techniques dispatch-ep} "
stages="${stages//,/ }"
stage_on() { case "$stages" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

note() { echo "gpu-check: $*"; }
elapsed() { echo $(( $(date +%s) - start_s )); }
# A stage's time limit: `wanted` seconds, or what is left of the budget (less 20 s for the summary
# and the copy to $OUT) when that is less; 0 when nothing is left. Every `timeout` sends SIGKILL
# `kill_grace` seconds after its SIGTERM (-k), so a process that ignores SIGTERM cannot overrun
# the budget; the 20 s cover that grace too. Killed so, timeout exits 137, not 124.
kill_grace=10
killed_detail() {  # killed_detail LIMIT: a row's detail for a run timeout ended with SIGKILL (137)
  echo "killed (exit 137): SIGTERM ignored past $1 s + ${kill_grace} s, or killed by the system"
}
limit_for() {  # limit_for WANTED_SECONDS
  local left=$(( budget_s - $(elapsed) - 20 ))
  [ "$left" -lt 5 ] && { echo 0; return; }
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
add_row() {
  summary+=("$1|$2|$3|$4")
  case "$2" in FAIL*) failures=$((failures + 1)) ;; esac
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then echo "$1 | $2 | $3 s | $4" >>"$OUT/rows-so-far.txt"; fi
}
budget_row() { add_row "$1" skipped 0 "not run: the script's $budget_s s budget was spent (FLATPEAK_GPU_CHECK_BUDGET)"; }

print_summary() {
  local device
  device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
  [ -z "$device" ] && device=$(grep -h '^device 0:' "$logs"/*_test.log 2>/dev/null | head -1)
  {
    echo
    echo "flatpeak gpu-check  $(date -u '+%Y-%m-%d %H:%M UTC')  commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with changes)')  sources $(source_fingerprint)"
    echo "device: ${device:-none found}   toolkit: $("$nvcc" --version 2>/dev/null | tail -1)   arch: sm_$arch"
    local row c r s d width=28
    for row in "${summary[@]}"; do c=${row%%|*}; [ ${#c} -gt "$width" ] && width=${#c}; done
    printf '%-*s %-18s %6s  %s\n' "$width" "check" "result" "sec" "detail"
    for row in "${summary[@]}"; do
      IFS='|' read -r c r s d <<<"$row"
      printf '%-*s %-18s %6s  %s\n' "$width" "$c" "$r" "$s" "$d"
    done
    echo "total: $(elapsed) s; $failures failed"
  } | tee "$build_dir/summary.txt"
}

# Results back from the device machine: at most 8 files there, so the logs travel as one archive.
copy_out() {
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
  cp "$build_dir/summary.txt" "$OUT/"
  cp "$build_dir"/calibration.json "$build_dir"/*.calibrated.json "$OUT/" 2>/dev/null
  tar czf "$OUT/logs.tar.gz" -C "$build_dir" logs 2>/dev/null
  note "results copied to $OUT"
}

finish() {  # finish [forced status]
  print_summary
  copy_out
  if [ -n "${1:-}" ]; then exit "$1"; fi
  if [ "$failures" -gt 0 ]; then exit 1; fi
  if [ "$device_seen" = no ]; then exit 77; fi
  exit 0
}

# Stopped from outside (SIGTERM, ^C): the rows so far still make a summary and reach $OUT.
trap 'add_row "gpu-check" FAIL "$(elapsed)" "stopped by a signal after $(elapsed) s"; finish 1' TERM INT

# A set-up failure before the build still ends in a summary (and in $OUT), so the reason comes back.
setup_failed() { note "$1"; add_row "set-up" FAIL "$(elapsed)" "$1"; finish 2; }
if [ ! -x "$nvcc" ]; then setup_failed "nvcc not found at $nvcc (set CUDA_HOME); nothing can be built"; fi
# CMake and ninja may be the Python packages' (cmake, ninja) without their folder on PATH.
for tool in cmake ninja; do
  if ! command -v $tool >/dev/null 2>&1; then
    dir=$(python3 -c "import $tool; print(getattr($tool, 'CMAKE_BIN_DIR', None) or $tool.BIN_DIR)" 2>/dev/null)
    [ -n "$dir" ] && [ -x "$dir/$tool" ] && export PATH="$dir:$PATH"
  fi
done
if ! command -v cmake >/dev/null 2>&1; then setup_failed "cmake not found; nothing can be built"; fi

# ---- cuBLAS and NCCL: the toolkit's, else the Python packages' --------------------------------
# NAME: the folder above the first lib/NAME inside the Python `nvidia` namespace packages.
python_nvidia_home() {
  python3 - "$1" 2>/dev/null <<'PY'
import glob, os, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
for root in list(nvidia.__path__):
    hits = sorted(glob.glob(os.path.join(root, "**", "lib", sys.argv[1]), recursive=True))
    if hits:
        print(os.path.dirname(os.path.dirname(hits[0])))
        break
PY
}
toolkit_has() {  # GLOB: whether a library matching it lies in one of the toolkit's library folders
  local f
  # shellcheck disable=SC2086,SC2231  # $1 is a glob
  for f in "$cuda_home"/lib64/$1 "$cuda_home"/lib/$1 "$cuda_home"/targets/*/lib/$1; do [ -e "$f" ] && return 0; done
  return 1
}
lib_path=""
if ! toolkit_has 'libcublas.so*'; then
  CUBLAS_HOME="${CUBLAS_HOME:-$(python_nvidia_home 'libcublas.so.*')}"
  if [ -z "$CUBLAS_HOME" ]; then setup_failed "cuBLAS not found in $cuda_home nor in a Python nvidia-cublas package"; fi
  export CUBLAS_HOME
  lib_path="$CUBLAS_HOME/lib"
  note "cuBLAS from $CUBLAS_HOME"
fi
if [ -z "${NCCL_HOME:-}" ] && ! { toolkit_has 'libnccl.so*' && [ -f "$cuda_home/include/nccl.h" ]; }; then
  home=$(python_nvidia_home 'libnccl.so.*')
  if [ -n "$home" ] && [ -f "$home/include/nccl.h" ]; then
    export NCCL_HOME="$home"
    note "NCCL from $NCCL_HOME"
  else
    note "NCCL not found beside the toolkit nor in a Python nvidia-nccl package: the nccl test is skipped"
  fi
fi
[ -n "${NCCL_HOME:-}" ] && lib_path="$NCCL_HOME/lib${lib_path:+:$lib_path}"
# CMake's build RPATH already names these; the path also serves binaries built by an older configure.
[ -n "$lib_path" ] && export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- configure and build ---------------------------------------------------------------------
configure=(-S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DFLATPEAK_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc"
           -DCMAKE_CUDA_ARCHITECTURES="$arch" -DFLATPEAK_MPI=OFF -DFLATPEAK_BENCH=OFF -DFLATPEAK_TESTS=ON)
if [ ! -f "$build_dir/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then configure+=(-G Ninja); fi
# FLATPEAK_GPU_CHECK_CMAKE_ARGS: more configure flags, e.g. to try the device machine's set-up here
# (-DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON and so on, so that third_party/ is used as it is there).
# shellcheck disable=SC2206
configure+=(${FLATPEAK_GPU_CHECK_CMAKE_ARGS:-})
if command -v ccache >/dev/null 2>&1; then
  configure+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
note "configuring $build_dir ($("$nvcc" --version | tail -1), sm_$arch, $jobs jobs)"
if ! cmake "${configure[@]}" >"$logs/configure.log" 2>&1; then
  tail -20 "$logs/configure.log"
  note "configure failed ($logs/configure.log); without Debian's packages, run 'bash tools/vendor-deps.sh' on a machine that has them and bring third_party/ along"
  add_row "configure" FAIL "$(elapsed)" "$(grep -m1 'Error\|error' "$logs/configure.log")"
  finish 2
fi
grep '^-- flatpeak:' "$logs/configure.log" | sed 's/^-- /  /'
# flatpeak_cuda_tests: every CUDA test, flatpeak_calibrate and cuda_techniques (tests/CMakeLists.txt).
t0=$(date +%s)
build_limit=$(limit_for 100000)
if [ "$build_limit" -eq 0 ]; then budget_row "build (sm_$arch)"; finish 1; fi  # `timeout 0` would not limit it
# Keep going past a failed compile: one target that does not build on the device machine's
# compiler must not cost the rows of every other one (each missing binary is its own FAIL row).
keep_going=(-k)
grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$build_dir/CMakeCache.txt" && keep_going=(-k 0)
cuda_tests=()
for src in tests/cuda/*_test.cu tests/cuda/*_test.cpp; do name=$(basename "$src"); cuda_tests+=("${name%.*}"); done
timeout -k "$kill_grace" "$build_limit" cmake --build "$build_dir" -j "$jobs" --target flatpeak flatpeak_cuda_tests -- "${keep_going[@]}" >"$logs/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  grep -B2 -A12 -m3 'error' "$logs/build.log" | head -60
  case $rc in
    124|137) detail="stopped at the budget's $build_limit s" ;;
    *) detail="exit $rc: $(grep -c 'FAILED:\|\*\*\*' "$logs/build.log") failed steps; $(grep -m1 'error' "$logs/build.log" | cut -c1-160)" ;;
  esac
  add_row "build (sm_$arch)" FAIL "$(( $(date +%s) - t0 ))" "$detail ($logs/build.log); the stages below run what was built"
else
  add_row "build (sm_$arch)" ok "$(( $(date +%s) - t0 ))" "flatpeak, ${#cuda_tests[@]} CUDA tests, flatpeak_calibrate, cuda_techniques"
fi

# ---- CUDA tests ------------------------------------------------------------------------------
tests_to_run=()
if stage_on tests; then
  tests_to_run=("${cuda_tests[@]}")
else  # whether a device is seen still decides between exit 0 and 77
  timeout -k "$kill_grace" 60 "$build_dir/tests/device_query_test" >"$logs/device_query_test.log" 2>&1
  case $? in 0) device_seen=yes ;; 77) device_seen=no ;; esac
fi
for name in ${tests_to_run[@]+"${tests_to_run[@]}"}; do
  bin="$build_dir/tests/$name"
  if [ ! -x "$bin" ]; then
    case "$name" in
      nccl_*) add_row "$name" skipped 0 "NCCL not found (not built)" ;;
      *) add_row "$name" FAIL 0 "not built: $bin" ;;
    esac
    continue
  fi
  limit=$(limit_for 120)
  if [ "$limit" -eq 0 ]; then budget_row "$name"; continue; fi
  t0=$(date +%s)
  timeout -k "$kill_grace" "$limit" "$bin" >"$logs/$name.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  checks=$(grep -E '^[0-9]+ of [0-9]+ checks failed' "$logs/$name.log" | tail -1)
  case $rc in
    0) add_row "$name" ok "$seconds" "$checks" ;;
    77) add_row "$name" skipped "$seconds" "$(head -1 "$logs/$name.log")" ;;
    124) add_row "$name" FAIL "$seconds" "timed out after $limit s" ;;
    137) add_row "$name" FAIL "$seconds" "$(killed_detail "$limit")" ;;
    *) add_row "$name" FAIL "$seconds" "exit $rc; ${checks:-$(tail -1 "$logs/$name.log")}" ;;
  esac
  if [ "$name" = device_query_test ]; then
    case $rc in 0) device_seen=yes ;; 77) device_seen=no ;; esac
    # A GPU the driver lists but CUDA does not see (e.g. a driver older than the toolkit) would
    # otherwise turn every GPU row into "skipped": that is a failure of this machine's set-up.
    if [ "$device_seen" = no ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
      add_row "CUDA sees the GPU" FAIL 0 "nvidia-smi lists $(nvidia-smi -L | head -1 | cut -c1-60), but CUDA says: $(head -1 "$logs/$name.log")"
    fi
  fi
  grep -E '^(FAIL|ok  )' "$logs/$name.log" | sed "s/^/  [$name] /"
done

# ---- calibration: the runtime overhead terms of the hardware card ----------------------------
# A calibrated copy of the matching card (the card itself is left as it is), checked by loading it
# with flatpeak; the verify plans below use it when it is the H200's, so that verify judges the
# device's own view of a calibrated overhead.
flatpeak="$build_dir/tools/flatpeak"
verify_gpu=H200
calibrate_stage() {
  t0=$(date +%s)
  rm -f "$build_dir/calibration.json" "$build_dir"/*.calibrated.json
  calibrate_limit=$(limit_for 60)
  if [ "$calibrate_limit" -gt 0 ]; then
    timeout -k "$kill_grace" "$calibrate_limit" "$build_dir/tools/flatpeak_calibrate" >"$build_dir/calibration.json" 2>"$logs/calibrate.log"
    rc=$?
  else
    echo "not run: budget spent" >"$logs/calibrate.log"
    rc=125
  fi
  if [ $rc -eq 0 ]; then
    overhead=$(sed -n 's/.*"runtime_overhead_bytes": \([0-9]*\).*/\1/p' "$build_dir/calibration.json")
    source=$(sed -n 's/.*"overhead_source": "\(.*\)".*/\1/p' "$build_dir/calibration.json")
    detail="runtime_overhead_bytes $overhead by $source ($build_dir/calibration.json)"
    gpu_name=$(sed -n 's/.*"device": "\(.*\)".*/\1/p' "$build_dir/calibration.json")
    case "$gpu_name" in *H200*) card=models/hardware/H200.json ;; *H100*) card=models/hardware/H100-80GB.json ;; *) card="" ;; esac
    calibrated="$build_dir/$(basename "$card" .json).calibrated.json"
    if [ -n "$card" ] && python3 - "$card" "$build_dir/calibration.json" "$calibrated" 2>"$logs/calibrated-card.log" <<'PY'
import json, sys
card, cal = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
nccl = cal["nccl_bytes"] if cal["nccl_bytes"] is not None and cal["nccl_bytes"] > 0 else 0  # as the tool's total
card["runtime_overhead_bytes"] = cal["runtime_overhead_bytes"]
card["overhead_calibrated"] = True
card["runtime_overhead_terms"] = {
    "cuda_context_bytes": cal["cuda_context_bytes"], "cublas_bytes": cal["cublas_bytes"],
    "cublas_workspace_bytes": cal["cublas_workspace_bytes"], "nccl_bytes": nccl}
card.setdefault("notes", {})["runtime_overhead_bytes"] = (
    "measured by flatpeak_calibrate on %s, %s: CUDA context %d + cuBLAS %d + workspace %d + NCCL %s bytes (%s)"
    % (cal["device"], cal["date"], cal["cuda_context_bytes"], cal["cublas_bytes"], cal["cublas_workspace_bytes"], cal["nccl_bytes"],
       cal["overhead_source"]))
json.dump(card, open(sys.argv[3], "w"), indent=2)
PY
    then
      "$flatpeak" plan --model gpt-oss-120b --gpu "$calibrated" --gpus 8 --context 64K >/dev/null 2>>"$logs/calibrated-card.log"
      rc=$?
      if [ $rc -eq 0 ] || [ $rc -eq 3 ]; then
        detail="$detail; calibrated card: $calibrated"
        case "$card" in *H200*) verify_gpu="$calibrated" ;; esac
        add_row "calibrate overhead" ok "$(( $(date +%s) - t0 ))" "$detail"
      else
        add_row "calibrate overhead" FAIL "$(( $(date +%s) - t0 ))" "$detail; flatpeak rejects the calibrated card (exit $rc): $(tail -1 "$logs/calibrated-card.log")"
      fi
    elif [ -n "$card" ]; then
      add_row "calibrate overhead" FAIL "$(( $(date +%s) - t0 ))" "$detail; no calibrated card: $(tail -1 "$logs/calibrated-card.log")"
    else
      add_row "calibrate overhead" ok "$(( $(date +%s) - t0 ))" "$detail; no card for '$gpu_name'"
    fi
  else
    rm -f "$build_dir/calibration.json"
    if grep -q "no CUDA device" "$logs/calibrate.log"; then
      add_row "calibrate overhead" skipped "$(( $(date +%s) - t0 ))" "no CUDA device (the tool built)"
    elif [ $rc -eq 125 ]; then
      budget_row "calibrate overhead"
    elif [ $rc -eq 124 ]; then
      add_row "calibrate overhead" FAIL "$(( $(date +%s) - t0 ))" "timed out after $calibrate_limit s"
    elif [ $rc -eq 137 ]; then
      add_row "calibrate overhead" FAIL "$(( $(date +%s) - t0 ))" "$(killed_detail "$calibrate_limit")"
    else
      add_row "calibrate overhead" FAIL "$(( $(date +%s) - t0 ))" "exit $rc; $(tail -1 "$logs/calibrate.log")"
    fi
  fi
}
if stage_on calibrate; then
  calibrate_stage
elif [ -f "$build_dir/H200.calibrated.json" ]; then
  verify_gpu="$build_dir/H200.calibrated.json"  # an earlier run's
fi

# ---- verify: the vocab component on the GPU against the planner, for fixed plans ---------------
# Exit codes of `flatpeak verify` (tools/cli/exit_codes.h): 0 pass, 5 mismatch beyond tolerance,
# 4 backend failure (also its answer when there is no device), 2 input error, 77 skipped.
verify_plans=(  # name|flatpeak plan arguments (--gpu: H200's card, or its calibrated copy above)
  # In order of what they show, so that a stage out of time drops the least: the blocked loss
  # (the planner picks Ring-DTP at R = 1), Ring-DTP at R = 4 (the ring's 4 ranks share the GPU),
  # the materialised baseline (about 126 GiB at 64K tokens), gradients in forward with one vocab
  # block (the fused pass reads the forward's logits), another model.
  "gpt-oss-120b flatpeak|--model gpt-oss-120b --gpus 8 --context 64K --schedule flatpeak"
  "gpt-oss-120b ring4|--model gpt-oss-120b --gpus 8 --context 64K --schedule flatpeak --ring-size 4"
  "gpt-oss-120b baseline|--model gpt-oss-120b --gpus 8 --context 64K --schedule baseline"
  "gpt-oss-120b gif-1vblk|--model gpt-oss-120b --gpus 8 --context 64K --schedule flatpeak --vocab-backward in-forward --ring-size 1 --token-block 4096 --vocab-block 201088"
  "Qwen3-30B-A3B flatpeak|--model Qwen3-30B-A3B --gpus 8 --context 64K --schedule flatpeak"
)
# --scale 1 runs the plan's own sizes: the vocab component only (the checkpoint stack's attention
# is O(T²) per layer even on the tensor-core kernels: a 64K-token, 36-layer step would take
# minutes, estimated, beyond the verify limit); --scale auto runs every component with a CUDA twin
# (dispatch: the EP group's ranks share the GPU).
verify_components="${FLATPEAK_VERIFY_COMPONENTS:-vocab}"
verify_auto_components="${FLATPEAK_VERIFY_AUTO_COMPONENTS:-vocab checkpoint dispatch}"
verify_limit="${FLATPEAK_VERIFY_TIMEOUT:-60}"
verify_stage_limit="${FLATPEAK_VERIFY_STAGE_TIMEOUT:-150}"

# The largest |relative error| row of a `verify --format json` report, as "worst: ..." (or nothing).
worst_row() {
  python3 - "$1" 2>/dev/null <<'PY'
import json, sys
rows = json.load(open(sys.argv[1])).get("results", [])
rows = [r for r in rows if r.get("judged", True)] or rows  # rows not judged are only reported
if rows:
    r = max(rows, key=lambda r: abs(r["relative_error"]))
    print("worst %s %s rank %s: %+.3f%% (predicted %d, measured %d)" % (
        r["component"], r["phase"], r["rank"], 100 * r["relative_error"], r["predicted_bytes"], r["measured_bytes"]))
PY
}

verify_row() {  # verify_row ROW_NAME PLAN_JSON COMPONENT SCALE LOG_STEM
  local name="$1" plan="$2" component="$3" scale="$4" stem="$5" t0 rc seconds worst err
  if [ $(( $(date +%s) - verify_t0 )) -ge "$verify_stage_limit" ]; then
    add_row "$name" skipped 0 "not run: the verify stage's $verify_stage_limit s were spent"
    return
  fi
  local limit
  limit=$(limit_for "$verify_limit")
  if [ "$limit" -eq 0 ]; then budget_row "$name"; return; fi
  t0=$(date +%s)
  timeout -k "$kill_grace" "$limit" "$flatpeak" verify "$plan" --component "$component" --backend cuda --scale "$scale" --format json \
    >"$logs/$stem.json" 2>"$logs/$stem.err"
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  worst=$(worst_row "$logs/$stem.json")
  err=$(grep -v '^\s*$' "$logs/$stem.err" | tail -1)
  case $rc in
    0) add_row "$name" ok "$seconds" "pass; ${worst:-no rows}" ;;
    5) add_row "$name" "FAIL: mismatch" "$seconds" "beyond tolerance; ${worst:-no rows}" ;;
    77) add_row "$name" skipped "$seconds" "${err:-exit 77}" ;;
    4) if [ "$device_seen" = no ] || grep -qi 'no CUDA device' "$logs/$stem.err"; then
         add_row "$name" skipped "$seconds" "no CUDA device (exit 4)"
       else
         add_row "$name" "FAIL: backend" "$seconds" "exit 4; $err"
       fi ;;
    2) if grep -q -- '--backend' "$logs/$stem.err"; then
         add_row "$name" "FAIL" "$seconds" "--backend not accepted (exit 2): $err"
       else
         add_row "$name" "FAIL: input" "$seconds" "exit 2; $err"
       fi ;;
    124) add_row "$name" FAIL "$seconds" "timed out after $limit s" ;;
    137) add_row "$name" FAIL "$seconds" "$(killed_detail "$limit")" ;;
    *) add_row "$name" FAIL "$seconds" "exit $rc; $err" ;;
  esac
}

if stage_on verify; then
  verify_t0=$(date +%s)
  note "verify plans on --gpu $verify_gpu"
  for entry in "${verify_plans[@]}"; do
    IFS='|' read -r plan_name plan_args <<<"$entry"
    stem="verify-$(echo "$plan_name" | tr ' ' '-')"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    "$flatpeak" plan $plan_args --gpu "$verify_gpu" --format json >"$logs/$stem.plan.json" 2>"$logs/$stem.plan.err"
    rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 3 ]; then  # 3: computed but does not fit; still a plan to verify
      add_row "plan $plan_name" FAIL "$(( $(date +%s) - t0 ))" "flatpeak plan exit $rc; $(tail -1 "$logs/$stem.plan.err")"
      continue
    fi
    for component in $verify_components; do
      verify_row "verify $component $plan_name s=1" "$logs/$stem.plan.json" "$component" 1 "$stem-$component-scale1"
    done
    for component in $verify_auto_components; do
      verify_row "verify $component $plan_name s=auto" "$logs/$stem.plan.json" "$component" auto "$stem-$component-auto"
    done
  done
fi

# ---- technique benchmarks (tools/bench/cuda_techniques.cu): one row per figure it prints ------
# Each run under its own time limit (cut to the budget); figure rows printed before a timeout are
# kept. A failed section also ends cuda_techniques with exit 1, counted once in the stage's row.
benchmark_stage() {  # benchmark_stage ROW_NAME LOG_NAME WANTED_SECONDS CUDA_TECHNIQUES_ARGS...
  local name="$1" log="$logs/$2" tag="${2%.log}" limit rc seconds t0 c r d
  limit=$(limit_for "$3")
  shift 3
  if [ "$limit" -eq 0 ]; then budget_row "$name"; return; fi
  t0=$(date +%s)
  timeout -k "$kill_grace" "$limit" "$build_dir/tools/cuda_techniques" "$@" >"$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  local figure_failures=0
  while IFS='|' read -r _ c r d; do
    summary+=("$c|$r|-|$d")
    case "$r" in FAIL*) figure_failures=$((figure_failures + 1)) ;; esac
    if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then echo "$c | $r | - | $d" >>"$OUT/rows-so-far.txt"; fi
  done < <(grep '^summary|' "$log")
  # A figure judged FAIL (PipelinedLLEP's ratio, the attention kernels' agreement, SCO's bits, a
  # dispatch-ep run that failed) ends cuda_techniques with exit 0; counted here, or the table
  # would say "0 failed" and the script exit 0 under a FAIL row. A non-zero exit (a section that
  # threw) is counted once, by the stage's own row below.
  [ "$rc" -eq 0 ] && failures=$((failures + figure_failures))
  case $rc in
    0) add_row "$name" ok "$seconds" "figures above; full output: $log" ;;
    77) add_row "$name" skipped "$seconds" "$(head -1 "$log")" ;;
    124) add_row "$name" FAIL "$seconds" "timed out after $limit s (rows above: the figures printed before)" ;;
    137) add_row "$name" FAIL "$seconds" "$(killed_detail "$limit") (rows above: the figures printed before)" ;;
    *) add_row "$name" FAIL "$seconds" "exit $rc; $(grep -v '^summary|' "$log" | tail -1)" ;;
  esac
  grep -v '^summary|' "$log" | sed "s/^/  [$tag] /"
}

# FLATPEAK_TECHNIQUES_ARGS: the flags, e.g. "--only vocab --big 262144" (default: every section
# but dispatch-ep, which runs next under its own limit, so the sections here keep their time).
# shellcheck disable=SC2086
stage_on techniques && benchmark_stage "technique benchmarks" cuda_techniques.log "${FLATPEAK_TECHNIQUES_TIMEOUT:-150}" \
  ${FLATPEAK_TECHNIQUES_ARGS:---only vocab,dispatch,attention,checkpoint,offload}
# Dispatch at EP = 4 on the one GPU: PipelinedLLEP against uncapped EP, per-rank peaks.
# shellcheck disable=SC2086
stage_on dispatch-ep && benchmark_stage "dispatch EP=4 benchmark" cuda_techniques_dispatch_ep.log "${FLATPEAK_DISPATCH_EP_TIMEOUT:-120}" \
  --only dispatch-ep ${FLATPEAK_DISPATCH_EP_ARGS:-}

finish
