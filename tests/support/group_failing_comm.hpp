// tests/support/group_failing_comm.hpp: a communicator over Comm (threads or MPI) whose
// `fail_split`-th split (counted on the world communicator: a layer makes ep then tp, the
// gradient hooks efsdp, fsdp, dp_replicate) makes, on the world ranks of `fail_ranks` (a
// bit each), a communicator whose all_gather completes and then raises
// errc::communicator: that group's collective failing on every member, as after its
// watchdog (tests/core/test_layer_errors.cpp, tests/core/test_layer_mpi.cpp).
#pragma once

#include <cstddef>
#include <memory>

#include "epx/comm/communicator.hpp"
#include "epx/core/error.hpp"
#include "support/forwarding_comm.hpp"

namespace epx::test {

template <class Comm>
struct group_failing_comm : forwarding_comm<Comm> {
  int world_rank = 0;
  int fail_split = -1;
  unsigned fail_ranks = 0;
  bool fails = false;
  std::shared_ptr<int> splits = std::make_shared<int>(0);
  group_failing_comm split(int color, int key) const {
    const bool f = *splits == fail_split && ((fail_ranks >> world_rank) & 1u) != 0;
    ++*splits;
    return {{this->c.split(color, key)}, world_rank, -1, 0, f};
  }
  void all_gather(const void* s, void* r, std::size_t n, epx::datatype t) {
    this->c.all_gather(s, r, n, t);
    if (fails) throw epx::error(epx::errc::communicator, "injected failure of a group's all_gather", EPX_HERE);
  }
};

}  // namespace epx::test
