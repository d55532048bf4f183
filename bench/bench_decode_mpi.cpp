// The decode step of bench_decode.cpp over MPI: one process per rank, 128 tokens x 7168
// hidden, top-8 of 256 experts, ep = 8 (run with 8 processes), bf16, inference forward with
// identity experts in place; the normal mode against bounded mode (spec section 11), each
// on the direct route (the ranks on one node read each other's buffers through the
// communicator's MPI-3 shared window) and on the staged route (MPI all-to-all), and the FP8
// dispatch (spec section 12) on both routes.
//
//   mpiexec -n 8 ./bench_decode_mpi --benchmark_out=decode_mpi.json --benchmark_out_format=json
//   mpiexec -n 8 ./bench_decode_mpi --calls=50 --benchmark_filter=bounded
//   mpiexec -n 2 ./bench_decode_mpi --quick       # seconds: 8 tokens, H = 256, ep = the job's size
//
// The measurement, the checks and the counters are bench_decode.cpp's (decode_common.hpp):
// latency per call barrier to barrier (median_us, p99_us; Google Benchmark's time is the
// median), wait_share (time inside the communicator over the latency, mean over ranks and
// calls), floor_us (the memcpy of the route's bytes, all ranks at once; on the direct route
// the copies of x and of the outputs into the shared window included), overflow_pairs,
// checked. The label names the backend, mode and route.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "check_failed.hpp"
#include "decode_common.hpp"
#include "epx/comm/mpi.hpp"
#include "epx/epx.hpp"
#include "mpi_common.hpp"

namespace {

using namespace epx::bench;
using namespace epx::bench::decode;
using comm_t = epx::mpi::communicator;

shape g_shape;
int g_calls = 300;

void BM_decode_mpi(benchmark::State& state, bool bounded, bool direct, bool fp8) {
  comm_t world = comm_t::world();
  rank_result r;
  for (auto _ : state) {
    r = decode_rank(world, g_shape, g_calls, bounded, direct, fp8, direct);
    const bool failed = max_over_ranks(r.failure.empty() ? 0.0 : 1.0) > 0;
    if (failed) {
      if (!r.failure.empty()) std::fprintf(stderr, "rank %d: %s\n", world.rank(), r.failure.c_str());
      fail_check(state, "output check failed");
      return;
    }
    state.SetIterationTime(percentile(r.latency, 0.5));
  }
  const double ranks = world.size();
  state.counters["median_us"] = percentile(r.latency, 0.5) * 1e6;
  state.counters["p99_us"] = percentile(r.latency, 0.99) * 1e6;
  state.counters["wait_share"] = sum_over_ranks(r.wait_share) / ranks;
  state.counters["floor_us"] = percentile(r.floors, 0.5) * 1e6;
  state.counters["MiB_moved"] = r.bytes / (1024.0 * 1024.0);
  state.counters["overflow_pairs"] = max_over_ranks(static_cast<double>(r.overflow));
  state.counters["checked"] = 1;
  state.counters["tokens"] = static_cast<double>(g_shape.tokens);
  state.counters["hidden"] = static_cast<double>(g_shape.hidden);
  state.counters["cap"] = bounded ? static_cast<double>(g_shape.cap) : 0.0;
  state.SetLabel(std::string("mpi np=") + std::to_string(world.size()) +
                 (fp8 ? " bf16 layer, fp8 rows out " : " bf16 ") + (bounded ? "bounded" : "normal") +
                 " route=" + (direct ? "direct (shared window)" : "staged"));
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<char*> args;
  bool quick = false;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a.rfind("--calls=", 0) == 0) g_calls = std::max(1, std::atoi(a.c_str() + 8));
    else if (!epx::bench::stream_threshold_flag(a)) args.push_back(argv[i]);
  }
  g_shape.ep = size;
  if (quick) {
    g_shape.tokens = 8;
    g_shape.hidden = 256;
    g_shape.experts = 4 * size;
    g_shape.top_k = std::min(4, g_shape.experts);
    g_shape.cap = 8;
    g_calls = 5;
  }
  if (g_shape.experts % size != 0) {
    if (rank == 0) std::fprintf(stderr, "bench_decode_mpi: %d experts over %d ranks: run with 1, 2, 4 or 8\n", g_shape.experts, size);
    MPI_Finalize();
    return 1;
  }
  for (bool direct : {true, false})
    for (bool bounded : {false, true}) {
      const std::string name = std::string("decode_mpi/bf16/") + (bounded ? "bounded" : "normal") + "/" +
                               (direct ? "direct" : "staged");
      benchmark::RegisterBenchmark(name.c_str(), BM_decode_mpi, bounded, direct, false)
          ->UseManualTime()
          ->Iterations(1)
          ->Unit(benchmark::kMicrosecond);
    }
  for (bool direct : {true, false})
    benchmark::RegisterBenchmark((std::string("decode_mpi/fp8/normal/") + (direct ? "direct" : "staged")).c_str(),
                                 BM_decode_mpi, false, direct, true)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMicrosecond);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  // A mistyped flag is not ignored: rank 0 names it, every rank returns 1.
  if (rank == 0 ? benchmark::ReportUnrecognizedArguments(n, args.data()) : n > 1) {
    MPI_Finalize();
    return 1;
  }
  benchmark::AddCustomContext("stream_threshold", std::to_string(epx::exec::stream_threshold()));
  run_on_every_rank(rank, n, args.data());
  benchmark::Shutdown();
  MPI_Finalize();
  return check_failed() ? 1 : 0;  // a failed output check fails the run
}
