#!/usr/bin/env bash
# Installs what is missing, then configures, builds and runs the whole test suite with the
# `host` preset (build/host). Extra arguments go to ctest (e.g. -L mesh, -R package).
#
#   scripts/run-tests.sh
#   scripts/run-tests.sh -L comm
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

scripts/install-deps.sh
# OpenMPI refuses to start as root unless told; CI runs as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cmake --preset host
cmake --build --preset host
# ctest ends with its summary: the pass count, the failed tests and the time per label.
ctest --preset host "$@"
