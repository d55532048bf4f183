// epx/comm/mpi/environment.hpp: epx::mpi::environment, the MPI_Init_thread / MPI_Finalize
// guard (needs <mpi.h>).
#pragma once

#include <mpi.h>

#include "epx/comm/mpi/support.hpp"

namespace epx::mpi {

// Initializes MPI on construction (MPI_Init_thread) unless it already is, and finalizes it on
// destruction if and only if this guard initialized it. Neither copyable nor movable.
class environment {
 public:
  explicit environment(int* argc = nullptr, char*** argv = nullptr, int required = MPI_THREAD_FUNNELED) {
    int initialized = 0;
    EPX_MPI_CHECK(MPI_Initialized(&initialized));
    if (initialized) {
      EPX_MPI_CHECK(MPI_Query_thread(&provided_));
      return;
    }
    EPX_MPI_CHECK(MPI_Init_thread(argc, argv, required, &provided_));
    owns_ = true;
  }
  environment(int& argc, char**& argv, int required = MPI_THREAD_FUNNELED)
      : environment(&argc, &argv, required) {}
  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;
  ~environment() {
    if (!owns_) return;
    int finalized = 0;
    if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Finalize();
  }

  // The thread support level MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  int thread_level() const noexcept { return provided_; }
  // Whether this guard initialized MPI (and will finalize it).
  bool owns_mpi() const noexcept { return owns_; }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_ = false;
};

}  // namespace epx::mpi
