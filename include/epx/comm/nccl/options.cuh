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
};

}  // namespace epx::nccl
