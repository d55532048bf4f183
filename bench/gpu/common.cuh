// bench/gpu/common.cuh: what both GPU benchmarks set up the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

}  // namespace epx::bench::gpu
