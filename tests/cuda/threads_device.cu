// Several ranks on one GPU: the threads communicator over device memory
// (<epx/comm/threads/cuda.cuh>), each rank a thread with its own stream and exec::cuda
// policy, an ep = 8 (and a tp = 2, ep = 4) layer forward and backward against the same
// layer on exec::emulated_device over host memory: bitwise the same outputs and gradients
// (the same kernels, the same launch shape, sums in the same order). Needs a GPU (label cuda).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/comm/threads.hpp"
#include "epx/comm/threads/cuda.cuh"
#include "epx/epx.hpp"
#include "epx/exec/cuda.cuh"

using namespace epx::test::cuda;

namespace {

template <class T>
struct scale_rows {
  const T* in;
  T* out;
  float s;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = epx::convert<T>(s * epx::convert<float>(in[i])); }
};

// out = (1 + e/4) * in for global expert e; backward the same on the gradients.
template <class T>
struct scaling_experts {
  template <class Exec>
  void run(const Exec& ex, const epx::expert_rows<const T>& in, const T* from, T* to) {
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden, n = in.count(l) * in.hidden;
      epx::exec::for_each_n(ex, n, scale_rows<T>{from + b, to + b, 1.0f + 0.25f * static_cast<float>(in.first_global_expert + l)});
    }
  }
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const T>& in, T* out) { run(ex, in, in.rows, out); }
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const T>& in, const T* g, T* gi) { run(ex, in, g, gi); }
};

template <class T>
struct batch {
  std::vector<T> x, g;
  std::vector<std::int32_t> ids;
  std::vector<float> w;
};

template <class T>
batch<T> make_batch(int b, std::size_t N, std::size_t H, int E, int k) {
  std::mt19937 rng(1000u + static_cast<unsigned>(b));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  batch<T> d;
  d.x.resize(N * H);
  d.g.resize(N * H);
  for (auto& v : d.x) v = epx::convert<T>(u(rng));
  for (auto& v : d.g) v = epx::convert<T>(u(rng));
  d.ids.resize(N * static_cast<std::size_t>(k));
  d.w.resize(d.ids.size());
  std::vector<int> perm(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) perm[static_cast<std::size_t>(e)] = e;
  for (std::size_t t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      std::swap(perm[static_cast<std::size_t>(j)], perm[static_cast<std::size_t>(j) + rng() % static_cast<std::size_t>(E - j)]);
      d.ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)] = perm[static_cast<std::size_t>(j)];
      d.w[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)] = 0.1f + 0.9f * std::fabs(u(rng));
    }
  return d;
}

template <class T>
struct result {
  std::vector<T> out, gx;
  std::vector<float> gw;
};

template <class T>
void ep_on_one_gpu(const epx::mesh_config& mc, std::size_t N, std::size_t H, int k) {
  const int world = mc.tp * mc.fsdp;
  std::vector<result<T>> host(static_cast<std::size_t>(world)), dev(host.size());
  epx::layer_options opt;
  opt.hidden = H;
  opt.top_k = k;
  // The same layer on the emulated device over host memory.
  epx::threads::run(world, [&](epx::threads::communicator& comm) {
    const epx::mesh m(mc);
    const auto d = make_batch<T>(m.batch(comm.rank()), N, H, mc.experts, k);
    epx::exec::emulated_device ex;
    epx::moe_layer<epx::threads::communicator, T, epx::impl::all_to_all, epx::exec::emulated_device> layer(m, comm, opt, ex);
    scaling_experts<T> experts;
    auto& r = host[static_cast<std::size_t>(comm.rank())];
    r.out.resize(N * H);
    r.gx.resize(N * H);
    r.gw.resize(d.w.size());
    auto s = layer.forward(epx::span<const T>(d.x), epx::span<const std::int32_t>(d.ids), epx::span<const float>(d.w),
                           epx::span<T>(r.out), experts, epx::mode::train);
    layer.backward(std::move(s), epx::span<const T>(d.g), epx::span<T>(r.gx), epx::span<float>(r.gw), experts);
  });
  // Every rank on the one GPU, with its own stream.
  epx::threads::options o;
  o.memory = epx::threads::device_memory();
  epx::threads::run(
      world,
      [&](epx::threads::communicator& comm) {
        EPX_CUDA_CHECK(cudaSetDevice(0));
        const epx::mesh m(mc);
        const auto d = make_batch<T>(m.batch(comm.rank()), N, H, mc.experts, k);
        test_stream ts;
        const epx::exec::cuda ex = ts.policy();
        epx::moe_layer<epx::threads::communicator, T, epx::impl::all_to_all, epx::exec::cuda> layer(m, comm, opt, ex);
        scaling_experts<T> experts;
        auto x = to_device(ex, d.x);
        auto g = to_device(ex, d.g);
        auto ids = to_device(ex, d.ids);
        auto w = to_device(ex, d.w);
        device_buffer<T> out(N * H, ex), gx(N * H, ex);
        device_buffer<float> gw(d.w.size(), ex);
        auto s = layer.forward(epx::span<const T>(x.data(), N * H), epx::span<const std::int32_t>(ids.data(), d.ids.size()),
                               epx::span<const float>(w.data(), d.w.size()), epx::span<T>(out.data(), N * H), experts,
                               epx::mode::train);
        layer.backward(std::move(s), epx::span<const T>(g.data(), N * H), epx::span<T>(gx.data(), N * H),
                       epx::span<float>(gw.data(), d.w.size()), experts);
        auto& r = dev[static_cast<std::size_t>(comm.rank())];
        r.out = to_host(ex, out.data(), N * H);
        r.gx = to_host(ex, gx.data(), N * H);
        r.gw = to_host(ex, gw.data(), d.w.size());
      },
      o);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    CHECK(same_bits(dev[i].out, host[i].out));
    CHECK(same_bits(dev[i].gx, host[i].gx));
    CHECK(same_bits(dev[i].gw, host[i].gw));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("threads ranks on one GPU: the layer matches the emulated device bitwise", T, float, epx::bf16) {
  SUBCASE("ep 8, tp 1, 64 experts, top-8, H 7168") { ep_on_one_gpu<T>({1, 8, 1, 1, 8, 64, 0}, 256, 7168, 8); }
  SUBCASE("ep 4, tp 2, 16 experts, top-2, H 4096") { ep_on_one_gpu<T>({2, 4, 1, 1, 4, 16, 0}, 96, 4096, 2); }
}

// fp16 at the smaller of the two shapes only, to keep the run short.
TEST_CASE("threads ranks on one GPU: the fp16 layer matches the emulated device bitwise") {
  SUBCASE("ep 4, tp 2, 16 experts, top-2, H 4096") { ep_on_one_gpu<epx::fp16>({2, 4, 1, 1, 4, 16, 0}, 96, 4096, 2); }
}

TEST_CASE("threads ranks on one GPU: a bad expert id raises on every rank") {
  epx::threads::options o;
  o.memory = epx::threads::device_memory();
  const epx::mesh_config mc{1, 4, 1, 1, 4, 8, 0};
  std::vector<std::string> msgs(4);
  epx::threads::run(
      4,
      [&](epx::threads::communicator& comm) {
        EPX_CUDA_CHECK(cudaSetDevice(0));
        const epx::mesh m(mc);
        epx::layer_options opt;
        opt.hidden = 128;
        opt.top_k = 2;
        auto d = make_batch<float>(comm.rank(), 16, 128, 8, 2);
        if (comm.rank() == 2) d.ids[7] = 11;
        test_stream ts;
        const epx::exec::cuda ex = ts.policy();
        epx::moe_layer<epx::threads::communicator, float, epx::impl::all_to_all, epx::exec::cuda> layer(m, comm, opt, ex);
        scaling_experts<float> experts;
        auto x = to_device(ex, d.x);
        auto ids = to_device(ex, d.ids);
        auto w = to_device(ex, d.w);
        device_buffer<float> out(d.x.size(), ex);
        try {
          layer.forward(epx::span<const float>(x.data(), d.x.size()), epx::span<const std::int32_t>(ids.data(), d.ids.size()),
                        epx::span<const float>(w.data(), d.w.size()), epx::span<float>(out.data(), d.x.size()), experts,
                        epx::mode::inference);
        } catch (const epx::error& e) {
          if (e.category() == epx::errc::input) msgs[static_cast<std::size_t>(comm.rank())] = e.message();
        }
      },
      o);
  for (const auto& m : msgs) CHECK_MESSAGE(m.find("11") != std::string::npos, m);
}
