// epx/comm/mpi/state.hpp: what the copies of one epx::mpi::communicator share (needs <mpi.h>).
//
// The wrapped MPI_Comm, the private duplicate for chunked point-to-point traffic
// (epx/comm/mpi/transport.hpp), this rank and the size, and the name of the collective in
// progress (for the watchdog's message, epx/comm/mpi/wait.hpp). After a watchdog timeout:
// the message (`failed`: the communicator cannot be used any more) and the timed-out
// requests with the library's buffers they still read and write (`orphans`), kept until
// the requests complete. An owned communicator and the duplicate are freed with the state,
// unless MPI is finalized by then; orphaned buffers whose requests never completed are
// left allocated (freeing them could let a late rank write into reused memory).
// The shared-memory window of peer access (epx/comm/mpi/shared.hpp) lives here too.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
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
  MPI_Comm chunk_comm = MPI_COMM_NULL;  // private duplicate for chunked point-to-point traffic
  bool owned = false;
  int rank = 0;
  int size = 1;
  std::size_t chunked_rounds = 0;
  const char* op = "";   // the collective in progress (watchdog messages)
  std::string failed;    // set by a watchdog timeout: why the communicator cannot be used
  std::vector<mpi_orphan> orphans;
  mpi_peer_window peer;   // the copies of access_peers
  mpi_peer_window arena;  // peer_memory: buffers made in place, published without a copy
  long long window_id = 0;  // the number of this state's windows on comm (mpi_next_window_id), 0: none yet
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

  // MPI_Win_free is collective and blocks until every rank calls it, and a rank that leaves
  // by an exception may never call it. So the window is freed only after every rank has
  // agreed, within the watchdog's time, that it is freeing this very communicator's
  // windows: a nonblocking MPI_Iallreduce on comm of the number of its windows (`window_id`,
  // the minimum and the maximum). Communicators over one MPI_Comm destroyed in different
  // orders on the ranks meet in that reduction with different numbers: every rank sees the
  // same disagreement and leaves its window to MPI_Finalize instead of waiting in
  // MPI_Win_free for a rank that frees another window (a plain barrier would pair them and
  // hang there). Never while an exception unwinds or after a failure either.
  void free_peer_window() noexcept {
    if (peer.win == MPI_WIN_NULL && arena.win == MPI_WIN_NULL) return;
    if (std::uncaught_exceptions() > 0 || !failed.empty() || !orphans.empty()) return;
    // On the heap: a late rank may still complete the reduction after a timeout.
    auto* ids = new long long[2]{window_id, -window_id};
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Iallreduce(MPI_IN_PLACE, ids, 2, MPI_LONG_LONG, MPI_MIN, comm, &req) != MPI_SUCCESS) {
      delete[] ids;
      return;
    }
    const auto timeout = std::max(peer.timeout, arena.timeout);
    const auto deadline = deadline_after(timeout);
    for (unsigned spin = 1;; ++spin) {
      int done = 0;
      if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;  // ids stay: MPI may still write
      if (done) break;
      if (timeout.count() != 0 && spin % 64 == 0 && std::chrono::steady_clock::now() >= deadline) {
        new MPI_Request(req);  // pending: leave it, its buffer and the window to MPI_Finalize
        return;
      }
      if (spin % 64 == 0) std::this_thread::yield();
    }
    const bool same = ids[0] == window_id && -ids[1] == window_id;
    delete[] ids;
    if (!same) return;  // the ranks free different windows: leave this one to MPI_Finalize
    for (MPI_Win* w : {&peer.win, &arena.win}) {
      if (*w == MPI_WIN_NULL) continue;
      MPI_Win_unlock_all(*w);
      MPI_Win_free(w);
    }
  }

  ~mpi_state() {
    int finalized = 0;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;  // MPI freed everything
    if (!orphans.empty() && settle_orphans() != 0) {
      // Still pending: a late rank may write into these buffers at any time. Leave them.
      new std::vector<mpi_orphan>(std::move(orphans));
    }
    free_peer_window();
    if (chunk_comm != MPI_COMM_NULL) MPI_Comm_free(&chunk_comm);
    if (owned && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

}  // namespace epx::detail
