// An implementation without the split-phase stages runs the fused calls; the split calls
// (dispatch_start, ...) on it fail to compile with the sentence of their static_assert.
#include <cstdint>
#include <vector>

#include "epx/epx.hpp"

template <class Comm>
struct fused_only {
  explicit fused_only(const epx::layer_context<Comm>&) {}
  template <class T, class Exec, class Experts>
  void forward(const Exec&, const epx::forward_args<T>&, Experts&, epx::saved_state<T>*) {}
  template <class T, class Exec, class Experts>
  void backward(const Exec&, const epx::backward_args<T>&, Experts&, epx::saved_state<T>&) {}
};

using comm_t = epx::threads::communicator;
using layer_t = epx::moe_layer<comm_t, float, fused_only<comm_t>>;

void call(layer_t& layer) {
  std::vector<float> x(4), w(1);
  std::vector<std::int32_t> ids(1);
#ifdef EPX_COMPILE_FAIL
  auto h = layer.dispatch_start(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                                epx::span<const float>(w), epx::mode::inference);
  (void)h;
#else
  (void)layer;
#endif
}

int main() { return sizeof(layer_t) > 0 ? 0 : 1; }
