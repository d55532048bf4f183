// all_to_allv of rows over the MPI communicator, against a memcpy of the same bytes.
//
//   mpirun -np 2 ./bench_comm_mpi --benchmark_out=mpi_np2.json --benchmark_out_format=json
//   (and -np 4, -np 8; add --oversubscribe when ranks exceed cores)
//
// Every rank runs every benchmark; only rank 0 reports (and writes --benchmark_out). Each
// iteration's time is the slowest rank's (MPI_Allreduce MAX), handed to Google Benchmark as
// manual time, so all ranks see identical times and take identical iteration decisions.
// Each rank sends `bytes_per_rank` split evenly into rows of H = 1024 floats to all peers
// (itself included). Counters:
//   GB/s          bytes moved by all ranks per call / time
//   memcpy_GB/s   the same bytes copied by a plain memcpy on every rank at once, timed the
//                 same way, in the same benchmark run
//   floor_ratio   all_to_allv time / memcpy time (1.0 would be the copy floor)
//   checked       1 with the default count check (an all_to_all of the counts first)
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/mpi.hpp"

namespace {

constexpr std::size_t kRowElems = 1024;  // floats per row: 4 KiB rows

double max_over_ranks(double t) {
  double m = t;
  MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

void all_to_allv_rows(benchmark::State& state) {
  const auto bytes_per_rank = static_cast<std::size_t>(state.range(0));
  const bool checked = state.range(1) != 0;
  epx::mpi::options o;
  o.check_counts = checked;
  epx::mpi::communicator comm = epx::mpi::communicator::world(o);
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t rows_per_peer = std::max<std::size_t>(1, bytes_per_rank / (kRowElems * sizeof(float)) / n);
  const std::size_t rows = rows_per_peer * n;
  std::vector<std::size_t> counts(n, rows_per_peer), offsets(n);
  for (std::size_t p = 0; p < n; ++p) offsets[p] = p * rows_per_peer;
  std::vector<float> send(rows * kRowElems), recv(rows * kRowElems);  // [rows, H], peer-major
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(i % 1000) * 0.5f;
  std::fill(recv.begin(), recv.end(), 0.0f);
  auto exchange = [&] {
    epx::all_to_allv_rows(comm, send.data(), epx::make_span(counts), epx::make_span(offsets), recv.data(),
                          epx::make_span(counts), epx::make_span(offsets), kRowElems);
  };
  for (int w = 0; w < 2; ++w) exchange();  // warm-up: connections, page faults

  double total = 0;
  for (auto _ : state) {
    comm.barrier();
    const double t0 = MPI_Wtime();
    exchange();
    const double t = max_over_ranks(MPI_Wtime() - t0);
    state.SetIterationTime(t);
    total += t;
  }
  benchmark::DoNotOptimize(recv.data());

  // The floor: every rank copies the same bytes at once, as many times.
  const std::size_t bytes = send.size() * sizeof(float);
  double copy_total = 0;
  const auto iters = static_cast<std::size_t>(state.iterations());
  for (std::size_t k = 0; k < iters + 1; ++k) {
    comm.barrier();
    const double t0 = MPI_Wtime();
    std::memcpy(recv.data(), send.data(), bytes);
    benchmark::ClobberMemory();
    const double t = max_over_ranks(MPI_Wtime() - t0);
    if (k > 0) copy_total += t;  // first copy is a warm-up
  }
  const double moved = static_cast<double>(bytes) * static_cast<double>(n);
  const double per_call = total / static_cast<double>(iters), per_copy = copy_total / static_cast<double>(iters);
  state.counters["ranks"] = static_cast<double>(n);
  state.counters["bytes_per_rank"] = static_cast<double>(bytes);
  state.counters["checked"] = checked ? 1 : 0;
  state.counters["GB/s"] = moved / per_call * 1e-9;
  state.counters["memcpy_GB/s"] = moved / per_copy * 1e-9;
  state.counters["floor_ratio"] = per_call / per_copy;
  state.SetBytesProcessed(static_cast<std::int64_t>(moved) * state.iterations());
}

// 64 KiB .. 16 MiB per rank, with and without the count check. Fixed iteration counts keep
// every rank in step and the run short on small machines.
void args(benchmark::internal::Benchmark* b) {
  for (std::int64_t kib : {64, 1024, 4096, 16384}) {
    for (std::int64_t checked : {1, 0}) b->Args({kib * 1024, checked});
  }
  b->ArgNames({"bytes_per_rank", "checked"});
}

BENCHMARK(all_to_allv_rows)->Apply(args)->UseManualTime()->Iterations(20)->Unit(benchmark::kMicrosecond);

// Reports nothing: used on every rank but 0.
class null_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  epx::mpi::environment env(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  benchmark::Initialize(&argc, argv);
  bool has_out = false;
  for (int i = 1; i < argc; ++i) has_out = has_out || std::string(argv[i]).rfind("--benchmark_out=", 0) == 0;
  try {
    if (rank == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      null_reporter display, file;
      benchmark::RunSpecifiedBenchmarks(&display, has_out ? &file : nullptr);
    }
  } catch (const std::exception& e) {
    epx::mpi::abort_job(MPI_COMM_WORLD, e.what());
  }
  benchmark::Shutdown();
  return 0;
}
