// Load statistics after a layer call: tokens per local expert, rows sent/received per peer,
// max/mean load over the EP group, checked against counts taken from the routing itself.
#include <doctest/doctest.h>

#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_layer_stats_cpp {

namespace {

using comm_t = epx::threads::communicator;
using epx::test::layer_case;

// Per rank: the stats of one forward, plus the failures of the reference comparison.
struct rank_view {
  epx::layer_stats stats;
  std::string failures;
};

std::vector<rank_view> run_stats(const layer_case& c) {
  const epx::mesh m(c.topology);
  std::vector<rank_view> v(static_cast<std::size_t>(m.world()));
  epx::threads::run(m.world(), [&](comm_t& comm) {
    auto& me = v[static_cast<std::size_t>(comm.rank())];
    try {
      const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, 5);
      me.stats = epx::test::run_layer<comm_t, float, epx::impl::all_to_all>(comm, c, global).stats;
    } catch (const std::exception& e) {
      me.failures = e.what();
    }
  });
  return v;
}

}  // namespace

TEST_CASE("stats: per-peer rows, per-expert tokens and group load match the routing") {
  layer_case c;
  c.topology = epx::mesh_config{2, 4, 1, 1, 4, 16, 0};  // tp=2 fsdp=4 ep=4 E=16, L=4
  c.top_k = 2;
  c.hidden = 4;
  c.routing = epx::test::routing_kind::uneven;
  c.rows = [](int b) { return std::size_t{10} + static_cast<std::size_t>(b) * 3; };
  c.pad = {1, 4};
  const epx::mesh m(c.topology);
  const auto v = run_stats(c);
  const int E = m.experts(), L = m.local_experts(), ep = m.ep();
  for (int r = 0; r < m.world(); ++r) {
    CAPTURE(r);
    const auto& s = v[static_cast<std::size_t>(r)].stats;
    REQUIRE(v[static_cast<std::size_t>(r)].failures.empty());
    CHECK(std::string(s.path) == "all_to_all");
    CHECK(s.calls == 1);
    REQUIRE(s.rows_sent.size() == static_cast<std::size_t>(ep));
    REQUIRE(s.rows_received.size() == static_cast<std::size_t>(ep));
    REQUIRE(s.tokens_per_local_expert.size() == static_cast<std::size_t>(L));
    REQUIRE(s.tokens_per_expert.size() == static_cast<std::size_t>(E));
    // Expected from the routing of this rank's slice and its EP group's batches.
    const auto members = m.group_members(epx::group_kind::ep, r);
    std::vector<std::int64_t> per_expert(static_cast<std::size_t>(E), 0);
    std::vector<std::int64_t> sent(static_cast<std::size_t>(ep), 0), recv(static_cast<std::size_t>(ep), 0);
    for (int src = 0; src < ep; ++src) {
      const int g = members[static_cast<std::size_t>(src)];
      const auto d = epx::test::make_batch<float>(c, m.batch(g));
      const auto sl = epx::slice_bounds(c.rows_of(m.batch(g)), m.tp(), m.coords(g).tp);
      for (std::size_t i = sl.begin * 2; i < sl.end * 2; ++i) {
        const int e = d.ids[i];
        ++per_expert[static_cast<std::size_t>(e)];
        if (g == r) ++sent[static_cast<std::size_t>(e / L)];
        if (e / L == m.ep_rank(r)) ++recv[static_cast<std::size_t>(src)];
      }
    }
    CHECK(s.tokens_per_expert == per_expert);
    CHECK(s.rows_sent == sent);
    CHECK(s.rows_received == recv);
    std::int64_t total = 0, mx = 0, rmx = 0;
    for (auto x : per_expert) {
      total += x;
      mx = std::max(mx, x);
    }
    for (int q = 0; q < ep; ++q) {
      std::int64_t rs = 0;
      for (int l = 0; l < L; ++l) rs += per_expert[static_cast<std::size_t>(q * L + l)];
      rmx = std::max(rmx, rs);
    }
    CHECK(s.max_expert_load == doctest::Approx(static_cast<double>(mx)));
    CHECK(s.mean_expert_load == doctest::Approx(static_cast<double>(total) / E));
    CHECK(s.max_rank_load == doctest::Approx(static_cast<double>(rmx)));
    CHECK(s.mean_rank_load == doctest::Approx(static_cast<double>(total) / ep));
    CHECK(s.imbalance() >= 1.0);
    for (int l = 0; l < L; ++l) {
      const auto got = s.tokens_per_local_expert[static_cast<std::size_t>(l)];
      CHECK(got == per_expert[static_cast<std::size_t>(m.ep_rank(r) * L + l)]);
      const auto pad = s.padding_per_local_expert[static_cast<std::size_t>(l)];
      CHECK(pad >= 1);
      CHECK((got + pad) % 4 == 0);
    }
  }
}

TEST_CASE("stats: with capacity, per-rank sends and the staged route, every figure agrees with the routing and the peers") {
  // Each rank's rows_received from a peer are the rows that peer reports sent to it; the
  // load figures count routed pairs (kept and dropped), tokens_per_local_expert the kept.
  std::vector<layer_case> cases;
  for (int v = 0; v < 6; ++v) {
    layer_case c;
    c.topology = v % 2 ? epx::mesh_config{2, 4, 1, 1, 4, 8, 0} : epx::mesh_config{1, 4, 1, 2, 4, 12, 0};
    c.top_k = 2 + v % 2;
    c.hidden = 4;
    c.seed = 11 + static_cast<std::uint64_t>(v);
    c.routing = v < 3 ? epx::test::routing_kind::uneven : epx::test::routing_kind::random;
    c.rows = [v](int b) { return static_cast<std::size_t>((b + v) % 3 == 0 ? 0 : 5 + 2 * b); };
    c.pad = {v % 2, 1 + v % 3};
    c.capacity.mode = v == 3 ? epx::capacity_mode::off
                     : v % 3 == 2 ? epx::capacity_mode::global
                                  : epx::capacity_mode::local;
    c.capacity.rows = 2;
    c.capacity.priority = v % 2 ? epx::drop_priority::score : epx::drop_priority::position;
    c.sends = v % 3 == 1 ? epx::row_sends::per_rank : epx::row_sends::per_slot;
    c.peer_access = v % 2 == 0;
    c.ranks_per_node = 2;
    cases.push_back(c);
  }
  for (const auto& c : cases) {
    CAPTURE(c.describe());
    const epx::mesh m(c.topology);
    const auto v = run_stats(c);
    const int E = m.experts(), L = m.local_experts(), ep = m.ep(), k = c.top_k;
    for (int r = 0; r < m.world(); ++r) {
      CAPTURE(r);
      const auto& s = v[static_cast<std::size_t>(r)].stats;
      REQUIRE(v[static_cast<std::size_t>(r)].failures.empty());
      REQUIRE(s.rows_received.size() == static_cast<std::size_t>(ep));
      const auto members = m.group_members(epx::group_kind::ep, r);
      std::vector<std::int64_t> routed(static_cast<std::size_t>(E), 0);
      for (int g : members) {
        const auto d = epx::test::make_batch<float>(c, m.batch(g));
        const auto sl = epx::slice_bounds(c.rows_of(m.batch(g)), m.tp(), m.coords(g).tp);
        for (std::size_t i = sl.begin * k; i < sl.end * k; ++i) ++routed[static_cast<std::size_t>(d.ids[i])];
      }
      CHECK(s.tokens_per_expert == routed);
      std::int64_t dropped = 0, total = 0, mx = 0, rmx = 0, received = 0, kept = 0;
      if (c.capacity.enabled()) REQUIRE(s.dropped_per_expert.size() == static_cast<std::size_t>(E));
      else CHECK(s.dropped_per_expert.empty());
      for (auto x : s.dropped_per_expert) dropped += x;
      CHECK(s.dropped_pairs == dropped);
      for (auto x : routed) {
        total += x;
        mx = std::max(mx, x);
      }
      for (int q = 0; q < ep; ++q) {
        std::int64_t rs = 0;
        for (int l = 0; l < L; ++l) rs += routed[static_cast<std::size_t>(q * L + l)];
        rmx = std::max(rmx, rs);
      }
      CHECK(s.max_expert_load == doctest::Approx(static_cast<double>(mx)));
      CHECK(s.mean_expert_load == doctest::Approx(static_cast<double>(total) / E));
      CHECK(s.max_rank_load == doctest::Approx(static_cast<double>(rmx)));
      CHECK(s.mean_rank_load == doctest::Approx(static_cast<double>(total) / ep));
      for (int l = 0; l < L; ++l) {
        const auto e = static_cast<std::size_t>(m.ep_rank(r) * L + l);
        const auto got = s.tokens_per_local_expert[static_cast<std::size_t>(l)];
        CHECK(got == routed[e] - (s.dropped_per_expert.empty() ? 0 : s.dropped_per_expert[e]));
        CHECK(s.padding_per_local_expert[static_cast<std::size_t>(l)] ==
              static_cast<std::int64_t>(c.pad.padded_rows(static_cast<std::size_t>(got))) - got);
        kept += got;
      }
      for (int q = 0; q < ep; ++q) {
        const auto& peer = v[static_cast<std::size_t>(members[static_cast<std::size_t>(q)])].stats;
        CHECK(s.rows_received[static_cast<std::size_t>(q)] == peer.rows_sent[static_cast<std::size_t>(m.ep_rank(r))]);
        received += s.rows_received[static_cast<std::size_t>(q)];
      }
      if (c.sends == epx::row_sends::per_slot) CHECK(received == kept);
      else CHECK(received <= kept);
    }
  }
}

TEST_CASE("stats: the masked all-reduce path reports its path and no rows moved") {
  layer_case c;
  c.topology = epx::mesh_config{2, 2, 1, 1, 2, 4, 0};
  c.top_k = 2;
  c.hidden = 4;
  const epx::mesh m(c.topology);
  std::vector<epx::layer_stats> v(4);
  epx::threads::run(4, [&](comm_t& comm) {
    const auto global = epx::ref::linear_experts::random(4, 4, 5);
    v[static_cast<std::size_t>(comm.rank())] =
        epx::test::run_layer<comm_t, float, epx::impl::automatic>(comm, c, global).stats;
  });
  // Training goes through all_to_all even when ep == tp.
  for (const auto& s : v) CHECK(std::string(s.path) == "all_to_all");
  epx::threads::run(4, [&](comm_t& comm) {
    const auto global = epx::ref::linear_experts::random(4, 4, 5);
    v[static_cast<std::size_t>(comm.rank())] =
        epx::test::run_layer<comm_t, float, epx::impl::all_reduce>(comm, c, global).stats;
  });
  for (int r = 0; r < 4; ++r) {
    const auto& s = v[static_cast<std::size_t>(r)];
    CHECK(std::string(s.path) == "all_reduce");
    for (auto x : s.rows_sent) CHECK(x == 0);
    const auto d = epx::test::make_batch<float>(c, m.batch(r));
    std::int64_t mine = 0;
    for (auto e : d.ids) mine += (e / 2 == m.ep_rank(r));
    CHECK(s.tokens_per_local_expert[0] + s.tokens_per_local_expert[1] == mine);
  }
}

TEST_CASE("automatic: inference takes the masked path when ep == tp, all_to_all otherwise") {
  layer_case c;
  c.topology = epx::mesh_config{2, 2, 1, 1, 2, 4, 0};
  c.top_k = 2;
  c.hidden = 4;
  std::vector<std::string> f(4);
  epx::threads::run(4, [&](comm_t& comm) {
    f[static_cast<std::size_t>(comm.rank())] =
        epx::test::check_inference<comm_t, float, epx::impl::automatic>(comm, c, "all_reduce") +
        epx::test::check_inference<comm_t, float, epx::impl::all_to_all>(comm, c, "all_to_all");
  });
  layer_case d = c;
  d.topology = epx::mesh_config{1, 4, 1, 1, 2, 4, 0};
  std::vector<std::string> g(4);
  epx::threads::run(4, [&](comm_t& comm) {
    g[static_cast<std::size_t>(comm.rank())] =
        epx::test::check_inference<comm_t, epx::bf16, epx::impl::automatic>(comm, d, "all_to_all");
  });
  for (int r = 0; r < 4; ++r) {
    CHECK_MESSAGE(f[static_cast<std::size_t>(r)].empty(), f[static_cast<std::size_t>(r)]);
    CHECK_MESSAGE(g[static_cast<std::size_t>(r)].empty(), g[static_cast<std::size_t>(r)]);
  }
  // Training takes the all-to-all path even where ep == tp (the masked path keeps no saved
  // state for a backward): the same mesh as c, mode::train.
  std::vector<std::string> t(4);
  epx::threads::run(4, [&](comm_t& comm) {
    const epx::test::rank_inputs<float> in(c, comm.rank());
    epx::moe_layer<comm_t, float, epx::impl::automatic, epx::test::test_exec> layer(in.m, comm,
                                                                                  epx::test::options_for(c));
    epx::ref::test_linear_experts<float> experts(in.global, in.m.ep_rank(in.rank), in.m.local_experts());
    std::vector<float> out(in.N * in.H);
    (void)layer.forward(epx::span<const float>(in.x), epx::span<const std::int32_t>(in.d.ids),
                        epx::span<const float>(in.w), epx::span<float>(out), experts, epx::mode::train);
    t[static_cast<std::size_t>(comm.rank())] = layer.stats().path;
  });
  for (const auto& p : t) CHECK(p == "all_to_all");
}

namespace {

// Linear experts whose forward or backward throws while asked to: a call that fails after
// its count exchange, its rows on the way.
struct failing_experts : epx::ref::test_linear_experts<float> {
  using base = epx::ref::test_linear_experts<float>;
  using base::base;
  bool fail_forward = false, fail_backward = false;
  template <class Exec, class Rows>
  void forward(const Exec& e, const Rows& in, float* out) {
    if (fail_forward) throw std::runtime_error("injected: the experts' forward failed");
    base::forward(e, in, out);
  }
  template <class Exec, class Rows>
  void backward(const Exec& e, const Rows& in, const float* grad_out, float* grad_in) {
    if (fail_backward) throw std::runtime_error("injected: the experts' backward failed");
    base::backward(e, in, grad_out, grad_in);
  }
};

// Every field of `have` that differs from `want`, as a sentence ("" when none).
std::string stats_differences(const epx::layer_stats& have, const epx::layer_stats& want) {
  std::string d;
  const auto field = [&d](const char* name, bool same) {
    if (!same) d += std::string(name) + " ";
  };
  field("tokens_per_local_expert", have.tokens_per_local_expert == want.tokens_per_local_expert);
  field("padding_per_local_expert", have.padding_per_local_expert == want.padding_per_local_expert);
  field("rows_sent", have.rows_sent == want.rows_sent);
  field("rows_received", have.rows_received == want.rows_received);
  field("tokens_per_expert", have.tokens_per_expert == want.tokens_per_expert);
  field("max_expert_load", have.max_expert_load == want.max_expert_load);
  field("mean_expert_load", have.mean_expert_load == want.mean_expert_load);
  field("max_rank_load", have.max_rank_load == want.max_rank_load);
  field("mean_rank_load", have.mean_rank_load == want.mean_rank_load);
  field("dropped_per_expert", have.dropped_per_expert == want.dropped_per_expert);
  field("dropped_pairs", have.dropped_pairs == want.dropped_pairs);
  field("max_nodes_per_token", have.max_nodes_per_token == want.max_nodes_per_token);
  field("mean_nodes_per_token", have.mean_nodes_per_token == want.mean_nodes_per_token);
  field("path", std::string(have.path) == want.path);
  field("peer_access", have.peer_access == want.peer_access);
  field("indexed_sends", have.indexed_sends == want.indexed_sends);
  field("stage_rounds", have.stage_rounds == want.stage_rounds);
  field("bounded", have.bounded == want.bounded);
  field("calls", have.calls == want.calls);
  field("host_syncs", have.host_syncs == want.host_syncs);
  return d;
}

// Calls of one layer on every rank of `a`'s mesh: batch a, then batch b (same options, other
// routing and rows) whose experts throw on every rank; the statistics must still be a's.
// Then b again (it completes), a training forward of a, b's inference forward, and a's
// backward whose experts throw: the statistics must be those of b's forward.
template <class Impl>
std::vector<std::string> failed_calls_keep_stats(const layer_case& a, const layer_case& b) {
  const epx::mesh m(a.topology);
  std::vector<std::string> failures(static_cast<std::size_t>(m.world()));
  epx::threads::run(m.world(), [&](comm_t& comm) {
    const int rank = comm.rank();
    std::string& f = failures[static_cast<std::size_t>(rank)];
    const epx::test::rank_inputs<float> A(a, rank), B(b, rank);
    failing_experts experts(A.global, m.ep_rank(rank), m.local_experts());
    epx::moe_layer<comm_t, float, Impl> layer(m, comm, epx::test::options_for(a));
    std::vector<float> out_a(A.N * A.H), out_b(B.N * B.H), gx(A.N * A.H), gw(A.w.size());
    const std::vector<float> go(A.N * A.H, 0.5f);
    const auto forward = [&](const epx::test::rank_inputs<float>& in, std::vector<float>& out, epx::mode md) {
      return layer.forward(epx::span<const float>(in.x), epx::span<const std::int32_t>(in.d.ids),
                           epx::span<const float>(in.w), epx::span<float>(out), experts, md);
    };
    const auto expect_throw = [&](const char* what, auto call) {
      try {
        call();
        f += std::string(what) + " did not raise; ";
      } catch (const std::exception& e) {
        if (std::string(e.what()).find("injected") == std::string::npos)
          f += std::string(what) + " raised '" + e.what() + "'; ";
      }
    };
    (void)forward(A, out_a, epx::mode::inference);
    const epx::layer_stats after_a = layer.stats();
    experts.fail_forward = true;
    expect_throw("the failing forward", [&] { (void)forward(B, out_b, epx::mode::inference); });
    experts.fail_forward = false;
    std::string d = stats_differences(layer.stats(), after_a);
    if (!d.empty()) f += "after a forward whose experts threw, these differ from the last completed call's: " + d + "; ";
    (void)forward(B, out_b, epx::mode::inference);
    const epx::layer_stats after_b = layer.stats();
    if (after_b.calls != 2) f += "calls after two completed forwards is " + std::to_string(after_b.calls) + "; ";
    if (after_b.tokens_per_expert == after_a.tokens_per_expert)
      f += "batches a and b route alike: the case cannot tell their statistics apart; ";
    auto saved = forward(A, out_a, epx::mode::train);
    (void)forward(B, out_b, epx::mode::inference);
    const epx::layer_stats before_backward = layer.stats();
    experts.fail_backward = true;
    expect_throw("the failing backward", [&] {
      layer.backward(std::move(saved), epx::span<const float>(go), epx::span<float>(gx), epx::span<float>(gw), experts);
    });
    d = stats_differences(layer.stats(), before_backward);
    if (!d.empty()) f += "after a backward whose experts threw, these differ from the last completed call's: " + d + "; ";
  });
  return failures;
}

}  // namespace

TEST_CASE("stats: a call that raises midway leaves the statistics of the last call that completed") {
  layer_case a;
  a.topology = epx::mesh_config{1, 2, 1, 1, 2, 4, 0};  // tp=1 fsdp=2 ep=2 E=4, world 2
  a.top_k = 2;
  a.hidden = 4;
  a.routing = epx::test::routing_kind::uneven;
  a.rows = [](int r) { return std::size_t{12} + static_cast<std::size_t>(r); };
  layer_case b = a;
  b.routing = epx::test::routing_kind::one_expert;
  b.rows = [](int r) { return std::size_t{20} + static_cast<std::size_t>(r); };
  b.seed = 3;
  std::vector<std::string> failures;
  SUBCASE("all_to_all, staged in rounds, sends gathered") {
    // Two slice rows per round: 6 or 7 rounds for a, 10 or 11 for b.
    a.peer_access = b.peer_access = false;
    a.indexed_sends = b.indexed_sends = false;
    a.stage_bytes = b.stage_bytes = 2 * 2 * 4 * sizeof(float);
    failures = failed_calls_keep_stats<epx::impl::all_to_all>(a, b);
  }
  SUBCASE("all_to_all, the direct route") { failures = failed_calls_keep_stats<epx::impl::all_to_all>(a, b); }
  SUBCASE("the masked all_reduce path") {
    a.topology = b.topology = epx::mesh_config{2, 1, 1, 1, 2, 4, 0};  // tp=2 ep=2
    failures = failed_calls_keep_stats<epx::impl::all_reduce>(a, b);
  }
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("stats: experts that throw on one rank leave every rank the statistics of the last call that completed") {
  layer_case a;
  a.topology = epx::mesh_config{1, 2, 1, 1, 2, 4, 0};
  a.top_k = 2;
  a.hidden = 4;
  a.routing = epx::test::routing_kind::uneven;
  layer_case b = a;
  b.routing = epx::test::routing_kind::one_expert;
  b.rows = [](int) { return std::size_t{20}; };
  const epx::mesh m(a.topology);
  std::vector<std::string> failures(2);
  const auto rank_body = [&](comm_t& comm) {
    const int rank = comm.rank();
    std::string& f = failures[static_cast<std::size_t>(rank)];
    const epx::test::rank_inputs<float> A(a, rank), B(b, rank);
    failing_experts experts(A.global, m.ep_rank(rank), m.local_experts());
    epx::moe_layer<comm_t, float> layer(m, comm, epx::test::options_for(a));
    std::vector<float> out_a(A.N * A.H), out_b(B.N * B.H);
    (void)layer.forward(epx::span<const float>(A.x), epx::span<const std::int32_t>(A.d.ids),
                        epx::span<const float>(A.w), epx::span<float>(out_a), experts, epx::mode::inference);
    const epx::layer_stats after_a = layer.stats();
    experts.fail_forward = rank == 0;
    try {
      (void)layer.forward(epx::span<const float>(B.x), epx::span<const std::int32_t>(B.d.ids),
                          epx::span<const float>(B.w), epx::span<float>(out_b), experts, epx::mode::inference);
      f += "the forward did not raise; ";
    } catch (const epx::error& e) {
      if (rank == 0 || e.category() != epx::errc::communicator) f += std::string("raised '") + e.what() + "'; ";
    } catch (const std::exception&) {
      const std::string d = stats_differences(layer.stats(), after_a);
      if (!d.empty()) f += "the throwing rank's " + d + "differ; ";
      throw;
    }
    const std::string d = stats_differences(layer.stats(), after_a);
    if (!d.empty()) f += "a peer's " + d + "differ; ";
  };
  // Rank 0's exception escapes its function: the run ends the peer's collectives
  // (errc::communicator) and raises it here.
  CHECK_THROWS_WITH(epx::threads::run(2, rank_body), "injected: the experts' forward failed");
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("stats: a stage takes the whole slice rows it holds, at least one a round; a later one-round call reports 0") {
  // tp=1 fsdp=2 ep=2, k=2, H=4 float: a slice row's k rows are 32 bytes; slices of 12 and 13
  // rows. A stage below one row (1 byte included) or up to 1.5 rows takes one row a round
  // (13 rounds); 2 + 1/32 and 3 - 1/32 rows take two (7). Each gives the one-round output.
  // Then a call of one row per slice on the same layer goes in one round: stage_rounds 0.
  const epx::mesh m(epx::mesh_config{1, 2, 1, 1, 2, 4, 0});
  const std::size_t row = 2 * 4 * sizeof(float);
  std::vector<std::string> failures(2);
  epx::threads::run(2, [&](comm_t& comm) {
    std::string& f = failures[static_cast<std::size_t>(comm.rank())];
    layer_case c;
    c.topology = epx::mesh_config{1, 2, 1, 1, 2, 4, 0};
    c.top_k = 2;
    c.hidden = 4;
    c.peer_access = false;
    layer_case one = c;
    c.rows = [](int b) { return std::size_t{12} + static_cast<std::size_t>(b); };
    one.rows = [](int) { return std::size_t{1}; };
    const epx::test::rank_inputs<float> in(c, comm.rank()), small(one, comm.rank());
    epx::ref::test_linear_experts<float> experts(in.global, m.ep_rank(comm.rank()), m.local_experts());
    const auto forward = [&](auto& layer, const epx::test::rank_inputs<float>& u) {
      std::vector<float> out(u.N * u.H);
      (void)layer.forward(epx::span<const float>(u.x), epx::span<const std::int32_t>(u.d.ids),
                          epx::span<const float>(u.w), epx::span<float>(out), experts, epx::mode::inference);
      return out;
    };
    epx::moe_layer<comm_t, float> whole(m, comm, epx::test::options_for(c));
    const std::vector<float> want = forward(whole, in);
    const std::pair<std::size_t, std::int64_t> stages[] = {{1, 13},           {row - 1, 13},     {row, 13},
                                                           {row + row / 2, 13}, {2 * row + 1, 7}, {3 * row - 1, 7}};
    for (const auto& [stage, rounds] : stages) {
      c.stage_bytes = stage;
      epx::moe_layer<comm_t, float> layer(m, comm, epx::test::options_for(c));
      if (forward(layer, in) != want) f += "stage_bytes " + std::to_string(stage) + ": out differs from one round; ";
      if (layer.stats().stage_rounds != rounds)
        f += "stage_bytes " + std::to_string(stage) + ": " + std::to_string(layer.stats().stage_rounds) +
             " rounds, not " + std::to_string(rounds) + "; ";
      (void)forward(layer, small);
      if (layer.stats().stage_rounds != 0)
        f += "stage_bytes " + std::to_string(stage) + ", one row per slice after a call in rounds: stage_rounds " +
             std::to_string(layer.stats().stage_rounds) + ", not 0; ";
    }
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

}  // namespace test_layer_stats_cpp
