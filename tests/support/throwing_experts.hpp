// tests/support/throwing_experts.hpp: the float64-checked linear experts of
// tests/support/reference.hpp whose forward or backward throws once when asked to (a
// rank's experts failing inside a layer call).
#pragma once

#include <stdexcept>
#include <utility>

#include "support/reference.hpp"

namespace epx::test {

struct throwing_experts : epx::ref::test_linear_experts<float> {
  using base = epx::ref::test_linear_experts<float>;
  using base::base;
  bool fail_forward = false, fail_backward = false;
  template <class Exec, class Rows>
  void forward(const Exec& e, const Rows& in, float* out) {
    if (std::exchange(fail_forward, false)) throw std::runtime_error("injected: the experts' forward failed");
    base::forward(e, in, out);
  }
  template <class Exec, class Rows>
  void backward(const Exec& e, const Rows& in, const float* grad_out, float* grad_in) {
    if (std::exchange(fail_backward, false)) throw std::runtime_error("injected: the experts' backward failed");
    base::backward(e, in, grad_out, grad_in);
  }
};

}  // namespace epx::test
