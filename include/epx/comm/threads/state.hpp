// epx/comm/threads/state.hpp: shared state behind epx::threads::communicator.
//
// A `threads_world` is one call of epx::threads::run: the abort state shared by every
// communicator split from it (set when an exception escapes a rank's function). A
// `threads_group` is one communicator's members: a slot per member where each rank
// publishes its call (buffers, counts), a generation barrier, and the failure of a
// collective that broke the group without aborting the run (the watchdog, a member gone).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epx/comm/datatype.hpp"
#include "epx/comm/threads/options.hpp"
#include "epx/core/error.hpp"

namespace epx::detail {

enum class threads_op : int {
  none,
  barrier,
  all_to_all,
  all_to_allv,
  all_to_allv_segments,
  all_to_allv_indexed,
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  split,
  access_peers,
};

inline const char* to_string(threads_op k) noexcept {
  switch (k) {
    case threads_op::none: return "none";
    case threads_op::barrier: return "barrier";
    case threads_op::all_to_all: return "all_to_all";
    case threads_op::all_to_allv: return "all_to_allv";
    case threads_op::all_to_allv_segments: return "all_to_allv_segments";
    case threads_op::all_to_allv_indexed: return "all_to_allv_indexed";
    case threads_op::all_reduce: return "all_reduce";
    case threads_op::reduce_scatter: return "reduce_scatter";
    case threads_op::all_gather: return "all_gather";
    case threads_op::broadcast: return "broadcast";
    case threads_op::split: return "split";
    case threads_op::access_peers: return "access_peers";
  }
  return "?";
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class threads_group;

// What a rank published for a collective. Written by its owner before the entry barrier,
// read by every member after it.
struct alignas(64) threads_slot {
  threads_op op = threads_op::none;
  datatype type = datatype::byte;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;  // all_to_allv_segments: the number of segments per peer; access_peers: pointers
  const std::size_t* send_counts = nullptr;
  const std::size_t* send_displs = nullptr;
  const std::size_t* recv_counts = nullptr;
  const std::size_t* recv_displs = nullptr;
  const std::int64_t* rows = nullptr;  // all_to_allv_indexed: the rows of `send` in send order
  std::size_t row_elems = 1;           // all_to_allv_indexed: elements per row (the counts' unit)
  double scale = 1.0;
  int root = 0;
  int color = 0;
  int key = 0;
  std::shared_ptr<threads_group> new_group;  // split: created by the lowest rank of a color
  // What is wrong with this member's own call (its buffers overlap, a null buffer claims
  // bytes, an unknown datatype), as the rest of "rank r ...": published like the rest, so
  // that every member raises it (errc::input) instead of only this one. Empty: nothing.
  std::string fault;
};

struct alignas(64) padded_counter {
  std::atomic<std::uint64_t> value{0};
};

// Synchronisation of one slot. Ranks that read (or write) a peer's buffers before the entry
// barrier has passed register as accessors; a rank that leaves a collective early
// retracts its slot and waits for its accessors to finish, so that nobody touches its
// buffers after it has left.
struct alignas(64) slot_sync {
  std::atomic<std::uint64_t> published{0};  // sequence number of the call in the slot
  std::atomic<int> accessors{0};
  std::atomic<bool> retracted{false};
};

// passed; cancelled (the run aborted); timed_out (the watchdog); member_gone (a member that
// has not entered returned from its function, so it never will).
enum class wait_result { passed, cancelled, timed_out, member_gone };

class threads_world;

class threads_group {
 public:
  threads_group(threads_world* world, std::vector<int> world_ranks)
      : world_(world),
        world_ranks_(std::move(world_ranks)),
        n_(static_cast<int>(world_ranks_.size())),
        slots_(new threads_slot[2 * world_ranks_.size()]),
        syncs_(new slot_sync[2 * world_ranks_.size()]),
        entered_(new padded_counter[world_ranks_.size()]),
        users_(new user_slot[world_ranks_.size()]) {}

  int size() const noexcept { return n_; }
  int world_rank(int r) const noexcept { return world_ranks_[static_cast<std::size_t>(r)]; }
  const std::vector<int>& world_ranks() const noexcept { return world_ranks_; }
  // Slots are double-buffered by the parity of the collective's sequence number: a rank
  // writes the slots of collective s+2 only after every member has entered s+1, that is,
  // after every member has finished reading the slots of s.
  threads_slot& slot(std::uint64_t seq, int r) noexcept { return slots_[index(seq, r)]; }
  slot_sync& sync(std::uint64_t seq, int r) noexcept { return syncs_[index(seq, r)]; }

  // Whether rank r has published collective `seq`.
  bool published(std::uint64_t seq, int r) noexcept { return sync(seq, r).published.load() == seq; }

  // Registers as an accessor of rank r's buffers; false if r has retracted them.
  bool acquire(std::uint64_t seq, int r) noexcept {
    auto& x = sync(seq, r);
    x.accessors.fetch_add(1);
    if (x.retracted.load()) {
      x.accessors.fetch_sub(1);
      return false;
    }
    return true;
  }
  void release(std::uint64_t seq, int r) noexcept { sync(seq, r).accessors.fetch_sub(1); }

  // Before leaving collective `seq` early: no new accessor gets in, the current ones finish
  // their copies (bounded).
  void retract(std::uint64_t seq, int r) noexcept {
    auto& x = sync(seq, r);
    x.retracted.store(true);
    while (x.accessors.load() != 0) std::this_thread::yield();
  }

  // The thread inside a collective of rank r on this group (no thread: none), which
  // refuses a second thread (threads::communicator::use_guard).
  std::atomic<std::thread::id>& user(int r) noexcept { return users_[static_cast<std::size_t>(r)].id; }

  // Number of collectives rank r has entered on this group (written by r only).
  std::uint64_t entered(int r) const noexcept { return entered_[static_cast<std::size_t>(r)].value.load(std::memory_order_acquire); }
  void set_entered(int r, std::uint64_t v) noexcept {
    entered_[static_cast<std::size_t>(r)].value.store(v, std::memory_order_release);
  }

  // Generation barrier. `abortable` waits give up when the world aborts or `deadline`
  // passes, and then cancel the generation so that no member can pass it: once any member
  // has left early, nobody reads its buffers. Non-abortable waits (the exit barrier of a
  // collective, where every member is known to be running bounded copy code) always pass.
  // `seq` is the caller's collective number on this group (for member_gone).
  inline wait_result arrive_and_wait(bool abortable, std::chrono::steady_clock::time_point deadline,
                                     std::uint64_t seq = 0);

  // arrive_and_wait in two steps: arrive counts this member in the current generation
  // (done: we were the last one, or it was cancelled); wait_gen waits for it to pass.
  struct arrival {
    std::uint32_t gen;
    bool done;
    wait_result result;
  };
  inline arrival arrive() noexcept;
  inline wait_result wait_gen(std::uint32_t gen, bool abortable, std::chrono::steady_clock::time_point deadline,
                              std::uint64_t seq);

  // Whether a member that has not entered collective `seq` has finished its function.
  inline bool member_gone(std::uint64_t seq) const noexcept;

  // Wakes the sleepers so that they re-check the world's abort flag.
  void poke() noexcept {
    { std::lock_guard<std::mutex> lk(m_); }
    cv_.notify_all();
  }

  // A collective of this group failed on its own (the watchdog, or a member that returned
  // without entering it), not because the run aborted. The member that cancelled the
  // generation records the failure here; the members that see the cancellation raise it
  // too. The generation stays cancelled, so the group cannot be used any more, but the run
  // goes on: only an exception that escapes a rank's function aborts it. Later calls keep
  // the first failure.
  void fail(int world_rank, const std::exception_ptr& e) noexcept {
    std::lock_guard<std::mutex> lk(failure_m_);
    if (failed_.load()) return;
    failed_rank_ = world_rank;
    try {
      failure_ = describe_exception(e);
    } catch (...) {
      failure_.clear();
    }
    failed_.store(true);
  }
  bool failed() const noexcept { return failed_.load(); }

  [[noreturn]] void throw_failed(int world_rank) const {
    int r;
    std::string m;
    {
      std::lock_guard<std::mutex> lk(failure_m_);
      r = failed_rank_;
      m = failure_;
    }
    EPX_THROW(errc::communicator, "rank ", r, " failed: ", m, " (collective aborted on rank ", world_rank, ")");
  }

 private:
  static constexpr std::uint64_t cancel_bit = std::uint64_t{1} << 31;
  static constexpr std::uint64_t count_mask = cancel_bit - 1;

  static std::uint32_t gen_of(std::uint64_t s) noexcept { return static_cast<std::uint32_t>(s >> 32); }

  // Rank r's entry of the slot arrays for the collective with sequence number seq.
  std::size_t index(std::uint64_t seq, int r) const noexcept {
    return static_cast<std::size_t>(seq & 1) * static_cast<std::size_t>(n_) + static_cast<std::size_t>(r);
  }

  void wake() noexcept {
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lk(m_); }
      cv_.notify_all();
    }
  }

  // Sets the cancel bit if generation `gen` has not passed yet.
  // 0: it passed; 1: we cancelled it; 2: someone else had cancelled it.
  int try_cancel(std::uint32_t gen) noexcept {
    std::uint64_t s = state_.load();
    for (;;) {
      if (gen_of(s) != gen) return 0;
      if (s & cancel_bit) return 2;
      if (state_.compare_exchange_weak(s, s | cancel_bit)) {
        { std::lock_guard<std::mutex> lk(m_); }
        cv_.notify_all();
        return 1;
      }
    }
  }

  threads_world* world_;
  std::vector<int> world_ranks_;
  int n_;
  std::unique_ptr<threads_slot[]> slots_;
  std::unique_ptr<slot_sync[]> syncs_;
  std::unique_ptr<padded_counter[]> entered_;
  struct alignas(64) user_slot {
    std::atomic<std::thread::id> id{};
  };
  std::unique_ptr<user_slot[]> users_;
  // [generation:32][cancelled:1][arrived:31]
  alignas(64) std::atomic<std::uint64_t> state_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<bool> failed_{false};
  mutable std::mutex failure_m_;
  int failed_rank_ = -1;
  std::string failure_;
};

class threads_world {
 public:
  threads_world(int n, std::chrono::milliseconds timeout, threads::memory memory = {})
      : timeout_(timeout), memory_(memory), finished_(new padded_counter[static_cast<std::size_t>(n)]) {
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    // With more ranks than cores a spinning or yielding waiter steals the core of the rank
    // it waits for (or hands a whole time slice to another process): sleep at once.
    spin_limit_ = static_cast<unsigned>(n) <= hw ? 4000 : 0;
  }

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const threads::memory& memory() const noexcept { return memory_; }
  bool finished(int world_rank) const noexcept { return finished_[static_cast<std::size_t>(world_rank)].value.load() != 0; }

  // Rank `world_rank` returned from its function: waiters for it can stop waiting.
  void mark_finished(int world_rank) noexcept {
    finished_[static_cast<std::size_t>(world_rank)].value.store(1);
    poke_all();
  }
  int spin_limit() const noexcept { return spin_limit_; }
  bool aborted() const noexcept { return aborted_.load(); }

  std::shared_ptr<threads_group> make_group(std::vector<int> world_ranks) {
    auto g = std::make_shared<threads_group>(this, std::move(world_ranks));
    std::lock_guard<std::mutex> lk(m_);
    // Communicators own their groups; the world only needs to wake the live ones.
    groups_.erase(std::remove_if(groups_.begin(), groups_.end(), [](const auto& w) { return w.expired(); }),
                  groups_.end());
    groups_.push_back(g);
    return g;
  }

  // Aborts the run: records the first failure (an exception that escaped a rank's function,
  // rethrown by epx::threads::run) and wakes every waiter of every group, whose pending and
  // later collectives then raise it. Later calls keep the first failure.
  void fail(int world_rank, std::exception_ptr e) noexcept {
    {
      std::lock_guard<std::mutex> lk(m_);
      if (!aborted_.load()) {
        failed_rank_ = world_rank;
        first_ = e;
        try {
          message_ = describe_exception(e);
        } catch (...) {
          message_.clear();
        }
        aborted_.store(true);
      }
    }
    poke_all();
  }

  [[noreturn]] void throw_aborted(int world_rank) const {
    int r;
    std::string m;
    {
      std::lock_guard<std::mutex> lk(m_);
      r = failed_rank_;
      m = message_;
    }
    EPX_THROW(errc::communicator, "rank ", r, " failed: ", m, " (collective aborted on rank ", world_rank, ")");
  }

  void throw_if_aborted(int world_rank) const {
    if (aborted()) throw_aborted(world_rank);
  }

  // The first failure that aborted the run, or null.
  std::exception_ptr first_failure() const {
    std::lock_guard<std::mutex> lk(m_);
    return first_;
  }

 private:
  void poke_all() noexcept {
    std::vector<std::shared_ptr<threads_group>> live;
    {
      std::lock_guard<std::mutex> lk(m_);
      try {
        for (auto& w : groups_)
          if (auto g = w.lock()) live.push_back(std::move(g));
      } catch (...) {  // out of memory: the waiters still see the flags at their deadline
      }
    }
    for (auto& g : live) g->poke();
  }

  std::chrono::milliseconds timeout_;
  threads::memory memory_;
  std::unique_ptr<padded_counter[]> finished_;
  int spin_limit_ = 0;
  std::atomic<bool> aborted_{false};
  mutable std::mutex m_;
  int failed_rank_ = -1;
  std::string message_;
  std::exception_ptr first_;
  std::vector<std::weak_ptr<threads_group>> groups_;
};

inline bool threads_group::member_gone(std::uint64_t seq) const noexcept {
  for (int r = 0; r < n_; ++r)
    if (entered(r) < seq && world_->finished(world_rank(r))) return true;
  return false;
}

inline wait_result threads_group::arrive_and_wait(bool abortable,
                                                  std::chrono::steady_clock::time_point deadline,
                                                  std::uint64_t seq) {
  const arrival a = arrive();
  if (a.done) return a.result;
  return wait_gen(a.gen, abortable, deadline, seq);
}

inline threads_group::arrival threads_group::arrive() noexcept {
  std::uint64_t s = state_.load();
  for (;;) {
    const std::uint32_t gen = gen_of(s);
    if (s & cancel_bit) return {gen, true, wait_result::cancelled};
    const std::uint64_t arrived = (s & count_mask) + 1;
    const bool last = arrived == static_cast<std::uint64_t>(n_);
    const std::uint64_t next = last ? (static_cast<std::uint64_t>(gen + 1u) << 32) : s + 1;
    if (state_.compare_exchange_weak(s, next)) {
      if (last) {
        wake();
        return {gen, true, wait_result::passed};
      }
      return {gen, false, wait_result::passed};
    }
  }
}

inline wait_result threads_group::wait_gen(std::uint32_t gen, bool abortable,
                                           std::chrono::steady_clock::time_point deadline, std::uint64_t seq) {
  // Spin briefly (when every rank has a core), then sleep on the condition variable.
  const int spins = world_->spin_limit();
  for (int i = 0; i < spins; ++i) {
    const std::uint64_t v = state_.load();
    if (gen_of(v) != gen) return wait_result::passed;
    if (v & cancel_bit) return wait_result::cancelled;
    if (abortable && world_->aborted()) break;
    cpu_relax();
  }

  bool timed_out = false, gone = false;
  {
    std::unique_lock<std::mutex> lk(m_);
    sleepers_.fetch_add(1);
    auto ready = [&] {
      const std::uint64_t v = state_.load();
      if (gen_of(v) != gen || (v & cancel_bit) != 0) return true;
      if (!abortable) return false;
      gone = member_gone(seq);
      return gone || world_->aborted();
    };
    if (abortable) {
      timed_out = !cv_.wait_until(lk, deadline, ready);
    } else {
      cv_.wait(lk, ready);
    }
    sleepers_.fetch_sub(1);
  }
  const std::uint64_t v = state_.load();
  if (gen_of(v) != gen) return wait_result::passed;
  if (v & cancel_bit) return wait_result::cancelled;
  // Abortable and (aborted or timed out): make sure nobody passes this generation.
  const int c = try_cancel(gen);
  if (c == 0) return wait_result::passed;
  if (c == 2 || world_->aborted()) return wait_result::cancelled;
  return gone ? wait_result::member_gone : timed_out ? wait_result::timed_out : wait_result::cancelled;
}

}  // namespace epx::detail
