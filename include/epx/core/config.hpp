// epx/core/config.hpp: version, host/device annotation and small portability macros.
#pragma once

// epx's results are specified for IEEE-754 arithmetic: -ffast-math or -ffinite-math-only
// (finite math only, reassociation) breaks the NaN and infinity handling of the FP8 conversions and the
// routing's checks, and the fixed summation orders behind the bitwise guarantees. Define
// EPX_ALLOW_FAST_MATH to silence this warning.
#if (defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__ > 0)) && \
    !defined(EPX_ALLOW_FAST_MATH) && !defined(__CUDA_ARCH__)
#warning "epx: compiled with -ffast-math or -ffinite-math-only; epx's NaN/infinity handling and bitwise guarantees need IEEE-754 arithmetic (define EPX_ALLOW_FAST_MATH to silence this)"
#endif

#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 1
#define EPX_VERSION_PATCH 0

// EPX_HOST_DEVICE marks per-element work that runs both on the CPU and on a CUDA device.
// Under a plain C++ compiler it expands to nothing, so the same functor body is what the
// CPU tests execute and what the GPU kernels execute.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define EPX_HOST_DEVICE __host__ __device__
#define EPX_DEVICE __device__
#else
#define EPX_HOST_DEVICE
#define EPX_DEVICE
#endif

#if defined(__CUDA_ARCH__)
#define EPX_IS_DEVICE_CODE 1
#else
#define EPX_IS_DEVICE_CODE 0
#endif

// EPX_DEVICE_ALGORITHMS picks the variant of an algorithm where the host and the device
// differ in shape but not in result (routing's key tables, which only the host keeps;
// capacity's digit widths and gather array): 1 in device code, and on the host where the
// build defines EPX_EMULATE_DEVICE_ALGORITHMS=1, so that the CPU runs the variants a GPU
// runs (the emulated label's tests do). Intrinsics (::expf, the CUDA conversions) stay
// with EPX_IS_DEVICE_CODE. Every translation unit of one program must agree on it.
#if EPX_IS_DEVICE_CODE || (defined(EPX_EMULATE_DEVICE_ALGORITHMS) && EPX_EMULATE_DEVICE_ALGORITHMS)
#define EPX_DEVICE_ALGORITHMS 1
#else
#define EPX_DEVICE_ALGORITHMS 0
#endif

// EPX_HOST_NOINLINE keeps a host compiler from inlining a hot loop into its caller, where
// it would share the registers of the caller's other loops (and keep its pointers on the
// stack). Nothing on the device, or for compilers without the attribute.
#if !defined(__CUDA_ARCH__) && (defined(__GNUC__) || defined(__clang__))
#define EPX_HOST_NOINLINE __attribute__((noinline))
#else
#define EPX_HOST_NOINLINE
#endif

// EPX_HOST_INLINE makes a host compiler inline a small function into its caller (a loop body
// into a loop compiled for wider vector instructions, epx/kernels/fp8.hpp). Plain `inline`
// on the device and for other compilers.
#if !defined(__CUDA_ARCH__) && (defined(__GNUC__) || defined(__clang__))
#define EPX_HOST_INLINE inline __attribute__((always_inline))
#else
#define EPX_HOST_INLINE inline
#endif

// EPX_HOST_ISA_DISPATCH is 1 where the host code may hold loops compiled for AVX2 and
// AVX-512 besides the build's baseline, chosen at run time by what the CPU supports
// (x86-64 with GCC or Clang, nvcc's host pass included). Define EPX_NO_ISA_DISPATCH to
// keep every loop at the build's flags.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(EPX_NO_ISA_DISPATCH)
#define EPX_HOST_ISA_DISPATCH 1
#else
#define EPX_HOST_ISA_DISPATCH 0
#endif

#if defined(_OPENMP)
#define EPX_HAS_OPENMP 1
#else
#define EPX_HAS_OPENMP 0
#endif

// What exec::openmp does depends on EPX_HAS_OPENMP: a parallel loop in a translation unit
// compiled with OpenMP, a serial one elsewhere. So that a program whose translation units
// differ there (a .cu source compiled without the host compiler's OpenMP flag beside .cpp
// sources compiled with it) holds two distinct sets of definitions, not one inline
// definition that differs between translation units (an ODR violation, of which the linker
// would keep either), the policy lives in an inline namespace named after EPX_HAS_OPENMP:
// every function and template that takes exec::openmp, epx's own included, is then a
// different entity in each kind of translation unit. Each keeps its own behaviour: serial
// where the unit lacks OpenMP. The CMake targets give every source, CUDA included, the
// flag (README.md, "Using epx from CMake"), so that no program mixes the two by accident.
#if EPX_HAS_OPENMP
#define EPX_OPENMP_ABI_NAMESPACE with_openmp
#else
#define EPX_OPENMP_ABI_NAMESPACE without_openmp
#endif

namespace epx {

// Used in static_assert inside `if constexpr` chains so that an invalid policy composition
// fails with a sentence instead of a template wall.
template <class...>
inline constexpr bool dependent_false = false;

}  // namespace epx
