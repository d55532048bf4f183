// epx/routing/detail/topk.hpp: per-token building blocks of the routing functors.
//
// Everything here is EPX_HOST_DEVICE, allocation-free and works on fixed-size local
// arrays, so the same code runs in the host policies and in a CUDA kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

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

// softmax_of when the largest value mx is known. With `ex` non-null, also stores
// ex[i] = exp(v(i) - mx), the terms of z.
template <class V>
EPX_HOST_DEVICE inline softmax_f32 softmax_with_max(int n, const V& v, float mx, float* ex = nullptr) noexcept {
  float z = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float e = exp_f32(v(i) - mx);
    if (ex != nullptr) ex[i] = e;
    z += e;
  }
  return softmax_f32{mx, z};
}

template <class V>
EPX_HOST_DEVICE inline softmax_f32 softmax_of(int n, const V& v, float* ex = nullptr) noexcept {
  float mx = v(0);
  for (int i = 1; i < n; ++i) {
    const float x = v(i);
    mx = x > mx ? x : mx;
  }
  return softmax_with_max(n, v, mx, ex);
}

// A running top-k list: keys descending, ties in insertion order. Candidates are offered
// in ascending expert id, so ties end up ordered by the lower expert id first.
template <int Capacity>
struct topk_list {
  float key[static_cast<std::size_t>(Capacity)];
  std::int32_t id[static_cast<std::size_t>(Capacity)];
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

// Up to this many experts a host functor holds a token's selection keys in a local array
// (key_table); device threads compute each key where they need it and offer every one.
inline constexpr int max_key_table = 512;

// A token's selection keys key[e], e in [0, E) (host), with the maximum of every group of
// `span` consecutive keys, so that the best c keys of a range come from few of its keys:
// split the range's groups into c disjoint runs; the smallest of the c run maxima is
// reached by c keys (one in each run), so each of the best c keys reaches it. Offering, in
// ascending id, only the keys that reach that threshold leaves a topk_list exactly as
// offering all of them would: the skipped keys are below c others, and the list holds the
// best c of what it was offered, ties to the earlier offer. One pass fills the table (and
// gives the largest key); a selection then reads the group maxima and compares each key of
// its range once, offering a few of them, where offering all would insert at every new
// leader (a mispredicted branch each).
struct key_table {
  float key[max_key_table];
  float gmax[max_key_table];
  int span = 1;  // keys per group: 4, 2 or 1, the largest dividing `unit`

  // key[e] = f(e) for e in [0, E), E <= max_key_table; `unit` (dividing E: the experts of a
  // node, or E) is what no group may cross. Returns the largest key.
  template <class F>
  float fill(int E, int unit, const F& f) noexcept {
    span = unit % 4 == 0 ? 4 : unit % 2 == 0 ? 2 : 1;
    for (int e = 0; e < E; ++e) key[e] = f(e);
    const int groups = E / span;
    float mx = std::numeric_limits<float>::lowest();  // keys are finite
    for (int g = 0; g < groups; ++g) {
      float m = key[g * span];
      for (int i = 1; i < span; ++i) m = key[g * span + i] > m ? key[g * span + i] : m;
      gmax[g] = m;
      mx = m > mx ? m : mx;
    }
    return mx;
  }

  // The threshold of the best c keys of the groups whose maxima are gm[0, ng): the smallest
  // maximum of c runs of consecutive groups; the lowest float (every key: keys are finite)
  // with fewer than c groups.
  static float threshold(const float* gm, int ng, int c) noexcept {
    if (c < 1 || ng < c) return std::numeric_limits<float>::lowest();
    float t = std::numeric_limits<float>::max();
    for (int j = 0; j < c; ++j) {
      const int a = j * ng / c, b = (j + 1) * ng / c;
      float m = gm[a];
      for (int i = a + 1; i < b; ++i) m = gm[i] > m ? gm[i] : m;
      t = m < t ? m : t;
    }
    return t;
  }

  // Offers the keys of [lo, hi) (group boundaries) to `top` in ascending id, as offering all
  // of them would leave it.
  template <class List>
  void offer(int lo, int hi, List& top) const noexcept {
    offer_reaching(lo, hi, threshold(gmax + lo / span, (hi - lo) / span, top.k), top);
  }

  // Offers the keys of [lo, hi) (group boundaries) that reach t, in ascending id. The
  // groups whose maximum reaches t are gathered first, then their keys that reach it, each
  // without a branch (an index store and a compare), so that only the offers, few, branch
  // on the data.
  template <class List>
  void offer_reaching(int lo, int hi, float t, List& top) const noexcept {
    std::int32_t at[max_key_table];
    int ng = 0;
    for (int g = lo / span; g < hi / span; ++g) {
      at[ng] = g;
      ng += gmax[g] >= t ? 1 : 0;
    }
    std::int32_t ids[max_key_table];
    int n = 0;
    for (int i = 0; i < ng; ++i)
      for (int e = at[i] * span; e < (at[i] + 1) * span; ++e) {
        ids[n] = e;
        n += key[e] >= t ? 1 : 0;
      }
    for (int i = 0; i < n; ++i) top.offer(key[ids[i]], ids[i]);
  }
};

}  // namespace epx::routing::detail
