// epx/exec/host_isa.hpp: the host CPU's vector instructions for the loops that have
// versions for them.
//
// The host's hot row loops (the weighted sum of combine, the scaled row copies, the
// weight-gradient dot products, the FP8 quantisation and dequantisation: epx/kernels/) are
// compiled three times on x86-64 with GCC or Clang (EPX_HOST_ISA_DISPATCH,
// epx/core/config.hpp): at the build's flags, for AVX2 and for AVX-512 (F, BW, VL), and run
// the widest one the CPU supports, so a build with the default flags vectorises as a
// -march=native one does. Every version gives the same bits: each runs the same operations
// in the same order (only the instructions differ), and no version contracts a product and
// a sum into a fused multiply-add (AVX-512 brings FMA instructions; GCC's versions are
// compiled with fp-contract=off, and epx::detail::mul_add (epx/core/numeric.hpp) forbids it to Clang), so each
// operation rounds as on the device. GCC's versions also ask for the loop vectoriser with
// its dynamic cost model: at -O2 GCC 12 keeps the very cheap one, which leaves these loops
// scalar (the FP8 quantisation ran 8-10 times slower). Tests run each version the CPU
// supports (tests/core/test_host_isa.cpp, in the suite at -O2; test_core_test_host_isa_O3 at
// -O3, test_core_test_host_isa_fma built for AVX2 and FMA).
//
//   exec::host_isa                    baseline, avx2, avx512
//   exec::host_isa_supported(isa)     this CPU (and OS) runs it; baseline always
//   exec::active_host_isa()           the one the loops use: the widest supported, unless set
//   exec::use_host_isa(isa)           choose it for every thread (tests, benchmarks); returns
//                                     the previous one; errc::input if not supported
//   to_string(isa)                    "baseline", "avx2", "avx512"
//   exec::run_widest(f, args...)      f.body(args...) in the active version (f.body inlined
//                                     into it: EPX_HOST_INLINE); f.body(args...) where
//                                     EPX_HOST_ISA_DISPATCH is 0
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

#if EPX_HOST_ISA_DISPATCH
#if defined(__clang__)
#define EPX_ISA_VERSION(isa) __attribute__((noinline, target(isa)))
#define EPX_ISA_VERSION_BASELINE __attribute__((noinline))
#else
#define EPX_ISA_OPTIMIZE optimize("fp-contract=off", "tree-vectorize", "vect-cost-model=dynamic")
#define EPX_ISA_VERSION(isa) __attribute__((noinline, target(isa), EPX_ISA_OPTIMIZE))
#define EPX_ISA_VERSION_BASELINE __attribute__((noinline, EPX_ISA_OPTIMIZE))
#endif
namespace detail {
template <class F, class... A>
EPX_ISA_VERSION("avx512f,avx512bw,avx512vl") void run_avx512(const F& f, A... a) {
  f.body(a...);
}
template <class F, class... A>
EPX_ISA_VERSION("avx2") void run_avx2(const F& f, A... a) {
  f.body(a...);
}
template <class F, class... A>
EPX_ISA_VERSION_BASELINE void run_baseline(const F& f, A... a) {
  f.body(a...);
}
}  // namespace detail
#undef EPX_ISA_VERSION
#undef EPX_ISA_VERSION_BASELINE
#ifdef EPX_ISA_OPTIMIZE
#undef EPX_ISA_OPTIMIZE
#endif
#endif

// In an EPX_HOST_DEVICE functor's operator(): its body(...) in the widest host version on
// the host, the plain body on a device.
#if EPX_HOST_ISA_DISPATCH && !defined(__CUDA_ARCH__)
#define EPX_RUN_WIDEST(...) ::epx::exec::run_widest(*this, __VA_ARGS__)
#else
#define EPX_RUN_WIDEST(...) this->body(__VA_ARGS__)
#endif

template <class F, class... A>
inline void run_widest(const F& f, A... a) {
#if EPX_HOST_ISA_DISPATCH
  switch (active_host_isa()) {
    case host_isa::avx512: detail::run_avx512(f, a...); break;
    case host_isa::avx2: detail::run_avx2(f, a...); break;
    default: detail::run_baseline(f, a...); break;
  }
#else
  f.body(a...);
#endif
}

}  // namespace epx::exec
