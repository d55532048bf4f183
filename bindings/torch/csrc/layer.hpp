// bindings/torch/csrc/layer.hpp: dispatch and combine of epx as four calls on torch tensors.
//
// The fused epx::moe_layer runs the user's experts between its two all-to-alls. Here the
// experts are torch code, so the layer is cut at the experts: dispatch (plan, count
// exchange, rows to their experts' owners), combine (rows back, weighted sum), and their
// two backward halves. The order of operations and every kernel are those of the staged
// route of epx/impl/all_to_all.hpp and of epx/impl/all_reduce.hpp, so the results are
// bitwise those of epx::moe_layer with the same experts (test_ops.py checks it against the
// fused layer over the same communicator).
//
// One template, three layers (basic_torch_layer<Exec, Comm>):
//   torch_layer           CPU tensors, exec::openmp, torch_communicator (gloo; shared memory)
//   emulated_torch_layer  CPU tensors, exec::emulated_device over torch_device_communicator:
//                         the device path on the CPU, for the tests (layer.cpp)
//   cuda_torch_layer      CUDA tensors on torch's current stream, exec::cuda over
//                         torch_device_communicator (NCCL) (layer_cuda.cu)
// The device layers read nothing of the policy's memory on the host except the count
// exchange's records (one read-back per dispatch, through the communicator's bounded wait).
// Policy and communicator always match (a host policy with the host communicator, a device
// policy with the device communicator on its queue), so the layer's kernels and the
// collectives are ordered by that queue alone (no epx::detail::order_before_collective).
//
// Inputs are checked on each rank and the verdict travels in epx's record exchange
// (epx::detail::exchange_records), so bad input on one rank raises on every rank of the EP
// group before any row moves.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/epx.hpp"
#include "device_communicator.hpp"
#include "torch_communicator.hpp"

namespace epx_torch {

enum class path_kind : int { all_to_all = 0, all_reduce = 1, automatic = 2 };
enum class dtype_code : int { float32 = 0, float64 = 1, bfloat16 = 2, float16 = 3 };

inline at::ScalarType scalar_type_of(dtype_code d) {
  switch (d) {
    case dtype_code::float32: return at::kFloat;
    case dtype_code::float64: return at::kDouble;
    case dtype_code::bfloat16: return at::kBFloat16;
    case dtype_code::float16: return at::kHalf;
  }
  return at::kFloat;
}

// f(T{}) with T the element type of code d.
template <class F>
decltype(auto) with_type(dtype_code d, F&& f) {
  switch (d) {
    case dtype_code::float64: return f(double{});
    case dtype_code::bfloat16: return f(epx::bf16{});
    case dtype_code::float16: return f(epx::fp16{});
    case dtype_code::float32: break;
  }
  return f(float{});
}

template <class T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Tensors a layer hands out, kept between calls: a slot's buffer is handed out again once
// nobody holds the tensor made from it (the caller, autograd or a handle), so steady-state
// calls neither page-fault fresh memory nor have the kernel zero it. Contents are not
// initialised.
class tensor_pool {
 public:
  explicit tensor_pool(at::Device d = at::Device(at::kCPU)) : device_(d) {}
  enum : int { send = 0, back, grad_send, grad_back, rows, out, grad_rows, grad_w, grad_x, weights, count };

  at::Tensor get(int slot, std::int64_t rows, std::int64_t cols, at::ScalarType t) {
    at::Tensor& c = slots_[static_cast<std::size_t>(slot)];
    const auto bytes = static_cast<std::int64_t>(rows * cols * static_cast<std::int64_t>(c10::elementSize(t)));
    if (!c.defined() || c.use_count() != 1 || c.numel() < bytes)
      c = at::empty({std::max<std::int64_t>(bytes, 1)}, at::TensorOptions().dtype(at::kByte).device(device_));
    at::Tensor keep = c;  // in use while the tensor below (or a view of it) lives
    return at::from_blob(c.data_ptr(), {rows, cols}, [keep](void*) {}, at::TensorOptions().dtype(t).device(device_));
  }

 private:
  at::Device device_;
  at::Tensor slots_[count];
};

// What one dispatch keeps for combine and the two backward halves.
struct dispatch_state {
  bool masked = false;      // the all_reduce path (ep == tp)
  bool training = false;    // keep what backward needs
  bool combined = false;    // combine ran (once per dispatch)
  bool backed = false;      // combine's backward ran (once per combine: it frees `y`)
  std::size_t rows = 0, hidden = 0, expert_rows = 0;
  int top_k = 0;
  epx::row_slice slice;                              // all-to-all: this TP rank's rows
  epx::detail::receive_layout layout;
  epx::detail::segments seg;                         // all-to-all: this rank's segments
  std::vector<std::size_t> offsets;                  // [L+1] expert-major offsets, padding included
  // int64 tensors on the layer's device, over the plan's buffers in the policy's memory:
  at::Tensor pos;                                    // [n*k] all-to-all: send position; masked: local row or -1
  at::Tensor src_row;                                // all-to-all: [S] slice row of each send position
  at::Tensor row_source;                             // masked: [R] token of each local row, -1 for padding
  at::Tensor weights_at;                             // all-to-all: [S] weight of each send position; masked: [R]
  at::Tensor y;                                      // after a training combine: all-to-all [S, H] send order; masked [R, H]
};

// How a layer reaches its policy and its tensors' device.
template <class Exec>
struct layer_side {  // a device policy (device_communicator.hpp's device_side)
  static Exec current() { return device_side<Exec>::current(); }
  static at::Device device() { return device_side<Exec>::device(); }
  using guard = typename device_side<Exec>::guard;  // makes the layer's device current
};
template <>
struct layer_side<epx::exec::openmp> {
  static epx::exec::openmp current() { return epx::exec::openmp{at::get_num_threads()}; }
  static at::Device device() { return at::Device(at::kCPU); }
  struct guard {
    explicit guard(at::Device) {}
  };
};

template <class Exec, class Comm>
class basic_torch_layer {
 public:
  using exec_type = Exec;
  using comm_type = Comm;
  static constexpr bool on_host = epx::exec::is_host_policy_v<Exec>;

  // transport: 0 auto (shared memory when the EP group's ranks share a host), 1 shared
  // memory (required), 2 the process group's own all-to-all (device layers: always).
  // timeout_s bounds the shared-memory barrier and a device layer's waits (the process
  // group's collectives have the group's own timeout).
  basic_torch_layer(const epx::mesh_config& mc, const std::string& world_group, int world_rank, int world_size,
                    std::size_t hidden, int top_k, int pad_rows, int pad_align, int dtype, int path, int transport,
                    double timeout_s);

  // `not_tensors`: empty, or why an argument is not a tensor (Python's None or another
  // object; that argument comes undefined): this rank's verdict in the group's check, so that
  // every rank raises it, as for a bad tensor.
  std::tuple<at::Tensor, at::Tensor, std::shared_ptr<dispatch_state>> dispatch(const at::Tensor& x,
                                                                              const at::Tensor& ids,
                                                                              const at::Tensor& weights, bool training,
                                                                              bool masked,
                                                                              const std::string& not_tensors = {});
  // `keep`: keep what combine's backward needs (a training dispatch's state, combined with
  // gradients enabled); else combine as for inference (a training dispatch combined under
  // torch.no_grad, as the forward of a reentrant activation checkpoint does).
  at::Tensor combine(const std::shared_ptr<dispatch_state>& s, const at::Tensor& expert_out, const at::Tensor& weights,
                     bool keep, const std::string& not_tensors = {});
  std::tuple<at::Tensor, at::Tensor> combine_backward(const std::shared_ptr<dispatch_state>& s,
                                                      const at::Tensor& grad_out);
  at::Tensor dispatch_backward(const std::shared_ptr<dispatch_state>& s, const at::Tensor& grad_rows);

  void reduce_expert_gradients(at::Tensor& grad);
  void reduce_dense_gradients(at::Tensor& grad);

  const epx::mesh& topology() const noexcept { return *mesh_; }
  const epx::layer_options& options() const noexcept { return options_; }
  dtype_code dtype() const noexcept { return dtype_; }
  path_kind path() const noexcept { return path_; }
  int world_rank() const noexcept { return world_rank_; }
  Comm& ep() { return *ep_; }
  Comm& tp() { return *tp_; }
  bool shared_memory() const noexcept {
    if constexpr (std::is_same_v<Comm, torch_communicator>) return ep_->shared_memory();
    return false;
  }
  Exec exec() const { return layer_side<Exec>::current(); }
  // The device of the layer's tensors: for CUDA, the current device at construction.
  at::Device device() const { return device_; }

 private:
  template <class T>
  std::tuple<at::Tensor, at::Tensor, std::shared_ptr<dispatch_state>> dispatch_t(const at::Tensor& x,
                                                                                const at::Tensor& ids,
                                                                                const at::Tensor& weights,
                                                                                bool training, bool masked,
                                                                                const std::string& why);
  template <class T>
  at::Tensor combine_t(dispatch_state& s, const at::Tensor& y, const at::Tensor& weights, bool keep,
                       const std::string& not_tensors);
  template <class T>
  std::tuple<at::Tensor, at::Tensor> combine_backward_t(dispatch_state& s, const at::Tensor& grad_out);
  template <class T>
  at::Tensor dispatch_backward_t(dispatch_state& s, const at::Tensor& grad_rows);
  // The return exchange of the all-to-all path (the owners' expert-major rows back to this
  // rank's send positions). With shared memory and `in_place`, the rows are read where they
  // sit in their owners' buffers, before the EP group's next collective (the sums of
  // combine's inference and of dispatch's backward read each row once, with no copy into
  // send order): true, and table[p] = send position p's row. Else false, and the rows are
  // copied into send order in `back` (pool slot `slot`), which a training combine keeps for
  // backward.
  template <class T>
  bool returned_rows(const dispatch_state& s, const T* expert_rows, bool in_place, int slot, at::Tensor& back,
                     std::vector<const T*>& table);
  // Where the S rows of H a rank sends in send order are written: the shared-memory
  // exchange's buffer, else pool slot `slot` (held by `keep`).
  template <class T>
  T* send_buffer(std::size_t S, int slot, at::Tensor& keep);
  // The expert-major offsets off[0..L] as an int64 tensor on the layer's device.
  at::Tensor offsets_tensor(const std::size_t* off, int L);
  // Adopts a buffer of the policy as an int64 tensor of `n` elements on the layer's device.
  template <class B>
  at::Tensor adopt(B&& b, std::size_t n) const;

  std::string check_tensor(const char* what, const at::Tensor& t, at::ScalarType want, std::int64_t rows,
                           std::int64_t cols) const;

  std::unique_ptr<epx::mesh> mesh_;
  epx::layer_options options_;
  dtype_code dtype_ = dtype_code::float32;
  path_kind path_ = path_kind::all_to_all;
  int world_rank_ = 0;
  std::unique_ptr<Comm> world_, ep_, tp_, efsdp_, fsdp_, dp_replicate_;
  at::Device device_ = layer_side<Exec>::device();
  tensor_pool pool_{device_};
  at::Tensor pinned_;  // on a GPU: the offsets' pinned staging buffer
};

using torch_layer = basic_torch_layer<epx::exec::openmp, torch_communicator>;
using emulated_torch_layer =
    basic_torch_layer<epx::exec::emulated_device, torch_device_communicator<epx::exec::emulated_device>>;

}  // namespace epx_torch
