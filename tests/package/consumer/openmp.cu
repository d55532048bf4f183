// Compiled by nvcc into the consumer program beside main.cpp, when the package tests ask
// for it (EPX_CONSUMER_CUDA_OPENMP): host code only, nothing runs on a device. epx::epx
// must give CUDA sources the host compiler's OpenMP flag too, so that exec::openmp is as
// parallel here as in main.cpp and default_chunks(exec::openmp{}) gives the same count in
// both (a .cu source compiled without OpenMP would print "serial" and 1).
#include <ostream>

#include "openmp_probe.hpp"

void epx_consumer_cuda_openmp(std::ostream& out) { epx_consumer_report_openmp(out, ".cu source: "); }
