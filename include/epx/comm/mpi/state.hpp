// epx/comm/mpi/state.hpp: what the copies of one epx::mpi::communicator share (needs <mpi.h>).
//
// The wrapped MPI_Comm, the private duplicate for chunked point-to-point traffic
// (epx/comm/mpi/transport.hpp), this rank and the size, and the name of the collective in
// progress (for the watchdog's message, epx/comm/mpi/wait.hpp). After a watchdog timeout:
// the message (`failed`: the communicator cannot be used any more) and the timed-out
// requests with the library's buffers they still read and write (`orphans`), kept until
// the requests complete. An owned communicator and the duplicate are freed with the state,
// unless MPI is finalized by then or requests are still pending on them; orphaned buffers
// whose requests never completed are left allocated (freeing them could let a late rank
// write into reused memory), and so are the communicators of such requests (a late rank's
// arrival makes MPI progress them: on a freed communicator Open MPI crashes).
// The shared-memory window of peer access (epx/comm/mpi/shared.hpp) lives here too.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epx/comm/detail/deadline.hpp"

namespace epx::detail {

// Timed-out requests and the buffers they touch (see epx/comm/mpi/wait.hpp).
struct mpi_orphan {
  std::vector<MPI_Request> requests;
  std::vector<std::shared_ptr<void>> buffers;
};

// Peer access through MPI-3 shared memory (epx/comm/mpi/shared.hpp): whether every rank of
// the communicator shares one node, and the grow-only window the published buffers are
// copied into (every rank's segment has `capacity` bytes; base[r] is rank r's, mapped here).
struct mpi_peer_window {
  int available = -1;  // -1: not checked yet; 0: no; 1: every rank shares this node
  MPI_Win win = MPI_WIN_NULL;
  std::size_t capacity = 0;
  std::vector<char*> base;
  std::chrono::milliseconds timeout{0};  // the watchdog of the barrier before MPI_Win_free
};

// The peer buffers (communicator::peer_buffer, epx/comm/mpi/shared.hpp): a pool of shared
// windows in which each rank's segment is one block, handed out by this rank alone and
// handed back when the last holder of the block lets go (on any thread: the mutex guards
// `busy`). Slot w is the same window on every rank (slots are filled and emptied
// collectively); an empty slot has MPI_WIN_NULL.
struct mpi_pool_window {
  MPI_Win win = MPI_WIN_NULL;
  std::vector<char*> base;  // every rank's segment, mapped here
  std::size_t bytes = 0;    // this rank's segment
  bool busy = false;        // this rank's block is handed out
};
struct mpi_peer_pool {
  static constexpr std::size_t most_windows = 64;  // a bit each in one 64-bit mask
  std::mutex m;
  std::vector<mpi_pool_window> windows;
  std::chrono::milliseconds timeout{0};  // the watchdog of the barrier before MPI_Win_free
};

// The windows of the communicators over one MPI_Comm are numbered in the order they are
// first made (an attribute of that MPI_Comm counts them). Windows are made collectively, so
// every rank gives the same window the same number; the frees compare it (free_peer_window).
inline int mpi_window_keyval() {
  static const int key = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(
        MPI_COMM_NULL_COPY_FN,
        [](MPI_Comm, int, void* v, void*) -> int {
          delete static_cast<long long*>(v);
          return MPI_SUCCESS;
        },
        &k, nullptr);
    return k;
  }();
  return key;
}

// The next window number of `comm` (1, 2, ...).
inline long long mpi_next_window_id(MPI_Comm comm) {
  const int key = mpi_window_keyval();
  void* v = nullptr;
  int found = 0;
  if (key != MPI_KEYVAL_INVALID) MPI_Comm_get_attr(comm, key, &v, &found);
  if (!found || v == nullptr) {
    v = new long long(0);
    if (key == MPI_KEYVAL_INVALID || MPI_Comm_set_attr(comm, key, v) != MPI_SUCCESS) {
      delete static_cast<long long*>(v);
      static long long fallback = 0;  // no attribute: still the same on every rank of one comm
      return ++fallback;
    }
  }
  return ++*static_cast<long long*>(v);
}

struct mpi_state {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm chunk_comm = MPI_COMM_NULL;  // private duplicate: chunked point-to-point traffic (tag 0), window-free verdicts (tag 1)
  bool owned = false;
  int rank = 0;
  int size = 1;
  std::size_t chunked_rounds = 0;
  const char* op = "";   // the collective in progress (watchdog messages)
  std::string failed;    // set by a watchdog timeout: why the communicator cannot be used
  int thread_level = MPI_THREAD_MULTIPLE;  // MPI_Query_thread at construction (mpi_enter's check)
  std::vector<mpi_orphan> orphans;
  mpi_peer_window peer;   // the copies of access_peers
  // peer_buffer: blocks made in place, published without a copy. Shared with the blocks'
  // holders, which hand their block back only while the pool lives.
  std::shared_ptr<mpi_peer_pool> pool = std::make_shared<mpi_peer_pool>();
  std::shared_ptr<void> arena;  // peer_memory's block (valid until its next call)
  long long window_id = 0;  // the number of this state's windows on comm (mpi_next_window_id), 0: none yet
  // Requests left pending on comm or chunk_comm (a watchdog's orphans, free_peer_window's
  // timed-out rounds): MPI may still progress them, so the communicators are not freed
  // (Open MPI's nonblocking collectives then touch a freed communicator and crash).
  bool requests_left = false;
  mpi_state() = default;
  mpi_state(const mpi_state&) = delete;
  mpi_state& operator=(const mpi_state&) = delete;

  // Tests the orphaned requests; frees the buffers of those that completed. Returns how
  // many orphans still wait (0 after MPI_Finalize: MPI is gone, nothing can write).
  std::size_t settle_orphans() {
    int finalized = 0;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) {
      orphans.clear();
      return 0;
    }
    std::vector<mpi_orphan> left;
    for (auto& o : orphans) {
      int done = 0;
      if (MPI_Testall(static_cast<int>(o.requests.size()), o.requests.data(), &done, MPI_STATUSES_IGNORE) !=
              MPI_SUCCESS ||
          !done)
        left.push_back(std::move(o));
    }
    orphans = std::move(left);
    return orphans.size();
  }

  // Waits for `n` requests until `deadline` (time_point::max(): for ever); false if they
  // did not complete by then (they stay pending).
  static bool wait_until(MPI_Request* reqs, int n, std::chrono::steady_clock::time_point deadline) noexcept {
    for (unsigned spin = 1;; ++spin) {
      int done = 0;
      if (MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) return false;
      if (done) return true;
      if (spin % 64 == 0) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::yield();
      }
    }
  }

  // MPI_Win_free is collective and blocks until every rank calls it, and a rank that leaves
  // by an exception may never call it. So the windows are freed only when every rank
  // frees them now, which two rounds settle, and never while an exception unwinds or after
  // a failure (then they are left to MPI_Finalize):
  //  1. a nonblocking MPI_Iallreduce on comm of the number of this communicator's windows
  //     (`window_id`, its minimum and maximum), within the watchdog's time. Communicators
  //     over one MPI_Comm destroyed in different orders on the ranks meet here with
  //     different numbers, and every rank sees the same disagreement (a plain barrier
  //     would pair them, and each rank would wait in MPI_Win_free of another window);
  //  2. every rank sends every other its verdict (round 1 done in time, numbers equal) on
  //     the private duplicate chunk_comm, and frees only when every verdict is yes. A rank
  //     whose round 1 timed out says no, so a late rank that completes round 1 afterwards
  //     does not go on into an MPI_Win_free that the early one never makes. Every rank
  //     that entered round 1 sends its verdict within its own watchdog time, so this wait
  //     ends.
  void free_peer_window() noexcept {
    if (peer.win == MPI_WIN_NULL && pool_windows() == 0) return;
    if (std::uncaught_exceptions() > 0 || !failed.empty() || !orphans.empty()) return;
    if (chunk_comm == MPI_COMM_NULL) return;  // made with the first window: not here, nothing agreed
    const auto timeout = std::max(peer.timeout, pool->timeout);
    const bool forever = timeout.count() == 0;
    const auto never = std::chrono::steady_clock::time_point::max();
    // On the heap: a late rank may still complete the reduction after a timeout.
    auto* ids = new long long[2]{window_id, -window_id};
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Iallreduce(MPI_IN_PLACE, ids, 2, MPI_LONG_LONG, MPI_MIN, comm, &req) != MPI_SUCCESS) {
      delete[] ids;
      return;
    }
    const bool in_time = wait_until(&req, 1, forever ? never : deadline_after(timeout));
    bool yes = in_time && ids[0] == window_id && -ids[1] == window_id;
    if (in_time) delete[] ids;
    else {  // pending: it, its buffer, the windows and the communicators stay to MPI_Finalize
      new MPI_Request(req);
      requests_left = true;
    }
    // Round 2: the verdicts. The send buffers are static: nothing to keep alive.
    static const int verdict[2] = {0, 1};
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      MPI_Request sr = MPI_REQUEST_NULL;
      if (MPI_Isend(&verdict[yes ? 1 : 0], 1, MPI_INT, p, 1, chunk_comm, &sr) == MPI_SUCCESS) MPI_Request_free(&sr);
    }
    // A rank that says no posts no receives, and a rank that hears a no frees nothing: some
    // verdict sent then stays unreceived, its request on chunk_comm with it.
    if (!yes) {
      requests_left = true;
      return;
    }
    std::vector<MPI_Request> rq(static_cast<std::size_t>(size), MPI_REQUEST_NULL);
    auto* votes = new int[static_cast<std::size_t>(size)]();
    for (int p = 0; p < size; ++p)
      if (p != rank && MPI_Irecv(&votes[p], 1, MPI_INT, p, 1, chunk_comm, &rq[static_cast<std::size_t>(p)]) !=
                           MPI_SUCCESS)
        yes = false;
    // Every peer that entered round 1 has sent by the end of its own watchdog time; twice
    // that and a second is a bound that only a dead rank reaches (for ever where twice the
    // timeout does not fit: milliseconds::max() is a timeout too).
    const bool huge = timeout > (std::chrono::milliseconds::max() - std::chrono::seconds(1)) / 2;
    const auto bound = forever || huge ? never : deadline_after(2 * timeout + std::chrono::seconds(1));
    if (!yes || !wait_until(rq.data(), size, bound)) {
      for (auto& r : rq)
        if (r != MPI_REQUEST_NULL) {  // pending receives into `votes`: left with it
          new MPI_Request(r);
          requests_left = true;
        }
      return;
    }
    for (int p = 0; p < size; ++p) yes = yes && (p == rank || votes[p] == 1);
    delete[] votes;
    if (!yes) {  // some rank frees different windows or gave up: leave them to MPI_Finalize
      requests_left = true;
      return;
    }
    std::vector<MPI_Win*> wins{&peer.win};
    for (auto& p : pool->windows) wins.push_back(&p.win);
    for (MPI_Win* w : wins) {
      if (*w == MPI_WIN_NULL) continue;
      MPI_Win_unlock_all(*w);
      MPI_Win_free(w);
    }
  }

  std::size_t pool_windows() const noexcept {
    std::size_t k = 0;
    for (const auto& p : pool->windows) k += p.win != MPI_WIN_NULL ? 1 : 0;
    return k;
  }

  ~mpi_state() {
    int finalized = 0;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;  // MPI freed everything
    if (!orphans.empty() && settle_orphans() != 0) {
      // Still pending: a late rank may write into these buffers at any time. Leave them.
      new std::vector<mpi_orphan>(std::move(orphans));
      requests_left = true;
    }
    free_peer_window();
    if (requests_left) return;  // the communicators stay to MPI_Finalize with their requests
    if (chunk_comm != MPI_COMM_NULL) MPI_Comm_free(&chunk_comm);
    if (owned && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

}  // namespace epx::detail
