// bench/check_failed.hpp: a benchmark whose output check fails is skipped with the reason
// and makes the program exit with status 1, so that the bench-smoke tests fail on it.
#pragma once

#include <string>

#include <benchmark/benchmark.h>

namespace epx::bench {

inline bool& check_failed() {
  static bool failed = false;
  return failed;
}

inline void fail_check(benchmark::State& state, const std::string& why) {
  check_failed() = true;
  state.SkipWithError(why.c_str());
}

}  // namespace epx::bench
