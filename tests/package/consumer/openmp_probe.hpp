// Included by main.cpp and openmp.cu: says, after `prefix`, whether exec::openmp runs in
// parallel in the including source and the chunk count of its plans. `static` on purpose:
// each source keeps its own copy, compiled with its own flags (the point of the check).
#pragma once

#include <epx/epx.hpp>

#include <cstddef>
#include <ostream>
#include <set>
#include <vector>

#if EPX_HAS_OPENMP
#include <omp.h>
#endif

static void epx_consumer_report_openmp(std::ostream& out, const char* prefix) {
  // Two threads asked for: each element records the OpenMP thread that ran it.
  std::vector<int> ran_on(64, 0);
  epx::exec::for_each_n(epx::exec::openmp{2}, ran_on.size(), [&](std::size_t i) {
#if EPX_HAS_OPENMP
    ran_on[i] = omp_get_thread_num();
#else
    (void)i;
#endif
  });
  const std::set<int> threads(ran_on.begin(), ran_on.end());
  if (threads.size() > 1) {
    out << prefix << "exec::openmp: parallel, " << threads.size() << " threads\n";
  } else {
    out << prefix << "exec::openmp: serial\n";
  }
  // One chunk per OpenMP thread (OMP_NUM_THREADS=3 in the package tests), 1 without OpenMP.
  out << prefix << "default_chunks(exec::openmp{}): " << epx::layout::default_chunks(epx::exec::openmp{}) << "\n";
}
