// The MoE layer over MPI, on both routes, against the memcpy of the bytes the route reads
// and writes, measured in the same run: the direct route (ranks on one node read each
// other's buffers through the communicator's MPI-3 shared window) and the staged route
// (layer_options::peer_access = false: segmented all-to-alls through MPI).
//
//   mpirun -np 8 ./bench_layer_mpi --benchmark_out=layer_mpi.json --benchmark_out_format=json
//   mpirun -np 2 ./bench_layer_mpi --quick
//   mpirun -np 8 ./bench_layer_mpi --gathered   # staged sends gather first (indexed_sends = false)
//   (add --oversubscribe when ranks exceed cores)
//
// Every rank is a process with its own exec::serial policy and runs every benchmark; rank 0
// reports. One iteration: barrier, the layer call timed on every rank, the slowest rank's
// time (MPI_Allreduce MAX) is the iteration's; then the floor: every rank memcpys half the
// bytes its call reads plus writes (bench/layer_common.hpp's route_traffic, plus on the
// direct route the copy of the caller's rows into the shared window: x in forward,
// grad_out in backward; the layer's own published rows live in peer buffers), all ranks
// at once, timed the same way. Every benchmark checks its outputs once against the direct
// computation (identity experts). Counters as in bench_layer (epx_ms, floor_ms,
// floor_ratio, floor_bytes, memcpy_GB/s, rows_sent, repeat_fraction, checked); on the
// staged and per-rank routes also gathered_ms and speedup_vs_gathered(_paired): the same
// layer with gather-first sends (layer_options::indexed_sends = false) in the same loop.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "check_failed.hpp"
#include "epx/comm/mpi.hpp"
#include "epx/epx.hpp"
#include "layer_common.hpp"
#include "mpi_common.hpp"

namespace {

using namespace epx::bench;
using epx::bf16;
using comm_t = epx::mpi::communicator;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class T>
const char* type_name() {
  return std::is_same_v<T, bf16> ? "bf16" : "f32";
}

struct shape {
  std::size_t tokens, hidden;
  int k, experts;
};

template <class T>
void bench_mpi_route(benchmark::State& state, shape s, route rt, bool backward) {
  comm_t world = comm_t::world();
  const int ep = world.size(), me = world.rank();
  const std::size_t N = s.tokens, H = s.hidden, K = static_cast<std::size_t>(s.k);
  auto x = make_rows<T>(N, H, me), g = make_rows<T>(N, H, me + 50);
  auto ids = make_ids(N, s.k, s.experts, balanced, me);
  auto w = make_weights(N, s.k, me);
  std::vector<T> out(N * H), gx(N * H);
  std::vector<float> gw(N * K);
  epx::layer_options lo;
  lo.hidden = H;
  lo.top_k = s.k;
  lo.peer_access = rt == route::direct;
  if (rt == route::per_rank) lo.sends = epx::row_sends::per_rank;
  lo.indexed_sends = !epx::bench::gathered();
  const epx::mesh m = ep_mesh(ep, s.experts);
  epx::moe_layer<comm_t, T> layer(m, world, lo);
  identity_experts<T> experts;
  epx::saved_state<T> saved;
  auto fwd = [&](epx::mode md) {
    return layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                         epx::span<T>(out), experts, md);
  };
  auto bwd = [&] {
    layer.backward(std::move(saved), epx::span<const T>(g), epx::span<T>(gx), epx::span<float>(gw), experts);
  };
  // One checked call.
  const int partials = rt == route::per_rank ? std::min(s.k, ep) : 1;
  saved = fwd(epx::mode::train);
  std::string bad = check_forward(x.data(), w.data(), out.data(), N, H, s.k, partials);
  bwd();
  if (bad.empty()) bad = check_backward(x.data(), w.data(), g.data(), gx.data(), gw.data(), N, H, s.k, partials);
  // The timed forward is an inference call (on the direct route under MPI its rows and
  // outputs live in the peer memory): checked too.
  std::fill(out.begin(), out.end(), T{});
  (void)fwd(epx::mode::inference);
  if (bad.empty()) bad = check_forward(x.data(), w.data(), out.data(), N, H, s.k, partials);
  const double failed = max_over_ranks(bad.empty() ? 0.0 : 1.0);
  if (failed > 0) {
    if (!bad.empty()) std::fprintf(stderr, "rank %d: output check failed: %s\n", me, bad.c_str());
    epx::bench::fail_check(state, "output check failed");
    return;
  }
  // Staged and per-rank routes: the same layer with gather-first sends
  // (layer_options::indexed_sends = false), timed in the same loop; bitwise the same.
  const bool pair = rt != route::direct && lo.indexed_sends;
  std::unique_ptr<epx::moe_layer<comm_t, T>> layer_g;
  std::vector<T> out_g(N * H), gx_g(N * H);
  std::vector<float> gw_g(N * K);
  epx::saved_state<T> saved_g;
  auto fwd_g = [&](epx::mode md) {
    return layer_g->forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                            epx::span<T>(out_g), experts, md);
  };
  auto bwd_g = [&] {
    layer_g->backward(std::move(saved_g), epx::span<const T>(g), epx::span<T>(gx_g), epx::span<float>(gw_g), experts);
  };
  if (pair) {
    epx::layer_options lg = lo;
    lg.indexed_sends = false;
    layer_g = std::make_unique<epx::moe_layer<comm_t, T>>(m, world, lg);
    saved = fwd(epx::mode::train);
    saved_g = fwd_g(epx::mode::train);
    const bool by_index = layer.stats().indexed_sends && !layer_g->stats().indexed_sends;
    bwd();
    bwd_g();
    auto same = [](const auto& a, const auto& b) {
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    const bool equal = by_index && same(out, out_g) && same(gx, gx_g) && same(gw, gw_g);
    if (max_over_ranks(equal ? 0.0 : 1.0) > 0) {
      epx::bench::fail_check(state, "gather-first sends differ bitwise (or did not take their route)");
      return;
    }
  }
  const auto& st = layer.stats();
  if (max_over_ranks(st.peer_access == (rt == route::direct) ? 0.0 : 1.0) > 0) {
    epx::bench::fail_check(state, "the layer did not take the requested route");
    return;
  }
  // The staged sends the floor counts: by index, or gathered first with --gathered.
  if (max_over_ranks(rt != route::direct && st.indexed_sends == epx::bench::gathered() ? 1.0 : 0.0) > 0) {
    epx::bench::fail_check(state, "the layer's staged sends were not those the floor counts");
    return;
  }
  const std::string label = epx::detail::concat(
      "mpi np=", ep, " route=", rt == route::direct ? "direct (shared window)" : to_string(rt),
      rt == route::direct ? "" : st.indexed_sends ? " sends=by index" : " sends=gathered");
  std::size_t R = 0, P = 0, S = 0, remote = 0, got = 0;
  for (auto c : st.tokens_per_local_expert) R += static_cast<std::size_t>(c);
  for (auto c : st.padding_per_local_expert) P += static_cast<std::size_t>(c);
  R += P;
  for (std::size_t p = 0; p < st.rows_sent.size(); ++p) {
    S += static_cast<std::size_t>(st.rows_sent[p]);
    got += static_cast<std::size_t>(st.rows_received[p]);
    if (static_cast<int>(p) != me) remote += static_cast<std::size_t>(st.rows_sent[p]);
  }
  std::size_t per_rank = 0;
  {
    const int L = s.experts / ep;
    std::vector<std::size_t> seen(static_cast<std::size_t>(ep), N);
    for (std::size_t t = 0; t < N; ++t)
      for (std::size_t j = 0; j < K; ++j) {
        const auto owner = static_cast<std::size_t>(ids[t * K + j] / L);
        if (seen[owner] != t) {
          seen[owner] = t;
          ++per_rank;
        }
      }
  }
  const double row_bytes = static_cast<double>(H * sizeof(T));
  double traffic = 0;
  std::vector<std::size_t> parts;
  std::vector<double> route_rows = route_traffic(rt, backward, static_cast<double>(S), static_cast<double>(R),
                                                 static_cast<double>(P), static_cast<double>(N), static_cast<double>(N), 1,
                                                 static_cast<double>(got), epx::bench::gathered());
  if (rt == route::direct) {
    // The copy into the shared window (a copy reads and writes) of the caller's rows: x
    // (N rows) in forward, grad_out (N) in backward. The rows the layer publishes itself
    // (the experts' outputs, the input gradients) are made in peer buffers and read where
    // they are; the index and weight arrays are small beside them and not counted.
    route_rows.push_back(2 * static_cast<double>(N));
  }
  for (double p : route_rows) {
    traffic += p * row_bytes;
    parts.push_back(static_cast<std::size_t>(p * row_bytes / 2));
  }
  std::size_t max_part = 1;
  for (auto p : parts) max_part = std::max(max_part, p);
  const std::size_t cap = std::min<std::size_t>(max_part, std::size_t{64} << 20);
  std::vector<char> fa(cap, 1), fb(cap, 2);
  auto floor_copy = [&] {
    bool dir = false;
    for (std::size_t n : parts)
      while (n > 0) {
        const std::size_t c = std::min(n, cap);
        std::memcpy(dir ? fa.data() : fb.data(), dir ? fb.data() : fa.data(), c);
        dir = !dir;
        n -= c;
      }
    benchmark::DoNotOptimize(fa.data());
  };
  auto timed = [&](auto&& f) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return max_over_ranks(t);
  };
  std::vector<double> times, floors, times_g, ratio_g;
  for (auto _ : state) {
    if (backward) saved = fwd(epx::mode::train);
    const double t = backward ? timed(bwd) : timed([&] { fwd(epx::mode::inference); });
    if (pair) {
      if (backward) saved_g = fwd_g(epx::mode::train);
      times_g.push_back(backward ? timed(bwd_g) : timed([&] { fwd_g(epx::mode::inference); }));
      ratio_g.push_back(times_g.back() / t);
    }
    floors.push_back(timed(floor_copy));
    times.push_back(t);
    state.SetIterationTime(t);
  }
  const double te = median(times), tf = median(floors);
  if (pair) {
    state.counters["gathered_ms"] = median(times_g) * 1e3;
    state.counters["speedup_vs_gathered"] = te > 0 ? median(times_g) / te : 0.0;
    state.counters["speedup_vs_gathered_paired"] = median(ratio_g);
  }
  const double all_traffic = sum_over_ranks(traffic);
  const double rows = sum_over_ranks(static_cast<double>(S)), rows_remote = sum_over_ranks(static_cast<double>(remote)),
               rows_pr = sum_over_ranks(static_cast<double>(per_rank));
  state.counters["epx_ms"] = te * 1e3;
  state.counters["floor_ms"] = tf * 1e3;
  state.counters["floor_ratio"] = tf > 0 ? te / tf : 0.0;
  state.counters["floor_bytes"] = all_traffic;
  state.counters["GB/s"] = te > 0 ? all_traffic / te * 1e-9 : 0.0;
  state.counters["memcpy_GB/s"] = tf > 0 ? all_traffic / tf * 1e-9 : 0.0;
  state.counters["rows_sent"] = rows / ep;
  state.counters["rows_sent_remote"] = rows_remote / ep;
  state.counters["rows_per_rank_mode"] = rows_pr / ep;
  state.counters["repeat_fraction"] = rows > 0 ? 1.0 - rows_pr / rows : 0.0;
  state.counters["checked"] = 1;
  state.SetLabel(label);
}

template <class T>
void reg(const shape& s, route rt, bool backward, int iters) {
  const std::string name = epx::detail::concat("mpi_route<", type_name<T>(), ">/", to_string(rt), "/", backward ? "bwd" : "fwd",
                                               "/tokens:", s.tokens, "/hidden:", s.hidden, "/k:", s.k,
                                               "/experts:", s.experts);
  benchmark::RegisterBenchmark(name.c_str(),
                               [s, rt, backward](benchmark::State& st) { bench_mpi_route<T>(st, s, rt, backward); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(iters);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  bool quick = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    else if (!epx::bench::gathered_flag(argv[i]) && !epx::bench::stream_threshold_flag(argv[i])) args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  // A mistyped flag is not ignored: rank 0 names it, every rank returns 1.
  if (rank == 0 ? benchmark::ReportUnrecognizedArguments(n, args.data()) : n > 1) {
    MPI_Finalize();
    return 1;
  }
  benchmark::AddCustomContext("staged_sends", epx::bench::gathered() ? "gathered" : "by index");
  benchmark::AddCustomContext("stream_threshold", std::to_string(epx::exec::stream_threshold()));
  for (route rt : {route::direct, route::staged, route::per_rank}) {
    if (quick) {
      reg<bf16>({128, 1024, 8, 64}, rt, false, 3);
      reg<bf16>({128, 1024, 8, 64}, rt, true, 3);
    } else {
      // The transformers comparison shape, then the target shape.
      for (bool bwd : {false, true}) {
        reg<bf16>({1024, 1024, 8, 64}, rt, bwd, 20);
        reg<float>({1024, 1024, 8, 64}, rt, bwd, 20);
      }
      reg<bf16>({4096, 4096, 8, 64}, rt, false, 10);
      reg<bf16>({4096, 4096, 8, 64}, rt, true, 10);
    }
  }
  epx::bench::run_on_every_rank(rank, n, args.data());
  benchmark::Shutdown();
  MPI_Finalize();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
