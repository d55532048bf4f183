// epx/layout/slicing.hpp: the rows a TP rank dispatches (spec section 3).
//
// Every rank of a TP group holds the same N rows; TP rank t takes
// [floor(N*t/tp), floor(N*(t+1)/tp)). Slices may be uneven or empty (a one-token decode
// step on tp=2 gives rank 0 nothing); an empty slice still joins every collective.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"

namespace epx {

struct row_slice {
  std::size_t begin = 0;
  std::size_t end = 0;
  EPX_HOST_DEVICE constexpr std::size_t size() const noexcept { return end - begin; }
  EPX_HOST_DEVICE constexpr bool empty() const noexcept { return end == begin; }
};

// Rows of TP rank t out of tp, computed in 64-bit (N*t does not overflow for N < 2^63/tp).
inline row_slice slice_bounds(std::size_t N, int tp, int t) {
  EPX_REQUIRE(tp >= 1 && t >= 0 && t < tp, errc::input, "slice_bounds: tp rank (", t, ") out of range [0, ",
              tp, ")");
  const auto n = static_cast<std::uint64_t>(N);
  const auto b = n * static_cast<std::uint64_t>(t) / static_cast<std::uint64_t>(tp);
  const auto e = n * static_cast<std::uint64_t>(t + 1) / static_cast<std::uint64_t>(tp);
  return row_slice{static_cast<std::size_t>(b), static_cast<std::size_t>(e)};
}

// The same slices in host and device code: the first row of slice t, and the slice that
// holds row r (the largest t with floor(N*t/tp) <= r; r < N).
EPX_HOST_DEVICE constexpr std::size_t slice_begin(std::size_t N, int tp, int t) noexcept {
  return static_cast<std::size_t>(static_cast<std::uint64_t>(N) * static_cast<std::uint64_t>(t) /
                                  static_cast<std::uint64_t>(tp));
}
EPX_HOST_DEVICE constexpr int slice_of_row(std::size_t r, std::size_t N, int tp) noexcept {
  return static_cast<int>(((static_cast<std::uint64_t>(r) + 1) * static_cast<std::uint64_t>(tp) - 1) /
                          static_cast<std::uint64_t>(N));
}

}  // namespace epx
