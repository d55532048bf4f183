// epx/comm/mpi/transport.hpp: how all_to_allv-shaped traffic moves over MPI (needs <mpi.h>).
//
// MPI counts and displacements are int. A transfer whose counts and displacements all fit in
// `options::max_count` elements goes as one MPI_Ialltoallv. A larger one travels as
// point-to-point chunks of at most max_count elements, in rounds (round k moves chunk k of
// every peer's message), on a private duplicate of the communicator, so that no tag can
// collide with the user's traffic. Every rank of a collective must take the same path: the
// callers agree on it first (epx/comm/mpi/agreement.hpp), or always take the chunked one.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "epx/comm/datatype.hpp"
#include "epx/comm/mpi/options.hpp"
#include "epx/comm/mpi/state.hpp"
#include "epx/comm/mpi/support.hpp"
#include "epx/comm/mpi/wait.hpp"

namespace epx::detail {

// all_to_allv as point-to-point messages of at most opt.max_count elements. Round k moves
// chunk k of every peer's message; all ranks must enter together (the path is agreed).
// Counts and displacements in elements, one per peer.
inline void mpi_exchange_chunked(mpi_state& s, const mpi::options& opt, const void* send, const std::size_t* sc,
                                 const std::size_t* sd, void* recv, const std::size_t* rc, const std::size_t* rd,
                                 datatype t) {
  if (s.chunk_comm == MPI_COMM_NULL) {
    // MPI_Comm_idup under the watchdog (a blocking dup would wait for a stalled rank
    // forever), into a handle of our own that a timeout keeps alive.
    std::vector<MPI_Comm> dup(1, MPI_COMM_NULL);
    mpi_keep keep(dup);
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep, MPI_Comm_idup(s.comm, dup.data(), &epx_req_));
    s.chunk_comm = dup[0];
    EPX_MPI_CHECK(MPI_Comm_set_errhandler(s.chunk_comm, MPI_ERRORS_RETURN));
  }
  const int n = s.size, me = s.rank;
  const std::size_t es = size_of(t), chunk = opt.max_count;
  const MPI_Datatype mt = mpi_type(t);
  const auto* sb = static_cast<const unsigned char*>(send);
  auto* rb = static_cast<unsigned char*>(recv);
  const std::size_t self = std::min(sc[me], rc[me]);  // equal unless the caller skipped the check
  if (self != 0) std::memmove(rb + rd[me] * es, sb + sd[me] * es, self * es);
  std::size_t rounds = 0;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    rounds = std::max({rounds, (sc[p] + chunk - 1) / chunk, (rc[p] + chunk - 1) / chunk});
  }
  std::vector<MPI_Request> req;
  req.reserve(2 * static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < rounds; ++k) {
    ++s.chunked_rounds;
    req.clear();
    const std::size_t off = k * chunk;
    for (int d = 1; d < n; ++d) {  // receive from me-d, send to me+d: spreads the load
      const int q = (me - d + n) % n;
      if (rc[q] > off) {
        req.emplace_back();
        const int c = static_cast<int>(std::min(chunk, rc[q] - off));
        EPX_MPI_CHECK(MPI_Irecv(rb + (rd[q] + off) * es, c, mt, q, 0, s.chunk_comm, &req.back()));
      }
    }
    for (int d = 1; d < n; ++d) {
      const int p = (me + d) % n;
      if (sc[p] > off) {
        req.emplace_back();
        const int c = static_cast<int>(std::min(chunk, sc[p] - off));
        EPX_MPI_CHECK(MPI_Isend(sb + (sd[p] + off) * es, c, mt, p, 0, s.chunk_comm, &req.back()));
      }
    }
    if (!req.empty()) {
      mpi_wait_bounded(s, opt, req.data(), static_cast<int>(req.size()));
    }
  }
}

// all_to_allv with an agreed path: `large` (some rank has a count or displacement over
// max_count) takes the chunked one, else one MPI_Ialltoallv.
inline void mpi_exchange(mpi_state& s, const mpi::options& opt, const void* send, const std::size_t* sc,
                         const std::size_t* sd, void* recv, const std::size_t* rc, const std::size_t* rd, datatype t,
                         bool large) {
  if (large) {
    mpi_exchange_chunked(s, opt, send, sc, sd, recv, rc, rd, t);
    return;
  }
  const int n = s.size;
  std::vector<int> v(4 * static_cast<std::size_t>(n));
  const auto N = static_cast<std::size_t>(n);
  for (std::size_t p = 0; p < N; ++p) {
    v[p] = static_cast<int>(sc[p]);
    v[N + p] = static_cast<int>(sd[p]);
    v[2 * N + p] = static_cast<int>(rc[p]);
    v[3 * N + p] = static_cast<int>(rd[p]);
  }
  const MPI_Datatype mt = mpi_type(t);
  EPX_MPI_BOUNDED_ON(s, opt, MPI_Ialltoallv(send, v.data(), v.data() + n, mt, recv, v.data() + 2 * n,
                                            v.data() + 3 * n, mt, s.comm, &epx_req_));
}

}  // namespace epx::detail
