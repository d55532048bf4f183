// epx/kernels/dot.hpp: the routing-weight gradients, one dot product per (token, slot).
//
//   grad_w[t, j] = sum_h y(pos[t*k+j])[h] * grad_out[t, h]     (0 for a negative position)
//
// The sum runs in dot_lanes interleaved lanes: lane w holds the terms h = w, w + dot_lanes,
// ... in h order, and the lanes are added in lane order at the end. A fixed order, the same
// on every policy (bitwise reproducible), that a host compiler vectorises without
// reassociating anything; on the host in its widest version (epx/exec/host_isa.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/kernels/rows.hpp"

namespace epx::kernels {

namespace detail {
inline constexpr std::size_t dot_lanes = 16;

template <class A, class T, class U>
EPX_HOST_DEVICE EPX_HOST_INLINE A dot_in_lanes(const T* a, const U* b, std::size_t n) noexcept {
  A lane[dot_lanes];
  for (std::size_t w = 0; w < dot_lanes; ++w) lane[w] = A(0);
  std::size_t h = 0;
  for (; h + dot_lanes <= n; h += dot_lanes)
    for (std::size_t w = 0; w < dot_lanes; ++w) lane[w] = mul_add(lane[w], convert<A>(a[h + w]), convert<A>(b[h + w]));
  for (std::size_t w = 0; h + w < n; ++w) lane[w] = mul_add(lane[w], convert<A>(a[h + w]), convert<A>(b[h + w]));
  A s = A(0);
  for (std::size_t w = 0; w < dot_lanes; ++w) s += lane[w];
  return s;
}
}  // namespace detail

// Call with i = t*k + j in [0, n*k).
template <class T, class Rows>
struct pair_dot {
  Rows y;                   // dense_rows or row_table, indexed by position
  const T* grad_out;        // [n, H]
  const std::int64_t* pos;  // [n, k]
  float* grad_weights;      // [n, k]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t i) const { EPX_RUN_WIDEST(i); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t i) const {
    using A = accum_t<T>;
    const std::int64_t p = pos[i];
    if (p < 0) {
      grad_weights[i] = 0.0f;
      return;
    }
    const T* g = grad_out + (i / static_cast<std::size_t>(top_k)) * hidden;
    grad_weights[i] = static_cast<float>(detail::dot_in_lanes<A>(row_at(y, static_cast<std::size_t>(p), hidden), g, hidden));
  }
};

// The device shape of the same sums (exec::row_shape::chunks16 policies): one call per
// (pair, lane), so neighbouring threads read neighbouring elements of a row, then one call
// per pair adds the lanes in lane order. Each lane holds the terms h = w, w + dot_lanes, ...
// in h order, exactly as dot_in_lanes does: the same bits as pair_dot.
// Call with q = i * dot_lanes + w in [0, n*k*dot_lanes).
template <class T, class Rows>
struct pair_dot_lanes {
  Rows y;
  const T* grad_out;          // [n, H]
  const std::int64_t* pos;    // [n, k]
  accum_t<T>* lanes;          // [n*k, dot_lanes]
  std::size_t hidden;
  int top_k;

  // On the host (exec::emulated_device) through the host versions too, which are compiled
  // without contraction: at the build's flags a GCC build for FMA targets (-mfma,
  // -march=haswell) would fuse mul_add here and differ from pair_dot.
  EPX_HOST_DEVICE void operator()(std::size_t q) const { EPX_RUN_WIDEST(q); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t q) const {
    using A = accum_t<T>;
    const std::size_t i = q / detail::dot_lanes, w = q % detail::dot_lanes;  // powers of two
    const std::int64_t p = pos[i];
    A acc = A(0);
    if (p >= 0) {
      const T* a = row_at(y, static_cast<std::size_t>(p), hidden);
      const T* g = grad_out + (i / static_cast<std::size_t>(top_k)) * hidden;
      for (std::size_t h = w; h < hidden; h += detail::dot_lanes)
        acc = detail::mul_add(acc, convert<A>(a[h]), convert<A>(g[h]));
    }
    lanes[q] = acc;
  }
};

// Call with i in [0, n*k): grad_w[i] = the lanes of pair i added in lane order (0 for a
// negative position).
template <class A>
struct pair_dot_sum {
  const A* lanes;             // [n*k, dot_lanes]
  const std::int64_t* pos;    // [n, k]
  float* grad_weights;        // [n, k]

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    if (pos[i] < 0) {
      grad_weights[i] = 0.0f;
      return;
    }
    A s = A(0);
    for (std::size_t w = 0; w < detail::dot_lanes; ++w) s += lanes[i * detail::dot_lanes + w];
    grad_weights[i] = static_cast<float>(s);
  }
};

}  // namespace epx::kernels
