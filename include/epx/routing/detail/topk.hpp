// epx/routing/detail/topk.hpp: per-token building blocks of the routing functors.
//
// Everything here is EPX_HOST_DEVICE, allocation-free and works on fixed-size local
// arrays, so the same code runs in the host policies and in a CUDA kernel.
#pragma once

#include <cmath>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"

namespace epx::routing::detail {

// exp in float32 on host and device.
EPX_HOST_DEVICE inline float exp_f32(float x) noexcept {
#if EPX_IS_DEVICE_CODE
  return ::expf(x);
#else
  return std::exp(x);
#endif
}

// 1 / (1 + exp(-x)), never NaN. For x < 0 it is computed as e / (1 + e), e = exp(x), which
// keeps relative precision down to the float32 subnormals (x > -103) instead of
// rounding to 0 once exp(-x) overflows (x < -88).
EPX_HOST_DEVICE inline float sigmoid_f32(float x) noexcept {
  if (x >= 0.0f) return 1.0f / (1.0f + exp_f32(-x));
  const float e = exp_f32(x);
  return e / (1.0f + e);
}

// Neither NaN nor +-inf (exponent bits not all ones); no <cmath> dependency on device.
EPX_HOST_DEVICE inline bool is_finite_f32(float x) noexcept {
  return (epx::detail::float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

EPX_HOST_DEVICE inline bool is_finite_f64(double x) noexcept {
  return x - x == 0.0;  // NaN - NaN and inf - inf are NaN
}

// The float32 softmax of n values v(0), ..., v(n - 1): p(x) = exp(x - mx) / z, where mx is
// the largest value and z the sum of exp(v(i) - mx) taken in ascending i.
struct softmax_f32 {
  float mx;
  float z;

  EPX_HOST_DEVICE float p(float x) const noexcept { return exp_f32(x - mx) / z; }
};

// With `ex` non-null, also stores ex[i] = exp(v(i) - mx), the terms of z.
template <class V>
EPX_HOST_DEVICE inline softmax_f32 softmax_of(int n, const V& v, float* ex = nullptr) noexcept {
  float mx = v(0);
  for (int i = 1; i < n; ++i) {
    const float x = v(i);
    mx = x > mx ? x : mx;
  }
  float z = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float e = exp_f32(v(i) - mx);
    if (ex != nullptr) ex[i] = e;
    z += e;
  }
  return softmax_f32{mx, z};
}

// A running top-k list: keys descending, ties in insertion order. Candidates are offered
// in ascending expert id, so ties end up ordered by the lower expert id first.
template <int Capacity>
struct topk_list {
  float key[Capacity];
  std::int32_t id[Capacity];
  int size = 0;
  int k = 0;

  EPX_HOST_DEVICE explicit topk_list(int k_) noexcept : k(k_) {}

  EPX_HOST_DEVICE void offer(float v, std::int32_t e) noexcept {
    if (size == k && !(v > key[k - 1])) return;  // not better than the current k-th
    int pos = size < k ? size : k - 1;
    // Shift strictly smaller keys down; an equal key stays ahead (it has a lower id).
    while (pos > 0 && key[pos - 1] < v) {
      key[pos] = key[pos - 1];
      id[pos] = id[pos - 1];
      --pos;
    }
    key[pos] = v;
    id[pos] = e;
    if (size < k) ++size;
  }
};

}  // namespace epx::routing::detail
