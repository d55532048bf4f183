// epx/comm/mpi/agreement.hpp: how the ranks of an MPI communicator agree before a collective
// (needs <mpi.h>).
//
// With `options::check_counts` (default on) every collective entry point of the
// communicator (all_to_all, all_to_allv, all_to_allv_segments, all_to_allv_indexed,
// all_reduce, reduce_scatter, all_gather, broadcast, barrier, split, and the peer access
// calls peer_access_available (its collective first call), peer_buffer, peer_memory and
// access_peers)
// opens with the same call header: one small MPI_Iallreduce of the same 17 integers on
// every rank (mpi_agree_call). So ranks in different collectives meet there, whichever
// collectives they are, instead of in calls that MPI pairs without a word or never pairs
// (which only the watchdog would end). The header carries the collective, the datatype,
// the count, the root, the segment count and the row width, and a rank's own bad argument
// (which reaches every rank in the same reduction). For the exchanges whose counts differ by
// peer (all_to_allv and the segmented and indexed ones) it also sums, modulo 2^64, a hash of
// every (sender, receiver, segment, count) that a rank sends minus one of every one that a
// rank expects: the sums are 0 over all ranks exactly when every sender sends what its
// receiver expects (but for a chance of 2^-128), so the per-pair check costs no exchange;
// only when the sums differ does an all_to_all of the counts name the first disagreeing pair.
// A disagreement raises epx::error(errc::communicator) on every rank, naming the
// collectives and the lowest rank of each, or the values; a rank's bad argument raises its
// category (errc::input) on every rank, with the lowest such rank's message. The same
// reduction tells every rank whether any of them needs the chunked path
// (epx/comm/mpi/transport.hpp), so that all take the same one. split agrees even without
// check_counts (a negative color raises on every rank); without it, the other collectives
// compare nothing, and barrier is MPI_Ibarrier.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/datatype.hpp"
#include "epx/comm/mpi/options.hpp"
#include "epx/comm/mpi/state.hpp"
#include "epx/comm/mpi/support.hpp"
#include "epx/comm/mpi/wait.hpp"
#include "epx/core/error.hpp"

namespace epx::detail {

// Raises on every rank the lowest failing rank's `local_error` (its category), once a
// reduction showed that some rank failed: buf[0] != 0, buf[1] = -(lowest failing rank).
[[noreturn]] inline void mpi_raise_local(mpi_state& s, const mpi::options& opt, long long failing_neg,
                                         const std::string& local_error, errc local_category) {
  const int culprit = static_cast<int>(-failing_neg);  // lowest failing rank
  std::vector<char> msg;
  if (culprit == s.rank) msg.assign(local_error.begin(), local_error.end());
  // [length, category]: the culprit's category, which may differ from this rank's.
  std::vector<int> len = {static_cast<int>(std::min<std::size_t>(msg.size(), 4096)),
                          static_cast<int>(local_category)};
  {
    mpi_keep keep(len);
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep, MPI_Ibcast(len.data(), 2, MPI_INT, culprit, s.comm, &epx_req_));
  }
  msg.resize(static_cast<std::size_t>(len[0]) + 1);
  {
    mpi_keep keep(msg);
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                         MPI_Ibcast(msg.data(), len[0], MPI_CHAR, culprit, s.comm, &epx_req_));
  }
  throw error(static_cast<errc>(len[1]), std::string(msg.data(), static_cast<std::size_t>(len[0])), EPX_HERE);
}

// One MPI_Allreduce(MAX) over [error, -failing rank, any, values..., -values...].
// Raises on every rank when some rank passed a non-empty `local_error` (category
// `local_category`; the lowest such rank's message and category are broadcast, so every
// rank names the same values) or, as errc::communicator, when `values` differ between ranks. Returns the
// maximum of `any` over ranks.
inline long long mpi_agree(mpi_state& s, const mpi::options& opt, const char* op,
                           std::initializer_list<std::pair<const char*, long long>> values,
                           const std::string& local_error, errc local_category, long long any = 0) {
  const std::size_t k = values.size();
  std::vector<long long> buf(3 + 2 * k);
  const bool failed = !local_error.empty();
  buf[0] = failed ? 1 : 0;
  buf[1] = failed ? -static_cast<long long>(s.rank) : std::numeric_limits<long long>::min();
  buf[2] = any;
  std::size_t i = 0;
  for (const auto& v : values) {
    buf[3 + i] = v.second;
    buf[3 + k + i] = -v.second;
    ++i;
  }
  // Every buffer of these calls is a vector of our own: a watchdog timeout raises and keeps
  // them alive (epx/comm/mpi/wait.hpp).
  {
    mpi_keep keep(buf);
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                         MPI_Iallreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_LONG_LONG,
                                        MPI_MAX, s.comm, &epx_req_));
  }
  if (buf[0] != 0) mpi_raise_local(s, opt, buf[1], local_error, local_category);
  i = 0;
  for (const auto& v : values) {
    const long long hi = buf[3 + i], lo = -buf[3 + k + i];
    if (hi != lo && std::string(v.first) == "the datatype") {
      // By name: "float32", not its number.
      auto name = [](long long x) { return std::string(to_string(static_cast<datatype>(x))); };
      EPX_THROW(errc::communicator, op, ": ranks disagree on the datatype (values from ", name(lo), " to ", name(hi),
                "; rank ", s.rank, " passed ", name(v.second), ")");
    }
    EPX_REQUIRE(hi == lo, errc::communicator, op, ": ranks disagree on ", v.first, " (values from ", lo, " to ", hi,
                "; rank ", s.rank, " passed ", v.second, ")");
    ++i;
  }
  return buf[2];
}

// The collective entry points of the communicator, numbered for the agreement: every one
// (with options::check_counts; split always) opens with the same call header, so that
// ranks in different ones meet in the same reduction and all see the disagreement.
enum class mpi_kind : long long {
  none = 0,
  all_to_all = 1,
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  all_to_allv,
  all_to_allv_segments,
  all_to_allv_indexed,
  barrier,
  split,
  peer_access_available,
  peer_memory,
  access_peers,
  peer_buffer,
};
inline constexpr long long mpi_kind_count = 15;  // one past the last

inline const char* mpi_kind_name(mpi_kind k) noexcept {
  static constexpr const char* names[] = {"another collective", "all_to_all", "all_reduce", "reduce_scatter",
                                          "all_gather", "broadcast", "all_to_allv", "all_to_allv_segments",
                                          "all_to_allv_indexed", "barrier", "split", "peer_access_available",
                                          "peer_memory", "access_peers", "peer_buffer"};
  const auto i = static_cast<long long>(k);
  return i >= 0 && i < mpi_kind_count ? names[i] : "an unknown collective";
}

// One rank's call, as the header agreement compares it. Fields a collective does not use
// stay 0 on every rank. `pairs`: this rank's share of the pair sums (mpi_pair_sums).
struct mpi_call {
  mpi_kind kind = mpi_kind::none;
  long long type = 0;       // the datatype (static_cast of epx::datatype)
  long long count = 0;      // the count (per peer, per rank or in all, as the collective says)
  long long root = 0;
  long long segments = 0;   // segments per peer (the segmented and indexed exchanges)
  long long row_elems = 0;  // elements per row (all_to_allv_indexed)
  std::uint64_t pairs[2] = {0, 0};
  long long any = 0;        // returned as its maximum over the ranks
  std::string local_error;  // this rank's own bad argument (raised on every rank)
  errc local_category = errc::input;
};

// The header's reduction: the maximum of every entry but the last two, which are summed
// (modulo 2^64). Commutative and associative, like MPI_MAX and MPI_SUM.
inline constexpr int mpi_header_sums = 2;
inline void mpi_header_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const long long*>(in);
  auto* b = static_cast<long long*>(inout);
  const int n = *len;
  for (int i = 0; i < n - mpi_header_sums; ++i) b[i] = std::max(a[i], b[i]);
  for (int i = std::max(0, n - mpi_header_sums); i < n; ++i) {
    std::uint64_t x = 0, y = 0;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    x += y;
    std::memcpy(b + i, &x, sizeof x);
  }
}

// The MPI_Op of mpi_header_reduce, made once per process and freed by MPI_Finalize (which
// deletes MPI_COMM_SELF's attributes first).
inline MPI_Op mpi_header_op() {
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    if (MPI_Op_create(&mpi_header_reduce, 1, &o) != MPI_SUCCESS) return MPI_OP_NULL;
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(
            MPI_COMM_NULL_COPY_FN,
            [](MPI_Comm, int, void* v, void*) -> int {
              auto* p = static_cast<MPI_Op*>(v);
              MPI_Op_free(p);
              delete p;
              return MPI_SUCCESS;
            },
            &key, nullptr) == MPI_SUCCESS) {
      auto* kept = new MPI_Op(o);
      if (MPI_Comm_set_attr(MPI_COMM_SELF, key, kept) != MPI_SUCCESS) delete kept;  // left to the process end
    }
    return o;
  }();
  EPX_REQUIRE(op != MPI_OP_NULL, errc::mpi, "MPI_Op_create failed for the agreement of the MPI communicator");
  return op;
}

inline std::uint64_t mpi_mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// This rank's share of the pair sums of an exchange (arrays [peers][nseg], in elements):
// plus a hash of (me, q, i, what me sends q in segment i) for every q and i, minus a hash of
// (p, me, i, what me expects from p in segment i) for every p and i. Over all ranks the
// sums are 0 when every sender sends what its receiver expects (each term meets its
// negative), and otherwise differ from 0 but for a chance of 2^-128.
inline void mpi_pair_sums(const mpi_state& s, const std::size_t* send_counts, const std::size_t* recv_counts,
                          std::size_t nseg, std::uint64_t (&out)[2]) noexcept {
  const auto n = static_cast<std::uint64_t>(s.size), me = static_cast<std::uint64_t>(s.rank);
  std::uint64_t plus[2] = {0, 0}, minus[2] = {0, 0};
  auto add = [&](std::uint64_t (&acc)[2], std::uint64_t pair, std::size_t i, std::size_t count) {
    const std::uint64_t h = mpi_mix(mpi_mix(pair ^ static_cast<std::uint64_t>(i)) ^ static_cast<std::uint64_t>(count));
    acc[0] += h;
    acc[1] += mpi_mix(h ^ 0x5851f42d4c957f2dull);
  };
  for (std::uint64_t q = 0; q < n; ++q) {
    const std::uint64_t to = mpi_mix(me * n + q), from = mpi_mix(q * n + me);
    for (std::size_t i = 0; i < nseg; ++i) {
      add(plus, to, i, send_counts[q * nseg + i]);
      add(minus, from, i, recv_counts[q * nseg + i]);
    }
  }
  out[0] = plus[0] - minus[0];
  out[1] = plus[1] - minus[1];
}

// The call header: one MPI_Iallreduce of the same 17 integers on every rank, whatever its
// collective, so ranks in different collectives meet here instead of in calls MPI cannot
// pair. Raises on every rank: the lowest failing rank's local error (its category), then,
// as errc::communicator, a disagreement on the collective (naming the lowest rank of the
// smallest and of the largest kind), the datatype, count, root, segment count or row width
// (naming the range and this rank's value). Returns the maximum of `any` and whether the
// pair sums differ from 0 (some sender sends what its receiver does not expect).
struct mpi_header_result {
  long long any = 0;
  bool pairs_disagree = false;
};
inline mpi_header_result mpi_agree_call(mpi_state& s, const mpi::options& opt, const mpi_call& c) {
  constexpr std::size_t k = 5;
  const long long v[k] = {c.type, c.count, c.root, c.segments, c.row_elems};
  static constexpr const char* names[k] = {"the datatype", "the count", "the root", "the segment count",
                                           "the row width"};
  // [error, -failing rank, any, kind high, kind low, values, -values, pair sums]
  std::vector<long long> buf(5 + 2 * k + mpi_header_sums);
  const bool failed = !c.local_error.empty();
  const long long kind = static_cast<long long>(c.kind);
  const long long low_rank = 0x7fffffffLL - s.rank;  // the maximum names the lowest rank
  buf[0] = failed ? 1 : 0;
  buf[1] = failed ? -static_cast<long long>(s.rank) : std::numeric_limits<long long>::min();
  buf[2] = c.any;
  buf[3] = kind * (1LL << 32) + low_rank;                     // the largest kind, its lowest rank
  buf[4] = (mpi_kind_count - kind) * (1LL << 32) + low_rank;  // the smallest kind, its lowest rank
  for (std::size_t i = 0; i < k; ++i) {
    buf[5 + i] = v[i];
    buf[5 + k + i] = -v[i];
  }
  std::memcpy(&buf[5 + 2 * k], &c.pairs[0], sizeof c.pairs[0]);
  std::memcpy(&buf[6 + 2 * k], &c.pairs[1], sizeof c.pairs[1]);
  const MPI_Op op = mpi_header_op();
  {
    mpi_keep keep(buf);
    // The peer access calls wait as they did before the header (idle: peers may compute long).
    if (c.kind == mpi_kind::peer_memory || c.kind == mpi_kind::access_peers || c.kind == mpi_kind::peer_buffer) {
      EPX_MPI_BOUNDED_IDLE(s, opt, &keep,
                           MPI_Iallreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_LONG_LONG, op,
                                          s.comm, &epx_req_));
    } else {
      EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                           MPI_Iallreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_LONG_LONG, op,
                                          s.comm, &epx_req_));
    }
  }
  if (buf[0] != 0) mpi_raise_local(s, opt, buf[1], c.local_error, c.local_category);
  const char* me = mpi_kind_name(c.kind);
  const long long hi_kind = buf[3] >> 32, lo_kind = mpi_kind_count - (buf[4] >> 32);
  if (hi_kind != lo_kind) {
    const long long hi_rank = 0x7fffffffLL - (buf[3] & 0xffffffffLL), lo_rank = 0x7fffffffLL - (buf[4] & 0xffffffffLL);
    EPX_THROW(errc::communicator, me, ": ranks disagree on the collective: rank ", lo_rank, " called ",
              mpi_kind_name(static_cast<mpi_kind>(lo_kind)), ", rank ", hi_rank, " called ",
              mpi_kind_name(static_cast<mpi_kind>(hi_kind)));
  }
  for (std::size_t i = 0; i < k; ++i) {
    const long long hi = buf[5 + i], lo = -buf[5 + k + i];
    if (hi == lo) continue;
    if (i == 0) {
      // By name: "float32", not its number.
      auto name = [](long long x) { return std::string(to_string(static_cast<datatype>(x))); };
      EPX_THROW(errc::communicator, me, ": ranks disagree on the datatype (values from ", name(lo), " to ", name(hi),
                "; rank ", s.rank, " passed ", name(v[i]), ")");
    }
    EPX_THROW(errc::communicator, me, ": ranks disagree on ", names[i], " (values from ", lo, " to ", hi, "; rank ",
              s.rank, " passed ", v[i], ")");
  }
  mpi_header_result r;
  r.any = buf[2];
  r.pairs_disagree = buf[5 + 2 * k] != 0 || buf[6 + 2 * k] != 0;
  return r;
}

// A datatype that is none of epx::datatype's, as the local error of `op` on this rank
// (raised as errc::input on every rank by the agreement); empty for a known one.
inline std::string mpi_unknown_datatype(const mpi_state& s, const char* op, datatype t) {
  if (size_of(t) != 0) return std::string();
  return concat(op, ": rank ", s.rank, " passes datatype ", static_cast<int>(t), ", which is none of epx::datatype's");
}

// The header of a collective without counts to pair (barrier, split, the peer access
// calls, and the equal-count collectives through mpi_agree_same). Returns the maximum of `any`.
inline long long mpi_agree_kind(mpi_state& s, const mpi::options& opt, mpi_kind kind,
                                const std::string& local_error = std::string(), long long any = 0) {
  mpi_call c;
  c.kind = kind;
  c.local_error = local_error;
  c.any = any;
  return mpi_agree_call(s, opt, c).any;
}

// The common case: the collective, datatype, count and root must agree; `local_error` as for
// mpi_agree (raised as errc::input).
inline void mpi_agree_same(mpi_state& s, const mpi::options& opt, mpi_kind kind, datatype t, std::size_t count,
                           int root = 0, const std::string& local_error = std::string()) {
  mpi_call c;
  c.kind = kind;
  c.type = static_cast<long long>(t);
  c.count = static_cast<long long>(count);
  c.root = root;
  c.local_error = local_error.empty() ? mpi_unknown_datatype(s, mpi_kind_name(kind), t) : local_error;
  mpi_agree_call(s, opt, c);
}

// After a header whose pair sums differ (every rank knows it): every rank learns what each
// peer sends it (an all_to_all of nseg integers per peer), compares it with what it
// expects, and the ranks agree on the first disagreement found; raises it on every rank as
// errc::communicator, naming the receiver, the sender, the segment and both counts.
[[noreturn]] inline void mpi_name_pair_disagreement(mpi_state& s, const mpi::options& opt, mpi_kind kind,
                                                    const std::size_t* send_counts, const std::size_t* recv_counts,
                                                    std::size_t nseg, datatype t) {
  const char* op = mpi_kind_name(kind);
  const std::size_t m = static_cast<std::size_t>(s.size) * nseg;
  std::string bad;
  if (nseg <= static_cast<std::size_t>(INT_MAX)) {
    std::vector<unsigned long long> mine(m), theirs(m);  // theirs[p*nseg+i]: what p sends me in segment i
    for (std::size_t j = 0; j < m; ++j) mine[j] = send_counts[j];
    if (m > 0) {
      mpi_keep keep(mine, theirs);
      EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                           MPI_Ialltoall(mine.data(), static_cast<int>(nseg), MPI_UNSIGNED_LONG_LONG, theirs.data(),
                                         static_cast<int>(nseg), MPI_UNSIGNED_LONG_LONG, s.comm, &epx_req_));
    }
    const bool segmented = kind != mpi_kind::all_to_allv;
    for (std::size_t j = 0; j < m && bad.empty(); ++j) {
      if (theirs[j] != recv_counts[j])
        bad = concat(op, ": send and receive counts disagree: rank ", s.rank, " expects ", recv_counts[j], " ",
                     to_string(t), " elements", segmented ? concat(" in segment ", j % nseg) : std::string(),
                     " from rank ", j / nseg, ", which sends ", theirs[j]);
    }
  }
  mpi_agree(s, opt, op, {}, bad, errc::communicator);
  // Not reached when the counts differ: the sums differ only then.
  EPX_THROW(errc::communicator, op, ": send and receive counts disagree (", nseg, " segments per peer)");
}

// The count check of all_to_allv (nseg 1), all_to_allv_segments and all_to_allv_indexed
// (arrays [peers][nseg], in elements): one header that also agrees on the datatype, the
// segment count (and row width) and sums the pairs (mpi_pair_sums); only when the pairs
// disagree, the all_to_all that names them. `local_error`: this rank's own argument error
// (errc::input on every rank). Returns whether any rank needs the chunked path (`large`).
inline bool mpi_check_pairs(mpi_state& s, const mpi::options& opt, mpi_kind kind, const std::size_t* send_counts,
                            const std::size_t* recv_counts, std::size_t nseg, datatype t, bool large,
                            std::size_t row_elems = 0, const std::string& local_error = std::string()) {
  mpi_call c;
  c.kind = kind;
  c.type = static_cast<long long>(t);
  c.segments = kind == mpi_kind::all_to_allv ? 0 : static_cast<long long>(nseg);
  c.row_elems = static_cast<long long>(row_elems);
  c.any = large ? 1 : 0;
  c.local_error = local_error.empty() ? mpi_unknown_datatype(s, mpi_kind_name(kind), t) : local_error;
  if (c.local_error.empty()) mpi_pair_sums(s, send_counts, recv_counts, nseg, c.pairs);
  const mpi_header_result r = mpi_agree_call(s, opt, c);
  if (r.pairs_disagree) mpi_name_pair_disagreement(s, opt, kind, send_counts, recv_counts, nseg, t);
  return r.any != 0;
}

// Without the count check: whether any rank passed `mine` = true (one MPI_Allreduce(MAX)),
// so that every rank takes the same path.
inline bool mpi_any(mpi_state& s, const mpi::options& opt, bool mine) {
  std::vector<int> l(1, mine ? 1 : 0);  // not on the stack: a timed-out request keeps writing it
  mpi_keep keep(l);
  EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                       MPI_Iallreduce(MPI_IN_PLACE, l.data(), 1, MPI_INT, MPI_MAX, s.comm, &epx_req_));
  return l[0] != 0;
}

}  // namespace epx::detail
