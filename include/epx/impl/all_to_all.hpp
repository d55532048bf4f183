// epx/impl/all_to_all.hpp: token dispatch and combine over the EP group (spec section 4).
//
// Forward, per call:
//   1. TP slice [b, e) of the N rows (empty slices join everything below);
//   2. counting-sort send layout of the slice's (row, slot) pairs (epx/layout/plan.hpp);
//   3. count exchange: all_gather of {status, N, H, k, counts[E]} over the EP group; bad
//      input anywhere raises on every rank here, before rows move;
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
//   direct (communicators with peer access, epx::has_peer_access_v, and host policies;
//      layer_options::peer_access): each owner copies its rows straight out of the
//      senders' x, and combine reads every slot's output row in place at its owner
//      (epx/layout/receive.hpp): two passes, no send buffer.
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
#include "epx/layout/exchange.hpp"
#include "epx/layout/receive.hpp"
#include "epx/comm/settle.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/kernels/functors.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/layout/slicing.hpp"
#include "epx/exec/host.hpp"
#include "epx/impl/experts.hpp"
#include "epx/layout/plan.hpp"

namespace epx {
namespace detail {

// Where rows go and land, in rows. Arrays are [ep][L] (segment l of peer d).
struct segment_layout {
  std::vector<std::size_t> send_counts, send_displs;  // this rank's send buffer (send order)
  std::vector<std::size_t> recv_counts, recv_displs;  // this rank's expert-major buffer
  std::vector<std::size_t> offsets;                   // [L+1] expert-major offsets, padding included
  std::vector<std::size_t> received;                  // [L] rows received per local expert
};

inline segment_layout make_segment_layout(const group_records& g, const std::vector<std::int64_t>& my_offset,
                                          int my_ep_rank, int L, const padding& pad) {
  const int ep = g.size;
  const std::size_t m = static_cast<std::size_t>(ep) * static_cast<std::size_t>(L);
  segment_layout s;
  s.send_counts.assign(m, 0);
  s.send_displs.assign(m, 0);
  s.recv_counts.assign(m, 0);
  s.recv_displs.assign(m, 0);
  s.offsets.assign(static_cast<std::size_t>(L) + 1, 0);
  s.received.assign(static_cast<std::size_t>(L), 0);
  const int me = my_ep_rank;
  for (int d = 0; d < ep; ++d)
    for (int l = 0; l < L; ++l) {
      const std::size_t e = static_cast<std::size_t>(d) * static_cast<std::size_t>(L) + static_cast<std::size_t>(l);
      s.send_counts[e] = static_cast<std::size_t>(my_offset[e + 1] - my_offset[e]);
      s.send_displs[e] = static_cast<std::size_t>(my_offset[e]);
    }
  std::size_t off = 0;
  for (int l = 0; l < L; ++l) {
    s.offsets[static_cast<std::size_t>(l)] = off;
    std::size_t at = off;
    for (int src = 0; src < ep; ++src) {
      const auto c = static_cast<std::size_t>(g.counts(src)[me * L + l]);
      const std::size_t i = static_cast<std::size_t>(src) * static_cast<std::size_t>(L) + static_cast<std::size_t>(l);
      s.recv_counts[i] = c;
      s.recv_displs[i] = at;
      at += c;
    }
    s.received[static_cast<std::size_t>(l)] = at - off;
    off += pad.padded_rows(at - off);
  }
  s.offsets[static_cast<std::size_t>(L)] = off;
  return s;
}

// This rank's per-local-expert statistics from its expert-major layout ([L+1] offsets,
// padding included; [L] rows received), and zeroed per-peer row counts ([ep]).
inline void fill_local_stats(layer_stats& st, const char* path, const std::vector<std::size_t>& offsets,
                             const std::vector<std::size_t>& received, int ep) {
  const std::size_t L = received.size();
  st.path = path;
  st.tokens_per_local_expert.assign(L, 0);
  st.padding_per_local_expert.assign(L, 0);
  for (std::size_t l = 0; l < L; ++l) {
    st.tokens_per_local_expert[l] = static_cast<std::int64_t>(received[l]);
    st.padding_per_local_expert[l] = static_cast<std::int64_t>(offsets[l + 1] - offsets[l] - received[l]);
  }
  st.rows_sent.assign(static_cast<std::size_t>(ep), 0);
  st.rows_received.assign(static_cast<std::size_t>(ep), 0);
  st.peer_access = false;
}

// Group-wide load statistics from gathered counts ([E] per rank).
inline void fill_group_stats(layer_stats& st, const group_records& g, int ep, int L) {
  const int E = ep * L;
  st.tokens_per_expert.assign(static_cast<std::size_t>(E), 0);
  for (int r = 0; r < g.size; ++r)
    for (int e = 0; e < E; ++e) st.tokens_per_expert[static_cast<std::size_t>(e)] += g.counts(r)[e];
  std::int64_t total = 0, mx = 0;
  for (auto c : st.tokens_per_expert) {
    total += c;
    mx = std::max(mx, c);
  }
  st.max_expert_load = static_cast<double>(mx);
  st.mean_expert_load = static_cast<double>(total) / E;
  std::int64_t rmx = 0;
  for (int d = 0; d < ep; ++d) {
    std::int64_t s = 0;
    for (int l = 0; l < L; ++l) s += st.tokens_per_expert[static_cast<std::size_t>(d * L + l)];
    rmx = std::max(rmx, s);
  }
  st.max_rank_load = static_cast<double>(rmx);
  st.mean_rank_load = static_cast<double>(total) / ep;
}

// Zero-fills the padding rows of an expert-major buffer.
template <class Exec, class T>
void zero_padding(const Exec& ex, T* rows, const std::vector<std::size_t>& offsets,
                  const std::vector<std::size_t>& received, std::size_t H) {
  for (std::size_t l = 0; l + 1 < offsets.size(); ++l) {
    const std::size_t b = offsets[l] + received[l];
    exec::fill_zero(ex, rows + b * H, (offsets[l + 1] - b) * H);
  }
}

template <class Comm>
class all_to_all_impl {
 public:
  static constexpr const char* name = "all_to_all";

  explicit all_to_all_impl(const layer_context<Comm>& ctx) : ctx_(ctx) {}

  // What backward needs; buffers in the policy's memory space.
  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    row_slice slice;
    std::size_t recv_rows = 0;
    segment_layout layout;
    bool direct = false;                    // made by the peer-access path (y stays at the owners)
    group_layout group;                     // direct: every member's layout
    exec::buffer<std::int64_t, Exec> pos;   // [n*k] send position of pair (t, j)
    exec::buffer<float, Exec> weights;      // [n*k] copy of the slice's routing weights; direct: [S] in send order
    exec::buffer<std::int64_t, Exec> src_row;  // direct: [S] the slice row of each send position
    rows_buffer<T, Exec> x_recv;            // [R, H] expert-major input rows
    rows_buffer<T, Exec> y;                 // staged: [S, H] outputs in send order; direct: [R, H] expert-major
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    check_experts_forward<Experts, Exec, T>();
    const int E = ctx_.num_experts(), L = ctx_.local_experts(), tp = ctx_.tp_size();
    const std::size_t H = a.hidden;
    const auto k = static_cast<std::size_t>(a.top_k);
    const row_slice sl = a.status == 0 ? slice_bounds(a.rows, tp, ctx_.tp_rank()) : row_slice{};
    const std::size_t n = sl.size();

    // 1-3: layout and count exchange.
    auto plan = layout::build_plan(ex, a.status == 0 ? a.ids + sl.begin * k : nullptr,
                                   a.status == 0 ? a.weights + sl.begin * k : nullptr, n, a.top_k, E,
                                   ctx_.options.chunks);
    std::int64_t status = a.status;
    std::string msg = a.status_message;
    if (status == 0 && !plan.check) {
      status = 2;
      msg = layout::describe(plan.check, a.top_k, E, sl.begin);
    }
    const group_records g = exchange_records(*ctx_.ep, ex, status, a.rows, H, a.top_k, ctx_.rank,
                                             plan.host_counts.data(), static_cast<std::size_t>(E), msg,
                                             "moe_layer forward", tp);
    segment_layout lay = make_segment_layout(g, plan.host_offset, ctx_.ep_rank(), L, ctx_.options.pad);
    const bool direct = uses_peer_access<Exec>();
    record_stats(g, lay);
    if (ctx_.stats != nullptr) ctx_.stats->peer_access = direct;
    const std::size_t S = n * k, R = lay.offsets.back();
    const T* x = a.x + sl.begin * H;
    const float* w = a.weights + sl.begin * k;
    T* out = a.out + sl.begin * H;
    exec::fill_zero(ex, a.out, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, a.out + sl.end * H, (a.rows - sl.end) * H);
    auto x_recv = make_rows<T>(ws_, ex, R * H);
    const expert_rows<const T> rows{x_recv.data(), R, H, lay.offsets.data(), L, ctx_.first_expert()};
    rows_buffer<T, Exec> y;  // the experts' outputs: [S, H] in send order (staged), [R, H] at the owner (direct)
    group_layout gl;

    if constexpr (has_peer_access_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (direct) {
        // 4: every rank pulls its expert-major rows straight out of the owners' x (gather
        // and dispatch in one pass; padding rows come out zero).
        gl = make_group_layout(g, L, ctx_.options.pad);
        const int me = ctx_.ep_rank();
        auto table = ws_.template acquire<const T*>(std::max(R, S));
        const void* mine[2] = {x, plan.src_row.data()};
        ctx_.ep->access_peers(mine, 2, [&](const auto& peers) {
          fill_receive_table(gl, me, table.data(), R, [&](int s, std::size_t q) {
            const auto* src_row = static_cast<const std::int64_t*>(peers(s, 1));
            return static_cast<const T*>(peers(s, 0)) + static_cast<std::size_t>(src_row[q]) * H;
          });
          dispatch::launch_copy_rows(ex, R, H, static_cast<const T* const*>(table.data()), x_recv.data());
        });
        // 5: experts.
        T* y_rows = run_experts(ex, experts, rows, x_recv.data(), saved != nullptr, y);
        // 6-7: combine reads every slot's output row in place at its owner.
        const void* mine_y[1] = {y_rows};
        ctx_.ep->access_peers(mine_y, 1, [&](const auto& peers) {
          fill_return_table(gl, me, table.data(), H, [&](int d) { return static_cast<const T*>(peers(d, 0)); });
          dispatch::launch_combine(ex, n, H, a.top_k, dispatch::row_table<T>{table.data()}, w, plan.pos.data(), out);
        });
      }
    }
    if (!direct) {
      // 4: rows into send order, then the segmented all-to-all lands them expert-major.
      auto send = make_rows<T>(ws_, ex, S * H);
      dispatch::launch_gather(ex, S, H, x, static_cast<const std::int64_t*>(plan.src_row.data()), send.data());
      zero_padding(ex, x_recv.data(), lay.offsets, lay.received, H);
      settle(ex, *ctx_.ep);
      all_to_allv_segments(*ctx_.ep, static_cast<const T*>(send.data()), make_span(lay.send_counts),
                           make_span(lay.send_displs), x_recv.data(), make_span(lay.recv_counts),
                           make_span(lay.recv_displs), static_cast<std::size_t>(L), H);
      // 5: experts.
      rows_buffer<T, Exec> y_recv;
      const T* y_rows = run_experts(ex, experts, rows, x_recv.data(), saved != nullptr, y_recv);
      // 6: outputs back into send order (reusing the send buffer); 7: combine.
      settle(ex, *ctx_.ep);
      all_to_allv_segments(*ctx_.ep, y_rows, make_span(lay.recv_counts),
                           make_span(lay.recv_displs), send.data(), make_span(lay.send_counts),
                           make_span(lay.send_displs), static_cast<std::size_t>(L), H);
      dispatch::launch_combine(ex, n, H, a.top_k, static_cast<const T*>(send.data()), w, plan.pos.data(), out);
      y = std::move(send);
    }
    // The TP group sums the slices.
    settle(ex, *ctx_.ep);
    if (tp > 1) all_reduce(*ctx_.tp, span<T>(a.out, a.rows * H));

    if (saved != nullptr) {
      auto& s = saved->template emplace<state<T, Exec>>();
      s.rows = a.rows;
      s.hidden = H;
      s.top_k = a.top_k;
      s.slice = sl;
      s.recv_rows = R;
      s.layout = std::move(lay);
      s.direct = direct;
      s.group = std::move(gl);
      s.weights = exec::make_buffer<float>(ex, S);
      if (direct) {  // what the owners read in backward: the weight and row of each send position
        for (std::size_t i = 0; i < S; ++i) s.weights.data()[plan.pos.data()[i]] = w[i];
        s.src_row = std::move(plan.src_row);
      } else {
        exec::copy_n(ex, w, S, s.weights.data());
      }
      s.pos = std::move(plan.pos);
      s.x_recv = std::move(x_recv);
      s.y = std::move(y);
    }
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    check_experts_backward<Experts, Exec, T>();
    auto& s = saved.template get<state<T, Exec>>();
    const int L = ctx_.local_experts(), tp = ctx_.tp_size();
    const std::size_t H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    exchange_backward_status(*ctx_.ep, ex, a, s.rows, s.hidden, s.top_k, ctx_.rank, tp);
    const row_slice sl = s.slice;
    const std::size_t n = sl.size(), S = n * k, R = s.recv_rows;
    const segment_layout& lay = s.layout;
    const T* grad_out = a.grad_out + sl.begin * H;
    const float* w = static_cast<const float*>(s.weights.data());
    T* grad_x = a.grad_x + sl.begin * H;
    float* grad_w = a.grad_weights + sl.begin * k;
    exec::fill_zero(ex, a.grad_weights, a.rows * k);
    exec::fill_zero(ex, a.grad_x, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, a.grad_x + sl.end * H, (a.rows - sl.end) * H);
    const expert_rows<const T> rows{s.x_recv.data(), R, H, lay.offsets.data(), L, ctx_.first_expert()};
    auto grad_recv = make_rows<T>(ws_, ex, R * H);
    auto grad_in = make_rows<T>(ws_, ex, R * H);

    if constexpr (has_peer_access_v<Comm> && exec::is_host_policy_v<Exec>) {
      if (s.direct) {
        const group_layout& gl = s.group;
        const int me = ctx_.ep_rank();
        auto table = ws_.template acquire<const T*>(std::max(R, S));
        auto scale = ws_.template acquire<float>(R);
        // The owners make their grad_y rows straight from the token owners' grad_out
        // (scatter and dispatch in one pass); each token owner takes the dot products of its
        // grad_out rows with the slots' outputs kept at their owners (grad_w).
        const void* mine[4] = {grad_out, s.src_row.data(), s.weights.data(), s.y.data()};
        ctx_.ep->access_peers(mine, 4, [&](const auto& peers) {
          // Row i: send position q of member src, i.e. its grad_out row src_row[q] times its
          // weight (padding rows: null, a zero row).
          fill_receive_table(gl, me, table.data(), R, [&](int src, std::size_t q) {
            const auto* src_row = static_cast<const std::int64_t*>(peers(src, 1));
            return static_cast<const T*>(peers(src, 0)) + static_cast<std::size_t>(src_row[q]) * H;
          });
          for_each_received(gl, me, [&](std::size_t i, int src, std::size_t q) {
            scale.data()[i] = static_cast<const float*>(peers(src, 2))[q];
          });
          dispatch::launch_scale_rows(ex, R, H, static_cast<const T* const*>(table.data()),
                                      static_cast<const float*>(scale.data()), grad_recv.data());
        });
        const void* mine_y[1] = {s.y.data()};
        ctx_.ep->access_peers(mine_y, 1, [&](const auto& peers) {
          fill_return_table(gl, me, table.data(), H, [&](int d) { return static_cast<const T*>(peers(d, 0)); });
          dispatch::launch_weight_gradients(ex, n, H, s.top_k, dispatch::row_table<T>{table.data()}, grad_out,
                                            s.pos.data(), grad_w);
        });
        experts.backward(ex, rows, static_cast<const T*>(grad_recv.data()), grad_in.data());
        // Each token sums its slots' input gradients in place at their owners.
        const void* mine_i[1] = {grad_in.data()};
        ctx_.ep->access_peers(mine_i, 1, [&](const auto& peers) {
          fill_return_table(gl, me, table.data(), H, [&](int d) { return static_cast<const T*>(peers(d, 0)); });
          dispatch::launch_reduce_grad_rows(ex, n, H, s.top_k, dispatch::row_table<T>{table.data()}, s.pos.data(),
                                            grad_x);
        });
      }
    }
    if (!s.direct) {
      auto grad_send = make_rows<T>(ws_, ex, S * H);  // grad_y rows in send order
      dispatch::launch_combine_backward(ex, n, H, s.top_k, static_cast<const T*>(s.y.data()), grad_out, w,
                                        s.pos.data(), grad_send.data(), grad_w);
      zero_padding(ex, grad_recv.data(), lay.offsets, lay.received, H);
      settle(ex, *ctx_.ep);
      all_to_allv_segments(*ctx_.ep, static_cast<const T*>(grad_send.data()), make_span(lay.send_counts),
                           make_span(lay.send_displs), grad_recv.data(), make_span(lay.recv_counts),
                           make_span(lay.recv_displs), static_cast<std::size_t>(L), H);
      experts.backward(ex, rows, static_cast<const T*>(grad_recv.data()), grad_in.data());
      settle(ex, *ctx_.ep);
      all_to_allv_segments(*ctx_.ep, static_cast<const T*>(grad_in.data()), make_span(lay.recv_counts),
                           make_span(lay.recv_displs), grad_send.data(), make_span(lay.send_counts),
                           make_span(lay.send_displs), static_cast<std::size_t>(L), H);
      dispatch::launch_reduce_grad_rows(ex, n, H, s.top_k, static_cast<const T*>(grad_send.data()), s.pos.data(),
                                        grad_x);
    }
    if (tp > 1) {
      settle(ex, *ctx_.ep);
      all_reduce(*ctx_.tp, span<T>(a.grad_x, a.rows * H));
      all_reduce(*ctx_.tp, span<float>(a.grad_weights, a.rows * k));
    }
  }

 private:
  // Runs the experts over `rows` (whose data is x_recv) and returns their outputs: written
  // over x_recv when the experts allow it and nothing is kept for backward, into `y`
  // (allocated here, R rows) otherwise.
  template <class T, class Exec, class Experts>
  T* run_experts(const Exec& ex, Experts& experts, const expert_rows<const T>& rows, T* x_recv, bool training,
                 rows_buffer<T, Exec>& y) {
    T* out = x_recv;
    if (training || !forward_in_place_v<Experts>) {
      y = make_rows<T>(ws_, ex, rows.num_rows * rows.hidden);
      out = y.data();
    }
    experts.forward(ex, rows, out);
    return out;
  }

  // Whether this call reads rows out of the peers' buffers (see layer_options::peer_access).
  template <class Exec>
  bool uses_peer_access() const noexcept {
    return has_peer_access_v<Comm> && exec::is_host_policy_v<Exec> && ctx_.options.peer_access;
  }

  void record_stats(const group_records& g, const segment_layout& lay) {
    if (ctx_.stats == nullptr) return;
    layer_stats& st = *ctx_.stats;
    const int ep = ctx_.ep_size(), L = ctx_.local_experts();
    fill_local_stats(st, name, lay.offsets, lay.received, ep);
    for (int d = 0; d < ep; ++d)
      for (int l = 0; l < L; ++l) {
        const auto i = static_cast<std::size_t>(d * L + l);
        st.rows_sent[static_cast<std::size_t>(d)] += static_cast<std::int64_t>(lay.send_counts[i]);
        st.rows_received[static_cast<std::size_t>(d)] += static_cast<std::int64_t>(lay.recv_counts[i]);
      }
    fill_group_stats(st, g, ep, L);
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
