// Compiled by nvcc into the consumer program beside main.cpp, when the package tests ask
// for it (EPX_CONSUMER_CUDA_OPENMP): host code only, nothing runs on a device. epx::epx
// must give CUDA sources the host compiler's OpenMP flag too, so that exec::openmp is as
// parallel here as in main.cpp and default_chunks(exec::openmp{}) gives the same count in
// both (a .cu source compiled without OpenMP would print "serial" and 1).
#include <epx/epx.hpp>

#include <cstddef>
#include <iostream>
#include <set>
#include <vector>

#if EPX_HAS_OPENMP
#include <omp.h>
#endif

void epx_consumer_cuda_openmp(std::ostream& out) {
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
    out << ".cu source: exec::openmp: parallel, " << threads.size() << " threads\n";
  } else {
    out << ".cu source: exec::openmp: serial\n";
  }
  out << ".cu source: default_chunks(exec::openmp{}): " << epx::layout::default_chunks(epx::exec::openmp{}) << "\n";
}
