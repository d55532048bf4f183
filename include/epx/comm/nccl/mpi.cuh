// epx/comm/nccl/mpi.cuh: an NCCL communicator bootstrapped over MPI (needs nvcc, NCCL, MPI).
//
//   MPI_Init(...);
//   cudaSetDevice(local_rank);                   // or pass the device
//   auto comm = epx::nccl::from_unique_id(MPI_COMM_WORLD);
//
// Rank 0 makes the ncclUniqueId and broadcasts it over MPI; every rank then joins the
// NCCL communicator (same rank order as the MPI communicator). A failure on any rank
// (making the id, or joining) raises epx::error on EVERY rank, carrying the failing rank's
// message: the ranks agree over MPI before returning. Use options::blocking = false so
// that a rank that never joins is bounded by options::timeout instead of hanging NCCL's
// initialisation.
//
// Compiles to nothing when <mpi.h> is not on the include path.
#pragma once

#if __has_include(<mpi.h>)
#include <mpi.h>

#include <cstring>
#include <exception>
#include <string>

#include "epx/comm/nccl/communicator.cuh"

namespace epx::nccl {
namespace detail {

inline void mpi_check(int rc, const char* call, source_location where) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) std::strcpy(text, "unknown MPI error");
  throw error(errc::mpi, ::epx::detail::concat(call, " failed: ", text, " (code ", rc, ")"), where,
              static_cast<long>(rc));
}

}  // namespace detail

#define EPX_NCCL_MPI_CHECK_(...) ::epx::nccl::detail::mpi_check((__VA_ARGS__), #__VA_ARGS__, EPX_HERE)

// Collective over `mpi_comm`. `device` >= 0 selects the CUDA device for this rank
// (otherwise the current one); collectives are enqueued on `stream`.
inline communicator from_unique_id(MPI_Comm mpi_comm, int device = -1, cudaStream_t stream = 0,
                                   options opt = {}) {
  int rank = 0;
  int size = 0;
  EPX_NCCL_MPI_CHECK_(MPI_Comm_rank(mpi_comm, &rank));
  EPX_NCCL_MPI_CHECK_(MPI_Comm_size(mpi_comm, &size));

  // Rank 0's id together with its status, so that a failing ncclGetUniqueId reaches everyone.
  struct {
    int status;
    ncclUniqueId id;
  } root{};
  if (rank == 0) root.status = static_cast<int>(ncclGetUniqueId(&root.id));
  EPX_NCCL_MPI_CHECK_(MPI_Bcast(&root, static_cast<int>(sizeof root), MPI_BYTE, 0, mpi_comm));
  if (root.status != static_cast<int>(ncclSuccess))
    throw error(errc::nccl,
                ::epx::detail::concat("nccl::from_unique_id: ncclGetUniqueId failed on rank 0: ",
                                      ncclGetErrorString(static_cast<ncclResult_t>(root.status))),
                EPX_HERE, root.status);

  communicator c;
  constexpr int msg_len = 256;
  char msg[msg_len] = {};
  try {
    c = communicator::from_unique_id(root.id, size, rank, device, stream, opt);
  } catch (const std::exception& e) {
    std::strncpy(msg, e.what(), msg_len - 1);
  } catch (...) {
    std::strncpy(msg, "unknown exception", msg_len - 1);
  }
  // The lowest failing rank (size when none) tells everyone its message.
  const int mine = msg[0] != '\0' ? rank : size;
  int first_bad = size;
  EPX_NCCL_MPI_CHECK_(MPI_Allreduce(&mine, &first_bad, 1, MPI_INT, MPI_MIN, mpi_comm));
  if (first_bad == size) return c;
  EPX_NCCL_MPI_CHECK_(MPI_Bcast(msg, msg_len, MPI_CHAR, first_bad, mpi_comm));
  msg[msg_len - 1] = '\0';
  c.abort();
  throw error(errc::nccl,
              ::epx::detail::concat("nccl::from_unique_id: rank ", first_bad, " of ", size,
                                    " could not join the NCCL communicator: ", msg),
              EPX_HERE);
}

#undef EPX_NCCL_MPI_CHECK_

}  // namespace epx::nccl

#endif  // __has_include(<mpi.h>)
