// epx/exec/host.hpp: host execution policies.
//
// Per-element work is written once as a functor marked EPX_HOST_DEVICE and launched
// through an execution policy:
//
//   epx::exec::for_each_n(policy, n, f);              // f(i) for i in [0, n), any order
//   epx::exec::for_each_range(policy, a, b, f);       // f(i) for i in [a, b), any order
//   epx::exec::for_each_row<T>(policy, rows, cols, g); // g(r, h0, h1): columns [h0, h1) of row r
//
// for_each_row covers every column of every row exactly once; the policy chooses the
// launch shape (row_shape_v): host policies call g once per whole row (long contiguous
// loops), device policies once per 16-byte chunk of a row (neighbouring threads touch
// neighbouring bytes). The functor is the same either way.
//
// Host policies: `serial` (one thread) and `openmp` (a parallel loop when the translation
// unit is compiled with OpenMP, serial otherwise; the two are distinct types, see
// EPX_OPENMP_ABI_NAMESPACE in epx/core/config.hpp). The CUDA policy `epx::exec::cuda`
// (epx/exec/cuda.cuh) launches the very same functors with a grid-stride kernel on a user
// stream.
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

// In an inline namespace named after EPX_HAS_OPENMP (epx/core/config.hpp): a translation
// unit compiled without OpenMP has a different type, so nothing that takes it is one inline
// definition with two bodies.
inline namespace EPX_OPENMP_ABI_NAMESPACE {
struct openmp {
  int threads = 0;  // 0: the OpenMP default
};
}  // namespace EPX_OPENMP_ABI_NAMESPACE

template <class P>
struct is_host_policy : std::false_type {};
template <>
struct is_host_policy<serial> : std::true_type {};
template <>
struct is_host_policy<openmp> : std::true_type {};
template <class P>
inline constexpr bool is_host_policy_v = is_host_policy<std::remove_cv_t<P>>::value;

// Whether the host may read and write the policy's memory itself: host policies, and the
// emulated device (whose memory is host memory). A host communicator (threads, MPI) moves
// such buffers from the host; the CUDA policy's device memory needs a device communicator
// (NCCL) or the threads communicator over device memory (threads::device_memory()).
template <class P>
struct host_addressable : is_host_policy<P> {};
template <class P>
inline constexpr bool host_addressable_v = host_addressable<std::remove_cv_t<P>>::value;

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

namespace detail {
template <class F>
struct shifted_call {
  F f;
  std::size_t first;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { f(first + i); }
};
}  // namespace detail

// f(i) for i in [first, last), any order, on any policy (for_each_n over the range's length).
template <class P, class F>
void for_each_range(const P& p, std::size_t first, std::size_t last, F f) {
  if (last > first) for_each_n(p, last - first, detail::shifted_call<F>{f, first});
}

// The launch shape of a row operation on a policy.
enum class row_shape : int {
  whole_rows = 0,  // g(r, 0, cols) once per row
  chunks16 = 1,    // g(r, h0, h1) once per 16 bytes of a row (the last chunk may be shorter)
};
template <class P, class = void>
struct row_shape_of : std::integral_constant<row_shape, row_shape::chunks16> {};  // device policies
template <class P>
struct row_shape_of<P, std::enable_if_t<is_host_policy_v<P>>>
    : std::integral_constant<row_shape, row_shape::whole_rows> {};
template <class P>
inline constexpr row_shape row_shape_v = row_shape_of<std::remove_cv_t<P>>::value;

namespace detail {
template <class G>
struct whole_row_call {
  G g;
  std::size_t cols;
  EPX_HOST_DEVICE void operator()(std::size_t r) const { g(r, 0, cols); }
};
// One division per chunk (not per element) recovers the row.
template <class G>
struct row_chunk_call {
  G g;
  std::size_t chunks;  // per row
  std::size_t width;   // elements per chunk
  std::size_t cols;
  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::size_t r = i / chunks;
    const std::size_t h0 = (i - r * chunks) * width;
    g(r, h0, h0 + width < cols ? h0 + width : cols);
  }
};
}  // namespace detail

// Elements of T in one 16-byte chunk (at least 1).
template <class T>
inline constexpr std::size_t chunk_elements = sizeof(T) >= 16 ? 1 : 16 / sizeof(T);

// g(r, h0, h1) over rows [0, rows) and columns [0, cols) of elements of type T, in the
// policy's launch shape (row_shape_v<P>). Every (row, column) is covered exactly once.
template <class T, class P, class G>
void for_each_row(const P& p, std::size_t rows, std::size_t cols, G g) {
  if (rows == 0 || cols == 0) return;
  if constexpr (row_shape_v<P> == row_shape::whole_rows) {
    for_each_n(p, rows, detail::whole_row_call<G>{g, cols});
  } else {
    constexpr std::size_t w = chunk_elements<T>;
    const std::size_t chunks = (cols + w - 1) / w;
    for_each_n(p, rows * chunks, detail::row_chunk_call<G>{g, chunks, w, cols});
  }
}

namespace detail {
// Where a host policy's buffers come from: new[] and delete[].
template <class T>
struct heap_storage {
  using owner = std::unique_ptr<T[]>;
  static owner allocate(std::size_t n) { return owner(n ? new T[n] : nullptr); }
};
}  // namespace detail

// n elements in memory from Storage (Storage::allocate(n): an owning unique_ptr). Not
// value-initialised: callers fill what they read.
template <class T, class Storage = detail::heap_storage<T>>
class basic_buffer {
 public:
  basic_buffer() = default;
  explicit basic_buffer(std::size_t n) : data_(Storage::allocate(n)), size_(n), capacity_(n) {}
  T* data() noexcept { return data_.get(); }
  const T* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  // Grows (never shrinks) the allocation; contents are not preserved.
  void reserve_discard(std::size_t n) {
    if (n > capacity_) {
      data_ = Storage::allocate(n);
      capacity_ = n;
    }
    size_ = n;
  }

 private:
  typename Storage::owner data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

// Host memory owned by a host policy.
template <class T>
using host_buffer = basic_buffer<T>;

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

// Whether two policies put their work on one queue (so work on one is ordered after work
// on the other without a wait). Host policies have no queue; policies of different kinds
// never share one. (The emulated device's overload, epx/exec/emulated.hpp, also takes
// policies derived from it.)
struct emulated_device;
template <class A, class B,
          std::enable_if_t<!(std::is_base_of_v<emulated_device, A> && std::is_base_of_v<emulated_device, B>), int> = 0>
bool same_queue(const A&, const B&) {
  return std::is_same_v<A, B> && is_host_policy_v<A>;
}

// Host policies finish their work before returning.
inline void synchronize(const serial&) {}
inline void synchronize(const openmp&) {}

// Held by library code around device work it starts through another door than the
// policy's functions (Thrust's algorithms): nothing, except for the emulated device in
// strict mode (epx/exec/emulated.hpp), where the host may touch the policy's memory only
// inside such a scope.
struct no_launch_scope {};
template <class P, std::enable_if_t<!std::is_base_of_v<emulated_device, P>, int> = 0>
no_launch_scope launch_scope(const P&) {
  return {};
}

}  // namespace epx::exec

// The emulated device policy is declared with the host policies, so that library code
// (whose qualified exec:: calls see only what is declared before it) finds its functions
// whatever the order of includes.
#include "epx/exec/emulated.hpp"

// Likewise the CUDA policy, when nvcc compiles: a .cu file may include any epx header
// first (epx/epx.hpp, the layer, a communicator) and exec::cuda's functions are still
// declared before the library code that calls them.
#if defined(__CUDACC__)
#include "epx/exec/cuda.cuh"
#endif
