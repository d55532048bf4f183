// bench/gpu/bench_kernels.cu: device kernels of dispatch/combine against the device's copy
// bandwidth, and the NCCL path's round trip at world size 1. Timed with CUDA events.
//
//   epx_bench_gpu_kernels [--quick]
//
// Metrics (bytes counted once per element read and once per element written):
//   copy floor   max(cudaMemcpyAsync D2D, a 16-byte-vector copy kernel), GB/s of read+write
//   gather_rows  send[p,:] = x[src_row[p],:]          bytes 2*S*H*sizeof(T)
//   combine      out[t,:] = sum_j w*y[pos[t,j],:]      bytes (S+N)*H*sizeof(T)
//   fraction     GB/s of the kernel / copy floor GB/s (target >= 0.85)
//   round trip   gather_rows -> all_to_allv_segments (E segments) -> back -> combine on an
//                epx::nccl::communicator of one rank; floor_ratio = time / (bytes / floor)
// Rows "kernels" launch the library's kernels (epx/kernels/launch.hpp) through
// exec::for_each_n(exec::cuda); rows "vec16" are this file's reference kernels that give
// each thread 16 contiguous bytes of a row (what reaching the floor takes), for comparison.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/nccl.cuh"
#include "epx/core/numeric.hpp"
#include "epx/exec/cuda.cuh"

#include "epx/kernels/launch.hpp"
#include "epx/layer/moe_layer.hpp"

#include "common.cuh"

namespace {

using epx::exec::device_buffer;

struct event_timer {
  cudaEvent_t a{}, b{};
  cudaStream_t s;
  explicit event_timer(cudaStream_t st) : s(st) {
    EPX_CUDA_CHECK(cudaEventCreate(&a));
    EPX_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~event_timer() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  // Mean seconds per call of f over `iters` calls after `warmup` calls.
  template <class F>
  double time(F&& f, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) f();
    EPX_CUDA_CHECK(cudaStreamSynchronize(s));
    EPX_CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < iters; ++i) f();
    EPX_CUDA_CHECK(cudaEventRecord(b, s));
    EPX_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms) * 1e-3 / iters;
  }
};

// 16 bytes per call: i indexes uint4 words.
struct copy_vec16 {
  const uint4* src;
  uint4* dst;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { dst[i] = src[i]; }
};

template <class T>
struct alignas(16) pack16 {
  static constexpr std::size_t n = 16 / sizeof(T);
  T v[n];
};

// Reference: send[p, c] for every 16-byte word c of row p.
template <class T>
struct gather_rows_vec16 {
  const pack16<T>* x;
  const std::int64_t* src_row;
  pack16<T>* dst;
  std::size_t words;  // 16-byte words per row
  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const std::size_t p = i / words, c = i - p * words;
    const std::int64_t r = src_row[p];
    if (r < 0) {
      dst[i] = pack16<T>{};
      return;
    }
    dst[i] = x[static_cast<std::size_t>(r) * words + c];
  }
};

// Reference: out[t, word c] = sum_j w[t,j] * y[pos[t,j], word c] in accum_t, slot order.
template <class T>
struct combine_vec16 {
  const pack16<T>* y;
  const float* weights;
  const std::int64_t* pos;
  pack16<T>* out;
  std::size_t words;
  int top_k;
  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    using A = epx::accum_t<T>;
    constexpr std::size_t V = pack16<T>::n;
    const std::size_t t = i / words, c = i - t * words;
    A acc[V];
    for (std::size_t e = 0; e < V; ++e) acc[e] = A(0);
    for (int j = 0; j < top_k; ++j) {
      const std::int64_t p = pos[t * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(j)];
      if (p < 0) continue;
      const A w = static_cast<A>(weights[t * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(j)]);
      const pack16<T> v = y[static_cast<std::size_t>(p) * words + c];
      for (std::size_t e = 0; e < V; ++e) acc[e] += w * epx::convert<A>(v.v[e]);
    }
    pack16<T> o;
    for (std::size_t e = 0; e < V; ++e) o.v[e] = epx::convert<T>(acc[e]);
    out[i] = o;
  }
};

// A balanced random routing of N tokens x k slots over E experts, laid out by a stable
// counting sort (send order: expert, then token, then slot), as the layout plan does.
struct routing {
  std::size_t N, k, S;
  int E;
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> pos, src_row, expert_offset;
  std::vector<float> w;
};

routing make_routing(std::size_t N, std::size_t k, int E, unsigned seed) {
  routing r{N, k, N * k, E, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::vector<std::int32_t>& ids = r.ids;
  ids.resize(r.S);
  std::vector<int> experts(static_cast<std::size_t>(E));
  std::iota(experts.begin(), experts.end(), 0);
  for (std::size_t t = 0; t < N; ++t) {
    // k distinct experts per token.
    for (std::size_t j = 0; j < k; ++j) std::swap(experts[j], experts[j + rng() % (static_cast<std::size_t>(E) - j)]);
    for (std::size_t j = 0; j < k; ++j) ids[t * k + j] = experts[j];
  }
  r.expert_offset.assign(static_cast<std::size_t>(E) + 1, 0);
  for (const int e : ids) ++r.expert_offset[static_cast<std::size_t>(e) + 1];
  for (int e = 0; e < E; ++e) r.expert_offset[static_cast<std::size_t>(e) + 1] += r.expert_offset[static_cast<std::size_t>(e)];
  std::vector<std::int64_t> next(r.expert_offset.begin(), r.expert_offset.end() - 1);
  r.pos.resize(r.S);
  r.src_row.resize(r.S);
  for (std::size_t i = 0; i < r.S; ++i) {
    const auto p = next[static_cast<std::size_t>(ids[i])]++;
    r.pos[i] = p;
    r.src_row[static_cast<std::size_t>(p)] = static_cast<std::int64_t>(i / k);
  }
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  r.w.resize(r.S);
  for (auto& v : r.w) v = u(rng);
  return r;
}

template <class T>
device_buffer<T> upload(cudaStream_t s, const std::vector<T>& v) {
  device_buffer<T> b(v.size());
  epx::exec::copy_from_host(epx::exec::cuda{s}, v.data(), v.size(), b.data());
  return b;
}

// Experts for the layer rows: out = (1 + e/4) * in per expert, one kernel per local expert.
template <class T>
struct scale_rows {
  const T* in;
  T* out;
  float s;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = epx::convert<T>(s * epx::convert<float>(in[i])); }
};
template <class T>
struct scaling_experts {
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const T>& in, T* out) {
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden;
      epx::exec::for_each_n(ex, in.count(l) * in.hidden,
                            scale_rows<T>{in.rows + b, out + b, 1.0f + 0.25f * static_cast<float>(in.first_global_expert + l)});
    }
  }
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden;
      epx::exec::for_each_n(ex, in.count(l) * in.hidden,
                            scale_rows<T>{grad_out + b, grad_in + b, 1.0f + 0.25f * static_cast<float>(in.first_global_expert + l)});
    }
  }
};

double gbps(double bytes, double secs) { return bytes / secs * 1e-9; }

// One measurement: a table row, and a JSON line (collected by bench/gpu/run.sh) with whether
// the measured call's output was checked and matched (`validated`).
std::vector<std::string> g_json;
void row(const char* name, const std::string& shape, double bytes, double secs, double floor_gbps, bool validated) {
  const double g = gbps(bytes, secs);
  std::printf("| %-26s | %-30s | %9.3f | %8.1f | %6.3f | %s\n", name, shape.c_str(), secs * 1e3, g, g / floor_gbps,
              validated ? "ok" : "NOT VALIDATED");
  char line[512];
  std::snprintf(line, sizeof line,
                "{\"bench\": \"%s\", \"shape\": \"%s\", \"backend\": \"one GPU, world size 1\", \"validated\": %s, "
                "\"us\": %.2f, \"bytes\": %.0f, \"GBps\": %.1f, \"copy_fraction\": %.3f}",
                name, shape.c_str(), validated ? "true" : "false", secs * 1e6, bytes, g, g / floor_gbps);
  g_json.emplace_back(line);
}

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, epx::bf16>) return "bf16";
  else return "?";
}

// Sampled rows of a device buffer [rows, H] (every `step`-th row), copied to the host.
template <class T>
std::vector<std::vector<T>> sample_rows(cudaStream_t s, const T* d, std::size_t rows, std::size_t H, std::size_t step) {
  std::vector<std::vector<T>> out;
  EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  for (std::size_t r = 0; r < rows; r += step) {
    std::vector<T> v(H);
    EPX_CUDA_CHECK(cudaMemcpy(v.data(), d + r * H, H * sizeof(T), cudaMemcpyDeviceToHost));
    out.push_back(std::move(v));
  }
  return out;
}

template <class T>
void bench_shape(cudaStream_t s, epx::nccl::communicator& comm, std::size_t N, std::size_t H, std::size_t k, int E,
                 double floor_gbps, int iters) {
  const auto r = make_routing(N, k, E, 1234u);
  const std::size_t S = r.S;
  const std::size_t words = H * sizeof(T) / 16;
  const epx::exec::cuda dev{s};
  std::vector<T> hx(N * H);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : hx) v = epx::convert<T>(u(rng));
  auto x = upload(s, hx);
  auto pos = upload(s, r.pos);
  auto src = upload(s, r.src_row);
  auto w = upload(s, r.w);
  device_buffer<T> send(S * H), recv(S * H), back(S * H), out(N * H);
  epx::exec::fill_zero(dev, send.data(), S * H);
  epx::exec::fill_zero(dev, recv.data(), S * H);
  epx::exec::fill_zero(dev, back.data(), S * H);
  event_timer tm(s);
  char shape[128];
  std::snprintf(shape, sizeof shape, "N=%zu H=%zu k=%zu E=%d %s", N, H, k, E, type_name<T>());
  const double gather_bytes = 2.0 * static_cast<double>(S * H * sizeof(T));
  const double combine_bytes = static_cast<double>((S + N) * H * sizeof(T));
  const std::size_t step_s = std::max<std::size_t>(1, S / 64), step_n = std::max<std::size_t>(1, N / 64);
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1.0 / 64;

  // send[p] == x[src_row[p]] bit for bit (sampled rows).
  auto gather_ok = [&] {
    const auto got = sample_rows(s, send.data(), S, H, step_s);
    for (std::size_t i = 0; i < got.size(); ++i) {
      const auto row0 = static_cast<std::size_t>(r.src_row[i * step_s]);
      if (std::memcmp(got[i].data(), hx.data() + row0 * H, H * sizeof(T)) != 0) return false;
    }
    return true;
  };
  // out[t] == sum_j w[t,j] * scale(e) * x[t] within the rounding of T (sampled tokens); the
  // rows combined are x's own rows, scaled by `scale` (the experts of the layer rows).
  auto combine_ok = [&](auto&& scale) {
    const auto got = sample_rows(s, out.data(), N, H, step_n);
    double err = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const std::size_t t = i * step_n;
      for (std::size_t h = 0; h < H; ++h) {
        double ref = 0;
        for (std::size_t j = 0; j < k; ++j) {
          const float sx = scale(r.ids[t * k + j]) * epx::convert<float>(hx[t * H + h]);
          ref += static_cast<double>(r.w[t * k + j]) * epx::convert<double>(epx::convert<T>(sx));
        }
        err = std::max(err, std::fabs(epx::convert<double>(got[i][h]) - ref) / (1.0 + std::fabs(ref)));
      }
    }
    if (err > tol) std::printf("|   check failed: max rel err %.2e (tol %.1e)\n", err, tol);
    return err <= tol;
  };
  auto unit = [](int) { return 1.0f; };

  {
    const T* xs = x.data();
    const std::int64_t* src_rows = src.data();
    const double tg = tm.time([&] { epx::kernels::gather(dev, S, H, xs, src_rows, send.data()); }, 2, iters);
    row("gather (kernels::gather)", shape, gather_bytes, tg, floor_gbps, gather_ok());
    const T* ys = send.data();
    const double tc = tm.time(
        [&] { epx::kernels::combine(dev, N, H, static_cast<int>(k), ys, w.data(), pos.data(), out.data()); }, 2, iters);
    row("combine (kernels::combine)", shape, combine_bytes, tc, floor_gbps, combine_ok(unit));
  }
  const gather_rows_vec16<T> gv{reinterpret_cast<const pack16<T>*>(x.data()), src.data(),
                                reinterpret_cast<pack16<T>*>(send.data()), words};
  const double tgv = tm.time([&] { epx::exec::for_each_n(dev, S * words, gv); }, 2, iters);
  row("gather_rows (vec16 ref)", shape, gather_bytes, tgv, floor_gbps, gather_ok());
  const combine_vec16<T> cv{reinterpret_cast<const pack16<T>*>(send.data()), w.data(), pos.data(),
                            reinterpret_cast<pack16<T>*>(out.data()), words, static_cast<int>(k)};
  const double tcv = tm.time([&] { epx::exec::for_each_n(dev, N * words, cv); }, 2, iters);
  row("combine (vec16 ref)", shape, combine_bytes, tcv, floor_gbps, combine_ok(unit));

  // Round trip through the NCCL communicator: E segments (one per expert) each way.
  const auto E_ = static_cast<std::size_t>(E);
  std::vector<std::size_t> cnt(E_), off(E_);
  for (std::size_t e = 0; e < E_; ++e) {
    off[e] = static_cast<std::size_t>(r.expert_offset[e]);
    cnt[e] = static_cast<std::size_t>(r.expert_offset[e + 1] - r.expert_offset[e]);
  }
  const epx::span<const std::size_t> c_(cnt.data(), E_), o_(off.data(), E_);
  comm.set_stream(s);
  const double trip_bytes = gather_bytes + 2.0 * gather_bytes + combine_bytes;
  auto trip = [&](auto&& gather, std::size_t gn, auto&& comb, std::size_t cn) {
    epx::exec::for_each_n(dev, gn, gather);
    epx::all_to_allv_segments(comm, send.data(), c_, o_, recv.data(), c_, o_, E_, H);
    epx::all_to_allv_segments(comm, recv.data(), c_, o_, back.data(), c_, o_, E_, H);
    epx::exec::for_each_n(dev, cn, comb);
  };
  const combine_vec16<T> cvb{reinterpret_cast<const pack16<T>*>(back.data()), w.data(), pos.data(),
                             reinterpret_cast<pack16<T>*>(out.data()), words, static_cast<int>(k)};
  epx::exec::fill_zero(dev, out.data(), N * H);
  const double tt = tm.time([&] { trip(gv, S * words, cvb, N * words); }, 1, std::max(1, iters / 2));
  comm.wait();
  row("round trip nccl ws1 (vec16)", shape, trip_bytes, tt, floor_gbps, combine_ok(unit));
  {
    const T* xs = x.data();
    const T* bs = back.data();
    const std::int64_t* src_rows = src.data();
    epx::exec::fill_zero(dev, out.data(), N * H);
    const double tk = tm.time([&] {
          epx::kernels::gather(dev, S, H, xs, src_rows, send.data());
          epx::all_to_allv_segments(comm, send.data(), c_, o_, recv.data(), c_, o_, E_, H);
          epx::all_to_allv_segments(comm, recv.data(), c_, o_, back.data(), c_, o_, E_, H);
          epx::kernels::combine(dev, N, H, static_cast<int>(k), bs, w.data(), pos.data(), out.data());
        }, 1, std::max(1, iters / 2));
    comm.wait();
    row("round trip nccl ws1 (kernels)", shape, trip_bytes, tk, floor_gbps, combine_ok(unit));
  }

  // NCCL itself at world size 1: an in-place scaled all-reduce of the [N, H] output (checked
  // on one extra call: every sampled element halves exactly, away from subnormals).
  const double ta = tm.time([&] { comm.all_reduce(out.data(), out.data(), N * H, epx::datatype_of<T>(), 0.5); }, 1, iters);
  comm.wait();
  {
    trip(gv, S * words, cvb, N * words);
    comm.wait();
    const auto before = sample_rows(s, out.data(), N, H, step_n);
    comm.all_reduce(out.data(), out.data(), N * H, epx::datatype_of<T>(), 0.5);
    comm.wait();
    const auto after = sample_rows(s, out.data(), N, H, step_n);
    bool ok = true;
    for (std::size_t i = 0; i < before.size(); ++i)
      for (std::size_t h = 0; h < H; ++h) {
        const double b = epx::convert<double>(before[i][h]);
        if (std::fabs(b) > 1e-30 && epx::convert<double>(after[i][h]) != 0.5 * b) ok = false;
      }
    row("nccl all_reduce ws1 x0.5", shape, 2.0 * static_cast<double>(N * H * sizeof(T)), ta, floor_gbps, ok);
  }

  {
    // The whole layer on the GPU path (counting-sort plan, count exchange, dispatch,
    // experts, combine; backward): bytes as the round trip plus the experts' read+write.
    epx::mesh_config mc;
    mc.experts = E;
    const epx::mesh m(mc);
    epx::layer_options lo;
    lo.hidden = H;
    lo.top_k = static_cast<int>(k);
    lo.pad.rows_per_expert = 0;
    epx::moe_layer<epx::nccl::communicator, T, epx::impl::all_to_all, epx::exec::cuda> layer(m, comm, lo, dev);
    auto ids = upload(s, r.ids);
    device_buffer<T> gx(N * H);
    device_buffer<float> gw(S);
    scaling_experts<T> experts;
    const epx::span<const T> xs(x.data(), N * H);
    const epx::span<const std::int32_t> is(ids.data(), S);
    const epx::span<const float> ws(w.data(), S);
    const double expert_bytes = gather_bytes;
    auto scale = [](int e) { return 1.0f + 0.25f * static_cast<float>(e); };
    const double tf = tm.time(
        [&] { layer.forward(xs, is, ws, epx::span<T>(out.data(), N * H), experts, epx::mode::inference); }, 1,
        std::max(1, iters / 2));
    comm.wait();
    row("moe_layer forward (infer)", shape, trip_bytes + expert_bytes, tf, floor_gbps, combine_ok(scale));
    epx::exec::fill_zero(dev, out.data(), N * H);
    const double tb = tm.time(
        [&] {
          auto saved = layer.forward(xs, is, ws, epx::span<T>(out.data(), N * H), experts, epx::mode::train);
          layer.backward(std::move(saved), epx::span<const T>(out.data(), N * H), epx::span<T>(gx.data(), N * H),
                         epx::span<float>(gw.data(), S), experts);
        },
        1, std::max(1, iters / 4));
    comm.wait();
    row("moe_layer forward+backward", shape, 2.0 * (trip_bytes + expert_bytes), tb, floor_gbps, combine_ok(scale));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  if (const int rc = epx::bench::gpu::start("epx_bench_gpu_kernels", argc, argv, quick)) return rc;
  try {
    cudaDeviceProp prop{};
    EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    EPX_CUDA_CHECK(cudaSetDevice(0));
    epx::bench::gpu::keep_freed_pool_memory(0);
    const epx::bench::gpu::owned_stream stream;  // outlives the communicator and the buffers below
    const cudaStream_t s = stream.get();
    const int iters = quick ? 5 : 20;
    std::printf("epx GPU kernels on %s (sm_%d%d, %d SMs, %.0f GiB)%s\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1 << 30),
                quick ? " [quick]" : "");

    // Copy floor: 1 GiB (256 MiB quick) read + written.
    const std::size_t bytes = (quick ? std::size_t{256} : std::size_t{1024}) << 20;
    device_buffer<uint4> a(bytes / 16), b(bytes / 16);
    EPX_CUDA_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s));
    event_timer tm(s);
    const double t_memcpy =
        tm.time([&] { EPX_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s)); }, 2, iters);
    const double t_kernel =
        tm.time([&] { epx::exec::for_each_n(epx::exec::cuda{s}, bytes / 16, copy_vec16{a.data(), b.data()}); }, 2, iters);
    const double g_memcpy = gbps(2.0 * bytes, t_memcpy), g_kernel = gbps(2.0 * bytes, t_kernel);
    const double floor_gbps = std::max(g_memcpy, g_kernel);
    {
      char line[256];
      std::snprintf(line, sizeof line,
                    "{\"bench\": \"copy bandwidth\", \"bytes\": %.0f, \"memcpy_GBps\": %.1f, \"kernel_GBps\": %.1f, "
                    "\"floor_GBps\": %.1f, \"validated\": true}",
                    2.0 * static_cast<double>(bytes), g_memcpy, g_kernel, floor_gbps);
      g_json.emplace_back(line);
    }
    std::printf("copy bandwidth (read+write): cudaMemcpy D2D %.1f GB/s, copy kernel %.1f GB/s; floor %.1f GB/s\n",
                g_memcpy, g_kernel, floor_gbps);
    a = device_buffer<uint4>();
    b = device_buffer<uint4>();

    ncclUniqueId id;
    EPX_NCCL_CHECK(ncclGetUniqueId(&id));
    auto comm = epx::nccl::communicator::from_unique_id(id, 1, 0, 0, s);
    comm.barrier();

    std::printf("| %-26s | %-30s | %9s | %8s | %6s | output\n", "kernel", "shape", "ms", "GB/s", "frac");
    std::printf("|%s|%s|%s|%s|%s|\n", std::string(28, '-').c_str(), std::string(32, '-').c_str(),
                std::string(11, '-').c_str(), std::string(10, '-').c_str(), std::string(8, '-').c_str());
    if (quick) {
      bench_shape<epx::bf16>(s, comm, 1024, 4096, 8, 64, floor_gbps, iters);
    } else {
      bench_shape<epx::bf16>(s, comm, 4096, 4096, 8, 64, floor_gbps, iters);
      bench_shape<epx::bf16>(s, comm, 4096, 7168, 8, 256, floor_gbps, iters);
      bench_shape<float>(s, comm, 4096, 4096, 2, 8, floor_gbps, iters);
      bench_shape<epx::bf16>(s, comm, 128, 4096, 8, 64, floor_gbps, iters);
    }
    comm.barrier();
    std::printf("frac = GB/s / copy floor (target >= 0.85). \"kernels\": epx/kernels/launch.hpp through "
                "exec::cuda; \"vec16 ref\": 16 bytes per thread.\n");
    for (const auto& l : g_json) std::printf("JSON %s\n", l.c_str());
    for (const auto& l : g_json)
      if (l.find("\"validated\": false") != std::string::npos) return 1;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx_bench_gpu_kernels: %s\n", e.what());
    return 1;
  }
}
