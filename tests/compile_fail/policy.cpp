// A layer over a type that is not an execution policy: the static_assert names what is
// missing. Without EPX_COMPILE_FAIL the same code with exec::serial compiles.
#include "epx/epx.hpp"

namespace user {
struct not_a_policy {};
}  // namespace user

#ifdef EPX_COMPILE_FAIL
using policy = user::not_a_policy;
#else
using policy = epx::exec::serial;
#endif

int main() {
  using layer = epx::moe_layer<epx::threads::communicator, float, epx::impl::all_to_all, policy>;
  return sizeof(layer) > 0 ? 0 : 1;
}
