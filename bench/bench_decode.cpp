// A decode step of the MoE layer over the threads communicator: 128 tokens x 7168 hidden,
// top-8 of 256 experts, ep = 8 (one rank per thread), bf16, inference forward with identity
// experts in place; the normal mode against bounded mode (layer_options::counts ==
// count_exchange::device, spec section 11), each on the direct route (peer reads, the
// threads default) and on the staged route (layer_options::peer_access = false).
//
//   ./bench_decode --benchmark_out=decode.json --benchmark_out_format=json
//   ./bench_decode --calls=50 --benchmark_filter=bounded     # fewer calls, one mode
//   ./bench_decode --quick                                   # seconds (bench-smoke): 8 tokens, H = 256
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
// The label names the backend, element type, mode and route.
//
// FP8 dispatch (spec section 12, layer_options::fp8_dispatch; the staged route, normal
// mode: bounded mode carries rows in the layer's type):
//   decode/fp8/normal/staged   the decode step above with E4M3 rows and per-128 scales on
//                              the way out (experts dequantise), checked against the
//                              unquantised output within the E4M3 bound; its floor counts
//                              the FP8 route's bytes (route_rows)
//   dispatch/bf16-vs-fp8/staged/tokens:4096
//                              the dispatch phase alone (moe_layer::dispatch: plan, count
//                              exchange, rows to the experts' owners) at 4096 tokens, bf16
//                              rows against FP8 rows, alternating in one loop (`--dispatch-calls`,
//                              default 20); counters bf16_median_us, fp8_median_us and
//                              fp8_over_bf16 (target 0.65); each layer's full forward checked once
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
#include "layer_common.hpp"
#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// The threads communicator with the time spent inside it counted (peer access: the time
// outside the caller's function, i.e. the barriers around it).
class timed_comm {
 public:
  using peer_pointers = epx::threads::communicator::peer_pointers;
  timed_comm(epx::threads::communicator c, std::shared_ptr<double> waited)
      : c_(std::move(c)), waited_(std::move(waited)) {}
  int rank() const noexcept { return c_.rank(); }
  int size() const noexcept { return c_.size(); }
  timed_comm split(int color, int key) const { return timed_comm(c_.split(color, key), waited_); }
  void all_to_all(const void* s, void* r, std::size_t n, epx::datatype t) {
    timed([&] { c_.all_to_all(s, r, n, t); });
  }
  void all_to_allv(const void* s, const std::size_t* sc, const std::size_t* sd, void* r, const std::size_t* rc,
                   const std::size_t* rd, epx::datatype t) {
    timed([&] { c_.all_to_allv(s, sc, sd, r, rc, rd, t); });
  }
  void all_reduce(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    timed([&] { c_.all_reduce(s, r, n, t, scale); });
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    timed([&] { c_.reduce_scatter(s, r, n, t, scale); });
  }
  void all_gather(const void* s, void* r, std::size_t n, epx::datatype t) {
    timed([&] { c_.all_gather(s, r, n, t); });
  }
  void broadcast(void* d, std::size_t n, epx::datatype t, int root) { timed([&] { c_.broadcast(d, n, t, root); }); }
  void barrier() { timed([&] { c_.barrier(); }); }
  template <class F>
  void access_peers(const void* const* mine, const std::size_t* bytes, std::size_t count, F&& f) {
    double inside = 0;
    const auto t0 = clock_type::now();
    c_.access_peers(mine, bytes, count, [&](const peer_pointers& p) {
      const auto t1 = clock_type::now();
      f(p);
      inside += seconds_since(t1);
    });
    *waited_ += seconds_since(t0) - inside;
  }

 private:
  template <class F>
  void timed(F&& f) {
    const auto t0 = clock_type::now();
    f();
    *waited_ += seconds_since(t0);
  }
  epx::threads::communicator c_;
  std::shared_ptr<double> waited_;
};
static_assert(epx::has_peer_access_v<timed_comm>);

struct shape {
  std::size_t tokens = 128, hidden = 7168;
  int top_k = 8, experts = 256, ep = 8;
  std::int64_t cap = 16;
};
shape g_shape;
int g_calls = 300;

struct result {
  std::vector<double> latency;  // seconds per call
  double wait_share = 0, floor_s = 0, bytes = 0;
  std::int64_t overflow = 0;
  bool checked = true;
  std::string failure;
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Rows each rank reads plus writes per call (identity experts in place move nothing):
//   direct  pull 2R, combine S + n
//   staged  gather 2S, all-to-all out (the threads all-to-all copies what each rank
//           receives: normal 2R, bounded the fixed slabs 2*ep*slab), unpack 2R (bounded)
//           or padding P (normal), pack 2R (bounded), all-to-all back (as out), combine S + n
//   fp8     (staged, normal) quantise n rows (read n, write n/2), gather S/2 + S/2, all-to-all
//           out R/2 + R/2, padding P/2, experts dequantise (read R/2, write R), all-to-all
//           back 2R, combine S + n (in rows of T; E4M3 rows are half as wide; scales left out)
// S = n*k pairs sent, R = rows received (mean over ranks: S), slab = hdr + L*cap.
double route_rows(const shape& s, bool bounded, bool direct, bool fp8 = false) {
  const double n = static_cast<double>(s.tokens), S = n * s.top_k, R = S;
  if (fp8) return 1.5 * n + S + R + 0.5 * (s.experts / s.ep) + 1.5 * R + 2 * R + S + n;
  if (direct) return 2 * R + S + n;
  const int L = s.experts / s.ep;
  const double slab = 1.0 + static_cast<double>(L) * static_cast<double>(s.cap);
  const double moved = bounded ? 2.0 * s.ep * slab : 2 * R;
  const double pack = bounded ? 4 * R : static_cast<double>(L);
  return 2 * S + 2 * moved + pack + S + n;
}

// Identity experts for FP8 rows: out = float(q) * scale, rounded to T (the library's
// dequantisation, epx::kernels::dequantise_e4m3).
struct fp8_identity_experts {
  using T = epx::bf16;
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const epx::fp8_e4m3>& in, const float* scales, T* out) {
    epx::kernels::dequantise_e4m3(ex, in.num_rows, in.hidden, in.rows, scales, out);
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* g, T* gi) {
    if (in.num_rows) std::memcpy(gi, g, in.num_rows * in.hidden * sizeof(T));
  }
};

// out against sum_j w_j x[t] within the E4M3 bound: each element of x' is within |x|/16
// plus half a subnormal step of its block (scale * 2^-10) of x, then the bf16 roundings.
std::string check_fp8_forward(const epx::bf16* x, const float* w, const epx::bf16* out, std::size_t n, std::size_t H,
                              int k) {
  for (std::size_t t = 0; t < n; ++t) {
    for (std::size_t b0 = 0; b0 < H; b0 += 128) {
      double amax = 0;
      for (std::size_t h = b0; h < b0 + 128; ++h) amax = std::max(amax, std::fabs(epx::convert<double>(x[t * H + h])));
      const double scale = amax / 448.0;
      for (std::size_t h = b0; h < b0 + 128; ++h) {
        const double xv = epx::convert<double>(x[t * H + h]);
        double ref = 0, sw = 0;
        for (int j = 0; j < k; ++j) {
          ref += static_cast<double>(w[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)]) * xv;
          sw += std::fabs(w[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)]);
        }
        const double bound = sw * (std::fabs(xv) / 16 + scale * 0x1p-10) * (1 + 0x1p-7) + std::fabs(ref) * 0x1p-7 + 1e-30;
        const double got = epx::convert<double>(out[t * H + h]);
        if (!(std::fabs(got - ref) <= bound))
          return epx::detail::concat("fp8 out[", t, ",", h, "] = ", got, ", expected ", ref, " within ", bound);
      }
    }
  }
  return {};
}

// One decode measurement: bounded or normal mode, direct or staged route, bf16 rows or
// (fp8: normal mode, staged route) E4M3 rows with experts that dequantise.
result run_decode(bool bounded, bool direct, bool fp8 = false) {
  using T = epx::bf16;
  const shape s = g_shape;
  const int P = s.ep;
  result res;
  std::vector<double> wait_sum(static_cast<std::size_t>(P), 0.0);
  std::vector<std::string> failures(static_cast<std::size_t>(P));
  std::vector<std::int64_t> overflow(static_cast<std::size_t>(P), 0);
  std::vector<double> floors;
  epx::threads::run(P, [&](epx::threads::communicator& world) {
    const int r = world.rank();
    auto waited = std::make_shared<double>(0.0);
    timed_comm comm(world.split(0, r), waited);
    epx::mesh_config mc;
    mc.fsdp = P;
    mc.ep = P;
    mc.experts = s.experts;
    const epx::mesh m(mc);
    epx::layer_options o;
    o.hidden = s.hidden;
    o.top_k = s.top_k;
    o.peer_access = direct && !fp8;
    o.fp8_dispatch = fp8;
    epx::layer_options ob = o;
    ob.counts = epx::count_exchange::device;
    ob.bound.cap = s.cap;
    const std::size_t n = s.tokens, H = s.hidden, k = static_cast<std::size_t>(s.top_k);
    const auto x = epx::bench::make_rows<T>(n, H, r);
    const auto ids = epx::bench::make_ids(n, s.top_k, s.experts, epx::bench::balanced, r);
    const auto w = epx::bench::make_weights(n, s.top_k, r);
    std::vector<T> out(n * H), ref(n * H);
    epx::bench::identity_experts<T> experts;
    fp8_identity_experts experts8;
    epx::moe_layer<timed_comm, T, epx::impl::all_to_all> layer(m, comm, bounded ? ob : o);
    auto call = [&](std::vector<T>& y) {
      if (fp8)
        (void)layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                            epx::span<T>(y), experts8, epx::mode::inference);
      else
        (void)layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                            epx::span<T>(y), experts, epx::mode::inference);
    };
    // Check once: against the direct computation (FP8: within the E4M3 bound), and bounded
    // against the normal mode.
    call(out);
    std::string f = fp8 ? check_fp8_forward(x.data(), w.data(), out.data(), n, H, s.top_k)
                        : epx::bench::check_forward(x.data(), w.data(), out.data(), n, H, s.top_k);
    if (bounded) {
      epx::moe_layer<timed_comm, T, epx::impl::all_to_all> normal(m, comm, o);
      (void)normal.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<T>(ref), experts, epx::mode::inference);
      if (std::memcmp(out.data(), ref.data(), out.size() * sizeof(T)) != 0)
        f += " bounded output differs bitwise from the normal mode's";
    }
    failures[static_cast<std::size_t>(r)] = f;
    for (int i = 0; i < 10; ++i) call(out);
    std::vector<double> lat;
    double share = 0;
    for (int i = 0; i < g_calls; ++i) {
      world.barrier();
      *waited = 0;
      const auto t0 = clock_type::now();
      call(out);
      const double mine = seconds_since(t0);
      world.barrier();
      const double total = seconds_since(t0);
      lat.push_back(total);
      share += mine > 0 ? *waited / total : 0;
    }
    wait_sum[static_cast<std::size_t>(r)] = share / g_calls;
    if (bounded) overflow[static_cast<std::size_t>(r)] = layer.check().overflow_pairs;
    // The memcpy floor of the route's bytes.
    const std::size_t bytes = static_cast<std::size_t>(route_rows(s, bounded, direct && !fp8, fp8) * static_cast<double>(H) *
                                                       sizeof(T) / 2.0);  // a memcpy of B reads B and writes B
    const std::size_t chunk = std::min<std::size_t>(bytes, std::size_t{16} << 20);  // copied again until done
    std::vector<unsigned char> a(chunk, 1), b(chunk);
    std::vector<double> fl;
    for (int i = 0; i < 20; ++i) {
      world.barrier();
      const auto t0 = clock_type::now();
      for (std::size_t done = 0; done < bytes; done += chunk)
        std::memcpy(b.data(), a.data(), std::min(chunk, bytes - done));
      benchmark::DoNotOptimize(b.data());
      world.barrier();
      fl.push_back(seconds_since(t0));
    }
    if (r == 0) {
      res.latency = lat;
      floors = fl;
      res.bytes = 2.0 * static_cast<double>(bytes);
    }
  });
  for (const auto& f : failures)
    if (!f.empty()) {
      res.checked = false;
      res.failure = f;
    }
  for (double v : wait_sum) res.wait_share += v / P;
  for (auto v : overflow) res.overflow = std::max(res.overflow, v);
  res.floor_s = percentile(floors, 0.5);
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
                 (bounded ? "bounded" : "normal") + " route=" + (direct && !fp8 ? "direct" : "staged"));
}

std::size_t g_dispatch_tokens = 4096;
int g_dispatch_calls = 20;

// The dispatch phase alone, bf16 rows against FP8 rows, alternating in one loop.
void BM_dispatch_fp8_vs_bf16(benchmark::State& state) {
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
      epx::mesh_config mc;
      mc.fsdp = P;
      mc.ep = P;
      mc.experts = s.experts;
      const epx::mesh m(mc);
      epx::layer_options o;
      o.hidden = s.hidden;
      o.top_k = s.top_k;
      o.peer_access = false;  // the staged route, the one FP8 takes
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
        (void)l8.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                         epx::span<T>(out), e8, epx::mode::inference);
        f += check_fp8_forward(x.data(), w.data(), out.data(), n, H, s.top_k);
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
  state.SetLabel(std::string("threads ep=") + std::to_string(s.ep) + " dispatch phase, staged route, bf16 vs fp8 rows");
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
  benchmark::RegisterBenchmark("decode/fp8/normal/staged", BM_decode, false, false, true)
      ->UseManualTime()
      ->Iterations(1)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark(("dispatch/bf16-vs-fp8/staged/tokens:" + std::to_string(g_dispatch_tokens)).c_str(),
                               BM_dispatch_fp8_vs_bf16)
      ->UseManualTime()
      ->Iterations(1)
      ->Unit(benchmark::kMicrosecond);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
