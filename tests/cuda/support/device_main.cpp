// Main of the CUDA tests: runs doctest when a CUDA device is present; otherwise says so and
// exits with 77, which ctest reports as "skipped" (SKIP_RETURN_CODE), never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::fprintf(stderr, "epx CUDA tests: no usable CUDA device (%s): skipped\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("epx CUDA tests: %d device(s); device 0: %s (sm_%d%d)\n", count, prop.name, prop.major, prop.minor);
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
