// bf16 and fp16 conversions (epx/core/numeric.hpp) bit for bit against an implementation
// that shares nothing with them: tests/support/reference.hpp's float_format, written with
// double arithmetic (ldexp, ilogb, floor) instead of bit manipulation, and, where the
// compiler has it, the compiler's own _Float16.
//
// Decoding: all 2^16 patterns of each format. Encoding: every value of the format, the
// midpoints between neighbours (ties: even significand wins) and the floats next to
// them, the overflow threshold, float subnormals, zeros, infinities, NaNs (payloads and
// signs), and a large sample of random float bit patterns.
#include <doctest/doctest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "support/bits.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_numeric_cpp {

namespace {

using epx::ref::float_format;

using epx::test::bits_of;
using epx::test::float_of;


bool is_nan_pattern(const float_format& f, std::uint32_t b) {
  return (b & f.exp_mask()) == f.exp_mask() && (b & ((1u << f.man) - 1u)) != 0;
}

struct codec {
  const char* name;
  float_format fmt;
  std::uint16_t (*encode)(float);
  float (*decode)(std::uint16_t);
};

std::uint16_t lib_bf16(float f) { return epx::detail::float_to_bf16_bits(f); }
std::uint16_t lib_fp16(float f) { return epx::detail::float_to_fp16_bits(f); }
float lib_bf16_dec(std::uint16_t b) { return epx::detail::bf16_bits_to_float(b); }
float lib_fp16_dec(std::uint16_t b) { return epx::detail::fp16_bits_to_float(b); }

const codec codecs[] = {{"bf16", epx::ref::bf16_format, lib_bf16, lib_bf16_dec},
                        {"fp16", epx::ref::fp16_format, lib_fp16, lib_fp16_dec}};

// Checks one float; returns an empty string or the first mismatch.
std::string check_encode(const codec& c, float x) {
  const std::uint16_t got = c.encode(x);
  if (std::isnan(x)) {
    // bf16 and fp16: every NaN (quiet or signalling, either sign) is the canonical 0x7fff, as
    // CUDA's __float2bfloat16 and __float2half give it (tests/cuda/host/numeric.cu compares them).
    if (got != 0x7fffu)
      return epx::detail::concat(c.name, ": NaN 0x", std::hex, bits_of(x), " encodes to 0x", got,
                                 ", not the canonical NaN 0x7fff");
    return {};
  }
  const std::uint32_t want = epx::ref::format_encode(c.fmt, static_cast<double>(x));
  if (got != want)
    return epx::detail::concat(c.name, ": float 0x", std::hex, bits_of(x), " (", std::dec, x, ") encodes to 0x",
                               std::hex, got, ", the reference gives 0x", want);
  return {};
}

// Runs check_encode over `xs`; fails the test case on the first few mismatches.
void check_all(const codec& c, const std::vector<float>& xs, const std::string& what) {
  std::size_t bad = 0;
  for (float x : xs) {
    const std::string e = check_encode(c, x);
    if (!e.empty() && ++bad <= 5) FAIL_CHECK(what << ": " << e);
  }
  CHECK_MESSAGE(bad == 0, std::string(c.name) << " " << what << ": " << bad << " of " << xs.size() << " floats differ");
}

}  // namespace

TEST_CASE("numeric: the reference format is right about a few well-known values") {
  using epx::ref::format_encode;
  // bf16
  CHECK(format_encode(epx::ref::bf16_format, 1.0) == 0x3f80u);
  CHECK(format_encode(epx::ref::bf16_format, -2.0) == 0xc000u);
  CHECK(format_encode(epx::ref::bf16_format, 1.0 + 1.0 / 256) == 0x3f80u);       // tie: even (down)
  CHECK(format_encode(epx::ref::bf16_format, 1.0 + 3.0 / 256) == 0x3f82u);       // tie: even (up)
  CHECK(format_encode(epx::ref::bf16_format, std::ldexp(1.0, -133)) == 0x0001u);  // smallest subnormal
  CHECK(format_encode(epx::ref::bf16_format, std::ldexp(1.0, -134)) == 0x0000u);  // tie to zero (even)
  CHECK(format_encode(epx::ref::bf16_format, 3.3895313892515355e38) == 0x7f7fu);  // largest finite
  CHECK(format_encode(epx::ref::bf16_format, 3.4e38) == 0x7f80u);                 // past it: infinity
  // fp16
  CHECK(format_encode(epx::ref::fp16_format, 1.0) == 0x3c00u);
  CHECK(format_encode(epx::ref::fp16_format, 65504.0) == 0x7bffu);
  CHECK(format_encode(epx::ref::fp16_format, 65519.99) == 0x7bffu);
  CHECK(format_encode(epx::ref::fp16_format, 65520.0) == 0x7c00u);  // tie at the top: infinity
  CHECK(format_encode(epx::ref::fp16_format, std::ldexp(1.0, -24)) == 0x0001u);
  CHECK(format_encode(epx::ref::fp16_format, std::ldexp(1.0, -14)) == 0x0400u);  // smallest normal
  CHECK(format_encode(epx::ref::fp16_format, std::ldexp(3.0, -25)) == 0x0002u);  // 1.5 * 2^-24: tie to even (up)
  CHECK(format_encode(epx::ref::fp16_format, -0.0) == 0x8000u);
  CHECK(epx::ref::format_decode(epx::ref::fp16_format, 0x7bffu) == 65504.0);
  CHECK(epx::ref::format_decode(epx::ref::bf16_format, 0x0001u) == std::ldexp(1.0, -133));
}

TEST_CASE("numeric: decoding every bf16 and fp16 bit pattern") {
  for (const codec& c : codecs) {
    const std::string codec_name = c.name;  // a const char* would print as its address
    CAPTURE(codec_name);
    std::size_t bad = 0;
    for (std::uint32_t b = 0; b < 0x10000u; ++b) {
      const float got = c.decode(static_cast<std::uint16_t>(b));
      const double want = epx::ref::format_decode(c.fmt, b);
      bool ok;
      if (is_nan_pattern(c.fmt, b) && c.fmt.exp_bits == 5) {
        ok = bits_of(got) == 0x7fffffffu;  // fp16: every NaN is the quiet float NaN (__half2float)
      } else if (is_nan_pattern(c.fmt, b)) {
        ok = std::isnan(got) && std::signbit(got) == ((b & c.fmt.sign_bit()) != 0);
      } else {
        ok = static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
      }
      // bf16 is the top half of a float: decoding keeps every bit, NaN payloads included.
      if (c.fmt.exp_bits == 8) ok = ok && bits_of(got) == (b << 16);
      if (!ok && ++bad <= 5) FAIL_CHECK(c.name << ": pattern 0x" << std::hex << b << " decodes to " << got);
      // Round trip: encoding a decoded value gives the pattern back (NaN: some NaN).
      if (!is_nan_pattern(c.fmt, b)) {
        if (c.encode(got) != b && ++bad <= 5) FAIL_CHECK(c.name << ": 0x" << std::hex << b << " does not round-trip");
      }
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("numeric: encoding every value, every midpoint (ties to even) and the floats around them") {
  for (const codec& c : codecs) {
    const std::string codec_name = c.name;  // a const char* would print as its address
    CAPTURE(codec_name);
    std::vector<float> xs;
    const std::uint32_t top = c.fmt.exp_mask();  // +infinity's pattern
    for (std::uint32_t b = 0; b < top; ++b) {     // every finite non-negative value
      const auto x = static_cast<float>(epx::ref::format_decode(c.fmt, b));
      const double next = epx::ref::format_decode(c.fmt, b + 1);  // the next value (or infinity)
      // The midpoint to the next value; past the largest finite value, the overflow
      // threshold (max + half an ulp), which rounds to infinity.
      const double ulp = b + 1 < top ? next - static_cast<double>(x)
                                     : static_cast<double>(x) - epx::ref::format_decode(c.fmt, b - 1);
      const auto mid = static_cast<float>(static_cast<double>(x) + ulp / 2);  // exact in float
      REQUIRE(static_cast<double>(mid) == static_cast<double>(x) + ulp / 2);
      for (float v : {x, mid, std::nextafter(x, 0.0f), std::nextafter(x, INFINITY), std::nextafter(mid, 0.0f),
                      std::nextafter(mid, INFINITY)}) {
        xs.push_back(v);
        xs.push_back(-v);
      }
    }
    check_all(c, xs, "values and midpoints");
  }
}

TEST_CASE("numeric: encoding zeros, float subnormals, infinities, NaNs and extremes") {
  std::vector<float> xs = {0.0f, -0.0f, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN,
                           FLT_TRUE_MIN, -FLT_TRUE_MIN, 65504.0f, 65520.0f, 65519.996f, 1e-8f, 2.9802322e-8f,
                           5.9604645e-8f, 6.1035156e-5f};
  for (std::uint32_t m = 1; m < (1u << 23); m += 97) {  // float subnormals, both signs
    xs.push_back(float_of(m));
    xs.push_back(float_of(0x80000000u | m));
  }
  for (std::uint32_t m = 1; m < (1u << 23); m = m * 3 + 1) {  // NaN payloads (quiet and signalling), both signs
    xs.push_back(float_of(0x7f800000u | m));
    xs.push_back(float_of(0xff800000u | m));
  }
  for (int i = 0; i < 23; ++i) {
    xs.push_back(float_of(0x7f800000u | (1u << i)));
    xs.push_back(float_of(0xff800000u | (1u << i)));
  }
  for (const codec& c : codecs) check_all(c, xs, "classes");
}

TEST_CASE("numeric: encoding a random sample of 2^22 float bit patterns and 2^20 floats in fp16's range") {
  epx::ref::rng g(0xb16f16ull);
  std::vector<float> xs;
  xs.reserve((1u << 22) + (1u << 20));
  for (std::uint32_t i = 0; i < (1u << 22); ++i) xs.push_back(float_of(static_cast<std::uint32_t>(g.next())));
  for (std::uint32_t i = 0; i < (1u << 20); ++i)
    xs.push_back(static_cast<float>(std::ldexp(g.uniform(-1.0, 1.0), g.below(44) - 27)));  // 2^-27 .. 2^16
  for (const codec& c : codecs) check_all(c, xs, "random");
#if defined(__FLT16_MANT_DIG__) && !defined(__CUDACC__)
  // The compiler's _Float16 (libgcc/compiler-rt conversion): a third implementation.
  std::size_t bad = 0;
  for (float x : xs) {
    if (std::isnan(x)) continue;
    const _Float16 h = static_cast<_Float16>(x);
    std::uint16_t hb;
    std::memcpy(&hb, &h, sizeof hb);
    if (hb != epx::detail::float_to_fp16_bits(x) && ++bad <= 5)
      FAIL_CHECK("fp16: float 0x" << std::hex << bits_of(x) << ": _Float16 gives 0x" << hb << ", epx 0x"
                                  << epx::detail::float_to_fp16_bits(x));
  }
  CHECK(bad == 0);
#endif
}

TEST_CASE("numeric: the storage types convert through the same codecs") {
  for (float x : {0.1f, -3.75f, 1e-30f, 70000.0f, 1.00390625f}) {
    CHECK(epx::bf16(x).bits == epx::detail::float_to_bf16_bits(x));
    CHECK(epx::fp16(x).bits == epx::detail::float_to_fp16_bits(x));
    CHECK(static_cast<float>(epx::bf16::from_bits(0x3f81)) == epx::detail::bf16_bits_to_float(0x3f81));
    CHECK(epx::convert<float>(epx::fp16(x)) == static_cast<float>(epx::fp16(x)));
  }
  // ref::to_type_exact (the test experts' rounding) agrees with the library on floats,
  // for fp16 also at the ends of its range: the largest value, the overflow midpoint, the
  // subnormals and the tie below the smallest one.
  for (float x : {0.1f, -3.75f, 1.00390625f, 1.01171875f, 65519.0f, 65520.0f, -65520.0f, 70000.0f, 6.1e-5f,
                  5.9604645e-8f, 2.9802322e-8f, 2.9802326e-8f, 8.9406967e-8f, 1e-30f}) {
    CHECK(epx::ref::to_type_exact<epx::bf16>(x).bits == epx::bf16(x).bits);
    CHECK(epx::ref::to_type_exact<epx::fp16>(x).bits == epx::fp16(x).bits);
  }
}

#if defined(__FLT16_MANT_DIG__) && !defined(__CUDACC__)
TEST_CASE("numeric: decoding every fp16 bit pattern equals the compiler's _Float16") {
  // The third implementation of the random-sample case, for decoding: every non-NaN
  // pattern gives the float bits of _Float16's conversion (subnormals, zeros and
  // infinities of both signs included); NaN patterns are checked above.
  std::size_t bad = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const auto hb = static_cast<std::uint16_t>(b);
    _Float16 h;
    std::memcpy(&h, &hb, sizeof h);
    const float want = static_cast<float>(h);
    if (std::isnan(want)) continue;
    const float got = epx::detail::fp16_bits_to_float(hb);
    if (bits_of(got) != bits_of(want) && ++bad <= 5)
      FAIL_CHECK("fp16 0x" << std::hex << b << " decodes to 0x" << bits_of(got) << ", _Float16 gives 0x"
                           << bits_of(want));
  }
  CHECK(bad == 0);
}
#endif

}  // namespace test_numeric_cpp
