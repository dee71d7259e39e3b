#!/usr/bin/env bash
# Copies the header-only dependencies and GoogleTest's source from this machine's Debian packages
# into third_party/ (ignored by git), for a machine that has a compiler, CMake and the CUDA toolkit
# but none of Debian's -dev packages and no network (the lent GPU machine: tools/gpu-check.sh).
# cmake/FlatpeakDeps.cmake uses a folder here only for a package find_package does not find, so a
# machine with Debian's packages builds exactly as before.
#
#   third_party/nlohmann_json/nlohmann/   nlohmann-json3-dev  (header-only)
#   third_party/CLI11/CLI/                libcli11-dev        (header-only)
#   third_party/fmt/fmt/                  libfmt-dev          (used header-only: FMT_HEADER_ONLY)
#   third_party/eigen3/Eigen/             libeigen3-dev       (header-only; unsupported/ left out)
#   third_party/googletest/               googletest          (source; googlemock, docs, samples
#                                                              and gtest's own tests left out)
#   third_party/VERSIONS                  which package versions these came from
#
# Each folder also holds the package's copyright file. Run `bash tools/setup-deps.sh` first if a
# package is missing. Usage: tools/vendor-deps.sh   (replaces third_party/ as a whole)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party

# package | source | destination (relative to $dest)
copies=(
  "nlohmann-json3-dev|/usr/include/nlohmann|nlohmann_json/nlohmann"
  "libcli11-dev|/usr/include/CLI|CLI11/CLI"
  "libfmt-dev|/usr/include/fmt|fmt/fmt"
  "libeigen3-dev|/usr/include/eigen3/Eigen|eigen3/Eigen"
  "googletest|/usr/src/googletest/CMakeLists.txt|googletest/CMakeLists.txt"
  "googletest|/usr/src/googletest/googletest/CMakeLists.txt|googletest/googletest/CMakeLists.txt"
  "googletest|/usr/src/googletest/googletest/cmake|googletest/googletest/cmake"
  "googletest|/usr/src/googletest/googletest/include|googletest/googletest/include"
  "googletest|/usr/src/googletest/googletest/src|googletest/googletest/src"
)

missing=()
for entry in "${copies[@]}"; do
  IFS='|' read -r package source _ <<<"$entry"
  [ -e "$source" ] || missing+=("$source (package $package)")
done
if [ ${#missing[@]} -gt 0 ]; then
  printf 'vendor-deps: not found: %s\n' "${missing[@]}" >&2
  echo "vendor-deps: install the packages first (bash tools/setup-deps.sh)" >&2
  exit 2
fi

# Build the new tree beside the old one, then swap, so that a failure leaves the old one intact.
staging=$(mktemp -d "$dest.new.XXXXXX")
trap 'rm -rf "$staging"' EXIT
for entry in "${copies[@]}"; do
  IFS='|' read -r package source target <<<"$entry"
  mkdir -p "$staging/$(dirname "$target")"
  cp -a "$source" "$staging/$target"
  top=${target%%/*}
  [ -f "$staging/$top/copyright" ] || cp "/usr/share/doc/$package/copyright" "$staging/$top/copyright"
done
# Eigen's own marker file (its config scripts look for it); tiny.
cp /usr/include/eigen3/signature_of_eigen3_matrix_library "$staging/eigen3/"

{
  echo "# Copied by tools/vendor-deps.sh on $(date -u '+%Y-%m-%d %H:%M UTC') from Debian packages:"
  for package in $(printf '%s\n' "${copies[@]}" | cut -d'|' -f1 | sort -u); do
    echo "$package $(dpkg-query -W -f='${Version}' "$package")"
  done
} >"$staging/VERSIONS"

rm -rf "$dest"
mv "$staging" "$dest"
trap - EXIT
cat "$dest/VERSIONS"
size_kib=$(du -sk "$dest" | cut -f1)
echo "vendor-deps: $dest/ holds $(find "$dest" -type f | wc -l) files, $((size_kib / 1024)).$(((size_kib % 1024) * 10 / 1024)) MiB ($size_kib KiB)"
# The device tool carries at most 64 MiB (working tree included); keep well under it.
if [ "$size_kib" -gt $((32 * 1024)) ]; then
  echo "vendor-deps: $dest/ is over 32 MiB; too large to carry beside the working tree" >&2
  exit 1
fi
