// epx/impl/all_to_all.hpp: token dispatch and combine over the EP group (spec section 4).
//
// Forward, per call:
//   1. TP slice [b, e) of the N rows (empty slices join everything below);
//   2-3. the shared prologue (epx/impl/prologue.hpp): counting-sort send layout of the
//      slice's (row, slot) pairs, count exchange (all_gather of {status, N, H, k,
//      rank, mode, counts[E]} over the EP group; bad input anywhere raises on every rank here, before
//      rows move) and the receive layout (epx/layout/receive.hpp);
//   4. rows land expert-major (with zero padding rows) at the owner of their expert, with
//      no second permutation;
//   5. the user's experts (over their own inputs in inference when they allow it,
//      epx::forward_in_place_v): the caller's, between the dispatch stage (1-4) and the
//      combine stage (6-7); the fused forward runs the two stages around them
//      (detail::forward_by_stages), the split-phase calls of the layer one at a time;
//   6-7. every token's k output rows are summed in accum_t, slot order, into the
//      zero-filled [N, H] output; the TP group all-reduces it.
// Steps 4 and 6-7 take one of two routes, with bitwise the same results:
//   staged (any communicator): gather into a send-order buffer, segmented all-to-all;
//      then the mirrored all-to-all back into send order, and combine: four passes over
//      the routed rows. An inference forward and every backward make them in rounds
//      through a stage of at most layer_options::stage_bytes instead of a buffer of all
//      n*k rows (epx/layout/rounds.hpp); a training forward keeps its send-order outputs
//      for backward and moves them in one round, and the FP8 dispatch's rows go out in one
//      round (an inference call's outputs still come back in rounds). On communicators
//      that send rows by index (epx::has_indexed_sends_v: threads, MPI) and host
//      policies, the forward dispatch sends the rows straight out of x (FP8: the bytes,
//      then the scales, out of the quantised rows, in two collectives), in one
//      collective, with no gather (layer_options::indexed_sends): three passes;
//   direct (communicators with peer access, epx::has_peer_access_v, whose ranks can use it
//      now, epx::peer_access_available; layer_options::peer_access): each owner copies
//      its rows straight out of the senders' x (FP8: out of their quantised rows and
//      scales), and combine reads every slot's output row in place at its owner
//      (epx/layout/receive.hpp): two passes, no send buffer. The row tables are made on
//      the policy (kernels::peer_table reads the senders' send-position rows where they
//      are), so device policies take it too: the threads communicator over one device's
//      memory hands out the ranks' device pointers, as NVLink peer access would. (On
//      MPI the peers can read only shared memory: the rows the layer publishes itself, the
//      experts' outputs (inference in place: their inputs) and backward's input
//      gradients, are made in peer buffers (epx::has_peer_buffer_v) and read there; the
//      caller's x and grad_out are copied into the communicator's shared window, one more
//      pass over them.)
// With per-rank sends (layer_options::sends == row_sends::per_rank, spec section 14;
// epx/layout/per_rank.hpp) the staged route moves one row per (token, destination rank):
//   gather the unique rows, all-to-all them with their slot entries (expert-major row and
//   weight of each slot at that owner), the owner copies each into its slots' rows; back,
//   the owner sums w * y over each unique row's slots (accum_t<T>: double for double rows,
//   float32 otherwise; slot order, rounded once to T) and the source adds the returned rows
//   in the order of each owner's first slot.
//   Expert rows and grad_weights are bitwise the per-slot mode's; out and grad_x differ by
//   that rounding. It takes the staged route even where peer access is available.
// Before every call of a host communicator (threads, MPI) over a device policy's buffers
// the policy is synchronised, so the communicator never reads buffers a device stream is
// still writing; a device communicator runs on the policy's queue, after its work, with no
// wait. Every read-back of a collective's result waits through the communicator's bounded
// wait first (detail::read_back).
// Backward runs the same route in reverse with the saved layout (no count exchange, only
// a small shape check exchange), in two stages as well: backward_dispatch (grad_weights
// and the gradients of the experts' outputs, expert-major) and backward_combine (grad_x).
// In bounded mode (layer_options::counts == count_exchange::device) forward and backward
// take the route of epx/impl/bounded.hpp instead, and the split-phase stages are refused.
// Row buffers of host policies come from a pool kept by the implementation between calls
// (detail::workspace), so repeated calls do not page-fault fresh allocations; device
// policies allocate through exec::make_buffer (stream-ordered).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/comm/settle.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/impl/bounded.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/impl/prologue.hpp"
#include "epx/kernels/fp8.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/exec/host_copy.hpp"
#include "epx/layout/per_rank.hpp"
#include "epx/layout/receive.hpp"
#include "epx/layout/rounds.hpp"
#include "epx/layout/slicing.hpp"

namespace epx {
namespace detail {

// Zero-fills the padding rows of owner `me`'s expert-major buffer.
template <class Exec, class T>
void zero_padding(const Exec& ex, T* rows, const receive_layout& lay, int me, std::size_t H) {
  const std::size_t* off = lay.offsets(me);
  const std::size_t* got = lay.received(me);
  for (int l = 0; l < lay.L; ++l) {
    const std::size_t b = off[l] + got[l];
    exec::fill_zero(ex, rows + b * H, (off[l + 1] - b) * H);
  }
}

// Scale 1 for the padding rows of owner `me`'s FP8 scales ([R, H/128]), as for a zero block.
template <class Exec>
void unit_padding_scales(const Exec& ex, float* scales, const receive_layout& lay, int me, std::size_t blocks) {
  const std::size_t* off = lay.offsets(me);
  const std::size_t* got = lay.received(me);
  for (int l = 0; l < lay.L; ++l) {
    const std::size_t b = off[l] + got[l];
    kernels::fill(ex, (off[l + 1] - b) * blocks, 1.0f, scales + b * blocks);
  }
}

template <class Comm>
class all_to_all_impl {
 public:
  static constexpr const char* name = "all_to_all";

  explicit all_to_all_impl(const layer_context<Comm>& ctx) : ctx_(ctx), bounded_(ctx) {}

  // Any mesh: the all-to-all path has no rule of its own beyond the mesh's.
  static std::string can_implement(const mesh&, const layer_options&) { return {}; }

  // What combine and backward need; buffers in the policy's memory space. The dispatch
  // stage makes it (the flight state of a split call), combine moves it into the saved
  // state of a training call.
  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    row_slice slice;
    receive_layout layout;
    segments seg;                              // staged: this rank's segments
    std::size_t widest = 0;                    // staged: the EP group's largest slice (rows)
    // Staged route in rounds (epx/layout/rounds.hpp; inference forwards and backward, when
    // a stage of layer_options::stage_bytes holds fewer rows than the largest slice sends):
    // rounds.count > 1, `send` is the stage.
    staged_rounds rounds;
    // The plan's index vectors on device policies, copied to the policy's memory (host
    // policies read rounds.src, send_pos and at themselves): in_policy picks.
    rows_buffer<std::int64_t, Exec> round_src, round_pos, round_at;
    const std::int64_t* in_policy(const std::vector<std::int64_t>& planned,
                                  const rows_buffer<std::int64_t, Exec>& copy) const {
      if constexpr (exec::is_host_policy_v<Exec>) {
        (void)copy;
        return planned.data();
      } else {
        (void)planned;
        return copy.data();
      }
    }
    bool direct = false;                       // made by the direct route (y stays at the owners)
    exec::buffer<std::int64_t, Exec> pos;      // [n*k] send position of pair (t, j)
    exec::buffer<std::int64_t, Exec> src_row;  // [S] the slice row of each send position
    exec::buffer<float, Exec> weights;         // [S] routing weight of each send position
    rows_buffer<T, Exec> x_recv;               // [R, H] expert-major input rows (FP8 dispatch: made by backward)
    bool fp8 = false;                          // FP8 dispatch (layer_options::fp8_dispatch)
    bool by_index = false;                     // staged sends read rows by index (layer_options::indexed_sends)
    // Per-rank sends (layer_options::sends; staged route; epx/layout/per_rank.hpp): the
    // send and return buffers hold U unique rows, y stays at its owner (expert-major), and
    // the owner keeps its received rows' slot entries.
    bool per_rank = false;
    rank_rows ranks;                           // unique rows to and from every peer
    rows_buffer<std::int64_t, Exec> unique_src;  // [U] slice row of each unique row
    rows_buffer<std::int64_t, Exec> first;     // [n*k] unique row at the first slot of its owner, -1
    rows_buffer<std::int64_t, Exec> pair;      // [n*k] u*k + j of a kept pair, -1
    rows_buffer<std::int64_t, Exec> slot_row;  // owner: [Ur*k] expert-major row of each received slot, -1;
                                               // then (as floats) slot_weight
    float* slot_weight = nullptr;              // owner: [Ur*k] its weight, inside slot_row's buffer
    rows_buffer<std::int64_t, Exec> recv_from;   // owner: [R] received row of each expert-major row, -1
    rows_buffer<float, Exec> recv_weight;        // owner: [R] its slot's weight
    rows_buffer<T, Exec> stage;                // owner: [Ur, H] received rows, then the returned sums
    rows_buffer<fp8_e4m3, Exec> x8;            // FP8: [R, H] expert-major rows as E4M3, then their scales
    float* scales = nullptr;                   // FP8: [R, H/128] the scales, in x8 after the R*H bytes
    rows_buffer<T, Exec> y;                    // staged: [S, H] outputs in send order; direct: [R, H] expert-major
    // Between dispatch and combine only.
    exec::buffer<float, Exec> slice_weights;  // [n*k] the slice's routing weights (the caller's may change)
    rows_buffer<T, Exec> send;                 // staged: [S, H] send order, reused for the return (rounds: the stage)
    rows_buffer<T, Exec> outputs;              // [R, H] the experts' outputs (unless over x_recv)
    T* out_rows = nullptr;                     // where the experts write
  };

  // What backward's combine needs: the forward's state and the gradient rows.
  template <class T, class Exec>
  struct backward_state {
    saved_state<T> forward;
    rows_buffer<T, Exec> grad_recv;  // [R, H] gradients of the experts' outputs
    rows_buffer<T, Exec> grad_in;    // [R, H] gradients of their inputs
    rows_buffer<T, Exec> grad_send;  // staged: [S, H] send order (per-rank: [U, H]; rounds: the stage)
    rows_buffer<T, Exec> grad_stage;  // per-rank, owner: [Ur, H] grad_out rows, then the summed grad_in
    float* grad_weights = nullptr;   // the call's [N, k], summed over the TP group by backward_combine
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    check_experts_forward<Experts, Exec, T>();
    if (ctx_.bound != nullptr) return bounded_.forward(ex, a, experts, saved);  // spec section 11
    forward_by_stages(*this, ex, a, experts, saved);
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    check_experts_backward<Experts, Exec, T>();
    if (ctx_.bound != nullptr) return bounded_.backward(ex, a, experts, saved);
    backward_by_stages(*this, ex, a, experts, saved);
  }

  // Steps 1-4: the rows land expert-major at the owners of their experts.
  template <class T, class Exec>
  expert_batch<T> dispatch(const Exec& ex, const forward_args<T>& a, saved_state<T>& flight, bool training,
                           bool in_place) {
    require_unbounded(ctx_, "dispatch");
    const int L = ctx_.local_experts(), tp = ctx_.tp_size(), me = ctx_.ep_rank();
    const std::size_t H = a.hidden;
    const auto k = static_cast<std::size_t>(a.top_k);
    const row_slice sl = a.status == 0 ? slice_bounds(a.rows, tp, ctx_.tp_rank()) : row_slice{};
    const std::size_t n = sl.size();

    // 1-3: send plan, count exchange, receive layout.
    route_request q;
    q.row0 = sl.begin;
    q.n = n;
    q.agree_rows = tp;
    q.path = name;
    q.training = training;
    routed<Exec> r = route_forward(ctx_, ex, a, q);
    auto& s = flight.template emplace<state<T, Exec>>();
    s.rows = a.rows;
    s.hidden = H;
    s.top_k = a.top_k;
    s.slice = sl;
    s.fp8 = ctx_.options.fp8_dispatch;
    s.per_rank = ctx_.options.sends == row_sends::per_rank;
    s.direct = uses_peer_access<Exec>() && !s.per_rank;
    s.by_index = !s.direct && sends_by_index<Exec>();
    if (ctx_.stats != nullptr) {
      ctx_.stats->peer_access = s.direct;
      ctx_.stats->indexed_sends = s.by_index;
    }
    s.layout = std::move(r.layout);
    s.widest = widest_slice(r.records, ctx_.ep_size(), ctx_.num_experts(), k);
    s.pos = std::move(r.plan.pos);
    s.src_row = std::move(r.plan.src_row);
    const receive_layout& lay = s.layout;
    const std::size_t S = n * k, R = lay.rows(me);
    const T* x = a.x + sl.begin * H;
    s.slice_weights = exec::make_buffer<float>(ex, S);
    if (S > 0) exec::copy_n(ex, a.weights + sl.begin * k, S, s.slice_weights.data());
    // FP8 (spec section 12): each row as E4M3 with one scale per 128 elements, quantised
    // once here; the owners receive bytes and scales in one buffer ([R, H] bytes, then
    // [R, B] scales).
    const std::size_t B = s.fp8 ? kernels::fp8_scales_per_row(H) : 0;
    rows_buffer<fp8_e4m3, Exec> rows8;  // FP8: [n, H] bytes, then [n, B] scales
    float* row_scales = nullptr;
    if (s.fp8) {
      rows8 = make_rows<fp8_e4m3>(ws_, ex, n * H + n * B * sizeof(float));
      row_scales = reinterpret_cast<float*>(rows8.data() + n * H);
      kernels::quantise_e4m3(ex, n, H, x, rows8.data(), row_scales);
      s.x8 = make_rows<fp8_e4m3>(ws_, ex, R * H + R * B * sizeof(float));
      s.scales = reinterpret_cast<float*>(s.x8.data() + R * H);
    } else if (s.direct && !training && in_place) {
      s.x_recv = published_rows<T>(ex, R * H);  // the experts' outputs go over it, read in place
    } else {
      s.x_recv = make_rows<T>(ws_, ex, R * H);
    }

    if constexpr (has_peer_access_v<Comm>) {
      if (s.direct) {
        // 4: every rank pulls its expert-major rows straight out of the owners' x (gather
        // and dispatch in one pass; padding rows come out zero). FP8: the bytes and the
        // scales of the owners' quantised rows, a row of H bytes copied as H/4 floats (H is
        // a multiple of 128); padding rows come out zero with scale 1. Buffer 0 of every
        // rank is its src_row.
        const auto from = received_from(ex, lay, me, R);
        order_before_collective(ex, *ctx_.ep);
        if (s.fp8) {
          const void* mine[3] = {s.src_row.data(), rows8.data(), row_scales};
          const std::size_t bytes[3] = {S * sizeof(std::int64_t), n * H, n * B * sizeof(float)};
          ctx_.ep->access_peers(mine, bytes, 3, [&](const auto& peers) {
            pull_rows(ex, peers, from.data(), R, H / sizeof(float), 1, 0, -1, reinterpret_cast<float*>(s.x8.data()));
            pull_rows(ex, peers, from.data(), R, B, 2, 0, -1, s.scales);
            order_after_peer_reads(ex, *ctx_.ep);
          });
          unit_padding_scales(ex, s.scales, lay, me, B);
        } else {
          const void* mine[2] = {s.src_row.data(), x};
          const std::size_t bytes[2] = {S * sizeof(std::int64_t), n * H * sizeof(T)};
          ctx_.ep->access_peers(mine, bytes, 2, [&](const auto& peers) {
            pull_rows(ex, peers, from.data(), R, H, 1, 0, -1, s.x_recv.data());
            order_after_peer_reads(ex, *ctx_.ep);
          });
        }
      }
    }
    if (s.per_rank) {
      // 4 (spec section 14): each row once to each owner of its kept slots; the owner copies
      // it into its slots' rows (padding rows come out zero).
      // The plan is made on the host (a device policy's send positions and weights are
      // read back first: one synchronisation) in vectors kept between calls.
      const std::int64_t* pos_h = host_view(ex, static_cast<const std::int64_t*>(s.pos.data()), S, host_i64_);
      const float* w_h = host_view(ex, static_cast<const float*>(s.slice_weights.data()), S, host_f32_);
      if (!exec::is_host_policy_v<Exec> && S > 0) host_sync(ex);
      per_rank_plan& g = plan_;
      make_per_rank_plan(g, lay, me, n, a.top_k, pos_h, w_h);
      s.ranks = exchange_rank_rows(ex, g.send_rows, g.send_offsets);
      const std::size_t U = s.ranks.sent(), Ur = s.ranks.received();
      s.unique_src = to_policy(ex, g.src_row);
      s.first = to_policy(ex, g.first);
      s.pair = to_policy(ex, g.pair);
      // Each row's k slot entries (expert-major row, weight) travel in one collective: the
      // rows' k int64 entries, then their k float weights, in one buffer on each side.
      auto slots_out = make_rows<std::int64_t>(ws_, ex, slot_words(U * k));
      if (U > 0) {
        exec::copy_n(ex, g.slot_row.data(), U * k, slots_out.data());
        exec::copy_n(ex, g.slot_weight.data(), U * k, reinterpret_cast<float*>(slots_out.data() + U * k));
      }
      s.send = make_rows<T>(ws_, ex, U * H);  // where the summed rows come back
      s.stage = make_rows<T>(ws_, ex, Ur * H);
      s.slot_row = make_rows<std::int64_t>(ws_, ex, slot_words(Ur * k));
      s.slot_weight = reinterpret_cast<float*>(s.slot_row.data() + Ur * k);
      send_unique(ex, s, x, static_cast<const std::int64_t*>(s.unique_src.data()), s.send.data(), s.stage.data());
      exchange_slots(s.ranks, slots_out.data(), s.slot_row.data(), k);
      s.recv_from = make_rows<std::int64_t>(ws_, ex, R);
      s.recv_weight = make_rows<float>(ws_, ex, R);
      if constexpr (exec::is_host_policy_v<Exec>) {
        receive_rows(Ur, a.top_k, s.slot_row.data(), s.slot_weight, R, s.recv_from.data(),
                     s.recv_weight.data());
      } else {  // one synchronisation: the received slot entries read back
        std::vector<std::int64_t> slot_row_h(Ur * k), from_h(R);
        std::vector<float> slot_weight_h(Ur * k), weight_h(R);
        if (Ur > 0) {
          settle(ex, *ctx_.ep);  // the exchange's wait, bounded by the communicator (detail::read_back)
          exec::copy_n(ex, static_cast<const std::int64_t*>(s.slot_row.data()), Ur * k, slot_row_h.data());
          exec::copy_n(ex, static_cast<const float*>(s.slot_weight), Ur * k, slot_weight_h.data());
          exec::synchronize(ex);  // the queue was idle: not counted again
        }
        receive_rows(Ur, a.top_k, slot_row_h.data(), slot_weight_h.data(), R, from_h.data(), weight_h.data());
        exec::copy_n(ex, static_cast<const std::int64_t*>(from_h.data()), R, s.recv_from.data());
        exec::copy_n(ex, static_cast<const float*>(weight_h.data()), R, s.recv_weight.data());
      }
      kernels::gather(ex, R, H, static_cast<const T*>(s.stage.data()),
                      static_cast<const std::int64_t*>(s.recv_from.data()), s.x_recv.data());
      if (ctx_.stats != nullptr)
        for (std::size_t p = 0; p < s.ranks.send_rows.size(); ++p) {
          ctx_.stats->rows_sent[p] = static_cast<std::int64_t>(s.ranks.send_rows[p]);
          ctx_.stats->rows_received[p] = static_cast<std::int64_t>(s.ranks.recv_rows[p]);
        }
    } else if (!s.direct) {
      // 4: rows into send order, then the segmented all-to-all lands them expert-major.
      s.seg = segments_of(lay, me);
      // In rounds (epx/layout/rounds.hpp) each round's rows go through the stage; in one
      // round through a send buffer of all S rows, which a training call keeps as the
      // outputs in send order. FP8 dispatch moves in one round, by index out of the
      // quantised rows where sends go by index (no send buffer), else gathered (its rows are
      // half as many bytes, and each round's collective cost it more than the stage saved);
      // its way back (rows in T) takes rounds like any other, planned by combine.
      const bool in_rounds = !training && !s.fp8 && plan_staged_rounds(ex, s);
      const staged_rounds& o = s.rounds;
      if (s.fp8) {
        zero_padding(ex, s.x8.data(), lay, me, H);
        unit_padding_scales(ex, s.scales, lay, me, B);
        if (s.by_index) {
          // FP8 by index: the bytes, then the scales, read straight out of the quantised
          // rows as they are sent (two collectives, no gather: the gather wrote and the
          // collective read again all S rows' bytes).
          const auto* src = static_cast<const std::int64_t*>(s.src_row.data());
          send_by_index(s.seg, reinterpret_cast<const unsigned char*>(rows8.data()), n, src, S,
                        reinterpret_cast<unsigned char*>(s.x8.data()), L, H);
          send_by_index(s.seg, static_cast<const float*>(row_scales), n, src, S, s.scales, L, B);
        } else {
          // FP8 gathered: the quantised rows' bytes and scales gathered into send order
          // (one buffer, as on the owners' side), then one collective.
          auto send8 = make_rows<fp8_e4m3>(ws_, ex, S * H + S * B * sizeof(float));
          float* const send_scales = reinterpret_cast<float*>(send8.data() + S * H);
          kernels::gather_e4m3(ex, S, H, static_cast<const fp8_e4m3*>(rows8.data()), row_scales,
                               static_cast<const std::int64_t*>(s.src_row.data()), send8.data(), send_scales);
          order_before_collective(ex, *ctx_.ep);
          exchange_fp8_rows(s.seg, send8.data(), S, s.x8.data(), R, H);
        }
      } else {
        // The send buffer (or stage) is also where the outputs come back (FP8: the send
        // buffer of the way back is made by combine).
        s.send = make_rows<T>(ws_, ex, (in_rounds ? o.stage_rows() : S) * H);
        zero_padding(ex, s.x_recv.data(), lay, me, H);
        if (s.by_index) {
          // Rows read by index straight out of x as they are sent: no gather, one collective.
          send_by_index(s.seg, x, n, static_cast<const std::int64_t*>(s.src_row.data()), S, s.x_recv.data(), L, H);
        } else {
          const auto send = [&](std::size_t rows, const std::int64_t* src, const segments& g) {
            kernels::gather(ex, rows, H, x, src, s.send.data());
            order_before_collective(ex, *ctx_.ep);
            exchange_rows(g, static_cast<const T*>(s.send.data()), s.x_recv.data(), L, H, false);
          };
          if (!in_rounds) send(S, static_cast<const std::int64_t*>(s.src_row.data()), s.seg);
          for (std::size_t rd = 0; in_rounds && rd < o.count; ++rd)
            send(o.sent(rd), s.in_policy(o.src, s.round_src) + o.stage_at[rd], round_segments(o, rd));
        }
      }
    }
    // 5 is the caller's: the experts read x_recv (FP8: x8 and scales) and write out_rows.
    if (s.direct && (training || s.fp8 || !in_place)) {
      s.outputs = published_rows<T>(ex, R * H);  // read in place by combine (and backward)
      s.out_rows = s.outputs.data();
    } else {
      s.out_rows = expert_output_rows(ws_, ex, R, H, s.x_recv.data(), training || s.fp8, in_place, s.outputs);
    }
    expert_batch<T> b;
    b.in = expert_rows<const T>{s.x_recv.data(), R, H, lay.offsets(me), L, ctx_.first_expert()};
    b.out = s.out_rows;
    if (s.fp8) {
      b.fp8 = true;
      b.in8 = expert_rows<const fp8_e4m3>{s.x8.data(), R, H, lay.offsets(me), L, ctx_.first_expert()};
      b.scales = s.scales;
    }
    return b;
  }

  // Steps 6-7: every token's k output rows are summed into out ([N, H], all written); the
  // TP group sums the slices. For training, the flight state becomes the saved state.
  template <class T, class Exec>
  void combine(const Exec& ex, saved_state<T>& flight, T* out_all, saved_state<T>* saved) {
    auto& s = flight.template get<state<T, Exec>>();
    const int L = ctx_.local_experts(), tp = ctx_.tp_size(), me = ctx_.ep_rank();
    const std::size_t H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    const row_slice sl = s.slice;
    const receive_layout& lay = s.layout;
    const std::size_t n = sl.size(), S = n * k, R = lay.rows(me);
    const float* w = s.slice_weights.data();
    T* out = out_all + sl.begin * H;
    exec::fill_zero(ex, out_all, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, out_all + sl.end * H, (s.rows - sl.end) * H);

    if constexpr (has_peer_access_v<Comm>) {
      if (s.direct) {
        // 6-7: combine reads every slot's output row in place at its owner.
        const void* mine_y[1] = {s.out_rows};
        const std::size_t bytes_y[1] = {R * H * sizeof(T)};
        order_before_collective(ex, *ctx_.ep);  // the experts' outputs
        ctx_.ep->access_peers(mine_y, bytes_y, 1, [&](const auto& peers) {
          const auto table = return_table<T>(ex, peers, lay, me, S, H);
          kernels::combine(ex, n, H, s.top_k, kernels::row_table<T>{table.data()}, w, s.pos.data(), out);
          order_after_peer_reads(ex, *ctx_.ep);
        });
        s.y = std::move(s.outputs);  // training: the outputs stay at their owner for backward
      }
    }
    if (s.fp8 && !s.direct) {
      // FP8 dispatch came in one round; the outputs return in T, in rounds where an
      // inference call's would (plan_staged_rounds: every rank decides alike).
      const bool in_rounds = saved == nullptr && plan_staged_rounds(ex, s);
      s.send = make_rows<T>(ws_, ex, (in_rounds ? s.rounds.stage_rows() : S) * H);
    }
    if (s.per_rank) {
      // 6: the owner sums w * y over each received row's slots (accum_t<T>, slot order) and
      // returns one row per (token, rank); 7: the source adds them in the order of each
      // owner's first slot.
      const std::size_t Ur = s.ranks.received();
      kernels::combine(ex, Ur, H, s.top_k, static_cast<const T*>(s.out_rows), static_cast<const float*>(s.slot_weight),
                       static_cast<const std::int64_t*>(s.slot_row.data()), s.stage.data());
      order_before_collective(ex, *ctx_.ep);
      exchange_unique(s.ranks, static_cast<const T*>(s.stage.data()), s.send.data(), H, true);
      kernels::combine(ex, n, H, s.top_k, static_cast<const T*>(s.send.data()), nullptr,
                       static_cast<const std::int64_t*>(s.first.data()), out);
      s.y = std::move(s.outputs);  // training: the outputs stay at their owner for backward
      s.send = rows_buffer<T, Exec>{};
      s.stage = rows_buffer<T, Exec>{};
    } else if (!s.direct && s.rounds.count > 1) {
      // 6-7 in rounds: each round's outputs back into the stage, then combined.
      EPX_REQUIRE(saved == nullptr, errc::internal, "moe_layer combine: a training call has no staged rounds");
      return_in_rounds(ex, s.rounds, static_cast<const T*>(s.out_rows), s.send.data(), L, H,
                       [&](std::size_t t0, std::size_t t1, const T* stage) {
                         kernels::combine(ex, t1 - t0, H, s.top_k, stage, w + t0 * k,
                                          s.in_policy(s.rounds.at, s.round_at) + t0 * k, out + t0 * H);
                       });
      s.send = rows_buffer<T, Exec>{};
    } else if (!s.direct) {
      // 6: outputs back into send order (reusing the send buffer); 7: combine.
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(s.seg, static_cast<const T*>(s.out_rows), s.send.data(), L, H, true);
      kernels::combine(ex, n, H, s.top_k, static_cast<const T*>(s.send.data()), w, s.pos.data(), out);
      s.y = std::move(s.send);
      s.outputs = rows_buffer<T, Exec>{};
    }
    s.out_rows = nullptr;
    // The TP group sums the slices.
    order_before_collective(ex, *ctx_.ep);
    if (tp > 1) all_reduce(*ctx_.tp, span<T>(out_all, s.rows * H));

    if (saved != nullptr) {
      s.weights = exec::make_buffer<float>(ex, s.per_rank ? 0 : S);  // the weight of each send position
      if (!s.per_rank)
        kernels::scatter(ex, S, static_cast<const std::int64_t*>(s.pos.data()), w, s.weights.data());
      s.slice_weights = exec::buffer<float, Exec>{};
      *saved = std::move(flight);
    }
  }

  // Backward up to the experts: the gradients of the experts' outputs, expert-major at the
  // owners, and this rank's slice of grad_weights (the TP group sums them in
  // backward_combine, with grad_x: one wait for both). Consumes `saved`.
  template <class T, class Exec>
  expert_grad_batch<T> backward_dispatch(const Exec& ex, const backward_args<T>& a, saved_state<T>& saved,
                                         saved_state<T>& flight) {
    require_unbounded(ctx_, "backward_dispatch");
    const int L = ctx_.local_experts(), tp = ctx_.tp_size(), me = ctx_.ep_rank();
    // Every rank checks its input (and its state) before the state is moved out of `saved`:
    // a call that the group rejects leaves the states for a retry.
    if (const char* why = saved.template unusable_as<state<T, Exec>>(ctx_.layer); *why)
      reject_saved_state(*ctx_.ep, a, why, ctx_.rank, tp);
    {
      const auto& s0 = saved.template get<state<T, Exec>>();
      exchange_backward_status(*ctx_.ep, a, s0.rows, s0.hidden, s0.top_k, ctx_.rank, tp, saved.call());
    }
    auto& b = flight.template emplace<backward_state<T, Exec>>();
    b.forward = std::move(saved);
    auto& s = b.forward.template get<state<T, Exec>>();
    const std::size_t H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    const row_slice sl = s.slice;
    const receive_layout& lay = s.layout;
    const std::size_t n = sl.size(), S = n * k, R = lay.rows(me);
    const T* grad_out = a.grad_out + sl.begin * H;
    const float* w_send = static_cast<const float*>(s.weights.data());
    float* grad_w = a.grad_weights + sl.begin * k;
    exec::fill_zero(ex, a.grad_weights, s.rows * k);
    if (s.fp8 && s.x_recv.size() == 0 && R > 0) {
      // The experts' backward reads the rows they saw, in T: the FP8 rows dequantised.
      s.x_recv = make_rows<T>(ws_, ex, R * H);
      kernels::dequantise_e4m3(ex, R, H, static_cast<const fp8_e4m3*>(s.x8.data()),
                               static_cast<const float*>(s.scales), s.x_recv.data());
    }
    b.grad_recv = make_rows<T>(ws_, ex, R * H);
    b.grad_in = s.direct ? published_rows<T>(ex, R * H) : make_rows<T>(ws_, ex, R * H);  // direct: read in place

    if constexpr (has_peer_access_v<Comm>) {
      if (s.direct) {
        // The owners make their grad_y rows straight from the token owners' grad_out
        // (scatter and dispatch in one pass); each token owner takes the dot products of its
        // grad_out rows with the slots' outputs kept at their owners (grad_w).
        // One access for both: buffer 3 is the outputs kept since forward.
        const void* mine[4] = {grad_out, s.src_row.data(), s.weights.data(), s.y.data()};
        const std::size_t bytes[4] = {n * H * sizeof(T), S * sizeof(std::int64_t), S * sizeof(float),
                                      R * H * sizeof(T)};
        const auto from = received_from(ex, lay, me, R);
        order_before_collective(ex, *ctx_.ep);
        ctx_.ep->access_peers(mine, bytes, 4, [&](const auto& peers) {
          // Row i: send position q of member src, i.e. its grad_out row src_row[q] times its
          // weight (padding rows: a zero row).
          pull_rows(ex, peers, from.data(), R, H, 0, 1, 2, b.grad_recv.data());
          const auto table = return_table<T>(ex, peers, lay, me, S, H, 3);
          kernels::weight_gradients(ex, n, H, s.top_k, kernels::row_table<T>{table.data()}, grad_out, s.pos.data(),
                                    grad_w);
          order_after_peer_reads(ex, *ctx_.ep);
        });
      }
    }
    if (s.per_rank) {
      // One grad_out row per (token, owner) travels; the owner forms every slot's
      // w * grad_out and the slot's grad_w (from the outputs it kept), and grad_w returns.
      const std::size_t U = s.ranks.sent(), Ur = s.ranks.received();
      b.grad_stage = make_rows<T>(ws_, ex, Ur * H);
      b.grad_send = make_rows<T>(ws_, ex, U * H);  // where the input gradients come back
      send_unique(ex, s, grad_out, static_cast<const std::int64_t*>(s.unique_src.data()), b.grad_send.data(),
                  b.grad_stage.data());
      kernels::gather(ex, R, H, static_cast<const T*>(b.grad_stage.data()),
                      static_cast<const std::int64_t*>(s.recv_from.data()),
                      static_cast<const float*>(s.recv_weight.data()), b.grad_recv.data());
      auto gw_owner = make_rows<float>(ws_, ex, Ur * k);
      auto gw_back = make_rows<float>(ws_, ex, U * k);
      kernels::weight_gradients(ex, Ur, H, s.top_k, static_cast<const T*>(s.y.data()),
                                static_cast<const T*>(b.grad_stage.data()),
                                static_cast<const std::int64_t*>(s.slot_row.data()), gw_owner.data());
      order_before_collective(ex, *ctx_.ep);
      exchange_unique(s.ranks, static_cast<const float*>(gw_owner.data()), gw_back.data(), k, true);
      kernels::gather(ex, S, 1, static_cast<const float*>(gw_back.data()),
                      static_cast<const std::int64_t*>(s.pair.data()), grad_w);
    } else if (!s.direct && plan_staged_rounds(ex, s)) {
      // In rounds: each round's w * grad_out rows through the stage; grad_w from the
      // outputs kept in send order.
      const staged_rounds& o = s.rounds;
      b.grad_send = make_rows<T>(ws_, ex, o.stage_rows() * H);
      auto w_stage = make_rows<float>(ws_, ex, o.stage_at[o.count]);
      kernels::gather(ex, o.stage_at[o.count], 1, w_send, s.in_policy(o.send_pos, s.round_pos),
                      w_stage.data());
      kernels::weight_gradients(ex, n, H, s.top_k, static_cast<const T*>(s.y.data()), grad_out, s.pos.data(), grad_w);
      zero_padding(ex, b.grad_recv.data(), lay, me, H);
      for (std::size_t rd = 0; rd < o.count; ++rd) {
        kernels::gather(ex, o.sent(rd), H, grad_out, s.in_policy(o.src, s.round_src) + o.stage_at[rd],
                        static_cast<const float*>(w_stage.data()) + o.stage_at[rd], b.grad_send.data());
        order_before_collective(ex, *ctx_.ep);
        exchange_rows(round_segments(o, rd), static_cast<const T*>(b.grad_send.data()), b.grad_recv.data(), L, H, false);
      }
    } else if (!s.direct) {
      // grad_y rows in send order: w * grad_out of the position's row; grad_w from the
      // outputs kept in send order.
      b.grad_send = make_rows<T>(ws_, ex, S * H);
      kernels::gather(ex, S, H, grad_out, static_cast<const std::int64_t*>(s.src_row.data()), w_send,
                      b.grad_send.data());
      kernels::weight_gradients(ex, n, H, s.top_k, static_cast<const T*>(s.y.data()), grad_out, s.pos.data(), grad_w);
      zero_padding(ex, b.grad_recv.data(), lay, me, H);
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(s.seg, static_cast<const T*>(b.grad_send.data()), b.grad_recv.data(), L, H, false);
    }
    b.grad_weights = a.grad_weights;
    expert_grad_batch<T> g;
    g.in = expert_rows<const T>{s.x_recv.data(), R, H, lay.offsets(me), L, ctx_.first_expert()};
    g.grad_out = b.grad_recv.data();
    g.grad_in = b.grad_in.data();
    return g;
  }

  // Backward after the experts: each token sums its slots' input gradients into grad_x
  // ([N, H], all written); the TP group sums the slices of grad_x and grad_weights.
  template <class T, class Exec>
  void backward_combine(const Exec& ex, saved_state<T>& flight, T* grad_x_all) {
    auto& b = flight.template get<backward_state<T, Exec>>();
    auto& s = b.forward.template get<state<T, Exec>>();
    const int L = ctx_.local_experts(), tp = ctx_.tp_size(), me = ctx_.ep_rank();
    const std::size_t H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    const row_slice sl = s.slice;
    const receive_layout& lay = s.layout;
    const std::size_t n = sl.size(), S = n * k, R = lay.rows(me);
    T* grad_x = grad_x_all + sl.begin * H;
    exec::fill_zero(ex, grad_x_all, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, grad_x_all + sl.end * H, (s.rows - sl.end) * H);

    if constexpr (has_peer_access_v<Comm>) {
      if (s.direct) {
        // Each token sums its slots' input gradients in place at their owners.
        const void* mine_i[1] = {b.grad_in.data()};
        const std::size_t bytes_i[1] = {R * H * sizeof(T)};
        order_before_collective(ex, *ctx_.ep);  // the experts' input gradients
        ctx_.ep->access_peers(mine_i, bytes_i, 1, [&](const auto& peers) {
          const auto table = return_table<T>(ex, peers, lay, me, S, H);
          kernels::reduce(ex, n, H, s.top_k, kernels::row_table<T>{table.data()}, s.pos.data(), grad_x);
          order_after_peer_reads(ex, *ctx_.ep);
        });
      }
    }
    if (s.per_rank) {
      // The owner sums the input gradients of each received row's slots (accum_t<T>, slot
      // order); the source adds the returned rows in the order of each owner's first slot.
      const std::size_t Ur = s.ranks.received();
      kernels::reduce(ex, Ur, H, s.top_k, static_cast<const T*>(b.grad_in.data()),
                      static_cast<const std::int64_t*>(s.slot_row.data()), b.grad_stage.data());
      order_before_collective(ex, *ctx_.ep);
      exchange_unique(s.ranks, static_cast<const T*>(b.grad_stage.data()), b.grad_send.data(), H, true);
      kernels::reduce(ex, n, H, s.top_k, static_cast<const T*>(b.grad_send.data()),
                      static_cast<const std::int64_t*>(s.first.data()), grad_x);
    } else if (!s.direct && s.rounds.count > 1) {
      return_in_rounds(ex, s.rounds, static_cast<const T*>(b.grad_in.data()), b.grad_send.data(), L, H,
                       [&](std::size_t t0, std::size_t t1, const T* stage) {
                         kernels::reduce(ex, t1 - t0, H, s.top_k, stage,
                                         s.in_policy(s.rounds.at, s.round_at) + t0 * k, grad_x + t0 * H);
                       });
    } else if (!s.direct) {
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(s.seg, static_cast<const T*>(b.grad_in.data()), b.grad_send.data(), L, H, true);
      kernels::reduce(ex, n, H, s.top_k, static_cast<const T*>(b.grad_send.data()), s.pos.data(), grad_x);
    }
    if (tp > 1) {
      order_before_collective(ex, *ctx_.ep);
      all_reduce(*ctx_.tp, span<T>(grad_x_all, s.rows * H));
      all_reduce(*ctx_.tp, span<float>(b.grad_weights, s.rows * k));
    }
  }

 private:
  // The largest slice (rows) of the EP group, from the counts of the count exchange (every
  // rank sends k pairs per row).
  static std::size_t widest_slice(const group_records& rec, int ep, int E, std::size_t k) {
    std::size_t most = 0;
    for (int r = 0; r < ep; ++r) {
      std::int64_t pairs = 0;
      for (int e = 0; e < E; ++e) pairs += rec.counts(r)[e];
      most = std::max(most, static_cast<std::size_t>(pairs) / std::max<std::size_t>(k, 1));
    }
    return most;
  }

  // The stage of the staged route (layer_options::stage_bytes; 0: automatic) for a call
  // whose largest slice sends `whole` bytes; 0: one round.
  template <class Exec>
  std::size_t stage_bytes(std::size_t whole) const {
    if (ctx_.options.stage_bytes != 0) return ctx_.options.stage_bytes;
    return exec::is_host_policy_v<Exec> && whole > default_host_one_round_bytes ? default_host_stage_bytes : 0;
  }

  // Whether the staged route of this call runs in rounds (epx/layout/rounds.hpp): when the
  // stage holds fewer slice rows than the EP group's largest slice (the same answer on
  // every rank). Then plans this rank's rounds and exchanges their counts (collective over
  // the EP group; once per forward, kept for backward).
  template <class T, class Exec>
  bool plan_staged_rounds(const Exec& ex, state<T, Exec>& s) {
    if (s.rounds.count > 1) return true;
    const auto k = static_cast<std::size_t>(s.top_k);
    const std::size_t stage = stage_bytes<Exec>(s.widest * k * s.hidden * sizeof(T));
    if (stage == 0) return false;
    const std::size_t T_rows = round_tokens(stage, k, s.hidden * sizeof(T));
    const std::size_t count = rounds_for(s.widest, T_rows);
    if (count <= 1) return false;
    const std::size_t n = s.slice.size(), S = n * k;
    const auto L = static_cast<std::size_t>(ctx_.local_experts());
    const auto P = static_cast<std::size_t>(ctx_.ep_size());
    const std::int64_t* src_h = host_view(ex, static_cast<const std::int64_t*>(s.src_row.data()), S, host_i64_);
    const std::int64_t* pos_h = host_view(ex, static_cast<const std::int64_t*>(s.pos.data()), S, host_pos_);
    if (!exec::is_host_policy_v<Exec> && S > 0) host_sync(ex);
    plan_rounds(s.rounds, s.seg, T_rows, count, src_h, pos_h, n, k, round_scratch_);
    // Every owner learns how many rows each source sends it in each round: [peers][count][L].
    const std::size_t per = count * L;
    std::vector<std::int64_t> h(2 * P * per);
    for (std::size_t p = 0; p < P; ++p)
      for (std::size_t rd = 0; rd < count; ++rd)
        for (std::size_t l = 0; l < L; ++l)
          h[(p * count + rd) * L + l] = static_cast<std::int64_t>(s.rounds.send_count(rd, p * L + l));
    auto b = exec::make_buffer<std::int64_t>(ex, 2 * P * per);
    exec::copy_n(ex, static_cast<const std::int64_t*>(h.data()), P * per, b.data());
    order_before_collective(ex, *ctx_.ep);
    all_to_all(*ctx_.ep, span<const std::int64_t>(b.data(), P * per), span<std::int64_t>(b.data() + P * per, P * per));
    read_back(ex, *ctx_.ep, static_cast<const std::int64_t*>(b.data()) + P * per, P * per, h.data() + P * per);
    std::vector<std::size_t> from(P * per);
    for (std::size_t i = 0; i < P * per; ++i) from[i] = static_cast<std::size_t>(h[P * per + i]);
    set_received(s.rounds, s.seg, L, from.data());
    if constexpr (!exec::is_host_policy_v<Exec>) {
      s.round_src = to_policy(ex, s.rounds.src);
      s.round_pos = to_policy(ex, s.rounds.send_pos);
      s.round_at = to_policy(ex, s.rounds.at);
    }
    if (ctx_.stats != nullptr) ctx_.stats->stage_rounds = static_cast<std::int64_t>(count);
    return true;
  }

  // The return of the staged route in rounds: round after round, the owners send the
  // round's rows of their expert-major buffer `from` into the stage, and `use(t0, t1,
  // stage)` takes in the round's slice rows [t0, t1) before the next round reuses it.
  template <class Exec, class T, class Use>
  void return_in_rounds(const Exec& ex, const staged_rounds& o, const T* from, T* stage, int L, std::size_t H, Use&& use) {
    for (std::size_t rd = 0; rd < o.count; ++rd) {
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(round_segments(o, rd), from, stage, L, H, true);
      const std::size_t t0 = rd * o.tokens, t1 = std::min(o.rows, t0 + o.tokens);
      if (t1 > t0) use(t0, t1, static_cast<const T*>(stage));
    }
  }

  // Collective over the EP group: every member learns how many unique rows each peer sends it.
  template <class Exec>
  rank_rows exchange_rank_rows(const Exec& ex, const std::vector<std::size_t>& send_rows,
                               const std::vector<std::size_t>& send_offsets) {
    const std::size_t P = send_rows.size();
    rank_rows r;
    r.send_rows = send_rows;
    r.send_offsets = send_offsets;
    std::vector<std::int64_t> h(2 * P);
    for (std::size_t p = 0; p < P; ++p) h[p] = static_cast<std::int64_t>(send_rows[p]);
    auto b = exec::make_buffer<std::int64_t>(ex, 2 * P);
    exec::copy_n(ex, static_cast<const std::int64_t*>(h.data()), P, b.data());
    order_before_collective(ex, *ctx_.ep);
    all_to_all(*ctx_.ep, span<const std::int64_t>(b.data(), P), span<std::int64_t>(b.data() + P, P));
    read_back(ex, *ctx_.ep, static_cast<const std::int64_t*>(b.data()) + P, P, h.data() + P);
    r.recv_rows.resize(P);
    r.recv_offsets.resize(P);
    std::size_t at = 0;
    for (std::size_t p = 0; p < P; ++p) {
      r.recv_rows[p] = static_cast<std::size_t>(h[P + p]);
      r.recv_offsets[p] = at;
      at += r.recv_rows[p];
    }
    return r;
  }

  // A host vector in the policy's memory (host policies: a pooled buffer). Queued on a
  // device policy without a wait: the copy of pageable host memory is taken before the call
  // returns, and the policy's later work is ordered after it.
  template <class Exec, class V>
  rows_buffer<V, Exec> to_policy(const Exec& ex, const std::vector<V>& v) {
    auto b = make_rows<V>(ws_, ex, v.size());
    if (!v.empty()) exec::copy_n(ex, v.data(), v.size(), b.data());
    return b;
  }

  // n values of the policy's memory readable on the host: `p` itself on host policies, else
  // a copy in `scratch`, readable after the caller's host_sync.
  template <class Exec, class V>
  static const V* host_view(const Exec& ex, const V* p, std::size_t n, std::vector<V>& scratch) {
    if constexpr (exec::is_host_policy_v<Exec>) {
      (void)ex, (void)n, (void)scratch;
      return p;
    } else {
      scratch.resize(n);
      if (n > 0) exec::copy_n(ex, p, n, scratch.data());
      return scratch.data();
    }
  }

  // The all-to-all of per-rank sends, rows of `width` elements: unique rows to their
  // owners, or back (`back`).
  template <class V>
  void exchange_unique(const rank_rows& r, const V* from, V* to, std::size_t width, bool back) {
    if (!back)
      all_to_allv_rows(*ctx_.ep, from, make_span(r.send_rows), make_span(r.send_offsets), to, make_span(r.recv_rows),
                       make_span(r.recv_offsets), width);
    else
      all_to_allv_rows(*ctx_.ep, from, make_span(r.recv_rows), make_span(r.recv_offsets), to, make_span(r.send_rows),
                       make_span(r.send_offsets), width);
  }

  // Per-rank sends of the unique rows src[idx[u]] to their owners, landing in `to`: by
  // index straight out of src (s.by_index), or gathered into `send` first.
  template <class T, class Exec, class State>
  void send_unique(const Exec& ex, const State& s, const T* src, const std::int64_t* idx, T* send, T* to) {
    const rank_rows& r = s.ranks;
    const std::size_t H = s.hidden;
    if (s.by_index) {
      all_to_allv_indexed(*ctx_.ep, span<const T>(src, s.slice.size() * H), span<const std::int64_t>(idx, r.sent()),
                          make_span(r.send_rows),
                          make_span(r.send_offsets), to, make_span(r.recv_rows), make_span(r.recv_offsets), 1, H);
      return;
    }
    kernels::gather(ex, r.sent(), H, src, idx, send);
    order_before_collective(ex, *ctx_.ep);
    exchange_unique(r, static_cast<const T*>(send), to, H, false);
  }

  // The staged dispatch's rows src[idx[q]] (q in send order, `rows` of them; src holds
  // `n` rows) straight into expert-major order at the owners, read by index as they are sent.
  template <class T>
  void send_by_index(const segments& g, const T* src, std::size_t n, const std::int64_t* idx, std::size_t rows, T* to,
                     int L, std::size_t H) {
    all_to_allv_indexed(*ctx_.ep, span<const T>(src, n * H), span<const std::int64_t>(idx, rows), make_span(g.send_counts),
                        make_span(g.send_displs), to, make_span(g.recv_counts), make_span(g.recv_displs),
                        static_cast<std::size_t>(L), H);
  }

  // int64 words for m slot entries and m float weights after them.
  static std::size_t slot_words(std::size_t m) noexcept { return m + (m * sizeof(float) + 7) / 8; }

  // The per-rank slot entries, one collective: `from` holds U*k int64 rows then U*k float
  // weights (U unique rows sent), `to` the same for the Ur rows received.
  void exchange_slots(const rank_rows& r, const std::int64_t* from, std::int64_t* to, std::size_t k) {
    segments g;
    g.send_counts = r.send_rows;
    g.send_displs = r.send_offsets;
    g.recv_counts = r.recv_rows;
    g.recv_displs = r.recv_offsets;
    exchange_two_parts(g, from, r.sent(), to, r.received(), k * sizeof(std::int64_t), k * sizeof(float));
  }

  // One segmented all-to-all of rows in two parts, in bytes: on each side a buffer of
  // `rows` rows holds every row's first part ([rows, a] bytes), then its second part
  // ([rows, b] bytes, from byte rows * a). `g` gives the segments in rows ([peers][m]);
  // segment i to or from peer p travels as two byte segments, i and m + i of p.
  void exchange_two_parts(const segments& g, const void* from, std::size_t send_rows, void* to, std::size_t recv_rows,
                          std::size_t a, std::size_t b) {
    const std::size_t total = g.send_counts.size(), peers = static_cast<std::size_t>(ctx_.ep_size());
    const std::size_t m = total / peers, nseg = 2 * m;
    std::vector<std::size_t> v(4 * peers * nseg);
    std::size_t* sc = v.data();
    std::size_t* sd = sc + peers * nseg;
    std::size_t* rc = sd + peers * nseg;
    std::size_t* rd = rc + peers * nseg;
    for (std::size_t p = 0; p < peers; ++p)
      for (std::size_t i = 0; i < m; ++i) {
        const std::size_t s = p * m + i, first = p * nseg + i, second = first + m;
        sc[first] = g.send_counts[s] * a;
        sd[first] = g.send_displs[s] * a;
        sc[second] = g.send_counts[s] * b;
        sd[second] = send_rows * a + g.send_displs[s] * b;
        rc[first] = g.recv_counts[s] * a;
        rd[first] = g.recv_displs[s] * a;
        rc[second] = g.recv_counts[s] * b;
        rd[second] = recv_rows * a + g.recv_displs[s] * b;
      }
    const std::size_t n = peers * nseg;
    all_to_allv_segments(*ctx_.ep, static_cast<const unsigned char*>(from), span<const std::size_t>(sc, n),
                         span<const std::size_t>(sd, n), static_cast<unsigned char*>(to), span<const std::size_t>(rc, n),
                         span<const std::size_t>(rd, n), nseg, 1);
  }

  // The segmented all-to-all of the staged route: send order -> expert-major (dispatch),
  // or back (`back`: expert-major -> send order).
  template <class T>
  void exchange_rows(const segments& g, const T* from, T* to, int L, std::size_t H, bool back) {
    if (!back)
      all_to_allv_segments(*ctx_.ep, from, make_span(g.send_counts), make_span(g.send_displs), to,
                           make_span(g.recv_counts), make_span(g.recv_displs), static_cast<std::size_t>(L), H);
    else
      all_to_allv_segments(*ctx_.ep, from, make_span(g.recv_counts), make_span(g.recv_displs), to,
                           make_span(g.send_counts), make_span(g.send_displs), static_cast<std::size_t>(L), H);
  }

  // The FP8 dispatch's one collective: S send rows of H E4M3 bytes followed by their S*B
  // scales (B = H/128) land as the R expert-major rows' bytes followed by their scales.
  void exchange_fp8_rows(const segments& g, const fp8_e4m3* from, std::size_t S, fp8_e4m3* to, std::size_t R,
                         std::size_t H) {
    exchange_two_parts(g, from, S, to, R, H, kernels::fp8_scales_per_row(H) * sizeof(float));
  }

  // Whether this call's row sends read the rows by index as they go (see
  // layer_options::indexed_sends): the communicator can, and the rows are host memory.
  template <class Exec>
  bool sends_by_index() const {
    if constexpr (has_indexed_sends_v<Comm> && exec::is_host_policy_v<Exec>)
      return ctx_.options.indexed_sends;
    else
      return false;
  }

  // Whether this call reads rows out of the peers' buffers (see layer_options::peer_access):
  // the communicator has peer access and its ranks can use it now (MPI: all on one node;
  // the same answer on every member, collective the first time).
  template <class Exec>
  bool uses_peer_access() const {
    if constexpr (has_peer_access_v<Comm>)
      return ctx_.options.peer_access && peer_access_available(*ctx_.ep);
    else
      return false;
  }

  // n elements of T that the direct route publishes to the peers (the experts' outputs, and
  // in backward the input gradients): in a peer buffer on communicators that hand them out
  // (epx::has_peer_buffer_v, MPI: access_peers then copies nothing) and host policies, in
  // the workspace otherwise (and when the communicator has no block to give: then
  // access_peers copies them). Collective there: every rank of a direct call makes the same
  // calls of it in the same order.
  template <class T, class Exec>
  rows_buffer<T, Exec> published_rows(const Exec& ex, std::size_t n) {
    if constexpr (has_peer_buffer_v<Comm> && exec::is_host_policy_v<Exec>) {
      std::shared_ptr<void> block = ctx_.ep->peer_buffer(n * sizeof(T));
      if (block != nullptr || n == 0) return rows_buffer<T, Exec>(std::move(block), n);
    }
    return make_rows<T>(ws_, ex, n);
  }

  // The direct route's row tables. Row i of this owner's expert-major buffer comes from
  // send position q of member m: from[2i] = m, from[2i+1] = q (m = -1: a padding row),
  // made on the host from the layout, in the policy's memory (host policies: written
  // straight into the pooled buffer; device policies: through `from_`, then one copy).
  template <class Exec>
  rows_buffer<std::int64_t, Exec> received_from(const Exec& ex, const receive_layout& lay, int me, std::size_t R) {
    const auto fill = [&](std::int64_t* from) {
      std::fill(from, from + 2 * R, std::int64_t{-1});
      for_each_received(lay, me, [&](std::size_t i, int m, std::size_t q) {
        from[2 * i] = m;
        from[2 * i + 1] = static_cast<std::int64_t>(q);
      });
    };
    if constexpr (exec::is_host_policy_v<Exec>) {
      auto b = make_rows<std::int64_t>(ws_, ex, 2 * R);
      fill(b.data());
      return b;
    } else {
      from_.resize(2 * R);
      fill(from_.data());
      return to_policy(ex, from_);
    }
  }

  // This owner's R expert-major rows of `width` elements, pulled out of the members'
  // published buffers (kernels::peer_table, then the copy, both on the policy): row index
  // [m][q] of member m's buffer `rows_at`, where buffer `index_at` holds each send
  // position's row; scaled by buffer `weights_at`'s weight of the send position when it is
  // not negative. Padding rows come out zero.
  template <class Exec, class Peers, class V>
  void pull_rows(const Exec& ex, const Peers& peers, const std::int64_t* from, std::size_t R, std::size_t width,
                 std::size_t rows_at, std::size_t index_at, int weights_at, V* dst) {
    const auto P = static_cast<std::size_t>(peers.size());
    std::vector<const V*> rows(P);
    std::vector<const std::int64_t*> index(P);
    std::vector<const float*> weights(weights_at >= 0 ? P : 0);
    for (std::size_t m = 0; m < P; ++m) {
      rows[m] = static_cast<const V*>(peers(static_cast<int>(m), rows_at));
      index[m] = static_cast<const std::int64_t*>(peers(static_cast<int>(m), index_at));
      if (weights_at >= 0)
        weights[m] = static_cast<const float*>(peers(static_cast<int>(m), static_cast<std::size_t>(weights_at)));
    }
    const auto rows_p = to_policy(ex, rows);
    const auto index_p = to_policy(ex, index);
    const auto weights_p = to_policy(ex, weights);
    const float* const* wp = weights_at >= 0 ? weights_p.data() : nullptr;
    auto table = make_rows<const V*>(ws_, ex, R);
    auto scale = make_rows<float>(ws_, ex, weights_at >= 0 ? R : 0);
    kernels::peer_table(ex, R, from, rows_p.data(), index_p.data(), wp, width, table.data(), scale.data());
    kernels::copy(ex, R, width, static_cast<const V* const*>(table.data()),
                  weights_at >= 0 ? static_cast<const float*>(scale.data()) : nullptr, dst);
  }

  // Send position p of this member <- its row of owner d's buffer `at` ([*, H]), for the
  // positions that travel (kernels::row_table of combine, reduce and the weight gradients).
  // Made on the host (every address follows from the layout), then in the policy's memory.
  template <class V, class Exec, class Peers>
  rows_buffer<const V*, Exec> return_table(const Exec& ex, const Peers& peers, const receive_layout& lay, int me,
                                           std::size_t S, std::size_t H, std::size_t at = 0) {
    const auto base = [&](int d) { return static_cast<const V*>(peers(d, at)); };
    if constexpr (exec::is_host_policy_v<Exec>) {
      auto table = make_rows<const V*>(ws_, ex, S);
      fill_return_table(lay, me, table.data(), H, base);
      return table;
    } else {
      std::vector<const V*> h(S, nullptr);
      fill_return_table(lay, me, h.data(), H, base);
      return to_policy(ex, h);
    }
  }

  layer_context<Comm> ctx_;
  workspace ws_;  // pooled row buffers (host policies)
  // Per-rank sends: the plan and the host copies of a device policy's arrays, kept between
  // calls so that a call allocates nothing once the sizes have been seen.
  per_rank_plan plan_;
  std::vector<std::int64_t> host_i64_;
  std::vector<std::int64_t> host_pos_, round_scratch_;  // staged rounds (host copies, scratch)
  std::vector<float> host_f32_;
  std::vector<std::int64_t> from_;  // the direct route's received rows on device policies (received_from)
  bounded_route<Comm> bounded_;  // bounded mode (epx/impl/bounded.hpp)
};

}  // namespace detail

namespace impl {
// Token dispatch: rows travel to the owners of their experts and back (spec section 4).
struct all_to_all {
  template <class Comm>
  using with = detail::all_to_all_impl<Comm>;
};
}  // namespace impl

}  // namespace epx
