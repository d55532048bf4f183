// An implementation that cannot be built from a layer context: the static_assert says so.
// Without EPX_COMPILE_FAIL it has the constructor and the code compiles.
#include "epx/epx.hpp"

template <class Comm>
struct my_impl {
#ifndef EPX_COMPILE_FAIL
  explicit my_impl(const epx::layer_context<Comm>&) {}
#endif
  template <class T, class Exec, class Experts>
  void forward(const Exec&, const epx::forward_args<T>&, Experts&, epx::saved_state<T>*) {}
  template <class T, class Exec, class Experts>
  void backward(const Exec&, const epx::backward_args<T>&, Experts&, epx::saved_state<T>&) {}
};

int main() {
  using layer = epx::moe_layer<epx::threads::communicator, float, my_impl<epx::threads::communicator>>;
  return sizeof(layer) > 0 ? 0 : 1;
}
