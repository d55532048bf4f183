// Compiled, not run, when the epx under test provides epx::cuda: the CUDA headers through
// epx::cuda alone (its include directories and nvcc options: a __device__ lambda needs
// --extended-lambda).
#include <epx/epx.hpp>
#include <epx/comm/nccl.cuh>
#include <epx/exec/cuda.cuh>

#include <cstddef>

void epx_consumer_fill(cudaStream_t stream, float* data, std::size_t n) {
  epx::exec::for_each_n(epx::exec::cuda{stream}, n, [data] __device__(std::size_t i) { data[i] = 1.0f; });
}
