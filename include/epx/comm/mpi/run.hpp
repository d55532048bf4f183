// epx/comm/mpi/run.hpp: epx::mpi::run, the entry point of an MPI job, and abort_job.
//
// run initializes MPI, calls f(world) and finalizes; an exception escaping f on any rank
// ends the whole job with "epx: rank R failed: <message>", so no rank is left waiting.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <type_traits>

#include "epx/comm/mpi/communicator.hpp"
#include "epx/comm/mpi/environment.hpp"

namespace epx::mpi {

// Prints "epx: rank R failed: <message>" to stderr and aborts every process of `comm`
// (MPI_Abort), so that mpirun tears the job down instead of leaving peers waiting.
[[noreturn]] inline void abort_job(MPI_Comm comm, const char* message) noexcept {
  int r = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  std::fprintf(stderr, "epx: rank %d failed: %s\n", r, message);
  std::fflush(stderr);
  MPI_Abort(comm, 1);
  std::abort();
}

// Initializes MPI (if needed), calls f(world communicator) and finalizes MPI. An exception
// escaping f on any rank aborts the whole job with its message (see abort_job). Returns f's
// result if it returns int, else 0.
template <class F>
int run(int& argc, char**& argv, F&& f, int required_thread_level = MPI_THREAD_FUNNELED) {
  environment env(argc, argv, required_thread_level);
  int result = 0;
  try {
    communicator world = communicator::world();
    if constexpr (std::is_convertible_v<std::invoke_result_t<F, communicator&>, int>) {
      result = static_cast<int>(f(world));
    } else {
      f(world);
    }
  } catch (const std::exception& e) {
    abort_job(MPI_COMM_WORLD, e.what());
  } catch (...) {
    abort_job(MPI_COMM_WORLD, "unknown exception");
  }
  return result;
}

}  // namespace epx::mpi
