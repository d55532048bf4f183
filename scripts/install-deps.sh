#!/usr/bin/env bash
# Installs the Debian packages epx needs for building and testing, and only those that are
# missing. Quick and silent when everything is present; runs `apt-get update` at most once.
# Works as root (CI) and through sudo otherwise.
#
#   scripts/install-deps.sh            # everything (build, tests, MPI, sanitizers)
#   scripts/install-deps.sh --build    # only what building the examples needs
#   EPX_DEPS_EXTRA="pkg ..." scripts/install-deps.sh   # and these
set -euo pipefail

# The sanitizer runtime package follows the installed clang (Debian 12: 14).
clang_major=14
if command -v clang >/dev/null 2>&1; then
  v=$(clang -dumpversion 2>/dev/null || true)
  case "${v%%.*}" in ''|*[!0-9]*) ;; *) clang_major=${v%%.*} ;; esac
fi

packages=(
  cmake g++ make           # build
  doctest-dev              # unit tests
  libbenchmark-dev         # benchmarks
  libopenmpi-dev openmpi-bin  # MPI backend and its tests
  clang "libclang-rt-${clang_major}-dev"  # sanitizer / libFuzzer builds
)
if [ "${1:-}" = "--build" ]; then
  packages=(cmake g++ make)
fi
# shellcheck disable=SC2206
packages+=(${EPX_DEPS_EXTRA:-})

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: missing packages (${missing[*]}) and no apt-get to install them" >&2
  exit 1
fi

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    as_root=(sudo -n)
    # -n never prompts; fall back to an interactive sudo only with a terminal.
    if ! sudo -n true 2>/dev/null; then
      if [ -t 0 ]; then as_root=(sudo); else
        echo "install-deps: need root to install: ${missing[*]} (sudo asks for a password; run it by hand)" >&2
        exit 1
      fi
    fi
  else
    echo "install-deps: need root to install: ${missing[*]} (not root and no sudo)" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
