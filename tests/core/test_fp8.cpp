// FP8 E4M3 (epx/core/fp8.hpp) against an independent model of the format, and the per-128
// block quantisation of rows (epx/kernels/fp8.hpp) against a float32 model (bits) and a
// float64 reference (error bounds), on every host policy and the emulated device.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/core/fp8.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/emulated.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/kernels/fp8.hpp"
#include "support/bits.hpp"
#include "support/fp8_cases.hpp"
#include "support/host_isa.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_fp8_cpp {

namespace {

using epx::test::for_each_host_isa;

namespace model = epx::test::fp8;
using epx::test::bits_of;
using epx::test::double_of;
using epx::test::float_of;
using epx::fp8_e4m3;

std::string hex(std::uint64_t v) {
  static const char* d = "0123456789abcdef";
  std::string s;
  do {
    s.insert(s.begin(), d[v & 15]);
    v >>= 4;
  } while (v);
  return "0x" + s;
}

// ---------------------------------------------------------------------------------------
// The storage type
// ---------------------------------------------------------------------------------------

TEST_CASE("fp8_e4m3: one byte, trivially copyable") {
  static_assert(sizeof(fp8_e4m3) == 1);
  static_assert(std::is_trivially_copyable_v<fp8_e4m3>);
  static_assert(std::is_trivially_default_constructible_v<fp8_e4m3>);
  CHECK(epx::fp8_e4m3_max == 448.0f);
  CHECK(fp8_e4m3::from_bits(0x7e).bits == 0x7e);
}

TEST_CASE("fp8_e4m3: every one of the 256 codes decodes to the model's value") {
  int nans = 0;
  for (unsigned b = 0; b < 256; ++b) {
    CAPTURE(hex(b));
    const auto v = fp8_e4m3::from_bits(static_cast<std::uint8_t>(b));
    const float f = static_cast<float>(v);
    const double d = static_cast<double>(v);
    const double want = model::decode(static_cast<std::uint8_t>(b));
    if (std::isnan(want)) {
      ++nans;
      CHECK(bits_of(f) == 0x7fffffffu);  // CUDA's decoding: the canonical float NaN
      CHECK(std::isnan(d));
      CHECK(!std::signbit(d));
    } else {
      CHECK(static_cast<double>(f) == want);
      CHECK(d == want);
      CHECK(std::signbit(f) == ((b & 0x80) != 0));  // -0 stays -0
    }
  }
  CHECK(nans == 2);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x7e)) == 448.0f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0xfe)) == -448.0f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x01)) == 0x1p-9f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x07)) == 7 * 0x1p-9f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x08)) == 0x1p-6f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x38)) == 1.0f);
}

TEST_CASE("fp8_e4m3: every finite code survives a round trip through float and double") {
  for (unsigned b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    CAPTURE(hex(b));
    const auto v = fp8_e4m3::from_bits(static_cast<std::uint8_t>(b));
    CHECK(fp8_e4m3(static_cast<float>(v)).bits == b);
    CHECK(fp8_e4m3(static_cast<double>(v)).bits == b);
  }
}

TEST_CASE("fp8_e4m3: float encoding equals the model over every float class") {
  const auto cases = model::float_cases(1, std::size_t{1} << 21);
  std::size_t bad = 0;
  for (std::uint32_t u : cases) {
    const float f = float_of(u);
    const std::uint8_t got = fp8_e4m3(f).bits;
    const std::uint8_t want = model::encode(static_cast<double>(f));
    if (got != want && ++bad <= 10) FAIL_CHECK("float " << hex(u) << " (" << f << "): " << hex(got) << " != " << hex(want));
  }
  CHECK(bad == 0);
  MESSAGE(cases.size() << " floats");
}

TEST_CASE("fp8_e4m3: double encoding rounds the double once and keeps a NaN's sign") {
  const auto cases = model::double_cases(2, std::size_t{1} << 20);
  std::size_t bad = 0, differs_from_float = 0;
  for (std::uint64_t u : cases) {
    const double d = double_of(u);
    const std::uint8_t got = fp8_e4m3(d).bits;
    const std::uint8_t want = model::encode(d, true);
    if (got != want && ++bad <= 10) FAIL_CHECK("double " << hex(u) << " (" << d << "): " << hex(got) << " != " << hex(want));
    if (got != fp8_e4m3(static_cast<float>(d)).bits) ++differs_from_float;
  }
  CHECK(bad == 0);
  CHECK(differs_from_float > 0);  // the cases include doubles that rounding through float would get wrong
}

TEST_CASE("fp8_e4m3: the named cases") {
  auto enc = [](float f) { return fp8_e4m3(f).bits; };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(enc(0.0f) == 0x00);
  CHECK(enc(-0.0f) == 0x80);
  CHECK(enc(1.0f) == 0x38);
  CHECK(enc(-2.0f) == 0xc0);
  CHECK(enc(448.0f) == 0x7e);
  CHECK(enc(463.99997f) == 0x7e);
  CHECK(enc(464.0f) == 0x7e);  // the tie above 448 goes to the even 448
  CHECK(enc(std::nextafter(464.0f, inf)) == 0x7e);  // saturation, not NaN
  CHECK(enc(1e30f) == 0x7e);
  CHECK(enc(-1e30f) == 0xfe);
  CHECK(enc(inf) == 0x7e);
  CHECK(enc(-inf) == 0xfe);
  CHECK(enc(nan) == 0x7f);
  CHECK(enc(-nan) == 0x7f);
  CHECK(fp8_e4m3(-static_cast<double>(nan)).bits == 0xff);
  CHECK(enc(0x1p-9f) == 0x01);
  CHECK(enc(0x1p-10f) == 0x00);  // the tie between 0 and 2^-9 goes to 0
  CHECK(enc(-0x1p-10f) == 0x80);
  CHECK(enc(std::nextafter(0x1p-10f, 1.0f)) == 0x01);
  CHECK(enc(0x1.8p-9f) == 0x02);  // 1.5 * 2^-9: tie between 1 and 2, to even 2
  CHECK(enc(0x1.8p-8f) == 0x03);  // 3 * 2^-9 exactly
  CHECK(enc(0x1.ep-7f) == 0x08);  // 7.5 * 2^-9: tie between 0x07 and 0x08, to even 0x08
  CHECK(enc(1.0625f) == 0x38);    // tie between 1 and 1.125, to even 1
  CHECK(enc(1.1875f) == 0x3a);    // tie between 1.125 and 1.25, to even 1.25
  CHECK(enc(std::numeric_limits<float>::denorm_min()) == 0x00);
  CHECK(enc(-std::numeric_limits<float>::denorm_min()) == 0x80);
}

// ---------------------------------------------------------------------------------------
// Quantising rows
// ---------------------------------------------------------------------------------------

TEST_CASE("check_fp8_hidden: a hidden size that is not a multiple of 128 is a configuration error") {
  CHECK_NOTHROW(epx::kernels::check_fp8_hidden(128));
  CHECK_NOTHROW(epx::kernels::check_fp8_hidden(7168));
  for (std::size_t H : {1u, 64u, 100u, 129u, 7000u}) {
    CAPTURE(H);
    try {
      epx::kernels::check_fp8_hidden(H);
      FAIL("no error");
    } catch (const epx::error& e) {
      CHECK(e.category() == epx::errc::configuration);
      CHECK(e.message().find("multiple of 128") != std::string::npos);
      CHECK(e.message().find("hidden size is " + std::to_string(H)) != std::string::npos);
    }
    // The quantisation launch refuses it too (it would leave each row's tail unwritten).
    std::vector<float> x(2 * H, 1.0f), scale(2 * H);
    std::vector<epx::fp8_e4m3> q(2 * H);
    CHECK_THROWS_AS(epx::kernels::quantise_e4m3(epx::exec::serial{}, 2, H, x.data(), q.data(), scale.data()),
                    epx::error);
  }
  CHECK(epx::kernels::fp8_scales_per_row(7168) == 56);
}

// Rows of varied magnitude: block b of row r is scaled by mag = 2^((r * 7 + b * 3) % 17 - 10),
// and is one of: all zero; one non-zero element; elements down to 2^-19 of the largest
// (E4M3 subnormals after scaling); exact ties of x / scale (the largest element is
// 448 * mag, so the scale is mag exactly and x / mag = (17 + 2j) / 16 * 2^e is a midpoint
// between two E4M3 values); normal(0, mag).
std::vector<double> test_rows(std::size_t rows, std::size_t H, std::uint64_t seed) {
  epx::ref::rng g(seed);
  std::vector<double> x(rows * H);
  const std::size_t blocks = H / 128;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t b = 0; b < blocks; ++b) {
      double* d = x.data() + r * H + b * 128;
      const double mag = std::ldexp(1.0, static_cast<int>((r * 7 + b * 3) % 17) - 10);
      const std::size_t kind = (r * blocks + b) % 7;
      for (std::size_t h = 0; h < 128; ++h) {
        const int j = static_cast<int>(h % 8), e = static_cast<int>((h / 8) % 10) - 7;
        switch (kind) {
          case 0: d[h] = 0.0; break;
          case 1: d[h] = h == 77 ? -mag : 0.0; break;
          case 2: d[h] = mag * std::ldexp(g.uniform(-1, 1), -static_cast<int>(h % 20)); break;
          case 3: d[h] = h == 0 ? 448.0 * mag : (h % 3 ? 1 : -1) * mag * std::ldexp(17.0 + 2 * j, e - 4); break;
          default: d[h] = mag * g.normal(); break;
        }
      }
    }
  return x;
}

// The float32 model of the quantisation, written from the contract: the bits epx must give.
template <class T>
void model_quantise(const std::vector<T>& x, std::size_t rows, std::size_t H, std::vector<std::uint8_t>& q,
                    std::vector<float>& scale) {
  q.assign(rows * H, 0);
  scale.assign(rows * H / 128, 0.0f);
  for (std::size_t i = 0; i < rows * H / 128; ++i) {
    if constexpr (std::is_same_v<T, double>) {
      // Double rows: amax and the quotient in double, the scale amax / 448 rounded to float,
      // each quotient rounded to E4M3 from its double value (not through float).
      double amax = 0.0;
      for (std::size_t h = 0; h < 128; ++h) amax = std::max(amax, std::fabs(x[i * 128 + h]));
      float s = static_cast<float>(amax / 448.0);
      if (s == 0.0f) s = 1.0f;
      scale[i] = s;
      for (std::size_t h = 0; h < 128; ++h) q[i * 128 + h] = model::encode(x[i * 128 + h] / static_cast<double>(s), true);
      continue;
    }
    float amax = 0.0f;
    for (std::size_t h = 0; h < 128; ++h) amax = std::max(amax, std::fabs(epx::convert<float>(x[i * 128 + h])));
    float s = amax / 448.0f;
    if (s == 0.0f) s = 1.0f;
    scale[i] = s;
    for (std::size_t h = 0; h < 128; ++h) {
      const float y = epx::convert<float>(x[i * 128 + h]) / s;
      q[i * 128 + h] = model::encode(static_cast<double>(y));
    }
  }
}

// Half the spacing of T's significand (0 for float and double: the bound of the float
// operations covers them).
template <class T>
double output_rounding() {
  if constexpr (std::is_same_v<T, epx::bf16>) return 0x1p-8;
  if constexpr (std::is_same_v<T, epx::fp16>) return 0x1p-11;
  return 0.0;
}

template <class T>
std::vector<T> from_double(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = epx::convert<T>(v[i]);
  return out;
}

template <class T>
void check_quantisation(std::size_t rows, std::size_t H) {
  CAPTURE(rows);
  CAPTURE(H);
  const std::vector<T> x = from_double<T>(test_rows(rows, H, 11 + rows + H));
  const std::size_t S = rows * H / 128;
  std::vector<fp8_e4m3> q(rows * H);
  std::vector<float> scale(S);
  epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), scale.data());

  // Bits: the float32 model.
  std::vector<std::uint8_t> mq;
  std::vector<float> ms;
  model_quantise(x, rows, H, mq, ms);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < rows * H; ++i) bad += q[i].bits != mq[i];
  CHECK(bad == 0);
  CHECK(std::memcmp(scale.data(), ms.data(), S * sizeof(float)) == 0);

  std::vector<T> out(rows * H);
  epx::kernels::dequantise_e4m3(epx::exec::serial{}, rows, H, q.data(), scale.data(), out.data());
  using A = epx::accum_t<T>;
  for (std::size_t i = 0; i < rows * H; ++i) {
    const T want = epx::convert<T>(static_cast<A>(model::decode(mq[i])) * static_cast<A>(ms[i / 128]));
    bad += std::memcmp(&out[i], &want, sizeof(T)) != 0;
  }
  CHECK(bad == 0);

  // Error: the float64 reference (amax, scale and quotient in float64, the nearest E4M3
  // value, the product in float64) and the input itself. E4M3 keeps 3 mantissa bits: for
  // |y| = |x| / scale >= 2^-6 the rounding error is at most |y| * 2^-4, below 2^-6 at most
  // 2^-10 (half the subnormal spacing); times the scale (amax / 448). The float32
  // operations (scale, quotient, product) add a few 2^-24 relative; a 16-bit output type
  // its own rounding.
  double worst_ratio = 0.0;
  std::size_t zero_blocks = 0;
  for (std::size_t i = 0; i < S; ++i) {
    double amax = 0.0;
    for (std::size_t h = 0; h < 128; ++h) amax = std::max(amax, std::fabs(epx::convert<double>(x[i * 128 + h])));
    if (amax == 0.0) {
      ++zero_blocks;
      CHECK(scale[i] == 1.0f);
    } else {
      CHECK(std::fabs(static_cast<double>(scale[i]) - amax / 448) <= amax / 448 * 0x1p-23);
    }
    const double s = amax > 0 ? amax / 448 : 1.0;
    for (std::size_t h = 0; h < 128; ++h) {
      const std::size_t e = i * 128 + h;
      const double xv = epx::convert<double>(x[e]);
      const double ref = model::decode(model::encode(xv / s)) * s;
      const double got = epx::convert<double>(out[e]);
      const double quant = std::max(std::fabs(xv) * 0x1p-4, s * 0x1p-10);
      const double bound = quant + (std::fabs(xv) + amax) * 0x1p-20 + std::fabs(xv) * (17.0 / 16) * output_rounding<T>() +
                           (std::is_same_v<T, epx::fp16> ? 0x1p-24 : 0.0);
      if (std::fabs(got - xv) > bound && ++bad <= 10)
        FAIL_CHECK("element " << e << ": x " << xv << " came back as " << got << ", bound " << bound);
      if (std::fabs(ref - xv) > quant * (1 + 1e-12) && ++bad <= 10)
        FAIL_CHECK("element " << e << ": the float64 reference " << ref << " is off " << xv);
      // epx and the reference differ by at most one E4M3 step (a quotient near a tie can
      // round either way after the float32 scale)
      if (std::fabs(got - ref) > 2 * quant + (std::fabs(xv) + amax) * 0x1p-20 + std::fabs(xv) * 2 * output_rounding<T>() +
                                     0x1p-24 &&
          ++bad <= 10)
        FAIL_CHECK("element " << e << ": " << got << " and the float64 reference " << ref << " differ");
      if (quant > 0) worst_ratio = std::max(worst_ratio, std::fabs(got - xv) / quant);
      if (std::fabs(xv) == amax && amax > 0) CHECK((q[e].bits & 0x7f) == 0x7e);  // the largest is +-448
    }
  }
  CHECK(bad == 0);
  if (S >= 7) {  // every kind of block is there
    CHECK(zero_blocks > 0);
    CHECK(worst_ratio > 0.5);  // the bound is not loose by more than 2x
  }
}

TEST_CASE_TEMPLATE("quantise_e4m3: bits of the float32 model, error of E4M3 against float64", T, float, double, epx::bf16,
                   epx::fp16) {
  for_each_host_isa([] {
    check_quantisation<T>(1, 128);
    check_quantisation<T>(5, 256);
    check_quantisation<T>(33, 7 * 128);
  });
}

// The vectorised block loop (every host version) over every float class: each block holds
// 448 first, so its scale is 1 and its bytes are the E4M3 codes of the elements themselves;
// the other 127 are float cases of magnitude at most 448, or NaN (which does not count
// towards the scale).
TEST_CASE("quantise_e4m3: the block loop encodes every float class as the model does") {
  std::vector<float> x;
  for (std::uint32_t u : model::float_cases(3, std::size_t{1} << 20)) {
    const float f = float_of(u);
    if (!(std::fabs(f) <= 448.0f) && !std::isnan(f)) continue;
    if (x.size() % 128 == 0) x.push_back(448.0f);
    x.push_back(f);
  }
  while (x.size() % 128) x.push_back(-0.0f);
  const std::size_t H = 128, rows = x.size() / H;
  for_each_host_isa([&] {
    std::vector<fp8_e4m3> q(x.size());
    std::vector<float> s(rows);
    epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), s.data());
    std::size_t bad = 0;
    for (std::size_t r = 0; r < rows; ++r) CHECK(s[r] == 1.0f);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::uint8_t want = model::encode(static_cast<double>(x[i]));
      if (q[i].bits != want && ++bad <= 10)
        FAIL_CHECK("float " << hex(bits_of(x[i])) << " (" << x[i] << "): " << hex(q[i].bits) << " != " << hex(want));
    }
    CHECK(bad == 0);
  });
  MESSAGE(x.size() << " elements");
}

TEST_CASE("quantise_e4m3: NaN, infinity, underflowing scales and rows that are not there") {
  for_each_host_isa([] {
    const std::size_t H = 256;
    std::vector<float> x(2 * H, 0.25f);
    x[3] = std::numeric_limits<float>::quiet_NaN();
    x[128 + 5] = std::numeric_limits<float>::infinity();
    // row 1: block 0 is tiny (amax / 448 underflows to 0), block 1 has float-subnormal scale
    for (std::size_t h = 0; h < 128; ++h) x[H + h] = h == 9 ? 0x1p-149f : 0.0f;
    for (std::size_t h = 128; h < 256; ++h) x[H + h] = (h % 2 ? -1.0f : 1.0f) * 0x1p-130f;
    std::vector<fp8_e4m3> q(2 * H);
    std::vector<float> s(4);
    epx::kernels::quantise_e4m3(epx::exec::serial{}, 2, H, x.data(), q.data(), s.data());
    // NaN stays NaN, alone in its block
    CHECK(s[0] == 0.25f / 448.0f);
    CHECK(q[3].bits == 0x7f);
    CHECK(q[4].bits == 0x7e);
    // an infinity makes its block's scale infinite, and the block comes back as NaN
    CHECK(std::isinf(s[1]));
    std::vector<float> out(2 * H);
    epx::kernels::dequantise_e4m3(epx::exec::serial{}, 2, H, q.data(), s.data(), out.data());
    CHECK(std::isnan(out[3]));
    CHECK(out[4] == x[4]);
    for (std::size_t h = 128; h < 256; ++h) CHECK(std::isnan(out[h]));
    // amax / 448 == 0: scale 1 (the elements round to zero)
    CHECK(s[2] == 1.0f);
    CHECK(q[H + 9].bits == 0x00);
    CHECK(out[H + 9] == 0.0f);
    // a subnormal scale: the block still comes back within the bound of its amax
    CHECK(s[3] == 0x1p-130f / 448.0f);
    CHECK(s[3] > 0.0f);
    for (std::size_t h = 128; h < 256; ++h) CHECK(std::fabs(out[H + h] - x[H + h]) <= 0x1p-130f * 0x1p-4f);

    // rows that are not there: zero bytes, scale 1
    const std::vector<std::int64_t> index{1, -1, 0};
    std::vector<fp8_e4m3> g(3 * H, fp8_e4m3::from_bits(0x55));
    std::vector<float> gs(6, -1.0f);
    epx::kernels::quantise_e4m3(epx::exec::serial{}, 3, H, x.data(), index.data(), g.data(), gs.data());
    for (std::size_t h = 0; h < H; ++h) {
      CHECK(g[h].bits == q[H + h].bits);
      CHECK(g[H + h].bits == 0);
      CHECK(g[2 * H + h].bits == q[h].bits);
    }
    CHECK(gs[2] == 1.0f);
    CHECK(gs[3] == 1.0f);
    CHECK(gs[0] == s[2]);
    CHECK(std::isinf(gs[5]));
  });
}

TEST_CASE("fp8_e4m3: the in-range float encoding equals the full one up to 464") {
  const auto cases = model::float_cases(4, std::size_t{1} << 21);
  std::size_t bad = 0, checked = 0;
  for (std::uint32_t u : cases) {
    const float f = float_of(u);
    if (!(std::fabs(f) <= 464.0f)) continue;  // NaN, beyond 464
    ++checked;
    const std::uint8_t got = epx::detail::float_to_fp8_e4m3_bits_in_range(f);
    const std::uint8_t want = epx::detail::float_to_fp8_e4m3_bits(f);
    if (got != want && ++bad <= 10) FAIL_CHECK("float " << hex(u) << " (" << f << "): " << hex(got) << " != " << hex(want));
  }
  CHECK(bad == 0);
  CHECK(checked > cases.size() / 4);
}

// fp8_e4m3_magnitude_code (no branches: each of its two roundings sees the magnitude
// clamped to its range) against fp8_e4m3_round (branches: exponent, shift, remainder) over
// every magnitude from just below 2^-10 (the first subnormal tie) to just above 2^-6, and
// above that every magnitude within 64 of a binade's start, of a tie of E4M3 and of the
// next binade, up to 464 (the largest the callers pass); below 2^-11 (code 0) a sweep.
TEST_CASE("fp8_e4m3: the branch-free magnitude rounding equals the branching one up to 464") {
  std::size_t bad = 0, checked = 0;
  const auto check = [&](std::uint32_t a) {
    ++checked;
    const std::uint32_t got = epx::detail::fp8_e4m3_magnitude_code(a);
    const std::uint32_t want = epx::detail::fp8_e4m3_round<std::uint32_t, 23, 127>(a);
    if (got != want && ++bad <= 10) FAIL_CHECK("magnitude " << hex(a) << ": " << hex(got) << " != " << hex(want));
  };
  for (std::uint32_t a = 0; a < 0x3a000000u; a += 4099) check(a);
  for (std::uint32_t a = 0x3a000000u; a < 0x3c900000u; ++a) check(a);
  for (std::uint32_t p = 0x3c900000u; p < 0x43e80000u; p += 0x100000u)
    for (std::uint32_t low : {0x0u, 0x7ffc0u, 0xfffc0u})
      for (std::uint32_t j = 0; j < 64; ++j) check(p + low + j);
  check(0x43e80000u);  // 464: the tie above 448 goes to 448
  CHECK(bad == 0);
  CHECK(checked > 40000000u);
}

// quantise_e4m3 of rows x [., H] on every host version against the model's bytes mq and
// scales ms, bit for bit; where(i) names element i's block in a failure.
template <class T, class Where>
void check_blocks_against_model(const std::vector<T>& x, std::size_t H, const std::vector<std::uint8_t>& mq,
                                const std::vector<float>& ms, Where where) {
  const std::size_t rows = x.size() / H;
  for_each_host_isa([&] {
    std::vector<fp8_e4m3> q(x.size());
    std::vector<float> s(rows);
    epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), s.data());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (q[i].bits != mq[i] && ++bad <= 10)
        FAIL_CHECK("element " << i << " (" << where(i) << "): " << hex(q[i].bits) << " != " << hex(mq[i]));
    CHECK(bad == 0);
    CHECK(std::memcmp(s.data(), ms.data(), rows * sizeof(float)) == 0);
  });
}

// The block loop takes a shorter conversion where every element is finite and the scale is
// a normal float (no quotient saturates or is NaN there), the full one elsewhere: blocks
// whose largest magnitude sweeps across the smallest normal scale (448 * 2^-126), up to
// the largest float, down to float subnormals, with an infinity or a NaN, against the model.
template <class T>
void check_block_paths() {
  std::vector<float> amaxes;
  const float edge = 448.0f * 0x1p-126f;  // amax / 448 is the smallest normal float
  for (int k = -40; k <= 40; ++k) {
    amaxes.push_back(float_of(static_cast<std::uint32_t>(static_cast<std::int64_t>(bits_of(edge)) + k)));
    amaxes.push_back(float_of(static_cast<std::uint32_t>(static_cast<std::int64_t>(bits_of(edge)) + k * 4099)));
  }
  for (float a : {0x1p-149f, 0x1p-140f, 0x1p-127f, 0x1p-120f, 0x1p-118f, 0x1p-117f, 1.0f, 448.0f, 0x1p100f, 0x1p127f,
                  std::numeric_limits<float>::max()})
    amaxes.push_back(a);
  const std::size_t H = 128;
  epx::ref::rng g(17);
  std::vector<T> x;
  for (std::size_t i = 0; i < amaxes.size() * 4; ++i) {
    const float amax = amaxes[i / 4];
    const std::size_t variant = i % 4, at = (i * 37) % H;
    for (std::size_t h = 0; h < H; ++h) {
      float v = h == at ? (i % 8 < 4 ? amax : -amax) : static_cast<float>(amax * std::ldexp(g.uniform(-1, 1), -static_cast<int>(h % 24)));
      if (variant == 1 && h == (at + 5) % H) v = std::numeric_limits<float>::quiet_NaN();
      if (variant == 2 && h == (at + 9) % H) v = -std::numeric_limits<float>::infinity();
      if (variant == 3 && h % 2) v = 0.0f;
      x.push_back(epx::convert<T>(v));
    }
  }
  const std::size_t rows = x.size() / H;
  std::vector<std::uint8_t> mq;
  std::vector<float> ms;
  model_quantise(x, rows, H, mq, ms);
  std::size_t fast = 0;
  for (std::size_t r = 0; r < rows; ++r) fast += ms[r] >= 0x1p-126f && std::isfinite(ms[r]) && r % 4 != 1 && r % 4 != 2;
  CHECK(fast > 0);
  CHECK(fast < rows / 2);
  check_blocks_against_model(x, H, mq, ms, [&](std::size_t i) { return "block amax " + std::to_string(amaxes[i / H / 4]); });
}

TEST_CASE_TEMPLATE("quantise_e4m3: blocks on either side of the finite, normal-scale conversion", T, float, epx::bf16) {
  check_block_paths<T>();
}

// The rounding of E4M3's normals alone (the block loop's conversion where no quotient is
// below 2^-6) against the full float conversion, over every float magnitude from 2^-6 to
// 464 with either sign.
TEST_CASE("fp8_e4m3: the normal-range float encoding equals the full one from 2^-6 to 464") {
  std::size_t bad = 0, checked = 0;
  for (std::uint32_t a = 0x3c800000u; a <= 0x43e80000u; ++a) {
    const std::uint32_t u = a | ((a & 1u) << 31);  // every other magnitude negative
    const float f = float_of(u);
    ++checked;
    const std::uint8_t got = epx::detail::float_to_fp8_e4m3_bits_normal(f);
    const std::uint8_t want = epx::detail::float_to_fp8_e4m3_bits(f);
    if (got != want && ++bad <= 10) FAIL_CHECK("float " << hex(u) << " (" << f << "): " << hex(got) << " != " << hex(want));
  }
  CHECK(bad == 0);
  CHECK(checked == 0x43e80000u - 0x3c800000u + 1);
}

// The block loop rounds a finite block with a normal scale by the normals' rounding alone
// when its smallest magnitude's quotient is at least 2^-6: blocks whose smallest element's
// quotient lies a few steps of T on either side of 2^-6, or further inside either range
// (0.26 to 1.5 times it; the others between 2^-5 and 448),
// for scales from the smallest normal float up, against the model on every host version;
// both conversions are taken.
template <class T>
void check_normal_blocks() {
  const std::size_t H = 128;
  epx::ref::rng g(29);
  std::vector<T> x;
  std::vector<bool> normal_only;  // per block, from the model's quotients
  for (float amax : {1.0f, 448.0f, 3.14159f, 1e-3f, 1e20f, 448.0f * 0x1p-120f, 0.75f}) {
    const float a = epx::convert<float>(epx::convert<T>(amax));  // representable in T
    const float sc = a / 448.0f;
    const T edge = epx::convert<T>(0x1p-6f * sc);  // near the smallest quotient of 2^-6
    std::vector<float> leasts;
    const std::uint32_t mag = epx::test::bits_of(epx::convert<float>(edge)) & 0x7fffffffu;
    const std::uint32_t step = std::is_same_v<T, float> ? 1u : 0x10000u;  // one step of T
    for (int d = -3; d <= 3; ++d) leasts.push_back(float_of(mag + static_cast<std::uint32_t>(d) * step));
    for (float f : {0.26f, 0.5f, 0.74f, 0.9f, 1.1f, 1.5f})  // further inside either range
      leasts.push_back(epx::convert<float>(epx::convert<T>(f * epx::convert<float>(edge))));
    for (float least : leasts) {
      for (int sign = 0; sign < 2; ++sign) {
        const std::size_t at = 1 + static_cast<std::size_t>(g.below(static_cast<int>(H) - 1));
        for (std::size_t h = 0; h < H; ++h) {
          float v = h == 0 ? a : h == at ? least : static_cast<float>(g.uniform(2 * 0x1p-6 * sc, a));
          if (g.uniform(0, 1) < 0.5) v = -v;
          if (h == at && sign) v = -least;
          x.push_back(epx::convert<T>(v));
        }
        normal_only.push_back(epx::test::bits_of(epx::convert<float>(epx::convert<T>(least)) / sc) >= 0x3c800000u);
      }
    }
  }
  const std::size_t rows = x.size() / H;
  CHECK(std::count(normal_only.begin(), normal_only.end(), true) > 0);
  CHECK(std::count(normal_only.begin(), normal_only.end(), false) > 0);
  std::vector<std::uint8_t> mq;
  std::vector<float> ms;
  model_quantise(x, rows, H, mq, ms);
  check_blocks_against_model(x, H, mq, ms, [&](std::size_t i) { return "block " + std::to_string(i / H); });
}

TEST_CASE_TEMPLATE("quantise_e4m3: blocks on either side of the normals-only conversion", T, float, epx::bf16) {
  check_normal_blocks<T>();
}

TEST_CASE("quantise_e4m3: double rows are scaled in double, each quotient rounded to E4M3 once") {
  for_each_host_isa([] {
    const std::size_t H = 384;
    const double above_tie = 1.0625 + 0x1p-40;  // just above the tie between 1 and 1.125
    std::vector<double> x(H, 0.0);
    x[0] = 448.0;  // scale 1
    x[1] = above_tie;
    x[2] = -above_tie;
    x[3] = 1.0625;  // the tie itself: to the even 1
    x[4] = -std::numeric_limits<double>::quiet_NaN();
    x[128] = 1e39;  // beyond float's range: a finite scale
    x[129] = -0.5e39;
    x[256] = 5.0;  // a NaN after the largest magnitude leaves it the block's amax
    x[257] = std::numeric_limits<double>::quiet_NaN();
    x[258] = 1.0;
    std::vector<fp8_e4m3> q(H);
    std::vector<float> s(3);
    epx::kernels::quantise_e4m3(epx::exec::serial{}, 1, H, x.data(), q.data(), s.data());
    CHECK(s[0] == 1.0f);
    CHECK(q[0].bits == 0x7e);
    CHECK(q[1].bits == 0x39);  // 1.125 (through float: the tie 1.0625, which goes to 1)
    CHECK(q[2].bits == 0xb9);
    CHECK(q[3].bits == 0x38);
    CHECK(q[4].bits == 0xff);  // a double NaN keeps its sign
    CHECK(s[1] == static_cast<float>(1e39 / 448.0));
    CHECK(q[128].bits == 0x7e);
    CHECK(q[129].bits == model::encode(-0.5e39 / static_cast<double>(s[1])));
    CHECK(s[2] == static_cast<float>(5.0 / 448.0));
    CHECK(q[256].bits == 0x7e);
    CHECK(q[257].bits == 0x7f);
    CHECK(q[258].bits == model::encode(1.0 / static_cast<double>(s[2])));
    std::vector<double> out(H);
    epx::kernels::dequantise_e4m3(epx::exec::serial{}, 1, H, q.data(), s.data(), out.data());
    CHECK(out[1] == 1.125);
    CHECK(std::isnan(out[4]));
    CHECK(std::fabs(out[128] - 1e39) <= 1e39 * 0x1p-20);
    CHECK(std::fabs(out[129] + 0.5e39) <= 0.5e39 * 0x1p-4);
    CHECK(std::fabs(out[256] - 5.0) <= 5.0 * 0x1p-20);
    CHECK(std::fabs(out[258] - 1.0) <= 0x1p-4);
  });
}

// The same bytes from every policy, for every source of rows.
template <class T, class Exec>
void run_all(const Exec& ex, std::size_t rows, std::size_t H, const std::vector<T>& x,
             const std::vector<std::int64_t>& index, std::vector<std::uint8_t>& bytes) {
  const std::size_t S = rows * H / 128;
  std::vector<fp8_e4m3> q(3 * rows * H);
  std::vector<float> s(3 * S);
  std::vector<const T*> table(rows);
  for (std::size_t r = 0; r < rows; ++r) table[r] = r % 4 == 3 ? nullptr : x.data() + ((r * 5) % rows) * H;
  epx::kernels::quantise_e4m3(ex, rows, H, x.data(), q.data(), s.data());
  epx::kernels::quantise_e4m3(ex, rows, H, x.data(), index.data(), q.data() + rows * H, s.data() + S);
  epx::kernels::quantise_e4m3(ex, rows, H, table.data(), q.data() + 2 * rows * H, s.data() + 2 * S);
  std::vector<T> out(3 * rows * H);
  epx::kernels::dequantise_e4m3(ex, 3 * rows, H, q.data(), s.data(), out.data());
  // Gathering the quantised rows by index gives the bytes of quantising the indexed rows.
  std::vector<fp8_e4m3> g(rows * H, fp8_e4m3::from_bits(0x55));
  std::vector<float> gs(S, -1.0f);
  epx::kernels::gather_e4m3(ex, rows, H, q.data(), s.data(), index.data(), g.data(), gs.data());
  CHECK(std::memcmp(g.data(), q.data() + rows * H, rows * H) == 0);
  CHECK(std::memcmp(gs.data(), s.data() + S, S * sizeof(float)) == 0);
  const auto* qb = reinterpret_cast<const std::uint8_t*>(q.data());
  const auto* sb = reinterpret_cast<const std::uint8_t*>(s.data());
  const auto* ob = reinterpret_cast<const std::uint8_t*>(out.data());
  bytes.assign(qb, qb + q.size());
  bytes.insert(bytes.end(), sb, sb + s.size() * sizeof(float));
  bytes.insert(bytes.end(), ob, ob + out.size() * sizeof(T));
}

TEST_CASE_TEMPLATE("quantise_e4m3 and dequantise_e4m3: the same bits on serial, openmp and the emulated device", T,
                   float, double, epx::bf16, epx::fp16) {
  const std::size_t rows = 37, H = 3 * 128;
  const std::vector<T> x = from_double<T>(test_rows(rows, H, 5));
  std::vector<std::int64_t> index(rows);
  for (std::size_t r = 0; r < rows; ++r) index[r] = r % 5 == 2 ? -1 : static_cast<std::int64_t>((r * 11) % rows);
  std::vector<std::uint8_t> a, b, c, d;
  for_each_host_isa([&] {  // every version of the host loops, the same bytes
    run_all(epx::exec::serial{}, rows, H, x, index, d);
    if (!a.empty()) CHECK(d == a);
    a = d;
  });
  run_all(epx::exec::openmp{}, rows, H, x, index, b);
  epx::exec::emulated_device dev;
  run_all(dev, rows, H, x, index, c);
  CHECK(a == b);
  CHECK(a == c);
  CHECK(dev.counters->launches.load() == 5);  // three quantisations, one gather and one dequantisation
  // the serial results are those of the model
  std::vector<std::uint8_t> mq;
  std::vector<float> ms;
  model_quantise(x, rows, H, mq, ms);
  CHECK(std::memcmp(a.data(), mq.data(), mq.size()) == 0);
}

TEST_CASE("quantise_e4m3: no rows, no launch") {
  epx::exec::emulated_device dev;
  epx::kernels::quantise_e4m3(dev, 0, 256, static_cast<const float*>(nullptr), nullptr, nullptr);
  epx::kernels::dequantise_e4m3(dev, 0, 256, nullptr, nullptr, static_cast<float*>(nullptr));
  CHECK(dev.counters->launches.load() == 0);
}

}  // namespace

}  // namespace test_fp8_cpp
