// Builds a mesh through the public umbrella header and prints its rank table, then says
// whether exec::openmp runs in parallel with nothing but epx::epx linked, and the chunk
// count of its plans; with EPX_CONSUMER_CUDA_OPENMP, openmp.cu (nvcc) says the same.
#include <epx/epx.hpp>

#include <iostream>

#include "openmp_probe.hpp"

#if EPX_CONSUMER_CUDA_OPENMP
#include <ostream>
void epx_consumer_cuda_openmp(std::ostream& out);  // openmp.cu
#endif

// Set by the package tests: whether the epx under test was built with OpenMP. epx::epx
// must then bring OpenMP's compile flags, whichever way the consumer found it.
#if defined(EPX_CONSUMER_EXPECT_OPENMP)
static_assert(EPX_HAS_OPENMP == EPX_CONSUMER_EXPECT_OPENMP,
              "EPX_HAS_OPENMP differs from the OpenMP setting of the epx under test");
#endif

// Set by the package tests from epx's CMake project version: the headers' macros must agree.
#if defined(EPX_CONSUMER_VERSION_MAJOR)
static_assert(EPX_VERSION_MAJOR == EPX_CONSUMER_VERSION_MAJOR && EPX_VERSION_MINOR == EPX_CONSUMER_VERSION_MINOR &&
                  EPX_VERSION_PATCH == EPX_CONSUMER_VERSION_PATCH,
              "EPX_VERSION_MAJOR/MINOR/PATCH (epx/core/config.hpp) differ from epx's CMake project version");
#endif

int main() {
  epx::mesh_config c;
  c.tp = 2;
  c.fsdp = 4;
  c.experts = 8;
  try {
    std::cout << epx::describe(c, {2, 4, 8});
    c.ep = 3;
    epx::mesh bad(c);  // must throw: ep_size (3) is not a multiple of tp_size (2)
    return 1;
  } catch (const epx::error& e) {
    std::cout << "error: " << e.message() << "\n";
  }

  epx_consumer_report_openmp(std::cout, "");
#if EPX_CONSUMER_CUDA_OPENMP
  epx_consumer_cuda_openmp(std::cout);  // openmp.cu: the same, from a CUDA source
#endif
  return 0;
}
