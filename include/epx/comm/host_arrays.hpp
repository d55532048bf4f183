// epx/comm/host_arrays.hpp: collectives over small host arrays on any communicator, and
// reading a collective's result back to the host.
//
// A device communicator (epx::nccl::communicator: `execution()` names its queue) reads and
// writes device memory only; the host arrays of the library's agreements, count exchanges
// and load sums go through device copies on the communicator's own queue, and the host
// waits once, through the communicator's bounded wait. Host communicators take the host
// arrays as they are.
//
//   all_gather_host(comm, mine, n, all)      all = every rank's n elements, in rank order
//   all_reduce_host(comm, data)              data = the sum over the ranks (in place)
//   read_back(ex, comm, src, n, host_dst)    after a collective that wrote src (the policy's
//                                            memory): waits, then copies into host memory
#pragma once

#include <cstddef>

#include "epx/comm/collectives.hpp"
#include "epx/comm/settle.hpp"
#include "epx/core/span.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"

namespace epx::detail {

// After a collective of `comm` on `ex`'s queue that wrote `src` (n elements of the policy's
// memory): waits for the queue through the communicator's bounded wait (settle, the one
// counted host synchronisation), then copies into host memory. Copying first would make
// that wait unbounded: a copy into pageable host memory returns only once it is done, so a
// peer that never arrives would hold the host inside the copy, where no timeout reaches.
template <class Exec, class Comm, class T>
void read_back(const Exec& ex, Comm& comm, const T* src, std::size_t n, T* host_dst) {
  settle(ex, comm);
  if (n == 0) return;
  exec::copy_n(ex, src, n, host_dst);
  exec::synchronize(ex);  // the queue was idle: returns once the copy is done (not counted again)
}

// all_gather of n host elements per rank into `all` (host memory, n * comm.size()).
template <class Comm, class T>
void all_gather_host(Comm& comm, const T* mine, std::size_t n, T* all) {
  const std::size_t total = n * static_cast<std::size_t>(comm.size());
  if constexpr (is_device_communicator_v<Comm>) {
    const auto ex = comm.execution();
    auto send = exec::make_buffer<T>(ex, n);
    auto recv = exec::make_buffer<T>(ex, total);
    exec::copy_n(ex, mine, n, send.data());
    ::epx::all_gather(comm, span<const T>(send.data(), n), span<T>(recv.data(), total));
    read_back(ex, comm, static_cast<const T*>(recv.data()), total, all);
  } else {
    ::epx::all_gather(comm, span<const T>(mine, n), span<T>(all, total));
  }
}

// In place: data (host memory) becomes the sum over the ranks of comm.
template <class Comm, class T>
void all_reduce_host(Comm& comm, span<T> data) {
  if constexpr (is_device_communicator_v<Comm>) {
    const auto ex = comm.execution();
    auto d = exec::make_buffer<T>(ex, data.size());
    exec::copy_n(ex, static_cast<const T*>(data.data()), data.size(), d.data());
    ::epx::all_reduce(comm, span<T>(d.data(), data.size()));
    read_back(ex, comm, static_cast<const T*>(d.data()), data.size(), data.data());
  } else {
    ::epx::all_reduce(comm, data);
  }
}

}  // namespace epx::detail
