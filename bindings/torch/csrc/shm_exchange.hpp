// bindings/torch/csrc/shm_exchange.hpp: the all-to-alls of a group whose ranks share one
// host, through POSIX shared memory instead of the process group's transport.
//
// Every rank owns a control segment (a barrier in rank 0's, and per rank the name and
// generation of its two data buffers) and two grow-only data buffers, used in turn by
// successive exchanges. An exchange:
//   1. the sender writes a table (where each (peer, segment) block sits) and the blocks
//      into its buffer of this exchange;
//   2. a barrier over the group (an atomic counter in shared memory; waiters sleep on a
//      futex, bounded by the group's timeout);
//   3. each receiver copies its blocks straight from every sender's buffer to where it
//      wants them (expert-major for dispatch, send order for combine), or reads them where
//      they are (exchange_in_place: the sums of combine's inference and dispatch's backward).
// Two buffers make one barrier per exchange enough: a sender writes buffer b at exchange i
// only after the barrier of exchange i-1, which every receiver passes after it has read
// exchange i-2 (the last one that used b). Rows move by two copies, with no socket; an
// exchange that moves at least epx::exec::stream_threshold() bytes (4 MiB by default) writes
// both around the caches (non-temporal stores, fenced before the barrier and before
// returning; epx/exec/stream.hpp): at 8 ranks, 1024 x 1024 rows, top-8, a forward and backward
// took 10-20% less time than with memcpy (bindings/torch/tests/bench.py's shape, float32 and
// bfloat16).
//
// Names are /epx.<pid>.<token>.<n>, with a random token drawn once per process: names of
// concurrent jobs never meet, and a name left behind by a killed process whose pid is later
// reused does not block the new process. The control segments' names are removed right
// after setup; a data buffer's name by the last peer that maps it (every peer maps a new
// buffer in the exchange that publishes it), so no name outlives its exchange, whenever a
// rank's communicator is destroyed. When a rank fails on its own (no shared memory left for
// a larger buffer, a peer's buffer that cannot be mapped) or times out (a peer died or never
// called), it marks the group failed with its reason: every rank then stops at its next call
// or wait with that reason instead of waiting out the timeout, and the exchange raises from
// then on. A peer may still be reading the previous exchange when another fails, so the
// names are removed only once every rank has stopped (the last one to stop removes every
// rank's); after a timeout (a peer is gone and may never stop), every rank that notices it
// removes its own at once. Only a rank killed in the middle of an exchange, or one that
// never calls again after a failure of another kind, leaves a name behind.
#pragma once

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/exec/stream.hpp"

namespace epx_torch {

class shm_exchange {
 public:
  static constexpr std::size_t name_len = 48;

  struct slot_info {
    std::atomic<std::uint64_t> generation;  // bumped when the buffer is replaced
    std::atomic<std::uint32_t> mapped;      // peers that mapped this generation; the last one unlinks it
    std::uint32_t pad_;
    std::uint64_t bytes;
    char name[name_len];
  };
  static constexpr std::size_t reason_len = 240;
  struct control {
    std::atomic<std::uint32_t> count;  // rank 0's: the barrier
    std::atomic<std::uint32_t> sense;
    std::atomic<std::uint32_t> failed;   // rank 0's: 1 + the first rank that failed; the others stop too
    std::atomic<std::uint32_t> stopped;  // rank 0's: ranks that have seen the failure and read no more
    slot_info slot[2];
    char reason[reason_len];  // this rank's failure, written before it sets rank 0's `failed`
    std::uint32_t timed_out;  // that failure was a timeout (a peer is gone), written likewise
  };

  // Creates this rank's control segment; `names()` is what the peers need to map it.
  explicit shm_exchange(int rank, int size, double timeout_s)
      : rank_(rank), size_(size), timeout_(timeout_s), peers_(static_cast<std::size_t>(size)) {
    own_name_ = make_name();
    own_ = static_cast<control*>(create(own_name_, sizeof(control), &own_fd_));
    new (own_) control{};
    for (auto& s : own_->slot) s.generation.store(0);
  }

  ~shm_exchange() {
    if (own_ != nullptr && peers_[0].ctl != nullptr && peers_[0].ctl->failed.load() != 0) drop_names();
    for (auto& p : peers_) {
      if (p.ctl != nullptr && p.ctl != own_) munmap(p.ctl, sizeof(control));
      for (auto& b : p.buf)
        if (b.ptr != nullptr) munmap(b.ptr, b.bytes);
    }
    for (auto& b : mine_)
      if (b.ptr != nullptr) munmap(b.ptr, b.bytes);
    if (own_ != nullptr) munmap(own_, sizeof(control));
    if (!own_name_.empty() && !control_unlinked_) shm_unlink(own_name_.c_str());
    for (int fd : fds_) close(fd);
    if (own_fd_ >= 0) close(own_fd_);
  }

  const std::string& control_name() const noexcept { return own_name_; }

  // After every rank has created its control segment: map the peers' (names in rank order).
  void attach(const std::vector<std::string>& names) {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        peers_[static_cast<std::size_t>(r)].ctl = own_;
        continue;
      }
      int fd = -1;
      peers_[static_cast<std::size_t>(r)].ctl = static_cast<control*>(open_map(names[static_cast<std::size_t>(r)],
                                                                               sizeof(control), &fd));
      fds_.push_back(fd);
    }
  }
  // After a barrier that follows attach() on every rank: nobody needs the names any more.
  void unlink_control() {
    shm_unlink(own_name_.c_str());
    control_unlinked_ = true;
  }

  // One exchange. Blocks (peer p, segment i) of send_counts[p*nseg+i] elements at
  // send_displs[...] go to peer p, which stores them at its recv_displs[me*nseg+i]; counts
  // and displacements in bytes here.
  // Where the next exchange with `nseg` segments per peer may take its send buffer of
  // `bytes` bytes in place (no copy): a sender that writes its blocks there (at their
  // send_displs) and passes this pointer as `send` saves the copy of step 1.
  std::byte* outbox(std::size_t bytes, std::size_t nseg) {
    const std::size_t table = round_up(2 * static_cast<std::size_t>(size_) * nseg * sizeof(std::uint64_t));
    check_group();
    return guarded([&] { return own_buffer(static_cast<int>(calls_ % 2), table + bytes); }) + table;
  }

  void exchange(const std::byte* send, const std::size_t* send_counts, const std::size_t* send_displs,
                std::byte* recv, const std::size_t* recv_counts, const std::size_t* recv_displs, std::size_t nseg) {
    std::size_t total = 0;
    for (std::size_t j = 0; j < static_cast<std::size_t>(size_) * nseg; ++j) total += recv_counts[j];
    const bool stream = epx::exec::streams(total);
    exchange_in_place(send, send_counts, send_displs, recv_counts, nseg,
                      [&](std::size_t q, std::size_t i, const std::byte* block, std::size_t bytes) {
                        copy(recv + recv_displs[q * nseg + i], block, bytes, stream);
                      });
    if (stream) epx::exec::stream_fence();
  }

  // The exchange with step 3 left to the caller: at(q, i, block, bytes) for every sender q
  // and segment i, with `block` where q's block for this rank sits in q's buffer. The blocks
  // stay there until this rank's next exchange or all_gather (the barrier of the next
  // exchange is what lets a sender reuse the buffer), so the caller reads them before it.
  template <class At>
  void exchange_in_place(const std::byte* send, const std::size_t* send_counts, const std::size_t* send_displs,
                         const std::size_t* recv_counts, std::size_t nseg, At&& at_block) {
    const auto P = static_cast<std::size_t>(size_);
    const int b = static_cast<int>(calls_ % 2);
    // 1. The table ([P][nseg] offsets into the buffer, then counts) and the blocks.
    const std::size_t table = round_up(2 * P * nseg * sizeof(std::uint64_t));
    const bool in_place = mine_[b].ptr != nullptr && send == mine_[b].ptr + table;
    std::size_t total = table;
    for (std::size_t j = 0; j < P * nseg; ++j) total += in_place ? 0 : round_up(send_counts[j]);
    check_group();
    std::byte* buf = in_place ? mine_[b].ptr : guarded([&] { return own_buffer(b, total); });
    ++calls_;
    auto* off = reinterpret_cast<std::uint64_t*>(buf);
    auto* cnt = off + P * nseg;
    std::size_t at = table;
    const bool stream = !in_place && epx::exec::streams(total - table);
    for (std::size_t j = 0; j < P * nseg; ++j) {
      cnt[j] = send_counts[j];
      if (in_place) {
        off[j] = table + send_displs[j];
        continue;
      }
      off[j] = at;
      copy(buf + at, send + send_displs[j], send_counts[j], stream);
      at += round_up(send_counts[j]);
    }
    if (stream) epx::exec::stream_fence();
    // 2. Everyone's blocks are written.
    barrier();
    // 3. Read every sender's blocks for this rank.
    for (std::size_t q = 0; q < P; ++q) {
      const std::byte* src = guarded([&] { return peer_buffer(static_cast<int>(q), b); });
      const auto* qoff = reinterpret_cast<const std::uint64_t*>(src);
      const auto* qcnt = qoff + P * nseg;
      for (std::size_t i = 0; i < nseg; ++i) {
        const std::size_t j = static_cast<std::size_t>(rank_) * nseg + i;
        const std::size_t want = recv_counts[q * nseg + i];
        EPX_REQUIRE(qcnt[j] == want, epx::errc::communicator, "shared-memory all-to-all: rank ", q, " sends ",
                    qcnt[j], " bytes of segment ", i, " to rank ", rank_, ", which expects ", want);
        at_block(q, i, src + qoff[j], want);
      }
    }
  }

  // Every rank's `bytes` bytes to every rank, in rank order (the same protocol, one block).
  void all_gather(const std::byte* send, std::byte* recv, std::size_t bytes) {
    const int b = static_cast<int>(calls_ % 2);
    check_group();
    std::byte* buf = guarded([&] { return own_buffer(b, 64 + bytes); });
    ++calls_;
    const std::uint64_t n = bytes;
    std::memcpy(buf, &n, sizeof n);
    if (bytes) std::memcpy(buf + 64, send, bytes);
    barrier();
    for (int q = 0; q < size_; ++q) {
      const std::byte* src = guarded([&] { return peer_buffer(q, b); });
      std::uint64_t m = 0;
      std::memcpy(&m, src, sizeof m);
      EPX_REQUIRE(m == n, epx::errc::communicator, "shared-memory all_gather: rank ", q, " sends ", m,
                  " bytes, rank ", rank_, " expects ", n);
      if (bytes) std::memcpy(recv + static_cast<std::size_t>(q) * bytes, src + 64, bytes);
    }
  }

  void barrier() {
    control* c0 = peers_[0].ctl;
    check_group();
    sense_ = !sense_;
    const std::uint32_t s = sense_ ? 1u : 0u;
    if (c0->count.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(size_)) {
      c0->count.store(0, std::memory_order_relaxed);
      c0->sense.store(s, std::memory_order_release);
      futex(&c0->sense, FUTEX_WAKE, INT32_MAX, nullptr);  // the waiters sleep in the kernel
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (unsigned spin = 0; c0->sense.load(std::memory_order_acquire) != s; ++spin) {
      check_group();
      if (spin < 128) continue;
      // Sleep until the last rank flips the sense (or 20 ms pass, to check the timeout): the
      // ranks often outnumber the cores, and a spinning waiter takes a core from the others.
      timespec ts{0, 20000000};
      futex(&c0->sense, FUTEX_WAIT, 1u - s, &ts);
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_) {
        const std::string why = epx::detail::concat("shared-memory all-to-all: rank ", rank_, " waited more than ",
                                                    timeout_, " s for the other ranks of its group (one died or did "
                                                    "not call)");
        fail_group(why, true);
        throw epx::error(epx::errc::communicator, why, EPX_HERE);
      }
    }
  }

 private:
  struct mapping {
    std::byte* ptr = nullptr;
    std::size_t bytes = 0;
    std::uint64_t generation = 0;
    std::string name;  // own buffers: the name peers open
  };
  struct peer {
    control* ctl = nullptr;
    mapping buf[2];
  };

  static std::size_t round_up(std::size_t n) { return (n + 63) / 64 * 64; }

  // n bytes from s to d, around the caches when `stream` (the caller fences).
  static void copy(std::byte* d, const std::byte* s, std::size_t n, bool stream) {
    if (n == 0) return;
    if (stream) epx::exec::stream_copy(d, s, n);
    else std::memcpy(d, s, n);
  }

  // Raises when a rank of the group has failed (on every later call too: the exchange is
  // broken for good), with that rank's reason.
  void check_group() {
    control* c0 = peers_[0].ctl;
    const std::uint32_t f = c0->failed.load(std::memory_order_acquire);
    if (f == 0) return;
    const int r = static_cast<int>(f) - 1;
    const control* cr = r >= 0 && r < size_ ? peers_[static_cast<std::size_t>(r)].ctl : nullptr;
    // After a timeout a peer is gone and may never stop: remove this rank's names now.
    if (cr != nullptr && cr->timed_out != 0) drop_names();
    note_stopped();
    std::string why = cr != nullptr ? std::string(cr->reason, strnlen(cr->reason, reason_len)) : std::string();
    if (r == rank_) throw epx::error(epx::errc::communicator, "shared-memory exchange: failed earlier: " + why, EPX_HERE);
    throw epx::error(epx::errc::communicator,
                     epx::detail::concat("shared-memory exchange: rank ", r, " of the group failed: ", why), EPX_HERE);
  }

  // This rank cannot go on: publish its reason and mark the group failed (the first failure
  // wins), so the peers stop at their next wait instead of timing out.
  void fail_group(const std::string& why, bool timed_out = false) {
    own_->timed_out = timed_out ? 1u : 0u;
    if (timed_out) drop_names();
    std::memset(own_->reason, 0, reason_len);
    std::memcpy(own_->reason, why.data(), std::min(why.size(), reason_len - 1));
    std::uint32_t none = 0;
    peers_[0].ctl->failed.compare_exchange_strong(none, static_cast<std::uint32_t>(rank_ + 1), std::memory_order_acq_rel);
    futex(&peers_[0].ctl->sense, FUTEX_WAKE, INT32_MAX, nullptr);
    note_stopped();
  }

  // This rank reads no more buffers of the group; the last rank to stop removes every rank's
  // buffer names (each at most once; a name already removed is no error).
  void note_stopped() {
    if (stopped_) return;
    stopped_ = true;
    if (peers_[0].ctl->stopped.fetch_add(1, std::memory_order_acq_rel) + 1 != static_cast<std::uint32_t>(size_))
      return;
    drop_names();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      for (const slot_info& sl : peers_[static_cast<std::size_t>(r)].ctl->slot)
        if (sl.name[0] != 0) shm_unlink(std::string(sl.name, strnlen(sl.name, name_len)).c_str());
    }
  }

  // Runs a step that may fail on this rank alone; a failure marks the group failed first.
  template <class F>
  auto guarded(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const epx::error& e) {
      fail_group(e.message());
      throw;
    }
  }

  // The group is broken: remove this rank's buffer names now, since the peers that would
  // have removed them may never map them.
  void drop_names() {
    for (auto& m : mine_)
      if (!m.name.empty()) {
        shm_unlink(m.name.c_str());
        m.name.clear();
      }
  }

  // futex on a word of a shared mapping (not FUTEX_PRIVATE: the waiters are processes).
  static long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t val, const timespec* ts) {
    static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
    return syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, val, ts, nullptr, 0);
  }

  // /epx.<pid>.<token>.<n>: the token is random, drawn once per process.
  static std::string make_name() {
    static std::atomic<std::uint64_t> next{0};
    static const std::string token = [] {
      std::uint64_t t = 0;
      try {
        std::random_device rd;
        t = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
      } catch (...) {
      }
      t ^= static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
      char b[17];
      std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(t));
      return std::string(b);
    }();
    return epx::detail::concat("/epx.", static_cast<long>(getpid()), ".", token, ".", next.fetch_add(1));
  }

  void* create(const std::string& name, std::size_t bytes, int* fd_out) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EPX_REQUIRE(fd >= 0, epx::errc::communicator, "shm_open(", name, ") failed: ", std::strerror(errno));
    // Reserve the pages now, so that a full /dev/shm is an error here and not a SIGBUS later.
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw epx::error(epx::errc::communicator,
                       epx::detail::concat("reserving ", bytes, " bytes of shared memory (", name,
                                           ") failed: ", std::strerror(rc)),
                       EPX_HERE);
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      close(fd);
      shm_unlink(name.c_str());
      throw epx::error(epx::errc::communicator, epx::detail::concat("mmap of ", name, " failed: ", std::strerror(errno)),
                       EPX_HERE);
    }
    *fd_out = fd;
    return p;
  }

  static void* open_map(const std::string& name, std::size_t bytes, int* fd_out) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    EPX_REQUIRE(fd >= 0, epx::errc::communicator, "shm_open(", name, ") of a peer failed: ", std::strerror(errno));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    EPX_REQUIRE(p != MAP_FAILED, epx::errc::communicator, "mmap of a peer's ", name, " failed: ", std::strerror(errno));
    *fd_out = -1;
    return p;
  }

  // EPX_TORCH_SHM_MAX_BYTES: the most one data buffer of this process may take (unset: no
  // limit but /dev/shm's); an exchange that needs more fails on every rank of the group.
  static std::size_t max_buffer_bytes() {
    const char* v = std::getenv("EPX_TORCH_SHM_MAX_BYTES");
    if (v == nullptr || *v == 0) return SIZE_MAX;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    EPX_REQUIRE(end != nullptr && *end == 0, epx::errc::configuration, "EPX_TORCH_SHM_MAX_BYTES='", v,
                "' is not a number of bytes");
    return static_cast<std::size_t>(n);
  }

  std::byte* own_buffer(int b, std::size_t bytes) {
    mapping& m = mine_[b];
    if (m.bytes >= bytes) return m.ptr;
    const std::size_t limit = max_buffer_bytes();
    EPX_REQUIRE(bytes <= limit, epx::errc::communicator, "shared-memory exchange: rank ", rank_, " needs a buffer of ",
                bytes, " bytes, above EPX_TORCH_SHM_MAX_BYTES=", limit);
    const std::size_t want = std::min(std::max<std::size_t>(bytes + bytes / 4, 1 << 20), std::max(limit, bytes));
    const std::string name = make_name();
    int fd = -1;
    auto* p = static_cast<std::byte*>(create(name, want, &fd));
    close(fd);
    if (m.ptr != nullptr) munmap(m.ptr, m.bytes);
    m.ptr = p;
    m.bytes = want;
    m.name = name;
    slot_info& s = own_->slot[b];
    s.bytes = want;
    std::memset(s.name, 0, name_len);
    std::memcpy(s.name, name.data(), std::min(name.size(), name_len - 1));
    s.mapped.store(0, std::memory_order_relaxed);
    s.generation.fetch_add(1, std::memory_order_release);
    if (size_ == 1) shm_unlink(name.c_str());  // nobody else maps it
    return p;
  }

  const std::byte* peer_buffer(int q, int b) {
    if (q == rank_) return mine_[b].ptr;
    peer& p = peers_[static_cast<std::size_t>(q)];
    slot_info& s = p.ctl->slot[b];
    const std::uint64_t g = s.generation.load(std::memory_order_acquire);
    mapping& m = p.buf[b];
    if (m.generation != g || m.ptr == nullptr) {
      if (m.ptr != nullptr) munmap(m.ptr, m.bytes);
      int fd = -1;
      m.bytes = s.bytes;
      m.ptr = static_cast<std::byte*>(open_map(std::string(s.name), s.bytes, &fd));
      m.generation = g;
      // Every peer maps every new buffer in the exchange that publishes it (each reads
      // every sender's buffer): the last one to map it removes its name.
      auto& ctl = *p.ctl;
      if (ctl.slot[b].mapped.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(size_ - 1))
        shm_unlink(s.name);
    }
    return m.ptr;
  }

  int rank_, size_;
  double timeout_;
  std::vector<peer> peers_;
  mapping mine_[2];
  control* own_ = nullptr;
  int own_fd_ = -1;
  std::string own_name_;
  bool control_unlinked_ = false;
  bool stopped_ = false;
  bool sense_ = false;
  std::uint64_t calls_ = 0;
  std::vector<int> fds_;
};

}  // namespace epx_torch
