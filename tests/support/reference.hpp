// tests/support/reference.hpp: the float64 single-process reference (spec section 7).
//
// Everything here is plain double-precision math with simple loops. It does not use any
// epx routing, layout or dispatch code, so a test that compares the library against it
// compares two independent computations. Contents:
//
//   - seeded random generators (x, logits, weights, routings of several shapes);
//   - routing references for every policy of spec section 2, forward and backward;
//   - test expert families (`linear_experts`, `swiglu_experts`) with double forward and
//     backward, and the MoE forward/backward over one batch (`moe_forward`, `moe_backward`);
//   - `expected_expert_grads_after_hook` (mean of the per-batch gradients over B batches);
//   - `test_linear_experts<T>`: the same linear experts in the shape of the library's
//     experts concept (local experts of one EP rank, host loops in accum_t<T>);
//   - rounding to bf16/fp16 written without the library's converters (`format_round`,
//     `format_encode`, `round_value<T>`), rounding units, and `diag_experts` /
//     `test_diag_experts<T>`: elementwise experts with O(H) parameters for large H;
//   - comparison helpers (`compare`, `max_abs_err`, doctest `check_close`).
//
// Conventions: matrices are row-major std::vector<double>; ids are [N, k] int32 and
// weights [N, k]; slot j = 0 is the best-scoring expert of a token.
//
// Test binaries get `check_close` (a doctest check). A program without doctest (an
// example, a benchmark) defines EPX_REF_NO_DOCTEST before including this header and uses
// `compare` instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifndef EPX_REF_NO_DOCTEST
#include <doctest/doctest.h>
#endif

#include "epx/core/numeric.hpp"

namespace epx::ref {

// ---------------------------------------------------------------------------------------
// Basics
// ---------------------------------------------------------------------------------------

inline void require(bool cond, const std::string& what) {
  if (!cond) throw std::invalid_argument("epx::ref: " + what);
}

template <class T>
double to_d(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
    return static_cast<double>(static_cast<float>(v));
  } else {
    return static_cast<double>(v);
  }
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = to_d(v[i]);
  return r;
}

template <class T>
std::vector<double> to_double(const T* p, std::size_t n) {
  std::vector<double> r(n);
  for (std::size_t i = 0; i < n; ++i) r[i] = to_d(p[i]);
  return r;
}

// Converts doubles to an activation type (float, double, bf16, fp16) with round to nearest.
template <class T>
std::vector<T> from_double(const std::vector<double>& v) {
  std::vector<T> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
      r[i] = T(static_cast<float>(v[i]));
    } else {
      r[i] = static_cast<T>(v[i]);
    }
  }
  return r;
}

// Rounds every value through T and back: the exact input the library sees for type T.
template <class T>
std::vector<double> round_through(const std::vector<double>& v) {
  return to_double(from_double<T>(v));
}

// Deterministic, platform-independent generator (splitmix64).
class rng {
 public:
  explicit rng(std::uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // [0, 1)
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // [0, n)
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t s_;
};

// ---------------------------------------------------------------------------------------
// Random inputs
// ---------------------------------------------------------------------------------------

// [rows, cols] with entries normal(0, scale).
inline std::vector<double> random_normal(std::size_t rows, std::size_t cols, std::uint64_t seed,
                                         double scale = 1.0) {
  rng g(seed);
  std::vector<double> v(rows * cols);
  for (auto& e : v) e = scale * g.normal();
  return v;
}

// Activations x [N, H], entries normal(0, scale).
inline std::vector<double> random_x(std::size_t N, int H, std::uint64_t seed, double scale = 1.0) {
  return random_normal(N, static_cast<std::size_t>(H), seed ^ 0x78ull, scale);
}

// Router logits [N, E], entries normal(0, scale).
inline std::vector<double> random_logits(std::size_t N, int E, std::uint64_t seed, double scale = 2.0) {
  return random_normal(N, static_cast<std::size_t>(E), seed ^ 0x10617ull, scale);
}

// Routing weights [N, k], uniform in [lo, hi) (positive by default, like softmax outputs).
inline std::vector<double> random_weights(std::size_t N, int k, std::uint64_t seed, double lo = 0.05,
                                          double hi = 1.0) {
  rng g(seed ^ 0x3e16ull);
  std::vector<double> v(N * static_cast<std::size_t>(k));
  for (auto& e : v) e = g.uniform(lo, hi);
  return v;
}

// k distinct ids drawn uniformly from `pool` (pool.size() >= k), written to out[0..k).
inline void distinct_ids_from(rng& g, const std::vector<int>& pool, int k, std::int32_t* out) {
  require(static_cast<int>(pool.size()) >= k, "distinct_ids_from: pool smaller than k");
  std::vector<int> p = pool;
  for (int j = 0; j < k; ++j) {  // partial Fisher-Yates
    const int r = j + g.below(static_cast<int>(p.size()) - j);
    std::swap(p[j], p[r]);
    out[j] = p[j];
  }
}

inline std::vector<int> iota_experts(int E) {
  std::vector<int> v(E);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Global experts owned by the given EP ranks (expert e lives on rank e / L, L = E / ep).
inline std::vector<int> experts_of_ranks(int E, int ep, const std::vector<int>& ranks) {
  require(ep >= 1 && E % ep == 0, "experts_of_ranks: E must be divisible by ep");
  const int L = E / ep;
  std::vector<int> v;
  for (int r : ranks)
    for (int l = 0; l < L; ++l) v.push_back(r * L + l);
  return v;
}

// Uniform random routing: k distinct experts per token. ids [N, k].
inline std::vector<std::int32_t> random_routing(std::size_t N, int E, int k, std::uint64_t seed) {
  rng g(seed ^ 0x5a11ull);
  std::vector<std::int32_t> ids(N * k);
  const auto pool = iota_experts(E);
  for (std::size_t t = 0; t < N; ++t) distinct_ids_from(g, pool, k, &ids[t * k]);
  return ids;
}

// Balanced routing: every expert receives exactly N*k/E pairs and each token has k
// distinct experts. Requires N*k % E == 0 and k <= E.
inline std::vector<std::int32_t> balanced_routing(std::size_t N, int E, int k, std::uint64_t seed) {
  require(k >= 1 && k <= E, "balanced_routing: need 1 <= k <= E");
  require((N * static_cast<std::size_t>(k)) % static_cast<std::size_t>(E) == 0,
          "balanced_routing: N*k must be a multiple of E");
  rng g(seed ^ 0xba1ull);
  std::vector<int> relabel = iota_experts(E);
  for (int i = E - 1; i > 0; --i) std::swap(relabel[i], relabel[g.below(i + 1)]);
  std::vector<std::int32_t> ids(N * k);
  for (std::size_t t = 0; t < N; ++t) {
    // k consecutive pair indices modulo E are distinct; each residue occurs N*k/E times.
    for (int j = 0; j < k; ++j) ids[t * k + j] = relabel[(t * k + j) % E];
    for (int j = k - 1; j > 0; --j) std::swap(ids[t * k + j], ids[t * k + g.below(j + 1)]);
  }
  return ids;
}

// Uneven routing: k distinct experts per token with probability of expert e proportional
// to 1 / (1 + perm(e))^skew (a random expert order), so a few experts get most pairs.
inline std::vector<std::int32_t> uneven_routing(std::size_t N, int E, int k, std::uint64_t seed,
                                                double skew = 1.5) {
  require(k >= 1 && k <= E, "uneven_routing: need 1 <= k <= E");
  rng g(seed ^ 0x0e7e4ull);
  std::vector<int> perm = iota_experts(E);
  for (int i = E - 1; i > 0; --i) std::swap(perm[i], perm[g.below(i + 1)]);
  std::vector<double> p(E);
  for (int e = 0; e < E; ++e) p[e] = 1.0 / std::pow(1.0 + perm[e], skew);
  std::vector<std::int32_t> ids(N * k);
  for (std::size_t t = 0; t < N; ++t) {
    std::vector<double> q = p;
    for (int j = 0; j < k; ++j) {
      double total = 0;
      for (double v : q) total += v;
      double r = g.uniform() * total;
      int pick = -1;
      for (int e = 0; e < E; ++e) {
        if (q[e] <= 0) continue;
        pick = e;  // the last positive one absorbs rounding
        if (r < q[e]) break;
        r -= q[e];
      }
      ids[t * k + j] = pick;
      q[pick] = 0;
    }
  }
  return ids;
}

// Every token goes to the same k experts: {e, e+1, ..., e+k-1} mod E (for k = 1 every
// token goes to expert e alone).
inline std::vector<std::int32_t> one_expert_routing(std::size_t N, int E, int k, int e = 0) {
  require(k >= 1 && k <= E && e >= 0 && e < E, "one_expert_routing: bad k or e");
  std::vector<std::int32_t> ids(N * k);
  for (std::size_t t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) ids[t * k + j] = (e + j) % E;
  return ids;
}

// Random distinct ids restricted to `allowed` experts (e.g. experts_of_ranks(E, ep, {0}))
// so that the experts of every other rank receive nothing.
inline std::vector<std::int32_t> subset_routing(std::size_t N, int k, const std::vector<int>& allowed,
                                                std::uint64_t seed) {
  require(static_cast<int>(allowed.size()) >= k, "subset_routing: fewer allowed experts than k");
  rng g(seed ^ 0x50b5e7ull);
  std::vector<std::int32_t> ids(N * k);
  for (std::size_t t = 0; t < N; ++t) distinct_ids_from(g, allowed, k, &ids[t * k]);
  return ids;
}

// Tokens per expert of a routing: counts[E].
inline std::vector<std::size_t> expert_counts(const std::vector<std::int32_t>& ids, int E) {
  std::vector<std::size_t> c(E, 0);
  for (auto id : ids) {
    require(id >= 0 && id < E, "expert_counts: id out of range");
    ++c[id];
  }
  return c;
}

// ---------------------------------------------------------------------------------------
// Routing references (spec section 2), float64
// ---------------------------------------------------------------------------------------

struct routing_result {
  std::vector<std::int32_t> ids;  // [N, k], slot 0 = best
  std::vector<double> weights;    // [N, k]
  // Per token: the smallest gap between a selection score that was taken and one that was
  // not (k-th vs (k+1)-th expert, and kept vs dropped group scores; softmax_topk measures
  // it in logits, see there). Tests compare ids exactly only where this exceeds float32
  // rounding; +inf when nothing was left out.
  std::vector<double> margin;  // [N]
};

namespace detail {

// Indices of the k largest keys among `cand`, by key descending, ties to the lower index.
// Returns the gap between the k-th key taken and the best key left out (+inf if none).
inline double topk_of(const double* key, const std::vector<int>& cand, int k, std::int32_t* out) {
  std::vector<int> c = cand;
  std::stable_sort(c.begin(), c.end(), [&](int a, int b) {
    if (key[a] != key[b]) return key[a] > key[b];
    return a < b;
  });
  for (int j = 0; j < k; ++j) out[j] = c[j];
  if (static_cast<int>(c.size()) == k) return std::numeric_limits<double>::infinity();
  return key[c[k - 1]] - key[c[k]];
}

// The smallest |l[a] - l[b]| between a selected expert a (one of the k `ids`) and an
// unselected expert b, +inf if every expert is selected. Where the selection follows the
// logits this is the k-th largest logit minus the (k+1)-th.
inline double logit_gap(const double* l, int E, int k, const std::int32_t* ids) {
  std::vector<char> selected(E, 0);
  for (int j = 0; j < k; ++j) selected[ids[j]] = 1;
  double gap = std::numeric_limits<double>::infinity();
  for (int j = 0; j < k; ++j)
    for (int b = 0; b < E; ++b)
      if (!selected[b]) gap = std::min(gap, std::abs(l[ids[j]] - l[b]));
  return gap;
}

inline void check_route_args(std::size_t n_logits, std::size_t N, int E, int k) {
  require(E >= 1 && k >= 1 && k <= E, "routing: need E >= 1 and 1 <= k <= E");
  require(n_logits == N * static_cast<std::size_t>(E), "routing: logits must hold N*E values");
}

}  // namespace detail

// Node-limited routing (spec section 10): node g holds experts [g*E/nodes, (g+1)*E/nodes);
// a token may use the max_nodes best nodes. No limit when max_nodes is 0 or >= nodes.
struct node_limit_params {
  int nodes = 0;
  int max_nodes = 0;
  bool active() const { return max_nodes > 0 && max_nodes < nodes; }
};

namespace detail {

// The experts a token may choose from: with an active limit, those of the max_nodes nodes
// whose ceil(k / max_nodes) best `score` values have the largest sum (ties to the lower
// node); every expert otherwise. Lowers `margin` to the gap between the last kept and the
// best dropped node score.
inline std::vector<int> node_candidates(const double* score, int E, int k, const node_limit_params& nl,
                                        double& margin) {
  if (!nl.active()) return iota_experts(E);
  require(E % nl.nodes == 0 && k <= nl.max_nodes * (E / nl.nodes), "node limit: bad nodes, max_nodes or k");
  const int per = E / nl.nodes, best = (k + nl.max_nodes - 1) / nl.max_nodes;
  std::vector<double> nscore(nl.nodes);
  for (int g = 0; g < nl.nodes; ++g) {
    std::vector<double> v(score + g * per, score + (g + 1) * per);
    std::sort(v.begin(), v.end(), std::greater<double>());
    nscore[g] = 0;
    for (int i = 0; i < best; ++i) nscore[g] += v[i];
  }
  std::vector<std::int32_t> kept(nl.max_nodes);
  margin = std::min(margin, topk_of(nscore.data(), iota_experts(nl.nodes), nl.max_nodes, kept.data()));
  std::sort(kept.begin(), kept.end());
  std::vector<int> cand;
  for (int g : kept)
    for (int i = 0; i < per; ++i) cand.push_back(g * per + i);
  return cand;
}

// logit_gap restricted to the candidates `cand` (the selected ids are among them).
inline double logit_gap_in(const double* l, const std::vector<int>& cand, int k, const std::int32_t* ids) {
  double gap = std::numeric_limits<double>::infinity();
  for (int j = 0; j < k; ++j)
    for (int b : cand)
      if (std::find(ids, ids + k, b) == ids + k) gap = std::min(gap, std::abs(l[ids[j]] - l[b]));
  return gap;
}

}  // namespace detail

// p = softmax(logits) per token; the top-k of p as a float32 value (the spec's p is
// float32), ties to the lower id: experts whose p round to the same float32 tie even where
// their logits differ (logits 0 and 1e-8; logits so low that p rounds to 0). The float32 p
// here is the float64 p rounded once; the library computes it in float32 and may land an
// ulp or two away, which matters only for near ties, so the margin is the smallest logit
// gap between a selected and an unselected expert (a gap in log p, the scale on which
// float32 rounds p): 0 for equal logits, which tie in both, tiny for a tie made by
// rounding, which tests do not compare. Weights are the float64 p at the selected ids,
// divided by their sum when `renormalize`.
// With a node limit, nodes are scored by the float64 p and the margin also holds the node
// score gap (see node_candidates).
inline routing_result softmax_topk(const std::vector<double>& logits, std::size_t N, int E, int k,
                                   bool renormalize, const node_limit_params& nl = {}) {
  detail::check_route_args(logits.size(), N, E, k);
  routing_result r{std::vector<std::int32_t>(N * k), std::vector<double>(N * k), std::vector<double>(N)};
  std::vector<double> p32(E), p(E);
  for (std::size_t t = 0; t < N; ++t) {
    const double* l = &logits[t * E];
    double mx = l[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    double z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(l[e] - mx);
    for (int e = 0; e < E; ++e) p32[e] = static_cast<float>(p[e] = std::exp(l[e] - mx) / z);
    double margin = std::numeric_limits<double>::infinity();
    const auto cand = detail::node_candidates(p.data(), E, k, nl, margin);
    detail::topk_of(p32.data(), cand, k, &r.ids[t * k]);
    r.margin[t] = std::min(margin, detail::logit_gap_in(l, cand, k, &r.ids[t * k]));
    double s = 0;
    for (int j = 0; j < k; ++j) {
      r.weights[t * k + j] = std::exp(l[r.ids[t * k + j]] - mx) / z;
      s += r.weights[t * k + j];
    }
    if (renormalize)
      for (int j = 0; j < k; ++j) r.weights[t * k + j] /= s;
  }
  return r;
}

// Top-k of the logits, softmax over the k selected logits.
// With a node limit, nodes are scored by p = softmax over all E logits.
inline routing_result topk_softmax(const std::vector<double>& logits, std::size_t N, int E, int k,
                                   const node_limit_params& nl = {}) {
  detail::check_route_args(logits.size(), N, E, k);
  routing_result r{std::vector<std::int32_t>(N * k), std::vector<double>(N * k), std::vector<double>(N)};
  std::vector<double> p(E);
  for (std::size_t t = 0; t < N; ++t) {
    const double* l = &logits[t * E];
    double lmx = l[0], zall = 0;
    for (int e = 1; e < E; ++e) lmx = std::max(lmx, l[e]);
    for (int e = 0; e < E; ++e) zall += std::exp(l[e] - lmx);
    for (int e = 0; e < E; ++e) p[e] = std::exp(l[e] - lmx) / zall;
    double margin = std::numeric_limits<double>::infinity();
    const auto cand = detail::node_candidates(p.data(), E, k, nl, margin);
    r.margin[t] = std::min(margin, detail::topk_of(l, cand, k, &r.ids[t * k]));
    const double mx = l[r.ids[t * k]];
    double z = 0;
    for (int j = 0; j < k; ++j) z += std::exp(l[r.ids[t * k + j]] - mx);
    for (int j = 0; j < k; ++j) r.weights[t * k + j] = std::exp(l[r.ids[t * k + j]] - mx) / z;
  }
  return r;
}

struct sigmoid_bias_params {
  std::vector<double> bias;  // [E] or empty (no bias)
  int n_group = 1;
  int topk_group = 1;
  double scaling = 1.0;
  bool normalize = true;
  node_limit_params limit = {};  // nodes scored by s + bias (only with n_group == 1)
};

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// DeepSeek-V3 routing. s = sigmoid(logits); key = s + bias. With n_group > 1 the experts
// form n_group contiguous groups of E/n_group; a group's score is the sum of its top
// min(2, E/n_group) keys; the topk_group best groups are kept (ties to the lower group)
// and the top-k keys among their experts are selected. Weights are s at the selected ids,
// divided by (sum + 1e-20) when `normalize`, times `scaling`.
inline routing_result sigmoid_bias(const std::vector<double>& logits, std::size_t N, int E, int k,
                                   const sigmoid_bias_params& prm) {
  detail::check_route_args(logits.size(), N, E, k);
  require(prm.bias.empty() || static_cast<int>(prm.bias.size()) == E, "sigmoid_bias: bias must hold E values");
  require(prm.n_group >= 1 && E % prm.n_group == 0, "sigmoid_bias: E % n_group != 0");
  require(prm.topk_group >= 1 && prm.topk_group <= prm.n_group, "sigmoid_bias: bad topk_group");
  const int gs = E / prm.n_group;
  require(k <= prm.topk_group * gs, "sigmoid_bias: k > topk_group * E / n_group");
  routing_result r{std::vector<std::int32_t>(N * k), std::vector<double>(N * k), std::vector<double>(N)};
  std::vector<double> s(E), key(E), gscore(prm.n_group);
  for (std::size_t t = 0; t < N; ++t) {
    for (int e = 0; e < E; ++e) {
      s[e] = sigmoid(logits[t * E + e]);
      key[e] = s[e] + (prm.bias.empty() ? 0.0 : prm.bias[e]);
    }
    double margin = std::numeric_limits<double>::infinity();
    std::vector<int> cand;
    if (prm.n_group == 1) {
      cand = detail::node_candidates(key.data(), E, k, prm.limit, margin);
    } else {
      const int top = std::min(2, gs);
      for (int g = 0; g < prm.n_group; ++g) {
        std::vector<int> members(gs);
        std::iota(members.begin(), members.end(), g * gs);
        std::vector<std::int32_t> best(top);
        detail::topk_of(key.data(), members, top, best.data());
        gscore[g] = 0;
        for (int i = 0; i < top; ++i) gscore[g] += key[best[i]];
      }
      std::vector<std::int32_t> kept(prm.topk_group);
      margin = std::min(margin, detail::topk_of(gscore.data(), iota_experts(prm.n_group), prm.topk_group,
                                                kept.data()));
      std::sort(kept.begin(), kept.end());
      for (int g : kept)
        for (int i = 0; i < gs; ++i) cand.push_back(g * gs + i);
    }
    margin = std::min(margin, detail::topk_of(key.data(), cand, k, &r.ids[t * k]));
    r.margin[t] = margin;
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += s[r.ids[t * k + j]];
    const double denom = prm.normalize ? sum + 1e-20 : 1.0;
    for (int j = 0; j < k; ++j) r.weights[t * k + j] = s[r.ids[t * k + j]] / denom * prm.scaling;
  }
  return r;
}

// --- routing backward: grad_weights [N, k] -> grad_logits [N, E] ------------------------

// softmax_topk: with renormalize, w = p_sel / sum(p_sel), so dL/dp_sel = (g - <g, w>) / S;
// then through the full softmax: dL/dl_i = p_i (gp_i - sum_m p_m gp_m), gp = 0 unselected.
inline std::vector<double> softmax_topk_backward(const std::vector<double>& logits, std::size_t N, int E,
                                                 int k, bool renormalize,
                                                 const std::vector<std::int32_t>& ids,
                                                 const std::vector<double>& grad_w) {
  detail::check_route_args(logits.size(), N, E, k);
  std::vector<double> gl(N * E, 0.0), p(E), gp(E);
  for (std::size_t t = 0; t < N; ++t) {
    const double* l = &logits[t * E];
    double mx = l[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    double z = 0;
    for (int e = 0; e < E; ++e) z += (p[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) p[e] /= z;
    std::fill(gp.begin(), gp.end(), 0.0);
    if (renormalize) {
      double S = 0, gw = 0;
      for (int j = 0; j < k; ++j) S += p[ids[t * k + j]];
      for (int j = 0; j < k; ++j) gw += grad_w[t * k + j] * p[ids[t * k + j]] / S;
      for (int j = 0; j < k; ++j) gp[ids[t * k + j]] += (grad_w[t * k + j] - gw) / S;
    } else {
      for (int j = 0; j < k; ++j) gp[ids[t * k + j]] += grad_w[t * k + j];
    }
    double dot = 0;
    for (int e = 0; e < E; ++e) dot += p[e] * gp[e];
    for (int e = 0; e < E; ++e) gl[t * E + e] = p[e] * (gp[e] - dot);
  }
  return gl;
}

// topk_softmax: dL/dl_{id_j} = w_j (g_j - sum_m w_m g_m); unselected logits get 0.
inline std::vector<double> topk_softmax_backward(const std::vector<double>& logits, std::size_t N, int E,
                                                 int k, const std::vector<std::int32_t>& ids,
                                                 const std::vector<double>& grad_w) {
  detail::check_route_args(logits.size(), N, E, k);
  std::vector<double> gl(N * E, 0.0), w(k);
  for (std::size_t t = 0; t < N; ++t) {
    const double* l = &logits[t * E];
    double mx = l[ids[t * k]];
    for (int j = 1; j < k; ++j) mx = std::max(mx, l[ids[t * k + j]]);
    double z = 0;
    for (int j = 0; j < k; ++j) z += (w[j] = std::exp(l[ids[t * k + j]] - mx));
    double dot = 0;
    for (int j = 0; j < k; ++j) dot += (w[j] /= z) * grad_w[t * k + j];
    for (int j = 0; j < k; ++j) gl[t * E + ids[t * k + j]] += w[j] * (grad_w[t * k + j] - dot);
  }
  return gl;
}

// sigmoid_bias: w_j = c s_j / D (D = sum s_sel + 1e-20) or c s_j; ds/dl = s (1 - s);
// the bias only selects and gets no gradient; unselected logits get 0.
inline std::vector<double> sigmoid_bias_backward(const std::vector<double>& logits, std::size_t N, int E,
                                                 int k, const sigmoid_bias_params& prm,
                                                 const std::vector<std::int32_t>& ids,
                                                 const std::vector<double>& grad_w) {
  detail::check_route_args(logits.size(), N, E, k);
  std::vector<double> gl(N * E, 0.0), s(k);
  for (std::size_t t = 0; t < N; ++t) {
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += (s[j] = sigmoid(logits[t * E + ids[t * k + j]]));
    std::vector<double> gs(k);
    if (prm.normalize) {
      const double D = sum + 1e-20;
      double dot = 0;
      for (int j = 0; j < k; ++j) dot += grad_w[t * k + j] * s[j];
      for (int j = 0; j < k; ++j) gs[j] = prm.scaling * (grad_w[t * k + j] / D - dot / (D * D));
    } else {
      for (int j = 0; j < k; ++j) gs[j] = prm.scaling * grad_w[t * k + j];
    }
    for (int j = 0; j < k; ++j) gl[t * E + ids[t * k + j]] += gs[j] * s[j] * (1.0 - s[j]);
  }
  return gl;
}

// ---------------------------------------------------------------------------------------
// Load balancing (spec section 9), float64
// ---------------------------------------------------------------------------------------

struct loss_result {
  double loss = 0;
  std::vector<double> grad;  // [N, E]: dL / dlogits
};

// Switch/GShard: L = alpha * E * sum_e f_e P_e, f_e = load_e / sum(load), P_e = mean_t p[t,e].
inline loss_result aux_loss(const std::vector<double>& logits, std::size_t N, int E,
                            const std::vector<std::int64_t>& load, double alpha) {
  require(logits.size() == N * E && static_cast<int>(load.size()) == E, "aux_loss: shapes");
  double total = 0;
  for (auto v : load) total += static_cast<double>(v);
  std::vector<double> f(E, 0.0), p(E);
  for (int e = 0; e < E; ++e) f[e] = total > 0 ? static_cast<double>(load[e]) / total : 0.0;
  loss_result r{0.0, std::vector<double>(N * E, 0.0)};
  for (std::size_t t = 0; t < N; ++t) {
    const double* l = &logits[t * E];
    double mx = l[0], z = 0, q = 0;
    for (int e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    for (int e = 0; e < E; ++e) z += std::exp(l[e] - mx);
    for (int e = 0; e < E; ++e) q += f[e] * (p[e] = std::exp(l[e] - mx) / z);
    r.loss += alpha * E * q / static_cast<double>(N);
    for (int e = 0; e < E; ++e) r.grad[t * E + e] = alpha * E / static_cast<double>(N) * p[e] * (f[e] - q);
  }
  return r;
}

// DeepSeek-V3, sequences of T tokens: L = mean over sequences of alpha * sum_e f'_e P'_e,
// f'_e = E / (k T) * #{t : e selected for t}, P'_e = mean_t s[t,e] / sum_e' s[t,e'].
inline loss_result sequence_balance_loss(const std::vector<double>& logits, const std::vector<std::int32_t>& ids,
                                         std::size_t N, int E, int k, std::size_t T, double alpha) {
  require(logits.size() == N * E && ids.size() == N * k && T >= 1 && N % T == 0, "sequence_balance_loss: shapes");
  const std::size_t nseq = N / T;
  loss_result r{0.0, std::vector<double>(N * E, 0.0)};
  std::vector<double> s(E);
  for (std::size_t q = 0; q < nseq; ++q) {
    std::vector<double> fp(E, 0.0);
    for (std::size_t t = q * T; t < (q + 1) * T; ++t)
      for (int e = 0; e < E; ++e)
        if (std::find(&ids[t * k], &ids[t * k] + k, e) != &ids[t * k] + k) fp[e] += 1.0;
    for (auto& v : fp) v *= static_cast<double>(E) / (static_cast<double>(k) * static_cast<double>(T));
    for (std::size_t t = q * T; t < (q + 1) * T; ++t) {
      double S = 0, dot = 0;
      for (int e = 0; e < E; ++e) S += (s[e] = sigmoid(logits[t * E + e]));
      for (int e = 0; e < E; ++e) dot += fp[e] * s[e] / S;
      r.loss += alpha * dot / static_cast<double>(T) / static_cast<double>(nseq);
      for (int e = 0; e < E; ++e)
        r.grad[t * E + e] = alpha / static_cast<double>(N) * (fp[e] - dot) * s[e] * (1.0 - s[e]) / S;
    }
  }
  return r;
}

// ST-MoE: L = beta * mean_t (logsumexp_e logits[t,e])^2.
inline loss_result z_loss(const std::vector<double>& logits, std::size_t N, int E, double beta) {
  require(logits.size() == N * E, "z_loss: shapes");
  loss_result r{0.0, std::vector<double>(N * E, 0.0)};
  for (std::size_t t = 0; t < N; ++t) {
    const double* l = &logits[t * E];
    double mx = l[0], z = 0;
    for (int e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    for (int e = 0; e < E; ++e) z += std::exp(l[e] - mx);
    const double lse = mx + std::log(z);
    r.loss += beta * lse * lse / static_cast<double>(N);
    for (int e = 0; e < E; ++e) r.grad[t * E + e] = beta * 2.0 / static_cast<double>(N) * lse * std::exp(l[e] - lse);
  }
  return r;
}

// DeepSeek-V3 bias update: sign(mean load - load_e), sign(0) = 0, in {-1, 0, 1}.
inline std::vector<int> bias_update_signs(const std::vector<std::int64_t>& load) {
  double mean = 0;
  for (auto v : load) mean += static_cast<double>(v);
  mean /= static_cast<double>(load.size());
  std::vector<int> sgn(load.size());
  for (std::size_t e = 0; e < load.size(); ++e) {
    const double d = mean - static_cast<double>(load[e]);
    sgn[e] = d > 0 ? 1 : d < 0 ? -1 : 0;
  }
  return sgn;
}

// Central finite difference of a scalar function at x, component-wise.
inline std::vector<double> finite_difference(const std::function<double(const std::vector<double>&)>& f,
                                             std::vector<double> x, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// ---------------------------------------------------------------------------------------
// Test experts (float64)
// ---------------------------------------------------------------------------------------
//
// An expert family holds the parameters of all E experts as one flat vector [E, P]
// (P = params_per_expert()), so parameter gradients of any family compare and reduce the
// same way. Gradient accumulators have the same [E, P] layout.

// y = W_e x + b_e, W_e [H, H] (out, in), b_e [H]. Per expert: [W_e (H*H), b_e (H)].
struct linear_experts {
  int E = 0;
  int H = 0;
  std::vector<double> params;  // [E, H*H + H]

  linear_experts() = default;
  linear_experts(int num_experts, int hidden)
      : E(num_experts), H(hidden), params(static_cast<std::size_t>(num_experts) * (hidden * hidden + hidden)) {}

  // W entries normal(0, 1/sqrt(H)), b entries normal(0, 0.1): outputs of order |x|.
  static linear_experts random(int E, int H, std::uint64_t seed) {
    linear_experts ex(E, H);
    rng g(seed ^ 0x11ea7ull);
    const double ws = 1.0 / std::sqrt(static_cast<double>(H));
    for (int e = 0; e < E; ++e) {
      double* p = ex.expert(e);
      for (int i = 0; i < H * H; ++i) p[i] = ws * g.normal();
      for (int i = 0; i < H; ++i) p[H * H + i] = 0.1 * g.normal();
    }
    return ex;
  }

  std::size_t params_per_expert() const { return static_cast<std::size_t>(H) * H + H; }
  double* expert(int e) { return params.data() + e * params_per_expert(); }
  const double* expert(int e) const { return params.data() + e * params_per_expert(); }
  std::vector<double> zero_grads() const { return std::vector<double>(params.size(), 0.0); }

  void forward_row(int e, const double* x, double* y) const {
    const double* W = expert(e);
    const double* b = W + static_cast<std::size_t>(H) * H;
    for (int o = 0; o < H; ++o) {
      double acc = b[o];
      for (int i = 0; i < H; ++i) acc += W[o * H + i] * x[i];
      y[o] = acc;
    }
  }

  // gx = W_e^T gy (overwritten); grads[e] += (gy x^T, gy).
  void backward_row(int e, const double* x, const double* gy, double* gx, std::vector<double>& grads) const {
    const double* W = expert(e);
    double* gW = grads.data() + e * params_per_expert();
    double* gb = gW + static_cast<std::size_t>(H) * H;
    for (int i = 0; i < H; ++i) gx[i] = 0;
    for (int o = 0; o < H; ++o) {
      for (int i = 0; i < H; ++i) {
        gx[i] += W[o * H + i] * gy[o];
        gW[o * H + i] += gy[o] * x[i];
      }
      gb[o] += gy[o];
    }
  }
};

// y = W2_e (silu(W1_e x) * (W3_e x)), W1, W3 [F, H], W2 [H, F].
// Per expert: [W1 (F*H), W3 (F*H), W2 (H*F)].
struct swiglu_experts {
  int E = 0;
  int H = 0;
  int F = 0;
  std::vector<double> params;  // [E, 3*F*H]

  swiglu_experts() = default;
  swiglu_experts(int num_experts, int hidden, int ffn)
      : E(num_experts), H(hidden), F(ffn), params(static_cast<std::size_t>(num_experts) * 3 * ffn * hidden) {}

  static swiglu_experts random(int E, int H, int F, std::uint64_t seed) {
    swiglu_experts ex(E, H, F);
    rng g(seed ^ 0x5e1ull);
    const double s1 = 1.0 / std::sqrt(static_cast<double>(H)), s2 = 1.0 / std::sqrt(static_cast<double>(F));
    for (int e = 0; e < E; ++e) {
      double* p = ex.expert(e);
      for (int i = 0; i < 2 * F * H; ++i) p[i] = s1 * g.normal();
      for (int i = 0; i < H * F; ++i) p[2 * F * H + i] = 2.0 * s2 * g.normal();
    }
    return ex;
  }

  std::size_t params_per_expert() const { return static_cast<std::size_t>(3) * F * H; }
  double* expert(int e) { return params.data() + e * params_per_expert(); }
  const double* expert(int e) const { return params.data() + e * params_per_expert(); }
  std::vector<double> zero_grads() const { return std::vector<double>(params.size(), 0.0); }

  static double silu(double a) { return a * sigmoid(a); }

  void forward_row(int e, const double* x, double* y) const {
    const double* W1 = expert(e);
    const double* W3 = W1 + F * H;
    const double* W2 = W3 + F * H;
    std::vector<double> h(F);
    for (int f = 0; f < F; ++f) {
      double a = 0, b = 0;
      for (int i = 0; i < H; ++i) {
        a += W1[f * H + i] * x[i];
        b += W3[f * H + i] * x[i];
      }
      h[f] = silu(a) * b;
    }
    for (int o = 0; o < H; ++o) {
      double acc = 0;
      for (int f = 0; f < F; ++f) acc += W2[o * F + f] * h[f];
      y[o] = acc;
    }
  }

  void backward_row(int e, const double* x, const double* gy, double* gx, std::vector<double>& grads) const {
    const double* W1 = expert(e);
    const double* W3 = W1 + F * H;
    const double* W2 = W3 + F * H;
    double* gW1 = grads.data() + e * params_per_expert();
    double* gW3 = gW1 + F * H;
    double* gW2 = gW3 + F * H;
    for (int i = 0; i < H; ++i) gx[i] = 0;
    for (int f = 0; f < F; ++f) {
      double a = 0, b = 0;
      for (int i = 0; i < H; ++i) {
        a += W1[f * H + i] * x[i];
        b += W3[f * H + i] * x[i];
      }
      const double sg = sigmoid(a), sa = a * sg;
      double gh = 0;
      for (int o = 0; o < H; ++o) {
        gh += W2[o * F + f] * gy[o];
        gW2[o * F + f] += gy[o] * sa * b;
      }
      const double ga = gh * b * sg * (1.0 + a * (1.0 - sg));
      const double gb = gh * sa;
      for (int i = 0; i < H; ++i) {
        gW1[f * H + i] += ga * x[i];
        gW3[f * H + i] += gb * x[i];
        gx[i] += W1[f * H + i] * ga + W3[f * H + i] * gb;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------
// One batch of the MoE layer (spec sections 5-6), float64
// ---------------------------------------------------------------------------------------

// out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]).  x [N, H], ids/w [N, k] -> out [N, H].
// `keep` [N, k] (empty: every pair): a pair with keep 0 was dropped by a capacity and adds
// nothing (spec section 8).
template <class Experts>
std::vector<double> moe_forward(const std::vector<double>& x, const std::vector<std::int32_t>& ids,
                                const std::vector<double>& w, const Experts& ex, const std::vector<char>& keep = {}) {
  const std::size_t H = static_cast<std::size_t>(ex.H);
  require(H > 0 && x.size() % H == 0, "moe_forward: x must hold N*H values");
  const std::size_t N = x.size() / H;
  require(N == 0 ? ids.empty() : ids.size() % N == 0, "moe_forward: ids must hold N*k values");
  const std::size_t k = N == 0 ? 0 : ids.size() / N;
  require(w.size() == ids.size(), "moe_forward: weights and ids differ in size");
  require(keep.empty() || keep.size() == ids.size(), "moe_forward: keep and ids differ in size");
  std::vector<double> out(N * H, 0.0), y(H);
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      require(e >= 0 && e < ex.E, "moe_forward: expert id out of range");
      if (!keep.empty() && !keep[t * k + j]) continue;
      ex.forward_row(e, &x[t * H], y.data());
      for (std::size_t h = 0; h < H; ++h) out[t * H + h] += w[t * k + j] * y[h];
    }
  return out;
}

struct moe_grads {
  std::vector<double> grad_x;       // [N, H]
  std::vector<double> grad_w;       // [N, k]
  std::vector<double> grad_params;  // [E, P], summed over this batch's tokens
};

// Backward of moe_forward: grad_y[t,j] = w[t,j] grad_out[t]; grad_w[t,j] = <y[t,j], grad_out[t]>;
// grad_x[t] = sum_j expert backward of grad_y[t,j]; parameter gradients summed over the batch.
// A dropped pair (keep 0) gets grad_w = 0 and gives no gradient.
template <class Experts>
moe_grads moe_backward(const std::vector<double>& x, const std::vector<std::int32_t>& ids,
                       const std::vector<double>& w, const std::vector<double>& grad_out, const Experts& ex,
                       const std::vector<char>& keep = {}) {
  const std::size_t H = static_cast<std::size_t>(ex.H);
  require(H > 0 && x.size() % H == 0 && grad_out.size() == x.size(), "moe_backward: x/grad_out shapes");
  const std::size_t N = x.size() / H;
  require(N == 0 ? ids.empty() : ids.size() % N == 0, "moe_backward: ids must hold N*k values");
  const std::size_t k = N == 0 ? 0 : ids.size() / N;
  require(w.size() == ids.size(), "moe_backward: weights and ids differ in size");
  require(keep.empty() || keep.size() == ids.size(), "moe_backward: keep and ids differ in size");
  moe_grads g{std::vector<double>(N * H, 0.0), std::vector<double>(N * k, 0.0), ex.zero_grads()};
  std::vector<double> y(H), gy(H), gx(H);
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      require(e >= 0 && e < ex.E, "moe_backward: expert id out of range");
      if (!keep.empty() && !keep[t * k + j]) continue;
      ex.forward_row(e, &x[t * H], y.data());
      double dot = 0;
      for (std::size_t h = 0; h < H; ++h) {
        dot += y[h] * grad_out[t * H + h];
        gy[h] = w[t * k + j] * grad_out[t * H + h];
      }
      g.grad_w[t * k + j] = dot;
      ex.backward_row(e, &x[t * H], gy.data(), gx.data(), g.grad_params);
      for (std::size_t h = 0; h < H; ++h) g.grad_x[t * H + h] += gx[h];
    }
  return g;
}

// ---------------------------------------------------------------------------------------
// Capacity and token dropping (spec section 8), per EP group
// ---------------------------------------------------------------------------------------

struct capacity_params {
  enum mode_t { off = 0, local = 1, global = 2 };
  int mode = off;
  double factor = 1.0;
  std::int64_t rows = 0;  // > 0: the capacity itself
  bool by_score = false;  // else by position
};

// keep[s] [n_s * k] for the senders of one EP group in ep-rank order; ids[s] and w[s] are
// sender s's pairs [n_s, k] (its TP slice). local: C = ceil(factor * n_s * k / E) per
// sender; global: C = ceil(factor * P / E), P all pairs of the group, filled in ep-rank
// order. The pairs kept are the first by position (row, then slot) or by score (weight
// descending, ties by position).
inline std::vector<std::vector<char>> capacity_keep(const std::vector<std::vector<std::int32_t>>& ids,
                                                    const std::vector<std::vector<double>>& w, int E, int k,
                                                    const capacity_params& c) {
  const std::size_t S = ids.size();
  std::vector<std::vector<char>> keep(S);
  for (std::size_t s = 0; s < S; ++s) keep[s].assign(ids[s].size(), 1);
  if (c.mode == capacity_params::off) return keep;
  const auto cap = [&](double pairs) {
    return c.rows > 0 ? c.rows : static_cast<std::int64_t>(std::ceil(c.factor * pairs / static_cast<double>(E)));
  };
  std::vector<std::vector<std::int64_t>> count(S, std::vector<std::int64_t>(E, 0));
  double P = 0;
  for (std::size_t s = 0; s < S; ++s) {
    for (auto e : ids[s]) ++count[s][e];
    P += static_cast<double>(ids[s].size());
  }
  for (int e = 0; e < E; ++e) {
    std::int64_t before = 0;
    for (std::size_t s = 0; s < S; ++s) {
      std::int64_t C;
      if (c.mode == capacity_params::local) {
        C = std::min(count[s][e], cap(static_cast<double>(ids[s].size())));
      } else {
        C = std::max<std::int64_t>(0, std::min(count[s][e], cap(P) - before));
        before += count[s][e];
      }
      std::vector<std::size_t> mine;  // pair indices (row, slot order)
      for (std::size_t i = 0; i < ids[s].size(); ++i)
        if (ids[s][i] == e) mine.push_back(i);
      if (c.by_score)
        std::stable_sort(mine.begin(), mine.end(), [&](std::size_t a, std::size_t b) { return w[s][a] > w[s][b]; });
      for (std::size_t r = static_cast<std::size_t>(C); r < mine.size(); ++r) keep[s][mine[r]] = 0;
    }
  }
  return keep;
}

// Expert-weight gradients after the hook (spec section 6): the mean of the per-batch
// gradients over all B = dp_replicate * fsdp batches. per_batch[b] is batch b's [E, P].
inline std::vector<double> expected_expert_grads_after_hook(const std::vector<std::vector<double>>& per_batch) {
  require(!per_batch.empty(), "expected_expert_grads_after_hook: no batches");
  std::vector<double> r(per_batch[0].size(), 0.0);
  for (const auto& b : per_batch) {
    require(b.size() == r.size(), "expected_expert_grads_after_hook: batches differ in size");
    for (std::size_t i = 0; i < r.size(); ++i) r[i] += b[i];
  }
  for (auto& v : r) v /= static_cast<double>(per_batch.size());
  return r;
}

// Dense gradients after their hook: also the mean over the B batches.
inline std::vector<double> expected_dense_grads_after_hook(const std::vector<std::vector<double>>& per_batch) {
  return expected_expert_grads_after_hook(per_batch);
}

// The rows [first_expert, first_expert + count) of an [E, P] parameter/gradient array.
inline std::vector<double> expert_slice(const std::vector<double>& all, std::size_t params_per_expert,
                                        int first_expert, int count) {
  require((static_cast<std::size_t>(first_expert) + count) * params_per_expert <= all.size(),
          "expert_slice: out of range");
  return std::vector<double>(all.begin() + first_expert * params_per_expert,
                             all.begin() + (first_expert + count) * params_per_expert);
}

// ---------------------------------------------------------------------------------------
// The linear test experts in the shape of the library's experts concept
// ---------------------------------------------------------------------------------------
//
// Holds the L local experts [first, first + L) of one EP rank, parameters rounded to
// accum_t<T>. forward/backward take any `Rows` with the fields of epx::expert_rows
// (rows, num_rows, hidden, offsets, num_local, first_global_expert) and run plain host
// loops in accum_t<T>. Parameter gradients accumulate in double, [L, H*H + H], in row
// order, so they compare with linear_experts gradients directly.
template <class T>
class test_linear_experts {
 public:
  using accum = accum_t<T>;

  // Local experts of EP rank `ep_rank` with L experts per rank: global [ep_rank*L, ep_rank*L+L).
  test_linear_experts(const linear_experts& global, int ep_rank, int L)
      : H_(global.H), L_(L), first_(ep_rank * L) {
    require(L >= 1 && first_ + L <= global.E, "test_linear_experts: experts out of range");
    const std::size_t P = global.params_per_expert();
    params_.resize(static_cast<std::size_t>(L) * P);
    for (int l = 0; l < L; ++l)
      for (std::size_t i = 0; i < P; ++i) params_[l * P + i] = static_cast<accum>(global.expert(first_ + l)[i]);
    grads_.assign(params_.size(), 0.0);
  }

  int hidden() const { return H_; }
  int num_local() const { return L_; }
  int first_global_expert() const { return first_; }
  std::size_t params_per_expert() const { return static_cast<std::size_t>(H_) * H_ + H_; }

  // [L, P] accumulated parameter gradients (double).
  const std::vector<double>& grads() const { return grads_; }
  std::vector<double>& grads() { return grads_; }
  void zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0); }

  // Calls and rows seen (pad rows included), for tests of what the layer hands in.
  std::size_t forward_calls() const { return forward_calls_; }
  std::size_t backward_calls() const { return backward_calls_; }
  std::size_t rows_seen() const { return rows_seen_; }

  // out [in.num_rows, H] = W_l row + b_l for the rows of each local expert l.
  template <class Exec, class Rows>
  void forward(const Exec&, const Rows& in, T* out) {
    check(in, "forward");
    ++forward_calls_;
    rows_seen_ += in.num_rows;
    const std::size_t P = params_per_expert();
    for (int l = 0; l < L_; ++l) {
      const accum* W = params_.data() + l * P;
      const accum* b = W + static_cast<std::size_t>(H_) * H_;
      for (std::size_t r = in.offsets[l]; r < in.offsets[l + 1]; ++r) {
        const auto* x = in.rows + r * H_;
        for (int o = 0; o < H_; ++o) {
          accum acc = b[o];
          for (int i = 0; i < H_; ++i) acc += W[o * H_ + i] * convert<accum>(x[i]);
          out[r * H_ + o] = convert<T>(acc);
        }
      }
    }
  }

  // grad_in [in.num_rows, H] = W_l^T grad_out; grads[l] += (grad_out x^T, grad_out).
  template <class Exec, class Rows>
  void backward(const Exec&, const Rows& in, const T* grad_out, T* grad_in) {
    check(in, "backward");
    ++backward_calls_;
    const std::size_t P = params_per_expert();
    std::vector<accum> gx(H_);
    for (int l = 0; l < L_; ++l) {
      const accum* W = params_.data() + l * P;
      double* gW = grads_.data() + l * P;
      double* gb = gW + static_cast<std::size_t>(H_) * H_;
      for (std::size_t r = in.offsets[l]; r < in.offsets[l + 1]; ++r) {
        const auto* x = in.rows + r * H_;
        const T* gy = grad_out + r * H_;
        std::fill(gx.begin(), gx.end(), accum(0));
        for (int o = 0; o < H_; ++o) {
          const accum g = convert<accum>(gy[o]);
          for (int i = 0; i < H_; ++i) {
            gx[i] += W[o * H_ + i] * g;
            gW[o * H_ + i] += static_cast<double>(g) * to_d(x[i]);
          }
          gb[o] += static_cast<double>(g);
        }
        for (int i = 0; i < H_; ++i) grad_in[r * H_ + i] = convert<T>(gx[i]);
      }
    }
  }

 private:
  template <class Rows>
  void check(const Rows& in, const char* what) const {
    require(static_cast<int>(in.hidden) == H_, std::string("test_linear_experts::") + what + ": hidden mismatch");
    require(in.num_local == L_, std::string("test_linear_experts::") + what + ": num_local mismatch");
    require(in.first_global_expert == first_, std::string("test_linear_experts::") + what +
                                                  ": first_global_expert mismatch");
    require(in.offsets[0] == 0 && in.offsets[L_] == in.num_rows,
            std::string("test_linear_experts::") + what + ": offsets do not span the rows");
  }

  int H_;
  int L_;
  int first_;
  std::vector<accum> params_;  // [L, H*H + H]
  std::vector<double> grads_;  // [L, H*H + H]
  std::size_t forward_calls_ = 0;
  std::size_t backward_calls_ = 0;
  std::size_t rows_seen_ = 0;
};

// ---------------------------------------------------------------------------------------
// Rounding to a 16-bit float format, independent of the library's converters
// ---------------------------------------------------------------------------------------
//
// A binary floating-point format with `man` stored significand bits and `exp_bits`
// exponent bits (IEEE layout: sign, biased exponent, significand; subnormals, infinities,
// NaN). bf16 = {7, 8}, fp16 = {10, 5}. Plain double arithmetic (ldexp, ilogb, floor): no
// bit tricks shared with epx/core/numeric.hpp, so a test can hold the library's
// conversions against it.
struct float_format {
  int man;
  int exp_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  int emin() const { return 1 - bias(); }
  int emax() const { return bias(); }
  std::uint32_t exp_mask() const { return ((1u << exp_bits) - 1u) << man; }
  std::uint32_t sign_bit() const { return 1u << (man + exp_bits); }
};
inline constexpr float_format bf16_format{7, 8};
inline constexpr float_format fp16_format{10, 5};

// The value of a bit pattern (NaN for NaN patterns).
inline double format_decode(const float_format& f, std::uint32_t bits) {
  const bool neg = (bits & f.sign_bit()) != 0;
  const std::uint32_t e = (bits & f.exp_mask()) >> f.man;
  const std::uint32_t m = bits & ((1u << f.man) - 1u);
  double v;
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), f.emin() - f.man);
  } else if (e == (1u << f.exp_bits) - 1u) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(static_cast<double>((1u << f.man) + m), static_cast<int>(e) - f.bias() - f.man);
  }
  return neg ? -v : v;
}

// The nearest value of the format to v, ties to the even significand, overflow to
// infinity (round to nearest even), as a double; NaN stays NaN.
inline double format_round(const float_format& f, double v) {
  if (std::isnan(v) || std::isinf(v) || v == 0) return v;
  const double a = std::abs(v);
  const int e = std::max(std::ilogb(a), f.emin());
  const int q = e - f.man;                      // exponent of the last significand bit
  const double n = std::ldexp(a, -q);           // exact: a power-of-two scaling
  double r = std::floor(n);
  const double frac = n - r;                    // exact
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0.0)) r += 1.0;
  double out = std::ldexp(r, q);
  // Past the largest finite value (2 - 2^-man) 2^emax: infinity.
  if (out >= std::ldexp(1.0, f.emax() + 1)) out = std::numeric_limits<double>::infinity();
  return v < 0 ? -out : out;
}

// The bit pattern of a value of the format (v = format_round(f, v), or NaN: the canonical
// quiet NaN with v's sign).
inline std::uint32_t format_encode_exact(const float_format& f, double v) {
  const std::uint32_t sign = std::signbit(v) ? f.sign_bit() : 0u;
  if (std::isnan(v)) return sign | f.exp_mask() | (1u << (f.man - 1));
  const double a = std::abs(v);
  if (std::isinf(a)) return sign | f.exp_mask();
  if (a == 0) return sign;
  if (a < std::ldexp(1.0, f.emin())) {  // subnormal: a = m 2^(emin - man)
    return sign | static_cast<std::uint32_t>(std::ldexp(a, f.man - f.emin()));
  }
  const int e = std::ilogb(a);
  const auto m = static_cast<std::uint32_t>(std::ldexp(a, f.man - e)) - (1u << f.man);
  return sign | (static_cast<std::uint32_t>(e + f.bias()) << f.man) | m;
}

// Round to nearest even, then the bits.
inline std::uint32_t format_encode(const float_format& f, double v) { return format_encode_exact(f, format_round(f, v)); }

// v rounded once to the activation type T, as a double (bf16/fp16 by format_round; float
// by the cast, which rounds to nearest even; double unchanged).
template <class T>
double round_value(double v) {
  if constexpr (std::is_same_v<T, bf16>) return format_round(bf16_format, v);
  else if constexpr (std::is_same_v<T, fp16>) return format_round(fp16_format, v);
  else if constexpr (std::is_same_v<T, float>) return static_cast<double>(static_cast<float>(v));
  else return v;
}

// v rounded once to T, as a T (the value of round_value<T>(v)).
template <class T>
T to_type_exact(double v) {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16::from_bits(static_cast<std::uint16_t>(format_encode(bf16_format, v)));
  else if constexpr (std::is_same_v<T, fp16>)
    return fp16::from_bits(static_cast<std::uint16_t>(format_encode(fp16_format, v)));
  else
    return static_cast<T>(v);
}

// The rounding unit of T (half an ulp relative: 2^-p for a p-bit significand).
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, double>) return 0x1p-53;
  else if constexpr (std::is_same_v<T, float>) return 0x1p-24;
  else if constexpr (std::is_same_v<T, fp16>) return 0x1p-11;
  else return 0x1p-8;
}
// Half the smallest subnormal of T: the absolute error of rounding below the normal range.
template <class T>
constexpr double subnormal_half() {
  if constexpr (std::is_same_v<T, double>) return 0.0;
  else if constexpr (std::is_same_v<T, float>) return 0x1p-150;
  else if constexpr (std::is_same_v<T, fp16>) return 0x1p-25;
  else return 0x1p-134;
}
// gamma_n = n u / (1 - n u): the relative error bound of n rounded operations.
inline double gamma_n(double n, double u) { return n * u / (1.0 - n * u); }

// ---------------------------------------------------------------------------------------
// Diagonal test experts: O(H) parameters, for large H
// ---------------------------------------------------------------------------------------
//
// y = a_e * x + b_e elementwise, a_e, b_e [H]. Per expert: [a_e (H), b_e (H)]. The entries
// have at most 4 significant bits (a in +-[0.25, 2), b in [-1/8, 1/8] in steps of 1/64), so
// a x is exact in float for 16-bit and float inputs and in double for any input.
// forward_row gives y in double (fma: one rounding); the test experts round it once to T.
struct diag_experts {
  int E = 0;
  int H = 0;
  std::vector<double> params;  // [E, 2H]

  diag_experts() = default;
  diag_experts(int num_experts, int hidden)
      : E(num_experts), H(hidden), params(static_cast<std::size_t>(num_experts) * 2 * hidden) {}

  static diag_experts random(int E, int H, std::uint64_t seed) {
    diag_experts ex(E, H);
    rng g(seed ^ 0xd1a6ull);
    for (int e = 0; e < E; ++e) {
      double* p = ex.expert(e);
      for (int h = 0; h < H; ++h) {
        const double mant = 1.0 + g.below(8) / 8.0;                  // 1, 1.125, ..., 1.875
        p[h] = (g.below(2) ? -1.0 : 1.0) * std::ldexp(mant, g.below(3) - 2);  // +-[0.25, 2)
        p[H + h] = (g.below(17) - 8) / 64.0;                         // [-1/8, 1/8]
      }
    }
    return ex;
  }

  std::size_t params_per_expert() const { return static_cast<std::size_t>(2) * H; }
  double* expert(int e) { return params.data() + e * params_per_expert(); }
  const double* expert(int e) const { return params.data() + e * params_per_expert(); }
  std::vector<double> zero_grads() const { return std::vector<double>(params.size(), 0.0); }

  double a(int e, int h) const { return expert(e)[h]; }
  double b(int e, int h) const { return expert(e)[H + h]; }

  void forward_row(int e, const double* x, double* y) const {
    for (int h = 0; h < H; ++h) y[h] = std::fma(a(e, h), x[h], b(e, h));
  }
  // gx = a_e gy (overwritten); grads[e] += (gy x, gy).
  void backward_row(int e, const double* x, const double* gy, double* gx, std::vector<double>& grads) const {
    double* ga = grads.data() + e * params_per_expert();
    double* gb = ga + H;
    for (int h = 0; h < H; ++h) {
      gx[h] = a(e, h) * gy[h];
      ga[h] += gy[h] * x[h];
      gb[h] += gy[h];
    }
  }
};

// The diagonal experts in the shape of the library's experts concept: the local experts
// [ep_rank*L, ep_rank*L + L). Outputs are computed in double and rounded once to T
// (to_type_exact): forward y = round_T(fma(a, x, b)), backward grad_in = round_T(a gy)
// (exact product). Parameter gradients accumulate in double, [L, 2H], in row order.
template <class T>
class test_diag_experts {
 public:
  test_diag_experts(const diag_experts& global, int ep_rank, int L) : g_(&global), L_(L), first_(ep_rank * L) {
    require(L >= 1 && first_ + L <= global.E, "test_diag_experts: experts out of range");
    grads_.assign(static_cast<std::size_t>(L) * global.params_per_expert(), 0.0);
  }

  const std::vector<double>& grads() const { return grads_; }
  std::size_t forward_calls() const { return forward_calls_; }
  std::size_t backward_calls() const { return backward_calls_; }
  std::size_t rows_seen() const { return rows_seen_; }

  template <class Exec, class Rows>
  void forward(const Exec&, const Rows& in, T* out) {
    check(in);
    ++forward_calls_;
    rows_seen_ += in.num_rows;
    const int H = g_->H;
    for (int l = 0; l < L_; ++l)
      for (std::size_t r = in.offsets[l]; r < in.offsets[l + 1]; ++r)
        for (int h = 0; h < H; ++h)
          out[r * H + h] = to_type_exact<T>(std::fma(g_->a(first_ + l, h), to_d(in.rows[r * H + h]), g_->b(first_ + l, h)));
  }

  template <class Exec, class Rows>
  void backward(const Exec&, const Rows& in, const T* grad_out, T* grad_in) {
    check(in);
    ++backward_calls_;
    const int H = g_->H;
    const std::size_t P = g_->params_per_expert();
    for (int l = 0; l < L_; ++l) {
      double* ga = grads_.data() + static_cast<std::size_t>(l) * P;
      double* gb = ga + H;
      for (std::size_t r = in.offsets[l]; r < in.offsets[l + 1]; ++r)
        for (int h = 0; h < H; ++h) {
          const double gy = to_d(grad_out[r * H + h]);
          grad_in[r * H + h] = to_type_exact<T>(g_->a(first_ + l, h) * gy);
          ga[h] += gy * to_d(in.rows[r * H + h]);
          gb[h] += gy;
        }
    }
  }

 private:
  template <class Rows>
  void check(const Rows& in) const {
    require(static_cast<int>(in.hidden) == g_->H && in.num_local == L_ && in.first_global_expert == first_ &&
                in.offsets[0] == 0 && in.offsets[L_] == in.num_rows,
            "test_diag_experts: the rows do not match these experts");
  }

  const diag_experts* g_;
  int L_;
  int first_;
  std::vector<double> grads_;
  std::size_t forward_calls_ = 0, backward_calls_ = 0, rows_seen_ = 0;
};

// ---------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------

struct comparison {
  bool ok = true;
  std::size_t count = 0;        // elements compared
  std::size_t failures = 0;     // elements outside atol + rtol*|want|
  std::size_t worst = 0;        // index of the largest excess over the tolerance
  double worst_got = 0, worst_want = 0;
  double max_abs_err = 0;
  std::string message;  // empty when ok
};

// Element-wise |got - want| <= atol + rtol*|want|; NaN in got fails. Thread-safe.
template <class G>
comparison compare(const G* got, const double* want, std::size_t n, double atol, double rtol,
                   const std::string& what = "") {
  comparison c;
  c.count = n;
  double worst_excess = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < n; ++i) {
    const double g = to_d(got[i]);
    const double err = std::abs(g - want[i]);
    const double tol = atol + rtol * std::abs(want[i]);
    const double excess = std::isnan(err) ? std::numeric_limits<double>::infinity() : err - tol;
    if (!(err <= tol)) ++c.failures;
    if (!std::isnan(err)) c.max_abs_err = std::max(c.max_abs_err, err);
    if (excess > worst_excess) {
      worst_excess = excess;
      c.worst = i;
      c.worst_got = g;
      c.worst_want = want[i];
    }
  }
  c.ok = c.failures == 0;
  if (!c.ok) {
    std::ostringstream os;
    os.precision(10);
    os << what << ": " << c.failures << " of " << n << " elements outside atol=" << atol << " rtol=" << rtol
       << "; worst at index " << c.worst << ": got " << c.worst_got << " want " << c.worst_want
       << " (abs err " << std::abs(c.worst_got - c.worst_want) << ")";
    c.message = os.str();
  }
  return c;
}

template <class G>
comparison compare(const std::vector<G>& got, const std::vector<double>& want, double atol, double rtol,
                   const std::string& what = "") {
  if (got.size() != want.size()) {
    comparison c;
    c.ok = false;
    c.message = what + ": size " + std::to_string(got.size()) + " != expected " + std::to_string(want.size());
    return c;
  }
  return compare(got.data(), want.data(), want.size(), atol, rtol, what);
}

template <class G>
double max_abs_err(const std::vector<G>& got, const std::vector<double>& want) {
  require(got.size() == want.size(), "max_abs_err: sizes differ");
  double m = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(to_d(got[i]) - want[i]);
    if (std::isnan(e)) return std::numeric_limits<double>::infinity();
    m = std::max(m, e);
  }
  return m;
}

#ifndef EPX_REF_NO_DOCTEST
// doctest check (main test thread only): fails with the worst index and values.
template <class G>
bool check_close(const std::vector<G>& got, const std::vector<double>& want, double atol, double rtol,
                 const std::string& what) {
  const comparison c = compare(got, want, atol, rtol, what);
  CHECK_MESSAGE(c.ok, c.message);
  return c.ok;
}
#endif  // EPX_REF_NO_DOCTEST

}  // namespace epx::ref
