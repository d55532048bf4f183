// tests/core/mpi_cases.hpp: the cases of the MPI layer tests (test_layer_mpi.cpp,
// test_split_mpi.cpp, test_bounded_mpi.cpp, test_capacity_mpi.cpp), one mesh each: case_maker makes a layer_case of a mesh with a seed
// from its numbers, and holds what a test file sets apart from another: the routing where a
// case names none, the rows of a batch and an offset of the seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "core/layer_cases.hpp"

namespace epx::test {

struct case_maker {
  routing_kind routing = routing_kind::random;  // where a case names none
  std::function<std::size_t(int)> rows;         // rows of batch b (empty: layer_case's 12)
  int seed_offset = 0;                          // added to the seed of every case

  // tp x fsdp ranks (times R, dp_replicate), EP groups of ep ranks, E experts, top-k, routing r.
  layer_case operator()(int tp, int fsdp, int ep, int E, int k, routing_kind r, int R = 1) const {
    layer_case c;
    c.topology = mesh_config{tp, fsdp, 1, R, ep, E, 0};
    c.top_k = k;
    c.routing = r;
    c.rows = rows;
    c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + R + seed_offset);
    return c;
  }
  layer_case operator()(int tp, int fsdp, int ep, int E, int k) const { return (*this)(tp, fsdp, ep, E, k, routing); }
};

}  // namespace epx::test
