// Bounded mode (spec section 11) on the GPU: exec::cuda with the NCCL communicator at world
// size 1, on both paths (impl::all_to_all, and the masked impl::all_reduce, which a mesh of
// ep == tp == 1 takes). An inference forward is captured in a CUDA graph (no allocation, no
// host read, no synchronisation inside the call, or the capture fails) and replayed on new
// inputs; its outputs equal the normal mode's bitwise. A training forward and backward in
// bounded mode equal the normal mode's bitwise, and the overflow counter stays on the device
// until check(). Needs a GPU (label cuda).
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/comm/nccl.cuh"
#include "epx/exec/cuda.cuh"
#include "epx/layer/moe_layer.hpp"

using namespace epx::test::cuda;

namespace {

template <class T>
struct scale_elements {
  const T* in;
  T* out;
  float s;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = epx::convert<T>(s * epx::convert<float>(in[i])); }
};

// Row-wise experts: expert e scales its rows by 1 + e/4. They run over every row of each
// block (offsets and count on the host, the same in every call of bounded mode).
template <class T>
struct scaling_experts {
  static float scale(int e) { return 1.0f + 0.25f * static_cast<float>(e); }
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const T>& in, T* out) {
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden, n = in.count(l) * in.hidden;
      epx::exec::for_each_n(ex, n, scale_elements<T>{in.rows + b, out + b, scale(in.first_global_expert + l)});
    }
  }
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden, n = in.count(l) * in.hidden;
      epx::exec::for_each_n(ex, n, scale_elements<T>{grad_out + b, grad_in + b, scale(in.first_global_expert + l)});
    }
  }
};

struct inputs {
  std::vector<std::int32_t> ids;
  std::vector<float> w;
};

inputs make_inputs(std::size_t N, int E, int k, unsigned seed) {
  std::mt19937 rng(seed);
  inputs in;
  in.ids.resize(N * static_cast<std::size_t>(k));
  in.w.resize(in.ids.size());
  for (std::size_t t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      in.ids[t * k + j] = static_cast<std::int32_t>((static_cast<int>(rng() % E) + j) % E);
      in.w[t * k + j] = 0.1f + 0.05f * static_cast<float>(rng() % 16);
    }
  return in;
}

// The path an implementation's calls report in layer_stats::path.
template <class Impl>
std::string path_of() {
  return std::is_same_v<Impl, epx::impl::all_reduce> ? "all_reduce" : "all_to_all";
}

}  // namespace

template <class T, class Impl>
void capture_and_replay() {
  test_stream ts;
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  auto world = epx::nccl::communicator::from_unique_id(id, 1, 0, -1, ts.s);
  const epx::exec::cuda dev{world.stream()};
  const int E = 8, k = 2;
  const std::size_t N = 64, H = 256;
  epx::mesh_config mc;
  mc.experts = E;
  const epx::mesh m(mc);
  epx::layer_options normal_opt;
  normal_opt.hidden = H;
  normal_opt.top_k = k;
  epx::layer_options opt = normal_opt;
  opt.counts = epx::count_exchange::device;
  opt.bound.cap = static_cast<std::int64_t>(N);  // nothing overflows
  using layer_t = epx::moe_layer<epx::nccl::communicator, T, Impl, epx::exec::cuda>;
  layer_t normal(m, world, normal_opt, dev);
  layer_t bounded(m, world, opt, dev);
  scaling_experts<T> experts;

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> x(N * H), x2(N * H);
  for (auto& v : x) v = epx::convert<T>(u(rng));
  for (auto& v : x2) v = epx::convert<T>(u(rng));
  const inputs in = make_inputs(N, E, k, 11);
  auto d_x = to_device(dev, x);
  auto d_ids = to_device(dev, in.ids);
  auto d_w = to_device(dev, in.w);
  device_buffer<T> d_out(N * H, dev), d_ref(N * H, dev);
  const epx::span<const T> sx(d_x.data(), N * H);
  const epx::span<const std::int32_t> sids(d_ids.data(), N * k);
  const epx::span<const float> sw(d_w.data(), N * k);

  // Warm-up call outside the capture (the layer's buffers exist from construction on a
  // device policy; this checks the call itself), then the capture.
  (void)bounded.forward(sx, sids, sw, epx::span<T>(d_out.data(), N * H), experts, epx::mode::inference);
  CHECK(bounded.stats().host_syncs == 0);
  CHECK(std::string(bounded.stats().path) == path_of<Impl>());
  cudaGraph_t graph = nullptr;
  EPX_CUDA_CHECK(cudaStreamBeginCapture(world.stream(), cudaStreamCaptureModeThreadLocal));
  (void)bounded.forward(sx, sids, sw, epx::span<T>(d_out.data(), N * H), experts, epx::mode::inference);
  EPX_CUDA_CHECK(cudaStreamEndCapture(world.stream(), &graph));
  cudaGraphExec_t exec = nullptr;
  EPX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (const auto* xs : {&x, &x2}) {
    epx::exec::copy_from_host(dev, xs->data(), xs->size(), d_x.data());
    EPX_CUDA_CHECK(cudaMemsetAsync(d_out.data(), 0xff, N * H * sizeof(T), world.stream()));
    EPX_CUDA_CHECK(cudaGraphLaunch(exec, world.stream()));
    (void)normal.forward(sx, sids, sw, epx::span<T>(d_ref.data(), N * H), experts, epx::mode::inference);
    world.wait();
    CHECK(same_bits(to_host(dev, d_out.data(), N * H), to_host(dev, d_ref.data(), N * H)));
  }
  EPX_CUDA_CHECK(cudaGraphExecDestroy(exec));
  EPX_CUDA_CHECK(cudaGraphDestroy(graph));
  CHECK(bounded.check().overflow_pairs == 0);
}

template <class T, class Impl>
void training_against_normal() {
  test_stream ts;
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  auto world = epx::nccl::communicator::from_unique_id(id, 1, 0, -1, ts.s);
  const epx::exec::cuda dev{world.stream()};
  const int E = 8, k = 2;
  const std::size_t N = 40, H = 128;
  epx::mesh_config mc;
  mc.experts = E;
  const epx::mesh m(mc);
  epx::layer_options normal_opt;
  normal_opt.hidden = H;
  normal_opt.top_k = k;
  std::vector<T> x(N * H), g(N * H);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : x) v = epx::convert<T>(u(rng));
  for (auto& v : g) v = epx::convert<T>(u(rng));
  const inputs in = make_inputs(N, E, k, 5);
  auto d_x = to_device(dev, x);
  auto d_g = to_device(dev, g);
  auto d_ids = to_device(dev, in.ids);
  auto d_w = to_device(dev, in.w);
  scaling_experts<T> experts;
  for (const std::int64_t cap : {std::int64_t{40}, std::int64_t{2}}) {
    // The normal mode with the drops of the bound: local capacity C = cap.
    epx::layer_options ref_opt = normal_opt;
    ref_opt.capacity.mode = epx::capacity_mode::local;
    ref_opt.capacity.rows = cap;
    epx::layer_options opt = normal_opt;
    opt.counts = epx::count_exchange::device;
    opt.bound.cap = cap;
    std::vector<std::vector<T>> rows;
    std::vector<std::vector<float>> gws;
    for (const auto& o : {ref_opt, opt}) {
      epx::moe_layer<epx::nccl::communicator, T, Impl, epx::exec::cuda> layer(m, world, o, dev);
      device_buffer<T> d_out(N * H, dev), d_gx(N * H, dev);
      device_buffer<float> d_gw(N * k, dev);
      auto saved = layer.forward(epx::span<const T>(d_x.data(), N * H), epx::span<const std::int32_t>(d_ids.data(), N * k),
                                 epx::span<const float>(d_w.data(), N * k), epx::span<T>(d_out.data(), N * H), experts,
                                 epx::mode::train);
      layer.backward(std::move(saved), epx::span<const T>(d_g.data(), N * H), epx::span<T>(d_gx.data(), N * H),
                     epx::span<float>(d_gw.data(), N * k), experts);
      CHECK(std::string(layer.stats().path) == path_of<Impl>());
      if (o.counts == epx::count_exchange::device) {
        CHECK(layer.stats().host_syncs == 0);
        std::int64_t overflow = -1;
        epx::exec::copy_to_host(dev, layer.overflow_counter(), 1, &overflow);
        CHECK((overflow > 0) == (cap == 2));
        CHECK(layer.check().overflow_pairs == overflow);
      }
      world.wait();
      rows.push_back(to_host(dev, d_out.data(), N * H));
      rows.push_back(to_host(dev, d_gx.data(), N * H));
      gws.push_back(to_host(dev, d_gw.data(), N * k));
    }
    CHECK(same_bits(rows[0], rows[2]));
    CHECK(same_bits(rows[1], rows[3]));
    CHECK(same_bits(gws[0], gws[1]));
  }
}

TEST_CASE_TEMPLATE("bounded mode: an inference call captured in a CUDA graph and replayed", T, float, epx::bf16,
                   epx::fp16) {
  SUBCASE("all-to-all path") { capture_and_replay<T, epx::impl::all_to_all>(); }
  SUBCASE("masked path") { capture_and_replay<T, epx::impl::all_reduce>(); }
}

TEST_CASE_TEMPLATE("bounded mode on the device: training bitwise the normal mode; overflow counted on the device", T,
                   epx::bf16, epx::fp16) {
  SUBCASE("all-to-all path") { training_against_normal<T, epx::impl::all_to_all>(); }
  SUBCASE("masked path") { training_against_normal<T, epx::impl::all_reduce>(); }
}
