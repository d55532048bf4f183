// bindings/torch/csrc/module.cpp: the Python module epx_torch._C.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind_layer.hpp"
#include "layer.hpp"

#ifndef EPX_TORCH_WITH_CUDA
#define EPX_TORCH_WITH_CUDA 0
#endif

namespace py = pybind11;

namespace epx_torch {
void bind_reference(py::module_& m);
#if EPX_TORCH_WITH_CUDA
void bind_cuda(py::module_& m);  // layer_cuda.cu: _CudaLayer
#endif
}

namespace {

epx::group_kind kind_of(const std::string& s) {
  for (auto g : epx::all_group_kinds)
    if (s == epx::to_string(g)) return g;
  throw epx::error(epx::errc::input, epx::detail::concat("unknown group kind '", s,
                                                         "' (tp, fsdp, ep, efsdp, dp_replicate, pp)"),
                   EPX_HERE);
}

// Typed collectives of a torch_communicator on 1-D CPU tensors, for the tests.
void check_1d(const at::Tensor& t) {
  EPX_REQUIRE(t.device().type() == at::kCPU && t.is_contiguous(), epx::errc::input,
              "the communicator's test calls take contiguous CPU tensors");
}
epx::datatype datatype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kInt: return epx::datatype::int32;
    case at::kLong: return epx::datatype::int64;
    case at::kFloat: return epx::datatype::float32;
    case at::kDouble: return epx::datatype::float64;
    case at::kBFloat16: return epx::datatype::bfloat16;
    case at::kHalf: return epx::datatype::float16;
    case at::kByte: return epx::datatype::byte;
    default: break;
  }
  throw epx::error(epx::errc::input, "no epx datatype for this tensor", EPX_HERE);
}

// Typed collectives of a communicator over a torch group on 1-D CPU tensors, for the tests.
template <class C, class Make>
void bind_communicator(py::module_& m, const char* name, Make make) {
  py::class_<C>(m, name)
      .def(py::init(make))
      .def("rank", &C::rank)
      .def("size", &C::size)
      .def_property_readonly("name", &C::name)
      .def("split", &C::split, py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](C& c, at::Tensor t, double scale) {
            check_1d(t);
            c.all_reduce(t.data_ptr(), t.data_ptr(), static_cast<std::size_t>(t.numel()), datatype_of(t), scale);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](C& c, const at::Tensor& send, at::Tensor recv, double scale) {
            check_1d(send);
            check_1d(recv);
            EPX_REQUIRE(send.numel() == recv.numel() * c.size(), epx::errc::input, "reduce_scatter: sizes");
            c.reduce_scatter(send.data_ptr(), recv.data_ptr(), static_cast<std::size_t>(recv.numel()),
                             datatype_of(send), scale);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather",
          [](C& c, const at::Tensor& send, at::Tensor recv) {
            check_1d(send);
            check_1d(recv);
            EPX_REQUIRE(recv.numel() == send.numel() * c.size(), epx::errc::input, "all_gather: sizes");
            c.all_gather(send.data_ptr(), recv.data_ptr(), static_cast<std::size_t>(send.numel()), datatype_of(send));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_to_allv",
          [](C& c, const at::Tensor& send, const std::vector<std::size_t>& sc,
             const std::vector<std::size_t>& sd, at::Tensor recv, const std::vector<std::size_t>& rc,
             const std::vector<std::size_t>& rd) {
            check_1d(send);
            check_1d(recv);
            c.all_to_allv(send.data_ptr(), sc.data(), sd.data(), recv.data_ptr(), rc.data(), rd.data(),
                          datatype_of(send));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "broadcast",
          [](C& c, at::Tensor t, int root) {
            check_1d(t);
            c.broadcast(t.data_ptr(), static_cast<std::size_t>(t.numel()), datatype_of(t), root);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("barrier", &C::barrier, py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace epx_torch;
  static py::exception<epx::error> error_type(m, "EpxError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const epx::error& e) {
      PyErr_SetString(error_type.ptr(), e.what());
    }
  });

  m.def("set_split_callback", [](py::function f) {
    // Kept for the life of the process (never destroyed after the interpreter).
    auto* keep = new py::function(std::move(f));
    split_hook() = [keep](const std::vector<std::vector<int>>& groups, int mine) {
      return (*keep)(groups, mine).cast<std::string>();
    };
  });

  py::class_<epx::mesh>(m, "Mesh")
      .def(py::init([](int tp, int fsdp, int ep, int pp, int dp_replicate, int experts) {
             epx::mesh_config c;
             c.tp = tp;
             c.fsdp = fsdp;
             c.ep = ep;
             c.pp = pp;
             c.dp_replicate = dp_replicate;
             c.experts = experts;
             return epx::mesh(c);
           }),
           py::kw_only(), py::arg("tp") = 1, py::arg("fsdp") = 1, py::arg("ep") = 1, py::arg("pp") = 1,
           py::arg("dp_replicate") = 1, py::arg("experts") = 1)
      .def_property_readonly("tp", &epx::mesh::tp)
      .def_property_readonly("fsdp", &epx::mesh::fsdp)
      .def_property_readonly("ep", &epx::mesh::ep)
      .def_property_readonly("pp", &epx::mesh::pp)
      .def_property_readonly("dp_replicate", &epx::mesh::dp_replicate)
      .def_property_readonly("experts", &epx::mesh::experts)
      .def_property_readonly("world", &epx::mesh::world)
      .def_property_readonly("efsdp", &epx::mesh::efsdp)
      .def_property_readonly("local_experts", &epx::mesh::local_experts)
      .def_property_readonly("batches", &epx::mesh::batches)
      .def("batch", &epx::mesh::batch)
      .def("ep_rank", &epx::mesh::ep_rank)
      .def("tp_rank", [](const epx::mesh& s, int r) { return s.coords(r).tp; })
      .def("expert_begin", &epx::mesh::expert_begin)
      .def("group_members", [](const epx::mesh& s, const std::string& g, int r) { return s.group_members(kind_of(g), r); })
      .def("group_rank", [](const epx::mesh& s, const std::string& g, int r) { return s.group_rank(kind_of(g), r); })
      .def("describe", [](const epx::mesh& s) { return epx::describe(s); })
      .def("__repr__", [](const epx::mesh& s) {
        return epx::detail::concat("Mesh(tp=", s.tp(), ", fsdp=", s.fsdp(), ", ep=", s.ep(), ", pp=", s.pp(),
                                   ", dp_replicate=", s.dp_replicate(), ", experts=", s.experts(), ")");
      });

  py::class_<dispatch_state, std::shared_ptr<dispatch_state>>(m, "_Handle")
      .def_readonly("rows", &dispatch_state::rows)
      .def_readonly("hidden", &dispatch_state::hidden)
      .def_readonly("top_k", &dispatch_state::top_k)
      .def_readonly("expert_rows", &dispatch_state::expert_rows)
      .def_readonly("masked", &dispatch_state::masked)
      .def_readonly("training", &dispatch_state::training)
      .def_readonly("combined", &dispatch_state::combined)
      // Whether the state holds the experts' output for combine's backward (a combine with
      // gradients on a training dispatch's handle, until that backward).
      .def_property_readonly("keeps_output", [](const dispatch_state& s) { return s.y.defined(); })
      .def_property_readonly("slice", [](const dispatch_state& s) { return py::make_tuple(s.slice.begin, s.slice.end); })
      .def_property_readonly("offsets", [](const dispatch_state& s) { return s.offsets; });

  m.attr("with_cuda") = static_cast<bool>(EPX_TORCH_WITH_CUDA);
  bind_layer<torch_layer>(m, "_Layer");
  bind_layer<emulated_torch_layer>(m, "_EmulatedLayer");
  // Tests only: the emulated device's checks (epx/exec/emulated.hpp). Strict memory maps the
  // emulated buffers allocated from then on so that any host access outside a launch scope
  // faults; unbounded waits counts this thread's host waits for a queued collective that no
  // communicator timeout bounds.
  m.def("_emulated_strict_memory", &epx::exec::emulated_strict_memory);
  m.def("_emulated_unbounded_waits", &epx::exec::emulated_unbounded_waits);
  // The bytes from which epx's host copies, and the shared-memory exchange's, stream (returns
  // the previous value; 0: every copy streams).
  m.def("_set_stream_threshold", &epx::exec::set_stream_threshold);
  // The host synchronisations epx has made on device policies on this thread.
  m.def("_host_syncs", [] { return epx::detail::host_syncs_on_this_thread(); });
#if EPX_TORCH_WITH_CUDA
  bind_cuda(m);
#endif

  bind_communicator<torch_communicator>(m, "_Communicator", [](const std::string& g, int r, int w) {
    return new torch_communicator(g, r, w);
  });
  using emulated_communicator = torch_device_communicator<epx::exec::emulated_device>;
  bind_communicator<emulated_communicator>(m, "_EmulatedCommunicator", [](const std::string& g, int r, int w) {
    return new emulated_communicator(g, r, w, std::chrono::milliseconds(300000));
  });

  bind_reference(m);
}
