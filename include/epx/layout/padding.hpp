// epx/layout/padding.hpp: the zero rows appended to every local expert's segment.
#pragma once

#include <cstddef>

#include "epx/core/error.hpp"

namespace epx {

// Zero rows appended to every local expert's segment of the expert-major buffer.
// Expert l gets round_up(count_l + rows_per_expert, align) - count_l padding rows, so every
// local expert runs (and produces a gradient, exactly zero when it received nothing).
// rows_per_expert = 0 and align = 1 turn padding off; align = M makes every expert's row
// count a multiple of M (grouped GEMMs, low-precision formats).
struct padding {
  int rows_per_expert = 1;
  int align = 1;

  std::size_t padded_rows(std::size_t count) const noexcept {
    const std::size_t a = static_cast<std::size_t>(align);
    const std::size_t need = count + static_cast<std::size_t>(rows_per_expert);
    return (need + a - 1) / a * a;
  }
  void validate() const {
    EPX_REQUIRE(rows_per_expert >= 0, errc::configuration, "padding.rows_per_expert (", rows_per_expert,
                ") must be >= 0");
    EPX_REQUIRE(align >= 1, errc::configuration, "padding.align (", align, ") must be >= 1");
  }
};

}  // namespace epx
