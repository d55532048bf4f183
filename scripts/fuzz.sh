#!/usr/bin/env bash
# Builds every fuzz target with clang's libFuzzer (+ASan/UBSan) and runs each for
# FUZZ_SECONDS (default 60) over its committed corpus. New interesting inputs go to a
# scratch directory (merge them into tests/fuzz/corpus/<name> by hand with -merge=1);
# a crash leaves its input in build/fuzz/<name>/ and fails the script: add that input to
# the corpus so the replay test keeps it as a regression test.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${FUZZ_SECONDS:-60}"
cxx="${FUZZ_CXX:-clang++}"
out="$here/build/fuzz"
mkdir -p "$out"
status=0
for src in "$here"/tests/fuzz/fuzz_*.cpp; do
  name="$(basename "$src" .cpp)"; name="${name#fuzz_}"
  echo "== fuzz $name: building"
  "$cxx" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$here/include" "$src" -o "$out/fuzz_$name"
  mkdir -p "$out/$name/new"
  echo "== fuzz $name: running ${seconds}s"
  if ! (cd "$out/$name" && "$out/fuzz_$name" -max_total_time="$seconds" -print_final_stats=1 \
        new "$here/tests/fuzz/corpus/$name" 2>"$out/$name/log"); then
    echo "fuzz $name FAILED: see $out/$name/log and the crash-* file in $out/$name"; tail -40 "$out/$name/log"; status=1
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added" "$out/$name/log" | sed "s/^/  $name: /"
  fi
done
exit $status
