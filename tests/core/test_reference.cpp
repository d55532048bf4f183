// Self-checks of the float64 reference (tests/support/reference.hpp): its backward passes
// against finite differences of its forward passes, its generators against their stated
// properties, and test_linear_experts against linear_experts.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include "epx/exec/host.hpp"
#include "epx/impl/experts.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_reference_cpp {

namespace ref = epx::ref;

namespace {

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

TEST_CASE("reference routing backward matches finite differences") {
  const std::size_t N = 6;
  for (int E : {4, 9, 16}) {
    for (int k : {1, 2, 4}) {
      if (k > E) continue;
      CAPTURE(E);
      CAPTURE(k);
      const auto logits = ref::random_logits(N, E, 100 + E * 7 + k);
      const auto gw = ref::random_normal(N, k, 200 + E + k);
      ref::sigmoid_bias_params sp;
      sp.bias = ref::random_normal(1, E, 300 + E, 0.1);
      sp.scaling = 2.5;
      struct variant {
        const char* name;
        std::function<ref::routing_result(const std::vector<double>&)> fwd;
        std::function<std::vector<double>(const std::vector<double>&, const std::vector<std::int32_t>&)> bwd;
      };
      std::vector<variant> vs;
      for (bool renorm : {false, true})
        vs.push_back({renorm ? "softmax_topk renorm" : "softmax_topk",
                      [=](const std::vector<double>& l) { return ref::softmax_topk(l, N, E, k, renorm); },
                      [=](const std::vector<double>& l, const std::vector<std::int32_t>& ids) {
                        return ref::softmax_topk_backward(l, N, E, k, renorm, ids, gw);
                      }});
      vs.push_back({"topk_softmax", [=](const std::vector<double>& l) { return ref::topk_softmax(l, N, E, k); },
                    [=](const std::vector<double>& l, const std::vector<std::int32_t>& ids) {
                      return ref::topk_softmax_backward(l, N, E, k, ids, gw);
                    }});
      for (bool norm : {false, true}) {
        auto p = sp;
        p.normalize = norm;
        vs.push_back({norm ? "sigmoid_bias normalize" : "sigmoid_bias",
                      [=](const std::vector<double>& l) { return ref::sigmoid_bias(l, N, E, k, p); },
                      [=](const std::vector<double>& l, const std::vector<std::int32_t>& ids) {
                        return ref::sigmoid_bias_backward(l, N, E, k, p, ids, gw);
                      }});
      }
      for (auto& v : vs) {
        const std::string name = v.name;
        CAPTURE(name);
        const auto r0 = v.fwd(logits);
        for (double m : r0.margin) REQUIRE(m > 1e-4);  // selection stable under the FD step
        const auto fd = ref::finite_difference(
            [&](const std::vector<double>& l) {
              const auto r = v.fwd(l);
              REQUIRE(r.ids == r0.ids);
              return dot(r.weights, gw);
            },
            logits, 1e-6);
        const auto an = v.bwd(logits, r0.ids);
        ref::check_close(an, fd, 1e-7, 1e-6, v.name);
      }
    }
  }
}

TEST_CASE("reference routing: renormalized softmax_topk equals topk_softmax") {
  const std::size_t N = 20;
  const int E = 12, k = 3;
  const auto logits = ref::random_logits(N, E, 5);
  const auto a = ref::softmax_topk(logits, N, E, k, true);
  const auto b = ref::topk_softmax(logits, N, E, k);
  CHECK(a.ids == b.ids);
  ref::check_close(a.weights, b.weights, 1e-14, 1e-12, "weights");
  const auto gw = ref::random_normal(N, k, 6);
  ref::check_close(ref::softmax_topk_backward(logits, N, E, k, true, a.ids, gw),
                   ref::topk_softmax_backward(logits, N, E, k, b.ids, gw), 1e-14, 1e-12, "grad_logits");
}

TEST_CASE("reference routing: selection rules, ties and groups") {
  // Ties go to the lower expert id, slots ordered by score.
  const std::vector<double> l = {1.0, 3.0, 3.0, 0.5, 3.0};
  auto r = ref::topk_softmax(l, 1, 5, 2);
  CHECK(r.ids == std::vector<std::int32_t>{1, 2});
  CHECK(r.weights[0] == doctest::Approx(0.5));
  CHECK(r.margin[0] == 0.0);
  r = ref::softmax_topk(l, 1, 5, 4, false);
  CHECK(r.ids == std::vector<std::int32_t>{1, 2, 4, 0});

  // Groups: E = 8, 4 groups of 2; group scores = pair sums of s + bias.
  ref::sigmoid_bias_params p;
  p.n_group = 4;
  p.topk_group = 2;
  p.bias = std::vector<double>(8, 0.0);
  // logits chosen so that expert 7 alone is best but group 3 = {6, 7} has a poor partner,
  // while groups 0 and 1 have two good members each.
  const std::vector<double> g = {2.0, 2.0, 1.9, 1.9, -5, -5, -5, 4.0};
  r = ref::sigmoid_bias(g, 1, 8, 2, p);
  CHECK(r.ids == std::vector<std::int32_t>{0, 1});  // expert 7 not eligible: its group lost
  p.n_group = 1;
  p.topk_group = 1;
  r = ref::sigmoid_bias(g, 1, 8, 2, p);
  CHECK(r.ids == std::vector<std::int32_t>{7, 0});
  // Bias changes selection only.
  p.bias[3] = 1.0;
  p.normalize = false;
  p.scaling = 2.0;
  r = ref::sigmoid_bias(g, 1, 8, 2, p);
  CHECK(r.ids == std::vector<std::int32_t>{3, 7});
  CHECK(r.weights[0] == doctest::Approx(2.0 * ref::sigmoid(1.9)));
}

namespace {

template <class Experts>
void check_moe_backward_fd(const Experts& ex0, std::size_t N, int k, std::uint64_t seed) {
  const int H = ex0.H, E = ex0.E;
  const auto x = ref::random_x(N, H, seed);
  const auto ids = ref::random_routing(N, E, k, seed + 1);
  const auto w = ref::random_weights(N, k, seed + 2);
  const auto go = ref::random_normal(N, H, seed + 3);
  const auto g = ref::moe_backward(x, ids, w, go, ex0);

  const auto fx = ref::finite_difference(
      [&](const std::vector<double>& xx) { return dot(ref::moe_forward(xx, ids, w, ex0), go); }, x);
  ref::check_close(g.grad_x, fx, 1e-7, 1e-6, "grad_x");
  const auto fw = ref::finite_difference(
      [&](const std::vector<double>& ww) { return dot(ref::moe_forward(x, ids, ww, ex0), go); }, w);
  ref::check_close(g.grad_w, fw, 1e-7, 1e-6, "grad_w");
  const auto fp = ref::finite_difference(
      [&](const std::vector<double>& pp) {
        Experts ex = ex0;
        ex.params = pp;
        return dot(ref::moe_forward(x, ids, w, ex), go);
      },
      ex0.params);
  ref::check_close(g.grad_params, fp, 1e-7, 1e-6, "grad_params");
  // Experts that received nothing have exactly zero gradient.
  const auto counts = ref::expert_counts(ids, E);
  const std::size_t P = ex0.params_per_expert();
  for (int e = 0; e < E; ++e)
    if (counts[e] == 0)
      for (std::size_t i = 0; i < P; ++i) CHECK(g.grad_params[e * P + i] == 0.0);
}

}  // namespace

TEST_CASE("reference moe_backward matches finite differences of moe_forward") {
  SUBCASE("linear experts") { check_moe_backward_fd(ref::linear_experts::random(5, 3, 11), 4, 2, 21); }
  SUBCASE("linear experts k=1") { check_moe_backward_fd(ref::linear_experts::random(3, 4, 12), 5, 1, 22); }
  SUBCASE("swiglu experts") { check_moe_backward_fd(ref::swiglu_experts::random(4, 3, 5, 13), 4, 2, 23); }
}

TEST_CASE("reference moe_forward by hand") {
  ref::linear_experts ex(2, 2);
  // expert 0: W = [[1,2],[3,4]], b = [0.5,-1]; expert 1: W = I, b = 0
  const std::vector<double> p = {1, 2, 3, 4, 0.5, -1, 1, 0, 0, 1, 0, 0};
  ex.params = p;
  const std::vector<double> x = {1, 1};
  const std::vector<std::int32_t> ids = {0, 1};
  const std::vector<double> w = {0.25, 2.0};
  const auto out = ref::moe_forward(x, ids, w, ex);
  CHECK(out[0] == doctest::Approx(0.25 * 3.5 + 2.0));
  CHECK(out[1] == doctest::Approx(0.25 * 6.0 + 2.0));
}

TEST_CASE("reference generators") {
  const std::size_t N = 48;
  const int E = 16;
  for (int k : {1, 2, 8}) {
    CAPTURE(k);
    const auto check_distinct = [&](const std::vector<std::int32_t>& ids) {
      for (std::size_t t = 0; t < N; ++t) {
        std::set<int> s(ids.begin() + t * k, ids.begin() + (t + 1) * k);
        CHECK(static_cast<int>(s.size()) == k);
      }
    };
    const auto b = ref::balanced_routing(N, E, k, 3);
    for (auto c : ref::expert_counts(b, E)) CHECK(c == N * k / E);
    check_distinct(b);
    const auto u = ref::uneven_routing(N, E, k, 4);
    check_distinct(u);
    const auto cu = ref::expert_counts(u, E);
    if (k < 8) CHECK(*std::max_element(cu.begin(), cu.end()) > 2 * N * k / E);
    const auto allowed = ref::experts_of_ranks(E, 2, {1});
    const auto s = ref::subset_routing(N, k, allowed, 5);
    check_distinct(s);
    const auto cs = ref::expert_counts(s, E);
    for (int e = 0; e < E / 2; ++e) CHECK(cs[e] == 0);
    const auto o = ref::one_expert_routing(N, E, k, 3);
    CHECK(ref::expert_counts(o, E)[3] == N);
    check_distinct(o);
    CHECK(ref::random_routing(N, E, k, 9) == ref::random_routing(N, E, k, 9));
    CHECK(ref::random_routing(N, E, k, 9) != ref::random_routing(N, E, k, 10));
  }
}

TEST_CASE("reference hook expectation is the mean over batches") {
  const std::vector<std::vector<double>> per = {{1, 2}, {3, 6}, {5, -2}};
  const auto m = ref::expected_expert_grads_after_hook(per);
  CHECK(m[0] == doctest::Approx(3.0));
  CHECK(m[1] == doctest::Approx(2.0));
}

namespace {

struct rows_view {  // the documented fields of epx::expert_rows
  const float* rows;
  std::size_t num_rows;
  std::size_t hidden;
  const std::size_t* offsets;
  int num_local;
  int first_global_expert;
};

}  // namespace

TEST_CASE("test_linear_experts matches linear_experts") {
  const int E = 6, H = 5, ep = 3, L = E / ep, rank = 1;
  const auto global = ref::linear_experts::random(E, H, 77);
  ref::test_linear_experts<float> local(global, rank, L);
  // expert-major rows: 3 rows for local 0 (+1 zero pad row), 0 rows for local 1 (+1 pad).
  const std::vector<std::size_t> offsets = {0, 4, 5};
  auto xd = ref::random_x(5, H, 78);
  for (int h = 0; h < H; ++h) xd[3 * H + h] = xd[4 * H + h] = 0;  // pad rows are zero
  const auto x = ref::from_double<float>(xd);
  rows_view in{x.data(), 5, static_cast<std::size_t>(H), offsets.data(), L, rank * L};
  std::vector<float> y(5 * H), gx(5 * H);
  local.forward(0, in, y.data());
  auto gyd = ref::random_normal(5, H, 79);
  for (int h = 0; h < H; ++h) gyd[3 * H + h] = gyd[4 * H + h] = 0;  // pad rows get zero gradient
  const auto gy = ref::from_double<float>(gyd);
  local.backward(0, in, gy.data(), gx.data());

  std::vector<double> want_y(5 * H), want_gx(5 * H);
  auto want_grads = global.zero_grads();
  for (int r = 0; r < 5; ++r) {
    const int e = rank * L + (r < 4 ? 0 : 1);
    global.forward_row(e, &xd[r * H], &want_y[r * H]);
    global.backward_row(e, &xd[r * H], &gyd[r * H], &want_gx[r * H], want_grads);
  }
  ref::check_close(y, want_y, 1e-5, 1e-5, "y");
  ref::check_close(gx, want_gx, 1e-5, 1e-5, "grad_in");
  ref::check_close(local.grads(), ref::expert_slice(want_grads, global.params_per_expert(), rank * L, L), 1e-5,
                   1e-5, "grads");
  CHECK(local.rows_seen() == 5);
  rows_view bad = in;
  bad.first_global_expert = 0;
  CHECK_THROWS(local.forward(0, bad, y.data()));
}

// The test experts meet the library's experts concept for every activation type.
static_assert(epx::detail::has_expert_forward<ref::test_linear_experts<float>, epx::exec::serial, float>::value);
static_assert(epx::detail::has_expert_backward<ref::test_linear_experts<float>, epx::exec::serial, float>::value);
static_assert(epx::detail::has_expert_forward<ref::test_linear_experts<epx::bf16>, epx::exec::openmp, epx::bf16>::value);
static_assert(epx::detail::has_expert_backward<ref::test_linear_experts<double>, epx::exec::serial, double>::value);

TEST_CASE_TEMPLATE("test_linear_experts through epx::expert_rows", T, float, double, epx::bf16, epx::fp16) {
  const int E = 8, H = 4, L = 4, rank = 1;
  const auto global = ref::linear_experts::random(E, H, 91);
  ref::test_linear_experts<T> local(global, rank, L);
  const std::vector<std::size_t> offsets = {0, 2, 2, 5, 6};  // local expert 1 has no rows
  const auto xd = ref::round_through<T>(ref::random_x(6, H, 92));
  const auto gyd = ref::round_through<T>(ref::random_normal(6, H, 93));
  const auto x = ref::from_double<T>(xd);
  const auto gy = ref::from_double<T>(gyd);
  epx::expert_rows<const T> in;
  in.rows = x.data();
  in.num_rows = 6;
  in.hidden = H;
  in.offsets = offsets.data();
  in.num_local = L;
  in.first_global_expert = rank * L;
  std::vector<T> y(6 * H), gx(6 * H);
  local.forward(epx::exec::serial{}, in, y.data());
  local.backward(epx::exec::serial{}, in, gy.data(), gx.data());
  std::vector<double> want_y(6 * H), want_gx(6 * H);
  auto want_grads = global.zero_grads();
  for (int l = 0; l < L; ++l)
    for (std::size_t r = offsets[l]; r < offsets[l + 1]; ++r) {
      global.forward_row(rank * L + l, &xd[r * H], &want_y[r * H]);
      global.backward_row(rank * L + l, &xd[r * H], &gyd[r * H], &want_gx[r * H], want_grads);
    }
  const double tol = sizeof(T) == 2 ? (std::is_same_v<T, epx::bf16> ? 2e-2 : 3e-3) : 1e-5;
  ref::check_close(y, want_y, tol, tol, "y");
  ref::check_close(gx, want_gx, tol, tol, "grad_in");
  ref::check_close(local.grads(), ref::expert_slice(want_grads, global.params_per_expert(), rank * L, L), 1e-5, 1e-5,
                   "grads");
  CHECK(local.forward_calls() == 1);
  CHECK(local.backward_calls() == 1);
}

TEST_CASE("compare reports the worst index") {
  const std::vector<float> got = {1.0f, 2.0f, 3.5f, 4.0f};
  const std::vector<double> want = {1.0, 2.0, 3.0, 4.1};
  const auto c = ref::compare(got, want, 1e-3, 0.0, "v");
  CHECK_FALSE(c.ok);
  CHECK(c.failures == 2);
  CHECK(c.worst == 2);
  CHECK(c.message.find("index 2") != std::string::npos);
  CHECK(ref::max_abs_err(got, want) == doctest::Approx(0.5));
  CHECK(ref::compare(got, want, 0.6, 0.0).ok);
  const std::vector<float> nan = {std::nanf(""), 2, 3, 4};
  CHECK_FALSE(ref::compare(nan, want, 1.0, 1.0).ok);
}

}  // namespace test_reference_cpp
