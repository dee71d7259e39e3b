#!/usr/bin/env bash
# `verify --trace PATH` leaves an existing PATH whole when the run fails (a bad plan, after the
# trace's check) and when the write fails, replaces it only with a whole trace when the run ends,
# and leaves no temporary beside it (CTest golden.verify_trace_kept).
#   verify_trace_kept.sh FLATPEAK PLAN.json
set -u
flatpeak=$1 plan=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "verify_trace_kept: FAILED: $*"; exit 1; }
no_temporary() { [ -z "$(ls "$dir" | grep '\.tmp-')" ] || fail "a temporary was left: $(ls "$dir")"; }

echo "old trace" >"$dir/trace.json"
# A plan verify refuses (a misspelt key): exit 2, the old trace untouched.
sed 's/"context_tokens"/"context_token"/' "$plan" >"$dir/bad.json"
"$flatpeak" verify "$dir/bad.json" --component vocab --max-ranks 1 --trace "$dir/trace.json" >"$dir/bad.out" 2>"$dir/bad.err"
rc=$?
[ $rc = 2 ] || fail "a bad plan exited $rc (expected 2): $(cat "$dir/bad.err")"
grep -q "context_token: unknown key" "$dir/bad.err" || fail "the bad plan's error is missing: $(cat "$dir/bad.err")"
[ "$(cat "$dir/trace.json")" = "old trace" ] || fail "the old trace was changed by a failed run: $(head -c 200 "$dir/trace.json")"
no_temporary

# A run that ends: the trace is replaced whole.
"$flatpeak" verify "$plan" --component vocab --max-ranks 1 --trace "$dir/trace.json" >"$dir/good.out" 2>"$dir/good.err"
rc=$?
[ $rc = 0 ] || fail "the run exited $rc (expected 0): $(cat "$dir/good.err")"
grep -q '"format": "flatpeak-timeline"' "$dir/trace.json" || fail "the trace was not written: $(head -c 200 "$dir/trace.json")"
tail -c 2 "$dir/trace.json" | grep -q '}' || fail "the trace does not end its JSON document"
no_temporary
echo "verify_trace_kept: ok"
