// epx/comm/threads/cuda.cuh: several threads ranks on one GPU (device memory).
//
//   epx::threads::options o;
//   o.memory = epx::threads::device_memory();
//   epx::threads::run(8, [&](epx::threads::communicator& comm) {
//     cudaStream_t s;  // each rank its own stream
//     cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
//     epx::moe_layer<epx::threads::communicator, epx::bf16, epx::impl::all_to_all, epx::exec::cuda>
//         layer(mesh, comm, lo, epx::exec::cuda{s});
//     ...
//   }, o);
//
// The ranks' row buffers are device memory of the current device; the communicator moves
// each block with cudaMemcpyAsync on the calling thread's per-thread stream
// (cudaMemcpyDefault: device to device within one GPU, and host memory where a caller
// passes it) and waits for that stream before the copy counts as done. A plain cudaMemcpy
// would not do: between two device buffers it returns before the copy has run, on the
// legacy default stream, which the ranks' non-blocking streams do not wait for. The layer
// waits for a rank's stream before each collective of a host communicator
// (epx/comm/settle.hpp), and a rank's later work on its stream starts after the
// collective's exit barrier, when every peer's copies have completed, so no event is
// needed.
// Sums (all_reduce, reduce_scatter) are staged through the host and computed there in rank
// order, as on host memory. With layer_options::peer_access (the default) the layer takes
// the direct route here too: its kernels read the peers' device rows, which share the one
// GPU's memory (epx/impl/options.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "epx/comm/threads/options.hpp"

namespace epx::threads {

// Copies `bytes` between any two buffers of the device address space (threads::memory::copy)
// and returns once the bytes are in place. A failure is returned (the communicator raises
// it) and cleared from the thread's last CUDA error, which the next kernel launch on this
// thread checks: left there, it would be raised again as that launch's failure.
inline bool cuda_device_copy(void* dst, const void* src, std::size_t bytes) noexcept {
  if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread) == cudaSuccess &&
      cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess)
    return true;
  (void)cudaGetLastError();
  return false;
}

// The memory of ranks whose buffers are CUDA device memory (or managed memory).
inline memory device_memory() noexcept {
  memory m;
  m.copy = &cuda_device_copy;
  m.host_accessible = false;
  m.name = "cuda device";
  return m;
}

}  // namespace epx::threads
