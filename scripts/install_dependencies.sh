#!/usr/bin/env bash
# Installs metile's build and test dependencies from Debian's packages.
# Idempotent and quiet: packages already present are not touched. The CUDA
# toolkit is expected at /usr/local/cuda (without it the CUDA backend is skipped).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev
  pybind11-dev python3 python3-dev python3-numpy python3-pytest
  libboost-graph-dev liblemon-dev
  clang libclang-rt-14-dev
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "dependencies: all ${#packages[@]} Debian packages present"
  exit 0
fi

echo "dependencies: installing ${missing[*]}"
sudo_prefix=()
if [ "$(id -u)" -ne 0 ]; then sudo_prefix=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_prefix[@]}" apt-get update -qq
"${sudo_prefix[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "dependencies: installed ${#missing[@]} packages"
