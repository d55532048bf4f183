// The MoE layer's stages and round trips over the threads communicator, against the plain
// memcpy of the same bytes and against the hand-written baseline (bench/baseline.hpp).
//
//   ./bench_layer --benchmark_out=layer.json --benchmark_out_format=json   # the registered set
//   ./bench_layer --quick                                                  # seconds (bench-smoke)
//   ./bench_layer --benchmark_filter='round_trip'                          # any filter
//
// Every rank is a thread of epx::threads::run with its own exec::serial policy, as in
// bench_comm.cpp: rank 0 drives Google Benchmark's loop, the other ranks follow. One
// iteration: barrier, the measured call on every rank, barrier (timed on rank 0: the time
// until the last rank is done), then the floor: every rank memcpys the same number of
// bytes as the measured call moves, all ranks at once, barrier to barrier (timed). So the
// floor runs on the same machine, with as many threads copying at once, in the same
// process run, and floor_ratio = median(measured) / median(memcpy).
//
// Bytes moved by a stage: every routed row once (read once and written once), summed over
// the ranks; a round trip moves the sum of its stages' bytes. Forward: gather S rows,
// dispatch R rows, return S rows, combine S rows per rank (S = n*k routed rows this rank
// sends, R = rows its experts receive, padding included); the identity experts run in
// place and move nothing, in epx and in the baseline alike. Backward adds the experts' R
// rows (their grad_in copy). A route that fuses stages (epx's direct route on threads:
// gather+dispatch, return+combine) moves fewer bytes than this sum, so its floor_ratio can
// drop below 1: the floor is what the stages would cost as plain copies.
//
// Counters (medians over the iterations; see bench/README.md):
//   GB/s, memcpy_GB/s, floor_ratio       bytes moved / time; the same for the memcpys; ratio
//   pairs/s, speedup_vs_baseline         layout: (token, slot) pairs per second on one rank
//   extra_MiB, allowance_MiB, extra_vs_allowance
//                                        round trips: the layer's peak heap use per rank
//                                        beyond inputs and outputs (counted by the
//                                        instrumented operator new below), against the
//                                        expert-major buffer (routed rows once + padding)
// A summary table (epx against baseline, side by side) is printed at the end of the run.
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
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "baseline.hpp"
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

// --- inputs ----------------------------------------------------------------------------------
enum routing_kind : int { balanced = 0, zipf = 1 };
constexpr double zipf_exponent = 1.0;

// [n, k] expert ids, k distinct experts per token. balanced: uniform over the E experts
// (every expert gets n*k/E pairs in expectation). zipf: P(e) proportional to 1/(e+1)^s,
// s = 1 (expert 0 the most loaded, so ep rank 0 receives the most rows).
std::vector<std::int32_t> make_ids(std::size_t n, int k, int E, routing_kind r, int rank) {
  std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
  std::vector<double> cdf(static_cast<std::size_t>(E));
  double s = 0;
  for (int e = 0; e < E; ++e)
    cdf[static_cast<std::size_t>(e)] = (s += r == balanced ? 1.0 : std::pow(e + 1.0, -zipf_exponent));
  std::mt19937_64 gen(0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<double> u(0.0, s);
  std::vector<char> used(static_cast<std::size_t>(E));
  for (std::size_t t = 0; t < n; ++t) {
    std::fill(used.begin(), used.end(), 0);
    for (int j = 0; j < k; ++j) {
      int e;
      do {
        e = static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u(gen)) - cdf.begin());
        e = std::min(e, E - 1);
      } while (used[static_cast<std::size_t>(e)]);
      used[static_cast<std::size_t>(e)] = 1;
      ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)] = e;
    }
  }
  return ids;
}

std::vector<float> make_weights(std::size_t n, int k, int rank) {
  std::vector<float> w(n * static_cast<std::size_t>(k));
  std::mt19937 gen(1234u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (auto& v : w) v = u(gen);
  return w;
}

template <class T>
std::vector<T> make_rows(std::size_t n, std::size_t H, int rank) {
  std::vector<T> x(n * H);
  std::uint32_t s = 0x12345u + static_cast<std::uint32_t>(rank) * 7919u;
  for (auto& v : x) {
    s = s * 1664525u + 1013904223u;
    v = epx::convert<T>(static_cast<float>(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
  return x;
}

// Identity experts: out = in (nothing to do in place, a copy otherwise), grad_in = grad_out.
template <class T>
struct identity_experts {
  static constexpr bool forward_in_place = true;
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const T>& in, T* out) {
    if (in.num_rows && static_cast<const T*>(out) != in.rows)
      std::memcpy(out, in.rows, in.num_rows * in.hidden * sizeof(T));
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    if (in.num_rows) std::memcpy(grad_in, grad_out, in.num_rows * in.hidden * sizeof(T));
  }
};

// --- the driver -------------------------------------------------------------------------------
// What one rank does per iteration. `prepare` runs untimed before the measured call (e.g.
// the training forward before a backward); `floor` is the memcpy of the same bytes.
struct rank_work {
  std::function<void()> prepare;
  std::function<void()> measured;
  std::function<void()> floor;
  double bytes = 0;  // bytes this rank's measured call moves
};

struct run_result {
  std::vector<double> times, floor_times;
  double bytes = 0;  // all ranks
  std::vector<std::int64_t> extra;      // [ranks] peak heap bytes during one measured call
  std::vector<std::int64_t> allowance;  // [ranks] expert-major buffer bytes
};

// `make(comm, rank_result&)` builds a rank's work (collective calls allowed); it may set
// allowance for its rank. The measured call's heap peak is taken during the warm-up.
template <class Make>
run_result drive(benchmark::State& state, int ranks, Make&& make) {
  run_result r;
  r.extra.assign(static_cast<std::size_t>(ranks), 0);
  r.allowance.assign(static_cast<std::size_t>(ranks), 0);
  std::vector<double> bytes(static_cast<std::size_t>(ranks), 0.0);
  std::atomic<bool> go{false};
  heap::trim();  // the previous benchmark's blocks
  epx::threads::run(ranks, [&](epx::threads::communicator& comm) {
    const auto me = static_cast<std::size_t>(comm.rank());
    rank_work w = make(comm, r.allowance[me]);
    bytes[me] = w.bytes;
    auto iteration = [&](bool timed) {
      if (w.prepare) w.prepare();
      comm.barrier();
      const auto t0 = clock_type::now();
      w.measured();
      comm.barrier();
      const auto t1 = clock_type::now();
      w.floor();
      comm.barrier();
      const auto t2 = clock_type::now();
      if (timed) {
        r.times.push_back(seconds_since(t0, t1));
        r.floor_times.push_back(seconds_since(t1, t2));
        state.SetIterationTime(seconds_since(t0, t1));
      }
    };
    // Warm-up; the first call also counts the heap peak.
    if (w.prepare) w.prepare();
    comm.barrier();
    heap::begin();
    w.measured();
    r.extra[me] = heap::end();
    comm.barrier();
    w.floor();
    comm.barrier();
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
  });
  for (double b : bytes) r.bytes += b;
  return r;
}

// A per-rank memcpy floor over buffers of `rows` rows (ping-pong between two buffers so
// that a chain of copies never reads what it just wrote in cache).
struct floor_buffers {
  std::vector<char> a, b;
  explicit floor_buffers(std::size_t bytes) : a(std::max<std::size_t>(bytes, 1), 1), b(a.size(), 2) {}
  // Copies `parts` byte counts in sequence, alternating direction.
  void copy(const std::vector<std::size_t>& parts) {
    bool dir = false;
    for (std::size_t n : parts) {
      if (n) std::memcpy(dir ? a.data() : b.data(), dir ? b.data() : a.data(), n);
      dir = !dir;
    }
    benchmark::DoNotOptimize(a.data());
    benchmark::DoNotOptimize(b.data());
  }
};

// --- results for the summary table ----------------------------------------------------------
struct summary_row {
  std::string name;
  double us = 0, floor_ratio = 0, gbs = 0, baseline_us = 0, speedup = 0;
  double extra_mib = 0, allowance_mib = 0;
};
std::mutex g_mutex;
std::map<std::string, double> g_baseline_s;  // shape key -> baseline median seconds
std::vector<summary_row> g_rows;
std::string g_current_name;  // the running benchmark's name (rank 0's thread writes rows)

void add_row(const summary_row& row) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& r : g_rows)
    if (r.name == row.name) {
      r = row;
      return;
    }
  g_rows.push_back(row);
}

void set_data_counters(benchmark::State& state, const run_result& r, summary_row& row) {
  const double t = median(r.times), f = median(r.floor_times);
  state.counters["bytes_moved"] = r.bytes;
  state.counters["GB/s"] = t > 0 ? r.bytes / t * 1e-9 : 0.0;
  state.counters["memcpy_GB/s"] = f > 0 ? r.bytes / f * 1e-9 : 0.0;
  state.counters["floor_ratio"] = f > 0 ? t / f : 0.0;
  row.us = t * 1e6;
  row.floor_ratio = f > 0 ? t / f : 0.0;
  row.gbs = t > 0 ? r.bytes / t * 1e-9 : 0.0;
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

epx::mesh ep_mesh(const shape& s) {
  epx::mesh_config c;
  c.tp = 1;
  c.fsdp = s.ep;
  c.ep = s.ep;
  c.experts = s.experts;
  return epx::mesh(c);
}

// Iterations: about `budget` seconds of measured time, at least 3, from a rough estimate
// of 2 GB/s per core on this kind of machine.
int iterations_for(double total_bytes, double budget = 1.0) {
  const double est = std::max(1e-5, total_bytes / 2e9);
  return static_cast<int>(std::clamp(budget / est, 3.0, 2000.0));
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
  const double te = median(t_epx), tb = median(t_base);
  state.counters["pairs/s"] = static_cast<double>(s.pairs()) / te;
  state.counters["baseline_pairs/s"] = static_cast<double>(s.pairs()) / tb;
  state.counters["speedup_vs_baseline"] = tb / te;
  summary_row row;
  row.name = g_current_name;
  row.us = te * 1e6;
  row.baseline_us = tb * 1e6;
  row.speedup = tb / te;
  add_row(row);
}

// --- stages: scatter (gather_rows), exchange (segmented all-to-all), combine ---------------
enum class stage { scatter, exchange, combine };

template <class T>
void bench_stage(benchmark::State& state, shape s, stage which) {
  const std::size_t H = s.hidden, n = s.tokens, S = s.pairs();
  const int L = s.experts / s.ep;
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
      std::vector<char> src;
    };
    auto d = std::make_shared<data_t>();
    d->x = make_rows<T>(n, H, me);
    d->out.assign(n * H, epx::convert<T>(0.0f));
    d->ids = make_ids(n, s.k, s.experts, s.routing, me);
    d->w = make_weights(n, s.k, me);
    d->plan = epx::layout::build_plan(ex, d->ids.data(), d->w.data(), n, s.k, s.experts, 1);
    const auto g = epx::detail::exchange_records(comm, ex, 0, n, H, s.k, me, d->plan.host_counts.data(),
                                                 static_cast<std::size_t>(s.experts), "", "bench", 1);
    const auto layout = epx::detail::make_receive_layout(s.ep, s.ep, L, epx::padding{},
                                                         [&](int r) { return g.counts(r); });
    d->lay = epx::detail::segments_of(layout, me);
    const std::size_t R = layout.rows(me);
    d->send = make_rows<T>(S, H, me + 100);  // touched; the combine stage reads it as y
    d->recv.assign(R * H, epx::convert<T>(0.0f));
    const std::size_t row_bytes = H * sizeof(T);
    const std::size_t rows = which == stage::exchange ? R : S;
    d->src.assign(std::max(S, R) * row_bytes, 0x3f);
    rank_work w;
    w.bytes = static_cast<double>(rows * row_bytes);
    // The floor writes into the stage's output buffer (combine: into its input y, whose
    // values stay normal floats so no denormal arithmetic follows).
    T* floor_dst = which == stage::exchange ? d->recv.data() : d->send.data();
    w.floor = [d, floor_dst, rows, row_bytes] {
      std::memcpy(floor_dst, d->src.data(), rows * row_bytes);
      benchmark::DoNotOptimize(floor_dst);
    };
    switch (which) {
      case stage::scatter:
        w.measured = [d, S, H] {
          epx::kernels::gather(epx::exec::serial{}, S, H, static_cast<const T*>(d->x.data()),
                               static_cast<const std::int64_t*>(d->plan.src_row.data()), d->send.data());
          benchmark::DoNotOptimize(d->send.data());
        };
        break;
      case stage::exchange:
        w.measured = [d, &comm, L, H] {
          epx::all_to_allv_segments(comm, static_cast<const T*>(d->send.data()), epx::make_span(d->lay.send_counts),
                                    epx::make_span(d->lay.send_displs), d->recv.data(),
                                    epx::make_span(d->lay.recv_counts), epx::make_span(d->lay.recv_displs),
                                    static_cast<std::size_t>(L), H);
        };
        break;
      case stage::combine:
        w.measured = [d, n, H, s] {
          epx::kernels::combine(epx::exec::serial{}, n, H, s.k, static_cast<const T*>(d->send.data()), d->w.data(),
                                static_cast<const std::int64_t*>(d->plan.pos.data()), d->out.data());
          benchmark::DoNotOptimize(d->out.data());
        };
        break;
    }
    return w;
  });
  summary_row row;
  row.name = g_current_name;
  set_data_counters(state, r, row);
  add_row(row);
}

// --- round trips ----------------------------------------------------------------------------
std::string shape_key(const shape& s, const char* type) { return s.str() + "/" + type; }

// Per-rank floor parts of a round trip. Forward: gather S, dispatch R, return S, combine S
// (the identity experts work in place). Backward: scatter S, dispatch R, experts R,
// return S, reduce S.
std::vector<std::size_t> round_trip_parts(std::size_t S, std::size_t R, std::size_t row_bytes, bool backward) {
  if (backward) return {S * row_bytes, R * row_bytes, R * row_bytes, S * row_bytes, S * row_bytes};
  return {S * row_bytes, R * row_bytes, S * row_bytes, S * row_bytes};
}

template <class T>
void bench_baseline(benchmark::State& state, shape s) {
  const std::size_t H = s.hidden, n = s.tokens;
  std::vector<std::int64_t> workspace(static_cast<std::size_t>(s.ep), 0);
  const run_result r = drive(state, s.ep, [&](epx::threads::communicator& comm, std::int64_t&) {
    const int me = comm.rank();
    struct data_t {
      std::vector<T> x, out;
      std::vector<std::int32_t> ids;
      std::vector<float> w;
      epx::bench::baseline_layer<T> layer;
    };
    auto d = std::make_shared<data_t>();
    d->x = make_rows<T>(n, H, me);
    d->out.assign(n * H, epx::convert<T>(0.0f));
    d->ids = make_ids(n, s.k, s.experts, s.routing, me);
    d->w = make_weights(n, s.k, me);
    // One call sizes the workspace (kept between calls, as a caching allocator would).
    d->layer.forward(comm, d->x.data(), d->ids.data(), d->w.data(), n, H, s.k, s.experts, d->out.data());
    workspace[static_cast<std::size_t>(me)] = static_cast<std::int64_t>(d->layer.workspace_bytes());
    rank_work w;
    w.measured = [d, &comm, n, H, s] {
      d->layer.forward(comm, d->x.data(), d->ids.data(), d->w.data(), n, H, s.k, s.experts, d->out.data());
      benchmark::DoNotOptimize(d->out.data());
    };
    w.floor = [] {};
    return w;
  });
  const double t = median(r.times);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_baseline_s[shape_key(s, type_name<T>())] = t;
  }
  state.counters["workspace_MiB"] =
      static_cast<double>(*std::max_element(workspace.begin(), workspace.end())) / (1 << 20);
  summary_row row;
  row.name = g_current_name;
  row.us = t * 1e6;
  row.extra_mib = state.counters["workspace_MiB"];
  add_row(row);
}

// Forward (inference) or backward of the layer with identity experts. `tp_equals_ep`
// builds the mesh tp = ep (one batch per EP group) for the masked-path comparison.
// `store_key`: remember this median under that key; `compare_key`: report
// speedup_vs_baseline against the median stored under that key earlier in the run.
template <class T, class Impl = epx::impl::all_to_all>
void bench_round_trip(benchmark::State& state, shape s, bool backward, bool tp_equals_ep, std::string store_key,
                      std::string compare_key, bool staged = false) {
  const std::size_t H = s.hidden, n = s.tokens;
  const run_result r = drive(state, s.ep, [&](epx::threads::communicator& comm, std::int64_t& allowance) {
    const int me = comm.rank();
    struct data_t {
      std::vector<T> x, out, grad_out, grad_x;
      std::vector<std::int32_t> ids;
      std::vector<float> w, grad_w;
      std::unique_ptr<epx::moe_layer<epx::threads::communicator, T, Impl>> layer;
      identity_experts<T> experts;
      epx::saved_state<T> saved;
      std::unique_ptr<floor_buffers> fl;
      std::vector<std::size_t> parts;
    };
    auto d = std::make_shared<data_t>();
    // With tp = ep every rank of the group holds the same batch (seeded by batch 0).
    const int seed = tp_equals_ep ? 0 : me;
    d->x = make_rows<T>(n, H, seed);
    d->out.assign(n * H, epx::convert<T>(0.0f));
    d->ids = make_ids(n, s.k, s.experts, s.routing, seed);
    d->w = make_weights(n, s.k, seed);
    epx::layer_options o;
    o.hidden = H;
    o.top_k = s.k;
    o.chunks = 1;
    o.peer_access = !staged;
    epx::mesh_config c;
    c.tp = tp_equals_ep ? s.ep : 1;
    c.fsdp = tp_equals_ep ? 1 : s.ep;
    c.ep = s.ep;
    c.experts = s.experts;
    d->layer = std::make_unique<epx::moe_layer<epx::threads::communicator, T, Impl>>(epx::mesh(c), comm, o);
    auto forward = [d](epx::mode m) {
      return d->layer->forward(epx::span<const T>(d->x.data(), d->x.size()),
                               epx::span<const std::int32_t>(d->ids.data(), d->ids.size()),
                               epx::span<const float>(d->w.data(), d->w.size()),
                               epx::span<T>(d->out.data(), d->out.size()), d->experts, m);
    };
    // One call to learn S (rows sent) and R (rows received, padding included) from the stats.
    forward(epx::mode::inference);
    const auto& st = d->layer->stats();
    std::size_t R = 0, S = 0;
    for (auto c2 : st.tokens_per_local_expert) R += static_cast<std::size_t>(c2);
    for (auto c2 : st.padding_per_local_expert) R += static_cast<std::size_t>(c2);
    for (auto c2 : st.rows_sent) S += static_cast<std::size_t>(c2);
    const std::size_t row_bytes = H * sizeof(T);
    allowance = static_cast<std::int64_t>(R * row_bytes);
    // A fresh layer: its row-buffer pool (kept between calls) is filled by the warm-up call,
    // so the heap peak counted there includes the pool's blocks.
    d->layer = std::make_unique<epx::moe_layer<epx::threads::communicator, T, Impl>>(epx::mesh(c), comm, o);
    if (std::is_same_v<Impl, epx::impl::all_reduce>)
      d->parts = {R * row_bytes, R * row_bytes, R * row_bytes, n * row_bytes};  // gather, experts, combine, all-reduce
    else
      d->parts = round_trip_parts(S, R, row_bytes, backward);
    d->fl = std::make_unique<floor_buffers>(std::max({S, R, n}) * row_bytes);
    rank_work w;
    for (auto b : d->parts) w.bytes += static_cast<double>(b);
    w.floor = [d] { d->fl->copy(d->parts); };
    if (!backward) {
      w.measured = [d, forward] { forward(epx::mode::inference); };
    } else {
      d->grad_out = make_rows<T>(n, H, seed + 50);
      d->grad_x.assign(n * H, epx::convert<T>(0.0f));
      d->grad_w.assign(n * static_cast<std::size_t>(s.k), 0.0f);
      w.prepare = [d, forward] { d->saved = forward(epx::mode::train); };
      w.measured = [d] {
        d->layer->backward(std::move(d->saved), epx::span<const T>(d->grad_out.data(), d->grad_out.size()),
                           epx::span<T>(d->grad_x.data(), d->grad_x.size()),
                           epx::span<float>(d->grad_w.data(), d->grad_w.size()), d->experts);
      };
    }
    return w;
  });
  summary_row row;
  row.name = g_current_name;
  set_data_counters(state, r, row);
  set_memory_counters(state, r, row);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!store_key.empty()) g_baseline_s[store_key] = median(r.times);
  if (!compare_key.empty()) {
    auto it = g_baseline_s.find(compare_key);
    if (it != g_baseline_s.end() && row.us > 0) {
      row.baseline_us = it->second * 1e6;
      row.speedup = row.baseline_us / row.us;
      state.counters["baseline_us"] = row.baseline_us;
      state.counters["speedup_vs_baseline"] = row.speedup;
    }
  }
  for (auto& x : g_rows)
    if (x.name == row.name) {
      x = row;
      return;
    }
  g_rows.push_back(row);
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

// Bytes one round trip copies on all ranks (for the iteration estimate).
double round_trip_bytes(const shape& s, std::size_t elem) {
  return 4.0 * static_cast<double>(s.pairs()) * static_cast<double>(s.hidden * elem) * s.ep;
}

template <class T>
void register_round_trip(const shape& s, bool with_baseline, bool with_backward, int iters_override) {
  const std::string key = shape_key(s, type_name<T>());
  const int it = iters_override > 0 ? iters_override : iterations_for(round_trip_bytes(s, sizeof(T)));
  const std::string tn = type_name<T>();
  if (with_baseline)
    finish(reg("baseline_forward<" + tn + ">/" + s.str(),
                                        [s](benchmark::State& st) { bench_baseline<T>(st, s); }),
           it);
  finish(reg("round_trip_forward<" + tn + ">/" + s.str(),
             [s, key](benchmark::State& st) { bench_round_trip<T>(st, s, false, false, "", key); }),
         it);
  if (with_backward)
    finish(reg("round_trip_backward<" + tn + ">/" + s.str(),
               [s](benchmark::State& st) { bench_round_trip<T>(st, s, true, false, "", ""); }),
           it);
}

// The staged route (layer_options::peer_access = false: rows through the communicator's
// all-to-all, as on MPI and NCCL) on the same communicator, forward and backward.
template <class T>
void register_staged(const shape& s, int iters_override) {
  const std::string key = shape_key(s, type_name<T>());
  const int it = iters_override > 0 ? iters_override : iterations_for(round_trip_bytes(s, sizeof(T)));
  const std::string tn = type_name<T>();
  finish(reg("round_trip_forward_staged<" + tn + ">/" + s.str(),
             [s, key](benchmark::State& st) { bench_round_trip<T>(st, s, false, false, "", key, true); }),
         it);
  finish(reg("round_trip_backward_staged<" + tn + ">/" + s.str(),
             [s](benchmark::State& st) { bench_round_trip<T>(st, s, true, false, "", "", true); }),
         it);
}

template <class T>
void register_stages(const shape& s, int iters_override) {
  const std::string tn = type_name<T>();
  const int it = iters_override > 0 ? iters_override : iterations_for(round_trip_bytes(s, sizeof(T)) / 5, 0.5);
  const std::pair<const char*, stage> stages[] = {
      {"scatter", stage::scatter}, {"exchange", stage::exchange}, {"combine", stage::combine}};
  for (const auto& [name, which] : stages) {
    const stage w = which;
    finish(reg(std::string(name) + "<" + tn + ">/" + s.str(),
                                        [s, w](benchmark::State& st) { bench_stage<T>(st, s, w); }),
           it);
  }
}

template <class T>
void register_masked(const shape& s, int iters_override) {
  const std::string tn = type_name<T>();
  const int it = iters_override > 0 ? iters_override : iterations_for(round_trip_bytes(s, sizeof(T)) / 2);
  const std::string key = "tp=ep/" + shape_key(s, tn.c_str());
  finish(reg("tp_eq_ep_all_to_all<" + tn + ">/" + s.str(),
                                      [s, key](benchmark::State& st) {
                                        bench_round_trip<T, epx::impl::all_to_all>(st, s, false, true, key, "");
                                      }),
         it);
  // speedup_vs_baseline here: all_to_all time / all_reduce time at the same shape.
  finish(reg("tp_eq_ep_all_reduce<" + tn + ">/" + s.str(),
                                      [s, key](benchmark::State& st) {
                                        bench_round_trip<T, epx::impl::all_reduce>(st, s, false, true, "", key);
                                      }),
         it);
}

void register_layout(const shape& s, int iters_override) {
  const int it = iters_override > 0 ? iters_override
                                    : static_cast<int>(std::clamp(4e6 / static_cast<double>(s.pairs()), 5.0, 2000.0));
  finish(reg("layout/" + s.str(),
                                      [s](benchmark::State& st) { bench_layout(st, s); }),
         it)
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

// The registered set; see bench/README.md for why these shapes.
void register_all(bool quick) {
  if (quick) {
    const int q = 3;
    register_layout(make_shape(8, 128, 0, 8, 64), q);
    register_layout(make_shape(8, 128, 0, 8, 64, zipf), q);
    register_stages<bf16>(make_shape(2, 128, 1024, 8, 64), q);
    register_round_trip<bf16>(make_shape(2, 128, 1024, 8, 64), true, true, q);
    register_staged<bf16>(make_shape(2, 128, 1024, 8, 64), q);
    register_round_trip<float>(make_shape(2, 128, 1024, 2, 8, zipf), true, false, q);
    register_masked<bf16>(make_shape(2, 128, 1024, 8, 64), q);
    return;
  }
  // Layout: every tokens x k x experts, both routings (one rank; cheap).
  for (routing_kind r : {balanced, zipf})
    for (std::size_t tokens : {128, 4096, 16384})
      for (int k : {2, 8})
        for (int E : {8, 64, 256}) register_layout(make_shape(8, tokens, 0, k, E, r), 0);
  // Stages at ep = 8: hidden 1024 and 4096, the target shape skewed, float32, and hidden
  // 7168 at ep = 2 (memory).
  register_stages<bf16>(make_shape(8, 128, 1024, 8, 64), 0);
  register_stages<bf16>(make_shape(8, 4096, 1024, 8, 64), 0);
  register_stages<bf16>(make_shape(8, 4096, 4096, 8, 64), 0);
  register_stages<bf16>(make_shape(8, 4096, 4096, 8, 64, zipf), 0);
  register_stages<float>(make_shape(8, 4096, 1024, 8, 64), 0);
  register_stages<bf16>(make_shape(2, 4096, 7168, 8, 64), 0);
  // Round trips. The target shape (both routings, forward and backward, with baseline);
  // growth in tokens x k x hidden at ep = 8 (16 MiB to 256 MiB of routed rows per rank);
  // ep 2 and 4; experts 8 and 256 and float32 at hidden 1024; hidden 7168 at ep = 2; the
  // latency end (128 tokens).
  register_round_trip<bf16>(make_shape(8, 4096, 4096, 8, 64), true, true, 0);
  register_staged<bf16>(make_shape(8, 4096, 4096, 8, 64), 0);
  register_round_trip<bf16>(make_shape(8, 4096, 4096, 8, 64, zipf), true, true, 0);
  register_round_trip<bf16>(make_shape(8, 4096, 1024, 2, 64), true, false, 0);
  register_round_trip<bf16>(make_shape(8, 4096, 1024, 8, 64), true, true, 0);
  register_round_trip<bf16>(make_shape(8, 16384, 1024, 8, 64), true, false, 0);
  register_round_trip<bf16>(make_shape(2, 4096, 4096, 8, 64), true, false, 0);
  register_round_trip<bf16>(make_shape(4, 4096, 4096, 8, 64), true, false, 0);
  register_round_trip<bf16>(make_shape(8, 4096, 1024, 8, 8), true, false, 0);
  register_round_trip<bf16>(make_shape(8, 4096, 1024, 8, 256), true, false, 0);
  register_round_trip<float>(make_shape(8, 4096, 1024, 8, 64), true, true, 0);
  register_round_trip<bf16>(make_shape(2, 4096, 7168, 8, 64), true, false, 0);
  register_round_trip<bf16>(make_shape(8, 128, 1024, 8, 64), true, true, 0);
  // Masked all-reduce against all-to-all with tp = ep (one batch per EP group).
  for (int ep : {2, 4, 8}) register_masked<bf16>(make_shape(ep, 4096, 1024, 8, 64), 0);
  register_masked<bf16>(make_shape(8, 128, 1024, 8, 64), 0);
}

void print_summary() {
  if (g_rows.empty()) return;
  std::printf("\nSummary (median per call; speedup = baseline / epx; memory per rank; heap=%s)\n",
              heap::caching ? "cache" : "system");
  std::printf("%-88s %11s %11s %8s %8s %7s %9s %9s\n", "benchmark", "epx_ms", "baseline_ms", "speedup",
              "floor", "GB/s", "extra_MiB", "allow_MiB");
  for (const auto& r : g_rows) {
    std::printf("%-88s %11.3f %11s %8s %8s %7s %9s %9s\n", r.name.c_str(), r.us * 1e-3,
                r.baseline_us > 0 ? epx::detail::concat(r.baseline_us * 1e-3).c_str() : "-",
                r.speedup > 0 ? epx::detail::concat(r.speedup).c_str() : "-",
                r.floor_ratio > 0 ? epx::detail::concat(r.floor_ratio).c_str() : "-",
                r.gbs > 0 ? epx::detail::concat(r.gbs).c_str() : "-",
                r.extra_mib > 0 ? epx::detail::concat(r.extra_mib).c_str() : "-",
                r.allowance_mib > 0 ? epx::detail::concat(r.allowance_mib).c_str() : "-");
  }
}

}  // namespace

// --quick: the small set (seconds), used by the bench-smoke ctest. --heap=cache (default) or
// --heap=system: see the heap namespace above. Any Google Benchmark flag
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
    else
      args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  register_all(quick);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  print_summary();
  return 0;
}
