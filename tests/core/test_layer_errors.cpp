// Bad input and bad configuration: epx::error on every rank of the group, nobody hangs.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/emulated.hpp"
#include "epx/grad/hooks.hpp"
#include "support/copy_experts.hpp"
#include "support/forwarding_comm.hpp"
#include "support/group_failing_comm.hpp"
#include "support/throwing_experts.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_layer_errors_cpp {

namespace {

using epx::test::bad_input;
using epx::test::layer_case;
using epx::test::raised;
using comm_t = epx::threads::communicator;

layer_case small(int tp, int fsdp, int ep, int E = 8, int k = 2) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.experts = E;
  c.top_k = k;
  c.hidden = 4;
  c.rows = [](int) { return std::size_t{6}; };
  return c;
}

// Every rank raised an epx::error of `category` whose message holds each of `words`.
void require_every_rank_raised(const std::vector<raised>& seen, epx::errc category,
                               std::initializer_list<const char*> words) {
  for (const auto& x : seen) {
    CAPTURE(x.message);
    REQUIRE(x.thrown);
    CHECK(x.category == category);
    for (const char* w : words) CHECK_MESSAGE(x.message.find(w) != std::string::npos, "missing: ", std::string(w));
  }
}

// Every rank of the bad rank's EP group must raise errc::input whose message names the bad
// rank. Options that differ between ranks (hidden, top_k) are a configuration the layer's
// constructor refuses: errc::configuration on every rank of the world.
template <class Impl = epx::impl::all_to_all>
void expect_everyone_raises(const layer_case& c, bad_input kind, int bad_rank) {
  const int world = c.topology.tp * c.topology.fsdp;
  std::vector<raised> seen(static_cast<std::size_t>(world));
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      world,
      [&](comm_t& comm) {
        seen[static_cast<std::size_t>(comm.rank())] = epx::test::run_bad_input<comm_t, float, Impl>(comm, c, kind, bad_rank);
      },
      opts);
  const epx::mesh m(c.topology);
  const auto group = m.group_members(epx::group_kind::ep, bad_rank);
  for (int r = 0; r < world; ++r) {
    const auto& s = seen[static_cast<std::size_t>(r)];
    const std::string kind_name = epx::test::to_string(kind);
    CAPTURE(kind_name);
    CAPTURE(bad_rank);
    CAPTURE(r);
    CAPTURE(s.message);
    const bool config = kind == bad_input::hidden_differs || kind == bad_input::top_k_differs;
    const bool in_group = config || std::find(group.begin(), group.end(), r) != group.end();
    if (!in_group) {
      // Other EP groups are independent: their calls succeed.
      CHECK_FALSE(s.thrown);
      continue;
    }
    REQUIRE(s.thrown);
    CHECK(s.category == (config ? epx::errc::configuration : epx::errc::input));
    CHECK_MESSAGE(s.moved.empty(), s.moved);
    CHECK(s.message.find("rank " + std::to_string(bad_rank)) != std::string::npos);
    if (config) CHECK(s.message.find(kind == bad_input::hidden_differs ? "hidden=" : "top_k=") != std::string::npos);
    if (kind == bad_input::mode_differs) CHECK(s.message.find("must pass the same mode") != std::string::npos);
  }
}

}  // namespace

TEST_CASE("bad input on any rank raises on every rank of its EP group (all-to-all path)") {
  const auto c = small(2, 2, 4);  // world 4, one EP group
  for (auto kind : {bad_input::id_too_large, bad_input::id_negative, bad_input::weight_nan, bad_input::weight_inf,
                    bad_input::x_size, bad_input::ids_size, bad_input::weights_size, bad_input::out_size,
                    bad_input::rows_differ_in_tp_group, bad_input::hidden_differs, bad_input::top_k_differs,
                    bad_input::grad_x_size, bad_input::grad_weights_size, bad_input::empty_state,
                    bad_input::mode_differs})
    for (int bad = 0; bad < 4; ++bad) expect_everyone_raises(c, kind, bad);
}

TEST_CASE("bad input with per-rank sends raises on every rank of its EP group") {
  auto c = small(2, 2, 4, 8, 4);
  c.sends = epx::row_sends::per_rank;
  for (auto kind : {bad_input::id_too_large, bad_input::weight_nan, bad_input::ids_size, bad_input::out_size,
                    bad_input::rows_differ_in_tp_group, bad_input::grad_x_size, bad_input::grad_weights_size,
                    bad_input::empty_state})
    for (int bad : {0, 3}) expect_everyone_raises(c, kind, bad);
}

TEST_CASE("bad input raises only in the EP group that holds the bad rank") {
  const auto c = small(1, 4, 2);  // two EP groups of two ranks
  for (auto kind : {bad_input::id_too_large, bad_input::weight_nan, bad_input::out_size, bad_input::hidden_differs,
                    bad_input::empty_state, bad_input::mode_differs})
    for (int bad : {0, 3}) expect_everyone_raises(c, kind, bad);
}

TEST_CASE("bad input on the masked all-reduce path") {
  const auto c = small(2, 2, 2);
  for (auto kind : {bad_input::id_too_large, bad_input::id_negative, bad_input::weight_inf, bad_input::ids_size,
                    bad_input::rows_differ_in_tp_group, bad_input::top_k_differs, bad_input::grad_weights_size,
                    bad_input::empty_state, bad_input::mode_differs})
    for (int bad : {0, 1, 3}) expect_everyone_raises<epx::impl::all_reduce>(c, kind, bad);
  for (int bad : {0, 3}) expect_everyone_raises<epx::impl::automatic>(c, bad_input::empty_state, bad);
}

namespace {

// Counts a rank's all_gathers, over the communicator and the ones its split made.
struct gather_counting_comm : epx::test::forwarding_comm<comm_t> {
  int* gathers = nullptr;
  gather_counting_comm split(int color, int key) const { return {{c.split(color, key)}, gathers}; }
  void all_gather(const void* s, void* r, std::size_t n, epx::datatype t) {
    ++*gathers;
    c.all_gather(s, r, n, t);
  }
};

}  // namespace

// docs/guarantees.md: the input check rides on the count exchange's record, one small
// all-gather per call; a second one, carrying the failing ranks' messages, only on the
// error path, on every rank of the EP group.
TEST_CASE("the input check adds no collective: one all_gather per forward call, a second only when it fails") {
  for (const int tp : {1, 2}) {
    CAPTURE(tp);
    std::vector<int> clean(4, -1), failed(4, -1), after(4, -1);
    std::vector<raised> seen(4);
    epx::threads::run(4, [&](comm_t& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      int gathers = 0;
      gather_counting_comm world{{std::move(comm)}, &gathers};
      const epx::mesh m(epx::mesh_config{tp, 4 / tp, 1, 1, 4, 8, 0});  // one EP group of 4
      epx::layer_options o;
      o.hidden = 4;
      o.top_k = 2;
      epx::moe_layer<gather_counting_comm, float> layer(m, world, o);
      std::vector<float> x(3 * 4, 1.0f), y(3 * 4), w(6, 0.5f);
      std::vector<std::int32_t> ids = {0, 1, 2, 3, 4, 5}, bad = ids;
      if (r == 1) bad[3] = 8;
      epx::test::copy_experts experts;
      const auto call = [&](const std::vector<std::int32_t>& i) {
        gathers = 0;
        (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(i), epx::span<const float>(w),
                            epx::span<float>(y), experts, epx::mode::inference);
      };
      call(ids);
      clean[r] = gathers;
      seen[r] = epx::test::capture([&] { call(bad); });
      failed[r] = gathers;
      call(ids);
      after[r] = gathers;
    });
    for (std::size_t r = 0; r < 4; ++r) {
      CAPTURE(r);
      CAPTURE(seen[r].message);
      CHECK(seen[r].thrown);
      CHECK(seen[r].category == epx::errc::input);
      CHECK(clean[r] == 1);
      CHECK(failed[r] == 2);
      CHECK(after[r] == 1);
    }
  }
}

// docs/guarantees.md: in bounded mode there is no per-call exchange on the host; bad ids
// are counted and raised by check().
TEST_CASE("bounded mode's calls all-gather nothing; a bad id is raised by check() on every rank") {
  std::vector<int> calls(4, -1);
  std::vector<raised> seen(4);
  epx::threads::run(4, [&](comm_t& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    int gathers = 0;
    gather_counting_comm world{{std::move(comm)}, &gathers};
    const epx::mesh m(epx::mesh_config{1, 4, 1, 1, 4, 8, 0});
    epx::layer_options o;
    o.hidden = 4;
    o.top_k = 2;
    o.counts = epx::count_exchange::device;
    o.bound.cap = 4;
    epx::moe_layer<gather_counting_comm, float> layer(m, world, o);
    std::vector<float> x(3 * 4, 1.0f), y(3 * 4), w(6, 0.5f);
    std::vector<std::int32_t> ids = {0, 1, 2, 3, 4, 5};
    if (r == 1) ids[3] = 8;
    epx::test::copy_experts experts;
    gathers = 0;
    for (int i = 0; i < 2; ++i)
      (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                          epx::span<float>(y), experts, epx::mode::inference);
    calls[r] = gathers;
    seen[r] = epx::test::capture([&] { (void)layer.check(); });
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CAPTURE(seen[r].message);
    CHECK(calls[r] == 0);
    CHECK(seen[r].thrown);
    CHECK(seen[r].category == epx::errc::input);
    CHECK(seen[r].message.find("expert id out of range") != std::string::npos);
  }
}

TEST_CASE("the error message names the token, slot and value") {
  const auto c = small(1, 2, 2);
  std::vector<raised> seen(2);
  epx::threads::run(2, [&](comm_t& comm) {
    seen[static_cast<std::size_t>(comm.rank())] = epx::test::run_bad_input<comm_t, float>(comm, c, bad_input::id_too_large, 1);
  });
  for (const auto& s : seen) {
    CAPTURE(s.message);
    CHECK(s.message.find("expert id (8) of token 3 slot 1 out of range [0, 8)") != std::string::npos);
    CHECK(s.message.find("moe_layer forward") != std::string::npos);
  }
}

namespace {
struct nothing_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>&, float*) {}
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>&, const float*, float*) {}
};

template <class Impl = epx::impl::all_to_all>
void expect_configuration_error(int world, epx::mesh_config mc, epx::layer_options o, const std::string& words) {
  std::vector<raised> seen(static_cast<std::size_t>(world));
  epx::threads::run(world, [&](comm_t& comm) {
    const raised r = epx::test::capture([&] {
      const epx::mesh m(mc);
      epx::moe_layer<comm_t, float, Impl> layer(m, comm, o);
    });
    seen[static_cast<std::size_t>(comm.rank())] = r;
  });
  for (const auto& s : seen) {
    CAPTURE(s.message);
    REQUIRE(s.thrown);
    CHECK(s.category == epx::errc::configuration);
    CHECK(s.message.find(words) != std::string::npos);
  }
}
}  // namespace

TEST_CASE("bad configuration raises on every rank, together, before rows move") {
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  SUBCASE("mesh does not fit the communicator") {
    expect_configuration_error(4, {2, 4, 1, 1, 4, 8, 0}, o, "communicator size (4)");
  }
  SUBCASE("E not divisible by ep") { expect_configuration_error(4, {1, 4, 1, 1, 4, 6, 0}, o, "num_experts (6)"); }
  SUBCASE("k out of range") {
    o.top_k = 9;
    expect_configuration_error(4, {1, 4, 1, 1, 4, 8, 0}, o, "top_k (9)");
    o.top_k = 0;
    expect_configuration_error(4, {1, 4, 1, 1, 4, 8, 0}, o, "top_k (0)");
  }
  SUBCASE("hidden size zero") {
    o.hidden = 0;
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o, "hidden (0)");
  }
  SUBCASE("padding") {
    o.pad.align = 0;
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o, "padding.align (0)");
    o.pad = {-1, 1};
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o, "padding.rows_per_expert (-1) must be >= 0");
  }
  SUBCASE("hidden size whose row bytes would wrap") {
    o.hidden = static_cast<std::size_t>(-1);  // a negative size converted: hidden * sizeof(float) wraps
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o,
                               "layer_options.hidden (18446744073709551615) is too large: a row of hidden * "
                               "sizeof(T) bytes must stay within 9223372036854775807 bytes (hidden at most "
                               "2305843009213693951)");
  }
  SUBCASE("bounded mode without a bound") {
    o.counts = epx::count_exchange::device;
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o, "layer_options.bound.cap (0) must be at least 1");
  }
  SUBCASE("bounded mode with a chunk count whose buffers would wrap") {
    o.counts = epx::count_exchange::device;
    o.bound.cap = 4;
    o.chunks = std::size_t{1} << 62;  // [chunks * E] wraps to 0 entries with E = 4
    expect_configuration_error(4, {4, 1, 1, 1, 4, 4, 0}, o,
                               "layer_options.chunks (4611686018427387904) is too large in bounded mode");
    expect_configuration_error<epx::impl::all_reduce>(4, {4, 1, 1, 1, 4, 4, 0}, o,
                                                      "layer_options.chunks (4611686018427387904) is too large");
  }
  SUBCASE("bounded mode with slabs of 9e15 elements or more") {
    o.counts = epx::count_exchange::device;
    o.hidden = std::size_t{1} << 20;
    o.bound.cap = 1 << 30;  // ep * L * cap * hidden = 2 * 4 * 2^30 * 2^20 = 2^53, just above 9e15
    const std::string words = "layer_options.bound.cap (1073741824) is too large: ep * L * cap * hidden = ";
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o, words);
    expect_configuration_error<epx::impl::all_reduce>(2, {2, 1, 1, 1, 2, 8, 0}, o, words);
  }
  SUBCASE("bounded mode with padding whose expert-major buffers would wrap") {
    o.counts = epx::count_exchange::device;
    o.bound.cap = 1;
    o.top_k = 1;
    o.hidden = std::size_t{1} << 24;
    o.pad.rows_per_expert = (1 << 30) - 2 + (1 << 30);  // block = padded(ep * cap) = 2 + 2^31 - 2 = 2^31 rows
    // ep * L * cap * hidden = 2 * 512 * 1 * 2^24 passes; L * block * hidden = 2^9 * 2^31 * 2^24 = 2^64 wraps to 0.
    const std::string words =
        "layer_options.bound.cap (1) with padding.rows_per_expert (2147483646) and padding.align (1) is too large: "
        "L * padded(ep * cap) * hidden = 512 * 2147483648 * 16777216 =";
    expect_configuration_error(2, {1, 2, 1, 1, 2, 1024, 0}, o, words);
    expect_configuration_error<epx::impl::all_reduce>(2, {2, 1, 1, 1, 2, 1024, 0}, o, words);
  }
  SUBCASE("an unknown count exchange") {
    o.counts = static_cast<epx::count_exchange>(5);
    expect_configuration_error(2, {1, 2, 1, 1, 2, 8, 0}, o, "layer_options.counts (5)");
  }
  SUBCASE("all_reduce path with ep != tp") {
    expect_configuration_error<epx::impl::all_reduce>(4, {1, 4, 1, 1, 4, 8, 0}, o, "requires ep_size (4) == tp_size (1)");
    expect_configuration_error<epx::impl::all_reduce>(4, {1, 4, 1, 1, 4, 8, 0}, o,
                                                      "same rows; use impl::all_to_all or impl::automatic on this mesh");
  }
}

namespace {
struct scale_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* y) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) y[i] = 2.0f * in.rows[i];
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>&, const float*, float*) {}
};

// Each rank builds the layer from its own mesh config (mine(rank)); returns what each raised.
// Each rank r constructs a layer of mesh mine(r) and options o (changed by adjust(r, o) where
// given); what each raised.
std::vector<raised> construct_each(int world, const std::function<epx::mesh_config(int)>& mine, epx::layer_options o,
                                   const std::function<void(int, epx::layer_options&)>& adjust = {}) {
  std::vector<raised> seen(static_cast<std::size_t>(world));
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      world,
      [&](comm_t& comm) {
        const raised r = epx::test::capture([&] {
          const epx::mesh m(mine(comm.rank()));
          epx::layer_options own = o;
          if (adjust) adjust(comm.rank(), own);
          epx::moe_layer<comm_t, float> layer(m, comm, own);
        });
        seen[static_cast<std::size_t>(comm.rank())] = r;
      },
      opts);
  return seen;
}
}  // namespace

TEST_CASE("per-rank sends refused with FP8, bounded mode, the all_reduce path, a bad value or a disagreeing rank") {
  const epx::mesh_config mc{2, 2, 1, 1, 2, 4, 0};  // tp 2 x fsdp 2, ep 2 == tp
  epx::layer_options o;
  o.hidden = 128;
  o.top_k = 2;
  o.sends = epx::row_sends::per_rank;
  auto fp8 = o;
  fp8.fp8_dispatch = true;
  expect_configuration_error(4, mc, fp8, "row_sends::per_rank is not available with fp8_dispatch");
  auto bounded = o;
  bounded.counts = epx::count_exchange::device;
  bounded.bound.cap = 4;
  expect_configuration_error(4, mc, bounded, "layer_options.sends must be row_sends::per_slot in bounded mode");
  expect_configuration_error<epx::impl::all_reduce>(4, mc, o, "has no per-rank sends");
  auto bad = o;
  bad.sends = static_cast<epx::row_sends>(7);
  expect_configuration_error(4, mc, bad, "layer_options.sends (7) must be");
  // One rank sends per slot, the others per rank: every rank raises, naming the field.
  std::vector<raised> seen(4);
  epx::threads::run(4, [&](comm_t& comm) {
    seen[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
      const epx::mesh m(mc);
      epx::layer_options mine = o;
      if (comm.rank() == 3) mine.sends = epx::row_sends::per_slot;
      epx::moe_layer<comm_t, float> layer(m, comm, mine);
    });
  });
  require_every_rank_raised(seen, epx::errc::configuration,
                            {"rank 3 has sends=row_sends::per_slot but rank 0 has sends=row_sends::per_rank"});
  // impl::automatic builds no masked path with per-rank sends: it constructs.
  epx::threads::run(4, [&](comm_t& comm) {
    seen[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
      const epx::mesh m(mc);
      epx::moe_layer<comm_t, float, epx::impl::automatic> layer(m, comm, o);
    });
  });
  for (const auto& x : seen) {
    CAPTURE(x.message);
    CHECK(!x.thrown);
  }
}

TEST_CASE("ranks that built different meshes or options raise errc::configuration on every rank") {
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  SUBCASE("one rank says ep=2, the other ep=1") {
    // Without the agreement the staged route overflows a heap buffer here.
    const auto seen = construct_each(2, [](int r) { return epx::mesh_config{1, 2, 1, 1, r == 0 ? 2 : 1, 4, 0}; }, o);
    require_every_rank_raised(seen, epx::errc::configuration, {"rank 1 has ep=1 but rank 0 has ep=2"});
  }
  SUBCASE("the ranks disagree on tp") {
    // rank 0: tp=2 x fsdp=1; rank 1: tp=1 x fsdp=2 (both fit 2 ranks).
    const auto seen =
        construct_each(2, [](int r) { return r == 0 ? epx::mesh_config{2, 1, 1, 1, 2, 4, 0} : epx::mesh_config{1, 2, 1, 1, 2, 4, 0}; }, o);
    require_every_rank_raised(seen, epx::errc::configuration,
                              {"rank 1 has tp=1 but rank 0 has tp=2",
                               "rank 1 has fsdp=2 but rank 0 has fsdp=1"});
  }
  SUBCASE("the ranks disagree on the number of experts and the padding") {
    const auto seen = construct_each(
        4, [](int r) { return epx::mesh_config{1, 4, 1, 1, 4, r == 3 ? 4 : 8, 0}; }, o,
        [](int r, epx::layer_options& p) {
          if (r == 2) p.pad.rows_per_expert = 4;
          if (r == 3) p.pad.align = 4;
        });
    require_every_rank_raised(seen, epx::errc::configuration,
                              {"rank 3 has num_experts=4 but rank 0 has num_experts=8",
                               "rank 2 has pad.rows_per_expert=4 but rank 0 has pad.rows_per_expert=1",
                               "rank 3 has pad.align=4 but rank 0 has pad.align=1"});
  }
  SUBCASE("the ranks disagree on the element type, also of one size (bf16 and fp16)") {
    // Without the agreement a float rank and a double rank overflow a heap buffer in forward.
    const epx::mesh_config mc{1, 2, 1, 1, 2, 4, 0};
    std::vector<raised> seen(4);
    epx::threads::run(4, [&](comm_t& comm) {
      const int r = comm.rank();
      seen[static_cast<std::size_t>(r)] = epx::test::capture([&] {
        // Ranks 0, 1: float and double; ranks 2, 3: bf16 and fp16 (two worlds of two).
        epx::threads::communicator pair = comm.split(r / 2, r % 2);
        const epx::mesh m(mc);
        if (r == 0) epx::moe_layer<comm_t, float> layer(m, pair, o);
        if (r == 1) epx::moe_layer<comm_t, double> layer(m, pair, o);
        if (r == 2) epx::moe_layer<comm_t, epx::bf16> layer(m, pair, o);
        if (r == 3) epx::moe_layer<comm_t, epx::fp16> layer(m, pair, o);
      });
    });
    const char* want[] = {"rank 1 has element type T=double but rank 0 has element type T=float",
                          "rank 1 has element type T=fp16 but rank 0 has element type T=bf16"};
    for (int r = 0; r < 4; ++r) {
      const auto& x = seen[static_cast<std::size_t>(r)];
      CAPTURE(r);
      CAPTURE(x.message);
      REQUIRE(x.thrown);
      CHECK(x.category == epx::errc::configuration);
      CHECK(x.message.find(want[r / 2]) != std::string::npos);
    }
  }
  SUBCASE("the ranks disagree on the implementation") {
    // Without the agreement the first forward on MPI truncates a message on one rank and
    // waits out the watchdog (10 minutes by default) on the other.
    std::vector<raised> seen(2);
    epx::threads::run(2, [&](comm_t& comm) {
      seen[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
        const epx::mesh m(epx::mesh_config{2, 1, 1, 1, 2, 4, 0});  // ep == tp: both paths run it
        if (comm.rank() == 0) epx::moe_layer<comm_t, float, epx::impl::all_reduce> layer(m, comm, o);
        if (comm.rank() == 1) epx::moe_layer<comm_t, float, epx::impl::all_to_all> layer(m, comm, o);
      });
    });
    require_every_rank_raised(seen, epx::errc::configuration,
                              {"rank 1 has implementation=all_to_all but rank 0 has implementation=all_reduce"});
  }
  SUBCASE("one rank runs a host policy, another a device policy") {
    // Host and device policies take different routes (indexed sends, rounds): without the
    // agreement the first forward on the staged route mismatches its collectives.
    std::vector<raised> seen(2);
    epx::threads::run(2, [&](comm_t& comm) {
      seen[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
        const epx::mesh m(epx::mesh_config{1, 2, 1, 1, 2, 4, 0});
        using device = epx::exec::emulated_device;
        if (comm.rank() == 0) epx::moe_layer<comm_t, float, epx::impl::all_to_all, epx::exec::serial> layer(m, comm, o);
        if (comm.rank() == 1) epx::moe_layer<comm_t, float, epx::impl::all_to_all, device> layer(m, comm, o);
      });
    });
    require_every_rank_raised(seen, epx::errc::configuration,
                              {"rank 1 has exec::is_host_policy_v<Exec>=false but rank 0 has exec::is_host_policy_v<Exec>=true"});
  }
  SUBCASE("the ranks disagree on the capacity factor: the message shows both values") {
    epx::layer_options p = o;
    p.capacity.mode = epx::capacity_mode::local;
    std::vector<raised> seen(3);
    epx::threads::run(3, [&](comm_t& comm) {
      seen[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
        const epx::mesh m(epx::mesh_config{1, 3, 1, 1, 3, 6, 0});
        epx::layer_options mine = p;
        // 1.1 and the next double after it: two values, two texts.
        mine.capacity.factor = comm.rank() == 0 ? 1.5 : comm.rank() == 1 ? 1.1 : std::nextafter(1.1, 2.0);
        epx::moe_layer<comm_t, float> layer(m, comm, mine);
      });
    });
    require_every_rank_raised(seen, epx::errc::configuration,
                              {"rank 1 has capacity.factor=1.1 but rank 0 has capacity.factor=1.5",
                               "rank 2 has capacity.factor=1.1000000000000003 but rank 0 has capacity.factor=1.5"});
  }
  SUBCASE("the ranks disagree on options that are enumerators or bools: the message names them") {
    std::vector<raised> seen(3);
    epx::threads::run(3, [&](comm_t& comm) {
      seen[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
        const epx::mesh m(epx::mesh_config{1, 3, 1, 1, 3, 6, 0});
        epx::layer_options mine = o;
        if (comm.rank() == 1) {
          mine.capacity.mode = epx::capacity_mode::global;
          mine.capacity.priority = epx::drop_priority::score;
        }
        if (comm.rank() == 2) {
          mine.peer_access = !mine.peer_access;
          mine.counts = epx::count_exchange::device;
          mine.bound.cap = 4;
        }
        epx::moe_layer<comm_t, float> layer(m, comm, mine);
      });
    });
    const bool access = o.peer_access;
    for (const auto& x : seen) {
      CAPTURE(x.message);
      REQUIRE(x.thrown);
      CHECK(x.category == epx::errc::configuration);
      for (const std::string part :
           {"rank 1 has capacity.mode=capacity_mode::global but rank 0 has capacity.mode=capacity_mode::off",
            "rank 1 has capacity.priority=drop_priority::score but rank 0 has capacity.priority=drop_priority::position",
            "rank 2 has counts=count_exchange::device but rank 0 has counts=count_exchange::host"})
        CHECK(x.message.find(part) != std::string::npos);
      CHECK(x.message.find(std::string("rank 2 has peer_access=") + (access ? "false" : "true") +
                           " but rank 0 has peer_access=" + (access ? "true" : "false")) != std::string::npos);
    }
    // A value outside an enumeration reads as its number.
    CHECK(epx::detail::record_text(epx::detail::record_format::capacity_mode, 7) == "7");
    CHECK(epx::detail::record_text(epx::detail::record_format::boolean, -1) == "-1");
  }
  SUBCASE("one rank's own configuration is bad: every rank hears it") {
    std::vector<raised> seen(4);
    epx::threads::run(4, [&](comm_t& comm) {
      const raised x = epx::test::capture([&] {
        const epx::mesh m(epx::mesh_config{1, 4, 1, 1, 4, 8, 0});
        epx::layer_options mine = o;
        if (comm.rank() == 2) mine.top_k = 9;  // more than the 8 experts
        epx::moe_layer<comm_t, float> layer(m, comm, mine);
      });
      seen[static_cast<std::size_t>(comm.rank())] = x;
    });
    require_every_rank_raised(seen, epx::errc::configuration, {"rank 2: top_k (9) must be in [1, num_experts (8)]"});
  }
}

TEST_CASE("framework constructor: the caller's ep and tp communicators, checked against the mesh") {
  const epx::mesh_config mc{2, 2, 1, 1, 4, 8, 0};  // tp=2, fsdp=2, ep=4: world 4
  epx::layer_options o;
  o.hidden = 6;
  o.top_k = 2;
  SUBCASE("the same results as the layer that makes its own groups") {
    std::vector<std::vector<float>> a(4), b(4);
    epx::threads::run(4, [&](comm_t& comm) {
      const epx::mesh m(mc);
      const int r = comm.rank();
      const std::size_t N = 5, H = 6;
      std::vector<float> x(N * H), w(N * 2, 0.5f), out(N * H);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(m.batch(r))) % 11) - 5.0f;
      std::vector<std::int32_t> ids(N * 2);
      for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 3 + 1) % 8);
      scale_experts ex;
      epx::moe_layer<comm_t, float> own(m, comm, o);
      own.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                  epx::span<float>(out), ex, epx::mode::inference);
      a[static_cast<std::size_t>(r)] = out;
      comm_t ep = epx::sub_communicator(comm, m, epx::group_kind::ep);
      comm_t tp = epx::sub_communicator(comm, m, epx::group_kind::tp);
      epx::moe_layer<comm_t, float> given(m, r, std::move(ep), std::move(tp), o);
      given.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                    epx::span<float>(out), ex, epx::mode::inference);
      b[static_cast<std::size_t>(r)] = out;
    });
    for (int r = 0; r < 4; ++r) CHECK(a[static_cast<std::size_t>(r)] == b[static_cast<std::size_t>(r)]);
  }
  SUBCASE("communicators that do not match the mesh raise on every rank") {
    for (int variant = 0; variant < 4; ++variant) {
      CAPTURE(variant);
      std::vector<raised> seen(4);
      epx::threads::options opts;
      opts.timeout = std::chrono::seconds(20);
      epx::threads::run(
          4,
          [&](comm_t& comm) {
            const epx::mesh m(mc);
            const raised x = epx::test::capture([&] {
              comm_t ep = epx::sub_communicator(comm, m, epx::group_kind::ep);
              comm_t tp = epx::sub_communicator(comm, m, epx::group_kind::tp);
              if (variant == 0) {
                comm_t tp2 = epx::sub_communicator(comm, m, epx::group_kind::tp);
                epx::moe_layer<comm_t, float> l(m, comm.rank(), std::move(tp2), std::move(tp), o);  // tp where ep belongs
              } else if (variant == 1) {
                // The ep group in the wrong order (reversed ranks).
                comm_t rev = comm.split(0, 3 - comm.rank());
                epx::moe_layer<comm_t, float> l(m, comm.rank(), std::move(rev), std::move(tp), o);
              } else if (variant == 2) {
                epx::moe_layer<comm_t, float> l(m, (comm.rank() + 1) % 4, std::move(ep), std::move(tp), o);  // wrong world rank
              } else {
                // A rank of a larger job (this world as ranks 4 to 7 of 8) instead of the rank in the mesh's world.
                epx::moe_layer<comm_t, float> l(m, comm.rank() + 4, std::move(ep), std::move(tp), o);
              }
            });
            seen[static_cast<std::size_t>(comm.rank())] = x;
          },
          opts);
      for (const auto& x : seen) {
        CAPTURE(x.message);
        REQUIRE(x.thrown);
        CHECK(x.category == epx::errc::configuration);
      }
      if (variant == 0) CHECK(seen[0].message.find("the ep communicator has 2 ranks but the mesh has ep=4") != std::string::npos);
      if (variant == 3)
        CHECK(seen[0].message.find("world rank (4) out of range [0, 4): the layer's world_rank is this rank's rank "
                                   "in the mesh's world (the communicator whose ranks the mesh numbers), not in a larger "
                                   "job that holds it") != std::string::npos);
    }
  }
  SUBCASE("a tp communicator across two ep groups, one of which raises: the other group's ranks hear why") {
    // tp=2, fsdp=4, ep=2: ep groups {0,1} {2,3} {4,5} {6,7}; the tp communicators {0,3} and
    // {2,1} have the right sizes and tp ranks but the wrong members, and rank 0 a bad option.
    const epx::mesh_config c8{2, 4, 1, 1, 2, 4, 0};
    std::vector<raised> seen(8);
    epx::threads::options opts;
    opts.timeout = std::chrono::seconds(20);
    epx::threads::run(
        8,
        [&](comm_t& comm) {
          const int r = comm.rank();
          const epx::mesh m(c8);
          comm_t ep = epx::sub_communicator(comm, m, epx::group_kind::ep);
          const int color[] = {0, 1, 1, 0, 2, 2, 3, 3};
          comm_t tp = comm.split(color[r], r % 2);
          epx::layer_options mine = o;
          if (r == 0) mine.hidden = 0;
          // The raising ranks go on into a collective of the world, as a caller that catches would.
          seen[static_cast<std::size_t>(r)] = epx::test::capture(
              [&] { epx::moe_layer<comm_t, float> l(m, r, std::move(ep), std::move(tp), mine); });
          comm.barrier();
        },
        opts);
    for (int r = 0; r < 8; ++r) {
      const auto& x = seen[static_cast<std::size_t>(r)];
      CAPTURE(r);
      CAPTURE(x.message);
      if (r >= 4) {
        CHECK_FALSE(x.thrown);
        continue;
      }
      REQUIRE(x.thrown);
      CHECK(x.category == epx::errc::configuration);
    }
    CHECK(seen[3].message.find("bad configuration in the tp communicator; rank 0: layer_options.hidden (0)") !=
          std::string::npos);
    CHECK(seen[2].message.find("the tp communicator does not hold the ranks of the mesh's tp group") != std::string::npos);
  }
}

// A user's communicator over the threads backend whose split orders a color's members by
// descending key (`reversed`), or as the concept asks.
struct split_comm : epx::test::forwarding_comm<comm_t> {
  bool reversed = false;
  split_comm split(int color, int key) const { return {{c.split(color, reversed ? -key : key)}, reversed}; }
};
static_assert(epx::check_communicator<split_comm>());

TEST_CASE("a communicator whose split does not order members by key: the layer and the hooks refuse it on every rank") {
  const epx::mesh_config mc{2, 4, 1, 1, 4, 8, 0};  // tp=2, fsdp=4, ep=4: world 8
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  for (const bool reversed : {false, true}) {
    CAPTURE(reversed);
    std::vector<raised> layer(8), hooks(8);
    epx::threads::run(8, [&](comm_t& comm) {
      split_comm world{{std::move(comm)}, reversed};
      const epx::mesh m(mc);
      const auto r = static_cast<std::size_t>(world.rank());
      layer[r] = epx::test::capture([&] { epx::moe_layer<split_comm, float> l(m, world, o); });
      hooks[r] = epx::test::capture([&] { epx::gradient_hooks<split_comm> h(m, world); });
    });
    for (std::size_t r = 0; r < 8; ++r) {
      CAPTURE(r);
      CAPTURE(layer[r].message);
      CAPTURE(hooks[r].message);
      REQUIRE(layer[r].thrown == reversed);
      REQUIRE(hooks[r].thrown == reversed);
      if (!reversed) continue;
      CHECK(layer[r].category == epx::errc::configuration);
      CHECK(hooks[r].category == epx::errc::configuration);
      // Every rank names every rank's finding (the first group that fails on each).
      CHECK(layer[r].message.find("moe_layer: the communicators that split made from the world communicator do not "
                                  "hold the mesh's groups (split must order the members of a color by (key, rank))") !=
            std::string::npos);
      // ep groups {0,1,2,3} and {4,5,6,7}, each in reverse.
      CHECK(layer[r].message.find("; rank 0,1,2,3: moe_layer: the ep communicator does not hold the ranks of the "
                                  "mesh's ep group; member 0 is world rank 3 but the mesh puts world rank 0 there") !=
            std::string::npos);
      CHECK(layer[r].message.find("; rank 4,5,6,7: moe_layer: the ep communicator does not hold the ranks of the "
                                  "mesh's ep group; member 0 is world rank 7 but the mesh puts world rank 4 there") !=
            std::string::npos);
      CHECK(hooks[r].message.find("gradient_hooks: the communicators that split made") != std::string::npos);
      // efsdp groups {0,4}, {1,5}, {2,6}, {3,7}.
      CHECK(hooks[r].message.find("; rank 1,5: gradient_hooks: the efsdp communicator does not hold the ranks of the "
                                  "mesh's efsdp group; member 0 is world rank 5 but the mesh puts world rank 1 there") !=
            std::string::npos);
    }
  }
}

// The threads backend's communicator whose chosen group's check fails as a collective
// (tests/support/group_failing_comm.hpp).
using group_failing_comm = epx::test::group_failing_comm<comm_t>;
static_assert(epx::check_communicator<group_failing_comm>());

TEST_CASE("a group's check that fails as a collective reaches every rank of the world at once, not by the watchdog") {
  using clock = std::chrono::steady_clock;
  const epx::mesh_config mc{2, 4, 1, 1, 4, 8, 0};  // tp=2, fsdp=4, ep=4: world 8
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  const auto watchdog = std::chrono::milliseconds(6000);  // the checks below: well inside half of it
  struct scenario {
    const char* name;
    int fail_split;
    unsigned fail_ranks;
    const char* kind;
    const char* who;
  };
  // The layer's ep group {4,5,6,7}; the hooks' efsdp group {1,5}.
  for (const scenario sc : {scenario{"moe_layer", 0, 0xf0u, "ep", "moe_layer"},
                            scenario{"gradient_hooks", 0, 0x22u, "efsdp", "gradient_hooks"}}) {
    CAPTURE(sc.name);
    std::vector<raised> seen(8);
    std::vector<double> seconds(8, 0.0);
    std::atomic<int> answered{0};
    epx::threads::options opts;
    opts.timeout = watchdog;
    const auto t0 = clock::now();
    const auto since = [t0] { return std::chrono::duration<double>(clock::now() - t0).count(); };
    epx::threads::run(
        8,
        [&](comm_t& comm) {
          const int r = comm.rank();
          group_failing_comm world{{std::move(comm)}, r, sc.fail_split, sc.fail_ranks};
          const epx::mesh m(mc);
          seen[static_cast<std::size_t>(r)] = epx::test::capture([&] {
            if (std::string(sc.name) == "moe_layer") epx::moe_layer<group_failing_comm, float> l(m, world, o);
            else epx::gradient_hooks<group_failing_comm> h(m, world);
          });
          seconds[static_cast<std::size_t>(r)] = since();
          // Stay alive as a process of a job would, calling no collective, until every rank
          // has its answer (or long after the watchdog).
          ++answered;
          while (answered.load() < 8 && since() < 4.0 * watchdog.count() / 1000.0)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        },
        opts);
    for (int r = 0; r < 8; ++r) {
      const auto& x = seen[static_cast<std::size_t>(r)];
      CAPTURE(r);
      CAPTURE(x.message);
      REQUIRE(x.thrown);
      CHECK(x.category == epx::errc::communicator);
      CHECK(x.message.find("watchdog") == std::string::npos);
      // Long before the watchdog.
      CHECK(seconds[static_cast<std::size_t>(r)] < watchdog.count() / 1000.0 / 2);
      if ((sc.fail_ranks >> r) & 1u) {  // the failed group's members: their own error, as thrown
        CHECK(x.message.find("epx communicator error: injected failure of a group's all_gather [") == 0);
      } else {
        const std::string head = std::string(sc.who) +
                                 ": the check of the communicators that split made from the world communicator "
                                 "failed on another rank; rank ";
        CHECK(x.message.find(head) != std::string::npos);
        for (int b = 0; b < 8; ++b)
          if ((sc.fail_ranks >> b) & 1u)
            CHECK(x.message.find("; rank " + std::to_string(b) + " failed: the " + sc.kind +
                                 " group's check failed: injected failure of a group's all_gather") !=
                  std::string::npos);
      }
    }
  }
}

TEST_CASE("can_implement: the masked path's rule lives in its implementation") {
  using comm = comm_t;
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  const epx::mesh ep_eq_tp(epx::mesh_config{2, 2, 1, 1, 2, 8, 0});
  const epx::mesh ep_gt_tp(epx::mesh_config{1, 4, 1, 1, 4, 8, 0});
  CHECK(epx::can_implement<epx::impl_for_t<epx::impl::all_reduce, comm>>(ep_eq_tp, o).empty());
  const std::string why = epx::can_implement<epx::impl_for_t<epx::impl::all_reduce, comm>>(ep_gt_tp, o);
  CHECK(why.find("requires ep_size (4) == tp_size (1)") != std::string::npos);
  CHECK(epx::can_implement<epx::impl_for_t<epx::impl::all_to_all, comm>>(ep_gt_tp, o).empty());
  CHECK(epx::can_implement<epx::impl_for_t<epx::impl::automatic, comm>>(ep_gt_tp, o).empty());
  // An implementation without can_implement runs everything.
  struct plain {};
  CHECK(epx::can_implement<plain>(ep_gt_tp, o).empty());
}

TEST_CASE("layer agreement: every rank gets each rank's own configuration error whole, however long") {
  // A rank's local reason (its mesh against its communicator, an implementation's
  // can_implement) travels to every rank of the communicator; a long one is not cut.
  const epx::mesh m(epx::mesh_config{1, 3, 1, 1, 3, 6, 0});
  epx::layer_options o;
  o.hidden = 4;
  o.top_k = 2;
  std::string long_reason = "rank 1's reason:";
  while (long_reason.size() < 900) long_reason += " a clause of a long can_implement explanation,";
  long_reason += " and its end";
  std::vector<std::string> got(3);
  epx::threads::run(3, [&](comm_t& comm) {
    const int r = comm.rank();
    const std::string mine = r == 1 ? long_reason : r == 2 ? "rank 2's short reason" : "";
    got[static_cast<std::size_t>(r)] = epx::test::capture([&] {
      epx::detail::agree_on_layer(comm, m, o, r, "test", mine);
    }).message;
  });
  for (const auto& g : got) {
    CHECK_MESSAGE(g.find(long_reason) != std::string::npos, g);
    CHECK_MESSAGE(g.find("rank 2's short reason") != std::string::npos, g);
  }
}

TEST_CASE("saved state: state types that two translation units could name alike are told apart") {
  // The type key is a hash of the type's name, the same in every shared library; local
  // types (and types in anonymous namespaces) fall back to an address, since another
  // translation unit may spell a different type the same way.
  struct local_a {
    int x[4];
  };
  struct local_b {
    int x[4];
  };
  epx::saved_state<float> s;
  s.emplace<local_a>();
  CHECK(s.holds<local_a>());
  CHECK_FALSE(s.holds<local_b>());
  CHECK(std::string(s.unusable_as<local_b>()) == "the saved state was made by a different implementation");
  s.emplace<epx::mesh_config>();
  CHECK(s.holds<epx::mesh_config>());
  CHECK_FALSE(s.holds<local_a>());
}

TEST_CASE("saved state: inference keeps nothing; backward of an empty state raises") {
  epx::threads::run(2, [](comm_t& comm) {
    const epx::mesh m(epx::mesh_config{1, 2, 1, 1, 2, 4, 0});
    epx::layer_options o;
    o.hidden = 2;
    o.top_k = 1;
    epx::moe_layer<comm_t, float> layer(m, comm, o);
    nothing_experts ex;
    std::vector<float> x(4, 1.0f), w(2, 1.0f), out(4), gx(4), gw(2);
    std::vector<std::int32_t> ids = {0, 3};
    auto s = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(out), ex, epx::mode::inference);
    if (!s.empty()) throw std::runtime_error("inference returned a non-empty saved state");
    bool raised_input = false;
    try {
      layer.backward(std::move(s), epx::span<const float>(out), epx::span<float>(gx), epx::span<float>(gw), ex);
    } catch (const epx::error& e) {
      raised_input = e.category() == epx::errc::input;
      // Both ranks made the same mistake: one entry names them both, the text once.
      const std::string& msg = e.message();
      if (msg.find("group; rank 0,1: backward needs the saved state of a training forward") == std::string::npos ||
          msg.find("; rank 1: ") != std::string::npos)
        throw std::runtime_error("the ranks' equal messages are not one entry: " + msg);
    }
    if (!raised_input) throw std::runtime_error("backward of an empty saved state did not raise errc::input");
    auto t = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(out), ex, epx::mode::train);
    if (t.empty()) throw std::runtime_error("training forward returned an empty saved state");
    auto moved = std::move(layer);  // the layer may move between forward and backward
    moved.backward(std::move(t), epx::span<const float>(out), epx::span<float>(gx), epx::span<float>(gw), ex);
    if (!t.empty()) throw std::runtime_error("backward did not consume the saved state");
  });
  CHECK(true);
}

TEST_CASE("saved state: backward of a state that another layer made raises on every rank and keeps it") {
  // Layers a (E = 8) and b (E = 4) on one mesh shape: b would read a's layout with its own
  // number of local experts.
  for (int variant = 0; variant < 4; ++variant) {
    CAPTURE(variant);
    const bool masked = variant == 2, bounded = variant == 3;
    const int world = 2;
    std::vector<std::string> failures(world);
    epx::threads::run(world, [&](comm_t& comm) {
      std::string& f = failures[static_cast<std::size_t>(comm.rank())];
      // tp = 2 = ep for the masked path, else fsdp = 2, ep = 2.
      const epx::mesh_config ma =
          masked ? epx::mesh_config{2, 1, 1, 1, 2, 8, 0} : epx::mesh_config{1, 2, 1, 1, 2, 8, 0};
      epx::mesh_config mb = ma;
      mb.experts = 4;
      epx::layer_options o;
      o.hidden = 4;
      o.top_k = 2;
      o.peer_access = variant == 0;
      if (bounded) {
        o.counts = epx::count_exchange::device;
        o.bound.cap = 16;
      }
      const auto run = [&](auto impl) {
        using layer_t = epx::moe_layer<comm_t, float, decltype(impl), epx::test::test_exec>;
        layer_t a(epx::mesh(ma), comm, o), b(epx::mesh(mb), comm, o);
        nothing_experts ex;
        const std::size_t N = 6;
        std::vector<float> x(N * 4, 1.0f), w(N * 2, 0.5f), out(N * 4), gx(N * 4), gw(N * 2);
        std::vector<std::int32_t> ids(N * 2);
        for (std::size_t t = 0; t < N; ++t) {
          ids[2 * t] = static_cast<std::int32_t>(t % 8);
          ids[2 * t + 1] = static_cast<std::int32_t>((t + 3) % 8);
        }
        auto s = a.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(out), ex, epx::mode::train);
        const raised r = epx::test::capture([&] {
          b.backward(std::move(s), epx::span<const float>(out), epx::span<float>(gx), epx::span<float>(gw), ex);
        });
        if (!r.thrown || r.category != epx::errc::input || r.message.find("another layer") == std::string::npos)
          f += "backward of another layer's state: '" + r.message + "'; ";
        if (bounded) return;  // the bounded mode consumes a state it cannot use
        if (s.empty()) f += "the rejected state was consumed; ";
        a.backward(std::move(s), epx::span<const float>(out), epx::span<float>(gx), epx::span<float>(gw), ex);
      };
      try {
        if (masked) run(epx::impl::all_reduce{});
        else run(epx::impl::all_to_all{});
      } catch (const std::exception& e) {
        f += std::string("raised: ") + e.what();
      }
    });
    for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
  }
}

TEST_CASE("a backward that the group rejects for bad sizes keeps the saved states: the retry gives the fused result") {
  const auto c = small(2, 2, 4);  // world 4, one EP group
  for (bool split : {false, true}) {
    CAPTURE(split);
    std::vector<std::string> failures(4);
    epx::threads::run(4, [&](comm_t& comm) {
      const epx::mesh m(c.topology);
      const int rank = comm.rank(), b = m.batch(rank);
      const auto d = epx::test::make_batch<float>(c, b);
      const std::size_t N = c.rows_of(b), H = 4, k = 2;
      const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
      std::vector<float> x(d.x.begin(), d.x.end()), w(d.w.begin(), d.w.end()), go(d.grad_out.begin(), d.grad_out.end());
      epx::moe_layer<comm_t, float> layer(m, comm, epx::test::options_for(c));
      // One call: forward, then backward with grad_weights one element too long on rank 3.
      const auto call = [&](bool bad_once, std::vector<float>& gx, std::vector<float>& gw, std::string& first_error) {
        epx::ref::test_linear_experts<float> experts(global, m.ep_rank(rank), m.local_experts());
        std::vector<float> out(N * H);
        auto saved = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(d.ids),
                                   epx::span<const float>(w), epx::span<float>(out), experts, epx::mode::train);
        std::vector<float> wrong(N * k + 1);
        const auto backward = [&](epx::span<float> grad_w) {
          if (!split) {
            layer.backward(std::move(saved), epx::span<const float>(go), epx::span<float>(gx), grad_w, experts);
            return;
          }
          auto g = layer.backward_dispatch_start(std::move(saved), epx::span<const float>(go), grad_w);
          layer.backward_dispatch_wait(g);
          experts.backward(epx::test::test_exec{}, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
          layer.backward_combine(g, epx::span<const float>(g.grad_inputs().data(), g.grad_inputs().size()),
                                 epx::span<float>(gx));
        };
        if (bad_once) {
          try {
            backward(rank == 3 ? epx::span<float>(wrong) : epx::span<float>(gw));
          } catch (const epx::error& e) {
            first_error = e.category() == epx::errc::input ? e.message() : "wrong category";
          }
          if (saved.empty()) first_error += " [the saved state was consumed]";
        }
        backward(epx::span<float>(gw));
      };
      std::vector<float> gx1(N * H), gw1(N * k), gx2(N * H), gw2(N * k);
      std::string first, none;
      std::string& f = failures[static_cast<std::size_t>(rank)];
      try {
        call(true, gx1, gw1, first);
        call(false, gx2, gw2, none);
      } catch (const std::exception& e) {
        f += std::string("raised: ") + e.what();
      }
      if (first.find("rank 3: grad_weights have 13 elements") == std::string::npos) f += "first call: '" + first + "'; ";
      if (gx1 != gx2 || gw1 != gw2) f += "the retried backward differs from a fresh one; ";
    });
    for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
  }
}

namespace {
// Two training forwards (micro-batches 0 and 1, different rows and routing), then their
// backwards; on the first try rank `odd` takes back call 1 where the others take back call
// 0. Every rank must raise errc::input (the layouts of the two calls differ: nothing may be
// read through the wrong one) and keep both states; backward in the same order on every
// rank must then give bitwise the results of one forward and backward per micro-batch.
template <class Impl>
void check_backward_of_different_calls(layer_case c, bool split, int odd) {
  CAPTURE(c.describe());
  CAPTURE(split);
  const int world = c.topology.tp * c.topology.fsdp;
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      world,
      [&](comm_t& comm) {
        std::string& f = failures[static_cast<std::size_t>(comm.rank())];
        const epx::mesh m(c.topology);
        const int rank = comm.rank();
        const std::size_t H = static_cast<std::size_t>(c.hidden), k = static_cast<std::size_t>(c.top_k);
        const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, 77);
        epx::ref::test_linear_experts<float> experts(global, m.ep_rank(rank), m.local_experts());
        struct micro {
          epx::test::batch_data d;
          std::vector<float> x, w, go, out, gx, gw;
        };
        std::vector<micro> mb(2);
        for (int i = 0; i < 2; ++i) {
          layer_case ci = c;
          ci.seed = c.seed + static_cast<std::uint64_t>(i);
          ci.rows = [](int b) { return static_cast<std::size_t>(8 + b); };
          micro& u = mb[static_cast<std::size_t>(i)];
          u.d = epx::test::make_batch<float>(ci, m.batch(rank));
          u.x.assign(u.d.x.begin(), u.d.x.end());
          u.w.assign(u.d.w.begin(), u.d.w.end());
          u.go.assign(u.d.grad_out.begin(), u.d.grad_out.end());
          const std::size_t N = u.x.size() / H;
          u.out.resize(N * H);
          u.gx.resize(N * H);
          u.gw.resize(N * k);
        }
        using layer_t = epx::moe_layer<comm_t, float, Impl, epx::test::test_exec>;
        const auto forward = [&](layer_t& layer, micro& u) {
          return layer.forward(epx::span<const float>(u.x), epx::span<const std::int32_t>(u.d.ids),
                               epx::span<const float>(u.w), epx::span<float>(u.out), experts, epx::mode::train);
        };
        const auto backward = [&](layer_t& layer, epx::saved_state<float>& s, micro& u) {
          if (!split) {
            layer.backward(std::move(s), epx::span<const float>(u.go), epx::span<float>(u.gx), epx::span<float>(u.gw),
                           experts);
            return;
          }
          auto g = layer.backward_dispatch_start(std::move(s), epx::span<const float>(u.go), epx::span<float>(u.gw));
          layer.backward_dispatch_wait(g);
          experts.backward(epx::test::test_exec{}, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
          layer.backward_combine(g, epx::span<const float>(g.grad_inputs().data(), g.grad_inputs().size()),
                                 epx::span<float>(u.gx));
        };
        try {
          // One forward and backward per micro-batch: what the two calls must give.
          layer_t single(m, comm, epx::test::options_for(c));
          std::vector<micro> want = mb;
          for (auto& u : want) {
            auto s = forward(single, u);
            backward(single, s, u);
          }
          layer_t layer(m, comm, epx::test::options_for(c));
          epx::saved_state<float> saved[2];
          if (!split) {
            for (int i = 0; i < 2; ++i) saved[i] = forward(layer, mb[static_cast<std::size_t>(i)]);
          } else {
            // Both forwards in flight at once (dispatch 0, dispatch 1, combine 0, combine 1):
            // each saved state still names its own call, not the latest one started.
            epx::forward_handle<float> h[2];
            for (int i = 0; i < 2; ++i) {
              const micro& u = mb[static_cast<std::size_t>(i)];
              h[i] = layer.dispatch_start(epx::span<const float>(u.x), epx::span<const std::int32_t>(u.d.ids),
                                          epx::span<const float>(u.w), epx::mode::train);
            }
            for (int i = 0; i < 2; ++i) {
              layer.dispatch_wait(h[i]);
              experts.forward(epx::test::test_exec{}, h[i].inputs(), h[i].outputs().data());
            }
            for (int i = 0; i < 2; ++i)
              saved[i] = layer.combine(h[i], epx::span<const float>(h[i].outputs().data(), h[i].outputs().size()),
                                       epx::span<float>(mb[static_cast<std::size_t>(i)].out));
          }
          const int first = rank == odd ? 1 : 0;
          const raised r =
              epx::test::capture([&] { backward(layer, saved[first], mb[static_cast<std::size_t>(first)]); });
          if (!r.thrown || r.category != epx::errc::input ||
              r.message.find("different forward calls") == std::string::npos)
            f += "backward of different calls: '" + r.message + "'; ";
          if (saved[0].empty() || saved[1].empty()) f += "a rejected backward consumed a saved state; ";
          for (int i : {1, 0}) backward(layer, saved[i], mb[static_cast<std::size_t>(i)]);
          for (int i = 0; i < 2; ++i) {
            const micro &u = mb[static_cast<std::size_t>(i)], &v = want[static_cast<std::size_t>(i)];
            if (u.gx != v.gx || u.gw != v.gw)
              f += epx::detail::concat("micro-batch ", i, ": gradients differ from one call per micro-batch; ");
          }
        } catch (const std::exception& e) {
          f += std::string("raised: ") + e.what();
        }
      },
      opts);
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}
}  // namespace

TEST_CASE("backward of different forward calls on the ranks of a group raises on every rank and keeps the states") {
  for (bool split : {false, true}) {
    for (bool direct : {true, false}) {
      auto c = small(2, 2, 4);  // one EP group of 4, tp = 2
      c.peer_access = direct;
      check_backward_of_different_calls<epx::impl::all_to_all>(c, split, 3);
      auto d = small(1, 2, 2, 4, 2);  // tp = 1: the ranks' rows differ
      d.peer_access = direct;
      check_backward_of_different_calls<epx::impl::all_to_all>(d, split, 1);
    }
    check_backward_of_different_calls<epx::impl::all_reduce>(small(4, 1, 4), split, 2);  // the masked path
  }
}
TEST_CASE("a moved-from layer raises errc::configuration on every call; the layer it moved into goes on") {
  const auto c = small(1, 2, 2, 4);  // world 2, one EP group
  std::vector<std::string> failures(2);
  epx::threads::run(2, [&](comm_t& comm) {
    const epx::mesh m(c.topology);
    const int rank = comm.rank(), b = m.batch(rank);
    const auto d = epx::test::make_batch<float>(c, b);
    const std::size_t N = c.rows_of(b), H = 4;
    const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    epx::ref::test_linear_experts<float> experts(global, m.ep_rank(rank), m.local_experts());
    std::vector<float> x(d.x.begin(), d.x.end()), w(d.w.begin(), d.w.end()), out(N * H), fused(N * H);
    const epx::span<const float> xs(x), ws(w);
    const epx::span<const std::int32_t> ids(d.ids);
    epx::moe_layer<comm_t, float> layer(m, comm, epx::test::options_for(c));
    (void)layer.forward(xs, ids, ws, epx::span<float>(fused), experts, epx::mode::inference);
    auto h = layer.dispatch_start(xs, ids, ws, epx::mode::inference);
    epx::moe_layer<comm_t, float> moved(std::move(layer));
    std::string& f = failures[static_cast<std::size_t>(rank)];
    const auto refused = [&](const char* what, auto call) {
      const auto r = epx::test::capture(call);
      if (!r.thrown || r.category != epx::errc::configuration ||
          r.message.find(std::string("moe_layer ") + what + " (rank " + std::to_string(rank) +
                         "): this layer was moved from") == std::string::npos)
        f += std::string(what) + ": '" + r.message + "'; ";
    };
    // Each of these is local to the rank (it raises before any collective).
    refused("dispatch_wait", [&] { layer.dispatch_wait(h); });
    refused("forward", [&] {
      (void)layer.forward(xs, ids, ws, epx::span<float>(out), experts, epx::mode::inference);
    });
    refused("dispatch_start", [&] { (void)layer.dispatch_start(xs, ids, ws, epx::mode::inference); });
    refused("check", [&] { (void)layer.check(); });
    // So does every accessor of the state that moved (it would be a null dereference):
    refused("stats", [&] { (void)layer.stats(); });
    refused("topology", [&] { (void)layer.topology(); });
    refused("node_limit", [&] { (void)layer.node_limit(); });
    refused("ep_communicator", [&] { (void)layer.ep_communicator(); });
    refused("tp_communicator", [&] { (void)layer.tp_communicator(); });
    // The layer's own copies stay readable; the bounded counters are null as in the normal mode.
    if (layer.options().hidden != H) f += "options() of the moved-from layer changed; ";
    if (layer.overflow_counter() != nullptr) f += "overflow_counter() of the moved-from layer is not null; ";
    if (moved.stats().calls != 1 || moved.topology().world() != 2 || moved.ep_communicator().size() != 2)
      f += "the moved-into layer's accessors do not show the moved state; ";
    // The handle belongs to the layer that now holds the state.
    try {
      moved.dispatch_wait(h);
      experts.forward(epx::test::test_exec{}, h.inputs(), h.outputs().data());
      (void)moved.combine(h, h.outputs(), epx::span<float>(out));
      if (out != fused) f += "the moved-into layer's split call differs from the fused one; ";
    } catch (const std::exception& e) {
      f += std::string("moved-into layer raised: ") + e.what();
    }
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("bad input: an out-of-range id in token 0 slot 0 (the first pair) raises on every rank of the EP group") {
  const layer_case c = small(1, 2, 2, 4);
  for (bool split : {false, true}) {
    CAPTURE(split);
    std::vector<raised> r(2);
    epx::threads::run(2, [&](comm_t& comm) {
      epx::test::rank_inputs<float> in(c, comm.rank());
      REQUIRE(in.N > 0);
      if (comm.rank() == 1) in.d.ids[0] = 99;
      epx::moe_layer<comm_t, float> layer(in.m, comm, epx::test::options_for(c));
      epx::ref::test_linear_experts<float> experts(in.global, in.m.ep_rank(comm.rank()), in.m.local_experts());
      std::vector<float> out(in.N * in.H);
      r[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
        const epx::span<const float> x(in.x), w(in.w);
        const epx::span<const std::int32_t> ids(in.d.ids);
        if (split) (void)layer.dispatch_start(x, ids, w, epx::mode::train);
        else (void)layer.forward(x, ids, w, epx::span<float>(out), experts, epx::mode::train);
      });
    });
    require_every_rank_raised(r, epx::errc::input, {"expert id (99) of token 0 slot 0"});
  }
}

TEST_CASE("a call whose expert-major buffers would wrap rows * H raises errc::input on every rank, before rows move") {
  // No rank has a token, yet every owner's buffer holds its padding rows: 2^24 rows of
  // H = 2^40 elements, 2^64 elements, which wrap to a buffer of none.
  epx::layer_options o;
  o.hidden = std::size_t{1} << 40;
  o.top_k = 1;
  o.pad.rows_per_expert = 1 << 24;
  const auto run = [&](auto impl, epx::mesh_config mc) {
    using Impl = decltype(impl);
    std::vector<raised> r(2);
    epx::threads::run(2, [&](comm_t& comm) {
      const epx::mesh m(mc);
      epx::moe_layer<comm_t, float, Impl> layer(m, comm, o);
      scale_experts experts;
      r[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
        (void)layer.forward(epx::span<const float>(), epx::span<const std::int32_t>(), epx::span<const float>(),
                            epx::span<float>(), experts, epx::mode::inference);
      });
    });
    require_every_rank_raised(r, epx::errc::input,
                              {"the expert-major buffer of ep rank 0 would hold 16777216 rows (padding included) of "
                                "H=1099511627776 elements of 4 bytes, more than 9223372036854775807 bytes"});
  };
  SUBCASE("all-to-all path") { run(epx::impl::all_to_all{}, {1, 2, 1, 1, 2, 2, 0}); }
  SUBCASE("masked all-reduce path") { run(epx::impl::all_reduce{}, {2, 1, 1, 1, 2, 2, 0}); }
}

namespace {

// forward and dispatch_start of a layer with options `o` over 2 ranks of mesh `mc`, each
// raising errc::input with `text` on every rank; `call(layer, experts, split)` makes the
// call (split: dispatch_start).
template <class Call>
void both_entries_refuse(const epx::layer_options& o, const epx::mesh_config& mc, const char* text, Call call) {
  for (bool split : {false, true}) {
    CAPTURE(split);
    std::vector<raised> r(2);
    epx::threads::run(2, [&](comm_t& comm) {
      const epx::mesh m(mc);
      epx::moe_layer<comm_t, float> layer(m, comm, o);
      scale_experts experts;
      r[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] { call(layer, experts, split); });
    });
    require_every_rank_raised(r, epx::errc::input, {text});
  }
}

}  // namespace

TEST_CASE("tensor sizes whose N*k would wrap raise errc::input on every rank of the EP group") {
  // x of 2^61 rows of H = 1 (a size no buffer has: the call must refuse it before reading)
  // and k = 8: N*k = 2^64 wraps to 0, which empty ids and weights used to match.
  epx::layer_options o;
  o.hidden = 1;
  o.top_k = 8;
  const std::size_t N = std::size_t{1} << 61;
  both_entries_refuse(o, {1, 2, 1, 1, 2, 8, 0},
                      "expert ids have 0 elements but N*k = 2305843009213693952*8 = more than SIZE_MAX",
                      [N](auto& layer, auto& experts, bool split) {
                        std::vector<float> x(8), out(8);
                        const epx::span<const float> xs(x.data(), N), w;
                        const epx::span<const std::int32_t> ids;
                        if (split) (void)layer.dispatch_start(xs, ids, w, epx::mode::inference);
                        else
                          (void)layer.forward(xs, ids, w, epx::span<float>(out.data(), N), experts,
                                              epx::mode::inference);
                      });
}

TEST_CASE("ids and weights made for another k than layer_options.top_k: the message names the option") {
  // top_k left at its default 1, ids and weights of 2 slots per token.
  epx::layer_options o;
  o.hidden = 2;
  both_entries_refuse(o, {1, 2, 1, 1, 2, 4, 0}, "expert ids have 8 elements but N*k = 4*1 = 4 (k is layer_options.top_k)",
                      [](auto& layer, auto& experts, bool split) {
                        std::vector<float> x(8), w(8), out(8);
                        std::vector<std::int32_t> ids(8, 0);
                        if (split)
                          (void)layer.dispatch_start(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                                                     epx::span<const float>(w), epx::mode::inference);
                        else
                          (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                                              epx::span<const float>(w), epx::span<float>(out), experts,
                                              epx::mode::inference);
                      });
}

namespace {

using epx::test::throwing_experts;  // support/throwing_experts.hpp

// What a rank saw of a call: "" when it returned, else the exception's what().
template <class F>
std::string outcome(F&& f) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

// One layer, training steps of the same batch on every rank: a clean step, then one whose
// experts throw (in forward or in backward) on rank `thrower` (-1: on every rank), every
// rank catching what it raises. A thrower alone leaves its peers inside the call, so its
// next step meets them there and raises errc::communicator, as theirs does (docs/
// guarantees.md, known limits). Once every rank has caught its error the ranks are in step
// again, and the next steps must give the clean step's results bit for bit.
template <class Impl>
std::vector<std::string> steps_after_a_throw(const layer_case& c, int thrower, bool in_backward) {
  const epx::mesh m(c.topology);
  std::vector<std::string> failures(static_cast<std::size_t>(m.world()));
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      m.world(),
      [&](comm_t& comm) {
        const int rank = comm.rank();
        std::string& f = failures[static_cast<std::size_t>(rank)];
        const epx::test::rank_inputs<float> in(c, rank);
        throwing_experts experts(in.global, m.ep_rank(rank), m.local_experts());
        epx::moe_layer<comm_t, float, Impl, epx::test::test_exec> layer(m, comm, epx::test::options_for(c));
        const std::vector<float> go(in.d.grad_out.begin(), in.d.grad_out.end());
        std::vector<float> out, gx, gw;
        const auto step = [&] {
          out.assign(in.N * in.H, 7.0f);
          gx.assign(in.N * in.H, 7.0f);
          gw.assign(in.w.size(), 7.0f);
          return outcome([&] {
            auto saved = layer.forward(epx::span<const float>(in.x), epx::span<const std::int32_t>(in.d.ids),
                                       epx::span<const float>(in.w), epx::span<float>(out), experts, epx::mode::train);
            layer.backward(std::move(saved), epx::span<const float>(go), epx::span<float>(gx), epx::span<float>(gw),
                           experts);
          });
        };
        std::string e = step();
        if (!e.empty()) {
          f += "the clean step raised: " + e;
          return;
        }
        const auto out0 = out, gx0 = gx, gw0 = gw;
        const bool throws = thrower < 0 || thrower == rank;
        (in_backward ? experts.fail_backward : experts.fail_forward) = throws;
        e = step();
        if (e.find(throws ? "injected" : "epx communicator error") == std::string::npos)
          f += "the failing step raised '" + e + "'; ";
        if (thrower == rank) {  // its peers are still inside that call: its next one meets them
          e = step();
          if (e.find("epx communicator error") == std::string::npos)
            f += "the thrower's next step raised '" + e + "', not errc::communicator; ";
        }
        for (int i = 0; i < 2; ++i) {
          e = step();
          if (!e.empty()) f += "step " + std::to_string(i) + " after the failure raised: " + e + "; ";
          else if (out != out0 || gx != gx0 || gw != gw0)
            f += "step " + std::to_string(i) + " after the failure differs from the clean step; ";
        }
      },
      opts);
  return failures;
}

}  // namespace

TEST_CASE("experts that throw, on one rank or on all, caught there: every rank raises, then the layer gives the clean results again") {
  auto c = small(1, 2, 2, 4);  // world 2, one EP group
  const auto run = [](const layer_case& lc, bool masked) {
    for (int thrower : {-1, 0, 1})
      for (bool in_backward : {false, true}) {
        CAPTURE(thrower);
        CAPTURE(in_backward);
        const auto failures = masked ? steps_after_a_throw<epx::impl::all_reduce>(lc, thrower, in_backward)
                                     : steps_after_a_throw<epx::impl::all_to_all>(lc, thrower, in_backward);
        for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
      }
  };
  SUBCASE("the direct route") { run(c, false); }
  SUBCASE("the staged route") {
    c.peer_access = false;
    run(c, false);
  }
  SUBCASE("the staged route in rounds, sends gathered") {
    c.peer_access = false;
    c.indexed_sends = false;
    c.stage_bytes = 2 * 2 * 4 * sizeof(float);  // two slice rows a round
    run(c, false);
  }
  SUBCASE("per-rank sends") {
    c.peer_access = false;
    c.sends = epx::row_sends::per_rank;
    run(c, false);
  }
  SUBCASE("the masked all-reduce path") { run(small(2, 1, 2, 4), true); }
}

}  // namespace test_layer_errors_cpp
