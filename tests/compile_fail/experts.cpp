// Experts without a backward: the layer's backward names the missing member. Without
// EPX_COMPILE_FAIL the experts have one and the code compiles.
#include <utility>

#include "epx/epx.hpp"

struct experts_t {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>&, float*) {}
#ifndef EPX_COMPILE_FAIL
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>&, const float*, float*) {}
#endif
};

void call(epx::moe_layer<epx::threads::communicator, float>& layer, experts_t& e) {
  layer.backward(epx::saved_state<float>{}, {}, {}, {}, e);
}

int main() { return 0; }
