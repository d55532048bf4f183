// bindings/torch/csrc/bind_layer.hpp: the Python class of one torch layer type (layer.hpp),
// shared by the host module (module.cpp: _Layer, _EmulatedLayer) and the CUDA one
// (layer_cuda.cu: _CudaLayer).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>

#include "layer.hpp"

namespace epx_torch {

template <class Layer>
void bind_layer(pybind11::module_& m, const char* name) {
  namespace py = pybind11;
  py::class_<Layer>(m, name)
      .def(py::init([](const epx::mesh& mesh, const std::string& world_group, int world_rank, int world_size,
                       std::size_t hidden, int top_k, int pad_rows, int pad_align, int dtype, int path, int transport,
                       double timeout_s) {
             return new Layer(mesh.config(), world_group, world_rank, world_size, hidden, top_k, pad_rows, pad_align,
                              dtype, path, transport, timeout_s);
           }),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shared_memory", &Layer::shared_memory)
      .def_property_readonly("mesh", [](const Layer& l) { return l.topology(); })
      .def_property_readonly("device", [](const Layer& l) { return l.device().str(); })
      // None for a tensor comes as an undefined one, with `not_tensors` saying why (the
      // Python wrappers'): it joins the group's check instead of failing on this rank alone.
      .def(
          "dispatch",
          [](Layer& l, const std::optional<at::Tensor>& x, const std::optional<at::Tensor>& ids,
             const std::optional<at::Tensor>& weights, bool training, bool masked, const std::string& not_tensors) {
            return l.dispatch(x.value_or(at::Tensor()), ids.value_or(at::Tensor()), weights.value_or(at::Tensor()),
                              training, masked, not_tensors);
          },
          py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("training"), py::arg("masked"),
          py::arg("not_tensors") = std::string(), py::call_guard<py::gil_scoped_release>())
      .def(
          "combine",
          [](Layer& l, const std::shared_ptr<dispatch_state>& s, const std::optional<at::Tensor>& expert_out,
             const at::Tensor& weights, bool keep, const std::string& not_tensors) {
            return l.combine(s, expert_out.value_or(at::Tensor()), weights, keep, not_tensors);
          },
          py::arg("state"), py::arg("expert_out"), py::arg("weights"), py::arg("keep"),
          py::arg("not_tensors") = std::string(), py::call_guard<py::gil_scoped_release>())
      .def("combine_backward", &Layer::combine_backward, py::call_guard<py::gil_scoped_release>())
      .def("dispatch_backward", &Layer::dispatch_backward, py::call_guard<py::gil_scoped_release>())
      // None (Python's wrappers: for anything not a tensor) comes as an undefined tensor,
      // which the hooks' agreement refuses on every rank of the groups.
      .def(
          "reduce_expert_gradients",
          [](Layer& l, const std::optional<at::Tensor>& grad) {
            at::Tensor g = grad.value_or(at::Tensor());
            l.reduce_expert_gradients(g);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_dense_gradients",
          [](Layer& l, const std::optional<at::Tensor>& grad) {
            at::Tensor g = grad.value_or(at::Tensor());
            l.reduce_dense_gradients(g);
          },
          py::call_guard<py::gil_scoped_release>());
}

}  // namespace epx_torch
