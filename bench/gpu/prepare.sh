#!/usr/bin/env bash
# bench/gpu/prepare.sh: run here (the development machine) before bench/gpu/run.sh is sent to
# a GPU machine that has nvcc but no doctest. Copies doctest's header folder into .gpu-deps/
# (ignored by git: .gitignore) so that the device tool can carry it:
#
#   bench/gpu/prepare.sh
#   then, with the device tool: run(command="bench/gpu/run.sh", carry=[".gpu-deps"], timeout_s=540)
#
# run.sh looks for doctest in .gpu-deps/ when DOCTEST_INCLUDE is not set. Nothing here is
# committed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
src=""
for d in "${DOCTEST_INCLUDE:-}" /usr/include /usr/local/include; do
  [[ -n "$d" && -f "$d/doctest/doctest.h" ]] && { src="$d/doctest"; break; }
done
[[ -n "$src" ]] || { echo "prepare.sh: doctest not found (apt-get install doctest-dev, or set DOCTEST_INCLUDE)" >&2; exit 1; }
mkdir -p .gpu-deps
rm -rf .gpu-deps/doctest
cp -r "$src" .gpu-deps/doctest
echo "prepared .gpu-deps/doctest from $src ($(du -sh .gpu-deps | cut -f1)); carry \".gpu-deps\" with bench/gpu/run.sh"
