// bench/gpu/bench_layer_ep.cu: the MoE layer's real device path with ep ranks on one GPU:
// ep threads of epx::threads::run over device memory (<epx/comm/threads/cuda.cuh>), each
// with its own stream and exec::cuda policy, on both routes: direct (the ranks' device
// pointers read as NVLink peer access would, the threads communicator's default) and staged
// (layer_options::peer_access = false: the one NCCL takes), forward (inference) and
// forward + backward (training), identity-like experts.
//
//   epx_bench_gpu_layer_ep [--quick]
//
// Shapes (per rank; all ranks on the one GPU): 4096 tokens x 7168 hidden, bf16, top-8,
// 256 experts, ep 8, and the decode shape 128 tokens x 7168. One iteration: a barrier, the
// call on every rank, its stream synchronised, a barrier; rank 0's wall time between the
// barriers. Before timing, one call is checked against a float64 computation on sampled
// tokens (`validated`, which also requires the route asked for). Bytes: every rank's route
// (staged: gather 2S, dispatch 2R, experts 2R, return 2S, combine S + n rows; direct: pull
// 2R, experts 2R, combine S + n; backward about twice that), over all ranks, against
// the device copy bandwidth measured in the same process (`copy_fraction`). Prints one JSON
// line per measurement ("JSON {...}"), with median and p99 microseconds.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// The umbrella first: under nvcc it declares exec::cuda's functions (epx/exec/host.hpp)
// before the library code that calls them, whatever the order of includes.
#include "epx/epx.hpp"
#include "epx/comm/threads.hpp"
#include "epx/comm/threads/cuda.cuh"
#include "epx/exec/cuda.cuh"
#include "common.cuh"

namespace {

using epx::exec::device_buffer;
using clock_type = std::chrono::steady_clock;

template <class T>
struct scale_rows {
  const T* in;
  T* out;
  float s;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = epx::convert<T>(s * epx::convert<float>(in[i])); }
};

// out = (1 + e/64) * in for global expert e (a cheap expert whose output the check can
// predict); backward the same on the gradients.
float scale_of(int e) { return 1.0f + static_cast<float>(e) / 64.0f; }

template <class T>
struct scaling_experts {
  template <class Exec>
  void run(const Exec& ex, const epx::expert_rows<const T>& in, const T* from, T* to) {
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden, n = in.count(l) * in.hidden;
      if (n) epx::exec::for_each_n(ex, n, scale_rows<T>{from + b, to + b, scale_of(in.first_global_expert + l)});
    }
  }
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const T>& in, T* out) { run(ex, in, in.rows, out); }
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const T>& in, const T* g, T* gi) { run(ex, in, g, gi); }
};

struct shape {
  int ep;
  std::size_t tokens, hidden;
  int k, experts;
};

using epx::bench::gpu::median_of;
using epx::bench::gpu::p99_of;

double copy_bandwidth(int iters) {
  const std::size_t bytes = std::size_t{1} << 30;
  device_buffer<char> a(bytes), b(bytes);
  EPX_CUDA_CHECK(cudaMemset(a.data(), 1, bytes));
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int i = 0; i < iters + 2; ++i) {
    const auto t0 = clock_type::now();
    EPX_CUDA_CHECK(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    if (i >= 2) t.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  return 2.0 * static_cast<double>(bytes) / median_of(t) * 1e-9;  // read + write
}

void json(const char* bench, const shape& s, const char* dtype, bool direct, bool validated,
          const std::vector<double>& t, double bytes, double copy_gbps) {
  const double med = median_of(t), gbps = bytes / med * 1e-9;
  std::printf("JSON {\"bench\": \"%s\", \"backend\": \"threads x%d on one GPU\", \"route\": \"%s\", "
              "\"dtype\": \"%s\", \"tokens\": %zu, \"hidden\": %zu, \"k\": %d, \"experts\": %d, \"ep\": %d, "
              "\"validated\": %s, \"us\": %.1f, \"p99_us\": %.1f, \"bytes\": %.0f, \"GBps\": %.1f, "
              "\"copy_fraction\": %.3f}\n",
              bench, s.ep, direct ? "direct" : "staged", dtype, s.tokens, s.hidden, s.k, s.experts, s.ep,
              validated ? "true" : "false", med * 1e6, p99_of(t) * 1e6, bytes, gbps, gbps / copy_gbps);
  std::fflush(stdout);
}

// Runs one shape; returns false if a check failed.
template <class T>
bool bench_shape(const shape& s, bool direct, int iters, double copy_gbps, const char* dtype) {
  epx::mesh_config mc{1, s.ep, 1, 1, s.ep, s.experts, 0};
  const std::size_t N = s.tokens, H = s.hidden, k = static_cast<std::size_t>(s.k);
  std::vector<double> t_fwd, t_train;
  std::vector<double> bytes_fwd(static_cast<std::size_t>(s.ep)), bytes_train(bytes_fwd.size());
  std::vector<char> ok(bytes_fwd.size(), 0);
  epx::threads::options o;
  o.memory = epx::threads::device_memory();
  o.timeout = std::chrono::minutes(5);
  epx::threads::run(
      s.ep,
      [&](epx::threads::communicator& comm) {
        EPX_CUDA_CHECK(cudaSetDevice(0));
        const int me = comm.rank();
        const epx::mesh m(mc);
        const epx::bench::gpu::owned_stream stream;  // outlives the layer and the buffers below
        const cudaStream_t st = stream.get();
        const epx::exec::cuda ex{st};
        epx::layer_options lo;
        lo.hidden = H;
        lo.top_k = s.k;
        lo.pad.rows_per_expert = 0;
        lo.peer_access = direct;
        epx::moe_layer<epx::threads::communicator, T, epx::impl::all_to_all, epx::exec::cuda> layer(m, comm, lo, ex);
        // Inputs: uniform routing, k distinct experts per token.
        std::mt19937 rng(100u + static_cast<unsigned>(me));
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<T> hx(N * H);
        for (auto& v : hx) v = epx::convert<T>(u(rng));
        std::vector<std::int32_t> hid(N * k);
        std::vector<float> hw(N * k);
        std::vector<int> perm(static_cast<std::size_t>(s.experts));
        for (int e = 0; e < s.experts; ++e) perm[static_cast<std::size_t>(e)] = e;
        for (std::size_t t = 0; t < N; ++t)
          for (std::size_t j = 0; j < k; ++j) {
            std::swap(perm[j], perm[j + rng() % (static_cast<std::size_t>(s.experts) - j)]);
            hid[t * k + j] = perm[j];
            hw[t * k + j] = 0.1f + 0.9f * std::fabs(u(rng));
          }
        device_buffer<T> x(N * H, ex), out(N * H, ex), gx(N * H, ex);
        device_buffer<std::int32_t> ids(N * k, ex);
        device_buffer<float> w(N * k, ex), gw(N * k, ex);
        epx::exec::copy_from_host(ex, hx.data(), hx.size(), x.data());
        epx::exec::copy_from_host(ex, hid.data(), hid.size(), ids.data());
        epx::exec::copy_from_host(ex, hw.data(), hw.size(), w.data());
        scaling_experts<T> experts;
        const epx::span<const T> xs(x.data(), N * H);
        const epx::span<const std::int32_t> is(ids.data(), N * k);
        const epx::span<const float> ws(w.data(), N * k);
        auto fwd = [&] { layer.forward(xs, is, ws, epx::span<T>(out.data(), N * H), experts, epx::mode::inference); };
        auto train = [&] {
          auto saved = layer.forward(xs, is, ws, epx::span<T>(out.data(), N * H), experts, epx::mode::train);
          layer.backward(std::move(saved), epx::span<const T>(x.data(), N * H), epx::span<T>(gx.data(), N * H),
                         epx::span<float>(gw.data(), N * k), experts);
        };
        // Check one forward on sampled tokens.
        fwd();
        EPX_CUDA_CHECK(cudaStreamSynchronize(st));
        const std::size_t step = std::max<std::size_t>(1, N / 32);
        double err = 0;
        std::vector<T> row(H);
        for (std::size_t t = 0; t < N; t += step) {
          EPX_CUDA_CHECK(cudaMemcpy(row.data(), out.data() + t * H, H * sizeof(T), cudaMemcpyDeviceToHost));
          for (std::size_t h = 0; h < H; ++h) {
            double ref = 0;
            for (std::size_t j = 0; j < k; ++j) {
              const float y = scale_of(hid[t * k + j]) * epx::convert<float>(hx[t * H + h]);
              ref += static_cast<double>(hw[t * k + j]) * epx::convert<double>(epx::convert<T>(y));
            }
            err = std::max(err, std::fabs(epx::convert<double>(row[h]) - ref) / (1.0 + std::fabs(ref)));
          }
        }
        const double tol = std::is_same_v<T, float> ? 1e-5 : 1.0 / 128;
        const auto& stats = layer.stats();
        ok[static_cast<std::size_t>(me)] = err <= tol && stats.peer_access == direct;
        if (err > tol) std::fprintf(stderr, "rank %d: forward check failed: %.3e > %.1e\n", me, err, tol);
        if (stats.peer_access != direct)
          std::fprintf(stderr, "rank %d: the layer took the %s route\n", me, stats.peer_access ? "direct" : "staged");
        // Bytes of this rank's route, in rows of H elements.
        std::size_t R = 0;
        for (auto c : stats.tokens_per_local_expert) R += static_cast<std::size_t>(c);
        const double row_bytes = static_cast<double>(H * sizeof(T)), S = static_cast<double>(N * k);
        const double Rd = static_cast<double>(R), Nd = static_cast<double>(N);
        const double fb = (direct ? 2 * Rd + 2 * Rd + S + Nd : 2 * S + 2 * Rd + 2 * Rd + 2 * S + S + Nd) * row_bytes;
        bytes_fwd[static_cast<std::size_t>(me)] = fb;
        bytes_train[static_cast<std::size_t>(me)] = 2 * fb + 2 * S * row_bytes;  // + the weight-gradient dots
        auto timed = [&](auto&& call, std::vector<double>& times) {
          call();  // warm-up
          EPX_CUDA_CHECK(cudaStreamSynchronize(st));
          for (int i = 0; i < iters; ++i) {
            comm.barrier();
            const auto t0 = clock_type::now();
            call();
            EPX_CUDA_CHECK(cudaStreamSynchronize(st));
            comm.barrier();
            if (me == 0) times.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
          }
        };
        timed(fwd, t_fwd);
        timed(train, t_train);
      },
      o);
  bool all_ok = true;
  for (char c : ok) all_ok = all_ok && c;
  double bf = 0, bt = 0;
  for (std::size_t i = 0; i < bytes_fwd.size(); ++i) {
    bf += bytes_fwd[i];
    bt += bytes_train[i];
  }
  json("layer forward (inference)", s, dtype, direct, all_ok, t_fwd, bf, copy_gbps);
  json("layer forward+backward (training)", s, dtype, direct, all_ok, t_train, bt, copy_gbps);
  return all_ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  if (const int rc = epx::bench::gpu::start("epx_bench_gpu_layer_ep", argc, argv, quick)) return rc;
  try {
    EPX_CUDA_CHECK(cudaSetDevice(0));
    epx::bench::gpu::keep_freed_pool_memory(0);
    const double copy = copy_bandwidth(quick ? 3 : 10);
    std::printf("JSON {\"bench\": \"copy bandwidth (cudaMemcpy D2D, read+write)\", \"GBps\": %.1f, \"validated\": true}\n",
                copy);
    const int iters = quick ? 5 : 20;
    bool ok = true;
    for (const bool direct : {true, false}) {
      ok = bench_shape<epx::bf16>({8, quick ? std::size_t{1024} : std::size_t{4096}, 7168, 8, 256}, direct, iters,
                                  copy, "bf16") && ok;
      ok = bench_shape<epx::bf16>({8, 128, 7168, 8, 256}, direct, quick ? 10 : 50, copy, "bf16") && ok;
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx_bench_gpu_layer_ep: %s\n", e.what());
    return 1;
  }
}
