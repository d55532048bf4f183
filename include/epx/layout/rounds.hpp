// epx/layout/rounds.hpp: the staged route in rounds, through a stage of bounded size.
//
// The staged route gathers its send rows into a buffer before the all-to-all and receives
// the experts' outputs into one after it: S = n*k rows each way, as many as the owners
// receive. In rounds it needs only a stage of about layer_options::stage_bytes:
//   round r holds the pairs of slice rows [r*T, (r+1)*T) of every rank (T rows per round,
//   the same on every rank: round_tokens), at most T*k rows;
//   dispatch: each round's rows are gathered into the stage and the segmented all-to-all
//   lands them at their place in the owners' expert-major buffers;
//   return: the owners send each round's rows back out of their expert-major buffers into
//   the stage, and the round's rows are combined (or reduced, in backward) into out before
//   the next round reuses the stage.
// Every rank makes the same number of rounds (the largest slice of the EP group decides);
// a rank whose slice is shorter sends and receives nothing in the later ones.
//
// The send plan (epx/layout/plan.hpp) keeps each segment (owner p, local expert l) in row
// order, kept pairs first (epx/layout/capacity.hpp), so a round is a run of positions in
// every segment: its rows are found by binary search on the plan's src_row. The stage
// holds a round's runs segment after segment. An owner learns how many rows each source
// sends it in each round from one all-to-all of the counts (the caller's), after plan_rounds.
// The results are bitwise those of one round: the same rows are copied, and out[t] adds
// its slots in the same order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/layout/receive.hpp"

namespace epx::detail {

// Slice rows per round: as many as fill `stage_bytes` with their k rows of `row_bytes`,
// at least 1.
inline std::size_t round_tokens(std::size_t stage_bytes, std::size_t k, std::size_t row_bytes) noexcept {
  const std::size_t per_row = std::max<std::size_t>(1, k * row_bytes);
  return std::max<std::size_t>(1, stage_bytes / per_row);
}

// The rounds of one rank (m = peers * L segments, as in `segments`).
struct staged_rounds {
  std::size_t tokens = 0;  // T, slice rows per round
  std::size_t count = 0;   // rounds, the same on every EP rank
  std::size_t rows = 0;    // n, this rank's slice rows
  std::size_t m = 0;       // segments
  std::vector<std::size_t> first;      // [count + 1][m] first send position of round r in segment i
  std::vector<std::size_t> stage_at;   // [count + 1] first row of round r in the rounds' stage order
  std::vector<std::int64_t> src;       // [stage_at[count]] slice row of each stage row, round after round
  std::vector<std::int64_t> send_pos;  // [stage_at[count]] its send position
  std::vector<std::int64_t> at;        // [n*k] row of pair (t, j) in its round's stage, -1 if dropped
  std::vector<std::size_t> recv;       // [count][m] rows that source p sends for local expert l in round r
  std::vector<std::size_t> recv_at;    // [count][m] where they land in the expert-major buffer

  std::size_t sent(std::size_t r) const noexcept { return stage_at[r + 1] - stage_at[r]; }
  // Rows of the largest round's stage.
  std::size_t stage_rows() const noexcept {
    std::size_t most = 0;
    for (std::size_t r = 0; r < count; ++r) most = std::max(most, sent(r));
    return most;
  }
  // Send counts of round r to peer p, local expert l (what `recv` of its owner becomes).
  std::size_t send_count(std::size_t r, std::size_t i) const noexcept {
    return first[(r + 1) * m + i] - first[r * m + i];
  }
};

// Rounds needed by a slice of n rows, T rows per round.
inline std::size_t rounds_for(std::size_t n, std::size_t T) noexcept { return n == 0 ? 0 : 1 + (n - 1) / T; }

// This rank's rounds: `count` rounds of `T` slice rows over its segments `g`
// (segments_of), from its plan's src_row ([S], host) and pos ([n*k], host). `recv` and
// `recv_at` are filled by set_received once the owners' counts are known. `scratch` holds
// one value per send position (kept between calls by the caller).
inline void plan_rounds(staged_rounds& o, const segments& g, std::size_t T, std::size_t count, const std::int64_t* src_row,
                        const std::int64_t* pos, std::size_t n, std::size_t k, std::vector<std::int64_t>& scratch) {
  const std::size_t m = g.send_counts.size();
  EPX_REQUIRE(T >= 1 && rounds_for(n, T) <= count, errc::internal, "staged rounds: ", count, " rounds of ", T,
              " rows cannot hold a slice of ", n, " rows");
  o.tokens = T;
  o.count = count;
  o.rows = n;
  o.m = m;
  o.first.assign((count + 1) * m, 0);
  std::size_t S = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const std::int64_t* b = src_row + g.send_displs[i];
    const std::int64_t* e = b + g.send_counts[i];
    for (std::size_t r = 0; r < count; ++r) {
      const auto row = static_cast<std::int64_t>(std::min(r * T, n));
      o.first[r * m + i] = g.send_displs[i] + static_cast<std::size_t>(std::lower_bound(b, e, row) - b);
    }
    o.first[count * m + i] = g.send_displs[i] + g.send_counts[i];  // every row is below n
    S = std::max(S, g.send_displs[i] + g.send_counts[i]);
  }
  // Stage order: round, then segment; `scratch` maps a send position to its stage row.
  o.stage_at.assign(count + 1, 0);
  o.src.resize(S);
  o.send_pos.resize(S);
  scratch.resize(S);
  std::size_t at = 0;
  for (std::size_t r = 0; r < count; ++r) {
    o.stage_at[r] = at;
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t q = o.first[r * m + i]; q < o.first[(r + 1) * m + i]; ++q) {
        o.src[at] = src_row[q];
        o.send_pos[at] = static_cast<std::int64_t>(q);
        scratch[q] = static_cast<std::int64_t>(at - o.stage_at[r]);
        ++at;
      }
  }
  o.stage_at[count] = at;
  o.src.resize(at);
  o.send_pos.resize(at);
  o.at.resize(n * k);
  for (std::size_t p = 0; p < n * k; ++p) o.at[p] = pos[p] < 0 ? -1 : scratch[static_cast<std::size_t>(pos[p])];
}

// The owner's side: recv[r][i] (source p, local expert l) from the counts every source
// sent it ([peers][count][L], as the all-to-all delivers them), and where each round's rows
// land in the expert-major buffer (after the earlier rounds' rows of the same source).
inline void set_received(staged_rounds& o, const segments& g, std::size_t L, const std::size_t* from_sources) {
  const std::size_t m = o.m, peers = L == 0 ? 0 : m / L;
  o.recv.assign(o.count * m, 0);
  o.recv_at.assign(o.count * m, 0);
  for (std::size_t p = 0; p < peers; ++p)
    for (std::size_t l = 0; l < L; ++l) {
      const std::size_t i = p * L + l;
      std::size_t at = g.recv_displs[i], total = 0;
      for (std::size_t r = 0; r < o.count; ++r) {
        const std::size_t c = from_sources[(p * o.count + r) * L + l];
        o.recv[r * m + i] = c;
        o.recv_at[r * m + i] = at;
        at += c;
        total += c;
      }
      EPX_REQUIRE(total == g.recv_counts[i], errc::internal, "staged rounds: source ", p, " sends ", total,
                  " rows for local expert ", l, " over the rounds, the count exchange said ", g.recv_counts[i]);
    }
}

// Round r as a segmented all-to-all (rows): the stage (segment after segment) to the
// expert-major buffer.
inline segments round_segments(const staged_rounds& o, std::size_t r) {
  segments s;
  const std::size_t m = o.m;
  s.send_counts.resize(m);
  s.send_displs.resize(m);
  s.recv_counts.assign(o.recv.begin() + static_cast<std::ptrdiff_t>(r * m),
                       o.recv.begin() + static_cast<std::ptrdiff_t>((r + 1) * m));
  s.recv_displs.assign(o.recv_at.begin() + static_cast<std::ptrdiff_t>(r * m),
                       o.recv_at.begin() + static_cast<std::ptrdiff_t>((r + 1) * m));
  std::size_t at = 0;
  for (std::size_t i = 0; i < m; ++i) {
    s.send_counts[i] = o.send_count(r, i);
    s.send_displs[i] = at;
    at += s.send_counts[i];
  }
  return s;
}

}  // namespace epx::detail
