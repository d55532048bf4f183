// epx/routing/sigmoid_bias.hpp: sigmoid with selection bias (DeepSeek-V3), forward and
// backward, with optional group-limited selection.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/detail/topk.hpp"
#include "epx/routing/node_limit.hpp"

namespace epx::routing {

// DeepSeek-V3: s = sigmoid(logits); experts are selected by the top-k of s + bias (the
// bias changes selection only); weights are s at the selected ids, divided by
// (sum + 1e-20) when `normalize`, times `scaling`.
// Group-limited selection (n_group > 1): experts form n_group contiguous groups of
// E / n_group; a group's score is the sum of its two largest s + bias (its one value for
// groups of a single expert), as in DeepSeek-V3; the topk_group best groups are kept (ties
// to the lower group id) and the top-k is taken among the experts of the kept groups.
// `limit`: node-limited selection (epx/routing/node_limit.hpp), nodes scored by s + bias;
// it replaces group-limited selection (n_group must then be 1).
struct sigmoid_bias {
  const float* bias = nullptr;  // [E] in the policy's memory space; null: no bias
  int n_group = 1;
  int topk_group = 1;
  float scaling = 1.0f;
  bool normalize = true;
  node_limit limit = {};
};

namespace detail {

// Selection of sigmoid_bias: fills `top` with the selected experts (keys are s + bias).
// Returns false with `st` filled when a bias value is not finite.
template <class T>
EPX_HOST_DEVICE inline bool sigmoid_bias_select(const T* l, int E, const float* bias, int n_group, int topk_group,
                                                const node_limit& limit, topk_list<max_top_k>& top,
                                                token_status& st) noexcept {
  if (bias != nullptr) {
    for (int e = 0; e < E; ++e)
      if (!is_finite_f32(bias[e])) {
        st.kind = status_bad_bias;
        st.index = e;
        st.value = static_cast<double>(bias[e]);
        return false;
      }
  }
  const auto key = [&](int e) {
    const float s = sigmoid_f32(convert<float>(l[e]));
    return bias != nullptr ? s + bias[e] : s;
  };
  if (n_group <= 1) {
#if !EPX_DEVICE_ALGORITHMS
    if (E <= max_key_table) {
      // The keys in a key table (epx/routing/detail/topk.hpp): each sigmoid taken once,
      // the same selection from the few keys that reach each threshold.
      key_table keys;
      keys.fill(E, limit.active() ? E / limit.nodes : E, key);
      const std::uint64_t nodes = select_nodes(limit, E, top.k, keys, [&](int e) { return keys.key[e]; });
      offer_allowed(limit, nodes, E, keys, top);
      return true;
    }
#endif
    const std::uint64_t nodes = select_nodes(limit, E, top.k, key, key);
    for_each_allowed(limit, nodes, E, [&](int e) { top.offer(key(e), e); });
    return true;
  }
  const int gs = E / n_group;
  float gscore[max_groups];
  for (int g = 0; g < n_group; ++g) {
    topk_list<2> best(gs < 2 ? gs : 2);
    for (int i = 0; i < gs; ++i) best.offer(key(g * gs + i), g * gs + i);
    float sum = 0.0f;
    for (int i = 0; i < best.size; ++i) sum += best.key[i];
    gscore[g] = sum;
  }
  std::uint64_t kept = 0;  // bit g: group g is kept
  for (int r = 0; r < topk_group; ++r) {
    int pick = -1;
    for (int g = 0; g < n_group; ++g) {
      if ((kept >> g) & 1u) continue;
      if (pick < 0 || gscore[g] > gscore[pick]) pick = g;  // strict: ties keep the lower group
    }
    kept |= std::uint64_t{1} << pick;
  }
  for (int e = 0; e < E; ++e)
    if ((kept >> (e / gs)) & 1u) top.offer(key(e), e);
  return true;
}

template <class T>
struct sigmoid_bias_forward {
  forward_io<T> io;
  const float* bias;  // [E] or null
  int n_group;
  int topk_group;
  float scaling;
  bool normalize;
  node_limit limit;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l;
    if (!io.begin(t, l)) return;
    const int k = io.k;
    topk_list<max_top_k> top(k);
    token_status st = token_ok();
    if (!sigmoid_bias_select(l, io.E, bias, n_group, topk_group, limit, top, st)) return io.fail(t, st);
    float* w = io.weights + io.slots(t);
    std::int32_t* id = io.ids + io.slots(t);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const float s = sigmoid_f32(convert<float>(l[top.id[j]]));
      w[j] = s;
      id[j] = top.id[j];
      sum += s;
    }
    // s / D, then times the scaling (as written: scaling / D first could overflow).
    const float D = sum + 1e-20f;
    for (int j = 0; j < k; ++j) w[j] = (normalize ? w[j] / D : w[j]) * scaling;
    io.done(t);
  }
};

// w_j = c s_j / D (normalize, D = sum s + 1e-20) or c s_j; ds/dl = s (1 - s);
//   dL/ds_j = c (g_j - sum_m g_m s_m / D) / D  (normalize) or c g_j.
// The bias only selects: it has no gradient. Unselected logits get 0.
template <class T>
struct sigmoid_bias_backward {
  backward_io<T> io;
  float scaling;
  bool normalize;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    io.run(t, [&](const T* l, const std::int32_t* id, const float* g, float* gl) {
      const int k = io.k;
      float s[max_top_k];
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) sum += (s[j] = sigmoid_f32(convert<float>(l[id[j]])));
      if (normalize) {
        const float D = sum + 1e-20f;
        float dot = 0.0f;
        for (int j = 0; j < k; ++j) dot = detail::mul_add(dot, g[j], s[j]);
        const float mean = dot / D;
        for (int j = 0; j < k; ++j)
          gl[id[j]] = detail::mul_add(gl[id[j]], scaling * (g[j] - mean) / D * s[j], 1.0f - s[j]);
      } else {
        for (int j = 0; j < k; ++j) gl[id[j]] = detail::mul_add(gl[id[j]], scaling * g[j] * s[j], 1.0f - s[j]);
      }
    });
  }
};

// ---- host side: what route() and route_backward() call for this policy -------------------

inline const char* policy_name(const sigmoid_bias&) { return "sigmoid_bias"; }

// The top-k checks, then the group parameters and the scaling.
inline void validate(const sigmoid_bias& policy, const char* call, int E, int k) {
  validate_top_k(call, policy_name(policy), E, k);
  const int ng = policy.n_group, tg = policy.topk_group;
  EPX_REQUIRE(ng >= 1 && ng <= max_groups, errc::configuration, call, "(sigmoid_bias): n_group (", ng,
              ") must be in [1, routing::max_groups = ", max_groups, "]");
  EPX_REQUIRE(E % ng == 0, errc::configuration, call, "(sigmoid_bias): E (", E, ") is not divisible by n_group (",
              ng, ")");
  EPX_REQUIRE(tg >= 1 && tg <= ng, errc::configuration, call, "(sigmoid_bias): topk_group (", tg,
              ") must be in [1, n_group] with n_group = ", ng);
  EPX_REQUIRE(k <= tg * (E / ng), errc::configuration, call, "(sigmoid_bias): top_k (", k,
              ") exceeds the experts of the kept groups: topk_group (", tg, ") * E / n_group (", E / ng, ") = ",
              tg * (E / ng));
  EPX_REQUIRE(is_finite_f32(policy.scaling), errc::configuration, call, "(sigmoid_bias): scaling (", policy.scaling,
              ") is not finite");
  validate_node_limit(call, policy_name(policy), policy.limit, E, k);
  EPX_REQUIRE(ng == 1 || !policy.limit.active(), errc::configuration, call,
              "(sigmoid_bias): a node limit (max_nodes ", policy.limit.max_nodes, ") and group-limited selection (n_group ",
              ng, ") do not combine: use one or the other");
}

template <class Exec, class T>
void launch_forward(const sigmoid_bias& policy, const Exec& exec, std::size_t N, const forward_io<T>& io) {
  exec::for_each_n(exec, N,
                   sigmoid_bias_forward<T>{io, policy.bias, policy.n_group, policy.topk_group, policy.scaling,
                                           policy.normalize, policy.limit});
}

template <class Exec, class T>
void launch_backward(const sigmoid_bias& policy, const Exec& exec, std::size_t N, const backward_io<T>& io) {
  exec::for_each_n(exec, N, sigmoid_bias_backward<T>{io, policy.scaling, policy.normalize});
}

}  // namespace detail
}  // namespace epx::routing
