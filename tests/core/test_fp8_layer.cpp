// The layer with FP8 dispatch (spec section 12) on the threads backend: against float64
// through the quantised rows and within the E4M3 bound of the unquantised output, meshes
// with tp > 1, float32 and bf16 (double and fp16 on two meshes), H up to 4096, the split-phase calls bitwise the fused
// ones, with a capacity's drops; and the configurations it refuses on every rank.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/fp8_layer_cases.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_fp8_layer_cpp {

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::threads::communicator;

layer_case make(int tp, int fsdp, int ep, int E, int k, int H, routing_kind r = routing_kind::random) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.experts = E;
  c.top_k = k;
  c.hidden = H;
  c.routing = r;
  c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + H);
  return c;
}

template <class T>
void check(const layer_case& c) {
  CAPTURE(c.describe());
  const int world = c.topology.tp * c.topology.fsdp;
  std::vector<std::string> f(static_cast<std::size_t>(world));
  epx::threads::run(world, [&](comm_t& comm) {
    f[static_cast<std::size_t>(comm.rank())] = epx::test::check_fp8_layer<comm_t, T>(comm, c);
  });
  for (const auto& s : f) CHECK_MESSAGE(s.empty(), s);
}

}  // namespace

TEST_CASE_TEMPLATE("fp8 dispatch: against float64 and the E4M3 bound, split phase bitwise the fused calls", T, float,
                   epx::bf16) {
  check<T>(make(1, 4, 4, 8, 2, 256));
  check<T>(make(2, 2, 4, 8, 2, 128, routing_kind::uneven));
  check<T>(make(2, 4, 4, 16, 8, 256));
  check<T>(make(4, 2, 4, 8, 2, 384, routing_kind::first_rank_only));
  auto empty = make(2, 2, 4, 8, 2, 128);
  empty.rows = [](int b) { return b % 2 ? std::size_t{0} : std::size_t{7}; };
  check<T>(empty);
  auto padded = make(2, 2, 2, 4, 2, 256);
  padded.pad = {2, 4};
  check<T>(padded);
  auto big = make(1, 4, 4, 8, 2, 4096, routing_kind::uneven);
  big.rows = [](int) { return std::size_t{24}; };
  check<T>(big);
  // A stage of one and five slice rows: the inference forward's FP8 rows go out in one
  // round and its outputs come back in rounds, backward (in T) takes rounds, over slices of
  // different lengths; on the staged route, and on the direct route (no rounds).
  for (std::size_t per_round : {std::size_t{1}, std::size_t{5}}) {
    for (auto c : {make(2, 4, 4, 16, 8, 256), make(4, 2, 4, 8, 2, 384, routing_kind::first_rank_only), big}) {
      c.rows = [](int b) { return static_cast<std::size_t>(13 + 3 * b); };
      c.stage_bytes = per_round * static_cast<std::size_t>(c.top_k) * static_cast<std::size_t>(c.hidden) * sizeof(T);
      check<T>(c);
      c.peer_access = false;
      check<T>(c);
    }
  }
}

TEST_CASE_TEMPLATE("fp8 dispatch: double and fp16 layers against float64 and the E4M3 bound", T, double, epx::fp16) {
  check<T>(make(1, 4, 4, 8, 2, 256));
  check<T>(make(2, 2, 4, 8, 2, 384, routing_kind::uneven));
}

TEST_CASE_TEMPLATE("fp8 dispatch: with a capacity, local and global, by position and by score: the pairs float64 drops", T,
                   float, epx::bf16) {
  for (auto mode : {epx::capacity_mode::local, epx::capacity_mode::global})
    for (auto prio : {epx::drop_priority::position, epx::drop_priority::score}) {
      CAPTURE(static_cast<int>(mode));
      CAPTURE(static_cast<int>(prio));
      for (auto c : {make(1, 4, 4, 8, 2, 128, routing_kind::uneven), make(2, 2, 4, 8, 4, 256),
                     make(2, 4, 4, 16, 2, 128, routing_kind::first_rank_only)}) {
        c.capacity.mode = mode;
        c.capacity.priority = prio;
        c.capacity.factor = 0.75;
        c.rows = [](int b) { return static_cast<std::size_t>(14 + 3 * b); };
        check<T>(c);
      }
    }
}

namespace {
template <class Impl, class Body>
std::vector<epx::test::raised> on_four(const epx::layer_options& o, Body body) {
  std::vector<epx::test::raised> r(4);
  epx::threads::run(4, [&](comm_t& comm) {
    const epx::mesh m(epx::mesh_config{2, 2, 1, 1, 2, 4, 0});  // ep == tp == 2
    r[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
      epx::moe_layer<comm_t, float, Impl> layer(m, comm, o);
      body(layer, m, comm.rank());
    });
  });
  return r;
}
}  // namespace

TEST_CASE("fp8 dispatch: refused configurations raise errc::configuration on every rank") {
  epx::layer_options o;
  o.hidden = 200;
  o.top_k = 2;
  o.fp8_dispatch = true;
  for (const auto& r : on_four<epx::impl::all_to_all>(o, [](auto&, const epx::mesh&, int) {})) {
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::configuration);
    CHECK(r.message.find("200") != std::string::npos);
    CHECK(r.message.find("128") != std::string::npos);
  }
  o.hidden = 128;
  for (const auto& r : on_four<epx::impl::all_reduce>(o, [](auto&, const epx::mesh&, int) {})) {
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::configuration);
    CHECK(r.message.find("has no FP8 dispatch") != std::string::npos);
  }
  // impl::automatic takes the all-to-all path for every call with FP8 dispatch.
  for (const auto& r : on_four<epx::impl::automatic>(o, [](auto& layer, const epx::mesh& m, int rank) {
         std::vector<float> x(3 * 128, 0.5f), w(6, 0.5f), out(3 * 128);
         std::vector<std::int32_t> ids = {0, 1, 2, 3, 1, 2};
         epx::test::fp8_scale_experts<float> e{m.expert_begin(rank)};
         layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                       epx::span<float>(out), e, epx::mode::inference);
         EPX_REQUIRE(std::string(layer.stats().path) == "all_to_all", epx::errc::internal, "path ", layer.stats().path);
         EPX_REQUIRE(out[0] == out[0], epx::errc::internal, "NaN");
       })) {
    CAPTURE(r.message);
    CHECK(!r.thrown);
  }
  // Experts without an FP8 forward.
  for (const auto& r : on_four<epx::impl::all_to_all>(o, [](auto& layer, const epx::mesh&, int) {
         std::vector<float> x(128), w(2, 0.5f), out(128);
         std::vector<std::int32_t> ids = {0, 1};
         epx::test::scale_experts<float> e(0, 2);
         layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                       epx::span<float>(out), e, epx::mode::inference);
       })) {
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::configuration);
    CHECK(r.message.find("fp8_dispatch needs experts with") != std::string::npos);
  }
}

TEST_CASE("fp8 dispatch: experts that take only FP8 rows, without fp8_dispatch and in bounded mode, raise errc::configuration on every rank") {
  const auto fp8_only_forward = [](auto& layer, const epx::mesh& m, int rank) {
    std::vector<float> x(2 * 128, 0.5f), w(4, 0.5f), out(2 * 128, 7.0f);
    std::vector<std::int32_t> ids = {0, 1, 2, 3};
    epx::test::fp8_scale_experts<float> e{m.expert_begin(rank)};
    layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                  epx::span<float>(out), e, epx::mode::inference);
  };
  epx::layer_options o;
  o.hidden = 128;
  o.top_k = 2;
  for (const auto& r : on_four<epx::impl::all_to_all>(o, fp8_only_forward)) {
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::configuration);
    CHECK(r.message.find("these experts take only FP8 rows: set layer_options::fp8_dispatch") != std::string::npos);
  }
  // Bounded mode refuses fp8_dispatch, so the message must not send the caller there.
  o.counts = epx::count_exchange::device;
  o.bound.cap = 4;
  for (const auto& r : on_four<epx::impl::all_to_all>(o, fp8_only_forward)) {
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == epx::errc::configuration);
    CHECK(r.message.find("bounded mode needs experts with `forward(const Exec&, const epx::expert_rows<const T>&, T* "
                         "out)`: these experts take only FP8 rows, and layer_options::fp8_dispatch is not available in "
                         "bounded mode") != std::string::npos);
  }
}

}  // namespace test_fp8_layer_cpp
