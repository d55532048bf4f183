// tests/support/on_ranks.hpp: runs a test body on every rank of a threads world and checks
// what each rank reported.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "epx/comm/threads.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx::test {

// The ranks of a mesh: tp * fsdp * dp_replicate * pp.
inline int world_of(const epx::mesh_config& m) { return m.tp * m.fsdp * m.dp_replicate * m.pp; }

// Runs `body(comm)` on each of `world` threads ranks; each rank's returned text must be
// empty (it names what failed otherwise).
template <class Body>
void on_ranks(int world, Body body) {
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  epx::threads::run(world, [&](epx::threads::communicator& comm) {
    failures[static_cast<std::size_t>(comm.rank())] = body(comm);
  });
  for (int r = 0; r < world; ++r)
    CHECK_MESSAGE(failures[static_cast<std::size_t>(r)].empty(), failures[static_cast<std::size_t>(r)]);
}

}  // namespace epx::test
