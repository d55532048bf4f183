// epx/exec/cuda.cuh: the CUDA execution policy (needs nvcc).
//
// The same EPX_HOST_DEVICE functors the host policies run (epx/exec/host.hpp) are launched
// on a user stream:
//
//   epx::exec::cuda dev{stream};
//   epx::exec::for_each_n(dev, n, f);     // f(i) for i in [0, n) on the device, asynchronous
//   epx::exec::synchronize(dev);          // waits for the stream; raises epx::error on failure
//
// The function names match the host policies (for_each_n, buffer<T, Policy>, make_buffer,
// copy_n, fill_zero, synchronize), so templated library code is written once for both.
// Everything is stream-ordered: pointers handed to for_each_n/copy_n/fill_zero must be
// device memory (or managed/pinned memory reachable from the device); copy_n also moves
// between host and device memory (cudaMemcpyDefault). Host memory written by a copy is
// only safe to read after synchronize().
//
// CUDA failures raise epx::error(errc::cuda) naming the call, cudaGetErrorName /
// cudaGetErrorString and the cudaError_t code (EPX_CUDA_CHECK).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/thrust.hpp"

#include <thrust/system/cuda/execution_policy.h>

namespace epx::detail {

// Raises epx::error(errc::cuda) for a failed runtime call. Clears the (non-sticky) error
// state so that the next call does not report it again.
inline void cuda_check(cudaError_t e, const char* call, source_location where) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw error(errc::cuda,
              concat(call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ", code ",
                     static_cast<int>(e), ")"),
              where, static_cast<long>(e));
}

}  // namespace epx::detail

// EPX_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
#define EPX_CUDA_CHECK(...) ::epx::detail::cuda_check((__VA_ARGS__), #__VA_ARGS__, EPX_HERE)

namespace epx::exec {

// Device execution on `stream` (0: the current device's default stream). A plain value:
// copy it freely; it owns nothing.
struct cuda {
  cudaStream_t stream = 0;
};

inline bool same_queue(const cuda& a, const cuda& b) { return a.stream == b.stream; }

template <class P>
struct is_device_policy : std::false_type {};
template <>
struct is_device_policy<cuda> : std::true_type {};
template <class P>
inline constexpr bool is_device_policy_v = is_device_policy<std::remove_cv_t<P>>::value;

namespace detail {

inline constexpr unsigned for_each_block = 256;
// Grid-stride loop: more blocks than this only add scheduling work.
inline constexpr std::size_t for_each_max_blocks = std::size_t{1} << 20;

template <class F>
__global__ void __launch_bounds__(for_each_block) for_each_n_kernel(std::size_t n, F f) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// Whether the current device has stream-ordered memory pools (cudaMallocAsync).
inline bool memory_pools_supported() {
  int dev = 0;
  int supported = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return supported != 0;
}

}  // namespace detail

// Calls f(i) for every i in [0, n) on the device, in any order, asynchronously on
// p.stream. `F` is copied to the device by value: it holds raw pointers and values (no
// containers), and its call operator is EPX_HOST_DEVICE (or __device__). A launch failure raises epx::error now;
// a failure while running shows up at synchronize().
template <class F>
void for_each_n(const cuda& p, std::size_t n, F&& f) {
  using functor = std::decay_t<F>;
  if (n == 0) return;
  const std::size_t blocks =
      std::min<std::size_t>((n + detail::for_each_block - 1) / detail::for_each_block, detail::for_each_max_blocks);
  detail::for_each_n_kernel<functor>
      <<<static_cast<unsigned>(blocks), detail::for_each_block, 0, p.stream>>>(n, static_cast<functor>(f));
  EPX_CUDA_CHECK(cudaGetLastError());
}

// Device memory for `n` elements of T, freed in stream order on the stream it was made
// for (cudaMallocAsync/cudaFreeAsync where the device supports memory pools, cudaMalloc/
// cudaFree otherwise). Not value-initialised: use fill_zero. Move-only; the destructor
// never throws (a failing free is ignored: there is nobody to tell). A stream-ordered
// buffer is freed on its stream, so that stream must outlive it, and work on other
// streams that uses it must be ordered before the free (an event or a synchronize).
// Library code that allocates per call should prefer make_buffer(policy, n): the
// synchronous cudaMalloc/cudaFree pair of buffer(n) stalls the device on every free.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  // Synchronous cudaMalloc on the current device: usable from any stream.
  explicit device_buffer(std::size_t n) { allocate_(n); }
  // Stream-ordered allocation on p.stream: use it on that stream (or after synchronising).
  device_buffer(std::size_t n, const cuda& p) : stream_(p.stream), stream_ordered_(true) { allocate_(n); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept { swap(o); }
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      release_();
      swap(o);
    }
    return *this;
  }
  ~device_buffer() { release_(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return capacity_; }
  cudaStream_t stream() const noexcept { return stream_; }

  // Grows (never shrinks) the allocation; contents are not preserved.
  void reserve_discard(std::size_t n) {
    if (n > capacity_) {
      release_();
      allocate_(n);
    }
    size_ = n;
  }

  void swap(device_buffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
    std::swap(stream_, o.stream_);
    std::swap(stream_ordered_, o.stream_ordered_);
    std::swap(pooled_, o.pooled_);
  }

 private:
  static bool pools_supported_() { return detail::memory_pools_supported(); }

  void allocate_(std::size_t n) {
    size_ = capacity_ = 0;
    data_ = nullptr;
    if (n == 0) return;
    EPX_REQUIRE(n <= static_cast<std::size_t>(-1) / sizeof(T), errc::input, "device_buffer: ", n,
                " elements of ", sizeof(T), " bytes overflow the address space");
    void* p = nullptr;
    pooled_ = stream_ordered_ && pools_supported_();
    if (pooled_) {
      EPX_CUDA_CHECK(cudaMallocAsync(&p, n * sizeof(T), stream_));
    } else {
      EPX_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    }
    data_ = static_cast<T*>(p);
    size_ = capacity_ = n;
  }

  void release_() noexcept {
    if (data_ != nullptr) {
      const cudaError_t e = pooled_ ? cudaFreeAsync(data_, stream_) : cudaFree(data_);
      if (e != cudaSuccess) (void)cudaGetLastError();
    }
    data_ = nullptr;
    size_ = capacity_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
  cudaStream_t stream_ = 0;
  bool stream_ordered_ = false;
  bool pooled_ = false;
};

template <class T>
struct buffer_for<T, cuda> {
  using type = device_buffer<T>;
};

// A buffer of n elements in the policy's memory space; for the CUDA policy allocated in
// the order of the policy's stream.
template <class T>
device_buffer<T> make_buffer(const cuda& p, std::size_t n) {
  return device_buffer<T>(n, p);
}

// dst[0, n) = src[0, n), stream-ordered. Either side may be host or device memory
// (cudaMemcpyDefault, unified addressing). Read a host destination after synchronize().
template <class T>
void copy_n(const cuda& p, const T* src, std::size_t n, T* dst) {
  static_assert(std::is_trivially_copyable_v<T>, "epx::exec::copy_n(cuda): T must be trivially copyable");
  if (n == 0) return;
  EPX_CUDA_CHECK(cudaMemcpyAsync(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(T),
                                 cudaMemcpyDefault, p.stream));
}

// dst[0, n) = all-zero bytes (0 for integers, +0.0 for floating types), stream-ordered.
template <class T>
void fill_zero(const cuda& p, T* dst, std::size_t n) {
  if (n == 0) return;
  EPX_CUDA_CHECK(cudaMemsetAsync(static_cast<void*>(dst), 0, n * sizeof(T), p.stream));
}

// Waits until everything enqueued on p.stream has finished; raises epx::error for a
// failure of that work (e.g. a kernel fault).
inline void synchronize(const cuda& p) { EPX_CUDA_CHECK(cudaStreamSynchronize(p.stream)); }

// Device (or host) memory -> host memory, after the stream's earlier work; `host_dst` is
// readable when this returns (it synchronises the stream: use for small arrays such as
// counts, offsets and status flags).
template <class T>
void copy_to_host(const cuda& p, const T* src, std::size_t n, T* host_dst) {
  copy_n(p, src, n, host_dst);
  synchronize(p);
}

// Host memory -> device memory in stream order; `host_src` may be reused or freed when
// this returns (it synchronises the stream, so pinned host sources are safe too).
template <class T>
void copy_from_host(const cuda& p, const T* host_src, std::size_t n, T* dst) {
  copy_n(p, host_src, n, dst);
  synchronize(p);
}

namespace detail {
// Temporary storage of Thrust calls on the policy's stream, allocated and freed in stream
// order (cudaMallocAsync / cudaFreeAsync), so a call needs no device-wide synchronisation.
// Without memory pools (device_buffer's fallback too): cudaMalloc, and cudaFree, which
// waits for the device.
struct thrust_stream_allocator {
  using value_type = char;
  cudaStream_t stream = 0;
  bool pooled = memory_pools_supported();
  char* allocate(std::ptrdiff_t n) {
    void* p = nullptr;
    if (pooled) {
      EPX_CUDA_CHECK(cudaMallocAsync(&p, static_cast<std::size_t>(n), stream));
    } else {
      EPX_CUDA_CHECK(cudaMalloc(&p, static_cast<std::size_t>(n)));
    }
    return static_cast<char*>(p);
  }
  void deallocate(char* p, std::size_t) noexcept {
    if (pooled) (void)cudaFreeAsync(p, stream);
    else (void)cudaFree(p);
  }
};
}  // namespace detail

// Thrust's CUDA system (CUB kernels) on the policy's stream, with no synchronisation after
// each call (par_nosync) and stream-ordered temporary storage (epx/exec/thrust.hpp).
inline auto thrust_policy(const cuda& p) {
  return thrust::cuda::par_nosync(detail::thrust_stream_allocator{p.stream}).on(p.stream);
}

}  // namespace epx::exec
