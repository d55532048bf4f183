// epx/comm/mpi/state.hpp: what the copies of one epx::mpi::communicator share (needs <mpi.h>).
//
// The wrapped MPI_Comm, the private duplicate for chunked point-to-point traffic
// (epx/comm/mpi/transport.hpp), this rank and the size, and the name of the collective in
// progress (for the watchdog's message, epx/comm/mpi/wait.hpp). An owned communicator and
// the duplicate are freed with the state, unless MPI is finalized by then.
#pragma once

#include <mpi.h>

#include <cstddef>

namespace epx::detail {

struct mpi_state {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm chunk_comm = MPI_COMM_NULL;  // private duplicate for chunked point-to-point traffic
  bool owned = false;
  int rank = 0;
  int size = 1;
  std::size_t chunked_rounds = 0;
  const char* op = "";  // the collective in progress (watchdog messages)
  mpi_state() = default;
  mpi_state(const mpi_state&) = delete;
  mpi_state& operator=(const mpi_state&) = delete;
  ~mpi_state() {
    int finalized = 0;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;  // MPI freed everything
    if (chunk_comm != MPI_COMM_NULL) MPI_Comm_free(&chunk_comm);
    if (owned && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

}  // namespace epx::detail
