// Library B of the shared-library test: makes layers and runs backward.
#include "dso/dso_layer.hpp"

std::uint64_t dso_b_next_layer_id() { return epx::detail::next_layer_id(); }

std::unique_ptr<dso::layer_t> dso_b_make(dso::comm_t& world) {
  return std::make_unique<dso::layer_t>(dso::dso_mesh(), world, dso::dso_options());
}

void dso_b_backward(dso::layer_t& layer, epx::saved_state<float>&& saved, const float* grad_out, float* grad_x,
                    float* grad_w, std::size_t n) {
  dso::doubling_experts experts;
  const std::size_t H = 8, k = 2;
  layer.backward(std::move(saved), epx::span<const float>(grad_out, n * H), epx::span<float>(grad_x, n * H),
                 epx::span<float>(grad_w, n * k), experts);
}
