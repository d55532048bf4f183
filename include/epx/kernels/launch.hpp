// epx/kernels/launch.hpp: the operations of dispatch and combine, launched on a policy.
//
// Each is one functor of this folder, launched the same way by every policy; the launch
// shape of row operations is the policy's (exec::for_each_row: whole rows on the host,
// 16-byte chunks on a device). Rows given as `const T*` are dense (row p at base + p*H);
// a row_table reads rows anywhere.
//
//   gather(ex, rows, H, x, index, dst)           dst[r] = x[index[r]]            (zero for index < 0)
//   gather(ex, rows, H, x, index, scale, dst)    dst[r] = scale[r] * x[index[r]]
//   copy(ex, rows, H, table, dst)                dst[r] = *table[r]              (zero for null)
//   copy(ex, rows, H, table, scale, dst)         dst[r] = scale[r] * *table[r]
//                                                (gather and copy without a scale write around
//                                                the caches on a host policy from
//                                                exec::stream_threshold() bytes: exec/stream.hpp)
//   peer_table(ex, R, from, rows, index, weights, width, table, scale)
//                                                table[i] = rows[m] + index[m][q] * width for
//                                                (m, q) = from[i] (null for m < 0); scale[i] =
//                                                weights[m][q] when weights are given
//   combine(ex, n, H, k, y, w, pos, out)         out[t] = sum_j w[t,j] * y[pos[t,j]]
//   reduce(ex, n, H, k, y, pos, out)             out[t] = sum_j y[pos[t,j]]
//   weight_gradients(ex, n, H, k, y, g, pos, gw) gw[t,j] = y[pos[t,j]] . g[t]   (host: a token per call
//                                                through a row table or for 16-bit rows, else a
//                                                pair; device: a (pair, lane) per call, then the lanes)
//   scatter(ex, n, pos, v, out)                  out[pos[i]] = v[i]               (pos >= 0)
//   fill(ex, n, v, out)                          out[i] = v
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epx/exec/host.hpp"
#include "epx/kernels/combine.hpp"
#include "epx/kernels/dot.hpp"
#include "epx/kernels/rows.hpp"

namespace epx::kernels {

namespace detail {
template <class T>
dense_rows<T> rows_of(const T* base) noexcept {
  return {base};
}
template <class T>
row_table<T> rows_of(row_table<T> t) noexcept {
  return t;
}

// row_copy over [rows, H]; on a host policy a copy of at least exec::stream_threshold()
// bytes streams (row_stream_copy, about 128 KiB of rows a call): a plain copy of any type, a
// scaled one of float or double. (Streamed through its stack buffer, the scaled copy made the
// float32 backward 6-11% faster at 1024 x 1024 and the bf16 one 3-13% slower at 1024 x 1024
// and 4096 x 4096, where the conversion to bf16 and the extra pass through the buffer
// cost more than the line reads they save; bench/README.md.)
template <class Exec, class T, class Src>
void copy_rows(const Exec& ex, std::size_t rows, std::size_t H, Src src, const float* scale, T* dst) {
  if constexpr (exec::is_host_policy_v<Exec>) {
    const std::size_t row_bytes = H * sizeof(T);
    if (rows > 0 && row_bytes > 0 && (scale == nullptr || sizeof(T) >= 4) && exec::streams(rows * row_bytes)) {
      const std::size_t group = std::max<std::size_t>(16, (std::size_t{128} << 10) / row_bytes);
      exec::for_each_n(ex, (rows + group - 1) / group, row_stream_copy<T, Src>{src, scale, dst, H, rows, group});
      return;
    }
  }
  exec::for_each_row<T>(ex, rows, H, row_copy<T, Src>{src, scale, dst, H});
}
}  // namespace detail

template <class Exec, class T>
void gather(const Exec& ex, std::size_t rows, std::size_t H, const T* x, const std::int64_t* index, const float* scale,
            T* dst) {
  detail::copy_rows(ex, rows, H, indexed_rows<T>{x, index}, scale, dst);
}
template <class Exec, class T>
void gather(const Exec& ex, std::size_t rows, std::size_t H, const T* x, const std::int64_t* index, T* dst) {
  gather(ex, rows, H, x, index, static_cast<const float*>(nullptr), dst);
}

template <class Exec, class T>
void copy(const Exec& ex, std::size_t rows, std::size_t H, const T* const* table, const float* scale, T* dst) {
  detail::copy_rows(ex, rows, H, row_table<T>{table}, scale, dst);
}
template <class Exec, class T>
void copy(const Exec& ex, std::size_t rows, std::size_t H, const T* const* table, T* dst) {
  copy(ex, rows, H, table, static_cast<const float*>(nullptr), dst);
}

template <class Exec, class V>
void peer_table(const Exec& ex, std::size_t R, const std::int64_t* from, const V* const* rows,
                const std::int64_t* const* index, const float* const* weights, std::size_t width, const V** table,
                float* scale) {
  if (R > 0) exec::for_each_n(ex, R, peer_row_table<V>{from, rows, index, weights, width, table, scale});
}

// y: `const T*` (dense) or row_table<T>.
template <class Exec, class T, class Rows>
void combine(const Exec& ex, std::size_t n, std::size_t H, int k, Rows y, const float* w, const std::int64_t* pos,
             T* out) {
  using R = decltype(detail::rows_of(y));
  exec::for_each_row<T>(ex, n, H, row_combine<T, R>{detail::rows_of(y), w, pos, out, H, k, n});
}

template <class Exec, class T, class Rows>
void reduce(const Exec& ex, std::size_t n, std::size_t H, int k, Rows y, const std::int64_t* pos, T* out) {
  combine(ex, n, H, k, y, static_cast<const float*>(nullptr), pos, out);
}

template <class Exec, class T, class Rows>
void weight_gradients(const Exec& ex, std::size_t n, std::size_t H, int k, Rows y, const T* grad_out,
                      const std::int64_t* pos, float* grad_w) {
  using R = decltype(detail::rows_of(y));
  const std::size_t pairs = n * static_cast<std::size_t>(k);
  if (pairs == 0) return;
  if constexpr (exec::row_shape_v<Exec> == exec::row_shape::whole_rows) {
    if constexpr (groups_slots_v<T, R>)
      exec::for_each_n(ex, n, token_dots<T, R>{{detail::rows_of(y), grad_out, pos, H, k}, grad_w});
    else
      exec::for_each_n(ex, pairs, pair_dot<T, R>{{detail::rows_of(y), grad_out, pos, H, k}, grad_w});
  } else {
    // Device shape: dot_lanes threads per pair, then the lanes in lane order (same bits).
    using A = accum_t<T>;
    auto lanes = exec::make_buffer<A>(ex, pairs * kernels::detail::dot_lanes);
    exec::for_each_n(ex, pairs * kernels::detail::dot_lanes,
                     pair_dot_lanes<T, R>{{detail::rows_of(y), grad_out, pos, H, k}, lanes.data()});
    exec::for_each_n(ex, pairs, pair_dot_sum<A>{static_cast<const A*>(lanes.data()), pos, grad_w});
  }
}

template <class Exec, class V>
void scatter(const Exec& ex, std::size_t n, const std::int64_t* pos, const V* v, V* out) {
  if (n) exec::for_each_n(ex, n, value_scatter<V>{pos, v, out});
}

template <class Exec, class V>
void fill(const Exec& ex, std::size_t n, V v, V* out) {
  if (n) exec::for_each_n(ex, n, value_fill<V>{v, out});
}

}  // namespace epx::kernels
