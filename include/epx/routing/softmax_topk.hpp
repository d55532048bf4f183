// epx/routing/softmax_topk.hpp: softmax then top-k (Qwen3-MoE), forward and backward.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/detail/topk.hpp"
#include "epx/routing/node_limit.hpp"

namespace epx::routing {

// p = softmax(logits) in float32, the top-k of p, weights p at the selected ids; with
// `renormalize` the k weights are divided by their sum. Selection compares the float32 p
// themselves (the very values the weights are made of), not the logits: distinct logits
// can round to one p (logits 0 and 1e-8 both give p = 0.5; logits far below the maximum
// give p = 0), and such experts tie, the tie going to the lower expert id.
// `limit`: node-limited selection (epx/routing/node_limit.hpp), nodes scored by p.
struct softmax_topk {
  bool renormalize = false;
  node_limit limit = {};
};

namespace detail {

// The float32 softmax of a token's logits: the p of the forward and the backward.
template <class T>
EPX_HOST_DEVICE inline softmax_f32 softmax_of_logits(const T* l, int E, float* ex = nullptr) noexcept {
  return softmax_of(E, [&](int e) { return convert<float>(l[e]); }, ex);
}

// The top-k of p from the top-(k + 1) of the logits `cand` (over the experts a token may
// use), so that p is computed for k + 2 experts instead of all of them. p never decreases
// as the logit grows, so the k best logits carry the k best p, unless rounding gives the
// (k + 1)-th best logit the k-th best p (distinct logits, one p; p = 0 far below the
// maximum): then the ids among equal p could differ, and this returns false without
// touching `top`, for the caller to offer every p. Otherwise `top` ends as offering every
// p in ascending id leaves it: the k candidates, offered by p in ascending id.
template <class P>
EPX_HOST_DEVICE inline bool top_from_candidates(const topk_list<max_top_k + 1>& cand, int k, const P& p,
                                                topk_list<max_top_k>& top) {
  if (cand.size > k && !(p(cand.id[k]) < p(cand.id[k - 1]))) return false;
  const int n = cand.size < k ? cand.size : k;
  std::int32_t id[max_top_k];
  for (int i = 0; i < n; ++i) {  // ascending id (insertion sort of at most k)
    int j = i;
    for (; j > 0 && id[j - 1] > cand.id[i]; --j) id[j] = id[j - 1];
    id[j] = cand.id[i];
  }
  for (int i = 0; i < n; ++i) top.offer(p(id[i]), id[i]);
  return true;
}

template <class T>
struct softmax_topk_forward {
  forward_io<T> io;
  bool renormalize;
  node_limit limit;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l;
    if (!io.begin(t, l)) return;
    const int E = io.E, k = io.k;
    // The top-k of p, offered in ascending id: equal p keep the lower id first. The keys are
    // the weights, so selection and weights see the same float32 values. Nodes are ranked
    // by the logits (p grows with them) and scored by p.
    topk_list<max_top_k> top(k);
    topk_list<max_top_k + 1> cand(k + 1);
#if !EPX_DEVICE_ALGORITHMS
    if (E <= max_key_table) {
      // The logits in a key table (epx/routing/detail/topk.hpp), which also gives their
      // maximum; with a limit the softmax keeps its terms exp(x - mx), and p of an expert
      // is its term over z (sm.p's very operations), read by the node scores.
      key_table keys;
      float terms[max_key_table];
      float* ex = limit.active() ? terms : nullptr;
      const float mx = keys.fill(E, limit.active() ? E / limit.nodes : E, [&](int e) { return convert<float>(l[e]); });
      const softmax_f32 sm = softmax_with_max(E, [&](int e) { return keys.key[e]; }, mx, ex);
      const auto p = [&](int e) { return ex != nullptr ? ex[e] / sm.z : sm.p(keys.key[e]); };
      const std::uint64_t nodes = select_nodes(limit, E, k, keys, p);
      offer_allowed(limit, nodes, E, keys, cand);
      if (!top_from_candidates(cand, k, p, top)) for_each_allowed(limit, nodes, E, [&](int e) { top.offer(p(e), e); });
      return finish(t, top);
    }
#endif
    const softmax_f32 sm = softmax_of_logits(l, E);
    const auto x = [&](int e) { return convert<float>(l[e]); };
    const auto p = [&](int e) { return sm.p(x(e)); };
    const std::uint64_t nodes = select_nodes(limit, E, k, x, p);
    for_each_allowed(limit, nodes, E, [&](int e) { cand.offer(x(e), e); });
    if (!top_from_candidates(cand, k, p, top)) for_each_allowed(limit, nodes, E, [&](int e) { top.offer(p(e), e); });
    finish(t, top);
  }

  // The selected weights and ids of token t (renormalised when asked).
  EPX_HOST_DEVICE void finish(std::size_t t, const topk_list<max_top_k>& top) const {
    const int k = io.k;
    float* w = io.weights + io.slots(t);
    std::int32_t* id = io.ids + io.slots(t);
    float sel = 0.0f;
    for (int j = 0; j < k; ++j) {
      w[j] = top.key[j];
      id[j] = top.id[j];
      sel += top.key[j];
    }
    if (renormalize)
      for (int j = 0; j < k; ++j) w[j] /= sel;
    io.done(t);
  }
};

// Through the (optional) renormalisation, then the full softmax:
//   renormalize: gp_j = (g_j - sum_m g_m w_m) / S, S = sum of the selected p; else gp_j = g_j;
//   grad_l_e = p_e (gp_e - sum_j p_{id_j} gp_j), gp_e = 0 for unselected experts.
template <class T>
struct softmax_topk_backward {
  backward_io<T> io;
  bool renormalize;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    io.run(t, [&](const T* l, const std::int32_t* id, const float* g, float* gl) {
      const int E = io.E, k = io.k;
      const softmax_f32 sm = softmax_of_logits(l, E);
      float p[max_top_k];
      float gp[max_top_k];
      float S = 0.0f;
      for (int j = 0; j < k; ++j) {
        p[j] = sm.p(convert<float>(l[id[j]]));
        S += p[j];
      }
      if (renormalize) {
        float gw = 0.0f;
        for (int j = 0; j < k; ++j) gw = detail::mul_add(gw, g[j], p[j] / S);
        for (int j = 0; j < k; ++j) gp[j] = (g[j] - gw) / S;
      } else {
        for (int j = 0; j < k; ++j) gp[j] = g[j];
      }
      float dot = 0.0f;
      for (int j = 0; j < k; ++j) dot = detail::mul_add(dot, p[j], gp[j]);
      for (int e = 0; e < E; ++e) gl[e] = -sm.p(convert<float>(l[e])) * dot;
      for (int j = 0; j < k; ++j) gl[id[j]] = detail::mul_add(gl[id[j]], p[j], gp[j]);
    });
  }
};

// ---- host side: what route() and route_backward() call for this policy -------------------

inline const char* policy_name(const softmax_topk&) { return "softmax_topk"; }

inline void validate(const softmax_topk& policy, const char* call, int E, int k) {
  validate_top_k(call, policy_name(policy), E, k);
  validate_node_limit(call, policy_name(policy), policy.limit, E, k);
}

template <class Exec, class T>
void launch_forward(const softmax_topk& policy, const Exec& exec, std::size_t N, const forward_io<T>& io) {
  exec::for_each_n(exec, N, softmax_topk_forward<T>{io, policy.renormalize, policy.limit});
}

template <class Exec, class T>
void launch_backward(const softmax_topk& policy, const Exec& exec, std::size_t N, const backward_io<T>& io) {
  exec::for_each_n(exec, N, softmax_topk_backward<T>{io, policy.renormalize});
}

}  // namespace detail
}  // namespace epx::routing
