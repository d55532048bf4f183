// epx/impl/all_reduce.hpp: the masked all-reduce path (spec section 5), ep == tp.
//
// Every rank of the EP group holds the same N rows. Each rank gathers the rows routed to
// its own local experts into an expert-major buffer (same counting-sort layout and padding
// as the all-to-all path), runs its experts, applies the routing weights on the expert
// side with zero for non-local slots, and the EP group all-reduces (sums) the output. No
// rows move. Backward mirrors it: each rank produces the input and routing-weight
// gradients of its own slots and the EP group sums them.
//
// One small all_gather of {status, N, H, k} per call checks the inputs on every rank so
// that bad input raises everywhere instead of hanging in the all-reduce.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/impl/all_to_all.hpp"
#include "epx/layout/exchange.hpp"
#include "epx/comm/settle.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/kernels/functors.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/exec/host.hpp"
#include "epx/impl/experts.hpp"
#include "epx/layout/plan.hpp"

namespace epx {
namespace detail {

template <class Comm>
class all_reduce_impl {
 public:
  static constexpr const char* name = "all_reduce";

  explicit all_reduce_impl(const layer_context<Comm>& ctx) : ctx_(ctx) { ctx.topology->validate_all_reduce_path(); }

  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    std::size_t local_rows = 0;
    std::vector<std::size_t> offsets;            // [L+1] host
    exec::buffer<std::int64_t, Exec> local_pos;  // [N*k] row in the local buffer, -1 if not local
    exec::buffer<float, Exec> weights;           // [N*k]
    rows_buffer<T, Exec> x_local;                // [R, H]
    rows_buffer<T, Exec> y_local;                // [R, H]
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    check_experts_forward<Experts, Exec, T>();
    const int E = ctx_.num_experts(), L = ctx_.local_experts(), first = ctx_.first_expert();
    const std::size_t H = a.hidden, N = a.status == 0 ? a.rows : 0;
    const auto k = static_cast<std::size_t>(a.top_k);
    auto plan = layout::build_plan(ex, a.ids, a.weights, N, a.top_k, E, ctx_.options.chunks);
    std::int64_t status = a.status;
    std::string msg = a.status_message;
    if (status == 0 && !plan.check) {
      status = 2;
      msg = layout::describe(plan.check, a.top_k, E);
    }
    exchange_records(*ctx_.ep, ex, status, a.rows, H, a.top_k, ctx_.rank, nullptr, 0, msg, "moe_layer forward",
                     ctx_.ep_size());

    // Expert-major layout of this rank's experts (padding included).
    std::vector<std::size_t> offsets(static_cast<std::size_t>(L) + 1, 0), received(static_cast<std::size_t>(L), 0);
    std::vector<std::int64_t> off64(static_cast<std::size_t>(L) + 1, 0);
    for (int l = 0; l < L; ++l) {
      const auto i = static_cast<std::size_t>(l);
      received[i] = static_cast<std::size_t>(plan.host_counts[static_cast<std::size_t>(first + l)]);
      offsets[i + 1] = offsets[i] + ctx_.options.pad.padded_rows(received[i]);
      off64[i + 1] = static_cast<std::int64_t>(offsets[i + 1]);
    }
    record_stats(plan.host_counts, offsets, received);
    const std::size_t R = offsets.back();
    auto local_offset = exec::make_buffer<std::int64_t>(ex, static_cast<std::size_t>(L) + 1);
    auto row_source = exec::make_buffer<std::int64_t>(ex, R);
    auto local_pos = exec::make_buffer<std::int64_t>(ex, N * k);
    detail::from_host(ex, off64.data(), off64.size(), local_offset.data());
    exec::for_each_n(ex, static_cast<std::size_t>(L),
                     dispatch::masked_source_rows{plan.src_row.data(), plan.expert_offset.data(),
                                                  local_offset.data(), row_source.data(), first});
    exec::for_each_n(ex, N * k,
                     dispatch::masked_positions{a.ids, plan.pos.data(), plan.expert_offset.data(),
                                                local_offset.data(), local_pos.data(), first, L});
    auto x_local = make_rows<T>(ws_, ex, R * H);  // pooled for host policies (detail::workspace)
    dispatch::launch_gather(ex, R, H, a.x, static_cast<const std::int64_t*>(row_source.data()), x_local.data());

    // The experts write over their inputs when they allow it and nothing is kept for backward.
    const expert_rows<const T> rows{x_local.data(), R, H, offsets.data(), L, first};
    rows_buffer<T, Exec> y_local;
    T* y = x_local.data();
    if (saved != nullptr || !forward_in_place_v<Experts>) {
      y_local = make_rows<T>(ws_, ex, R * H);
      y = y_local.data();
    }
    experts.forward(ex, rows, y);

    dispatch::launch_combine(ex, N, H, a.top_k, static_cast<const T*>(y), a.weights,
                             static_cast<const std::int64_t*>(local_pos.data()), a.out);
    settle(ex, *ctx_.ep);
    all_reduce(*ctx_.ep, span<T>(a.out, N * H));

    if (saved != nullptr) {
      auto& s = saved->template emplace<state<T, Exec>>();
      s.rows = N;
      s.hidden = H;
      s.top_k = a.top_k;
      s.local_rows = R;
      s.offsets = std::move(offsets);
      s.local_pos = std::move(local_pos);
      s.weights = exec::make_buffer<float>(ex, N * k);
      exec::copy_n(ex, a.weights, N * k, s.weights.data());
      s.x_local = std::move(x_local);
      s.y_local = std::move(y_local);
    }
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    check_experts_backward<Experts, Exec, T>();
    auto& s = saved.template get<state<T, Exec>>();
    const int L = ctx_.local_experts();
    exchange_backward_status(*ctx_.ep, ex, a, s.rows, s.hidden, s.top_k, ctx_.rank, ctx_.ep_size());
    const std::size_t N = s.rows, H = s.hidden, R = s.local_rows;
    const auto k = static_cast<std::size_t>(s.top_k);

    auto grad_y = make_rows<T>(ws_, ex, R * H);
    auto grad_in = make_rows<T>(ws_, ex, R * H);
    exec::fill_zero(ex, grad_y.data(), R * H);  // padding rows stay zero
    dispatch::launch_combine_backward(ex, N, H, s.top_k, static_cast<const T*>(s.y_local.data()), a.grad_out,
                                      static_cast<const float*>(s.weights.data()),
                                      static_cast<const std::int64_t*>(s.local_pos.data()), grad_y.data(),
                                      a.grad_weights);
    const expert_rows<const T> rows{s.x_local.data(), R, H, s.offsets.data(), L, ctx_.first_expert()};
    experts.backward(ex, rows, static_cast<const T*>(grad_y.data()), grad_in.data());
    dispatch::launch_reduce_grad_rows(ex, N, H, s.top_k, static_cast<const T*>(grad_in.data()),
                                      static_cast<const std::int64_t*>(s.local_pos.data()), a.grad_x);
    settle(ex, *ctx_.ep);
    all_reduce(*ctx_.ep, span<T>(a.grad_x, N * H));
    all_reduce(*ctx_.ep, span<float>(a.grad_weights, N * k));
  }

 private:
  void record_stats(const std::vector<std::int64_t>& counts, const std::vector<std::size_t>& offsets,
                    const std::vector<std::size_t>& received) {
    if (ctx_.stats == nullptr) return;
    layer_stats& st = *ctx_.stats;
    const int ep = ctx_.ep_size(), L = ctx_.local_experts();
    fill_local_stats(st, name, offsets, received, ep);
    // The EP group holds one batch: this rank's counts are the group's.
    group_records g;
    g.size = 1;
    g.stride = record_header + counts.size();
    g.data.assign(g.stride, 0);
    std::copy(counts.begin(), counts.end(), g.data.begin() + record_header);
    fill_group_stats(st, g, ep, L);
  }

  layer_context<Comm> ctx_;
  workspace ws_;  // pooled row buffers (host policies)
};

}  // namespace detail

namespace impl {
// The masked all-reduce path; requires ep == tp (checked at layer construction).
struct all_reduce {
  template <class Comm>
  using with = detail::all_reduce_impl<Comm>;
};
}  // namespace impl

}  // namespace epx
