// tests/core/user_implementation.hpp: a user-defined implementation, the one shown in
// docs/implementations.md (keep the two in sync; test_user_impl.cpp compiles and checks it).
//
// `local_only` runs every expert on the rank itself: valid when ep_size == 1 (each rank
// owns all experts, so no row has to move). It reuses the library's building blocks: the
// counting-sort plan, whose send order is already expert-major, and the combine functors.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace user {

template <class Comm>
class local_only {
 public:
  static constexpr const char* name = "local_only";

  explicit local_only(const epx::layer_context<Comm>& ctx) : ctx_(ctx) {
    EPX_REQUIRE(ctx.ep_size() == 1, epx::errc::configuration, "local_only needs ep_size 1, not ", ctx.ep_size());
  }

  template <class T, class Exec>
  struct state {
    epx::layout::send_plan<Exec> plan;       // pos [N*k]: row of pair (t, j) in the expert-major buffer
    std::vector<std::size_t> offsets;        // [E+1]
    epx::exec::buffer<float, Exec> weights;  // [N*k] in send order
    epx::exec::buffer<T, Exec> x_rows;       // [N*k, H]
    epx::exec::buffer<T, Exec> y_rows;       // [N*k, H]
  };

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const epx::forward_args<T>& a, Experts& experts, epx::saved_state<T>* saved) {
    EPX_REQUIRE(a.status == 0, epx::errc::input, a.status_message);
    const int E = ctx_.num_experts();
    const std::size_t N = a.rows, H = a.hidden, S = N * static_cast<std::size_t>(a.top_k);
    state<T, Exec> s;
    s.plan = epx::layout::build_plan(ex, a.ids, a.weights, N, a.top_k, E);
    EPX_REQUIRE(static_cast<bool>(s.plan.check), epx::errc::input, epx::layout::describe(s.plan.check, a.top_k, E));
    s.offsets.assign(s.plan.host_offset.begin(), s.plan.host_offset.end());
    s.x_rows = epx::exec::make_buffer<T>(ex, S * H);
    s.y_rows = epx::exec::make_buffer<T>(ex, S * H);
    epx::kernels::gather(ex, S, H, a.x, static_cast<const std::int64_t*>(s.plan.src_row.data()), s.x_rows.data());
    const epx::expert_rows<const T> rows{s.x_rows.data(), S, H, s.offsets.data(), E, 0};
    experts.forward(ex, rows, s.y_rows.data());
    epx::kernels::combine(ex, N, H, a.top_k, static_cast<const T*>(s.y_rows.data()), a.weights, s.plan.pos.data(),
                          a.out);
    if (ctx_.stats != nullptr) {
      ctx_.stats->path = name;
      ctx_.stats->tokens_per_local_expert = s.plan.host_counts;
    }
    if (saved != nullptr) {
      s.weights = epx::exec::make_buffer<float>(ex, S);  // in send order
      epx::kernels::scatter(ex, S, static_cast<const std::int64_t*>(s.plan.pos.data()), a.weights, s.weights.data());
      saved->template emplace<state<T, Exec>>(std::move(s));
    }
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const epx::backward_args<T>& a, Experts& experts, epx::saved_state<T>& saved) {
    EPX_REQUIRE(a.status == 0, epx::errc::input, a.status_message);
    auto& s = saved.template get<state<T, Exec>>();
    const std::size_t N = a.rows, H = a.hidden, S = N * static_cast<std::size_t>(a.top_k);
    auto grad_y = epx::exec::make_buffer<T>(ex, S * H);
    auto grad_in = epx::exec::make_buffer<T>(ex, S * H);
    epx::kernels::gather(ex, S, H, a.grad_out, static_cast<const std::int64_t*>(s.plan.src_row.data()),
                         static_cast<const float*>(s.weights.data()), grad_y.data());
    epx::kernels::weight_gradients(ex, N, H, a.top_k, static_cast<const T*>(s.y_rows.data()), a.grad_out,
                                   s.plan.pos.data(), a.grad_weights);
    const epx::expert_rows<const T> rows{s.x_rows.data(), S, H, s.offsets.data(), ctx_.num_experts(), 0};
    experts.backward(ex, rows, static_cast<const T*>(grad_y.data()), grad_in.data());
    epx::kernels::reduce(ex, N, H, a.top_k, static_cast<const T*>(grad_in.data()), s.plan.pos.data(), a.grad_x);
  }

 private:
  epx::layer_context<Comm> ctx_;
};

}  // namespace user
