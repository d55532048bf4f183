// A communicator without all_gather: check_communicator names the missing call. Without
// EPX_COMPILE_FAIL the type has it and meets the concept.
#include <cstddef>

#include "epx/comm/communicator.hpp"

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

static_assert(epx::check_communicator<my_comm>(), "my_comm is not a communicator");

}  // namespace

int main() { return 0; }
