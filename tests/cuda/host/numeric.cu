// epx's fp16 and bf16 conversions (epx/core/numeric.hpp) against CUDA's __float2half and
// __half2float (cuda_fp16.h) and __float2bfloat16 and __bfloat162float (cuda_bf16.h), bit
// for bit. Compiled by nvcc, run on the host: cuda_fp16.h's
// conversions are __host__ __device__, so this needs no GPU (label cuda-host). Decoding: all
// 2^16 patterns. Encoding: every float NaN and infinity pattern, the floats of every fp16
// value and midpoint and their neighbours, and a stride over all 2^32 float patterns.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "epx/core/numeric.hpp"
#include "support/bits.hpp"

namespace {

using epx::test::bits_of;
using epx::test::float_of;

std::uint16_t cuda_encode(float f) {
  const __half_raw r = __float2half(f);
  return r.x;
}
float cuda_decode(std::uint16_t b) {
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}

std::uint64_t encode_mismatches(std::uint32_t u, std::uint64_t& shown) {
  const float f = float_of(u);
  const std::uint16_t got = epx::detail::float_to_fp16_bits(f), want = cuda_encode(f);
  if (got == want) return 0;
  if (shown++ < 10) FAIL_CHECK("float bits " << u << ": epx " << got << ", CUDA " << want);
  return 1;
}

std::uint16_t cuda_bf16_encode(float f) {
  const __nv_bfloat16_raw r = __float2bfloat16(f);
  return r.x;
}
float cuda_bf16_decode(std::uint16_t b) {
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

}  // namespace

TEST_CASE("fp16 decoding: all 2^16 patterns, signalling NaNs included, the bits of __half2float") {
  std::uint64_t bad = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float got = epx::detail::fp16_bits_to_float(static_cast<std::uint16_t>(b));
    const float want = cuda_decode(static_cast<std::uint16_t>(b));
    if (bits_of(got) != bits_of(want) && bad++ < 10)
      FAIL_CHECK("fp16 " << b << ": epx " << bits_of(got) << ", CUDA " << bits_of(want));
  }
  CHECK(bad == 0);
  CHECK(bits_of(epx::detail::fp16_bits_to_float(0x7c01u)) == 0x7fffffffu);  // a signalling NaN comes out quiet
}

TEST_CASE("fp16 encoding: NaNs of every payload, infinities, every value and midpoint, a stride over all floats") {
  std::uint64_t bad = 0, shown = 0;
  for (std::uint32_t m = 0; m < (1u << 23); ++m) {  // infinities, quiet and signalling NaNs, both signs
    bad += encode_mismatches(0x7f800000u | m, shown);
    bad += encode_mismatches(0xff800000u | m, shown);
  }
  for (std::uint32_t b = 0; b < 0x7c00u; ++b) {  // every finite fp16 value and the floats around it
    const std::uint32_t u = bits_of(cuda_decode(static_cast<std::uint16_t>(b)));
    for (std::uint32_t w : {u, u + 1, u - 1, u + 0x1000u, u + 0xfffu, u + 0x1001u})
      for (std::uint32_t sign : {0u, 0x80000000u}) bad += encode_mismatches((w & 0x7fffffffu) | sign, shown);
  }
  for (std::uint64_t w = 0; w < (1ull << 32); w += 101) bad += encode_mismatches(static_cast<std::uint32_t>(w), shown);
  CHECK(bad == 0);
}

TEST_CASE("bf16 decoding and encoding: all 2^16 patterns, every float NaN, a stride over all floats") {
  std::uint64_t bad = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float got = epx::detail::bf16_bits_to_float(static_cast<std::uint16_t>(b));
    const float want = cuda_bf16_decode(static_cast<std::uint16_t>(b));
    if (bits_of(got) != bits_of(want) && bad++ < 10)
      FAIL_CHECK("bf16 " << b << ": epx " << bits_of(got) << ", CUDA " << bits_of(want));
  }
  std::uint64_t shown = 0;
  const auto encode = [&](std::uint32_t u) {
    const float f = float_of(u);
    const std::uint16_t got = epx::detail::float_to_bf16_bits(f), want = cuda_bf16_encode(f);
    if (got != want && shown++ < 10) FAIL_CHECK("float bits " << u << ": epx " << got << ", CUDA " << want);
    bad += got != want ? 1 : 0;
  };
  for (std::uint32_t m = 0; m < (1u << 23); ++m) {  // infinities, quiet and signalling NaNs, both signs
    encode(0x7f800000u | m);
    encode(0xff800000u | m);
  }
  for (std::uint32_t b = 0; b < 0x7f80u; ++b) {  // every finite bf16 value, its midpoints and neighbours
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    for (std::uint32_t w : {u, u + 1, u - 1, u + 0x8000u, u + 0x7fffu, u + 0x8001u})
      for (std::uint32_t sign : {0u, 0x80000000u}) encode((w & 0x7fffffffu) | sign);
  }
  for (std::uint64_t w = 0; w < (1ull << 32); w += 101) encode(static_cast<std::uint32_t>(w));
  CHECK(bad == 0);
  CHECK(epx::detail::float_to_bf16_bits(float_of(0xff800001u)) == 0x7fffu);  // a signalling NaN: the canonical NaN
}
