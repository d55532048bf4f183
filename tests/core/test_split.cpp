// The split-phase calls of the layer (spec section 13) on the threads backend: bitwise the
// fused calls across meshes, routes, implementations, element types and policies; every
// misuse raises on every rank that makes it (and, for the collective starts, on every rank
// of the EP group), nothing hangs.
#include <doctest/doctest.h>

#include <array>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/split_cases.hpp"
#include "epx/comm/threads.hpp"
#include "support/on_ranks.hpp"
#include "support/throwing_experts.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_split_cpp {

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using epx::test::split_misuse;
using comm_t = epx::threads::communicator;

using epx::test::world_of;

using epx::test::on_ranks;  // support/on_ranks.hpp

layer_case make(int tp, int fsdp, int ep, int E, int k, routing_kind r = routing_kind::random, int R = 1) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.dp_replicate = R;
  c.topology.experts = E;
  c.top_k = k;
  c.routing = r;
  c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + static_cast<int>(r) * 13 + R);
  return c;
}

template <class T, class Impl = epx::impl::all_to_all>
void check_split(const layer_case& c, epx::mode md = epx::mode::train) {
  CAPTURE(c.describe());
  on_ranks(world_of(c.topology), [&](comm_t& comm) {
    return epx::test::check_split_matches_fused<comm_t, T, Impl>(comm, c, md);
  });
}

std::vector<layer_case> meshes() {
  std::vector<layer_case> v = {make(1, 4, 4, 8, 2),          make(2, 4, 4, 16, 2, routing_kind::uneven),
                               make(2, 2, 4, 8, 8),          make(4, 2, 4, 16, 2),
                               make(1, 2, 2, 4, 2, routing_kind::random, 2), make(3, 2, 3, 12, 2),
                               make(2, 4, 8, 16, 1),         make(1, 4, 1, 4, 2)};
  auto some_empty = make(2, 2, 4, 8, 2);
  some_empty.rows = [](int b) { return b % 2 ? std::size_t{0} : std::size_t{10}; };
  v.push_back(some_empty);
  auto padded = make(2, 2, 4, 8, 2, routing_kind::first_rank_only);
  padded.pad = {2, 4};
  v.push_back(padded);
  return v;
}

}  // namespace

TEST_CASE("split phase: bitwise the fused calls across meshes (tp x fsdp with ep, tp > 1), both routes (float32)") {
  for (auto c : meshes()) {
    for (bool direct : {true, false}) {
      c.peer_access = direct;
      check_split<float>(c);
    }
  }
}

TEST_CASE("split phase: bf16 and double, inference, capacity") {
  for (auto c : {make(2, 4, 4, 16, 2, routing_kind::uneven), make(1, 4, 2, 8, 8)}) {
    for (bool direct : {true, false}) {
      c.peer_access = direct;
      check_split<epx::bf16>(c);
      check_split<float>(c, epx::mode::inference);
    }
    check_split<double>(c);
  }
  auto cap = make(1, 4, 4, 8, 2, routing_kind::uneven);
  cap.capacity.mode = epx::capacity_mode::local;
  cap.capacity.factor = 0.75;
  check_split<float>(cap);
}

TEST_CASE("split phase: per-rank sends (spec section 14), bitwise the fused calls") {
  for (auto c : meshes()) {
    c.sends = epx::row_sends::per_rank;
    check_split<float>(c);
  }
  auto c = make(1, 4, 2, 8, 8);
  c.sends = epx::row_sends::per_rank;
  check_split<epx::bf16>(c);
  check_split<float>(c, epx::mode::inference);
}

TEST_CASE("split phase: the staged route in rounds (one slice row a round), bitwise the fused calls") {
  for (auto c : meshes()) {
    c.peer_access = false;
    c.stage_bytes = 1;
    check_split<float>(c);
    check_split<float>(c, epx::mode::inference);
  }
}

TEST_CASE("split phase: the masked all-reduce path and impl::automatic (ep == tp)") {
  for (const auto& m : std::vector<std::array<int, 2>>{{2, 2}, {4, 1}, {2, 3}}) {
    auto c = make(m[0], m[1], m[0], 16, 2, routing_kind::uneven);
    check_split<float, epx::impl::all_reduce>(c);
    check_split<epx::bf16, epx::impl::all_reduce>(c);
    check_split<float, epx::impl::all_reduce>(c, epx::mode::inference);
    check_split<float, epx::impl::automatic>(c);                        // training: all_to_all
    check_split<float, epx::impl::automatic>(c, epx::mode::inference);  // inference: the masked path
  }
}

TEST_CASE("split phase: a realistic hidden size (H=4096) and the openmp policy") {
  // Elementwise experts (epx::test::scale_experts): bitwise against the fused calls; the
  // fused calls at these sizes are checked against float64 in test_layer_sizes.cpp.
  for (bool direct : {true, false}) {
    auto c = make(2, 2, 4, 8, 2, routing_kind::uneven);
    c.hidden = 4096;
    c.rows = [](int) { return std::size_t{64}; };
    c.peer_access = direct;
    CAPTURE(c.describe());
    on_ranks(4, [&](comm_t& comm) {
      return epx::test::check_split_matches_fused<comm_t, float>(comm, c, epx::mode::train, {}, false) +
             epx::test::check_split_matches_fused<comm_t, epx::bf16>(comm, c, epx::mode::train, {}, false);
    });
  }
  auto o = make(2, 4, 4, 16, 2, routing_kind::uneven);
  on_ranks(8, [&](comm_t& comm) {
    return epx::test::check_split_matches_fused<comm_t, float, epx::impl::all_to_all, epx::exec::openmp>(
        comm, o, epx::mode::train, epx::exec::openmp{2});
  });
}

namespace {
// Runs misuse `kind`, made by the ranks `bad(rank)`; every rank must raise `want` with `text`.
template <class Bad>
void check_misuse(const layer_case& c, split_misuse kind, Bad bad, epx::errc want, const std::string& text) {
  CAPTURE(epx::test::to_string(kind));
  const int n = world_of(c.topology);
  std::vector<epx::test::raised> r(static_cast<std::size_t>(n));
  epx::threads::run(n, [&](comm_t& comm) {
    r[static_cast<std::size_t>(comm.rank())] =
        epx::test::run_split_misuse<comm_t, float>(comm, c, kind, bad(comm.rank()));
  });
  for (int i = 0; i < n; ++i) {
    const auto& x = r[static_cast<std::size_t>(i)];
    CAPTURE(i);
    CAPTURE(x.message);
    REQUIRE(x.thrown);
    CHECK(x.category == want);
    CHECK(x.message.find(text) != std::string::npos);
  }
}
}  // namespace

TEST_CASE("split phase: misuse raises on every rank, nothing hangs") {
  for (bool direct : {true, false}) {
    auto c = make(2, 2, 4, 8, 2, routing_kind::uneven);
    c.peer_access = direct;
    const auto all = [](int) { return true; };
    const auto last = [](int r) { return r == 3; };
    using epx::errc;
    // Local calls (waits, accessors): every rank that makes the mistake raises.
    check_misuse(c, split_misuse::dispatch_wait_without_start, all, errc::configuration, "dispatch_wait got an empty handle");
    check_misuse(c, split_misuse::dispatch_wait_twice, all, errc::configuration,
                 "dispatch_wait needs a handle whose phase is 'dispatch started, not waited for' but this one's is 'dispatched'");
    check_misuse(c, split_misuse::combine_wait_without_start, all, errc::configuration,
                 "combine_wait needs a handle whose phase is 'combine started, not waited for'");
    check_misuse(c, split_misuse::inputs_before_wait, all, errc::configuration,
                 "forward_handle::inputs() is only available between dispatch_wait and combine_start");
    check_misuse(c, split_misuse::inputs_before_wait, all, errc::configuration,
                 "; this handle's phase is 'dispatch started, not waited for': call dispatch_wait on it first");
    check_misuse(c, split_misuse::backward_wait_without_start, all, errc::configuration,
                 "backward_dispatch_wait got an empty handle");
    // Collective starts: one rank's mistake raises on every rank of the EP group.
    check_misuse(c, split_misuse::combine_before_dispatch_wait, last, errc::configuration, "rank 3: combine_start needs");
    check_misuse(c, split_misuse::combine_before_dispatch_wait, last, errc::configuration,
                 "but this one's is 'dispatch started, not waited for': call dispatch_wait on it first");
    check_misuse(c, split_misuse::dispatch_wait_twice, all, errc::configuration,
                 "'dispatched': each phase of a handle runs once");
    check_misuse(c, split_misuse::combine_wait_without_start, all, errc::configuration,
                 "but this one's is 'dispatched': call combine_start on it first");
    check_misuse(c, split_misuse::combine_twice, last, errc::configuration, "'already combined'");
    // The same message from every rank: one entry naming them all.
    check_misuse(c, split_misuse::combine_twice, all, errc::configuration, "; rank 0,1,2,3: combine_start needs");
    check_misuse(c, split_misuse::combine_other_layer, last, errc::configuration,
                 "rank 3: combine_start got a handle made by another layer");
    check_misuse(c, split_misuse::combine_moved_from, last, errc::configuration, "rank 3: combine_start got an empty handle");
    check_misuse(c, split_misuse::combine_other_layer_type, last, errc::configuration,
                 "rank 3: combine_start got a handle made by another layer");
    check_misuse(c, split_misuse::combine_in_other_order, last, errc::configuration,
                 "combine different calls (rank 0: its call 1, rank 1: its call 1, rank 2: its call 1, rank 3: its call 2");
    check_misuse(c, split_misuse::backward_empty_state, last, errc::input,
                 "rank 3: backward needs the saved state of a training forward");
    check_misuse(c, split_misuse::expert_outputs_size, last, errc::input, "rank 3: combine_start: the expert outputs have");
    check_misuse(c, split_misuse::out_size, last, errc::input, "rank 3: combine_start: out has");
    check_misuse(c, split_misuse::backward_combine_twice, last, errc::configuration,
                 "rank 3: backward_combine_start needs a handle whose phase is 'dispatched' but this one's is 'already combined': "
                 "each phase of a handle runs once");
    check_misuse(c, split_misuse::backward_grad_inputs_size, last, errc::input,
                 "rank 3: backward_combine_start: the experts' input gradients have");
    check_misuse(c, split_misuse::grad_x_size, last, errc::input, "rank 3: backward_combine_start: grad_x has");
    check_misuse(c, split_misuse::grad_x_larger, last, errc::input, "rank 3: backward_combine_start: grad_x has");
  }
}

TEST_CASE("split phase: a handle's accessors outside their phase, and the FP8 rows of a layer that dispatches T") {
  // Local calls: errc::configuration on the rank that makes them, naming the accessor and
  // the handle's phase; the call then goes on to the fused result's end.
  const auto c = make(1, 2, 2, 4, 2);
  on_ranks(2, [&](comm_t& comm) {
    using T = float;
    using exec_t = epx::test::test_exec;
    const epx::mesh m(c.topology);
    const exec_t policy{};
    epx::test::micro_batch<T> mb(c, m.batch(comm.rank()));
    epx::moe_layer<comm_t, T, epx::impl::all_to_all, exec_t> layer(m, comm, epx::test::options_for(c), policy);
    const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0x51ull);
    epx::ref::test_linear_experts<T> experts(global, m.ep_rank(comm.rank()), m.local_experts());
    std::string f;
    const auto refused = [&f](auto call, const std::string& words) {
      const auto r = epx::test::capture(call);
      if (!r.thrown)
        f += "no error for '" + words + "'; ";
      else if (r.category != epx::errc::configuration || r.message.find(words) == std::string::npos)
        f += "'" + r.message + "' (wanted errc::configuration, '" + words + "'); ";
    };
    const std::string fwd_phase = " is only available between dispatch_wait and combine_start; this handle's phase is '";
    const std::string bwd_phase =
        " is only available between backward_dispatch_wait and backward_combine_start; this handle's phase is '";
    auto h = layer.dispatch_start(epx::span<const T>(mb.x), epx::span<const std::int32_t>(mb.d.ids),
                                  epx::span<const float>(mb.w), epx::mode::train);
    refused([&] { (void)h.outputs(); }, "forward_handle::outputs()" + fwd_phase + "dispatch started, not waited for': call dispatch_wait on it first");
    layer.dispatch_wait(h);
    if (h.fp8()) f += "fp8() is true without fp8_dispatch; ";
    refused([&] { (void)h.fp8_inputs(); },
            "forward_handle::fp8_inputs(): the layer dispatches rows in T (layer_options::fp8_dispatch is off)");
    refused([&] { (void)h.scales(); },
            "forward_handle::scales(): the layer dispatches rows in T (layer_options::fp8_dispatch is off)");
    experts.forward(policy, h.inputs(), h.outputs().data());
    layer.combine_start(h, epx::span<const T>(h.outputs().data(), h.outputs().size()), epx::span<T>(mb.out));
    refused([&] { (void)h.inputs(); }, "forward_handle::inputs()" + fwd_phase + "combine started, not waited for'");
    auto saved = layer.combine_wait(h);
    refused([&] { (void)h.scales(); }, "forward_handle::scales()" + fwd_phase + "already combined'");
    epx::backward_handle<T> none;
    refused([&] { (void)none.inputs(); }, "backward_handle::inputs()" + bwd_phase + "empty (default-constructed or moved from)'");
    auto g = layer.backward_dispatch_start(std::move(saved), epx::span<const T>(mb.go), epx::span<float>(mb.gw));
    refused([&] { (void)g.grad_outputs(); }, "backward_handle::grad_outputs()" + bwd_phase + "dispatch started, not waited for': call backward_dispatch_wait on it first");
    layer.backward_dispatch_wait(g);
    experts.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
    layer.backward_combine_start(g, epx::span<const T>(g.grad_inputs().data(), g.grad_inputs().size()),
                                 epx::span<T>(mb.gx));
    refused([&] { (void)g.grad_inputs(); }, "backward_handle::grad_inputs()" + bwd_phase + "combine started, not waited for'");
    layer.backward_combine_wait(g);
    refused([&] { (void)g.inputs(); }, "backward_handle::inputs()" + bwd_phase + "already combined'");
    return f;
  });
}

TEST_CASE("split phase: bad input in dispatch_start raises on every rank of the EP group") {
  auto c = make(1, 4, 4, 8, 2);
  std::vector<epx::test::raised> r(4);
  epx::threads::run(4, [&](comm_t& comm) {
    const epx::mesh m(c.topology);
    epx::test::micro_batch<float> mb(c, m.batch(comm.rank()));
    if (comm.rank() == 2) mb.d.ids[1] = 99;
    epx::moe_layer<comm_t, float> layer(m, comm, epx::test::options_for(c));
    r[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
      auto h = layer.dispatch_start(epx::span<const float>(mb.x), epx::span<const std::int32_t>(mb.d.ids),
                                    epx::span<const float>(mb.w), epx::mode::train);
    });
  });
  for (const auto& x : r) {
    CAPTURE(x.message);
    REQUIRE(x.thrown);
    CHECK(x.category == epx::errc::input);
    CHECK(x.message.find("rank 2") != std::string::npos);
  }
}

TEST_CASE("split phase: dispatch_start raises on routing weights of another size than N*k, on every rank") {
  const auto c = make(1, 2, 2, 4, 2);
  std::vector<epx::test::raised> r(2);
  epx::threads::run(2, [&](comm_t& comm) {
    const epx::mesh m(c.topology);
    epx::test::micro_batch<float> mb(c, m.batch(comm.rank()));
    REQUIRE(mb.w.size() == mb.d.ids.size());
    REQUIRE(mb.w.size() >= 2);
    epx::moe_layer<comm_t, float> layer(m, comm, epx::test::options_for(c));
    // Rank 1's weights hold one value fewer than its ids.
    const std::size_t nw = mb.w.size() - (comm.rank() == 1 ? 1 : 0);
    r[static_cast<std::size_t>(comm.rank())] = epx::test::capture([&] {
      (void)layer.dispatch_start(epx::span<const float>(mb.x), epx::span<const std::int32_t>(mb.d.ids),
                                 epx::span<const float>(mb.w.data(), nw), epx::mode::train);
    });
  });
  for (const auto& x : r) {
    CAPTURE(x.message);
    REQUIRE(x.thrown);
    CHECK(x.category == epx::errc::input);
    CHECK(x.message.find("rank 1: ") != std::string::npos);
    CHECK(x.message.find("routing weights have") != std::string::npos);
  }
}

namespace {

using epx::test::throwing_experts;  // support/throwing_experts.hpp

// Training steps through the split calls, as steps_after_a_throw of test_layer_errors.cpp
// for the fused ones: a clean step, then one whose experts (run by the caller between a
// wait and the next start) throw on rank `thrower` (-1: every rank), every rank catching
// what it raises. A thrower alone leaves its peers in their combine_start, where its next
// step's dispatch_start meets them (errc::communicator on every rank). Then the next steps
// must give the clean step's results bit for bit.
template <class Impl = epx::impl::all_to_all>
std::string split_steps_after_a_throw(comm_t& comm, const layer_case& c, int thrower, bool in_backward) {
  const epx::mesh m(c.topology);
  const int rank = comm.rank();
  std::string f;
  const epx::test::rank_inputs<float> in(c, rank);
  throwing_experts experts(in.global, m.ep_rank(rank), m.local_experts());
  epx::moe_layer<comm_t, float, Impl, epx::test::test_exec> layer(m, comm, epx::test::options_for(c));
  const epx::test::test_exec exec{};
  const std::vector<float> go(in.d.grad_out.begin(), in.d.grad_out.end());
  std::vector<float> out, gx, gw;
  const auto step = [&]() -> std::string {
    out.assign(in.N * in.H, 7.0f);
    gx.assign(in.N * in.H, 7.0f);
    gw.assign(in.w.size(), 7.0f);
    try {
      auto h = layer.dispatch(epx::span<const float>(in.x), epx::span<const std::int32_t>(in.d.ids),
                              epx::span<const float>(in.w), epx::mode::train);
      experts.forward(exec, h.inputs(), h.outputs().data());
      auto saved = layer.combine(h, h.outputs(), epx::span<float>(out));
      auto g = layer.backward_dispatch(std::move(saved), epx::span<const float>(go), epx::span<float>(gw));
      experts.backward(exec, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
      layer.backward_combine(g, g.grad_inputs(), epx::span<float>(gx));
      return {};
    } catch (const std::exception& e) {
      return e.what();
    }
  };
  std::string e = step();
  if (!e.empty()) return "the clean step raised: " + e;
  const auto out0 = out, gx0 = gx, gw0 = gw;
  const bool throws = thrower < 0 || thrower == rank;
  (in_backward ? experts.fail_backward : experts.fail_forward) = throws;
  e = step();
  if (e.find(throws ? "injected" : "epx communicator error") == std::string::npos)
    f += "the failing step raised '" + e + "'; ";
  if (thrower == rank) {
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
  return f;
}

}  // namespace

TEST_CASE("split phase: experts that throw, on one rank or on all, caught there: every rank raises, then the calls give the clean results again") {
  // 0: the direct route, 1: the staged one, 2: per-rank sends, 3: the masked all-reduce path.
  for (int route = 0; route < 4; ++route)
    for (int thrower : {-1, 0, 2})
      for (bool in_backward : {false, true}) {
        auto c = route == 3 ? make(4, 1, 4, 8, 2) : make(1, 4, 4, 8, 2);
        c.peer_access = route == 0;
        if (route == 2) c.sends = epx::row_sends::per_rank;
        CAPTURE(route);
        CAPTURE(thrower);
        CAPTURE(in_backward);
        on_ranks(4, [&](comm_t& comm) {
          return route == 3 ? split_steps_after_a_throw<epx::impl::all_reduce>(comm, c, thrower, in_backward)
                            : split_steps_after_a_throw(comm, c, thrower, in_backward);
        });
      }
}

namespace {

// One layer's micro-batch on this rank: inputs, experts and results.
struct stage_batch {
  epx::test::rank_inputs<float> in;
  epx::ref::test_linear_experts<float> experts;
  std::vector<float> go, out, gx, gw;
  stage_batch(const layer_case& c, const epx::mesh& m, int rank)
      : in(c, rank),
        experts(in.global, m.ep_rank(rank), m.local_experts()),
        go(in.d.grad_out.begin(), in.d.grad_out.end()),
        out(in.N * in.H, 7.0f),
        gx(in.N * in.H, 7.0f),
        gw(in.w.size(), 7.0f) {}
  epx::span<const float> x() const { return epx::span<const float>(in.x); }
  epx::span<const std::int32_t> ids() const { return epx::span<const std::int32_t>(in.d.ids); }
  epx::span<const float> w() const { return epx::span<const float>(in.w); }
  // A fused training step on layer l: forward, then the backward of its saved state.
  template <class Layer>
  void train(Layer& l) {
    auto s = l.forward(x(), ids(), w(), epx::span<float>(out), experts, epx::mode::train);
    l.backward(std::move(s), epx::span<const float>(go), epx::span<float>(gx), epx::span<float>(gw), experts);
  }
};

// Whether a and b hold bitwise the same outputs and gradients (with `expert_grads`, the
// experts' gradients too).
bool same_results(const stage_batch& a, const stage_batch& b, bool expert_grads) {
  return a.out == b.out && a.gx == b.gx && a.gw == b.gw && (!expert_grads || a.experts.grads() == b.experts.grads());
}

using all_to_all_layer = epx::moe_layer<comm_t, float, epx::impl::all_to_all, epx::test::test_exec>;

// Two micro-batches of case c on this rank (c and epx::test::second_micro_batch(c)): `want`
// what a layer gives each alone, through its fused calls one after the other; `have` for
// the calls under test.
struct micro_batches {
  const epx::mesh m;
  const int rank;
  const layer_case c1;
  stage_batch want[2], have[2];
  micro_batches(comm_t& comm, const layer_case& c)
      : m(c.topology),
        rank(comm.rank()),
        c1(epx::test::second_micro_batch(c)),
        want{stage_batch(c, m, rank), stage_batch(c1, m, rank)},
        have{stage_batch(c, m, rank), stage_batch(c1, m, rank)} {
    all_to_all_layer l(m, comm, epx::test::options_for(c));
    for (auto& sb : want) sb.train(l);
  }
  // "micro-batch i differs from <than>; " for each micro-batch whose `have` is not `want`
  // (same_results, with `expert_grads` as given).
  std::string differences(bool expert_grads, const std::string& than) const {
    std::string f;
    for (int i = 0; i < 2; ++i)
      if (!same_results(have[i], want[i], expert_grads))
        f += "micro-batch " + std::to_string(i) + " differs from " + than + "; ";
    return f;
  }
};

// check(comm, c) on 4 ranks, with c's peers read directly and through the staged route.
template <class Check>
void on_both_routes(layer_case c, Check check) {
  for (bool direct : {true, false}) {
    CAPTURE(direct);
    c.peer_access = direct;
    on_ranks(4, [&](comm_t& comm) { return check(comm, c); });
  }
}

// Two layers of one model on the same world communicator (each with its own groups),
// called as a pipeline schedule calls them: forward of A, forward of B, backward of B,
// backward of A, in fused calls and in split calls whose phases interleave across the
// layers. Each must give bitwise what each layer gives alone, one after the other, and
// the expert gradients must be the same.
std::string two_layers_interleaved(comm_t& comm, const layer_case& ca, const layer_case& cb) {
  const epx::test::test_exec exec{};
  const epx::mesh ma(ca.topology), mb(cb.topology);
  const int rank = comm.rank();
  std::string f;
  const auto same = [&](const stage_batch& have, const stage_batch& want, const char* what) {
    if (!same_results(have, want, true)) f += std::string(what) + ": the results differ from the layer's alone; ";
  };
  // Alone, one after the other.
  stage_batch a0(ca, ma, rank), b0(cb, mb, rank);
  for (auto* sb : {&a0, &b0}) {
    const bool is_a = sb == &a0;
    all_to_all_layer l(is_a ? ma : mb, comm, epx::test::options_for(is_a ? ca : cb));
    sb->train(l);
  }
  all_to_all_layer la(ma, comm, epx::test::options_for(ca)), lb(mb, comm, epx::test::options_for(cb));
  {  // Fused: forward A, forward B, backward B, backward A.
    stage_batch a(ca, ma, rank), b(cb, mb, rank);
    auto sa = la.forward(a.x(), a.ids(), a.w(), epx::span<float>(a.out), a.experts, epx::mode::train);
    auto sb = lb.forward(b.x(), b.ids(), b.w(), epx::span<float>(b.out), b.experts, epx::mode::train);
    lb.backward(std::move(sb), epx::span<const float>(b.go), epx::span<float>(b.gx), epx::span<float>(b.gw), b.experts);
    la.backward(std::move(sa), epx::span<const float>(a.go), epx::span<float>(a.gx), epx::span<float>(a.gw), a.experts);
    same(a, a0, "fused, layer A");
    same(b, b0, "fused, layer B");
  }
  {  // Split, the phases of the two layers interleaved.
    stage_batch a(ca, ma, rank), b(cb, mb, rank);
    auto ha = la.dispatch_start(a.x(), a.ids(), a.w(), epx::mode::train);
    auto hb = lb.dispatch_start(b.x(), b.ids(), b.w(), epx::mode::train);
    lb.dispatch_wait(hb);
    la.dispatch_wait(ha);
    b.experts.forward(exec, hb.inputs(), hb.outputs().data());
    a.experts.forward(exec, ha.inputs(), ha.outputs().data());
    lb.combine_start(hb, hb.outputs(), epx::span<float>(b.out));
    la.combine_start(ha, ha.outputs(), epx::span<float>(a.out));
    auto sa = la.combine_wait(ha);
    auto sb = lb.combine_wait(hb);
    auto gb = lb.backward_dispatch_start(std::move(sb), epx::span<const float>(b.go), epx::span<float>(b.gw));
    auto ga = la.backward_dispatch_start(std::move(sa), epx::span<const float>(a.go), epx::span<float>(a.gw));
    la.backward_dispatch_wait(ga);
    lb.backward_dispatch_wait(gb);
    a.experts.backward(exec, ga.inputs(), ga.grad_outputs().data(), ga.grad_inputs().data());
    b.experts.backward(exec, gb.inputs(), gb.grad_outputs().data(), gb.grad_inputs().data());
    la.backward_combine_start(ga, ga.grad_inputs(), epx::span<float>(a.gx));
    lb.backward_combine_start(gb, gb.grad_inputs(), epx::span<float>(b.gx));
    lb.backward_combine_wait(gb);
    la.backward_combine_wait(ga);
    same(a, a0, "split, layer A");
    same(b, b0, "split, layer B");
  }
  {  // Each layer on a thread of its own, at the same time: their communicators differ
     // (docs/guarantees.md: a rank's different communicators may be used by different
     // threads at once).
    stage_batch a(ca, ma, rank), b(cb, mb, rank);
    const auto train = [](all_to_all_layer& l, stage_batch& sb) {
      try {
        sb.train(l);
        return std::string();
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
    };
    std::string ea;
    std::thread t([&] { ea = train(la, a); });
    const std::string eb = train(lb, b);
    t.join();
    if (!ea.empty() || !eb.empty()) f += "concurrent: raised '" + ea + "' / '" + eb + "'; ";
    same(a, a0, "concurrent, layer A");
    same(b, b0, "concurrent, layer B");
  }
  return f;
}

}  // namespace

TEST_CASE("two layers on one communicator, pipelined (forward A, forward B, backward B, backward A): bitwise each alone") {
  for (bool direct : {true, false}) {
    CAPTURE(direct);
    auto ca = make(1, 4, 4, 8, 2);
    auto cb = make(2, 2, 2, 4, 1, routing_kind::uneven);  // another mesh of the same world, other E and k
    ca.peer_access = cb.peer_access = direct;
    on_ranks(4, [&](comm_t& comm) { return two_layers_interleaved(comm, ca, cb); });
  }
}

namespace {

// Two micro-batches of one layer, each rank running micro-batch 0's experts on a worker
// thread while its own thread starts micro-batch 1's phase (docs/layer.md section 9, what
// overlaps: a handle's buffers are its own, nothing of the layer is touched by the
// experts' thread), forward and backward. Bitwise the fused calls of each micro-batch;
// under ThreadSanitizer (the tsan preset) no race.
std::string experts_on_a_worker_thread(comm_t& comm, const layer_case& c) {
  const epx::test::test_exec exec{};
  micro_batches mb(comm, c);
  auto& have = mb.have;
  all_to_all_layer l(mb.m, comm, epx::test::options_for(c));
  epx::forward_handle<float> h[2];
  h[0] = l.dispatch(have[0].x(), have[0].ids(), have[0].w(), epx::mode::train);
  std::thread worker([&] { have[0].experts.forward(exec, h[0].inputs(), h[0].outputs().data()); });
  h[1] = l.dispatch(have[1].x(), have[1].ids(), have[1].w(), epx::mode::train);
  worker.join();
  l.combine_start(h[0], h[0].outputs(), epx::span<float>(have[0].out));
  worker = std::thread([&] { have[1].experts.forward(exec, h[1].inputs(), h[1].outputs().data()); });
  epx::saved_state<float> saved[2];
  saved[0] = l.combine_wait(h[0]);
  worker.join();
  saved[1] = l.combine(h[1], h[1].outputs(), epx::span<float>(have[1].out));
  epx::backward_handle<float> g[2];
  g[0] = l.backward_dispatch(std::move(saved[0]), epx::span<const float>(have[0].go), epx::span<float>(have[0].gw));
  worker = std::thread([&] {
    have[0].experts.backward(exec, g[0].inputs(), g[0].grad_outputs().data(), g[0].grad_inputs().data());
  });
  g[1] = l.backward_dispatch(std::move(saved[1]), epx::span<const float>(have[1].go), epx::span<float>(have[1].gw));
  worker.join();
  l.backward_combine_start(g[0], g[0].grad_inputs(), epx::span<float>(have[0].gx));
  worker = std::thread([&] {
    have[1].experts.backward(exec, g[1].inputs(), g[1].grad_outputs().data(), g[1].grad_inputs().data());
  });
  l.backward_combine_wait(g[0]);
  worker.join();
  l.backward_combine(g[1], g[1].grad_inputs(), epx::span<float>(have[1].gx));
  return mb.differences(true, "the fused calls");
}

}  // namespace

TEST_CASE("split phase: one micro-batch's experts on a worker thread while the next one's phase starts: bitwise the fused calls") {
  on_both_routes(make(2, 2, 4, 8, 2), experts_on_a_worker_thread);
}

namespace {

// One layer: micro-batch 0 through the split calls, and micro-batch 1's fused forward and
// backward made while micro-batch 0's handles are in flight (between its dispatch and its
// combine, and between its backward dispatch and backward combine). Each must be bitwise
// what the layer gives it alone. Then handles in flight outlive their layer (split.hpp: a
// handle may outlive its layer): their rows stay readable until the handles go.
std::string fused_calls_between_split_phases(comm_t& comm, const layer_case& c) {
  const epx::test::test_exec exec{};
  micro_batches mb(comm, c);
  auto& have = mb.have;
  std::string f;
  epx::forward_handle<float> late_forward;
  epx::backward_handle<float> late_backward;
  std::vector<float> late_rows;
  {
    all_to_all_layer l(mb.m, comm, epx::test::options_for(c));
    stage_batch& a = have[0];
    auto h = l.dispatch(a.x(), a.ids(), a.w(), epx::mode::train);
    have[1].train(l);  // between micro-batch 0's dispatch and its combine
    a.experts.forward(exec, h.inputs(), h.outputs().data());
    auto saved = l.combine(h, h.outputs(), epx::span<float>(a.out));
    auto g = l.backward_dispatch(std::move(saved), epx::span<const float>(a.go), epx::span<float>(a.gw));
    stage_batch again(mb.c1, mb.m, mb.rank);
    again.train(l);  // between its backward dispatch and backward combine
    a.experts.backward(exec, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
    l.backward_combine(g, g.grad_inputs(), epx::span<float>(a.gx));
    if (!same_results(again, mb.want[1], false))
      f += "the second fused call of micro-batch 1 differs from the layer's alone; ";
    // Handles left in flight when the layer goes.
    stage_batch late(c, mb.m, mb.rank);
    late_forward = l.dispatch(late.x(), late.ids(), late.w(), epx::mode::train);
    late_rows.assign(late_forward.inputs().num_rows * late_forward.inputs().hidden, 0.0f);
    auto s2 = l.forward(late.x(), late.ids(), late.w(), epx::span<float>(late.out), late.experts, epx::mode::train);
    late_backward = l.backward_dispatch(std::move(s2), epx::span<const float>(late.go), epx::span<float>(late.gw));
  }
  // The layer is gone: its handles' rows are still theirs.
  const auto& rows = late_forward.inputs();
  std::copy(rows.rows, rows.rows + late_rows.size(), late_rows.begin());
  const auto go = late_backward.grad_outputs();
  double sum = 0;
  for (std::size_t i = 0; i < go.size(); ++i) sum += go[i];
  (void)sum;
  late_forward = epx::forward_handle<float>();
  late_backward = epx::backward_handle<float>();
  return f + mb.differences(false, "the layer's alone");
}

}  // namespace

TEST_CASE("split phase: fused calls between a handle's phases, and handles that outlive their layer") {
  on_both_routes(make(2, 2, 4, 8, 2), fused_calls_between_split_phases);
}

namespace {

// A saved state is the layer's whatever call made it: the split calls' state taken back by
// the fused backward, and the fused forward's by the split backward, bitwise the fused
// calls throughout.
template <class Impl>
std::string split_and_fused_states_mix(comm_t& comm, const layer_case& c) {
  using layer_t = epx::moe_layer<comm_t, float, Impl, epx::test::test_exec>;
  const epx::test::test_exec exec{};
  const epx::mesh m(c.topology);
  const int rank = comm.rank();
  std::string f;
  stage_batch want(c, m, rank), split_fwd(c, m, rank), split_bwd(c, m, rank);
  layer_t l(m, comm, epx::test::options_for(c));
  want.train(l);
  try {
    stage_batch& a = split_fwd;  // split forward, fused backward
    auto h = l.dispatch(a.x(), a.ids(), a.w(), epx::mode::train);
    a.experts.forward(exec, h.inputs(), h.outputs().data());
    auto s = l.combine(h, h.outputs(), epx::span<float>(a.out));
    l.backward(std::move(s), epx::span<const float>(a.go), epx::span<float>(a.gx), epx::span<float>(a.gw), a.experts);
  } catch (const std::exception& e) {
    f += std::string("split forward, fused backward raised: ") + e.what() + "; ";
  }
  try {
    stage_batch& b = split_bwd;  // fused forward, split backward
    auto s = l.forward(b.x(), b.ids(), b.w(), epx::span<float>(b.out), b.experts, epx::mode::train);
    auto g = l.backward_dispatch(std::move(s), epx::span<const float>(b.go), epx::span<float>(b.gw));
    b.experts.backward(exec, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
    l.backward_combine(g, g.grad_inputs(), epx::span<float>(b.gx));
  } catch (const std::exception& e) {
    f += std::string("fused forward, split backward raised: ") + e.what() + "; ";
  }
  for (const stage_batch* sb : {&split_fwd, &split_bwd})
    if (!same_results(*sb, want, true))
      f += std::string(sb == &split_fwd ? "split forward, fused backward" : "fused forward, split backward") +
           " differs from the fused calls; ";
  return f;
}

}  // namespace

TEST_CASE("split phase: a split forward's saved state taken back by the fused backward, and the other way round") {
  auto c = make(1, 4, 4, 8, 2, routing_kind::uneven);
  on_both_routes(c, split_and_fused_states_mix<epx::impl::all_to_all>);
  c.sends = epx::row_sends::per_rank;
  on_both_routes(c, split_and_fused_states_mix<epx::impl::all_to_all>);
  const auto masked = make(2, 1, 2, 4, 2);
  on_ranks(2, [&](comm_t& comm) { return split_and_fused_states_mix<epx::impl::all_reduce>(comm, masked); });
  on_ranks(2, [&](comm_t& comm) { return split_and_fused_states_mix<epx::impl::automatic>(comm, masked); });
}

}  // namespace test_split_cpp
