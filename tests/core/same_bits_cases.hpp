// tests/core/same_bits_cases.hpp: one run of the layer on one rank, kept byte for byte, and
// the comparison of two runs (tests/core/test_same_bits.cpp: policies, chunk counts and
// routes on threads; tests/core/test_same_bits_mpi.cpp: the MPI backend against threads).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/fp8_layer_cases.hpp"
#include "core/layer_cases.hpp"
#include "support/sanitizers.hpp"

namespace epx::test::bitwise_runs {

using epx::test::layer_case;
namespace ref = epx::ref;

// What one run gave on one rank.
template <class T>
struct run_bits {
  std::vector<T> out, inference_out, grad_x;
  std::vector<float> grad_w;
  std::vector<double> expert_grads;  // after the hook
  std::int64_t stage_rounds = 0;     // of the inference call
  bool peer_access = false;          // route of the training forward
  bool inference_peer_access = false;
  std::string path, inference_path;  // layer_stats::path of the training and inference calls
  std::int64_t overflow_pairs = 0;   // bounded mode: pairs its two forward calls dropped (EP group)
};

// Where a and b differ first, byte for byte ("" when they do not).
template <class V>
std::string first_difference(const std::vector<V>& a, const std::vector<V>& b, const std::string& what) {
  if (a.size() != b.size()) return epx::detail::concat(what, ": ", a.size(), " elements against ", b.size(), "\n");
  if (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0) return {};
  std::size_t i = 0, n = 0;
  for (std::size_t j = 0; j < a.size(); ++j)
    if (std::memcmp(&a[j], &b[j], sizeof(V)) != 0) {
      if (n == 0) i = j;
      ++n;
    }
  char values[96];
  std::snprintf(values, sizeof values, "%a against %a", ref::to_d(a[i]), ref::to_d(b[i]));
  return epx::detail::concat(what, ": ", n, " of ", a.size(), " elements differ; first at ", i, ": ", values, "\n");
}

template <class T>
std::string differences(const run_bits<T>& a, const run_bits<T>& b, const std::string& where, bool outputs = true) {
  std::string f;
  if (outputs) {
    f += first_difference(a.out, b.out, where + " out");
    f += first_difference(a.inference_out, b.inference_out, where + " inference out");
    f += first_difference(a.grad_x, b.grad_x, where + " grad_x");
  }
  f += first_difference(a.grad_w, b.grad_w, where + " grad_weights");
  f += first_difference(a.expert_grads, b.expert_grads, where + " expert grads");
  return f;
}

// Experts cheap at any size (no policy in them): local expert of global id e computes
// y = T(s_e x + c_h) in accum_t<T>, s_e = 1 + e / 64, c_h = (h % 17 - 8) / 64; backward
// grad_in = T(s_e grad_out), and each expert's gradient [H] adds grad_out * x in double in
// row order (so it sees the order of its rows, as the expert gradients of a real layer do).
template <class T>
struct scale_experts {
  int first = 0, L = 1;
  std::vector<double> grads;  // [L, H]

  static float scale_of(int e) { return 1.0f + static_cast<float>(e) / 64.0f; }
  static float offset_of(std::size_t h) { return (static_cast<float>(h % 17) - 8.0f) / 64.0f; }

  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const T>& in, T* out) {
    using A = epx::accum_t<T>;
    const std::size_t H = in.hidden;
    for (int l = 0; l < in.num_local; ++l) {
      const A s = static_cast<A>(scale_of(in.first_global_expert + l));
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r)
        for (std::size_t h = 0; h < H; ++h)
          out[r * H + h] = epx::convert<T>(s * epx::convert<A>(in.rows[r * H + h]) + static_cast<A>(offset_of(h)));
    }
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    using A = epx::accum_t<T>;
    const std::size_t H = in.hidden;
    grads.resize(static_cast<std::size_t>(L) * H, 0.0);
    for (int l = 0; l < in.num_local; ++l) {
      const A s = static_cast<A>(scale_of(in.first_global_expert + l));
      double* g = grads.data() + static_cast<std::size_t>(l) * H;
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r)
        for (std::size_t h = 0; h < H; ++h) {
          const std::size_t i = r * H + h;
          grad_in[i] = epx::convert<T>(s * epx::convert<A>(grad_out[i]));
          g[h] += epx::convert<double>(grad_out[i]) * epx::convert<double>(in.rows[i]);
        }
    }
  }
};

// fp8_scale_experts that also keep an expert gradient [L, H] as scale_experts do: grad_out
// * the rows backward hands them (the forward's x' in T), in double, in row order, so the
// FP8 runs compare the expert gradients after the hook too.
template <class T>
struct fp8_grad_experts : epx::test::fp8_scale_experts<T> {
  int L = 1;
  std::vector<double> grads;  // [L, H]

  fp8_grad_experts(int first_expert, int local) : epx::test::fp8_scale_experts<T>{first_expert}, L(local) {}

  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    epx::test::fp8_scale_experts<T>::backward(ex, in, grad_out, grad_in);
    const std::size_t H = in.hidden;
    grads.resize(static_cast<std::size_t>(L) * H, 0.0);
    for (int l = 0; l < in.num_local; ++l) {
      double* g = grads.data() + static_cast<std::size_t>(l) * H;
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r)
        for (std::size_t h = 0; h < H; ++h)
          g[h] += epx::convert<double>(grad_out[r * H + h]) * epx::convert<double>(in.rows[r * H + h]);
    }
  }
};

// A training forward, backward and the expert hook, then an inference forward with fresh
// experts, on this rank's batch of case c, with the options o.
template <class Comm, class T, class Exec, class Impl = epx::impl::all_to_all>
run_bits<T> run_one(Comm& world, const layer_case& c, const epx::layer_options& o, Exec policy) {
  const epx::mesh m(c.topology);
  const int rank = world.rank(), b = m.batch(rank);
  epx::test::micro_batch<T> mb(c, b);
  const std::size_t N = mb.N, H = static_cast<std::size_t>(c.hidden);
  epx::moe_layer<Comm, T, Impl, Exec> layer(m, world, o, policy);
  run_bits<T> r;
  r.inference_out.assign(N * H, epx::convert<T>(7.0f));
  epx::gradient_hooks<Comm> hooks(m, world);
  if (o.fp8_dispatch) {
    fp8_grad_experts<T> experts(m.expert_begin(rank), m.local_experts());
    epx::test::fp8_scale_experts<T> inf{m.expert_begin(rank)};
    auto saved = layer.forward(epx::span<const T>(mb.x), epx::span<const std::int32_t>(mb.d.ids),
                               epx::span<const float>(mb.w), epx::span<T>(mb.out), experts, epx::mode::train);
    r.peer_access = layer.stats().peer_access;
    r.path = layer.stats().path;
    layer.backward(std::move(saved), epx::span<const T>(mb.go), epx::span<T>(mb.gx), epx::span<float>(mb.gw), experts);
    r.expert_grads = experts.grads;
    r.expert_grads.resize(static_cast<std::size_t>(m.local_experts()) * H, 0.0);
    hooks.reduce_expert(epx::span<double>(r.expert_grads));
    layer.forward(epx::span<const T>(mb.x), epx::span<const std::int32_t>(mb.d.ids), epx::span<const float>(mb.w),
                  epx::span<T>(r.inference_out), inf, epx::mode::inference);
  } else {
    scale_experts<T> experts{m.expert_begin(rank), m.local_experts(), {}};
    scale_experts<T> inf{m.expert_begin(rank), m.local_experts(), {}};
    auto saved = layer.forward(epx::span<const T>(mb.x), epx::span<const std::int32_t>(mb.d.ids),
                               epx::span<const float>(mb.w), epx::span<T>(mb.out), experts, epx::mode::train);
    r.peer_access = layer.stats().peer_access;
    r.path = layer.stats().path;
    layer.backward(std::move(saved), epx::span<const T>(mb.go), epx::span<T>(mb.gx), epx::span<float>(mb.gw), experts);
    r.expert_grads = experts.grads;
    r.expert_grads.resize(static_cast<std::size_t>(m.local_experts()) * H, 0.0);
    hooks.reduce_expert(epx::span<double>(r.expert_grads));
    layer.forward(epx::span<const T>(mb.x), epx::span<const std::int32_t>(mb.d.ids), epx::span<const float>(mb.w),
                  epx::span<T>(r.inference_out), inf, epx::mode::inference);
  }
  r.stage_rounds = layer.stats().stage_rounds;
  r.inference_peer_access = layer.stats().peer_access;
  r.inference_path = layer.stats().path;
  if (o.counts == epx::count_exchange::device) r.overflow_pairs = layer.check().overflow_pairs;
  r.out = std::move(mb.out);
  r.grad_x = std::move(mb.gx);
  r.grad_w = std::move(mb.gw);
  return r;
}

// A case of E = 64 experts, top-8, hidden H (256 under ThreadSanitizer, a quarter of an H
// above 2048 under AddressSanitizer), about `rows` rows per batch.
inline layer_case make(int tp, int fsdp, int ep, int H, std::size_t rows,
                       epx::test::routing_kind routing = epx::test::routing_kind::random) {
  layer_case c;
  c.topology = epx::mesh_config{tp, fsdp, 1, 1, ep, 64, 0};
  c.top_k = 8;
  c.hidden = static_cast<int>(epx::test::tsan_hidden(epx::test::asan_hidden(static_cast<std::size_t>(H)), 256));
  c.routing = routing;
  c.rows = [rows](int b) { return rows + static_cast<std::size_t>(3 * b % 5); };
  c.seed = static_cast<std::uint64_t>(H + 7 * tp + 11 * ep);
  return c;
}

// Bytes of a stage that holds `rows` slice rows' k rows of T.
inline std::size_t stage_of(const layer_case& c, std::size_t rows, std::size_t elem) {
  return rows * static_cast<std::size_t>(c.top_k) * static_cast<std::size_t>(c.hidden) * elem;
}

}  // namespace epx::test::bitwise_runs
