// epx/exec/host_isa.hpp: the host CPU's vector instructions for the loops that have
// versions for them.
//
// A few host loops (the FP8 quantisation, epx/kernels/fp8.hpp) are compiled three times on
// x86-64 with GCC or Clang (EPX_HOST_ISA_DISPATCH, epx/core/config.hpp): at the build's
// flags, for AVX2 and for AVX-512 (F, BW, VL), and run the widest one the CPU supports, so a
// build with the default flags vectorises as a -march=native one does. Every version gives
// the same bits (the loops are written without branches and without fused multiply-adds
// that could round differently); tests run each one the CPU supports.
//
//   exec::host_isa                    baseline, avx2, avx512
//   exec::host_isa_supported(isa)     this CPU (and OS) runs it; baseline always
//   exec::active_host_isa()           the one the loops use: the widest supported, unless set
//   exec::use_host_isa(isa)           choose it for every thread (tests, benchmarks); returns
//                                     the previous one; errc::input if not supported
//   to_string(isa)                    "baseline", "avx2", "avx512"
#pragma once

#include <atomic>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"

namespace epx::exec {

enum class host_isa { baseline, avx2, avx512 };

inline const char* to_string(host_isa isa) noexcept {
  switch (isa) {
    case host_isa::avx2: return "avx2";
    case host_isa::avx512: return "avx512";
    case host_isa::baseline: return "baseline";
    default: return "unknown";
  }
}

inline bool host_isa_supported(host_isa isa) noexcept {
#if EPX_HOST_ISA_DISPATCH
  __builtin_cpu_init();
  switch (isa) {
    case host_isa::avx2: return __builtin_cpu_supports("avx2");
    case host_isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
    case host_isa::baseline: return true;
    default: return false;
  }
#else
  return isa == host_isa::baseline;
#endif
}

namespace detail {
inline host_isa widest_host_isa() noexcept {
  if (host_isa_supported(host_isa::avx512)) return host_isa::avx512;
  if (host_isa_supported(host_isa::avx2)) return host_isa::avx2;
  return host_isa::baseline;
}
inline std::atomic<host_isa>& host_isa_choice() noexcept {
  static std::atomic<host_isa> choice{widest_host_isa()};
  return choice;
}
}  // namespace detail

inline host_isa active_host_isa() noexcept { return detail::host_isa_choice().load(std::memory_order_relaxed); }

inline host_isa use_host_isa(host_isa isa) {
  EPX_REQUIRE(host_isa_supported(isa), errc::input, "use_host_isa: this CPU or build does not support ",
              to_string(isa), " (", static_cast<int>(isa), ")");
  return detail::host_isa_choice().exchange(isa, std::memory_order_relaxed);
}

}  // namespace epx::exec
