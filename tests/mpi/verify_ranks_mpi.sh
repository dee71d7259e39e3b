#!/usr/bin/env bash
# `flatpeak verify` under mpirun: 4 processes give the same report (rank 0 prints one JSON document)
# and the same exit code as 4 thread ranks, for the dispatch component, for a default verify
# (every component, --scale auto; its step runs on the 4 ranks at EP = 4, each MoE layer's
# dispatch crossing them), for the whole step on 4 ranks with FSDP at EP = 1 (an
# OLMoE-1B-7B --gpus 4 --ep 1 plan, --scale 64) and for the dispatch component of a --gpus 4
# --ep 2 plan (two EP groups, each on its own MPI_Comm_split communicator) and the whole step of
# that plan (EP groups and expert replicas, both split communicators), and the layer component and
# the whole step of a gpt-oss-20b --gpus 4 --cp 2 plan (rings of 2 ranks: a sliding window's halo
# and full attention's ring, in CP groups split from the job), all of which pass
# (exit 0); a job whose process count differs
# from the plan's ranks ends with exit 2 and says so; an unwritable --trace ends every process with
# exit 2 before the run, and a failed run leaves an old trace whole. Every step runs under its own timeout (then
# SIGKILL 10 s later) and is announced first, so a hang names the step and the script always ends,
# with a message, before CTest's limit.
#   verify_ranks_mpi.sh FLATPEAK MPIRUN NP_FLAG [MPIRUN OPTIONS...]   (CTest mpi.verify_ranks)
set -u
flatpeak=$1 mpirun=$2 np_flag=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "verify_ranks_mpi: FAILED: $*"; exit 1; }
step() { echo "verify_ranks_mpi: $(date +%T) $*"; }
limit() { timeout --kill-after=10 "$@"; }  # limit SECONDS CMD...

step "plan: Qwen3-30B-A3B, --gpus 4 --ep 4, flatpeak, rho=2.5"
limit 20 "$flatpeak" plan --model Qwen3-30B-A3B --gpus 4 --ep 4 --context 64K --gpu H200 --schedule flatpeak \
  --imbalance rho=2.5 --format json >"$dir/plan.json" 2>"$dir/plan.err"
rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || fail "plan exited $rc: $(cat "$dir/plan.err")"
step "plan: OLMoE-1B-7B, --gpus 4 --ep 1, flatpeak"
limit 20 "$flatpeak" plan --model OLMoE-1B-7B --gpus 4 --ep 1 --context 16K --gpu H200 --schedule flatpeak \
  --format json >"$dir/plan_ep1.json" 2>"$dir/plan_ep1.err"
rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || fail "plan (EP = 1) exited $rc: $(cat "$dir/plan_ep1.err")"
plan=$dir/plan.json  # the plan verify_both verifies

# verify_both NAME LIMIT_S [VERIFY OPTIONS...]: threads, then mpirun -np 4; both exit 0 with the same report.
verify_both() {
  local name=$1 seconds=$2
  shift 2
  step "$name: 4 thread ranks"
  limit "$seconds" "$flatpeak" verify "$plan" --format json "$@" >"$dir/$name.threads.json" 2>"$dir/$name.threads.err"
  local threads_rc=$?
  [ $threads_rc = 0 ] || fail "$name: threads run exited $threads_rc (expected 0): $(cat "$dir/$name.threads.err") $(grep -B2 -A6 '"relative_error"' "$dir/$name.threads.json" | head -40)"
  step "$name: mpirun $np_flag 4"
  limit "$seconds" "$mpirun" "$np_flag" 4 "${mpirun_options[@]}" "$flatpeak" verify "$plan" --format json "$@" \
    >"$dir/$name.mpi.json" 2>"$dir/$name.mpi.err"
  local mpi_rc=$?
  [ $mpi_rc = 0 ] || fail "$name: mpirun $np_flag 4 exited $mpi_rc (expected 0; 124/137: timed out): $(cat "$dir/$name.mpi.err")"
  [ "$(grep -c '"plan":' "$dir/$name.mpi.json")" = 1 ] ||
    fail "$name: expected one JSON document (rank 0 only), got $(grep -c '"plan":' "$dir/$name.mpi.json"); stderr: $(cat "$dir/$name.mpi.err")"
  grep -q '"ranks": 4' "$dir/$name.mpi.json" || fail "$name: expected \"ranks\": 4"
  grep -q '"launcher": "mpi"' "$dir/$name.mpi.json" || fail "$name: expected \"launcher\": \"mpi\""
  sed 's/"launcher": "mpi"/"launcher": "threads"/' "$dir/$name.mpi.json" | diff -u "$dir/$name.threads.json" - ||
    fail "$name: the MPI report differs from the threads report (above)"
}
mpirun_options=("$@")
verify_both dispatch 40 --scale auto --component dispatch
verify_both default 60 --scale auto
grep -q 'step: 4 ranks, FSDP with EP = 4' "$dir/default.mpi.json" || fail "default: the MPI report's step is not the 4-rank step at EP = 4"
plan=$dir/plan_ep1.json
verify_both step 40 --scale 64 --component step
grep -q 'step: 4 ranks, FSDP at EP = 1' "$dir/step.mpi.json" || fail "step: the MPI report does not come from the 4-rank step"

step "plan: Qwen3-30B-A3B, --gpus 4 --ep 2 (two EP groups), flatpeak, rho=1.8"
limit 20 "$flatpeak" plan --model Qwen3-30B-A3B --gpus 4 --ep 2 --context 64K --gpu H200 --schedule flatpeak \
  --imbalance rho=1.8 --format json >"$dir/plan_ep2.json" 2>"$dir/plan_ep2.err"
rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || fail "plan (--ep 2) exited $rc: $(cat "$dir/plan_ep2.err")"
plan=$dir/plan_ep2.json
verify_both dispatch_ep2 40 --scale auto --component dispatch
grep -q '2 EP groups of 2 ranks' "$dir/dispatch_ep2.mpi.json" || fail "dispatch_ep2: the EP groups did not run: $(grep -A3 '"notes"' "$dir/dispatch_ep2.mpi.json")"
verify_both step_ep2 40 --scale auto --component step
grep -q 'step: 4 ranks, FSDP with EP = 2' "$dir/step_ep2.mpi.json" || fail "step_ep2: the MPI report does not come from the 4-rank step at EP = 2"

step "plan: gpt-oss-20b, --gpus 4 --cp 2 (sliding-window layers with a halo, full layers on the ring), flatpeak"
limit 20 "$flatpeak" plan --model gpt-oss-20b --gpus 4 --cp 2 --context 64K --gpu H200 --schedule flatpeak --mtp off \
  --format json >"$dir/plan_cp2.json" 2>"$dir/plan_cp2.err"
rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || fail "plan (--cp 2) exited $rc: $(cat "$dir/plan_cp2.err")"
plan=$dir/plan_cp2.json
verify_both layer_cp2 30 --component layer
grep -q 'a halo of the previous rank.s last 127 keys, on CP = 2 ranks' "$dir/layer_cp2.mpi.json" ||
  fail "layer_cp2: the halo did not run on a ring of 2 MPI ranks: $(grep -A4 '"notes"' "$dir/layer_cp2.mpi.json")"
verify_both step_cp2 30 --component step
grep -q 'ring attention in CP groups of 2 ranks' "$dir/step_cp2.mpi.json" || fail "step_cp2: the MPI report's step has no CP groups"

step "mpirun $np_flag 2 on the 4-rank plan"
limit 20 "$mpirun" "$np_flag" 2 "$@" "$flatpeak" verify "$dir/plan.json" --component dispatch >"$dir/np2.out" 2>"$dir/np2.err"
np2_rc=$?
[ $np2_rc = 2 ] || fail "mpirun $np_flag 2 on a 4-rank plan exited $np2_rc (expected 2): $(cat "$dir/np2.err")"
grep -q "the job has 2 processes but the scaled configuration has 4 ranks" "$dir/np2.err" ||
  fail "missing the process-count message: $(cat "$dir/np2.err")"
# --trace under MPI: rank 0 checks the path before the run and every rank learns the outcome (exit
# 2, no hang); a failing run leaves an old trace whole; a run that ends writes it (rank 0 only).
step "mpirun $np_flag 4 with an unwritable --trace"
limit 30 "$mpirun" "$np_flag" 4 "$@" "$flatpeak" verify "$dir/plan.json" --component dispatch --trace "$dir/none/trace.json" \
  >"$dir/trace_bad.out" 2>"$dir/trace_bad.err"
rc=$?
[ $rc = 2 ] || fail "an unwritable --trace under mpirun exited $rc (expected 2; 124/137: timed out): $(cat "$dir/trace_bad.err")"
grep -q "rank 0: $dir/none/trace.json: cannot write the trace" "$dir/trace_bad.err" ||
  fail "missing the trace message: $(cat "$dir/trace_bad.err")"
step "mpirun $np_flag 4 with --trace over an old trace: a bad plan, then a run that ends"
echo "old trace" >"$dir/trace.json"
sed 's/"context_tokens"/"context_token"/' "$dir/plan.json" >"$dir/plan_bad.json"
limit 30 "$mpirun" "$np_flag" 4 "$@" "$flatpeak" verify "$dir/plan_bad.json" --component dispatch --trace "$dir/trace.json" \
  >"$dir/trace_kept.out" 2>"$dir/trace_kept.err"
rc=$?
[ $rc = 2 ] || fail "a bad plan under mpirun exited $rc (expected 2): $(cat "$dir/trace_kept.err")"
[ "$(cat "$dir/trace.json")" = "old trace" ] || fail "a failed run under mpirun changed the old trace"
limit 40 "$mpirun" "$np_flag" 4 "$@" "$flatpeak" verify "$dir/plan.json" --component dispatch --trace "$dir/trace.json" \
  >"$dir/trace_good.out" 2>"$dir/trace_good.err"
rc=$?
[ $rc = 0 ] || fail "verify --trace under mpirun exited $rc (expected 0): $(cat "$dir/trace_good.err")"
grep -q '"format": "flatpeak-timeline"' "$dir/trace.json" || fail "the trace was not written under mpirun"
step "threads and mpirun $np_flag 4 agree and pass (dispatch, default verify with the step at EP = 4, step at EP = 1, dispatch and step at EP = 2 of N = 4, layer and step at CP = 2); $np_flag 2 exits 2"
