// epx/comm/threads/communicator.hpp: the in-process communicator: N ranks as N threads of one process.
//
//   epx::threads::run(8, [](epx::threads::communicator& comm) {
//     auto tp = epx::sub_communicator(comm, mesh, epx::group_kind::tp);
//     epx::all_reduce(tp, epx::span<float>(grad), 0.5);
//   });
//
// Collectives go through shared memory. Every rank publishes its buffers and counts in a
// slot of the communicator and pulls its blocks straight from the peers' send buffers into
// its own receive buffer with one memcpy per block (no staging copy), starting with each
// peer as soon as that peer has published; an exit barrier keeps the senders' buffers
// alive until every read is done. all_reduce and reduce_scatter wait for every member at
// an entry barrier first; all_reduce splits the elements into one chunk per rank, each rank
// sums its chunk over the ranks in rank order and writes the result into every rank's
// receive buffer, so every rank gets bitwise the same result.
//
// Nothing hangs: an exception escaping any rank's function aborts the run, and every
// pending or later collective of every rank (sub-communicators included) throws
// epx::error(errc::communicator) naming the failed rank and its message. A rank that
// returns from its function while others wait for it in a collective fails that
// collective at once, and a watchdog (options::timeout) turns a collective that some
// members have not entered in time into an error listing them; such a failure ends that
// communicator (its pending and later collectives raise the same error on every member),
// not the run. Calls that disagree (different collectives, datatypes, counts, segment
// counts, roots or scales) are detected on every rank and reported with the values
// (epx/comm/threads/agreement.hpp); the communicator stays usable. An error that a rank
// catches is its own to handle: only an exception that escapes a rank's function aborts
// the run (epx/comm/threads/run.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/detail/deadline.hpp"
#include "epx/comm/detail/reduce.hpp"
#include "epx/comm/threads/agreement.hpp"
#include "epx/comm/threads/options.hpp"
#include "epx/comm/threads/state.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/stream.hpp"

namespace epx {
namespace threads {

class communicator;

}  // namespace threads

namespace detail {
struct threads_access;
}

namespace threads {

// One rank's handle on a group of threads. One thread at a time may use it (a second thread
// that calls a collective while one is in progress on it gets errc::input); a rank's
// different communicators (its ep and tp sub-communicators, say) may be used by different
// threads of the rank at once.
// Movable, not copyable; a moved-from communicator may only be assigned to or destroyed.
class communicator {
 public:
  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() = default;

  // This rank in [0, size()).
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return group_->size(); }
  // This rank's index in the communicator of epx::threads::run.
  int world_rank() const noexcept { return group_->world_rank(rank_); }

  // Collective: members with the same color form one new communicator, ordered by
  // (key, rank). Colors must be non-negative (as on MPI and NCCL): a negative one raises
  // errc::input on every member, naming the rank. It belongs to the same run: an exception escaping any rank's function
  // aborts its collectives too.
  communicator split(int color, int key) const {
    const use_guard in_use(*this, detail::threads_op::split);
    detail::threads_slot d;
    d.op = detail::threads_op::split;
    d.color = color;
    d.key = key;
    if (color < 0) d.fault = detail::concat("passes color ", color, ", which must be non-negative");
    const int n = size();
    std::vector<std::pair<int, int>> members;  // (key, rank) of this color
    members.reserve(static_cast<std::size_t>(n));
    int leader = n;
    int new_rank = 0;
    std::string failure;
    enter(d, [&] {
      for (int r = 0; r < n; ++r)
        if (slot(r).color == color) members.emplace_back(slot(r).key, r);
      std::sort(members.begin(), members.end());
      for (std::size_t i = 0; i < members.size(); ++i) {
        leader = std::min(leader, members[i].second);
        if (members[i].second == rank_) new_rank = static_cast<int>(i);
      }
      if (leader == rank_) {
        std::shared_ptr<detail::threads_group> created;
        try {
          std::vector<int> world_ranks;
          world_ranks.reserve(members.size());
          for (const auto& m : members) world_ranks.push_back(group_->world_rank(m.second));
          created = world_->make_group(std::move(world_ranks));
        } catch (const std::exception& e) {
          failure = e.what();
        }
        slot(rank_).new_group = created;
      }
    });
    // Second phase: the leaders have published the new groups; pick ours up. (The slots are
    // double-buffered, so nobody overwrites the leader's before we have read it.)
    wait_exit();
    std::shared_ptr<detail::threads_group> g = slot(leader).new_group;
    EPX_REQUIRE(g != nullptr, errc::communicator, "split: could not create the group of color ", color,
                failure.empty() ? "" : ": ", failure);
    return communicator(world_, std::move(g), new_rank);
  }

  // Equal counts: send holds size()*count elements, block p goes to peer p.
  void all_to_all(const void* send, void* recv, std::size_t count, datatype t) {
    detail::threads_slot d = make_slot(detail::threads_op::all_to_all, t, send, recv, count);
    require_buffer(d, send, count * static_cast<std::size_t>(size()), "send");
    require_buffer(d, recv, count * static_cast<std::size_t>(size()), "recv");
    if (!d.fault.empty()) return enter_pull(d, [](int) {});  // raises on every member
    const std::size_t bytes = count * size_of(t);
    const std::size_t all = bytes * static_cast<std::size_t>(size());
    check_overlap(d, send, all, recv, all, size() == 1 && send == recv, "in place is not supported");
    enter_pull(d, [&](int p) {
      const auto* src = static_cast<const char*>(slot(p).send) + static_cast<std::size_t>(rank_) * bytes;
      copy_bytes(static_cast<char*>(recv) + static_cast<std::size_t>(p) * bytes, src, bytes);
    });
  }

  // Per-peer counts and displacements in elements: send_counts[p] elements from
  // send + send_displs[p] go to peer p, recv_counts[p] elements from peer p land at
  // recv + recv_displs[p]. send_counts on p's side must equal recv_counts on ours.
  void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                   const std::size_t* recv_counts, const std::size_t* recv_displs, datatype t) {
    exchange_segments(detail::threads_op::all_to_allv, send, send_counts, send_displs, recv, recv_counts,
                      recv_displs, 1, t);
  }

  // Segmented all-to-all (see epx::all_to_allv_segments): arrays are [peers][nseg], in
  // elements; segment i that this rank sends to peer q (send_counts[q*nseg+i] elements at
  // send + send_displs[q*nseg+i]) lands at recv + q's recv_displs[me*nseg+i], and q's
  // recv_counts[me*nseg+i] must equal it. One collective: every segment is copied once,
  // straight from the sender's buffer into the receiver's, with one entry and one exit
  // barrier for all nseg segments.
  void all_to_allv_segments(const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
                            void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
                            std::size_t nseg, datatype t) {
    exchange_segments(detail::threads_op::all_to_allv_segments, send, send_counts, send_displs, recv, recv_counts,
                      recv_displs, nseg, t);
  }

  // Segmented all-to-all of rows picked by index (see epx::all_to_allv_indexed): arrays
  // are [peers][nseg], in rows of row_elems elements; segment i to peer q is the rows
  // src + rows[j] * row_elems for j in [send_displs[q*nseg+i], + send_counts[q*nseg+i]),
  // and lands as a block at recv + q's recv_displs[me*nseg+i] rows. Each row is copied
  // once, from the sender's src straight into the receiver's buffer: no send buffer.
  void all_to_allv_indexed(const void* src, const std::int64_t* rows, std::size_t row_elems,
                           const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                           const std::size_t* recv_counts, const std::size_t* recv_displs, std::size_t nseg,
                           datatype t) {
    exchange_segments(detail::threads_op::all_to_allv_indexed, src, send_counts, send_displs, recv, recv_counts,
                      recv_displs, nseg, t, rows, row_elems);
  }

  // recv = scale * sum over ranks of send (send == recv allowed). Summed in rank order;
  // every rank gets bitwise the same result.
  void all_reduce(const void* send, void* recv, std::size_t count, datatype t, double scale) {
    detail::threads_slot d = reduction_slot(detail::threads_op::all_reduce, t, send, count, recv, count, scale);
    if (!d.fault.empty()) return enter_and_finish(d, [] {});  // raises on every member
    check_overlap(d, send, count * size_of(t), recv, count * size_of(t), send == recv, "in place: send == recv");
    const int n = size();
    std::vector<const void*> srcs(static_cast<std::size_t>(n));
    const std::size_t es = size_of(t);
    const bool direct = world_->memory().host_accessible;
    // Blocks of the chunk: sum into our recv, then copy to the peers' recv. Each block of
    // every send buffer is read before the same block of any recv buffer is written, so
    // send == recv works. Memory the host cannot read is staged: the members' blocks are
    // copied to the host, summed there and the sum copied back.
    constexpr std::size_t block = 16 * 1024;
    std::vector<char> staged;
    if (!direct) staged.resize((static_cast<std::size_t>(n) + 1) * block * es);
    enter_and_finish(d, [&] {
      // This rank's chunk, in whole 64-element pieces so chunks do not share cache lines.
      const std::size_t pieces = (count + 63) / 64;
      const std::size_t begin = std::min(count, pieces * static_cast<std::size_t>(rank_) / static_cast<std::size_t>(n) * 64);
      const std::size_t end = std::min(count, pieces * static_cast<std::size_t>(rank_ + 1) / static_cast<std::size_t>(n) * 64);
      for (std::size_t b = begin; b < end; b += block) {
        const std::size_t m = std::min(block, end - b);
        char* sum = direct ? static_cast<char*>(recv) + b * es : staged.data() + static_cast<std::size_t>(n) * block * es;
        for (int k = 0; k < n; ++k) {
          const char* src = static_cast<const char*>(slot(k).send) + b * es;
          if (!direct) {
            char* host = staged.data() + static_cast<std::size_t>(k) * block * es;
            copy_bytes(host, src, m * es);
            src = host;
          }
          srcs[static_cast<std::size_t>(k)] = src;
        }
        detail::reduce_sum(t, srcs.data(), n, sum, m, scale);
        for (int k = direct ? 1 : 0; k < n; ++k) {
          const int p = (rank_ + k) % n;
          copy_bytes(static_cast<char*>(slot(p).recv) + b * es, sum, m * es);
        }
      }
    });
    throw_if_copy_failed("all_reduce");
  }

  // send holds size()*recv_count elements; block r, summed over ranks and times scale,
  // lands in rank r's recv.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, datatype t, double scale) {
    detail::threads_slot d = reduction_slot(detail::threads_op::reduce_scatter, t, send,
                                            recv_count * static_cast<std::size_t>(size()), recv, recv_count, scale);
    if (!d.fault.empty()) return enter_and_finish(d, [] {});  // raises on every member
    const int n = size();
    std::vector<const void*> srcs(static_cast<std::size_t>(n));
    const std::size_t es = size_of(t);
    // In place: recv is this rank's own block of send, which no peer reads.
    const char* own = static_cast<const char*>(send) + static_cast<std::size_t>(rank_) * recv_count * es;
    check_overlap(d, send, static_cast<std::size_t>(n) * recv_count * es, recv, recv_count * es, recv == own,
                  "in place: recv = send + rank * recv_count");
    const bool direct = world_->memory().host_accessible;
    std::vector<char> staged;
    if (!direct) staged.resize((static_cast<std::size_t>(n) + 1) * recv_count * es);
    enter_and_finish(d, [&] {
      for (int k = 0; k < n; ++k) {
        const char* src = static_cast<const char*>(slot(k).send) + static_cast<std::size_t>(rank_) * recv_count * es;
        if (!direct) {
          char* host = staged.data() + static_cast<std::size_t>(k) * recv_count * es;
          copy_bytes(host, src, recv_count * es);
          src = host;
        }
        srcs[static_cast<std::size_t>(k)] = src;
      }
      if (direct) {
        detail::reduce_sum(t, srcs.data(), n, recv, recv_count, scale);
      } else {
        char* sum = staged.data() + static_cast<std::size_t>(n) * recv_count * es;
        detail::reduce_sum(t, srcs.data(), n, sum, recv_count, scale);
        copy_bytes(recv, sum, recv_count * es);
      }
    });
    throw_if_copy_failed("reduce_scatter");
  }

  // recv holds size()*count elements: block p is rank p's send.
  void all_gather(const void* send, void* recv, std::size_t count, datatype t) {
    detail::threads_slot d = make_slot(detail::threads_op::all_gather, t, send, recv, count);
    require_buffer(d, send, count, "send");
    require_buffer(d, recv, count * static_cast<std::size_t>(size()), "recv");
    if (!d.fault.empty()) return enter_pull(d, [](int) {});  // raises on every member
    const std::size_t bytes = count * size_of(t);
    // In place: send is this rank's own block of recv, which no peer writes.
    const char* own = static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    check_overlap(d, send, bytes, recv, bytes * static_cast<std::size_t>(size()), send == own,
                  "in place: send = recv + rank * count");
    enter_pull(d, [&](int p) {
      copy_bytes(static_cast<char*>(recv) + static_cast<std::size_t>(p) * bytes, slot(p).send, bytes);
    });
  }

  // data on every rank = data on root.
  void broadcast(void* data, std::size_t count, datatype t, int root) {
    detail::threads_slot d = make_slot(detail::threads_op::broadcast, t, data, data, count);
    d.root = root;
    if ((root < 0 || root >= size()) && d.fault.empty())
      d.fault = detail::concat("passes root ", root, ", out of range [0, ", size(), ")");
    require_buffer(d, data, count, "data");
    if (!d.fault.empty()) return enter_pull(d, [](int) {});  // raises on every member
    enter_pull(d, [&](int p) {
      if (p == root && rank_ != root) copy_bytes(data, slot(root).send, count * size_of(t));
    });
  }

  // Peer access, for ranks that share one address space (see epx::has_peer_access_v).
  // Collective: every member publishes `count` pointers (`mine`, e.g. the buffers it lets
  // the others read); once every member has published, f(peers) runs, where
  // peers(r, i) is pointer i of member r (peers(rank(), i) == mine[i]). Nobody leaves
  // before every member's f has returned, so what a member published stays valid while
  // the others read it; a member must not write what it published while f runs, except
  // the rows that are its own to write. If f throws on one member, that member still
  // waits for the others' f, then rethrows; the others carry on. Members that pass
  // different counts all fail with the values.
  // `bytes` (the size of each buffer) is what backends that copy the buffers need; threads
  // ranks read the buffers themselves, so it may be null here.
  // A null buffer that claims bytes fails on every member (errc::input), with its index.
  template <class F>
  void access_peers(const void* const* mine, const std::size_t* bytes, std::size_t count, F&& f) {
    std::string fault;
    for (std::size_t i = 0; i < count && bytes != nullptr && mine != nullptr && fault.empty(); ++i)
      if (mine[i] == nullptr && bytes[i] > 0)
        fault = detail::concat("publishes buffer ", i, " as null but claims ", bytes[i], " bytes for it");
    peers_call(mine, count, std::move(fault), std::forward<F>(f));
  }
  // Threads ranks share one address space: peer access always works.
  bool peer_access_available() const noexcept { return true; }
  // Whether the ranks' buffers may be memory the host cannot read (threads::options::memory,
  // e.g. threads::device_memory()): blocks then move through the run's copy, and a layer
  // on a device policy may use this communicator.
  bool device_buffers() const noexcept { return !world_->memory().host_accessible; }

  template <class F>
  void access_peers(const void* const* mine, std::size_t count, F&& f) {
    peers_call(mine, count, std::string(), std::forward<F>(f));
  }

  // The view access_peers hands to its function.
  class peer_pointers {
   public:
    const void* operator()(int r, std::size_t i) const noexcept {
      return static_cast<const void* const*>(comm_->slot(r).send)[i];
    }
    int size() const noexcept { return comm_->size(); }

   private:
    friend class communicator;
    explicit peer_pointers(const communicator* c) noexcept : comm_(c) {}
    const communicator* comm_;
  };

  void barrier() {
    detail::threads_slot d;
    d.op = detail::threads_op::barrier;
    // The entry barrier is the barrier: no buffers to keep alive, so no exit barrier.
    enter(d, [] {});
  }

 private:
  friend struct epx::detail::threads_access;

  // One thread at a time per communicator: a collective started while another thread is
  // inside one on the same communicator (the same rank of the same group) raises
  // errc::input on the thread that came second, before it publishes anything; the first
  // one's collective goes on. The same thread again (a collective inside the function of
  // its access_peers) is left to publish, which says why that is refused.
  class use_guard {
   public:
    use_guard(const communicator& c, detail::threads_op op) {
      auto& user = c.group_->user(c.rank_);
      const std::thread::id me = std::this_thread::get_id();
      std::thread::id none{};
      if (user.compare_exchange_strong(none, me)) {
        user_ = &user;
        return;
      }
      if (none == me) return;
      EPX_THROW(errc::input, to_string(op), " on ", c.who(c.rank_),
                ": another thread is inside a collective on this communicator (a communicator is used by one "
                "thread at a time)");
    }
    use_guard(const use_guard&) = delete;
    use_guard& operator=(const use_guard&) = delete;
    ~use_guard() {
      if (user_ != nullptr) user_->store(std::thread::id{});
    }

   private:
    std::atomic<std::thread::id>* user_ = nullptr;
  };

  // d's fault (unless it has one) when send bytes [send, + ns) and recv bytes [recv, + nr)
  // share a byte, unless `in_place` (the collective's own in-place layout); `rule` says
  // what is allowed.
  static void check_overlap(detail::threads_slot& d, const void* send, std::size_t ns, const void* recv,
                            std::size_t nr, bool in_place, const char* rule) {
    const auto x = reinterpret_cast<std::uintptr_t>(send), y = reinterpret_cast<std::uintptr_t>(recv);
    const bool shared = ns > 0 && nr > 0 && x < y + nr && y < x + ns;
    if (shared && !in_place && d.fault.empty())
      d.fault = detail::concat("passes send and recv buffers that overlap (", rule, ")");
  }

  // access_peers, with this member's fault (if any). While f runs, this rank's slot holds
  // the pointers the peers read: a collective on this communicator inside f would replace
  // them, so it raises errc::input (publish).
  template <class F>
  void peers_call(const void* const* mine, std::size_t count, std::string fault, F&& f) {
    const use_guard in_use(*this, detail::threads_op::access_peers);
    detail::threads_slot d;
    d.op = detail::threads_op::access_peers;
    d.send = static_cast<const void*>(mine);
    d.count = count;
    d.fault = std::move(fault);
    require_buffer(d, mine, count, "pointer list");
    std::exception_ptr failure;
    enter(d, [&] {
      const peer_pointers peers(this);
      in_access_ = true;
      try {
        f(peers);
      } catch (...) {
        failure = std::current_exception();
      }
      in_access_ = false;
    });
    wait_exit();
    if (failure) std::rethrow_exception(failure);
  }

  communicator(std::shared_ptr<detail::threads_world> world, std::shared_ptr<detail::threads_group> group,
               int rank) noexcept
      : world_(std::move(world)), group_(std::move(group)), rank_(rank) {}

  // all_to_allv (op all_to_allv, nseg = 1), all_to_allv_segments and all_to_allv_indexed:
  // the arrays are [peers][nseg] in units of `row_elems` elements; every segment (indexed:
  // every row) is copied once, from the sender's buffer straight into the receiver's.
  // Indexed, the send displacements index `rows`, which names rows of `send`.
  void exchange_segments(detail::threads_op op, const void* send, const std::size_t* send_counts,
                         const std::size_t* send_displs, void* recv, const std::size_t* recv_counts,
                         const std::size_t* recv_displs, std::size_t nseg, datatype t,
                         const std::int64_t* rows = nullptr, std::size_t row_elems = 1) {
    const bool indexed = op == detail::threads_op::all_to_allv_indexed;
    const bool segmented = op != detail::threads_op::all_to_allv;
    const int n = size();
    const std::size_t m = static_cast<std::size_t>(n) * nseg;
    detail::threads_slot d = make_slot(op, t, send, recv, nseg);
    d.row_elems = row_elems;
    // Arguments this rank cannot use are its fault, which every member raises (errc::input)
    // once all have published; nothing is read or copied then.
    if (m > 0 && !(send_counts && send_displs && recv_counts && recv_displs) && d.fault.empty())
      d.fault = detail::concat("passes null counts or displacements",
                               segmented ? detail::concat(" (", n, " peers x ", nseg, " segments)") : std::string());
    if (indexed && row_elems == 0 && d.fault.empty()) d.fault = "passes row_elems 0 (rows of no elements)";
    if (!d.fault.empty()) return enter_pull(d, [](int) {});
    std::size_t total_send = 0, total_recv = 0;
    for (std::size_t j = 0; j < m; ++j) {
      total_send += send_counts[j];
      total_recv += recv_counts[j];
    }
    require_buffer(d, send, total_send, indexed ? "src" : "send");
    require_buffer(d, rows, indexed ? total_send : 0, "rows");
    require_buffer(d, recv, total_recv, "recv");
    if (!d.fault.empty()) return enter_pull(d, [](int) {});
    {
      // The bytes each side spans, in units of the counts. Indexed, send spans up to its last
      // row named, which only matters when recv starts inside or after src: otherwise one
      // byte of src is as good (no pass over the rows).
      const bool scan_rows = indexed && recv >= send;
      std::size_t send_end = 0, recv_end = 0;
      bool identity = n == 1 && !indexed && send == recv;  // one rank copying each block onto itself
      for (std::size_t j = 0; j < m; ++j) {
        if (send_counts[j] > 0 && !indexed) send_end = std::max(send_end, send_displs[j] + send_counts[j]);
        if (send_counts[j] > 0 && indexed) send_end = std::max<std::size_t>(send_end, 1);
        for (std::size_t r = 0; scan_rows && r < send_counts[j]; ++r)
          send_end = std::max(send_end, static_cast<std::size_t>(rows[send_displs[j] + r]) + 1);
        if (recv_counts[j] > 0) recv_end = std::max(recv_end, recv_displs[j] + recv_counts[j]);
        identity = identity && (send_counts[j] == 0 || send_displs[j] == recv_displs[j]);
      }
      const std::size_t unit = size_of(t) * row_elems;
      check_overlap(d, send, send_end * unit, recv, recv_end * unit, identity, "in place is not supported");
    }
    d.send_counts = send_counts;
    d.send_displs = send_displs;
    d.recv_counts = recv_counts;
    d.recv_displs = recv_displs;
    d.rows = rows;
    const std::size_t es = size_of(t) * row_elems;  // bytes per unit of the counts
    // A call that writes at least exec::stream_threshold() bytes into host memory writes
    // them around the caches (epx/exec/stream.hpp), each peer's blocks then a fence.
    const bool stream = world_->memory().copy == nullptr && exec::streams(total_recv * size_of(t) * row_elems);
    const auto copy = [&](void* to, const void* from, std::size_t bytes) { copy_bytes(to, from, bytes, stream); };
    enter_pull(d, [&](int p) {
      const auto& s = slot(p);
      const std::size_t from = static_cast<std::size_t>(rank_) * nseg;  // our row of p's arrays
      const std::size_t to = static_cast<std::size_t>(p) * nseg;        // p's row of ours
      for (std::size_t i = 0; i < nseg; ++i) {
        char* dst = static_cast<char*>(recv) + recv_displs[to + i] * es;
        if (!indexed) {
          copy(dst, static_cast<const char*>(s.send) + s.send_displs[from + i] * es, recv_counts[to + i] * es);
          continue;
        }
        const std::int64_t* r = s.rows + s.send_displs[from + i];
        for (std::size_t j = 0; j < recv_counts[to + i]; ++j)
          copy(dst + j * es, static_cast<const char*>(s.send) + static_cast<std::size_t>(r[j]) * es, es);
      }
      if (stream) exec::stream_fence();
    });
  }

  // What every member concludes of the published calls: a member's own fault
  // (threads_slot::fault: errc::input), else calls that disagree (errc::communicator), else
  // nothing. A failure to compare counts as a disagreement.
  struct verdict {
    errc category = errc::communicator;
    std::string message;  // empty: the calls agree
    explicit operator bool() const noexcept { return !message.empty(); }
    [[noreturn]] void raise() const { throw epx::error(category, message, EPX_HERE); }
  };
  verdict check_calls() const {
    try {
      const std::uint64_t seq = group_->entered(rank_);
      if (std::string fault = detail::threads_check_faults(*group_, seq); !fault.empty())
        return {errc::input, std::move(fault)};
      return {errc::communicator, detail::threads_check_match(*group_, seq)};
    } catch (...) {
      return {errc::communicator, "could not compare the members' calls"};
    }
  }

  // A call's slot: the collective, datatype, buffers and count (the other fields as needed).
  static detail::threads_slot make_slot(detail::threads_op op, datatype t, const void* send, void* recv,
                                        std::size_t count) {
    detail::threads_slot d;
    d.op = op;
    d.type = t;
    d.send = send;
    d.recv = recv;
    d.count = count;
    if (size_of(t) == 0) d.fault = detail::concat("passes datatype ", static_cast<int>(t), ", which is none of epx::datatype's");
    return d;
  }

  // The slot of a sum (all_reduce, reduce_scatter): send holds send_count elements, recv
  // recv_count; a datatype that cannot be summed or a null buffer is its fault.
  static detail::threads_slot reduction_slot(detail::threads_op op, datatype t, const void* send,
                                             std::size_t send_count, void* recv, std::size_t recv_count,
                                             double scale) {
    detail::threads_slot d = make_slot(op, t, send, recv, recv_count);
    d.scale = scale;
    if (d.fault.empty() && !is_reducible(t))
      d.fault = detail::concat("passes datatype ", to_string(t), ", which cannot be summed");
    require_buffer(d, send, send_count, "send");
    require_buffer(d, recv, recv_count, "recv");
    return d;
  }

  // Rank r's slot for the collective in progress (this rank's sequence number's parity).
  detail::threads_slot& slot(int r) const noexcept { return group_->slot(group_->entered(rank_), r); }

  // Every block a collective moves goes through here: memcpy (exec::stream_copy where the
  // caller streams: host memory only, the caller fences), or the run's memory copy
  // (threads::memory), whose failure is remembered and raised once the collective is over
  // (throw_if_copy_failed), so that no member is left waiting.
  void copy_bytes(void* dst, const void* src, std::size_t bytes, bool stream = false) const noexcept {
    if (bytes == 0 || dst == src) return;
    const auto copy = world_->memory().copy;
    if (copy == nullptr && stream) {
      exec::stream_copy(dst, src, bytes);
    } else if (copy == nullptr) {
      std::memcpy(dst, src, bytes);
    } else if (!copy(dst, src, bytes)) {
      copy_failed_ = true;
    }
  }

  void throw_if_copy_failed(const char* op) const {
    if (!copy_failed_) return;
    copy_failed_ = false;
    const char* name = world_->memory().name;
    EPX_THROW(errc::communicator, op, ": copying a block between the ranks' buffers failed (memory '",
              name ? name : "?", "') on ", who(rank_));
  }

  // A null buffer that should hold `count` elements (or pointers) is the slot's fault (the
  // first one stays).
  static void require_buffer(detail::threads_slot& d, const void* p, std::size_t count, const char* what) {
    if (p == nullptr && count > 0 && d.fault.empty())
      d.fault = detail::concat("passes a null ", what, " buffer that should hold ", count, " elements");
  }

  // "rank 2", or "rank 2 (world rank 6)" inside a sub-communicator.
  std::string who(int r) const { return detail::threads_who(*group_, r); }

  // The exit barrier: every member has passed the entry barrier and runs bounded copy
  // code, so this wait always completes.
  void wait_exit() const noexcept {
    group_->arrive_and_wait(false, std::chrono::steady_clock::time_point::max());
  }

  // The error of a collective that timed out or can never complete (a member is gone).
  epx::error wait_failure(detail::wait_result w, detail::threads_op op) const {
    const std::uint64_t seq = group_->entered(rank_);
    const bool gone = w == detail::wait_result::member_gone;
    std::string missing;
    for (int r = 0; r < size(); ++r)
      if (group_->entered(r) < seq && (!gone || world_->finished(group_->world_rank(r))))
        missing += (missing.empty() ? "" : ", ") + who(r);
    if (missing.empty()) missing = "none at the time of the check";
    const std::string what = detail::concat(to_string(op), " (collective #", seq, " on a communicator of ",
                                            size(), " ranks)");
    return epx::error(errc::communicator,
                      gone ? detail::concat(what, " can never complete: ranks that returned from their function "
                                                  "without entering it: ", missing)
                           : detail::concat("watchdog: ", what, " still waits after ", world_->timeout().count(),
                                            " ms; ranks that never entered it: ", missing),
                      EPX_HERE);
  }

  [[noreturn]] void on_wait_failure(detail::wait_result w, detail::threads_op op) const {
    if (w == detail::wait_result::timed_out || w == detail::wait_result::member_gone) {
      // We cancelled the generation. This group is broken (the generation stays cancelled),
      // the run is not: a rank that catches the error goes on with its other communicators.
      // It aborts the run only if it escapes a rank's function (epx::threads::run).
      std::exception_ptr e;
      try {
        e = std::make_exception_ptr(wait_failure(w, op));
      } catch (...) {
        e = std::current_exception();  // out of memory: the members still learn that it failed
      }
      group_->fail(world_rank(), e);
      group_->retract(group_->entered(rank_), rank_);
      std::rethrow_exception(e);
    }
    // Cancelled: whoever cancelled records the failure right after (the group's, or the
    // run's abort); wait for it.
    group_->retract(group_->entered(rank_), rank_);
    for (;;) {
      if (group_->failed()) group_->throw_failed(world_rank());
      if (world_->aborted()) world_->throw_aborted(world_rank());
      std::this_thread::yield();
    }
  }

  // Makes `d` this rank's call number `seq` (the next one) and returns seq.
  std::uint64_t publish(const detail::threads_slot& d) const {
    EPX_REQUIRE(!in_access_, errc::input, to_string(d.op), " on ", who(rank_),
                ": a collective on this communicator inside the function of its access_peers (which reads the "
                "pointers this rank published for it)");
    world_->throw_if_aborted(world_rank());
    copy_failed_ = false;  // the flag of this call only
    const std::uint64_t seq = group_->entered(rank_) + 1;
    group_->slot(seq, rank_) = d;
    group_->set_entered(rank_, seq);
    group_->sync(seq, rank_).published.store(seq);
    return seq;
  }

  // Publishes `d`, waits at the entry barrier, checks that every member called the same
  // collective with matching arguments, then runs `work` (which must not throw). On a
  // mismatch every member sees the same disagreement, passes the exit barrier and throws.
  // Collectives that read peers' buffers call wait_exit afterwards (split runs a second
  // phase first); barrier needs no exit barrier, because the slots are double-buffered.
  template <class Work>
  void enter(const detail::threads_slot& d, Work&& work) const {
    const use_guard in_use(*this, d.op);
    const std::uint64_t seq = publish(d);
    const auto deadline = detail::deadline_after(world_->timeout());
    const auto w = group_->arrive_and_wait(true, deadline, seq);
    if (w != detail::wait_result::passed) on_wait_failure(w, d.op);
    const verdict v = check_calls();
    if (v) {
      wait_exit();
      v.raise();
    }
    work();
  }

  // The collectives where each rank only reads from peers (all_to_all, all_to_allv,
  // all_to_allv_segments, all_gather, broadcast): pull(p) copies this rank's blocks from peer p (must not throw).
  // Instead of waiting for every member at the entry barrier, a rank starts copying from
  // each peer as soon as that peer has published a matching call, registered as an
  // accessor of the peer's buffers, and sleeps only when no published peer is left. Before
  // the exit barrier it makes sure the entry barrier has passed (so that nobody leaves
  // early any more) and checks every member's call, like enter().
  template <class Pull>
  void enter_pull(const detail::threads_slot& d, Pull&& pull) const {
    const int n = size();
    std::vector<char> done(static_cast<std::size_t>(n), 0);
    const use_guard in_use(*this, d.op);
    const std::uint64_t seq = publish(d);
    const auto deadline = detail::deadline_after(world_->timeout());
    const auto a = group_->arrive();
    if (a.done && a.result != detail::wait_result::passed) on_wait_failure(a.result, d.op);
    bool all_in = a.done;  // the entry barrier has passed: every member has published
    int remaining = n;
    while (remaining > 0) {
      bool progress = false;
      for (int k = 0; k < n; ++k) {
        const int p = (rank_ + k) % n;
        if (done[static_cast<std::size_t>(p)] || (!all_in && !group_->published(seq, p))) continue;
        done[static_cast<std::size_t>(p)] = 1;
        --remaining;
        progress = true;
        if (p == rank_) {
          if (pair_matches(p)) pull(p);
        } else {
          // The peer's counts and buffers stay valid while we are its accessor.
          if (!group_->acquire(seq, p)) on_wait_failure(detail::wait_result::cancelled, d.op);
          if (pair_matches(p)) pull(p);  // a mismatch is reported below, once every call is known
          group_->release(seq, p);
        }
      }
      if (remaining > 0 && !progress) {
        const auto w = group_->wait_gen(a.gen, true, deadline, seq);
        if (w != detail::wait_result::passed) on_wait_failure(w, d.op);
        all_in = true;
      }
    }
    if (!all_in) {
      const auto w = group_->wait_gen(a.gen, true, deadline, seq);
      if (w != detail::wait_result::passed) on_wait_failure(w, d.op);
    }
    const verdict v = check_calls();
    wait_exit();
    if (v) v.raise();
    throw_if_copy_failed(to_string(d.op));
  }

  // Whether peer p's published call agrees with ours on what we read from it
  // (epx/comm/threads/agreement.hpp).
  bool pair_matches(int p) const noexcept {
    return detail::threads_pair_matches(*group_, group_->entered(rank_), rank_, p);
  }

  template <class Work>
  void enter_and_finish(const detail::threads_slot& d, Work&& work) const {
    enter(d, std::forward<Work>(work));
    wait_exit();
  }

  std::shared_ptr<detail::threads_world> world_;
  std::shared_ptr<detail::threads_group> group_;
  int rank_ = 0;
  mutable bool copy_failed_ = false;  // a memory copy of the collective in progress failed
  bool in_access_ = false;            // the function of this rank's access_peers is running
};

}  // namespace threads

namespace detail {
struct threads_access {
  static threads::communicator make(std::shared_ptr<threads_world> w, std::shared_ptr<threads_group> g, int r) {
    return threads::communicator(std::move(w), std::move(g), r);
  }
};
}  // namespace detail

static_assert(check_communicator<threads::communicator>(), "threads::communicator must satisfy the communicator concept");

}  // namespace epx
