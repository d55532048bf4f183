// Library A of the shared-library test: makes layers and runs forward.
#include "dso/dso_layer.hpp"

std::uint64_t dso_a_next_layer_id() { return epx::detail::next_layer_id(); }

std::unique_ptr<dso::layer_t> dso_a_make(dso::comm_t& world) {
  return std::make_unique<dso::layer_t>(dso::dso_mesh(), world, dso::dso_options());
}

epx::saved_state<float> dso_a_forward(dso::layer_t& layer, const float* x, const std::int32_t* ids, const float* w,
                                      float* out, std::size_t n) {
  dso::doubling_experts experts;
  const std::size_t H = 8, k = 2;
  return layer.forward(epx::span<const float>(x, n * H), epx::span<const std::int32_t>(ids, n * k),
                       epx::span<const float>(w, n * k), epx::span<float>(out, n * H), experts, epx::mode::train);
}
