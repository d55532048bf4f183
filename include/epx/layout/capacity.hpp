// epx/layout/capacity.hpp: expert capacity and token dropping (spec section 8).
//
// Off by default. With a capacity, each sending rank keeps at most C_s(e) of its pairs for
// expert e and drops the rest:
//   local  (Switch Transformer): C = ceil(factor * n * k / E) per sending rank, n its rows;
//   global (over the EP group):  C = ceil(factor * P / E) per expert, P all pairs the group
//          dispatches; ranks fill it in ep-rank order: rank q keeps
//          min(count[q][e], max(0, C - sum_{q' < q} count[q'][e])).
// `rows` > 0 gives C directly (an absolute capacity, pairs per expert) instead of a factor.
// Which of a rank's pairs for e stay: by position (ascending row, then slot) or by score
// (descending routing weight, ties to ascending row, then slot).
//
// Both modes need nothing but the counts of the count exchange (keep_counts, on the host).
// The device side works on the send plan (epx/layout/plan.hpp), whose send order holds the
// pairs of expert e of each source as one segment in (row, slot) order. On the all-to-all
// path (one source) the plan's scatter applies the cut as it places the pairs
// (layout::plan_cut): by position the dropped pairs never get a position; by score, when
// many pairs are in overflowing segments, every pair's weight key and slot are also
// written at its send position, drop_pairs' scratch (keyed_slot). The functors here:
//   drop_pairs (one call per segment) keeps `keep` of its `count` pairs: the kept ones stay
//     at the front of the segment in (row, slot) order (with their pos and src_row), the
//     dropped ones get pos = -1 and leave src_row = -1 holes at the segment's end. Segments
//     that keep everything are not touched; by position only the dropped pairs are
//     visited, by score every pair of a segment that drops (fill_scratch reads them in one
//     sweep over the pairs when there are many);
//   compact_pairs (one call per pair) closes the holes: the masked path's local buffer is
//     laid out from the kept pairs only;
//   segment_starts (one call per segment) finds where each source's rows start inside an
//     expert's block when one plan holds several sources (the masked path).
// A dropped pair has no send position, like a masked slot: it moves no row, adds nothing to
// out[t] and gets grad_w = 0 (epx/kernels treat pos < 0 so).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"

namespace epx {

enum class capacity_mode : int { off = 0, local = 1, global = 2 };

// Which of a rank's pairs for an expert stay when it has more than its capacity.
enum class drop_priority : int {
  position = 0,  // ascending row, then slot
  score = 1,     // descending routing weight; ties to ascending row, then slot
};

inline const char* to_string(capacity_mode m) noexcept {
  switch (m) {
    case capacity_mode::off: return "off";
    case capacity_mode::local: return "local";
    case capacity_mode::global: return "global";
  }
  return "?";
}

inline const char* to_string(drop_priority p) noexcept {
  return p == drop_priority::position ? "position" : p == drop_priority::score ? "score" : "?";
}

struct capacity_policy {
  capacity_mode mode = capacity_mode::off;
  double factor = 1.0;     // C = ceil(factor * pairs / E), evaluated in double as written
  std::int64_t rows = 0;   // > 0: C = rows (pairs per expert), the factor is not used
  drop_priority priority = drop_priority::position;

  bool enabled() const noexcept { return mode != capacity_mode::off; }

  // The capacity of one expert when `pairs` pairs are spread over E experts.
  std::int64_t limit(std::int64_t pairs, int E) const noexcept {
    if (rows > 0) return rows;
    const double c = std::ceil(factor * static_cast<double>(pairs) / static_cast<double>(E));
    return c >= 9.0e18 ? INT64_MAX : static_cast<std::int64_t>(c);
  }

  // errc::configuration naming the values: an unknown mode or priority, a negative or
  // non-finite factor, a negative `rows`, and (when on) a zero factor without `rows`.
  void validate() const {
    const int m = static_cast<int>(mode), p = static_cast<int>(priority);
    EPX_REQUIRE(m >= 0 && m <= 2, errc::configuration, "capacity.mode (", m, ") must be off, local or global");
    EPX_REQUIRE(p >= 0 && p <= 1, errc::configuration, "capacity.priority (", p, ") must be position or score");
    EPX_REQUIRE(std::isfinite(factor) && factor >= 0.0, errc::configuration, "capacity.factor (", factor,
                ") must be a finite number >= 0");
    EPX_REQUIRE(rows >= 0, errc::configuration, "capacity.rows (", rows, ") must be >= 0 (0: use the factor)");
    EPX_REQUIRE(!enabled() || rows > 0 || factor > 0.0, errc::configuration, "capacity.factor (", factor,
                ") must be > 0 for capacity mode ", to_string(mode), " when capacity.rows is 0");
  }
};

namespace layout {

// kept[s][e] for `sources` senders in ep-rank order: counts_of(s) points at sender s's E
// counts (a row of the count exchange's matrix), pairs[s] = the pairs sender s dispatches
// (its rows times k). `dropped` (when not null, [E]) receives the pairs each expert loses.
template <class CountsOf, std::enable_if_t<std::is_invocable_v<CountsOf&, int>, int> = 0>
std::vector<std::int64_t> keep_counts(const capacity_policy& c, int sources, int E, CountsOf&& counts_of,
                                      const std::int64_t* pairs, std::int64_t* dropped = nullptr) {
  const auto S = static_cast<std::size_t>(sources), Es = static_cast<std::size_t>(E);
  std::vector<std::int64_t> kept(S * Es);
  if (dropped != nullptr)
    for (std::size_t e = 0; e < Es; ++e) dropped[e] = 0;
  const bool global = c.mode == capacity_mode::global;
  std::int64_t C = INT64_MAX;
  std::vector<std::int64_t> left;  // global: what the lower ep ranks left of each expert's capacity
  if (global) {
    std::int64_t P = 0;
    for (std::size_t s = 0; s < S; ++s) P += pairs[s];
    C = c.limit(P, E);
    left.assign(Es, C);
  }
  for (std::size_t s = 0; s < S; ++s) {
    const std::int64_t* n = counts_of(static_cast<int>(s));
    std::int64_t* k = kept.data() + s * Es;
    if (c.mode == capacity_mode::local) C = c.limit(pairs[s], E);
    for (std::size_t e = 0; e < Es; ++e) {
      const std::int64_t room = global ? left[e] : C;
      k[e] = n[e] < room ? n[e] : room;
      if (global) left[e] = room - k[e];
      if (dropped != nullptr) dropped[e] += n[e] - k[e];
    }
  }
  return kept;
}

// The same over a contiguous count matrix [sources][E].
inline std::vector<std::int64_t> keep_counts(const capacity_policy& c, int sources, int E, const std::int64_t* counts,
                                             const std::int64_t* pairs, std::int64_t* dropped = nullptr) {
  return keep_counts(
      c, sources, E, [&](int s) { return counts + static_cast<std::size_t>(s) * static_cast<std::size_t>(E); }, pairs,
      dropped);
}

// A float's bits as an unsigned key that orders like the float (-0 as +0): the weight
// order of capacity by score.
EPX_HOST_DEVICE inline std::uint32_t order_key(float w) noexcept {
  std::uint32_t u = epx::detail::float_bits(w);
  if ((u & 0x7fffffffu) == 0) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A pair's entry in drop_pairs' scratch: its weight's order_key above its slot j. With the
// row at its send position p the entry names the pair, src_row[p] * k + j, so one 64-bit
// word is all the selection reads and writes per pair.
EPX_HOST_DEVICE inline std::uint64_t keyed_slot(float w, std::int64_t j) noexcept {
  return static_cast<std::uint64_t>(order_key(w)) << 32 | static_cast<std::uint64_t>(j);
}

// The pair (row * k + slot) of expert e at send position p: the slot of p's row whose id is
// e and whose position is p; -1 for an inconsistent plan.
EPX_HOST_DEVICE inline std::int64_t pair_at_position(const std::int32_t* ids, const std::int64_t* pos,
                                                     const std::int64_t* src_row, int top_k, std::int64_t p,
                                                     int e) noexcept {
  const std::int64_t base = src_row[p] * top_k;
  for (int j = 0; j < top_k; ++j)
    if (ids[base + j] == e && pos[base + j] == p) return base + j;
  return -1;
}

// One segment of the send order: `count` pairs of one source for one expert from position
// `begin`, of which `keep` stay; `shift` = pairs dropped in all earlier segments (for
// compact_pairs); `scratch` = where the segment's `count` entries start in drop_pairs'
// scratch arrays (score priority, segments that drop), else -1.
struct drop_segment {
  std::int64_t begin;
  std::int64_t count;
  std::int64_t keep;
  std::int64_t shift;
  std::int64_t scratch;
};

// Call with g in [0, segments). For the segment's positions p in [begin, begin + count),
// src_row[p] is the row of the pair there and pos[row*k + j] == p for its slot j, with
// ids[row*k + j] == e (the segment's expert, e = g / sources). With keep < count:
//   position priority: positions [begin + keep, begin + count) are dropped;
//   score priority: the keep pairs of largest weight (ties to the lower position) stay,
//     moved to [begin, begin + keep) in position order;
// every dropped pair gets pos = -1, every freed position src_row = -1. `by_score` picks
// the priority; `keyed` is the scratch (keyed_slot entries) of the segments with a
// `scratch` offset (score priority, see scratch_size), null when none has one.
struct drop_pairs {
  // Up to this many dropped pairs a segment keeps them in a sorted list in one pass; more,
  // and the digit selection costs less than the list's insertions.
  static constexpr int few = 4;
  // The most pairs one segment may hold (the selection counts in 32 bits); callers check
  // with check_segment before launching.
  static constexpr std::int64_t max_segment_pairs = 0xffffffff;
  static void check_segment(std::int64_t count) {
    EPX_REQUIRE(count <= max_segment_pairs, errc::input, "capacity: one expert's segment holds ", count,
                " pairs; at most ", max_segment_pairs, " are supported per call");
  }

  const std::int32_t* ids;      // [pairs]
  const float* weights;         // [pairs] (score priority)
  std::int64_t* pos;            // [pairs]
  std::int64_t* src_row;        // [pairs] row of each send position
  const drop_segment* segments; // [segments]
  std::uint64_t* keyed;         // [scratch_size] or null
  int top_k;
  int sources;                  // segments per expert
  bool by_score;
  bool prefilled;               // score priority: the scratch is filled (fill_scratch, or the scatter)

  // Scratch entries a segment of `count` pairs keeping `keep` needs (score priority).
  static std::int64_t scratch_size(std::int64_t count, std::int64_t keep) noexcept {
    return keep < count ? count : 0;
  }

  // The pair at position p of expert e.
  EPX_HOST_DEVICE std::int64_t pair_at(std::int64_t p, int e) const noexcept {
    return pair_at_position(ids, pos, src_row, top_k, p, e);
  }

  // The scratch entry of position p of expert e found from its row (not prefilled);
  // returns it after storing it at p + o.
  EPX_HOST_DEVICE std::uint64_t fill(std::int64_t p, int e, std::int64_t o) const noexcept {
    const std::int64_t i = pair_at(p, e);
    return keyed[p + o] = keyed_slot(weights[i], i - src_row[p] * top_k);
  }

  // The pair of position p from its scratch entry (src_row[p] still the position's row).
  EPX_HOST_DEVICE std::int64_t pair_of(std::int64_t p, std::uint64_t entry) const noexcept {
    return src_row[p] * top_k + static_cast<std::int64_t>(entry & 0xffffffffu);
  }

  EPX_HOST_DEVICE void operator()(std::size_t g) const {
    const drop_segment s = segments[g];
    if (s.keep >= s.count) return;
    const int e = static_cast<int>(g / static_cast<std::size_t>(sources));
    const std::int64_t b = s.begin, end = s.begin + s.count;
    if (!by_score) {
      for (std::int64_t p = b + s.keep; p < end; ++p) {
        const std::int64_t i = pair_at(p, e);
        if (i >= 0) pos[i] = -1;
        src_row[p] = -1;
      }
      return;
    }
    // The d = count - keep pairs that go are the d smallest keys, ties to the higher
    // position. At most `few` of them: one pass keeps them in a small sorted list, a second
    // one moves the others. Else a radix selection over the segment's scratch.
    const std::int64_t d = s.count - s.keep;
    const std::int64_t o = s.scratch - b;  // scratch entry of position p: p + o
    if (d <= few && s.count <= 0xffffffff) {
      // How bad pair p is, as one number: its key's complement above its offset in the
      // segment (a smaller key, or the same key at a higher position, is worse). The list
      // holds the d worst so far, worst first; most pairs are better than its last entry.
      std::uint64_t wv[few];
      int n = 0;
      std::uint64_t last = 0;  // wv[n - 1] once the list is full
      for (std::int64_t p = b; p < end; ++p) {
        const std::uint64_t entry = prefilled ? keyed[p + o] : fill(p, e, o);
        const std::uint64_t v = (~entry & 0xffffffff00000000ull) | static_cast<std::uint64_t>(p - b);
        if (n == d && v < last) continue;
        int at = n < d ? n : n - 1;
        while (at > 0 && v > wv[at - 1]) {
          wv[at] = wv[at - 1];
          --at;
        }
        wv[at] = v;
        if (n < d) ++n;
        last = wv[n - 1];
      }
      std::int64_t wp[few];  // the dropped positions, ascending
      for (int r = 0; r < n; ++r) {
        const std::int64_t q = b + static_cast<std::int64_t>(wv[r] & 0xffffffffu);
        int at = r;
        for (; at > 0 && wp[at - 1] > q; --at) wp[at] = wp[at - 1];
        wp[at] = q;
      }
      // Positions before the first dropped one keep their pairs.
      std::int64_t at = wp[0];
      int next = 0;
      for (std::int64_t p = wp[0]; p < end; ++p) {
        const std::int64_t i = pair_of(p, keyed[p + o]);
        if (next < n && wp[next] == p) {
          ++next;
          pos[i] = -1;
        } else {
          pos[i] = at;
          src_row[at] = src_row[p];  // at <= p: this position was already read
          ++at;
        }
      }
      for (std::int64_t p = at; p < end; ++p) src_row[p] = -1;
      return;
    }
    for (std::int64_t p = b; p < end && !prefilled; ++p) fill(p, e, o);
    const auto key = [&](std::int64_t p) { return static_cast<std::uint32_t>(keyed[p + o] >> 32); };
    // The keep-th largest key, a digit at a time, on the bits under `mask`; `need` ends as
    // the number of pairs whose masked key is `prefix` that stay (the first ones in
    // position order). The bits every key shares start the prefix, so the first digit
    // starts at the highest bit the keys do not share (one expert's weights mostly share
    // their sign and exponent bits). When every pair of the chosen bucket stays, the lower
    // bits do not matter and the selection stops there. On the host a digit has 11 bits,
    // and once the chosen bucket fits a local array its keys are gathered there, so that
    // the next digits read them instead of the whole segment; the segment is read three
    // times in all (shared bits, first digit, gather) before the pass that moves the pairs.
    // The histogram adds the match (0 or 1) instead of branching on it. The device's
    // variant (EPX_DEVICE_ALGORITHMS: also the emulated tests') keeps a small frame: 8-bit
    // digits, no gathering, every digit reads the segment.
#if EPX_DEVICE_ALGORITHMS
    constexpr int digit_max = 8, gathered_max = 0;
    const int digit = 8;
#else
    constexpr int digit_max = 11, gathered_max = 1024;
    const int digit = s.count >= 2048 ? 11 : 8;  // a histogram not much larger than the segment
#endif
    std::uint32_t all_or = 0, all_and = ~std::uint32_t{0};
    for (std::int64_t p = b; p < end; ++p) {
      all_or |= key(p);
      all_and &= key(p);
    }
    const std::uint32_t differ = all_or ^ all_and;
    int hi = 32;  // the digit covers bits [hi - digit, hi)
    while (hi > 0 && ((differ >> (hi - 1)) & 1u) == 0) --hi;
    std::uint32_t mask = hi >= 32 ? 0u : ~std::uint32_t{0} << hi;
    std::uint32_t prefix = all_and & mask;
    std::int64_t need = s.keep;
    if (need > 0 && differ != 0) {
      std::uint32_t gathered[gathered_max + 1];
      if (gathered_max == 0) gathered[0] = 0;  // never read there; some compilers' warnings think otherwise
      std::int64_t ng = -1;  // keys in `gathered`; -1: read the segment
      for (; hi > 0; hi -= digit) {
        const int shift = hi > digit ? hi - digit : 0;
        const std::uint32_t dm = (std::uint32_t{1} << (hi - shift)) - 1u;
        // 32-bit counts (a segment holds fewer than 2^32 pairs: max_segment_pairs): on a
        // GPU the frame is local memory reserved for every resident thread.
        std::uint32_t hist[std::size_t{1} << digit_max];
        for (std::uint32_t h = 0; h <= dm; ++h) hist[h] = 0;
        if (ng < 0) {
          for (std::int64_t p = b; p < end; ++p)
            hist[(key(p) >> shift) & dm] += static_cast<std::uint32_t>((key(p) & mask) == prefix);
        } else {
          for (std::int64_t i = 0; i < ng; ++i) ++hist[(gathered[i] >> shift) & dm];
        }
        std::uint32_t h = dm;
        for (; h > 0 && need > static_cast<std::int64_t>(hist[h]); --h) need -= static_cast<std::int64_t>(hist[h]);
        prefix |= h << shift;
        mask |= dm << shift;
        if (need == static_cast<std::int64_t>(hist[h]) || shift == 0) break;
        // Deeper: the chosen bucket's keys into `gathered` (without a branch: a store and
        // a compare per key), when they fit.
        if (ng < 0 && hist[h] <= gathered_max) {
          ng = 0;
          for (std::int64_t p = b; p < end; ++p) {
            gathered[ng] = key(p);
            ng += static_cast<std::int64_t>((key(p) & mask) == prefix);
          }
        } else if (ng >= 0) {
          std::int64_t m = 0;
          for (std::int64_t i = 0; i < ng; ++i) {
            gathered[m] = gathered[i];
            m += static_cast<std::int64_t>((gathered[i] & mask) == prefix);
          }
          ng = m;
        }
      }
    }
    std::int64_t at = b;
    for (std::int64_t p = b; p < end; ++p) {
      const std::int64_t i = pair_of(p, keyed[p + o]);
      const std::uint32_t kp = key(p) & mask;
      bool stay = s.keep > 0 && kp > prefix;
      if (s.keep > 0 && kp == prefix && need > 0) {
        stay = true;
        --need;
      }
      if (stay) {
        pos[i] = at;
        src_row[at] = src_row[p];  // at <= p: this position was already read
        ++at;
      } else {
        pos[i] = -1;
      }
    }
    for (std::int64_t p = at; p < end; ++p) src_row[p] = -1;
  }
};

// Capacity by score as a sort (device policies with a Thrust execution policy,
// epx/exec/thrust.hpp): drop_pairs' selection without a thread per segment. Over the M
// positions of the segments that drop (`score_segment`s, in order, the d-th starting at
// entry `at`), m in [0, M):
//   score_entries writes each position's sort key (d above the complement of its pair's
//     order_key: ascending keys are descending weights), its pair, its row and d;
//   a stable sort by key (Thrust) keeps position order among equal weights, so the first
//     `keep` entries of each segment are the pairs that stay (ties to the lower position,
//     as drop_pairs);
//   score_keep marks them at their positions; an exclusive scan by segment (Thrust)
//     numbers the kept ones in position order;
//   score_place moves the kept pairs to the front of their segment in that order, drops
//     the others (pos = -1) and frees the segment's tail (src_row = -1): drop_pairs' result,
//     bit for bit.
struct score_segment {
  std::int64_t begin;  // first position in the send order
  std::int64_t count;
  std::int64_t keep;
  std::int64_t at;     // first entry of the M
  int expert;
};

// Call with m in [0, M).
struct score_entries {
  const std::int32_t* ids;       // [pairs]
  const float* weights;          // [pairs]
  const std::int64_t* pos;       // [pairs]
  const std::int64_t* src_row;   // [pairs] row of each send position
  const score_segment* segments; // [D]
  int D;
  int top_k;
  std::uint64_t* key;            // [M]
  std::int64_t* order;           // [M] m (the sort's values)
  std::int64_t* pair;            // [M]
  std::int64_t* row;             // [M]
  std::int32_t* seg_of;          // [M]

  EPX_HOST_DEVICE void operator()(std::size_t mi) const {
    const auto m = static_cast<std::int64_t>(mi);
    int lo = 0, hi = D;  // the last segment with at <= m
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      if (segments[mid].at <= m) lo = mid;
      else hi = mid;
    }
    const score_segment s = segments[lo];
    const std::int64_t p = s.begin + (m - s.at);
    const std::int64_t i = pair_at_position(ids, pos, src_row, top_k, p, s.expert);
    key[m] = static_cast<std::uint64_t>(lo) << 32 | static_cast<std::uint64_t>(~order_key(weights[i]));
    order[m] = m;
    pair[m] = i;
    row[m] = src_row[p];
    seg_of[m] = lo;
  }
};

// Call with j in [0, M) after the sort: kept[order[j]] = whether rank j within its segment
// is under the segment's keep.
struct score_keep {
  const std::uint64_t* key;       // [M] sorted
  const std::int64_t* order;      // [M] sorted
  const score_segment* segments;  // [D]
  std::int32_t* kept;             // [M]

  EPX_HOST_DEVICE void operator()(std::size_t j) const {
    const score_segment s = segments[key[j] >> 32];
    kept[order[j]] = static_cast<std::int64_t>(j) - s.at < s.keep ? 1 : 0;
  }
};

// Call with m in [0, M) after the scan (rank[m]: kept entries of m's segment before m).
struct score_place {
  const score_segment* segments;  // [D]
  const std::int32_t* seg_of;     // [M]
  const std::int32_t* kept;       // [M]
  const std::int64_t* rank;       // [M]
  const std::int64_t* pair;       // [M]
  const std::int64_t* row;        // [M]
  std::int64_t* pos;              // [pairs]
  std::int64_t* src_row;          // [pairs]

  EPX_HOST_DEVICE void operator()(std::size_t mi) const {
    const auto m = static_cast<std::int64_t>(mi);
    const score_segment s = segments[seg_of[m]];
    if (kept[m] != 0) {
      const std::int64_t q = s.begin + rank[m];  // < begin + keep
      pos[pair[m]] = q;
      src_row[q] = row[m];
    } else {
      pos[pair[m]] = -1;
    }
    if (m - s.at >= s.keep) src_row[s.begin + (m - s.at)] = -1;  // the tail: >= begin + keep
  }
};

// Call with i in [0, pairs) before drop_pairs (score priority, when many positions are in
// segments that drop): the scratch entry (keyed_slot) of every such position, from one
// sequential sweep over the pairs instead of a lookup per position.
struct fill_scratch {
  const std::int32_t* ids;       // [pairs]
  const float* weights;          // [pairs]
  const std::int64_t* pos;       // [pairs]
  const drop_segment* segments;  // [E * sources]
  std::uint64_t* keyed;          // [scratch]
  int sources;
  int top_k;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::int64_t p = pos[i];
    if (p < 0) return;
    const drop_segment* seg = segments + static_cast<std::size_t>(ids[i]) * static_cast<std::size_t>(sources);
    int s = 0;
    while (s + 1 < sources && p >= seg[s + 1].begin) ++s;
    if (seg[s].scratch < 0) return;
    const std::int64_t at = seg[s].scratch + (p - seg[s].begin);
    keyed[at] = keyed_slot(weights[i], static_cast<std::int64_t>(i % static_cast<std::size_t>(top_k)));
  }
};

// Call with i in [0, pairs) after drop_pairs: closes the holes. pos[i] -= the segment's
// shift, and new_src_row[new position] = src_row[old position]. The segment of a kept pair
// is the one of its expert whose kept range holds its position.
struct compact_pairs {
  const std::int32_t* ids;       // [pairs]
  std::int64_t* pos;             // [pairs]
  const std::int64_t* src_row;   // [pairs] with holes
  std::int64_t* new_src_row;     // [kept pairs]
  const drop_segment* segments;  // [E * sources]
  int sources;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::int64_t p = pos[i];
    if (p < 0) return;
    const drop_segment* seg = segments + static_cast<std::size_t>(ids[i]) * static_cast<std::size_t>(sources);
    int s = 0;
    while (s + 1 < sources && p >= seg[s + 1].begin) ++s;
    const std::int64_t q = p - seg[s].shift;
    pos[i] = q;
    new_src_row[q] = src_row[p];
  }
};

// Call with g = e * sources + s in [0, E * sources): starts[g] = the first position of
// expert e's block whose row is >= row_begin[s] (src_row is ascending inside a block).
struct segment_starts {
  const std::int64_t* src_row;        // [pairs]
  const std::int64_t* expert_offset;  // [E+1]
  const std::int64_t* row_begin;      // [sources]
  std::int64_t* starts;               // [E * sources]
  int sources;

  EPX_HOST_DEVICE void operator()(std::size_t g) const {
    const std::size_t e = g / static_cast<std::size_t>(sources), s = g % static_cast<std::size_t>(sources);
    std::int64_t lo = expert_offset[e], hi = expert_offset[e + 1];
    const std::int64_t r = row_begin[s];
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (src_row[mid] < r)
        lo = mid + 1;
      else
        hi = mid;
    }
    starts[g] = lo;
  }
};

}  // namespace layout
}  // namespace epx
