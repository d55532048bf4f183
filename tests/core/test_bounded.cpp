// Bounded mode (spec section 11) on the threads backend: bitwise the normal mode when
// nothing overflows, the local-capacity drops of the float64 reference when something
// does (by position and by score), over meshes with tp > 1, float and bf16, serial and
// OpenMP policies (exec::emulated_device: tests/emulated/test_bounded.cpp), both routes (direct peer reads and the staged all-to-all), realistic
// hidden sizes; the masked path (ep == tp) against the normal masked path; the overflow
// counter and check(); bad options and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/bounded_cases.hpp"
#include "epx/comm/threads.hpp"
#include "support/on_ranks.hpp"
#include "support/sanitizers.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_bounded_cpp {

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::threads::communicator;

using epx::test::on_ranks;  // support/on_ranks.hpp

// Scales its rows by 2 (in place allowed): a stand-in for the experts of the error tests.
struct doubling_experts {
  static constexpr bool forward_in_place = true;
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) out[i] = 2.0f * in.rows[i];
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>& in, const float* g, float* gi) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) gi[i] = 2.0f * g[i];
  }
};

// A mesh of tp x fsdp ranks, EP groups of ep ranks, `experts` experts.
epx::mesh_config mesh_of(int tp, int fsdp, int ep, int experts) {
  epx::mesh_config mc;
  mc.tp = tp;
  mc.fsdp = fsdp;
  mc.ep = ep;
  mc.experts = experts;
  return mc;
}

// Bounded mode (counts exchanged on the device) with bound `cap`, rows of `hidden`, top-k.
epx::layer_options bounded_options(std::size_t hidden, int top_k, std::int64_t cap) {
  epx::layer_options o;
  o.hidden = hidden;
  o.top_k = top_k;
  o.counts = epx::count_exchange::device;
  o.bound.cap = cap;
  return o;
}

// Four ranks, ep = 4, 8 experts: tp = 4 and the masked path (every rank holds the same
// rows) when `masked`, else fsdp = 4 and the all-to-all path; options o. body(layer) runs on
// this rank's layer.
template <class Body>
void on_path_with(bool masked, comm_t& comm, const epx::layer_options& o, Body body) {
  const epx::mesh m(masked ? mesh_of(4, 1, 4, 8) : mesh_of(1, 4, 4, 8));
  if (masked) {
    epx::moe_layer<comm_t, float, epx::impl::all_reduce> layer(m, comm, o);
    body(layer);
  } else {
    epx::moe_layer<comm_t, float> layer(m, comm, o);
    body(layer);
  }
}

// on_path_with in bounded mode with bound cap, hidden 4, top-2.
template <class Body>
void on_path(bool masked, comm_t& comm, std::int64_t cap, bool raise_on_overflow, Body body) {
  epx::layer_options o = bounded_options(4, 2, cap);
  o.bound.raise_on_overflow = raise_on_overflow;
  on_path_with(masked, comm, o, body);
}

// One call's tensors on this rank (hidden 4, top-2): N rows of x = 1 with weights 0.5 and
// ids[i] = (i * step) % 8, grad_out = 1 and the gradients on `grad_rows` rows.
struct call_rows {
  std::vector<float> x, w, y, g, gx, gw;
  std::vector<std::int32_t> ids;
  call_rows(std::size_t N, std::size_t step, std::size_t grad_rows)
      : x(N * 4, 1.0f), w(N * 2, 0.5f), y(N * 4), g(grad_rows * 4, 1.0f), gx(grad_rows * 4), gw(grad_rows * 2),
        ids(N * 2) {
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * step) % 8);
  }
  // layer.forward of x, ids and w into `out` (y where not given).
  template <class Layer, class Experts>
  auto forward(Layer& layer, Experts& e, epx::mode m, std::vector<float>& out) {
    return layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                         epx::span<float>(out), e, m);
  }
  template <class Layer, class Experts>
  auto forward(Layer& layer, Experts& e, epx::mode m) {
    return forward(layer, e, m, y);
  }
  // layer.backward of saved state s with grad_out g into gx and gw.
  template <class Layer, class State, class Experts>
  void backward(Layer& layer, State&& s, Experts& e) {
    layer.backward(std::forward<State>(s), epx::span<const float>(g), epx::span<float>(gx), epx::span<float>(gw), e);
  }
};

using epx::test::world_of;

layer_case make(int tp, int fsdp, int ep, int E, int k, routing_kind r = routing_kind::random, int R = 1) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.dp_replicate = R;
  c.topology.experts = E;
  c.top_k = k;
  c.routing = r;
  c.rows = [](int b) { return static_cast<std::size_t>(10 + 3 * b); };
  c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + static_cast<int>(r) * 13 + R);
  return c;
}

// A bound that no block can exceed: every pair of a slice.
std::int64_t no_overflow(const layer_case& c) {
  std::size_t most = 0;
  const epx::mesh m(c.topology);
  for (int b = 0; b < m.batches(); ++b) most = std::max(most, c.rows_of(b));
  return static_cast<std::int64_t>(most);  // distinct experts per token: at most one pair per row
}

template <class T, class Exec = epx::test::test_exec, class Impl = epx::impl::all_to_all>
void check(const layer_case& c, std::int64_t cap, bool drops, Exec policy = {}) {
  CAPTURE(c.describe());
  CAPTURE(cap);
  on_ranks(world_of(c.topology), [&](comm_t& comm) {
    return epx::test::check_bounded_case<comm_t, T, Exec, Impl>(comm, c, cap, drops, policy);
  });
}
template <class T, class Exec = epx::test::test_exec>
void check_masked(const layer_case& c, std::int64_t cap, bool drops, Exec policy = {}) {
  check<T, Exec, epx::impl::all_reduce>(c, cap, drops, policy);
}

// ep == tp: the masked path.
std::vector<layer_case> masked_meshes() {
  return {make(2, 1, 2, 4, 2),  make(4, 1, 4, 8, 2), make(2, 2, 2, 8, 2, routing_kind::uneven),
          make(4, 2, 4, 16, 4), make(2, 1, 2, 8, 2, routing_kind::random, 2),
          make(1, 1, 1, 4, 2),  make(8, 1, 8, 16, 3)};
}

std::vector<layer_case> meshes() {
  return {make(1, 4, 4, 8, 2),     make(2, 2, 4, 8, 2),    make(2, 4, 8, 16, 4, routing_kind::uneven),
          make(1, 2, 2, 4, 1),     make(4, 2, 8, 16, 2),   make(1, 4, 2, 8, 2, routing_kind::random, 1),
          make(1, 2, 2, 8, 2, routing_kind::random, 2), make(1, 1, 1, 4, 2)};
}

}  // namespace

TEST_CASE("bounded: bitwise the normal mode when nothing overflows (meshes, float and bf16, both routes)") {
  for (auto c : meshes()) {
    check<float>(c, no_overflow(c), false);
    check<epx::bf16>(c, no_overflow(c), false);
    c.peer_access = false;  // the staged route everywhere
    check<float>(c, no_overflow(c), false);
  }
}

TEST_CASE("bounded: overflow drops the local-capacity pairs of the reference, by position and by score") {
  for (auto c : meshes()) {
    if (c.top_k == 1 && c.topology.experts == 4) c.routing = routing_kind::one_expert;  // something must overflow
    for (auto prio : {epx::drop_priority::position, epx::drop_priority::score}) {
      c.capacity.priority = prio;
      check<float>(c, 1, true);
      check<epx::bf16>(c, 1, true);
      auto staged = c;
      staged.peer_access = false;
      check<float>(staged, 1, true);
    }
  }
  auto uneven = make(2, 4, 8, 16, 4, routing_kind::uneven);
  check<float>(uneven, 2, true);
}

TEST_CASE("bounded, masked path: bitwise the normal masked path, with and without drops (meshes, float and bf16)") {
  for (auto c : masked_meshes()) {
    check_masked<float>(c, no_overflow(c), false);
    check_masked<epx::bf16>(c, no_overflow(c), false);
    // Something must overflow cap 1: more pairs in the smallest slice than experts, or one expert.
    if (c.rows_of(0) / static_cast<std::size_t>(c.topology.tp) * static_cast<std::size_t>(c.top_k) <=
        static_cast<std::size_t>(c.topology.experts))
      c.routing = routing_kind::one_expert;
    for (auto prio : {epx::drop_priority::position, epx::drop_priority::score}) {
      c.capacity.priority = prio;
      check_masked<float>(c, 1, true);
      check_masked<epx::bf16>(c, 1, true);
    }
  }
  auto decode = make(4, 1, 4, 8, 2);
  decode.rows = [](int) { return std::size_t{3}; };  // fewer rows than slices: an empty slice
  check_masked<float>(decode, 1, false);
  auto empty = make(2, 2, 2, 8, 2);
  empty.rows = [](int b) { return static_cast<std::size_t>(b == 0 ? 0 : 5); };  // an empty batch
  check_masked<float>(empty, no_overflow(empty), false);
  auto wide = make(2, 2, 2, 8, 2);
  wide.hidden = epx::test::tsan_hidden(1024, 256);
  wide.rows = [](int b) { return static_cast<std::size_t>(6 + b); };
  check_masked<epx::bf16>(wide, no_overflow(wide), false);
  check_masked<float, epx::exec::openmp>(wide, 1, true, epx::exec::openmp{2});
}

TEST_CASE("bounded: OpenMP policy, decode-sized and empty batches, realistic hidden size") {
  auto c = make(2, 2, 4, 8, 2);
  check<float, epx::exec::openmp>(c, no_overflow(c), false, epx::exec::openmp{2});
  check<float, epx::exec::openmp>(c, 1, true, epx::exec::openmp{2});
  auto decode = make(1, 4, 4, 8, 2);
  decode.rows = [](int b) { return static_cast<std::size_t>(b % 2); };  // empty and one-token batches
  check<float>(decode, 1, false);
  auto wide = make(2, 2, 4, 8, 2);
  wide.hidden = epx::test::tsan_hidden(1024, 256);
  wide.rows = [](int b) { return static_cast<std::size_t>(6 + b); };
  check<epx::bf16>(wide, no_overflow(wide), false);
  check<epx::bf16>(wide, 1, true);
}

namespace {
// Row-wise experts with O(H) work: out = 2 * in (bf16 rounding), grad_in = 2 * grad_out.
template <class T>
struct doubling_rows {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const T>& in, T* out) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i)
      out[i] = epx::convert<T>(2.0f * epx::convert<float>(in.rows[i]));
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* g, T* gi) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) gi[i] = epx::convert<T>(2.0f * epx::convert<float>(g[i]));
  }
};

// Forward (train), backward and inference at H = 4096 and 7168, bounded against normal, bitwise
// (tp = 8: the masked path, Impl all_reduce).
template <class T, class Impl = epx::impl::all_to_all, class Exec = epx::test::test_exec>
std::string wide_bitwise(comm_t& comm, std::size_t H, int tp) {
  const epx::mesh m(mesh_of(tp, 8 / tp, 8, 32));
  const std::size_t N = 16, k = 8;
  const int b = m.batch(comm.rank());
  std::vector<T> x(N * H), g(N * H);
  std::vector<float> w(N * k);
  std::vector<std::int32_t> ids(N * k);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = epx::convert<T>(static_cast<float>((i * 7919 + static_cast<std::size_t>(b) * 31) % 2003) / 1001.0f - 1.0f);
    g[i] = epx::convert<T>(static_cast<float>((i * 104729 + 17) % 997) / 498.0f - 1.0f);
  }
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t j = 0; j < k; ++j) {
      ids[t * k + j] = static_cast<std::int32_t>((t * 5 + j * 4 + static_cast<std::size_t>(b)) % 32);
      w[t * k + j] = 0.05f + 0.1f * static_cast<float>((t + j) % 7);
    }
  std::vector<std::vector<T>> outs;
  std::vector<std::vector<float>> gws;
  for (bool bounded : {false, true}) {
    epx::layer_options o;
    o.hidden = H;
    o.top_k = static_cast<int>(k);
    if (bounded) {
      o.counts = epx::count_exchange::device;
      o.bound.cap = 16;
    }
    epx::moe_layer<comm_t, T, Impl, Exec> layer(m, comm, o);
    doubling_rows<T> e;
    std::vector<T> y(N * H), gx(N * H), yi(N * H);
    std::vector<float> gw(N * k);
    auto s = layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<T>(y), e, epx::mode::train);
    layer.backward(std::move(s), epx::span<const T>(g), epx::span<T>(gx), epx::span<float>(gw), e);
    (void)layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                        epx::span<T>(yi), e, epx::mode::inference);
    if (bounded && layer.check().overflow_pairs != 0) return "unexpected overflow";
    outs.push_back(y);
    outs.push_back(gx);
    outs.push_back(yi);
    gws.push_back(gw);
  }
  std::string f;
  for (int i = 0; i < 3; ++i)
    if (!epx::test::bitwise_equal(outs[static_cast<std::size_t>(i)], outs[static_cast<std::size_t>(i + 3)]))
      f += epx::detail::concat("H=", H, " tp=", tp, ": output ", i, " differs bitwise\n");
  if (!epx::test::bitwise_equal(gws[0], gws[1])) f += epx::detail::concat("H=", H, " tp=", tp, ": grad_w differs\n");
  return f;
}
}  // namespace

TEST_CASE("bounded: H = 4096 and 7168, ep = 8, top-8 of 32 experts: bitwise the normal mode") {
  // Under TSan one size (every byte a thread touches is checked; 7168 adds no race).
  const std::vector<std::size_t> sizes =
      epx::test::under_tsan ? std::vector<std::size_t>{4096} : std::vector<std::size_t>{4096, 7168};
  for (std::size_t H : sizes) {
    CAPTURE(H);
    for (int tp : {1, 2}) {
      CAPTURE(tp);
      on_ranks(8, [&](comm_t& comm) { return wide_bitwise<epx::bf16>(comm, H, tp); });
    }
    on_ranks(8, [&](comm_t& comm) { return wide_bitwise<epx::bf16, epx::impl::all_reduce>(comm, H, 8); });
  }
}

TEST_CASE("bounded: a bound below 1, a capacity mode, FP8 on either path: errc::configuration on every rank") {
  const auto expect_bad = [](epx::layer_options o, const std::string& words, bool masked) {
    o.hidden = 4;
    o.top_k = 2;
    o.counts = epx::count_exchange::device;
    std::vector<std::string> got(4);
    epx::threads::run(4, [&](comm_t& comm) {
      try {
        on_path_with(masked, comm, o, [](auto&) {});
        got[static_cast<std::size_t>(comm.rank())] = "no error";
      } catch (const epx::error& e) {
        got[static_cast<std::size_t>(comm.rank())] =
            e.category() == epx::errc::configuration ? e.message() : std::string("wrong category: ") + e.what();
      }
    });
    for (const auto& g : got)
      CHECK_MESSAGE(g.find(words) != std::string::npos, std::string(g + " (wanted: " + words + ")"));
  };
  epx::layer_options o;
  o.bound.cap = 0;
  expect_bad(o, "layer_options.bound.cap (0) must be at least 1", false);
  o.bound.cap = -5;
  expect_bad(o, "layer_options.bound.cap (-5) must be at least 1", false);
  o.bound.cap = 4;
  o.capacity.mode = epx::capacity_mode::global;
  o.capacity.factor = 1.0;
  expect_bad(o, "layer_options.capacity.mode (global) must be off in bounded mode", false);
  expect_bad(o, "layer_options.capacity.mode (global) must be off in bounded mode", true);
  o.capacity = {};
  o.hidden = 128;
  o.fp8_dispatch = true;
  expect_bad(o, "layer_options.fp8_dispatch must be off in bounded mode", false);
  expect_bad(o, "layer_options.fp8_dispatch must be off in bounded mode", true);
  o.fp8_dispatch = false;
  o.bound.cap = 0;
  expect_bad(o, "layer_options.bound.cap (0) must be at least 1", true);

  // One rank with another bound: every rank raises.
  std::vector<std::string> got(2);
  const epx::mesh m(mesh_of(1, 2, 2, 4));
  epx::threads::run(2, [&](comm_t& comm) {
    try {
      epx::moe_layer<comm_t, float> layer(m, comm, bounded_options(4, 1, comm.rank() == 1 ? 0 : 3));
    } catch (const epx::error& e) {
      got[static_cast<std::size_t>(comm.rank())] = e.category() == epx::errc::configuration ? e.message() : "wrong";
    }
  });
  for (const auto& g : got) CHECK_MESSAGE(g.find("bound.cap (0) must be at least 1") != std::string::npos, g);

  // The automatic implementation takes the all-to-all path in bounded mode on ep == tp.
  epx::threads::run(2, [&](comm_t& comm) {
    epx::moe_layer<comm_t, float, epx::impl::automatic> layer(epx::mesh(mesh_of(2, 1, 2, 4)), comm,
                                                              bounded_options(4, 1, 8));
    std::vector<float> x(16, 0.5f), w(4, 1.0f), y(16);
    std::vector<std::int32_t> ids = {0, 1, 2, 3};
    doubling_experts e;
    (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                        epx::span<float>(y), e, epx::mode::inference);
    CHECK(std::string(layer.stats().path) == "all_to_all");
    CHECK(layer.stats().bounded);
  });
}

namespace {
struct outcome {
  bool call_threw = false;
  std::string check_message;  // "" when check() did not raise
  epx::bound_report report;
  std::int64_t counter = -1;  // this rank's overflow counter before check()
};

// Four ranks (on_path: the all-to-all or the masked path, cap 1), three rows each;
// `bad_rank` gets `bad`.
template <class Mutate>
std::vector<outcome> run_errors(bool raise_on_overflow, int bad_rank, Mutate bad, bool masked = false) {
  std::vector<outcome> got(4);
  epx::threads::run(4, [&](comm_t& comm) {
    const int r = comm.rank();
    call_rows io(3, 1, 3);  // ids 0, 1, 2, 3, 4, 5: distinct experts, nothing overflows
    if (r == bad_rank) bad(io.ids, io.w, io.y);
    doubling_experts e;
    auto& g = got[static_cast<std::size_t>(r)];
    on_path(masked, comm, 1, raise_on_overflow, [&](auto& layer) {
      try {
        (void)io.forward(layer, e, epx::mode::inference);
      } catch (const epx::error&) {
        g.call_threw = true;
      }
      g.counter = layer.overflow_counter()[0];
      try {
        g.report = layer.check();
      } catch (const epx::error& ex) {
        g.check_message = ex.category() == epx::errc::input ? ex.message() : std::string("wrong category");
      }
    });
  });
  return got;
}
}  // namespace

TEST_CASE("bounded: overflow counter and check(), raising on overflow when asked") {
  struct overflow_case {
    std::vector<std::int32_t> ids;  // rank 2's
    std::int64_t pairs, on_expert_0, on_expert_1;
  };
  const overflow_case cases[] = {
      {{0, 1, 0, 1, 0, 2}, 3, 2, 1},  // expert 0 three times, expert 1 twice: 3 pairs over cap 1
      {{0, 1, 0, 3, 4, 5}, 1, 1, 0},  // expert 0 twice: a single pair over cap 1 raises too
  };
  for (const auto& oc : cases) {
    CAPTURE(oc.pairs);
    auto over = [&](std::vector<std::int32_t>& ids, std::vector<float>&, std::vector<float>&) { ids = oc.ids; };
    for (bool raise : {false, true}) {
      const auto got = run_errors(raise, 2, over);
      for (int r = 0; r < 4; ++r) {
        const auto& g = got[static_cast<std::size_t>(r)];
        CHECK(!g.call_threw);
        CHECK(g.counter == (r == 2 ? oc.pairs : 0));
        if (raise) {
          CHECK_MESSAGE(g.check_message.find(std::to_string(oc.pairs) +
                                             " (token, slot) pair(s) overflowed the bound cap=1") != std::string::npos,
                        g.check_message);
          CHECK_MESSAGE(g.check_message.find("(most for expert 0: " + std::to_string(oc.on_expert_0) +
                                             "); raise layer_options::bound.cap, or set "
                                             "bound.raise_on_overflow = false to drop them without raising") !=
                            std::string::npos,
                        g.check_message);
        } else {
          CHECK(g.check_message.empty());
          CHECK(g.report.overflow_pairs == oc.pairs);
          CHECK(g.report.dropped_per_expert[0] == oc.on_expert_0);
          CHECK(g.report.dropped_per_expert[1] == oc.on_expert_1);
          CHECK(g.report.calls == 4);
        }
      }
    }
  }
}

TEST_CASE("bounded: no count reaches the host, so the load figures stay empty, nodes per token included") {
  // ranks_per_node = 2 would make the normal mode report nodes per token (section 10); in
  // bounded mode (section 11) no count is read back: the figures stay 0 and empty, on both
  // paths, after a training and an inference call.
  for (bool masked : {false, true}) {
    CAPTURE(masked);
    epx::layer_options o = bounded_options(4, 2, 8);
    o.ranks_per_node = 2;
    on_ranks(4, [&](comm_t& comm) {
      std::string f;
      on_path_with(masked, comm, o, [&](auto& layer) {
        doubling_experts e;
        call_rows io(6, 3, 6);
        for (auto md : {epx::mode::train, epx::mode::inference}) {
          (void)io.forward(layer, e, md);
          const epx::layer_stats& st = layer.stats();
          if (!st.bounded) f += "stats.bounded is false\n";
          if (st.max_nodes_per_token != 0 || st.mean_nodes_per_token != 0.0)
            f += epx::detail::concat("nodes per token ", st.max_nodes_per_token, " / ", st.mean_nodes_per_token, "\n");
          if (!st.tokens_per_expert.empty() || !st.tokens_per_local_expert.empty() || !st.dropped_per_expert.empty() ||
              st.dropped_pairs != 0 || st.max_expert_load != 0.0 || st.max_rank_load != 0.0)
            f += "load figures reported in bounded mode\n";
        }
        (void)layer.check();
      });
      return f;
    });
  }
}

TEST_CASE("bounded, masked path: a bad pair in any TP slice counts the call on every rank") {
  // tp = ep = 4: every rank holds the same 4 rows, one per TP slice; token t slot 1 gets id 8
  // (out of range), t = 0..3 in turn. Each rank counts its call as one with bad input,
  // whichever slice the bad pair lies in: check() reports 4 rank-calls on every rank.
  for (std::size_t t = 0; t < 4; ++t) {
    CAPTURE(t);
    std::vector<std::string> got(4);
    epx::threads::run(4, [&](comm_t& comm) {
      on_path(true, comm, 4, false, [&](auto& layer) {
        call_rows io(4, 1, 4);  // ids 0, 1, ..., 7
        io.ids[t * 2 + 1] = 8;
        doubling_experts e;
        (void)io.forward(layer, e, epx::mode::inference);
        const auto r = epx::test::capture([&] { (void)layer.check(); });
        got[static_cast<std::size_t>(comm.rank())] = r.category == epx::errc::input ? r.message : "no input error";
      });
    });
    for (const auto& m : got) {
      CHECK_MESSAGE(m.find("since the last check, 4 call(s) of the EP group had an expert id out of range") !=
                        std::string::npos,
                    m);
      CHECK_MESSAGE(m.find("; counted on rank 0 (1 with bad ids or weights), rank 1 (1 with bad ids or weights), "
                           "rank 2 (1 with bad ids or weights), rank 3 (1 with bad ids or weights)") != std::string::npos,
                    m);
    }
  }
}

TEST_CASE("bounded: bad expert ids, non-finite weights and bad shapes raise errc::input on every rank, no hang") {
  using mut = void (*)(std::vector<std::int32_t>&, std::vector<float>&, std::vector<float>&);
  const mut bad_id = [](std::vector<std::int32_t>& ids, std::vector<float>&, std::vector<float>&) { ids[3] = 8; };
  const mut nan_w = [](std::vector<std::int32_t>&, std::vector<float>& w, std::vector<float>&) { w[1] = 0.0f / 0.0f; };
  const mut bad_out = [](std::vector<std::int32_t>&, std::vector<float>&, std::vector<float>& y) { y.resize(5); };
  for (bool masked : {false, true})
    for (mut m : {bad_id, nan_w, bad_out}) {
      CAPTURE(masked);
      const auto got = run_errors(false, 3, m, masked);
      for (int r = 0; r < 4; ++r) {
        const auto& g = got[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CHECK(g.call_threw == (m == bad_out && r == 3));  // a bad shape raises at once on its rank
        CHECK_MESSAGE(g.check_message.find("bounded mode: since the last check") != std::string::npos,
                      g.check_message);
      }
    }
}

namespace {

// Four ranks on both paths (on_path, cap 4): a training forward of 6 rows, then a backward
// that rank `bad` gets wrong (`empty_state`: its saved state is reset; else its gradient
// tensors have two rows fewer). That rank raises errc::input with `text` and the others
// nothing; then every rank's check() raises for the one call with bad shapes.
void check_one_bad_backward(int bad, bool empty_state, const std::string& text) {
  for (bool masked : {false, true}) {
    CAPTURE(masked);
    std::vector<std::string> threw(4), checked(4);
    const auto input_error = [](const epx::error& ex) {
      return ex.category() == epx::errc::input ? ex.message() : std::string("wrong");
    };
    epx::threads::run(4, [&](comm_t& comm) {
      on_path(masked, comm, 4, false, [&](auto& layer) {
        const bool me = comm.rank() == bad;
        call_rows io(6, 3, me && !empty_state ? 4 : 6);
        doubling_experts e;
        auto s = io.forward(layer, e, epx::mode::train);
        if (me && empty_state) s.reset();
        try {
          io.backward(layer, std::move(s), e);
        } catch (const epx::error& ex) {
          threw[static_cast<std::size_t>(comm.rank())] = input_error(ex);
        }
        try {
          (void)layer.check();
        } catch (const epx::error& ex) {
          checked[static_cast<std::size_t>(comm.rank())] = input_error(ex);
        }
      });
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& t = threw[static_cast<std::size_t>(r)];
      if (r == bad) {
        CHECK_MESSAGE(t.find(text) != std::string::npos, t);
        CHECK_MESSAGE(t.find("; every rank of the EP group, this one included, raises it at its next "
                             "moe_layer::check(), a collective this rank must still make)") != std::string::npos,
                      t);
      } else
        CHECK_MESSAGE(t.empty(), t);
      CHECK_MESSAGE(checked[static_cast<std::size_t>(r)].find("1 call(s) had bad shapes") != std::string::npos,
                    checked[static_cast<std::size_t>(r)]);
    }
  }
}

}  // namespace

TEST_CASE("bounded: a backward with other shapes than its forward raises errc::input there, check() on every rank") {
  check_one_bad_backward(1, false, "backward shapes N=4 H=4 k=2 differ from the forward call's N=6");
}

TEST_CASE("bounded: a forward with bad shapes on one rank, raised there: the next training steps take back the same calls") {
  // Rank 3's out is too short: its forward raises at once, after joining the call's
  // collectives, while the peers' completes; check() then raises for that call on every
  // rank. The ranks stay in step, so a training step afterwards takes back the same forward
  // call on every rank and the next check() is quiet.
  for (bool masked : {false, true}) {
    CAPTURE(masked);
    std::vector<std::string> failures(4);
    epx::threads::run(4, [&](comm_t& comm) {
      on_path(masked, comm, 4, false, [&](auto& layer) {
        std::string& f = failures[static_cast<std::size_t>(comm.rank())];
        call_rows io(6, 3, 6);
        std::vector<float> bad_y(comm.rank() == 3 ? 5 : 6 * 4);
        doubling_experts e;
        const auto r = epx::test::capture([&] { (void)io.forward(layer, e, epx::mode::train, bad_y); });
        if (r.thrown != (comm.rank() == 3)) f += "the forward with bad shapes raised '" + r.message + "'; ";
        const auto c1 = epx::test::capture([&] { (void)layer.check(); });
        if (c1.message.find("1 call(s) had bad shapes") == std::string::npos ||
            c1.message.find("; counted on rank 3 (1 with bad shapes)") == std::string::npos)
          f += "the first check() raised '" + c1.message + "'; ";
        const auto step = epx::test::capture([&] { io.backward(layer, io.forward(layer, e, epx::mode::train), e); });
        if (step.thrown) f += "the training step raised '" + step.message + "'; ";
        const auto c2 = epx::test::capture([&] { (void)layer.check(); });
        if (c2.thrown) f += "the check() after the training step raised '" + c2.message + "'; ";
      });
    });
    for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
  }
}

TEST_CASE("bounded: ranks whose backwards take back different forward calls are raised by check() on every rank") {
  // Two training forwards A and B on every rank; rank 2 takes them back in the other order.
  // No backward raises (bounded mode reads nothing back), and check() raises errc::input on
  // every rank; in the same order on every rank, check() is quiet. Both paths: the
  // all-to-all path's slab headers and the masked path's all-reduce carry the call numbers.
  for (bool masked : {false, true})
  for (bool swapped : {false, true}) {
    CAPTURE(masked);
    CAPTURE(swapped);
    std::vector<std::string> threw(4), checked(4);
    epx::threads::run(4, [&](comm_t& comm) {
      on_path(masked, comm, 4, false, [&](auto& layer) {
        call_rows io(6, 3, 6);
        doubling_experts e;
        auto a = io.forward(layer, e, epx::mode::train);
        auto b = io.forward(layer, e, epx::mode::train);
        const bool other = swapped && comm.rank() == 2;
        try {
          io.backward(layer, std::move(other ? a : b), e);
          io.backward(layer, std::move(other ? b : a), e);
        } catch (const epx::error& ex) {
          threw[static_cast<std::size_t>(comm.rank())] = ex.message();
        }
        try {
          (void)layer.check();
        } catch (const epx::error& ex) {
          checked[static_cast<std::size_t>(comm.rank())] =
              ex.category() == epx::errc::input ? ex.message() : std::string("wrong category: ") + ex.message();
        }
      });
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& t = threw[static_cast<std::size_t>(r)];
      const auto& c = checked[static_cast<std::size_t>(r)];
      CHECK_MESSAGE(t.empty(), t);
      if (swapped)
        CHECK_MESSAGE(c.find("took back different forward calls") != std::string::npos, c);
      else
        CHECK_MESSAGE(c.empty(), c);
    }
  }
}

namespace {

// Sums |g| over the gradient rows its backward receives (and doubles them).
struct grad_recording_experts : doubling_experts {
  double received = 0;
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const float>& in, const float* g, float* gi) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) received += std::fabs(static_cast<double>(g[i]));
    doubling_experts::backward(ex, in, g, gi);
  }
};

// One call of `layer` (hidden 4, top-2) over x[t] = t + 1, weights 0.5, after a warm call of
// 6 rows that left every pair a position: ids, the NaN at pair `nan_pair`, then the output
// rows' first elements and the routing-weight gradients (grad_out = 1).
template <class Layer>
std::pair<std::vector<float>, std::vector<float>> bad_pair_call(Layer& layer, std::vector<std::int32_t> ids,
                                                                std::size_t nan_pair) {
  doubling_experts e;
  {
    call_rows warm(6, 3, 6);
    (void)warm.forward(layer, e, epx::mode::inference);
    (void)layer.check();
  }
  const std::size_t N = ids.size() / 2;
  std::vector<float> x(N * 4), w(N * 2, 0.5f), y(N * 4, -7.0f), g(N * 4, 1.0f), gx(N * 4), gw(N * 2, -7.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i / 4 + 1);
  w[nan_pair] = std::nanf("");
  auto saved = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                             epx::span<float>(y), e, epx::mode::train);
  layer.backward(std::move(saved), epx::span<const float>(g), epx::span<float>(gx), epx::span<float>(gw), e);
  std::vector<float> first(N);
  for (std::size_t t = 0; t < N; ++t) first[t] = y[t * 4];
  return {first, gw};
}

}  // namespace

TEST_CASE("bounded: a non-finite weight on an expert's pair after a warm call: that pair does not travel, the others keep their places") {
  // Expert 3 gets pairs 0, 2, 4 and 5; pair 4's weight is NaN. Each rank sends its own rows
  // on the all-to-all path (cap 2: pairs 0 and 2 stay, 5 is dropped by position); on the
  // masked path each of the 4 slices holds at most one row (nothing dropped).
  const std::vector<std::int32_t> ids = {3, 2, 3, 2, 3, 3};
  for (bool masked : {false, true})
    for (bool peers : {true, false}) {
      CAPTURE(masked);
      CAPTURE(peers);
      std::vector<std::string> failures(4);
      epx::threads::run(4, [&](comm_t& comm) {
        epx::layer_options o = bounded_options(4, 2, 2);
        o.peer_access = peers;
        std::pair<std::vector<float>, std::vector<float>> got;
        std::string checked;
        on_path_with(masked, comm, o, [&](auto& layer) {
          got = bad_pair_call(layer, ids, 4);
          try {
            (void)layer.check();
          } catch (const epx::error& ex) {
            checked = ex.message();
          }
        });
        // Doubling experts, weights 0.5: a kept slot adds x[t] = t + 1.
        const std::vector<float> want_y = {2.0f, 4.0f, masked ? 3.0f : 0.0f};
        // d out / d w = 2 x . grad_out = 8 (t + 1) for a kept slot, 0 for the bad and dropped ones.
        const std::vector<float> want_gw = {8.0f, 8.0f, 16.0f, 16.0f, 0.0f, masked ? 24.0f : 0.0f};
        std::string& f = failures[static_cast<std::size_t>(comm.rank())];
        if (got.first != want_y) f += "outputs differ; ";
        if (got.second != want_gw) f += "routing-weight gradients differ; ";
        if (checked.find("non-finite routing weight") == std::string::npos) f += "check(): '" + checked + "'";
      });
      for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
    }
  // One rank on the masked path, a warm call of 40 rows, then 4 rows (the stale positions of
  // the warm call lie past the new plan).
  epx::threads::run(1, [&](comm_t& comm) {
    epx::moe_layer<comm_t, float, epx::impl::all_reduce> layer(epx::mesh(mesh_of(1, 1, 1, 4)), comm,
                                                               bounded_options(2, 1, 10));
    doubling_experts e;
    std::vector<float> x(80, 1.0f), w(40, 0.5f), y(80);
    std::vector<std::int32_t> warm(40);
    for (std::size_t t = 0; t < 40; ++t) warm[t] = static_cast<std::int32_t>(t % 4);
    (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(warm), epx::span<const float>(w),
                        epx::span<float>(y), e, epx::mode::inference);
    std::vector<std::int32_t> ids = {0, 1, 2, 3};
    std::vector<float> w4(4, 0.5f), y4(8, -7.0f), g(8, 1.0f), gx(8), gw(4);
    w4[3] = std::nanf("");
    auto s = layer.forward(epx::span<const float>(x.data(), 8), epx::span<const std::int32_t>(ids),
                           epx::span<const float>(w4), epx::span<float>(y4), e, epx::mode::train);
    layer.backward(std::move(s), epx::span<const float>(g), epx::span<float>(gx), epx::span<float>(gw), e);
    CHECK(y4 == std::vector<float>{1, 1, 1, 1, 1, 1, 0, 0});
    CHECK(gx == std::vector<float>{1, 1, 1, 1, 1, 1, 0, 0});
    CHECK(gw == std::vector<float>{4, 4, 4, 0});
    CHECK_THROWS_AS((void)layer.check(), epx::error);
  });
}

TEST_CASE("bounded: a rank whose backward has bad shapes sends its peers zero gradient rows") {
  // Every row goes to expert 0 (rank 0's); rank 0's grad_out is zero and rank 1's has the
  // wrong size, so rank 0's experts must receive nothing but zeros.
  std::vector<double> received(2, -1.0);
  epx::threads::run(2, [&](comm_t& comm) {
    epx::moe_layer<comm_t, float> layer(epx::mesh(mesh_of(1, 2, 2, 2)), comm, bounded_options(4, 1, 4));
    grad_recording_experts e;
    const std::size_t N = 3;
    std::vector<float> x(N * 4, 1.0f), w(N, 1.0f), y(N * 4), gw(N);
    std::vector<std::int32_t> ids(N, 0);
    auto s = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(y), e, epx::mode::train);
    const std::size_t rows = comm.rank() == 1 ? N - 1 : N;
    std::vector<float> g(rows * 4, 0.0f), gx(rows * 4);
    try {
      layer.backward(std::move(s), epx::span<const float>(g), epx::span<float>(gx), epx::span<float>(gw), e);
    } catch (const epx::error&) {
    }
    received[static_cast<std::size_t>(comm.rank())] = e.received;
    try {
      (void)layer.check();
    } catch (const epx::error&) {
    }
  });
  CHECK(received[0] == 0.0);
  CHECK(received[1] == 0.0);
}

TEST_CASE("bounded: a backward of an empty saved state raises on its rank, the others at check(), nothing hangs") {
  check_one_bad_backward(2, true, "backward needs the saved state of a training forward");
}

TEST_CASE("bounded: check() raises in the EP group, check(world) on every rank of the world") {
  // fsdp 4, ep 2: two EP groups. Rank 0 overflows its bound (cap 2) in each of two calls.
  const epx::mesh m(mesh_of(1, 4, 2, 4));
  std::vector<std::string> group_check(4), world_check(4);
  epx::threads::run(4, [&](comm_t& comm) {
    epx::layer_options o = bounded_options(4, 2, 2);
    o.bound.raise_on_overflow = true;
    epx::moe_layer<comm_t, float> layer(m, comm, o);
    doubling_experts e;
    call_rows io(3, 1, 3);
    io.ids = {0, 1, 2, 3, 0, 2};                          // at most 2 pairs per expert
    if (comm.rank() == 0) io.ids = {0, 1, 0, 1, 0, 1};  // 3 each for experts 0 and 1
    const auto call = [&] { (void)io.forward(layer, e, epx::mode::inference); };
    const auto seen = [](auto check) {
      try {
        (void)check();
      } catch (const epx::error& ex) {
        return ex.category() == epx::errc::input ? ex.message() : std::string("wrong category");
      }
      return std::string();
    };
    call();
    group_check[static_cast<std::size_t>(comm.rank())] = seen([&] { return layer.check(); });
    call();
    world_check[static_cast<std::size_t>(comm.rank())] = seen([&] { return layer.check(comm); });
  });
  const auto group = m.group_members(epx::group_kind::ep, 0);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const bool in_group = std::find(group.begin(), group.end(), r) != group.end();
    const auto& g = group_check[static_cast<std::size_t>(r)];
    CHECK_MESSAGE((g.find("2 (token, slot) pair(s) overflowed the bound cap=2") != std::string::npos) == in_group, g);
    CHECK_MESSAGE(world_check[static_cast<std::size_t>(r)].find("2 (token, slot) pair(s) overflowed the bound cap=2") !=
                      std::string::npos,
                  world_check[static_cast<std::size_t>(r)]);
  }
}

TEST_CASE("bounded: check(group) over a group that is not made of whole EP groups raises on every rank, and keeps the counters") {
  // fsdp 4, ep 2. Groups {0, 1, 2} and {3} (3 and 1 ranks), then each rank alone: every
  // member raises errc::configuration before the collective, and the counters stay for the
  // check over the world.
  const epx::mesh m(mesh_of(1, 4, 2, 4));
  on_ranks(4, [&](comm_t& comm) {
    epx::moe_layer<comm_t, float> layer(m, comm, bounded_options(4, 2, 2));
    doubling_experts e;
    call_rows io(3, 1, 3);
    io.ids = {0, 1, 2, 3, 0, 2};
    if (comm.rank() == 0) io.ids = {0, 1, 0, 1, 0, 1};  // 2 pairs over the bound of 2
    (void)io.forward(layer, e, epx::mode::inference);
    std::string f;
    for (const bool alone : {false, true}) {
      comm_t group = comm.split(alone ? comm.rank() : (comm.rank() == 3 ? 1 : 0), comm.rank());
      const std::string words = "moe_layer::check(group) (rank " + std::to_string(comm.rank()) + "): the group has " +
                                std::to_string(group.size()) +
                                " ranks, not a multiple of the EP group's 2: it must be made of whole EP groups";
      const auto r = epx::test::capture([&] { (void)layer.check(group); });
      if (!r.thrown || r.category != epx::errc::configuration || r.message.find(words) == std::string::npos)
        f += "check(group of " + std::to_string(group.size()) + ") gave '" + r.message + "'; ";
    }
    const auto report = layer.check(comm);
    if (report.overflow_pairs != 2 || report.calls != 4)
      f += "check(world) after the refused checks: " + std::to_string(report.overflow_pairs) + " overflowed pairs in " +
           std::to_string(report.calls) + " rank-calls, not 2 in 4; ";
    return f;
  });
}

TEST_CASE("bounded, masked path: a rank with another N makes the all-reduce raise errc::communicator everywhere") {
  std::vector<std::string> got(4);
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      4,
      [&](comm_t& comm) {
        on_path(true, comm, 4, false, [&](auto& layer) {
          const std::size_t N = comm.rank() == 2 ? 5 : 6;
          call_rows io(N, 1, N);
          doubling_experts e;
          auto& g = got[static_cast<std::size_t>(comm.rank())];
          try {
            (void)io.forward(layer, e, epx::mode::inference);
            g = "no error";
          } catch (const epx::error& ex) {
            g = ex.category() == epx::errc::communicator ? ex.message() : std::string("wrong category: ") + ex.what();
          }
        });
      },
      opts);
  for (const auto& g : got) CHECK_MESSAGE(g.find("all_reduce: mismatched counts") != std::string::npos, g);
}

TEST_CASE("bounded: the split-phase calls raise errc::configuration on every rank, nothing hangs") {
  const epx::mesh m(mesh_of(1, 4, 4, 8));
  std::vector<std::string> got(4);
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      4,
      [&](comm_t& comm) {
        epx::moe_layer<comm_t, float> layer(m, comm, bounded_options(8, 2, 4));
        std::vector<float> x(6 * 8, 0.5f), w(12, 0.5f);
        std::vector<std::int32_t> ids(12);
        for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i % 8);
        try {
          auto h = layer.dispatch(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                                  epx::span<const float>(w), epx::mode::train);
          got[static_cast<std::size_t>(comm.rank())] = "no error";
        } catch (const epx::error& e) {
          got[static_cast<std::size_t>(comm.rank())] =
              e.category() == epx::errc::configuration ? e.message() : std::string("wrong category: ") + e.what();
        }
      },
      opts);
  for (const auto& g : got)
    CHECK_MESSAGE(g.find("the split-phase calls are not available in bounded mode") != std::string::npos, g);
}

namespace {
// doubling_experts whose forward throws the first time it is called while armed.
struct throwing_once_experts : doubling_experts {
  bool armed = false;
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const float>& in, float* out) {
    if (armed) {
      armed = false;
      throw std::bad_alloc();
    }
    doubling_experts::forward(ex, in, out);
  }
};

// doubling_experts whose backward throws the first time it is called while armed.
struct throwing_backward_experts : doubling_experts {
  bool armed = false;
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const float>& in, const float* g, float* gi) {
    if (armed) {
      armed = false;
      throw std::runtime_error("injected: the experts' backward failed");
    }
    doubling_experts::backward(ex, in, g, gi);
  }
};

// Four ranks on both paths (on_path, cap 4), each with call_rows(6, 1, 6) and experts of type
// Experts, armed on rank 1 only: call(layer, e, rows) twice on every rank, each returning
// what it raised ("no error" where nothing). Rank 1's first call must end with `thrown` and
// its second be refused with `refused`.
template <class Experts, class Call>
void check_refused_after_throw(Call call, const std::string& thrown, const std::string& refused) {
  for (bool masked : {false, true}) {
    CAPTURE(masked);
    std::vector<std::string> first(4), second(4);
    epx::threads::options opts;
    opts.timeout = std::chrono::seconds(20);
    epx::threads::run(
        4,
        [&](comm_t& comm) {
          on_path(masked, comm, 4, false, [&](auto& layer) {
            const auto r = static_cast<std::size_t>(comm.rank());
            Experts e;
            e.armed = comm.rank() == 1;
            call_rows io(6, 1, 6);
            first[r] = call(layer, e, io);
            second[r] = call(layer, e, io);
          });
        },
        opts);
    CHECK(first[1] == thrown);
    CHECK_MESSAGE(second[1].find(refused) != std::string::npos, second[1]);
    // Its peers wait for it in their first call's combine, and hear that it left.
    for (int p : {0, 2, 3}) {
      CAPTURE(p);
      CHECK_MESSAGE(first[static_cast<std::size_t>(p)].find("rank 1") != std::string::npos,
                    first[static_cast<std::size_t>(p)]);
      CHECK_MESSAGE(second[static_cast<std::size_t>(p)].find("the layer cannot be used any more") != std::string::npos,
                    second[static_cast<std::size_t>(p)]);
    }
  }
}
}  // namespace

TEST_CASE("bounded: a rank whose experts throw, caught there, is refused its next call; no call pairs with its peers'") {
  // Without the refusal rank 1's next forward would pair its all-to-alls (or its sum) with
  // the combine of its peers' first call: both would return, with each other's rows.
  check_refused_after_throw<throwing_once_experts>(
      [](auto& layer, throwing_once_experts& e, call_rows& io) -> std::string {
        try {
          (void)io.forward(layer, e, epx::mode::inference);
        } catch (const epx::error& ex) {
          return ex.what();
        } catch (const std::bad_alloc&) {
          return "bad_alloc";
        }
        return "no error";
      },
      "bad_alloc",
      "epx communicator error: moe_layer forward (rank 1): bounded mode: an earlier call of this layer on this rank "
      "failed (its forward ended before its last collective: std::bad_alloc)");
}

TEST_CASE("bounded: a rank whose experts throw in backward, caught there, is refused its next call") {
  // As the forward case above: rank 1 leaves its backward between the two all-to-alls (or
  // before the sums); its next call would pair with its peers' backward.
  check_refused_after_throw<throwing_backward_experts>(
      [](auto& layer, throwing_backward_experts& e, call_rows& io) -> std::string {
        try {
          io.backward(layer, io.forward(layer, e, epx::mode::train), e);
        } catch (const std::exception& ex) {
          return ex.what();
        }
        return "no error";
      },
      "injected: the experts' backward failed",
      "epx communicator error: moe_layer forward (rank 1): bounded mode: an earlier call of this layer on this rank "
      "failed (its backward ended before its last collective: injected: the experts' backward failed)");
}

}  // namespace test_bounded_cpp
