// Test support for FP8 E4M3: an independent model of the format (decoder and
// round-to-nearest-even encoder written from the definition, not from epx's bit tricks),
// and the inputs of every class that the conversion tests run over. Used by
// tests/core/test_fp8.cpp (against the model) and by the nvcc tests under tests/cuda
// (against CUDA's __nv_fp8_e4m3).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/bits.hpp"

namespace epx::test::fp8 {

// The value of E4M3 code b: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
// is subnormal (m * 2^-9); S.1111.111 is NaN; there is no infinity.
inline double decode(std::uint8_t b) {
  if ((b & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
  const int e = (b >> 3) & 15;
  const int m = b & 7;
  const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(static_cast<double>(8 + m), e - 10);
  return (b & 0x80) ? -mag : mag;
}

// The 127 finite non-negative values, codes 0x00..0x7e, increasing.
inline const std::array<double, 127>& positive_values() {
  static const std::array<double, 127> v = [] {
    std::array<double, 127> a{};
    for (int c = 0; c < 127; ++c) a[static_cast<std::size_t>(c)] = decode(static_cast<std::uint8_t>(c));
    return a;
  }();
  return v;
}

// The E4M3 code nearest to x, ties to the even code (an even mantissa), anything at or
// above 448 in magnitude (infinity included) saturated to 448, the sign of x kept (also
// for zeros). NaN: 0x7f, or 0xff for a negative NaN when nan_sign is set (CUDA's double
// conversion keeps a NaN's sign; its float conversion does not).
inline std::uint8_t encode(double x, bool nan_sign = false) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<std::uint8_t>(0x7f | (nan_sign ? sign : 0));
  const double a = std::fabs(x);
  const auto& v = positive_values();
  if (a >= v[126]) return static_cast<std::uint8_t>(sign | 0x7e);
  // v[lo] <= a < v[lo + 1]
  const std::size_t lo = static_cast<std::size_t>(std::upper_bound(v.begin(), v.end(), a) - v.begin()) - 1;
  std::size_t c = lo;
  if (a != v[lo]) {
    const double mid = (v[lo] + v[lo + 1]) / 2;  // exact: both have 4 significant bits
    if (a > mid || (a == mid && (lo & 1))) c = lo + 1;
  }
  return static_cast<std::uint8_t>(sign | c);
}

// Float inputs of every class, as bit patterns: zeros, infinities, NaNs (quiet,
// signalling, with payloads, both signs), float subnormals, every E4M3 value, every
// midpoint between neighbouring E4M3 values (ties) and the floats around each, the
// saturation and underflow thresholds, a stride over the mantissas of every exponent of
// both signs, and `random` random patterns (half of them in the E4M3 range).
inline std::vector<std::uint32_t> float_cases(std::uint64_t seed, std::size_t random) {
  std::vector<std::uint32_t> out;
  auto add = [&](std::uint32_t u) {
    out.push_back(u);
    out.push_back(u ^ 0x80000000u);
  };
  auto add_around = [&](double d, int ulps) {
    const float f = static_cast<float>(d);  // the points here are floats exactly
    const std::uint32_t u = bits_of(f);
    for (int k = -ulps; k <= ulps; ++k) {
      const std::int64_t w = static_cast<std::int64_t>(u) + k;
      if (w >= 0 && w <= 0x7f800000) add(static_cast<std::uint32_t>(w));
    }
  };
  // zeros, infinities, NaNs
  for (std::uint32_t u : {0x00000000u, 0x7f800000u, 0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0x7fffffffu, 0x7fc00001u,
                          0x7fa5a5a5u})
    add(u);
  // float subnormals and the smallest normals
  for (std::uint32_t u = 1; u < 4096; ++u) add(u);
  for (std::uint32_t u = 0x00800000u - 4096; u <= 0x00800000u + 4096; ++u) add(u);
  for (std::uint32_t u = 4096; u < 0x00800000u; u += 997) add(u);
  // every E4M3 value and the midpoints, with their float neighbours
  const auto& v = positive_values();
  for (std::size_t i = 0; i < v.size(); ++i) {
    add_around(v[i], 3);
    if (i + 1 < v.size()) add_around((v[i] + v[i + 1]) / 2, 3);
  }
  // thresholds: half the smallest subnormal (2^-10), 448 + half an ulp (464), the next
  // would-be value (480), the float and half limits, large values
  for (double d : {0x1p-10, 0x1p-11, 0x1.8p-10, 464.0, 480.0, 496.0, 512.0, 65504.0, 1e10, 1e30,
                   static_cast<double>(std::numeric_limits<float>::max())})
    add_around(d, 3);
  // every exponent field, a stride over its mantissas, and the ends of each
  for (std::uint32_t e = 0; e < 256; ++e) {
    const std::uint32_t base = e << 23;
    for (std::uint32_t m = 0; m < 0x00800000u; m += 4093) add(base | m);
    for (std::uint32_t m = 0; m < 16; ++m) {
      add(base | m);
      add(base | (0x007fffffu - m));
    }
  }
  // random patterns, and random floats with magnitudes in [2^-12, 2^10)
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&] {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (std::size_t i = 0; i < random; ++i) {
    const std::uint64_t r = next();
    if (i & 1)
      out.push_back(static_cast<std::uint32_t>(r));
    else
      out.push_back(static_cast<std::uint32_t>((r & 0x807fffffu) | ((115u + (r >> 40) % 22u) << 23)));
  }
  return out;
}

// Double inputs: the float cases widened, doubles one and two ulps (of a double) around
// every E4M3 midpoint and threshold (where rounding the double directly and rounding it
// through float differ), NaNs of both signs with payloads, and `random` random patterns.
inline std::vector<std::uint64_t> double_cases(std::uint64_t seed, std::size_t random) {
  std::vector<std::uint64_t> out;
  for (std::uint32_t u : float_cases(seed, random / 2)) out.push_back(bits_of(static_cast<double>(float_of(u))));
  auto add_around = [&](double d) {
    const std::uint64_t u = bits_of(d);
    for (int k = -2; k <= 2; ++k) {
      const std::uint64_t w = u + static_cast<std::uint64_t>(static_cast<std::int64_t>(k));
      out.push_back(w);
      out.push_back(w ^ 0x8000000000000000ull);
    }
  };
  const auto& v = positive_values();
  for (std::size_t i = 0; i + 1 < v.size(); ++i) add_around((v[i] + v[i + 1]) / 2);
  for (double d : {0x1p-10, 464.0, 448.0, 0x1p-149, 0x1p-126, 1e300}) add_around(d);
  for (std::uint64_t u : {0x7ff0000000000000ull, 0x7ff8000000000000ull, 0x7ff0000000000001ull, 0x7fffffffffffffffull,
                          0x7ff4000000000123ull, 0x0000000000000001ull, 0x000fffffffffffffull}) {
    out.push_back(u);
    out.push_back(u ^ 0x8000000000000000ull);
  }
  std::uint64_t s = seed * 0xd1b54a32d192ed03ull + 7;
  for (std::size_t i = 0; i < random; ++i) {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    if (i & 1) z = (z & 0x800fffffffffffffull) | (static_cast<std::uint64_t>(1011 + (z >> 20) % 22) << 52);
    out.push_back(z);
  }
  return out;
}

}  // namespace epx::test::fp8
