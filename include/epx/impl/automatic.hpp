// epx/impl/automatic.hpp: impl::automatic, the implementation chosen per call.
//
// Inference on a mesh whose EP group shares one batch (ep == tp) takes the masked
// all-reduce path (no rows move; one record exchange), except in bounded mode; everything
// else (training, ep > tp, bounded mode) takes the all-to-all path. Backward follows
// whichever path its saved state came from.
#pragma once

#include <memory>
#include <string>

#include "epx/impl/all_reduce.hpp"
#include "epx/impl/all_to_all.hpp"
#include "epx/impl/implementation.hpp"

namespace epx {
namespace detail {

template <class Comm>
class automatic_impl {
 public:
  static constexpr const char* name = "automatic";

  explicit automatic_impl(const layer_context<Comm>& ctx) : a2a_(ctx), bounded_(ctx.bound != nullptr) {
    if (all_reduce_impl<Comm>::can_implement(*ctx.topology, ctx.options).empty())
      masked_ = std::make_unique<all_reduce_impl<Comm>>(ctx);
  }

  // Any mesh: the all-to-all path runs whatever the masked path cannot.
  static std::string can_implement(const mesh& m, const layer_options& o) {
    return all_to_all_impl<Comm>::can_implement(m, o);
  }

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
    check_experts_forward<Experts, Exec, T>();
    if (bounded_) return a2a_.forward(ex, a, experts, saved);  // bounded mode: fused calls only
    forward_by_stages(*this, ex, a, experts, saved);
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
    check_experts_backward<Experts, Exec, T>();
    if (bounded_) return a2a_.backward(ex, a, experts, saved);
    backward_by_stages(*this, ex, a, experts, saved);
  }

  // The stages follow the path of the call: dispatch chooses it, combine and backward follow
  // the state it made.
  template <class T, class Exec>
  expert_batch<T> dispatch(const Exec& ex, const forward_args<T>& a, saved_state<T>& flight, bool training,
                           bool in_place) {
    if (!training && masked_) return masked_->dispatch(ex, a, flight, training, in_place);
    return a2a_.dispatch(ex, a, flight, training, in_place);
  }

  template <class T, class Exec>
  void combine(const Exec& ex, saved_state<T>& flight, T* out, saved_state<T>* saved) {
    using masked_state = typename all_reduce_impl<Comm>::template state<T, Exec>;
    if (masked_ && flight.template holds<masked_state>())
      masked_->combine(ex, flight, out, saved);
    else
      a2a_.combine(ex, flight, out, saved);
  }

  template <class T, class Exec>
  expert_grad_batch<T> backward_dispatch(const Exec& ex, const backward_args<T>& a, saved_state<T>& saved,
                                         saved_state<T>& flight) {
    using masked_state = typename all_reduce_impl<Comm>::template state<T, Exec>;
    if (masked_ && saved.template holds<masked_state>()) return masked_->backward_dispatch(ex, a, saved, flight);
    return a2a_.backward_dispatch(ex, a, saved, flight);
  }

  template <class T, class Exec>
  void backward_combine(const Exec& ex, saved_state<T>& flight, T* grad_x) {
    using masked_state = typename all_reduce_impl<Comm>::template backward_state<T, Exec>;
    if (masked_ && flight.template holds<masked_state>())
      masked_->backward_combine(ex, flight, grad_x);
    else
      a2a_.backward_combine(ex, flight, grad_x);
  }

 private:
  all_to_all_impl<Comm> a2a_;
  std::unique_ptr<all_reduce_impl<Comm>> masked_;
  bool bounded_;  // bounded mode (count_exchange::device): the all-to-all path's own calls
};

}  // namespace detail

namespace impl {
// all_reduce for inference when the EP group shares one batch (ep == tp), all_to_all
// otherwise (always all_to_all for training).
struct automatic {
  template <class Comm>
  using with = detail::automatic_impl<Comm>;
};
}  // namespace impl

}  // namespace epx
