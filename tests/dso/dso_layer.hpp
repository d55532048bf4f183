// One layer used from two shared libraries built with hidden visibility (the default of
// many projects' builds): library A runs forward, library B backward of the same layer,
// and each makes layers of its own. The states and ids must mean the same in both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"

#define EPX_DSO_API __attribute__((visibility("default")))

namespace dso {

using comm_t = epx::threads::communicator;
using layer_t = epx::moe_layer<comm_t, float>;

// out = 2 * in; grad_in = 2 * grad_out.
struct doubling_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) out[i] = 2.0f * in.rows[i];
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>& in, const float* grad_out, float* grad_in) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) grad_in[i] = 2.0f * grad_out[i];
  }
};

// The mesh and options of every layer here: 2 ranks, ep = 2, 4 experts, H = 8, top-2.
inline epx::mesh dso_mesh() { return epx::mesh(epx::mesh_config{1, 2, 1, 1, 2, 4, 0}); }
inline epx::layer_options dso_options() {
  epx::layer_options o;
  o.hidden = 8;
  o.top_k = 2;
  return o;
}

}  // namespace dso

// Library A.
EPX_DSO_API std::uint64_t dso_a_next_layer_id();  // epx::detail::next_layer_id() as library A has it
EPX_DSO_API std::unique_ptr<dso::layer_t> dso_a_make(dso::comm_t& world);
EPX_DSO_API epx::saved_state<float> dso_a_forward(dso::layer_t& layer, const float* x, const std::int32_t* ids,
                                                  const float* w, float* out, std::size_t n);
// Library B.
EPX_DSO_API std::uint64_t dso_b_next_layer_id();
EPX_DSO_API std::unique_ptr<dso::layer_t> dso_b_make(dso::comm_t& world);
EPX_DSO_API void dso_b_backward(dso::layer_t& layer, epx::saved_state<float>&& saved, const float* grad_out,
                                float* grad_x, float* grad_w, std::size_t n);
