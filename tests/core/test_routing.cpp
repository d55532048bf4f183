// Routing policies (spec section 2) against the float64 reference: ids exactly, weights
// and logit gradients within float32 tolerances, for every policy, logit type and host
// execution policy; ties; group-limited selection; bad inputs with their messages.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "epx/routing/routing.hpp"
#include "core/routing_cases.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_routing_cpp {

namespace ref = epx::ref;
namespace routing = epx::routing;

namespace {

using epx::test::lib_routing;
using epx::test::near_tie;
using epx::test::run_route;

template <class T, class Policy, class Exec>
std::vector<float> run_backward(const Policy& p, const Exec& ex, const std::vector<T>& logits, std::size_t N, int E,
                                int k, const std::vector<std::int32_t>& ids, const std::vector<float>& gw) {
  std::vector<float> gl(N * E, -7.0f);
  routing::route_backward(p, ex, epx::span<const T>(logits.data(), logits.size()), E, k, epx::make_span(ids),
                          epx::span<const float>(), epx::make_span(gw), epx::make_span(gl));
  return gl;
}

ref::sigmoid_bias_params ref_params(const routing::sigmoid_bias& p, int E) {
  ref::sigmoid_bias_params r;
  if (p.bias != nullptr) r.bias.assign(p.bias, p.bias + E);
  r.n_group = p.n_group;
  r.topk_group = p.topk_group;
  r.scaling = p.scaling;
  r.normalize = p.normalize;
  return r;
}

ref::routing_result ref_route(const routing::softmax_topk& p, const std::vector<double>& l, std::size_t N, int E,
                              int k) {
  return ref::softmax_topk(l, N, E, k, p.renormalize);
}
ref::routing_result ref_route(const routing::topk_softmax&, const std::vector<double>& l, std::size_t N, int E,
                              int k) {
  return ref::topk_softmax(l, N, E, k);
}
ref::routing_result ref_route(const routing::sigmoid_bias& p, const std::vector<double>& l, std::size_t N, int E,
                              int k) {
  return ref::sigmoid_bias(l, N, E, k, ref_params(p, E));
}

std::vector<double> ref_backward(const routing::softmax_topk& p, const std::vector<double>& l, std::size_t N, int E,
                                 int k, const std::vector<std::int32_t>& ids, const std::vector<double>& gw) {
  return ref::softmax_topk_backward(l, N, E, k, p.renormalize, ids, gw);
}
std::vector<double> ref_backward(const routing::topk_softmax&, const std::vector<double>& l, std::size_t N, int E,
                                 int k, const std::vector<std::int32_t>& ids, const std::vector<double>& gw) {
  return ref::topk_softmax_backward(l, N, E, k, ids, gw);
}
std::vector<double> ref_backward(const routing::sigmoid_bias& p, const std::vector<double>& l, std::size_t N, int E,
                                 int k, const std::vector<std::int32_t>& ids, const std::vector<double>& gw) {
  return ref::sigmoid_bias_backward(l, N, E, k, ref_params(p, E), ids, gw);
}

// Compares one routing call with the reference on the same (T-rounded) logits. Returns
// the number of near-tie tokens whose ids were not compared.
template <class T, class Policy, class Exec>
std::size_t check_route(const Policy& p, const Exec& ex, std::size_t N, int E, int k, std::uint64_t seed) {
  const auto ld = ref::round_through<T>(ref::random_logits(N, E, seed));
  const auto lt = ref::from_double<T>(ld);
  const auto got = run_route(p, ex, lt, N, E, k);
  const auto want = ref_route(p, ld, N, E, k);
  std::size_t skipped = 0;
  std::vector<double> want_w(N * k);
  for (std::size_t t = 0; t < N; ++t) {
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
        want_w[i] = got.weights[i];  // different but equally valid selection; not compared
      }
    }
    skipped += comparable ? 0 : 1;
  }
  ref::check_close(got.weights, want_w, 2e-6, 2e-5, "weights");
  return skipped;
}

struct shape {
  std::size_t N;
  int E;
  int k;
};

const std::vector<shape> shapes = {{1, 1, 1},  {7, 4, 2},   {33, 8, 8},  {64, 16, 1}, {50, 64, 8},
                                   {20, 64, 32}, {9, 40, 32}, {128, 32, 2}, {3, 128, 4}, {0, 8, 2}};

template <class T, class Exec>
void check_all_policies(const Exec& ex) {
  std::size_t skipped = 0, tokens = 0;
  std::uint64_t seed = 1000;
  for (const auto& s : shapes) {
    CAPTURE(s.N);
    CAPTURE(s.E);
    CAPTURE(s.k);
    for (bool renorm : {false, true}) skipped += check_route<T>(routing::softmax_topk{renorm}, ex, s.N, s.E, s.k, ++seed);
    skipped += check_route<T>(routing::topk_softmax{}, ex, s.N, s.E, s.k, ++seed);
    const auto bias = ref::from_double<float>(ref::random_normal(1, s.E, ++seed, 0.05));
    for (bool norm : {true, false}) {
      routing::sigmoid_bias p;
      p.normalize = norm;
      p.scaling = norm ? 2.5f : 1.0f;
      skipped += check_route<T>(p, ex, s.N, s.E, s.k, ++seed);
      p.bias = bias.data();
      skipped += check_route<T>(p, ex, s.N, s.E, s.k, ++seed);
      // Group-limited: every (n_group, topk_group) that divides E and leaves room for k.
      for (int ng : {2, 4, 8}) {
        if (s.E % ng != 0) continue;
        for (int tg : {1, 2, ng / 2 + 1, ng}) {
          if (tg > ng || s.k > tg * (s.E / ng)) continue;
          p.n_group = ng;
          p.topk_group = tg;
          CAPTURE(ng);
          CAPTURE(tg);
          skipped += check_route<T>(p, ex, s.N, s.E, s.k, ++seed);
        }
      }
    }
    tokens += 12 * s.N;
  }
  MESSAGE("near-tie tokens not compared: " << skipped << " of ~" << tokens);
  CHECK(skipped * 50 < tokens);
}

}  // namespace

TEST_CASE_TEMPLATE("route matches the float64 reference", T, float, double, epx::bf16, epx::fp16) {
  SUBCASE("serial") { check_all_policies<T>(epx::exec::serial{}); }
  SUBCASE("openmp") { check_all_policies<T>(epx::exec::openmp{2}); }
}

TEST_CASE("route: serial and openmp agree bitwise") {
  const std::size_t N = 301;
  const int E = 64, k = 8;
  const auto l = ref::from_double<float>(ref::random_logits(N, E, 17));
  const auto bias = ref::from_double<float>(ref::random_normal(1, E, 18, 0.05));
  routing::sigmoid_bias p{bias.data(), 8, 3, 2.5f, true};
  const auto a = run_route(p, epx::exec::serial{}, l, N, E, k);
  const auto b = run_route(p, epx::exec::openmp{2}, l, N, E, k);
  CHECK(a.ids == b.ids);
  CHECK(std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)) == 0);
  const auto gw = ref::from_double<float>(ref::random_normal(N, k, 19));
  const auto ga = run_backward(p, epx::exec::serial{}, l, N, E, k, a.ids, gw);
  const auto gb = run_backward(p, epx::exec::openmp{2}, l, N, E, k, a.ids, gw);
  CHECK(std::memcmp(ga.data(), gb.data(), ga.size() * sizeof(float)) == 0);
}

TEST_CASE("route: ties go to the lower expert id") {
  const epx::exec::serial ex;
  SUBCASE("all logits equal") {
    const std::vector<float> l(3 * 10, 0.25f);
    for (int k : {1, 3, 10}) {
      const auto s = run_route(routing::softmax_topk{}, ex, l, 3, 10, k);
      const auto t = run_route(routing::topk_softmax{}, ex, l, 3, 10, k);
      const auto g = run_route(routing::sigmoid_bias{}, ex, l, 3, 10, k);
      for (std::size_t t0 = 0; t0 < 3; ++t0)
        for (int j = 0; j < k; ++j) {
          CHECK(s.ids[t0 * k + j] == j);
          CHECK(t.ids[t0 * k + j] == j);
          CHECK(g.ids[t0 * k + j] == j);
          CHECK(s.weights[t0 * k + j] == doctest::Approx(0.1f));
          CHECK(t.weights[t0 * k + j] == doctest::Approx(1.0 / k));
          CHECK(g.weights[t0 * k + j] == doctest::Approx(1.0 / k));
        }
    }
  }
  SUBCASE("repeated values, slots ordered by score then id") {
    const std::vector<epx::bf16> l = ref::from_double<epx::bf16>({1.0, 3.0, -2.0, 3.0, 0.5, 3.0, 1.0});
    const auto r = run_route(routing::topk_softmax{}, ex, l, 1, 7, 5);
    CHECK(r.ids == std::vector<std::int32_t>{1, 3, 5, 0, 6});
    CHECK(r.weights[0] == r.weights[1]);
    CHECK(r.weights[3] == r.weights[4]);
  }
  SUBCASE("bias ties") {
    // s + bias equal for experts 2 and 5 (same logit, same bias): lower id first.
    const std::vector<float> l = {0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1.0f};
    const std::vector<float> bias = {0.5f, 0.0f, 0.25f, 0.0f, 0.0f, 0.25f};
    routing::sigmoid_bias p;
    p.bias = bias.data();
    const auto r = run_route(p, ex, l, 1, 6, 3);
    CHECK(r.ids == std::vector<std::int32_t>{0, 2, 5});  // s(0) + 0.5 = 1 beats s(1) + 0.25
  }
  SUBCASE("group ties keep the lower group") {
    const std::vector<float> l = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    routing::sigmoid_bias p;
    p.n_group = 4;
    p.topk_group = 2;
    const auto r = run_route(p, ex, l, 1, 8, 4);
    CHECK(r.ids == std::vector<std::int32_t>{0, 1, 2, 3});
  }
}

// softmax_topk selects on p = softmax(logits) as float32 computes it, not on the logits:
// experts whose float32 p are equal tie, and the tie goes to the lower id even where the
// higher id has the larger logit.
TEST_CASE("route: softmax_topk takes the top-k of the float32 p, ties to the lower id") {
  const auto check = [](const auto& ex) {
    // exp(-1e-8) rounds to 1 in float32, so p = {0.5, 0.5}: a tie, expert 0.
    for (bool renorm : {false, true}) {
      const auto r = run_route(routing::softmax_topk{renorm}, ex, std::vector<float>{0.0f, 1e-8f}, 1, 2, 1);
      CHECK(r.ids == std::vector<std::int32_t>{0});
      CHECK(r.weights[0] == (renorm ? 1.0f : 0.5f));
    }
    // Four logits within 3e-9 of each other have one float32 p: k = 2 takes the two lowest
    // ids of the four, not the two largest logits (ids 1 and 3).
    {
      const std::vector<float> l = {-1.0f, 3e-9f, 0.0f, 2e-9f, 1e-9f};
      const auto r = run_route(routing::softmax_topk{}, ex, l, 1, 5, 2);
      CHECK(r.ids == std::vector<std::int32_t>{1, 2});
      CHECK(r.weights[0] == r.weights[1]);
    }
    // p that underflow to 0 in float32 tie at 0: after the two live experts comes the lowest
    // id, not the largest logit (-150, id 1).
    {
      const std::vector<float> l = {-200.0f, -150.0f, 0.0f, -160.0f, 0.5f};
      for (bool renorm : {false, true}) {
        const auto r = run_route(routing::softmax_topk{renorm}, ex, l, 1, 5, 3);
        CHECK(r.ids == std::vector<std::int32_t>{4, 2, 0});
        CHECK(r.weights[2] == 0.0f);
      }
    }
    // Near ties in bulk, against the p the library returns: with k = E the weights are every
    // expert's float32 p; for each k the ids must be the first k experts by that p,
    // descending, ties to the lower id, and the weights exactly those p.
    const int E = 12;
    const std::size_t N = 40;
    std::vector<float> l(N * E);
    for (std::size_t t = 0; t < N; ++t)
      for (int e = 0; e < E; ++e) {
        float v = static_cast<float>((t * 5 + e * 3) % 4) - 1.5f;               // four bases
        for (std::size_t u = 0; u < (t + e * 7) % 5; ++u) v = std::nextafter(v, 10.0f);  // a few ulps up
        if ((t + e) % 3 == 0) v = -300.0f + static_cast<float>(e);               // p underflows to 0
        l[t * E + e] = v;
      }
    const auto all = run_route(routing::softmax_topk{}, ex, l, N, E, E);
    std::size_t ties = 0;
    for (int k : {1, 2, 3, 5, 8, 10, E}) {
      CAPTURE(k);
      const auto r = run_route(routing::softmax_topk{}, ex, l, N, E, k);
      for (std::size_t t = 0; t < N; ++t) {
        CAPTURE(t);
        std::vector<float> p(E);
        for (int j = 0; j < E; ++j) p[all.ids[t * E + j]] = all.weights[t * E + j];
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        for (int j = 0; j < k; ++j) {
          CHECK(r.ids[t * k + j] == order[j]);
          CHECK(r.weights[t * k + j] == p[order[j]]);
        }
        if (k < E && p[order[k - 1]] == p[order[k]] && l[t * E + order[k - 1]] < l[t * E + order[k]]) ++ties;
      }
    }
    CHECK(ties > 0);  // the data holds ties in p that selection on the logits would break the other way
  };
  SUBCASE("serial") { check(epx::exec::serial{}); }
  SUBCASE("openmp") { check(epx::exec::openmp{2}); }
}

TEST_CASE("reference softmax_topk takes the top-k of the float32 p, ties to the lower id") {
  auto r = ref::softmax_topk({0.0, 1e-8}, 1, 2, 1, false);
  CHECK(r.ids == std::vector<std::int32_t>{0});
  CHECK(r.margin[0] < 1e-7);  // a tie made by rounding: tests do not compare such tokens
  r = ref::softmax_topk({-1.0, 3e-9, 0.0, 2e-9, 1e-9}, 1, 5, 2, false);
  CHECK(r.ids == std::vector<std::int32_t>{1, 2});
  r = ref::softmax_topk({-200.0, -150.0, 0.0, -160.0, 0.5}, 1, 5, 3, true);
  CHECK(r.ids == std::vector<std::int32_t>{4, 2, 0});
  CHECK(r.weights[2] < 1e-60);
  // Equal logits are an exact tie (margin 0), compared like any other token.
  r = ref::softmax_topk({1.0, 3.0, 3.0, 0.5, 3.0}, 1, 5, 2, false);
  CHECK(r.ids == std::vector<std::int32_t>{1, 2});
  CHECK(r.margin[0] == 0.0);
}

TEST_CASE("route: sigmoid_bias group-limited selection by hand") {
  const epx::exec::serial ex;
  // 4 groups of 2. Expert 7 is the single best, but its partner is poor, so group 3
  // (score s7 + s6) loses to groups 0 and 1 (two good members each).
  const std::vector<float> l = {2.0f, 2.0f, 1.9f, 1.9f, -5.0f, -5.0f, -5.0f, 4.0f};
  routing::sigmoid_bias p;
  p.n_group = 4;
  p.topk_group = 2;
  auto r = run_route(p, ex, l, 1, 8, 2);
  CHECK(r.ids == std::vector<std::int32_t>{0, 1});
  CHECK(r.weights[0] == doctest::Approx(0.5));
  p.topk_group = 3;  // third group: 3 (s7 + s6 > 2*sigmoid(-5))
  r = run_route(p, ex, l, 1, 8, 3);
  CHECK(r.ids == std::vector<std::int32_t>{7, 0, 1});
  p.n_group = 1;
  p.topk_group = 1;
  r = run_route(p, ex, l, 1, 8, 2);
  CHECK(r.ids == std::vector<std::int32_t>{7, 0});
  // The bias changes selection, not the weights.
  const std::vector<float> bias = {0, 0, 0, 1.0f, 0, 0, 0, 0};
  p.bias = bias.data();
  p.normalize = false;
  p.scaling = 2.0f;
  r = run_route(p, ex, l, 1, 8, 2);
  CHECK(r.ids == std::vector<std::int32_t>{3, 7});
  CHECK(r.weights[0] == doctest::Approx(2.0 * ref::sigmoid(1.9)).epsilon(1e-6));
  CHECK(r.weights[1] == doctest::Approx(2.0 * ref::sigmoid(4.0)).epsilon(1e-6));
}

// ---- backward ------------------------------------------------------------------------------

namespace {

template <class T, class Policy>
void check_backward(const Policy& p, std::size_t N, int E, int k, std::uint64_t seed, bool finite_differences) {
  const epx::exec::openmp ex{2};
  const auto ld = ref::round_through<T>(ref::random_logits(N, E, seed));
  const auto lt = ref::from_double<T>(ld);
  const auto fwd = run_route(p, ex, lt, N, E, k);
  const auto gwd = ref::round_through<float>(ref::random_normal(N, k, seed + 1));
  const auto gw = ref::from_double<float>(gwd);
  const auto got = run_backward(p, ex, lt, N, E, k, fwd.ids, gw);
  // Analytic float64 reference with the same ids.
  const auto want = ref_backward(p, ld, N, E, k, fwd.ids, gwd);
  ref::check_close(got, want, 2e-6, 2e-5, "grad_logits vs analytic reference");
  if (!finite_differences) return;
  // Finite differences of the float64 reference forward, on tokens whose selection is
  // stable under the step.
  const auto r0 = ref_route(p, ld, N, E, k);
  const auto fd = ref::finite_difference(
      [&](const std::vector<double>& l) {
        const auto r = ref_route(p, l, N, E, k);
        double s = 0;
        for (std::size_t i = 0; i < r.weights.size(); ++i) s += r.weights[i] * gwd[i];
        return s;
      },
      ld, 1e-6);
  std::vector<float> got_stable;
  std::vector<double> fd_stable;
  for (std::size_t t = 0; t < N; ++t) {
    if (r0.margin[t] < 1e-3) continue;
    for (int e = 0; e < E; ++e) {
      got_stable.push_back(got[t * E + e]);
      fd_stable.push_back(fd[t * E + e]);
    }
  }
  CHECK(fd_stable.size() >= N * E / 2);
  ref::check_close(got_stable, fd_stable, 1e-5, 1e-4, "grad_logits vs finite differences");
}

template <class T>
void check_backward_all(bool fd) {
  std::uint64_t seed = 5000;
  const std::vector<shape> bshapes = fd ? std::vector<shape>{{6, 4, 1}, {6, 8, 2}, {5, 16, 4}, {3, 12, 12}}
                                        : std::vector<shape>{{1, 1, 1}, {40, 64, 8}, {17, 40, 32}, {64, 16, 2}};
  for (const auto& s : bshapes) {
    CAPTURE(s.N);
    CAPTURE(s.E);
    CAPTURE(s.k);
    for (bool renorm : {false, true}) check_backward<T>(routing::softmax_topk{renorm}, s.N, s.E, s.k, ++seed, fd);
    check_backward<T>(routing::topk_softmax{}, s.N, s.E, s.k, ++seed, fd);
    const auto bias = ref::from_double<float>(ref::random_normal(1, s.E, ++seed, 0.05));
    for (bool norm : {true, false}) {
      routing::sigmoid_bias p{bias.data(), 1, 1, norm ? 2.5f : 0.75f, norm};
      check_backward<T>(p, s.N, s.E, s.k, ++seed, fd);
      if (s.E % 4 == 0 && s.k <= 2 * (s.E / 4)) {
        p.n_group = 4;
        p.topk_group = 2;
        check_backward<T>(p, s.N, s.E, s.k, ++seed, fd);
      }
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("route_backward matches the analytic float64 reference", T, float, double, epx::bf16,
                   epx::fp16) {
  check_backward_all<T>(false);
}

TEST_CASE_TEMPLATE("route_backward matches finite differences of the float64 reference", T, float, double) {
  check_backward_all<T>(true);
}

TEST_CASE("route_backward: unselected experts get zero gradient except through the full softmax") {
  const epx::exec::serial ex;
  const std::size_t N = 4;
  const int E = 8, k = 2;
  const auto l = ref::from_double<float>(ref::random_logits(N, E, 3));
  const std::vector<float> gw(N * k, 1.0f);
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    std::vector<float> gl;
    lib_routing r;
    if (which == 0) {
      r = run_route(routing::topk_softmax{}, ex, l, N, E, k);
      gl = run_backward(routing::topk_softmax{}, ex, l, N, E, k, r.ids, gw);
    } else if (which == 1) {
      r = run_route(routing::sigmoid_bias{}, ex, l, N, E, k);
      gl = run_backward(routing::sigmoid_bias{}, ex, l, N, E, k, r.ids, gw);
    } else {
      r = run_route(routing::softmax_topk{true}, ex, l, N, E, k);
      gl = run_backward(routing::softmax_topk{true}, ex, l, N, E, k, r.ids, gw);
    }
    for (std::size_t t = 0; t < N; ++t)
      for (int e = 0; e < E; ++e) {
        const bool sel = r.ids[t * k] == e || r.ids[t * k + 1] == e;
        if (!sel) CHECK(gl[t * E + e] == 0.0f);
      }
  }
  // softmax_topk without renormalisation: d(sum of selected p)/dl is nonzero everywhere.
  const auto r = run_route(routing::softmax_topk{}, ex, l, N, E, k);
  const auto gl = run_backward(routing::softmax_topk{}, ex, l, N, E, k, r.ids, gw);
  for (std::size_t t = 0; t < N; ++t) {
    double row = 0;
    for (int e = 0; e < E; ++e) {
      CHECK(gl[t * E + e] != 0.0f);
      row += gl[t * E + e];
    }
    CHECK(std::abs(row) < 1e-6);  // softmax gradients sum to zero over the row
  }
}

// ---- bad input -----------------------------------------------------------------------------

namespace {

template <class F>
std::string error_of(F&& f, epx::errc want) {
  try {
    f();
  } catch (const epx::error& e) {
    CHECK(e.category() == want);
    return e.message();
  }
  FAIL_CHECK("no epx::error was raised");
  return "";
}

bool has(const std::string& s, const std::string& part) {
  const bool ok = s.find(part) != std::string::npos;
  if (!ok) MESSAGE("message '" << s << "' lacks '" << part << "'");
  return ok;
}

}  // namespace

TEST_CASE_TEMPLATE("route: non-finite logits name the token, expert and value", T, float, double, epx::bf16,
                   epx::fp16) {
  const std::size_t N = 6;
  const int E = 8, k = 2;
  for (int exi = 0; exi < 2; ++exi) {
    auto ld = ref::random_logits(N, E, 9);
    ld[3 * E + 5] = std::numeric_limits<double>::quiet_NaN();
    ld[4 * E + 1] = std::numeric_limits<double>::infinity();  // a later token: not the first
    const auto l = ref::from_double<T>(ld);
    std::vector<std::int32_t> ids(N * k);
    std::vector<float> w(N * k);
    const auto call = [&](const auto& policy) {
      if (exi == 0)
        routing::route(policy, epx::exec::serial{}, l.data(), N, E, k, ids.data(), w.data());
      else
        routing::route(policy, epx::exec::openmp{2}, l.data(), N, E, k, ids.data(), w.data());
    };
    for (int pi = 0; pi < 3; ++pi) {
      std::string m;
      if (pi == 0) m = error_of([&] { call(routing::softmax_topk{}); }, epx::errc::input);
      if (pi == 1) m = error_of([&] { call(routing::topk_softmax{}); }, epx::errc::input);
      if (pi == 2) m = error_of([&] { call(routing::sigmoid_bias{}); }, epx::errc::input);
      CHECK(has(m, "token 3"));
      CHECK(has(m, "expert 5"));
      CHECK(has(m, "nan"));
    }
    ld[3 * E + 5] = 0.0;
    ld[4 * E + 1] = -std::numeric_limits<double>::infinity();
    const auto l2 = ref::from_double<T>(ld);
    const auto m = error_of(
        [&] { routing::route(routing::topk_softmax{}, epx::exec::serial{}, l2.data(), N, E, k, ids.data(), w.data()); },
        epx::errc::input);
    CHECK(has(m, "token 4"));
    CHECK(has(m, "expert 1"));
    CHECK(has(m, "-inf"));
  }
}

TEST_CASE("route: double logits beyond float32 range are reported") {
  std::vector<double> l = {0.0, 1e300, 0.5};
  std::vector<std::int32_t> ids(1);
  std::vector<float> w(1);
  const auto m = error_of(
      [&] { routing::route(routing::topk_softmax{}, epx::exec::serial{}, l.data(), 1, 3, 1, ids.data(), w.data()); },
      epx::errc::input);
  CHECK(has(m, "token 0"));
  CHECK(has(m, "expert 1"));
  CHECK(has(m, "1e+300"));
}

TEST_CASE("route: bad k, E and group parameters") {
  const epx::exec::serial ex;
  const std::vector<float> l(4 * 40, 0.0f);
  std::vector<std::int32_t> ids(4 * 40);
  std::vector<float> w(4 * 40);
  const auto call = [&](const auto& p, int E, int k) {
    routing::route(p, ex, l.data(), 4, E, k, ids.data(), w.data());
  };
  auto m = error_of([&] { call(routing::softmax_topk{}, 8, 0); }, epx::errc::input);
  CHECK(has(m, "top_k (0)"));
  m = error_of([&] { call(routing::topk_softmax{}, 8, 9); }, epx::errc::input);
  CHECK(has(m, "top_k (9)"));
  CHECK(has(m, "E = 8"));
  m = error_of([&] { call(routing::topk_softmax{}, 40, 33); }, epx::errc::input);
  CHECK(has(m, "max_top_k (32)"));
  m = error_of([&] { call(routing::topk_softmax{}, 0, 1); }, epx::errc::input);
  CHECK(has(m, "E (0)"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 3, 1}, 8, 2); }, epx::errc::configuration);
  CHECK(has(m, "E (8) is not divisible by n_group (3)"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 4, 0}, 8, 2); }, epx::errc::configuration);
  CHECK(has(m, "topk_group (0)"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 4, 5}, 8, 2); }, epx::errc::configuration);
  CHECK(has(m, "topk_group (5)"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 4, 1}, 8, 3); }, epx::errc::configuration);
  CHECK(has(m, "top_k (3)"));
  CHECK(has(m, "= 2"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 0, 1}, 8, 2); }, epx::errc::configuration);
  CHECK(has(m, "n_group (0)"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 80, 1}, 160, 1); }, epx::errc::configuration);
  CHECK(has(m, "max_groups"));
  m = error_of([&] { call(routing::sigmoid_bias{nullptr, 1, 1, std::nanf("")}, 8, 2); }, epx::errc::configuration);
  CHECK(has(m, "scaling"));
  std::vector<float> bias(8, 0.0f);
  bias[6] = std::numeric_limits<float>::infinity();
  m = error_of([&] { call(routing::sigmoid_bias{bias.data()}, 8, 2); }, epx::errc::input);
  CHECK(has(m, "bias of expert 6"));
  // Span shapes.
  m = error_of(
      [&] {
        routing::route(routing::topk_softmax{}, ex, epx::span<const float>(l.data(), 10), 4, 1, epx::make_span(ids),
                       epx::make_span(w));
      },
      epx::errc::input);
  CHECK(has(m, "not a multiple of E (4)"));
  m = error_of(
      [&] {
        routing::route(routing::topk_softmax{}, ex, epx::span<const float>(l.data(), 16), 4, 2,
                       epx::span<std::int32_t>(ids.data(), 8), epx::span<float>(w.data(), 7));
      },
      epx::errc::input);
  CHECK(has(m, "weights (7)"));
  // Zero tokens: nothing to do, but the parameters are still validated.
  routing::route(routing::topk_softmax{}, ex, static_cast<const float*>(nullptr), 0, 8, 2, nullptr, nullptr);
  CHECK_THROWS_AS(routing::route(routing::topk_softmax{}, ex, static_cast<const float*>(nullptr), 0, 8, 9, nullptr,
                                 nullptr),
                  epx::error);
}

TEST_CASE("route_backward: bad ids, gradients and shapes") {
  const epx::exec::serial ex;
  const std::size_t N = 5;
  const int E = 6, k = 2;
  const auto l = ref::from_double<float>(ref::random_logits(N, E, 4));
  auto r = run_route(routing::topk_softmax{}, ex, l, N, E, k);
  std::vector<float> gw(N * k, 0.5f);
  std::vector<float> gl(N * E);
  const auto call = [&](const auto& p) {
    routing::route_backward(p, ex, l.data(), N, E, k, r.ids.data(), nullptr, gw.data(), gl.data());
  };
  r.ids[2 * k + 1] = 6;
  auto m = error_of([&] { call(routing::topk_softmax{}); }, epx::errc::input);
  CHECK(has(m, "token 2, slot 1 (6)"));
  r.ids[2 * k + 1] = -1;
  m = error_of([&] { call(routing::softmax_topk{true}); }, epx::errc::input);
  CHECK(has(m, "(-1)"));
  r.ids[2 * k + 1] = 0;
  gw[3 * k] = std::nanf("");
  m = error_of([&] { call(routing::sigmoid_bias{}); }, epx::errc::input);
  CHECK(has(m, "grad_weights of token 3, slot 0"));
  gw[3 * k] = 0.0f;
  auto lbad = l;
  lbad[E + 2] = std::numeric_limits<float>::infinity();
  m = error_of(
      [&] {
        routing::route_backward(routing::topk_softmax{}, ex, lbad.data(), N, E, k, r.ids.data(), nullptr, gw.data(),
                                gl.data());
      },
      epx::errc::input);
  CHECK(has(m, "token 1, expert 2"));
  m = error_of(
      [&] {
        routing::route_backward(routing::topk_softmax{}, ex, epx::span<const float>(l.data(), l.size()), E, k,
                                epx::make_span(r.ids), epx::span<const float>(), epx::make_span(gw),
                                epx::span<float>(gl.data(), 7));
      },
      epx::errc::input);
  CHECK(has(m, "grad_logits (7)"));
  m = error_of([&] { routing::route_backward(routing::topk_softmax{}, ex, l.data(), N, E, 7, r.ids.data(), nullptr,
                                             gw.data(), gl.data()); },
               epx::errc::input);
  CHECK(has(m, "top_k (7)"));
}

TEST_CASE("route: null buffers for N > 0 and route_backward's spans of other sizes than N * k") {
  const epx::exec::serial ex;
  const std::size_t N = 3;
  const int E = 4, k = 2;
  std::vector<float> l(N * E, 0.25f), w(N * k), gw(N * k, 1.0f), gl(N * E, -7.0f);
  std::vector<std::int32_t> ids(N * k);
  auto m = error_of([&] { routing::route(routing::softmax_topk{}, ex, l.data(), N, E, k, nullptr, w.data()); },
                    epx::errc::input);
  CHECK(has(m, "route(softmax_topk): null logits, ids or weights for N = 3 tokens"));
  m = error_of([&] {
    routing::route(routing::sigmoid_bias{}, ex, static_cast<const float*>(nullptr), N, E, k, ids.data(), w.data());
  }, epx::errc::input);
  CHECK(has(m, "route(sigmoid_bias): null logits, ids or weights for N = 3 tokens"));
  routing::route(routing::topk_softmax{}, ex, l.data(), N, E, k, ids.data(), w.data());
  m = error_of([&] {
    routing::route_backward(routing::topk_softmax{}, ex, l.data(), N, E, k, ids.data(), nullptr, gw.data(), nullptr);
  }, epx::errc::input);
  CHECK(has(m, "route_backward(topk_softmax): null logits, ids, grad_weights or grad_logits for N = 3 tokens"));
  m = error_of([&] {
    routing::route_backward(routing::topk_softmax{}, ex, l.data(), N, E, k, ids.data(), nullptr, nullptr, gl.data());
  }, epx::errc::input);
  CHECK(has(m, "null logits, ids, grad_weights or grad_logits"));
  for (float g : gl) CHECK(g == -7.0f);  // nothing written
  // The span form: ids, weights (when given) and grad_weights must each hold N * k values.
  const auto backward = [&](std::size_t nids, std::size_t nw, std::size_t ngw) {
    routing::route_backward(routing::topk_softmax{}, ex, epx::span<const float>(l), E, k,
                            epx::span<const std::int32_t>(ids.data(), nids), epx::span<const float>(w.data(), nw),
                            epx::span<const float>(gw.data(), ngw), epx::make_span(gl));
  };
  m = error_of([&] { backward(5, 6, 6); }, epx::errc::input);
  CHECK(has(m, "route_backward: ids (5), weights (6) and grad_weights (6) must hold N * k = 3 * 2 values"));
  m = error_of([&] { backward(6, 4, 6); }, epx::errc::input);
  CHECK(has(m, "route_backward: ids (6), weights (4) and grad_weights (6) must hold N * k = 3 * 2 values"));
  m = error_of([&] { backward(6, 0, 5); }, epx::errc::input);
  CHECK(has(m, "route_backward: ids (6), weights (0) and grad_weights (5) must hold N * k = 3 * 2 values"));
  backward(6, 0, 6);  // no weights: fine
  m = error_of([&] {
    routing::route(routing::topk_softmax{}, ex, epx::span<const float>(l), E, k, epx::span<std::int32_t>(ids.data(), 4),
                   epx::make_span(w));
  }, epx::errc::input);
  CHECK(has(m, "route: ids (4) and weights (6) must hold N * k = 3 * 2 values"));
}

TEST_CASE("route: the span forms name a bad k or E before the sizes") {
  const epx::exec::serial ex;
  std::vector<float> l(32, 0.0f), w(8), gw(8), gl(32);
  std::vector<std::int32_t> ids(8);
  auto m = error_of([&] {
    routing::route(routing::softmax_topk{}, ex, epx::make_span(l), 8, 0, epx::make_span(ids), epx::make_span(w));
  }, epx::errc::input);
  CHECK(has(m, "route(softmax_topk): top_k (0) must be in [1, E] with E = 8"));
  m = error_of([&] {
    routing::route(routing::softmax_topk{}, ex, epx::make_span(l), 0, 2, epx::make_span(ids), epx::make_span(w));
  }, epx::errc::input);
  CHECK(has(m, "route(softmax_topk): number of experts E (0) must be at least 1"));
  m = error_of([&] {
    routing::route_backward(routing::softmax_topk{}, ex, epx::make_span(l), 8, 9, epx::span<const std::int32_t>(ids),
                            epx::span<const float>(w), epx::span<const float>(gw), epx::make_span(gl));
  }, epx::errc::input);
  CHECK(has(m, "route_backward(softmax_topk): top_k (9) must be in [1, E] with E = 8"));
}

TEST_CASE("route: sigmoid_bias divides by the sum before the scaling (a large scaling stays finite)") {
  const epx::exec::serial ex;
  const int E = 4, k = 2;
  const std::vector<float> l = {-30.0f, -31.0f, -40.0f, -45.0f};  // sigmoids near 1e-13: the sum is tiny
  const auto r = run_route(routing::sigmoid_bias{nullptr, 1, 1, 1e20f, true}, ex, l, 1, E, k);
  const float s0 = 1.0f / (1.0f + std::exp(30.0f)), s1 = 1.0f / (1.0f + std::exp(31.0f));
  for (int j = 0; j < k; ++j) {
    CAPTURE(j);
    CHECK(std::isfinite(r.weights[static_cast<std::size_t>(j)]));
    const float s = j == 0 ? s0 : s1;
    CHECK(r.weights[static_cast<std::size_t>(j)] == doctest::Approx(s / (s0 + s1) * 1e20f).epsilon(1e-5));
  }
}

TEST_CASE("route: span forms accept mutable and const logits alike") {
  const epx::exec::serial ex;
  const std::size_t N = 9;
  const int E = 12, k = 3;
  auto l = ref::from_double<epx::fp16>(ref::random_logits(N, E, 31));
  std::vector<std::int32_t> ids(N * k), ids2(N * k);
  std::vector<float> w(N * k), w2(N * k);
  routing::route(routing::softmax_topk{true}, ex, epx::make_span(l), E, k, epx::make_span(ids), epx::make_span(w));
  const auto& cl = l;
  routing::route(routing::softmax_topk{true}, ex, epx::make_span(cl), E, k, epx::make_span(ids2), epx::make_span(w2));
  CHECK(ids == ids2);
  CHECK(w == w2);
  std::vector<float> gw(N * k, 1.0f), gl(N * E), gl2(N * E);
  routing::route_backward(routing::softmax_topk{true}, ex, epx::make_span(l), E, k, epx::make_span(ids),
                          epx::make_span(w), epx::make_span(gw), epx::make_span(gl));
  routing::route_backward(routing::softmax_topk{true}, ex, l.data(), N, E, k, ids.data(), nullptr, gw.data(),
                          gl2.data());
  CHECK(gl == gl2);
  // Renormalised weights sum to 1, so a constant upstream gradient gives zero.
  for (float g : gl) CHECK(std::abs(g) < 1e-6f);
}

TEST_CASE("route: extreme finite logits give finite weights and gradients") {
  const epx::exec::serial ex;
  const int E = 6, k = 3;
  const std::vector<double> ld = {1000.0, -1000.0, 88.0, -88.0, 0.0, 30000.0,   // token 0
                                  -1e4,   -1e4,    -1e4, -1e4,  -1e4, -1e4,     // token 1: all equal, very negative
                                  -60.0,  -70.0,   -95.0, -90.0,  -85.0,  -75.0};   // token 2: tiny sigmoids
  const std::size_t N = ld.size() / E;
  const auto l = ref::from_double<float>(ld);
  const auto gwd = ref::random_normal(N, k, 77);
  const auto gw = ref::from_double<float>(gwd);
  const auto check = [&](const auto& p) {
    const auto r = run_route(p, ex, l, N, E, k);
    const auto want = ref_route(p, ld, N, E, k);
    CHECK(r.ids == want.ids);
    ref::check_close(r.weights, want.weights, 1e-6, 1e-5, "weights");
    const auto gl = run_backward(p, ex, l, N, E, k, r.ids, gw);
    for (float g : gl) CHECK(std::isfinite(g));
    ref::check_close(gl, ref_backward(p, ld, N, E, k, r.ids, gwd), 1e-6, 1e-5, "grad_logits");
  };
  check(routing::softmax_topk{});
  check(routing::softmax_topk{true});
  check(routing::topk_softmax{});
  check(routing::sigmoid_bias{});
  check(routing::sigmoid_bias{nullptr, 3, 2, 1.5f, false});
}

TEST_CASE("route: sigmoids of logits from -88 to -103 stay apart as float32 subnormals") {
  // 1 / (1 + exp(-x)) rounds to 0 once exp(-x) overflows (x < -88.7); the selection would
  // then see equal keys and take the lowest ids. Here the float64 order is 1, 3, 0, 2.
  for (const float x : {-88.0f, -90.0f, -95.0f, -99.0f, -103.0f}) {
    CAPTURE(x);
    const double want = 1.0 / (1.0 + std::exp(-static_cast<double>(x)));
    const float got = epx::routing::detail::sigmoid_f32(x);
    CHECK(got > 0.0f);
    CHECK(std::fabs(static_cast<double>(got) - want) <= want * 1e-5 + 0x1p-148);  // two subnormal spacings
  }
  const epx::exec::serial ex;
  const int E = 4, k = 2;
  const std::vector<double> ld = {-95.0, -90.0, -99.0, -92.0};
  const auto l = ref::from_double<float>(ld);
  for (const auto& p : {routing::sigmoid_bias{}, routing::sigmoid_bias{nullptr, 1, 1, 1.0f, false}}) {
    CAPTURE(p.normalize);
    const auto r = run_route(p, ex, l, 1, E, k);
    const auto want = ref_route(p, ld, 1, E, k);
    CHECK(want.ids == std::vector<std::int32_t>{1, 3});
    CHECK(r.ids == want.ids);
    for (int j = 0; j < k; ++j) {
      CAPTURE(j);
      const auto i = static_cast<std::size_t>(j);
      CHECK(r.weights[i] > 0.0f);
      CHECK(std::fabs(static_cast<double>(r.weights[i]) - want.weights[i]) <= want.weights[i] * 1e-2);
    }
  }
}

}  // namespace test_routing_cpp
