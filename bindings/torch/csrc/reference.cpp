// bindings/torch/csrc/reference.cpp: for the tests only. The fused epx::moe_layer over the
// same torch communicators as a torch_layer, with experts that scale each local expert's
// rows by a constant (the same bits in C++ and in torch), so that the split torch ops can be
// compared with the C++ layer bit for bit. For the emulated device layer, the fused layer
// runs on the emulated device policy over the same device communicators.
#include <pybind11/pybind11.h>

#include "layer.hpp"

namespace epx_torch {

namespace {

template <class T>
struct scale_experts {
  std::vector<float> c;  // one factor per local expert

  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const T>& in, T* out) {
    apply(in, in.rows, out);
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    apply(in, grad_out, grad_in);
  }
  void apply(const epx::expert_rows<const T>& in, const T* src, T* dst) const {
    using A = epx::accum_t<T>;
    for (int l = 0; l < in.num_local; ++l) {
      const A f = static_cast<A>(c[static_cast<std::size_t>(l)]);
      for (std::size_t i = in.begin(l) * in.hidden; i < in.offsets[l + 1] * in.hidden; ++i)
        dst[i] = epx::convert<T>(f * epx::convert<A>(src[i]));
    }
  }
};

// The fused layer's policy: one thread on the host; the emulated device for its layer.
template <class Layer>
using fused_exec = std::conditional_t<Layer::on_host, epx::exec::serial, typename Layer::exec_type>;

template <class T, class Impl, class Layer>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_reference(Layer& layer, const at::Tensor& x,
                                                              const at::Tensor& ids, const at::Tensor& w,
                                                              const at::Tensor& grad_out, const std::vector<float>& c) {
  using Exec = fused_exec<Layer>;
  Exec ex{};
  if constexpr (!Layer::on_host) ex = layer.exec();
  epx::moe_layer<typename Layer::comm_type, T, Impl, Exec> fused(layer.topology(), layer.world_rank(), layer.ep(),
                                                                 layer.tp(), layer.options(), ex);
  scale_experts<T> experts{c};
  const auto N = static_cast<std::size_t>(x.size(0)), H = layer.options().hidden;
  const auto k = static_cast<std::size_t>(layer.options().top_k);
  at::Tensor out = at::empty_like(x), gx = at::empty_like(x), gw = at::empty({x.size(0), w.size(1)}, at::kFloat);
  auto saved = fused.forward(epx::span<const T>(ptr<const T>(x), N * H),
                             epx::span<const std::int32_t>(ptr<const std::int32_t>(ids), N * k),
                             epx::span<const float>(ptr<const float>(w), N * k), epx::span<T>(ptr<T>(out), N * H),
                             experts, epx::mode::train);
  fused.backward(std::move(saved), epx::span<const T>(ptr<const T>(grad_out), N * H), epx::span<T>(ptr<T>(gx), N * H),
                 epx::span<float>(ptr<float>(gw), N * k), experts);
  return {out, gx, gw};
}

template <class Layer>
void bind_reference_for(pybind11::module_& m) {
  m.def(
      "_fused_reference",
      [](Layer& layer, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w, const at::Tensor& g,
         const std::vector<float>& c, bool masked) {
        const at::Tensor xc = x.contiguous(), ic = ids.contiguous(), wc = w.contiguous(), gc = g.contiguous();
        return with_type(layer.dtype(), [&](auto t) {
          using T = decltype(t);
          return masked ? run_reference<T, epx::impl::all_reduce>(layer, xc, ic, wc, gc, c)
                        : run_reference<T, epx::impl::all_to_all>(layer, xc, ic, wc, gc, c);
        });
      },
      pybind11::call_guard<pybind11::gil_scoped_release>(),
      "Tests only: epx::moe_layer over the layer's communicators with experts y = c[l] * x.");
}

}  // namespace

void bind_reference(pybind11::module_& m) {
  bind_reference_for<torch_layer>(m);
  bind_reference_for<emulated_torch_layer>(m);
}

}  // namespace epx_torch
