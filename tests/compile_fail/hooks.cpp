// The gradient hooks over a communicator without all_gather: gradient_hooks names the
// missing call (check_communicator) before any error of the collectives it would call.
// Without EPX_COMPILE_FAIL the type has it and the hooks compile.
#include <cstddef>

#include "epx/grad/hooks.hpp"

namespace {

using epx::datatype;

struct my_comm {
  int rank() const { return 0; }
  int size() const { return 1; }
  my_comm split(int, int) const { return {}; }
  void all_to_all(const void*, void*, std::size_t, datatype) {}
  void all_to_allv(const void*, const std::size_t*, const std::size_t*, void*, const std::size_t*,
                   const std::size_t*, datatype) {}
  void all_reduce(const void*, void*, std::size_t, datatype, double) {}
  void reduce_scatter(const void*, void*, std::size_t, datatype, double) {}
#ifndef EPX_COMPILE_FAIL
  void all_gather(const void*, void*, std::size_t, datatype) {}
#endif
  void broadcast(void*, std::size_t, datatype, int) {}
  void barrier() {}
};

[[maybe_unused]] void reduce(my_comm& world, float* grad, std::size_t n) {
  const epx::mesh m(epx::mesh_config{1, 1, 1, 1, 1, 1, 0});
  epx::gradient_hooks<my_comm> hooks(m, world);
  hooks.reduce_expert(epx::span<float>(grad, n));
}

}  // namespace

int main() { return 0; }
