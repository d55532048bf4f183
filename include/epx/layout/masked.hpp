// epx/layout/masked.hpp: the masked path's expert-major buffer, from the send plan.
//
// On the masked path (ep == tp) every rank of the EP group holds the same rows and keeps
// the pairs routed to its own L local experts [first, first+L). The plan's send order
// already groups pairs by expert; local expert l's rows are its send positions
// [expert_offset[first+l], expert_offset[first+l+1]) in order, then padding (the receive
// layout with this rank as the only source, epx/layout/receive.hpp, gives the offsets).
//
// Bounded mode (epx/impl/bounded_masked.hpp) plans each of the ep slices of the rows
// (epx/layout/slicing.hpp) on its own, as the all-to-all path's ranks would, with each
// slice's plan written at its first pair (pos, src_row) and its summary at
// summary[s * stride] (offsets at + offset_at); local expert l's block of `block` rows at
// l*block holds slice 0's kept rows, then slice 1's, ..., then rows that are not data:
//   masked_bound_arrivals  (per local expert) where each slice's rows start in the block,
//                          and the block's rows (the experts' device counts);
//   masked_bound_positions (per pair) its row in the blocks, -1 when not local or not kept;
//   masked_bound_rows      (per block row) its token, -1 past the block's rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/layout/slicing.hpp"

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

// row_source[r] = the token of local row r (-1 for padding). Call with r in [0, R), R =
// local_offset[L]: one call per row (a search over the L + 1 offsets for its expert), so
// a device spreads the rows of a large expert over threads.
struct masked_source_rows {
  const std::int64_t* src_row;        // [n*k] from the plan: the token of each send position
  const std::int64_t* expert_offset;  // [E+1] from the plan
  const std::int64_t* local_offset;   // [L+1]
  std::int64_t* row_source;           // [R]
  int first_expert;
  int num_local;                      // L

  EPX_HOST_DEVICE void operator()(std::size_t ri) const {
    const auto r = static_cast<std::int64_t>(ri);
    int lo = 0, hi = num_local;  // the last expert whose block starts at or before r
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      if (local_offset[mid] <= r) lo = mid;
      else hi = mid;
    }
    const std::int64_t b = expert_offset[first_expert + lo];
    const std::int64_t count = expert_offset[first_expert + lo + 1] - b;
    const std::int64_t q = r - local_offset[lo];
    row_source[r] = q < count ? src_row[b + q] : -1;
  }
};

// row_off[l*(S+1) + s] = the first row of slice s in local expert l's block (the kept pairs
// of slices before s), row_off[l*(S+1) + S] = rows[l] = the block's rows. Call with l in
// [0, L).
struct masked_bound_arrivals {
  const std::int64_t* kept;  // [S][E] each slice's kept pairs per expert
  int num_experts;
  int first_expert;
  int slices;                // S
  std::int64_t* row_off;     // [L*(S+1)]
  std::int64_t* rows;        // [L]

  EPX_HOST_DEVICE void operator()(std::size_t l) const {
    std::int64_t* o = row_off + l * static_cast<std::size_t>(slices + 1);
    const std::size_t e = static_cast<std::size_t>(first_expert) + l;
    std::int64_t at = 0;
    for (int s = 0; s < slices; ++s) {
      o[s] = at;
      at += kept[static_cast<std::size_t>(s) * static_cast<std::size_t>(num_experts) + e];
    }
    o[slices] = at;
    rows[l] = at;
  }
};

// The slices' plans as the functors below read them.
struct masked_slice_plans {
  const std::int64_t* summary;  // [S][stride]
  std::size_t stride;
  std::size_t offset_at;        // where a summary's expert offsets [E+1] start
  const std::int64_t* row_off;  // [L*(S+1)] (masked_bound_arrivals)
  std::size_t rows;             // N, the rows of the call
  int slices;                   // S
  int top_k;
  int first_expert;
  int num_local;
  std::size_t block;            // rows of a local expert's block

  EPX_HOST_DEVICE const std::int64_t* offsets(int s) const noexcept {
    return summary + static_cast<std::size_t>(s) * stride + offset_at;
  }
  EPX_HOST_DEVICE const std::int64_t* starts(std::size_t l) const noexcept {
    return row_off + l * static_cast<std::size_t>(slices + 1);
  }
};

// local_pos[i] = l*block + (first row of pair i's slice in l's block) + (its place among the
// slice's kept pairs of expert e = ids[i]), l = e - first; -1 when e is not local or the pair
// has no send position (dropped by the bound, or bad). Call with i in [0, N*k).
struct masked_bound_positions {
  const std::int32_t* ids;  // [N*k]
  const std::int64_t* pos;  // [N*k] each pair's send position in its slice's plan
  masked_slice_plans plans;
  std::int64_t* local_pos;  // [N*k]

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const int e = ids[i], l = e - plans.first_expert;
    if (l < 0 || l >= plans.num_local || pos[i] < 0) {
      local_pos[i] = -1;
      return;
    }
    const int s = slice_of_row(i / static_cast<std::size_t>(plans.top_k), plans.rows, plans.slices);
    const auto ls = static_cast<std::size_t>(l);
    local_pos[i] = static_cast<std::int64_t>(ls * plans.block) + plans.starts(ls)[s] + (pos[i] - plans.offsets(s)[e]);
  }
};

// row_source[r] = the token of block row r, -1 past its block's rows. Call with r in
// [0, L*block).
struct masked_bound_rows {
  const std::int64_t* src_row;  // [N*k] each slice's plan at its first pair: the slice row of each send position
  masked_slice_plans plans;
  std::int64_t* row_source;     // [L*block]

  EPX_HOST_DEVICE void operator()(std::size_t r) const {
    const std::size_t l = r / plans.block;
    const auto i = static_cast<std::int64_t>(r % plans.block);
    const std::int64_t* o = plans.starts(l);
    if (i >= o[plans.slices]) {
      row_source[r] = -1;
      return;
    }
    int s = 0;
    while (o[s + 1] <= i) ++s;
    const std::size_t b = slice_begin(plans.rows, plans.slices, s);
    const std::int64_t at = plans.offsets(s)[plans.first_expert + static_cast<int>(l)] + (i - o[s]);
    row_source[r] = static_cast<std::int64_t>(b) +
                    src_row[b * static_cast<std::size_t>(plans.top_k) + static_cast<std::size_t>(at)];
  }
};

}  // namespace epx::layout
