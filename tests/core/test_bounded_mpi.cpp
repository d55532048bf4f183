// Bounded mode (spec section 11) on the MPI backend (staged route: one fixed-size
// all-to-all per direction): bitwise the normal mode when nothing overflows, the
// local-capacity drops of the float64 reference with overflow, for the meshes that fit the
// job's size (np 1, 2, 4, 8); a bad bound and bad input on the last rank.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/bounded_cases.hpp"
#include "core/mpi_cases.hpp"
#include "epx/comm/mpi.hpp"
#include "support/copy_experts.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::mpi::communicator;

// Routing random where a case names none, 9 + 2b rows in batch b (core/mpi_cases.hpp).
const epx::test::case_maker make{routing_kind::random, [](int b) { return static_cast<std::size_t>(9 + 2 * b); }, 5};

std::vector<layer_case> cases_for(int n) {
  switch (n) {
    case 1: return {make(1, 1, 1, 4, 2)};
    case 2: return {make(1, 2, 2, 8, 2), make(2, 1, 2, 4, 1)};
    case 4: return {make(2, 2, 4, 8, 2, routing_kind::uneven), make(1, 4, 2, 8, 4)};
    case 8: return {make(2, 4, 8, 16, 4), make(4, 2, 4, 8, 2, routing_kind::one_expert), make(1, 8, 8, 16, 2, routing_kind::uneven)};
    default: return {};
  }
}

}  // namespace

TEST_CASE("bounded (MPI): bitwise the normal mode without overflow, reference drops with overflow") {
  comm_t world = comm_t::world();
  for (auto c : cases_for(world.size())) {
    CAPTURE(c.describe());
    const std::string a = epx::test::check_bounded_case<comm_t, float, epx::exec::serial>(world, c, 64, false);
    CHECK_MESSAGE(a.empty(), a);
    const std::string b = epx::test::check_bounded_case<comm_t, epx::bf16, epx::exec::serial>(world, c, 64, false);
    CHECK_MESSAGE(b.empty(), b);
    if (c.top_k > 1 || c.topology.experts > 4) {
      c.capacity.priority = epx::drop_priority::score;
      const std::string d = epx::test::check_bounded_case<comm_t, float, epx::exec::serial>(world, c, 1, true);
      if (!d.empty()) std::fprintf(stderr, "%s", d.c_str());
      CHECK_MESSAGE(d.empty(), d);
    }
  }
}

TEST_CASE("bounded (MPI), masked path: bitwise the normal masked path, reference drops with overflow") {
  comm_t world = comm_t::world();
  for (auto c : cases_for(world.size())) {
    if (c.topology.ep != c.topology.tp) continue;
    CAPTURE(c.describe());
    const std::string a =
        epx::test::check_bounded_case<comm_t, float, epx::exec::serial, epx::impl::all_reduce>(world, c, 64, false);
    CHECK_MESSAGE(a.empty(), a);
    c.routing = routing_kind::one_expert;
    const std::string d =
        epx::test::check_bounded_case<comm_t, float, epx::exec::serial, epx::impl::all_reduce>(world, c, 1, true);
    CHECK_MESSAGE(d.empty(), d);
  }
}

TEST_CASE("bounded (MPI): a bound below 1 on the last rank, and a bad expert id, raise on every rank") {
  comm_t world = comm_t::world();
  const int n = world.size();
  epx::mesh_config mc{1, n, 1, 1, n, 2 * n, 0};
  const epx::mesh m(mc);
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 1;
  o.counts = epx::count_exchange::device;
  o.bound.cap = world.rank() == n - 1 ? 0 : 2;
  std::string msg;
  try {
    epx::moe_layer<comm_t, float> layer(m, world, o);
  } catch (const epx::error& e) {
    if (e.category() == epx::errc::configuration) msg = e.message();
  }
  CHECK_MESSAGE(msg.find("bound.cap (0) must be at least 1") != std::string::npos, msg);

  o.bound.cap = 2;
  epx::moe_layer<comm_t, float> layer(m, world, o);
  std::vector<float> x(8, 1.0f), w(2, 1.0f), y(8);
  std::vector<std::int32_t> ids = {0, world.rank() == n - 1 ? 2 * n : 1};
  epx::test::copy_experts e;
  (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                      epx::span<float>(y), e, epx::mode::inference);
  msg.clear();
  try {
    (void)layer.check();
  } catch (const epx::error& err) {
    if (err.category() == epx::errc::input) msg = err.message();
  }
  CHECK_MESSAGE(msg.find("1 call(s) of the EP group had an expert id out of range") != std::string::npos, msg);
}

// docs/guarantees.md: on bounded mode's masked path a rank whose N differs makes the sums'
// own count check raise errc::communicator at the call, on every rank (MPI as on threads).
TEST_CASE("bounded (MPI), masked path: a rank with another N makes the all-reduce raise errc::communicator everywhere") {
  comm_t world = comm_t::world();
  const int n = world.size();
  if (n < 2) return;
  const epx::mesh m(epx::mesh_config{n, 1, 1, 1, n, 2 * n, 0});
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 1;
  o.counts = epx::count_exchange::device;
  o.bound.cap = 4;
  epx::moe_layer<comm_t, float, epx::impl::all_reduce> layer(m, world, o);
  const std::size_t N = world.rank() == n - 1 ? 3 : 4;
  std::vector<float> x(N * 4, 1.0f), w(N, 1.0f), y(N * 4);
  std::vector<std::int32_t> ids(N, 0);
  epx::test::copy_experts e;
  std::string msg = "no error";
  try {
    (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                        epx::span<float>(y), e, epx::mode::inference);
  } catch (const epx::error& err) {
    msg = err.category() == epx::errc::communicator ? err.message() : std::string("wrong category: ") + err.what();
  }
  CHECK_MESSAGE(msg.find("all_reduce") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("wrong category") == std::string::npos, msg);
}
