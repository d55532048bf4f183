// The MoE layer against the float64 reference with error bounds derived from the
// arithmetic, for diagonal experts (ref::diag_experts: y = a * x + b elementwise, O(H)
// parameters, so the hidden sizes people run cost what toy sizes cost):
//   out[t]      = round_T( sum_j w_j * y_j )           sum of k products in accum_t<T>
//   grad_x[t]   = round_T( sum_j round_T(a_j * round_T(w_j * g)) )
//   grad_w[t,j] = sum_h y_j[h] * g[h]                  H products in accum_t<T>
//   expert grads: sum over the routed rows of round_T(w * g) * x (double), mean over batches
// With u = unit roundoff of T, u_a that of accum_t<T>, gamma_n = n u_a / (1 - n u_a) and
// S = sum of the terms' magnitudes (computed by the reference beside each value):
//   |out - ref| <= u |ref| + (1 + u) gamma_k S                      (+ the masked path's
//   partial sums, each rounded to T, and their sum over the EP group).
// A bf16 accumulation instead (every partial sum rounded to bf16) makes errors of order u S,
// so the bound tells the two apart (tests/core/test_layer_sizes.cpp shows that it does).
// check_diag_case<Comm, T, Impl>(world, c) runs one case on any communicator: the threads
// tests (test_layer_sizes.cpp) and the MPI ones (test_layer_sizes_mpi.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "core/layer_cases.hpp"

namespace epx::test::sizes {

namespace ref = epx::ref;

// Values and the magnitudes of their terms, float64.
struct expectation {
  std::vector<double> out, out_mag;        // [N, H]
  std::vector<double> grad_x, grad_x_mag;  // [N, H]
  std::vector<double> grad_w, grad_w_mag;  // [N, k]
  std::vector<double> grads, grads_mag, grads_abs;  // [E, 2H]; grads_abs: sum |x| (a) or the count (b)
};

// One batch through the diagonal experts (outputs rounded once to T, as the test experts do).
template <class T>
expectation expect_batch(const epx::test::batch_data& d, const ref::diag_experts& ex, int k) {
  const std::size_t H = static_cast<std::size_t>(ex.H), N = d.x.size() / H, K = static_cast<std::size_t>(k);
  expectation e;
  e.out.assign(N * H, 0.0);
  e.out_mag = e.out;
  e.grad_x = e.out;
  e.grad_x_mag = e.out;
  e.grad_w.assign(N * K, 0.0);
  e.grad_w_mag = e.grad_w;
  e.grads = ex.zero_grads();
  e.grads_mag = e.grads;
  e.grads_abs = e.grads;
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t j = 0; j < K; ++j) {
      const int id = d.ids[t * K + j];
      const double w = d.w[t * K + j];
      double* ga = e.grads.data() + static_cast<std::size_t>(id) * 2 * H;
      double* ma = e.grads_mag.data() + static_cast<std::size_t>(id) * 2 * H;
      double* ca = e.grads_abs.data() + static_cast<std::size_t>(id) * 2 * H;
      for (std::size_t h = 0; h < H; ++h) {
        const double x = d.x[t * H + h], g = d.grad_out[t * H + h];
        const double a = ex.a(id, static_cast<int>(h)), b = ex.b(id, static_cast<int>(h));
        const double y = ref::round_value<T>(std::fma(a, x, b));
        e.out[t * H + h] += w * y;
        e.out_mag[t * H + h] += std::abs(w * y);
        e.grad_w[t * K + j] += y * g;
        e.grad_w_mag[t * K + j] += std::abs(y * g);
        const double gy = w * g;
        e.grad_x[t * H + h] += a * gy;
        e.grad_x_mag[t * H + h] += std::abs(a * gy);
        ga[h] += gy * x;
        ma[h] += std::abs(gy * x);
        ca[h] += std::abs(x);
        ga[H + h] += gy;
        ma[H + h] += std::abs(gy);
        ca[H + h] += 1.0;
      }
    }
  return e;
}

// Element-wise |got - want| <= bound[i]; the text names the worst element.
template <class G>
std::string within(const std::vector<G>& got, const std::vector<double>& want, const std::vector<double>& bound,
                   const std::string& what) {
  if (got.size() != want.size()) return epx::detail::concat(what, ": size ", got.size(), " != ", want.size(), "\n");
  std::size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(ref::to_d(got[i]) - want[i]);
    const double ratio = err / bound[i];
    if (!(err <= bound[i])) ++bad;
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (bad == 0) return {};
  return epx::detail::concat(what, ": ", bad, " of ", got.size(), " elements outside the bound; worst at ", worst,
                             ": got ", ref::to_d(got[worst]), " want ", want[worst], " bound ", bound[worst],
                             " (error / bound = ", worst_ratio, ")\n");
}

// The error bounds of the layer's arithmetic (see the top of the file).
template <class T>
struct bounds {
  using A = epx::accum_t<T>;
  static constexpr double u = ref::unit_roundoff<T>(), ua = ref::unit_roundoff<A>(), eta = ref::subnormal_half<T>();
  int k = 1;
  int partials = 1;  // masked path: the EP group's partial sums (each rounded to T); per-rank
                     // sends: a token's partial sums at up to min(k, ep) owners; else 1
  std::size_t hidden = 1;

  // Sum over the slots of terms with relative error c each, then rounded to T.
  double slot_sum(double ref_value, double S, double c) const {
    double E = c * S + ref::gamma_n(k, ua) * (1 + c) * S;
    if (partials > 1)
      E += (u + ref::gamma_n(partials, ua)) * (1 + u) * ((1 + c) * S + E) + partials * eta;
    return u * std::abs(ref_value) + (1 + u) * E + eta;
  }
  // round_T(w g) against w g.
  double c_in() const { return u + ua * (1 + u); }
  std::vector<double> out(const expectation& e) const {
    std::vector<double> b(e.out.size());
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = slot_sum(e.out[i], e.out_mag[i], 0.0);
    return b;
  }
  std::vector<double> grad_x(const expectation& e) const {
    const double cx = c_in() * (1 + u) + u;  // and the experts' rounding of a * gy
    std::vector<double> b(e.grad_x.size());
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = slot_sum(e.grad_x[i], e.grad_x_mag[i], cx) + 4 * k * eta;
    return b;
  }
  std::vector<double> grad_w(const expectation& e) const {
    const double prod = sizeof(T) == 2 ? 0.0 : ua;  // 16-bit products are exact in float
    const double to_float = std::is_same_v<T, double> ? 0x1p-24 : 0.0;
    std::vector<double> b(e.grad_w.size());
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = (prod + ref::gamma_n(static_cast<double>(hidden), ua) * (1 + prod)) * e.grad_w_mag[i] +
             to_float * std::abs(e.grad_w[i]) + 0x1p-140;
    return b;
  }
  std::vector<double> grads(const std::vector<double>& mag, const std::vector<double>& abs_terms) const {
    std::vector<double> b(mag.size());
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = (c_in() + 1e-12) * mag[i] + 2 * eta * abs_terms[i] + 1e-300;
    return b;
  }
};

template <class T>
struct diag_run {
  std::vector<T> out, grad_x;
  std::vector<float> grad_w;
  std::vector<double> expert_grads;
  epx::layer_stats stats;
  std::int64_t overflow_pairs = 0;  // bounded mode: check() after backward
};

// Forward (train), backward and the expert hook of this rank's batch with diagonal experts;
// bounded mode (spec section 11) with bound `bound_cap` when it is positive.
template <class Comm, class T, class Impl, class Exec = epx::test::test_exec>
diag_run<T> run_diag(Comm& world, const layer_case& c, const ref::diag_experts& global, std::int64_t bound_cap = 0) {
  const epx::mesh m(c.topology);
  const int rank = world.rank(), b = m.batch(rank);
  const auto d = epx::test::make_batch<T>(c, b);
  const std::size_t N = c.rows_of(b), H = static_cast<std::size_t>(c.hidden), K = static_cast<std::size_t>(c.top_k);
  epx::layer_options o = epx::test::options_for(c);
  if (bound_cap > 0) {
    o.counts = epx::count_exchange::device;
    o.bound.cap = bound_cap;
  }
  epx::moe_layer<Comm, T, Impl, Exec> layer(m, world, o);
  ref::test_diag_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
  const auto x = ref::from_double<T>(d.x);
  const auto go = ref::from_double<T>(d.grad_out);
  const std::vector<float> w(d.w.begin(), d.w.end());
  diag_run<T> r;
  r.out.assign(N * H, epx::convert<T>(7.0f));
  r.grad_x.assign(N * H, epx::convert<T>(7.0f));
  r.grad_w.assign(N * K, 7.0f);
  auto saved = layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(d.ids), epx::span<const float>(w),
                             epx::span<T>(r.out), experts, epx::mode::train);
  r.stats = layer.stats();
  layer.backward(std::move(saved), epx::span<const T>(go), epx::span<T>(r.grad_x), epx::span<float>(r.grad_w),
                 experts);
  if (bound_cap > 0) r.overflow_pairs = layer.check().overflow_pairs;
  epx::gradient_hooks<Comm> hooks(m, world);
  r.expert_grads = experts.grads();
  hooks.reduce_expert(epx::span<double>(r.expert_grads));
  return r;
}

// This rank's expectation: its batch's outputs and gradients, and its local experts'
// gradients after the hook (the mean over all batches).
template <class T>
expectation expect_rank(const layer_case& c, const ref::diag_experts& global, int rank) {
  const epx::mesh m(c.topology);
  expectation mine;
  std::vector<std::vector<double>> g, gm, ga;
  for (int bb = 0; bb < m.batches(); ++bb) {
    auto e = expect_batch<T>(epx::test::make_batch<T>(c, bb), global, c.top_k);
    g.push_back(e.grads);
    gm.push_back(e.grads_mag);
    ga.push_back(e.grads_abs);
    if (bb == m.batch(rank)) mine = std::move(e);
  }
  const std::size_t P = global.params_per_expert();
  const int L = m.local_experts(), first = m.expert_begin(rank);
  mine.grads = ref::expert_slice(ref::expected_expert_grads_after_hook(g), P, first, L);
  mine.grads_mag = ref::expert_slice(ref::expected_expert_grads_after_hook(gm), P, first, L);
  mine.grads_abs = ref::expert_slice(ref::expected_expert_grads_after_hook(ga), P, first, L);
  return mine;
}

// bound_cap > 0: bounded mode with that bound, which must drop nothing.
template <class Comm, class T, class Impl = epx::impl::all_to_all>
std::string check_diag_case(Comm& world, const layer_case& c, std::int64_t bound_cap = 0) {
  std::string f;
  try {
    const auto global = ref::diag_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    const auto r = run_diag<Comm, T, Impl>(world, c, global, bound_cap);
    const auto e = expect_rank<T>(c, global, world.rank());
    bounds<T> bd;
    bd.k = c.top_k;
    bd.hidden = static_cast<std::size_t>(c.hidden);
    const bool masked = std::string(r.stats.path) == "all_reduce";
    const bool per_rank = !masked && c.sends == epx::row_sends::per_rank;
    bd.partials = masked ? c.topology.ep : per_rank ? std::min(c.top_k, c.topology.ep) : 1;
    const std::string where = epx::detail::concat(c.describe(), masked ? " masked" : "", " rank ", world.rank());
    f += within(r.out, e.out, bd.out(e), where + " out");
    f += within(r.grad_x, e.grad_x, bd.grad_x(e), where + " grad_x");
    f += within(r.grad_w, e.grad_w, bd.grad_w(e), where + " grad_weights");
    f += within(r.expert_grads, e.grads, bd.grads(e.grads_mag, e.grads_abs), where + " expert grads after hook");
    if (bound_cap > 0 && (!r.stats.bounded || r.overflow_pairs != 0))
      f += epx::detail::concat(where, ": bounded mode: stats.bounded ", r.stats.bounded, ", check().overflow_pairs ",
                               r.overflow_pairs, " (expected true, 0)\n");
    // A bounded training forward takes the staged route (the direct one is inference's).
    const bool direct = !masked && !per_rank && bound_cap == 0 && c.peer_access && epx::has_peer_access_v<Comm>;
    if (r.stats.peer_access != direct)
      f += epx::detail::concat(where, ": stats.peer_access is ", r.stats.peer_access, ", expected ", direct, "\n");
  } catch (const std::exception& ex) {
    f += epx::detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

inline layer_case make(int tp, int fsdp, int ep, int E, int k, int H, std::size_t rows, bool direct,
                routing_kind r = routing_kind::uneven) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.experts = E;
  c.top_k = k;
  c.hidden = H;
  c.routing = r;
  c.rows = [rows](int b) { return rows + static_cast<std::size_t>(b % 2); };
  c.peer_access = direct;
  c.seed = static_cast<std::uint64_t>(H * 31 + tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7);
  return c;
}

}  // namespace epx::test::sizes
