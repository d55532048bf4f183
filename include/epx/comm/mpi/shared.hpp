// epx/comm/mpi/shared.hpp: peer access of the MPI backend through MPI-3 shared memory (needs
// <mpi.h>).
//
// When every rank of a communicator runs on one node (MPI_Comm_split_type with
// MPI_COMM_TYPE_SHARED gives back all of them), the ranks can read each other's memory the
// way the threads backend's ranks do, provided the memory lies in a shared window. The
// communicator keeps one window (MPI_Win_allocate_shared), made on the first access_peers
// and grown (never shrunk) when a call publishes more bytes than a rank's segment holds.
// access_peers copies each rank's published buffers into its own segment, then every rank
// reads the peers' copies in place. The copy is one pass over the published bytes (the
// route's extra traffic on MPI); nothing else moves. Buffers the caller made in the peer
// memory (communicator::peer_memory: a second grow-only window, `arena`) are published
// where they are, without a copy.
//
// Every wait is bounded by the watchdog (options::timeout): the blocking MPI calls
// (MPI_Comm_split_type, MPI_Win_allocate_shared, MPI_Win_free) run only right after a
// nonblocking barrier, gather or reduction that every rank has passed, so none of them can
// wait for a rank that is not there; MPI_Win_free only once that reduction, and every rank's
// verdict on it, show every rank freeing the same window (mpi_state::free_peer_window).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "epx/comm/mpi/options.hpp"
#include "epx/comm/mpi/state.hpp"
#include "epx/comm/mpi/support.hpp"
#include "epx/comm/mpi/wait.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/stream.hpp"

namespace epx::detail {

// Most buffers one access_peers call publishes on the MPI backend.
inline constexpr std::size_t mpi_max_peer_buffers = 16;
// One rank's record in the access_peers gather: [error code, count, bytes needed, detail,
// offset of buffer i in the segment...].
inline constexpr std::size_t mpi_peer_record = 4 + mpi_max_peer_buffers;
// Buffers start on this boundary in a segment.
inline constexpr std::size_t mpi_peer_align = 256;

inline std::size_t mpi_peer_round(std::size_t bytes) noexcept {
  return (bytes + mpi_peer_align - 1) / mpi_peer_align * mpi_peer_align;
}

// Whether every rank of s.comm shares this node; collective, once per communicator (the
// result is kept in the state its copies share).
inline bool mpi_peer_access_available(mpi_state& s, const mpi::options& opt) {
  if (!opt.shared_memory) return false;
  if (s.peer.available < 0) {
    // Everyone is here before the blocking split (the watchdog bounds the barrier; a
    // timeout ends the job, see mpi_buffers::gate).
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::gate, nullptr, MPI_Ibarrier(s.comm, &epx_req_));
    MPI_Comm node = MPI_COMM_NULL;
    EPX_MPI_CHECK(MPI_Comm_split_type(s.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    int n = 0;
    const int rc = MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
    EPX_MPI_CHECK(rc);
    s.peer.available = n == s.size ? 1 : 0;
  }
  return s.peer.available == 1;
}

// Replaces the window by one whose segments hold at least `need` bytes (the same on every
// rank). Collective. A bounded barrier first (a gate: a timeout ends the job): a rank that
// timed out in the gather before it and raised has left that gather pending, which a late
// rank's gather matches; the late rank must not go on into the blocking calls below.
inline void mpi_peer_grow(mpi_state& s, const mpi::options& opt, mpi_peer_window& w, std::size_t need) {
  EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::gate, nullptr, MPI_Ibarrier(s.comm, &epx_req_));
  if (s.window_id == 0) s.window_id = mpi_next_window_id(s.comm);  // collective order: the same on every rank
  if (s.chunk_comm == MPI_COMM_NULL) {
    // The private duplicate that the window's free sends its verdicts on (mpi_state::
    // free_peer_window; also that of the chunked transfers): every rank is past the gate.
    EPX_MPI_CHECK(MPI_Comm_dup(s.comm, &s.chunk_comm));
    EPX_MPI_CHECK(MPI_Comm_set_errhandler(s.chunk_comm, MPI_ERRORS_RETURN));
  }
  const std::size_t old = w.capacity;
  if (w.win != MPI_WIN_NULL) {
    MPI_Win_unlock_all(w.win);
    EPX_MPI_CHECK(MPI_Win_free(&w.win));
    w.capacity = 0;
  }
  // Grow by half at least, in whole 2 MiB pieces, so that slowly growing calls do not
  // reallocate every time.
  constexpr std::size_t piece = std::size_t{2} << 20;
  const std::size_t want = std::max({need, old + old / 2, std::size_t{1}});
  const std::size_t cap = (want + piece - 1) / piece * piece;
  MPI_Info info = MPI_INFO_NULL;
  EPX_MPI_CHECK(MPI_Info_create(&info));
  MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each segment on its own pages
  void* mine = nullptr;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(cap), 1, info, s.comm, &mine, &w.win);
  MPI_Info_free(&info);
  EPX_MPI_CHECK(rc);
  MPI_Win_set_errhandler(w.win, MPI_ERRORS_RETURN);
  w.base.assign(static_cast<std::size_t>(s.size), nullptr);
  for (int r = 0; r < s.size; ++r) {
    MPI_Aint bytes = 0;
    int unit = 0;
    void* p = nullptr;
    EPX_MPI_CHECK(MPI_Win_shared_query(w.win, r, &bytes, &unit, &p));
    w.base[static_cast<std::size_t>(r)] = static_cast<char*>(p);
  }
  EPX_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, w.win));
  w.capacity = cap;
  w.timeout = opt.timeout;
}

// An offset in a record with this bit set lies in the rank's segment of the peer memory
// (mpi_state::arena), not in the copy window.
inline constexpr std::uint64_t mpi_peer_in_arena = std::uint64_t{1} << 63;

// Where buffer i of a record lies: its offset in the arena, or in the copy window.
inline bool mpi_in_arena(const mpi_state& s, const void* p, std::size_t bytes, std::uint64_t& offset) noexcept {
  if (s.arena.win == MPI_WIN_NULL || p == nullptr) return false;
  const char* a = s.arena.base[static_cast<std::size_t>(s.rank)];
  const char* q = static_cast<const char*>(p);
  if (q < a || q > a + s.arena.capacity || bytes > static_cast<std::size_t>(a + s.arena.capacity - q)) return false;
  offset = static_cast<std::uint64_t>(q - a) | mpi_peer_in_arena;
  return true;
}

// Copies this rank's published buffers into its segment at the offsets of its record
// (those already in the peer memory stay where they are); around the caches when they
// come to exec::stream_threshold() bytes (epx/exec/stream.hpp: the peers read them, not
// this rank).
inline void mpi_peer_copy_in(mpi_state& s, const void* const* mine, const std::size_t* bytes, std::size_t count,
                             const std::uint64_t* record) {
  char* seg = s.peer.base[static_cast<std::size_t>(s.rank)];
  std::size_t total = 0;
  for (std::size_t i = 0; i < count; ++i)
    if ((record[4 + i] & mpi_peer_in_arena) == 0) total += bytes[i];
  const bool stream = exec::streams(total);
  for (std::size_t i = 0; i < count; ++i) {
    if (bytes[i] == 0 || (record[4 + i] & mpi_peer_in_arena) != 0) continue;
    if (stream)
      exec::stream_copy(seg + record[4 + i], mine[i], bytes[i]);
    else
      std::memcpy(seg + record[4 + i], mine[i], bytes[i]);
  }
  if (stream) exec::stream_fence();
  MPI_Win_sync(s.peer.win);
  if (s.arena.win != MPI_WIN_NULL) MPI_Win_sync(s.arena.win);
}

// Peer memory (communicator::peer_memory): this rank's `bytes` of the arena window, grown
// (collectively, never shrunk) when some rank asks for more than a segment holds.
// `agreed`: `bytes` is already the largest size over the ranks (the agreement found it).
inline void* mpi_peer_memory(mpi_state& s, const mpi::options& opt, std::size_t bytes, bool agreed = false) {
  std::vector<unsigned long long> most(1, static_cast<unsigned long long>(bytes));
  if (!agreed) {
    mpi_keep keep(most);
    EPX_MPI_BOUNDED_IDLE(s, opt, &keep,
                         MPI_Iallreduce(MPI_IN_PLACE, most.data(), 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, s.comm, &epx_req_));
  }
  if (s.arena.win == MPI_WIN_NULL || most[0] > s.arena.capacity)
    mpi_peer_grow(s, opt, s.arena, static_cast<std::size_t>(most[0]));
  return s.arena.base[static_cast<std::size_t>(s.rank)];
}

}  // namespace epx::detail
