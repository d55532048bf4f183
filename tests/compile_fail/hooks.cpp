// The gradient hooks over a communicator without all_gather: gradient_hooks names the
// missing call (check_communicator) before any error of the collectives it would call.
// Without EPX_COMPILE_FAIL the type has it and the hooks compile.
#include <cstddef>

#include "epx/grad/hooks.hpp"
#include "my_comm.hpp"

namespace {

[[maybe_unused]] void reduce(my_comm& world, float* grad, std::size_t n) {
  const epx::mesh m(epx::mesh_config{1, 1, 1, 1, 1, 1, 0});
  epx::gradient_hooks<my_comm> hooks(m, world);
  hooks.reduce_expert(epx::span<float>(grad, n));
}

}  // namespace

int main() { return 0; }
