// forward has no default mode: a call that does not say train or inference does not
// compile. Without EPX_COMPILE_FAIL the call names its mode and compiles.
#include "epx/epx.hpp"

struct experts_t {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>&, float*) {}
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>&, const float*, float*) {}
};

void call(epx::moe_layer<epx::threads::communicator, float>& layer, experts_t& e) {
#ifdef EPX_COMPILE_FAIL
  auto s = layer.forward({}, {}, {}, {}, e);
#else
  auto s = layer.forward({}, {}, {}, {}, e, epx::mode::inference);
#endif
  (void)s;
}

int main() { return 0; }
