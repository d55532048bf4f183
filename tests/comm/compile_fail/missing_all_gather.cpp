// Must NOT compile: a communicator without all_gather. check_communicator names the missing
// call: "epx: the communicator type needs `void all_gather(const void* send, void* recv,
// std::size_t count, datatype t)`". Not built by the test glob (tests/comm/*.cpp only);
// compile it on its own to see the diagnostic:
//   c++ -std=c++17 -fsyntax-only -Iinclude tests/comm/compile_fail/missing_all_gather.cpp
#include <cstddef>

#include "epx/comm/communicator.hpp"

namespace {

using epx::datatype;

struct no_all_gather {
  int rank() const { return 0; }
  int size() const { return 1; }
  no_all_gather split(int, int) const { return {}; }
  void all_to_all(const void*, void*, std::size_t, datatype) {}
  void all_to_allv(const void*, const std::size_t*, const std::size_t*, void*, const std::size_t*,
                   const std::size_t*, datatype) {}
  void all_reduce(const void*, void*, std::size_t, datatype, double) {}
  void reduce_scatter(const void*, void*, std::size_t, datatype, double) {}
  void broadcast(void*, std::size_t, datatype, int) {}
  void barrier() {}
};

static_assert(epx::check_communicator<no_all_gather>(), "no_all_gather is not a communicator");

}  // namespace

int main() { return 0; }
