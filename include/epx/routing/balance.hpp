// epx/routing/balance.hpp: load-balancing losses and the bias update (spec section 9).
//
// Functions over routing inputs and outputs, autograd-agnostic like the gradient hooks:
// each loss returns its value, and its _backward writes, given the loss's gradient, the
// gradient with respect to the router logits [N, E] (fully written; add it to the routing
// gradient of route_backward yourself). p = softmax(logits), s = sigmoid(logits), both in
// float32 like the routing policies.
//
//   load = expert_load(exec, ids, N, k, E)                 pairs routed to each expert [E]
//   aux_loss(exec, logits, N, E, load, alpha)              Switch/GShard:
//       L = alpha * E * sum_e f_e P_e, f_e = load_e / sum(load), P_e = mean_t p[t, e];
//       local f: this batch's load; global-batch f: the load summed over every batch
//       (sum_over_batches); P stays local
//   sequence_balance_loss(exec, logits, ids, N, E, k, T, alpha)   DeepSeek-V3, per sequence
//       of T tokens: L = alpha * sum_e f'_e P'_e, f'_e = E / (k T) * #{t : e selected for t},
//       P'_e = mean_t s[t, e] / S_t, S_t = sum_e' s[t, e'] + 1e-20 (finite when every
//       sigmoid of a token underflows); the mean over the N / T sequences
//   z_loss(exec, logits, N, E, beta)                        ST-MoE: L = beta * mean_t lse_t^2,
//       lse_t = logsumexp_e logits[t, e]
//   update_bias(exec, bias, load, gamma)                   DeepSeek-V3, without a loss:
//       bias_e += gamma * sign(mean_e' load_e' - load_e), sign(0) = 0, from the integers alone
//   batch_communicator(world, mesh), sum_over_batches(batches, load)
//       the load over every batch of the job, one all_reduce of E int64: every rank gets the
//       same integers, so update_bias keeps the bias bitwise equal on every rank
//
// Per-token values are computed by one EPX_HOST_DEVICE functor per token (exec::for_each_n),
// in float32; a loss is the sum of the per-token values in double, in token order, times
// its coefficient. Pointers (logits, ids, bias, gradients) live in the execution policy's
// memory; `load` is host memory. Non-finite logits raise errc::input naming the token,
// expert and value; bad sizes and parameters errc::input, as does a non-finite grad_loss
// of a _backward; a non-finite coefficient errc::configuration, and so is a finite one whose
// scaled value (alpha * E / N, alpha / N, beta * 2 / N) is beyond float32's range, the
// float32 coefficient of the gradient (forward and _backward refuse it alike); a grad_loss
// that takes grad_loss times that value beyond float32's range errc::input.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"
#include "epx/mesh/mesh.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/detail/topk.hpp"

namespace epx::routing {

namespace detail {

EPX_HOST_DEVICE inline float log_f32(float x) noexcept {
#if EPX_IS_DEVICE_CODE
  return ::logf(x);
#else
  return std::log(x);
#endif
}

// Call with c in [0, C): counts [C, E] of chunk c's ids; bad[c] = the first id outside
// [0, E) in the chunk, -1 if none.
struct load_chunks {
  const std::int32_t* ids;
  std::size_t pairs;
  std::size_t per;
  int E;
  std::int64_t* counts;  // [C, E]
  std::int64_t* bad;     // [C]

  EPX_HOST_DEVICE void operator()(std::size_t c) const {
    std::int64_t* row = counts + c * static_cast<std::size_t>(E);
    for (int e = 0; e < E; ++e) row[e] = 0;
    const std::size_t b = c * per, end = b + per < pairs ? b + per : pairs;
    std::int64_t first = -1;
    for (std::size_t i = b; i < end; ++i) {
      const std::int32_t e = ids[i];
      if (e < 0 || e >= E) {
        if (first < 0) first = static_cast<std::int64_t>(i);
        continue;
      }
      ++row[e];
    }
    bad[c] = first;
  }
};

// Call with e in [0, E): load[e] = sum over the chunks.
struct load_sum {
  const std::int64_t* counts;  // [C, E]
  std::size_t chunks;
  int E;
  std::int64_t* load;  // [E]

  EPX_HOST_DEVICE void operator()(std::size_t e) const {
    std::int64_t s = 0;
    for (std::size_t c = 0; c < chunks; ++c) s += counts[c * static_cast<std::size_t>(E) + e];
    load[e] = s;
  }
};

// The start of a loss functor's token t: its logit row `l` and gradient row `g` (null
// without a gradient); writes the token's status. Returns false, with the token's value
// and gradient row zeroed, when one of its logits is not finite.
template <class T>
EPX_HOST_DEVICE inline bool loss_token(const T* logits, int E, std::size_t t, float* value, float* grad,
                                       token_status* status, const T*& l, float*& g) {
  l = logits + t * static_cast<std::size_t>(E);
  g = grad != nullptr ? grad + t * static_cast<std::size_t>(E) : nullptr;
  token_status st = token_ok();
  const bool ok = check_logits(l, E, st);
  status[t] = st;
  if (ok) return true;
  if (value != nullptr) value[t] = 0.0f;
  if (g != nullptr)
    for (int e = 0; e < E; ++e) g[e] = 0.0f;
  return false;
}

// Switch/GShard, token t: q[t] = sum_e f_e p[t, e]; with `grad`, grad[t, e] = coef * p_e (f_e - q_t).
template <class T>
struct aux_token {
  const T* logits;  // [N, E]
  int E;
  const float* f;  // [E]
  float* q;        // [N] or null
  float* grad;     // [N, E] or null
  float coef;
  token_status* status;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = nullptr;
    float* g = nullptr;
    if (!loss_token(logits, E, t, q, grad, status, l, g)) return;
    const softmax_f32 sm = softmax_of(E, [&](int e) { return convert<float>(l[e]); });
    float s = 0.0f;
    for (int e = 0; e < E; ++e) s = detail::mul_add(s, f[e], sm.p(convert<float>(l[e])));
    if (q != nullptr) q[t] = s;
    if (g != nullptr)
      for (int e = 0; e < E; ++e) g[e] = coef * sm.p(convert<float>(l[e])) * (f[e] - s);
  }
};

// DeepSeek-V3, sequence q in [0, N / T): fp[q, e] = E / (k T) * #{t in q : e selected for t}
// (an expert a token selects twice counts once).
struct sequence_selection {
  const std::int32_t* ids;  // [N, k]
  int E;
  int k;
  std::size_t T;
  float scale;  // E / (k T)
  float* fp;    // [N / T, E]

  EPX_HOST_DEVICE void operator()(std::size_t q) const {
    float* row = fp + q * static_cast<std::size_t>(E);
    for (int e = 0; e < E; ++e) row[e] = 0.0f;
    for (std::size_t t = q * T; t < (q + 1) * T; ++t) {
      const std::int32_t* id = ids + t * static_cast<std::size_t>(k);
      for (int j = 0; j < k; ++j) {
        if (id[j] < 0 || id[j] >= E) continue;  // reported by sequence_token
        bool again = false;
        for (int i = 0; i < j && !again; ++i) again = id[i] == id[j];
        if (!again) row[id[j]] += 1.0f;
      }
    }
    for (int e = 0; e < E; ++e) row[e] *= scale;
  }
};

// DeepSeek-V3, token t of sequence t / T: r_e = s_e / S, S = sum_e s_e; q[t] = sum_e fp_e r_e;
// with `grad`, grad[t, e] = coef * (fp_e - q_t) * s_e (1 - s_e) / S.
template <class T>
struct sequence_token {
  const T* logits;          // [N, E]
  const std::int32_t* ids;  // [N, k]
  int E;
  int k;
  std::size_t seq_len;
  const float* fp;  // [N / T, E]
  float* q;         // [N] or null
  float* grad;      // [N, E] or null
  float coef;
  token_status* status;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = logits + t * static_cast<std::size_t>(E);
    float* g = grad != nullptr ? grad + t * static_cast<std::size_t>(E) : nullptr;
    if (q != nullptr) q[t] = 0.0f;
    if (g != nullptr)
      for (int e = 0; e < E; ++e) g[e] = 0.0f;
    token_status st = token_ok();
    if (!check_logits(l, E, st)) {
      status[t] = st;
      return;
    }
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
      if (e < 0 || e >= E) {
        st.kind = status_bad_id;
        st.index = j;
        st.value = static_cast<double>(e);
        status[t] = st;
        return;
      }
    }
    const float* f = fp + (t / seq_len) * static_cast<std::size_t>(E);
    float S = 0.0f;
    for (int e = 0; e < E; ++e) S += sigmoid_f32(convert<float>(l[e]));
    S += 1e-20f;  // every sigmoid of the token may underflow to 0
    float s = 0.0f;
    for (int e = 0; e < E; ++e) s = detail::mul_add(s, f[e], sigmoid_f32(convert<float>(l[e])) / S);
    if (q != nullptr) q[t] = s;
    if (g != nullptr)
      for (int e = 0; e < E; ++e) {
        const float se = sigmoid_f32(convert<float>(l[e]));
        g[e] = coef * (f[e] - s) * se * (1.0f - se) / S;
      }
    status[t] = st;
  }
};

// ST-MoE, token t: z[t] = logsumexp_e l[t, e] = mx + log(sum_e exp(l_e - mx)); with `grad`,
// grad[t, e] = coef * (z_t * p_e): z_t * p_e is at most |z_t| (p <= 1), so a coefficient
// above 1 cannot make the product infinite where the gradient is not (nor inf * 0 a NaN
// where p_e is 0).
template <class T>
struct z_token {
  const T* logits;  // [N, E]
  int E;
  float* z;     // [N] or null
  float* grad;  // [N, E] or null
  float coef;
  token_status* status;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const T* l = nullptr;
    float* g = nullptr;
    if (!loss_token(logits, E, t, z, grad, status, l, g)) return;
    const softmax_f32 sm = softmax_of(E, [&](int e) { return convert<float>(l[e]); });
    const float lse = sm.mx + log_f32(sm.z);
    if (z != nullptr) z[t] = lse;
    if (g != nullptr)
      for (int e = 0; e < E; ++e) g[e] = coef * (lse * sm.p(convert<float>(l[e])));
  }
};

// Call with e in [0, E): bias[e] += gamma * sign[e] (sign in {-1, 0, 1}: one rounding).
struct bias_step {
  float* bias;
  const float* sign;
  float gamma;

  EPX_HOST_DEVICE void operator()(std::size_t e) const { bias[e] = bias[e] + gamma * sign[e]; }
};

// The checks every loss makes; `what` names the call.
template <class T>
void check_loss_args(const char* what, const T* logits, std::size_t N, int E, double coef, const char* coef_name) {
  EPX_REQUIRE(E >= 1, errc::input, what, ": number of experts E (", E, ") must be at least 1");
  EPX_REQUIRE(N == 0 || logits != nullptr, errc::input, what, ": null logits for N = ", N, " tokens");
  EPX_REQUIRE(std::isfinite(coef), errc::configuration, what, ": ", coef_name, " (", coef, ") is not finite");
}

// The float32 coefficient of a _backward, grad_loss * coef * m / N (m: E, 1 or 2; N = 0
// counted as 1). A coefficient whose scaled value coef * m / N is beyond float32's range is
// errc::configuration, checked by the forward too so that both refuse it; a grad_loss that
// takes the product beyond it errc::input. With grad_loss = 1 this is only the check.
inline float scaled_coefficient(const char* what, const char* coef_name, double coef, double m, std::size_t N,
                                float grad_loss = 1.0f) {
  constexpr double max = static_cast<double>(std::numeric_limits<float>::max());
  const double n = static_cast<double>(N ? N : 1);
  const double scaled = coef * m / n;
  EPX_REQUIRE(std::isfinite(scaled) && std::abs(scaled) <= max, errc::configuration, what, ": ", coef_name, " (",
              coef, ") scaled by ", m, " / ", n, " is ", scaled, ", not finite in float32");
  const double c = static_cast<double>(grad_loss) * coef * m / n;
  EPX_REQUIRE(std::isfinite(c) && std::abs(c) <= max, errc::input, what, ": grad_loss (", grad_loss,
              ") times the scaled ", coef_name, " (", scaled, ") is ", c, ", not finite in float32");
  return static_cast<float>(c);
}

// The checks every loss's _backward adds: a finite grad_loss (errc::input, like a
// non-finite grad_weights of route_backward) and a gradient buffer for N > 0.
inline void check_backward_args(const char* what, std::size_t N, float grad_loss, const float* grad_logits) {
  EPX_REQUIRE(std::isfinite(grad_loss), errc::input, what, ": grad_loss (", grad_loss, ") is not finite");
  EPX_REQUIRE(N == 0 || grad_logits != nullptr, errc::input, what, ": null grad_logits for N = ", N);
}

inline std::vector<float> load_fractions(const char* what, span<const std::int64_t> load, int E) {
  EPX_REQUIRE(load.size() == static_cast<std::size_t>(E), errc::input, what, ": load holds ", load.size(),
              " values, not E = ", E);
  std::int64_t total = 0;
  for (std::size_t e = 0; e < load.size(); ++e) {
    EPX_REQUIRE(load[e] >= 0, errc::input, what, ": load of expert ", e, " is negative (", load[e], ")");
    total += load[e];
  }
  std::vector<float> f(load.size(), 0.0f);
  if (total > 0)
    for (std::size_t e = 0; e < load.size(); ++e)
      f[e] = static_cast<float>(static_cast<double>(load[e]) / static_cast<double>(total));
  return f;
}

// Runs `launch(status)` over N tokens and raises for the first failing one.
template <class Exec, class Launch>
void run_tokens(const Exec& ex, std::size_t N, const char* what, const Launch& launch) {
  if (N == 0) return;
  auto status = exec::make_buffer<token_status>(ex, N);
  launch(status.data());
  check_status(ex, status.data(), N, what, "balance");
}

// Sum in double, in token order, of N float32 per-token values in the policy's memory.
template <class Exec>
double sum_tokens(const Exec& ex, const float* v, std::size_t N, bool squares = false) {
  std::vector<float> h(N);
  epx::detail::to_host(ex, v, N, h.data());
  double s = 0.0;
  for (float x : h) s += squares ? static_cast<double>(x) * static_cast<double>(x) : static_cast<double>(x);
  return s;
}

template <class Exec>
exec::buffer<float, Exec> to_policy(const Exec& ex, const std::vector<float>& v) {
  auto b = exec::make_buffer<float>(ex, v.size());
  epx::detail::from_host(ex, v.data(), v.size(), b.data());
  return b;
}

// The per-sequence fractions f' [N / T, E] in the policy's memory.
template <class Exec>
exec::buffer<float, Exec> sequence_fractions(const Exec& ex, const char* what, const std::int32_t* ids, std::size_t N,
                                             int E, int k, std::size_t T) {
  EPX_REQUIRE(k >= 1 && k <= E, errc::input, what, ": top_k (", k, ") must be in [1, E] with E = ", E);
  EPX_REQUIRE(T >= 1 && N % T == 0, errc::input, what, ": N (", N, ") must be a multiple of the sequence length T (",
              T, ")");
  EPX_REQUIRE(N == 0 || ids != nullptr, errc::input, what, ": null ids for N = ", N, " tokens");
  const std::size_t nseq = N / T;
  auto fp = exec::make_buffer<float>(ex, nseq * static_cast<std::size_t>(E));
  const auto scale = static_cast<float>(static_cast<double>(E) / (static_cast<double>(k) * static_cast<double>(T)));
  exec::for_each_n(ex, nseq, sequence_selection{ids, E, k, T, scale, fp.data()});
  return fp;
}

}  // namespace detail

// Pairs routed to each expert: load[e] = #{(t, j) : ids[t, j] == e}, host vector [E].
// ids [N, k] in the policy's memory. An id outside [0, E) raises errc::input naming it.
template <class Exec>
std::vector<std::int64_t> expert_load(const Exec& ex, const std::int32_t* ids, std::size_t N, int k, int E) {
  EPX_REQUIRE(E >= 1 && k >= 1, errc::input, "expert_load: E (", E, ") and k (", k, ") must be at least 1");
  const std::size_t pairs = N * static_cast<std::size_t>(k), Es = static_cast<std::size_t>(E);
  std::vector<std::int64_t> load(Es, 0);
  if (pairs == 0) return load;
  EPX_REQUIRE(ids != nullptr, errc::input, "expert_load: null ids for N = ", N, " tokens");
  std::size_t C = exec::is_host_policy_v<Exec> ? 1 : 256;
  C = C < pairs ? C : pairs;
  const std::size_t per = (pairs + C - 1) / C;
  C = (pairs + per - 1) / per;
  auto counts = exec::make_buffer<std::int64_t>(ex, C * Es);
  auto small = exec::make_buffer<std::int64_t>(ex, C + Es);  // [C] first bad id | [E] load
  exec::for_each_n(ex, C, detail::load_chunks{ids, pairs, per, E, counts.data(), small.data()});
  exec::for_each_n(ex, Es, detail::load_sum{counts.data(), C, E, small.data() + C});
  std::vector<std::int64_t> h(C + Es);
  epx::detail::to_host(ex, static_cast<const std::int64_t*>(small.data()), h.size(), h.data());
  for (std::size_t c = 0; c < C; ++c) {
    if (h[c] < 0) continue;
    std::int32_t id = 0;
    epx::detail::to_host(ex, ids + h[c], 1, &id);
    EPX_THROW(errc::input, "expert_load: expert id (", id, ") of token ", h[c] / k, " slot ", h[c] % k,
              " out of range [0, ", E, ")");
  }
  load.assign(h.begin() + static_cast<std::ptrdiff_t>(C), h.end());
  return load;
}

// Switch/GShard auxiliary loss (see the top of this header). `load` [E] (host): the local
// load of this batch, or the global-batch load (sum_over_batches).
template <class Exec, class T>
double aux_loss(const Exec& ex, const T* logits, std::size_t N, int E, span<const std::int64_t> load, double alpha) {
  detail::check_loss_args("aux_loss", logits, N, E, alpha, "alpha");
  detail::scaled_coefficient("aux_loss", "alpha", alpha, E, N);
  const auto f = detail::to_policy(ex, detail::load_fractions("aux_loss", load, E));
  if (N == 0) return 0.0;
  auto q = exec::make_buffer<float>(ex, N);
  detail::run_tokens(ex, N, "aux_loss", [&](detail::token_status* st) {
    exec::for_each_n(ex, N, detail::aux_token<T>{logits, E, f.data(), q.data(), nullptr, 0.0f, st});
  });
  return alpha * static_cast<double>(E) / static_cast<double>(N) * detail::sum_tokens(ex, q.data(), N);
}

// grad_logits [N, E] = grad_loss * dL/dlogits:
//   grad[t, e] = grad_loss * alpha * E / N * p[t, e] (f_e - sum_e' f_e' p[t, e']).
template <class Exec, class T>
void aux_loss_backward(const Exec& ex, const T* logits, std::size_t N, int E, span<const std::int64_t> load,
                       double alpha, float grad_loss, float* grad_logits) {
  detail::check_loss_args("aux_loss_backward", logits, N, E, alpha, "alpha");
  detail::check_backward_args("aux_loss_backward", N, grad_loss, grad_logits);
  const auto f = detail::to_policy(ex, detail::load_fractions("aux_loss_backward", load, E));
  const float coef = detail::scaled_coefficient("aux_loss_backward", "alpha", alpha, E, N, grad_loss);
  detail::run_tokens(ex, N, "aux_loss_backward", [&](detail::token_status* st) {
    exec::for_each_n(ex, N, detail::aux_token<T>{logits, E, f.data(), nullptr, grad_logits, coef, st});
  });
}

// DeepSeek-V3 sequence-wise balance loss over N / T sequences of T consecutive tokens (see
// the top of this header); ids [N, k] are the selected experts.
template <class Exec, class T>
double sequence_balance_loss(const Exec& ex, const T* logits, const std::int32_t* ids, std::size_t N, int E, int k,
                             std::size_t T_len, double alpha) {
  detail::check_loss_args("sequence_balance_loss", logits, N, E, alpha, "alpha");
  detail::scaled_coefficient("sequence_balance_loss", "alpha", alpha, 1.0, N);
  const auto fp = detail::sequence_fractions(ex, "sequence_balance_loss", ids, N, E, k, T_len);
  if (N == 0) return 0.0;
  auto q = exec::make_buffer<float>(ex, N);
  detail::run_tokens(ex, N, "sequence_balance_loss", [&](detail::token_status* st) {
    exec::for_each_n(ex, N,
                     detail::sequence_token<T>{logits, ids, E, k, T_len, fp.data(), q.data(), nullptr, 0.0f, st});
  });
  return alpha / static_cast<double>(N) * detail::sum_tokens(ex, q.data(), N);
}

// grad[t, e] = grad_loss * alpha / N * (f'_e - sum_e' f'_e' r[t, e']) * s_e (1 - s_e) / S_t,
// r = s / S_t, S_t = sum_e s[t, e] + 1e-20.
template <class Exec, class T>
void sequence_balance_loss_backward(const Exec& ex, const T* logits, const std::int32_t* ids, std::size_t N, int E,
                                    int k, std::size_t T_len, double alpha, float grad_loss, float* grad_logits) {
  detail::check_loss_args("sequence_balance_loss_backward", logits, N, E, alpha, "alpha");
  detail::check_backward_args("sequence_balance_loss_backward", N, grad_loss, grad_logits);
  const auto fp = detail::sequence_fractions(ex, "sequence_balance_loss_backward", ids, N, E, k, T_len);
  const float coef =
      detail::scaled_coefficient("sequence_balance_loss_backward", "alpha", alpha, 1.0, N, grad_loss);
  detail::run_tokens(ex, N, "sequence_balance_loss_backward", [&](detail::token_status* st) {
    exec::for_each_n(ex, N,
                     detail::sequence_token<T>{logits, ids, E, k, T_len, fp.data(), nullptr, grad_logits, coef, st});
  });
}

// ST-MoE router z-loss: L = beta * mean_t (logsumexp_e logits[t, e])^2.
template <class Exec, class T>
double z_loss(const Exec& ex, const T* logits, std::size_t N, int E, double beta) {
  detail::check_loss_args("z_loss", logits, N, E, beta, "beta");
  detail::scaled_coefficient("z_loss", "beta", beta, 2.0, N);
  if (N == 0) return 0.0;
  auto z = exec::make_buffer<float>(ex, N);
  detail::run_tokens(ex, N, "z_loss", [&](detail::token_status* st) {
    exec::for_each_n(ex, N, detail::z_token<T>{logits, E, z.data(), nullptr, 0.0f, st});
  });
  return beta / static_cast<double>(N) * detail::sum_tokens(ex, z.data(), N, /*squares=*/true);
}

// grad[t, e] = grad_loss * beta * 2 / N * lse_t * p[t, e].
template <class Exec, class T>
void z_loss_backward(const Exec& ex, const T* logits, std::size_t N, int E, double beta, float grad_loss,
                     float* grad_logits) {
  detail::check_loss_args("z_loss_backward", logits, N, E, beta, "beta");
  detail::check_backward_args("z_loss_backward", N, grad_loss, grad_logits);
  const float coef = detail::scaled_coefficient("z_loss_backward", "beta", beta, 2.0, N, grad_loss);
  detail::run_tokens(ex, N, "z_loss_backward", [&](detail::token_status* st) {
    exec::for_each_n(ex, N, detail::z_token<T>{logits, E, nullptr, grad_logits, coef, st});
  });
}

// sign(mean_e' load_e' - load_e) for every expert, from the integers alone (no rounding):
// with total = q E + r (0 <= r < E), mean - load_e has the sign of q - load_e, or of r when
// load_e == q.
inline std::vector<int> bias_signs(span<const std::int64_t> load) {
  std::int64_t total = 0;
  for (std::size_t e = 0; e < load.size(); ++e) {
    EPX_REQUIRE(load[e] >= 0, errc::input, "update_bias: load of expert ", e, " is negative (", load[e], ")");
    total += load[e];
  }
  const auto E = static_cast<std::int64_t>(load.size());
  std::vector<int> sign(load.size(), 0);
  if (E == 0) return sign;
  const std::int64_t q = total / E, r = total % E;
  for (std::size_t e = 0; e < load.size(); ++e)
    sign[e] = load[e] < q ? 1 : load[e] > q ? -1 : (r > 0 ? 1 : 0);
  return sign;
}

// DeepSeek-V3's bias update: bias_e += gamma * sign(mean_e' load_e' - load_e). bias [E] in
// the policy's memory; load [E] (host) the pairs routed to each expert over every batch of
// the job (sum_over_batches). The same load and bias give the same bits on every rank.
template <class Exec>
void update_bias(const Exec& ex, float* bias, span<const std::int64_t> load, float gamma) {
  EPX_REQUIRE(std::isfinite(gamma), errc::configuration, "update_bias: gamma (", gamma, ") is not finite");
  EPX_REQUIRE(load.empty() || bias != nullptr, errc::input, "update_bias: null bias for E = ", load.size());
  const std::vector<int> s = bias_signs(load);
  if (s.empty()) return;
  const std::vector<float> sign(s.begin(), s.end());
  const auto d = detail::to_policy(ex, sign);
  exec::for_each_n(ex, sign.size(), detail::bias_step{bias, d.data(), gamma});  // `d` is freed in stream order
}

// Collective over `world` (the mesh's world): the communicator of this rank's pipeline
// stage and tp position, one rank per batch of the job, in batch order. Its all_reduce sums
// a per-batch quantity once per batch (the ranks of a TP group hold the same batch).
template <class Comm>
Comm batch_communicator(const Comm& world, const mesh& m) {
  m.validate_world(world.size());
  const rank_coords x = m.coords(world.rank());
  return world.split(x.pp * m.tp() + x.tp, m.batch(world.rank()));
}

// In place: load [E] (host) becomes the sum over every batch of the job, with one
// all_reduce over `batches` (a batch_communicator). Integer sums are exact, so every rank
// ends with the same values.
template <class Comm>
void sum_over_batches(Comm& batches, span<std::int64_t> load) {
  ::epx::detail::all_reduce_host(batches, load);  // a device communicator sums a device copy
}

}  // namespace epx::routing
