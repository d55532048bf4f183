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
//   - slot j = 0 holds the best expert; ties in the selection key (the float32 p, logit or
//     s + bias) go to the lower expert id, so routing is deterministic and identical on
//     every host execution policy (the CUDA policy's exp may round p or s differently, so
//     a near tie can order the other way there); products and sums round separately on
//     the device and on hosts without fused multiply-add instructions
//     (epx::detail::mul_add; a host build for FMA targets, -march=native, may fuse them
//     unless built with -ffp-contract=off), so the CUDA policy's gradients differ from an
//     x86-64 baseline host's only through its exp;
//   - one EPX_HOST_DEVICE functor per token, launched with exec::for_each_n; the functors
//     use fixed-size local arrays (k <= max_top_k, n_group <= max_groups);
//   - non-finite logits raise epx::error(errc::input) naming the first bad token, the
//     expert and the value; the ids/weights of such a call are unspecified.
// Pointers (logits, ids, weights, bias, gradients) live in the execution policy's memory
// space (host memory for exec::serial / exec::openmp, device memory for exec::cuda).
//
// This header includes every policy and holds route() and route_backward():
//   routing/common.hpp        limits, is_routing_policy_v, status and finite checks,
//                             the inputs and outputs every functor shares (forward_io,
//                             backward_io)
//   routing/softmax_topk.hpp  routing/topk_softmax.hpp  routing/sigmoid_bias.hpp
//   routing/given.hpp         one policy each, its forward and backward functors
//   routing/detail/topk.hpp   the per-token top-k list and float32 math (sigmoid, softmax)
//   routing/node_limit.hpp    node-limited selection (every policy's `limit` member)
// and, beside it, routing/balance.hpp: balancing losses, expert loads and the bias update.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/given.hpp"
#include "epx/routing/node_limit.hpp"
#include "epx/routing/sigmoid_bias.hpp"
#include "epx/routing/softmax_topk.hpp"
#include "epx/routing/topk_softmax.hpp"

namespace epx::routing {

// Each policy header gives, in namespace detail, policy_name() and (except given, which
// route() refuses) validate(), launch_forward() and launch_backward(); route() and
// route_backward() below pick the overloads for the policy at hand.

namespace detail {

// What route() and route_backward() do once the types are checked: the policy's checks of
// E and k, nothing more for N == 0, the null-pointer check (`pointers` names the pointers
// for the message), then launch(status) with a per-token status buffer [N], which is read
// back and turned into an epx::error for the first failing token.
template <class Policy, class Exec, class Launch>
void run_checked(const Policy& policy, const Exec& exec, const char* call, std::size_t N, int E, int k,
                 bool non_null, const char* pointers, const Launch& launch) {
  validate(policy, call, E, k);
  if (N == 0) return;
  EPX_REQUIRE(non_null, errc::input, call, "(", policy_name(policy), "): null ", pointers, " for N = ", N,
              " tokens");
  auto status = exec::make_buffer<token_status>(exec, N);
  launch(status.data());
  check_status(exec, status.data(), N, call, policy_name(policy));
}

// The functors are launched by value on CUDA devices: plain aggregates, no virtual functions.
static_assert(std::is_trivially_copyable_v<softmax_topk_forward<bf16>> &&
                  std::is_trivially_copyable_v<softmax_topk_backward<bf16>> &&
                  std::is_trivially_copyable_v<topk_softmax_forward<bf16>> &&
                  std::is_trivially_copyable_v<topk_softmax_backward<bf16>> &&
                  std::is_trivially_copyable_v<sigmoid_bias_forward<bf16>> &&
                  std::is_trivially_copyable_v<sigmoid_bias_backward<bf16>>,
              "routing functors must stay trivially copyable");

// The span forms' N: the number of rows of E in `size` logits.
inline std::size_t token_count(const char* call, std::size_t size, int E) {
  EPX_REQUIRE(E >= 1 && size % static_cast<std::size_t>(E) == 0, errc::input, call, ": logits hold ", size,
              " values, not a multiple of E (", E, ")");
  return size / static_cast<std::size_t>(E);
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
    detail::run_checked(policy, exec, "route", N, E, k, logits != nullptr && ids != nullptr && weights != nullptr,
                        "logits, ids or weights", [&](detail::token_status* status) {
                          detail::launch_forward(policy, exec, N,
                                                 detail::forward_io<T>{logits, E, k, ids, weights, status});
                        });
  }
}

// Span form: N = logits.size() / E; ids and weights must hold N * k values. `logits` may
// be a span of T or of const T.
template <class Policy, class Exec, class L>
void route(const Policy& policy, const Exec& exec, span<L> logits, int E, int k, span<std::int32_t> ids,
           span<float> weights) {
  using T = std::remove_const_t<L>;
  detail::validate_top_k("route", detail::policy_name(policy), E, k);  // before the sizes, which follow from them
  const std::size_t N = detail::token_count("route", logits.size(), E);
  EPX_REQUIRE(ids.size() == N * static_cast<std::size_t>(k) && weights.size() == ids.size(), errc::input,
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
    detail::run_checked(
        policy, exec, "route_backward", N, E, k,
        logits != nullptr && ids != nullptr && grad_weights != nullptr && grad_logits != nullptr,
        "logits, ids, grad_weights or grad_logits", [&](detail::token_status* status) {
          detail::launch_backward(policy, exec, N,
                                  detail::backward_io<T>{logits, E, k, ids, grad_weights, grad_logits, status});
        });
  }
}

// Span form: N = logits.size() / E; ids, grad_weights [N, k]; grad_logits [N, E];
// `weights` may be empty.
template <class Policy, class Exec, class L>
void route_backward(const Policy& policy, const Exec& exec, span<L> logits, int E, int k,
                    span<const std::int32_t> ids, span<const float> weights, span<const float> grad_weights,
                    span<float> grad_logits) {
  detail::validate_top_k("route_backward", detail::policy_name(policy), E, k);
  const std::size_t N = detail::token_count("route_backward", logits.size(), E);
  EPX_REQUIRE(ids.size() == N * static_cast<std::size_t>(k) && grad_weights.size() == ids.size() &&
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
