#!/usr/bin/env bash
# Runs one golden case: flatpeak with the arguments in CASE/cmd, from CASE as working directory,
# and compares exit code, stdout and stderr with CASE/expected.*. FLATPEAK_UPDATE_GOLDEN=1
# rewrites the expected files instead (review the diff before committing).
set -u
binary=$(realpath "$1")  # absolute: the case runs from its own folder
case_dir=$2
cd "$case_dir" || exit 1
# shellcheck disable=SC2046 # word splitting of cmd is intended; arguments hold no spaces
eval "set -- $(cat cmd)"
actual_stdout=$(mktemp) actual_stderr=$(mktemp)
trap 'rm -f "$actual_stdout" "$actual_stderr"' EXIT
"$binary" "$@" >"$actual_stdout" 2>"$actual_stderr" </dev/null
actual_rc=$?

if [ "${FLATPEAK_UPDATE_GOLDEN:-0}" = 1 ]; then
  echo "$actual_rc" > expected.rc
  cp "$actual_stdout" expected.stdout
  cp "$actual_stderr" expected.stderr
  echo "updated $case_dir"
  exit 0
fi

status=0
expected_rc=$(cat expected.rc)
if [ "$actual_rc" != "$expected_rc" ]; then
  echo "exit code: expected $expected_rc, got $actual_rc"
  status=1
fi
for stream in stdout stderr; do
  if [ -f "expected.$stream" ]; then
    actual_file=actual_$stream
    if ! diff -u "expected.$stream" "${!actual_file}"; then
      echo "$stream differs (above: expected vs actual)"
      status=1
    fi
  fi
done
exit $status
