// The MoE layer on the MPI backend: the same bodies as the threads tests
// (core/layer_cases.hpp), for the meshes that fit the job's size (np 1, 2, 4, 8).
#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "core/mpi_cases.hpp"
#include "epx/comm/mpi.hpp"
#include "epx/exec/emulated.hpp"
#include "support/group_failing_comm.hpp"
#include "support/throwing_experts.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::mpi::communicator;

const epx::test::case_maker make{};

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

// cases_for(n) and one at H = 300 with slices of different lengths.
std::vector<layer_case> with_wide_case(int n) {
  auto cases = cases_for(n);
  auto wide = make(1, n, n, 4 * n, std::min(6, 4 * n), routing_kind::random);
  wide.hidden = 300;
  wide.rows = [](int b) { return static_cast<std::size_t>(30 + 3 * b); };
  cases.push_back(wide);
  return cases;
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

namespace {

using epx::test::throwing_experts;  // support/throwing_experts.hpp

}  // namespace

// As "experts that throw, on one rank or on all, caught there" of test_layer_errors.cpp, on
// MPI with options::check_counts (the default): the last rank's experts throw and it
// catches; its next step meets its peers still inside the failed call, which check_counts
// raises on every rank (errc::communicator). Then every rank's steps give the clean step's
// results bit for bit.
TEST_CASE("layer (MPI): experts that throw on the last rank, caught there: every rank raises, then the layer goes on") {
  comm_t world = comm_t::world();
  const int n = world.size(), rank = world.rank();
  if (n < 2) return;
  for (bool direct : {true, false})
    for (bool in_backward : {false, true}) {
      CAPTURE(direct);
      CAPTURE(in_backward);
      layer_case c = make(1, n, n, 2 * n, 2);
      c.hidden = 4;
      c.peer_access = direct;
      const epx::mesh m(c.topology);
      const epx::test::rank_inputs<float> in(c, rank);
      throwing_experts experts(in.global, m.ep_rank(rank), m.local_experts());
      epx::moe_layer<comm_t, float> layer(m, world, epx::test::options_for(c));
      const std::vector<float> go(in.d.grad_out.begin(), in.d.grad_out.end());
      std::vector<float> out, gx, gw;
      const auto step = [&]() -> std::string {
        out.assign(in.N * in.H, 7.0f);
        gx.assign(in.N * in.H, 7.0f);
        gw.assign(in.w.size(), 7.0f);
        try {
          auto saved = layer.forward(epx::span<const float>(in.x), epx::span<const std::int32_t>(in.d.ids),
                                     epx::span<const float>(in.w), epx::span<float>(out), experts, epx::mode::train);
          layer.backward(std::move(saved), epx::span<const float>(go), epx::span<float>(gx), epx::span<float>(gw),
                         experts);
          return {};
        } catch (const std::exception& e) {
          return e.what();
        }
      };
      std::string e = step();
      REQUIRE_MESSAGE(e.empty(), e);
      const auto out0 = out, gx0 = gx, gw0 = gw;
      const bool thrower = rank == n - 1;
      (in_backward ? experts.fail_backward : experts.fail_forward) = thrower;
      e = step();
      CHECK_MESSAGE(e.find(thrower ? "injected" : "epx communicator error") != std::string::npos, e);
      if (thrower) {
        e = step();
        CHECK_MESSAGE(e.find("epx communicator error") != std::string::npos, e);
      }
      for (int i = 0; i < 2; ++i) {
        CAPTURE(i);
        e = step();
        CHECK_MESSAGE(e.empty(), e);
        CHECK((out == out0 && gx == gx0 && gw == gw0));
      }
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
    CHECK_MESSAGE(r.moved.empty(), r.moved);  // raised before any row moved
    CHECK(r.message.find("rank " + std::to_string(n - 1)) != std::string::npos);
  }
}

// The direct route through shared memory (the ranks of a job on one node) and the staged
// route give bitwise the same outputs, input and weight gradients and expert gradients, in
// float32 and bf16, on every mesh of the job's size, at toy and at wider hidden sizes; each
// also matches the float64 reference (the test above runs the direct route, the default).
TEST_CASE("layer (MPI): the direct route (shared memory) and the staged one agree bitwise") {
  comm_t world = comm_t::world();
  REQUIRE(world.peer_access_available());  // the tests run on one node
  const int n = world.size();
  auto cases = cases_for(n);
  auto padded = make(1, n, n, 2 * n, 2, routing_kind::first_rank_only);
  padded.pad = {2, 4};
  cases.push_back(padded);
  auto some_empty = make(1, n, n, 4 * n, 2);
  some_empty.rows = [](int b) { return b % 2 ? std::size_t{0} : std::size_t{10}; };
  cases.push_back(some_empty);
  for (const auto& c : cases) {
    CAPTURE(c.describe());
    const std::string f32 = epx::test::check_routes_agree<comm_t, float>(world, c);
    CHECK_MESSAGE(f32.empty(), f32);
    const std::string b16 = epx::test::check_routes_agree<comm_t, epx::bf16>(world, c);
    CHECK_MESSAGE(b16.empty(), b16);
  }
  // Wider rows (H = 768, linear H x H experts: the float64 reference holds every expert on
  // every rank, so H stays well below 4096 here) with more tokens per rank.
  auto big = make(1, n, n, 2 * n, std::min(4, 2 * n), routing_kind::random);
  big.hidden = 768;
  big.rows = [](int b) { return static_cast<std::size_t>(24 + 5 * b); };
  CAPTURE(big.describe());
  const std::string f32 = epx::test::check_routes_agree<comm_t, float>(world, big);
  CHECK_MESSAGE(f32.empty(), f32);
  const std::string b16 = epx::test::check_routes_agree<comm_t, epx::bf16>(world, big);
  CHECK_MESSAGE(b16.empty(), b16);
  const std::string ref = epx::test::check_layer_case<comm_t, epx::bf16>(world, big);
  CHECK_MESSAGE(ref.empty(), ref);
}

// The direct route makes its published rows in the communicator's peer buffers: each
// saved state holds its outputs' block until its backward, so 70 training forwards held at
// once (the pool has 64 windows) end with some in the layer's own memory, published by
// copy. Every call's out, grad_x and grad_w are bitwise the staged route's.
TEST_CASE("layer (MPI): more saved states held at once than the peer buffers hold") {
  comm_t world = comm_t::world();
  REQUIRE(world.peer_access_available());
  const int n = world.size();
  layer_case c = make(1, n, n, 2 * n, std::min(2, 2 * n));
  c.hidden = 8;
  const epx::mesh m(c.topology);
  const int rank = world.rank(), b = m.batch(rank);
  const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  const epx::test::batch_data d = epx::test::make_batch<float>(c, b);
  const std::size_t N = c.rows_of(b), H = static_cast<std::size_t>(c.hidden), K = static_cast<std::size_t>(c.top_k);
  const auto x = epx::ref::from_double<float>(d.x);
  const auto go = epx::ref::from_double<float>(d.grad_out);
  const std::vector<float> w(d.w.begin(), d.w.end());
  layer_case staged_case = c;
  staged_case.peer_access = false;
  const auto want = epx::test::run_layer<comm_t, float, epx::impl::all_to_all>(world, staged_case, global);
  layer_case direct_case = c;
  direct_case.peer_access = true;
  epx::moe_layer<comm_t, float> layer(m, world, epx::test::options_for(direct_case));
  epx::ref::test_linear_experts<float> experts(global, m.ep_rank(rank), m.local_experts());
  constexpr int calls = 70;
  std::vector<epx::saved_state<float>> saved;
  std::string bad;
  for (int i = 0; i < calls; ++i) {
    std::vector<float> out(N * H, 7.0f);
    saved.push_back(layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(d.ids),
                                  epx::span<const float>(w), epx::span<float>(out), experts, epx::mode::train));
    if (out != want.out) bad += epx::detail::concat("forward ", i, " out; ");
  }
  CHECK(layer.stats().peer_access);
  for (int i = calls - 1; i >= 0; --i) {
    std::vector<float> gx(N * H, 7.0f), gw(N * K, 7.0f);
    layer.backward(std::move(saved[static_cast<std::size_t>(i)]), epx::span<const float>(go), epx::span<float>(gx),
                   epx::span<float>(gw), experts);
    if (gx != want.grad_x) bad += epx::detail::concat("backward ", i, " grad_x; ");
    if (gw != want.grad_w) bad += epx::detail::concat("backward ", i, " grad_w; ");
  }
  CHECK_MESSAGE(bad.empty(), bad);
}

// Per-rank sends (spec section 14): against float64, and against per-slot sends (expert
// and weight gradients bitwise, out and grad_x within rounding, no more rows sent).
TEST_CASE("layer (MPI): per-rank sends against float64 and against per-slot sends") {
  comm_t world = comm_t::world();
  const int n = world.size();
  const auto cases = with_wide_case(n);
  for (auto c : cases) {
    c.sends = epx::row_sends::per_rank;
    CAPTURE(c.describe());
    const std::string f32 = epx::test::check_layer_case<comm_t, float>(world, c);
    CHECK_MESSAGE(f32.empty(), f32);
    const std::string b16 = epx::test::check_layer_case<comm_t, epx::bf16>(world, c);
    CHECK_MESSAGE(b16.empty(), b16);
    const std::string agree = epx::test::check_sends_agree<comm_t, float>(world, c);
    CHECK_MESSAGE(agree.empty(), agree);
  }
}

// The staged route in rounds (layer_options::stage_bytes, one and a few slice rows a
// round): against float64, and bitwise against one round.
TEST_CASE("layer (MPI): the staged route in rounds against float64 and against one round") {
  comm_t world = comm_t::world();
  const int n = world.size();
  const auto cases = with_wide_case(n);
  for (auto c : cases) {
    c.peer_access = false;
    for (std::size_t per_round : {std::size_t{1}, std::size_t{4}}) {
      c.stage_bytes = per_round * static_cast<std::size_t>(c.top_k) * static_cast<std::size_t>(c.hidden) * sizeof(float);
      CAPTURE(c.describe());
      const std::string f32 = epx::test::check_layer_case<comm_t, float>(world, c);
      CHECK_MESSAGE(f32.empty(), f32);
      const std::string agree = epx::test::check_rounds_agree<comm_t, float>(world, c);
      CHECK_MESSAGE(agree.empty(), agree);
    }
  }
}

TEST_CASE("layer (MPI): without shared memory the layer takes the staged route, with the same bits") {
  comm_t world = comm_t::world();
  epx::mpi::options o;
  o.shared_memory = false;
  comm_t off = comm_t::world(o);
  const int n = world.size();
  const auto c = make(1, n, n, 2 * n, 2, routing_kind::uneven);
  const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  const auto a = epx::test::run_layer<comm_t, float, epx::impl::all_to_all>(world, c, global);
  const auto b = epx::test::run_layer<comm_t, float, epx::impl::all_to_all>(off, c, global);
  CHECK(a.stats.peer_access);
  CHECK(!b.stats.peer_access);
  CHECK(epx::test::bitwise_equal(a.out, b.out));
  CHECK(epx::test::bitwise_equal(a.grad_x, b.grad_x));
  CHECK(epx::test::bitwise_equal(a.grad_w, b.grad_w));
  CHECK(epx::test::bitwise_equal(a.expert_grads, b.expert_grads));
}

// Ranks that built the layer differently (options, element type, implementation, host or
// device policy) raise errc::configuration at construction on every rank, naming the
// field, instead of moving rows by different layouts (a heap overflow, a truncated message
// or a wait for the watchdog in the first forward).
TEST_CASE("layer (MPI): ranks that disagree on the options or the template arguments raise on every rank") {
  comm_t world = comm_t::world();
  const int n = world.size();
  if (n < 2) return;
  const int last = n - 1;
  const bool odd = world.rank() == last;
  const epx::mesh m(epx::mesh_config{n, 1, 1, 1, n, n, 0});  // ep == tp: every implementation runs it
  epx::layer_options o;
  o.hidden = 8;
  o.top_k = 1;
  using device = epx::exec::emulated_device;
  const std::vector<std::pair<std::string, std::function<void()>>> cases = {
      {"hidden=16", [&] {
         epx::layer_options p = o;
         if (odd) p.hidden = 16;
         epx::moe_layer<comm_t, float> l(m, world, p);
       }},
      {"element type T=double", [&] {
         if (odd) epx::moe_layer<comm_t, double> l(m, world, o);
         else epx::moe_layer<comm_t, float> l(m, world, o);
       }},
      {"implementation=all_reduce", [&] {
         if (odd) epx::moe_layer<comm_t, float, epx::impl::all_reduce> l(m, world, o);
         else epx::moe_layer<comm_t, float, epx::impl::all_to_all> l(m, world, o);
       }},
      {"exec::is_host_policy_v<Exec>=false", [&] {
         if (odd) epx::moe_layer<comm_t, float, epx::impl::all_to_all, device> l(m, world, o);
         else epx::moe_layer<comm_t, float> l(m, world, o);
       }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.first);
    const auto r = epx::test::capture(c.second);
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::configuration);
    CHECK(r.message.find("rank " + std::to_string(last) + " has " + c.first) != std::string::npos);
  }
}

namespace test_layer_mpi_cpp {

// An MPI communicator whose chosen group's check fails as a collective
// (tests/support/group_failing_comm.hpp).
using group_failing_comm = epx::test::group_failing_comm<epx::mpi::communicator>;
static_assert(epx::check_communicator<group_failing_comm>());

}  // namespace test_layer_mpi_cpp

TEST_CASE("layer (MPI): a tp group's check that fails as a collective reaches every rank at once, not by the watchdog") {
  using test_layer_mpi_cpp::group_failing_comm;
  epx::mpi::options opts;
  opts.timeout = std::chrono::seconds(6);  // before the fix: the watchdog ends the job here
  comm_t base = comm_t::world(opts);
  const int n = base.size(), rank = base.rank();
  if (n < 4 || n % 2 != 0) return;  // a rank outside the failed tp group is needed
  const epx::mesh m(epx::mesh_config{2, n / 2, 1, 1, 2, 4, 0});  // tp groups {0,1}, {2,3}, ...
  const unsigned last_tp = 3u << (n - 2);                       // the last tp group fails
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  group_failing_comm world{{std::move(base)}, rank, 1, last_tp};
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = epx::test::capture([&] { epx::moe_layer<group_failing_comm, float> l(m, world, o); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CAPTURE(r.message);
  REQUIRE(r.thrown);
  CHECK(r.category == epx::errc::communicator);
  CHECK(seconds < 3.0);
  if ((last_tp >> rank) & 1u) {
    CHECK(r.message.find("epx communicator error: injected failure of a group's all_gather [") == 0);
  } else {
    CHECK(r.message.find("moe_layer: the check of the communicators that split made from the world communicator "
                         "failed on another rank; rank " + std::to_string(n - 2) +
                         " failed: the tp group's check failed: injected failure of a group's all_gather; rank " +
                         std::to_string(n - 1) + " failed: the tp group's check failed: injected") !=
          std::string::npos);
  }
}
