// epx/kernels/functors.hpp: per-element work of dispatch and combine, forward and backward.
//
// Each functor is EPX_HOST_DEVICE, trivially copyable and holds raw pointers, so the
// CPU tests run exactly what a device launch runs:
//
//   exec::for_each_n(policy, n, functor{...});
//
// Work is split over tokens (or rows); every output element is written by exactly one
// call, and sums run in a fixed order (slot order j = 0..k-1, then h order), never with
// atomics: results are bitwise reproducible.
//
// Positions `pos[t*k+j]` index rows of a buffer in send order ([S, H], S = pairs of the
// slice). A negative position means "not here" (the masked all-reduce path: the slot's
// expert lives on another rank); such slots contribute nothing and get a zero weight
// gradient. The functors that read rows by position take the rows as `Rows`: a base
// pointer (`const T*`, row p at base + p*H, the default) or a row_table (row p at
// rows[p], anywhere: the fused paths read the peers' buffers in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"

namespace epx::dispatch {

// dst[p, :] = x[src_row[p], :]; a negative src_row gives a zero row. Call with p in [0, rows).
template <class T>
struct gather_rows {
  const T* x;                    // [*, H] source rows
  const std::int64_t* src_row;   // [rows]
  T* dst;                        // [rows, H]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t p) const {
    T* d = dst + p * hidden;
    const std::int64_t r = src_row[p];
    if (r < 0) {
      for (std::size_t h = 0; h < hidden; ++h) d[h] = convert<T>(0.0f);
      return;
    }
    const T* s = x + static_cast<std::size_t>(r) * hidden;
#if defined(__CUDA_ARCH__)
    for (std::size_t h = 0; h < hidden; ++h) d[h] = s[h];
#else
    std::memcpy(static_cast<void*>(d), static_cast<const void*>(s), hidden * sizeof(T));  // host: libc's copy
#endif
  }
};

// Row p of a send-order buffer through a table of row pointers.
template <class T>
struct row_table {
  const T* const* rows;  // [S]
};

template <class T>
EPX_HOST_DEVICE inline const T* row_at(const T* base, std::size_t p, std::size_t hidden) noexcept {
  return base + p * hidden;
}
template <class T>
EPX_HOST_DEVICE inline const T* row_at(row_table<T> t, std::size_t p, std::size_t) noexcept {
  return t.rows[p];
}

// dst[r, :] = *src[r] (a null source gives a zero row). Call with r in [0, rows).
template <class T>
struct copy_rows {
  const T* const* src;  // [rows] source rows, anywhere
  T* dst;               // [rows, H]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t r) const {
    T* d = dst + r * hidden;
    const T* s = src[r];
    if (s == nullptr) {
      for (std::size_t h = 0; h < hidden; ++h) d[h] = convert<T>(0.0f);
      return;
    }
#if defined(__CUDA_ARCH__)
    for (std::size_t h = 0; h < hidden; ++h) d[h] = s[h];
#else
    std::memcpy(static_cast<void*>(d), static_cast<const void*>(s), hidden * sizeof(T));
#endif
  }
};

namespace detail {
// Host rows are summed in blocks of this many columns: a block's accumulators live on the
// stack and every slot's row is streamed into them (vectorisable), instead of gathering k
// values per column. Each column still sums its slots in slot order from A(0): the same
// operations in the same order, so the results are bitwise those of the column loop.
constexpr std::size_t combine_block = 256;
}  // namespace detail

namespace detail {
// Dot products (weight gradients) sum in dot_lanes interleaved lanes: lane w holds the
// terms h = w, w + dot_lanes, ... in h order, and the lanes are added in lane order at the
// end. A fixed order, the same on host and device (bitwise reproducible), that a host
// compiler vectorises without reassociating anything.
constexpr std::size_t dot_lanes = 16;

template <class A, class T, class U>
EPX_HOST_DEVICE inline A dot_in_lanes(const T* a, const U* b, std::size_t n) noexcept {
  A lane[dot_lanes];
  for (std::size_t w = 0; w < dot_lanes; ++w) lane[w] = A(0);
  std::size_t h = 0;
  for (; h + dot_lanes <= n; h += dot_lanes)
    for (std::size_t w = 0; w < dot_lanes; ++w) lane[w] += convert<A>(a[h + w]) * convert<A>(b[h + w]);
  for (std::size_t w = 0; h + w < n; ++w) lane[w] += convert<A>(a[h + w]) * convert<A>(b[h + w]);
  A s = A(0);
  for (std::size_t w = 0; w < dot_lanes; ++w) s += lane[w];
  return s;
}
}  // namespace detail

// dst[r, :] = scale[r] * *src[r], rounded to T (a null source gives a zero row): grad_y
// rows made straight from the token owner's grad_out. Call with r in [0, rows).
template <class T>
struct scale_rows {
  const T* const* src;  // [rows] source rows, anywhere
  const float* scale;   // [rows]
  T* dst;               // [rows, H]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t r) const {
    using A = accum_t<T>;
    T* d = dst + r * hidden;
    const T* s = src[r];
    if (s == nullptr) {
      for (std::size_t h = 0; h < hidden; ++h) d[h] = convert<T>(0.0f);
      return;
    }
    const A w = static_cast<A>(scale[r]);
    for (std::size_t h = 0; h < hidden; ++h) d[h] = convert<T>(w * convert<A>(s[h]));
  }
};

// dst[r, :] = 0. Call with r in [0, rows).
template <class T>
struct zero_rows {
  T* dst;  // [rows, H]
  std::size_t hidden;
  EPX_HOST_DEVICE void operator()(std::size_t r) const {
    T* d = dst + r * hidden;
    for (std::size_t h = 0; h < hidden; ++h) d[h] = convert<T>(0.0f);
  }
};

// out[t, :] = sum_j w[t, j] * y[pos[t*k+j], :], in accum_t<T>, slot order (null weights: all
// 1, an exact product, so the plain sum of reduce_grad_rows). Call with t in [0, n).
template <class T, class Rows = const T*>
struct combine {
  Rows y;                      // [S, H] expert outputs in send order
  const float* weights;        // [n, k]
  const std::int64_t* pos;     // [n, k]
  T* out;                      // [n, H]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    using A = accum_t<T>;
    const std::size_t k = static_cast<std::size_t>(top_k);
    T* o = out + t * hidden;
#if defined(__CUDA_ARCH__)
    for (std::size_t h = 0; h < hidden; ++h) {
      A acc = A(0);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int64_t p = pos[t * k + j];
        if (p < 0) continue;
        acc += (weights ? static_cast<A>(weights[t * k + j]) : A(1)) *
               convert<A>(row_at(y, static_cast<std::size_t>(p), hidden)[h]);
      }
      o[h] = convert<T>(acc);
    }
#else
    A acc[detail::combine_block];
    for (std::size_t h0 = 0; h0 < hidden; h0 += detail::combine_block) {
      const std::size_t m = hidden - h0 < detail::combine_block ? hidden - h0 : detail::combine_block;
      for (std::size_t h = 0; h < m; ++h) acc[h] = A(0);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int64_t p = pos[t * k + j];
        if (p < 0) continue;
        const A w = weights ? static_cast<A>(weights[t * k + j]) : A(1);
        const T* yr = row_at(y, static_cast<std::size_t>(p), hidden) + h0;
        for (std::size_t h = 0; h < m; ++h) acc[h] += w * convert<A>(yr[h]);
      }
      for (std::size_t h = 0; h < m; ++h) o[h0 + h] = convert<T>(acc[h]);
    }
#endif
  }
};

// Backward of combine. Call with t in [0, n):
//   grad_y[pos[t*k+j], :] = w[t, j] * grad_out[t, :]
//   grad_w[t, j]          = sum_h y[pos[t*k+j], h] * grad_out[t, h]   (accum_t, detail::dot_in_lanes)
// Slots with a negative position get grad_w = 0 and write no grad_y row.
template <class T, class Rows = const T*>
struct combine_backward {
  Rows y;                      // [S, H] expert outputs saved by forward
  const T* grad_out;           // [n, H]
  const float* weights;        // [n, k]
  const std::int64_t* pos;     // [n, k]
  T* grad_y;                   // [S, H]
  float* grad_weights;         // [n, k]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    using A = accum_t<T>;
    const std::size_t k = static_cast<std::size_t>(top_k);
    const T* g = grad_out + t * hidden;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int64_t p = pos[t * k + j];
      if (p < 0) {
        grad_weights[t * k + j] = 0.0f;
        continue;
      }
      const A w = static_cast<A>(weights[t * k + j]);
      T* gy = grad_y + static_cast<std::size_t>(p) * hidden;
      for (std::size_t h = 0; h < hidden; ++h) gy[h] = convert<T>(w * convert<A>(g[h]));
      grad_weights[t * k + j] =
          static_cast<float>(detail::dot_in_lanes<A>(row_at(y, static_cast<std::size_t>(p), hidden), g, hidden));
    }
  }
};

// grad_x[t, :] = sum_j grad_rows[pos[t*k+j], :], slot order: combine with unit weights.
// Call with t in [0, n).
template <class T, class Rows = const T*>
struct reduce_grad_rows {
  Rows grad_rows;              // [S, H] input-row gradients in send order
  const std::int64_t* pos;     // [n, k]
  T* grad_x;                   // [n, H]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    combine<T, Rows>{grad_rows, nullptr, pos, grad_x, hidden, top_k}(t);
  }
};

// Masked path: maps the plan's send positions to positions in this rank's expert-major
// buffer, or -1 for slots whose expert is not local. Call with i in [0, n*k).
//   local_pos[i] = local_offset[l] + (pos[i] - expert_offset[e])  if e = ids[i] is local (l = e - first)
struct masked_positions {
  const std::int32_t* ids;            // [n*k]
  const std::int64_t* pos;            // [n*k] send positions from the plan
  const std::int64_t* expert_offset;  // [E+1] from the plan
  const std::int64_t* local_offset;   // [L+1] expert-major offsets (with padding)
  std::int64_t* local_pos;            // [n*k]
  int first_expert;
  int num_local;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const int l = ids[i] - first_expert;
    if (l < 0 || l >= num_local) {
      local_pos[i] = -1;
      return;
    }
    local_pos[i] = local_offset[l] + (pos[i] - expert_offset[ids[i]]);
  }
};

// Masked path: the source row of every row of the expert-major buffer (-1 for padding).
// Call with l in [0, L): rows of local expert l come from send positions
// [expert_offset[first+l], expert_offset[first+l+1]) in order.
struct masked_source_rows {
  const std::int64_t* src_row;        // [n*k] from the plan
  const std::int64_t* expert_offset;  // [E+1] from the plan
  const std::int64_t* local_offset;   // [L+1]
  std::int64_t* row_source;           // [R]
  int first_expert;

  EPX_HOST_DEVICE void operator()(std::size_t l) const {
    const std::int64_t b = expert_offset[first_expert + static_cast<int>(l)];
    const std::int64_t count = expert_offset[first_expert + static_cast<int>(l) + 1] - b;
    const std::int64_t r0 = local_offset[l];
    const std::int64_t r1 = local_offset[l + 1];
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t q = r - r0;
      row_source[r] = q < count ? src_row[b + q] : -1;
    }
  }
};

}  // namespace epx::dispatch
