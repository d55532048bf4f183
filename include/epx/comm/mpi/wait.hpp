// epx/comm/mpi/wait.hpp: the watchdog wait of the MPI backend (needs <mpi.h>).
//
// Every collective of epx::mpi::communicator but split runs as the nonblocking MPI call and
// waits for it here: with `options::timeout` (default 10 minutes) the requests are polled,
// and a collective still unfinished at the deadline raises epx::error(errc::communicator)
// naming the collective, so a rank that stalls or leaves turns into an error on the ranks
// that wait instead of a hang. The requests stay pending: the communicator cannot be used
// after that. A zero timeout waits forever (MPI_Waitall).
#pragma once

#include <mpi.h>

#include <chrono>
#include <thread>

#include "epx/comm/mpi/options.hpp"
#include "epx/comm/mpi/state.hpp"
#include "epx/comm/mpi/support.hpp"
#include "epx/core/error.hpp"

namespace epx::detail {

// Waits for n requests of the collective `s.op` on the communicator of `s`, under the
// watchdog of `opt` (see above).
inline void mpi_wait_bounded(const mpi_state& s, const mpi::options& opt, MPI_Request* reqs, int n) {
  if (n == 0) return;
  if (opt.timeout.count() == 0) {
    EPX_MPI_CHECK(MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE));
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + opt.timeout;
  for (unsigned spin = 1;; ++spin) {
    int done = 0;
    EPX_MPI_CHECK(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
    if (done) return;
    if (spin % 64 == 0) {
      if (std::chrono::steady_clock::now() >= deadline)
        throw error(errc::communicator,
                    concat("watchdog: MPI ", s.op, " on rank ", s.rank, " of a communicator of ", s.size,
                           " ranks still waits after ", opt.timeout.count(),
                           " ms: a rank stalled, died, or returned without calling it (the "
                           "communicator cannot be used any more)"),
                    EPX_HERE);
      std::this_thread::yield();
    }
  }
}

}  // namespace epx::detail

// Starts the nonblocking MPI call `call`, whose request argument is `&epx_req_`, and waits
// for it under the watchdog of state `s` and options `opt` (mpi_wait_bounded).
#define EPX_MPI_BOUNDED_ON(s, opt, call)                            \
  do {                                                              \
    MPI_Request epx_req_ = MPI_REQUEST_NULL;                        \
    EPX_MPI_CHECK(call);                                            \
    ::epx::detail::mpi_wait_bounded((s), (opt), &epx_req_, 1);      \
  } while (0)

// Inside epx::mpi::communicator: the same on the communicator's own state and options.
#define EPX_MPI_BOUNDED(call) EPX_MPI_BOUNDED_ON(*s_, opt_, call)
