// epx/layout/per_rank.hpp: one row per destination rank (spec section 14).
//
// In the per-slot mode a token sends its row once per slot. In the per-rank mode
// (layer_options::sends == row_sends::per_rank) it sends it once per distinct ep rank that
// owns one of its kept slots' experts. This file plans that, from the per-slot plan (the
// send position pos[t*k+j] of every pair, -1 for a dropped pair) and the receive layout:
//
//   source `me`: the rows to owner d are its tokens with a kept slot at d, in token order,
//     owners in order (send_rows[d] of them from send_offsets[d]); src_row[u] is the slice
//     row of unique row u;
//   with each unique row travel k entries, one per slot j in slot order: the row of slot j
//     in owner d's expert-major buffer (the row the per-slot mode would have sent there) and
//     its routing weight, or -1 and 0 when slot j is not at d (slot_row, slot_weight);
//   first[t*k+j]: unique row u when j is the first slot of its owner at token t, else -1.
//     The source sums the returned rows through it, in slot order: in the order of each
//     owner's first slot;
//   pair[t*k+j]: u*k + j for every kept pair (-1 for a dropped one): where the owner's
//     per-slot figures (the routing-weight gradients) come back.
//
// The owner copies each received row into its slots' rows (receive_rows), and on the way
// back sums w * y over a row's slots in slot order (the combine kernel over slot_row), so
// the expert-major buffers and the experts' inputs are bitwise the per-slot mode's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/layout/receive.hpp"

namespace epx::detail {

struct per_rank_plan {
  std::vector<std::size_t> send_rows, send_offsets;  // [owners]: unique rows to owner d
  std::vector<std::int64_t> src_row;                 // [U] slice row of unique row u
  std::vector<std::int64_t> slot_row;                // [U*k] row of slot j at the owner, -1
  std::vector<float> slot_weight;                    // [U*k] its routing weight, 0
  std::vector<std::int64_t> first;                   // [n*k] u at the first slot of its owner, -1
  std::vector<std::int64_t> pair;                    // [n*k] u*k + j for a kept pair, -1
  std::vector<std::int64_t> owner_of, row_of;        // scratch: [sent] owner and row of each send position

  std::size_t unique() const noexcept { return src_row.size(); }
};

// Per-rank sends of one call: this rank's unique rows to every peer (from its plan) and
// from every peer (the exchanged counts), host memory, [ep].
struct rank_rows {
  std::vector<std::size_t> send_rows, send_offsets, recv_rows, recv_offsets;
  std::size_t sent() const noexcept { return send_rows.empty() ? 0 : send_offsets.back() + send_rows.back(); }
  std::size_t received() const noexcept { return recv_rows.empty() ? 0 : recv_offsets.back() + recv_rows.back(); }
};

// pos and w: host memory, [n*k]; `me` is this rank as a source of `lay`. Fills `g`, whose
// vectors keep their capacity from one call to the next (a caller that keeps one plan
// allocates nothing once the sizes have been seen).
inline void make_per_rank_plan(per_rank_plan& g, const receive_layout& lay, int me, std::size_t n, int top_k,
                               const std::int64_t* pos, const float* w) {
  const auto k = static_cast<std::size_t>(top_k);
  const auto D = static_cast<std::size_t>(lay.owners);
  // Owner and expert-major row of every send position.
  auto& owner_of = g.owner_of;
  auto& row_of = g.row_of;
  owner_of.assign(lay.sent(me), -1);
  row_of.assign(lay.sent(me), -1);
  for_each_returned(lay, me, [&](std::size_t p, int d, std::size_t r) {
    owner_of[p] = d;
    row_of[p] = static_cast<std::int64_t>(r);
  });
  g.send_rows.assign(D, 0);
  g.send_offsets.assign(D, 0);
  constexpr std::size_t none = ~std::size_t(0);
  std::vector<std::size_t> last(D, none);  // the last token that counted owner d
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t j = 0; j < k; ++j) {
      const std::int64_t p = pos[t * k + j];
      if (p < 0) continue;
      const auto d = static_cast<std::size_t>(owner_of[static_cast<std::size_t>(p)]);
      if (last[d] != t) {
        last[d] = t;
        ++g.send_rows[d];
      }
    }
  std::size_t U = 0;
  for (std::size_t d = 0; d < D; ++d) {
    g.send_offsets[d] = U;
    U += g.send_rows[d];
  }
  g.src_row.assign(U, -1);
  g.slot_row.assign(U * k, -1);
  g.slot_weight.assign(U * k, 0.0f);
  g.first.assign(n * k, -1);
  g.pair.assign(n * k, -1);
  std::vector<std::size_t> next = g.send_offsets, at(D, 0);  // [owners]: small
  last.assign(D, none);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t i = t * k + j;
      const std::int64_t p = pos[i];
      if (p < 0) continue;
      const auto d = static_cast<std::size_t>(owner_of[static_cast<std::size_t>(p)]);
      if (last[d] != t) {
        last[d] = t;
        at[d] = next[d]++;
        g.src_row[at[d]] = static_cast<std::int64_t>(t);
        g.first[i] = static_cast<std::int64_t>(at[d]);
      }
      const std::size_t u = at[d];
      g.pair[i] = static_cast<std::int64_t>(u * k + j);
      g.slot_row[u * k + j] = row_of[static_cast<std::size_t>(p)];
      g.slot_weight[u * k + j] = w[i];
    }
}

inline per_rank_plan make_per_rank_plan(const receive_layout& lay, int me, std::size_t n, int top_k,
                                        const std::int64_t* pos, const float* w) {
  per_rank_plan g;
  make_per_rank_plan(g, lay, me, n, top_k, pos, w);
  return g;
}

// The owner's side: from the slot entries of the `received` rows it got ([received*k]),
// which received row each of its `rows` expert-major rows copies (from[i], -1 for padding)
// and that slot's routing weight (weight[i]). The entries come from the plans of its peers
// over the same layout, so every row is named exactly once; an entry outside [0, rows)
// is skipped rather than written.
inline void receive_rows(std::size_t received, int top_k, const std::int64_t* slot_row, const float* slot_weight,
                         std::size_t rows, std::int64_t* from, float* weight) {
  const auto k = static_cast<std::size_t>(top_k);
  for (std::size_t i = 0; i < rows; ++i) {
    from[i] = -1;
    weight[i] = 0.0f;
  }
  for (std::size_t u = 0; u < received; ++u)
    for (std::size_t j = 0; j < k; ++j) {
      const std::int64_t r = slot_row[u * k + j];
      if (r < 0 || static_cast<std::size_t>(r) >= rows) continue;
      from[r] = static_cast<std::int64_t>(u);
      weight[r] = slot_weight[u * k + j];
    }
}

}  // namespace epx::detail
