// epx/impl/limits.hpp: capacity and nodes inside a forward call (spec sections 8 and 10).
//
// The shared prologue (epx/impl/prologue.hpp) calls these around the count exchange:
//   1. nodes_to_count: with layer_options::ranks_per_node, the send plan also counts the
//      distinct nodes of every token the call dispatches (layout::nodes_per_token: in the
//      counting sort's pass 1, else routing::token_nodes), reduced to {tokens, sum, max};
//      on the all-to-all path they travel after the counts in this rank's record of the
//      count exchange, so every rank learns the EP group's figures without another
//      collective (count_nodes: the same figures read back, outside a layer call);
//   2. with layer_options::capacity, the pairs each source keeps per expert
//      (layout::keep_counts, from the gathered counts: no other communication), and the
//      plan loses the dropped pairs: on the all-to-all path (scatter_with_capacity) the
//      plan's scatter waits for the count exchange and cuts them as it places the pairs
//      (layout::plan_cut; by score with layout::drop_pairs after it); they leave holes at
//      the end of their expert's block of the send order (the receive layout skips them,
//      layout/receive.hpp); on the masked path (apply_capacity_masked) the call's rows are
//      split into the ep slices the all-to-all path would dispatch (so both paths drop the
//      same pairs), layout::drop_pairs drops them from the scattered plan, and the plan is
//      compacted (layout::compact_pairs);
//   3. record_limits: dropped pairs per expert and nodes per token into layer_stats.
// validate_limits checks the options at construction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"
#include "epx/impl/options.hpp"
#include "epx/impl/stats.hpp"
#include "epx/layout/capacity.hpp"
#include "epx/layout/exchange.hpp"
#include "epx/layout/plan.hpp"
#include "epx/layout/slicing.hpp"
#include "epx/mesh/mesh.hpp"
#include "epx/routing/node_limit.hpp"
#include "epx/exec/thrust.hpp"

#if EPX_HAS_CCCL
#include <thrust/scan.h>
#include <thrust/sort.h>
#endif

namespace epx::detail {

// layer_options::capacity, ranks_per_node and max_nodes against mesh m: errc::configuration
// naming the values.
inline void validate_limits(const mesh& m, const layer_options& o) {
  o.capacity.validate();
  const int rpn = o.ranks_per_node, M = o.max_nodes, ep = m.ep();
  EPX_REQUIRE(rpn >= 0, errc::configuration, "layer_options.ranks_per_node (", rpn, ") must be >= 0 (0: not given)");
  EPX_REQUIRE(M >= 0, errc::configuration, "layer_options.max_nodes (", M, ") must be >= 0 (0: no limit)");
  EPX_REQUIRE(rpn == 0 || ep % rpn == 0, errc::configuration, "layer_options.ranks_per_node (", rpn,
              ") must divide ep (", ep, ")");
  if (M == 0) return;
  EPX_REQUIRE(rpn > 0, errc::configuration, "layer_options.max_nodes (", M,
              ") needs layer_options.ranks_per_node (the ep ranks of a node)");
  const int nodes = ep / rpn;
  EPX_REQUIRE(M <= nodes, errc::configuration, "layer_options.max_nodes (", M,
              ") exceeds the number of nodes, ep / ranks_per_node = ", ep, " / ", rpn, " = ", nodes);
  EPX_REQUIRE(nodes <= routing::max_node_count, errc::configuration, "a node limit supports at most ",
              routing::max_node_count, " nodes, not ep / ranks_per_node = ", nodes);
  const long long room = 1LL * M * rpn * m.local_experts();
  EPX_REQUIRE(o.top_k <= room, errc::configuration, "top_k (", o.top_k, ") exceeds what max_nodes (", M,
              ") nodes hold: max_nodes * ranks_per_node * local experts = ", M, " * ", rpn, " * ", m.local_experts(),
              " = ", room);
}

// The routing policies' node limit for these options (no limit without max_nodes).
inline routing::node_limit node_limit_for(const mesh& m, const layer_options& o) {
  if (o.ranks_per_node <= 0 || o.max_nodes <= 0) return {};
  return routing::node_limit{m.ep() / o.ranks_per_node, o.max_nodes};
}

using layout::node_tally_size;

// What a call adds to the count exchange and takes from it.
struct call_limits {
  bool nodes = false;                // node figures follow the counts in the records
  std::int64_t tally[node_tally_size] = {0, 0, 0};
  std::vector<std::int64_t> record;  // this rank's counts [E] and tally (all-to-all with nodes)
  std::vector<std::int64_t> kept;    // [sources][E] pairs that travel; empty: every pair
  std::vector<std::int64_t> dropped; // [E] the EP group's dropped pairs per expert; empty: no capacity

  // The counts this rank contributes to the exchange: `ncounts` (E or 0) plus the tally.
  const std::int64_t* counts(const std::vector<std::int64_t>& plan_counts, std::size_t ncounts) const {
    return ncounts == 0 ? nullptr : record.empty() ? plan_counts.data() : record.data();
  }
  std::size_t size(std::size_t ncounts) const { return ncounts == 0 ? 0 : record.empty() ? ncounts : record.size(); }
};

// Step 1: the plan's count of nodes per token (layout::nodes_per_token) for these
// options; none without ranks_per_node.
inline layout::nodes_per_token nodes_to_count(const mesh& m, const layer_options& o) {
  if (o.ranks_per_node <= 0) return {};
  return layout::nodes_per_token{m.experts() / (m.ep() / o.ranks_per_node)};
}

// Step 1 with a read-back: the node figures of the n tokens at ids ([n, k], policy memory;
// null when the call's input is bad). `gather`: the all-to-all path (figures travel in the
// record after plan_counts).
template <class Exec>
call_limits count_nodes(const mesh& m, const layer_options& o, const Exec& ex, const std::int32_t* ids, std::size_t n,
                        int k, const std::vector<std::int64_t>& plan_counts, bool gather) {
  call_limits c;
  if (o.ranks_per_node <= 0) return c;
  c.nodes = true;
  if (ids != nullptr && n > 0) {
    const auto tally = layout::launch_token_nodes(ex, ids, n, k, m.experts(), nodes_to_count(m, o));
    to_host(ex, static_cast<const std::int64_t*>(tally.data()), node_tally_size, c.tally);
  }
  if (gather) {
    c.record = plan_counts;
    c.record.insert(c.record.end(), c.tally, c.tally + node_tally_size);
  }
  return c;
}

// Whether capacity by score selects with a sort (layout::score_entries and after it, on
// policies with a Thrust execution policy) or with layout::drop_pairs, a thread per
// segment.
template <class Exec>
inline constexpr bool score_by_sort_v = exec::has_thrust_policy_v<Exec> && EPX_HAS_CCCL;

#if EPX_HAS_CCCL
// Capacity by score on the Thrust route: the segments of `seg` (host; `sources` per
// expert) that drop keep their best pairs (layout::score_entries: drop_pairs' result).
template <class Exec>
void sort_drop_by_score(const Exec& ex, const std::vector<layout::drop_segment>& seg, int sources,
                        const std::int32_t* ids, const float* weights, int k, layout::send_plan<Exec>& plan) {
  std::vector<layout::score_segment> d;
  std::int64_t M = 0;
  for (std::size_t g = 0; g < seg.size(); ++g) {
    const layout::drop_segment& s = seg[g];
    if (s.keep >= s.count) continue;
    d.push_back({s.begin, s.count, s.keep, M, static_cast<int>(g / static_cast<std::size_t>(sources))});
    M += s.count;
  }
  if (M == 0) return;
  EPX_REQUIRE(d.size() < (std::size_t{1} << 31), errc::input, "capacity: ", d.size(),
              " segments drop; at most 2^31 - 1");
  const auto Ms = static_cast<std::size_t>(M);
  auto table = exec::make_buffer<layout::score_segment>(ex, d.size());
  exec::copy_n(ex, static_cast<const layout::score_segment*>(d.data()), d.size(), table.data());
  auto key = exec::make_buffer<std::uint64_t>(ex, Ms);
  auto order = exec::make_buffer<std::int64_t>(ex, Ms);
  auto pair = exec::make_buffer<std::int64_t>(ex, Ms);
  auto row = exec::make_buffer<std::int64_t>(ex, Ms);
  auto rank = exec::make_buffer<std::int64_t>(ex, Ms);
  auto seg_of = exec::make_buffer<std::int32_t>(ex, Ms);
  auto kept = exec::make_buffer<std::int32_t>(ex, Ms);
  exec::for_each_n(ex, Ms,
                   layout::score_entries{ids, weights, plan.pos.data(), plan.src_row.data(), table.data(),
                                         static_cast<int>(d.size()), k, key.data(), order.data(), pair.data(),
                                         row.data(), seg_of.data()});
  const auto tp = exec::thrust_policy(ex);
  {
    [[maybe_unused]] const auto on_device = exec::launch_scope(ex);
    thrust::stable_sort_by_key(tp, key.data(), key.data() + Ms, order.data());
  }
  exec::for_each_n(ex, Ms, layout::score_keep{key.data(), order.data(), table.data(), kept.data()});
  {
    [[maybe_unused]] const auto on_device = exec::launch_scope(ex);
    thrust::exclusive_scan_by_key(tp, seg_of.data(), seg_of.data() + Ms, kept.data(), rank.data(), std::int64_t{0});
  }
  exec::for_each_n(ex, Ms,
                   layout::score_place{table.data(), seg_of.data(), kept.data(), rank.data(), pair.data(), row.data(),
                                       plan.pos.data(), plan.src_row.data()});
}
#endif

// Launches layout::drop_pairs over the segments `seg` (host), with the scratch that score
// priority needs for the segments that drop. Returns the segment table in the
// policy's memory. `seg` may go after the call: the copy has read it (device policies
// stage pageable memory before returning); the buffers are freed in stream order.
template <class Exec>
exec::buffer<layout::drop_segment, Exec> run_drop_pairs(const capacity_policy& cap, const Exec& ex,
                                                        std::vector<layout::drop_segment>& seg,
                                                        const std::int32_t* ids, const float* weights, int k,
                                                        int sources, layout::send_plan<Exec>& plan) {
  const bool by_score = cap.priority == drop_priority::score;
  std::int64_t scratch = 0;
  if (by_score && !score_by_sort_v<Exec>)
    for (auto& s : seg) {
      layout::drop_pairs::check_segment(s.count);
      const std::int64_t n = layout::drop_pairs::scratch_size(s.count, s.keep);
      s.scratch = n > 0 ? scratch : -1;
      scratch += n;
    }
  auto table = exec::make_buffer<layout::drop_segment>(ex, seg.size());
  exec::copy_n(ex, static_cast<const layout::drop_segment*>(seg.data()), seg.size(), table.data());
#if EPX_HAS_CCCL
  if constexpr (score_by_sort_v<Exec>) {
    if (by_score) {
      sort_drop_by_score(ex, seg, sources, ids, weights, k, plan);
      return table;
    }
  }
#endif
  exec::buffer<std::uint64_t, Exec> keyed;
  if (scratch > 0) keyed = exec::make_buffer<std::uint64_t>(ex, static_cast<std::size_t>(scratch));
  // Many positions to look at: one sweep over the pairs reads them in order.
  const bool sweep = scratch > 0 && static_cast<std::size_t>(scratch) * 8 > plan.pairs;
  if (sweep)
    exec::for_each_n(ex, plan.pairs,
                     layout::fill_scratch{ids, weights, plan.pos.data(), table.data(), keyed.data(), sources, k});
  exec::for_each_n(ex, seg.size(),
                   layout::drop_pairs{ids, weights, plan.pos.data(), plan.src_row.data(), table.data(),
                                      scratch > 0 ? keyed.data() : nullptr, k, sources, by_score, sweep});
  return table;
}

// Step 2, all-to-all path: sources are the ep ranks (records), this rank is `me`; its plan
// covers its TP slice (ids, weights at the slice's first row) and is counted but not yet
// scattered (layout::launch_plan_counts). This launches the scatter, with the cut of this
// rank's kept counts (layout::plan_cut): by position the dropped pairs get no position in
// the scatter itself; by score layout::drop_pairs keeps the best of each overflowing
// expert, from its pairs' weight key and slot, which the scatter also writes in send
// order when many pairs are in overflowing experts. Without a capacity, or when nothing
// is dropped, the plain scatter.
template <class Exec>
void scatter_with_capacity(const capacity_policy& cap, const Exec& ex, const group_records& g, int me, int tp, int E,
                           int k, const std::int32_t* ids, const float* weights, layout::send_plan<Exec>& plan,
                           call_limits& c) {
  if (!cap.enabled()) {
    layout::launch_scatter(ex, plan, ids, weights);
    return;
  }
  const int S = g.size;
  const auto Es = static_cast<std::size_t>(E);
  std::vector<std::int64_t> pairs(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) {
    const auto rows = slice_bounds(static_cast<std::size_t>(g.rows(s)), tp, s % tp).size();
    pairs[static_cast<std::size_t>(s)] = static_cast<std::int64_t>(rows) * k;
  }
  c.dropped.resize(Es);
  c.kept = layout::keep_counts(cap, S, E, [&](int s) { return g.counts(s); }, pairs.data(), c.dropped.data());
  const std::int64_t* const keep = c.kept.data() + static_cast<std::size_t>(me) * Es;
  std::int64_t overflowing = 0;  // pairs in the experts that drop
  for (std::size_t e = 0; e < Es; ++e) overflowing += keep[e] < plan.host_counts[e] ? plan.host_counts[e] : 0;
  if (overflowing == 0) {
    layout::launch_scatter(ex, plan, ids, weights);
    return;
  }
  if (cap.priority != drop_priority::score) {
    // By position: the last position each expert keeps is all the scatter needs (read
    // where it is on host policies, copied to the policy's memory otherwise).
    std::vector<std::int64_t> last(Es);
    for (std::size_t e = 0; e < Es; ++e) last[e] = plan.host_offset[e] + keep[e] - 1;
    const std::int64_t* at = last.data();
    exec::buffer<std::int64_t, Exec> copy;
    if constexpr (!exec::is_host_policy_v<Exec>) {
      copy = exec::make_buffer<std::int64_t>(ex, Es);
      exec::copy_n(ex, at, Es, copy.data());
      at = copy.data();
    }
    layout::launch_scatter(ex, plan, ids, weights, layout::plan_cut{at, nullptr});
    return;
  }
  // By score: this rank's segments, one per expert, its plan block.
  std::vector<layout::drop_segment> seg(Es);
  for (std::size_t e = 0; e < Es; ++e) seg[e] = {plan.host_offset[e], plan.host_counts[e], keep[e], 0, -1};
  EPX_REQUIRE(weights != nullptr, errc::internal, "capacity by score needs the routing weights");
#if EPX_HAS_CCCL
  if constexpr (score_by_sort_v<Exec>) {
    // The plain scatter, then the selection as a sort.
    layout::launch_scatter(ex, plan, ids, weights);
    sort_drop_by_score(ex, seg, 1, ids, weights, k, plan);
    return;
  }
#endif
  if (overflowing * 8 <= static_cast<std::int64_t>(plan.pairs)) {
    // By score, few pairs in the segments that drop (at most an eighth): the plain
    // scatter, and drop_pairs finds each of their pairs from its row.
    layout::launch_scatter(ex, plan, ids, weights);
    run_drop_pairs(cap, ex, seg, ids, weights, k, 1, plan);
    return;
  }
  // By score, many: the scatter also writes every pair's weight key and slot at its send
  // position, and each dropping segment's scratch is its own positions.
  for (auto& sg : seg) {
    layout::drop_pairs::check_segment(sg.count);
    if (sg.keep < sg.count) sg.scratch = sg.begin;
  }
  auto table = exec::make_buffer<layout::drop_segment>(ex, Es);
  exec::copy_n(ex, static_cast<const layout::drop_segment*>(seg.data()), Es, table.data());
  auto keyed = exec::make_buffer<std::uint64_t>(ex, plan.pairs);
  layout::launch_scatter(ex, plan, ids, weights, layout::plan_cut{nullptr, keyed.data()});
  exec::for_each_n(ex, Es,
                   layout::drop_pairs{ids, weights, plan.pos.data(), plan.src_row.data(), table.data(), keyed.data(), k,
                                      1, true, true});
}

// Step 2, masked path: the plan covers all N rows of the group, split into the ep slices
// that the all-to-all path would dispatch; it is compacted to the kept pairs (its counts,
// offsets, pos and src_row).
template <class Exec>
void apply_capacity_masked(const capacity_policy& cap, const Exec& ex, int ep, int E, int k, std::size_t N,
                           const std::int32_t* ids, const float* weights, layout::send_plan<Exec>& plan,
                           call_limits& c) {
  if (!cap.enabled()) return;
  const int S = ep;
  const auto Es = static_cast<std::size_t>(E), Ss = static_cast<std::size_t>(S);
  std::vector<std::int64_t> row_begin(Ss), pairs(Ss);
  for (int s = 0; s < S; ++s) {
    const row_slice sl = slice_bounds(N, ep, s);
    row_begin[static_cast<std::size_t>(s)] = static_cast<std::int64_t>(sl.begin);
    pairs[static_cast<std::size_t>(s)] = static_cast<std::int64_t>(sl.size()) * k;
  }
  // Where each slice's pairs start inside each expert's block.
  std::vector<std::int64_t> starts(Es * Ss, 0);
  if (plan.pairs > 0) {
    auto begin_d = exec::make_buffer<std::int64_t>(ex, Ss);
    auto starts_d = exec::make_buffer<std::int64_t>(ex, Es * Ss);
    exec::copy_n(ex, static_cast<const std::int64_t*>(row_begin.data()), Ss, begin_d.data());
    exec::for_each_n(ex, Es * Ss,
                     layout::segment_starts{plan.src_row.data(), plan.expert_offset(), begin_d.data(), starts_d.data(), S});
    to_host(ex, static_cast<const std::int64_t*>(starts_d.data()), starts.size(), starts.data());
  }
  std::vector<std::int64_t> counts(Ss * Es);  // [S][E]
  for (std::size_t e = 0; e < Es; ++e)
    for (std::size_t s = 0; s < Ss; ++s) {
      const std::int64_t end = s + 1 < Ss ? starts[e * Ss + s + 1] : plan.host_offset[e + 1];
      counts[s * Es + e] = plan.pairs > 0 ? end - starts[e * Ss + s] : 0;
    }
  c.dropped.resize(Es);
  c.kept = layout::keep_counts(cap, S, E, counts.data(), pairs.data(), c.dropped.data());
  std::vector<layout::drop_segment> seg(Es * Ss);
  std::vector<std::int64_t> kept_e(Es, 0);
  std::int64_t shift = 0;
  for (std::size_t e = 0; e < Es; ++e)
    for (std::size_t s = 0; s < Ss; ++s) {
      const std::int64_t n = counts[s * Es + e], keep = c.kept[s * Es + e];
      seg[e * Ss + s] = {starts[e * Ss + s], n, keep, shift, -1};
      shift += n - keep;
      kept_e[e] += keep;
    }
  if (shift == 0) return;
  const auto table = run_drop_pairs(cap, ex, seg, ids, weights, k, S, plan);
  auto src_row = exec::make_buffer<std::int64_t>(ex, plan.pairs);
  exec::for_each_n(ex, plan.pairs,
                   layout::compact_pairs{ids, plan.pos.data(), plan.src_row.data(), src_row.data(), table.data(), S});
  plan.src_row = std::move(src_row);
  // The plan's counts and offsets become the kept ones, on the host and in the summary.
  plan.host_counts = kept_e;
  std::int64_t at = 0;
  for (std::size_t e = 0; e < Es; ++e) {
    plan.host_offset[e] = at;
    at += kept_e[e];
  }
  plan.host_offset[Es] = at;
  exec::copy_n(ex, static_cast<const std::int64_t*>(plan.host_counts.data()), Es, plan.expert_counts());
  exec::copy_n(ex, static_cast<const std::int64_t*>(plan.host_offset.data()), Es + 1, plan.expert_offset());
}

// Step 3: the EP group's node figures (from the records on the all-to-all path, this
// rank's own tally on the masked path) and dropped pairs into the statistics.
inline void record_limits(layer_stats& st, const call_limits& c, const group_records* g, std::size_t ncounts) {
  if (!c.dropped.empty()) {
    st.dropped_per_expert = c.dropped;
    st.dropped_pairs = 0;
    for (std::size_t e = 0; e < c.dropped.size(); ++e) {
      st.dropped_pairs += c.dropped[e];
      st.tokens_per_expert[e] += c.dropped[e];  // the routing's load: kept and dropped
    }
    summarize_loads(st, static_cast<int>(st.rows_sent.size()), static_cast<int>(st.tokens_per_local_expert.size()));
  }
  if (!c.nodes) return;
  std::int64_t tokens = 0, sum = 0, mx = 0;
  if (g != nullptr && ncounts > 0) {
    for (int s = 0; s < g->size; ++s) {
      const std::int64_t* t = g->counts(s) + ncounts;
      tokens += t[0];
      sum += t[1];
      mx = std::max(mx, t[2]);
    }
  } else {
    tokens = c.tally[0];
    sum = c.tally[1];
    mx = c.tally[2];
  }
  st.max_nodes_per_token = mx;
  st.mean_nodes_per_token = tokens > 0 ? static_cast<double>(sum) / static_cast<double>(tokens) : 0.0;
}

}  // namespace epx::detail
