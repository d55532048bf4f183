// epx/comm/settle.hpp: waiting for a policy's work without risking a hang.
//
// Before a communicator call, and before the host reads results, the layer waits for the
// execution policy's queued work. On a device stream that work may include collectives
// of a communicator whose peer has died; a plain stream synchronisation would then wait
// forever. A communicator with a bounded `wait()` (epx::nccl::communicator: polls the
// stream and the asynchronous error, aborts the communicator on timeout) is asked first,
// so the layer inherits its timeout; host policies and host communicators have nothing
// queued and return at once.
#pragma once

#include <type_traits>
#include <utility>

#include "epx/exec/host.hpp"
#include "epx/exec/host_copy.hpp"

namespace epx::detail {

template <class C, class = void>
struct has_bounded_wait : std::false_type {};
template <class C>
struct has_bounded_wait<C, std::void_t<decltype(std::declval<C&>().wait())>> : std::true_type {};

// Communicators whose collectives read and write device memory in the order of a device
// queue (epx::nccl::communicator: `execution()` names its stream). The others (threads,
// MPI) read host-addressable memory from the host, after the policy's work has finished.
template <class C, class = void>
struct is_device_communicator : std::false_type {};
template <class C>
struct is_device_communicator<C, std::void_t<decltype(std::declval<const C&>().execution())>> : std::true_type {};
template <class C>
inline constexpr bool is_device_communicator_v = is_device_communicator<C>::value;

// Host communicators that also move device memory, with `bool device_buffers() const`
// saying whether this one does (the threads communicator over threads::device_memory()).
template <class C, class = void>
struct has_device_buffers : std::false_type {};
template <class C>
struct has_device_buffers<C, std::void_t<decltype(bool(std::declval<const C&>().device_buffers()))>>
    : std::true_type {};

// Waits for `ex`'s queued work; with a communicator that has a bounded wait(), through it.
template <class Exec, class Comm>
void settle(const Exec& ex, Comm& comm) {
  if constexpr (!exec::is_host_policy_v<Exec> && has_bounded_wait<Comm>::value) comm.wait();
  host_sync(ex);
}

// Before a collective over device buffers: a host communicator reads them from the host, so
// the policy's queued work must finish first (a host synchronisation); a device
// communicator runs on the policy's queue (the layer checks they are the same), after it.
template <class Exec, class Comm>
void order_before_collective(const Exec& ex, Comm& comm) {
  if constexpr (!exec::is_host_policy_v<Exec> && !is_device_communicator_v<Comm>) settle(ex, comm);
}

// Inside access_peers, after the policy's work that reads the peers' buffers: a host
// communicator's exit barrier lets the peers go on from the host, so that work must have
// finished first (a host synchronisation); a device communicator's barrier is queued after
// it.
template <class Exec, class Comm>
void order_after_peer_reads(const Exec& ex, Comm& comm) {
  order_before_collective(ex, comm);
}

}  // namespace epx::detail
