// epx/comm/threads/agreement.hpp: how the threads backend checks that the members of a
// collective called it alike.
//
// Every member publishes its call (the collective, datatype, counts, root, scale, buffers)
// in its slot of the group (epx/comm/threads/state.hpp). Once the entry barrier has passed,
// every member reads every slot and reaches the same verdict: calls that disagree
// (different collectives, datatypes, counts, segment counts, roots or scales, or what a
// sender sends against what its receiver expects) raise epx::error(errc::communicator) on
// every member, naming the ranks and values; a member's own fault (overlapping buffers, a
// null buffer that claims bytes, an unknown datatype) raises errc::input on every member.
// Before that, a member that copies from a peer
// as soon as the peer has published checks only the pair (threads_pair_matches).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "epx/comm/datatype.hpp"
#include "epx/comm/threads/state.hpp"
#include "epx/core/error.hpp"

namespace epx::detail {

// "rank 2", or "rank 2 (world rank 6)" inside a sub-communicator.
inline std::string threads_who(const threads_group& g, int r) {
  std::string s = "rank " + std::to_string(r);
  if (g.world_rank(r) != r) s += " (world rank " + std::to_string(g.world_rank(r)) + ")";
  return s;
}

// Whether peer p's published call (collective `seq` of group `g`) agrees with rank me's on
// what me reads from it. Both calls must be published.
inline bool threads_pair_matches(threads_group& g, std::uint64_t seq, int me, int p) noexcept {
  const auto& mine = g.slot(seq, me);
  const auto& s = g.slot(seq, p);
  if (s.op != mine.op || s.type != mine.type || !s.fault.empty() || !mine.fault.empty()) return false;
  switch (mine.op) {
    case threads_op::all_to_allv:
    case threads_op::all_to_allv_segments:
    case threads_op::all_to_allv_indexed: {
      if (s.count != mine.count || s.row_elems != mine.row_elems) return false;
      const std::size_t nseg = mine.count;
      for (std::size_t i = 0; i < nseg; ++i)
        if (s.send_counts[static_cast<std::size_t>(me) * nseg + i] !=
            mine.recv_counts[static_cast<std::size_t>(p) * nseg + i])
          return false;
      return true;
    }
    case threads_op::broadcast: return s.count == mine.count && s.root == mine.root;
    default: return s.count == mine.count;
  }
}

// The first member's fault in collective `seq` of group `g` (threads_slot::fault), named:
// empty if none. Every member reads the same slots, so every member reaches the same verdict.
inline std::string threads_check_faults(threads_group& g, std::uint64_t seq) {
  for (int r = 0; r < g.size(); ++r) {
    const auto& s = g.slot(seq, r);
    if (!s.fault.empty()) return concat(to_string(s.op), ": ", threads_who(g, r), " ", s.fault);
  }
  return {};
}

// Two scales agree when their bits do (two NaN scales alike agree).
inline bool threads_same_scale(double a, double b) noexcept {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// Empty if every member's published call (collective `seq` of group `g`) agrees; otherwise
// names the values. Every member reads the same slots, so every member reaches the same
// verdict.
inline std::string threads_check_match(threads_group& g, std::uint64_t seq) {
  auto slot = [&](int r) -> const threads_slot& { return g.slot(seq, r); };
  auto who = [&](int r) { return threads_who(g, r); };
  const int n = g.size();
  const auto& s0 = slot(0);
  for (int r = 1; r < n; ++r) {
    const auto& s = slot(r);
    if (s.op != s0.op)
      return concat("mismatched collectives: ", who(0), " called ", to_string(s0.op), ", ", who(r),
                    " called ", to_string(s.op));
  }
  const auto op = s0.op;
  if (op == threads_op::barrier || op == threads_op::split) return {};
  for (int r = 1; r < n; ++r) {
    const auto& s = slot(r);
    if (s.type != s0.type)
      return concat(to_string(op), ": mismatched datatypes: ", who(0), " passed ", to_string(s0.type),
                    ", ", who(r), " passed ", to_string(s.type));
  }
  if (op == threads_op::all_to_allv || op == threads_op::all_to_allv_segments ||
      op == threads_op::all_to_allv_indexed) {
    const bool segmented = op != threads_op::all_to_allv;
    const bool indexed = op == threads_op::all_to_allv_indexed;
    for (int r = 1; r < n; ++r)
      if (slot(r).count != s0.count)
        return concat(to_string(op), ": mismatched segment counts: ", who(0), " passed ", s0.count,
                      " segments per peer, ", who(r), " passed ", slot(r).count);
    for (int r = 1; r < n; ++r)
      if (slot(r).row_elems != s0.row_elems)
        return concat(to_string(op), ": mismatched row widths: ", who(0), " passed ", s0.row_elems,
                      " elements per row, ", who(r), " passed ", slot(r).row_elems);
    const std::size_t nseg = s0.count;
    for (int src = 0; src < n; ++src)
      for (int dst = 0; dst < n; ++dst)
        for (std::size_t i = 0; i < nseg; ++i) {
          const std::size_t sent = slot(src).send_counts[static_cast<std::size_t>(dst) * nseg + i];
          const std::size_t expected = slot(dst).recv_counts[static_cast<std::size_t>(src) * nseg + i];
          if (sent != expected)
            return concat(to_string(op), ": mismatched counts: ", who(src), " sends ", sent,
                          indexed ? " rows" : " elements",
                          segmented ? concat(" in segment ", i) : std::string(), " to ", who(dst),
                          ", which expects ", expected, " from it");
        }
    return {};
  }
  for (int r = 1; r < n; ++r) {
    const auto& s = slot(r);
    if (s.count != s0.count)
      return concat(to_string(op), ": mismatched counts: ", who(0), " passed ", s0.count, ", ", who(r),
                    " passed ", s.count);
    if (op == threads_op::broadcast && s.root != s0.root)
      return concat("broadcast: mismatched roots: ", who(0), " passed ", s0.root, ", ", who(r),
                    " passed ", s.root);
    if ((op == threads_op::all_reduce || op == threads_op::reduce_scatter) &&
        !threads_same_scale(s.scale, s0.scale))
      return concat(to_string(op), ": mismatched scales: ", who(0), " passed ", s0.scale, ", ", who(r),
                    " passed ", s.scale);
  }
  return {};
}

}  // namespace epx::detail
