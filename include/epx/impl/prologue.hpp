// epx/impl/prologue.hpp: what every forward call of the built-in implementations does
// before rows move.
//
//   1. the counts of the send plan of the call's (row, slot) pairs (epx/layout/plan.hpp),
//      queued with nothing read back; its pass 1 also flags the first bad expert id or
//      non-finite weight; the plan's scatter waits until after the exchange, where the
//      capacity can cut it;
//   2. this rank's record of the exchange, built on the policy from the plan's summary
//      (layout plan_record: status with the bad-pair flag, shapes, the per-expert counts,
//      node figures), and the record exchange over the EP group
//      (epx/layout/exchange.hpp): the one host synchronisation of the call; bad input
//      anywhere raises on every rank here;
//   3. the receive layout (epx/layout/receive.hpp) from the gathered counts (all-to-all) or
//      from this rank's own counts (masked path);
//   4. the statistics of the call (detail::record_stats);
// with, around the exchange, capacity and node statistics (epx/impl/limits.hpp): the
// dropped pairs lose their send positions before the receive layout is made;
// and chooses where the experts write (expert_output_rows), in place where they allow it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "epx/exec/workspace.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/impl/limits.hpp"
#include "epx/impl/stats.hpp"
#include "epx/layout/exchange.hpp"
#include "epx/layout/plan.hpp"
#include "epx/layout/receive.hpp"

namespace epx::detail {

template <class Exec>
struct routed {
  layout::send_plan<Exec> plan;
  group_records records;
  receive_layout layout;
};

// What a call routes: the pairs of rows [row0, row0 + n) of the call's N = a.rows rows.
struct route_request {
  std::size_t row0 = 0;
  std::size_t n = 0;
  bool gather_counts = true;  // all-to-all: every rank's counts travel; masked: only the checks
  int agree_rows = 1;         // N must agree within runs of this many consecutive EP ranks
  const char* path = "";      // the implementation's name, for the statistics
  bool moves_rows = true;
  bool training = false;      // the ranks of the group must agree on it (their routes differ)
};

template <class Comm, class Exec, class T>
routed<Exec> route_forward(const layer_context<Comm>& ctx, const Exec& ex, const forward_args<T>& a,
                           const route_request& q) {
  const int E = ctx.num_experts(), L = ctx.local_experts();
  const auto k = static_cast<std::size_t>(a.top_k);
  const auto Es = static_cast<std::size_t>(E);
  const bool ok = a.status == 0;
  const std::int32_t* ids = ok ? a.ids + q.row0 * k : nullptr;
  const float* weights = ok ? a.weights + q.row0 * k : nullptr;
  routed<Exec> r;
  // Queued, nothing read back: the plan's counts and node figures, this rank's record of
  // the exchange built from them on the device ([status, N, H, k, rank, mode | counts[E] |
  // nodes]). The plan's scatter waits for the exchange (capacity cuts it).
  r.plan = layout::launch_plan_counts(ex, ids, weights, ok ? q.n : 0, a.top_k, E, ctx.options.chunks,
                                      nodes_to_count(*ctx.topology, ctx.options));
  call_limits lim;
  lim.nodes = ctx.options.ranks_per_node > 0;
  const std::size_t nextra = lim.nodes ? node_tally_size : 0;
  const std::size_t stride = record_header + Es + nextra;
  auto record = exec::make_buffer<std::int64_t>(ex, stride);
  exec::for_each_n(ex, stride,
                   plan_record{a.status, static_cast<std::int64_t>(a.rows), static_cast<std::int64_t>(a.hidden),
                               a.top_k, ctx.rank, r.plan.chunk_bad(), r.plan.chunks, r.plan.expert_counts(), Es,
                               lim.nodes ? static_cast<const std::int64_t*>(r.plan.node_tally.data()) : nullptr, nextra,
                               record.data(), q.training ? 1 : 0});
  // The call's one host synchronisation: every rank's record (bad-input flag, shapes,
  // counts) reaches the host together; bad input anywhere raises on every rank here.
  const auto message = [&]() -> std::string {
    if (a.status != 0) return a.status_message;
    return layout::describe(layout::find_bad_pair(ex, r.plan, ids, weights), a.top_k, E, q.row0);
  };
  r.records = exchange_policy_records(*ctx.ep, ex, static_cast<const std::int64_t*>(record.data()), stride, message,
                                      "moe_layer forward", q.agree_rows);
  const int ep = ctx.ep_size();
  const std::int64_t* own = r.records.counts(ctx.ep_rank());
  layout::set_host_counts(r.plan, own);
  if (lim.nodes) std::copy(own + Es, own + Es + node_tally_size, lim.tally);
  // Limits (epx/impl/limits.hpp): capacity drops pairs.
  if (q.gather_counts) {
    scatter_with_capacity(ctx.options.capacity, ex, r.records, ctx.ep_rank(), ctx.tp_size(), E, a.top_k, ids,
                          weights, r.plan, lim);
    const auto kept = [&](int s) {
      return lim.kept.empty() ? r.records.counts(s) : lim.kept.data() + static_cast<std::size_t>(s) * static_cast<std::size_t>(E);
    };
    r.layout = make_receive_layout(ep, ep, L, ctx.options.pad, kept, [&](int s) { return r.records.counts(s); });
  } else {
    layout::launch_scatter(ex, r.plan, ids, weights);
    apply_capacity_masked(ctx.options.capacity, ex, ep, E, a.top_k, q.n, ids, weights, r.plan, lim);
    r.layout = make_receive_layout(1, ep, L, ctx.options.pad, [&](int) { return r.plan.host_counts.data(); });
  }
  // Buffers of R rows of H elements: R * H * sizeof(T) must not wrap (the padding rows
  // count, and arrive on ranks whose own call is empty); raised on every rank together.
  check_buffer_rows(r.layout, a.hidden, sizeof(T), "moe_layer forward");
  if (ctx.stats != nullptr) {
    record_stats(*ctx.stats, q.path, r.layout, ctx.ep_rank(), q.moves_rows);
    // The all-to-all path sums the group's node figures; on the masked path every rank
    // holds the same rows, so its own figures are the group's.
    record_limits(*ctx.stats, lim, q.gather_counts ? &r.records : nullptr, q.gather_counts ? Es : 0);
  }
  return r;
}

// Where the experts write their outputs for `num_rows` rows of H (whose inputs are `x`):
// over x when they allow it (`in_place`, epx::forward_in_place_v) and nothing is kept for
// backward, into `y` (allocated here) otherwise.
template <class T, class Exec>
T* expert_output_rows(workspace& ws, const Exec& ex, std::size_t num_rows, std::size_t H, T* x, bool training,
                      bool in_place, rows_buffer<T, Exec>& y) {
  if (!training && in_place) return x;
  y = make_rows<T>(ws, ex, num_rows * H);
  return y.data();
}

}  // namespace epx::detail
