// epx/comm/mpi/environment.hpp: epx::mpi::environment, the MPI_Init_thread / MPI_Finalize
// guard (needs <mpi.h>).
#pragma once

#include <mpi.h>

#include "epx/comm/mpi/support.hpp"

namespace epx::mpi {

// Initializes MPI on construction (MPI_Init_thread) unless it already is, and finalizes it on
// destruction if and only if this guard initialized it. Neither copyable nor movable.
// Raises errc::configuration when MPI provides a lower thread level than `required` (MPI
// started by the caller with less, or an MPI without that support; a guard that started
// MPI finalizes it first) and when MPI was finalized already.
class environment {
 public:
  explicit environment(int* argc = nullptr, char*** argv = nullptr, int required = MPI_THREAD_FUNNELED) {
    int initialized = 0, finalized = 0;
    EPX_MPI_CHECK(MPI_Initialized(&initialized));
    EPX_MPI_CHECK(MPI_Finalized(&finalized));
    EPX_REQUIRE(!finalized, errc::configuration, "epx::mpi::environment: MPI was finalized already");
    if (initialized) {
      EPX_MPI_CHECK(MPI_Query_thread(&provided_));
    } else {
      EPX_MPI_CHECK(MPI_Init_thread(argc, argv, required, &provided_));
      owns_ = true;
    }
    if (provided_ < required) {
      if (owns_) MPI_Finalize();
      EPX_REQUIRE(false, errc::configuration, "epx::mpi::environment: MPI provides thread level ", provided_,
                  " but ", required, " is required (MPI_THREAD_SINGLE 0 ... MPI_THREAD_MULTIPLE 3)",
                  owns_ ? ""
                        : "; MPI was started by the caller with a lower level: a program that initialises MPI "
                          "itself needs no guard (wrap its communicators: epx::mpi::communicator(MPI_COMM_WORLD)), "
                          "or ask for the level it started MPI with (a third argument)");
    }
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
