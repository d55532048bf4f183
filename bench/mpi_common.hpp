// bench/mpi_common.hpp: what the MPI benchmarks share: sums and maxima over the ranks of
// MPI_COMM_WORLD, and the silent reporter of the ranks other than 0.
#pragma once

#include <vector>

#include <benchmark/benchmark.h>
#include <mpi.h>

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

}  // namespace epx::bench
