// epx/layout/receive.hpp: where every routed row lives, on every member of an EP group.
//
// The one place the receive layout is computed. Every implementation and route reads it:
//   - the staged route: its own send and receive segments (segments_of);
//   - the direct route: row records of every member (for_each_received / for_each_returned);
//   - the masked path: one source (the rank itself) and its own local experts.
//
// Input: the count matrix counts(s)[e], pairs member s sends to global expert e (E = owners
// * L; owner d holds experts [d*L, (d+1)*L)), as the count exchange gathers it. From it:
//   send order of member s: experts in order, so expert e's pairs start at the prefix sum
//     of s's counts (send_at);
//   expert-major buffer of owner d: local expert l holds the rows of source 0, 1, ...
//     (recv_at), then the zero padding rows (epx/layout/padding.hpp); expert l starts at
//     offsets(d)[l], and offsets(d)[L] is the buffer's row count.
// The row records walk these maps row by row:
//   dispatch: owner d's expert-major row i <- send position q of source s;
//   return:   send position p of member s <- row r of owner d's expert-major buffer.
// With a capacity (epx/layout/capacity.hpp) member s's send order keeps its plan's
// positions, sent(s)[e] of them per expert, of which the first counts(s)[e] travel: the
// dropped pairs leave holes at the end of each expert's block (make_receive_layout with
// sent_of).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/layout/padding.hpp"

namespace epx::detail {

struct receive_layout {
  int sources = 0;  // members that send (the EP group; 1 on the masked path)
  int owners = 0;   // members that own experts (ep)
  int L = 0;        // local experts per owner
  std::vector<std::int64_t> counts;        // [sources][E]
  std::vector<std::size_t> send_offset;    // [sources][E]: first send position of expert e at source s
  std::vector<std::size_t> recv_displ;     // [owners][sources][L]: first row of s's rows of local expert l at d
  std::vector<std::size_t> expert_offset;  // [owners][L+1]: first row of local expert l at d, padding included
  std::vector<std::size_t> received_rows;  // [owners][L]: rows local expert l of d receives (no padding)
  std::vector<std::size_t> send_size;      // [sources]: positions of s's send order (holes included)

  std::size_t E() const noexcept { return static_cast<std::size_t>(owners) * static_cast<std::size_t>(L); }
  std::int64_t count(int s, std::size_t e) const noexcept { return counts[static_cast<std::size_t>(s) * E() + e]; }
  std::size_t send_at(int s, std::size_t e) const noexcept { return send_offset[static_cast<std::size_t>(s) * E() + e]; }
  std::size_t recv_at(int d, int s, int l) const noexcept {
    return recv_displ[(static_cast<std::size_t>(d) * static_cast<std::size_t>(sources) + static_cast<std::size_t>(s)) *
                          static_cast<std::size_t>(L) +
                      static_cast<std::size_t>(l)];
  }
  // [L+1] offsets of owner d's expert-major buffer (host memory, what expert_rows holds).
  const std::size_t* offsets(int d) const noexcept {
    return expert_offset.data() + static_cast<std::size_t>(d) * (static_cast<std::size_t>(L) + 1);
  }
  // [L] rows each local expert of owner d receives, padding excluded.
  const std::size_t* received(int d) const noexcept {
    return received_rows.data() + static_cast<std::size_t>(d) * static_cast<std::size_t>(L);
  }
  std::size_t rows(int d) const noexcept { return offsets(d)[L]; }
  // Positions of member s's send order (the pairs it sends, and the holes of dropped pairs).
  std::size_t sent(int s) const noexcept { return send_size[static_cast<std::size_t>(s)]; }
};

// counts_of(s) points at member s's E counts (s in [0, sources)); sent_of(s) at the E
// counts of its send order's blocks (>= counts_of(s), the difference being holes).
template <class CountsOf, class SentOf>
receive_layout make_receive_layout(int sources, int owners, int L, const padding& pad, CountsOf&& counts_of,
                                   SentOf&& sent_of) {
  receive_layout r;
  r.sources = sources;
  r.owners = owners;
  r.L = L;
  const auto S = static_cast<std::size_t>(sources), D = static_cast<std::size_t>(owners),
             Ls = static_cast<std::size_t>(L), E = r.E();
  r.counts.resize(S * E);
  r.send_offset.resize(S * E);
  r.recv_displ.resize(D * S * Ls);
  r.expert_offset.resize(D * (Ls + 1));
  r.received_rows.resize(D * Ls);
  r.send_size.resize(S);
  for (std::size_t s = 0; s < S; ++s) {
    const std::int64_t* c = counts_of(static_cast<int>(s));
    const std::int64_t* b = sent_of(static_cast<int>(s));
    std::size_t at = 0;
    for (std::size_t e = 0; e < E; ++e) {
      r.counts[s * E + e] = c[e];
      r.send_offset[s * E + e] = at;
      at += static_cast<std::size_t>(b[e]);
    }
    r.send_size[s] = at;
  }
  for (std::size_t d = 0; d < D; ++d) {
    std::size_t off = 0;
    for (std::size_t l = 0; l < Ls; ++l) {
      r.expert_offset[d * (Ls + 1) + l] = off;
      std::size_t at = off;
      const std::size_t e = d * Ls + l;
      for (std::size_t s = 0; s < S; ++s) {
        r.recv_displ[(d * S + s) * Ls + l] = at;
        at += static_cast<std::size_t>(r.counts[s * E + e]);
      }
      r.received_rows[d * Ls + l] = at - off;
      off += pad.padded_rows(at - off);
    }
    r.expert_offset[d * (Ls + 1) + Ls] = off;
  }
  return r;
}

// Every pair of the send order travels: sent_of = counts_of.
template <class CountsOf>
receive_layout make_receive_layout(int sources, int owners, int L, const padding& pad, CountsOf&& counts_of) {
  return make_receive_layout(sources, owners, L, pad, counts_of, counts_of);
}

// The most bytes one row buffer of a call may hold: sizes in bytes stay representable as
// std::ptrdiff_t (and rows * H as std::size_t), so no size of a buffer wraps.
inline constexpr std::size_t max_buffer_bytes = static_cast<std::size_t>(PTRDIFF_MAX);

// Raises errc::input when a buffer that layout `r` sizes, rows of `hidden` elements of
// `elem_bytes` each, would hold more than max_buffer_bytes: the expert-major buffer of an
// owner (its rows, padding included) or the send order of a source. The layer checks
// hidden * elem_bytes <= max_buffer_bytes at construction. Every rank of an EP group makes
// the same layout (the all-to-all path's from the gathered counts; the masked path's from
// the group's common rows), so every rank raises together, before any row moves.
inline void check_buffer_rows(const receive_layout& r, std::size_t hidden, std::size_t elem_bytes, const char* what) {
  const std::size_t row_bytes = hidden * elem_bytes;
  const std::size_t most = row_bytes == 0 ? SIZE_MAX : max_buffer_bytes / row_bytes;
  for (int d = 0; d < r.owners; ++d)
    EPX_REQUIRE(r.rows(d) <= most, errc::input, what, ": the expert-major buffer of ep rank ", d, " would hold ",
                r.rows(d), " rows (padding included) of H=", hidden, " elements of ", elem_bytes,
                " bytes, more than ", max_buffer_bytes, " bytes (at most ", most, " rows)");
  for (int s = 0; s < r.sources; ++s)
    EPX_REQUIRE(r.sent(s) <= most, errc::input, what, ": the send order of ep rank ", s, " would hold ", r.sent(s),
                " rows of H=", hidden, " elements of ", elem_bytes, " bytes, more than ", max_buffer_bytes,
                " bytes (at most ", most, " rows)");
}

// What member `me` passes to a segmented all-to-all, in rows; arrays are [peers][L]
// (segment l of peer p).
struct segments {
  std::vector<std::size_t> send_counts, send_displs;  // its send order, to owner p's local expert l
  std::vector<std::size_t> recv_counts, recv_displs;  // its expert-major buffer, from source p
};

inline segments segments_of(const receive_layout& r, int me) {
  const std::size_t m = static_cast<std::size_t>(r.owners) * static_cast<std::size_t>(r.L);
  segments g;
  g.send_counts.assign(m, 0);
  g.send_displs.assign(m, 0);
  g.recv_counts.assign(m, 0);
  g.recv_displs.assign(m, 0);
  for (int p = 0; p < r.owners; ++p)
    for (int l = 0; l < r.L; ++l) {
      const std::size_t i = static_cast<std::size_t>(p) * static_cast<std::size_t>(r.L) + static_cast<std::size_t>(l);
      g.send_counts[i] = static_cast<std::size_t>(r.count(me, i));
      g.send_displs[i] = r.send_at(me, i);
      const std::size_t e = static_cast<std::size_t>(me) * static_cast<std::size_t>(r.L) + static_cast<std::size_t>(l);
      g.recv_counts[i] = static_cast<std::size_t>(r.count(p, e));
      g.recv_displs[i] = r.recv_at(me, p, l);
    }
  return g;
}

// f(i, s, q) for every row i of owner `me`'s expert-major buffer that source s sends from
// its send position q (padding rows are not visited).
template <class F>
void for_each_received(const receive_layout& r, int me, F&& f) {
  for (int l = 0; l < r.L; ++l) {
    const std::size_t e = static_cast<std::size_t>(me) * static_cast<std::size_t>(r.L) + static_cast<std::size_t>(l);
    for (int s = 0; s < r.sources; ++s) {
      const auto c = static_cast<std::size_t>(r.count(s, e));
      const std::size_t at = r.recv_at(me, s, l), q0 = r.send_at(s, e);
      for (std::size_t i = 0; i < c; ++i) f(at + i, s, q0 + i);
    }
  }
}

// f(p, d, r) for every send position p of source `me`: row r of owner d's expert-major
// buffer holds it.
template <class F>
void for_each_returned(const receive_layout& r, int me, F&& f) {
  for (int d = 0; d < r.owners; ++d)
    for (int l = 0; l < r.L; ++l) {
      const std::size_t e = static_cast<std::size_t>(d) * static_cast<std::size_t>(r.L) + static_cast<std::size_t>(l);
      const auto c = static_cast<std::size_t>(r.count(me, e));
      const std::size_t p0 = r.send_at(me, e), r0 = r.recv_at(d, me, l);
      for (std::size_t i = 0; i < c; ++i) f(p0 + i, d, r0 + i);
    }
}

// table[p] = base(d) + row * hidden for every send position p of source `me` ([sent]), where
// `base(d)` is owner d's expert-major buffer.
template <class T, class Base>
void fill_return_table(const receive_layout& r, int me, const T** table, std::size_t hidden, Base&& base) {
  for_each_returned(r, me, [&](std::size_t p, int d, std::size_t row) { table[p] = base(d) + row * hidden; });
}

}  // namespace epx::detail
