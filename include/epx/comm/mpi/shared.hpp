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
// route's extra traffic on MPI); nothing else moves. Buffers made in peer buffers
// (communicator::peer_buffer: a pool of windows, one block per rank in each) are
// published where they are, without a copy.
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
#include <memory>
#include <mutex>
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

// Before the blocking window calls: a bounded barrier (a gate: a timeout ends the job): a
// rank that timed out in the gather before it and raised has left that gather pending,
// which a late rank's gather matches; the late rank must not go on into the blocking calls
// after it. The state's window number and private duplicate are made with its first window.
inline void mpi_window_gate(mpi_state& s, const mpi::options& opt) {
  EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::gate, nullptr, MPI_Ibarrier(s.comm, &epx_req_));
  if (s.window_id == 0) s.window_id = mpi_next_window_id(s.comm);  // collective order: the same on every rank
  if (s.chunk_comm == MPI_COMM_NULL) {
    // The private duplicate that the window's free sends its verdicts on (mpi_state::
    // free_peer_window; also that of the chunked transfers): every rank is past the gate.
    EPX_MPI_CHECK(MPI_Comm_dup(s.comm, &s.chunk_comm));
    EPX_MPI_CHECK(MPI_Comm_set_errhandler(s.chunk_comm, MPI_ERRORS_RETURN));
  }
}

// A shared window whose segment here has `bytes` (the ranks' sizes may differ), locked for
// MPI_Win_sync; base[r] is rank r's segment mapped here. Collective, after the gate.
inline MPI_Win mpi_make_window(const mpi_state& s, std::size_t bytes, std::vector<char*>& base) {
  MPI_Info info = MPI_INFO_NULL;
  EPX_MPI_CHECK(MPI_Info_create(&info));
  MPI_Info_set(info, "alloc_shared_noncontig", "true");  // each segment on its own pages
  void* mine = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, s.comm, &mine, &win);
  MPI_Info_free(&info);
  EPX_MPI_CHECK(rc);
  MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
  base.assign(static_cast<std::size_t>(s.size), nullptr);
  for (int r = 0; r < s.size; ++r) {
    MPI_Aint got = 0;
    int unit = 0;
    void* p = nullptr;
    EPX_MPI_CHECK(MPI_Win_shared_query(win, r, &got, &unit, &p));
    base[static_cast<std::size_t>(r)] = static_cast<char*>(p);
  }
  EPX_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win));
  return win;
}

// Replaces the window by one whose segments hold at least `need` bytes (the same on every
// rank). Collective.
inline void mpi_peer_grow(mpi_state& s, const mpi::options& opt, mpi_peer_window& w, std::size_t need) {
  mpi_window_gate(s, opt);
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
  w.win = mpi_make_window(s, cap, w.base);
  w.capacity = cap;
  w.timeout = opt.timeout;
}

// An offset in a record with this bit set lies in the rank's block of peer-buffer window
// (offset >> mpi_pool_shift) & 63, at offset & mpi_pool_offset (mpi_state::pool), not in
// the copy window.
inline constexpr std::uint64_t mpi_peer_in_pool = std::uint64_t{1} << 63;
inline constexpr int mpi_pool_shift = 56;
inline constexpr std::uint64_t mpi_pool_offset = (std::uint64_t{1} << mpi_pool_shift) - 1;

// Whether `bytes` at p lie in one of this rank's peer buffers; if so, their record offset.
// (The slots change only in mpi_peer_buffer, on the communicator's own thread.)
inline bool mpi_in_pool(const mpi_state& s, const void* p, std::size_t bytes, std::uint64_t& offset) noexcept {
  if (p == nullptr) return false;
  const char* q = static_cast<const char*>(p);
  const auto& ws = s.pool->windows;
  for (std::size_t w = 0; w < ws.size(); ++w) {
    if (ws[w].win == MPI_WIN_NULL || ws[w].bytes == 0) continue;
    const char* a = ws[w].base[static_cast<std::size_t>(s.rank)];
    if (q < a || q > a + ws[w].bytes || bytes > static_cast<std::size_t>(a + ws[w].bytes - q)) continue;
    offset = static_cast<std::uint64_t>(q - a) | (static_cast<std::uint64_t>(w) << mpi_pool_shift) | mpi_peer_in_pool;
    return true;
  }
  return false;
}

// Rank r's buffer at record offset `off`, which lies in the pool.
inline const char* mpi_pool_address(const mpi_peer_pool& pool, int r, std::uint64_t off) noexcept {
  const auto w = static_cast<std::size_t>((off >> mpi_pool_shift) & (mpi_peer_pool::most_windows - 1));
  return pool.windows[w].base[static_cast<std::size_t>(r)] + (off & mpi_pool_offset);
}

// MPI_Win_sync on every window whose memory the peers read.
inline void mpi_sync_windows(mpi_state& s) {
  if (s.peer.win != MPI_WIN_NULL) MPI_Win_sync(s.peer.win);
  for (auto& w : s.pool->windows)
    if (w.win != MPI_WIN_NULL) MPI_Win_sync(w.win);
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
    if ((record[4 + i] & mpi_peer_in_pool) == 0) total += bytes[i];
  const bool stream = exec::streams(total);
  for (std::size_t i = 0; i < count; ++i) {
    if (bytes[i] == 0 || (record[4 + i] & mpi_peer_in_pool) != 0) continue;
    if (stream)
      exec::stream_copy(seg + record[4 + i], mine[i], bytes[i]);
    else
      std::memcpy(seg + record[4 + i], mine[i], bytes[i]);
  }
  if (stream) exec::stream_fence();
  mpi_sync_windows(s);
}

// A peer buffer (communicator::peer_buffer): `bytes` of this rank's memory in the pool,
// held until the last copy of the pointer dies (null for 0 bytes). Collective: every rank
// asks for its own size. Each rank takes its smallest free block that holds `bytes`; when
// some rank has none, the ranks free the windows that are free on every rank and make one
// more, in which each rank without a block gets one (1/32 larger, for calls whose sizes
// vary a little, in whole 64 KiB) and the others none. So the pool holds about as many
// windows as blocks were in use at once, and at most 64: past that, a rank without a free
// block that fits gets a null pointer.
inline std::shared_ptr<void> mpi_peer_buffer(mpi_state& s, const mpi::options& opt, std::size_t bytes) {
  auto& pool = *s.pool;
  constexpr std::size_t W = mpi_peer_pool::most_windows;
  const auto me = static_cast<std::size_t>(s.rank);
  std::size_t mine = W;  // the slot of this rank's block
  // Per rank: the bytes it lacks (0: it has its block), the mask of its free windows.
  std::vector<unsigned long long> rec(2 * static_cast<std::size_t>(s.size), 0);
  {
    std::lock_guard<std::mutex> lk(pool.m);
    if (pool.windows.size() < W) pool.windows.resize(W);  // once: slots never move
    for (std::size_t w = 0; w < W && bytes > 0; ++w) {
      const auto& x = pool.windows[w];
      if (x.win != MPI_WIN_NULL && !x.busy && x.bytes >= bytes && (mine == W || x.bytes < pool.windows[mine].bytes))
        mine = w;
    }
    if (mine != W) pool.windows[mine].busy = true;
    unsigned long long idle = 0;
    for (std::size_t w = 0; w < W; ++w)
      if (pool.windows[w].win != MPI_WIN_NULL && !pool.windows[w].busy) idle |= 1ull << w;
    rec[2 * me] = bytes > 0 && mine == W ? bytes : 0;
    rec[2 * me + 1] = idle;
  }
  const auto hand_back = [&] {
    if (mine == W) return;
    std::lock_guard<std::mutex> lk(pool.m);
    pool.windows[mine].busy = false;
  };
  try {
    {
      mpi_keep keep(rec);
      EPX_MPI_BOUNDED_IDLE(s, opt, &keep,
                           MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, rec.data(), 2, MPI_UNSIGNED_LONG_LONG,
                                          s.comm, &epx_req_));
    }
    unsigned long long lack = 0, everywhere = ~0ull;
    for (int r = 0; r < s.size; ++r) {
      lack = std::max(lack, rec[2 * static_cast<std::size_t>(r)]);
      everywhere &= rec[2 * static_cast<std::size_t>(r) + 1];
    }
    // The slots are alike on every rank, so every rank finds the same one, or none: then
    // the ranks without a block get none (a null pointer: they publish their own memory,
    // which access_peers copies).
    std::size_t slot = W;
    for (std::size_t w = 0; w < W && slot == W && lack > 0; ++w)
      if (pool.windows[w].win == MPI_WIN_NULL || (everywhere >> w & 1u) != 0) slot = w;
    if (slot != W) {
      mpi_window_gate(s, opt);
      for (std::size_t w = 0; w < W; ++w) {
        auto& x = pool.windows[w];
        if ((everywhere >> w & 1u) == 0 || x.win == MPI_WIN_NULL) continue;
        MPI_Win_unlock_all(x.win);
        EPX_MPI_CHECK(MPI_Win_free(&x.win));
        x.base.clear();
        x.bytes = 0;
      }
      constexpr std::size_t granule = std::size_t{64} << 10;
      const auto lacks = static_cast<std::size_t>(rec[2 * me]);
      const std::size_t want = lacks == 0 ? 0 : (lacks + lacks / 32 + granule - 1) / granule * granule;
      std::vector<char*> base;
      const MPI_Win win = mpi_make_window(s, want, base);
      {
        std::lock_guard<std::mutex> lk(pool.m);
        auto& x = pool.windows[slot];
        x.win = win;
        x.base = std::move(base);
        x.bytes = want;
        x.busy = want > 0;
      }
      pool.timeout = opt.timeout;
      if (want > 0) mine = slot;
    }
  } catch (...) {
    hand_back();
    throw;
  }
  if (mine == W) return nullptr;
  std::weak_ptr<mpi_peer_pool> owner = s.pool;
  return std::shared_ptr<void>(pool.windows[mine].base[me], [owner, mine](void*) {
    if (auto p = owner.lock()) {
      std::lock_guard<std::mutex> lk(p->m);
      p->windows[mine].busy = false;
    }
  });
}

}  // namespace epx::detail
