// bench/gpu/bench_decode.cu: a decode step's forward against the device time of its own
// kernels and copies: how much a call adds in launches and host synchronisation; and the
// layout plan of 32768 pairs, whose device time the issue bounds (see bench_layout).
//
//   epx_bench_gpu_decode [--quick]
//
// One rank (the NCCL communicator at world size 1, exec::cuda on its stream), 128 tokens x
// 7168 hidden, bf16, top-8 of 256 experts, identity experts that work in place (no kernel
// of their own), inference forward; the normal mode (count exchange read back by the host)
// and bounded mode (count_exchange::device, no host synchronisation). Per mode: the wall
// time of a call (host clock around the call and its stream's synchronisation; median and
// p99 over the timed calls) and, where the benchmark is built with CUPTI
// (EPX_BENCH_CUPTI, which bench/gpu/run.sh sets when it finds cupti.h and libcupti), the
// device time of as many calls again, traced apart (tracing slows launches): the durations
// of every kernel, memcpy and memset CUPTI recorded while they ran, per call. `wall_over_device` is their ratio (issue target: at
// most 2 at this shape). Every call's output is checked once against the input (identity
// experts: out = sum_j w_j x). One JSON line per measurement ("JSON {...}").
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "epx/comm/nccl.cuh"
#include "epx/exec/cuda.cuh"

#include "common.cuh"

#if EPX_BENCH_CUPTI
#include <cupti.h>
#endif

namespace {

using epx::exec::device_buffer;
using clock_type = std::chrono::steady_clock;

#if EPX_BENCH_CUPTI
// Device time of the activity CUPTI records between start() and stop(): kernels, memcpys,
// memsets (their end - start, summed; one stream, so they do not overlap).
namespace device_time {
// The record types of this CUPTI (each reads only start and end).
#if CUPTI_API_VERSION >= 130000
using kernel_record = CUpti_ActivityKernel10;
using memcpy_record = CUpti_ActivityMemcpy6;
#else
using kernel_record = CUpti_ActivityKernel9;
using memcpy_record = CUpti_ActivityMemcpy5;
#endif
using memset_record = CUpti_ActivityMemset4;

std::atomic<unsigned long long> g_ns{0}, g_records{0};

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = std::size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    unsigned long long ns = 0;
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const kernel_record*>(rec);
        ns = k->end - k->start;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const memcpy_record*>(rec);
        ns = m->end - m->start;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const memset_record*>(rec);
        ns = m->end - m->start;
        break;
      }
      default: continue;
    }
    g_ns += ns;
    ++g_records;
  }
  std::free(buffer);
}

bool check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  std::fprintf(stderr, "epx_bench_gpu_decode: %s failed: %s (device time not measured)\n", what, s ? s : "?");
  return false;
}

bool g_ok = false;
constexpr CUpti_ActivityKind g_kinds[3] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                           CUPTI_ACTIVITY_KIND_MEMSET};
void init() {
  g_ok = check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
}
void start() {
  if (!g_ok) return;
  cuptiActivityFlushAll(1);
  g_ns = 0;
  g_records = 0;
  for (const auto kind : g_kinds) g_ok = check(cuptiActivityEnable(kind), "cuptiActivityEnable") && g_ok;
}
// Seconds of device activity since start(), or a negative number when unmeasured. Every
// kind is disabled again, whether or not all were enabled.
double stop() {
  for (const auto kind : g_kinds) cuptiActivityDisable(kind);
  cuptiActivityFlushAll(1);
  if (!g_ok) return -1.0;
  return static_cast<double>(g_ns.load()) * 1e-9;
}
}  // namespace device_time
#else
namespace device_time {
void init() {}
void start() {}
double stop() { return -1.0; }
}  // namespace device_time
#endif

// out == in: nothing to do in inference (forward_in_place); training copies.
struct identity_experts {
  static constexpr bool forward_in_place = true;
  template <class Exec, class T>
  void forward(const Exec& ex, const epx::expert_rows<const T>& in, T* out) {
    if (out != in.rows) epx::exec::copy_n(ex, in.rows, in.num_rows * in.hidden, out);
  }
  template <class Exec, class T>
  void backward(const Exec& ex, const epx::expert_rows<const T>&, const T* g, T* gi) {
    (void)ex;
    (void)g;
    (void)gi;
  }
};

using epx::bench::gpu::median_of;
using epx::bench::gpu::p99_of;

// The layout plan on the device for N tokens x k slots over E experts (32768 pairs at
// 4096 x 8 over 256: issue target 20 us): the sorted plan (a stable radix sort by expert
// id through Thrust, CUB on the device: what the layer takes on exec::cuda) and the
// counting sort, each checked once against the host's plan, then `calls` plans back to
// back timed with events (`us`: launches included, as a call pays them) and traced apart
// with CUPTI (`device_us`: the plan's kernels, copies and fills alone). Returns false if a
// plan differs from the host's.
bool bench_layout(cudaStream_t s, std::size_t N, int k, int E, int calls) {
  const std::size_t P = N * static_cast<std::size_t>(k);
  std::mt19937 rng(11);
  std::vector<std::int32_t> hid(P);
  std::vector<float> hw(P);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  std::vector<int> perm(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) perm[static_cast<std::size_t>(e)] = e;
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
      std::swap(perm[j], perm[j + rng() % (static_cast<std::size_t>(E) - j)]);
      hid[t * k + j] = perm[j];
      hw[t * k + j] = u(rng);
    }
  const auto host = epx::layout::build_plan(epx::exec::serial{}, hid.data(), hw.data(), N, k, E);
  const std::vector<std::int64_t> want_pos(host.pos.data(), host.pos.data() + P);
  const std::vector<std::int64_t> want_src(host.src_row.data(), host.src_row.data() + P);
  const epx::exec::cuda dev{s};
  device_buffer<std::int32_t> ids(P, dev);
  device_buffer<float> w(P, dev);
  epx::exec::copy_from_host(dev, hid.data(), P, ids.data());
  epx::exec::copy_from_host(dev, hw.data(), P, w.data());
  cudaEvent_t a, b;
  EPX_CUDA_CHECK(cudaEventCreate(&a));
  EPX_CUDA_CHECK(cudaEventCreate(&b));
  bool all_ok = true;
  auto measure = [&](const char* name, auto&& plan) {
    bool ok;
    {
      const auto p = plan();
      std::vector<std::int64_t> pos(P), src(P);
      EPX_CUDA_CHECK(cudaStreamSynchronize(s));
      EPX_CUDA_CHECK(cudaMemcpy(pos.data(), p.pos.data(), P * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
      EPX_CUDA_CHECK(cudaMemcpy(src.data(), p.src_row.data(), P * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
      ok = pos == want_pos && src == want_src;
    }
    for (int i = 0; i < 5; ++i) (void)plan();
    EPX_CUDA_CHECK(cudaStreamSynchronize(s));
    EPX_CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < calls; ++i) (void)plan();
    EPX_CUDA_CHECK(cudaEventRecord(b, s));
    EPX_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    device_time::start();
    for (int i = 0; i < calls; ++i) (void)plan();
    EPX_CUDA_CHECK(cudaStreamSynchronize(s));
    const double dev_s = device_time::stop();
    char dev_us[32] = "null";
    if (dev_s >= 0) std::snprintf(dev_us, sizeof dev_us, "%.2f", dev_s / calls * 1e6);
    std::printf("JSON {\"bench\": \"layout plan (%s)\", \"tokens\": %zu, \"k\": %d, \"experts\": %d, \"pairs\": %zu, "
                "\"us\": %.2f, \"device_us\": %s, \"target_us\": 20, \"validated\": %s}\n",
                name, N, k, E, P, static_cast<double>(ms) * 1e3 / calls, dev_us, ok ? "true" : "false");
    std::fflush(stdout);
    all_ok = all_ok && ok;
  };
  measure("sorted, CUB", [&] { return epx::layout::launch_sorted_plan(dev, ids.data(), w.data(), N, k, E); });
  measure("counting sort", [&] { return epx::layout::launch_counting_plan(dev, ids.data(), w.data(), N, k, E); });
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return all_ok;
}

// One mode; returns false if the output check failed.
bool bench_mode(cudaStream_t s, epx::nccl::communicator& comm, bool bounded, int calls) {
  using T = epx::bf16;
  const std::size_t N = 128, H = 7168;
  const int k = 8, E = 256;
  epx::mesh_config mc;
  mc.experts = E;
  const epx::mesh m(mc);
  epx::layer_options lo;
  lo.hidden = H;
  lo.top_k = k;
  lo.pad.rows_per_expert = 0;
  if (bounded) {
    lo.counts = epx::count_exchange::device;
    lo.bound.cap = 16;
  }
  const epx::exec::cuda ex{s};
  epx::moe_layer<epx::nccl::communicator, T, epx::impl::all_to_all, epx::exec::cuda> layer(m, comm, lo, ex);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> hx(N * H);
  for (auto& v : hx) v = epx::convert<T>(u(rng));
  std::vector<std::int32_t> hid(N * k);
  std::vector<float> hw(N * k);
  std::vector<int> perm(E);
  for (int e = 0; e < E; ++e) perm[static_cast<std::size_t>(e)] = e;
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
      std::swap(perm[j], perm[j + rng() % (static_cast<std::size_t>(E) - j)]);
      hid[t * k + j] = perm[j];
      hw[t * k + j] = 0.1f + 0.9f * std::fabs(u(rng));
    }
  device_buffer<T> x(N * H, ex), out(N * H, ex);
  device_buffer<std::int32_t> ids(N * k, ex);
  device_buffer<float> w(N * k, ex);
  epx::exec::copy_from_host(ex, hx.data(), hx.size(), x.data());
  epx::exec::copy_from_host(ex, hid.data(), hid.size(), ids.data());
  epx::exec::copy_from_host(ex, hw.data(), hw.size(), w.data());
  identity_experts experts;
  auto call = [&] {
    layer.forward(epx::span<const T>(x.data(), N * H), epx::span<const std::int32_t>(ids.data(), N * k),
                  epx::span<const float>(w.data(), N * k), epx::span<T>(out.data(), N * H), experts,
                  epx::mode::inference);
    EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  };
  // The check: out[t] = sum_j w[t,j] x[t] (float accumulation, one rounding), within bf16's.
  call();
  std::vector<T> ho(N * H);
  EPX_CUDA_CHECK(cudaMemcpy(ho.data(), out.data(), ho.size() * sizeof(T), cudaMemcpyDeviceToHost));
  double err = 0;
  for (std::size_t t = 0; t < N; ++t) {
    double ws = 0;
    for (int j = 0; j < k; ++j) ws += hw[t * k + static_cast<std::size_t>(j)];
    for (std::size_t h = 0; h < H; ++h) {
      const double ref = ws * epx::convert<double>(hx[t * H + h]);
      err = std::max(err, std::fabs(epx::convert<double>(ho[t * H + h]) - ref) / (1.0 + std::fabs(ref)));
    }
  }
  const bool ok = err <= 1.0 / 128;
  if (!ok) std::fprintf(stderr, "epx_bench_gpu_decode: output check failed (%s): %.3e\n", bounded ? "bounded" : "normal", err);
  for (int i = 0; i < 10; ++i) call();
  std::vector<double> wall;
  for (int i = 0; i < calls; ++i) {
    const auto t0 = clock_type::now();
    call();
    wall.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  // The device time in calls of their own: tracing slows the launches it records.
  device_time::start();
  for (int i = 0; i < calls; ++i) call();
  const double dev = device_time::stop();
  const double med = median_of(wall), dev_call = dev >= 0 ? dev / calls : -1.0;
  char ratio[32] = "null", dev_us[32] = "null";
  if (dev_call > 0) {
    std::snprintf(ratio, sizeof ratio, "%.2f", med / dev_call);
    std::snprintf(dev_us, sizeof dev_us, "%.1f", dev_call * 1e6);
  }
  std::printf("JSON {\"bench\": \"decode forward (inference)\", \"mode\": \"%s\", \"backend\": \"nccl ws1\", "
              "\"route\": \"staged\", \"dtype\": \"bf16\", \"tokens\": %zu, \"hidden\": %zu, \"k\": %d, \"experts\": %d, "
              "\"validated\": %s, \"us\": %.1f, \"p99_us\": %.1f, \"device_us\": %s, \"wall_over_device\": %s, "
              "\"target_wall_over_device\": 2, \"host_syncs\": %lld}\n",
              bounded ? "bounded" : "normal", N, H, k, E, ok ? "true" : "false", med * 1e6, p99_of(wall) * 1e6, dev_us,
              ratio, static_cast<long long>(layer.stats().host_syncs));
  std::fflush(stdout);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  if (const int rc = epx::bench::gpu::start("epx_bench_gpu_decode", argc, argv, quick)) return rc;
  try {
    EPX_CUDA_CHECK(cudaSetDevice(0));
    epx::bench::gpu::keep_freed_pool_memory(0);
    device_time::init();
    const epx::bench::gpu::owned_stream stream;  // outlives the communicator and the layers
    ncclUniqueId id;
    EPX_NCCL_CHECK(ncclGetUniqueId(&id));
    auto comm = epx::nccl::communicator::from_unique_id(id, 1, 0, 0, stream.get());
    const int calls = quick ? 20 : 200;
    bool ok = bench_layout(stream.get(), 4096, 8, 256, calls);
    ok = bench_mode(stream.get(), comm, false, calls) && ok;
    ok = bench_mode(stream.get(), comm, true, calls) && ok;
    comm.barrier();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx_bench_gpu_decode: %s\n", e.what());
    return 1;
  }
}
