// all_to_allv of rows over the MPI communicator, against a memcpy of the same bytes.
//
//   mpirun -np 2 ./bench_comm_mpi --benchmark_out=mpi_np2.json --benchmark_out_format=json
//   (and -np 4, -np 8; add --oversubscribe when ranks exceed cores)
//
// The MPI counterpart of bench_comm.cpp (threads): same rows (H = 1024 floats), same
// `bytes_per_peer` sizes, same counters. Every rank runs every benchmark; only rank 0
// reports (and writes --benchmark_out). Each iteration: barrier, the exchange timed on every
// rank to its return, barrier, then the floor: every rank memcpys the bytes it receives
// (one block per peer, itself included) from its send buffer into its receive buffer, all
// ranks at once. A time is the slowest rank's (MPI_Allreduce MAX); Google Benchmark gets the
// exchange's as manual time, so all ranks see the same times and run the same iterations.
// Counters:
//   GB/s              bytes moved by all ranks per call / median time
//   memcpy_GB/s       the same bytes moved by the plain memcpys / their median time
//   floor_ratio       median all_to_allv time / median memcpy time (1.0 = the copy floor)
//   floor_ratio_mean  the same with means
//   raw_mpi_GB/s      a bare MPI_Alltoallv of the same bytes, timed the same way in the
//                     same iteration; vs_raw_mpi = median epx time / its median time
//   checked           1 with the default count check (all_to_all of the counts and one
//                     MPI_Allreduce before the data), 0 without (point-to-point only)
//   output_checked    1: the first exchange's received blocks matched the senders' data
//                     (every rank's differs); a mismatch fails the benchmark and the run
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "check_failed.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/mpi.hpp"
#include "mpi_common.hpp"

namespace {

constexpr std::size_t kRowElems = 1024;  // floats per row: 4 KiB rows

double max_over_ranks(double t) {
  double m = t;
  MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

void mpi_all_to_allv_rows(benchmark::State& state) {
  const auto bytes_per_peer = static_cast<std::size_t>(state.range(0));
  const bool checked = state.range(1) != 0;
  epx::mpi::options o;
  o.check_counts = checked;
  epx::mpi::communicator comm = epx::mpi::communicator::world(o);
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t rows_per_peer = std::max<std::size_t>(1, bytes_per_peer / (kRowElems * sizeof(float)));
  const std::size_t block_bytes = rows_per_peer * kRowElems * sizeof(float);
  std::vector<std::size_t> counts(n, rows_per_peer), offsets(n);
  for (std::size_t p = 0; p < n; ++p) offsets[p] = p * rows_per_peer;
  std::vector<float> send(n * rows_per_peer * kRowElems), recv(send.size());  // [n, rows_per_peer, H]
  const auto me = static_cast<std::size_t>(comm.rank());
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>((i + me) % 1000) * 0.5f;
  std::fill(recv.begin(), recv.end(), 0.0f);
  auto exchange = [&] {
    epx::all_to_allv_rows(comm, send.data(), epx::make_span(counts), epx::make_span(offsets), recv.data(),
                          epx::make_span(counts), epx::make_span(offsets), kRowElems);
  };
  auto copy_floor = [&] { std::memcpy(recv.data(), send.data(), n * block_bytes); };
  // The library underneath: one MPI_Alltoallv of the same bytes (int counts, no checks).
  const int elems = static_cast<int>(rows_per_peer * kRowElems);
  std::vector<int> raw_counts(n, elems), raw_displs(n);
  for (std::size_t p = 0; p < n; ++p) raw_displs[p] = static_cast<int>(p) * elems;
  auto raw_mpi = [&] {
    MPI_Alltoallv(send.data(), raw_counts.data(), raw_displs.data(), MPI_FLOAT, recv.data(), raw_counts.data(),
                  raw_displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
  };
  for (int w = 0; w < 2; ++w) {  // warm-up: connections, page faults
    exchange();
    if (w == 0) {  // the check, before the floor and the bare MPI call write recv
      const std::size_t block = rows_per_peer * kRowElems;
      double bad = 0;
      for (std::size_t p = 0; p < n && bad == 0; ++p)
        for (std::size_t i = 0; i < block; ++i)
          if (recv[p * block + i] != static_cast<float>((me * block + i + p) % 1000) * 0.5f) {
            bad = 1;
            break;
          }
      if (max_over_ranks(bad) > 0) {
        epx::bench::fail_check(state, "output check failed: a received block differs from the sender's");
        return;
      }
    }
    copy_floor();
    raw_mpi();
  }
  std::vector<double> times, copy_times, raw_times;
  for (auto _ : state) {
    comm.barrier();
    double t0 = MPI_Wtime();
    exchange();
    const double t = max_over_ranks(MPI_Wtime() - t0);
    comm.barrier();
    t0 = MPI_Wtime();
    copy_floor();
    benchmark::ClobberMemory();
    copy_times.push_back(max_over_ranks(MPI_Wtime() - t0));
    comm.barrier();
    t0 = MPI_Wtime();
    raw_mpi();
    raw_times.push_back(max_over_ranks(MPI_Wtime() - t0));
    state.SetIterationTime(t);
    times.push_back(t);
  }
  benchmark::DoNotOptimize(recv.data());
  const double moved = static_cast<double>(block_bytes) * static_cast<double>(n * n);  // every pair, self included
  const double per_call = median(times), per_copy = median(copy_times);
  state.counters["ranks"] = static_cast<double>(n);
  state.counters["bytes_per_peer"] = static_cast<double>(block_bytes);
  state.counters["checked"] = checked ? 1 : 0;
  state.counters["output_checked"] = 1;
  state.counters["GB/s"] = moved / per_call * 1e-9;
  state.counters["memcpy_GB/s"] = moved / per_copy * 1e-9;
  state.counters["floor_ratio"] = per_call / per_copy;
  state.counters["floor_ratio_mean"] = mean(times) / mean(copy_times);
  state.counters["raw_mpi_GB/s"] = moved / median(raw_times) * 1e-9;
  state.counters["vs_raw_mpi"] = per_call / median(raw_times);
  state.SetLabel(std::string("mpi np=") + std::to_string(n) + " all_to_allv_rows");
  state.SetBytesProcessed(static_cast<std::int64_t>(moved) * state.iterations());
}

// 64 KiB .. 4 MiB per peer, with and without the count check. A fixed iteration count
// keeps the run short on small machines (Google Benchmark's own choice would be the same on
// every rank too, since every rank sees the same manual times).
void args(benchmark::internal::Benchmark* b) {
  for (std::int64_t kib : {64, 256, 1024, 4096}) {
    for (std::int64_t checked : {1, 0}) b->Args({kib * 1024, checked});
  }
  b->ArgNames({"bytes_per_peer", "checked"});
}

BENCHMARK(mpi_all_to_allv_rows)->Apply(args)->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  epx::mpi::environment env(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  benchmark::Initialize(&argc, argv);
  // A mistyped flag is not ignored: rank 0 names it, every rank returns 1.
  if (rank == 0 ? benchmark::ReportUnrecognizedArguments(argc, argv) : argc > 1) return 1;
  epx::bench::run_on_every_rank(rank, argc, argv);
  benchmark::Shutdown();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
