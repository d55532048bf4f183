// Builds a mesh through the public umbrella header and prints its rank table.
#include <epx/epx.hpp>

#include <iostream>

int main() {
  static_assert(EPX_VERSION_MAJOR == 0 && EPX_VERSION_MINOR == 1, "unexpected epx version");
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
  return 0;
}
