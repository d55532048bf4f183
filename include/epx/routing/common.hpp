// epx/routing/common.hpp: what the routing policies share (spec section 2).
//
// The limits of the per-token functors (max_top_k, max_groups), the policy trait, and the
// detail pieces every policy uses: the per-token status the functors write, the finite
// checks of logits and backward inputs, the top-k validation, and the host side check that
// turns a failing token into an epx::error. The policies themselves live one per header:
// softmax_topk.hpp, topk_softmax.hpp, sigmoid_bias.hpp, given.hpp; routing.hpp includes them
// all and holds route() and route_backward().
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/detail/topk.hpp"

namespace epx::routing {

// Largest supported top-k: the per-token functors keep the selection in local arrays.
inline constexpr int max_top_k = 32;
// Largest supported number of expert groups for group-limited selection.
inline constexpr int max_groups = 64;

// The policies, each defined in its own header.
struct softmax_topk;
struct topk_softmax;
struct sigmoid_bias;
struct given;

template <class P>
inline constexpr bool is_routing_policy_v =
    std::is_same_v<P, softmax_topk> || std::is_same_v<P, topk_softmax> || std::is_same_v<P, sigmoid_bias> ||
    std::is_same_v<P, given>;

namespace detail {

// Per-token outcome written by the functors and read on the host after the launch.
struct token_status {
  std::int32_t kind;   // status_kind
  std::int32_t index;  // expert (logit) or slot (id, gradient) of the first problem
  double value;        // the offending value
};

enum status_kind : std::int32_t {
  status_ok = 0,
  status_bad_logit = 1,
  status_bad_bias = 2,
  status_bad_id = 3,
  status_bad_grad = 4,
};

// Scans a token's logits: returns false (and fills `st`) at the first non-finite one.
// Double logits are checked before the conversion, so a value that overflows float32
// is reported as well (as its float32 image, +-inf).
template <class T>
EPX_HOST_DEVICE inline bool check_logits(const T* l, int E, token_status& st) noexcept {
  for (int e = 0; e < E; ++e) {
    const float v = convert<float>(l[e]);
    bool ok = is_finite_f32(v);
    if constexpr (std::is_same_v<T, double>) ok = ok && is_finite_f64(l[e]);
    if (!ok) {
      st.kind = status_bad_logit;
      st.index = e;
      st.value = static_cast<double>(v);
      if constexpr (std::is_same_v<T, double>) st.value = l[e];
      return false;
    }
  }
  return true;
}

EPX_HOST_DEVICE inline void fail_token(std::int32_t* ids, float* weights, int k, token_status* status,
                                       std::size_t t, const token_status& st) noexcept {
  for (int j = 0; j < k; ++j) {
    ids[t * k + j] = -1;
    weights[t * k + j] = 0.0f;
  }
  status[t] = st;
}

// Shared checks of the backward inputs of token t: finite logits, ids in [0, E), finite
// grad_weights. Zero-fills the token's gradient row first.
template <class T>
EPX_HOST_DEVICE inline bool backward_prologue(const T* l, int E, int k, const std::int32_t* id, const float* gw,
                                              float* gl, token_status& st) noexcept {
  for (int e = 0; e < E; ++e) gl[e] = 0.0f;
  if (!check_logits(l, E, st)) return false;
  for (int j = 0; j < k; ++j) {
    if (id[j] < 0 || id[j] >= E) {
      st.kind = status_bad_id;
      st.index = j;
      st.value = static_cast<double>(id[j]);
      return false;
    }
    if (!is_finite_f32(gw[j])) {
      st.kind = status_bad_grad;
      st.index = j;
      st.value = static_cast<double>(gw[j]);
      return false;
    }
  }
  return true;
}

// ---- host side ---------------------------------------------------------------------------

// The checks every policy makes before a launch: E >= 1 and k in [1, min(E, max_top_k)].
// `name` is the policy's name for the message.
inline void validate_top_k(const char* call, const char* name, int E, int k) {
  EPX_REQUIRE(E >= 1, errc::input, call, "(", name, "): number of experts E (", E, ") must be at least 1");
  EPX_REQUIRE(k >= 1 && k <= E, errc::input, call, "(", name, "): top_k (", k, ") must be in [1, E] with E = ", E);
  EPX_REQUIRE(k <= max_top_k, errc::input, call, "(", name, "): top_k (", k, ") exceeds routing::max_top_k (",
              max_top_k, ")");
}

// Copies the per-token status to the host and raises for the first failing token.
template <class Exec>
void check_status(const Exec& exec, const token_status* status, std::size_t N, const char* call,
                  const char* name) {
  std::vector<token_status> h(N);
  exec::copy_n(exec, status, N, h.data());
  exec::synchronize(exec);
  for (std::size_t t = 0; t < N; ++t) {
    const token_status& s = h[t];
    switch (s.kind) {
      case status_ok:
        continue;
      case status_bad_logit:
        EPX_THROW(errc::input, call, "(", name, "): logit of token ", t, ", expert ", s.index, " is not finite (",
                  s.value, ")");
      case status_bad_bias:
        EPX_THROW(errc::input, call, "(", name, "): bias of expert ", s.index, " is not finite (", s.value, ")");
      case status_bad_id:
        EPX_THROW(errc::input, call, "(", name, "): expert id of token ", t, ", slot ", s.index, " (",
                  static_cast<long long>(s.value), ") is out of range [0, E)");
      case status_bad_grad:
        EPX_THROW(errc::input, call, "(", name, "): grad_weights of token ", t, ", slot ", s.index,
                  " is not finite (", s.value, ")");
      default:
        EPX_THROW(errc::internal, call, "(", name, "): unknown status ", s.kind, " for token ", t);
    }
  }
}

}  // namespace detail
}  // namespace epx::routing
