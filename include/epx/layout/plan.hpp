// epx/layout/plan.hpp: the send layout of one rank's (row, slot) pairs, by counting sort.
//
// Input: expert ids [n, k] (n = this rank's TP slice) and routing weights [n, k]. Output:
// every pair's position in the send buffer, with pairs grouped by global expert id, then
// row, then slot: what a stable sequential counting sort gives, so no comparison sort is
// needed and the order is deterministic.
//
// Three passes, each an EPX_HOST_DEVICE functor launched through exec::for_each_n:
//   1. histogram_chunks (one call per chunk of pairs): chunk_counts[c][e], and the first
//      pair of the chunk with a bad id (< 0 or >= E) or a non-finite weight; with
//      nodes_per_token also the distinct nodes of each row (chunks of whole rows then);
//   2. scan_chunks (one call per expert): exclusive scan over chunks, expert_counts[e];
//      expert_offsets (one call): exclusive scan over experts, expert_offset[E+1];
//   3. scatter_pairs (one call per chunk): pos[t*k+j] and src_row[p].
// The number of chunks C is a parameter: 1 for exec::serial, the thread count for
// exec::openmp, a few hundred on a device.
//
// Passes 1 and 2 (launch_plan_counts) give the counts that the count exchange carries;
// pass 3 (launch_scatter) may wait until the exchange is done, so that it can apply the
// capacity (spec section 8) as it places the pairs: a plan_cut drops every pair beyond an
// expert's kept count (by position: the cursor counts down to the last kept position, no
// comparison per pair) or writes every pair's weight key and slot in send order for
// layout::drop_pairs to choose from (by score).
//
// Because ep rank d owns experts [d*L, (d+1)*L), expert_counts[E] read as [ep][L] is the
// count matrix of the count exchange, and the send block for peer d is the positions
// [expert_offset[d*L], expert_offset[(d+1)*L]).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"
#include "epx/exec/thrust.hpp"
#include "epx/layout/capacity.hpp"
#include "epx/routing/node_limit.hpp"

#if EPX_HAS_CCCL
#include <thrust/binary_search.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/sort.h>
#endif

#if EPX_HAS_OPENMP
#include <omp.h>
#endif

namespace epx::layout {

// True for finite floats; bit test so that it behaves the same on host and device and
// under -ffast-math.
EPX_HOST_DEVICE inline bool is_finite_bits(float w) noexcept {
  return (epx::detail::float_bits(w) & 0x7f800000u) != 0x7f800000u;
}

// Pass 1. Call with c in [0, C). chunk_counts: [C, E]; chunk_bad: [C], the first pair
// index of the chunk whose id or weight is bad, -1 if none. Bad pairs are not counted.
// With chunk_nodes (nodes_per_token; chunks of whole rows): also {sum, max} over the
// chunk's rows of the distinct nodes among a row's good ids, node_bit[e] the flag of
// expert e's node (node_bits), into chunk_nodes[2c, 2c+1].
struct histogram_chunks {
  const std::int32_t* ids;       // [pairs]
  const float* weights;          // [pairs], or null to skip the weight check
  std::size_t pairs;
  std::size_t chunk_pairs;       // pairs per chunk (>= 1; a multiple of top_k with chunk_nodes)
  int num_experts;
  std::int64_t* chunk_counts;    // [C, E]
  std::int64_t* chunk_bad;       // [C]
  int top_k = 1;                 // with chunk_nodes
  const std::uint64_t* node_bit = nullptr;  // [E] with chunk_nodes
  std::int64_t* chunk_nodes = nullptr;      // [C, 2], or null
  bool node_bytes = false;                  // node_bit holds a byte per node (node_bits::stride 8)

  EPX_HOST_DEVICE void operator()(std::size_t c) const {
    std::int64_t* const row = chunk_counts + c * static_cast<std::size_t>(num_experts);
    for (int e = 0; e < num_experts; ++e) row[e] = 0;
    const std::size_t begin = c * chunk_pairs;
    const std::size_t end = begin + chunk_pairs < pairs ? begin + chunk_pairs : pairs;
    const std::int32_t* const id = ids;
    const float* const w = weights;
    const int E = num_experts;
    std::int64_t bad = -1;
    if (chunk_nodes == nullptr) {
      for (std::size_t i = begin; i < end; ++i) {
        const std::int32_t e = id[i];
        if (e >= 0 && e < E && (w == nullptr || is_finite_bits(w[i]))) {
          ++row[e];
        } else if (bad < 0) {
          bad = static_cast<std::int64_t>(i);
        }
      }
      chunk_bad[c] = bad;
      return;
    }
    // Row by row: one mask of node flags per row, then its count: with a byte per node
    // (at most 8 nodes) one multiply adds the bytes into the top one; else a popcount.
    const auto k = static_cast<std::size_t>(top_k);
    const std::uint64_t* const bit = node_bit;
    std::int64_t sum = 0, most = 0;
    for (std::size_t r = begin; r < end; r += k) {
      std::uint64_t mask = 0;
      for (std::size_t i = r; i < r + k; ++i) {
        const std::int32_t e = id[i];
        if (e >= 0 && e < E && (w == nullptr || is_finite_bits(w[i]))) {
          ++row[e];
          mask |= bit[e];
        } else if (bad < 0) {
          bad = static_cast<std::int64_t>(i);
        }
      }
      const std::int64_t nodes =
          node_bytes ? static_cast<std::int64_t>((mask * 0x0101010101010101ull) >> 56) : routing::token_nodes::popcount(mask);
      sum += nodes;
      most = nodes > most ? nodes : most;
    }
    chunk_bad[c] = bad;
    chunk_nodes[2 * c] = sum;
    chunk_nodes[2 * c + 1] = most;
  }
};

// Call with e in [0, E): bit[e] = the flag of expert e's node g = e / experts_per_node,
// 1 << (stride * g): a bit per node (stride 1, at most 64 nodes) or a byte per node
// (stride 8, at most 8 nodes: a row's distinct nodes are then the sum of its mask's bytes).
struct node_bits {
  int experts_per_node;
  std::uint64_t* bit;  // [E]
  int stride = 1;

  EPX_HOST_DEVICE void operator()(std::size_t e) const {
    bit[e] = std::uint64_t{1} << (stride * (static_cast<int>(e) / experts_per_node));
  }
};

inline constexpr std::size_t node_tally_size = 3;  // tokens, sum of the nodes per token, max

// Call once: tally = {rows, sum, max} from the chunks' {sum, max} of histogram_chunks.
struct node_chunk_totals {
  const std::int64_t* chunk_nodes;  // [C, 2]
  std::size_t chunks;
  std::int64_t rows;
  std::int64_t* tally;  // [node_tally_size]

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    std::int64_t sum = 0, most = 0;
    for (std::size_t c = 0; c < chunks; ++c) {
      sum += chunk_nodes[2 * c];
      most = chunk_nodes[2 * c + 1] > most ? chunk_nodes[2 * c + 1] : most;
    }
    tally[0] = rows;
    tally[1] = sum;
    tally[2] = most;
  }
};

// Call with b in [0, ceil(n / rows)): the {sum, max} of nodes over block b's rows, into
// sums[2b] and sums[2b + 1] (node_chunk_totals adds the blocks up). Blocks, so that a device
// does not walk all n rows with one thread.
struct node_block_sums {
  const std::int32_t* nodes;  // [n] (routing::token_nodes)
  std::size_t n;
  std::size_t rows;           // per block
  std::int64_t* sums;         // [blocks, 2]

  EPX_HOST_DEVICE void operator()(std::size_t b) const {
    const std::size_t t0 = b * rows, t1 = t0 + rows < n ? t0 + rows : n;
    std::int64_t sum = 0, mx = 0;
    for (std::size_t t = t0; t < t1; ++t) {
      sum += nodes[t];
      mx = nodes[t] > mx ? nodes[t] : mx;
    }
    sums[2 * b] = sum;
    sums[2 * b + 1] = mx;
  }
};
inline constexpr std::size_t node_block_rows = 256;

// What the plan counts besides the pairs: with experts_per_node > 0, the distinct nodes
// of each row's good expert ids (node of e: e / experts_per_node), reduced to {rows, sum,
// max} in send_plan::node_tally (the layer's nodes-per-token statistics). The counting
// sort counts them in its pass 1 (at most 64 nodes); else one pass of routing::token_nodes.
struct nodes_per_token {
  int experts_per_node = 0;  // 0: none
};

// Pass 2a. Call with e in [0, E): chunk_counts[c][e] becomes the exclusive prefix over
// chunks; expert_counts[e] the total.
struct scan_chunks {
  std::int64_t* chunk_counts;    // [C, E]
  std::int64_t* expert_counts;   // [E]
  std::size_t chunks;
  int num_experts;

  EPX_HOST_DEVICE void operator()(std::size_t e) const {
    std::int64_t running = 0;
    for (std::size_t c = 0; c < chunks; ++c) {
      std::int64_t& v = chunk_counts[c * static_cast<std::size_t>(num_experts) + e];
      const std::int64_t n = v;
      v = running;
      running += n;
    }
    expert_counts[e] = running;
  }
};

// Pass 2b. Call once (i == 0): expert_offset[0] = 0, expert_offset[e+1] = sum of counts <= e.
struct expert_offsets {
  const std::int64_t* expert_counts;  // [E]
  std::int64_t* expert_offset;        // [E+1]
  int num_experts;

  EPX_HOST_DEVICE void operator()(std::size_t) const {
    std::int64_t running = 0;
    expert_offset[0] = 0;
    for (int e = 0; e < num_experts; ++e) {
      running += expert_counts[e];
      expert_offset[e + 1] = running;
    }
  }
};

// What the scatter pass cuts from the plan (capacity, spec section 8), for a one-source
// plan; arrays in the policy's memory, all null: no cut. The r-th pair of expert e in the
// send order (r from 0) goes to position p = expert_offset[e] + r, and:
//   last ([E], by position): the last position expert e keeps, expert_offset[e] + keep[e]
//     - 1; a pair with p > last[e] (r >= keep[e]) is dropped there and then (pos = -1, and
//     its position a src_row = -1 hole at the block's end, what drop_pairs leaves);
//   keyed ([pairs], by score): every pair is placed, and also writes its weight key and
//     slot (keyed_slot, one 64-bit word) at its send position, so that layout::drop_pairs
//     (prefilled, each segment's scratch at its begin) reads the pairs of an overflowing
//     expert in position order with no lookup. Every pair writes: no branch per pair.
struct plan_cut {
  const std::int64_t* last = nullptr;
  std::uint64_t* keyed = nullptr;

  // Pair i (row t, slot j) of expert e at position p (one thread per pair: the sorted plan).
  EPX_HOST_DEVICE void place(const float* weights, std::int64_t i, int e, std::int64_t p, std::int64_t t,
                             std::int64_t j, std::int64_t* pos, std::int64_t* src_row) const {
    if (last != nullptr) {
      const bool stays = p <= last[e];
      pos[i] = stays ? p : -1;
      src_row[p] = stays ? t : -1;
      return;
    }
    pos[i] = p;
    src_row[p] = t;
    if (keyed != nullptr) keyed[p] = keyed_slot(weights[i], j);
  }
};

// Pass 3. Call with c in [0, C). Uses the scanned chunk_counts row of chunk c as its cursor
// (so they are consumed). pos[i] is the send position of pair i = t*k+j; src_row[p] = t for
// every send position p. Bad pairs (not counted by pass 1) get pos[i] = -1, as dropped
// ones do: the normal mode raises before anything reads the plan, bounded mode (which
// counts them and goes on) reads them as pairs that do not travel. `cut`: see plan_cut.
struct scatter_pairs {
  const std::int32_t* ids;             // [pairs]
  const float* weights;                // [pairs], or null
  std::size_t pairs;
  std::size_t chunk_pairs;
  int num_experts;
  int top_k;
  const std::int64_t* expert_offset;   // [E+1]
  std::int64_t* chunk_counts;          // [C, E] cursors
  std::int64_t* pos;                   // [pairs]
  std::int64_t* src_row;               // [pairs]
  plan_cut cut = {};

  enum kind : int { plain, by_position, by_score };

  EPX_HOST_DEVICE void operator()(std::size_t c) const {
    // One loop per kind of cut, so that no loop tests the kind per pair.
    // Weights or none is a parameter of the loop too (no null test per pair).
    if (cut.last != nullptr) {
      weights != nullptr ? run<by_position, true>(c) : run<by_position, false>(c);
    } else if (cut.keyed != nullptr) {
      run<by_score, true>(c);  // by score reads the weights
    } else {
      weights != nullptr ? run<plain, true>(c) : run<plain, false>(c);
    }
  }

  // On a CPU the loop is bound by its instructions per pair; everything it reads is a
  // local (kept in a register). By position, the cursor of expert e counts down from
  // keep[e] - 1 - (its pairs in earlier chunks) and the position is last[e] - cursor: a
  // negative cursor (r >= keep[e]) turns both writes into -1 by an OR with its sign, with
  // no comparison.
  // Each loop is a function of its own on the host: inlined together they share the
  // registers, and the pointers of the loop with the cut went to the stack (4 us of 44).
  template <int Kind, bool Weighted>
  EPX_HOST_NOINLINE EPX_HOST_DEVICE void run(std::size_t c) const {
    const std::int32_t* const id = ids;
    const float* const w = weights;
    const int E = num_experts;
    std::int64_t* const to_pos = pos;
    std::int64_t* const to_row = src_row;
    std::uint64_t* const keyed = cut.keyed;
    std::int64_t* const cursor = chunk_counts + c * static_cast<std::size_t>(E);
    const std::int64_t* const base = Kind == by_position ? cut.last : expert_offset;
    if (Kind == by_position)
      for (int e = 0; e < E; ++e) cursor[e] = base[e] - expert_offset[e] - cursor[e];
    const std::size_t begin = c * chunk_pairs;
    const std::size_t end = begin + chunk_pairs < pairs ? begin + chunk_pairs : pairs;
    // Row and slot of pair i kept as counters: no integer division per pair.
    const auto k = static_cast<std::size_t>(top_k);
    std::int64_t t = static_cast<std::int64_t>(begin / k);
    std::size_t j = begin % k;
    for (std::size_t i = begin; i < end; ++i) {
      const std::int32_t e = id[i];
      if (e >= 0 && e < E && (!Weighted || is_finite_bits(w[i]))) {
        if constexpr (Kind == by_position) {
          const std::int64_t down = cursor[e]--;
          const std::int64_t p = base[e] - down;
          const std::int64_t dropped = -static_cast<std::int64_t>(down < 0);  // all ones, or 0
          to_pos[i] = p | dropped;
          to_row[p] = t | dropped;
        } else {
          const std::int64_t p = base[e] + cursor[e]++;
          to_pos[i] = p;
          to_row[p] = t;
          if constexpr (Kind == by_score) keyed[p] = keyed_slot(w[i], static_cast<std::int64_t>(j));
        }
      } else {
        to_pos[i] = -1;  // a bad pair has no position (bounded mode reads on past it)
      }
      if (++j == k) {
        j = 0;
        ++t;
      }
    }
  }
};

// Chunk count used when the caller passes 0: one per thread on the host. The openmp
// overload's body depends on EPX_HAS_OPENMP; its parameter type (exec::openmp, in an inline
// namespace named after it) makes it a different function in each kind of translation unit.
inline std::size_t default_chunks(const exec::serial&) { return 1; }
inline std::size_t default_chunks(const exec::openmp& p) {
#if EPX_HAS_OPENMP
  return static_cast<std::size_t>(p.threads > 0 ? p.threads : omp_get_max_threads());
#else
  (void)p;
  return 1;
#endif
}
template <class Exec>
std::size_t default_chunks(const Exec&) {
  return 256;
}

// What pass 1 found: the first bad pair (lowest index) and its values.
struct input_check {
  enum kind_t : int { ok = 0, bad_expert_id = 1, non_finite_weight = 2 };
  int kind = ok;
  std::int64_t pair = -1;  // index t*k+j inside the slice
  std::int32_t id = 0;
  float weight = 0.0f;
  explicit operator bool() const noexcept { return kind == ok; }
};

// The send layout of one slice. Buffers live in the policy's memory space; the small
// per-chunk and per-expert arrays sit in one `summary` buffer. pos and src_row are written
// by the scatter (launch_scatter; `scattered`); until then the plan holds what the
// scatter needs (the counting sort's cursors, or the sorted keys and pair indices). The host copies
// (host_counts, host_offset, check) come either from one read-back of the summary
// (read_plan: one copy, one synchronisation) or, inside a layer call, from the count
// exchange, whose record this rank builds on the device from the summary (so the plan
// costs no synchronisation of its own; see epx/layout/exchange.hpp, plan_record).
template <class Exec>
struct send_plan {
  std::size_t pairs = 0;
  int num_experts = 0;
  int top_k = 0;
  std::size_t chunks = 0;
  std::size_t chunk_pairs = 0;                     // pairs per chunk (counting sort)
  bool sorted = false;                             // the plan of a stable sort (Thrust)
  bool scattered = false;                          // pos and src_row are written
  exec::buffer<std::int64_t, Exec> chunk_counts;   // [C, E] (counting sort) cursors of the scatter
  exec::buffer<std::int32_t, Exec> sorted_keys;    // [n*k] (stable sort) expert id of send position p, E if bad
  exec::buffer<std::int64_t, Exec> sorted_perm;    // [n*k] (stable sort) pair at send position p
  exec::buffer<std::int64_t, Exec> summary;        // [C] chunk_bad | [E] expert_counts | [E+1] expert_offset
  exec::buffer<std::int64_t, Exec> node_tally;     // [node_tally_size] rows, sum, max (nodes_per_token), else empty
  exec::buffer<std::int64_t, Exec> pos;            // [n*k] send position of pair (t, j)
  exec::buffer<std::int64_t, Exec> src_row;        // [n*k] slice row of send position p
  std::vector<std::int64_t> host_counts;           // [E]
  std::vector<std::int64_t> host_offset;           // [E+1]
  input_check check;

  std::int64_t* chunk_bad() noexcept { return summary.data(); }
  std::int64_t* expert_counts() noexcept { return summary.data() + chunks; }
  std::int64_t* expert_offset() noexcept { return summary.data() + chunks + static_cast<std::size_t>(num_experts); }
  const std::int64_t* chunk_bad() const noexcept { return summary.data(); }
  const std::int64_t* expert_counts() const noexcept { return summary.data() + chunks; }
  const std::int64_t* expert_offset() const noexcept {
    return summary.data() + chunks + static_cast<std::size_t>(num_experts);
  }
};

// The same plan from a stable sort (policies with a Thrust execution policy,
// epx/exec/thrust.hpp): pairs are keyed by expert id (a bad pair by E, after every good
// one) and carry their index; a stable sort by key gives the send order (expert, then row,
// then slot: bitwise the counting sort's positions), a vectorised upper bound over the
// sorted keys gives expert_offset, and the first bad pair is the first pair keyed E. The
// plan has one chunk (chunk_bad[0]). Functors below; the sort and the search are Thrust
// calls (CUB on a GPU).

// Call with i in [0, pairs): keys[i], perm[i] = i.
struct sort_keys {
  const std::int32_t* ids;
  const float* weights;  // or null
  int num_experts;
  std::int32_t* keys;
  std::int64_t* perm;

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::int32_t e = ids[i];
    const bool ok = e >= 0 && e < num_experts && (weights == nullptr || is_finite_bits(weights[i]));
    keys[i] = ok ? e : num_experts;
    perm[i] = static_cast<std::int64_t>(i);
  }
};

// Call with p in [0, pairs) after the sort: pos[perm[p]] = p and
// src_row[p] = its row, for the good pairs (keys[p] < E); `cut` as for scatter_pairs.
struct sorted_positions {
  const std::int32_t* keys;  // sorted
  const std::int64_t* perm;  // pair index of sorted position p
  const float* weights;      // [pairs] (score cut), or null
  int num_experts;
  int top_k;
  std::int64_t* pos;
  std::int64_t* src_row;
  plan_cut cut = {};

  EPX_HOST_DEVICE void operator()(std::size_t p) const {
    const std::int32_t e = keys[p];
    if (e >= num_experts) return;
    const std::int64_t i = perm[p];
    const std::int64_t t = i / top_k;
    cut.place(weights, i, e, static_cast<std::int64_t>(p), t, i - t * top_k, pos, src_row);
  }
};

// Call with e in [0, E] after expert_offset[1..E] holds the upper bounds: expert_offset[0]
// = 0, expert_counts[e], and (e == E) chunk_bad[0] = the first bad pair or -1.
struct sorted_summary {
  const std::int64_t* perm;
  std::size_t pairs;
  int num_experts;
  std::int64_t* chunk_bad;      // [1]
  std::int64_t* expert_counts;  // [E]
  std::int64_t* expert_offset;  // [E+1]

  EPX_HOST_DEVICE void operator()(std::size_t e) const {
    const auto E = static_cast<std::size_t>(num_experts);
    if (e == E) {
      const std::int64_t good = expert_offset[E];
      chunk_bad[0] = static_cast<std::size_t>(good) < pairs ? perm[good] : -1;
      expert_offset[0] = 0;
      return;
    }
    expert_counts[e] = expert_offset[e + 1] - (e == 0 ? 0 : expert_offset[e]);
  }
};

// {rows, sum, max} of the distinct nodes per row (nodes_per_token) by one pass of
// routing::token_nodes over the n rows at ids ([n, k], policy memory; null: no rows),
// queued, in a new buffer of the policy's memory; empty without experts_per_node.
template <class Exec>
exec::buffer<std::int64_t, Exec> launch_token_nodes(const Exec& ex, const std::int32_t* ids, std::size_t n, int k,
                                                    int E, nodes_per_token nodes) {
  const int d = nodes.experts_per_node;
  if (d <= 0) return {};
  auto tally = exec::make_buffer<std::int64_t>(ex, node_tally_size);
  if (ids == nullptr) n = 0;
  auto per_row = exec::make_buffer<std::int32_t>(ex, n);
  exec::for_each_n(ex, n, routing::token_nodes{ids, per_row.data(), k, E, d, routing::token_nodes::magic_for(E, d)});
  const std::size_t blocks = (n + node_block_rows - 1) / node_block_rows;
  auto sums = exec::make_buffer<std::int64_t>(ex, 2 * blocks);
  exec::for_each_n(ex, blocks, node_block_sums{per_row.data(), n, node_block_rows, sums.data()});
  exec::for_each_n(ex, 1, node_chunk_totals{sums.data(), blocks, static_cast<std::int64_t>(n), tally.data()});
  return tally;
}

#if EPX_HAS_CCCL
// The sorted plan's counts (see above); same contract as launch_plan_counts.
template <class Exec>
send_plan<Exec> launch_sorted_counts(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n,
                                     int k, int E, nodes_per_token nodes = {}) {
  EPX_REQUIRE(E >= 1 && k >= 1, errc::input, "build_plan: num_experts (", E, ") and top_k (", k,
              ") must be at least 1");
  send_plan<Exec> p;
  p.pairs = n * static_cast<std::size_t>(k);
  p.num_experts = E;
  p.top_k = k;
  p.chunks = 1;
  p.sorted = true;
  const auto Es = static_cast<std::size_t>(E);
  p.summary = exec::make_buffer<std::int64_t>(ex, 1 + 2 * Es + 1);
  p.sorted_keys = exec::make_buffer<std::int32_t>(ex, p.pairs);
  p.sorted_perm = exec::make_buffer<std::int64_t>(ex, p.pairs);
  exec::for_each_n(ex, p.pairs, sort_keys{ids, weights, E, p.sorted_keys.data(), p.sorted_perm.data()});
  const auto tp = thrust_policy(ex);
  if (p.pairs > 0) {
    [[maybe_unused]] const auto on_device = exec::launch_scope(ex);
    thrust::stable_sort_by_key(tp, p.sorted_keys.data(), p.sorted_keys.data() + p.pairs, p.sorted_perm.data());
    thrust::upper_bound(tp, p.sorted_keys.data(), p.sorted_keys.data() + p.pairs,
                        thrust::counting_iterator<std::int32_t>(0), thrust::counting_iterator<std::int32_t>(E),
                        p.expert_offset() + 1);
  } else {
    exec::fill_zero(ex, p.expert_offset(), Es + 1);
  }
  exec::for_each_n(ex, Es + 1,
                   sorted_summary{p.sorted_perm.data(), p.pairs, E, p.chunk_bad(), p.expert_counts(),
                                  p.expert_offset()});
  p.node_tally = launch_token_nodes(ex, ids, n, k, E, nodes);
  return p;
}
#endif

// Which algorithm launch_plan uses on policy Exec: "stable sort (Thrust)" or "counting sort".
template <class Exec>
constexpr const char* plan_algorithm() {
  return exec::has_thrust_policy_v<Exec> && EPX_HAS_CCCL ? "stable sort (Thrust)" : "counting sort";
}

// Passes 1 and 2 of the counting sort for `n` rows of `k` pairs, queued, nothing read back:
// the summary (bad-pair flags, counts, offsets) and the scatter's cursors. ids, weights:
// [n, k] in the policy's memory (weights may be null). The passes run whatever pass 1
// finds (bad pairs are left out), so the bad-pair flags, counts and offsets are read back
// together, by read_plan or inside the count exchange's record.
template <class Exec>
send_plan<Exec> launch_counting_counts(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n,
                                       int k, int E, std::size_t chunks = 0, nodes_per_token nodes = {}) {
  EPX_REQUIRE(E >= 1 && k >= 1, errc::input, "build_plan: num_experts (", E, ") and top_k (", k,
              ") must be at least 1");
  send_plan<Exec> p;
  p.pairs = n * static_cast<std::size_t>(k);
  p.num_experts = E;
  p.top_k = k;
  // Nodes per token in pass 1 when there are at most 64 nodes (chunks of whole rows
  // then); else routing::token_nodes after it.
  const int d = nodes.experts_per_node;
  // (64-bit products: 64 * d overflows an int from d = 2^25 experts per node.)
  const bool fused = d > 0 && E <= 64 * std::int64_t{d};
  const bool bytes = fused && E <= 8 * std::int64_t{d};  // at most 8 nodes: a byte per node
  std::size_t C = chunks ? chunks : default_chunks(ex);
  C = std::max<std::size_t>(1, std::min(C, p.pairs));
  std::size_t per = p.pairs ? (p.pairs + C - 1) / C : 1;
  if (fused) per = (per + static_cast<std::size_t>(k) - 1) / static_cast<std::size_t>(k) * static_cast<std::size_t>(k);
  C = p.pairs ? (p.pairs + per - 1) / per : 1;
  p.chunks = C;
  p.chunk_pairs = per;
  const auto Es = static_cast<std::size_t>(E);
  p.chunk_counts = exec::make_buffer<std::int64_t>(ex, C * Es);
  p.summary = exec::make_buffer<std::int64_t>(ex, C + 2 * Es + 1);
  exec::buffer<std::int64_t, Exec> chunk_nodes;
  exec::buffer<std::uint64_t, Exec> bit;
  if (fused) {
    chunk_nodes = exec::make_buffer<std::int64_t>(ex, 2 * C);
    bit = exec::make_buffer<std::uint64_t>(ex, Es);
    p.node_tally = exec::make_buffer<std::int64_t>(ex, node_tally_size);
    exec::for_each_n(ex, Es, node_bits{d, bit.data(), bytes ? 8 : 1});
  }
  exec::for_each_n(ex, C,
                   histogram_chunks{ids, weights, p.pairs, per, E, p.chunk_counts.data(), p.chunk_bad(), k,
                                    fused ? static_cast<const std::uint64_t*>(bit.data()) : nullptr,
                                    fused ? chunk_nodes.data() : nullptr, bytes});
  exec::for_each_n(ex, Es, scan_chunks{p.chunk_counts.data(), p.expert_counts(), C, E});
  exec::for_each_n(ex, 1, expert_offsets{p.expert_counts(), p.expert_offset(), E});
  if (fused) {
    exec::for_each_n(ex, 1, node_chunk_totals{chunk_nodes.data(), C, static_cast<std::int64_t>(n), p.node_tally.data()});
  } else {
    p.node_tally = launch_token_nodes(ex, ids, n, k, E, nodes);
  }
  return p;
}

// The counts of policy Exec's plan, queued: the sorted plan where it has a Thrust
// execution policy, the counting sort (in `chunks` chunks, 0: the policy's default)
// otherwise; with `nodes`, also the nodes per row (send_plan::node_tally). pos and
// src_row come with launch_scatter.
template <class Exec>
send_plan<Exec> launch_plan_counts(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n,
                                   int k, int E, std::size_t chunks = 0, nodes_per_token nodes = {}) {
#if EPX_HAS_CCCL
  if constexpr (exec::has_thrust_policy_v<Exec>) {
    (void)chunks;
    return launch_sorted_counts(ex, ids, weights, n, k, E, nodes);
  } else {
    return launch_counting_counts(ex, ids, weights, n, k, E, chunks, nodes);
  }
#else
  return launch_counting_counts(ex, ids, weights, n, k, E, chunks, nodes);
#endif
}

// The scatter of a counted plan, queued: pos and src_row, with an optional cut (plan_cut;
// its buffers in the policy's memory, alive until the scatter has run). ids and weights
// are those the plan was counted from. Once per plan.
template <class Exec>
void launch_scatter(const Exec& ex, send_plan<Exec>& p, const std::int32_t* ids, const float* weights,
                    const plan_cut& cut = {}) {
  EPX_REQUIRE(!p.scattered, errc::internal, "launch_scatter: the plan is already scattered");
  p.pos = exec::make_buffer<std::int64_t>(ex, p.pairs);
  p.src_row = exec::make_buffer<std::int64_t>(ex, p.pairs);
  p.scattered = true;
  if (p.pairs == 0) return;
  if (p.sorted) {
    exec::for_each_n(ex, p.pairs,
                     sorted_positions{p.sorted_keys.data(), p.sorted_perm.data(), weights,
                                      p.num_experts, p.top_k, p.pos.data(), p.src_row.data(), cut});
    return;
  }
  exec::for_each_n(ex, p.chunks,
                   scatter_pairs{ids, weights, p.pairs, p.chunk_pairs, p.num_experts, p.top_k, p.expert_offset(),
                                 p.chunk_counts.data(), p.pos.data(), p.src_row.data(), cut});
}

// The whole plan of the counting sort, queued (launch_counting_counts + launch_scatter).
template <class Exec>
send_plan<Exec> launch_counting_plan(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n,
                                     int k, int E, std::size_t chunks = 0) {
  send_plan<Exec> p = launch_counting_counts(ex, ids, weights, n, k, E, chunks);
  launch_scatter(ex, p, ids, weights);
  return p;
}

#if EPX_HAS_CCCL
// The whole sorted plan, queued (launch_sorted_counts + launch_scatter).
template <class Exec>
send_plan<Exec> launch_sorted_plan(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n,
                                   int k, int E) {
  send_plan<Exec> p = launch_sorted_counts(ex, ids, weights, n, k, E);
  launch_scatter(ex, p, ids, weights);
  return p;
}
#endif

// The whole plan of policy Exec, queued: launch_plan_counts, then launch_scatter with no
// cut. Nothing is read back: host_counts, host_offset and check stay empty.
template <class Exec>
send_plan<Exec> launch_plan(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n, int k,
                            int E, std::size_t chunks = 0) {
  send_plan<Exec> p = launch_plan_counts(ex, ids, weights, n, k, E, chunks);
  launch_scatter(ex, p, ids, weights);
  return p;
}

// The first bad pair of the plan, from the per-chunk flags `bad` (host memory, [chunks]):
// its index and values (read from ids and weights, the error path's only reads).
template <class Exec>
input_check describe_bad_pair(const Exec& ex, const std::int64_t* bad, std::size_t chunks, const std::int32_t* ids,
                              const float* weights, int E) {
  input_check check;
  for (std::size_t c = 0; c < chunks; ++c) {
    if (bad[c] < 0) continue;
    check.pair = bad[c];
    detail::to_host(ex, ids + bad[c], 1, &check.id);
    if (weights != nullptr) detail::to_host(ex, weights + bad[c], 1, &check.weight);
    check.kind = (check.id < 0 || check.id >= E) ? input_check::bad_expert_id : input_check::non_finite_weight;
    break;
  }
  return check;
}

// The error path of a plan whose summary was not read back: reads the bad-pair flags (one
// synchronisation) and names the first bad pair.
template <class Exec>
input_check find_bad_pair(const Exec& ex, const send_plan<Exec>& p, const std::int32_t* ids, const float* weights) {
  std::vector<std::int64_t> bad(p.chunks);
  detail::to_host(ex, p.chunk_bad(), p.chunks, bad.data());
  return describe_bad_pair(ex, bad.data(), p.chunks, ids, weights, p.num_experts);
}

// The host copies of the counts, given them ([E], host memory, e.g. this rank's record of
// the count exchange): host_counts and its exclusive scan host_offset. No device access.
template <class Exec>
void set_host_counts(send_plan<Exec>& p, const std::int64_t* counts) {
  const auto Es = static_cast<std::size_t>(p.num_experts);
  p.host_counts.assign(counts, counts + Es);
  p.host_offset.assign(Es + 1, 0);
  for (std::size_t e = 0; e < Es; ++e) p.host_offset[e + 1] = p.host_offset[e] + p.host_counts[e];
}

// Reads the summary back (one copy, one synchronisation): host_counts, host_offset and
// check. On bad input the counts are zero and `check` names the first bad pair; no
// exception is raised here, so the caller can still join the count exchange and let every
// rank of the group raise together.
template <class Exec>
void read_plan(const Exec& ex, send_plan<Exec>& p, const std::int32_t* ids, const float* weights) {
  const std::size_t C = p.chunks;
  const auto Es = static_cast<std::size_t>(p.num_experts);
  std::vector<std::int64_t> host(C + 2 * Es + 1);
  detail::to_host(ex, static_cast<const std::int64_t*>(p.summary.data()), host.size(), host.data());
  p.check = describe_bad_pair(ex, host.data(), C, ids, weights, p.num_experts);
  if (!p.check) {
    p.host_counts.assign(Es, 0);
    p.host_offset.assign(Es + 1, 0);
    return;
  }
  p.host_counts.assign(host.begin() + static_cast<std::ptrdiff_t>(C), host.begin() + static_cast<std::ptrdiff_t>(C + Es));
  p.host_offset.assign(host.begin() + static_cast<std::ptrdiff_t>(C + Es), host.end());
}

// launch_plan_counts and read_plan: the counted plan with its host copies (one
// synchronisation), its scatter still to come (launch_scatter, or with capacity
// detail::scatter_with_capacity).
template <class Exec>
send_plan<Exec> build_plan_counts(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n,
                                  int k, int E, std::size_t chunks = 0, nodes_per_token nodes = {}) {
  send_plan<Exec> p = launch_plan_counts(ex, ids, weights, n, k, E, chunks, nodes);
  read_plan(ex, p, ids, weights);
  return p;
}

// launch_plan and read_plan: the plan with its host copies (one synchronisation).
template <class Exec>
send_plan<Exec> build_plan(const Exec& ex, const std::int32_t* ids, const float* weights, std::size_t n, int k,
                           int E, std::size_t chunks = 0) {
  send_plan<Exec> p = launch_plan(ex, ids, weights, n, k, E, chunks);
  read_plan(ex, p, ids, weights);
  return p;
}

// A sentence describing a failed input_check, naming the token, slot and value.
inline std::string describe(const input_check& c, int k, int E, std::size_t row0 = 0) {
  if (c.kind == input_check::ok) return {};
  const auto t = static_cast<std::size_t>(c.pair) / static_cast<std::size_t>(k) + row0;
  const auto j = static_cast<std::size_t>(c.pair) % static_cast<std::size_t>(k);
  if (c.kind == input_check::bad_expert_id)
    return epx::detail::concat("expert id (", c.id, ") of token ", t, " slot ", j, " out of range [0, ", E, ")");
  return epx::detail::concat("routing weight (", c.weight, ") of token ", t, " slot ", j, " is not finite");
}

}  // namespace epx::layout
