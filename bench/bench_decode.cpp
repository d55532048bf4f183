// A decode step of the MoE layer over the threads communicator: 128 tokens x 7168 hidden,
// top-8 of 256 experts, ep = 8 (one rank per thread), bf16, inference forward with identity
// experts in place; the normal mode against bounded mode (layer_options::counts ==
// count_exchange::device, spec section 11), each on the direct route (peer reads, the
// threads default) and on the staged route (layer_options::peer_access = false).
//
//   ./bench_decode --benchmark_out=decode.json --benchmark_out_format=json
//   ./bench_decode --calls=50 --benchmark_filter=bounded     # fewer calls, one mode
//   ./bench_decode --quick                                   # seconds (bench-smoke): 8 tokens, H = 256
//   ./bench_decode --host-isa=baseline                       # the FP8 loops at the build's flags
//   ./bench_decode --stage-bytes=all                         # the staged route in one round
//   ./bench_decode --stream-threshold=0                      # every host row copy streams
//   ./bench_decode --benchmark_filter=quantise --host-isa=avx2 # the E4M3 quantisation alone
//
// One benchmark iteration is one measurement of `--calls` calls (default 300) after 10
// warm-up calls; each call runs between two barriers of all ranks, so its latency is that
// of the slowest rank. Google Benchmark's time is the median latency (manual time).
// Counters:
//   median_us, p99_us      latency per call over the measured calls
//   wait_share             time the ranks spend inside the communicator (collectives and
//                          peer-access barriers, not the work done inside them), over the
//                          call's latency, mean over ranks and calls
//   floor_us               the memcpy floor: every rank copies the bytes its route reads
//                          plus writes (rows, see route_rows), all ranks at once,
//                          barrier to barrier, median (through a buffer of at most 16 MiB,
//                          copied again until the bytes are done)
//   MiB_moved              per rank, those bytes
//   overflow_pairs         pairs dropped beyond the bound over the run (bounded mode; 0
//                          expected with cap = 16 on this routing)
//   checked                1: the first call's output matched the direct computation
//                          (identity experts: out[t] = sum_j w[t,j] x[t], within the rounding
//                          bound) and, in bounded mode, the normal mode's output bitwise
// The label names the backend, element type, mode and route, and for FP8 the host vector
// instructions its quantisation ran (exec::active_host_isa: the widest the CPU supports,
// or `--host-isa=baseline|avx2|avx512`).
//
// FP8 dispatch (spec section 12, layer_options::fp8_dispatch; normal mode: bounded mode
// carries rows in the layer's type), on the direct and the staged route:
//   decode/fp8/normal/{direct,staged}
//                              the decode step above with E4M3 rows and per-128 scales on
//                              the way out (experts dequantise), checked against the
//                              unquantised output within the E4M3 bound; its floor counts
//                              the FP8 route's bytes (route_rows)
//   dispatch/bf16-vs-fp8/{direct,staged}/tokens:4096
//                              the dispatch phase alone (moe_layer::dispatch: plan, count
//                              exchange, rows to the experts' owners) at 4096 tokens, bf16
//                              rows against FP8 rows on the same route, alternating in one
//                              loop (`--dispatch-calls`, default 20); counters bf16_median_us,
//                              fp8_median_us and fp8_over_bf16 (target 0.65); each layer's
//                              full forward checked once
//   quantise/bf16/rows:1024/hidden:7168
//                              kernels::quantise_e4m3 alone on one thread (exec::serial):
//                              1024 token rows of the benchmarks' inputs, ns_per_element
//                              (median of the iterations) and the host version it ran;
//                              checked once against each element's scalar conversion
//                              fp8_e4m3(x / scale) with scale = amax / 448 of its block
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "check_failed.hpp"
#include "decode_common.hpp"
#include "layer_common.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/epx.hpp"

namespace {

using namespace epx::bench::decode;

shape g_shape;
int g_calls = 300;

// One decode measurement on the threads backend (see decode_rank).
result run_decode(bool bounded, bool direct, bool fp8 = false) {
  const shape s = g_shape;
  const int P = s.ep;
  std::vector<rank_result> ranks(static_cast<std::size_t>(P));
  epx::threads::run(P, [&](epx::threads::communicator& world) {
    ranks[static_cast<std::size_t>(world.rank())] = decode_rank(world, s, g_calls, bounded, direct, fp8, false);
  });
  result res;
  for (const auto& r : ranks) {
    if (!r.failure.empty()) {
      res.checked = false;
      res.failure = r.failure;
    }
    res.wait_share += r.wait_share / P;
    res.overflow = std::max(res.overflow, r.overflow);
  }
  res.latency = ranks[0].latency;
  res.floor_s = percentile(ranks[0].floors, 0.5);
  res.bytes = ranks[0].bytes;
  return res;
}

void BM_decode(benchmark::State& state, bool bounded, bool direct, bool fp8) {
  result r;
  for (auto _ : state) {
    r = run_decode(bounded, direct, fp8);
    if (!r.checked) {
      epx::bench::fail_check(state, ("output check failed: " + r.failure));
      return;
    }
    state.SetIterationTime(percentile(r.latency, 0.5));
  }
  state.counters["median_us"] = percentile(r.latency, 0.5) * 1e6;
  state.counters["p99_us"] = percentile(r.latency, 0.99) * 1e6;
  state.counters["wait_share"] = r.wait_share;
  state.counters["floor_us"] = r.floor_s * 1e6;
  state.counters["MiB_moved"] = r.bytes / (1024.0 * 1024.0);
  state.counters["overflow_pairs"] = static_cast<double>(r.overflow);
  state.counters["checked"] = r.checked ? 1 : 0;
  state.counters["tokens"] = static_cast<double>(g_shape.tokens);
  state.counters["hidden"] = static_cast<double>(g_shape.hidden);
  state.counters["cap"] = bounded ? static_cast<double>(g_shape.cap) : 0.0;
  state.SetLabel(std::string("threads ep=") + std::to_string(g_shape.ep) + (fp8 ? " bf16 layer, fp8 rows out " : " bf16 ") +
                 (bounded ? "bounded" : "normal") + " route=" + (direct ? "direct" : "staged") +
                 (fp8 ? std::string(" (") + epx::exec::to_string(epx::exec::active_host_isa()) + ")" : std::string()));
}

// kernels::quantise_e4m3 on one thread, checked once against the scalar conversion.
void BM_quantise(benchmark::State& state) {
  using T = epx::bf16;
  const std::size_t rows = 1024, H = 7168, blocks = rows * H / epx::kernels::fp8_block;
  const std::vector<T> x = epx::bench::make_rows<T>(rows, H, 0);
  std::vector<epx::fp8_e4m3> q(rows * H);
  std::vector<float> scale(blocks);
  epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), scale.data());
  for (std::size_t b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    for (std::size_t h = 0; h < epx::kernels::fp8_block; ++h)
      amax = std::max(amax, std::fabs(epx::convert<float>(x[b * epx::kernels::fp8_block + h])));
    const float sc = amax > 0.0f ? amax / 448.0f : 1.0f;
    bool same = scale[b] == sc;
    for (std::size_t h = 0; h < epx::kernels::fp8_block && same; ++h) {
      const std::size_t e = b * epx::kernels::fp8_block + h;
      same = q[e].bits == epx::fp8_e4m3(epx::convert<float>(x[e]) / sc).bits;
    }
    if (!same) {
      epx::bench::fail_check(state, "output check failed: block " + std::to_string(b));
      return;
    }
  }
  std::vector<double> ns;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    epx::kernels::quantise_e4m3(epx::exec::serial{}, rows, H, x.data(), q.data(), scale.data());
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(q.data());
    state.SetIterationTime(t);
    ns.push_back(t * 1e9 / static_cast<double>(rows * H));
  }
  std::sort(ns.begin(), ns.end());
  state.counters["ns_per_element"] = ns[ns.size() / 2];
  state.counters["checked"] = 1;
  state.SetLabel(std::string("one thread, host version ") + epx::exec::to_string(epx::exec::active_host_isa()));
}

std::size_t g_dispatch_tokens = 4096;
int g_dispatch_calls = 20;

// The dispatch phase alone, bf16 rows against FP8 rows, alternating in one loop.
void BM_dispatch_fp8_vs_bf16(benchmark::State& state, bool direct) {
  using T = epx::bf16;
  const shape s = g_shape;
  const int P = s.ep;
  std::vector<double> t16, t8;
  std::vector<std::string> failures(static_cast<std::size_t>(P));
  for (auto _ : state) {
    t16.clear();
    t8.clear();
    epx::threads::run(P, [&](epx::threads::communicator& comm) {
      const int r = comm.rank();
      const epx::mesh m = epx::bench::ep_mesh(P, s.experts);
      epx::layer_options o;
      o.hidden = s.hidden;
      o.top_k = s.top_k;
      o.peer_access = direct;
      o.stage_bytes = epx::bench::stage_bytes();
      epx::layer_options o8 = o;
      o8.fp8_dispatch = true;
      const std::size_t n = g_dispatch_tokens, H = s.hidden;
      const auto x = epx::bench::make_rows<T>(n, H, r);
      const auto ids = epx::bench::make_ids(n, s.top_k, s.experts, epx::bench::balanced, r);
      const auto w = epx::bench::make_weights(n, s.top_k, r);
      epx::moe_layer<epx::threads::communicator, T, epx::impl::all_to_all> l16(m, comm, o), l8(m, comm, o8);
      {  // check each layer's full forward once
        std::vector<T> out(n * H);
        epx::bench::identity_experts<T> e16;
        (void)l16.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                          epx::span<T>(out), e16, epx::mode::inference);
        std::string f = epx::bench::check_forward(x.data(), w.data(), out.data(), n, H, s.top_k);
        fp8_identity_experts e8;
        std::fill(out.begin(), out.end(), T{});  // what the bf16 call left would pass the FP8 check
        (void)l8.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                         epx::span<T>(out), e8, epx::mode::inference);
        f += check_fp8_forward(x.data(), w.data(), out.data(), n, H, s.top_k);
        if (l16.stats().peer_access != direct || l8.stats().peer_access != direct)
          f += " a layer did not take the requested route";
        failures[static_cast<std::size_t>(r)] = f;
      }
      auto timed = [&](auto& layer, std::vector<double>& into) {
        comm.barrier();
        const auto t0 = clock_type::now();
        {
          auto h = layer.dispatch(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                                  epx::mode::inference);
          comm.barrier();
          if (r == 0) into.push_back(seconds_since(t0));
        }  // the handle (and its rows) goes back to the layer untimed
      };
      for (int i = 0; i < 2; ++i) {  // warm-up: the layers' pools
        timed(l16, t16);
        timed(l8, t8);
      }
      if (r == 0) {
        t16.clear();
        t8.clear();
      }
      for (int i = 0; i < g_dispatch_calls; ++i) {
        if (i % 2 == 0) {
          timed(l16, t16);
          timed(l8, t8);
        } else {
          timed(l8, t8);
          timed(l16, t16);
        }
      }
    });
    for (const auto& f : failures)
      if (!f.empty()) {
        epx::bench::fail_check(state, ("output check failed: " + f));
        return;
      }
    state.SetIterationTime(percentile(t8, 0.5));
  }
  const double m16 = percentile(t16, 0.5), m8 = percentile(t8, 0.5);
  state.counters["bf16_median_us"] = m16 * 1e6;
  state.counters["fp8_median_us"] = m8 * 1e6;
  state.counters["fp8_over_bf16"] = m16 > 0 ? m8 / m16 : 0.0;
  state.counters["checked"] = 1;
  state.counters["tokens"] = static_cast<double>(g_dispatch_tokens);
  state.counters["hidden"] = static_cast<double>(s.hidden);
  state.SetLabel(std::string("threads ep=") + std::to_string(s.ep) + " dispatch phase, route=" +
                 (direct ? "direct" : "staged") + ", bf16 vs fp8 rows (" +
                 epx::exec::to_string(epx::exec::active_host_isa()) + ")");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool quick = false;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a.rfind("--calls=", 0) == 0) {
      g_calls = std::max(1, std::atoi(a.c_str() + 8));
    } else if (epx::bench::host_isa_flag(a)) {
    } else if (epx::bench::stage_bytes_flag(a)) {
    } else if (epx::bench::stream_threshold_flag(a)) {
    } else if (a.rfind("--dispatch-calls=", 0) == 0) {
      g_dispatch_calls = std::max(1, std::atoi(a.c_str() + 17));
    } else {
      args.push_back(argv[i]);
    }
  }
  if (quick) {
    g_shape.tokens = 8;
    g_shape.hidden = 256;
    g_shape.experts = 32;
    g_shape.top_k = 4;
    g_shape.cap = 8;
    g_calls = 5;
    g_dispatch_tokens = 64;
    g_dispatch_calls = 3;
  }
  for (bool direct : {true, false})
    for (bool bounded : {false, true}) {
      const std::string name = std::string("decode/bf16/") + (bounded ? "bounded" : "normal") + "/" +
                               (direct ? "direct" : "staged");
      benchmark::RegisterBenchmark(name.c_str(), BM_decode, bounded, direct, false)
          ->UseManualTime()
          ->Iterations(1)
          ->Unit(benchmark::kMicrosecond);
    }
  for (bool direct : {true, false})
    benchmark::RegisterBenchmark((std::string("decode/fp8/normal/") + (direct ? "direct" : "staged")).c_str(), BM_decode,
                                 false, direct, true)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMicrosecond);
  for (bool direct : {true, false})
    benchmark::RegisterBenchmark((std::string("dispatch/bf16-vs-fp8/") + (direct ? "direct" : "staged") +
                                  "/tokens:" + std::to_string(g_dispatch_tokens))
                                     .c_str(),
                                 BM_dispatch_fp8_vs_bf16, direct)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("quantise/bf16/rows:1024/hidden:7168", BM_quantise)
      ->UseManualTime()
      ->Iterations(quick ? 3 : 30)
      ->Unit(benchmark::kMicrosecond);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;  // a mistyped flag is not ignored
  benchmark::AddCustomContext("stream_threshold", std::to_string(epx::exec::stream_threshold()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
