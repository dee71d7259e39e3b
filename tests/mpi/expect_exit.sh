#!/usr/bin/env bash
# expect_exit.sh EXPECTED_CODE LIMIT_S EXPECTED_STDERR_TEXT CMD...: runs CMD (an mpirun line),
# passes when it exits with EXPECTED_CODE within LIMIT_S seconds and its stderr names the text.
set -u
expected=$1; limit=$2; text=$3; shift 3
err=$(mktemp)
start=$(date +%s)
timeout --kill-after=5 "$limit" "$@" 2> "$err" > /dev/null
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$err" >&2
if [ "$rc" -ne "$expected" ]; then
  echo "expect_exit: exit status $rc, expected $expected (after ${elapsed}s)" >&2; rm -f "$err"; exit 1
fi
if ! grep -qF -- "$text" "$err"; then
  echo "expect_exit: stderr does not contain '$text'" >&2; rm -f "$err"; exit 1
fi
rm -f "$err"
echo "expect_exit: exit status $rc in ${elapsed}s"
