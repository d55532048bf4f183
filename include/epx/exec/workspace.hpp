// epx/exec/workspace.hpp: a grow-only pool of host row buffers kept by a layer
// implementation between calls.
//
// Every forward and backward needs a few buffers of routed rows (hundreds of MiB at real
// shapes). Allocated fresh per call, each one is a new mmap that page-faults (and is zeroed
// by the kernel) 4 KiB at a time, and ranks that are threads of one process serialise on the
// address space while they fault. The pool keeps the blocks of earlier calls and hands them
// out again:
//
//   detail::workspace ws;                     // one per implementation instance
//   auto rows = ws.acquire<T>(R * H);         // pooled_buffer<T>: move-only, data(), size()
//   ...                                       // rows go back to the pool when `rows` dies
//
// Blocks live in a shared state that every handle co-owns, so a handle kept in a saved
// state may outlive the workspace (a layer moved or destroyed before its saved state): the
// block is then freed with the last handle. A mutex guards the free list (a rank uses its
// own workspace, so it is never contended; it only makes a saved state safe to destroy on
// another thread). Contents are not initialised (callers fill what they read), as with
// exec::make_buffer. Host memory only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/exec/host.hpp"

namespace epx::detail {

class workspace_pool {
 public:
  struct block {
    std::byte* data = nullptr;  // 64-byte aligned start
    std::size_t bytes = 0;      // usable from data
    void* raw = nullptr;        // what operator new returned
  };

  workspace_pool() = default;
  workspace_pool(const workspace_pool&) = delete;
  workspace_pool& operator=(const workspace_pool&) = delete;
  ~workspace_pool() {
    for (auto& b : free_) release_memory(b);
  }

  // The smallest free block of at least `bytes`; a new one if none fits. A new block
  // replaces the largest free one (which is too small), so the pool holds at most as many
  // blocks as were in use at once.
  block take(std::size_t bytes) {
    bool grows = false;  // replaces a block that was too small
    {
      std::lock_guard<std::mutex> lk(m_);
      std::size_t best = free_.size(), largest = free_.size();
      for (std::size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].bytes >= bytes && (best == free_.size() || free_[i].bytes < free_[best].bytes)) best = i;
        if (largest == free_.size() || free_[i].bytes > free_[largest].bytes) largest = i;
      }
      if (best != free_.size()) {
        const block b = free_[best];
        free_[best] = free_.back();
        free_.pop_back();
        return b;
      }
      if (largest != free_.size()) {
        grows = true;
        release_memory(free_[largest]);
        free_[largest] = free_.back();
        free_.pop_back();
      }
    }
    // A block that replaces a smaller one gets room for calls whose row counts vary a
    // little (routing changes R from call to call by a few percent); first blocks are
    // exact. Plain operator new (aligned by hand), so that heap accounting that replaces it
    // sees the pool's memory.
    const std::size_t want = round_up(grows ? bytes + bytes / 32 : bytes);
    block b;
    b.raw = ::operator new(want + alignment);
    const auto addr = reinterpret_cast<std::uintptr_t>(b.raw);
    b.data = static_cast<std::byte*>(b.raw) + ((alignment - addr % alignment) % alignment);
    b.bytes = want;
    return b;
  }

  void give_back(block b) noexcept {
    std::lock_guard<std::mutex> lk(m_);
    try {
      free_.push_back(b);
    } catch (...) {  // out of memory for the list: free the block instead
      release_memory(b);
    }
  }

  // Bytes held in free blocks (for tests).
  std::size_t free_bytes() const {
    std::lock_guard<std::mutex> lk(m_);
    std::size_t s = 0;
    for (const auto& b : free_) s += b.bytes;
    return s;
  }
  std::size_t free_blocks() const {
    std::lock_guard<std::mutex> lk(m_);
    return free_.size();
  }

 private:
  static constexpr std::size_t alignment = 64;
  static constexpr std::size_t granule = std::size_t{64} << 10;  // 64 KiB
  static std::size_t round_up(std::size_t b) { return (b + granule - 1) / granule * granule; }
  static void release_memory(block& b) noexcept {
    if (b.raw != nullptr) ::operator delete(b.raw);
    b = block{};
  }

  mutable std::mutex m_;
  std::vector<block> free_;
};

// n elements of T in a pooled block; the block returns to its pool when the handle dies.
// T must be trivially copyable (row elements: bf16, fp16, float, ...).
template <class T>
class pooled_buffer {
 public:
  pooled_buffer() = default;
  pooled_buffer(std::shared_ptr<workspace_pool> pool, workspace_pool::block b, std::size_t n) noexcept
      : pool_(std::move(pool)), block_(b), size_(n) {}
  // n elements of T in memory held by `held` (a communicator's peer buffer, at least n * sizeof(T)
  // bytes), which goes back with the handle instead of to a pool.
  pooled_buffer(std::shared_ptr<void> held, std::size_t n) noexcept
      : held_(std::move(held)), block_{static_cast<std::byte*>(held_.get()), n * sizeof(T), nullptr}, size_(n) {}
  pooled_buffer(pooled_buffer&& o) noexcept
      : pool_(std::move(o.pool_)),
        held_(std::move(o.held_)),
        block_(std::exchange(o.block_, {})),
        size_(std::exchange(o.size_, 0)) {}
  pooled_buffer& operator=(pooled_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      pool_ = std::move(o.pool_);
      held_ = std::move(o.held_);
      block_ = std::exchange(o.block_, {});
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  pooled_buffer(const pooled_buffer&) = delete;
  pooled_buffer& operator=(const pooled_buffer&) = delete;
  ~pooled_buffer() { reset(); }

  T* data() noexcept { return reinterpret_cast<T*>(block_.data); }
  const T* data() const noexcept { return reinterpret_cast<const T*>(block_.data); }
  std::size_t size() const noexcept { return size_; }

  // Returns the block to the pool now.
  void reset() noexcept {
    if (pool_ != nullptr && block_.data != nullptr) pool_->give_back(block_);
    pool_.reset();
    held_.reset();
    block_ = {};
    size_ = 0;
  }

 private:
  std::shared_ptr<workspace_pool> pool_;
  std::shared_ptr<void> held_;
  workspace_pool::block block_;
  std::size_t size_ = 0;
};

// One implementation instance's pool. A copy starts with a pool of its own (instances never
// share blocks); a moved-from workspace makes a new pool on its next acquire.
class workspace {
 public:
  workspace() = default;
  workspace(const workspace&) noexcept {}
  workspace& operator=(const workspace&) noexcept {
    pool_.reset();
    return *this;
  }
  workspace(workspace&&) noexcept = default;
  workspace& operator=(workspace&&) noexcept = default;
  ~workspace() = default;

  // n elements of T (uninitialised).
  template <class T>
  pooled_buffer<T> acquire(std::size_t n) {
    if (pool_ == nullptr) pool_ = std::make_shared<workspace_pool>();
    if (n == 0) return pooled_buffer<T>(pool_, {}, 0);
    if (n > SIZE_MAX / 2 / sizeof(T)) throw std::bad_array_new_length();  // room for the pool's rounding
    return pooled_buffer<T>(pool_, pool_->take(n * sizeof(T)), n);
  }

  // The pool (null before the first acquire); for tests.
  const std::shared_ptr<workspace_pool>& pool() const noexcept { return pool_; }

 private:
  std::shared_ptr<workspace_pool> pool_;
};

// Row buffers of a layer implementation: pooled for host policies, the policy's own
// (stream-ordered device) buffers otherwise.
template <class T, class Exec>
using rows_buffer = std::conditional_t<exec::is_host_policy_v<Exec>, pooled_buffer<T>, exec::buffer<T, Exec>>;

template <class T, class Exec>
rows_buffer<T, Exec> make_rows(workspace& ws, const Exec& ex, std::size_t n) {
  if constexpr (exec::is_host_policy_v<Exec>) {
    (void)ex;
    return ws.template acquire<T>(n);
  } else {
    (void)ws;
    return exec::make_buffer<T>(ex, n);
  }
}

}  // namespace epx::detail
