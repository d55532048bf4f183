// epx/routing/topk_softmax.hpp: top-k then softmax (Mixtral), forward and backward.
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

// Top-k of the logits, softmax over the k selected logits. `limit`: node-limited selection
// (epx/routing/node_limit.hpp), nodes scored by p = softmax(logits) over all E.
struct topk_softmax {
  node_limit limit = {};
};

namespace detail {

template <class T>
struct topk_softmax_forward {
  forward_io<T> io;
  node_limit limit;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l;
    if (!io.begin(t, l)) return;
    const int E = io.E, k = io.k;
    topk_list<max_top_k> top(k);
    std::uint64_t nodes = ~std::uint64_t{0};
#if !EPX_DEVICE_ALGORITHMS
    if (E <= max_key_table) {
      // The logits in a key table (epx/routing/detail/topk.hpp): the same selection from
      // the few logits that reach each threshold.
      key_table keys;
      const float mx = keys.fill(E, limit.active() ? E / limit.nodes : E, [&](int e) { return convert<float>(l[e]); });
      if (limit.active()) {
        const softmax_f32 all = softmax_with_max(E, [&](int e) { return keys.key[e]; }, mx);
        nodes = select_nodes(limit, E, k, keys, [&](int e) { return all.p(keys.key[e]); });
      }
      offer_allowed(limit, nodes, E, keys, top);
      return finish(t, top);
    }
#endif
    if (limit.active()) {
      const softmax_f32 all = softmax_of(E, [&](int e) { return convert<float>(l[e]); });
      nodes = select_nodes(limit, E, k, [&](int e) { return convert<float>(l[e]); },
                           [&](int e) { return all.p(convert<float>(l[e])); });
    }
    for_each_allowed(limit, nodes, E, [&](int e) { top.offer(convert<float>(l[e]), e); });
    finish(t, top);
  }

  // Softmax over the k selected logits, the weights and ids of token t.
  EPX_HOST_DEVICE void finish(std::size_t t, const topk_list<max_top_k>& top) const {
    const int k = io.k;
    // The keys are descending: the softmax's maximum is top.key[0].
    const softmax_f32 sm = softmax_of(k, [&](int j) { return top.key[j]; });
    float* w = io.weights + io.slots(t);
    std::int32_t* id = io.ids + io.slots(t);
    for (int j = 0; j < k; ++j) {
      w[j] = sm.p(top.key[j]);
      id[j] = top.id[j];
    }
    io.done(t);
  }
};

// grad_l_{id_j} = w_j (g_j - sum_m w_m g_m); unselected logits get 0.
template <class T>
struct topk_softmax_backward {
  backward_io<T> io;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    io.run(t, [&](const T* l, const std::int32_t* id, const float* g, float* gl) {
      const int k = io.k;
      float w[max_top_k];  // exp(l_{id_j} - mx), then the weights
      const softmax_f32 sm = softmax_of(k, [&](int j) { return convert<float>(l[id[j]]); }, w);
      float dot = 0.0f;
      for (int j = 0; j < k; ++j) {
        w[j] /= sm.z;
        dot = detail::mul_add(dot, w[j], g[j]);
      }
      for (int j = 0; j < k; ++j) gl[id[j]] = detail::mul_add(gl[id[j]], w[j], g[j] - dot);
    });
  }
};

// ---- host side: what route() and route_backward() call for this policy -------------------

inline const char* policy_name(const topk_softmax&) { return "topk_softmax"; }

inline void validate(const topk_softmax& policy, const char* call, int E, int k) {
  validate_top_k(call, policy_name(policy), E, k);
  validate_node_limit(call, policy_name(policy), policy.limit, E, k);
}

template <class Exec, class T>
void launch_forward(const topk_softmax& policy, const Exec& exec, std::size_t N, const forward_io<T>& io) {
  exec::for_each_n(exec, N, topk_softmax_forward<T>{io, policy.limit});
}

template <class Exec, class T>
void launch_backward(const topk_softmax&, const Exec& exec, std::size_t N, const backward_io<T>& io) {
  exec::for_each_n(exec, N, topk_softmax_backward<T>{io});
}

}  // namespace detail
}  // namespace epx::routing
