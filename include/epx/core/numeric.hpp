// epx/core/numeric.hpp: 16-bit floating-point storage types and the accumulation rule.
//
// `epx::bf16` and `epx::fp16` are plain 16-bit storage types, bit-compatible with
// `__nv_bfloat16`/`__half` and with NCCL's ncclBfloat16/ncclFloat16, usable in host and
// device code alike. Conversions round to nearest even. fp16's give the bits of CUDA's
// __float2half and __half2float for every input: a NaN, quiet or signalling, of either
// sign, converts to the canonical NaN (0x7fff as fp16, 0x7fffffff as float). Arithmetic happens in the
// accumulation type: float for the 16-bit types and float, double for double.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "epx/core/config.hpp"

namespace epx {
namespace detail {

EPX_HOST_DEVICE inline std::uint32_t float_bits(float f) noexcept {
#if EPX_IS_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

EPX_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
#if EPX_IS_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Round to nearest even; a NaN of either sign, quiet or signalling, becomes the canonical
// NaN 0x7fff, as CUDA's __float2bfloat16 gives it. The NaN case is selected by a mask,
// not a branch, so that loops of conversions vectorise on the host; the mask comes from a
// signed compare (|u| and the infinity's bits are both below 2^31), which x86's vector
// units have and an unsigned one is emulated with, and the two cases are blended before
// the one shift: 115 instructions for GCC 12's AVX2 loop of w * x instead of 130, 0.8 of
// the time, the same bits for every float.
EPX_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t is_nan =
      0u - static_cast<std::uint32_t>(static_cast<std::int32_t>(u & 0x7fffffffu) > std::int32_t{0x7f800000});
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(((0x7fff0000u & is_nan) | (rounded & ~is_nan)) >> 16);
}

EPX_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

EPX_HOST_DEVICE inline std::uint16_t float_to_fp16_bits(float f) noexcept {
  std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  // A NaN of either sign, quiet or signalling: the canonical NaN 0x7fff (CUDA's __float2half).
  if (x >= 0x7f800000u) return static_cast<std::uint16_t>(x > 0x7f800000u ? 0x7fffu : sign | 0x7c00u);
  if (x >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (x < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (x < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = x >> 23;
    const std::uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t h = ((((x >> 23) - 112u) << 10) | ((x & 0x7fffffu) >> 13));
  const std::uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

EPX_HOST_DEVICE inline float fp16_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  // A NaN of either sign, quiet or signalling: the quiet float NaN 0x7fffffff (CUDA's
  // __half2float; keeping the payload would make a signalling half a signalling float).
  if (e == 31) return bits_float(m ? 0x7fffffffu : sign | 0x7f800000u);
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace detail

namespace detail {
struct bf16_codec {
  EPX_HOST_DEVICE static std::uint16_t encode(float f) noexcept { return float_to_bf16_bits(f); }
  EPX_HOST_DEVICE static float decode(std::uint16_t b) noexcept { return bf16_bits_to_float(b); }
};
struct fp16_codec {
  EPX_HOST_DEVICE static std::uint16_t encode(float f) noexcept { return float_to_fp16_bits(f); }
  EPX_HOST_DEVICE static float decode(std::uint16_t b) noexcept { return fp16_bits_to_float(b); }
};

// A 16-bit float in storage: its bits, converted from and to float by Codec (round to
// nearest even; NaN stays NaN).
template <class Codec>
struct half_storage {
  std::uint16_t bits;
  half_storage() = default;
  EPX_HOST_DEVICE explicit half_storage(float f) noexcept : bits(Codec::encode(f)) {}
  EPX_HOST_DEVICE explicit operator float() const noexcept { return Codec::decode(bits); }
  EPX_HOST_DEVICE static half_storage from_bits(std::uint16_t b) noexcept {
    half_storage v;
    v.bits = b;
    return v;
  }
};
}  // namespace detail

// bfloat16 (8-bit exponent) and IEEE binary16 (5-bit exponent) storage types.
using bf16 = detail::half_storage<detail::bf16_codec>;
using fp16 = detail::half_storage<detail::fp16_codec>;

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);
static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable_v<fp16>);

// Accumulation type of an activation type: double for double, float otherwise.
template <class T>
using accum_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Converts between activation and accumulation types (float, double, bf16, fp16).
template <class To, class From>
EPX_HOST_DEVICE inline To convert(From v) noexcept {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, bf16> || std::is_same_v<From, fp16>) {
    return static_cast<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bf16> || std::is_same_v<To, fp16>) {
    return To(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

namespace detail {
// acc + a * b, rounded after the product and after the sum on every compiler: device
// compilers contract a*b+c into one fused multiply-add by default, host compilers do not
// (for x86-64 without -mfma, or with -ffp-contract=off), and a fused one rounds once. The
// kernels and the routing gradients accumulate through this, so every policy computes the
// same bits.
// On the host: GCC contracts only where the target has FMA instructions (the AVX-512 and
// -march=native builds), and the loops of epx/exec/host_isa.hpp's versions are compiled
// with fp-contract=off (every kernel that accumulates runs in them on the host, in both
// launch shapes; tests/core/test_host_isa.cpp, built for FMA as test_core_test_host_isa_fma);
// Clang contracts within one expression, which the pragma forbids.
template <class A>
EPX_HOST_DEVICE inline A mul_add(A acc, A a, A b) noexcept {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>)
    return __fadd_rn(acc, __fmul_rn(a, b));
  else
    return __dadd_rn(acc, __dmul_rn(a, b));
#else
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  return acc + a * b;
#endif
}
}  // namespace detail

template <class T>
inline constexpr bool is_activation_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16> ||
    std::is_same_v<T, fp16>;

}  // namespace epx
