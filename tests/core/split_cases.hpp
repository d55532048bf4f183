// tests/core/split_cases.hpp: the split-phase calls of the layer (spec section 13), run on
// ONE rank like the bodies of layer_cases.hpp (threads, MPI, emulated device suites).
//
// check_split_matches_fused: two micro-batches through the split calls, interleaved
// (dispatch mb0, dispatch mb1, experts mb0, combine mb0, experts mb1, combine mb1, the
// waits last; backward likewise), give bitwise the outputs and gradients of the fused
// forward and backward of each micro-batch, and those match the float64 reference.
// run_split_misuse: a handle misused in one way on some ranks; returns what this rank raised.
#pragma once

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"

namespace epx::test {

// The second micro-batch of a case: other data, other row counts (the same on the ranks of
// a TP group, which share their batch index).
inline layer_case second_micro_batch(const layer_case& c) {
  layer_case d = c;
  d.seed = c.seed * 31 + 17;
  d.rows = [c](int b) { return c.rows_of(b) + static_cast<std::size_t>(b % 3); };
  return d;
}

template <class T>
struct micro_batch {
  batch_data d;
  std::vector<T> x, go;
  std::vector<float> w;
  std::size_t N = 0;
  std::vector<T> out, gx;
  std::vector<float> gw;

  micro_batch(const layer_case& c, int b)
      : d(make_batch<T>(c, b)),
        x(ref::from_double<T>(d.x)),
        go(ref::from_double<T>(d.grad_out)),
        w(d.w.begin(), d.w.end()),
        N(c.rows_of(b)) {
    const std::size_t H = static_cast<std::size_t>(c.hidden), k = static_cast<std::size_t>(c.top_k);
    out.assign(N * H, convert<T>(7.0f));  // garbage: the layer must write everything
    gx.assign(N * H, convert<T>(7.0f));
    gw.assign(N * k, 7.0f);
  }
};

template <class Comm, class T, class Impl, class Exec, class MakeExperts>
std::string check_split_with(Comm& world, const layer_case& c, mode md, Exec policy, MakeExperts make_experts) {
  std::string f;
  const std::string where = detail::concat(c.describe(), " rank ", world.rank(),
                                           md == mode::train ? " split phase (train): " : " split phase (inference): ");
  try {
    const mesh m(c.topology);
    const int rank = world.rank(), b = m.batch(rank);
    const layer_case c1 = second_micro_batch(c);
    const std::size_t H = static_cast<std::size_t>(c.hidden);
    const bool train = md == mode::train;

    // The fused calls, micro-batch 0 then 1.
    std::vector<micro_batch<T>> fused{micro_batch<T>(c, b), micro_batch<T>(c1, b)};
    std::vector<double> fused_grads;
    std::string fused_path;
    {
      moe_layer<Comm, T, Impl, Exec> layer(m, world, options_for(c), policy);
      auto experts = make_experts(m, rank);
      std::vector<saved_state<T>> saved;
      for (auto& mb : fused)
        saved.push_back(layer.forward(span<const T>(mb.x), span<const std::int32_t>(mb.d.ids),
                                      span<const float>(mb.w), span<T>(mb.out), experts, md));
      fused_path = layer.stats().path;
      if (train)
        for (std::size_t i = 0; i < fused.size(); ++i)
          layer.backward(std::move(saved[i]), span<const T>(fused[i].go), span<T>(fused[i].gx),
                         span<float>(fused[i].gw), experts);
      fused_grads = experts.grads();
    }

    // The split calls, interleaved. Micro-batch 0's experts write the handle's own buffer,
    // micro-batch 1's a buffer of their own (copied in by combine_start).
    std::vector<micro_batch<T>> split{micro_batch<T>(c, b), micro_batch<T>(c1, b)};
    moe_layer<Comm, T, Impl, Exec> layer(m, world, options_for(c), policy);
    auto experts = make_experts(m, rank);
    auto& m0 = split[0];
    auto& m1 = split[1];
    auto h0 = layer.dispatch_start(span<const T>(m0.x), span<const std::int32_t>(m0.d.ids), span<const float>(m0.w), md);
    auto h1 = layer.dispatch_start(span<const T>(m1.x), span<const std::int32_t>(m1.d.ids), span<const float>(m1.w), md);
    layer.dispatch_wait(h0);
    experts.forward(policy, h0.inputs(), h0.outputs().data());
    layer.combine_start(h0, span<const T>(h0.outputs().data(), h0.outputs().size()), span<T>(m0.out));
    layer.dispatch_wait(h1);
    const std::size_t R1 = h1.inputs().num_rows;
    auto y1 = exec::make_buffer<T>(policy, R1 * H);
    experts.forward(policy, h1.inputs(), y1.data());
    layer.combine_start(h1, span<const T>(y1.data(), R1 * H), span<T>(m1.out));
    saved_state<T> s0 = layer.combine_wait(h0);
    saved_state<T> s1 = layer.combine_wait(h1);
    if (std::string(layer.stats().path) != fused_path)
      f += where + "path " + layer.stats().path + ", the fused call's " + fused_path + "\n";
    if (s0.empty() == train || s1.empty() == train) f += where + "saved state " + (train ? "empty" : "not empty") + "\n";
    if (train) {
      auto g0 = layer.backward_dispatch_start(std::move(s0), span<const T>(m0.go), span<float>(m0.gw));
      auto g1 = layer.backward_dispatch_start(std::move(s1), span<const T>(m1.go), span<float>(m1.gw));
      layer.backward_dispatch_wait(g0);
      experts.backward(policy, g0.inputs(), g0.grad_outputs().data(), g0.grad_inputs().data());
      layer.backward_combine_start(g0, span<const T>(g0.grad_inputs().data(), g0.grad_inputs().size()),
                                   span<T>(m0.gx));
      layer.backward_dispatch_wait(g1);
      auto gi1 = exec::make_buffer<T>(policy, g1.grad_inputs().size());
      experts.backward(policy, g1.inputs(), g1.grad_outputs().data(), gi1.data());
      layer.backward_combine_start(g1, span<const T>(gi1.data(), g1.grad_inputs().size()), span<T>(m1.gx));
      layer.backward_combine_wait(g0);
      layer.backward_combine_wait(g1);
      if (!g0.empty() && !g1.empty() && (g0.tokens() != m0.N || g1.tokens() != m1.N))
        f += where + "backward handles report other token counts\n";
    }

    for (std::size_t i = 0; i < 2; ++i) {
      const std::string mb = detail::concat("micro-batch ", i, " ");
      if (!bitwise_equal(split[i].out, fused[i].out)) f += where + mb + "out differs bitwise from the fused call\n";
      if (train) {
        if (!bitwise_equal(split[i].gx, fused[i].gx)) f += where + mb + "grad_x differs bitwise from the fused call\n";
        if (!bitwise_equal(split[i].gw, fused[i].gw))
          f += where + mb + "grad_weights differ bitwise from the fused call\n";
      }
    }
    if (!bitwise_equal(experts.grads(), fused_grads)) f += where + "expert grads differ bitwise from the fused calls\n";

    // Micro-batch 0 against the float64 reference (bitwise equality carries it to the fused call).
    if constexpr (std::is_same_v<decltype(experts), ref::test_linear_experts<T>>) {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    const auto e = expect<T>(c, global, rank);
    const double at = atol_for<T>(), rt = rtol_for<T>();
    append(f, ref::compare(m0.out, e.out, at, rt, where + "out"));
    if (train) {
      append(f, ref::compare(m0.gx, e.grad_x, at, rt, where + "grad_x"));
      append(f, ref::compare(m0.gw, e.grad_w, std::max(2 * at, 1e-5), std::max(rt, 1e-5), where + "grad_weights"));
    }
    }
  } catch (const std::exception& ex) {
    f += where + "exception: " + ex.what() + "\n";
  }
  return f;
}

// Elementwise experts for large H (O(H) work and no H x H matrices): local expert l of
// global id e computes y = s_e * x with s_e = 1 + e / 8 in float, rounded to T; backward
// grad_in = s_e * grad_out and a parameter gradient per expert, the double sum of
// grad_out * x over its rows (so that the order of the backward calls shows).
template <class T>
struct scale_experts {
  int first = 0, L = 0;
  std::vector<double> grad;  // [L]

  scale_experts(int first_expert, int local) : first(first_expert), L(local), grad(static_cast<std::size_t>(local), 0.0) {}
  float scale(int l) const { return 1.0f + static_cast<float>(first + l) / 8.0f; }
  template <class Exec>
  void forward(const Exec&, const expert_rows<const T>& in, T* out) {
    for (int l = 0; l < in.num_local; ++l)
      for (std::size_t i = in.begin(l) * in.hidden; i < (in.begin(l) + in.count(l)) * in.hidden; ++i)
        out[i] = convert<T>(scale(l) * convert<float>(in.rows[i]));
  }
  template <class Exec>
  void backward(const Exec&, const expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    for (int l = 0; l < in.num_local; ++l)
      for (std::size_t i = in.begin(l) * in.hidden; i < (in.begin(l) + in.count(l)) * in.hidden; ++i) {
        grad_in[i] = convert<T>(scale(l) * convert<float>(grad_out[i]));
        grad[static_cast<std::size_t>(l)] +=
            static_cast<double>(convert<float>(grad_out[i])) * static_cast<double>(convert<float>(in.rows[i]));
      }
  }
  const std::vector<double>& grads() const { return grad; }
};

// `linear`: the reference's linear experts, and micro-batch 0 against the float64
// reference; else scale_experts (any H), bitwise against the fused calls only.
template <class Comm, class T, class Impl = impl::all_to_all, class Exec = test_exec>
std::string check_split_matches_fused(Comm& world, const layer_case& c, mode md = mode::train, Exec policy = {},
                                      bool linear = true) {
  if (linear)
    return check_split_with<Comm, T, Impl, Exec>(world, c, md, policy, [&](const mesh& m, int rank) {
      return ref::test_linear_experts<T>(ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull),
                                         m.ep_rank(rank), m.local_experts());
    });
  return check_split_with<Comm, T, Impl, Exec>(world, c, md, policy, [&](const mesh& m, int rank) {
    return scale_experts<T>(m.expert_begin(rank), m.local_experts());
  });
}

// Misuse of the split calls; `bad` says whether this rank makes it (the others call
// correctly where the call is collective).
enum class split_misuse {
  dispatch_wait_without_start,  // dispatch_wait on a default-constructed handle
  dispatch_wait_twice,
  combine_wait_without_start,   // combine_wait after dispatch_wait, no combine_start
  combine_before_dispatch_wait, // combine_start on a handle whose dispatch was not waited for
  combine_twice,                // combine_start on a combined handle (used twice)
  combine_other_layer,          // combine_start with a handle of another layer
  combine_moved_from,           // combine_start with a moved-from handle
  combine_other_layer_type,     // combine_start with a handle of a layer of another type (same T)
  combine_in_other_order,       // two calls in flight, combined in the other order
  backward_empty_state,         // backward_dispatch_start with an empty saved state
  expert_outputs_size,          // expert outputs of the wrong size
  out_size,                     // out of the wrong size
  inputs_before_wait,           // h.inputs() before dispatch_wait
  backward_wait_without_start,
  backward_combine_twice,
  backward_grad_inputs_size,
  grad_x_size,                  // grad_x one element short
  grad_x_larger,                // grad_x one element long
};

inline const char* to_string(split_misuse s) {
  switch (s) {
    case split_misuse::dispatch_wait_without_start: return "dispatch_wait_without_start";
    case split_misuse::dispatch_wait_twice: return "dispatch_wait_twice";
    case split_misuse::combine_wait_without_start: return "combine_wait_without_start";
    case split_misuse::combine_before_dispatch_wait: return "combine_before_dispatch_wait";
    case split_misuse::combine_twice: return "combine_twice";
    case split_misuse::combine_other_layer: return "combine_other_layer";
    case split_misuse::combine_moved_from: return "combine_moved_from";
    case split_misuse::combine_other_layer_type: return "combine_other_layer_type";
    case split_misuse::combine_in_other_order: return "combine_in_other_order";
    case split_misuse::backward_empty_state: return "backward_empty_state";
    case split_misuse::expert_outputs_size: return "expert_outputs_size";
    case split_misuse::out_size: return "out_size";
    case split_misuse::inputs_before_wait: return "inputs_before_wait";
    case split_misuse::backward_wait_without_start: return "backward_wait_without_start";
    case split_misuse::backward_combine_twice: return "backward_combine_twice";
    case split_misuse::backward_grad_inputs_size: return "backward_grad_inputs_size";
    case split_misuse::grad_x_larger: return "grad_x_larger";
    case split_misuse::grad_x_size: return "grad_x_size";
  }
  return "?";
}

// Runs forward and backward through the split calls with misuse `kind` on this rank when
// `bad`; returns what this rank raised.
template <class Comm, class T, class Impl = impl::all_to_all, class Exec = test_exec>
raised run_split_misuse(Comm& world, const layer_case& c, split_misuse kind, bool bad, Exec policy = {}) {
  const mesh m(c.topology);
  const int rank = world.rank(), b = m.batch(rank);
  const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  micro_batch<T> mb(c, b);
  const std::size_t H = static_cast<std::size_t>(c.hidden);
  moe_layer<Comm, T, Impl, Exec> layer(m, world, options_for(c), policy);
  moe_layer<Comm, T, Impl, Exec> other(m, world, options_for(c), policy);
  // Another layer type with the same T, whose first layer's id would have been `layer`'s
  // had each type counted its own.
  using other_impl = std::conditional_t<std::is_same_v<Impl, impl::automatic>, impl::all_to_all, impl::automatic>;
  moe_layer<Comm, T, other_impl, Exec> other_type(m, world, options_for(c), policy);
  ref::test_linear_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
  const auto dispatch = [&](auto& l) {
    return l.dispatch_start(span<const T>(mb.x), span<const std::int32_t>(mb.d.ids), span<const float>(mb.w),
                            mode::train);
  };
  return capture([&] {
    if (bad && kind == split_misuse::dispatch_wait_without_start) {
      forward_handle<T> none;
      layer.dispatch_wait(none);
    }
    auto h = dispatch(layer);
    forward_handle<T> h_other;
    if (kind == split_misuse::combine_other_layer) h_other = dispatch(other);
    if (kind == split_misuse::combine_other_layer_type) h_other = dispatch(other_type);
    if (bad && kind == split_misuse::inputs_before_wait) (void)h.inputs();
    if (bad && kind == split_misuse::combine_before_dispatch_wait) {
      layer.combine_start(h, span<const T>(), span<T>(mb.out));
    }
    layer.dispatch_wait(h);
    if (kind == split_misuse::combine_other_layer) other.dispatch_wait(h_other);
    if (kind == split_misuse::combine_other_layer_type) other_type.dispatch_wait(h_other);
    if (bad && kind == split_misuse::dispatch_wait_twice) layer.dispatch_wait(h);
    if (bad && kind == split_misuse::combine_wait_without_start) (void)layer.combine_wait(h);
    experts.forward(policy, h.inputs(), h.outputs().data());
    span<const T> y(h.outputs().data(), h.outputs().size());
    std::vector<T> wrong_y(y.size() + H);
    span<T> out(mb.out);
    std::vector<T> wrong_out(mb.out.size() + H);
    forward_handle<T> moved;
    forward_handle<T>* use = &h;
    if (bad) {
      if (kind == split_misuse::expert_outputs_size) y = span<const T>(wrong_y);
      if (kind == split_misuse::out_size) out = span<T>(wrong_out);
      if (kind == split_misuse::combine_other_layer || kind == split_misuse::combine_other_layer_type) use = &h_other;
      if (kind == split_misuse::combine_moved_from) moved = std::move(h);
    }
    if (bad && (kind == split_misuse::combine_other_layer || kind == split_misuse::combine_other_layer_type))
      y = span<const T>(h_other.outputs().data(), h_other.outputs().size());
    forward_handle<T> h2;
    if (kind == split_misuse::combine_in_other_order) {
      // A second call of the same inputs; the bad rank combines it first.
      h2 = dispatch(layer);
      layer.dispatch_wait(h2);
      experts.forward(policy, h2.inputs(), h2.outputs().data());
      if (bad) {
        use = &h2;
        y = span<const T>(h2.outputs().data(), h2.outputs().size());
      }
    }
    layer.combine_start(*use, y, out);
    saved_state<T> saved = layer.combine_wait(*use);
    if (kind == split_misuse::combine_twice) {
      // Every rank combines again: the good ones a fresh call, the bad one its spent handle.
      auto h2 = dispatch(layer);
      layer.dispatch_wait(h2);
      experts.forward(policy, h2.inputs(), h2.outputs().data());
      forward_handle<T>& again = bad ? h : h2;
      layer.combine_start(again, span<const T>(h2.outputs().data(), h2.outputs().size()), span<T>(mb.out));
    }
    if (bad && kind == split_misuse::backward_wait_without_start) {
      backward_handle<T> none;
      layer.backward_dispatch_wait(none);
    }
    if (bad && kind == split_misuse::backward_empty_state) saved.reset();
    auto g = layer.backward_dispatch_start(std::move(saved), span<const T>(mb.go), span<float>(mb.gw));
    layer.backward_dispatch_wait(g);
    experts.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
    span<const T> gi(g.grad_inputs().data(), g.grad_inputs().size());
    std::vector<T> wrong_gi(gi.size() + 1);
    span<T> gx(mb.gx);
    std::vector<T> wrong_gx(mb.gx.size() > 0 ? mb.gx.size() - 1 : 1);
    if (bad && kind == split_misuse::backward_grad_inputs_size) gi = span<const T>(wrong_gi);
    std::vector<T> longer_gx(mb.gx.size() + 1);
    if (bad && kind == split_misuse::grad_x_size) gx = span<T>(wrong_gx);
    if (bad && kind == split_misuse::grad_x_larger) gx = span<T>(longer_gx);
    layer.backward_combine_start(g, gi, gx);
    layer.backward_combine_wait(g);
    if (kind == split_misuse::backward_combine_twice) {
      // Every rank runs a second call; the bad rank combines its spent backward handle.
      auto h2 = dispatch(layer);
      layer.dispatch_wait(h2);
      experts.forward(policy, h2.inputs(), h2.outputs().data());
      layer.combine_start(h2, span<const T>(h2.outputs().data(), h2.outputs().size()), span<T>(mb.out));
      auto s2 = layer.combine_wait(h2);
      auto g2 = layer.backward_dispatch_start(std::move(s2), span<const T>(mb.go), span<float>(mb.gw));
      layer.backward_dispatch_wait(g2);
      experts.backward(policy, g2.inputs(), g2.grad_outputs().data(), g2.grad_inputs().data());
      backward_handle<T>& again = bad ? g : g2;
      layer.backward_combine_start(again, span<const T>(g2.grad_inputs().data(), g2.grad_inputs().size()),
                                   span<T>(mb.gx));
    }
  });
}

}  // namespace epx::test
