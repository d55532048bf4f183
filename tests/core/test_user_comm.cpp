// A communicator of a user's own (tests/core/user_communicator.hpp: the required members
// only) runs the layer and the hooks: results against the float64 reference, and bitwise
// those of the threads communicator's staged route, whose optional members (segments and
// indexed sends in one collective) this one lacks.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/layer_cases.hpp"
#include "core/user_communicator.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_user_comm_cpp {

namespace {

using epx::test::layer_case;
using comm_t = epx::threads::communicator;

static_assert(!epx::has_peer_access_v<user::my_comm>);
static_assert(!epx::has_indexed_sends_v<user::my_comm>);
static_assert(!epx::detail::has_native_segments<user::my_comm>::value);

layer_case make(int tp, int fsdp, int ep, int E, int k, int H, int R = 1) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.dp_replicate = R;
  c.topology.experts = E;
  c.top_k = k;
  c.hidden = H;
  c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + H + R);
  return c;
}

int world_of(const epx::mesh_config& m) { return m.tp * m.fsdp * m.dp_replicate * m.pp; }

template <class T, class Impl = epx::impl::all_to_all>
void check_case(const layer_case& c) {
  CAPTURE(c.describe());
  const int world = world_of(c.topology);
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  std::vector<epx::test::layer_outputs<T>> mine(failures.size()), threads(failures.size());
  const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  layer_case staged = c;
  staged.peer_access = false;
  epx::threads::run(world, [&](comm_t& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    threads[r] = epx::test::run_layer<comm_t, T, Impl>(comm, staged, global);
    user::my_comm own(std::move(comm));
    failures[r] = epx::test::check_layer_case<user::my_comm, T, Impl>(own, c);
    mine[r] = epx::test::run_layer<user::my_comm, T, Impl>(own, c, global);
  });
  for (std::size_t r = 0; r < failures.size(); ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(failures[r].empty(), failures[r]);
    const std::string diff = epx::test::bitwise_differences(mine[r], threads[r], "my_comm against threads: ");
    CHECK_MESSAGE(diff.empty(), diff);
  }
}

}  // namespace

TEST_CASE("a user's communicator with the required members only: the layer and the hooks over it") {
  check_case<float>(make(1, 4, 4, 8, 2, 64));
  // tp = 2. (Linear experts of H x H float64 weights: larger H is for test_layer_sizes.)
  check_case<float>(make(2, 4, 4, 8, 4, 256));
  check_case<epx::bf16>(make(2, 2, 4, 8, 2, 256, 2));  // dp_replicate = 2
  check_case<epx::bf16>(make(1, 8, 8, 16, 8, 128));    // top-8 over 8 ranks
}

TEST_CASE("a user's communicator: the all_reduce and automatic implementations over it") {
  check_case<float, epx::impl::all_reduce>(make(4, 1, 4, 8, 2, 256));
  check_case<float, epx::impl::automatic>(make(2, 2, 2, 4, 2, 128));
}

}  // namespace test_user_comm_cpp
