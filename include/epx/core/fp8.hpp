// epx/core/fp8.hpp: the 8-bit floating-point storage type E4M3.
//
// `epx::fp8_e4m3` is one byte, bit-compatible with CUDA's `__nv_fp8_e4m3` (cuda_fp8.h):
// 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, one NaN pattern
// per sign (S.1111.111), largest finite value 448 (0x7e), smallest subnormal 2^-9.
// Usable in host and device code alike; plain C++17, no CUDA header needed.
//
// The conversions give the bits of CUDA's:
//   fp8_e4m3(float f), fp8_e4m3(double d)  __nv_fp8_e4m3(f) and __nv_fp8_e4m3(d), i.e.
//       __nv_cvt_{float,double}_to_fp8(x, __NV_SATFINITE, __NV_E4M3): round to nearest
//       even; |x| above 464 (448 + half an ulp) and +-inf saturate to +-448 (464 itself is a
//       tie and rounds to 448); |x| <= 2^-10 (half the smallest subnormal) gives a zero of
//       the sign of x. A float NaN of either sign gives 0x7f (CUDA's float path makes it
//       the canonical NaN first); a double NaN keeps its sign (0x7f or 0xff), as CUDA's
//       double path does.
//   float(fp8_e4m3 v), double(v)           float(__nv_fp8_e4m3) and double(...): exact, a
//       zero keeps its sign, both NaN patterns give the float NaN 0x7fffffff.
// The float conversion is one rounding of the float's value (as CUDA's, whose float path
// widens to double exactly and rounds once); the double conversion rounds the double's
// value once (not through float).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"

namespace epx {
namespace detail {

EPX_HOST_DEVICE inline std::uint64_t fp8_double_bits(double d) noexcept {
#if EPX_IS_DEVICE_CODE
  return static_cast<std::uint64_t>(__double_as_longlong(d));
#else
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}

// E4M3 bits of x, where x is given by its magnitude's bits `a` of a binary format with
// `M` mantissa bits and exponent bias `B` (float: 23, 127; double: 52, 1023) and its sign.
// `a` is not NaN and not above 464; the callers handle those. Round to nearest even.
template <class U, int M, int B>
EPX_HOST_DEVICE inline std::uint8_t fp8_e4m3_round(U a) noexcept {
  // |x| <= 2^-10: zero (2^-10 is the tie between 0 and 2^-9 and goes to the even 0).
  if (a <= (static_cast<U>(B - 10) << M)) return 0u;
  const int e = static_cast<int>(a >> M) - B;  // unbiased exponent, in [-10, 8]
  const U sig = (a & ((static_cast<U>(1) << M) - 1u)) | (static_cast<U>(1) << M);
  // The E4M3 quantum at this exponent: 2^(e-3) for normals (e >= -6), 2^-9 below.
  // sig * 2^(e-M) / quantum = sig >> shift.
  const int shift = e >= -6 ? M - 3 : M - 3 + (-6 - e);
  U q = sig >> shift;
  const U rem = sig & ((static_cast<U>(1) << shift) - 1u);
  const U half = static_cast<U>(1) << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the next binade
  // q counts quanta: for normals q in [8, 16] holds the implicit bit, so the code is
  // ((e + 7) << 3) + (q - 8); for subnormals the code is q (q == 8 is the smallest normal).
  const unsigned code = e >= -6 ? (static_cast<unsigned>(e + 7) << 3) + static_cast<unsigned>(q) - 8u
                                : static_cast<unsigned>(q);
  return static_cast<std::uint8_t>(code);
}

// The same rounding as fp8_e4m3_round<uint32_t, 23, 127> (bit for bit over all 2^32
// floats), without branches, so that a loop over a block vectorises: normals round the
// float's 23-bit mantissa to 3 bits by integer arithmetic (nearest even, as the bf16
// conversion does); below 2^-6 the E4M3 code is |x| * 2^9 rounded to an integer, which
// the FPU's addition of 2^23 rounds to nearest even (|x| * 2^9 is exact: a power of two).
// fp8_e4m3_magnitude_code rounds a magnitude a (a float's bits without the sign) of at most
// 464; float_to_fp8_e4m3_bits adds saturation, the sign and NaN, and
// float_to_fp8_e4m3_bits_in_range only the sign.
EPX_HOST_DEVICE inline std::uint32_t fp8_e4m3_magnitude_code(std::uint32_t a) noexcept {
  // Each rounding sees the magnitude clamped to its own range (an unsigned max and min of
  // the bits), where the other gives 8 (the code of 2^-6), so the code is their sum less 8:
  // no selection between the two, which the host compiler turned into masks (the clamps are
  // single vector instructions; 11% less time per element than the masks with AVX2 and
  // AVX-512, the same at the SSE2 baseline).
  const std::uint32_t n = a > 0x3c800000u ? a : 0x3c800000u;  // at least 2^-6
  const float s = bits_float(a < 0x3c800000u ? a : 0x3c800000u);  // at most 2^-6
  const std::uint32_t normal = ((n + 0x7ffffu + ((n >> 20) & 1u)) >> 20) - (120u << 3);
  const std::uint32_t sub = float_bits(s * 512.0f + 8388608.0f) - 0x4b000000u;
  return normal + sub - 8u;
}

EPX_HOST_DEVICE inline std::uint8_t float_to_fp8_e4m3_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t a = u & 0x7fffffffu;
  const std::uint32_t is_big = 0u - static_cast<std::uint32_t>(a > 0x43e80000u);  // above 464, inf: +-448
  const std::uint32_t is_nan = 0u - static_cast<std::uint32_t>(a > 0x7f800000u);  // NaN, sign dropped
  std::uint32_t code = (0x7eu & is_big) | (fp8_e4m3_magnitude_code(a) & ~is_big);
  code |= (u >> 24) & 0x80u;
  code = (0x7fu & is_nan) | (code & ~is_nan);
  return static_cast<std::uint8_t>(code);
}

// float_to_fp8_e4m3_bits(f) for an f that is not NaN and at most 464 in magnitude (no
// saturation, no NaN code): the same bits with two selections fewer.
EPX_HOST_DEVICE inline std::uint8_t float_to_fp8_e4m3_bits_in_range(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  return static_cast<std::uint8_t>(fp8_e4m3_magnitude_code(u & 0x7fffffffu) | ((u >> 24) & 0x80u));
}

// float_to_fp8_e4m3_bits(f) for an f that is not NaN and whose magnitude lies in
// [2^-6, 464] (E4M3's normals and the ties at their ends): the rounding of the normals
// alone, which is fp8_e4m3_magnitude_code's where the subnormal rounding gives 8.
EPX_HOST_DEVICE inline std::uint8_t float_to_fp8_e4m3_bits_normal(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t a = u & 0x7fffffffu;
  const std::uint32_t code = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  return static_cast<std::uint8_t>(code | ((u >> 24) & 0x80u));
}

EPX_HOST_DEVICE inline std::uint8_t double_to_fp8_e4m3_bits(double d) noexcept {
  const std::uint64_t u = fp8_double_bits(d);
  const std::uint64_t a = u & 0x7fffffffffffffffull;
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 56) & 0x80u);
  if (a > 0x7ff0000000000000ull) return static_cast<std::uint8_t>(sign | 0x7fu);  // NaN, signed
  if (a > 0x407d000000000000ull) return static_cast<std::uint8_t>(sign | 0x7eu);  // above 464
  return static_cast<std::uint8_t>(sign | fp8_e4m3_round<std::uint64_t, 52, 1023>(a));
}

// The float value of E4M3 bits b (exact). Without branches (selections by masks), so that
// a loop over a block vectorises on the host: a subnormal code is m * 2^-9 (m <= 7, exact
// in float), a normal one moves its fields into place.
EPX_HOST_DEVICE inline float fp8_e4m3_bits_to_float(std::uint8_t b) noexcept {
  const std::uint32_t a = b & 0x7fu;
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t e = a >> 3;
  const std::uint32_t m = a & 7u;
  const std::uint32_t normal = sign | ((e + 120u) << 23) | (m << 20);
  const std::uint32_t sub = sign | float_bits(static_cast<float>(static_cast<int>(m)) * 0x1p-9f);
  const std::uint32_t is_normal = 0u - static_cast<std::uint32_t>(e != 0u);
  const std::uint32_t is_nan = 0u - static_cast<std::uint32_t>(a == 0x7fu);  // NaN, sign dropped
  const std::uint32_t r = (normal & is_normal) | (sub & ~is_normal);
  return bits_float((0x7fffffffu & is_nan) | (r & ~is_nan));
}

}  // namespace detail

// E4M3 in storage: its bits, converted from float and double with CUDA's rules above.
struct fp8_e4m3 {
  std::uint8_t bits;
  fp8_e4m3() = default;
  EPX_HOST_DEVICE explicit fp8_e4m3(float f) noexcept : bits(detail::float_to_fp8_e4m3_bits(f)) {}
  EPX_HOST_DEVICE explicit fp8_e4m3(double d) noexcept : bits(detail::double_to_fp8_e4m3_bits(d)) {}
  EPX_HOST_DEVICE explicit operator float() const noexcept { return detail::fp8_e4m3_bits_to_float(bits); }
  EPX_HOST_DEVICE explicit operator double() const noexcept {
    return static_cast<double>(detail::fp8_e4m3_bits_to_float(bits));
  }
  EPX_HOST_DEVICE static fp8_e4m3 from_bits(std::uint8_t b) noexcept {
    fp8_e4m3 v;
    v.bits = b;
    return v;
  }
};

static_assert(sizeof(fp8_e4m3) == 1 && std::is_trivially_copyable_v<fp8_e4m3>);

// The largest finite E4M3 value.
inline constexpr float fp8_e4m3_max = 448.0f;

}  // namespace epx
