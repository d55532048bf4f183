// epx/exec/host_copy.hpp: small copies between host memory and a policy's memory.
//
// Library code reads a few small arrays on the host (counts, offsets, status flags).
// exec::copy_n accepts host or policy memory on either side (cudaMemcpyDefault for the
// CUDA policy); synchronising afterwards makes the host side safe to read or reuse.
#pragma once

#include <cstddef>

#include "epx/exec/host.hpp"

namespace epx::detail {

// Host synchronisations the library has made on device policies on this thread (host
// policies have no queue to wait for and are not counted). The layer reports the count of
// one call in layer_stats::host_syncs.
inline long long& host_syncs_on_this_thread() noexcept {
  thread_local long long n = 0;
  return n;
}

// Waits for the policy's queued work and counts the wait when there is a queue.
template <class Exec>
void host_sync(const Exec& ex) {
  if constexpr (!exec::is_host_policy_v<Exec>) ++host_syncs_on_this_thread();
  exec::synchronize(ex);
}

template <class Exec, class T>
void to_host(const Exec& ex, const T* src, std::size_t n, T* host_dst) {
  if (n == 0) return;
  exec::copy_n(ex, src, n, host_dst);
  host_sync(ex);
}

template <class Exec, class T>
void from_host(const Exec& ex, const T* host_src, std::size_t n, T* dst) {
  if (n == 0) return;
  exec::copy_n(ex, host_src, n, dst);
  host_sync(ex);
}

}  // namespace epx::detail
