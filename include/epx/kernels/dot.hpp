// epx/kernels/dot.hpp: the routing-weight gradients, one dot product per (token, slot).
//
//   grad_w[t, j] = sum_h y(pos[t*k+j])[h] * grad_out[t, h]     (0 for a negative position)
//
// The sum runs in dot_lanes interleaved lanes: lane w holds the terms h = w, w + dot_lanes,
// ... in h order, and the lanes are added in lane order at the end. A fixed order, the same
// on every policy (bitwise reproducible), that a host compiler vectorises without
// reassociating anything; on the host in its widest version (epx/exec/host_isa.hpp).
//
// On the host, rows read through a row table (the direct route) and 16-bit rows go a token
// per call (token_dots): the slots that have a row go through in groups of up to
// dot_group, which share each load of the token's grad_out row and keep dot_group sums in
// flight. One slot's lanes are one chain of additions (a vector of 16 floats), and its
// latency bounded the slot-at-a-time loop, so that bf16 rows took as long as float32 ones.
// Dense float32 and float64 rows go a pair per call (pair_dot): grouped, the float32 dots
// of the PyTorch bindings' backward ran slower. Each slot's operations are those of one
// slot alone, so the bits are the same either way (bench/README.md, "Token-grouped dots").
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/kernels/rows.hpp"

namespace epx::kernels {

namespace detail {
inline constexpr std::size_t dot_lanes = 16;
inline constexpr std::size_t dot_group = 8;  // slots of a token summed together (host)

// a . b in dot_lanes lanes.
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

// s[u] = a[u] . b for u < G (G >= 2), each as dot_in_lanes sums it; the rows a[u] share
// each load of b. (One row goes through dot_in_lanes: GCC's -O3 vectorises this loop for
// G = 1 across h, with a shuffle per vector, three times slower.)
template <std::size_t G, class A, class T, class U>
EPX_HOST_DEVICE EPX_HOST_INLINE void dots_in_lanes(const T* const* a, const U* b, std::size_t n, A* s) noexcept {
  A lane[G][dot_lanes];
  for (std::size_t u = 0; u < G; ++u)
    for (std::size_t w = 0; w < dot_lanes; ++w) lane[u][w] = A(0);
  std::size_t h = 0;
  for (; h + dot_lanes <= n; h += dot_lanes)
    for (std::size_t u = 0; u < G; ++u)
      for (std::size_t w = 0; w < dot_lanes; ++w)
        lane[u][w] = mul_add(lane[u][w], convert<A>(a[u][h + w]), convert<A>(b[h + w]));
  for (std::size_t u = 0; u < G; ++u)
    for (std::size_t w = 0; h + w < n; ++w) lane[u][w] = mul_add(lane[u][w], convert<A>(a[u][h + w]), convert<A>(b[h + w]));
  for (std::size_t u = 0; u < G; ++u) {
    A sum = A(0);
    for (std::size_t w = 0; w < dot_lanes; ++w) sum += lane[u][w];
    s[u] = sum;
  }
}
}  // namespace detail

// Whether the host takes a token's slots in groups (token_dots) or a pair per call
// (pair_dot): through a row table, and for 16-bit rows. Dense float32 rows went a pair per
// call as fast or faster (bench/README.md, "Token-grouped dots").
template <class T, class Rows>
inline constexpr bool groups_slots_v = std::is_same_v<Rows, row_table<T>> || sizeof(T) < 4;

// What every weight-gradient dot reads: the rows by position, grad_out and the positions.
template <class T, class Rows>
struct dot_inputs {
  Rows y;                   // dense_rows or row_table, indexed by position
  const T* grad_out;        // [n, H]
  const std::int64_t* pos;  // [n, k]
  std::size_t hidden;
  int top_k;

  // The row at position p (>= 0) . g, as dot_in_lanes sums it.
  EPX_HOST_DEVICE EPX_HOST_INLINE float slot_dot(const T* g, std::int64_t p) const {
    return static_cast<float>(detail::dot_in_lanes<accum_t<T>>(row_at(y, static_cast<std::size_t>(p), hidden), g, hidden));
  }
};

// Call with i = t*k + j in [0, n*k).
template <class T, class Rows>
struct pair_dot : dot_inputs<T, Rows> {
  float* grad_weights;  // [n, k]

  EPX_HOST_DEVICE void operator()(std::size_t i) const { EPX_RUN_WIDEST(i); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t i) const {
    const std::int64_t p = this->pos[i];
    grad_weights[i] =
        p < 0 ? 0.0f : this->slot_dot(this->grad_out + (i / static_cast<std::size_t>(this->top_k)) * this->hidden, p);
  }
};

// Call with t in [0, n): grad_w of token t's k slots.
template <class T, class Rows>
struct token_dots : dot_inputs<T, Rows> {
  float* grad_weights;  // [n, k]

  EPX_HOST_DEVICE void operator()(std::size_t t) const { EPX_RUN_WIDEST(t); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t t) const {
    constexpr std::size_t G = detail::dot_group;
    const std::size_t k = static_cast<std::size_t>(this->top_k);
    const std::int64_t* p = this->pos + t * k;
    float* gw = grad_weights + t * k;
    const T* g = this->grad_out + t * this->hidden;
    std::size_t j = 0;
    for (;;) {
      std::size_t slot[G];  // the next slots with a row (at most G)
      std::size_t m = 0;
      for (; j < k && m < G; ++j) {
        if (p[j] < 0) gw[j] = 0.0f;
        else slot[m++] = j;
      }
      if (m == 0) return;
      std::size_t u = 0;
      if (m == G) u += group<G>(g, p, gw, slot);
      if (m - u >= 4) u += group<4>(g, p, gw, slot + u);
      if (m - u >= 2) u += group<2>(g, p, gw, slot + u);
      if (m - u >= 1) gw[slot[u]] = this->slot_dot(g, p[slot[u]]);
    }
  }

 private:
  template <std::size_t N>
  EPX_HOST_DEVICE EPX_HOST_INLINE std::size_t group(const T* g, const std::int64_t* p, float* gw,
                                                    const std::size_t* slot) const {
    using A = accum_t<T>;
    const T* a[N];
    A s[N];
    for (std::size_t u = 0; u < N; ++u) a[u] = row_at(this->y, static_cast<std::size_t>(p[slot[u]]), this->hidden);
    detail::dots_in_lanes<N>(a, g, this->hidden, s);
    for (std::size_t u = 0; u < N; ++u) gw[slot[u]] = static_cast<float>(s[u]);
    return N;
  }
};

// The device shape of the same sums (exec::row_shape::chunks16 policies): one call per
// (pair, lane), so neighbouring threads read neighbouring elements of a row, then one call
// per pair adds the lanes in lane order. Each lane holds the terms h = w, w + dot_lanes, ...
// in h order, exactly as dots_in_lanes does: the same bits as pair_dot and token_dots.
// Call with q = i * dot_lanes + w in [0, n*k*dot_lanes).
template <class T, class Rows>
struct pair_dot_lanes : dot_inputs<T, Rows> {
  accum_t<T>* lanes;  // [n*k, dot_lanes]

  // On the host (exec::emulated_device) through the host versions too, which are compiled
  // without contraction: at the build's flags a GCC build for FMA targets (-mfma,
  // -march=haswell) would fuse mul_add here and differ from token_dots.
  EPX_HOST_DEVICE void operator()(std::size_t q) const { EPX_RUN_WIDEST(q); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t q) const {
    using A = accum_t<T>;
    const std::size_t i = q / detail::dot_lanes, w = q % detail::dot_lanes;  // powers of two
    const std::int64_t p = this->pos[i];
    A acc = A(0);
    if (p >= 0) {
      const T* a = row_at(this->y, static_cast<std::size_t>(p), this->hidden);
      const T* g = this->grad_out + (i / static_cast<std::size_t>(this->top_k)) * this->hidden;
      for (std::size_t h = w; h < this->hidden; h += detail::dot_lanes)
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
