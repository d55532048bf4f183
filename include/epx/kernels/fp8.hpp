// epx/kernels/fp8.hpp: rows to FP8 E4M3 with one float32 scale per 128 elements, and back.
//
// The FP8 forward dispatch (contract section 12). A row of H elements (H a multiple of
// fp8_block = 128) is H / 128 blocks of 128 consecutive elements; block b of row r has
// the scale scale[r * H/128 + b], and the row travels as H E4M3 bytes:
//
//   v_h    = A(x[r, h]), A = accum_t<T>            (exact: float for float, bf16, fp16;
//                                                    double for double)
//   amax   = max over the block of |v_h|            (NaN elements do not count)
//   scale  = amax / 448, rounded to float (for double: the double quotient rounded to
//            float);  1 when that is 0 (an all-zero block, or an amax so small that the
//            quotient underflows)
//   q[r,h] = fp8_e4m3(v_h / A(scale))               (the quotient rounded to A, then to
//            E4M3: nearest even, saturating to +-448; epx/core/fp8.hpp. A double quotient
//            is rounded by the double conversion, as CUDA's __nv_fp8_e4m3(double), never
//            through float, and a NaN keeps its sign there)
//
// and comes back as out[r, h] = T(A(float(q[r, h])) * A(scale)) in A = accum_t<T>
// (exact for double; for float the product is rounded once; for bf16 and fp16 once to
// float and once to T). A NaN element stays NaN; an infinite element makes its block's
// scale infinite, and the whole block comes back as NaN. A "no row" (a negative index, a
// null row pointer) quantises to zero bytes with scale 1.
//
// Every operation is one EPX_HOST_DEVICE functor run by every policy, host and device
// alike, with the same bits: quantisation by exec::for_each_n, one call per block on a
// device and per 16 blocks on the host; the gather and the dequantisation by
// exec::for_each_row. Divisions and products are rounded to nearest on every compiler (no
// contraction into a fused multiply-add, no approximate division). On x86-64 hosts the quantisation and the dequantisation run the
// widest of their baseline, AVX2 and AVX-512 versions that the CPU supports
// (epx/exec/host_isa.hpp), the same bits from each.
//
//   check_fp8_hidden(H)                                  errc::configuration unless H % 128 == 0
//   quantise_e4m3(ex, rows, H, x, q, scale)              q[r], scale[r] from x[r]
//   quantise_e4m3(ex, rows, H, x, index, q, scale)       ... from x[index[r]]   (zero for index < 0)
//   quantise_e4m3(ex, rows, H, table, q, scale)          ... from *table[r]     (zero for null)
//   gather_e4m3(ex, rows, H, q, scale, index, dst, dst_scale)
//                                                        dst[r] = q[index[r]] with its scales
//   dequantise_e4m3(ex, rows, H, q, scale, out)          out[r] = q[r] * scale[r]
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/fp8.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/kernels/rows.hpp"

namespace epx::kernels {

// Elements per scale along a row.
inline constexpr std::size_t fp8_block = 128;

// Scales per row of `hidden` elements (hidden a multiple of fp8_block).
constexpr std::size_t fp8_scales_per_row(std::size_t hidden) noexcept { return hidden / fp8_block; }

// The FP8 dispatch needs a hidden size that is a multiple of 128.
inline void check_fp8_hidden(std::size_t hidden) {
  EPX_REQUIRE(hidden % fp8_block == 0, errc::configuration,
              "FP8 dispatch needs a hidden size that is a multiple of ", fp8_block,
              " (one float32 scale per block of ", fp8_block, " elements), but the hidden size is ", hidden);
}

namespace detail {

// a / b and a * b rounded to nearest on host and device alike.
template <class A>
EPX_HOST_DEVICE inline A div_rn(A a, A b) noexcept {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>)
    return __fdiv_rn(a, b);
  else
    return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
template <class A>
EPX_HOST_DEVICE inline A mul_rn(A a, A b) noexcept {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>)
    return __fmul_rn(a, b);
  else
    return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

EPX_HOST_DEVICE inline float abs_bits(float v) noexcept {
  return epx::detail::bits_float(epx::detail::float_bits(v) & 0x7fffffffu);
}
EPX_HOST_DEVICE inline double abs_bits(double v) noexcept {
  const std::uint64_t u = epx::detail::fp8_double_bits(v) & 0x7fffffffffffffffull;
#if EPX_IS_DEVICE_CODE
  return __longlong_as_double(static_cast<long long>(u));
#else
  double r;
  std::memcpy(&r, &u, sizeof r);
  return r;
#endif
}

}  // namespace detail

// The scale of a block whose largest magnitude is amax (amax >= 0, not NaN).
EPX_HOST_DEVICE inline float fp8_block_scale(float amax) noexcept {
  const float s = detail::div_rn(amax, fp8_e4m3_max);
  return s > 0.0f ? s : 1.0f;
}

// The scale of a block of double rows whose largest magnitude is amax (amax >= 0, not
// NaN): amax / 448 in double, rounded to float; 1 when that is 0.
EPX_HOST_DEVICE inline float fp8_block_scale_of_double(double amax) noexcept {
  const float s = static_cast<float>(detail::div_rn(amax, static_cast<double>(fp8_e4m3_max)));
  return s > 0.0f ? s : 1.0f;
}

// Blocks [i * group, (i + 1) * group) of all rows' blocks (block j = r * H/128 + b is
// q[r, 128b : 128b+128] and scale[j] from src(r)): one block a call on a device, a group
// of blocks a call on the host (the call's version choice and set-up paid once a group).
template <class T, class Src>
struct fp8_quantise {
  Src src;            // row source (epx/kernels/rows.hpp)
  fp8_e4m3* dst;      // [rows, H]
  float* scale;       // [rows, H / 128]
  std::size_t hidden;
  std::size_t group;  // blocks a call
  std::size_t count;  // blocks in all

  EPX_HOST_DEVICE void operator()(std::size_t i) const { EPX_RUN_WIDEST(i); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t i) const {
    const std::size_t blocks = hidden / fp8_block;
    const std::size_t j0 = i * group, j1 = count - j0 < group ? count : j0 + group;
    std::size_t r = j0 / blocks, b = j0 - r * blocks;
    for (std::size_t j = j0; j < j1; ++j) {
      block(j, r, b * fp8_block);
      if (++b == blocks) {
        b = 0;
        ++r;
      }
    }
  }

  // Block j (row r, elements h0 : h0 + 128). The loops are written without branches so
  // that they vectorise on the host.
  EPX_HOST_DEVICE EPX_HOST_INLINE void block(std::size_t j, std::size_t r, std::size_t h0) const {
    fp8_e4m3* d = dst + r * hidden + h0;
    const T* s = row_at(src, r, hidden);
    if (s == nullptr) {
      for (std::size_t h = 0; h < fp8_block; ++h) d[h] = fp8_e4m3::from_bits(0);
      scale[j] = 1.0f;
      return;
    }
    s += h0;
    if constexpr (std::is_same_v<T, double>) {
      // Double rows are scaled in double: amax in double, its scale amax / 448 rounded to
      // float, and each quotient x / scale rounded once to double and then to E4M3 by the
      // double conversion (CUDA's __nv_fp8_e4m3(double)), not through float.
      double amax = 0.0;
      for (std::size_t h = 0; h < fp8_block; ++h) {
        const double a = detail::abs_bits(s[h]);
        amax = a > amax ? a : amax;  // a NaN compares false and does not count
      }
      const float sc = fp8_block_scale_of_double(amax);
      for (std::size_t h = 0; h < fp8_block; ++h)
        d[h] = fp8_e4m3(detail::div_rn(s[h], static_cast<double>(sc)));
      scale[j] = sc;
      return;
    }
    // The largest magnitude as the largest bits of |x| (non-negative floats order as their
    // bits; an integer max reduction vectorises on the host), and the smallest alongside.
    // Bits above infinity's are a NaN's: then again with NaN left out.
    std::uint32_t amax_bits = 0, amin_bits = 0xffffffffu;
    for (std::size_t h = 0; h < fp8_block; ++h) {
      const std::uint32_t a = epx::detail::float_bits(convert<float>(s[h])) & 0x7fffffffu;
      amax_bits = a > amax_bits ? a : amax_bits;
      amin_bits = a < amin_bits ? a : amin_bits;
    }
    const bool finite = amax_bits < 0x7f800000u;  // no NaN, no infinity
    if (amax_bits > 0x7f800000u) {
      amax_bits = 0;
      for (std::size_t h = 0; h < fp8_block; ++h) {
        std::uint32_t a = epx::detail::float_bits(convert<float>(s[h])) & 0x7fffffffu;
        a &= 0u - static_cast<std::uint32_t>(a <= 0x7f800000u);  // NaN: 0
        amax_bits = a > amax_bits ? a : amax_bits;
      }
    }
    const float sc = fp8_block_scale(epx::detail::bits_float(amax_bits));
    if (finite && sc >= 0x1p-126f) {
      // Finite elements and a normal scale (sc = amax / 448 within 2^-24 relative): every
      // quotient is finite and at most 448 * (1 + 2^-23) in magnitude, so no element
      // saturates or is NaN (the same bits as fp8_e4m3(quotient), two selections fewer).
      // Where the smallest magnitude's quotient is at least 2^-6, so is every quotient (a
      // rounded division is monotone): no element is an E4M3 subnormal, and the rounding of
      // the normals alone gives the same bits (12-25% less time per element on the host).
      if (epx::detail::float_bits(detail::div_rn(epx::detail::bits_float(amin_bits), sc)) >= 0x3c800000u) {
        for (std::size_t h = 0; h < fp8_block; ++h)
          d[h] = fp8_e4m3::from_bits(
              epx::detail::float_to_fp8_e4m3_bits_normal(detail::div_rn(convert<float>(s[h]), sc)));
      } else {
        for (std::size_t h = 0; h < fp8_block; ++h)
          d[h] = fp8_e4m3::from_bits(
              epx::detail::float_to_fp8_e4m3_bits_in_range(detail::div_rn(convert<float>(s[h]), sc)));
      }
    } else {
      for (std::size_t h = 0; h < fp8_block; ++h) d[h] = fp8_e4m3(detail::div_rn(convert<float>(s[h]), sc));
    }
    scale[j] = sc;
  }
};

// dst row r = row index[r] of rows quantised once per token (q [., H], scale [., H/128]),
// bytes and scales; index -1 gives zero bytes and scales 1, as fp8_quantise of a missing
// row. Quantising the n token rows once and gathering their bytes gives the bytes of
// quantising every send row (the quantisation of a row depends on the row alone), at 1/k
// of the conversions. A row operation (exec::for_each_row): the call for dst[r, h0:h1]
// copies those bytes and the scales of the blocks that start in [h0, h1).
struct fp8_gather {
  const fp8_e4m3* q;
  const float* scale;
  const std::int64_t* index;  // [rows]
  fp8_e4m3* dst;              // [rows, H]
  float* dst_scale;           // [rows, H / 128]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t r, std::size_t h0, std::size_t h1) const {
    const std::size_t blocks = hidden / fp8_block;
    fp8_e4m3* d = dst + r * hidden;
    float* ds = dst_scale + r * blocks;
    const std::size_t b0 = (h0 + fp8_block - 1) / fp8_block, b1 = (h1 + fp8_block - 1) / fp8_block;
    const std::int64_t src = index[r];
    if (src < 0) {
      for (std::size_t h = h0; h < h1; ++h) d[h] = fp8_e4m3::from_bits(0);
      for (std::size_t b = b0; b < b1; ++b) ds[b] = 1.0f;
      return;
    }
    detail::copy_elements(d + h0, q + static_cast<std::size_t>(src) * hidden + h0, h1 - h0);
    const float* ss = scale + static_cast<std::size_t>(src) * blocks;
    for (std::size_t b = b0; b < b1; ++b) ds[b] = ss[b];
  }
};

// out[r, h0:h1] = T(A(q[r, h]) * A(scale[r, h / 128])).
template <class T>
struct fp8_dequantise {
  const fp8_e4m3* src;  // [rows, H]
  const float* scale;   // [rows, H / 128]
  T* dst;               // [rows, H]
  std::size_t hidden;

  EPX_HOST_DEVICE void operator()(std::size_t r, std::size_t h0, std::size_t h1) const { EPX_RUN_WIDEST(r, h0, h1); }

  EPX_HOST_DEVICE EPX_HOST_INLINE void body(std::size_t r, std::size_t h0, std::size_t h1) const {
    using A = accum_t<T>;
    const fp8_e4m3* q = src + r * hidden;
    const float* sc = scale + r * (hidden / fp8_block);
    T* d = dst + r * hidden;
    // Block by block, the block's scale loaded once (a loop without divisions vectorises).
    for (std::size_t b0 = h0; b0 < h1;) {
      const std::size_t end = (b0 / fp8_block + 1) * fp8_block;  // (not std::min: host-only in device code)
      const std::size_t b1 = h1 < end ? h1 : end;
      const A s = static_cast<A>(sc[b0 / fp8_block]);
      for (std::size_t h = b0; h < b1; ++h) d[h] = convert<T>(detail::mul_rn(static_cast<A>(static_cast<float>(q[h])), s));
      b0 = b1;
    }
  }
};

// The launches. H must be a multiple of fp8_block (check_fp8_hidden); q is [rows, H],
// scale [rows, H / 128], in the policy's memory.
template <class Exec, class T, class Src>
void quantise_e4m3_rows(const Exec& ex, std::size_t rows, std::size_t H, Src src, fp8_e4m3* q, float* scale) {
  check_fp8_hidden(H);  // else the tail of each row would be left unwritten
  const std::size_t n = rows * (H / fp8_block);
  const std::size_t group = exec::is_host_policy_v<Exec> ? 16 : 1;  // blocks a call
  if (n) exec::for_each_n(ex, (n + group - 1) / group, fp8_quantise<T, Src>{src, q, scale, H, group, n});
}

template <class Exec, class T>
void quantise_e4m3(const Exec& ex, std::size_t rows, std::size_t H, const T* x, fp8_e4m3* q, float* scale) {
  quantise_e4m3_rows<Exec, T>(ex, rows, H, dense_rows<T>{x}, q, scale);
}

template <class Exec, class T>
void quantise_e4m3(const Exec& ex, std::size_t rows, std::size_t H, const T* x, const std::int64_t* index,
                   fp8_e4m3* q, float* scale) {
  quantise_e4m3_rows<Exec, T>(ex, rows, H, indexed_rows<T>{x, index}, q, scale);
}

template <class Exec, class T>
void quantise_e4m3(const Exec& ex, std::size_t rows, std::size_t H, const T* const* table, fp8_e4m3* q,
                   float* scale) {
  quantise_e4m3_rows<Exec, T>(ex, rows, H, row_table<T>{table}, q, scale);
}

// dst/dst_scale row r = row index[r] of q/scale (fp8_gather).
template <class Exec>
void gather_e4m3(const Exec& ex, std::size_t rows, std::size_t H, const fp8_e4m3* q, const float* scale,
                 const std::int64_t* index, fp8_e4m3* dst, float* dst_scale) {
  exec::for_each_row<fp8_e4m3>(ex, rows, H, fp8_gather{q, scale, index, dst, dst_scale, H});
}

template <class Exec, class T>
void dequantise_e4m3(const Exec& ex, std::size_t rows, std::size_t H, const fp8_e4m3* q, const float* scale, T* out) {
  exec::for_each_row<T>(ex, rows, H, fp8_dequantise<T>{q, scale, out, H});
}

}  // namespace epx::kernels
