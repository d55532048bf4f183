// epx/comm/nccl/options.cuh: epx::nccl::options, the settings of one NCCL communicator.
#pragma once

#include <chrono>

namespace epx::nccl {

// Settings of a communicator.
struct options {
  // Bound on wait(), barrier() and on settling nonblocking calls; then ncclCommAbort.
  std::chrono::milliseconds timeout{60000};
  // NCCL config.blocking for communicators epx creates from a unique id (NCCL's
  // default: true). false makes initialisation and split abortable by the timeout.
  // Split communicators inherit their parent's mode; ncclCommInitAll has no config.
  bool blocking = true;
  // Peer access (access_peers, the layer's direct route) through a symmetric memory window
  // where every rank is in one NCCL LSA team with symmetric memory (one node, CUDA P2P
  // between the GPUs; NCCL >= 2.28; epx/comm/nccl/peers.cuh). Off
  // by default: each access reads its record exchange back (a host synchronisation), so a
  // forward call on the direct route makes three where the staged route makes one; turn
  // it on where the copies it saves pay for that. false: peer_access_available() answers
  // false, and the layer takes the staged route.
  bool peer_access = false;
};

}  // namespace epx::nccl
