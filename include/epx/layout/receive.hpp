// epx/layout/receive.hpp: where every routed row lives on every member of an EP
// group, for communicators whose ranks read each other's memory (epx::has_peer_access_v).
//
// The count exchange gives every rank the count matrix of the whole group (counts(s)[e]:
// pairs member s sends to global expert e), and from it every member's layout: its send
// order (experts in order, so expert e's pairs start at the prefix sum of its counts) and
// its expert-major receive buffer (local expert l: the rows of member 0, 1, ..., then the
// padding). With the peers' base pointers from access_peers, a rank then builds tables of
// row pointers and moves rows in one pass:
//   dispatch: its expert-major row i <- row q of source member s's send order
//             (fill_receive_table; padding rows get null, read as zeros);
//   return:   its send position p <- row r of owner d's expert-major buffer
//             (fill_return_table), read in place by combine or the gradient reduction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/layout/exchange.hpp"
#include "epx/layout/padding.hpp"

namespace epx::detail {

struct group_layout {
  int ep = 0, L = 0;
  std::vector<std::int64_t> counts;        // [ep][E]: pairs member s sends to expert e
  std::vector<std::size_t> send_offset;    // [ep][E]: member s's first send position of expert e
  std::vector<std::size_t> recv_displ;     // [ep dst][ep src][L]: first row of src's rows of dst's local expert l at dst

  std::size_t E() const noexcept { return static_cast<std::size_t>(ep) * static_cast<std::size_t>(L); }
  std::int64_t count(int s, std::size_t e) const noexcept { return counts[static_cast<std::size_t>(s) * E() + e]; }
  std::size_t send_at(int s, std::size_t e) const noexcept { return send_offset[static_cast<std::size_t>(s) * E() + e]; }
  std::size_t recv_at(int d, int s, int l) const noexcept {
    return recv_displ[(static_cast<std::size_t>(d) * static_cast<std::size_t>(ep) + static_cast<std::size_t>(s)) *
                          static_cast<std::size_t>(L) +
                      static_cast<std::size_t>(l)];
  }
};

inline group_layout make_group_layout(const group_records& g, int L, const padding& pad) {
  group_layout gl;
  gl.ep = g.size;
  gl.L = L;
  const std::size_t ep = static_cast<std::size_t>(g.size), E = gl.E();
  gl.counts.resize(ep * E);
  gl.send_offset.resize(ep * E);
  gl.recv_displ.resize(ep * ep * static_cast<std::size_t>(L));
  for (int s = 0; s < g.size; ++s) {
    std::size_t at = 0;
    for (std::size_t e = 0; e < E; ++e) {
      const std::int64_t c = g.counts(s)[e];
      gl.counts[static_cast<std::size_t>(s) * E + e] = c;
      gl.send_offset[static_cast<std::size_t>(s) * E + e] = at;
      at += static_cast<std::size_t>(c);
    }
  }
  for (int d = 0; d < g.size; ++d) {
    std::size_t off = 0;
    for (int l = 0; l < L; ++l) {
      std::size_t at = off;
      const std::size_t e = static_cast<std::size_t>(d) * static_cast<std::size_t>(L) + static_cast<std::size_t>(l);
      for (int s = 0; s < g.size; ++s) {
        gl.recv_displ[(static_cast<std::size_t>(d) * ep + static_cast<std::size_t>(s)) * static_cast<std::size_t>(L) +
                      static_cast<std::size_t>(l)] = at;
        at += static_cast<std::size_t>(gl.count(s, e));
      }
      off += pad.padded_rows(at - off);
    }
  }
  return gl;
}

// f(i, s, q) for every row i of member `me`'s expert-major buffer that member s sends from
// its send position q (padding rows are not visited).
template <class F>
void for_each_received(const group_layout& gl, int me, F&& f) {
  for (int l = 0; l < gl.L; ++l) {
    const std::size_t e = static_cast<std::size_t>(me) * static_cast<std::size_t>(gl.L) + static_cast<std::size_t>(l);
    for (int s = 0; s < gl.ep; ++s) {
      const auto c = static_cast<std::size_t>(gl.count(s, e));
      const std::size_t at = gl.recv_at(me, s, l), q0 = gl.send_at(s, e);
      for (std::size_t i = 0; i < c; ++i) f(at + i, s, q0 + i);
    }
  }
}

// f(p, d, r) for every send position p of member `me`: row r of owner d's expert-major
// buffer holds it.
template <class F>
void for_each_returned(const group_layout& gl, int me, F&& f) {
  for (int d = 0; d < gl.ep; ++d)
    for (int l = 0; l < gl.L; ++l) {
      const std::size_t e = static_cast<std::size_t>(d) * static_cast<std::size_t>(gl.L) + static_cast<std::size_t>(l);
      const auto c = static_cast<std::size_t>(gl.count(me, e));
      const std::size_t p0 = gl.send_at(me, e), r0 = gl.recv_at(d, me, l);
      for (std::size_t i = 0; i < c; ++i) f(p0 + i, d, r0 + i);
    }
}

// table[i] = source(s, q) for every row of member `me`'s expert-major buffer ([rows]), null
// for padding rows.
template <class T, class Source>
void fill_receive_table(const group_layout& gl, int me, const T** table, std::size_t rows, Source&& source) {
  for (std::size_t i = 0; i < rows; ++i) table[i] = nullptr;
  for_each_received(gl, me, [&](std::size_t i, int s, std::size_t q) { table[i] = source(s, q); });
}

// table[p] = row d's base + r * hidden for every send position p of member `me` ([S]), where
// `base(d)` is owner d's expert-major buffer.
template <class T, class Base>
void fill_return_table(const group_layout& gl, int me, const T** table, std::size_t hidden, Base&& base) {
  for_each_returned(gl, me, [&](std::size_t p, int d, std::size_t r) { table[p] = base(d) + r * hidden; });
}

}  // namespace epx::detail
