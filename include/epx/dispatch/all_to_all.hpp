// epx/dispatch/all_to_all.hpp: token dispatch and combine over the EP group (spec section 4).
//
// Forward, per call:
//   1. TP slice [b, e) of the N rows (empty slices join everything below);
//   2. counting-sort send layout of the slice's (row, slot) pairs (epx/layout/plan.hpp);
//   3. count exchange: all_gather of {status, N, H, k, counts[E]} over the EP group; bad
//      input anywhere raises on every rank here, before rows move;
//   4. gather rows into send order, segmented all-to-all so that they land expert-major
//      (with zero padding rows) at the owner: no second permutation;
//   5. the user's experts;
//   6. the mirrored segmented all-to-all brings outputs back into send order;
//   7. combine in accum_t, slot order, into the zero-filled [N, H] output; TP all-reduce.
// Before every communicator call the execution policy is synchronised (a no-op for host
// policies), so a communicator never reads buffers a device stream is still writing.
// Backward runs the same path in reverse with the saved layout (no count exchange, only a
// small shape check exchange).
// Row buffers of host policies come from a pool kept by the implementation between calls
// (detail::workspace), so repeated calls do not page-fault fresh allocations; device
// policies allocate through exec::make_buffer (stream-ordered).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/dispatch/detail/exchange.hpp"
#include "epx/dispatch/detail/settle.hpp"
#include "epx/dispatch/detail/workspace.hpp"
#include "epx/dispatch/functors.hpp"
#include "epx/dispatch/launch.hpp"
#include "epx/dispatch/implementation.hpp"
#include "epx/dispatch/slicing.hpp"
#include "epx/exec/host.hpp"
#include "epx/layer/experts.hpp"
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
    exec::buffer<std::int64_t, Exec> pos;   // [n*k] send position of pair (t, j)
    exec::buffer<float, Exec> weights;      // [n*k] copy of the slice's routing weights
    rows_buffer<T, Exec> x_recv;            // [R, H] expert-major input rows
    rows_buffer<T, Exec> y_send;            // [S, H] expert outputs in send order
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
    record_stats(g, lay);

    // 4: rows to their experts, landing expert-major.
    const std::size_t S = n * k, R = lay.offsets.back();
    auto send = make_rows<T>(ws_, ex, S * H);
    auto x_recv = make_rows<T>(ws_, ex, R * H);
    dispatch::launch_gather(ex, S, H, a.x + sl.begin * H, static_cast<const std::int64_t*>(plan.src_row.data()),
                            send.data());
    zero_padding(ex, x_recv.data(), lay.offsets, lay.received, H);
    settle(ex, *ctx_.ep);
    all_to_allv_segments(*ctx_.ep, send.data(), make_span(lay.send_counts), make_span(lay.send_displs),
                         x_recv.data(), make_span(lay.recv_counts), make_span(lay.recv_displs),
                         static_cast<std::size_t>(L), H);

    // 5: experts.
    auto y_recv = make_rows<T>(ws_, ex, R * H);
    const expert_rows<const T> rows{x_recv.data(), R, H, lay.offsets.data(), L, ctx_.first_expert()};
    experts.forward(ex, rows, y_recv.data());

    // 6: outputs back into send order (reusing the send buffer).
    settle(ex, *ctx_.ep);
    all_to_allv_segments(*ctx_.ep, static_cast<const T*>(y_recv.data()), make_span(lay.recv_counts),
                         make_span(lay.recv_displs), send.data(), make_span(lay.send_counts),
                         make_span(lay.send_displs), static_cast<std::size_t>(L), H);

    // 7: combine into the slice (every row of it written), zeros around it; the TP group
    // sums the slices.
    exec::fill_zero(ex, a.out, sl.begin * H);
    exec::fill_zero(ex, a.out + sl.end * H, (a.rows - sl.end) * H);
    dispatch::launch_combine(ex, n, H, a.top_k, static_cast<const T*>(send.data()), a.weights + sl.begin * k,
                             plan.pos.data(), a.out + sl.begin * H);
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
      s.pos = std::move(plan.pos);
      s.weights = exec::make_buffer<float>(ex, S);
      exec::copy_n(ex, a.weights + sl.begin * k, S, s.weights.data());
      s.x_recv = std::move(x_recv);
      s.y_send = std::move(send);
    }
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    check_experts_backward<Experts, Exec, T>();
    auto& s = saved.template get<state<T, Exec>>();
    const int L = ctx_.local_experts(), tp = ctx_.tp_size();
    const std::size_t H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    std::int64_t status = a.status;
    std::string msg = a.status_message;
    if (status == 0 && (a.rows != s.rows || a.hidden != s.hidden || a.top_k != s.top_k)) {
      status = 1;
      msg = concat("backward shapes N=", a.rows, " H=", a.hidden, " k=", a.top_k,
                   " differ from the forward call's N=", s.rows, " H=", s.hidden, " k=", s.top_k);
    }
    exchange_records(*ctx_.ep, ex, status, a.rows, a.hidden, a.top_k, ctx_.rank, nullptr, 0, msg,
                     "moe_layer backward", tp);
    const row_slice sl = s.slice;
    const std::size_t n = sl.size(), S = n * k, R = s.recv_rows;
    const segment_layout& lay = s.layout;

    // grad_y rows in send order and the routing-weight gradients of the slice.
    auto grad_send = make_rows<T>(ws_, ex, S * H);
    auto grad_recv = make_rows<T>(ws_, ex, R * H);
    exec::fill_zero(ex, a.grad_weights, a.rows * k);
    dispatch::launch_combine_backward(ex, n, H, s.top_k, static_cast<const T*>(s.y_send.data()),
                                      a.grad_out + sl.begin * H,
                                      static_cast<const float*>(s.weights.data()), s.pos.data(), grad_send.data(),
                                      a.grad_weights + sl.begin * k);
    zero_padding(ex, grad_recv.data(), lay.offsets, lay.received, H);
    settle(ex, *ctx_.ep);
    all_to_allv_segments(*ctx_.ep, static_cast<const T*>(grad_send.data()), make_span(lay.send_counts),
                         make_span(lay.send_displs), grad_recv.data(), make_span(lay.recv_counts),
                         make_span(lay.recv_displs), static_cast<std::size_t>(L), H);

    auto grad_in = make_rows<T>(ws_, ex, R * H);
    const expert_rows<const T> rows{s.x_recv.data(), R, H, lay.offsets.data(), L, ctx_.first_expert()};
    experts.backward(ex, rows, static_cast<const T*>(grad_recv.data()), grad_in.data());

    settle(ex, *ctx_.ep);
    all_to_allv_segments(*ctx_.ep, static_cast<const T*>(grad_in.data()), make_span(lay.recv_counts),
                         make_span(lay.recv_displs), grad_send.data(), make_span(lay.send_counts),
                         make_span(lay.send_displs), static_cast<std::size_t>(L), H);
    exec::fill_zero(ex, a.grad_x, sl.begin * H);  // the slice's rows are all written below
    exec::fill_zero(ex, a.grad_x + sl.end * H, (a.rows - sl.end) * H);
    dispatch::launch_reduce_grad_rows(ex, n, H, s.top_k, static_cast<const T*>(grad_send.data()), s.pos.data(),
                                      a.grad_x + sl.begin * H);
    if (tp > 1) {
      settle(ex, *ctx_.ep);
      all_reduce(*ctx_.tp, span<T>(a.grad_x, a.rows * H));
      all_reduce(*ctx_.tp, span<float>(a.grad_weights, a.rows * k));
    }
  }

 private:
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
