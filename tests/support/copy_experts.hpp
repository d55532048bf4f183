// tests/support/copy_experts.hpp: experts that hand their rows back (forward) and their
// gradient rows back (backward), float rows on a host policy: out = x, grad_x = grad_out
// through the layer, whatever the routing's weights make of them.
#pragma once

#include <cstddef>

#include "epx/impl/experts.hpp"

namespace epx::test {

struct copy_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) out[i] = in.rows[i];
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>& in, const float* grad_out, float* grad_in) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) grad_in[i] = grad_out[i];
  }
};

}  // namespace epx::test
