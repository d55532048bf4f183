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
log=build/host/ctest-summary.log
set +e
ctest --preset host "$@" 2>&1 | tee build/host/ctest.log
rc=${PIPESTATUS[0]}
set -e
# The summary again, at the end where it is easy to find.
echo
echo "==== test summary (build/host) ===="
sed -n '/tests passed/,$p' build/host/ctest.log | tee "$log"
exit "$rc"
