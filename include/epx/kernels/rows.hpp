// epx/kernels/rows.hpp: where an operation reads its rows, and the row copy.
//
// A row source names row r of an operation:
//   dense_rows{base}          row r at base + r*H;
//   indexed_rows{base, index} row r at base + index[r]*H, no row for index[r] < 0;
//   row_table{rows}           row r at rows[r], anywhere (a peer's buffer), no row for null.
// "No row" reads as a zero row. peer_row_table makes the direct route's row_table from
// the members' buffers.
//
// row_copy writes dst[r, h0:h1] = src(r)[h0:h1], or scale[r] * src(r)[h0:h1] rounded to T
// (in accum_t<T>) when a scale is given. It is every row movement of the layer: gather into
// send order, the direct route's pull from the peers, the gradient rows w * grad_out.
// Launched through exec::for_each_row (epx/kernels/launch.hpp), so the policy chooses the
// shape: whole rows on the host, 16-byte chunks on a device. The scaled copy runs the
// widest host version of its loop (epx/exec/host_isa.hpp). A copy of at least
// exec::stream_threshold() bytes on a host policy (plain, or scaled float and double rows)
// writes around the caches instead (row_stream_copy, groups of rows a call).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/exec/stream.hpp"

namespace epx::kernels {

template <class T>
struct dense_rows {
  const T* base;  // [*, H]
};

template <class T>
struct indexed_rows {
  const T* base;               // [*, H]
  const std::int64_t* index;   // [rows]; negative: no row
};

template <class T>
struct row_table {
  const T* const* rows;  // [rows]; null: no row
};

template <class T>
EPX_HOST_DEVICE inline const T* row_at(dense_rows<T> s, std::size_t r, std::size_t hidden) noexcept {
  return s.base + r * hidden;
}
template <class T>
EPX_HOST_DEVICE inline const T* row_at(indexed_rows<T> s, std::size_t r, std::size_t hidden) noexcept {
  const std::int64_t i = s.index[r];
  return i < 0 ? nullptr : s.base + static_cast<std::size_t>(i) * hidden;
}
template <class T>
EPX_HOST_DEVICE inline const T* row_at(row_table<T> s, std::size_t r, std::size_t) noexcept {
  return s.rows[r];
}

namespace detail {
using ::epx::detail::mul_add;  // epx/core/numeric.hpp

// n elements from s to d: libc's copy on the host; on a device one 16-byte load and store
// for a whole chunk of the device launch shape (exec::for_each_row: 16 bytes of a row per
// call) when both sides are 16-byte aligned, else a loop over the elements.
template <class T>
EPX_HOST_DEVICE inline void copy_elements(T* d, const T* s, std::size_t n) noexcept {
#if defined(__CUDA_ARCH__)
  if (n * sizeof(T) == 16 &&
      ((reinterpret_cast<std::uintptr_t>(d) | reinterpret_cast<std::uintptr_t>(s)) & std::uintptr_t{15}) == 0) {
    *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
    return;
  }
  for (std::size_t h = 0; h < n; ++h) d[h] = s[h];
#else
  if (n) std::memcpy(static_cast<void*>(d), static_cast<const void*>(s), n * sizeof(T));
#endif
}
}  // namespace detail

// dst[r, h0:h1] = src(r)[h0:h1] (scale null) or scale[r] * src(r)[h0:h1]; zero for no row.
template <class T, class Src>
struct row_copy {
  Src src;             // row source
  const float* scale;  // [rows] or null
  T* dst;              // [rows, H]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t r, std::size_t h0, std::size_t h1) const {
    if (scale == nullptr) {  // a copy: libc's on the host
      copy_or_zero(r, h0, h1);
      return;
    }
    EPX_RUN_WIDEST(r, h0, h1);
  }

  EPX_HOST_DEVICE void copy_or_zero(std::size_t r, std::size_t h0, std::size_t h1) const {
    T* d = dst + r * hidden;
    const T* s = row_at(src, r, hidden);
    if (s == nullptr) {
      for (std::size_t h = h0; h < h1; ++h) d[h] = convert<T>(0.0f);
    } else {
      detail::copy_elements(d + h0, s + h0, h1 - h0);
    }
  }

  // The scaled copy (scale not null).
  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t r, std::size_t h0, std::size_t h1) const {
    using A = accum_t<T>;
    const T* s = row_at(src, r, hidden);
    if (s == nullptr) return copy_or_zero(r, h0, h1);  // a zero row
    T* d = dst + r * hidden;
    const A w = static_cast<A>(scale[r]);
    for (std::size_t h = h0; h < h1; ++h) d[h] = convert<T>(w * convert<A>(s[h]));
  }
};

// The row copy of at least exec::stream_threshold() bytes on a host policy
// (epx/exec/stream.hpp; kernels::gather and copy choose it): call i copies rows
// [i * group, (i + 1) * group) with non-temporal stores (a missing row as zeros, with
// ordinary stores), then fences, so that each call's stores are ordered on the thread that
// made them before the launch returns. A scaled copy computes each `chunk` of a row into a
// buffer on the stack (row_copy's loop and arithmetic, in the widest host version) and
// streams it from there. The same bytes as row_copy; device policies always take
// row_copy.
template <class T, class Src>
struct row_stream_copy {
  Src src;
  const float* scale;  // [rows] or null
  T* dst;              // [rows, H]
  std::size_t hidden;
  std::size_t rows;
  std::size_t group;  // rows a call

  // Elements of a scaled row computed at a time (4 KiB: they stay in L1 until streamed).
  static constexpr std::size_t chunk = std::size_t{4096} / sizeof(T);

  void operator()(std::size_t i) const { EPX_RUN_WIDEST(i); }

  EPX_HOST_INLINE void body(std::size_t i) const {
    using A = accum_t<T>;
    alignas(64) T buf[chunk];  // a scaled copy's elements on their way out
    const std::size_t r0 = i * group, r1 = rows - r0 < group ? rows : r0 + group;
    for (std::size_t r = r0; r < r1; ++r) {
      T* d = dst + r * hidden;
      const T* s = row_at(src, r, hidden);
      if (s == nullptr) {
        for (std::size_t h = 0; h < hidden; ++h) d[h] = convert<T>(0.0f);
      } else if (scale == nullptr) {
        exec::stream_copy(d, s, hidden * sizeof(T));
      } else {
        const A w = static_cast<A>(scale[r]);
        for (std::size_t h0 = 0; h0 < hidden; h0 += chunk) {
          const std::size_t n = hidden - h0 < chunk ? hidden - h0 : chunk;
          for (std::size_t h = 0; h < n; ++h) buf[h] = convert<T>(w * convert<A>(s[h0 + h]));
          exec::stream_copy(d + h0, buf, n * sizeof(T));
        }
      }
    }
    exec::stream_fence();
  }
};

// The direct route's receive table (epx/impl/all_to_all.hpp): row i of an owner's
// expert-major buffer is send position q of member m (from[2i] = m, from[2i+1] = q; m < 0:
// a padding row), i.e. row index[m][q] of member m's rows: table[i] = rows[m] +
// index[m][q] * width, and scale[i] = weights[m][q] when weights are given (padding: null
// and 0). The members' arrays are read where they are (peer memory on a device), so the
// table is made by the policy that then copies the rows.
template <class V>
struct peer_row_table {
  const std::int64_t* from;           // [R, 2]: member, send position
  const V* const* rows;               // [members]: each member's rows
  const std::int64_t* const* index;   // [members]: each member's row of a send position
  const float* const* weights;        // [members]: each member's weight of a send position, or null
  std::size_t width;                  // elements per row
  const V** table;                    // [R]
  float* scale;                       // [R] (with weights)

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::int64_t m = from[2 * i];
    if (m < 0) {
      table[i] = nullptr;
      if (weights != nullptr) scale[i] = 0.0f;
      return;
    }
    const auto s = static_cast<std::size_t>(m);
    const auto q = static_cast<std::size_t>(from[2 * i + 1]);
    table[i] = rows[s] + static_cast<std::size_t>(index[s][q]) * width;
    if (weights != nullptr) scale[i] = weights[s][q];
  }
};

// out[pos[i]] = v[i] for every i with pos[i] >= 0: values into send (or expert-major) order.
template <class V>
struct value_scatter {
  const std::int64_t* pos;  // [n]
  const V* v;               // [n]
  V* out;                   // [max pos + 1]

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::int64_t p = pos[i];
    if (p >= 0) out[static_cast<std::size_t>(p)] = v[i];
  }
};

// out[i] = v: a constant into n elements.
template <class V>
struct value_fill {
  V v;
  V* out;  // [n]

  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = v; }
};

}  // namespace epx::kernels
