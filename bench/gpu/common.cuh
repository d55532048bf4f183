// bench/gpu/common.cuh: what both GPU benchmarks set up the same way.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "epx/exec/cuda.cuh"

namespace epx::bench::gpu {

// A non-blocking stream owned by a scope. Declare it before the buffers, layers and
// communicators that use it: it is destroyed after them, once its work is done.
class owned_stream {
 public:
  owned_stream() { EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~owned_stream() {
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Device buffers of exec::cuda come from the device's default memory pool
// (cudaMallocAsync). Its release threshold is 0 unless the program sets it, so every
// synchronisation hands the freed blocks back to the driver and the next call maps them
// again; a framework's caching allocator keeps them. The benchmarks keep them too.
inline void keep_freed_pool_memory(int device) {
  cudaMemPool_t pool = nullptr;
  EPX_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  std::uint64_t keep = UINT64_MAX;
  EPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
}

inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
inline double p99_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<std::size_t>(0.99 * static_cast<double>(v.size())))];
}

// The command line of every GPU benchmark, `[--quick]`: 0 when it parsed (quick set), else
// the exit status (2, after the usage line). Then whether a device is usable: 77 (the
// tests' "skipped") after a line naming the benchmark when not, else 0.
inline int start(const char* name, int argc, char** argv, bool& quick) {
  quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "%s: no usable CUDA device\n", name);
    return 77;
  }
  return 0;
}

}  // namespace epx::bench::gpu
