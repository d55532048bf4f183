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
// pairs of expert e of each source as one segment in (row, slot) order:
//   drop_pairs (one call per segment) keeps `keep` of its `count` pairs: the kept ones stay
//     at the front of the segment in (row, slot) order (with their pos and src_row), the
//     dropped ones get pos = -1 and leave src_row = -1 holes at the segment's end. Segments
//     that keep everything are not touched;
//   compact_pairs (one call per pair) closes the holes: the masked path's local buffer is
//     laid out from the kept pairs only.
// A dropped pair has no send position, like a masked slot: it moves no row, adds nothing to
// out[t] and gets grad_w = 0 (epx/kernels treat pos < 0 so).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
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

// kept[s][e] for `sources` senders in ep-rank order: counts [sources][E] (the count
// exchange's matrix), pairs[s] = the pairs sender s dispatches (its rows times k).
inline std::vector<std::int64_t> keep_counts(const capacity_policy& c, int sources, int E,
                                             const std::int64_t* counts, const std::int64_t* pairs) {
  const auto S = static_cast<std::size_t>(sources), Es = static_cast<std::size_t>(E);
  std::vector<std::int64_t> kept(counts, counts + S * Es);
  if (!c.enabled()) return kept;
  if (c.mode == capacity_mode::local) {
    for (std::size_t s = 0; s < S; ++s) {
      const std::int64_t C = c.limit(pairs[s], E);
      for (std::size_t e = 0; e < Es; ++e) kept[s * Es + e] = std::min(kept[s * Es + e], C);
    }
    return kept;
  }
  std::int64_t P = 0;
  for (std::size_t s = 0; s < S; ++s) P += pairs[s];
  const std::int64_t C = c.limit(P, E);
  for (std::size_t e = 0; e < Es; ++e) {
    std::int64_t before = 0;  // pairs of e from lower ep ranks
    for (std::size_t s = 0; s < S; ++s) {
      const std::int64_t n = counts[s * Es + e];
      const std::int64_t room = C - before > 0 ? C - before : 0;
      kept[s * Es + e] = n < room ? n : room;
      before += n;
    }
  }
  return kept;
}

// One segment of the send order: `count` pairs of one source for one expert from position
// `begin`, of which `keep` stay; `shift` = pairs dropped in all earlier segments (for
// compact_pairs). Int64 fields only, so a table of them copies as [segments][4] int64.
struct drop_segment {
  std::int64_t begin;
  std::int64_t count;
  std::int64_t keep;
  std::int64_t shift;
};

// Call with g in [0, segments). For the segment's positions p in [begin, begin + count),
// src_row[p] is the row of the pair there and pos[row*k + j] == p for its slot j, with
// ids[row*k + j] == e (the segment's expert, `expert_of` = g / sources). With keep < count:
//   position priority: positions [begin + keep, begin + count) are dropped;
//   score priority: the keep pairs of largest weight (ties to the lower position) stay,
//     moved to [begin, begin + keep) in position order;
// every dropped pair gets pos = -1, every freed position src_row = -1. `pair_of` and `key`
// ([pairs] each) are scratch for score priority (null for position priority).
struct drop_pairs {
  const std::int32_t* ids;      // [pairs]
  const float* weights;         // [pairs] (score priority)
  std::int64_t* pos;            // [pairs]
  std::int64_t* src_row;        // [pairs] row of each send position
  const drop_segment* segments; // [segments]
  std::int64_t* pair_of;        // [pairs] scratch (score priority) or null
  std::uint32_t* key;           // [pairs] scratch (score priority) or null
  int top_k;
  int sources;                  // segments per expert

  // A float's bits as an unsigned key that orders like the float (-0 as +0).
  EPX_HOST_DEVICE static std::uint32_t order_key(float w) noexcept {
    std::uint32_t u = epx::detail::float_bits(w);
    if ((u & 0x7fffffffu) == 0) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }

  // The pair at position p of expert e.
  EPX_HOST_DEVICE std::int64_t pair_at(std::int64_t p, int e) const noexcept {
    const std::int64_t base = src_row[p] * top_k;
    for (int j = 0; j < top_k; ++j)
      if (ids[base + j] == e && pos[base + j] == p) return base + j;
    return -1;  // not reached for a consistent plan
  }

  EPX_HOST_DEVICE void operator()(std::size_t g) const {
    const drop_segment s = segments[g];
    if (s.keep >= s.count) return;
    const int e = static_cast<int>(g / static_cast<std::size_t>(sources));
    const std::int64_t b = s.begin, end = s.begin + s.count;
    if (pair_of == nullptr) {
      for (std::int64_t p = b + s.keep; p < end; ++p) {
        const std::int64_t i = pair_at(p, e);
        if (i >= 0) pos[i] = -1;
        src_row[p] = -1;
      }
      return;
    }
    for (std::int64_t p = b; p < end; ++p) {
      const std::int64_t i = pair_at(p, e);
      pair_of[p] = i;
      key[p] = order_key(weights[i]);
    }
    // The keep-th largest key, 8 bits at a time; `need` ends as the number of pairs with
    // exactly that key that stay (the first ones in position order).
    std::uint32_t prefix = 0, mask = 0;
    std::int64_t need = s.keep;
    if (need > 0) {
      for (int shift = 24; shift >= 0; shift -= 8) {
        std::int64_t hist[256];
        for (int h = 0; h < 256; ++h) hist[h] = 0;
        for (std::int64_t p = b; p < end; ++p)
          if ((key[p] & mask) == prefix) ++hist[(key[p] >> shift) & 0xffu];
        int h = 255;
        for (; h > 0 && need > hist[h]; --h) need -= hist[h];
        prefix |= static_cast<std::uint32_t>(h) << shift;
        mask |= 0xffu << shift;
      }
    }
    std::int64_t at = b;
    for (std::int64_t p = b; p < end; ++p) {
      const std::int64_t i = pair_of[p];
      const std::uint32_t kp = key[p];
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
