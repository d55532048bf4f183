// epx/kernels/launch.hpp: launching the dispatch/combine work on a policy.
//
// Host policies run the row functors of epx/kernels/functors.hpp (one call per token or
// row: long contiguous loops). Device policies run one call per element (row, column)
// instead, so that neighbouring threads touch neighbouring columns (coalesced loads) and a
// one-token decode step still spreads over H threads. Both compute every element with the
// same operations in the same order (slot order j = 0..k-1 from A(0), dots in the lanes of
// detail::dot_in_lanes), so
// on one compiler the two forms give bitwise equal results (a device compiler may still
// fuse a multiply and an add where the host one does not).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/kernels/functors.hpp"
#include "epx/exec/host.hpp"

namespace epx::dispatch {

// dst[p, h] = x[src_row[p], h] (0 for a negative source). Call with i = p*H + h.
template <class T>
struct gather_elements {
  const T* x;                    // [*, H]
  const std::int64_t* src_row;   // [rows]
  T* dst;                        // [rows, H]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::size_t p = i / hidden, h = i - p * hidden;
    const std::int64_t r = src_row[p];
    dst[i] = r < 0 ? convert<T>(0.0f) : x[static_cast<std::size_t>(r) * hidden + h];
  }
};

// out[t, h] = sum_j w[t, j] * y[pos[t*k+j], h] (null weights: all 1). Call with i = t*H + h.
template <class T>
struct combine_elements {
  const T* y;                  // [S, H]
  const float* weights;        // [n, k]
  const std::int64_t* pos;     // [n, k]
  T* out;                      // [n, H]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    using A = accum_t<T>;
    const std::size_t k = static_cast<std::size_t>(top_k);
    const std::size_t t = i / hidden, h = i - t * hidden;
    A acc = A(0);
    for (std::size_t j = 0; j < k; ++j) {
      const std::int64_t p = pos[t * k + j];
      if (p < 0) continue;
      acc += (weights ? static_cast<A>(weights[t * k + j]) : A(1)) * convert<A>(y[static_cast<std::size_t>(p) * hidden + h]);
    }
    out[i] = convert<T>(acc);
  }
};

// grad_y[pos[t*k+j], h] = w[t, j] * grad_out[t, h]. Call with i = (t*k + j)*H + h.
template <class T>
struct scatter_grad_elements {
  const T* grad_out;           // [n, H]
  const float* weights;        // [n, k]
  const std::int64_t* pos;     // [n, k]
  T* grad_y;                   // [S, H]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    using A = accum_t<T>;
    const std::size_t pair = i / hidden, h = i - pair * hidden;
    const std::int64_t p = pos[pair];
    if (p < 0) return;
    const std::size_t t = pair / static_cast<std::size_t>(top_k);
    grad_y[static_cast<std::size_t>(p) * hidden + h] =
        convert<T>(static_cast<A>(weights[pair]) * convert<A>(grad_out[t * hidden + h]));
  }
};

// grad_w[t, j] = sum_h y[pos[t*k+j], h] * grad_out[t, h] (detail::dot_in_lanes order; 0
// for a negative position). Call with i = t*k + j.
template <class T, class Rows = const T*>
struct weight_gradients {
  Rows y;                      // [S, H]
  const T* grad_out;           // [n, H]
  const std::int64_t* pos;     // [n, k]
  float* grad_weights;         // [n, k]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    using A = accum_t<T>;
    const std::int64_t p = pos[i];
    if (p < 0) {
      grad_weights[i] = 0.0f;
      return;
    }
    const T* g = grad_out + (i / static_cast<std::size_t>(top_k)) * hidden;
    grad_weights[i] = static_cast<float>(dispatch::detail::dot_in_lanes<A>(row_at(y, static_cast<std::size_t>(p), hidden), g, hidden));
  }
};

// grad_x[t, h] = sum_j grad_rows[pos[t*k+j], h]: combine_elements with unit weights.
// Call with i = t*H + h.
template <class T>
struct reduce_grad_elements {
  const T* grad_rows;          // [S, H]
  const std::int64_t* pos;     // [n, k]
  T* grad_x;                   // [n, H]
  std::size_t hidden;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    combine_elements<T>{grad_rows, nullptr, pos, grad_x, hidden, top_k}(i);
  }
};

// Whether a policy runs the per-element functors (device policies) or the row functors.
template <class Exec>
inline constexpr bool by_element_v = !exec::is_host_policy_v<Exec>;

// dst [rows, H] = x rows named by src_row.
template <class Exec, class T>
void launch_gather(const Exec& ex, std::size_t rows, std::size_t H, const T* x, const std::int64_t* src_row, T* dst) {
  if (rows == 0 || H == 0) return;
  if constexpr (by_element_v<Exec>)
    exec::for_each_n(ex, rows * H, gather_elements<T>{x, src_row, dst, H});
  else
    exec::for_each_n(ex, rows, gather_rows<T>{x, src_row, dst, H});
}

// dst [rows, H] = the rows src points at (zero rows for null).
template <class Exec, class T>
void launch_copy_rows(const Exec& ex, std::size_t rows, std::size_t H, const T* const* src, T* dst) {
  if (rows == 0 || H == 0) return;
  exec::for_each_n(ex, rows, copy_rows<T>{src, dst, H});
}

// Whether a launch runs per element: device policies reading rows by base pointer (a
// row_table is read per token on every policy).
template <class Exec, class T, class Rows>
inline constexpr bool elementwise_v = by_element_v<Exec> && std::is_same_v<Rows, const T*>;

// out [n, H] = weighted sum of the k rows of each token (`y`: base pointer or row_table).
template <class Exec, class T, class Rows>
void launch_combine(const Exec& ex, std::size_t n, std::size_t H, int k, Rows y, const float* w,
                    const std::int64_t* pos, T* out) {
  if (n == 0 || H == 0) return;
  if constexpr (elementwise_v<Exec, T, Rows>)
    exec::for_each_n(ex, n * H, combine_elements<T>{y, w, pos, out, H, k});
  else
    exec::for_each_n(ex, n, combine<T, Rows>{y, w, pos, out, H, k});
}

// grad_y rows and grad_w [n, k] of combine.
template <class Exec, class T, class Rows>
void launch_combine_backward(const Exec& ex, std::size_t n, std::size_t H, int k, Rows y, const T* grad_out,
                             const float* w, const std::int64_t* pos, T* grad_y, float* grad_w) {
  if (n == 0) return;
  if constexpr (elementwise_v<Exec, T, Rows>) {
    const std::size_t pairs = n * static_cast<std::size_t>(k);
    if (H > 0) exec::for_each_n(ex, pairs * H, scatter_grad_elements<T>{grad_out, w, pos, grad_y, H, k});
    exec::for_each_n(ex, pairs, weight_gradients<T>{y, grad_out, pos, grad_w, H, k});
  } else {
    exec::for_each_n(ex, n, combine_backward<T, Rows>{y, grad_out, w, pos, grad_y, grad_w, H, k});
  }
}

// grad_w [n, k] alone (the direct route makes the grad_y rows at their owners).
template <class Exec, class T, class Rows>
void launch_weight_gradients(const Exec& ex, std::size_t n, std::size_t H, int k, Rows y, const T* grad_out,
                             const std::int64_t* pos, float* grad_w) {
  if (n == 0) return;
  exec::for_each_n(ex, n * static_cast<std::size_t>(k), weight_gradients<T, Rows>{y, grad_out, pos, grad_w, H, k});
}

// dst [rows, H] = scale[r] * the rows src points at (zero rows for null).
template <class Exec, class T>
void launch_scale_rows(const Exec& ex, std::size_t rows, std::size_t H, const T* const* src, const float* scale,
                       T* dst) {
  if (rows == 0 || H == 0) return;
  exec::for_each_n(ex, rows, scale_rows<T>{src, scale, dst, H});
}

// grad_x [n, H] = sum of the k gradient rows of each token.
template <class Exec, class T, class Rows>
void launch_reduce_grad_rows(const Exec& ex, std::size_t n, std::size_t H, int k, Rows grad_rows,
                             const std::int64_t* pos, T* grad_x) {
  if (n == 0 || H == 0) return;
  if constexpr (elementwise_v<Exec, T, Rows>)
    exec::for_each_n(ex, n * H, reduce_grad_elements<T>{grad_rows, pos, grad_x, H, k});
  else
    exec::for_each_n(ex, n, reduce_grad_rows<T, Rows>{grad_rows, pos, grad_x, H, k});
}

}  // namespace epx::dispatch
