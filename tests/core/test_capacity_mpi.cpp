// Capacity, token dropping, node statistics and the bias update on the MPI backend: the bodies of
// core/layer_cases.hpp for the meshes that fit the job's size (np 1, 2, 4, 8), in both
// capacity modes and priorities, on the all-to-all path (staged route) and, where ep == tp,
// the masked path.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/layer_cases.hpp"
#include "core/mpi_cases.hpp"
#include "epx/comm/mpi.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::mpi::communicator;

// Routing uneven where a case names none, 10 + 3b rows in batch b (core/mpi_cases.hpp).
const epx::test::case_maker make{routing_kind::uneven, [](int b) { return static_cast<std::size_t>(10 + 3 * b); }, 5};

std::vector<layer_case> cases_for(int n) {
  switch (n) {
    case 1: return {make(1, 1, 1, 4, 2)};
    case 2: return {make(1, 2, 2, 8, 2), make(2, 1, 2, 4, 1)};
    case 4: return {make(2, 2, 4, 8, 2), make(1, 4, 2, 8, 4), make(4, 1, 4, 8, 2)};
    case 8: return {make(2, 4, 4, 16, 2), make(1, 8, 8, 16, 2), make(2, 2, 2, 8, 2, routing_kind::uneven, 2)};
    default: return {};
  }
}

}  // namespace

TEST_CASE("capacity (MPI): local and global, by position and by score, against the float64 reference") {
  comm_t world = comm_t::world();
  for (auto c : cases_for(world.size()))
    for (auto mode : {epx::capacity_mode::local, epx::capacity_mode::global})
      for (auto prio : {epx::drop_priority::position, epx::drop_priority::score}) {
        c.capacity.mode = mode;
        c.capacity.priority = prio;
        c.capacity.factor = 0.75;
        c.ranks_per_node = c.topology.ep % 2 == 0 ? 2 : 1;
        CAPTURE(c.describe());
        const std::string f32 = epx::test::check_layer_case<comm_t, float>(world, c);
        CHECK_MESSAGE(f32.empty(), f32);
        const std::string b16 = epx::test::check_layer_case<comm_t, epx::bf16>(world, c);
        CHECK_MESSAGE(b16.empty(), b16);
        if (c.topology.ep == c.topology.tp) {
          const std::string ar = epx::test::check_layer_case<comm_t, float, epx::impl::all_reduce>(world, c);
          CHECK_MESSAGE(ar.empty(), ar);
        }
        const std::string det = epx::test::check_determinism<comm_t, float>(world, c);
        CHECK_MESSAGE(det.empty(), det);
      }
}

TEST_CASE("capacity (MPI): a negative factor raises errc::configuration on every rank") {
  comm_t world = comm_t::world();
  const int n = world.size();
  epx::mesh_config mc;
  mc.fsdp = n;
  mc.ep = n;
  mc.experts = 2 * n;
  const epx::mesh m(mc);
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 1;
  o.capacity.mode = epx::capacity_mode::local;
  o.capacity.factor = world.rank() == n - 1 ? -1.0 : 1.0;
  std::string msg;
  try {
    epx::moe_layer<comm_t, float> layer(m, world, o);
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::configuration);
    msg = e.message();
  }
  CHECK_MESSAGE(msg.find("capacity.factor (-1) must be a finite number >= 0") != std::string::npos, msg);
}

TEST_CASE("balance (MPI): loads summed over every batch keep the bias bitwise equal on every rank") {
  comm_t world = comm_t::world();
  const int n = world.size();
  epx::mesh_config mc;
  mc.tp = n % 2 == 0 ? 2 : 1;
  mc.fsdp = n / mc.tp;
  mc.ep = mc.tp;
  mc.experts = 8;
  const epx::mesh m(mc);
  const int E = 8, k = 2;
  const std::size_t N = 20;
  auto batches = epx::routing::batch_communicator(world, m);
  CHECK(batches.size() == m.batches());
  std::vector<float> bias(E, 0.0f);
  for (int step = 0; step < 4; ++step) {
    const auto ids = epx::ref::uneven_routing(N, E, k, 500 + static_cast<std::uint64_t>(m.batch(world.rank()) * 10 + step));
    auto load = epx::routing::expert_load(epx::exec::serial{}, ids.data(), N, k, E);
    epx::routing::sum_over_batches(batches, epx::span<std::int64_t>(load));
    std::vector<std::int64_t> want(E, 0);
    for (int b = 0; b < m.batches(); ++b)
      for (auto id : epx::ref::uneven_routing(N, E, k, 500 + static_cast<std::uint64_t>(b * 10 + step))) ++want[id];
    CHECK(load == want);
    epx::routing::update_bias(epx::exec::serial{}, bias.data(), epx::span<const std::int64_t>(load), 0.01f);
  }
  std::vector<float> all(static_cast<std::size_t>(n) * E);
  epx::all_gather(world, epx::span<const float>(bias), epx::span<float>(all));
  for (int r = 1; r < n; ++r) CHECK(std::memcmp(all.data(), all.data() + static_cast<std::size_t>(r) * E, E * sizeof(float)) == 0);
}
