// epx/exec/host_copy.hpp: small copies between host memory and a policy's memory.
//
// Library code reads a few small arrays on the host (counts, offsets, status flags).
// exec::copy_n accepts host or policy memory on either side (cudaMemcpyDefault for the
// CUDA policy); synchronising afterwards makes the host side safe to read or reuse.
#pragma once

#include <cstddef>

#include "epx/exec/host.hpp"

namespace epx::detail {

template <class Exec, class T>
void to_host(const Exec& ex, const T* src, std::size_t n, T* host_dst) {
  if (n == 0) return;
  exec::copy_n(ex, src, n, host_dst);
  exec::synchronize(ex);
}

template <class Exec, class T>
void from_host(const Exec& ex, const T* host_src, std::size_t n, T* dst) {
  if (n == 0) return;
  exec::copy_n(ex, host_src, n, dst);
  exec::synchronize(ex);
}

}  // namespace epx::detail
