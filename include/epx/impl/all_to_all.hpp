// epx/impl/all_to_all.hpp: token dispatch and combine over the EP group (spec section 4).
//
// Forward, per call:
//   1. TP slice [b, e) of the N rows (empty slices join everything below);
//   2-3. the shared prologue (epx/impl/prologue.hpp): counting-sort send layout of the
//      slice's (row, slot) pairs, count exchange (all_gather of {status, N, H, k,
//      counts[E]} over the EP group; bad input anywhere raises on every rank here, before
//      rows move) and the receive layout (epx/layout/receive.hpp);
//   4. rows land expert-major (with zero padding rows) at the owner of their expert, with
//      no second permutation;
//   5. the user's experts (over their own inputs in inference when they allow it,
//      epx::forward_in_place_v);
//   6-7. every token's k output rows are summed in accum_t, slot order, into the
//      zero-filled [N, H] output; the TP group all-reduces it.
// Steps 4 and 6-7 take one of two routes, with bitwise the same results:
//   staged (any communicator): gather into a send-order buffer, segmented all-to-all;
//      then the mirrored all-to-all back into send order, and combine: four passes over
//      the routed rows;
//   direct (communicators with peer access, epx::has_peer_access_v, whose ranks can use it
//      now, epx::peer_access_available, and host policies; layer_options::peer_access):
//      each owner copies its rows straight out of the senders' x, and combine reads every
//      slot's output row in place at its owner (epx/layout/receive.hpp): two passes, no
//      send buffer. (On MPI, the buffers published to the peers are first copied into
//      the communicator's shared window: one more pass over x and the outputs.)
// Before every communicator call the execution policy is synchronised (a no-op for host
// policies), so a communicator never reads buffers a device stream is still writing.
// Backward runs the same route in reverse with the saved layout (no count exchange, only
// a small shape check exchange).
// Row buffers of host policies come from a pool kept by the implementation between calls
// (detail::workspace), so repeated calls do not page-fault fresh allocations; device
// policies allocate through exec::make_buffer (stream-ordered).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/settle.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/impl/prologue.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/layout/receive.hpp"
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

template <class Comm>
class all_to_all_impl {
 public:
  static constexpr const char* name = "all_to_all";

  explicit all_to_all_impl(const layer_context<Comm>& ctx) : ctx_(ctx) {}

  // Any mesh: the all-to-all path has no rule of its own beyond the mesh's.
  static std::string can_implement(const mesh&, const layer_options&) { return {}; }

  // What backward needs; buffers in the policy's memory space.
  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    row_slice slice;
    receive_layout layout;
    segments seg;                              // staged: this rank's segments
    bool direct = false;                       // made by the direct route (y stays at the owners)
    exec::buffer<std::int64_t, Exec> pos;      // [n*k] send position of pair (t, j)
    exec::buffer<std::int64_t, Exec> src_row;  // [S] the slice row of each send position
    exec::buffer<float, Exec> weights;         // [S] routing weight of each send position
    rows_buffer<T, Exec> x_recv;               // [R, H] expert-major input rows
    rows_buffer<T, Exec> y;                    // staged: [S, H] outputs in send order; direct: [R, H] expert-major
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    check_experts_forward<Experts, Exec, T>();
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
    routed<Exec> r = route_forward(ctx_, ex, a, q);
    const receive_layout& lay = r.layout;
    const bool direct = uses_peer_access<Exec>();
    if (ctx_.stats != nullptr) ctx_.stats->peer_access = direct;
    const std::size_t S = n * k, R = lay.rows(me);
    const T* x = a.x + sl.begin * H;
    const float* w = a.weights + sl.begin * k;
    T* out = a.out + sl.begin * H;
    exec::fill_zero(ex, a.out, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, a.out + sl.end * H, (a.rows - sl.end) * H);
    // In inference, on communicators with peer memory (MPI), the direct route builds the
    // expert-major rows and the experts' outputs there, so that publishing the outputs
    // costs no copy (nothing of them is kept after the call).
    T* arena = nullptr;
    if constexpr (has_peer_memory_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (direct && saved == nullptr) {
        const std::size_t blocks = forward_in_place_v<Experts> ? 1 : 2;
        arena = static_cast<T*>(ctx_.ep->peer_memory(blocks * R * H * sizeof(T)));
      }
    }
    auto x_recv = make_rows<T>(ws_, ex, arena != nullptr ? 0 : R * H);
    T* const xr = arena != nullptr ? arena : x_recv.data();
    const expert_rows<const T> rows{xr, R, H, lay.offsets(me), L, ctx_.first_expert()};
    rows_buffer<T, Exec> y;  // the experts' outputs: [S, H] in send order (staged), [R, H] at the owner (direct)
    segments seg;

    if constexpr (has_peer_access_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (direct) {
        // 4: every rank pulls its expert-major rows straight out of the owners' x (gather
        // and dispatch in one pass; padding rows come out zero).
        auto table = ws_.template acquire<const T*>(std::max(R, S));
        const void* mine[2] = {x, r.plan.src_row.data()};
        const std::size_t bytes[2] = {n * H * sizeof(T), S * sizeof(std::int64_t)};
        ctx_.ep->access_peers(mine, bytes, 2, [&](const auto& peers) {
          fill_receive_table(lay, me, table.data(), R, [&](int s, std::size_t p) {
            const auto* src_row = static_cast<const std::int64_t*>(peers(s, 1));
            return static_cast<const T*>(peers(s, 0)) + static_cast<std::size_t>(src_row[p]) * H;
          });
          kernels::copy(ex, R, H, static_cast<const T* const*>(table.data()), xr);
        });
        // 5: experts.
        T* y_rows = nullptr;
        if (arena != nullptr && !forward_in_place_v<Experts>) {
          y_rows = arena + R * H;
          experts.forward(ex, rows, y_rows);
        } else {
          y_rows = run_experts(ws_, ex, experts, rows, xr, saved != nullptr, y);
        }
        // 6-7: combine reads every slot's output row in place at its owner.
        const void* mine_y[1] = {y_rows};
        const std::size_t bytes_y[1] = {R * H * sizeof(T)};
        ctx_.ep->access_peers(mine_y, bytes_y, 1, [&](const auto& peers) {
          fill_return_table(lay, me, table.data(), H, [&](int d) { return static_cast<const T*>(peers(d, 0)); });
          kernels::combine(ex, n, H, a.top_k, kernels::row_table<T>{table.data()}, w, r.plan.pos.data(), out);
        });
      }
    }
    if (!direct) {
      // 4: rows into send order, then the segmented all-to-all lands them expert-major.
      seg = segments_of(lay, me);
      auto send = make_rows<T>(ws_, ex, S * H);
      kernels::gather(ex, S, H, x, static_cast<const std::int64_t*>(r.plan.src_row.data()), send.data());
      zero_padding(ex, x_recv.data(), lay, me, H);
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(seg, static_cast<const T*>(send.data()), x_recv.data(), L, H, false);
      // 5: experts.
      rows_buffer<T, Exec> y_recv;
      const T* y_rows = run_experts(ws_, ex, experts, rows, x_recv.data(), saved != nullptr, y_recv);
      // 6: outputs back into send order (reusing the send buffer); 7: combine.
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(seg, y_rows, send.data(), L, H, true);
      kernels::combine(ex, n, H, a.top_k, static_cast<const T*>(send.data()), w, r.plan.pos.data(), out);
      y = std::move(send);
    }
    // The TP group sums the slices.
    order_before_collective(ex, *ctx_.ep);
    if (tp > 1) all_reduce(*ctx_.tp, span<T>(a.out, a.rows * H));

    if (saved != nullptr) {
      auto& s = saved->template emplace<state<T, Exec>>();
      s.rows = a.rows;
      s.hidden = H;
      s.top_k = a.top_k;
      s.slice = sl;
      s.direct = direct;
      s.weights = exec::make_buffer<float>(ex, S);  // the weight of each send position
      kernels::scatter(ex, S, static_cast<const std::int64_t*>(r.plan.pos.data()), w, s.weights.data());
      s.layout = std::move(r.layout);
      s.seg = std::move(seg);
      s.pos = std::move(r.plan.pos);
      s.src_row = std::move(r.plan.src_row);
      s.x_recv = std::move(x_recv);
      s.y = std::move(y);
    }
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    check_experts_backward<Experts, Exec, T>();
    auto& s = saved.template get<state<T, Exec>>();
    const int L = ctx_.local_experts(), tp = ctx_.tp_size(), me = ctx_.ep_rank();
    const std::size_t H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    exchange_backward_status(*ctx_.ep, ex, a, s.rows, s.hidden, s.top_k, ctx_.rank, tp);
    const row_slice sl = s.slice;
    const receive_layout& lay = s.layout;
    const std::size_t n = sl.size(), S = n * k, R = lay.rows(me);
    const T* grad_out = a.grad_out + sl.begin * H;
    const float* w_send = static_cast<const float*>(s.weights.data());
    T* grad_x = a.grad_x + sl.begin * H;
    float* grad_w = a.grad_weights + sl.begin * k;
    exec::fill_zero(ex, a.grad_weights, a.rows * k);
    exec::fill_zero(ex, a.grad_x, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, a.grad_x + sl.end * H, (a.rows - sl.end) * H);
    const expert_rows<const T> rows{s.x_recv.data(), R, H, lay.offsets(me), L, ctx_.first_expert()};
    auto grad_recv = make_rows<T>(ws_, ex, R * H);
    // The experts' input gradients, which the direct route publishes: in the peer memory
    // where the communicator has one (MPI), so that publishing them costs no copy.
    T* arena = nullptr;
    if constexpr (has_peer_memory_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (s.direct) arena = static_cast<T*>(ctx_.ep->peer_memory(R * H * sizeof(T)));
    }
    auto grad_in_pool = make_rows<T>(ws_, ex, arena != nullptr ? 0 : R * H);
    T* const grad_in = arena != nullptr ? arena : grad_in_pool.data();

    if constexpr (has_peer_access_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (s.direct) {
        auto table = ws_.template acquire<const T*>(std::max(R, S));
        auto scale = ws_.template acquire<float>(R);
        // The owners make their grad_y rows straight from the token owners' grad_out
        // (scatter and dispatch in one pass); each token owner takes the dot products of its
        // grad_out rows with the slots' outputs kept at their owners (grad_w).
        const void* mine[3] = {grad_out, s.src_row.data(), s.weights.data()};
        const std::size_t bytes[3] = {n * H * sizeof(T), S * sizeof(std::int64_t), S * sizeof(float)};
        ctx_.ep->access_peers(mine, bytes, 3, [&](const auto& peers) {
          // Row i: send position q of member src, i.e. its grad_out row src_row[q] times its
          // weight (padding rows: null, a zero row).
          fill_receive_table(lay, me, table.data(), R, [&](int src, std::size_t p) {
            const auto* src_row = static_cast<const std::int64_t*>(peers(src, 1));
            return static_cast<const T*>(peers(src, 0)) + static_cast<std::size_t>(src_row[p]) * H;
          });
          for_each_received(lay, me, [&](std::size_t i, int src, std::size_t p) {
            scale.data()[i] = static_cast<const float*>(peers(src, 2))[p];
          });
          kernels::copy(ex, R, H, static_cast<const T* const*>(table.data()), static_cast<const float*>(scale.data()),
                        grad_recv.data());
        });
        const void* mine_y[1] = {s.y.data()};
        const std::size_t bytes_y[1] = {R * H * sizeof(T)};
        ctx_.ep->access_peers(mine_y, bytes_y, 1, [&](const auto& peers) {
          fill_return_table(lay, me, table.data(), H, [&](int d) { return static_cast<const T*>(peers(d, 0)); });
          kernels::weight_gradients(ex, n, H, s.top_k, kernels::row_table<T>{table.data()}, grad_out, s.pos.data(),
                                    grad_w);
        });
        experts.backward(ex, rows, static_cast<const T*>(grad_recv.data()), grad_in);
        // Each token sums its slots' input gradients in place at their owners.
        const void* mine_i[1] = {grad_in};
        ctx_.ep->access_peers(mine_i, bytes_y, 1, [&](const auto& peers) {
          fill_return_table(lay, me, table.data(), H, [&](int d) { return static_cast<const T*>(peers(d, 0)); });
          kernels::reduce(ex, n, H, s.top_k, kernels::row_table<T>{table.data()}, s.pos.data(), grad_x);
        });
      }
    }
    if (!s.direct) {
      // grad_y rows in send order: w * grad_out of the position's row; grad_w from the
      // outputs kept in send order.
      auto grad_send = make_rows<T>(ws_, ex, S * H);
      kernels::gather(ex, S, H, grad_out, static_cast<const std::int64_t*>(s.src_row.data()), w_send,
                      grad_send.data());
      kernels::weight_gradients(ex, n, H, s.top_k, static_cast<const T*>(s.y.data()), grad_out, s.pos.data(), grad_w);
      zero_padding(ex, grad_recv.data(), lay, me, H);
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(s.seg, static_cast<const T*>(grad_send.data()), grad_recv.data(), L, H, false);
      experts.backward(ex, rows, static_cast<const T*>(grad_recv.data()), grad_in);
      order_before_collective(ex, *ctx_.ep);
      exchange_rows(s.seg, static_cast<const T*>(grad_in), grad_send.data(), L, H, true);
      kernels::reduce(ex, n, H, s.top_k, static_cast<const T*>(grad_send.data()), s.pos.data(), grad_x);
    }
    if (tp > 1) {
      order_before_collective(ex, *ctx_.ep);
      all_reduce(*ctx_.tp, span<T>(a.grad_x, a.rows * H));
      all_reduce(*ctx_.tp, span<float>(a.grad_weights, a.rows * k));
    }
  }

 private:
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

  // Whether this call reads rows out of the peers' buffers (see layer_options::peer_access):
  // the communicator has peer access and its ranks can use it now (MPI: all on one node;
  // the same answer on every member, collective the first time).
  template <class Exec>
  bool uses_peer_access() const {
    if constexpr (has_peer_access_v<Comm> && exec::is_host_policy_v<Exec>)
      return ctx_.options.peer_access && peer_access_available(*ctx_.ep);
    else
      return false;
  }

  layer_context<Comm> ctx_;
  workspace ws_;  // pooled row buffers (host policies)
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
