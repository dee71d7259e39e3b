#!/usr/bin/env bash
# `flatpeak trace` on a measured timeline (the one `verify --trace` writes) and a plan's predicted
# one, in every format: one CSV row, one Chrome slice and one SVG bar a phase, the same phases as
# the file, the measured trace's extra columns (workspace) kept (CTest golden.trace_formats).
#   trace_formats.sh FLATPEAK PLAN.json
set -u
flatpeak=$1 plan=$(realpath "$2")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "trace_formats: FAILED: $*"; exit 1; }
cd "$dir" || fail "no temporary folder"

"$flatpeak" verify "$plan" --component layer --max-ranks 8 --trace measured.json >verify.out 2>verify.err
rc=$?
[ $rc = 0 ] || fail "verify exited $rc: $(cat verify.err)"
phases=$(grep -c '"name": ' measured.json)
[ "$phases" -gt 10 ] || fail "the measured trace has $phases phases"

for file in measured.json "$plan"; do
  n=$(grep -c '"name": "[a-z]*/' "$file")
  "$flatpeak" trace "$file" --format csv >t.csv 2>t.err || fail "csv of $file: $(cat t.err)"
  [ "$(wc -l <t.csv)" = $((n + 1)) ] || fail "csv of $file: $(wc -l <t.csv) lines for $n phases"
  head -1 t.csv | grep -q '^index,phase,folds,space,params,grads,optimizer,fsdp,' || fail "csv header: $(head -1 t.csv)"
  "$flatpeak" trace "$file" --format chrome >t.json 2>t.err || fail "chrome of $file: $(cat t.err)"
  [ "$(grep -c '"ph": "X"' t.json)" = "$n" ] || fail "chrome of $file: $(grep -c '"ph": "X"' t.json) slices for $n phases"
  [ "$(grep -c '"ph": "C"' t.json)" = $((n + 1)) ] || fail "chrome of $file: counters"
  "$flatpeak" trace "$file" --format svg >t.svg 2>t.err || fail "svg of $file: $(cat t.err)"
  [ "$(grep -c '<g><title>' t.svg)" = "$n" ] || fail "svg of $file: $(grep -c '<g><title>' t.svg) bars for $n phases"
  tail -1 t.svg | grep -q '^</svg>$' || fail "svg of $file does not end with </svg>"
  "$flatpeak" trace "$file" --space host >t.txt 2>t.err || fail "host table of $file: $(cat t.err)"
done
# The measured device columns include the allocator's workspace category.
"$flatpeak" trace measured.json --format csv | head -1 | grep -q ',workspace,' || fail "no workspace column in the measured csv"
grep -q 'GPU budget' t.svg || fail "the plan's svg has no budget line"
# An overhead and a reserve whose sum wraps int64 leave no budget line (it was drawn at a negative
# usable size, far off the chart).
sed -e '/^  "gpu": {/,/^  }/ s/"overhead_bytes": [0-9]*/"overhead_bytes": 9223372036854775807/' \
    -e '/^  "gpu": {/,/^  }/ s/"fragmentation_bytes": [0-9]*/"fragmentation_bytes": 2/' "$plan" >wrapped.json
grep -q '"overhead_bytes": 9223372036854775807' wrapped.json || fail "could not edit the plan"
"$flatpeak" trace wrapped.json >w.txt 2>w.err || fail "table of the wrapped plan: $(cat w.err)"
grep -q 'GPU budget' w.txt && fail "a wrapped overhead + reserve still gives a budget: $(grep 'GPU budget' w.txt)"

# Unreadable and unknown inputs: exit 2, the file named.
"$flatpeak" trace missing.json >m.out 2>m.err
[ $? = 2 ] || fail "a missing file did not exit 2"
grep -q 'missing.json' m.err || fail "the missing file is not named: $(cat m.err)"
"$flatpeak" trace measured.json --format pdf >f.out 2>f.err
[ $? = 2 ] || fail "an unknown format did not exit 2"
echo "trace_formats: ok"
