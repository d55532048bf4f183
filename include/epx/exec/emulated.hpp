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
//
// Its buffers are its "device memory": every live one is registered, and
// exec::emulated_device_memory(p, bytes) tells whether [p, p + bytes) lies inside one. On a
// GPU a device communicator (NCCL) reads and writes device memory only, and the host must
// not read it; the emulated memory is host memory and forgives both, so tests ask the
// registry instead (tests/emulated/test_device_memory.cpp hands every pointer a device
// communicator gets to it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "epx/exec/host.hpp"

namespace epx::exec {

namespace detail {

// The live allocations of emulated device buffers: begin -> end addresses.
class emulated_allocations {
 public:
  static emulated_allocations& get() {
    static emulated_allocations r;
    return r;
  }
  void add(const void* p, std::size_t bytes) {
    if (p == nullptr) return;
    const std::lock_guard<std::mutex> lock(m_);
    live_[address(p)] = address(p) + bytes;
  }
  void remove(const void* p) {
    if (p == nullptr) return;
    const std::lock_guard<std::mutex> lock(m_);
    live_.erase(address(p));
  }
  bool holds(const void* p, std::size_t bytes) const {
    const std::lock_guard<std::mutex> lock(m_);
    auto it = live_.upper_bound(address(p));
    if (it == live_.begin()) return false;
    --it;
    return address(p) >= it->first && address(p) + bytes <= it->second;
  }

 private:
  static std::uintptr_t address(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }
  mutable std::mutex m_;
  std::map<std::uintptr_t, std::uintptr_t> live_;
};

template <class T>
struct emulated_delete {
  void operator()(T* p) const noexcept {
    emulated_allocations::get().remove(p);
    delete[] p;
  }
};

}  // namespace detail

// Whether [p, p + bytes) lies inside one live buffer of exec::emulated_device (bytes 0:
// p inside one, or p null).
inline bool emulated_device_memory(const void* p, std::size_t bytes) {
  if (p == nullptr && bytes == 0) return true;
  return detail::emulated_allocations::get().holds(p, bytes == 0 ? 1 : bytes);
}

// A buffer of exec::emulated_device: host memory, registered as the policy's device memory
// while it lives. The interface of host_buffer.
template <class T>
class emulated_buffer {
 public:
  emulated_buffer() = default;
  explicit emulated_buffer(std::size_t n) : data_(allocate(n)), size_(n), capacity_(n) {}
  T* data() noexcept { return data_.get(); }
  const T* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  // Grows (never shrinks) the allocation; contents are not preserved.
  void reserve_discard(std::size_t n) {
    if (n > capacity_) {
      data_ = allocate(n);
      capacity_ = n;
    }
    size_ = n;
  }

 private:
  using owner = std::unique_ptr<T[], detail::emulated_delete<T>>;
  static owner allocate(std::size_t n) {
    if (n == 0) return owner();
    owner p(new T[n]);
    detail::emulated_allocations::get().add(p.get(), n * sizeof(T));
    return p;
  }
  owner data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

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

// Its memory is host memory: host communicators move it as they move a host policy's.
template <>
struct host_addressable<emulated_device> : std::true_type {};

template <class T>
struct buffer_for<T, emulated_device> {
  using type = emulated_buffer<T>;
};

// (Also for policies derived from emulated_device, which tests use for other traits.)
template <class T, class P, std::enable_if_t<std::is_base_of_v<emulated_device, std::remove_cv_t<P>>, int> = 0>
emulated_buffer<T> make_buffer(const P&, std::size_t n) {
  return emulated_buffer<T>(n);
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
