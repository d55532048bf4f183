// epx/impl/all_reduce.hpp: the masked all-reduce path (spec section 5), ep == tp.
//
// Every rank of the EP group holds the same N rows. Each rank gathers the rows routed to
// its own local experts into an expert-major buffer (same counting-sort layout and padding
// as the all-to-all path), runs its experts, applies the routing weights on the expert
// side with zero for non-local slots, and the EP group all-reduces (sums) the output. No
// rows move. Backward mirrors it: each rank produces the input and routing-weight
// gradients of its own slots and the EP group sums them.
//
// One small all_gather per call of every rank's record {status, N, H, k, rank, mode, counts[E]}
// checks the inputs on every rank, so that bad input raises everywhere instead of hanging
// in the all-reduce, and gives this rank its own counts (its experts' row offsets). Bounded mode
// (layer_options::counts == count_exchange::device) has no such exchange and no host read:
// epx/impl/bounded_masked.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/settle.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"
#include "epx/exec/workspace.hpp"
#include "epx/impl/bounded_masked.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/impl/prologue.hpp"
#include "epx/kernels/launch.hpp"
#include "epx/layout/masked.hpp"
#include "epx/layout/receive.hpp"

namespace epx {
namespace detail {

template <class Comm>
class all_reduce_impl {
 public:
  static constexpr const char* name = "all_reduce";
  static constexpr bool bounded_masked = true;  // bounded mode: epx/impl/bounded_masked.hpp

  explicit all_reduce_impl(const layer_context<Comm>& ctx) : ctx_(ctx), bounded_(ctx) {
    const std::string why = can_implement(*ctx.topology, ctx.options);
    EPX_REQUIRE(why.empty(), errc::configuration, why);
  }

  // The masked path needs every rank of an EP group to hold the same rows: ep == tp.
  static std::string can_implement(const mesh& m, const layer_options& o) {
    if (o.fp8_dispatch)
      return "the all_reduce implementation moves no rows, so it has no FP8 dispatch (layer_options::fp8_dispatch): "
             "use impl::all_to_all or impl::automatic";
    if (o.sends != row_sends::per_slot)
      return "the all_reduce implementation moves no rows, so it has no per-rank sends (layer_options::sends == "
             "row_sends::per_rank): use impl::all_to_all or impl::automatic";
    if (m.ep() == m.tp()) return {};
    return concat("the all_reduce implementation requires ep_size (", m.ep(), ") == tp_size (", m.tp(),
                  "): every rank of an EP group must hold the same rows; use impl::all_to_all or impl::automatic "
                  "on this mesh");
  }

  template <class T, class Exec>
  struct state {
    std::size_t rows = 0, hidden = 0;
    int top_k = 0;
    std::size_t local_rows = 0;
    std::vector<std::size_t> offsets;             // [L+1] host
    exec::buffer<std::int64_t, Exec> local_pos;   // [N*k] row in the local buffer, -1 if not local
    exec::buffer<std::int64_t, Exec> row_source;  // [R] token of each local row, -1 for padding
    exec::buffer<float, Exec> weights;            // [R] routing weight of each local row
    rows_buffer<T, Exec> x_local;                 // [R, H]
    rows_buffer<T, Exec> y_local;                 // [R, H]
    // Between dispatch and combine only.
    exec::buffer<float, Exec> call_weights;       // [N*k] the call's routing weights
    T* out_rows = nullptr;                        // where the experts write
  };

  template <class T, class Exec>
  struct backward_state {
    saved_state<T> forward;
    rows_buffer<T, Exec> grad_y;   // [R, H]
    rows_buffer<T, Exec> grad_in;  // [R, H]
    float* grad_weights = nullptr; // the call's [N, k], summed over the EP group by backward_combine
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

  // The rows of this rank's experts, gathered expert-major (no row moves between ranks).
  template <class T, class Exec>
  expert_batch<T> dispatch(const Exec& ex, const forward_args<T>& a, saved_state<T>& flight, bool training,
                           bool in_place) {
    require_unbounded(ctx_, "dispatch");
    const int L = ctx_.local_experts(), first = ctx_.first_expert(), me = ctx_.ep_rank();
    const std::size_t H = a.hidden, N = a.status == 0 ? a.rows : 0;
    const auto k = static_cast<std::size_t>(a.top_k);
    route_request q;
    q.n = N;
    q.training = training;
    q.gather_counts = false;
    q.agree_rows = ctx_.ep_size();
    q.path = name;
    q.moves_rows = false;
    routed<Exec> r = route_forward(ctx_, ex, a, q);

    // Expert-major layout of this rank's experts (padding included).
    auto& s = flight.template emplace<state<T, Exec>>();
    const std::size_t* off = r.layout.offsets(me);
    s.offsets.assign(off, off + L + 1);
    std::vector<std::int64_t> off64(s.offsets.begin(), s.offsets.end());
    const std::size_t R = s.offsets.back();
    s.rows = N;
    s.hidden = H;
    s.top_k = a.top_k;
    s.local_rows = R;
    auto local_offset = exec::make_buffer<std::int64_t>(ex, static_cast<std::size_t>(L) + 1);
    s.row_source = exec::make_buffer<std::int64_t>(ex, R);
    s.local_pos = exec::make_buffer<std::int64_t>(ex, N * k);
    exec::copy_n(ex, static_cast<const std::int64_t*>(off64.data()), off64.size(), local_offset.data());  // queued, no wait
    exec::for_each_n(ex, R,
                     layout::masked_source_rows{r.plan.src_row.data(), r.plan.expert_offset(),
                                                local_offset.data(), s.row_source.data(), first, L});
    exec::for_each_n(ex, N * k,
                     layout::masked_positions{a.ids, r.plan.pos.data(), r.plan.expert_offset(),
                                              local_offset.data(), s.local_pos.data(), first, L});
    s.x_local = make_rows<T>(ws_, ex, R * H);  // pooled for host policies (detail::workspace)
    kernels::gather(ex, R, H, a.x, static_cast<const std::int64_t*>(s.row_source.data()), s.x_local.data());
    s.call_weights = exec::make_buffer<float>(ex, N * k);
    if (N > 0) exec::copy_n(ex, a.weights, N * k, s.call_weights.data());
    // The experts write over their inputs when they allow it and nothing is kept for backward.
    s.out_rows = expert_output_rows(ws_, ex, R, H, s.x_local.data(), training, in_place, s.y_local);
    expert_batch<T> b;
    b.in = expert_rows<const T>{s.x_local.data(), R, H, s.offsets.data(), L, first};
    b.out = s.out_rows;
    return b;
  }

  // The routing weights applied on the expert side (zero for non-local slots), then the EP
  // group sums the output.
  template <class T, class Exec>
  void combine(const Exec& ex, saved_state<T>& flight, T* out, saved_state<T>* saved) {
    auto& s = flight.template get<state<T, Exec>>();
    const std::size_t N = s.rows, H = s.hidden;
    const auto k = static_cast<std::size_t>(s.top_k);
    kernels::combine(ex, N, H, s.top_k, static_cast<const T*>(s.out_rows), static_cast<const float*>(s.call_weights.data()),
                     static_cast<const std::int64_t*>(s.local_pos.data()), out);
    s.out_rows = nullptr;
    order_before_collective(ex, *ctx_.ep);
    all_reduce(*ctx_.ep, span<T>(out, N * H));

    if (saved != nullptr) {
      s.weights = exec::make_buffer<float>(ex, s.local_rows);  // the weight of each local row (padding: unread)
      kernels::scatter(ex, N * k, static_cast<const std::int64_t*>(s.local_pos.data()),
                       static_cast<const float*>(s.call_weights.data()), s.weights.data());
      s.call_weights = exec::buffer<float, Exec>{};
      *saved = std::move(flight);
    }
  }

  // grad_y row r = w * grad_out of its token (padding rows: zero); grad_w of the local
  // slots from the kept outputs (0 for the others; the EP group sums them in
  // backward_combine, with grad_x).
  template <class T, class Exec>
  expert_grad_batch<T> backward_dispatch(const Exec& ex, const backward_args<T>& a, saved_state<T>& saved,
                                         saved_state<T>& flight) {
    require_unbounded(ctx_, "backward_dispatch");
    // As all_to_all's: the checks before the state is moved out of `saved`.
    if (const char* why = saved.template unusable_as<state<T, Exec>>(ctx_.layer); *why)
      reject_saved_state(*ctx_.ep, a, why, ctx_.rank, ctx_.ep_size());
    {
      const auto& s0 = saved.template get<state<T, Exec>>();
      exchange_backward_status(*ctx_.ep, a, s0.rows, s0.hidden, s0.top_k, ctx_.rank, ctx_.ep_size(), saved.call());
    }
    auto& b = flight.template emplace<backward_state<T, Exec>>();
    b.forward = std::move(saved);
    auto& s = b.forward.template get<state<T, Exec>>();
    const int L = ctx_.local_experts();
    const std::size_t N = s.rows, H = s.hidden, R = s.local_rows;
    b.grad_y = make_rows<T>(ws_, ex, R * H);
    b.grad_in = make_rows<T>(ws_, ex, R * H);
    kernels::gather(ex, R, H, a.grad_out, static_cast<const std::int64_t*>(s.row_source.data()),
                    static_cast<const float*>(s.weights.data()), b.grad_y.data());
    kernels::weight_gradients(ex, N, H, s.top_k, static_cast<const T*>(s.y_local.data()), a.grad_out,
                              static_cast<const std::int64_t*>(s.local_pos.data()), a.grad_weights);
    b.grad_weights = a.grad_weights;
    expert_grad_batch<T> g;
    g.in = expert_rows<const T>{s.x_local.data(), R, H, s.offsets.data(), L, ctx_.first_expert()};
    g.grad_out = b.grad_y.data();
    g.grad_in = b.grad_in.data();
    return g;
  }

  template <class T, class Exec>
  void backward_combine(const Exec& ex, saved_state<T>& flight, T* grad_x) {
    auto& b = flight.template get<backward_state<T, Exec>>();
    auto& s = b.forward.template get<state<T, Exec>>();
    const std::size_t N = s.rows, H = s.hidden;
    kernels::reduce(ex, N, H, s.top_k, static_cast<const T*>(b.grad_in.data()),
                    static_cast<const std::int64_t*>(s.local_pos.data()), grad_x);
    order_before_collective(ex, *ctx_.ep);
    all_reduce(*ctx_.ep, span<T>(grad_x, N * H));
    all_reduce(*ctx_.ep, span<float>(b.grad_weights, N * static_cast<std::size_t>(s.top_k)));
  }

 private:
  layer_context<Comm> ctx_;
  workspace ws_;  // pooled row buffers (host policies)
  bounded_masked_route<Comm> bounded_;  // bounded mode (epx/impl/bounded_masked.hpp)
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
