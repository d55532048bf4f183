// epx/exec/emulated.hpp: a device policy that runs on the CPU.
//
// epx::exec::emulated_device takes the device path of every algorithm in plain C++17: it is
// not a host policy (is_host_policy_v is false), so the layer uses the staged route with no
// peer access, device buffers (exec::buffer, not the host pool), the device launch shape of
// row operations (16-byte chunks, exec::row_shape::chunks16) and the same synchronisation
// points as exec::cuda. Its memory is host memory, so CPU tests can read what it wrote.
// It calls functors in reverse index order, so code that relies on the order of a launch
// shows up.
//
// It counts what a device policy pays for, synchronize() calls and launches, in the shared
// `counters` that every copy of the policy sees.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <type_traits>

#include "epx/exec/host.hpp"

namespace epx::exec {

struct emulated_device {
  int queue = 0;  // which emulated queue (stream) the work goes to
  struct counters_t {
    long long synchronizations = 0;
    long long launches = 0;
  };
  std::shared_ptr<counters_t> counters = std::make_shared<counters_t>();
};

template <class F>
void for_each_n(const emulated_device& p, std::size_t n, F&& f) {
  if (n == 0) return;
  ++p.counters->launches;
  for (std::size_t i = n; i-- > 0;) f(i);
}

template <class T>
struct buffer_for<T, emulated_device> {
  using type = host_buffer<T>;
};

template <class T, class P, std::enable_if_t<std::is_same_v<std::remove_cv_t<P>, emulated_device>, int> = 0>
host_buffer<T> make_buffer(const P&, std::size_t n) {
  return host_buffer<T>(n);
}

template <class T>
void copy_n(const emulated_device&, const T* src, std::size_t n, T* dst) {
  if (n) std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(T));
}

template <class T>
void fill_zero(const emulated_device&, T* dst, std::size_t n) {
  if (n) std::memset(static_cast<void*>(dst), 0, n * sizeof(T));
}

inline void synchronize(const emulated_device& p) { ++p.counters->synchronizations; }

inline bool same_queue(const emulated_device& a, const emulated_device& b) { return a.queue == b.queue; }

}  // namespace epx::exec
