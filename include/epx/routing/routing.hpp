// epx/routing/routing.hpp: routing policies (spec section 2), forward and backward.
//
// A routing policy turns router logits [N, E] into global expert ids [N, k] (int32) and
// weights [N, k] (float32):
//
//   epx::routing::softmax_topk{/*renormalize=*/true}   // Qwen3-MoE
//   epx::routing::topk_softmax{}                       // Mixtral
//   epx::routing::sigmoid_bias{bias, n_group, topk_group, scaling, normalize}  // DeepSeek-V3
//   epx::routing::given{}                              // the user computes ids and weights
//
//   epx::routing::route(policy, exec, logits, N, E, k, ids, weights);
//   epx::routing::route_backward(policy, exec, logits, N, E, k, ids, weights,
//                                grad_weights, grad_logits);
//
// Rules shared by every policy:
//   - all math in float32, whatever the logit type (float, double, bf16, fp16);
//   - slot j = 0 holds the best expert; ties go to the lower expert id, so routing is
//     deterministic and identical on every execution policy;
//   - one EPX_HOST_DEVICE functor per token, launched with exec::for_each_n; the functors
//     use fixed-size local arrays (k <= max_top_k, n_group <= max_groups);
//   - non-finite logits raise epx::error(errc::input) naming the first bad token, the
//     expert and the value; the ids/weights of such a call are unspecified.
// Pointers (logits, ids, weights, bias, gradients) live in the execution policy's memory
// space (host memory for exec::serial / exec::openmp, device memory for exec::cuda).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/detail/topk.hpp"

namespace epx::routing {

// Largest supported top-k: the per-token functors keep the selection in local arrays.
inline constexpr int max_top_k = 32;
// Largest supported number of expert groups for group-limited selection.
inline constexpr int max_groups = 64;

// p = softmax(logits) in float32, the top-k of p, weights p at the selected ids; with
// `renormalize` the k weights are divided by their sum. Selection is done on the logits,
// which orders experts exactly as p does (softmax is strictly increasing) without the
// rounding ties of float32 probabilities.
struct softmax_topk {
  bool renormalize = false;
};

// Top-k of the logits, softmax over the k selected logits.
struct topk_softmax {};

// DeepSeek-V3: s = sigmoid(logits); experts are selected by the top-k of s + bias (the
// bias changes selection only); weights are s at the selected ids, divided by
// (sum + 1e-20) when `normalize`, times `scaling`.
// Group-limited selection (n_group > 1): experts form n_group contiguous groups of
// E / n_group; a group's score is the sum of its two largest s + bias (its one value for
// groups of a single expert), as in DeepSeek-V3; the topk_group best groups are kept (ties
// to the lower group id) and the top-k is taken among the experts of the kept groups.
struct sigmoid_bias {
  const float* bias = nullptr;  // [E] in the policy's memory space; null: no bias
  int n_group = 1;
  int topk_group = 1;
  float scaling = 1.0f;
  bool normalize = true;
};

// The user supplies ids and weights; there is nothing to route.
struct given {};

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

// ---- forward functors: one call per token t ---------------------------------------------

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
    topk_list<max_top_k> top(k);
    float mx = convert<float>(l[0]);
    for (int e = 0; e < E; ++e) {
      const float v = convert<float>(l[e]);
      mx = v > mx ? v : mx;
      top.offer(v, e);
    }
    float z = 0.0f;
    for (int e = 0; e < E; ++e) z += exp_f32(convert<float>(l[e]) - mx);
    float sel = 0.0f;
    for (int j = 0; j < k; ++j) {
      const float p = exp_f32(top.key[j] - mx) / z;
      weights[t * k + j] = p;
      ids[t * k + j] = top.id[j];
      sel += p;
    }
    if (renormalize)
      for (int j = 0; j < k; ++j) weights[t * k + j] /= sel;
    status[t] = st;
  }
};

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

// Selection of sigmoid_bias: fills `top` with the selected experts (keys are s + bias).
// Returns false with `st` filled when a bias value is not finite.
template <class T>
EPX_HOST_DEVICE inline bool sigmoid_bias_select(const T* l, int E, const float* bias, int n_group, int topk_group,
                                                topk_list<max_top_k>& top, token_status& st) noexcept {
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
    for (int e = 0; e < E; ++e) top.offer(key(e), e);
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
  const T* logits;  // [N, E]
  int E;
  int k;
  const float* bias;  // [E] or null
  int n_group;
  int topk_group;
  float scaling;
  bool normalize;
  std::int32_t* ids;     // [N, k]
  float* weights;        // [N, k]
  token_status* status;  // [N]

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = logits + t * static_cast<std::size_t>(E);
    token_status st{status_ok, -1, 0.0};
    if (!check_logits(l, E, st)) return fail_token(ids, weights, k, status, t, st);
    topk_list<max_top_k> top(k);
    if (!sigmoid_bias_select(l, E, bias, n_group, topk_group, top, st))
      return fail_token(ids, weights, k, status, t, st);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const float s = sigmoid_f32(convert<float>(l[top.id[j]]));
      weights[t * k + j] = s;
      ids[t * k + j] = top.id[j];
      sum += s;
    }
    const float scale = normalize ? scaling / (sum + 1e-20f) : scaling;
    for (int j = 0; j < k; ++j) weights[t * k + j] *= scale;
    status[t] = st;
  }
};

// ---- backward functors: grad_weights [N, k] -> grad_logits [N, E] ------------------------

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

// w_j = c s_j / D (normalize, D = sum s + 1e-20) or c s_j; ds/dl = s (1 - s);
//   dL/ds_j = c (g_j - sum_m g_m s_m / D) / D  (normalize) or c g_j.
// The bias only selects: it has no gradient. Unselected logits get 0.
template <class T>
struct sigmoid_bias_backward {
  const T* logits;  // [N, E]
  int E;
  int k;
  float scaling;
  bool normalize;
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
    float s[max_top_k];
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += (s[j] = sigmoid_f32(convert<float>(l[id[j]])));
    if (normalize) {
      const float D = sum + 1e-20f;
      float dot = 0.0f;
      for (int j = 0; j < k; ++j) dot += g[j] * s[j];
      const float mean = dot / D;
      for (int j = 0; j < k; ++j) gl[id[j]] += scaling * (g[j] - mean) / D * s[j] * (1.0f - s[j]);
    } else {
      for (int j = 0; j < k; ++j) gl[id[j]] += scaling * g[j] * s[j] * (1.0f - s[j]);
    }
    status[t] = st;
  }
};

// ---- host side ---------------------------------------------------------------------------

inline const char* policy_name(const softmax_topk&) { return "softmax_topk"; }
inline const char* policy_name(const topk_softmax&) { return "topk_softmax"; }
inline const char* policy_name(const sigmoid_bias&) { return "sigmoid_bias"; }
inline const char* policy_name(const given&) { return "given"; }

template <class Policy>
void validate(const Policy& policy, const char* call, int E, int k) {
  const char* name = policy_name(policy);
  EPX_REQUIRE(E >= 1, errc::input, call, "(", name, "): number of experts E (", E, ") must be at least 1");
  EPX_REQUIRE(k >= 1 && k <= E, errc::input, call, "(", name, "): top_k (", k, ") must be in [1, E] with E = ", E);
  EPX_REQUIRE(k <= max_top_k, errc::input, call, "(", name, "): top_k (", k, ") exceeds routing::max_top_k (",
              max_top_k, ")");
  if constexpr (std::is_same_v<Policy, sigmoid_bias>) {
    const int ng = policy.n_group, tg = policy.topk_group;
    EPX_REQUIRE(ng >= 1 && ng <= max_groups, errc::configuration, call, "(sigmoid_bias): n_group (", ng,
                ") must be in [1, routing::max_groups = ", max_groups, "]");
    EPX_REQUIRE(E % ng == 0, errc::configuration, call, "(sigmoid_bias): E (", E,
                ") is not divisible by n_group (", ng, ")");
    EPX_REQUIRE(tg >= 1 && tg <= ng, errc::configuration, call, "(sigmoid_bias): topk_group (", tg,
                ") must be in [1, n_group] with n_group = ", ng);
    EPX_REQUIRE(k <= tg * (E / ng), errc::configuration, call, "(sigmoid_bias): top_k (", k,
                ") exceeds the experts of the kept groups: topk_group (", tg, ") * E / n_group (", E / ng,
                ") = ", tg * (E / ng));
    EPX_REQUIRE(is_finite_f32(policy.scaling), errc::configuration, call, "(sigmoid_bias): scaling (",
                policy.scaling, ") is not finite");
  }
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

// Routes N tokens: logits [N, E] -> ids [N, k] (global expert ids, slot 0 best) and
// weights [N, k] (float32). T is float, double, bf16 or fp16; the math is float32.
// Raises epx::error(errc::input) for E < 1, k outside [1, min(E, max_top_k)] and
// non-finite logits (naming token, expert and value), errc::configuration for bad group
// parameters. Synchronises the execution policy (it reads the per-token status).
template <class Policy, class Exec, class T>
void route(const Policy& policy, const Exec& exec, const T* logits, std::size_t N, int E, int k,
           std::int32_t* ids, float* weights) {
  static_assert(is_routing_policy_v<Policy>,
                "epx::routing::route: the policy must be softmax_topk, topk_softmax, sigmoid_bias or given");
  static_assert(is_activation_type_v<T>, "epx::routing::route: logits must be float, double, bf16 or fp16");
  if constexpr (std::is_same_v<Policy, given>) {
    static_assert(dependent_false<Policy>,
                  "epx::routing::given means the caller computes ids and weights: hand them to the layer "
                  "directly instead of calling route()");
  } else {
    detail::validate(policy, "route", E, k);
    if (N == 0) return;
    EPX_REQUIRE(logits != nullptr && ids != nullptr && weights != nullptr, errc::input,
                "route(", detail::policy_name(policy), "): null logits, ids or weights for N = ", N, " tokens");
    auto status = exec::make_buffer<detail::token_status>(exec, N);
    if constexpr (std::is_same_v<Policy, softmax_topk>) {
      exec::for_each_n(exec, N,
                       detail::softmax_topk_forward<T>{logits, E, k, policy.renormalize, ids, weights, status.data()});
    } else if constexpr (std::is_same_v<Policy, topk_softmax>) {
      exec::for_each_n(exec, N, detail::topk_softmax_forward<T>{logits, E, k, ids, weights, status.data()});
    } else {
      exec::for_each_n(exec, N,
                       detail::sigmoid_bias_forward<T>{logits, E, k, policy.bias, policy.n_group, policy.topk_group,
                                                       policy.scaling, policy.normalize, ids, weights,
                                                       status.data()});
    }
    detail::check_status(exec, status.data(), N, "route", detail::policy_name(policy));
  }
}

// Span form: N = logits.size() / E; ids and weights must hold N * k values. `logits` may
// be a span of T or of const T.
template <class Policy, class Exec, class L>
void route(const Policy& policy, const Exec& exec, span<L> logits, int E, int k, span<std::int32_t> ids,
           span<float> weights) {
  using T = std::remove_const_t<L>;
  EPX_REQUIRE(E >= 1 && logits.size() % static_cast<std::size_t>(E) == 0, errc::input,
              "route: logits hold ", logits.size(), " values, not a multiple of E (", E, ")");
  const std::size_t N = logits.size() / static_cast<std::size_t>(E);
  EPX_REQUIRE(k >= 1 && ids.size() == N * static_cast<std::size_t>(k) && weights.size() == ids.size(), errc::input,
              "route: ids (", ids.size(), ") and weights (", weights.size(), ") must hold N * k = ", N, " * ", k,
              " values");
  route(policy, exec, static_cast<const T*>(logits.data()), N, E, k, ids.data(), weights.data());
}

// Gradient of the routing weights with respect to the logits: grad_weights [N, k] ->
// grad_logits [N, E] (float32, fully written; zero for experts a token did not select,
// except softmax_topk whose full softmax spreads gradient over all E). `ids` are the ids
// route() produced for these logits; `weights` (the forward weights) are accepted for
// symmetry and may be null: the gradients are recomputed from the logits in float32.
// Validates like route(), plus ids in [0, E) and finite grad_weights.
template <class Policy, class Exec, class T>
void route_backward(const Policy& policy, const Exec& exec, const T* logits, std::size_t N, int E, int k,
                    const std::int32_t* ids, const float* weights, const float* grad_weights, float* grad_logits) {
  static_assert(is_routing_policy_v<Policy>,
                "epx::routing::route_backward: the policy must be softmax_topk, topk_softmax, sigmoid_bias or given");
  static_assert(is_activation_type_v<T>, "epx::routing::route_backward: logits must be float, double, bf16 or fp16");
  (void)weights;
  if constexpr (std::is_same_v<Policy, given>) {
    static_assert(dependent_false<Policy>,
                  "epx::routing::given has no logits: the gradient of user-supplied weights is grad_weights "
                  "itself, returned by the layer's backward");
  } else {
    detail::validate(policy, "route_backward", E, k);
    if (N == 0) return;
    EPX_REQUIRE(logits != nullptr && ids != nullptr && grad_weights != nullptr && grad_logits != nullptr,
                errc::input, "route_backward(", detail::policy_name(policy),
                "): null logits, ids, grad_weights or grad_logits for N = ", N, " tokens");
    auto status = exec::make_buffer<detail::token_status>(exec, N);
    if constexpr (std::is_same_v<Policy, softmax_topk>) {
      exec::for_each_n(exec, N,
                       detail::softmax_topk_backward<T>{logits, E, k, policy.renormalize, ids, grad_weights,
                                                        grad_logits, status.data()});
    } else if constexpr (std::is_same_v<Policy, topk_softmax>) {
      exec::for_each_n(exec, N,
                       detail::topk_softmax_backward<T>{logits, E, k, ids, grad_weights, grad_logits, status.data()});
    } else {
      exec::for_each_n(exec, N,
                       detail::sigmoid_bias_backward<T>{logits, E, k, policy.scaling, policy.normalize, ids,
                                                        grad_weights, grad_logits, status.data()});
    }
    detail::check_status(exec, status.data(), N, "route_backward", detail::policy_name(policy));
  }
}

// Span form: N = logits.size() / E; ids, grad_weights [N, k]; grad_logits [N, E];
// `weights` may be empty.
template <class Policy, class Exec, class L>
void route_backward(const Policy& policy, const Exec& exec, span<L> logits, int E, int k,
                    span<const std::int32_t> ids, span<const float> weights, span<const float> grad_weights,
                    span<float> grad_logits) {
  EPX_REQUIRE(E >= 1 && logits.size() % static_cast<std::size_t>(E) == 0, errc::input,
              "route_backward: logits hold ", logits.size(), " values, not a multiple of E (", E, ")");
  const std::size_t N = logits.size() / static_cast<std::size_t>(E);
  EPX_REQUIRE(k >= 1 && ids.size() == N * static_cast<std::size_t>(k) && grad_weights.size() == ids.size() &&
                  (weights.empty() || weights.size() == ids.size()),
              errc::input, "route_backward: ids (", ids.size(), "), weights (", weights.size(), ") and grad_weights (",
              grad_weights.size(), ") must hold N * k = ", N, " * ", k, " values");
  EPX_REQUIRE(grad_logits.size() == logits.size(), errc::input, "route_backward: grad_logits (", grad_logits.size(),
              ") must hold N * E = ", logits.size(), " values");
  using T = std::remove_const_t<L>;
  route_backward(policy, exec, static_cast<const T*>(logits.data()), N, E, k, ids.data(),
                 weights.empty() ? nullptr : weights.data(), grad_weights.data(), grad_logits.data());
}

}  // namespace epx::routing
