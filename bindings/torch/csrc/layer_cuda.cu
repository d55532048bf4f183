// bindings/torch/csrc/layer_cuda.cu: the CUDA layer of epx_torch (epx_torch_cuda_C only):
// CUDA tensors on torch's current stream, exec::cuda on that stream, the collectives of the
// group's NCCL backend (torch_device_communicator). c10d's NCCL work waits for the current
// stream before it starts and makes the current stream wait for it (Work::wait), so the
// layer's kernels and the group's collectives are ordered by the one stream; the host waits
// only where the layer reads the count exchange back (device_side<cuda>::wait, bounded).
#include "epx/exec/cuda.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <chrono>
#include <thread>

#include "bind_layer.hpp"
#include "layer_impl.hpp"

namespace epx_torch {

template <>
struct device_side<epx::exec::cuda> {
  static epx::exec::cuda current() { return epx::exec::cuda{at::cuda::getCurrentCUDAStream().stream()}; }
  static at::Device device() { return at::Device(at::kCUDA, c10::cuda::current_device()); }
  // Polls the stream: true once its work is done, false after `timeout` (a collective whose
  // peer never comes; the group's own watchdog aborts it). A CUDA error raises.
  static bool wait(const epx::exec::cuda& ex, std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const cudaError_t r = cudaStreamQuery(ex.stream);
      if (r == cudaSuccess) return true;
      EPX_REQUIRE(r == cudaErrorNotReady, epx::errc::cuda, "epx_torch: the CUDA stream failed: ",
                  cudaGetErrorString(r));
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  static void copy(const epx::exec::cuda& ex, std::byte* d, const std::byte* s, std::size_t n) {
    epx::exec::copy_n(ex, s, n, d);  // device to device, queued
  }
  static void collective_queued() {}
  static void collective_waited() {}
  struct scope {};
  using guard = c10::cuda::CUDAGuard;
};

using cuda_torch_layer = basic_torch_layer<epx::exec::cuda, torch_device_communicator<epx::exec::cuda>>;
template class basic_torch_layer<epx::exec::cuda, torch_device_communicator<epx::exec::cuda>>;

static_assert(epx::check_communicator<torch_device_communicator<epx::exec::cuda>>());
static_assert(epx::detail::is_device_communicator_v<torch_device_communicator<epx::exec::cuda>>);

void bind_cuda(pybind11::module_& m) { bind_layer<cuda_torch_layer>(m, "_CudaLayer"); }

}  // namespace epx_torch
