// epx's E4M3 conversions (epx/core/fp8.hpp) against CUDA's __nv_fp8_e4m3 (cuda_fp8.h),
// bit for bit. Compiled by nvcc, run on the host: cuda_fp8.h's conversions are
// __host__ __device__, so this needs no GPU (label cuda-host). Covers all 256 codes, every
// float of the exponents around E4M3's range (2^-27 to 2^14, both signs) and floats and
// doubles of every class (tests/support/fp8_cases.hpp); EPX_FP8_EXHAUSTIVE=1 in the
// environment runs all 2^32 floats. Also the row quantisation (epx/kernels/fp8.hpp)
// compiled by nvcc against the same operations written with __nv_fp8_e4m3.
#include <doctest/doctest.h>

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "epx/core/fp8.hpp"
#include "epx/exec/host.hpp"
#include "epx/kernels/fp8.hpp"
#include "support/bits.hpp"
#include "support/fp8_cases.hpp"

namespace {

namespace cases = epx::test::fp8;
using epx::test::bits_of;
using epx::test::double_of;
using epx::test::float_of;

std::uint8_t cuda_bits(float f) { return static_cast<std::uint8_t>(__nv_fp8_e4m3(f).__x); }
std::uint8_t cuda_bits(double d) { return static_cast<std::uint8_t>(__nv_fp8_e4m3(d).__x); }
__nv_fp8_e4m3 cuda_code(unsigned b) {
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(b);
  return v;
}

// Floats u in [first, last] (bit patterns, both signs) whose epx and CUDA codes differ.
std::uint64_t mismatches(std::uint64_t first, std::uint64_t last, std::uint64_t& shown) {
  std::uint64_t bad = 0;
  for (std::uint64_t w = first; w <= last; ++w) {
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      const std::uint32_t u = static_cast<std::uint32_t>(w) | sign;
      const float f = float_of(u);
      const std::uint8_t got = epx::fp8_e4m3(f).bits, want = cuda_bits(f);
      if (got != want) {
        ++bad;
        if (shown++ < 10) FAIL_CHECK("float bits " << u << ": epx " << int(got) << ", CUDA " << int(want));
      }
    }
  }
  return bad;
}

}  // namespace

TEST_CASE("E4M3 decoding: all 256 codes, float and double, the same bits as __nv_fp8_e4m3") {
  for (unsigned b = 0; b < 256; ++b) {
    CAPTURE(b);
    const auto v = epx::fp8_e4m3::from_bits(static_cast<std::uint8_t>(b));
    const float f = static_cast<float>(v), cf = static_cast<float>(cuda_code(b));
    const double d = static_cast<double>(v), cd = static_cast<double>(cuda_code(b));
    CHECK(bits_of(f) == bits_of(cf));
    CHECK(bits_of(d) == bits_of(cd));
  }
}

TEST_CASE("E4M3 encoding of floats: every float with an exponent in [2^-27, 2^14), the same bits as __nv_fp8_e4m3") {
  // Exponent fields 100..140: below 2^-27 everything is a signed zero, from 2^14 up
  // everything saturates; the cases below cover those ranges too.
  std::uint64_t shown = 0;
  const bool all = std::getenv("EPX_FP8_EXHAUSTIVE") != nullptr && std::getenv("EPX_FP8_EXHAUSTIVE")[0] == '1';
  const std::uint64_t first = all ? 0 : std::uint64_t{100} << 23, last = all ? 0x7fffffffu : (std::uint64_t{141} << 23) - 1;
  const std::uint64_t bad = mismatches(first, last, shown);
  CHECK(bad == 0);
  const std::uint64_t compared = 2 * (last - first + 1);
  const std::string what = all ? " (all of them)" : "";
  MESSAGE(compared << " floats compared" << what);
}

TEST_CASE("E4M3 encoding: floats and doubles of every class, the same bits as __nv_fp8_e4m3") {
  std::uint64_t bad = 0;
  const auto fc = cases::float_cases(3, std::size_t{1} << 22);
  for (std::uint32_t u : fc) {
    const float f = float_of(u);
    if (epx::fp8_e4m3(f).bits != cuda_bits(f) && ++bad <= 10)
      FAIL_CHECK("float bits " << u << ": epx " << int(epx::fp8_e4m3(f).bits) << ", CUDA " << int(cuda_bits(f)));
  }
  const auto dc = cases::double_cases(4, std::size_t{1} << 22);
  for (std::uint64_t u : dc) {
    const double d = double_of(u);
    if (epx::fp8_e4m3(d).bits != cuda_bits(d) && ++bad <= 10)
      FAIL_CHECK("double bits " << u << ": epx " << int(epx::fp8_e4m3(d).bits) << ", CUDA " << int(cuda_bits(d)));
  }
  CHECK(bad == 0);
  MESSAGE(fc.size() << " floats and " << dc.size() << " doubles compared");
}

TEST_CASE("quantise_e4m3 compiled by nvcc: the codes of __nv_fp8_e4m3(x / scale)") {
  const std::size_t rows = 9, H = 512;
  std::vector<float> x(rows * H);
  std::uint64_t s = 12345;
  for (std::size_t i = 0; i < x.size(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(s >> 11) * 0x1p-53 - 0.5;
    x[i] = static_cast<float>(std::ldexp(u, static_cast<int>((i / 128) % 30) - 20));
  }
  for (std::size_t h = 0; h < 128; ++h) x[h] = 0.0f;  // an all-zero block
  std::vector<epx::fp8_e4m3> q(rows * H);
  std::vector<float> scale(rows * H / 128);
  epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), scale.data());
  std::vector<float> out(rows * H);
  epx::kernels::dequantise_e4m3(epx::exec::serial{}, rows, H, q.data(), scale.data(), out.data());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < scale.size(); ++i) {
    float amax = 0.0f;
    for (std::size_t h = 0; h < 128; ++h) amax = std::fmax(amax, std::fabs(x[i * 128 + h]));
    const float sc = amax == 0.0f ? 1.0f : amax / 448.0f;
    bad += bits_of(sc) != bits_of(scale[i]);
    for (std::size_t h = 0; h < 128; ++h) {
      const std::size_t e = i * 128 + h;
      const __nv_fp8_e4m3 c(x[e] / sc);
      bad += q[e].bits != c.__x;
      bad += bits_of(out[e]) != bits_of(static_cast<float>(c) * sc);
    }
  }
  CHECK(bad == 0);
  CHECK(scale[0] == 1.0f);
}

TEST_CASE("quantise_e4m3 of double rows compiled by nvcc: the codes of __nv_fp8_e4m3(double(x) / scale)") {
  // Double rows round each quotient once from its double value, as CUDA's double
  // conversion does; the elements sit a double ulp or two around the E4M3 midpoints, where
  // rounding through float would give the other neighbour.
  const std::size_t rows = 7, H = 384;
  std::vector<double> x(rows * H);
  std::uint64_t s = 98765;
  for (std::size_t i = 0; i < x.size(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const std::size_t c = static_cast<std::size_t>(s >> 33) % 126;  // a midpoint of codes c, c + 1
    const double mid = (cases::decode(static_cast<std::uint8_t>(c)) + cases::decode(static_cast<std::uint8_t>(c + 1))) / 2;
    const int ulps = static_cast<int>((s >> 20) % 5) - 2;
    double v = mid;
    for (int k = 0; k < ulps; ++k) v = std::nextafter(v, 1e9);
    for (int k = 0; k > ulps; --k) v = std::nextafter(v, -1e9);
    x[i] = ((s >> 40) & 1 ? -v : v) * std::ldexp(1.0, static_cast<int>((i / 128) % 9) - 4);
  }
  for (std::size_t i = 0; i < x.size() / 128; ++i) x[i * 128 + 5] = 448.0 * std::ldexp(1.0, static_cast<int>(i % 9) - 4);
  for (std::size_t h = 0; h < 128; ++h) x[128 + h] = 0.0;  // an all-zero block
  std::vector<epx::fp8_e4m3> q(rows * H);
  std::vector<float> scale(rows * H / 128);
  epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), scale.data());
  std::size_t bad = 0, through_float_differs = 0;
  for (std::size_t i = 0; i < scale.size(); ++i) {
    double amax = 0.0;
    for (std::size_t h = 0; h < 128; ++h) amax = std::fmax(amax, std::fabs(x[i * 128 + h]));
    const float sc = amax == 0.0 ? 1.0f : static_cast<float>(amax / 448.0);
    bad += bits_of(sc) != bits_of(scale[i]);
    for (std::size_t h = 0; h < 128; ++h) {
      const std::size_t e = i * 128 + h;
      const __nv_fp8_e4m3 c(x[e] / static_cast<double>(sc));
      bad += q[e].bits != c.__x;
      through_float_differs += __nv_fp8_e4m3(static_cast<float>(x[e]) / sc).__x != c.__x;
    }
  }
  CHECK(bad == 0);
  CHECK(through_float_differs > 0);
  CHECK(scale[1] == 1.0f);
}
