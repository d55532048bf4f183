// epx/exec/emulated.hpp: a device policy that runs on the CPU.
//
// epx::exec::emulated_device takes the device path of every algorithm in plain C++17: it is
// not a host policy (is_host_policy_v is false), so the layer uses the staged route with no
// peer access, device buffers (exec::buffer, not the host pool), the device launch shape of
// row operations (16-byte chunks, exec::row_shape::chunks16) and the same synchronisation
// points as exec::cuda. Its memory is host memory, so CPU tests can read what it wrote.
// It calls functors in reverse index order, so code that relies on the order of a launch
// shows up; exec::emulated_launch_order(emulated_order::forward) turns a thread's launches
// round, so that a test can run the same work both ways (one fixed order hides the code
// that relies on that order).
//
// It counts what a device policy pays for, synchronize() calls and launches, in the shared
// `counters` that every copy of the policy sees.
//
// Its buffers are its "device memory": every live one is registered, and
// exec::emulated_device_memory(p, bytes) tells whether [p, p + bytes) lies inside one. On a
// GPU a device communicator (NCCL) reads and writes device memory only, and the host must
// not read it; the emulated memory is host memory and forgives both, so tests ask the
// registry instead (tests/emulated/test_device_memory.cpp hands every pointer a device
// communicator gets to it). For the second, exec::emulated_strict_memory(true) (POSIX)
// maps the buffers allocated from then on as pages the host may touch only while some
// thread is inside a launch scope: a launch, copy or fill of the policy, a Thrust call of
// the library, or an exec::launch_scope the caller opens (experts, which run on the device,
// and a device communicator's collectives). Any other host access faults at once, and the
// stack names the host code that would read device memory on a GPU.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define EPX_EMULATED_STRICT 1
#else
#define EPX_EMULATED_STRICT 0
#endif

#include "epx/exec/host.hpp"

namespace epx::exec {

namespace detail {

// The live allocations of emulated device buffers (begin -> end addresses), and strict
// mode: buffers allocated while it is on are whole pages of their own (`mapped`), readable
// and writable only while some thread is inside a launch scope (`inside` > 0). Every new
// buffer is filled with 0xff bytes (NaN in every float type), as a device pool hands out
// what it held before: code that reads what it never wrote does not meet zeros.
class emulated_allocations {
 public:
  static emulated_allocations& get() {
    static emulated_allocations r;
    return r;
  }
  // n bytes of emulated device memory, registered.
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    const std::lock_guard<std::mutex> lock(m_);
    void* p = nullptr;
    std::size_t mapped = 0;
#if EPX_EMULATED_STRICT
    if (strict_) {
      const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
      mapped = (bytes + page - 1) / page * page;
      p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
    }
#endif
    if (p == nullptr) p = ::operator new(bytes);
    std::memset(p, 0xff, bytes);
#if EPX_EMULATED_STRICT
    if (mapped != 0 && inside_.load() == 0) ::mprotect(p, mapped, PROT_NONE);
#endif
    live_[address(p)] = entry{address(p) + bytes, mapped};
    return p;
  }
  void release(void* p) noexcept {
    if (p == nullptr) return;
    const std::lock_guard<std::mutex> lock(m_);
    const auto it = live_.find(address(p));
    const std::size_t mapped = it == live_.end() ? 0 : it->second.mapped;
    if (it != live_.end()) live_.erase(it);
#if EPX_EMULATED_STRICT
    if (mapped != 0) {
      ::munmap(p, mapped);
      return;
    }
#endif
    ::operator delete(p);
  }
  bool holds(const void* p, std::size_t bytes) const {
    const std::lock_guard<std::mutex> lock(m_);
    auto it = live_.upper_bound(address(p));
    if (it == live_.begin()) return false;
    --it;
    // `bytes` compared with the room left (p + bytes may wrap for an absurd size).
    return address(p) <= it->second.end && bytes <= it->second.end - address(p);
  }
  // Strict mode on or off (process-wide; off opens every mapped buffer for good). Returns
  // false where it is not available.
  // Call it while no launch scope is open.
  bool set_strict(bool on) {
#if EPX_EMULATED_STRICT
    const std::lock_guard<std::mutex> lock(m_);
    strict_.store(on);
    protect_all(on && inside_.load() == 0);
    return true;
#else
    return !on;
#endif
  }
  // Outside strict mode a scope only counts (no lock: rank threads do not serialise).
  void enter() {
    if (!strict_.load()) {
      inside_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const std::lock_guard<std::mutex> lock(m_);
    if (inside_.fetch_add(1) == 0) protect_all(false);
  }
  void leave() {
    if (!strict_.load()) {
      inside_.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
    const std::lock_guard<std::mutex> lock(m_);
    if (inside_.fetch_sub(1) == 1) protect_all(true);
  }

 private:
  struct entry {
    std::uintptr_t end;
    std::size_t mapped;  // strict mode: the bytes mapped for it; 0: operator new
  };
  static std::uintptr_t address(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }
  void protect_all(bool closed) {
#if EPX_EMULATED_STRICT
    for (const auto& [begin, e] : live_)
      if (e.mapped != 0)
        ::mprotect(reinterpret_cast<void*>(begin), e.mapped, closed ? PROT_NONE : PROT_READ | PROT_WRITE);
#else
    (void)closed;
#endif
  }
  mutable std::mutex m_;
  std::map<std::uintptr_t, entry> live_;
  std::atomic<bool> strict_{false};
  std::atomic<int> inside_{0};
};

// Per thread (a rank): whether a device communicator's collective is queued and not yet
// waited for through its bounded wait, and the host waits made meanwhile.
struct emulated_queue_state {
  bool collective_pending = false;
  long long unbounded_waits = 0;
};
inline emulated_queue_state& emulated_queue() {
  thread_local emulated_queue_state s;
  return s;
}

template <class T>
struct emulated_delete {
  void operator()(T* p) const noexcept { emulated_allocations::get().release(p); }
};

// Where the emulated device's buffers come from: the registry above.
template <class T>
struct emulated_storage {
  static_assert(std::is_trivially_default_constructible_v<T> && std::is_trivially_destructible_v<T>,
                "emulated_buffer holds plain values");
  using owner = std::unique_ptr<T[], emulated_delete<T>>;
  static owner allocate(std::size_t n) {
    if (n == 0) return owner();
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    return owner(static_cast<T*>(emulated_allocations::get().allocate(n * sizeof(T))));
  }
};

}  // namespace detail

// Whether [p, p + bytes) lies inside one live buffer of exec::emulated_device (bytes 0:
// p inside one, or p null).
inline bool emulated_device_memory(const void* p, std::size_t bytes) {
  if (p == nullptr && bytes == 0) return true;
  return detail::emulated_allocations::get().holds(p, bytes == 0 ? 1 : bytes);
}

// Strict mode (see the header comment): on for the buffers allocated from now on, until
// it is turned off. Returns false where it is not available (not POSIX).
inline bool emulated_strict_memory(bool on) { return detail::emulated_allocations::get().set_strict(on); }

// For tests that emulate a device communicator: it says when it queues a collective and
// when its bounded wait() has waited for it. A copy from the emulated device's memory into
// other memory, or a synchronize(), while a collective is queued is a host wait that the
// communicator's timeout does not bound (on a GPU a peer that never arrives holds the host
// there); emulated_unbounded_waits() counts them on this thread.
inline void emulated_collective_queued() { detail::emulated_queue().collective_pending = true; }
inline void emulated_collective_waited() { detail::emulated_queue().collective_pending = false; }
inline long long emulated_unbounded_waits() { return detail::emulated_queue().unbounded_waits; }

// While it lives, the host plays the device: strict-mode buffers are open to it.
class emulated_launch_scope {
 public:
  emulated_launch_scope() { detail::emulated_allocations::get().enter(); }
  ~emulated_launch_scope() { detail::emulated_allocations::get().leave(); }
  emulated_launch_scope(const emulated_launch_scope&) = delete;
  emulated_launch_scope& operator=(const emulated_launch_scope&) = delete;
};

// A buffer of exec::emulated_device: host memory, registered as the policy's device memory
// while it lives. The interface of host_buffer.
template <class T>
using emulated_buffer = basic_buffer<T, detail::emulated_storage<T>>;

struct emulated_device {
  int queue = 0;  // which emulated queue (stream) the work goes to
  struct counters_t {  // atomic: ranks of threads::run may share one policy
    std::atomic<long long> synchronizations{0};
    std::atomic<long long> launches{0};
  };
  std::shared_ptr<counters_t> counters = std::make_shared<counters_t>();
};

// The order in which this thread's launches call their functors: reverse index order (the
// default) or forward. A GPU runs a launch's indices in any order, so its results must not
// depend on which.
enum class emulated_order { reverse, forward };
inline emulated_order& emulated_launch_order() noexcept {
  thread_local emulated_order order = emulated_order::reverse;
  return order;
}
inline void emulated_launch_order(emulated_order order) noexcept { emulated_launch_order() = order; }

template <class F>
void for_each_n(const emulated_device& p, std::size_t n, F&& f) {
  if (n == 0) return;
  ++p.counters->launches;
  const emulated_launch_scope on_device;
  if (emulated_launch_order() == emulated_order::forward) {
    for (std::size_t i = 0; i < n; ++i) f(i);
  } else {
    for (std::size_t i = n; i-- > 0;) f(i);
  }
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
  auto& q = detail::emulated_queue();
  if (q.collective_pending && n && emulated_device_memory(src, n * sizeof(T)) && !emulated_device_memory(dst, n * sizeof(T)))
    ++q.unbounded_waits;  // a read-back that waits for the queued collective on its own
  const emulated_launch_scope on_device;
  if (n) std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(T));
}

template <class T>
void fill_zero(const emulated_device&, T* dst, std::size_t n) {
  const emulated_launch_scope on_device;
  if (n) std::memset(static_cast<void*>(dst), 0, n * sizeof(T));
}

// Library code that runs device work through another door (Thrust) opens one of these
// (also for policies derived from emulated_device).
template <class P, std::enable_if_t<std::is_base_of_v<emulated_device, P>, int> = 0>
emulated_launch_scope launch_scope(const P&) {
  return {};
}

inline void synchronize(const emulated_device& p) {
  ++p.counters->synchronizations;
  auto& q = detail::emulated_queue();
  if (q.collective_pending) ++q.unbounded_waits;
}

// (Also for policies derived from emulated_device.)
template <class A, class B,
          std::enable_if_t<std::is_base_of_v<emulated_device, A> && std::is_base_of_v<emulated_device, B>, int> = 0>
bool same_queue(const A& a, const B& b) {
  return a.queue == b.queue;
}

}  // namespace epx::exec
