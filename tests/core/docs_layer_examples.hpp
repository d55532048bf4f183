// tests/core/docs_layer_examples.hpp: the code shown in docs/layer.md.
//
// Every region between an opening marker comment (doc:NAME in brackets) and the next
// closing one (/doc in brackets) appears verbatim in a ```cpp block of docs/layer.md; test_docs_examples.cpp checks that (so the document and
// this file cannot drift apart), compiles the code and runs it against float64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "epx/epx.hpp"

namespace docs {

// [doc:experts]
// Each local expert l scales its rows elementwise: y = d_l * x, d_l [H].
struct diagonal_experts {
  std::vector<float> d;     // [L, H] parameters of this rank's L experts
  std::vector<float> grad;  // [L, H] their gradients, accumulated by backward

  template <class Exec>  // host memory: exec::serial or exec::openmp
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    for (int l = 0; l < in.num_local; ++l)          // global expert in.first_global_expert + l
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r)  // padding rows included
        for (std::size_t h = 0; h < in.hidden; ++h)
          out[r * in.hidden + h] = d[l * in.hidden + h] * in.rows[r * in.hidden + h];
  }

  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>& in, const float* grad_out, float* grad_in) {
    for (int l = 0; l < in.num_local; ++l)
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r)
        for (std::size_t h = 0; h < in.hidden; ++h) {
          const std::size_t i = r * in.hidden + h;
          grad[l * in.hidden + h] += in.rows[i] * grad_out[i];  // padding rows: grad_out is 0
          grad_in[i] = d[l * in.hidden + h] * grad_out[i];
        }
  }
};
// [/doc]

// What one rank ends with after moe_step.
struct step_result {
  std::vector<float> out, grad_x, grad_logits;  // [N, H], [N, H], [N, E]
  epx::layer_stats stats;
};

// [doc:step]
// One training step of an MoE block on this rank's batch. Collective over `world`.
// x [N, H] and logits [N, E] are the same on the ranks of a TP group; grad_out [N, H].
template <class Comm>
step_result moe_step(Comm& world, const epx::mesh& m, diagonal_experts& experts, const std::vector<float>& x,
                     const std::vector<float>& logits, const std::vector<float>& grad_out, int H, int k) {
  const int E = m.experts();
  const std::size_t N = x.size() / H;
  const epx::exec::serial exec;
  const epx::routing::softmax_topk policy{/*renormalize=*/true};

  // Routing: ids [N, k] (global expert ids) and weights [N, k].
  std::vector<std::int32_t> ids(N * k);
  std::vector<float> w(N * k);
  epx::routing::route(policy, exec, logits.data(), N, E, k, ids.data(), w.data());

  // The layer (in a real model: built once, reused every step).
  epx::layer_options o;
  o.hidden = H;
  o.top_k = k;
  o.pad = {/*rows_per_expert=*/1, /*align=*/4};
  epx::moe_layer<Comm, float, epx::impl::all_to_all> layer(m, world, o);

  step_result r;
  r.out.resize(N * H);
  r.grad_x.resize(N * H);
  std::vector<float> grad_w(N * k);
  epx::saved_state<float> saved = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                                                epx::span<const float>(w), epx::span<float>(r.out), experts,
                                                epx::mode::train);
  r.stats = layer.stats();
  layer.backward(std::move(saved), epx::span<const float>(grad_out), epx::span<float>(r.grad_x),
                 epx::span<float>(grad_w), experts);

  // The router's gradient: grad_w [N, k] -> grad_logits [N, E].
  r.grad_logits.resize(N * E);
  epx::routing::route_backward(policy, exec, logits.data(), N, E, k, ids.data(), w.data(), grad_w.data(),
                               r.grad_logits.data());

  // Expert gradients: mean over the dp_replicate * fsdp batches (spec section 6).
  epx::gradient_hooks<Comm> hooks(m, world);
  hooks.reduce_expert(epx::span<float>(experts.grad));
  return r;
}
// [/doc]

// [doc:implementation]
// A user implementation: the built-in all-to-all path, plus a count of the calls per rank.
template <class Comm>
class counted_all_to_all {
 public:
  static constexpr const char* name = "counted_all_to_all";  // layer.stats().path

  explicit counted_all_to_all(const epx::layer_context<Comm>& ctx) : inner_(ctx), stats_(ctx.stats) {}

  template <class T, class Exec, class Experts>
  void forward(const Exec& ex, const epx::forward_args<T>& a, Experts& experts, epx::saved_state<T>* saved) {
    ++forward_calls;
    inner_.forward(ex, a, experts, saved);  // null `saved`: inference, keep nothing
    stats_->path = name;                    // the inner path wrote its own name
  }

  template <class T, class Exec, class Experts>
  void backward(const Exec& ex, const epx::backward_args<T>& a, Experts& experts, epx::saved_state<T>& saved) {
    ++backward_calls;
    inner_.backward(ex, a, experts, saved);
  }

  int forward_calls = 0, backward_calls = 0;

 private:
  epx::impl_for_t<epx::impl::all_to_all, Comm> inner_;  // the built-in implementation for Comm
  epx::layer_stats* stats_;                              // the layer's, filled by inner_
};

// epx::moe_layer<Comm, float, counted_all_to_all<Comm>> layer(mesh, world, options);
// [/doc]

// One micro-batch of the split-phase example: its inputs and what the layer writes.
struct micro_batch {
  std::vector<float> x, w, grad_out;       // [N, H], [N, k], [N, H]
  std::vector<std::int32_t> ids;           // [N, k]
  std::vector<float> out, grad_x, grad_w;  // [N, H], [N, H], [N, k]
};

// [doc:split]
// Forward and backward of two micro-batches through the split-phase calls: both
// dispatches are under way before the first experts run, so a caller can hand micro-batch
// 0's rows to its experts (another thread, a device stream) while micro-batch 1's travel.
// Bitwise the results of layer.forward and layer.backward on each micro-batch.
template <class Layer>
void two_micro_batches(Layer& layer, diagonal_experts& experts, micro_batch& a, micro_batch& b) {
  const epx::exec::serial exec;
  micro_batch* mb[2] = {&a, &b};
  epx::forward_handle<float> h[2];
  for (int i = 0; i < 2; ++i)  // collective: the same order on every rank
    h[i] = layer.dispatch_start(epx::span<const float>(mb[i]->x), epx::span<const std::int32_t>(mb[i]->ids),
                                epx::span<const float>(mb[i]->w), epx::mode::train);
  for (int i = 0; i < 2; ++i) {
    layer.dispatch_wait(h[i]);  // micro-batch i's rows are in h[i].inputs()
    experts.forward(exec, h[i].inputs(), h[i].outputs().data());
    mb[i]->out.resize(mb[i]->x.size());
    layer.combine_start(h[i], h[i].outputs(), epx::span<float>(mb[i]->out));
  }
  epx::saved_state<float> saved[2] = {layer.combine_wait(h[0]), layer.combine_wait(h[1])};

  epx::backward_handle<float> g[2];
  for (int i = 0; i < 2; ++i) {
    mb[i]->grad_x.resize(mb[i]->x.size());
    mb[i]->grad_w.resize(mb[i]->w.size());
    g[i] = layer.backward_dispatch_start(std::move(saved[i]), epx::span<const float>(mb[i]->grad_out),
                                         epx::span<float>(mb[i]->grad_w));
  }
  for (int i = 0; i < 2; ++i) {
    layer.backward_dispatch_wait(g[i]);
    experts.backward(exec, g[i].inputs(), g[i].grad_outputs().data(), g[i].grad_inputs().data());
    layer.backward_combine_start(g[i], g[i].grad_inputs(), epx::span<float>(mb[i]->grad_x));
  }
  for (auto& gi : g) layer.backward_combine_wait(gi);  // grad_x and grad_w are final
}
// [/doc]

}  // namespace docs
