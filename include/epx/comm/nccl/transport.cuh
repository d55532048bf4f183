// epx/comm/nccl/transport.cuh: all_to_allv over NCCL as one group of point-to-point calls
// (needs nvcc and NCCL).
//
// NCCL counts are size_t, so no message is cut into chunks: each non-empty segment for a
// peer is one ncclSend and one ncclRecv, all inside one NCCL group, and the block a rank
// sends itself is a device-to-device copy on the stream. NCCL matches the sends and
// receives between a pair in issue order, so segments pair up in order; empty segments are
// skipped on both sides because the counts agree. NCCL cannot see counts that disagree
// between peers: the stream stalls until a bounded wait (epx/comm/nccl/wait.cuh) ends it.
// Only the counts a rank sends itself are checked here.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>

#include "epx/comm/datatype.hpp"
#include "epx/comm/nccl/support.cuh"
#include "epx/comm/nccl/wait.cuh"
#include "epx/core/error.hpp"
#include "epx/exec/cuda.cuh"

namespace epx::nccl::detail {

// Segmented all-to-all on `h`'s communicator, enqueued on `stream`: arrays [peers][nseg] in
// elements (device buffers, host arrays); segment i sent to peer q lands where q names
// segment i from this rank. `timeout` bounds the settling of nonblocking calls.
inline void exchange_segments(const handle& h, cudaStream_t stream, std::chrono::milliseconds timeout,
                              const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
                              void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
                              std::size_t nseg, datatype t) {
  const std::size_t es = size_of(t);
  const ncclDataType_t nt = to_nccl(t);
  const auto n = static_cast<std::size_t>(h.size);
  const auto me = static_cast<std::size_t>(h.rank);
  for (std::size_t i = 0; i < nseg; ++i) {
    EPX_REQUIRE(send_counts[me * nseg + i] == recv_counts[me * nseg + i], errc::communicator,
                "nccl all_to_allv: rank ", h.rank, " sends itself ", send_counts[me * nseg + i],
                " elements in segment ", i, " but expects to receive ", recv_counts[me * nseg + i]);
  }
  device_guard dg(h.device);
  const auto* s = static_cast<const unsigned char*>(send);
  auto* d = static_cast<unsigned char*>(recv);
  for (std::size_t i = 0; i < nseg; ++i) {
    const std::size_t k = me * nseg + i;
    if (send_counts[k] != 0)
      EPX_CUDA_CHECK(cudaMemcpyAsync(d + recv_displs[k] * es, s + send_displs[k] * es, send_counts[k] * es,
                                     cudaMemcpyDefault, stream));
  }
  if (n == 1) return;
  group_guard g;
  for (std::size_t q = 1; q < n; ++q) {
    // Peers in ring order from this rank, so that not every rank starts with rank 0.
    const std::size_t to = (me + q) % n;
    const std::size_t from = (me + n - q) % n;
    for (std::size_t i = 0; i < nseg; ++i) {
      const std::size_t ks = to * nseg + i;
      if (send_counts[ks] != 0)
        h.check(ncclSend(s + send_displs[ks] * es, send_counts[ks], nt, static_cast<int>(to), h.comm, stream),
                "ncclSend", EPX_HERE, timeout);
      const std::size_t kr = from * nseg + i;
      if (recv_counts[kr] != 0)
        h.check(ncclRecv(d + recv_displs[kr] * es, recv_counts[kr], nt, static_cast<int>(from), h.comm, stream),
                "ncclRecv", EPX_HERE, timeout);
    }
  }
  h.check(g.end(), "ncclGroupEnd (all_to_allv)", EPX_HERE, timeout);
}

}  // namespace epx::nccl::detail
