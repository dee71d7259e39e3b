#!/usr/bin/env bash
# Every test on a fresh Debian machine: install dependencies; build and run the asan preset (unit
# and golden tests under ASan/UBSan, CUDA off); then, when nvcc is present, the cuda preset (every
# CPU target and the CUDA code for sm_90, warnings as errors) runs every test, the GPU ones
# reporting Skipped (exit 77) without a device, never Passed; without nvcc the ci preset (the same
# CPU targets and tests, warnings as errors) runs them instead. A run with no tests is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh
jobs=$(nproc)

# Under ASan each of these takes 8-60 s and runs a path that a lighter test already runs under
# it: the brute-force knob search (pure planner arithmetic), the same verify repeated for another
# model, and the mutation tests that raise one predicted term and expect verify to fail (their
# verify run is the passing test's). They run unsanitised in the last preset, like every test.
asan_repeats='^(PlannerKnobSearch\.ChosenKnobsAreOptimalByBruteForce'
asan_repeats+='|VerifyIndependence\.StrippedPlanVerifiesIdentically'
asan_repeats+='|VerifyLayer\.(Glm45|Qwen3_235b|Qwen3_30b)WithinOnePercent'
asan_repeats+='|(VerifyIndependence|VerifyStepRanksTerms|VerifyLayer|VerifyStep)\.OnePredictedTermRaisedTwoPercentFails'
asan_repeats+='|VerifyStepRanksTerms\.DispatchTermRaisedTwoPercentFailsAtEpFour'
asan_repeats+='|VerifyVocabRing\.CatchesAPredictionTwoPercentTooHigh'
asan_repeats+='|VerifyCheckpoint\.APredictionRaisedByTwoPercentFails'
# Plans of 2258 mutated cards (2 min under ASan); their loads run sanitised in the test before it.
asan_repeats+='|PlannerInputMutation\.EveryMutatedCardThatLoadsPlans)$'
# The same holds for most cases of two parameterised verifies (20-30 s each under ASan): two
# checkpoint plans of nine and four step-on-ranks cases of eight stay under it, the rest run
# unsanitised. Their names end in "  # GetParam() = ...", hence ( |$) instead of $. CMake's
# regular expressions allow 9 groups: past that ctest reports a compile error and excludes nothing.
ck='RealCards/VerifyCheckpointShapes\.[A-Za-z]+/'
sr='Cards/VerifyStepRanks\.[A-Za-z]+/'
asan_cases="^(${ck}gpt_oss_practice|${ck}gpt_oss_flatpeak|${ck}qwen3_baseline|${ck}qwen3_practice"
asan_cases+="|${ck}qwen3_flatpeak|${ck}deepseek_baseline|${ck}deepseek_flatpeak"
asan_cases+="|${sr}Qwen3_30B_A3B_[a-z]+_ep[0-9]+|${sr}gpt_oss_120b_baseline_ep1)( |\$)"

echo "== asan preset: unit and golden tests under ASan/UBSan (CUDA off, warnings as errors)"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
# Captured first: with pipefail, grep -q leaving early could fail ctest's write and the test.
asan_listing=$(ctest --preset asan -N -E "$asan_repeats|$asan_cases" 2>&1 || true)
if grep -q 'RegularExpression::compile' <<<"$asan_listing"; then
  echo "tools/test.sh: the asan exclusion pattern does not compile (ctest would exclude nothing)" >&2
  exit 1
fi
ASAN_OPTIONS=detect_leaks=1 ctest --preset asan -j "$jobs" --no-tests=error -E "$asan_repeats|$asan_cases"

if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then
  echo "== cuda preset: every target, CUDA for sm_90; every test (GPU tests report skipped without a device)"
  preset=cuda
else
  echo "== ci preset: nvcc not found; every CPU target and test (warnings as errors)"
  preset=ci
fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$jobs"
ctest --preset "$preset" -j "$jobs" --no-tests=error
