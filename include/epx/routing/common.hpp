// epx/routing/common.hpp: what the routing policies share (spec section 2).
//
// The limits of the per-token functors (max_top_k, max_groups), the policy trait, and the
// detail pieces every policy uses: the per-token status the functors write, the finite
// checks of logits and backward inputs, forward_io and backward_io (the inputs and outputs
// every forward or backward functor shares, with its per-token prologue and epilogue), the
// top-k validation, and the host side check that turns a failing token into an epx::error.
// The policies themselves live one per header: softmax_topk.hpp, topk_softmax.hpp,
// sigmoid_bias.hpp, given.hpp; routing.hpp includes them all and holds route() and
// route_backward().
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
using ::epx::detail::mul_add;  // acc + a * b, never fused (epx/core/numeric.hpp)

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

// The status of a token that passed.
EPX_HOST_DEVICE constexpr token_status token_ok() noexcept { return token_status{status_ok, -1, 0.0}; }

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

// What every forward functor reads and writes: logits [N, E] in, ids [N, k], weights [N, k]
// and the per-token status [N] out. A functor holds one as its member `io` and adds its
// policy's parameters. Its operator() calls begin(), then fail() or done(): sigmoid_bias
// can still fail a token after the logit check (a non-finite bias).
template <class T>
struct forward_io {
  const T* logits;  // [N, E]
  int E;
  int k;
  std::int32_t* ids;     // [N, k]
  float* weights;        // [N, k]
  token_status* status;  // [N]

  // Index of token t's first slot in ids and weights.
  EPX_HOST_DEVICE std::size_t slots(std::size_t t) const noexcept { return t * static_cast<std::size_t>(k); }

  // Points `l` at the logits of token t; returns false, with the token failed, when one of
  // them is not finite.
  EPX_HOST_DEVICE bool begin(std::size_t t, const T*& l) const noexcept {
    l = logits + t * static_cast<std::size_t>(E);
    token_status st = token_ok();
    if (check_logits(l, E, st)) return true;
    fail(t, st);
    return false;
  }

  // Token t failed with `st`: ids -1, weights 0.
  EPX_HOST_DEVICE void fail(std::size_t t, const token_status& st) const noexcept {
    for (int j = 0; j < k; ++j) {
      ids[slots(t) + static_cast<std::size_t>(j)] = -1;
      weights[slots(t) + static_cast<std::size_t>(j)] = 0.0f;
    }
    status[t] = st;
  }

  EPX_HOST_DEVICE void done(std::size_t t) const noexcept { status[t] = token_ok(); }
};

// What every backward functor reads and writes: logits [N, E], ids [N, k] and
// grad_weights [N, k] in, grad_logits [N, E] and the per-token status [N] out. A functor
// holds one as its member `io` and adds its policy's parameters.
template <class T>
struct backward_io {
  const T* logits;  // [N, E]
  int E;
  int k;
  const std::int32_t* ids;  // [N, k]
  const float* grad_w;      // [N, k]
  float* grad_logits;       // [N, E]
  token_status* status;     // [N]

  // Runs the backward of token t: zero-fills its gradient row and makes the checks every
  // backward makes (backward_prologue); when they pass, calls body(l, id, g, gl) with the
  // token's logits [E], ids [k], grad_weights [k] and gradient row [E]. Writes the status.
  template <class Body>
  EPX_HOST_DEVICE void run(std::size_t t, const Body& body) const {
    const T* l = logits + t * static_cast<std::size_t>(E);
    const std::int32_t* id = ids + t * static_cast<std::size_t>(k);
    const float* g = grad_w + t * static_cast<std::size_t>(k);
    float* gl = grad_logits + t * static_cast<std::size_t>(E);
    token_status st = token_ok();
    if (backward_prologue(l, E, k, id, g, gl, st)) body(l, id, g, gl);
    status[t] = st;
  }
};

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
