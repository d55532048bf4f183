// bench/mpi_common.hpp: what the MPI benchmarks share: sums and maxima over the ranks of
// MPI_COMM_WORLD, and the silent reporter of the ranks other than 0.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <mpi.h>

#include "epx/comm/mpi.hpp"

namespace epx::bench {

inline double max_over_ranks(double t) {
  double m = t;
  MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

inline double sum_over_ranks(double v) {
  double s = v;
  MPI_Allreduce(&v, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return s;
}

// Rank 0 reports; the others run silently.
class quiet_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// Runs the registered benchmarks on every rank of the job (args: what
// benchmark::Initialize left, args[0] the program): rank 0 reports (and writes
// --benchmark_out), the others run silently; an exception on a rank ends the whole job
// with its message.
inline void run_on_every_rank(int rank, int n, char** args) {
  bool has_out = false;
  for (int i = 1; i < n; ++i) has_out = has_out || std::string(args[i]).rfind("--benchmark_out=", 0) == 0;
  try {
    if (rank == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      quiet_reporter display, file;
      benchmark::RunSpecifiedBenchmarks(&display, has_out ? &file : nullptr);
    }
  } catch (const std::exception& e) {
    epx::mpi::abort_job(MPI_COMM_WORLD, e.what());
  }
}

}  // namespace epx::bench
