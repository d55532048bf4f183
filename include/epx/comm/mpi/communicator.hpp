// epx/comm/mpi/communicator.hpp: the MPI communicator backend (needs <mpi.h>; not part of epx/epx.hpp).
//
//   int main(int argc, char** argv) {
//     return epx::mpi::run(argc, argv, [](epx::mpi::communicator& world) {
//       auto ep = epx::sub_communicator(world, mesh, epx::group_kind::ep);
//       epx::all_to_allv_rows(ep, ...);
//     });
//   }
//
// `mpirun -np 8 ./example` then runs eight ranks. `run` turns an exception on any rank into
// "epx: rank R failed: <message>" and MPI_Abort, so a failure never leaves the others waiting.
//
// Design notes:
// - The communicator wraps an MPI_Comm and switches it to MPI_ERRORS_RETURN so that every
//   failing call becomes epx::error(errc::mpi). A wrapped user communicator is never freed;
//   communicators made by split() (and the private duplicate used for chunked transfers)
//   are owned and freed with MPI_Comm_free when the last copy goes away
//   (epx/comm/mpi/state.hpp).
// - MPI counts are int. Messages whose counts or displacements exceed `options::max_count`
//   elements travel as point-to-point chunks of at most max_count elements, in rounds, on a
//   private duplicate of the communicator (so no tag can collide with the user's traffic):
//   epx/comm/mpi/transport.hpp.
// - Sums (all_reduce, reduce_scatter) are not MPI_SUM: each rank receives the block it owns
//   from every rank, adds the contributions in rank order in the accumulation type (float for
//   bf16/fp16), multiplies by `scale` and rounds once; all_reduce then gathers the blocks
//   (small all_reduces gather all inputs and every rank sums them, in the same order).
//   The result is bitwise identical on every rank, independent of the MPI library's
//   algorithm choice, and equal to the threads backend's (epx/comm/detail/reduce.hpp).
// - Every collective but split runs as the nonblocking MPI call and waits for it with a
//   watchdog (`options::timeout`, default 10 minutes), so a rank that stalls or leaves turns
//   into an error on the ranks that wait instead of a hang: epx/comm/mpi/wait.hpp.
// - With `options::check_counts` (default on) every collective (barrier, split and the peer
//   access calls too) first agrees, with one small MPI_Allreduce of the same shape on every
//   rank, that all ranks called the same collective with the same datatype and counts; in
//   all_to_allv and the segmented and indexed exchanges the same reduction checks that
//   what each sender sends is what its receiver expects. A disagreement (different
//   collectives included) raises epx::error(errc::communicator) on every rank at once,
//   naming the collectives and ranks or the values: epx/comm/mpi/agreement.hpp.
// - Peer access (access_peers, the layer's direct route): when every rank of the
//   communicator runs on one node, the published buffers are copied into a shared window
//   (MPI_Win_allocate_shared, grow-only, one per communicator) and read there in place by
//   the peers, except those made in peer buffers (peer_buffer: blocks of a pool of shared
//   windows), which are read where they are: epx/comm/mpi/shared.hpp.
//   peer_access_available() says whether that is the case (collective on its first call).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/mpi/agreement.hpp"
#include "epx/comm/mpi/environment.hpp"
#include "epx/comm/mpi/options.hpp"
#include "epx/comm/mpi/shared.hpp"
#include "epx/comm/mpi/state.hpp"
#include "epx/comm/mpi/support.hpp"
#include "epx/comm/mpi/transport.hpp"
#include "epx/comm/mpi/wait.hpp"
#include "epx/core/error.hpp"

namespace epx::mpi {

// A communicator (see epx/comm/communicator.hpp) over an MPI_Comm. Copies share the
// wrapped communicator (shared ownership: an owned MPI_Comm is freed with the last copy;
// skipped if MPI is already finalized). A moved-from communicator may only be assigned to
// or destroyed. One thread at a time per communicator (MPI_THREAD_FUNNELED suffices).
// Every collective is collective over all ranks of the communicator, as in MPI.
class communicator {
 public:
  // The world communicator (MPI_COMM_WORLD). MPI must be initialized.
  communicator() : communicator(MPI_COMM_WORLD) {}

  // Wraps `comm` without taking ownership (the caller frees it, after every copy of this
  // communicator is gone). Sets MPI_ERRORS_RETURN on it. An intracommunicator: an
  // intercommunicator raises errc::input.
  explicit communicator(MPI_Comm comm, options opt = {}) : communicator(comm, false, opt) {}

  static communicator world(options opt = {}) { return communicator(MPI_COMM_WORLD, opt); }

  // Takes ownership of `comm`: MPI_Comm_free runs when the last copy goes away.
  static communicator adopt(MPI_Comm comm, options opt = {}) { return communicator(comm, true, opt); }

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  MPI_Comm native() const noexcept { return s_->comm; }
  const options& opts() const noexcept { return opt_; }
  // Rounds of chunked point-to-point transfers run so far on this communicator (shared by
  // its copies). Diagnostics: shows when the path for counts over max_count was taken.
  std::size_t chunked_rounds() const noexcept { return s_->chunked_rounds; }
  // After a watchdog timeout: why this communicator failed (empty while it works), and how
  // many timed-out calls still wait for a late rank (their buffers are kept until then).
  const std::string& failure() const noexcept { return s_->failed; }
  std::size_t pending_after_timeout() { return s_->settle_orphans(); }
  // Options apply to this copy only; all ranks must use the same options. A max_count
  // outside [1, INT_MAX] or a negative timeout raises errc::configuration (on that rank).
  void set_options(const options& opt) {
    EPX_REQUIRE(opt.max_count >= 1 && opt.max_count <= static_cast<std::size_t>(INT_MAX), errc::configuration,
                "mpi::options::max_count (", opt.max_count, ") must be in [1, ", INT_MAX, "]");
    EPX_REQUIRE(opt.timeout.count() >= 0, errc::configuration, "mpi::options::timeout (", opt.timeout.count(),
                " ms) must not be negative");
    opt_ = opt;
  }

  // Collective: ranks with the same color form one communicator, ordered by (key, rank).
  // Colors must be non-negative; a negative color raises on every rank.
  communicator split(int color, int key) const {
    detail::mpi_enter(*s_, "split");
    // Agreed with or without options::check_counts: a negative color raises on every rank.
    detail::mpi_agree_kind(*s_, opt_, detail::mpi_kind::split,
                           color < 0 ? detail::concat("split: color (", color, ") on rank ", rank(), " must be non-negative")
                                     : std::string());
    // A gate before the blocking split (mpi_buffers::gate: a timeout ends the job).
    EPX_MPI_BOUNDED_KEEP(*s_, opt_, detail::mpi_buffers::gate, nullptr, MPI_Ibarrier(s_->comm, &epx_req_));
    MPI_Comm out = MPI_COMM_NULL;
    EPX_MPI_CHECK(MPI_Comm_split(s_->comm, color, key, &out));
    return communicator(out, true, opt_);
  }

  // With check_counts the agreement's reduction is the barrier.
  void barrier() {
    detail::mpi_enter(*s_, "barrier");
    if (opt_.check_counts) {
      detail::mpi_agree_kind(*s_, opt_, detail::mpi_kind::barrier);
      return;
    }
    EPX_MPI_BOUNDED_KEEP(*s_, opt_, detail::mpi_buffers::own, nullptr, MPI_Ibarrier(s_->comm, &epx_req_));
  }

  // `send` is [size(), count_per_peer]: block p goes to rank p; `recv` likewise by source.
  void all_to_all(const void* send, void* recv, std::size_t count_per_peer, datatype t) {
    detail::mpi_enter(*s_, "all_to_all");
    if (opt_.check_counts) agree_same(detail::mpi_kind::all_to_all, t, count_per_peer);
    all_to_all_unchecked(send, recv, count_per_peer, t);
  }

  // Per-peer counts and displacements in elements. With check_counts, the counts are
  // exchanged first and every rank raises if any sender and receiver disagree.
  void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                   const std::size_t* recv_counts, const std::size_t* recv_displs, datatype t) {
    detail::mpi_enter(*s_, "all_to_allv");
    const int n = size();
    bool large = false;
    for (int p = 0; p < n; ++p) {
      large = large || send_counts[p] > opt_.max_count || recv_counts[p] > opt_.max_count ||
              send_displs[p] > opt_.max_count || recv_displs[p] > opt_.max_count;
    }
    if (!opt_.check_counts) {
      // Without the count exchange no rank knows whether a peer needs chunks, and all must
      // take the same path: point-to-point always works (one round unless over max_count).
      exchange_chunked(send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
      return;
    }
    large = detail::mpi_check_pairs(*s_, opt_, detail::mpi_kind::all_to_allv, send_counts, recv_counts, 1, t, large);
    exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, t, large);
  }

  // Segmented all-to-all (see epx::all_to_allv_segments): arrays are [peers][nseg], in
  // elements; segment i sent to peer q (send_counts[q*nseg+i] at send_displs[q*nseg+i])
  // lands at q's recv_displs[me*nseg+i]. One MPI_Alltoallw with an hindexed datatype per peer
  // (no staging copy, one synchronization instead of nseg); segments over max_count go as
  // nseg rounds of chunked point-to-point transfers instead.
  void all_to_allv_segments(const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
                            void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
                            std::size_t nseg, datatype t) {
    detail::mpi_enter(*s_, "all_to_allv_segments");
    const auto n = static_cast<std::size_t>(size());
    const std::size_t m = n * nseg;
    bool large = nseg > static_cast<std::size_t>(INT_MAX);
    for (std::size_t j = 0; j < m; ++j) large = large || send_counts[j] > opt_.max_count || recv_counts[j] > opt_.max_count;
    large = opt_.check_counts ? detail::mpi_check_pairs(*s_, opt_, detail::mpi_kind::all_to_allv_segments, send_counts,
                                                        recv_counts, nseg, t, large)
                              : detail::mpi_any(*s_, opt_, large);
    if (nseg == 0) return;
    if (large) {
      exchange_segments_chunked(send, send_counts, send_displs, recv, recv_counts, recv_displs, nseg, t);
      return;
    }
    const MPI_Datatype mt = detail::mpi_type(t);
    const auto es = static_cast<MPI_Aint>(size_of(t));
    detail::mpi_type_list types(2 * n);  // [send types by peer, recv types by peer], freed on scope exit
    std::vector<int> len(nseg), ones(n, 1), zeros(n, 0);
    std::vector<MPI_Aint> disp(nseg);
    for (std::size_t k = 0; k < 2 * n; ++k) {
      const std::size_t p = k % n;
      const std::size_t* c = k < n ? send_counts : recv_counts;
      const std::size_t* d = k < n ? send_displs : recv_displs;
      for (std::size_t i = 0; i < nseg; ++i) {
        len[i] = static_cast<int>(c[p * nseg + i]);
        disp[i] = static_cast<MPI_Aint>(d[p * nseg + i]) * es;
      }
      EPX_MPI_CHECK(MPI_Type_create_hindexed(static_cast<int>(nseg), len.data(), disp.data(), mt, &types[k]));
      EPX_MPI_CHECK(MPI_Type_commit(&types[k]));
    }
    EPX_MPI_BOUNDED(MPI_Ialltoallw(send, ones.data(), zeros.data(), types.data(), recv, ones.data(), zeros.data(),
                                types.data() + n, s_->comm, &epx_req_));
  }

  // Segmented all-to-all of rows picked by index (see epx::all_to_allv_indexed): arrays
  // are [peers][nseg], in rows of row_elems elements; segment i to peer q is the rows
  // src + rows[j] * row_elems for j in [send_displs[q*nseg+i], + send_counts[q*nseg+i]),
  // landing as one block at q's recv_displs[me*nseg+i]. One MPI_Alltoallw whose send
  // datatype per peer lists that peer's rows (MPI packs them as it sends: no send buffer
  // of the caller's); transfers over max_count are gathered into send order first and go
  // the chunked way of all_to_allv_segments.
  void all_to_allv_indexed(const void* src, const std::int64_t* rows, std::size_t row_elems,
                           const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                           const std::size_t* recv_counts, const std::size_t* recv_displs, std::size_t nseg,
                           datatype t) {
    detail::mpi_enter(*s_, "all_to_allv_indexed");
    // Raised on every rank by the count check's first agreement (or here, without the check).
    const std::string bad_rows =
        row_elems == 0 ? detail::concat("all_to_allv_indexed: row_elems must be positive (rank ", rank(), ")")
                       : std::string();
    EPX_REQUIRE(opt_.check_counts || bad_rows.empty(), errc::input, bad_rows);
    const auto n = static_cast<std::size_t>(size());
    const std::size_t m = n * nseg;
    // The checks and the path in elements, as all_to_allv_segments takes them.
    std::vector<std::size_t> v(4 * m);
    std::size_t *sc = v.data(), *sd = sc + m, *rc = sd + m, *rd = rc + m;
    bool large = nseg > static_cast<std::size_t>(INT_MAX) || row_elems > opt_.max_count;
    std::size_t sent = 0;
    for (std::size_t p = 0; p < n; ++p) {
      std::size_t to_p = 0;
      for (std::size_t i = 0; i < nseg; ++i) {
        const std::size_t j = p * nseg + i;
        sc[j] = send_counts[j] * row_elems;
        sd[j] = sent * row_elems;  // where the segment sits once gathered (the large path)
        rc[j] = recv_counts[j] * row_elems;
        rd[j] = recv_displs[j] * row_elems;
        sent += send_counts[j];
        to_p += send_counts[j];
        large = large || sc[j] > opt_.max_count || rc[j] > opt_.max_count;
      }
      large = large || to_p > static_cast<std::size_t>(INT_MAX);
    }
    // Counts in elements (rows times row_elems), checked as the segmented exchange checks them.
    large = opt_.check_counts
                ? detail::mpi_check_pairs(*s_, opt_, detail::mpi_kind::all_to_allv_indexed, sc, rc, nseg, t, large,
                                          row_elems, bad_rows)
                : detail::mpi_any(*s_, opt_, large);
    if (nseg == 0) return;
    const std::size_t row_bytes = row_elems * size_of(t);
    if (large) {
      std::vector<unsigned char> send(sent * row_bytes);
      detail::gather_indexed_rows(src, rows, row_bytes, send_counts, send_displs, m, send.data());
      exchange_segments_chunked(send.data(), sc, sd, recv, rc, rd, nseg, t);
      return;
    }
    const MPI_Datatype mt = detail::mpi_type(t);
    // [send types by peer, recv types by peer, the row type], freed on scope exit
    detail::mpi_type_list types(2 * n + 1);
    MPI_Datatype& row = types[2 * n];
    EPX_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(row_elems), mt, &row));
    EPX_MPI_CHECK(MPI_Type_commit(&row));
    std::vector<MPI_Aint> disp;
    std::vector<int> len(nseg), ones(n, 1), zeros(n, 0);
    for (std::size_t p = 0; p < n; ++p) {
      disp.clear();
      for (std::size_t i = 0; i < nseg; ++i) {
        const std::size_t j = p * nseg + i;
        for (std::size_t r = 0; r < send_counts[j]; ++r)
          disp.push_back(static_cast<MPI_Aint>(rows[send_displs[j] + r]) * static_cast<MPI_Aint>(row_bytes));
      }
      EPX_MPI_CHECK(MPI_Type_create_hindexed_block(static_cast<int>(disp.size()), 1, disp.data(), row, &types[p]));
      EPX_MPI_CHECK(MPI_Type_commit(&types[p]));
      disp.resize(nseg);
      for (std::size_t i = 0; i < nseg; ++i) {
        len[i] = static_cast<int>(rc[p * nseg + i]);
        disp[i] = static_cast<MPI_Aint>(recv_displs[p * nseg + i] * row_bytes);
      }
      EPX_MPI_CHECK(MPI_Type_create_hindexed(static_cast<int>(nseg), len.data(), disp.data(), mt, &types[n + p]));
      EPX_MPI_CHECK(MPI_Type_commit(&types[n + p]));
    }
    EPX_MPI_BOUNDED(MPI_Ialltoallw(src, ones.data(), zeros.data(), types.data(), recv, ones.data(), zeros.data(),
                                types.data() + n, s_->comm, &epx_req_));
  }

  // recv = scale * sum over ranks of send (send == recv allowed); bitwise equal on all ranks.
  void all_reduce(const void* send, void* recv, std::size_t count, datatype t, double scale) {
    detail::mpi_enter(*s_, "all_reduce");
    if (opt_.check_counts) agree_same(detail::mpi_kind::all_reduce, t, count, 0, reducible_error("all_reduce", t));
    else require_reducible("all_reduce", t);
    const auto n = static_cast<std::size_t>(size());
    const auto me = static_cast<std::size_t>(rank());
    const std::size_t es = size_of(t);
    if (count <= opt_.max_count && n * count * es <= opt_.all_reduce_gather_bytes) {
      // [n, count] every rank's input, this rank's copied in first: the gather touches only
      // this buffer, so a watchdog timeout can raise and keep it (epx/comm/mpi/wait.hpp).
      std::vector<unsigned char> all(n * count * es);
      if (count != 0) std::memcpy(all.data() + me * count * es, send, count * es);
      const MPI_Datatype mt = detail::mpi_type(t);
      detail::mpi_keep keep(all);
      EPX_MPI_BOUNDED_KEEP(*s_, opt_, detail::mpi_buffers::own, &keep,
                           MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all.data(), static_cast<int>(count),
                                          mt, s_->comm, &epx_req_));
      detail::mpi_reduce_blocks(all.data(), size(), count, recv, t, scale);
      return;
    }
    // Block p of the data, [start_p, start_p + len_p), is summed by rank p.
    const std::size_t base = count / n, rem = count % n;
    auto len = [&](std::size_t p) { return base + (p < rem ? 1 : 0); };
    auto start = [&](std::size_t p) { return p * base + std::min(p, rem); };
    const std::size_t mine = len(me);
    // Displacements reach at most (n - 1) * (base + 1) <= count + n.
    const bool large = count + n > opt_.max_count;
    std::vector<std::size_t> v(4 * n);
    for (std::size_t p = 0; p < n; ++p) {
      v[p] = len(p);            // send counts: my copy of block p to rank p
      v[n + p] = start(p);
      v[2 * n + p] = mine;      // recv counts: every rank's copy of my block
      v[3 * n + p] = p * mine;
    }
    std::vector<unsigned char> parts(n * mine * es);  // [n, mine] contributions to my block
    std::vector<unsigned char> sum(mine * es);        // [mine] my reduced block
    exchange(send, v.data(), v.data() + n, parts.data(), v.data() + 2 * n, v.data() + 3 * n, t, large);
    detail::mpi_reduce_blocks(parts.data(), size(), mine, sum.data(), t, scale);
    // Gather the reduced blocks: everyone gets block p from rank p.
    for (std::size_t p = 0; p < n; ++p) {
      v[p] = mine;
      v[n + p] = 0;
      v[2 * n + p] = len(p);
      v[3 * n + p] = start(p);
    }
    exchange(sum.data(), v.data(), v.data() + n, recv, v.data() + 2 * n, v.data() + 3 * n, t, large);
  }

  // `send` is [size(), recv_count]; block r, summed over ranks and scaled, lands on rank r.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, datatype t, double scale) {
    detail::mpi_enter(*s_, "reduce_scatter");
    if (opt_.check_counts) agree_same(detail::mpi_kind::reduce_scatter, t, recv_count, 0, reducible_error("reduce_scatter", t));
    else require_reducible("reduce_scatter", t);
    const auto n = static_cast<std::size_t>(size());
    std::vector<unsigned char> parts(n * recv_count * size_of(t));  // [n, recv_count] by source rank
    all_to_all_unchecked(send, parts.data(), recv_count, t);
    detail::mpi_reduce_blocks(parts.data(), size(), recv_count, recv, t, scale);
  }

  // `recv` is [size(), count]: block r holds rank r's `send`.
  void all_gather(const void* send, void* recv, std::size_t count, datatype t) {
    detail::mpi_enter(*s_, "all_gather");
    if (opt_.check_counts) agree_same(detail::mpi_kind::all_gather, t, count);
    if (count <= opt_.max_count) {
      const MPI_Datatype mt = detail::mpi_type(t);
      EPX_MPI_BOUNDED(MPI_Iallgather(send, static_cast<int>(count), mt, recv, static_cast<int>(count), mt, s_->comm, &epx_req_));
      return;
    }
    const auto n = static_cast<std::size_t>(size());
    std::vector<std::size_t> v(3 * n);
    for (std::size_t p = 0; p < n; ++p) {
      v[p] = count;
      v[n + p] = 0;
      v[2 * n + p] = p * count;
    }
    exchange_chunked(send, v.data(), v.data() + n, recv, v.data(), v.data() + 2 * n, t);
  }

  void broadcast(void* data, std::size_t count, datatype t, int root) {
    detail::mpi_enter(*s_, "broadcast");
    std::string bad;
    if (root < 0 || root >= size())
      bad = detail::concat("broadcast: root (", root, ") on rank ", rank(), " out of range [0, ", size(), ")");
    if (opt_.check_counts) agree_same(detail::mpi_kind::broadcast, t, count, root, bad);
    else EPX_REQUIRE(bad.empty(), errc::input, bad);
    const MPI_Datatype mt = detail::mpi_type(t);
    auto* p = static_cast<unsigned char*>(data);
    for (std::size_t off = 0; off < count; off += opt_.max_count) {
      const std::size_t c = std::min(opt_.max_count, count - off);
      EPX_MPI_BOUNDED(MPI_Ibcast(p + off * size_of(t), static_cast<int>(c), mt, root, s_->comm, &epx_req_));
    }
  }

  // Whether the ranks can read each other's memory: every rank of this communicator runs on
  // one node (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)) and options::shared_memory is on.
  // Collective on the first call on a communicator (and its copies): every rank must make
  // it; later calls return the kept answer, the same on every rank.
  bool peer_access_available() {
    detail::mpi_enter(*s_, "peer_access_available");
    // The collective first call agrees like any other collective.
    if (opt_.check_counts && opt_.shared_memory && s_->peer.available < 0)
      detail::mpi_agree_kind(*s_, opt_, detail::mpi_kind::peer_access_available);
    return detail::mpi_peer_access_available(*s_, opt_);
  }

  // Peer access (see epx::has_peer_access_v), when peer_access_available(). Collective:
  // every rank publishes `count` buffers (mine[i], bytes[i] bytes each; at most 16), which
  // are copied into its segment of the communicator's shared window; once every rank has
  // published, f(peers) runs, where peers(r, i) is rank r's copy of its buffer i (this
  // rank's too). The copies are read-only to the peers and stay valid until every rank's
  // f has returned: nobody leaves before that. If f throws on one rank, that rank still
  // waits for the others' f, then rethrows; the others carry on. Ranks that pass
  // different counts, or a null buffer with bytes, all fail with the values. Every wait is
  // bounded by the watchdog (options::timeout).
  class peer_pointers {
   public:
    const void* operator()(int r, std::size_t i) const noexcept {
      const std::uint64_t off = rec_[static_cast<std::size_t>(r) * detail::mpi_peer_record + 4 + i];
      if (off & detail::mpi_peer_in_pool) return detail::mpi_pool_address(*pool_, r, off);
      return base_[r] + off;
    }
    int size() const noexcept { return n_; }

   private:
    friend class communicator;
    peer_pointers(char* const* base, const detail::mpi_peer_pool* pool, const std::uint64_t* rec, int n) noexcept
        : base_(base), pool_(pool), rec_(rec), n_(n) {}
    char* const* base_;
    const detail::mpi_peer_pool* pool_;
    const std::uint64_t* rec_;
    int n_;
  };

  // A peer buffer: `bytes` of this rank's memory that the peers can map (a block of a pool
  // of shared windows), held until the last copy of the pointer dies, which may outlive
  // the communicator (the memory then lasts as long as the communicator's copies). A
  // buffer published through access_peers that lies in it is read there by the peers,
  // without the copy. Collective: every rank asks for its own size (0: a null pointer);
  // a block handed back is handed out again, and a new window is made only when some rank
  // has no free block that fits. At most 64 windows: past them a rank without a free block
  // gets a null pointer (its buffers are then published by copy). Needs
  // peer_access_available().
  std::shared_ptr<void> peer_buffer(std::size_t bytes) {
    enter_peer_call("peer_buffer", detail::mpi_kind::peer_buffer);
    return detail::mpi_peer_buffer(*s_, opt_, bytes);
  }

  // Peer memory: a peer buffer of `bytes` held by the communicator until the next
  // peer_memory call on it or its copies (which may hand out the same block again); null
  // when the pool has no block for it.
  void* peer_memory(std::size_t bytes) {
    enter_peer_call("peer_memory", detail::mpi_kind::peer_memory);
    s_->arena.reset();
    s_->arena = detail::mpi_peer_buffer(*s_, opt_, bytes);
    return s_->arena.get();
  }

  template <class F>
  void access_peers(const void* const* mine, const std::size_t* bytes, std::size_t count, F&& f) {
    enter_peer_call("access_peers", detail::mpi_kind::access_peers);
    auto& w = s_->peer;
    const auto n = static_cast<std::size_t>(size());
    constexpr std::size_t L = detail::mpi_peer_record;
    std::vector<std::uint64_t> rec(n * L, 0);
    std::uint64_t* my = rec.data() + static_cast<std::size_t>(rank()) * L;
    // Local checks travel in the record (code, detail), so every rank names the same values.
    std::uint64_t code = 0, what = 0, need = 0;
    if (count > detail::mpi_max_peer_buffers) {
      code = 1;
    } else if (count != 0 && (mine == nullptr || bytes == nullptr)) {
      code = 2;
    } else {
      for (std::size_t i = 0; i < count && code == 0; ++i) {
        if (mine[i] == nullptr && bytes[i] != 0) {
          code = 3;
          what = i;
        } else if (detail::mpi_in_pool(*s_, mine[i], bytes[i], my[4 + i])) {
          // made in a peer buffer: published where it is
        } else {
          my[4 + i] = need;
          need += detail::mpi_peer_round(bytes[i]);
        }
      }
    }
    my[0] = code;
    my[1] = count;
    my[2] = need;
    my[3] = what;
    // Publishing: when the buffers fit, copy them in before the gather (the gather is then
    // the barrier that makes them visible).
    const bool early = code == 0 && w.win != MPI_WIN_NULL && need <= w.capacity;
    if (early) detail::mpi_peer_copy_in(*s_, mine, bytes, count, my);
    {
      detail::mpi_keep keep(rec);
      EPX_MPI_BOUNDED_IDLE(*s_, opt_, &keep,
                           MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, rec.data(), static_cast<int>(L),
                                          MPI_UINT64_T, s_->comm, &epx_req_));
    }
    check_peer_records(rec);
    std::uint64_t most = 0;
    for (std::size_t r = 0; r < n; ++r) most = std::max(most, rec[r * L + 2]);
    if (most > w.capacity || w.win == MPI_WIN_NULL) {
      // Some rank's buffers do not fit: every rank takes part in the new window, copies its
      // buffers in, and waits for the others to have done so.
      detail::mpi_peer_grow(*s_, opt_, w, static_cast<std::size_t>(most));
      detail::mpi_peer_copy_in(*s_, mine, bytes, count, rec.data() + static_cast<std::size_t>(rank()) * L);
      EPX_MPI_BOUNDED_KEEP(*s_, opt_, detail::mpi_buffers::own, nullptr, MPI_Ibarrier(s_->comm, &epx_req_));
    }
    detail::mpi_sync_windows(*s_);
    std::exception_ptr failure;
    try {
      const peer_pointers peers(w.base.data(), s_->pool.get(), rec.data(), size());
      f(peers);
    } catch (...) {
      failure = std::current_exception();
    }
    // Exit barrier: nobody rewrites its segment while a peer still reads it.
    s_->op = "access_peers";
    EPX_MPI_BOUNDED_IDLE(*s_, opt_, nullptr, MPI_Ibarrier(s_->comm, &epx_req_));
    if (failure) std::rethrow_exception(failure);
  }

 private:
  // The opening of every peer access call: the entry, the agreement on the call, and the
  // check that every rank shares this node (errc::configuration on every rank otherwise).
  void enter_peer_call(const char* name, detail::mpi_kind kind) {
    detail::mpi_enter(*s_, name);
    if (opt_.check_counts && opt_.shared_memory) detail::mpi_agree_kind(*s_, opt_, kind);
    EPX_REQUIRE(detail::mpi_peer_access_available(*s_, opt_), errc::configuration, name,
                ": the ranks of this MPI communicator (", size(),
                ") do not all share one node, or options::shared_memory is off: no peer access");
  }

  // After the access_peers gather: raises on every rank, with the same message, when a rank
  // passed bad arguments or the counts differ.
  void check_peer_records(const std::vector<std::uint64_t>& rec) const {
    constexpr std::size_t L = detail::mpi_peer_record;
    const int n = size();
    for (int r = 0; r < n; ++r) {
      const std::uint64_t* q = rec.data() + static_cast<std::size_t>(r) * L;
      EPX_REQUIRE(q[0] != 1, errc::input, "access_peers: rank ", r, " passed ", q[1], " buffers; at most ",
                  detail::mpi_max_peer_buffers, " on the MPI backend");
      EPX_REQUIRE(q[0] != 2, errc::input, "access_peers: rank ", r, " passed ", q[1],
                  " buffers with a null pointer or byte list");
      EPX_REQUIRE(q[0] != 3, errc::input, "access_peers: rank ", r, ": buffer ", q[3], " is null but holds bytes");
    }
    std::string differ;
    for (int r = 1; r < n; ++r)
      if (rec[static_cast<std::size_t>(r) * L + 1] != rec[1])
        differ += detail::concat(", rank ", r, " passed ", rec[static_cast<std::size_t>(r) * L + 1]);
    EPX_REQUIRE(differ.empty(), errc::communicator, "access_peers: mismatched counts: rank 0 passed ", rec[1], differ);
  }

  void all_to_all_unchecked(const void* send, void* recv, std::size_t count_per_peer, datatype t) {
    if (count_per_peer <= opt_.max_count) {
      EPX_MPI_BOUNDED(MPI_Ialltoall(send, static_cast<int>(count_per_peer), detail::mpi_type(t), recv,
                                 static_cast<int>(count_per_peer), detail::mpi_type(t), s_->comm, &epx_req_));
      return;
    }
    const auto n = static_cast<std::size_t>(size());
    std::vector<std::size_t> v(2 * n);
    for (std::size_t p = 0; p < n; ++p) {
      v[p] = count_per_peer;
      v[n + p] = p * count_per_peer;
    }
    exchange_chunked(send, v.data(), v.data() + n, recv, v.data(), v.data() + n, t);
  }

  // Shared by the copies (epx/comm/mpi/state.hpp).
  using state = detail::mpi_state;

  communicator(MPI_Comm comm, bool owned, options opt) : s_(std::make_shared<state>()) {
    int initialized = 0;
    EPX_MPI_CHECK(MPI_Initialized(&initialized));
    EPX_REQUIRE(initialized, errc::mpi,
                "mpi::communicator: MPI is not initialized (create an epx::mpi::environment or call "
                "MPI_Init_thread first)");
    int finalized = 0;
    EPX_MPI_CHECK(MPI_Finalized(&finalized));
    EPX_REQUIRE(!finalized, errc::mpi, "mpi::communicator: MPI was finalized already (no MPI call may follow)");
    EPX_REQUIRE(comm != MPI_COMM_NULL, errc::input, "mpi::communicator: MPI_COMM_NULL cannot be wrapped");
    int inter = 0;
    EPX_MPI_CHECK(MPI_Comm_test_inter(comm, &inter));
    EPX_REQUIRE(!inter, errc::input,
                "mpi::communicator: an intercommunicator cannot be wrapped (its collectives pair two groups, "
                "not the ranks of one); merge it first (MPI_Intercomm_merge)");
    s_->comm = comm;
    s_->owned = owned;  // from here on, the state frees an owned communicator even if we throw
    EPX_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    EPX_MPI_CHECK(MPI_Comm_rank(comm, &s_->rank));
    EPX_MPI_CHECK(MPI_Comm_size(comm, &s_->size));
    EPX_MPI_CHECK(MPI_Query_thread(&s_->thread_level));
    set_options(opt);
  }

  static std::string reducible_error(const char* op, datatype t) {
    if (is_reducible(t)) return std::string();
    return detail::concat(op, ": datatype ", to_string(t),
                          " cannot be summed (use int32, int64, float32, float64, bfloat16 or float16)");
  }
  static void require_reducible(const char* op, datatype t) {
    const std::string e = reducible_error(op, t);
    EPX_REQUIRE(e.empty(), errc::input, e);
  }

  // The agreement (epx/comm/mpi/agreement.hpp), on this communicator.
  void agree_same(detail::mpi_kind kind, datatype t, std::size_t count, int root = 0,
                  const std::string& local_error = std::string()) const {
    detail::mpi_agree_same(*s_, opt_, kind, t, count, root, local_error);
  }

  // The transport (epx/comm/mpi/transport.hpp), on this communicator.
  void exchange(const void* send, const std::size_t* sc, const std::size_t* sd, void* recv, const std::size_t* rc,
                const std::size_t* rd, datatype t, bool large) {
    detail::mpi_exchange(*s_, opt_, send, sc, sd, recv, rc, rd, t, large);
  }
  // A segmented exchange as nseg rounds of chunked point-to-point transfers (arrays
  // [peers][nseg], in elements): the path of transfers over max_count.
  void exchange_segments_chunked(const void* send, const std::size_t* sc, const std::size_t* sd, void* recv,
                                 const std::size_t* rc, const std::size_t* rd, std::size_t nseg, datatype t) {
    const auto n = static_cast<std::size_t>(size());
    std::vector<std::size_t> v(4 * n);
    for (std::size_t i = 0; i < nseg; ++i) {
      for (std::size_t p = 0; p < n; ++p) {
        v[p] = sc[p * nseg + i];
        v[n + p] = sd[p * nseg + i];
        v[2 * n + p] = rc[p * nseg + i];
        v[3 * n + p] = rd[p * nseg + i];
      }
      exchange_chunked(send, v.data(), v.data() + n, recv, v.data() + 2 * n, v.data() + 3 * n, t);
    }
  }

  void exchange_chunked(const void* send, const std::size_t* sc, const std::size_t* sd, void* recv,
                        const std::size_t* rc, const std::size_t* rd, datatype t) {
    detail::mpi_exchange_chunked(*s_, opt_, send, sc, sd, recv, rc, rd, t);
  }

  std::shared_ptr<state> s_;
  options opt_;
};

static_assert(check_communicator<communicator>(), "epx::mpi::communicator must satisfy the communicator concept");

}  // namespace epx::mpi
