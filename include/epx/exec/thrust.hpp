// epx/exec/thrust.hpp: the Thrust execution policy of an epx execution policy.
//
// Library algorithms that are sorts, scans or searches call Thrust (CCCL) with
// exec::thrust_policy(p), so one call runs CUB kernels on the policy's stream for
// exec::cuda (epx/exec/cuda.cuh: thrust::cuda::par_nosync on the stream, temporary storage
// allocated in stream order) and Thrust's sequential host system for
// exec::emulated_device (thrust::cpp::par): the device path's algorithm, executed by the
// CPU. Host policies keep their own algorithms (no thrust_policy).
//
// EPX_HAS_CCCL: 1 when the CCCL headers (Thrust, CUB, libcu++) can be included. Always
// under nvcc; under a plain C++ compiler only when the build says so (-DEPX_HAS_CCCL=1 with
// the CCCL include folder on the path: the CMake build finds the CUDA toolkit's copy,
// include/cccl, and says which plan ran). Without it every policy uses the counting sort.
#pragma once

#include <type_traits>
#include <utility>

#ifndef EPX_HAS_CCCL
#if defined(__CUDACC__)
#define EPX_HAS_CCCL 1
#else
#define EPX_HAS_CCCL 0
#endif
#endif

#if EPX_HAS_CCCL
#include <thrust/system/cpp/execution_policy.h>
#endif

namespace epx::exec {

struct emulated_device;

#if EPX_HAS_CCCL
// The emulated device runs Thrust's sequential host system: the same call as on a GPU.
inline auto thrust_policy(const emulated_device&) { return thrust::cpp::par; }
#endif

namespace detail {
template <class P, class = void>
struct has_thrust_policy : std::false_type {};
template <class P>
struct has_thrust_policy<P, std::void_t<decltype(thrust_policy(std::declval<const P&>()))>> : std::true_type {};
}  // namespace detail

// Whether library algorithms take the Thrust route on policy P.
template <class P>
inline constexpr bool has_thrust_policy_v = detail::has_thrust_policy<std::remove_cv_t<P>>::value;

}  // namespace epx::exec
