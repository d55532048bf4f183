// Test support for the host versions of the row loops (epx/exec/host_isa.hpp): run a check
// once per version this CPU supports, with that version active.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "epx/exec/host_isa.hpp"

namespace epx::test {

// Runs f once for every version this CPU supports, with that one active; the previous
// choice comes back afterwards (also when f throws).
template <class F>
void for_each_host_isa(F&& f) {
  using epx::exec::host_isa;
  for (host_isa isa : {host_isa::baseline, host_isa::avx2, host_isa::avx512}) {
    if (!epx::exec::host_isa_supported(isa)) continue;
    const host_isa previous = epx::exec::use_host_isa(isa);
    const std::string isa_name = epx::exec::to_string(isa);
    CAPTURE(isa_name);
    try {
      f();
    } catch (...) {
      epx::exec::use_host_isa(previous);
      throw;
    }
    epx::exec::use_host_isa(previous);
  }
}

}  // namespace epx::test
