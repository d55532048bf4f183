// epx/layout/bounded.hpp: the fixed layout of bounded mode (spec section 11).
//
// Bounded mode (layer_options::counts == count_exchange::device) sizes every buffer from
// the bound `cap` (pairs per (source ep rank, global expert) block) and never reads a
// count on the host. Its shapes, fixed at construction (bound_shape):
//   slab:  what a rank sends one peer d: `hdr` header rows, whose bytes hold the int64 counts
//          of the pairs it sends each of d's L local experts, then L blocks of `cap` rows
//          (local expert l's rows at hdr + l*cap, in send order, the first count of them
//          used). The send buffer is ep slabs ([ep][slab] rows), one fixed-size all-to-all
//          moves it, and the same shape carries the outputs back.
//   block: rows of one local expert in the expert-major buffer, padded(ep*cap); local
//          expert l starts at row l*block and holds the rows of source 0, 1, ... packed, then
//          rows that are not data (zero in training calls).
// The functors (EPX_HOST_DEVICE, launched through exec::for_each_n / exec::for_each_row):
//   bound_keep      (per expert) the local capacity rule with C = cap: kept counts and the
//                   drop segments of layout::drop_pairs (epx/layout/capacity.hpp);
//   bound_tally     (once) adds the call's dropped pairs and bad-input flag to the counters
//                   (bound_note_bad: bad pairs of another plan of the call; bound_shape_failed:
//                   a backward call's shape error);
//   bound_slots     (per slab row) the slice row each slab row carries (-1: none);
//   bound_positions (per pair) the slab row of every (row, slot) pair (-1: dropped or bad);
//   bound_header    (per peer) writes the counts into a slab's header bytes;
//   bound_arrivals  (per local expert) reads the headers of the received slabs: where the
//                   rows of each source start in the expert's block, and its row count;
//   bound_unpack    (rows) received slabs -> expert-major blocks;
//   bound_pack      (rows) expert-major blocks -> slabs (the return);
//   bound_gather    (rows) slice rows (optionally scaled) -> slab rows.
// Row functors skip the rows that carry nothing (no zero fill of the fixed buffers), except
// bound_unpack with `zero_rest`, which zero-fills the rows of a block that are not data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"
#include "epx/layout/capacity.hpp"
#include "epx/layout/padding.hpp"
#include "epx/layout/plan.hpp"

namespace epx::layout {

// Counters of bounded mode, one array in the policy's memory: [bound_counter_fields + E].
enum bound_counter : int {
  bound_overflow = 0,     // pairs this rank dropped as a sender (beyond cap)
  bound_bad_input = 1,    // calls whose expert ids or routing weights were bad
  bound_shape_error = 2,  // calls whose shapes failed the local checks
  bound_calls = 3,        // forward calls
  bound_counter_fields = 4
};
// then [E]: the pairs dropped per global expert.

struct bound_shape {
  int ep = 0, L = 0;
  std::int64_t cap = 0;
  std::size_t hidden = 0;
  std::size_t hdr = 0;    // header rows of a slab
  std::size_t slab = 0;   // rows of a slab: hdr + L*cap
  std::size_t block = 0;  // rows of a local expert's block: padded(ep*cap)

  // row_bytes = hidden * sizeof(T).
  static bound_shape make(int ep, int L, std::int64_t cap, std::size_t hidden, std::size_t row_bytes,
                          const padding& pad) {
    bound_shape s;
    s.ep = ep;
    s.L = L;
    s.cap = cap;
    s.hidden = hidden;
    const std::size_t header_bytes = static_cast<std::size_t>(L) * sizeof(std::int64_t);
    s.hdr = (header_bytes + row_bytes - 1) / row_bytes;
    s.slab = s.hdr + static_cast<std::size_t>(L) * static_cast<std::size_t>(cap);
    s.block = pad.padded_rows(static_cast<std::size_t>(ep) * static_cast<std::size_t>(cap));
    return s;
  }
  EPX_HOST_DEVICE std::size_t send_rows() const noexcept { return static_cast<std::size_t>(ep) * slab; }
  EPX_HOST_DEVICE std::size_t expert_rows() const noexcept { return static_cast<std::size_t>(L) * block; }
  EPX_HOST_DEVICE int experts() const noexcept { return ep * L; }
};

namespace detail {
// int64 values at unaligned bytes (a slab's header sits at a row boundary of T).
EPX_HOST_DEVICE inline void put_int64(unsigned char* at, std::int64_t v) noexcept {
  auto u = static_cast<std::uint64_t>(v);
  for (int b = 0; b < 8; ++b) at[b] = static_cast<unsigned char>((u >> (8 * b)) & 0xffu);
}
// n elements from s to d: libc's copy on the host, a plain loop on a device.
template <class T>
EPX_HOST_DEVICE inline void copy_part(T* d, const T* s, std::size_t n) noexcept {
#if defined(__CUDA_ARCH__)
  for (std::size_t h = 0; h < n; ++h) d[h] = s[h];
#else
  if (n) std::memcpy(static_cast<void*>(d), static_cast<const void*>(s), n * sizeof(T));
#endif
}
EPX_HOST_DEVICE inline std::int64_t get_int64(const unsigned char* at) noexcept {
  std::uint64_t u = 0;
  for (int b = 0; b < 8; ++b) u |= static_cast<std::uint64_t>(at[b]) << (8 * b);
  return static_cast<std::int64_t>(u);
}
}  // namespace detail

// Call with e in [0, E): kept[e] = min(counts[e], cap); segments[e] for drop_pairs (one
// source; the scratch of a dropping segment is its own range of positions).
struct bound_keep {
  const std::int64_t* counts;  // [E] pairs per expert (the plan's expert counts)
  const std::int64_t* offset;  // [E+1] the plan's expert offsets
  std::int64_t cap;
  drop_segment* segments;      // [E]
  std::int64_t* kept;          // [E]

  EPX_HOST_DEVICE void operator()(std::size_t e) const {
    const std::int64_t n = counts[e], k = n < cap ? n : cap;
    segments[e] = drop_segment{offset[e], n, k, 0, k < n ? offset[e] : -1};
    kept[e] = k;
  }
};

// Call once: the call's figures into the counters ([bound_counter_fields + E]).
struct bound_tally {
  const std::int64_t* counts;     // [E]
  const std::int64_t* kept;       // [E]
  const std::int64_t* chunk_bad;  // [chunks] the plan's first bad pair per chunk (-1: none)
  std::size_t chunks;
  int num_experts;
  int shape_error;                // 1: this call's shapes failed the local checks
  std::int64_t* counters;
  const std::int64_t* more_bad = nullptr;  // or a flag of bad pairs elsewhere in the call (bound_note_bad)

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    std::int64_t dropped = 0;
    for (int e = 0; e < num_experts; ++e) {
      const std::int64_t d = counts[e] - kept[e];
      counters[bound_counter_fields + e] += d;
      dropped += d;
    }
    bool bad = false;
    for (std::size_t c = 0; c < chunks; ++c) bad = bad || chunk_bad[c] >= 0;
    if (more_bad != nullptr) bad = bad || *more_bad != 0;
    counters[bound_overflow] += dropped;
    counters[bound_bad_input] += bad ? 1 : 0;
    counters[bound_shape_error] += shape_error;
    counters[bound_calls] += 1;
  }
};

// Call once: flag = 1 when a plan's chunks found a bad pair (the masked path's other slices,
// whose bad pairs are this rank's call's too).
struct bound_note_bad {
  const std::int64_t* chunk_bad;  // [chunks]
  std::size_t chunks;
  std::int64_t* flag;

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    for (std::size_t c = 0; c < chunks; ++c)
      if (chunk_bad[c] >= 0) *flag = 1;
  }
};

// Call once: a call whose shapes failed (backward) into the counters.
struct bound_shape_failed {
  std::int64_t* counters;
  EPX_HOST_DEVICE void operator()(std::size_t) const { counters[bound_shape_error] += 1; }
};

// Call with r in [0, ep*slab): slot_row[r] = the slice row slab row r carries, -1 for
// header rows and unused rows.
struct bound_slots {
  const std::int64_t* src_row;  // [pairs] the plan's row of each send position (after drops)
  const std::int64_t* offset;   // [E+1]
  const std::int64_t* kept;     // [E]
  bound_shape shape;
  std::int64_t* slot_row;       // [ep*slab]

  EPX_HOST_DEVICE void operator()(std::size_t r) const {
    const std::size_t d = r / shape.slab, q = r % shape.slab;
    std::int64_t v = -1;
    if (q >= shape.hdr) {
      const auto c = static_cast<std::size_t>(shape.cap);
      const std::size_t l = (q - shape.hdr) / c, i = (q - shape.hdr) % c;
      const std::size_t e = d * static_cast<std::size_t>(shape.L) + l;
      if (static_cast<std::int64_t>(i) < kept[e]) v = src_row[static_cast<std::size_t>(offset[e]) + i];
    }
    slot_row[r] = v;
  }
};

// Call with i in [0, pairs): slab_pos[i] = the slab row of pair i, -1 when it was dropped or
// is bad (the plan gives bad pairs no position).
struct bound_positions {
  const std::int32_t* ids;     // [pairs]
  const float* weights;        // [pairs]
  const std::int64_t* pos;     // [pairs] the plan's send positions (after drops)
  const std::int64_t* offset;  // [E+1]
  bound_shape shape;
  std::int64_t* slab_pos;      // [pairs]

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::int32_t e = ids[i];
    const int E = shape.experts();
    if (e < 0 || e >= E || !is_finite_bits(weights[i]) || pos[i] < 0) {
      slab_pos[i] = -1;
      return;
    }
    const auto es = static_cast<std::size_t>(e), Ls = static_cast<std::size_t>(shape.L);
    const std::size_t j = static_cast<std::size_t>(pos[i] - offset[es]);
    slab_pos[i] = static_cast<std::int64_t>((es / Ls) * shape.slab + shape.hdr +
                                            (es % Ls) * static_cast<std::size_t>(shape.cap) + j);
  }
};

// Call with d in [0, ep): the kept counts of peer d's local experts into slab d's header.
struct bound_header {
  const std::int64_t* kept;  // [E]
  bound_shape shape;
  std::size_t row_bytes;
  unsigned char* send;       // the send buffer's bytes, [ep*slab*row_bytes]

  EPX_HOST_DEVICE void operator()(std::size_t d) const {
    unsigned char* h = send + d * shape.slab * row_bytes;
    for (int l = 0; l < shape.L; ++l)
      detail::put_int64(h + static_cast<std::size_t>(l) * 8, kept[d * static_cast<std::size_t>(shape.L) + static_cast<std::size_t>(l)]);
  }
};

// Call with d in [0, ep) (backward): the number of the forward call this rank takes back
// into slab d's header, its first 8 bytes (backward's receivers read the counts they saved,
// so the header is free; hdr * row_bytes >= 8 * L >= 8).
struct bound_call_tag {
  std::int64_t call;  // >= 1
  bound_shape shape;
  std::size_t row_bytes;
  unsigned char* send;  // the send buffer's bytes, [ep*slab*row_bytes]

  EPX_HOST_DEVICE void operator()(std::size_t d) const { detail::put_int64(send + d * shape.slab * row_bytes, call); }
};

// Call once (backward): when a received slab's header names another forward call than
// this rank's `call`, the ranks of the EP group take back different calls; the call counts
// as one with bad shapes (counters[bound_shape_error]), which check() raises on every rank.
// A header of 0 is a peer that sends nothing (its own backward failed and counted itself).
struct bound_call_check {
  const unsigned char* recv;  // the receive buffer's bytes, [ep*slab*row_bytes]
  bound_shape shape;
  std::size_t row_bytes;
  std::int64_t call;
  std::int64_t* counters;

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    bool other = false;
    for (int s = 0; s < shape.ep; ++s) {
      const std::int64_t c = detail::get_int64(recv + static_cast<std::size_t>(s) * shape.slab * row_bytes);
      other = other || (c != 0 && c != call);
    }
    if (other) counters[bound_shape_error] += 1;
  }
};

// The masked path's form of the two above (no slabs: its backward only all-reduces). The
// weight gradients' all-reduce carries ep extra float slots: call once to write this rank's
// forward call number into its own slot and zeros into the others' (0 in its own too when
// its backward failed and counted itself), and once after the sum to compare every slot
// with this rank's number. A number goes as 1 + (call - 1) mod (2^24 - 1), exact in float;
// calls 2^24 - 1 apart are not told apart.
EPX_HOST_DEVICE inline float bound_call_slot_value(std::int64_t call) {
  return static_cast<float>(1 + (call - 1) % 16777215);
}

struct bound_call_slots {
  float* slots;  // [ep], after the [N*k] weight gradients
  int ep;
  int me;
  float value;  // bound_call_slot_value(call), or 0

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    for (int s = 0; s < ep; ++s) slots[s] = s == me ? value : 0.0f;
  }
};

struct bound_call_slots_check {
  const float* slots;  // [ep], summed over the EP group
  int ep;
  float value;
  std::int64_t* counters;

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    bool other = false;
    for (int s = 0; s < ep; ++s) other = other || (slots[s] != 0.0f && slots[s] != value);
    if (other) counters[bound_shape_error] += 1;
  }
};

// Call with l in [0, L): from the received slabs' headers, row_off[l*(ep+1) + s] = where
// source s's rows start in local expert l's block (row_off[l*(ep+1) + ep] = its rows) and
// rows[l] = its row count (the experts' device counts).
struct bound_arrivals {
  const unsigned char* recv;  // the receive buffer's bytes, [ep*slab*row_bytes]
  bound_shape shape;
  std::size_t row_bytes;
  std::int64_t* row_off;      // [L*(ep+1)]
  std::int64_t* rows;         // [L]

  EPX_HOST_DEVICE void operator()(std::size_t l) const {
    std::int64_t* o = row_off + l * static_cast<std::size_t>(shape.ep + 1);
    std::int64_t at = 0;
    for (int s = 0; s < shape.ep; ++s) {
      o[s] = at;
      at += detail::get_int64(recv + static_cast<std::size_t>(s) * shape.slab * row_bytes + l * 8);
    }
    o[shape.ep] = at;
    rows[l] = at;
  }
};

// Rows r in [0, L*block) of the expert-major buffer: row i of local expert l's block is row
// i - row_off[l][s] of source s's block for l in the received slabs (the s whose range holds
// i). Rows past the data are zero-filled with `zero_rest`, left alone otherwise.
template <class T>
struct bound_unpack {
  const T* recv;                // [ep*slab, H]
  const std::int64_t* row_off;  // [L*(ep+1)]
  bound_shape shape;
  bool zero_rest;
  T* dst;                       // [L*block, H]

  EPX_HOST_DEVICE void operator()(std::size_t r, std::size_t h0, std::size_t h1) const {
    const std::size_t H = shape.hidden, l = r / shape.block;
    const auto i = static_cast<std::int64_t>(r % shape.block);
    const std::int64_t* o = row_off + l * static_cast<std::size_t>(shape.ep + 1);
    T* d = dst + r * H;
    if (i >= o[shape.ep]) {
      if (zero_rest)
        for (std::size_t h = h0; h < h1; ++h) d[h] = convert<T>(0.0f);
      return;
    }
    int s = 0;
    while (o[s + 1] <= i) ++s;
    const std::size_t q = static_cast<std::size_t>(s) * shape.slab + shape.hdr +
                          l * static_cast<std::size_t>(shape.cap) + static_cast<std::size_t>(i - o[s]);
    detail::copy_part(d + h0, recv + q * H + h0, h1 - h0);
  }
};

// Rows r in [0, ep*slab) of the slabs back to the sources: slab s, local expert l, index i
// takes row row_off[l][s] + i of l's block, for the rows source s sent; others are skipped.
template <class T>
struct bound_pack {
  const T* src;                 // [L*block, H] expert-major
  const std::int64_t* row_off;  // [L*(ep+1)]
  bound_shape shape;
  T* dst;                       // [ep*slab, H]

  EPX_HOST_DEVICE void operator()(std::size_t r, std::size_t h0, std::size_t h1) const {
    const std::size_t s = r / shape.slab, q = r % shape.slab;
    if (q < shape.hdr) return;
    const auto c = static_cast<std::size_t>(shape.cap);
    const std::size_t l = (q - shape.hdr) / c;
    const auto i = static_cast<std::int64_t>((q - shape.hdr) % c);
    const std::int64_t* o = row_off + l * static_cast<std::size_t>(shape.ep + 1);
    if (i >= o[s + 1] - o[s]) return;
    const std::size_t H = shape.hidden, from = l * shape.block + static_cast<std::size_t>(o[s] + i);
    detail::copy_part(dst + r * H + h0, src + from * H + h0, h1 - h0);
  }
};

// Rows r in [0, ep*slab): dst[r] = x[slot_row[r]], or scale[r] * x[slot_row[r]] rounded to T
// (the formula of kernels::row_copy), skipped for slot_row[r] < 0.
template <class T>
struct bound_gather {
  const T* x;                    // [n, H] the slice's rows
  const std::int64_t* slot_row;  // [ep*slab]
  const float* scale;            // [ep*slab] or null
  std::size_t hidden;
  T* dst;                        // [ep*slab, H]

  EPX_HOST_DEVICE void operator()(std::size_t r, std::size_t h0, std::size_t h1) const {
    const std::int64_t t = slot_row[r];
    if (t < 0) return;
    const T* s = x + static_cast<std::size_t>(t) * hidden;
    T* d = dst + r * hidden;
    if (scale == nullptr) {
      detail::copy_part(d + h0, s + h0, h1 - h0);
    } else {
      using A = accum_t<T>;
      const A w = static_cast<A>(scale[r]);
      for (std::size_t h = h0; h < h1; ++h) d[h] = convert<T>(w * convert<A>(s[h]));
    }
  }
};

}  // namespace epx::layout
