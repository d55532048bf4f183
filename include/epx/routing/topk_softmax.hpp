// epx/routing/topk_softmax.hpp: top-k then softmax (Mixtral), forward and backward.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/detail/topk.hpp"

namespace epx::routing {

// Top-k of the logits, softmax over the k selected logits.
struct topk_softmax {};

namespace detail {

template <class T>
struct topk_softmax_forward {
  const T* logits;  // [N, E]
  int E;
  int k;
  std::int32_t* ids;     // [N, k]
  float* weights;        // [N, k]
  token_status* status;  // [N]

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = logits + t * static_cast<std::size_t>(E);
    token_status st{status_ok, -1, 0.0};
    if (!check_logits(l, E, st)) return fail_token(ids, weights, k, status, t, st);
    topk_list<max_top_k> top(k);
    for (int e = 0; e < E; ++e) top.offer(convert<float>(l[e]), e);
    float z = 0.0f;
    for (int j = 0; j < k; ++j) z += exp_f32(top.key[j] - top.key[0]);
    for (int j = 0; j < k; ++j) {
      weights[t * k + j] = exp_f32(top.key[j] - top.key[0]) / z;
      ids[t * k + j] = top.id[j];
    }
    status[t] = st;
  }
};

// grad_l_{id_j} = w_j (g_j - sum_m w_m g_m); unselected logits get 0.
template <class T>
struct topk_softmax_backward {
  const T* logits;  // [N, E]
  int E;
  int k;
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
    float w[max_top_k];
    float mx = convert<float>(l[id[0]]);
    for (int j = 1; j < k; ++j) {
      const float v = convert<float>(l[id[j]]);
      mx = v > mx ? v : mx;
    }
    float z = 0.0f;
    for (int j = 0; j < k; ++j) z += (w[j] = exp_f32(convert<float>(l[id[j]]) - mx));
    float dot = 0.0f;
    for (int j = 0; j < k; ++j) dot += (w[j] /= z) * g[j];
    for (int j = 0; j < k; ++j) gl[id[j]] += w[j] * (g[j] - dot);
    status[t] = st;
  }
};

// ---- host side: what route() and route_backward() call for this policy -------------------

inline const char* policy_name(const topk_softmax&) { return "topk_softmax"; }

inline void validate(const topk_softmax& policy, const char* call, int E, int k) {
  validate_top_k(call, policy_name(policy), E, k);
}

template <class Exec, class T>
void launch_forward(const topk_softmax&, const Exec& exec, const T* logits, std::size_t N, int E, int k,
                    std::int32_t* ids, float* weights, token_status* status) {
  exec::for_each_n(exec, N, topk_softmax_forward<T>{logits, E, k, ids, weights, status});
}

template <class Exec, class T>
void launch_backward(const topk_softmax&, const Exec& exec, const T* logits, std::size_t N, int E, int k,
                     const std::int32_t* ids, const float* grad_weights, float* grad_logits, token_status* status) {
  exec::for_each_n(exec, N, topk_softmax_backward<T>{logits, E, k, ids, grad_weights, grad_logits, status});
}

}  // namespace detail
}  // namespace epx::routing
