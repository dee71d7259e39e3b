#!/usr/bin/env bash
# `flatpeak verify` under mpirun: 4 processes give the same report (rank 0 prints one JSON document)
# and the same exit code as 4 thread ranks; a job whose process count differs from the plan's
# ranks ends with exit 2 and says so, within the timeout.
#   verify_ranks_mpi.sh FLATPEAK MPIRUN NP_FLAG [MPIRUN OPTIONS...]   (CTest mpi.verify_ranks)
set -u
flatpeak=$1 mpirun=$2 np_flag=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "verify_ranks_mpi: $*"; exit 1; }

"$flatpeak" plan --model Qwen3-30B-A3B --gpus 4 --ep 4 --context 64K --gpu H200 --schedule flatpeak \
  --imbalance rho=2.5 --format json >"$dir/plan.json"
rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || fail "plan exited $rc"

"$flatpeak" verify "$dir/plan.json" --component dispatch --format json >"$dir/threads.json" 2>"$dir/threads.err"
threads_rc=$?
timeout 60 "$mpirun" "$np_flag" 4 "$@" "$flatpeak" verify "$dir/plan.json" --component dispatch --format json \
  >"$dir/mpi.json" 2>"$dir/mpi.err"
mpi_rc=$?
[ $threads_rc = 0 ] || [ $threads_rc = 5 ] || fail "threads run exited $threads_rc: $(cat "$dir/threads.err")"
[ $mpi_rc = $threads_rc ] || fail "mpirun -np 4 exited $mpi_rc, threads $threads_rc: $(cat "$dir/mpi.err")"
[ "$(grep -c '"plan":' "$dir/mpi.json")" = 1 ] || fail "expected one JSON document (rank 0 only)"
grep -q '"ranks": 4' "$dir/mpi.json" || fail "expected \"ranks\": 4"
grep -q '"launcher": "mpi"' "$dir/mpi.json" || fail "expected \"launcher\": \"mpi\""
sed 's/"launcher": "mpi"/"launcher": "threads"/' "$dir/mpi.json" | diff -u "$dir/threads.json" - ||
  fail "the MPI report differs from the threads report (above)"

timeout 60 "$mpirun" "$np_flag" 2 "$@" "$flatpeak" verify "$dir/plan.json" --component dispatch >"$dir/np2.out" 2>"$dir/np2.err"
np2_rc=$?
[ $np2_rc = 2 ] || fail "mpirun -np 2 on a 4-rank plan exited $np2_rc (expected 2): $(cat "$dir/np2.err")"
grep -q "the job has 2 processes but the scaled configuration has 4 ranks" "$dir/np2.err" ||
  fail "missing the process-count message: $(cat "$dir/np2.err")"
echo "verify_ranks_mpi: threads and mpirun -np 4 agree (exit $mpi_rc); -np 2 exits 2"
