// The MoE layer's routes, stages and round trips over the threads communicator, against
// the plain memcpy of the bytes each route reads and writes and against the hand-written
// baseline (bench/baseline.hpp), in the same iteration loop.
//
//   ./bench_layer --benchmark_out=layer.json --benchmark_out_format=json   # the registered set
//   ./bench_layer --quick                                                  # seconds (bench-smoke)
//   ./bench_layer --benchmark_filter='route<bf16>/staged/fwd'              # any filter
//   ./bench_layer --gathered ...     # staged sends gather first (layer_options::indexed_sends = false)
//
// Every rank is a thread of epx::threads::run with its own exec::serial policy; rank 0
// drives Google Benchmark's loop, the other ranks follow. One iteration runs every call of
// the benchmark (epx's layer, the baseline, epx's staged route decomposed into its stages),
// each between two barriers and timed on rank 0 (until the slowest rank is done), in an
// order that rotates from one iteration to the next; then the floor: every rank memcpys
// half the bytes its epx call reads plus writes (a memcpy of B bytes reads B and writes B),
// all ranks at once, barrier to barrier. So the memcpy rate is measured in the same run,
// with as many threads copying at the same time.
//
// Bytes a route reads plus writes, per rank, in rows of H elements (S = n*k rows this rank
// sends, its own included; R = rows its experts get, padding P included; Rr = R - P;
// identity experts that run in place move nothing in forward and copy R rows in backward):
//   staged forward   padding P, dispatch 2Rr (rows by index straight from x), return 2S,
//                    combine S + n; with --gathered (layer_options::indexed_sends = false)
//                    also gather 2S
//   direct forward   pull 2Rr + P (rows straight from the senders' x), combine S + n
//   staged backward  grad rows 2S, weight-gradient dots 2S, padding P, dispatch 2Rr,
//                    experts 2R, return 2S, reduce S + n
//   direct backward  pull Rr + R, dots 2S, experts 2R, reduce S + n
//   baseline fwd     gather 2S, dispatch 2Rr, return 2S, un-permute 2S, sum S + n
//   baseline bwd     grad rows 2S, dots 2S, dispatch 2Rr, experts 2Rr, return 2S,
//                    un-permute 2S, sum S + n
//   masked forward   gather 2Rr + P, combine Rr + N, all-reduce of [N, H] 3N + N/ep
// (the threads all-to-all pulls: each rank copies what it receives). A TP group of size tp
// > 1 adds the all-reduce of the output, 3N + N/tp.
//
// Every benchmark checks its outputs once against a direct computation (identity experts:
// out[t] = sum_j w[t,j] x[t]; grad_x[t] = sum_j round(w[t,j] grad_out[t]); grad_w[t,j] =
// <x[t], grad_out[t]>) within the rounding bound of the arithmetic, and fails otherwise.
//
// Counters (medians over the iterations; see bench/README.md):
//   epx_ms, floor_ms, floor_ratio, floor_bytes, memcpy_GB/s, GB/s
//   baseline_ms, baseline_floor_ratio, speedup_vs_baseline (median / median of the same
//   iterations), speedup_paired (median of the per-iteration ratios)
//   gathered_ms, speedup_vs_gathered(_paired): the same layer with gather-first sends
//   (layer_options::indexed_sends = false) in the same loop (staged and per-rank routes
//   of register_shape)
//   stage:<name>_ms (epx's staged route decomposed), baseline:<name>_ms, stages_ms
//   rows_sent, rows_sent_remote, rows_per_rank_mode, repeat_fraction (per rank, mean)
//   extra_MiB, allowance_MiB, extra_vs_allowance (peak heap beyond inputs and outputs)
//   checked (1: the outputs matched the direct computation)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "baseline.hpp"
#include "check_failed.hpp"
#include "layer_common.hpp"
#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"

// --- heap accounting and caching -----------------------------------------------------------
// Every operator new of this binary goes through a 64-byte header (keeping the cache-line
// alignment malloc gives) that records the size, so a thread can count the bytes it has
// live while a call runs and the peak. A rank is a thread, so the per-thread peak is the
// rank's peak.
//
// Blocks of 1 MiB and more are kept on free release and handed out again for the same size
// (`--heap=cache`, the default), as a framework's caching allocator (or a device's
// stream-ordered pool) does: the layer allocates its row buffers per call, and glibc maps
// blocks that large fresh from the kernel every time, so without a cache every call pays
// a page fault per 4 KiB of every buffer (`--heap=system` shows that cost). The cache is
// emptied before every benchmark.
namespace heap {
constexpr std::size_t header = 64;
constexpr std::size_t cache_min = std::size_t{1} << 20;
thread_local bool tracking = false;
thread_local std::int64_t live = 0;
thread_local std::int64_t peak = 0;
bool caching = true;
std::mutex cache_mutex;
std::multimap<std::size_t, void*>* cache = nullptr;  // block bytes -> block (never destroyed)

inline std::size_t block_bytes(std::size_t n) { return (n + 2 * header - 1) / header * header; }

inline void* allocate(std::size_t n) {
  const std::size_t b = block_bytes(n);
  void* p = nullptr;
  if (caching && b >= cache_min) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache != nullptr) {
      auto it = cache->find(b);
      if (it != cache->end()) {
        p = it->second;
        cache->erase(it);
      }
    }
  }
  if (p == nullptr) p = std::aligned_alloc(header, b);
  if (p == nullptr) throw std::bad_alloc();
  auto* h = static_cast<std::int64_t*>(p);
  h[0] = static_cast<std::int64_t>(n);
  h[1] = tracking ? 1 : 0;
  if (tracking) {
    live += static_cast<std::int64_t>(n);
    peak = std::max(peak, live);
  }
  return static_cast<char*>(p) + header;
}
inline void release(void* q) noexcept {
  if (q == nullptr) return;
  void* p = static_cast<char*>(q) - header;
  const auto* h = static_cast<const std::int64_t*>(p);
  const auto n = static_cast<std::size_t>(h[0]);
  if (tracking && h[1] != 0) live -= static_cast<std::int64_t>(n);
  const std::size_t b = block_bytes(n);
  if (caching && b >= cache_min) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache == nullptr) {
      void* m = std::malloc(sizeof(std::multimap<std::size_t, void*>));
      if (m != nullptr) cache = ::new (m) std::multimap<std::size_t, void*>();
    }
    if (cache != nullptr) {
      try {
        cache->emplace(b, p);  // the map's own nodes are small: plain allocations
        return;
      } catch (...) {
      }
    }
  }
  std::free(p);
}
// Frees every cached block.
inline void trim() noexcept {
  std::multimap<std::size_t, void*> blocks;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache == nullptr) return;
    blocks.swap(*cache);
  }
  for (auto& b : blocks) std::free(b.second);
}
inline void begin() noexcept {
  live = 0;
  peak = 0;
  tracking = true;
}
// Peak bytes allocated (and not yet freed) since begin().
inline std::int64_t end() noexcept {
  tracking = false;
  return peak;
}
}  // namespace heap

void* operator new(std::size_t n) { return heap::allocate(n); }
void* operator new[](std::size_t n) { return heap::allocate(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return heap::allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return heap::allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { heap::release(p); }
void operator delete[](void* p) noexcept { heap::release(p); }
void operator delete(void* p, std::size_t) noexcept { heap::release(p); }
void operator delete[](void* p, std::size_t) noexcept { heap::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { heap::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { heap::release(p); }

namespace {

using namespace epx::bench;
using clock_type = std::chrono::steady_clock;
using epx::bf16;

double seconds_since(clock_type::time_point t0, clock_type::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

template <class T>
const char* type_name() {
  return std::is_same_v<T, bf16> ? "bf16" : "f32";
}

// --- the driver -------------------------------------------------------------------------------
// One measured call of a benchmark: `prepare` runs untimed before it (e.g. the training
// forward before a backward); `stages` returns this rank's stage times of the last run
// (seconds, `stage_names.size()` of them) when the call records them.
struct call {
  std::string name;
  std::function<void()> prepare;
  std::function<void()> run;
  std::vector<std::string> stage_names;
  std::function<const double*()> stages;
};

struct rank_work {
  std::vector<call> calls;                 // calls[0] is epx's (floor, heap peak)
  std::vector<std::size_t> floor_parts;    // bytes of each memcpy of the floor
  double traffic = 0;                      // bytes calls[0] reads plus writes on this rank
  std::string check;                       // a failed output check, or empty
  std::vector<double> counters;            // per-rank values summed over ranks (see drive's caller)
  std::string label;                       // the backend and route taken (rank 0's is reported)
};

struct call_result {
  std::string name;
  std::vector<double> times;                 // [iterations] slowest rank
  std::vector<std::string> stage_names;
  std::vector<std::vector<double>> stages;   // [stage][iteration] slowest rank
};

struct run_result {
  std::vector<call_result> calls;
  std::vector<double> floor_times;
  double traffic = 0;                     // all ranks
  std::vector<std::int64_t> extra;       // [ranks] peak heap bytes during one epx call
  std::vector<std::int64_t> allowance;   // [ranks] expert-major buffer bytes
  std::vector<double> counters;          // summed over ranks
  std::string check;                     // the first failed check
  std::string label;                     // rank 0's rank_work::label
};

// Two buffers the floor copies between, in pieces of at most `cap` bytes (a copy that large
// runs from memory as a larger one would), alternating direction.
struct floor_buffers {
  static constexpr std::size_t cap = std::size_t{64} << 20;
  std::vector<char> a, b;
  explicit floor_buffers(std::size_t max_part)
      : a(std::max<std::size_t>(std::min(max_part, cap), 1), 1), b(a.size(), 2) {}
  void copy(const std::vector<std::size_t>& parts) {
    bool dir = false;
    for (std::size_t n : parts) {
      while (n > 0) {
        const std::size_t m = std::min(n, a.size());
        std::memcpy(dir ? a.data() : b.data(), dir ? b.data() : a.data(), m);
        dir = !dir;
        n -= m;
      }
    }
    benchmark::DoNotOptimize(a.data());
    benchmark::DoNotOptimize(b.data());
  }
};

// `make(comm, allowance&)` builds a rank's work (collective calls allowed). Each call runs
// once untimed first (the epx call's heap peak is counted there).
template <class Make>
run_result drive(benchmark::State& state, int ranks, Make&& make) {
  run_result r;
  r.extra.assign(static_cast<std::size_t>(ranks), 0);
  r.allowance.assign(static_cast<std::size_t>(ranks), 0);
  std::vector<rank_work*> works(static_cast<std::size_t>(ranks), nullptr);
  std::vector<double> traffic(static_cast<std::size_t>(ranks), 0.0);
  std::atomic<bool> go{false};
  heap::trim();  // the previous benchmark's blocks
  epx::threads::run(ranks, [&](epx::threads::communicator& comm) {
    const auto me = static_cast<std::size_t>(comm.rank());
    rank_work w = make(comm, r.allowance[me]);
    works[me] = &w;
    if (me == 0) r.label = w.label;
    traffic[me] = w.traffic;
    std::size_t max_part = 1;
    for (auto p : w.floor_parts) max_part = std::max(max_part, p);
    floor_buffers fl(max_part);
    const std::size_t nc = w.calls.size();
    if (me == 0) {
      r.calls.resize(nc);
      for (std::size_t c = 0; c < nc; ++c) {
        r.calls[c].name = w.calls[c].name;
        r.calls[c].stage_names = w.calls[c].stage_names;
        r.calls[c].stages.resize(w.calls[c].stage_names.size());
      }
    }
    // Warm-up; the first epx call also counts the heap peak.
    for (std::size_t c = 0; c < nc; ++c) {
      if (w.calls[c].prepare) w.calls[c].prepare();
      comm.barrier();
      if (c == 0) heap::begin();
      w.calls[c].run();
      if (c == 0) r.extra[me] = heap::end();
      comm.barrier();
    }
    fl.copy(w.floor_parts);
    comm.barrier();
    std::size_t it = 0;
    auto iteration = [&](bool timed) {
      for (std::size_t i = 0; i < nc; ++i) {
        const std::size_t c = (i + it) % nc;  // the order rotates
        if (w.calls[c].prepare) w.calls[c].prepare();
        comm.barrier();
        const auto t0 = clock_type::now();
        w.calls[c].run();
        comm.barrier();
        const auto t1 = clock_type::now();
        if (timed) {
          r.calls[c].times.push_back(seconds_since(t0, t1));
          if (c == 0) state.SetIterationTime(seconds_since(t0, t1));
        }
      }
      if (timed) {  // every rank waits at the next barrier: their stage times are stable
        for (std::size_t c = 0; c < nc; ++c)
          for (std::size_t s = 0; s < r.calls[c].stages.size(); ++s) {
            double mx = 0;
            for (auto* o : works) mx = std::max(mx, o->calls[c].stages()[s]);
            r.calls[c].stages[s].push_back(mx);
          }
      }
      comm.barrier();
      const auto f0 = clock_type::now();
      fl.copy(w.floor_parts);
      comm.barrier();
      if (timed) r.floor_times.push_back(seconds_since(f0, clock_type::now()));
      ++it;
    };
    if (me == 0) {
      for (auto _ : state) {
        go.store(true);
        comm.barrier();
        iteration(true);
      }
      go.store(false);
      comm.barrier();
    } else {
      for (;;) {
        comm.barrier();
        if (!go.load()) break;
        iteration(false);
      }
    }
    comm.barrier();  // nobody reads `w` after this
    {
      static std::mutex m;
      std::lock_guard<std::mutex> lock(m);
      if (r.check.empty() && !w.check.empty()) r.check = epx::detail::concat("rank ", me, ": ", w.check);
      if (r.counters.size() < w.counters.size()) r.counters.resize(w.counters.size(), 0.0);
      for (std::size_t i = 0; i < w.counters.size(); ++i) r.counters[i] += w.counters[i];
    }
    comm.barrier();
  });
  for (double b : traffic) r.traffic += b;
  return r;
}

// --- results for the summary table ----------------------------------------------------------
struct summary_row {
  std::string name;
  double ms = 0, floor_ratio = 0, floor_mib = 0, baseline_ms = 0, speedup = 0;
  double extra_mib = 0, allowance_mib = 0, rows_sent = 0, repeat = 0;
  std::string stages;
};
std::mutex g_mutex;
std::vector<summary_row> g_rows;
std::string g_current_name;  // the running benchmark's name

void add_row(const summary_row& row) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& r : g_rows)
    if (r.name == row.name) {
      r = row;
      return;
    }
  g_rows.push_back(row);
}

void set_floor_counters(benchmark::State& state, const run_result& r, summary_row& row) {
  const double t = median(r.calls.at(0).times), f = median(r.floor_times);
  state.counters["epx_ms"] = t * 1e3;
  state.counters["floor_ms"] = f * 1e3;
  state.counters["floor_bytes"] = r.traffic;
  state.counters["GB/s"] = t > 0 ? r.traffic / t * 1e-9 : 0.0;
  state.counters["memcpy_GB/s"] = f > 0 ? r.traffic / f * 1e-9 : 0.0;
  state.counters["floor_ratio"] = f > 0 ? t / f : 0.0;
  row.ms = t * 1e3;
  row.floor_ratio = f > 0 ? t / f : 0.0;
  row.floor_mib = r.traffic / (1 << 20);
}

void set_memory_counters(benchmark::State& state, const run_result& r, summary_row& row) {
  std::int64_t mx = 0, al = 0;
  double ratio = 0;
  for (std::size_t i = 0; i < r.extra.size(); ++i) {
    mx = std::max(mx, r.extra[i]);
    al = std::max(al, r.allowance[i]);
    if (r.allowance[i] > 0) ratio = std::max(ratio, static_cast<double>(r.extra[i]) / static_cast<double>(r.allowance[i]));
  }
  state.counters["extra_MiB"] = static_cast<double>(mx) / (1 << 20);
  state.counters["allowance_MiB"] = static_cast<double>(al) / (1 << 20);
  state.counters["extra_vs_allowance"] = ratio;
  row.extra_mib = static_cast<double>(mx) / (1 << 20);
  row.allowance_mib = static_cast<double>(al) / (1 << 20);
}

// --- shapes ------------------------------------------------------------------------------------
struct shape {
  int ep = 8;
  std::size_t tokens = 4096;  // per rank
  std::size_t hidden = 4096;
  int k = 8;
  int experts = 64;
  routing_kind routing = balanced;

  std::string str() const {
    return epx::detail::concat("ep:", ep, "/tokens:", tokens, "/hidden:", hidden, "/k:", k, "/experts:", experts,
                               "/", routing == balanced ? "balanced" : "zipf");
  }
  std::size_t pairs() const { return tokens * static_cast<std::size_t>(k); }
};

// Iterations: about `budget` seconds of measured time, at least `lo`, from a rough estimate
// of 2 GB/s per core on this kind of machine.
int iterations_for(double total_bytes, double budget = 1.0, double lo = 3.0) {
  const double est = std::max(1e-5, total_bytes / 2e9);
  return static_cast<int>(std::clamp(budget / est, lo, 2000.0));
}

// --- layout: counting sort against argsort, one rank (one thread) ------------------------
void bench_layout(benchmark::State& state, shape s) {
  const auto ids = make_ids(s.tokens, s.k, s.experts, s.routing, 0);
  const auto w = make_weights(s.tokens, s.k, 0);
  epx::bench::baseline_layout base;
  const epx::exec::serial ex;
  std::vector<double> t_epx, t_base;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    auto plan = epx::layout::build_plan(ex, ids.data(), w.data(), s.tokens, s.k, s.experts, 1);
    benchmark::DoNotOptimize(plan.pos.data());
    const auto t1 = clock_type::now();
    base.build(ids.data(), s.pairs(), s.experts, s.ep);
    benchmark::DoNotOptimize(base.order.data());
    const auto t2 = clock_type::now();
    t_epx.push_back(seconds_since(t0, t1));
    t_base.push_back(seconds_since(t1, t2));
    state.SetIterationTime(seconds_since(t0, t1));
  }
  // Checked once against the baseline's stable argsort (a direct computation of the same
  // order): pair order[p] goes to send position p, row order[p] / k, and both count the
  // same pairs per expert.
  {
    auto plan = epx::layout::build_plan(ex, ids.data(), w.data(), s.tokens, s.k, s.experts, 1);
    base.build(ids.data(), s.pairs(), s.experts, s.ep);
    const auto K = static_cast<std::int64_t>(s.k);
    std::vector<std::int64_t> count(static_cast<std::size_t>(s.experts), 0);
    for (auto e : ids) ++count[static_cast<std::size_t>(e)];
    bool ok = true;
    for (std::size_t p = 0; p < s.pairs() && ok; ++p) {
      const auto i = static_cast<std::size_t>(base.order[p]);
      ok = plan.pos.data()[i] == static_cast<std::int64_t>(p) && plan.src_row.data()[p] == base.order[p] / K;
    }
    for (std::size_t e = 0; e < count.size() && ok; ++e) ok = plan.host_counts[e] == count[e];
    if (!ok) {
      epx::bench::fail_check(state, "output check failed: the plan differs from the stable argsort by expert");
      return;
    }
  }
  const double te = median(t_epx), tb = median(t_base);
  state.SetLabel("one thread, counting sort (layout::build_plan)");
  state.counters["checked"] = 1;
  state.counters["pairs/s"] = static_cast<double>(s.pairs()) / te;
  state.counters["baseline_pairs/s"] = static_cast<double>(s.pairs()) / tb;
  state.counters["speedup_vs_baseline"] = tb / te;
  summary_row row;
  row.name = g_current_name;
  row.ms = te * 1e3;
  row.baseline_ms = tb * 1e3;
  row.speedup = tb / te;
  add_row(row);
}

// --- the staged route decomposed into its stages ------------------------------------------
// The calls impl::all_to_all's staged route makes, in its order, with a clock between the
// stages: forward plan + count exchange + receive layout, zero padding, dispatch (rows by
// index straight from x; with --gathered: gather and zero padding, dispatch from the send
// buffer), (identity experts in place), return, combine; backward grad rows (w * grad_out
// in send order), weight-gradient dots, dispatch, experts (a copy), return, reduce. Its
// total is what the layer's staged route costs without the layer's own checks and stats.
template <class T>
struct staged_pipeline {
  static constexpr const char* forward_stages[] = {"plan_counts", "padding", "dispatch", "return", "combine"};
  static constexpr const char* gathered_forward_stages[] = {"plan_counts", "gather", "dispatch", "return", "combine"};
  static constexpr const char* backward_stages[] = {"grad_rows", "weight_grads", "dispatch", "experts", "return",
                                                    "reduce"};
  epx::exec::serial ex;
  epx::layout::send_plan<epx::exec::serial> plan;
  epx::detail::receive_layout lay;
  epx::detail::segments seg;
  epx::exec::host_buffer<T> send, recv, grad_recv, grad_in;
  std::vector<float> w_send;
  epx::bench::stage_clock clock;
  std::size_t n = 0, H = 0;
  int k = 0, L = 0;

  template <class Comm>
  void forward(Comm& comm, const T* x, const std::int32_t* ids, const float* w, std::size_t n_, std::size_t H_, int k_,
               int E, T* out) {
    clock.start();
    n = n_;
    H = H_;
    k = k_;
    const int ep = comm.size(), me = comm.rank();
    L = E / ep;
    const std::size_t S = n * static_cast<std::size_t>(k);
    plan = epx::layout::build_plan(ex, ids, w, n, k, E, 1);
    const auto g = epx::detail::exchange_records(comm, 0, n, H, k, me, plan.host_counts.data(),
                                                 static_cast<std::size_t>(E), "", "bench", 1);
    lay = epx::detail::make_receive_layout(ep, ep, L, epx::padding{}, [&](int r) { return g.counts(r); });
    seg = epx::detail::segments_of(lay, me);
    const std::size_t R = lay.rows(me);
    send.reserve_discard(S * H);
    recv.reserve_discard(R * H);
    w_send.resize(S);
    epx::kernels::scatter(ex, S, static_cast<const std::int64_t*>(plan.pos.data()), w, w_send.data());
    clock.lap();
    const auto* src_row = static_cast<const std::int64_t*>(plan.src_row.data());
    if (epx::bench::gathered()) epx::kernels::gather(ex, S, H, x, src_row, send.data());
    epx::detail::zero_padding(ex, recv.data(), lay, me, H);
    clock.lap();
    if (epx::bench::gathered())
      epx::all_to_allv_segments(comm, static_cast<const T*>(send.data()), epx::make_span(seg.send_counts),
                                epx::make_span(seg.send_displs), recv.data(), epx::make_span(seg.recv_counts),
                                epx::make_span(seg.recv_displs), static_cast<std::size_t>(L), H);
    else
      epx::all_to_allv_indexed(comm, epx::span<const T>(x, n * H), epx::span<const std::int64_t>(src_row, S),
                               epx::make_span(seg.send_counts),
                               epx::make_span(seg.send_displs), recv.data(), epx::make_span(seg.recv_counts),
                               epx::make_span(seg.recv_displs), static_cast<std::size_t>(L), H);
    clock.lap();
    epx::all_to_allv_segments(comm, static_cast<const T*>(recv.data()), epx::make_span(seg.recv_counts),
                              epx::make_span(seg.recv_displs), send.data(), epx::make_span(seg.send_counts),
                              epx::make_span(seg.send_displs), static_cast<std::size_t>(L), H);
    clock.lap();
    epx::kernels::combine(ex, n, H, k, static_cast<const T*>(send.data()), w,
                          static_cast<const std::int64_t*>(plan.pos.data()), out);
    clock.lap();
  }

  // After forward (the outputs stay in send order in `send`).
  template <class Comm>
  void backward(Comm& comm, const T* grad_out, T* grad_x, float* grad_w) {
    clock.start();
    const int me = comm.rank();
    const std::size_t S = n * static_cast<std::size_t>(k), R = lay.rows(me);
    epx::exec::host_buffer<T> grad_send;
    grad_send.reserve_discard(S * H);
    grad_recv.reserve_discard(R * H);
    grad_in.reserve_discard(R * H);
    epx::kernels::gather(ex, S, H, grad_out, static_cast<const std::int64_t*>(plan.src_row.data()),
                         static_cast<const float*>(w_send.data()), grad_send.data());
    clock.lap();
    epx::kernels::weight_gradients(ex, n, H, k, static_cast<const T*>(send.data()), grad_out,
                                   static_cast<const std::int64_t*>(plan.pos.data()), grad_w);
    clock.lap();
    epx::detail::zero_padding(ex, grad_recv.data(), lay, me, H);
    epx::all_to_allv_segments(comm, static_cast<const T*>(grad_send.data()), epx::make_span(seg.send_counts),
                              epx::make_span(seg.send_displs), grad_recv.data(), epx::make_span(seg.recv_counts),
                              epx::make_span(seg.recv_displs), static_cast<std::size_t>(L), H);
    clock.lap();
    if (R) std::memcpy(grad_in.data(), grad_recv.data(), R * H * sizeof(T));
    clock.lap();
    epx::all_to_allv_segments(comm, static_cast<const T*>(grad_in.data()), epx::make_span(seg.recv_counts),
                              epx::make_span(seg.recv_displs), grad_send.data(), epx::make_span(seg.send_counts),
                              epx::make_span(seg.send_displs), static_cast<std::size_t>(L), H);
    clock.lap();
    epx::kernels::reduce(ex, n, H, k, static_cast<const T*>(grad_send.data()),
                         static_cast<const std::int64_t*>(plan.pos.data()), grad_x);
    clock.lap();
  }
};

// --- stages alone: scatter (gather_rows), exchange (segmented all-to-all), combine ---------
enum class stage { scatter, exchange, combine };

template <class T>
void bench_stage(benchmark::State& state, shape s, stage which) {
  const std::size_t H = s.hidden, n = s.tokens, S = s.pairs();
  const int L = s.experts / s.ep;
  std::vector<const void*> sends(static_cast<std::size_t>(s.ep));                  // every rank's send rows
  std::vector<const epx::detail::segments*> lays(static_cast<std::size_t>(s.ep));  // and its segments
  const run_result r = drive(state, s.ep, [&](epx::threads::communicator& comm, std::int64_t&) {
    const int me = comm.rank();
    const epx::exec::serial ex;
    struct data_t {
      std::vector<T> x, out;
      std::vector<std::int32_t> ids;
      std::vector<float> w;
      epx::layout::send_plan<epx::exec::serial> plan;
      epx::detail::segments lay;
      std::vector<T> send, recv;
    };
    auto d = std::make_shared<data_t>();
    d->x = make_rows<T>(n, H, me);
    d->out.assign(n * H, epx::convert<T>(0.0f));
    d->ids = make_ids(n, s.k, s.experts, s.routing, me);
    d->w = make_weights(n, s.k, me);
    d->plan = epx::layout::build_plan(ex, d->ids.data(), d->w.data(), n, s.k, s.experts, 1);
    const auto g = epx::detail::exchange_records(comm, 0, n, H, s.k, me, d->plan.host_counts.data(),
                                                 static_cast<std::size_t>(s.experts), "", "bench", 1);
    const auto layout = epx::detail::make_receive_layout(s.ep, s.ep, L, epx::padding{},
                                                         [&](int r) { return g.counts(r); });
    d->lay = epx::detail::segments_of(layout, me);
    std::size_t Rr = 0;
    for (auto c : d->lay.recv_counts) Rr += c;
    d->send = make_rows<T>(S, H, me + 100);  // touched; the combine stage reads it as y
    d->recv.assign(layout.rows(me) * H, epx::convert<T>(0.0f));
    const double row_bytes = static_cast<double>(H * sizeof(T));
    rank_work w;
    // Bytes read plus written: gather 2S, exchange 2Rr (the receiver pulls), combine S + n.
    const double rows = which == stage::scatter ? 2.0 * S : which == stage::exchange ? 2.0 * Rr : double(S + n);
    w.traffic = rows * row_bytes;
    w.floor_parts = {static_cast<std::size_t>(w.traffic / 2)};
    call c;
    c.name = "epx";
    switch (which) {
      case stage::scatter:
        c.run = [d, S, H] {
          epx::kernels::gather(epx::exec::serial{}, S, H, static_cast<const T*>(d->x.data()),
                               static_cast<const std::int64_t*>(d->plan.src_row.data()), d->send.data());
          benchmark::DoNotOptimize(d->send.data());
        };
        break;
      case stage::exchange:
        c.run = [d, &comm, L, H] {
          epx::all_to_allv_segments(comm, static_cast<const T*>(d->send.data()), epx::make_span(d->lay.send_counts),
                                    epx::make_span(d->lay.send_displs), d->recv.data(),
                                    epx::make_span(d->lay.recv_counts), epx::make_span(d->lay.recv_displs),
                                    static_cast<std::size_t>(L), H);
        };
        break;
      case stage::combine:
        c.run = [d, n, H, s] {
          epx::kernels::combine(epx::exec::serial{}, n, H, s.k, static_cast<const T*>(d->send.data()), d->w.data(),
                                static_cast<const std::int64_t*>(d->plan.pos.data()), d->out.data());
          benchmark::DoNotOptimize(d->out.data());
        };
        break;
    }
    // Checked once against a direct computation: scatter, send[p] = x[src_row[p]]; exchange,
    // every received segment is the rows its source sent for it; combine, out[t] =
    // sum_j w[t,j] y[pos[t,j]] within the rounding bound of float accumulation rounded to T.
    sends[static_cast<std::size_t>(me)] = d->send.data();
    lays[static_cast<std::size_t>(me)] = &d->lay;
    c.run();
    comm.barrier();
    const std::size_t rb = H * sizeof(T);
    if (which == stage::scatter) {
      for (std::size_t p = 0; p < S && w.check.empty(); ++p)
        if (std::memcmp(d->send.data() + p * H, d->x.data() + static_cast<std::size_t>(d->plan.src_row.data()[p]) * H,
                        rb) != 0)
          w.check = epx::detail::concat("scatter: send row ", p, " is not x[src_row]");
    } else if (which == stage::exchange) {
      for (int q = 0; q < s.ep && w.check.empty(); ++q)
        for (int l = 0; l < L && w.check.empty(); ++l) {
          const auto mine = static_cast<std::size_t>(q * L + l), theirs = static_cast<std::size_t>(me * L + l);
          const auto* src = static_cast<const T*>(sends[static_cast<std::size_t>(q)]) +
                            lays[static_cast<std::size_t>(q)]->send_displs[theirs] * H;
          if (d->lay.recv_counts[mine] != lays[static_cast<std::size_t>(q)]->send_counts[theirs] ||
              std::memcmp(d->recv.data() + d->lay.recv_displs[mine] * H, src, d->lay.recv_counts[mine] * rb) != 0)
            w.check = epx::detail::concat("exchange: the rows from rank ", q, " for local expert ", l, " differ");
        }
    } else {
      const auto K = static_cast<std::size_t>(s.k);
      const double u = sizeof(T) == 2 ? 0x1p-8 : 0x1p-24, ua = 0x1p-24;
      for (std::size_t t = 0; t < n && w.check.empty(); ++t)
        for (std::size_t h = 0; h < H; ++h) {
          double want = 0, abs_sum = 0;
          for (std::size_t j = 0; j < K; ++j) {
            const auto pos = d->plan.pos.data()[t * K + j];
            const double v = static_cast<double>(d->w[t * K + j]) *
                             static_cast<double>(epx::convert<float>(d->send[static_cast<std::size_t>(pos) * H + h]));
            want += v;
            abs_sum += std::abs(v);
          }
          const double got = static_cast<double>(epx::convert<float>(d->out[t * H + h]));
          if (!(std::abs(got - want) <= u * std::abs(want) + 2 * (K + 1) * ua * abs_sum + 1e-30)) {
            w.check = epx::detail::concat("combine: out[", t, ", ", h, "] = ", got, ", expected ", want);
            break;
          }
        }
    }
    comm.barrier();  // nobody's buffers change before every rank has read them
    w.calls.push_back(std::move(c));
    return w;
  });
  if (!r.check.empty()) {
    epx::bench::fail_check(state, "output check failed: " + r.check);
    return;
  }
  state.SetLabel(epx::detail::concat("threads ep=", s.ep, " stage=",
                                     which == stage::scatter ? "scatter" : which == stage::exchange ? "exchange" : "combine"));
  summary_row row;
  row.name = g_current_name;
  set_floor_counters(state, r, row);
  state.counters["checked"] = 1;
  add_row(row);
}

// --- routes -------------------------------------------------------------------------------------
// Options of one route benchmark.
struct route_setup {
  route r = route::staged;
  bool backward = false;
  bool baseline = false;  // the hand-written layer in the same loop
  bool stages = false;    // the staged route decomposed into its stages, in the same loop
  bool gathered = false;  // staged, per-rank: the same layer with gather-first sends in the same loop
};

// Per-rank counters summed over the ranks (drive's run_result::counters).
enum counter_index : std::size_t { c_rows_sent, c_rows_remote, c_rows_per_rank, c_baseline_traffic, c_count };

template <class T>
void bench_route(benchmark::State& state, shape s, route_setup o) {
  const std::size_t H = s.hidden, N = s.tokens;
  const bool masked = o.r == route::masked;
  using comm_t = epx::threads::communicator;
  const run_result res = drive(state, s.ep, [&](comm_t& comm, std::int64_t& allowance) {
    const int me = comm.rank();
    struct data_t {
      std::vector<T> x, out, grad_out, grad_x, out_b, grad_x_b, out_p, grad_x_p, out_g, grad_x_g;
      std::vector<std::int32_t> ids;
      std::vector<float> w, grad_w, grad_w_b, grad_w_p, grad_w_g;
      std::unique_ptr<epx::moe_layer<comm_t, T, epx::impl::all_to_all>> layer, layer_g;
      std::unique_ptr<epx::moe_layer<comm_t, T, epx::impl::all_reduce>> masked_layer;
      identity_experts<T> experts;
      epx::saved_state<T> saved, saved_g;
      epx::bench::baseline_layer<T> base;
      staged_pipeline<T> pipe;
      epx::layer_stats stats;
    };
    auto d = std::make_shared<data_t>();
    const int seed = masked ? 0 : me;  // tp = ep: every rank of the group holds batch 0
    d->x = make_rows<T>(N, H, seed);
    d->out.assign(N * H, epx::convert<T>(0.0f));
    d->ids = make_ids(N, s.k, s.experts, s.routing, seed);
    d->w = make_weights(N, s.k, seed);
    d->grad_out = make_rows<T>(N, H, seed + 50);
    d->grad_x.assign(N * H, epx::convert<T>(0.0f));
    d->grad_w.assign(N * static_cast<std::size_t>(s.k), 0.0f);
    epx::layer_options lo;
    lo.hidden = H;
    lo.top_k = s.k;
    lo.chunks = 1;
    lo.peer_access = o.r == route::direct;
    if (o.r == route::per_rank) lo.sends = epx::row_sends::per_rank;
    lo.stage_bytes = epx::bench::stage_bytes();
    lo.indexed_sends = !epx::bench::gathered();
    epx::mesh_config mc;
    mc.tp = masked ? s.ep : 1;
    mc.fsdp = masked ? 1 : s.ep;
    mc.ep = s.ep;
    mc.experts = s.experts;
    const epx::mesh m(mc);
    auto make_layer = [&] {
      if (masked)
        d->masked_layer = std::make_unique<epx::moe_layer<comm_t, T, epx::impl::all_reduce>>(m, comm, lo);
      else
        d->layer = std::make_unique<epx::moe_layer<comm_t, T, epx::impl::all_to_all>>(m, comm, lo);
    };
    auto forward = [d, masked](epx::mode md) {
      const epx::span<const T> x(d->x.data(), d->x.size());
      const epx::span<const std::int32_t> ids(d->ids.data(), d->ids.size());
      const epx::span<const float> w(d->w.data(), d->w.size());
      const epx::span<T> out(d->out.data(), d->out.size());
      if (masked) return d->masked_layer->forward(x, ids, w, out, d->experts, md);
      return d->layer->forward(x, ids, w, out, d->experts, md);
    };
    auto backward = [d, masked] {
      const epx::span<const T> g(d->grad_out.data(), d->grad_out.size());
      const epx::span<T> gx(d->grad_x.data(), d->grad_x.size());
      const epx::span<float> gw(d->grad_w.data(), d->grad_w.size());
      if (masked) d->masked_layer->backward(std::move(d->saved), g, gx, gw, d->experts);
      else d->layer->backward(std::move(d->saved), g, gx, gw, d->experts);
    };
    auto stats = [d, masked]() -> const epx::layer_stats& {
      return masked ? d->masked_layer->stats() : d->layer->stats();
    };
    rank_work w;
    // One call (training forward and backward) to learn the rows moved and check the results.
    make_layer();
    const int partials = masked ? s.ep : o.r == route::per_rank ? std::min(s.k, s.ep) : 1;
    std::int64_t rounds = 0;
    if (!o.backward) {
      // The timed forward is an inference call, which (unlike a training forward) moves its
      // rows in rounds when the stage asks for them: it is checked on its own, then out is
      // cleared so that the training forward's check sees only what that call wrote.
      (void)forward(epx::mode::inference);
      rounds = stats().stage_rounds;
      w.check = check_forward(d->x.data(), d->w.data(), d->out.data(), N, H, s.k, partials);
      if (!w.check.empty()) w.check = "inference forward: " + w.check;
      std::fill(d->out.begin(), d->out.end(), epx::convert<T>(0.0f));
    }
    d->saved = forward(epx::mode::train);
    d->stats = stats();
    if (w.check.empty()) w.check = check_forward(d->x.data(), d->w.data(), d->out.data(), N, H, s.k, partials);
    backward();
    if (o.backward) rounds = stats().stage_rounds;
    if (w.check.empty())
      w.check = check_backward(d->x.data(), d->w.data(), d->grad_out.data(), d->grad_x.data(), d->grad_w.data(), N, H,
                               s.k, partials);
    const auto& st = d->stats;
    // The route the layer took: the floor below counts the bytes of the requested one.
    if (w.check.empty()) {
      if (masked ? std::string(st.path) != "all_reduce" : st.peer_access != (o.r == route::direct))
        w.check = epx::detail::concat("the layer took another route (path ", st.path, ", peer_access ",
                                      st.peer_access ? 1 : 0, ")");
      else if (!masked && o.r != route::direct && st.indexed_sends == epx::bench::gathered())
        w.check = epx::detail::concat("the layer's staged sends were ", st.indexed_sends ? "by index" : "gathered",
                                      ", not as the floor counts");
    }
    w.label = epx::detail::concat("threads ep=", s.ep, " route=", masked ? "masked (all_reduce)" : to_string(o.r),
                                  masked || o.r == route::direct ? ""
                                  : st.indexed_sends                ? " sends=by index"
                                                                    : " sends=gathered",
                                  rounds > 1 ? epx::detail::concat(" rounds=", rounds) : std::string());
    std::size_t R = 0, P = 0, S = 0, remote = 0, got = 0;
    for (auto c : st.tokens_per_local_expert) R += static_cast<std::size_t>(c);
    for (auto c : st.padding_per_local_expert) P += static_cast<std::size_t>(c);
    R += P;
    for (std::size_t p = 0; p < st.rows_sent.size(); ++p) {
      S += static_cast<std::size_t>(st.rows_sent[p]);
      got += static_cast<std::size_t>(st.rows_received[p]);
      if (static_cast<int>(p) != me) remote += static_cast<std::size_t>(st.rows_sent[p]);
    }
    // What a per-rank mode (one row per token and owner rank) would send.
    std::size_t per_rank = 0;
    {
      const int L = s.experts / s.ep;
      std::vector<int> seen(static_cast<std::size_t>(s.ep), -1);
      for (std::size_t t = 0; t < N; ++t)
        for (int j = 0; j < s.k; ++j) {
          const int owner = d->ids[t * static_cast<std::size_t>(s.k) + static_cast<std::size_t>(j)] / L;
          if (seen[static_cast<std::size_t>(owner)] != static_cast<int>(t)) {
            seen[static_cast<std::size_t>(owner)] = static_cast<int>(t);
            ++per_rank;
          }
        }
    }
    const double row_bytes = static_cast<double>(H * sizeof(T));
    allowance = static_cast<std::int64_t>(static_cast<double>(R) * row_bytes);
    const double n = masked ? static_cast<double>(N) : static_cast<double>(N);
    const auto parts = route_traffic(o.r, o.backward, static_cast<double>(masked ? 0 : S), static_cast<double>(R),
                                     static_cast<double>(P), n, static_cast<double>(N), masked ? s.ep : 1,
                                     static_cast<double>(got), epx::bench::gathered());
    for (double p : parts) {
      w.traffic += p * row_bytes;
      w.floor_parts.push_back(static_cast<std::size_t>(p * row_bytes / 2));
    }
    double base_traffic = 0;
    for (double p : baseline_traffic(o.backward, static_cast<double>(S), static_cast<double>(R - P),
                                     static_cast<double>(N)))
      base_traffic += p * row_bytes;
    w.counters.assign(c_count, 0.0);
    w.counters[c_rows_sent] = static_cast<double>(S);
    w.counters[c_rows_remote] = static_cast<double>(remote);
    w.counters[c_rows_per_rank] = static_cast<double>(per_rank);
    w.counters[c_baseline_traffic] = base_traffic;
    // A fresh layer: its row-buffer pool (kept between calls) is filled by the warm-up call,
    // so the heap peak counted there includes the pool's blocks.
    make_layer();
    call epx_call;
    epx_call.name = "epx";
    if (!o.backward) {
      epx_call.run = [forward] { forward(epx::mode::inference); };
    } else {
      epx_call.prepare = [d, forward] { d->saved = forward(epx::mode::train); };
      epx_call.run = backward;
    }
    w.calls.push_back(std::move(epx_call));
    if (o.gathered && !masked && o.r != route::direct && lo.indexed_sends) {
      // The same layer with layer_options::indexed_sends = false: rows gathered into a send
      // buffer before they go (its own output buffers; results bitwise the same).
      epx::layer_options lg = lo;
      lg.indexed_sends = false;
      d->layer_g = std::make_unique<epx::moe_layer<comm_t, T, epx::impl::all_to_all>>(m, comm, lg);
      d->out_g.assign(N * H, epx::convert<T>(0.0f));
      d->grad_x_g.assign(N * H, epx::convert<T>(0.0f));
      d->grad_w_g.assign(d->grad_w.size(), 0.0f);
      auto fg = [d](epx::mode md) {
        return d->layer_g->forward(epx::span<const T>(d->x.data(), d->x.size()),
                                   epx::span<const std::int32_t>(d->ids.data(), d->ids.size()),
                                   epx::span<const float>(d->w.data(), d->w.size()),
                                   epx::span<T>(d->out_g.data(), d->out_g.size()), d->experts, md);
      };
      auto bg = [d] {
        d->layer_g->backward(std::move(d->saved_g), epx::span<const T>(d->grad_out.data(), d->grad_out.size()),
                             epx::span<T>(d->grad_x_g.data(), d->grad_x_g.size()),
                             epx::span<float>(d->grad_w_g.data(), d->grad_w_g.size()), d->experts);
      };
      auto same = [](const auto& a, const auto& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
      };
      d->saved_g = fg(epx::mode::train);
      if (d->layer_g->stats().indexed_sends && w.check.empty()) w.check = "gathered: the layer sent by index";
      if (!same(d->out_g, d->out) && w.check.empty()) w.check = "gathered: out differs bitwise from the layer's";
      bg();
      if ((!same(d->grad_x_g, d->grad_x) || !same(d->grad_w_g, d->grad_w)) && w.check.empty())
        w.check = "gathered: grad_x or grad_weights differ bitwise from the layer's";
      call g;
      g.name = "gathered";
      if (!o.backward) {
        g.run = [fg] { fg(epx::mode::inference); };
      } else {
        g.prepare = [d, fg] { d->saved_g = fg(epx::mode::train); };
        g.run = bg;
      }
      w.calls.push_back(std::move(g));
    }
    if (o.baseline) {
      d->out_b.assign(N * H, epx::convert<T>(0.0f));
      d->grad_x_b.assign(N * H, epx::convert<T>(0.0f));
      d->grad_w_b.assign(d->grad_w.size(), 0.0f);
      auto bf = [d, &comm, N, H, s](bool training) {
        d->base.forward(comm, d->x.data(), d->ids.data(), d->w.data(), N, H, s.k, s.experts, d->out_b.data(),
                        training);
      };
      bf(true);
      std::string c = check_forward(d->x.data(), d->w.data(), d->out_b.data(), N, H, s.k);
      d->base.backward(comm, d->grad_out.data(), d->grad_x_b.data(), d->grad_w_b.data());
      if (c.empty())
        c = check_backward(d->x.data(), d->w.data(), d->grad_out.data(), d->grad_x_b.data(), d->grad_w_b.data(), N,
                           H, s.k);
      if (!c.empty() && w.check.empty()) w.check = "baseline: " + c;
      call b;
      b.name = "baseline";
      if (!o.backward) {
        b.run = [bf] { bf(false); };
        for (const char* nm : epx::bench::baseline_layer<T>::forward_stages) b.stage_names.push_back(nm);
      } else {
        b.prepare = [bf] { bf(true); };
        b.run = [d, &comm] { d->base.backward(comm, d->grad_out.data(), d->grad_x_b.data(), d->grad_w_b.data()); };
        for (const char* nm : epx::bench::baseline_layer<T>::backward_stages) b.stage_names.push_back(nm);
      }
      b.stages = [d] { return d->base.stages().seconds(); };
      w.calls.push_back(std::move(b));
    }
    if (o.stages && !masked) {
      d->out_p.assign(N * H, epx::convert<T>(0.0f));
      d->grad_x_p.assign(N * H, epx::convert<T>(0.0f));
      d->grad_w_p.assign(d->grad_w.size(), 0.0f);
      auto pf = [d, &comm, N, H, s] {
        d->pipe.forward(comm, d->x.data(), d->ids.data(), d->w.data(), N, H, s.k, s.experts, d->out_p.data());
      };
      pf();
      std::string c = check_forward(d->x.data(), d->w.data(), d->out_p.data(), N, H, s.k);
      d->pipe.backward(comm, d->grad_out.data(), d->grad_x_p.data(), d->grad_w_p.data());
      if (c.empty())
        c = check_backward(d->x.data(), d->w.data(), d->grad_out.data(), d->grad_x_p.data(), d->grad_w_p.data(), N,
                           H, s.k);
      if (!c.empty() && w.check.empty()) w.check = "stages: " + c;
      call p;
      p.name = "stages";
      if (!o.backward) {
        p.run = pf;
        if (epx::bench::gathered())
          for (const char* nm : staged_pipeline<T>::gathered_forward_stages) p.stage_names.push_back(nm);
        else
          for (const char* nm : staged_pipeline<T>::forward_stages) p.stage_names.push_back(nm);
      } else {
        p.prepare = pf;
        p.run = [d, &comm] { d->pipe.backward(comm, d->grad_out.data(), d->grad_x_p.data(), d->grad_w_p.data()); };
        for (const char* nm : staged_pipeline<T>::backward_stages) p.stage_names.push_back(nm);
      }
      p.stages = [d] { return d->pipe.clock.seconds(); };
      w.calls.push_back(std::move(p));
    }
    return w;
  });
  if (!res.check.empty()) {
    epx::bench::fail_check(state, ("output check failed: " + res.check));
    return;
  }
  summary_row row;
  row.name = g_current_name;
  state.SetLabel(res.label);
  set_floor_counters(state, res, row);
  set_memory_counters(state, res, row);
  state.counters["checked"] = 1;
  const double ranks = s.ep;
  state.counters["rows_sent"] = res.counters[c_rows_sent] / ranks;
  state.counters["rows_sent_remote"] = res.counters[c_rows_remote] / ranks;
  state.counters["rows_per_rank_mode"] = res.counters[c_rows_per_rank] / ranks;
  const double repeat = res.counters[c_rows_sent] > 0
                            ? 1.0 - res.counters[c_rows_per_rank] / res.counters[c_rows_sent]
                            : 0.0;
  state.counters["repeat_fraction"] = repeat;
  row.rows_sent = res.counters[c_rows_sent] / ranks;
  row.repeat = repeat;
  const double te = median(res.calls[0].times), tf = median(res.floor_times);
  for (std::size_t c = 1; c < res.calls.size(); ++c) {
    const auto& cr = res.calls[c];
    const double tc = median(cr.times);
    std::string stages;
    for (std::size_t i = 0; i < cr.stage_names.size(); ++i) {
      const double ms = median(cr.stages[i]) * 1e3;
      state.counters[(cr.name == "baseline" ? "baseline:" : "stage:") + cr.stage_names[i] + "_ms"] = ms;
      stages += epx::detail::concat(i ? " " : "", cr.stage_names[i], " ", ms);
    }
    if (cr.name == "gathered") {
      std::vector<double> ratio(cr.times.size());
      for (std::size_t i = 0; i < ratio.size(); ++i) ratio[i] = cr.times[i] / res.calls[0].times[i];
      state.counters["gathered_ms"] = tc * 1e3;
      state.counters["speedup_vs_gathered"] = te > 0 ? tc / te : 0.0;
      state.counters["speedup_vs_gathered_paired"] = median(ratio);
      row.stages += epx::detail::concat("gathered sends ", tc * 1e3, " ms; ");
    } else if (cr.name == "baseline") {
      std::vector<double> ratio(cr.times.size());
      for (std::size_t i = 0; i < ratio.size(); ++i) ratio[i] = cr.times[i] / res.calls[0].times[i];
      state.counters["baseline_ms"] = tc * 1e3;
      state.counters["baseline_floor_ratio"] =
          tf > 0 ? tc / (tf * res.counters[c_baseline_traffic] / res.traffic) : 0.0;
      state.counters["speedup_vs_baseline"] = te > 0 ? tc / te : 0.0;
      state.counters["speedup_paired"] = median(ratio);
      row.baseline_ms = tc * 1e3;
      row.speedup = te > 0 ? tc / te : 0.0;
      row.stages += "baseline: " + stages + "; ";
    } else {
      state.counters["stages_ms"] = tc * 1e3;
      row.stages += epx::detail::concat("staged decomposed (", tc * 1e3, " ms): ", stages);
    }
  }
  add_row(row);
}

// --- registration ------------------------------------------------------------------------------
template <class F>
benchmark::internal::Benchmark* reg(const std::string& name, F fn) {
  return benchmark::RegisterBenchmark(name.c_str(), [name, fn](benchmark::State& st) {
    g_current_name = name;
    fn(st);
  });
}

benchmark::internal::Benchmark* finish(benchmark::internal::Benchmark* b, int iters) {
  return b->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(iters);
}

// Bytes one staged forward moves on all ranks (for the iteration estimate).
double round_trip_bytes(const shape& s, std::size_t elem) {
  return 7.0 * static_cast<double>(s.pairs()) * static_cast<double>(s.hidden * elem) * s.ep;
}

// route<T>/<route>/<fwd|bwd>/<shape>. iters 0: from the size, at least `min_iters`.
template <class T>
void register_route(const shape& s, route_setup o, int iters, int min_iters = 10) {
  const int it = iters > 0 ? iters : iterations_for(round_trip_bytes(s, sizeof(T)) * (o.backward ? 2 : 1), 2.0,
                                                    min_iters);
  const std::string name = epx::detail::concat("route<", type_name<T>(), ">/", to_string(o.r), "/",
                                               o.backward ? "bwd" : "fwd", "/", s.str());
  finish(reg(name, [s, o](benchmark::State& st) { bench_route<T>(st, s, o); }), it);
}

template <class T>
void register_stages(const shape& s, int iters_override) {
  const std::string tn = type_name<T>();
  const int it = iters_override > 0 ? iters_override : iterations_for(round_trip_bytes(s, sizeof(T)) / 5, 0.5);
  const std::pair<const char*, stage> stages[] = {
      {"scatter", stage::scatter}, {"exchange", stage::exchange}, {"combine", stage::combine}};
  for (const auto& [name, which] : stages) {
    const stage w = which;
    finish(reg(std::string(name) + "<" + tn + ">/" + s.str(), [s, w](benchmark::State& st) { bench_stage<T>(st, s, w); }),
           it);
  }
}

void register_layout(const shape& s, int iters_override) {
  const int it = iters_override > 0 ? iters_override
                                    : static_cast<int>(std::clamp(4e6 / static_cast<double>(s.pairs()), 5.0, 2000.0));
  finish(reg("layout/" + s.str(), [s](benchmark::State& st) { bench_layout(st, s); }), it)
      ->Unit(benchmark::kMicrosecond);
}

shape make_shape(int ep, std::size_t tokens, std::size_t hidden, int k, int experts, routing_kind r = balanced) {
  shape s;
  s.ep = ep;
  s.tokens = tokens;
  s.hidden = hidden;
  s.k = k;
  s.experts = experts;
  s.routing = r;
  return s;
}

// Every route of one shape: staged and direct, forward and backward, with the baseline (and
// the staged route's stages) in the same loop where `full`; the masked path where asked.
template <class T>
void register_shape(const shape& s, bool full, int iters, int min_iters = 10) {
  for (bool bwd : {false, true}) {
    register_route<T>(s, {route::staged, bwd, full, full, full}, iters, min_iters);
    register_route<T>(s, {route::direct, bwd, full, false}, iters, min_iters);
    register_route<T>(s, {route::per_rank, bwd, full, false, full}, iters, min_iters);
  }
}

// The registered set; see bench/README.md for why these shapes.
void register_all(bool quick) {
  if (quick) {
    const int q = 3;
    register_layout(make_shape(8, 128, 0, 8, 64), q);
    register_stages<bf16>(make_shape(2, 128, 1024, 8, 64), q);
    register_shape<bf16>(make_shape(2, 128, 1024, 8, 64), true, q);
    register_route<float>(make_shape(2, 128, 1024, 2, 8, zipf), {route::staged, false, true, true}, q);
    register_route<bf16>(make_shape(2, 128, 1024, 8, 64), {route::masked, false, false, false}, q);
    return;
  }
  // Layout: every tokens x k x experts, both routings (one rank; cheap).
  for (routing_kind r : {balanced, zipf})
    for (std::size_t tokens : {128, 4096, 16384})
      for (int k : {2, 8})
        for (int E : {8, 64, 256}) register_layout(make_shape(8, tokens, 0, k, E, r), 0);
  // Stages alone at ep = 8, and hidden 7168 at ep = 2 (memory).
  register_stages<bf16>(make_shape(8, 4096, 1024, 8, 64), 0);
  register_stages<bf16>(make_shape(8, 4096, 4096, 8, 64), 0);
  register_stages<bf16>(make_shape(2, 4096, 7168, 8, 64), 0);
  // The target shape (4096 x 4096, bf16, top-8, 64 experts, ep 8): forward with the
  // baseline and the decomposed staged route in the same loop; backward epx alone (the
  // three together need more memory than 8 ranks of this machine have).
  const shape target = make_shape(8, 4096, 4096, 8, 64);
  register_route<bf16>(target, {route::staged, false, true, true}, 0);
  register_route<bf16>(target, {route::direct, false, true, false}, 0);
  register_route<bf16>(target, {route::staged, true, false, false}, 0);
  register_route<bf16>(target, {route::direct, true, false, false}, 0);
  register_route<bf16>(target, {route::per_rank, false, true, false}, 0);
  register_route<bf16>(target, {route::per_rank, true, false, false}, 0);
  // The transformers comparison shape (1024 tokens x 1024 per rank, top-8, 64 experts,
  // ep 8), bf16 and float32: every route, both directions, baseline and stages.
  register_shape<bf16>(make_shape(8, 1024, 1024, 8, 64), true, 0, 20);
  register_shape<float>(make_shape(8, 1024, 1024, 8, 64), true, 0, 20);
  // Skewed routing, other sizes.
  register_route<bf16>(make_shape(8, 4096, 4096, 8, 64, zipf), {route::staged, false, true, false}, 0);
  register_route<bf16>(make_shape(8, 4096, 1024, 8, 64), {route::staged, false, true, true}, 0);
  register_route<bf16>(make_shape(2, 4096, 7168, 8, 64), {route::staged, false, true, false}, 0);
  register_route<bf16>(make_shape(8, 128, 1024, 8, 64), {route::staged, false, true, true}, 0);
  // Masked all-reduce path at tp = ep.
  for (int ep : {2, 8}) register_route<bf16>(make_shape(ep, 4096, 1024, 8, 64), {route::masked, false, false, false}, 0);
}

void print_summary() {
  if (g_rows.empty()) return;
  std::printf("\nSummary (median per call; speedup = baseline / epx, same iterations; floor_MiB = bytes read + "
              "written, all ranks; memory per rank; heap=%s)\n",
              heap::caching ? "cache" : "system");
  std::printf("%-80s %9s %11s %7s %6s %9s %9s %9s %9s %6s\n", "benchmark", "epx_ms", "baseline_ms", "speedup",
              "floor", "floor_MiB", "extra_MiB", "allow_MiB", "rows_sent", "repeat");
  auto num = [](double v) { return v > 0 ? epx::detail::concat(v) : std::string("-"); };
  for (const auto& r : g_rows) {
    std::printf("%-80s %9.3f %11s %7s %6s %9s %9s %9s %9s %6s\n", r.name.c_str(), r.ms, num(r.baseline_ms).c_str(),
                num(r.speedup).c_str(), num(r.floor_ratio).c_str(), num(r.floor_mib).c_str(),
                num(r.extra_mib).c_str(), num(r.allowance_mib).c_str(), num(r.rows_sent).c_str(),
                num(r.repeat).c_str());
    if (!r.stages.empty()) std::printf("    stage ms: %s\n", r.stages.c_str());
  }
}

}  // namespace

// --quick: the small set (seconds), used by the bench-smoke ctest. --heap=cache (default) or
// --heap=system: see the heap namespace above. --host-isa=baseline|avx2|avx512: the version
// of the host row loops (default the widest the CPU supports; the context says which).
// --stage-bytes=B|all: layer_options::stage_bytes of the staged route (default 0,
// automatic; `all`: one round, a send buffer of all n*k rows). --stream-threshold=B: the
// bytes from which host row copies stream (epx/exec/stream.hpp). Any Google Benchmark flag
// (--benchmark_filter, --benchmark_out, ...) works as usual.
int main(int argc, char** argv) {
  bool quick = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (std::strcmp(argv[i], "--heap=system") == 0)
      heap::caching = false;
    else if (std::strcmp(argv[i], "--heap=cache") == 0)
      heap::caching = true;
    else if (epx::bench::host_isa_flag(argv[i]))
      continue;
    else if (epx::bench::gathered_flag(argv[i]))
      continue;
    else if (epx::bench::stage_bytes_flag(argv[i]))
      continue;
    else if (epx::bench::stream_threshold_flag(argv[i]))
      continue;
    else
      args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("host_isa", epx::exec::to_string(epx::exec::active_host_isa()));
  benchmark::AddCustomContext("stage_bytes", epx::bench::stage_bytes_context());
  benchmark::AddCustomContext("staged_sends", epx::bench::gathered() ? "gathered" : "by index");
  benchmark::AddCustomContext("stream_threshold", std::to_string(epx::exec::stream_threshold()));
  register_all(quick);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  print_summary();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
