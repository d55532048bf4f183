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
#include <utility>
#include <vector>

#include "epx/epx.hpp"
#include "torch_communicator.hpp"

namespace epx_torch {

using policy = epx::exec::openmp;

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
  enum : int { send = 0, back, grad_send, grad_back, rows, out, grad_rows, grad_w, grad_x, weights, count };

  at::Tensor get(int slot, std::int64_t rows, std::int64_t cols, at::ScalarType t) {
    at::Tensor& c = slots_[static_cast<std::size_t>(slot)];
    const auto bytes = static_cast<std::int64_t>(rows * cols * static_cast<std::int64_t>(c10::elementSize(t)));
    if (!c.defined() || c.use_count() != 1 || c.numel() < bytes) c = at::empty({std::max<std::int64_t>(bytes, 1)}, at::kByte);
    at::Tensor keep = c;  // in use while the tensor below (or a view of it) lives
    return at::from_blob(c.data_ptr(), {rows, cols}, [keep](void*) {}, at::TensorOptions().dtype(t));
  }

 private:
  at::Tensor slots_[count];
};

// What one dispatch keeps for combine and the two backward halves.
struct dispatch_state {
  bool masked = false;      // the all_reduce path (ep == tp)
  bool training = false;    // keep what backward needs
  bool combined = false;    // combine ran (once per dispatch)
  std::size_t rows = 0, hidden = 0, expert_rows = 0;
  int top_k = 0;
  epx::row_slice slice;                              // all-to-all: this TP rank's rows
  epx::detail::receive_layout layout;
  epx::detail::segments seg;                         // all-to-all: this rank's segments
  std::vector<std::size_t> offsets;                  // [L+1] expert-major offsets, padding included
  epx::exec::buffer<std::int64_t, policy> pos;       // [n*k] all-to-all: send position; masked: local row or -1
  epx::exec::buffer<std::int64_t, policy> src_row;   // all-to-all: [S] slice row of each send position
  epx::exec::buffer<std::int64_t, policy> row_source;// masked: [R] token of each local row, -1 for padding
  at::Tensor weights_at;                             // all-to-all: [S] weight of each send position; masked: [R]
  at::Tensor y;                                      // after a training combine: all-to-all [S, H] send order; masked [R, H]
};

class torch_layer {
 public:
  // transport: 0 auto (shared memory when the EP group's ranks share a host), 1 shared
  // memory (required), 2 the process group's own all-to-all. timeout_s bounds the
  // shared-memory barrier (the process group's collectives have the group's own timeout).
  torch_layer(const epx::mesh_config& mc, const std::string& world_group, int world_rank, int world_size,
              std::size_t hidden, int top_k, int pad_rows, int pad_align, int dtype, int path, int transport,
              double timeout_s);

  std::tuple<at::Tensor, at::Tensor, std::shared_ptr<dispatch_state>> dispatch(const at::Tensor& x,
                                                                              const at::Tensor& ids,
                                                                              const at::Tensor& weights, bool training,
                                                                              bool masked);
  at::Tensor combine(const std::shared_ptr<dispatch_state>& s, const at::Tensor& expert_out, const at::Tensor& weights);
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
  torch_communicator& ep() { return *ep_; }
  torch_communicator& tp() { return *tp_; }
  bool shared_memory() const noexcept { return ep_->shared_memory(); }
  policy exec() const { return policy{at::get_num_threads()}; }

 private:
  template <class T>
  std::tuple<at::Tensor, at::Tensor, std::shared_ptr<dispatch_state>> dispatch_t(const at::Tensor& x,
                                                                                const at::Tensor& ids,
                                                                                const at::Tensor& weights,
                                                                                bool training, bool masked,
                                                                                const std::string& why);
  template <class T>
  at::Tensor combine_t(dispatch_state& s, const at::Tensor& y, const at::Tensor& weights);
  template <class T>
  std::tuple<at::Tensor, at::Tensor> combine_backward_t(dispatch_state& s, const at::Tensor& grad_out);
  template <class T>
  at::Tensor dispatch_backward_t(dispatch_state& s, const at::Tensor& grad_rows);
  // The return exchange of the all-to-all path (the owners' expert-major rows back to this
  // rank's send positions): table[p] = send position p's row. With shared memory and
  // `in_place`, where the row sits in its owner's buffer, read before the EP group's next
  // collective (the sums of combine's inference and of dispatch's backward read each row
  // once, with no copy into send order); else copied into send order in `back` (pool slot
  // `slot`), which a training combine keeps for backward.
  template <class T>
  std::vector<const T*> returned_rows(const dispatch_state& s, const T* expert_rows, bool in_place, int slot,
                                      at::Tensor& back);

  std::string check_tensor(const char* what, const at::Tensor& t, at::ScalarType want, std::int64_t rows,
                           std::int64_t cols) const;

  std::unique_ptr<epx::mesh> mesh_;
  epx::layer_options options_;
  dtype_code dtype_ = dtype_code::float32;
  path_kind path_ = path_kind::all_to_all;
  int world_rank_ = 0;
  std::unique_ptr<torch_communicator> world_, ep_, tp_, efsdp_, fsdp_, dp_replicate_;
  tensor_pool pool_;
};

}  // namespace epx_torch
