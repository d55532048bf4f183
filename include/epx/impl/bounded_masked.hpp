// epx/impl/bounded_masked.hpp: bounded mode of the masked all-reduce path (spec sections 5
// and 11).
//
// The masked path (ep == tp) with layer_options::counts == count_exchange::device and a
// bound layer_options::bound.cap. The bound means what it means on the all-to-all path: at
// most `cap` pairs per (slice, global expert), where the slices are the ep slices of the
// call's N rows that the all-to-all path's ranks would dispatch (epx/layout/slicing.hpp), so
// both paths drop the same pairs; and the expert-major buffer has the all-to-all path's fixed
// shape (epx/layout/bounded.hpp): local expert l's `block` = padded(ep*cap) rows at l*block.
// Every rank of the EP group holds all N rows and plans every slice itself; nothing but the
// output's all-reduce crosses ranks, and nothing is read back to the host.
//
// Forward, per call:
//   1. for each slice s: the plan of its pairs and the local rule with C = cap
//      (detail::bounded_plan, shared with the all-to-all path); the drops of this rank's own
//      slice (s = its ep rank) go into the layer's counters, so that moe_layer::check() sums
//      each slice once over the group, as on the all-to-all path, and a bad pair in any slice
//      counts this rank's call as one with bad input. The rule runs for every expert of the
//      own slice (its tally) and for the L local experts of the others (E + (ep-1)*L
//      experts' steps, not ep*E);
//   2. where each slice's rows start in each local block, the blocks' rows (the experts'
//      device counts), every pair's local row and every block row's token (the bounded
//      functors of epx/layout/masked.hpp);
//   3. the rows gathered into the blocks (zero past a block's rows), the experts, combine of
//      the local slots, and the EP group's all-reduce of the output.
// Backward (from the saved layout, no shape exchange): the gradient rows w * grad_out
// gathered into the blocks, the experts' backward, the local slots' grad_x and routing-weight
// gradients, each summed over the EP group by an all-reduce; the routing-weight gradients'
// carries each rank's forward call number in a slot of its own (layout::bound_call_slots),
// so that ranks taking back different forward calls count the call for check().
// With nothing dropped the results are bitwise the normal masked path's (each block holds the
// same rows in the same order; the same combine and all-reduce); with drops, bitwise the
// normal masked path's with the local capacity rule C = cap and the same priority.
//
// Errors without a host read, as on the all-to-all path: a rank whose call has bad shapes
// (known on its host, a backward's N against its forward's included) joins the all-reduces
// with zeros, counts the error and raises errc::input itself; bad expert ids or weights are
// counted (those pairs take no row); moe_layer::check() raises on every rank. The
// all-reduces have N*H and N*k elements from each rank's own N, which the masked path's
// premise makes the same on every rank; a rank with another N makes the sizes differ, which
// the threads communicator and the MPI one (with its count check, the default) raise as
// errc::communicator on every rank.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "epx/comm/collectives.hpp"
#include "epx/comm/settle.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/impl/bounded.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/layout/bounded.hpp"
#include "epx/layout/exchange.hpp"
#include "epx/layout/masked.hpp"
#include "epx/layout/slicing.hpp"

namespace epx::detail {

template <class Comm>
class bounded_masked_route {
 public:
  explicit bounded_masked_route(const layer_context<Comm>& ctx) : ctx_(ctx) {}

  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    exec::buffer<std::int64_t, Exec> local_pos;   // [N*k] row of each pair in the blocks, -1: none
    exec::buffer<std::int64_t, Exec> row_source;  // [L*block] token of each block row, -1: none
    exec::buffer<std::int64_t, Exec> row_off;     // [L*(ep+1)]
    exec::buffer<std::int64_t, Exec> rows_of;     // [L] the blocks' rows
    exec::buffer<float, Exec> weights;            // [L*block] routing weight of each block row
    exec::buffer<T, Exec> x_local;                // [L*block, H]
    rows_buffer<T, Exec> y_local;                 // [L*block, H]
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    auto& b = *static_cast<bound_buffers<T, Exec>*>(ctx_.bound);
    const layout::bound_shape& sh = b.shape;
    const int L = sh.L, S = sh.ep, E = sh.experts(), k = a.top_k, me = ctx_.ep_rank(), first = ctx_.first_expert();
    const auto ks = static_cast<std::size_t>(k), Ls = static_cast<std::size_t>(L);
    const std::size_t H = a.hidden, XR = sh.expert_rows();
    const bool ok = a.status == 0, train = saved != nullptr;
    const std::size_t N = ok ? a.rows : 0, P = N * ks;
    b.in_call = true;
    b.reserve_pairs(ex, P);

    // 1. Every slice's plan and bound; into the counters the drops of this rank's slice and
    //    a bad pair anywhere in the call.
    std::int64_t* other_bad = b.call_bad.data();
    exec::fill_zero(ex, other_bad, 1);
    std::size_t own_chunks = 1;
    for (int s = 0; s < S; ++s) {
      const row_slice sl = slice_bounds(N, S, s);
      const std::size_t p0 = sl.begin * ks, Ps = sl.size() * ks;
      const bound_plan_at at = b.slice_arrays(s, p0);
      // This rank's slice: the rule for every expert (its drops go into the counters);
      // another slice: for the local experts only, the blocks' rows.
      const int e0 = s == me ? 0 : first, e1 = s == me ? E : first + L;
      const std::size_t C =
          bounded_plan(ex, b, Ps ? a.ids + p0 : nullptr, Ps ? a.weights + p0 : nullptr, Ps, k, at, e0, e1);
      if (s == me)
        own_chunks = C;
      else
        exec::for_each_n(ex, 1, layout::bound_note_bad{at.chunk_bad, C, other_bad});
    }
    const bound_plan_at own = b.slice_arrays(me, 0);
    exec::for_each_n(ex, 1,
                     layout::bound_tally{own.counts, own.kept, own.chunk_bad, own_chunks, E, ok ? 0 : 1,
                                         b.counters.data(), other_bad});

    // 2. The blocks: this call's arrays are the layer's (inference) or the saved state's.
    state<T, Exec> st;
    std::int64_t* local_pos = call_array(ex, train, st.local_pos, b.slab_pos, std::max<std::size_t>(P, 1));
    std::int64_t* row_source = call_array(ex, train, st.row_source, b.row_source, XR);
    std::int64_t* row_off = call_array(ex, train, st.row_off, b.row_off, Ls * static_cast<std::size_t>(S + 1));
    std::int64_t* rows_of = call_array(ex, train, st.rows_of, b.rows, Ls);
    exec::for_each_n(ex, Ls, layout::masked_bound_arrivals{b.slice_kept.data(), E, first, S, row_off, rows_of});
    const layout::masked_slice_plans plans{b.slice_summary.data(), b.summary_stride(),
                                           b.chunks + static_cast<std::size_t>(E), row_off, N, S, k, first, L,
                                           sh.block};
    if (P > 0) exec::for_each_n(ex, P, layout::masked_bound_positions{a.ids, b.pos.data(), plans, local_pos});
    exec::for_each_n(ex, XR, layout::masked_bound_rows{b.src_row.data(), plans, row_source});
    if (ctx_.stats != nullptr) note_bounded_stats(*ctx_.stats, "all_reduce", false);

    // 3. Rows, experts, combine, the group's sum.
    if (train) st.x_local = exec::make_buffer<T>(ex, XR * H);
    T* x_local = train ? st.x_local.data() : b.expert_rows_buffer(ex);
    kernels::gather(ex, XR, H, ok ? a.x : nullptr, static_cast<const std::int64_t*>(row_source), x_local);
    const expert_rows<const T> er{x_local, XR, H, b.offsets.data(), L, first, rows_of};
    T* y = x_local;
    if (train) {
      st.y_local = make_rows<T>(ws_, ex, XR * H);
      y = st.y_local.data();
    } else if (!forward_in_place_v<Experts>) {
      y = b.outputs(ex);
    }
    bounded_expert_forward(experts, ex, er, y);
    if (ok)
      kernels::combine(ex, N, H, k, static_cast<const T*>(y), a.weights, static_cast<const std::int64_t*>(local_pos),
                       a.out);
    order_before_collective(ex, *ctx_.ep);
    sum_or_join_zeros(ex, *ctx_.ep, ok ? a.out : nullptr, a.rows * H);
    if (train) {
      st.rows = a.rows;
      st.hidden = H;
      st.top_k = k;
      st.weights = exec::make_buffer<float>(ex, XR);  // rows that are not data: unread
      if (P > 0) kernels::scatter(ex, P, static_cast<const std::int64_t*>(local_pos), a.weights, st.weights.data());
      saved->template emplace<state<T, Exec>>(std::move(st));
    }
    b.in_call = false;
    raise_bounded_shape(a.status, a.status_message);
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    auto& b = *static_cast<bound_buffers<T, Exec>*>(ctx_.bound);
    b.in_call = true;
    if (const char* why = saved.template unusable_as<state<T, Exec>>(ctx_.layer); *why) {
      // No state: count a shape failure, join both sums with zeros, raise (as bad shapes do).
      exec::for_each_n(ex, 1, layout::bound_shape_failed{b.counters.data()});
      order_before_collective(ex, *ctx_.ep);
      sum_or_join_zeros(ex, *ctx_.ep, static_cast<T*>(nullptr), a.rows * b.shape.hidden);
      sum_or_join_zeros(ex, *ctx_.ep, static_cast<float*>(nullptr),
                        a.rows * static_cast<std::size_t>(a.top_k) + static_cast<std::size_t>(b.shape.ep));
      b.in_call = false;
      raise_bounded_shape(1, why);
    }
    auto& s = saved.template get<state<T, Exec>>();
    const auto call = static_cast<std::int64_t>(saved.call());  // the number of its forward call (>= 1)
    const layout::bound_shape& sh = b.shape;
    const std::size_t N = s.rows, H = s.hidden, XR = sh.expert_rows();
    const auto k = static_cast<std::size_t>(s.top_k);
    // No shape exchange: each rank checks its own against its forward call's.
    const std::string differ = a.status == 0 ? backward_shape_error(a, s.rows, s.hidden, s.top_k) : std::string();
    const bool ok = a.status == 0 && differ.empty();
    if (!ok) exec::for_each_n(ex, 1, layout::bound_shape_failed{b.counters.data()});
    auto grad_y = make_rows<T>(ws_, ex, XR * H);
    auto grad_in = make_rows<T>(ws_, ex, XR * H);
    if (ok)
      kernels::gather(ex, XR, H, a.grad_out, static_cast<const std::int64_t*>(s.row_source.data()),
                      static_cast<const float*>(s.weights.data()), grad_y.data());
    else
      exec::fill_zero(ex, grad_y.data(), XR * H);
    // The weight gradients go into `gw`, whose sum carries each rank's forward call number in
    // a slot of its own after the N*k gradients: a rank that finds another number than its
    // own counts the call (check() raises it on every rank), as the all-to-all path's slab
    // headers do.
    const auto slots = static_cast<std::size_t>(sh.ep);
    auto gw = make_rows<float>(ws_, ex, N * k + slots);
    if (ok)
      kernels::weight_gradients(ex, N, H, s.top_k, static_cast<const T*>(s.y_local.data()), a.grad_out,
                                static_cast<const std::int64_t*>(s.local_pos.data()), gw.data());
    else
      exec::fill_zero(ex, gw.data(), N * k);
    const expert_rows<const T> er{s.x_local.data(), XR, H, b.offsets.data(), sh.L, ctx_.first_expert(), s.rows_of.data()};
    experts.backward(ex, er, static_cast<const T*>(grad_y.data()), grad_in.data());
    if (ok)
      kernels::reduce(ex, N, H, s.top_k, static_cast<const T*>(grad_in.data()),
                      static_cast<const std::int64_t*>(s.local_pos.data()), a.grad_x);
    const float mine = ok && call > 0 ? layout::bound_call_slot_value(call) : 0.0f;
    exec::for_each_n(ex, 1, layout::bound_call_slots{gw.data() + N * k, sh.ep, ctx_.ep_rank(), mine});
    order_before_collective(ex, *ctx_.ep);
    sum_or_join_zeros(ex, *ctx_.ep, ok ? a.grad_x : nullptr, N * H);
    all_reduce(*ctx_.ep, span<float>(gw.data(), N * k + slots));
    if (ok) exec::copy_n(ex, static_cast<const float*>(gw.data()), N * k, a.grad_weights);
    if (mine != 0.0f)
      exec::for_each_n(ex, 1, layout::bound_call_slots_check{gw.data() + N * k, sh.ep, mine, b.counters.data()});
    b.in_call = false;
    raise_bounded_shape(ok ? 0 : 1, differ.empty() ? a.status_message : differ.c_str());
  }

 private:
  layer_context<Comm> ctx_;
  workspace ws_;  // pooled row buffers (host policies)
};

}  // namespace epx::detail
