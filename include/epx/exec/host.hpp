// epx/exec/host.hpp: host execution policies.
//
// Per-element work is written once as a functor `f(std::size_t i)` marked EPX_HOST_DEVICE
// and launched through an execution policy:
//
//   epx::exec::for_each_n(policy, n, f);   // calls f(i) for i in [0, n), any order
//
// Host policies: `serial` (one thread) and `openmp` (a parallel loop when the translation
// unit is compiled with OpenMP, serial otherwise). The CUDA policy `epx::exec::cuda`
// (epx/exec/cuda.cuh) launches the very same functors through Thrust on a user stream.
//
// Memory: `buffer<T, Policy>` owns `n` elements in the policy's memory space (host memory
// here, device memory for the CUDA policy); `copy_n`, `fill_zero` move and clear it.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "epx/core/config.hpp"

namespace epx::exec {

struct serial {};

struct openmp {
  int threads = 0;  // 0: the OpenMP default
};

template <class P>
struct is_host_policy : std::false_type {};
template <>
struct is_host_policy<serial> : std::true_type {};
template <>
struct is_host_policy<openmp> : std::true_type {};
template <class P>
inline constexpr bool is_host_policy_v = is_host_policy<std::remove_cv_t<P>>::value;

template <class F>
void for_each_n(const serial&, std::size_t n, F&& f) {
  for (std::size_t i = 0; i < n; ++i) f(i);
}

template <class F>
void for_each_n(const openmp& p, std::size_t n, F&& f) {
#if EPX_HAS_OPENMP
  const long long nn = static_cast<long long>(n);
  if (p.threads > 0) {
#pragma omp parallel for schedule(static) num_threads(p.threads)
    for (long long i = 0; i < nn; ++i) f(static_cast<std::size_t>(i));
  } else {
#pragma omp parallel for schedule(static)
    for (long long i = 0; i < nn; ++i) f(static_cast<std::size_t>(i));
  }
#else
  (void)p;
  for (std::size_t i = 0; i < n; ++i) f(i);
#endif
}

// Host memory owned by a host policy. Not value-initialised: callers fill what they read.
template <class T>
class host_buffer {
 public:
  host_buffer() = default;
  explicit host_buffer(std::size_t n) : data_(n ? new T[n] : nullptr), size_(n) {}
  T* data() noexcept { return data_.get(); }
  const T* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  // Grows (never shrinks) the allocation; contents are not preserved.
  void reserve_discard(std::size_t n) {
    if (n > capacity_) {
      data_.reset(new T[n]);
      capacity_ = n;
    }
    size_ = n;
  }

 private:
  std::unique_ptr<T[]> data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = size_;
};

template <class T, class P>
struct buffer_for;
template <class T>
struct buffer_for<T, serial> { using type = host_buffer<T>; };
template <class T>
struct buffer_for<T, openmp> { using type = host_buffer<T>; };
template <class T, class P>
using buffer = typename buffer_for<T, std::remove_cv_t<P>>::type;

// A buffer of n elements in the policy's memory space (host memory for host policies);
// the CUDA policy's overload allocates in the order of its stream.
template <class T, class P, std::enable_if_t<is_host_policy_v<P>, int> = 0>
host_buffer<T> make_buffer(const P&, std::size_t n) {
  return host_buffer<T>(n);
}

template <class P, class T, std::enable_if_t<is_host_policy_v<P>, int> = 0>
void copy_n(const P&, const T* src, std::size_t n, T* dst) {
  if (n) std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(T));
}

template <class P, class T, std::enable_if_t<is_host_policy_v<P>, int> = 0>
void fill_zero(const P&, T* dst, std::size_t n) {
  if (n) std::memset(static_cast<void*>(dst), 0, n * sizeof(T));
}

// Copies between host memory and the policy's memory space (the same space for host
// policies). Library code uses these for the small arrays it reads on the host (counts,
// offsets, status flags); a device policy provides the same two functions.
template <class P, class T, std::enable_if_t<is_host_policy_v<P>, int> = 0>
void copy_to_host(const P& p, const T* src, std::size_t n, T* host_dst) {
  copy_n(p, src, n, host_dst);
}

template <class P, class T, std::enable_if_t<is_host_policy_v<P>, int> = 0>
void copy_from_host(const P& p, const T* host_src, std::size_t n, T* dst) {
  copy_n(p, host_src, n, dst);
}

// Host policies finish their work before returning.
inline void synchronize(const serial&) {}
inline void synchronize(const openmp&) {}

}  // namespace epx::exec
