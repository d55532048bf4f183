// epx/impl/bounded.hpp: bounded mode of the all-to-all path (spec section 11).
//
// layer_options::counts == count_exchange::device with a bound layer_options::bound.cap:
// every buffer size follows from the bound (epx/layout/bounded.hpp), the counts travel with
// the rows, and a forward or backward call reads nothing back to the host, so on a device
// it is a sequence of kernels and collectives on one queue (capturable in a CUDA graph).
//
// Forward, per call (this rank's TP slice of n rows, P = n*k pairs):
//   1. the counting-sort plan of epx/layout/plan.hpp (its four functors, no read-back);
//   2. the local capacity rule with C = cap (layout::bound_keep, layout::drop_pairs of
//      epx/layout/capacity.hpp, the priority of layer_options::capacity.priority); the
//      dropped pairs and a bad-input flag are added to the layer's counters (policy memory);
//   3. every pair's slab row and every slab row's slice row (layout::bound_positions,
//      layout::bound_slots);
//   4. staged route (any communicator): each slab gets its header (the counts) and its
//      rows; one all_to_all of the fixed send buffer; the receiver reads the headers
//      (layout::bound_arrivals) and packs its expert-major blocks (layout::bound_unpack);
//      direct route (inference on host policies with peer access, layer_options::peer_access):
//      each owner reads the counts and rows straight out of the senders' buffers;
//   5. the experts, with their per-expert row counts in the policy's memory
//      (expert_rows::device_counts; every block has `block` rows, the rows past the count
//      are zero in training calls and unspecified in inference calls);
//   6. the outputs go back in the slab shape (layout::bound_pack and the mirrored
//      all_to_all, or read in place by the direct route) and combine sums them per token
//      in slot order, as the normal mode does: with nothing dropped the results are
//      bitwise the normal mode's.
// Backward (staged route) sends the gradient rows w * grad_out in the same slabs and reads
// the counts it saved; no shape exchange. The slabs' headers carry the number of the
// forward call taken back (layout::bound_call_tag); a receiver that gets another number
// counts the call as one with bad shapes (layout::bound_call_check), raised by check().
//
// Errors without a host read: a rank whose call has bad shapes (known on its host) still
// joins every collective (sending nothing), counts the error, and raises errc::input
// itself afterwards; bad expert ids or weights are counted (those pairs do not travel).
// moe_layer::check() (collective over the EP group, a synchronising call) sums the
// counters of the group, resets them, and raises errc::input on every rank for counted
// errors, and for overflow with layer_options::bound.raise_on_overflow.
// Inference calls use buffers owned by the layer (made at construction on device
// policies; on host policies the row buffers are made on their first use); training calls
// make the buffers their saved state keeps (exec::make_buffer: stream-ordered on a device).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/comm/settle.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/impl/options.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/layout/bounded.hpp"
#include "epx/layout/capacity.hpp"
#include "epx/layout/exchange.hpp"
#include "epx/layout/plan.hpp"
#include "epx/layout/slicing.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx {

// What moe_layer::check() found over the EP group since the previous check.
struct bound_report {
  std::int64_t overflow_pairs = 0;               // pairs dropped beyond the bound
  std::int64_t bad_input_calls = 0;              // rank-calls with bad expert ids or weights
  std::int64_t shape_error_calls = 0;            // rank-calls whose shapes failed
  std::int64_t calls = 0;                        // rank-calls of forward
  std::vector<std::int64_t> dropped_per_expert;  // [E]
};

namespace detail {

// The bound's options against the mesh, as a sentence ("" when fine); checked at
// construction in bounded mode.
inline std::string bound_check(const mesh& m, const layer_options& o) {
  if (o.counts != count_exchange::device) return {};
  if (o.bound.cap < 1)
    return concat("layer_options.bound.cap (", o.bound.cap,
                  ") must be at least 1 in bounded mode (counts == count_exchange::device): it is the most pairs "
                  "one ep rank sends one expert per call");
  if (o.capacity.enabled())
    return concat("layer_options.capacity.mode (", to_string(o.capacity.mode),
                  ") must be off in bounded mode: the bound is the capacity (local rule, C = bound.cap = ",
                  o.bound.cap, ")");
  if (o.fp8_dispatch)
    return "layer_options.fp8_dispatch must be off in bounded mode (counts == count_exchange::device): the "
           "bounded slabs carry rows in the layer's element type";
  if (o.sends != row_sends::per_slot)
    return "layer_options.sends must be row_sends::per_slot in bounded mode (counts == count_exchange::device): "
           "the bounded slabs hold one row per (token, slot)";
  const double rows = static_cast<double>(m.ep()) * static_cast<double>(o.bound.cap) *
                      static_cast<double>(m.local_experts()) * static_cast<double>(o.hidden);
  if (rows > 9.0e15)
    return concat("layer_options.bound.cap (", o.bound.cap, ") is too large: ep * L * cap * hidden = ", rows,
                  " elements");
  // The expert-major buffers hold L blocks of padded(ep * cap) rows: the padding rows count
  // too (rows_per_expert and align up to 2^31 - 1 each would wrap L * block * hidden).
  // (ep * cap <= 9e15 here and the padding was validated, so the block fits a size_t.)
  const std::size_t block = o.pad.padded_rows(static_cast<std::size_t>(m.ep()) * static_cast<std::size_t>(o.bound.cap));
  const double expert_rows =
      static_cast<double>(m.local_experts()) * static_cast<double>(block) * static_cast<double>(o.hidden);
  if (expert_rows > 9.0e15)
    return concat("layer_options.bound.cap (", o.bound.cap, ") with padding.rows_per_expert (", o.pad.rows_per_expert,
                  ") and padding.align (", o.pad.align, ") is too large: L * padded(ep * cap) * hidden = ",
                  m.local_experts(), " * ", block, " * ", o.hidden, " = ", expert_rows, " elements");
  // The plan's buffers hold [chunks * E] and, on the masked path, [ep * (chunks + 2E + 1)]
  // entries, made at construction: a count beyond this would wrap their sizes.
  const double entries = static_cast<double>(o.chunks) * static_cast<double>(m.ep()) *
                         (static_cast<double>(m.experts()) + 1.0);
  if (entries > 9.0e15)
    return concat("layer_options.chunks (", o.chunks, ") is too large in bounded mode: chunks * ep * (E + 1) = ",
                  entries, " entries");
  return {};
}

// The experts' forward in the layer's type. Experts that take only FP8 rows compile with
// the layer (fp8_dispatch is refused in bounded mode at construction), and raise here.
template <class Experts, class Exec, class T>
void bounded_expert_forward(Experts& experts, const Exec& ex, const expert_rows<const T>& rows, T* out) {
  if constexpr (has_expert_forward<Experts, Exec, T>::value) {
    experts.forward(ex, rows, out);
  } else {
    (void)experts, (void)ex, (void)rows, (void)out;
    EPX_THROW(errc::configuration, "bounded mode needs experts with forward(const Exec&, const expert_rows<const T>&, "
                                   "T*): these experts take only FP8 rows");
  }
}

// Where one bounded plan (bounded_plan) writes: the first bad pair of each chunk, the pairs
// per expert and their offsets, the kept counts and drop segments of the local rule, and per
// pair its send position, the row of each send position and drop_pairs' scratch.
struct bound_plan_at {
  std::int64_t* chunk_bad;         // [chunks]
  std::int64_t* counts;            // [E]
  std::int64_t* offset;            // [E+1]
  std::int64_t* kept;              // [E]
  layout::drop_segment* segments;  // [E]
  std::int64_t* pos;               // [pairs]
  std::int64_t* src_row;           // [pairs]
  std::uint64_t* keyed;            // [pairs]
};

// The layer's own buffers of bounded mode (moe_layer makes them at construction). `masked`:
// for the masked path (epx/impl/bounded_masked.hpp), which plans every slice of the EP
// group's rows (one plan's arrays per slice) and moves no rows (no slabs).
template <class T, class Exec>
struct bound_buffers {
  layout::bound_shape shape;
  std::size_t row_bytes = 0;
  std::size_t chunks = 1;     // most chunks of the plan
  std::size_t pairs = 0;      // capacity of the per-pair arrays
  capacity_policy rule;       // local, rows = cap, the options' priority
  bool raise_on_overflow = false;
  std::vector<std::size_t> offsets;                    // host [L+1]: l * block
  exec::buffer<std::int64_t, Exec> counters;           // [bound_counter_fields + E]
  exec::buffer<std::int64_t, Exec> chunk_counts;       // [chunks * E]
  exec::buffer<std::int64_t, Exec> pos, src_row, slab_pos;  // [pairs] (slab_pos: each pair's slab row; masked: its block row)
  exec::buffer<std::uint64_t, Exec> keyed;             // [pairs] drop_pairs' scratch (by score)
  // The all-to-all path's one plan: its summary, kept counts and drop segments; the slot
  // rows of an inference call.
  exec::buffer<std::int64_t, Exec> summary;            // [chunks + 2E + 1]
  exec::buffer<std::int64_t, Exec> kept;               // [E]
  exec::buffer<layout::drop_segment, Exec> segments;   // [E]
  exec::buffer<std::int64_t, Exec> slot_row;           // [ep*slab]
  // Inference: arrivals, rows in both shapes.
  exec::buffer<std::int64_t, Exec> row_off;            // [L*(ep+1)]
  exec::buffer<std::int64_t, Exec> rows;               // [L]
  exec::buffer<T, Exec> send, recv;                    // [ep*slab, H] (staged route)
  exec::buffer<T, Exec> x_recv, y;                     // [L*block, H]
  // Direct route (host policies). On communicators with peer buffers (MPI) the rows
  // combine reads in place (the experts' outputs; their inputs when they run in place) are
  // one, made by the first direct call on every rank (zeroed, as x_recv and y are).
  std::vector<const T*> table;
  std::shared_ptr<void> published;
  bool published_made = false;
  std::vector<std::int64_t> start;                     // [E] first row of this rank's rows at the owner
  // Masked path: one plan per slice ([ep] summaries, kept counts, segments; another
  // slice's kept counts and segments hold only the local experts') and the token of each
  // expert-major row.
  bool masked = false;
  exec::buffer<std::int64_t, Exec> slice_summary;            // [ep * (chunks + 2E + 1)]
  exec::buffer<std::int64_t, Exec> slice_kept;               // [ep * E]
  exec::buffer<layout::drop_segment, Exec> slice_segments;   // [ep * E]
  exec::buffer<std::int64_t, Exec> row_source;               // [L*block]
  exec::buffer<std::int64_t, Exec> call_bad;                 // [1] a bad pair in another slice
  // Set while a call of this rank runs, until its last collective has returned: an
  // exception that leaves the call before then (the experts threw, a collective failed)
  // leaves the peers inside it, and moe_layer refuses the layer's later calls on this rank
  // (bounded mode has no exchange that would see the ranks out of step).
  bool in_call = false;

  bound_buffers(const Exec& ex, const mesh& m, const layer_options& o, bool for_masked = false) {
    const int ep = m.ep(), L = m.local_experts(), E = m.experts();
    row_bytes = o.hidden * sizeof(T);
    shape = layout::bound_shape::make(ep, L, o.bound.cap, o.hidden, row_bytes, o.pad);
    rule.mode = capacity_mode::local;
    rule.rows = o.bound.cap;
    rule.priority = o.capacity.priority;
    raise_on_overflow = o.bound.raise_on_overflow;
    chunks = std::max<std::size_t>(1, o.chunks ? o.chunks : layout::default_chunks(ex));
    const auto Es = static_cast<std::size_t>(E);
    offsets.resize(static_cast<std::size_t>(L) + 1);
    for (std::size_t l = 0; l <= static_cast<std::size_t>(L); ++l) offsets[l] = l * shape.block;
    counters = exec::make_buffer<std::int64_t>(ex, layout::bound_counter_fields + Es);
    exec::fill_zero(ex, counters.data(), layout::bound_counter_fields + Es);
    chunk_counts = exec::make_buffer<std::int64_t>(ex, chunks * Es);
    row_off = exec::make_buffer<std::int64_t>(ex, static_cast<std::size_t>(L) * static_cast<std::size_t>(ep + 1));
    rows = exec::make_buffer<std::int64_t>(ex, static_cast<std::size_t>(L));
    masked = for_masked;
    if (!masked) {
      summary = exec::make_buffer<std::int64_t>(ex, summary_stride());
      kept = exec::make_buffer<std::int64_t>(ex, Es);
      segments = exec::make_buffer<layout::drop_segment>(ex, Es);
      slot_row = exec::make_buffer<std::int64_t>(ex, shape.send_rows());
      start.assign(Es, 0);
    } else {
      const auto eps = static_cast<std::size_t>(ep);
      slice_summary = exec::make_buffer<std::int64_t>(ex, eps * summary_stride());
      slice_kept = exec::make_buffer<std::int64_t>(ex, eps * Es);
      slice_segments = exec::make_buffer<layout::drop_segment>(ex, eps * Es);
      row_source = exec::make_buffer<std::int64_t>(ex, shape.expert_rows());
      call_bad = exec::make_buffer<std::int64_t>(ex, 1);
    }
    // Device policies: every row buffer now (no allocation inside a call). Host policies
    // make them on first use: pages nobody touches cost nothing.
    if constexpr (!exec::is_host_policy_v<Exec>) {
      reserve_pairs(ex, 1024);
      if (!masked) staged(ex);
      expert_rows_buffer(ex);
      outputs(ex);
    }
  }

  // Entries of one plan's summary: [chunks] first bad pairs, [E] counts, [E+1] offsets.
  std::size_t summary_stride() const noexcept { return chunks + 2 * static_cast<std::size_t>(shape.experts()) + 1; }
  // The all-to-all path's one plan.
  bound_plan_at plan_arrays() {
    std::int64_t* sm = summary.data();
    const auto Es = static_cast<std::size_t>(shape.experts());
    return {sm, sm + chunks, sm + chunks + Es, kept.data(), segments.data(), pos.data(), src_row.data(), keyed.data()};
  }
  // The masked path's plan of slice s, whose pairs start at pair0 of the call.
  bound_plan_at slice_arrays(int s, std::size_t pair0) {
    const auto Es = static_cast<std::size_t>(shape.experts()), ss = static_cast<std::size_t>(s);
    std::int64_t* sm = slice_summary.data() + ss * summary_stride();
    return {sm,
            sm + chunks,
            sm + chunks + Es,
            slice_kept.data() + ss * Es,
            slice_segments.data() + ss * Es,
            pos.data() + pair0,
            src_row.data() + pair0,
            keyed.data() + pair0};
  }

  // The per-pair arrays hold at least n pairs (they grow on a call with more pairs than
  // any before; a captured call replays with the same shapes).
  void reserve_pairs(const Exec& ex, std::size_t n) {
    if (n <= pairs && pos.data() != nullptr) return;
    pairs = std::max<std::size_t>(n, 1);
    pos = exec::make_buffer<std::int64_t>(ex, pairs);
    src_row = exec::make_buffer<std::int64_t>(ex, pairs);
    slab_pos = exec::make_buffer<std::int64_t>(ex, pairs);
    keyed = exec::make_buffer<std::uint64_t>(ex, pairs);
  }
  void staged(const Exec& ex) {
    if (send.data() != nullptr) return;
    const std::size_t n = shape.send_rows() * shape.hidden;
    send = exec::make_buffer<T>(ex, n);
    recv = exec::make_buffer<T>(ex, n);
    exec::fill_zero(ex, send.data(), n);  // rows that carry nothing travel as zeros
    exec::fill_zero(ex, recv.data(), n);
  }
  T* expert_rows_buffer(const Exec& ex) {
    if (x_recv.data() == nullptr) {
      x_recv = exec::make_buffer<T>(ex, shape.expert_rows() * shape.hidden);
      if constexpr (!exec::is_host_policy_v<Exec>) exec::fill_zero(ex, x_recv.data(), shape.expert_rows() * shape.hidden);
    }
    return x_recv.data();
  }
  T* outputs(const Exec& ex) {
    if (y.data() == nullptr) {
      y = exec::make_buffer<T>(ex, shape.expert_rows() * shape.hidden);
      if constexpr (!exec::is_host_policy_v<Exec>) exec::fill_zero(ex, y.data(), shape.expert_rows() * shape.hidden);
    }
    return y.data();
  }
};

// The split-phase stages have no bounded-mode form: bounded mode's calls are fused (spec
// section 11). Options agree on every rank (checked at construction), so every rank raises
// here together.
template <class Comm>
void require_unbounded(const layer_context<Comm>& ctx, const char* stage) {
  EPX_REQUIRE(ctx.bound == nullptr, errc::configuration, "moe_layer ", stage,
              ": the split-phase calls are not available in bounded mode (layer_options::counts == "
              "count_exchange::device); use forward and backward");
}

// Whether implementation Impl takes bounded mode on the masked path (its bound_buffers then
// plan every slice and hold no slabs): Impl::bounded_masked.
template <class Impl, class = void>
struct bounded_masked_impl : std::false_type {};
template <class Impl>
struct bounded_masked_impl<Impl, std::void_t<decltype(Impl::bounded_masked)>>
    : std::bool_constant<Impl::bounded_masked> {};

// What layer_stats says of a bounded call: its path and route; the per-call figures of the
// normal mode stay empty (they would need a host read).
inline void note_bounded_stats(layer_stats& st, const char* path, bool direct) {
  st.path = path;
  st.bounded = true;
  st.peer_access = direct;
  st.tokens_per_local_expert.clear();
  st.padding_per_local_expert.clear();
  st.rows_sent.clear();
  st.rows_received.clear();
  st.tokens_per_expert.clear();
  st.dropped_per_expert.clear();
  st.dropped_pairs = 0;
  st.max_expert_load = st.mean_expert_load = st.max_rank_load = st.mean_rank_load = 0.0;
  st.max_nodes_per_token = 0;
  st.mean_nodes_per_token = 0.0;
  st.indexed_sends = false;
  st.stage_rounds = 0;
}

// A bounded call whose shapes failed on this rank raises here, after joining every
// collective of the call. The call is counted: the next check() raises it on every rank of
// the group, this one included, and this rank must make that collective too.
inline void raise_bounded_shape(int status, const char* message) {
  EPX_REQUIRE(status == 0, errc::input, message,
              " (bounded mode: this rank joined the call with nothing to send and counted it; every rank of the "
              "EP group, this one included, raises it at its next moe_layer::check(), a collective this rank "
              "must still make)");
}

// The group's sum of `count` values at `data` (in place); a rank with bad shapes passes null
// and joins with zeros. The caller has ordered the policy's work before it.
template <class Exec, class Comm, class V>
void sum_or_join_zeros(const Exec& ex, Comm& group, V* data, std::size_t count) {
  if (data != nullptr) {
    all_reduce(group, span<V>(data, count));
    return;
  }
  auto zeros = exec::make_buffer<V>(ex, std::max<std::size_t>(count, 1));
  exec::fill_zero(ex, zeros.data(), count);
  order_before_collective(ex, group);  // a host communicator reads the zeros from the host
  all_reduce(group, span<V>(zeros.data(), count));
}

// A call's array of n values: the layer's own `mine` in an inference call, a new one that
// the saved state keeps (`keep`) in a training call.
template <class Exec, class Buffer>
auto* call_array(const Exec& ex, bool train, Buffer& keep, Buffer& mine, std::size_t n) {
  if (!train) return mine.data();
  keep = exec::make_buffer<std::remove_pointer_t<decltype(mine.data())>>(ex, n);
  return keep.data();
}

// Steps 1 and 2 of a bounded call over P pairs (ids, w; null when P is 0): the counting-sort
// plan of epx/layout/plan.hpp (its four functors, nothing read back) and the local capacity
// rule with C = cap (layout::bound_keep, layout::drop_pairs with the options' priority), into
// `at`. The rule runs for the experts [bound_first, bound_last) (all E by default): the
// caller reads the kept counts, segments and drops of those only, and the other experts'
// pairs keep their plan positions. Returns the plan's chunk count (the entries of
// at.chunk_bad it wrote).
template <class T, class Exec>
std::size_t bounded_plan(const Exec& ex, bound_buffers<T, Exec>& b, const std::int32_t* ids, const float* w,
                         std::size_t P, int k, const bound_plan_at& at, int bound_first = 0, int bound_last = -1) {
  const int E = b.shape.experts();
  const auto Es = static_cast<std::size_t>(E);
  const auto e0 = static_cast<std::size_t>(bound_first), e1 = bound_last < 0 ? Es : static_cast<std::size_t>(bound_last);
  std::size_t C = std::max<std::size_t>(1, std::min(b.chunks, P));
  const std::size_t per = P ? (P + C - 1) / C : 1;
  C = P ? (P + per - 1) / per : 1;
  exec::for_each_n(ex, C, layout::histogram_chunks{ids, w, P, per, E, b.chunk_counts.data(), at.chunk_bad});
  exec::for_each_n(ex, Es, layout::scan_chunks{b.chunk_counts.data(), at.counts, C, E});
  exec::for_each_n(ex, 1, layout::expert_offsets{at.counts, at.offset, E});
  exec::for_each_n(ex, C, layout::scatter_pairs{ids, w, P, per, E, k, at.offset, b.chunk_counts.data(), at.pos, at.src_row});
  exec::for_each_range(ex, e0, e1, layout::bound_keep{at.counts, at.offset, b.shape.cap, at.segments, at.kept});
  if (b.rule.priority == drop_priority::score) layout::drop_pairs::check_segment(static_cast<std::int64_t>(P));
  if (P > 0)
    exec::for_each_range(ex, e0, e1,
                         layout::drop_pairs{ids, w, at.pos, at.src_row, at.segments, at.keyed, k, 1,
                                            b.rule.priority == drop_priority::score, false});
  return C;
}

// The route itself; all_to_all_impl hands it its calls in bounded mode.
template <class Comm>
class bounded_route {
 public:
  explicit bounded_route(const layer_context<Comm>& ctx) : ctx_(ctx) {}

  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    row_slice slice;
    exec::buffer<std::int64_t, Exec> slab_pos;  // [n*k]
    exec::buffer<std::int64_t, Exec> slot_row;  // [ep*slab]
    exec::buffer<float, Exec> w_slot;           // [ep*slab] routing weight of each slab row
    exec::buffer<std::int64_t, Exec> row_off;   // [L*(ep+1)]
    exec::buffer<std::int64_t, Exec> rows_of;   // [L]
    exec::buffer<T, Exec> x_recv;               // [L*block, H]
    exec::buffer<T, Exec> back;                 // [ep*slab, H] the outputs, back in slab shape
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    auto& b = *static_cast<bound_buffers<T, Exec>*>(ctx_.bound);
    const layout::bound_shape& sh = b.shape;
    const int L = sh.L, ep = sh.ep, E = sh.experts(), tp = ctx_.tp_size(), k = a.top_k;
    const auto ks = static_cast<std::size_t>(k);
    const std::size_t H = a.hidden, SR = sh.send_rows(), XR = sh.expert_rows();
    const bool ok = a.status == 0, train = saved != nullptr;
    b.in_call = true;
    const row_slice sl = ok ? slice_bounds(a.rows, tp, ctx_.tp_rank()) : row_slice{};
    const std::size_t n = sl.size(), P = n * ks;
    const std::int32_t* ids = ok ? a.ids + sl.begin * ks : nullptr;
    const float* w = ok ? a.weights + sl.begin * ks : nullptr;
    const T* x = ok ? a.x + sl.begin * H : nullptr;
    b.reserve_pairs(ex, P);

    // 1, 2. The plan (no read-back) and the bound; counters.
    const bound_plan_at at = b.plan_arrays();
    const std::size_t C = bounded_plan(ex, b, ids, w, P, k, at);
    const std::int64_t* counts = at.counts;
    const std::int64_t* offset = at.offset;
    exec::for_each_n(ex, 1, layout::bound_tally{counts, at.kept, at.chunk_bad, C, E, ok ? 0 : 1, b.counters.data()});

    // Where this call's arrays live: the layer's (inference) or the saved state's (training).
    state<T, Exec> st;
    const auto Ls = static_cast<std::size_t>(L);
    std::int64_t* slab_pos = call_array(ex, train, st.slab_pos, b.slab_pos, std::max<std::size_t>(P, 1));
    std::int64_t* slot_row = call_array(ex, train, st.slot_row, b.slot_row, SR);
    std::int64_t* row_off = call_array(ex, train, st.row_off, b.row_off, Ls * static_cast<std::size_t>(ep + 1));
    std::int64_t* rows_of = call_array(ex, train, st.rows_of, b.rows, Ls);
    // 3. Slab rows of the pairs and slice rows of the slab rows.
    exec::for_each_n(ex, P, layout::bound_positions{ids, w, b.pos.data(), offset, sh, slab_pos});
    exec::for_each_n(ex, SR, layout::bound_slots{b.src_row.data(), offset, b.kept.data(), sh, slot_row});

    T* out = ok ? a.out + sl.begin * H : nullptr;
    if (ok) {
      exec::fill_zero(ex, a.out, sl.begin * H);  // the slice's rows are all written below
      exec::fill_zero(ex, a.out + sl.end * H, (a.rows - sl.end) * H);
    }
    if (ctx_.stats != nullptr) note_bounded_stats(*ctx_.stats, "all_to_all", false);

    bool done = false;
    if constexpr (has_peer_access_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (!train && ctx_.options.peer_access && peer_access_available(*ctx_.ep)) {
        direct_forward(ex, b, experts, x, w, out, n, k, slab_pos, slot_row);
        done = true;
      }
    }
    if (!done) {
      // 4. Staged: headers and rows into the slabs, one fixed all-to-all.
      b.staged(ex);
      T* send = b.send.data();
      T* recv = b.recv.data();
      exec::for_each_n(ex, static_cast<std::size_t>(ep),
                       layout::bound_header{b.kept.data(), sh, b.row_bytes, reinterpret_cast<unsigned char*>(send)});
      exec::for_each_row<T>(ex, SR, H, layout::bound_gather<T>{x, slot_row, nullptr, H, send});
      order_before_collective(ex, *ctx_.ep);
      all_to_all(*ctx_.ep, span<const T>(send, SR * H), span<T>(recv, SR * H));
      exec::for_each_n(ex, static_cast<std::size_t>(L),
                       layout::bound_arrivals{reinterpret_cast<const unsigned char*>(recv), sh, b.row_bytes, row_off,
                                              rows_of});
      T* x_recv = nullptr;
      if (train) {
        st.x_recv = exec::make_buffer<T>(ex, XR * H);
        x_recv = st.x_recv.data();
      } else {
        x_recv = b.expert_rows_buffer(ex);
      }
      exec::for_each_row<T>(ex, XR, H, layout::bound_unpack<T>{recv, row_off, sh, train, x_recv});
      // 5. Experts.
      const expert_rows<const T> er{x_recv, XR, H, b.offsets.data(), L, ctx_.first_expert(), rows_of};
      rows_buffer<T, Exec> y_call;
      T* y = x_recv;
      if (train) {
        y_call = make_rows<T>(ws_, ex, XR * H);
        y = y_call.data();
      } else if (!forward_in_place_v<Experts>) {
        y = b.outputs(ex);
      }
      bounded_expert_forward(experts, ex, er, y);
      // 6. Back in slab shape; combine.
      exec::for_each_row<T>(ex, SR, H, layout::bound_pack<T>{y, row_off, sh, send});
      T* back = recv;
      if (train) {
        st.back = exec::make_buffer<T>(ex, SR * H);
        back = st.back.data();
      }
      order_before_collective(ex, *ctx_.ep);
      all_to_all(*ctx_.ep, span<const T>(send, SR * H), span<T>(back, SR * H));
      if (ok) kernels::combine(ex, n, H, k, static_cast<const T*>(back), w, slab_pos, out);
    }
    if (tp > 1) order_before_collective(ex, *ctx_.ep);
    finish_tp(ex, a.out, a.rows * H, ok);
    if (train) {
      st.rows = a.rows;
      st.hidden = H;
      st.top_k = k;
      st.slice = sl;
      st.w_slot = exec::make_buffer<float>(ex, SR);
      if (P > 0) kernels::scatter(ex, P, static_cast<const std::int64_t*>(slab_pos), w, st.w_slot.data());
      saved->template emplace<state<T, Exec>>(std::move(st));
    }
    b.in_call = false;
    raise_bounded_shape(a.status, a.status_message);
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    if (const char* why = saved.template unusable_as<state<T, Exec>>(ctx_.layer); *why) return join_without_state(ex, a, why);
    auto& s = saved.template get<state<T, Exec>>();
    const auto call = static_cast<std::int64_t>(saved.call());  // the number of its forward call (>= 1)
    auto& b = *static_cast<bound_buffers<T, Exec>*>(ctx_.bound);
    b.in_call = true;
    const layout::bound_shape& sh = b.shape;
    const int L = sh.L, tp = ctx_.tp_size();
    const std::size_t H = s.hidden, SR = sh.send_rows(), XR = sh.expert_rows();
    const auto k = static_cast<std::size_t>(s.top_k);
    // No shape exchange: each rank checks its own against its forward call's.
    const std::string differ = a.status == 0 ? backward_shape_error(a, s.rows, s.hidden, s.top_k) : std::string();
    const bool ok = a.status == 0 && differ.empty();
    const row_slice sl = s.slice;
    const std::size_t n = sl.size(), N = s.rows;
    if (!ok) exec::for_each_n(ex, 1, layout::bound_shape_failed{b.counters.data()});
    b.staged(ex);
    T* send = b.send.data();
    T* recv = b.recv.data();
    // grad_y rows w * grad_out in the forward's slab rows; the owners read the counts saved.
    // A rank with bad shapes sends zero rows (the buffer still holds the forward's rows,
    // which its peers would take for gradients).
    if (ok)
      exec::for_each_row<T>(ex, SR, H,
                            layout::bound_gather<T>{a.grad_out + sl.begin * H, s.slot_row.data(), s.w_slot.data(), H,
                                                    send});
    else
      exec::fill_zero(ex, send, SR * H);
    // The number of the forward call travels in the slabs' headers: a receiver that gets
    // another number than its own counts the call (check() raises it on every rank).
    if (ok && call > 0)
      exec::for_each_n(ex, static_cast<std::size_t>(sh.ep),
                       layout::bound_call_tag{call, sh, b.row_bytes, reinterpret_cast<unsigned char*>(send)});
    order_before_collective(ex, *ctx_.ep);
    all_to_all(*ctx_.ep, span<const T>(send, SR * H), span<T>(recv, SR * H));
    if (call > 0)
      exec::for_each_n(ex, 1,
                       layout::bound_call_check{reinterpret_cast<const unsigned char*>(recv), sh, b.row_bytes, call,
                                                b.counters.data()});
    auto grad_recv = make_rows<T>(ws_, ex, XR * H);
    auto grad_in = make_rows<T>(ws_, ex, XR * H);
    exec::for_each_row<T>(ex, XR, H, layout::bound_unpack<T>{recv, s.row_off.data(), sh, true, grad_recv.data()});
    const expert_rows<const T> er{s.x_recv.data(), XR, H, b.offsets.data(), L, ctx_.first_expert(), s.rows_of.data()};
    experts.backward(ex, er, static_cast<const T*>(grad_recv.data()), grad_in.data());
    exec::for_each_row<T>(ex, SR, H, layout::bound_pack<T>{grad_in.data(), s.row_off.data(), sh, send});
    order_before_collective(ex, *ctx_.ep);
    all_to_all(*ctx_.ep, span<const T>(send, SR * H), span<T>(recv, SR * H));
    if (ok) {
      exec::fill_zero(ex, a.grad_weights, N * k);
      exec::fill_zero(ex, a.grad_x, sl.begin * H);
      exec::fill_zero(ex, a.grad_x + sl.end * H, (N - sl.end) * H);
      const T* grad_out = a.grad_out + sl.begin * H;
      kernels::weight_gradients(ex, n, H, s.top_k, static_cast<const T*>(s.back.data()), grad_out,
                                static_cast<const std::int64_t*>(s.slab_pos.data()), a.grad_weights + sl.begin * k);
      kernels::reduce(ex, n, H, s.top_k, static_cast<const T*>(recv), static_cast<const std::int64_t*>(s.slab_pos.data()),
                      a.grad_x + sl.begin * H);
    }
    if (tp > 1) {
      order_before_collective(ex, *ctx_.ep);
      finish_tp(ex, a.grad_x, N * H, ok);
      finish_tp(ex, a.grad_weights, N * k, ok);
    }
    b.in_call = false;
    raise_bounded_shape(ok ? 0 : 1, differ.empty() ? a.status_message : differ.c_str());
  }

 private:
  // A backward whose saved state is unusable (`why`): this rank counts a shape failure,
  // joins both all-to-alls with zero rows (as an owner it has no rows to run its experts'
  // backward on: its peers get zero rows back) and the TP sums with zeros, then raises.
  template <class T, class Exec>
  void join_without_state(const Exec& ex, const backward_args<T>& a, const char* why) {
    auto& b = *static_cast<bound_buffers<T, Exec>*>(ctx_.bound);
    const layout::bound_shape& sh = b.shape;
    const std::size_t H = sh.hidden, SR = sh.send_rows();
    b.in_call = true;
    exec::for_each_n(ex, 1, layout::bound_shape_failed{b.counters.data()});
    b.staged(ex);
    T* send = b.send.data();
    T* recv = b.recv.data();
    exec::fill_zero(ex, send, SR * H);
    for (int direction = 0; direction < 2; ++direction) {
      order_before_collective(ex, *ctx_.ep);
      all_to_all(*ctx_.ep, span<const T>(send, SR * H), span<T>(recv, SR * H));
    }
    if (ctx_.tp_size() > 1) {
      order_before_collective(ex, *ctx_.ep);
      finish_tp(ex, static_cast<T*>(nullptr), a.rows * H, false);
      finish_tp(ex, static_cast<float*>(nullptr), a.rows * static_cast<std::size_t>(a.top_k), false);
    }
    b.in_call = false;
    raise_bounded_shape(1, why);
  }

  // The TP group sums the slices (a rank with bad shapes joins with zeros); the caller
  // has ordered the policy's work before it.
  template <class Exec, class V>
  void finish_tp(const Exec& ex, V* data, std::size_t count, bool ok) {
    if (ctx_.tp_size() > 1) sum_or_join_zeros(ex, *ctx_.tp, ok ? data : nullptr, count);
  }

  // Direct route, inference on host policies: the owners read counts and rows out of the
  // senders' buffers, combine reads the outputs in place at their owners.
  template <class T, class Exec, class Experts>
  void direct_forward(const Exec& ex, bound_buffers<T, Exec>& b, Experts& experts, const T* x, const float* w, T* out,
                      std::size_t n, int k, const std::int64_t* slab_pos, const std::int64_t* slot_row) {
    if constexpr (has_peer_access_v<Comm>) {
      const layout::bound_shape& sh = b.shape;
      const int L = sh.L, ep = sh.ep, E = sh.experts(), me = ctx_.ep_rank();
      const std::size_t H = sh.hidden, XR = sh.expert_rows(), SR = sh.send_rows();
      const auto cap = static_cast<std::size_t>(sh.cap);
      T* peer = nullptr;  // see bound_buffers::published
      if constexpr (has_peer_buffer_v<Comm>) {
        if (!b.published_made) {
          b.published = ctx_.ep->peer_buffer(XR * H * sizeof(T));
          b.published_made = true;
          if (b.published != nullptr) std::memset(b.published.get(), 0, XR * H * sizeof(T));
        }
        peer = static_cast<T*>(b.published.get());
      }
      T* x_recv = forward_in_place_v<Experts> && peer != nullptr ? peer : b.expert_rows_buffer(ex);
      b.table.resize(std::max(XR, SR));
      const T** table = b.table.data();
      std::int64_t* row_off = b.row_off.data();
      std::int64_t* rows_of = b.rows.data();
      const void* mine[3] = {x, slot_row, b.kept.data()};
      const std::size_t bytes[3] = {n * H * sizeof(T), SR * sizeof(std::int64_t),
                                    static_cast<std::size_t>(E) * sizeof(std::int64_t)};
      ctx_.ep->access_peers(mine, bytes, 3, [&](const auto& peers) {
        auto kept_of = [&](int s) { return static_cast<const std::int64_t*>(peers(s, 2)); };
        for (int e = 0; e < E; ++e) {
          std::int64_t at = 0;
          for (int s = 0; s < me; ++s) at += kept_of(s)[e];
          b.start[static_cast<std::size_t>(e)] = at;
        }
        for (int l = 0; l < L; ++l) {
          std::int64_t* o = row_off + static_cast<std::size_t>(l) * static_cast<std::size_t>(ep + 1);
          std::int64_t at = 0;
          const std::size_t e = static_cast<std::size_t>(me) * static_cast<std::size_t>(L) + static_cast<std::size_t>(l);
          const T** t = table + static_cast<std::size_t>(l) * sh.block;
          for (int s = 0; s < ep; ++s) {
            o[s] = at;
            const std::int64_t c = kept_of(s)[e];
            const T* xs = static_cast<const T*>(peers(s, 0));
            const auto* rs = static_cast<const std::int64_t*>(peers(s, 1)) + static_cast<std::size_t>(me) * sh.slab +
                             sh.hdr + static_cast<std::size_t>(l) * cap;
            for (std::int64_t i = 0; i < c; ++i)
              t[at + i] = xs + static_cast<std::size_t>(rs[i]) * H;
            at += c;
          }
          o[ep] = at;
          rows_of[l] = at;
          kernels::copy(ex, static_cast<std::size_t>(at), H, static_cast<const T* const*>(t),
                        x_recv + static_cast<std::size_t>(l) * sh.block * H);
        }
      });
      const expert_rows<const T> er{x_recv, XR, H, b.offsets.data(), L, ctx_.first_expert(), rows_of};
      T* y = forward_in_place_v<Experts> ? x_recv : peer != nullptr ? peer : b.outputs(ex);
      bounded_expert_forward(experts, ex, er, y);
      const std::int64_t* kept = b.kept.data();
      const void* mine_y[1] = {y};
      const std::size_t bytes_y[1] = {XR * H * sizeof(T)};
      ctx_.ep->access_peers(mine_y, bytes_y, 1, [&](const auto& peers) {
        for (int d = 0; d < ep; ++d) {
          const T* yd = static_cast<const T*>(peers(d, 0));
          for (int l = 0; l < L; ++l) {
            const std::size_t e = static_cast<std::size_t>(d) * static_cast<std::size_t>(L) + static_cast<std::size_t>(l);
            const std::size_t r0 = static_cast<std::size_t>(d) * sh.slab + sh.hdr + static_cast<std::size_t>(l) * cap;
            const std::size_t first = static_cast<std::size_t>(l) * sh.block + static_cast<std::size_t>(b.start[e]);
            for (std::int64_t i = 0; i < kept[e]; ++i)
              table[r0 + static_cast<std::size_t>(i)] = yd + (first + static_cast<std::size_t>(i)) * H;
          }
        }
        if (out != nullptr) kernels::combine(ex, n, H, k, kernels::row_table<T>{table}, w, slab_pos, out);
      });
      if (ctx_.stats != nullptr) ctx_.stats->peer_access = true;
    } else {
      (void)ex, (void)b, (void)experts, (void)x, (void)w, (void)out, (void)n, (void)k, (void)slab_pos, (void)slot_row;
    }
  }

  layer_context<Comm> ctx_;
  workspace ws_;
};

// moe_layer::check(): the counters of the ranks of `group` (the EP group, or a union of
// whole EP groups named `group_name`) since the last check (then reset); raises
// errc::input on every rank of `group` for counted bad input, and for overflow when asked to.
template <class Comm, class T, class Exec>
bound_report check_bound(const Exec& ex, Comm& group, bound_buffers<T, Exec>& b, int rank,
                         const char* group_name = "the EP group") {
  const std::size_t E = static_cast<std::size_t>(b.shape.experts()), n = layout::bound_counter_fields + E;
  // [0, n): the group's sums; [n, 2n): this rank's own counters (read for the message).
  auto sum = exec::make_buffer<std::int64_t>(ex, 2 * n);
  exec::copy_n(ex, static_cast<const std::int64_t*>(b.counters.data()), n, sum.data());
  exec::copy_n(ex, static_cast<const std::int64_t*>(b.counters.data()), n, sum.data() + n);
  exec::fill_zero(ex, b.counters.data(), n);
  order_before_collective(ex, group);
  all_reduce(group, span<std::int64_t>(sum.data(), n));
  std::vector<std::int64_t> h(2 * n);
  read_back(ex, group, static_cast<const std::int64_t*>(sum.data()), 2 * n, h.data());
  bound_report r;
  r.overflow_pairs = h[layout::bound_overflow];
  r.bad_input_calls = h[layout::bound_bad_input];
  r.shape_error_calls = h[layout::bound_shape_error];
  r.calls = h[layout::bound_calls];
  r.dropped_per_expert.assign(h.begin() + layout::bound_counter_fields, h.begin() + static_cast<std::ptrdiff_t>(n));
  if (r.bad_input_calls != 0 || r.shape_error_calls != 0) {
    // Every rank of the group takes this branch (the sums agree): one more collective
    // names the ranks whose calls were counted.
    const std::int64_t mine[3] = {rank, h[n + layout::bound_bad_input], h[n + layout::bound_shape_error]};
    std::vector<std::int64_t> all(3 * static_cast<std::size_t>(group.size()));
    all_gather_host(group, mine, 3, all.data());
    std::string where;
    for (std::size_t i = 0; i < all.size(); i += 3)
      if (all[i + 1] != 0 || all[i + 2] != 0)
        where += concat(where.empty() ? "" : ", ", "rank ", all[i], " (",
                        all[i + 1] != 0 ? concat(all[i + 1], " with bad ids or weights") : std::string(),
                        all[i + 1] != 0 && all[i + 2] != 0 ? ", " : "",
                        all[i + 2] != 0 ? concat(all[i + 2], " with bad shapes") : std::string(), ")");
    EPX_REQUIRE(false, errc::input, "moe_layer::check (rank ", rank, "): bounded mode: since the last check, ",
                r.bad_input_calls, " call(s) of ", group_name,
                " had an expert id out of range or a non-finite routing weight (those pairs did not travel) and ",
                r.shape_error_calls,
                " call(s) had bad shapes or were backwards whose ranks took back different forward calls; counted on ",
                where);
  }
  if (b.raise_on_overflow && r.overflow_pairs > 0) {
    const auto most = std::max_element(r.dropped_per_expert.begin(), r.dropped_per_expert.end());
    EPX_REQUIRE(false, errc::input, "moe_layer::check (rank ", rank, "): bounded mode: ", r.overflow_pairs,
                " (token, slot) pair(s) overflowed the bound cap=", b.shape.cap,
                " since the last check and were dropped (most for expert ", most - r.dropped_per_expert.begin(), ": ",
                *most, "); raise layer_options::bound.cap, or set bound.raise_on_overflow = false to drop them "
                "without raising");
  }
  return r;
}

}  // namespace detail
}  // namespace epx
