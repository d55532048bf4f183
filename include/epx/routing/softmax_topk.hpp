// epx/routing/softmax_topk.hpp: softmax then top-k (Qwen3-MoE), forward and backward.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/detail/topk.hpp"

namespace epx::routing {

// p = softmax(logits) in float32, the top-k of p, weights p at the selected ids; with
// `renormalize` the k weights are divided by their sum. Selection compares the float32 p
// themselves (the very values the weights are made of), not the logits: distinct logits
// can round to one p (logits 0 and 1e-8 both give p = 0.5; logits far below the maximum
// give p = 0), and such experts tie, the tie going to the lower expert id.
struct softmax_topk {
  bool renormalize = false;
};

namespace detail {

template <class T>
struct softmax_topk_forward {
  const T* logits;  // [N, E]
  int E;
  int k;
  bool renormalize;
  std::int32_t* ids;      // [N, k]
  float* weights;         // [N, k]
  token_status* status;   // [N]

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = logits + t * static_cast<std::size_t>(E);
    token_status st{status_ok, -1, 0.0};
    if (!check_logits(l, E, st)) return fail_token(ids, weights, k, status, t, st);
    float mx = convert<float>(l[0]);
    for (int e = 1; e < E; ++e) {
      const float v = convert<float>(l[e]);
      mx = v > mx ? v : mx;
    }
    float z = 0.0f;
    for (int e = 0; e < E; ++e) z += exp_f32(convert<float>(l[e]) - mx);
    // The top-k of p, offered in ascending id: equal p keep the lower id first. The keys are
    // the weights, so selection and weights see the same float32 values.
    topk_list<max_top_k> top(k);
    for (int e = 0; e < E; ++e) top.offer(exp_f32(convert<float>(l[e]) - mx) / z, e);
    float sel = 0.0f;
    for (int j = 0; j < k; ++j) {
      weights[t * k + j] = top.key[j];
      ids[t * k + j] = top.id[j];
      sel += top.key[j];
    }
    if (renormalize)
      for (int j = 0; j < k; ++j) weights[t * k + j] /= sel;
    status[t] = st;
  }
};

// Through the (optional) renormalisation, then the full softmax:
//   renormalize: gp_j = (g_j - sum_m g_m w_m) / S, S = sum of the selected p; else gp_j = g_j;
//   grad_l_e = p_e (gp_e - sum_j p_{id_j} gp_j), gp_e = 0 for unselected experts.
template <class T>
struct softmax_topk_backward {
  const T* logits;  // [N, E]
  int E;
  int k;
  bool renormalize;
  const std::int32_t* ids;  // [N, k]
  const float* grad_w;      // [N, k]
  float* grad_logits;       // [N, E]
  token_status* status;     // [N]

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = logits + t * static_cast<std::size_t>(E);
    const std::int32_t* id = ids + t * k;
    const float* g = grad_w + t * k;
    float* gl = grad_logits + t * static_cast<std::size_t>(E);
    token_status st{status_ok, -1, 0.0};
    if (!backward_prologue(l, E, k, id, g, gl, st)) {
      status[t] = st;
      return;
    }
    float mx = convert<float>(l[0]);
    for (int e = 1; e < E; ++e) {
      const float v = convert<float>(l[e]);
      mx = v > mx ? v : mx;
    }
    float z = 0.0f;
    for (int e = 0; e < E; ++e) z += exp_f32(convert<float>(l[e]) - mx);
    float p[max_top_k];
    float gp[max_top_k];
    float S = 0.0f;
    for (int j = 0; j < k; ++j) {
      p[j] = exp_f32(convert<float>(l[id[j]]) - mx) / z;
      S += p[j];
    }
    if (renormalize) {
      float gw = 0.0f;
      for (int j = 0; j < k; ++j) gw += g[j] * (p[j] / S);
      for (int j = 0; j < k; ++j) gp[j] = (g[j] - gw) / S;
    } else {
      for (int j = 0; j < k; ++j) gp[j] = g[j];
    }
    float dot = 0.0f;
    for (int j = 0; j < k; ++j) dot += p[j] * gp[j];
    for (int e = 0; e < E; ++e) gl[e] = -(exp_f32(convert<float>(l[e]) - mx) / z) * dot;
    for (int j = 0; j < k; ++j) gl[id[j]] += p[j] * gp[j];
    status[t] = st;
  }
};

// ---- host side: what route() and route_backward() call for this policy -------------------

inline const char* policy_name(const softmax_topk&) { return "softmax_topk"; }

inline void validate(const softmax_topk& policy, const char* call, int E, int k) {
  validate_top_k(call, policy_name(policy), E, k);
}

template <class Exec, class T>
void launch_forward(const softmax_topk& policy, const Exec& exec, const T* logits, std::size_t N, int E, int k,
                    std::int32_t* ids, float* weights, token_status* status) {
  exec::for_each_n(exec, N, softmax_topk_forward<T>{logits, E, k, policy.renormalize, ids, weights, status});
}

template <class Exec, class T>
void launch_backward(const softmax_topk& policy, const Exec& exec, const T* logits, std::size_t N, int E, int k,
                     const std::int32_t* ids, const float* grad_weights, float* grad_logits, token_status* status) {
  exec::for_each_n(exec, N,
                   softmax_topk_backward<T>{logits, E, k, policy.renormalize, ids, grad_weights, grad_logits, status});
}

}  // namespace detail
}  // namespace epx::routing
