// epx/kernels/combine.hpp: the weighted sum of each token's k expert output rows.
//
//   out[t, h] = sum_j w[t, j] * y(pos[t*k+j])[h]     (accum_t<T>, slot order j = 0..k-1, from 0)
//
// Slots with a negative position are not here (the masked path: their expert lives on
// another rank) and add nothing. Null weights mean 1 for every slot: the plain sum that the
// input gradient takes (grad_x = sum of the slots' input-gradient rows). The rows come from
// dense_rows (send or expert-major order) or a row_table (the peers' buffers, read in place).
//
// Each column sums its slots in slot order from A(0) whatever the launch shape: the host
// runs whole rows in blocks of column_block accumulators (every slot's row streamed into
// them), a device 16-byte chunks; the operations per column are the same, so every policy
// gives the same bits. On the host the loop runs its widest version (epx/exec/host_isa.hpp),
// and a token's call first prefetches the first prefetch_bytes of each of the next token's
// rows: the rows are scattered over the owners' buffers, mostly out of the caches, and the
// hardware prefetcher carries on from there (bench/README.md, "Prefetching the combine").
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/kernels/rows.hpp"

namespace epx::kernels {

namespace detail {
#if defined(__CUDA_ARCH__)
inline constexpr std::size_t column_block = 16;  // a chunk of 16 bytes is at most 16 columns
#else
inline constexpr std::size_t column_block = 256;
#endif
inline constexpr std::size_t prefetch_bytes = 1024;  // of each of the next token's rows (host)
}  // namespace detail

template <class T, class Rows>
struct row_combine {
  Rows y;                   // dense_rows or row_table, indexed by position
  const float* weights;     // [n, k] or null (all 1)
  const std::int64_t* pos;  // [n, k]
  T* out;                   // [n, H]
  std::size_t hidden;
  int top_k;
  std::size_t tokens;       // n: the host prefetches token t + 1's rows while t < n - 1

  EPX_HOST_DEVICE void operator()(std::size_t t, std::size_t h0, std::size_t h1) const { EPX_RUN_WIDEST(t, h0, h1); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t t, std::size_t h0, std::size_t h1) const {
    using A = accum_t<T>;
    constexpr std::size_t B = detail::column_block;
    const std::size_t k = static_cast<std::size_t>(top_k);
    T* o = out + t * hidden;
#if !defined(__CUDA_ARCH__) && defined(__GNUC__)
    if (t + 1 < tokens) {
      const std::size_t row = (h1 - h0) * sizeof(T);
      const std::size_t bytes = row < detail::prefetch_bytes ? row : detail::prefetch_bytes;
      for (std::size_t j = 0; j < k; ++j) {
        const std::int64_t p = pos[(t + 1) * k + j];
        if (p < 0) continue;
        const char* next = reinterpret_cast<const char*>(row_at(y, static_cast<std::size_t>(p), hidden) + h0);
        for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(next + b);
      }
    }
#endif
    A acc[B];
    for (std::size_t b = h0; b < h1; b += B) {
      const std::size_t m = h1 - b < B ? h1 - b : B;
      for (std::size_t h = 0; h < m; ++h) acc[h] = A(0);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int64_t p = pos[t * k + j];
        if (p < 0) continue;
        const A w = weights ? static_cast<A>(weights[t * k + j]) : A(1);
        const T* yr = row_at(y, static_cast<std::size_t>(p), hidden) + b;
        for (std::size_t h = 0; h < m; ++h) acc[h] = detail::mul_add(acc[h], w, convert<A>(yr[h]));
      }
      for (std::size_t h = 0; h < m; ++h) o[b + h] = convert<T>(acc[h]);
    }
  }
};

}  // namespace epx::kernels
