// The MoE layer on the MPI backend: the same bodies as the threads tests
// (core/layer_cases.hpp), for the meshes that fit the job's size (np 1, 2, 4, 8).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/mpi.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::mpi::communicator;

layer_case make(int tp, int fsdp, int ep, int E, int k, routing_kind r = routing_kind::random, int R = 1) {
  layer_case c;
  c.topology = epx::mesh_config{tp, fsdp, 1, R, ep, E, 0};
  c.top_k = k;
  c.routing = r;
  c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + R);
  return c;
}

// Meshes for a world of n ranks.
std::vector<layer_case> cases_for(int n) {
  std::vector<layer_case> v;
  switch (n) {
    case 1: v = {make(1, 1, 1, 4, 2), make(1, 1, 1, 8, 8, routing_kind::uneven)}; break;
    case 2: v = {make(1, 2, 2, 8, 2), make(2, 1, 2, 4, 1), make(1, 1, 1, 4, 2, routing_kind::random, 2)}; break;
    case 4: v = {make(2, 2, 4, 8, 2, routing_kind::uneven), make(1, 4, 2, 8, 8), make(1, 2, 2, 4, 2, routing_kind::random, 2)}; break;
    case 8:
      v = {make(4, 2, 4, 16, 2), make(1, 8, 4, 16, 2), make(2, 4, 4, 16, 2, routing_kind::uneven), make(8, 1, 8, 16, 2),
           make(2, 4, 2, 8, 1), make(2, 4, 8, 16, 8)};
      break;
    default: break;
  }
  return v;
}

}  // namespace

TEST_CASE("layer (MPI): forward, backward and hook against the float64 reference") {
  comm_t world = comm_t::world();
  for (auto c : cases_for(world.size())) {
    CAPTURE(c.describe());
    const std::string f32 = epx::test::check_layer_case<comm_t, float>(world, c);
    CHECK_MESSAGE(f32.empty(), f32);
    const std::string b16 = epx::test::check_layer_case<comm_t, epx::bf16>(world, c);
    CHECK_MESSAGE(b16.empty(), b16);
    if (c.topology.ep == c.topology.tp) {
      const std::string ar = epx::test::check_layer_case<comm_t, float, epx::impl::all_reduce>(world, c);
      CHECK_MESSAGE(ar.empty(), ar);
    }
    auto decode = c;
    decode.rows = [](int b) { return static_cast<std::size_t>(b % 2); };  // some batches empty, others one token
    const std::string d = epx::test::check_layer_case<comm_t, float>(world, decode);
    CHECK_MESSAGE(d.empty(), d);
    const std::string det = epx::test::check_determinism<comm_t, float>(world, c);
    CHECK_MESSAGE(det.empty(), det);
    const std::string ip = epx::test::check_in_place_experts<comm_t, float>(world, c);
    CHECK_MESSAGE(ip.empty(), ip);
  }
}

TEST_CASE("layer (MPI): bad input on the last rank raises on every rank of its EP group") {
  comm_t world = comm_t::world();
  const int n = world.size();
  layer_case c = make(1, n, n, 2 * n, 1);
  c.hidden = 4;
  for (auto kind : {epx::test::bad_input::id_too_large, epx::test::bad_input::weight_nan,
                    epx::test::bad_input::out_size, epx::test::bad_input::grad_x_size}) {
    const auto r = epx::test::run_bad_input<comm_t, float>(world, c, kind, n - 1);
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::input);
    CHECK(r.message.find("rank " + std::to_string(n - 1)) != std::string::npos);
  }
}
