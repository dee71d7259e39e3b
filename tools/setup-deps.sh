#!/usr/bin/env bash
# Installs flatpeak's build dependencies from Debian packages when any is missing (needs root or
# sudo). Safe to run repeatedly: it does nothing when everything is present.
set -euo pipefail

packages=(cmake g++ make libcli11-dev nlohmann-json3-dev libfmt-dev libeigen3-dev
          libgtest-dev libbenchmark-dev libopenmpi-dev openmpi-bin)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "flatpeak: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
