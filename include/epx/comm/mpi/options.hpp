// epx/comm/mpi/options.hpp: epx::mpi::options, the settings of one MPI communicator (plain
// C++: this header does not need <mpi.h>).
#pragma once

#include <chrono>
#include <climits>
#include <cstddef>

namespace epx::mpi {

// Tuning and checking of one communicator (plain aggregate; copies made by split inherit it).
struct options {
  // Agree on the collective, datatype and counts before each collective (every entry point,
  // barrier, split and the peer access calls included), and check in all_to_allv and the
  // segmented and indexed exchanges that the counts each rank sends match what the
  // receivers expect. Costs one small MPI_Allreduce per call (with check_counts, barrier is
  // that reduction). Without it, all_to_allv runs as point-to-point messages with no extra
  // synchronization, and ranks in different collectives get what MPI makes of them (not
  // defined: a wrong result, an MPI error, or a wait the watchdog ends).
  // (epx/comm/mpi/agreement.hpp)
  bool check_counts = true;
  // Largest count or displacement, in elements, handed to one MPI call. Larger transfers go
  // in chunks of at most this many elements. MPI counts are int, hence the default; tests
  // lower it to exercise the chunked path with small buffers. Must be at least 1.
  // (epx/comm/mpi/transport.hpp)
  std::size_t max_count = static_cast<std::size_t>(INT_MAX);
  // all_reduce of at most this many bytes over all ranks (size() * count * element size)
  // gathers every rank's input and sums it locally in rank order: one round of messages
  // instead of two, same bits. Larger ones split the sum by blocks over the ranks.
  std::size_t all_reduce_gather_bytes = std::size_t{256} << 10;
  // Watchdog: a collective still unfinished after this long (a rank stalled, died outside
  // epx::mpi::run, or returned without calling it) raises epx::error(errc::communicator) on
  // the ranks that wait, naming the collective; the communicator cannot be used after that
  // (epx::mpi::run then ends the job with the message). Zero: wait forever, as MPI does.
  // split() first agrees in a bounded reduction on its own buffers (a rank that times out
  // there raises, like any collective), then passes a bounded barrier before the blocking
  // MPI_Comm_split, where a timeout ends the job (MPI has no nonblocking split): a rank
  // that arrives after the others timed out ends it there. (epx/comm/mpi/wait.hpp)
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Peer access (access_peers, the layer's direct route) through MPI-3 shared memory when
  // every rank of the communicator runs on one node; false: never (peer_access_available()
  // is false and the layer takes the staged route). (epx/comm/mpi/shared.hpp)
  bool shared_memory = true;
};

}  // namespace epx::mpi
