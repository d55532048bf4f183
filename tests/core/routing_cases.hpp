// tests/core/routing_cases.hpp: what the routing tests share: running a policy through the
// library into fresh (garbage-filled) ids and weights, and the selection margin below which
// float32 and float64 may legitimately pick different experts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/routing/routing.hpp"

namespace epx::test {

// Below this selection margin float32 and float64 may legitimately pick different experts.
constexpr double near_tie = 1e-4;

struct lib_routing {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

template <class T, class Policy, class Exec>
lib_routing run_route(const Policy& p, const Exec& ex, const std::vector<T>& logits, std::size_t N, int E, int k) {
  lib_routing r{std::vector<std::int32_t>(N * k, -7), std::vector<float>(N * k, -7.0f)};
  routing::route(p, ex, epx::span<const T>(logits.data(), logits.size()), E, k, epx::make_span(r.ids),
                 epx::make_span(r.weights));
  return r;
}

}  // namespace epx::test
