// epx/layout/masked.hpp: the masked path's expert-major buffer, from the send plan.
//
// On the masked path (ep == tp) every rank of the EP group holds the same rows and keeps
// the pairs routed to its own L local experts [first, first+L). The plan's send order
// already groups pairs by expert; local expert l's rows are its send positions
// [expert_offset[first+l], expert_offset[first+l+1]) in order, then padding (the receive
// layout with this rank as the only source, epx/layout/receive.hpp, gives the offsets).
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"

namespace epx::layout {

// local_pos[i] = row of pair i in the local buffer, or -1 when its expert is not local or
// it has no send position (dropped by a capacity, epx/layout/capacity.hpp):
//   local_offset[l] + (pos[i] - expert_offset[e])   for e = ids[i], l = e - first local.
// Call with i in [0, n*k).
struct masked_positions {
  const std::int32_t* ids;            // [n*k]
  const std::int64_t* pos;            // [n*k] send positions from the plan
  const std::int64_t* expert_offset;  // [E+1] from the plan
  const std::int64_t* local_offset;   // [L+1] expert-major offsets (with padding)
  std::int64_t* local_pos;            // [n*k]
  int first_expert;
  int num_local;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const int l = ids[i] - first_expert;
    if (l < 0 || l >= num_local || pos[i] < 0) {
      local_pos[i] = -1;
      return;
    }
    local_pos[i] = local_offset[l] + (pos[i] - expert_offset[ids[i]]);
  }
};

// row_source[r] = the token of local row r (-1 for padding). Call with l in [0, L).
struct masked_source_rows {
  const std::int64_t* src_row;        // [n*k] from the plan: the token of each send position
  const std::int64_t* expert_offset;  // [E+1] from the plan
  const std::int64_t* local_offset;   // [L+1]
  std::int64_t* row_source;           // [R]
  int first_expert;

  EPX_HOST_DEVICE void operator()(std::size_t l) const {
    const std::int64_t b = expert_offset[first_expert + static_cast<int>(l)];
    const std::int64_t count = expert_offset[first_expert + static_cast<int>(l) + 1] - b;
    const std::int64_t r0 = local_offset[l];
    const std::int64_t r1 = local_offset[l + 1];
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t q = r - r0;
      row_source[r] = q < count ? src_row[b + q] : -1;
    }
  }
};

}  // namespace epx::layout
