// Node-limited routing (spec section 10) against the float64 reference for every routing
// policy, logit type and execution policy: ids where the selection is not a near tie,
// weights, at most M nodes per token, no change without a limit; the checks with their
// messages; the limit the layer derives from its options and the nodes-per-token
// statistics after routing with it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"
#include "core/routing_cases.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_node_limit_cpp {

namespace ref = epx::ref;
namespace routing = epx::routing;

namespace {

using epx::test::lib_routing;
using epx::test::near_tie;
using epx::test::run_route;

ref::node_limit_params ref_limit(const routing::node_limit& nl) { return {nl.nodes, nl.max_nodes}; }

ref::routing_result ref_route(const routing::softmax_topk& p, const std::vector<double>& l, std::size_t N, int E,
                              int k) {
  return ref::softmax_topk(l, N, E, k, p.renormalize, ref_limit(p.limit));
}
ref::routing_result ref_route(const routing::topk_softmax& p, const std::vector<double>& l, std::size_t N, int E,
                              int k) {
  return ref::topk_softmax(l, N, E, k, ref_limit(p.limit));
}
ref::routing_result ref_route(const routing::sigmoid_bias& p, const std::vector<double>& l, std::size_t N, int E,
                              int k) {
  ref::sigmoid_bias_params r;
  if (p.bias != nullptr) r.bias.assign(p.bias, p.bias + E);
  r.scaling = p.scaling;
  r.normalize = p.normalize;
  r.limit = ref_limit(p.limit);
  return ref::sigmoid_bias(l, N, E, k, r);
}

// One routing call with a node limit against the reference; every token on <= M nodes.
// Returns the number of near-tie tokens whose ids were not compared.
template <class T, class Policy, class Exec>
std::size_t check_limited(const Policy& p, const Exec& ex, std::size_t N, int E, int k, std::uint64_t seed) {
  const auto ld = ref::round_through<T>(ref::random_logits(N, E, seed));
  const auto lt = ref::from_double<T>(ld);
  const auto got = run_route(p, ex, lt, N, E, k);
  const auto want = ref_route(p, ld, N, E, k);
  std::size_t skipped = 0;
  std::vector<double> want_w(N * k);
  const int per = E / p.limit.nodes;
  for (std::size_t t = 0; t < N; ++t) {
    std::set<int> nodes;
    for (int j = 0; j < k; ++j) nodes.insert(got.ids[t * k + j] / per);
    if (static_cast<int>(nodes.size()) > p.limit.max_nodes) {
      FAIL_CHECK("token " << t << " uses " << nodes.size() << " nodes, limit " << p.limit.max_nodes);
      return skipped;
    }
    const bool comparable = want.margin[t] == 0.0 || want.margin[t] > near_tie;
    for (int j = 0; j < k; ++j) {
      const auto i = t * k + j;
      if (comparable) {
        if (got.ids[i] != want.ids[i]) {
          FAIL_CHECK("token " << t << " slot " << j << ": id " << got.ids[i] << " != reference " << want.ids[i]
                              << " (margin " << want.margin[t] << ")");
          return skipped;
        }
        want_w[i] = want.weights[i];
      } else {
        want_w[i] = got.weights[i];
      }
    }
    skipped += comparable ? 0 : 1;
  }
  ref::check_close(got.weights, want_w, 2e-6, 2e-5, "weights");
  return skipped;
}

struct limited_shape {
  std::size_t N;
  int E, k, nodes, M;
};

const std::vector<limited_shape> shapes = {{64, 16, 4, 4, 2},  {50, 64, 8, 8, 4},  {33, 32, 2, 8, 1},
                                           {20, 64, 32, 4, 2}, {40, 256, 8, 8, 4}, {17, 12, 3, 3, 2},
                                           {0, 8, 2, 2, 1}};

template <class T, class Exec>
void check_all_policies(const Exec& ex) {
  std::uint64_t seed = 100;
  std::size_t skipped = 0, tokens = 0;
  for (const auto& s : shapes) {
    CAPTURE(s.N);
    CAPTURE(s.E);
    CAPTURE(s.k);
    CAPTURE(s.M);
    const routing::node_limit nl{s.nodes, s.M};
    for (bool renorm : {false, true}) skipped += check_limited<T>(routing::softmax_topk{renorm, nl}, ex, s.N, s.E, s.k, ++seed);
    skipped += check_limited<T>(routing::topk_softmax{nl}, ex, s.N, s.E, s.k, ++seed);
    std::vector<float> bias(static_cast<std::size_t>(s.E));
    ref::rng g(seed);
    for (auto& b : bias) b = static_cast<float>(g.uniform(-0.3, 0.3));
    routing::sigmoid_bias sb;
    sb.bias = bias.data();
    sb.scaling = 2.5f;
    sb.limit = nl;
    skipped += check_limited<T>(sb, ex, s.N, s.E, s.k, ++seed);
    tokens += 4 * s.N;
  }
  CHECK(skipped * 20 < tokens + 20);  // near ties are rare
}

}  // namespace

TEST_CASE_TEMPLATE("node limit: every policy against float64 on serial, openmp and emulated_device", T, float, double,
                   epx::bf16) {
  check_all_policies<T>(epx::exec::serial{});
  check_all_policies<T>(epx::exec::openmp{2});
  check_all_policies<T>(epx::exec::emulated_device{});
}

TEST_CASE("node limit: without a limit, or with M = nodes, routing is unchanged bitwise") {
  const std::size_t N = 50;
  const int E = 32, k = 4;
  const auto l = ref::from_double<float>(ref::random_logits(N, E, 9));
  const epx::exec::serial ex;
  for (const routing::node_limit nl : {routing::node_limit{4, 4}, routing::node_limit{4, 0}, routing::node_limit{}}) {
    const auto a = run_route(routing::softmax_topk{true}, ex, l, N, E, k);
    const auto b = run_route(routing::softmax_topk{true, nl}, ex, l, N, E, k);
    CHECK(a.ids == b.ids);
    CHECK(a.weights == b.weights);
    const auto c = run_route(routing::topk_softmax{}, ex, l, N, E, k);
    const auto d = run_route(routing::topk_softmax{nl}, ex, l, N, E, k);
    CHECK(c.ids == d.ids);
    CHECK(c.weights == d.weights);
    routing::sigmoid_bias s1, s2;
    s2.limit = nl;
    const auto e1 = run_route(s1, ex, l, N, E, k);
    const auto e2 = run_route(s2, ex, l, N, E, k);
    CHECK(e1.ids == e2.ids);
    CHECK(e1.weights == e2.weights);
  }
}

TEST_CASE("node limit: M = 1 keeps every token on its best node; backward follows the selected ids") {
  const std::size_t N = 30;
  const int E = 16, k = 2;
  const auto ld = ref::random_logits(N, E, 4);
  const auto l = ref::from_double<float>(ld);
  const epx::exec::serial ex;
  const routing::softmax_topk p{false, routing::node_limit{4, 1}};
  const auto r = run_route(p, ex, l, N, E, k);
  for (std::size_t t = 0; t < N; ++t) CHECK(r.ids[t * k] / 4 == r.ids[t * k + 1] / 4);
  std::vector<float> gw(N * k), gl(N * E);
  ref::rng g(5);
  for (auto& v : gw) v = static_cast<float>(g.normal());
  routing::route_backward(p, ex, l.data(), N, E, k, r.ids.data(), r.weights.data(), gw.data(), gl.data());
  const auto want = ref::softmax_topk_backward(ld, N, E, k, false, r.ids, std::vector<double>(gw.begin(), gw.end()));
  ref::check_close(gl, want, 1e-6, 1e-4, "grad_logits");
}

TEST_CASE("node limit: softmax_topk picks by p among the kept nodes, ties in p to the lower id") {
  // Logits a few ulps apart share one float32 p, and p far below the maximum underflow to
  // 0: selecting on the logits would break those ties the other way. The ids must be what
  // offering every kept expert's p in ascending id gives (the definition), the weights
  // those p, with the nodes as select_nodes keeps them.
  const int E = 48, nodes = 4, per = E / nodes;
  const std::size_t N = 60;
  std::vector<float> l(N * E);
  for (std::size_t t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) {
      float v = static_cast<float>((t * 5 + static_cast<std::size_t>(e) * 3) % 4) - 1.5f;
      for (std::size_t u = 0; u < (t + static_cast<std::size_t>(e) * 7) % 5; ++u) v = std::nextafter(v, 10.0f);
      if ((t + static_cast<std::size_t>(e)) % 3 == 0) v = -300.0f + static_cast<float>(e);
      l[t * E + static_cast<std::size_t>(e)] = v;
    }
  std::size_t ties = 0;
  for (int M : {1, 2, 3, 4})
    for (int k : {1, 2, 5, 8, 12}) {
      if (k > M * per) continue;
      CAPTURE(M);
      CAPTURE(k);
      const routing::node_limit nl{nodes, M};
      for (bool renorm : {false, true}) {
        const auto r = run_route(routing::softmax_topk{renorm, nl}, epx::exec::serial{}, l, N, E, k);
        for (std::size_t t = 0; t < N; ++t) {
          CAPTURE(t);
          const float* lt = l.data() + t * E;
          const auto x = [&](int e) { return lt[e]; };
          const auto sm = routing::detail::softmax_of(E, x);
          const auto p = [&](int e) { return sm.p(lt[e]); };
          const std::uint64_t mask = routing::detail::select_nodes(nl, E, k, x, p);
          routing::detail::topk_list<routing::max_top_k> want(k);
          routing::detail::for_each_allowed(nl, mask, E, [&](int e) { want.offer(p(e), e); });
          float sum = 0.0f;
          for (int j = 0; j < k; ++j) sum += want.key[j];
          for (int j = 0; j < k; ++j) {
            CHECK(r.ids[t * k + static_cast<std::size_t>(j)] == want.id[j]);
            CHECK(r.weights[t * k + static_cast<std::size_t>(j)] == (renorm ? want.key[j] / sum : want.key[j]));
          }
          // A tie the logits would break the other way: the k-th and the next kept expert by
          // p share one p while the later one has the larger logit.
          routing::detail::topk_list<routing::max_top_k + 1> next(k + 1);
          routing::detail::for_each_allowed(nl, mask, E, [&](int e) { next.offer(p(e), e); });
          if (next.size > k && next.key[k] == next.key[k - 1] && lt[next.id[k]] > lt[next.id[k - 1]]) ++ties;
        }
      }
    }
  CHECK(ties > 0);
}

TEST_CASE("node limit: nodes whose scores tie exactly keep the lower nodes, for every policy") {
  // Every node holds the same logits (distinct within a node), so all node scores are equal
  // and the M kept nodes are 0 .. M-1. The ids are then the k largest logits among the
  // experts of those nodes, equal logits to the lower id (the policies are monotone in the
  // logit without a bias).
  struct shape {
    int E, nodes, M, k;
  };
  for (const shape s : {shape{16, 4, 2, 3}, shape{24, 3, 1, 2}, shape{32, 8, 3, 4}, shape{12, 4, 2, 2}}) {
    CAPTURE(s.E);
    CAPTURE(s.nodes);
    CAPTURE(s.M);
    CAPTURE(s.k);
    const int per = s.E / s.nodes;
    const std::size_t N = 9;
    std::vector<float> l(N * static_cast<std::size_t>(s.E));
    for (std::size_t t = 0; t < N; ++t)
      for (int e = 0; e < s.E; ++e) {
        const int i = e % per;  // same pattern on every node, a different one per token
        l[t * static_cast<std::size_t>(s.E) + static_cast<std::size_t>(e)] =
            0.25f * static_cast<float>((i * 5 + static_cast<int>(t) * 3) % per);
      }
    std::vector<std::int32_t> want(N * static_cast<std::size_t>(s.k));
    for (std::size_t t = 0; t < N; ++t) {
      std::vector<int> cand(static_cast<std::size_t>(s.M * per));
      std::iota(cand.begin(), cand.end(), 0);
      const float* lt = l.data() + t * static_cast<std::size_t>(s.E);
      std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return lt[a] > lt[b]; });
      for (int j = 0; j < s.k; ++j) want[t * static_cast<std::size_t>(s.k) + static_cast<std::size_t>(j)] = cand[static_cast<std::size_t>(j)];
    }
    const routing::node_limit nl{s.nodes, s.M};
    routing::sigmoid_bias sb;
    sb.limit = nl;
    const auto check = [&](const lib_routing& r, const char* what) {
      const std::string which = what;
      CAPTURE(which);
      CHECK(r.ids == want);
    };
    check(run_route(routing::softmax_topk{false, nl}, epx::exec::serial{}, l, N, s.E, s.k), "softmax_topk");
    check(run_route(routing::softmax_topk{true, nl}, epx::exec::openmp{2}, l, N, s.E, s.k), "softmax_topk renorm");
    check(run_route(routing::topk_softmax{nl}, epx::exec::serial{}, l, N, s.E, s.k), "topk_softmax");
    check(run_route(routing::topk_softmax{nl}, epx::exec::emulated_device{}, l, N, s.E, s.k), "topk_softmax device");
    check(run_route(sb, epx::exec::serial{}, l, N, s.E, s.k), "sigmoid_bias");
  }
}

namespace {
std::string route_error(const routing::node_limit& nl, int E, int k, int n_group = 1) {
  std::vector<float> l(static_cast<std::size_t>(E), 0.5f), w(static_cast<std::size_t>(k));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(k));
  routing::sigmoid_bias p;
  p.n_group = n_group;
  p.topk_group = n_group;
  p.limit = nl;
  try {
    if (n_group > 1)
      routing::route(p, epx::exec::serial{}, l.data(), 1, E, k, ids.data(), w.data());
    else
      routing::route(routing::softmax_topk{false, nl}, epx::exec::serial{}, l.data(), 1, E, k, ids.data(), w.data());
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::configuration);
    return e.message();
  }
  return "no error";
}
}  // namespace

TEST_CASE("node limit: bad limits raise errc::configuration naming the values") {
  CHECK(route_error({3, 1}, 16, 2).find("node_limit.nodes (3) must divide E (16)") != std::string::npos);
  CHECK(route_error({4, 5}, 16, 2).find("node_limit.max_nodes (5) must be in [0, nodes = 4]") != std::string::npos);
  // A negative max_nodes is named, whatever nodes holds.
  CHECK(route_error({0, -1}, 16, 2).find("node_limit.max_nodes (-1) must be >= 0") != std::string::npos);
  CHECK(route_error({4, -1}, 16, 2).find("node_limit.max_nodes (-1) must be >= 0") != std::string::npos);
  CHECK(route_error({4, 1}, 16, 5).find("top_k (5) exceeds the experts of max_nodes (1) nodes of E / nodes (4) "
                                        "experts each = 4") != std::string::npos);
  CHECK(route_error({4, 2}, 16, 2, 4).find("a node limit (max_nodes 2) and group-limited selection (n_group 4)") !=
        std::string::npos);
  // A limit that removes no choice (max_nodes = nodes, as layer.node_limit() gives for
  // max_nodes = ep / ranks_per_node) is no limit: it combines with groups, bit for bit.
  {
    const int E = 16, k = 4, N = 50;
    const auto l = ref::from_double<float>(ref::random_logits(N, E, 9));
    routing::sigmoid_bias grouped{nullptr, 4, 2};
    const auto plain = epx::test::run_route(grouped, epx::exec::serial{}, l, N, E, k);
    grouped.limit = {4, 4};
    const auto unlimited = epx::test::run_route(grouped, epx::exec::serial{}, l, N, E, k);
    CHECK(unlimited.ids == plain.ids);
    CHECK(unlimited.weights == plain.weights);
  }
  epx::mesh_config mc;
  mc.fsdp = 8;
  mc.ep = 8;
  mc.experts = 16;
  const epx::mesh m(mc);
  const auto nl = routing::node_limit_of(m, 2, 3);
  CHECK(nl.nodes == 4);
  CHECK(nl.max_nodes == 3);
  CHECK_THROWS_WITH_AS(routing::node_limit_of(m, 3, 1), doctest::Contains("ranks_per_node (3) must be >= 1 and divide ep (8)"),
                       epx::error);
  CHECK_THROWS_WITH_AS(routing::node_limit_of(m, 4, 3), doctest::Contains("max_nodes (3) must be in [0, nodes]"),
                       epx::error);
  // node_limit_of's other refusals, each errc::configuration naming the values.
  const auto limit_error = [](const epx::mesh& mesh, int rpn, int max_nodes) {
    try {
      (void)routing::node_limit_of(mesh, rpn, max_nodes);
    } catch (const epx::error& e) {
      CHECK(e.category() == epx::errc::configuration);
      return e.message();
    }
    return std::string("no error");
  };
  CHECK(limit_error(m, 0, 1).find("ranks_per_node (0) must be >= 1 and divide ep (8)") != std::string::npos);
  CHECK(limit_error(m, -2, 1).find("ranks_per_node (-2) must be >= 1 and divide ep (8)") != std::string::npos);
  CHECK(limit_error(m, 2, -1).find("max_nodes (-1) must be in [0, nodes] with nodes = ep / ranks_per_node = 8 / 2 = 4") !=
        std::string::npos);
  // More nodes than a limit's 64-bit masks hold: refused with a limit, fine without one.
  epx::mesh_config wide;
  wide.fsdp = 128;
  wide.ep = 128;
  wide.experts = 128;
  const epx::mesh w(wide);
  CHECK(limit_error(w, 1, 1).find("a node limit supports at most 64 nodes, not 128") != std::string::npos);
  CHECK(limit_error(w, 2, 64).find("no error") != std::string::npos);  // 64 nodes: the most a limit takes
  const auto none = routing::node_limit_of(w, 1, 0);
  CHECK(none.nodes == 128);
  CHECK_FALSE(none.active());
  // route() refuses a limit over more than 64 nodes, or over no node, as it does nodes not dividing E.
  CHECK(route_error({128, 1}, 128, 2).find("node_limit.nodes (128) must divide E (128) and be in [1, 64]") !=
        std::string::npos);
  CHECK(route_error({0, 1}, 16, 2).find("node_limit.nodes (0) must divide E (16) and be in [1, 64]") != std::string::npos);
}

TEST_CASE("node limit: the layer's limit routes every token onto at most M nodes (statistics)") {
  // 8 ranks, ep = 8, 2 ranks per node (4 nodes), 32 experts, top-4 on at most 2 nodes.
  epx::mesh_config mc;
  mc.fsdp = 8;
  mc.ep = 8;
  mc.experts = 32;
  const epx::mesh m(mc);
  using comm_t = epx::threads::communicator;
  std::vector<std::string> failures(8);
  epx::threads::run(8, [&](comm_t& world) {
    std::string& f = failures[static_cast<std::size_t>(world.rank())];
    const std::size_t N = 40, H = 4;
    const int E = 32, k = 4;
    epx::layer_options o;
    o.hidden = H;
    o.top_k = k;
    o.ranks_per_node = 2;
    for (int M : {0, 2, 1}) {
      o.max_nodes = M;
      epx::moe_layer<comm_t, float> layer(m, world, o);
      const routing::node_limit nl = layer.node_limit();
      if (M > 0 && (nl.nodes != 4 || nl.max_nodes != M)) f += "layer.node_limit() is wrong\n";
      const auto l = ref::from_double<float>(ref::random_logits(N, E, 77 + static_cast<std::uint64_t>(world.rank())));
      std::vector<std::int32_t> ids(N * k);
      std::vector<float> w(N * k);
      routing::route(routing::softmax_topk{true, nl}, epx::exec::serial{}, l.data(), N, E, k, ids.data(), w.data());
      const auto global = ref::linear_experts::random(E, static_cast<int>(H), 3);
      ref::test_linear_experts<float> experts(global, m.ep_rank(world.rank()), m.local_experts());
      const auto x = ref::from_double<float>(ref::random_x(N, static_cast<int>(H), 5));
      std::vector<float> out(N * H);
      layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                    epx::span<float>(out), experts, epx::mode::inference);
      const auto& st = layer.stats();
      if (M > 0 && st.max_nodes_per_token > M)
        f += epx::detail::concat("max nodes per token ", st.max_nodes_per_token, " > M = ", M, "\n");
      if (M == 1 && st.mean_nodes_per_token != 1.0) f += "M = 1 but the mean is not 1\n";
      if (M == 0 && st.max_nodes_per_token < 2) f += "without a limit some token should span two nodes\n";
      if (st.mean_nodes_per_token <= 0.0) f += "no node statistics\n";
    }
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("node limit: token_nodes counts the distinct nodes of every token, up to and beyond 64 nodes") {
  // (E, experts per node): 8 nodes (the plan counts a byte per node up to 8; 36 / 5: the
  // last node partial), 9 nodes (a bit per node), exactly 64, beyond 64 (the pairwise path), one
  // expert per node, and a shape where the multiply-shift does not apply (magic 0).
  struct shape { int E, per; };
  std::mt19937 gen(11);
  for (const shape s : {shape{256, 32}, shape{36, 5}, shape{72, 8}, shape{256, 4}, shape{96, 1}, shape{384, 3},
                        shape{1 << 20, 1 << 13}, shape{65536, 65537}}) {
    CAPTURE(s.E);
    CAPTURE(s.per);
    const auto magic = routing::token_nodes::magic_for(s.E, s.per);
    if (static_cast<std::uint64_t>(s.E) * static_cast<std::uint64_t>(s.per) <= (std::uint64_t{1} << 32)) {
      CHECK(magic != 0);
      // The multiply-shift is the division for every id of the shape.
      const routing::token_nodes tn{nullptr, nullptr, 1, s.E, s.per, magic};
      int wrong = 0;
      for (int e = 0; e < s.E; ++e) wrong += tn.node_of(e) != e / s.per ? 1 : 0;
      CHECK(wrong == 0);
    } else {
      CHECK(magic == 0);
    }
    for (const int k : {1, 4, 8, 13}) {
      const std::size_t n = 300;
      std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
      std::uniform_int_distribution<std::int32_t> any(0, s.E - 1);
      std::uniform_int_distribution<int> pick(0, 15);
      for (auto& id : ids) {
        const int r = pick(gen);
        id = r == 0 ? -1 - pick(gen) : r == 1 ? s.E + pick(gen) : any(gen);  // some ids outside [0, E)
      }
      std::vector<std::int32_t> nodes(n, -7);
      epx::exec::for_each_n(epx::exec::serial{}, n, routing::token_nodes{ids.data(), nodes.data(), k, s.E, s.per, magic});
      int wrong = 0;
      for (std::size_t t = 0; t < n; ++t) {
        std::set<int> want;
        for (int j = 0; j < k; ++j) {
          const std::int32_t e = ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
          if (e >= 0 && e < s.E) want.insert(e / s.per);
        }
        wrong += nodes[t] != static_cast<std::int32_t>(want.size()) ? 1 : 0;
      }
      CHECK_MESSAGE(wrong == 0, "k = ", k);

      // The send plan's count of the same figures (nodes_per_token): in the counting
      // sort's pass 1 with any chunking (at most 64 nodes), else one token_nodes pass; on
      // every host policy and the emulated device. Pairs with a non-finite weight are not
      // counted (such a call raises); here every weight is finite.
      std::int64_t sum = 0, most = 0;
      for (auto v : nodes) {
        sum += v;
        most = std::max<std::int64_t>(most, v);
      }
      const std::vector<float> w(ids.size(), 0.5f);
      const auto check_plan = [&](const auto& ex, std::size_t chunks, const char* name) {
        const auto p = epx::layout::build_plan_counts(ex, ids.data(), w.data(), n, k, s.E, chunks,
                                                      epx::layout::nodes_per_token{s.per});
        std::int64_t tally[3] = {-1, -1, -1};
        epx::exec::copy_n(ex, static_cast<const std::int64_t*>(p.node_tally.data()), std::size_t{3}, tally);
        epx::exec::synchronize(ex);
        CHECK_MESSAGE(tally[0] == static_cast<std::int64_t>(n), name, " chunks ", chunks);
        CHECK_MESSAGE(tally[1] == sum, name, " chunks ", chunks);
        CHECK_MESSAGE(tally[2] == most, name, " chunks ", chunks);
        // The counts are those of the plan without nodes.
        const auto q = epx::layout::build_plan_counts(ex, ids.data(), w.data(), n, k, s.E, chunks);
        CHECK(p.host_counts == q.host_counts);
      };
      if (s.E > 4096) continue;  // the plan's per-chunk counts are [chunks, E]
      for (std::size_t chunks : {std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{64}})
        check_plan(epx::exec::serial{}, chunks, "serial");
      check_plan(epx::exec::openmp{2}, 0, "openmp");
      check_plan(epx::exec::emulated_device{}, 0, "emulated_device");
    }
  }
}

TEST_CASE("key table: the selection from the keys that reach the threshold equals offering every key") {
  // routing::detail::key_table (the host functors' selection) against a topk_list offered
  // every key of the range in ascending id: the same keys and ids in the same order, for
  // plain ranges, each node's range and the kept nodes of random masks, on keys drawn so
  // that thresholds are tight or useless: random, few distinct values (ties), ascending,
  // descending, and one large key per group.
  using routing::detail::key_table;
  using routing::detail::topk_list;
  std::mt19937 gen(23);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  long long compared = 0, differ = 0;
  const auto same = [&](const auto& a, const auto& b) {
    ++compared;
    bool ok = a.size == b.size;
    for (int i = 0; ok && i < a.size; ++i) ok = a.key[i] == b.key[i] && a.id[i] == b.id[i];
    differ += ok ? 0 : 1;
  };
  for (const int E : {1, 3, 8, 36, 64, 256, 510, 512})
    for (int kind = 0; kind < 5; ++kind)
      for (int rep = 0; rep < 20; ++rep) {
        std::vector<float> x(static_cast<std::size_t>(E));
        for (int e = 0; e < E; ++e) {
          const float r = nd(gen);
          x[static_cast<std::size_t>(e)] = kind == 0   ? r
                                           : kind == 1 ? std::round(r * 2.0f)
                                           : kind == 2 ? static_cast<float>(e) + 0.001f * r
                                           : kind == 3 ? -static_cast<float>(e)
                                                       : (e % 4 == 1 ? 10.0f + r : r);
        }
        for (const int nodes : {1, 2, 4, 6, 8}) {
          if (E % nodes != 0) continue;
          const int per = E / nodes;
          key_table t;
          const float mx = t.fill(E, per, [&](int e) { return x[static_cast<std::size_t>(e)]; });
          CHECK(mx == *std::max_element(x.begin(), x.end()));
          for (const int c : {1, 2, 3, 8, 9, 33}) {
            // Each node's range.
            for (int g = 0; g < nodes; ++g) {
              topk_list<33> a(std::min(c, per)), b(std::min(c, per));
              t.offer(g * per, (g + 1) * per, a);
              for (int e = g * per; e < (g + 1) * per; ++e) b.offer(x[static_cast<std::size_t>(e)], e);
              same(a, b);
            }
            // The kept nodes of a mask (every node without a limit).
            for (int M = 1; M <= nodes; ++M) {
              const routing::node_limit nl{nodes, M};
              std::uint64_t mask = 0;
              std::vector<int> order(static_cast<std::size_t>(nodes));
              std::iota(order.begin(), order.end(), 0);
              std::shuffle(order.begin(), order.end(), gen);
              for (int i = 0; i < M; ++i) mask |= std::uint64_t{1} << order[static_cast<std::size_t>(i)];
              const int cc = std::min(c, nl.active() ? M * per : E);
              topk_list<33> a(cc), b(cc);
              routing::detail::offer_allowed(nl, mask, E, t, a);
              routing::detail::for_each_allowed(nl, mask, E, [&](int e) { b.offer(x[static_cast<std::size_t>(e)], e); });
              same(a, b);
            }
          }
        }
      }
  CHECK(compared > 10000);
  CHECK(differ == 0);
}

}  // namespace test_node_limit_cpp
