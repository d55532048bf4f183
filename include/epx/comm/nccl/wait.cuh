// epx/comm/nccl/wait.cuh: the bounded waits of the NCCL backend (needs nvcc and NCCL).
//
// Nothing hangs: waiting for a communicator's stream polls cudaStreamQuery and
// ncclCommGetAsyncError; on an asynchronous NCCL error or when the timeout passes it calls
// ncclCommAbort (the NCCL communicator is freed, also one that was only wrapped) and raises
// epx::error. Communicators in NCCL's nonblocking mode (options::blocking = false) return
// ncclInProgress from their calls; every such call is settled here, within the timeout,
// before it returns, and so are initialisation and split. One limit: ncclCommAbort frees
// the communicator's device memory, which waits for the work already queued on the device,
// so a kernel of the caller's that never ends keeps the abort, and the wait, from returning.
//
// `handle` is the NCCL communicator of one epx::nccl::communicator together with what its
// messages name (rank, size, device) and its abort state; every call on the communicator
// goes through it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <string>
#include <thread>

#include "epx/comm/detail/deadline.hpp"
#include "epx/comm/nccl/support.cuh"
#include "epx/core/error.hpp"

namespace epx::nccl::detail {

struct handle {
  // Abort state is mutable: any call, const ones included, may find the communicator
  // broken and must stop every later call from using it.
  mutable ncclComm_t comm = nullptr;  // null when empty or aborted
  mutable bool aborted = false;
  int rank = 0;
  int size = 0;
  int device = 0;

  // ncclCommAbort, once; later calls see `aborted`.
  void abort() const noexcept {
    if (comm != nullptr && !aborted) {
      (void)ncclCommAbort(comm);
      comm = nullptr;
      aborted = true;
    }
  }

  [[noreturn]] void fail(ncclResult_t r, const char* call, source_location where) const {
    throw error(errc::nccl,
                ::epx::detail::concat(call, " failed on rank ", rank, " of ", size, " (device ", device, "): ",
                                      describe(r, comm)),
                where, static_cast<long>(r));
  }

  [[noreturn]] void abort_and_fail(ncclResult_t r, const char* call, source_location where) const {
    const std::string what = describe(r, comm);
    abort();
    throw error(errc::nccl,
                ::epx::detail::concat(call, " on rank ", rank, " of ", size, " (device ", device, "): ", what,
                                      "; the NCCL communicator was aborted"),
                where, static_cast<long>(r));
  }

  // ncclSuccess: nothing. ncclInProgress (nonblocking mode): poll until the call has
  // settled, at most `timeout`. Anything else: raise (after aborting when the
  // communicator's state is broken: asynchronous errors and timeouts).
  void check(ncclResult_t r, const char* call, source_location where, std::chrono::milliseconds timeout) const {
    if (r == ncclSuccess) return;
    if (r != ncclInProgress) fail(r, call, where);
    const auto deadline = ::epx::detail::deadline_after(timeout);
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &async);
      if (q != ncclSuccess) abort_and_fail(q, "ncclCommGetAsyncError", where);
      if (async == ncclSuccess) return;
      if (async != ncclInProgress) abort_and_fail(async, call, where);
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        throw error(errc::communicator,
                    ::epx::detail::concat(call, " on rank ", rank, " of ", size, " did not complete within ",
                                          timeout.count(), " ms; the NCCL communicator was aborted"),
                    where);
      }
      std::this_thread::yield();
    }
  }

  // Waits for the work enqueued on `stream`, at most `timeout`. An asynchronous NCCL
  // error, a CUDA error on the stream or the timeout abort the communicator
  // (ncclCommAbort) and raise epx::error: errc::communicator for the timeout, errc::nccl
  // or errc::cuda otherwise. The caller makes `device` current.
  void wait(cudaStream_t stream, std::chrono::milliseconds timeout) const {
    const auto deadline = ::epx::detail::deadline_after(timeout);
    for (unsigned spin = 0;; ++spin) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &async);
      if (q != ncclSuccess) abort_and_fail(q, "ncclCommGetAsyncError", EPX_HERE);
      if (async != ncclSuccess && async != ncclInProgress)
        abort_and_fail(async, "asynchronous NCCL error (ncclCommGetAsyncError)", EPX_HERE);
      const cudaError_t s = cudaStreamQuery(stream);
      if (s == cudaSuccess && async == ncclSuccess) return;
      if (s != cudaSuccess && s != cudaErrorNotReady) {
        (void)cudaGetLastError();
        abort();
        throw error(errc::cuda,
                    ::epx::detail::concat("cudaStreamQuery on rank ", rank, " of ", size, " (device ", device,
                                          ") failed: ", cudaGetErrorName(s), " (", cudaGetErrorString(s), ", code ",
                                          static_cast<int>(s), "); the NCCL communicator was aborted"),
                    EPX_HERE, static_cast<long>(s));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        EPX_THROW(errc::communicator, "nccl wait timed out after ", timeout.count(), " ms on rank ", rank, " of ",
                  size, " (device ", device,
                  "): a peer did not join the collective, failed, or sent counts that disagree; the NCCL "
                  "communicator was aborted");
      }
      if (spin < 2000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
};

// A new communicator from an init or split: settles ncclInProgress (nonblocking mode)
// within `timeout`; on failure aborts it and raises.
inline void settle_new(ncclComm_t& c, ncclResult_t r, const char* call, std::chrono::milliseconds timeout) {
  if (r != ncclSuccess && r != ncclInProgress) {
    if (c != nullptr) (void)ncclCommAbort(c);
    c = nullptr;
    nccl_check(r, call, EPX_HERE);
  }
  EPX_REQUIRE(c != nullptr, errc::nccl, call, " returned no communicator");
  const auto deadline = ::epx::detail::deadline_after(timeout);
  for (;;) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(c, &async);
    if (q == ncclSuccess && async == ncclSuccess) return;
    if (q != ncclSuccess || async != ncclInProgress) {
      const ncclResult_t bad = q != ncclSuccess ? q : async;
      const std::string what = describe(bad, c);
      (void)ncclCommAbort(c);
      c = nullptr;
      throw error(errc::nccl, ::epx::detail::concat(call, " failed: ", what), EPX_HERE, static_cast<long>(bad));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      (void)ncclCommAbort(c);
      c = nullptr;
      EPX_THROW(errc::communicator, call, " did not complete within ", timeout.count(),
                " ms (a peer did not join); the new NCCL communicator was aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace epx::nccl::detail
