// epx/comm/detail/reduce.hpp: elementwise sums of several buffers, shared by host backends.
//
// The summation rule of every communicator (see epx/comm/communicator.hpp):
//   dst[i] = round(scale * (src[0][i] + src[1][i] + ... + src[n-1][i]))
// summed left to right (rank order) in the accumulation type: float for float, bf16 and
// fp16, double for double. `scale` multiplies the sum before the one final rounding.
// Integers sum exactly (two's complement wrap-around); with scale != 1 the scaled sum is
// computed in double and rounded to the nearest integer.
//
// reduce_sum applies the rule to n separate buffers on the host, a block at a time;
// rank_order_sum applies it to one element of P stacked blocks, for a backend that sums
// on a device policy (one call per element, launched by any policy). Both give the same
// bits (tests/comm/test_reduce.cpp).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epx/comm/datatype.hpp"
#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"

namespace epx::detail {

// Elements summed per pass: the accumulator block lives on the stack and stays in L1.
inline constexpr std::size_t reduce_block_elems = 1024;

template <class T>
void reduce_sum_typed(const void* const* srcs, int nsrcs, void* dst, std::size_t count, double scale) noexcept {
  T* out = static_cast<T*>(dst);
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // wrap-around instead of signed overflow
    for (std::size_t i = 0; i < count; ++i) {
      U acc = 0;
      for (int k = 0; k < nsrcs; ++k) acc = static_cast<U>(acc + static_cast<U>(static_cast<const T*>(srcs[k])[i]));
      if (scale == 1.0) {
        out[i] = static_cast<T>(acc);
      } else {
        out[i] = static_cast<T>(std::llround(static_cast<double>(static_cast<T>(acc)) * scale));
      }
    }
  } else {
    using A = accum_t<T>;
    const A s = static_cast<A>(scale);
    A acc[reduce_block_elems];
    for (std::size_t base = 0; base < count; base += reduce_block_elems) {
      const std::size_t m = count - base < reduce_block_elems ? count - base : reduce_block_elems;
      // Every source block is read before dst is written, so dst may alias a source.
      const T* s0 = static_cast<const T*>(srcs[0]) + base;
      for (std::size_t i = 0; i < m; ++i) acc[i] = convert<A>(s0[i]);
      for (int k = 1; k < nsrcs; ++k) {
        const T* sk = static_cast<const T*>(srcs[k]) + base;
        for (std::size_t i = 0; i < m; ++i) acc[i] += convert<A>(sk[i]);
      }
      if (scale != 1.0)
        for (std::size_t i = 0; i < m; ++i) acc[i] *= s;
      for (std::size_t i = 0; i < m; ++i) out[base + i] = convert<T>(acc[i]);
    }
  }
}

// The rule for one element i of P blocks of `count` elements stored one after the other
// (`all` is [P][count], rank order): dst[i] = round(scale * (all[0][i] + ... + all[P-1][i])).
// dst may alias the first block (each element is read before it is written). P >= 1.
template <class T>
struct rank_order_sum {
  const T* all;
  std::size_t count;
  int P;
  double scale;
  T* dst;
  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;  // wrap-around instead of signed overflow
      U acc = 0;
      for (int r = 0; r < P; ++r) acc = static_cast<U>(acc + static_cast<U>(all[static_cast<std::size_t>(r) * count + i]));
      dst[i] = scale == 1.0 ? static_cast<T>(acc) : static_cast<T>(llround(static_cast<double>(static_cast<T>(acc)) * scale));
    } else {
      using A = accum_t<T>;
      A acc = convert<A>(all[i]);
      for (int r = 1; r < P; ++r) acc += convert<A>(all[static_cast<std::size_t>(r) * count + i]);
      if (scale != 1.0) acc *= static_cast<A>(scale);
      dst[i] = convert<T>(acc);
    }
  }
};

// dst[i] = round(scale * sum over k of srcs[k][i]) for i in [0, count), in the order
// k = 0..nsrcs-1. dst may be one of the sources (element-wise in place). nsrcs >= 1.
// Throws epx::error(errc::input) for datatype::byte, which has no sum.
inline void reduce_sum(datatype t, const void* const* srcs, int nsrcs, void* dst, std::size_t count,
                       double scale) {
  EPX_REQUIRE(is_reducible(t), errc::input, "reduce_sum: datatype ", to_string(t), " cannot be summed");
  EPX_REQUIRE(nsrcs >= 1, errc::internal, "reduce_sum: needs at least one source (got ", nsrcs, ")");
  if (count == 0) return;
  switch (t) {
    case datatype::int32: reduce_sum_typed<std::int32_t>(srcs, nsrcs, dst, count, scale); break;
    case datatype::int64: reduce_sum_typed<std::int64_t>(srcs, nsrcs, dst, count, scale); break;
    case datatype::float32: reduce_sum_typed<float>(srcs, nsrcs, dst, count, scale); break;
    case datatype::float64: reduce_sum_typed<double>(srcs, nsrcs, dst, count, scale); break;
    case datatype::bfloat16: reduce_sum_typed<bf16>(srcs, nsrcs, dst, count, scale); break;
    case datatype::float16: reduce_sum_typed<fp16>(srcs, nsrcs, dst, count, scale); break;
    case datatype::byte: break;
  }
}

// data[i] = round(scale * data[i]): the single-source case, e.g. a backend whose native
// sum has no pre-multiplication. No-op for scale == 1.
inline void scale_in_place(datatype t, void* data, std::size_t count, double scale) {
  if (scale == 1.0) return;
  const void* src[1] = {data};
  reduce_sum(t, src, 1, data, count, scale);
}

}  // namespace epx::detail
