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

namespace epx::detail {

template <class C, class = void>
struct has_bounded_wait : std::false_type {};
template <class C>
struct has_bounded_wait<C, std::void_t<decltype(std::declval<C&>().wait())>> : std::true_type {};

// Waits for `ex`'s queued work; with a communicator that has a bounded wait(), through it.
template <class Exec, class Comm>
void settle(const Exec& ex, Comm& comm) {
  if constexpr (!exec::is_host_policy_v<Exec> && has_bounded_wait<Comm>::value) comm.wait();
  exec::synchronize(ex);
}

}  // namespace epx::detail
