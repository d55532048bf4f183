// epx/comm/mpi/agreement.hpp: how the ranks of an MPI communicator agree before a collective
// (needs <mpi.h>).
//
// With `options::check_counts` (default on) every collective first agrees, with one small
// MPI_Allreduce, that all ranks called it with the same datatype and counts (and root, and,
// for all_to_all, all_reduce, reduce_scatter, all_gather and broadcast, the same collective);
// a rank's own bad argument travels in the same reduction, so it reaches every rank.
// all_to_allv (and all_to_allv_segments) also exchange the counts (an all_to_all of one
// integer per peer and segment) and check that what each sender sends is what its receiver
// expects. A disagreement raises epx::error(errc::communicator) on every rank, naming the
// values; a rank's bad argument raises its category (errc::input) on every rank, with the
// lowest such rank's message. The same reduction tells every rank whether any of them
// needs the chunked path (epx/comm/mpi/transport.hpp), so that all take the same one.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
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
  if (buf[0] != 0) {
    const int culprit = static_cast<int>(-buf[1]);  // lowest failing rank
    std::vector<char> msg;
    if (culprit == s.rank) msg.assign(local_error.begin(), local_error.end());
    // [length, category]: the culprit's category, which may differ from this rank's.
    std::vector<int> len = {static_cast<int>(std::min<std::size_t>(msg.size(), 4096)),
                            static_cast<int>(local_category)};
    {
      mpi_keep keep(len);
      EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                           MPI_Ibcast(len.data(), 2, MPI_INT, culprit, s.comm, &epx_req_));
    }
    msg.resize(static_cast<std::size_t>(len[0]) + 1);
    {
      mpi_keep keep(msg);
      EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                           MPI_Ibcast(msg.data(), len[0], MPI_CHAR, culprit, s.comm, &epx_req_));
    }
    throw error(static_cast<errc>(len[1]), std::string(msg.data(), static_cast<std::size_t>(len[0])), EPX_HERE);
  }
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

// The collectives that agree through mpi_agree_same, numbered: ranks in different ones
// make the same agreement (one MPI_Iallreduce of the same length), and then calls that MPI
// can pair (the small all_reduce and all_gather are both one MPI_Iallgather), so the
// collective itself must agree too. 0: another name.
inline constexpr const char* mpi_same_collectives[] = {"all_to_all", "all_reduce", "reduce_scatter", "all_gather",
                                                       "broadcast"};
inline long long mpi_collective_id(const char* op) {
  long long id = 1;
  for (const char* name : mpi_same_collectives) {
    if (std::string(op) == name) return id;
    ++id;
  }
  return 0;
}

// A datatype that is none of epx::datatype's, as the local error of `op` on this rank
// (raised as errc::input on every rank by the agreement); empty for a known one.
inline std::string mpi_unknown_datatype(const mpi_state& s, const char* op, datatype t) {
  if (size_of(t) != 0) return std::string();
  return concat(op, ": rank ", s.rank, " passes datatype ", static_cast<int>(t), ", which is none of epx::datatype's");
}

// The common case: the collective, datatype, count and root must agree; `local_error` as for
// mpi_agree (raised as errc::input).
inline void mpi_agree_same(mpi_state& s, const mpi::options& opt, const char* op, datatype t,
                           std::size_t count, int root = 0, const std::string& local_error = std::string()) {
  const std::string unknown = local_error.empty() ? mpi_unknown_datatype(s, op, t) : std::string();
  mpi_agree(s, opt, op,
            {{"the collective (1 all_to_all, 2 all_reduce, 3 reduce_scatter, 4 all_gather, 5 broadcast)",
              mpi_collective_id(op)},
             {"the datatype", static_cast<long long>(t)},
             {"the count", static_cast<long long>(count)},
             {"the root", root}},
            unknown.empty() ? local_error : unknown, errc::input);
}

// all_to_allv's count check: every rank learns what each peer sends it and compares it with
// what it expects; then every rank agrees on the datatype and on the verdict. Returns
// whether any rank needs the chunked path (`large` on some rank).
inline bool mpi_check_counts_v(mpi_state& s, const mpi::options& opt, const std::size_t* send_counts,
                               const std::size_t* recv_counts, datatype t, bool large) {
  const auto n = static_cast<std::size_t>(s.size);
  std::vector<unsigned long long> mine(n), theirs(n);  // theirs[p]: what p sends to me
  for (std::size_t p = 0; p < n; ++p) mine[p] = send_counts[p];
  {
    mpi_keep keep(mine, theirs);
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                         MPI_Ialltoall(mine.data(), 1, MPI_UNSIGNED_LONG_LONG, theirs.data(), 1,
                                       MPI_UNSIGNED_LONG_LONG, s.comm, &epx_req_));
  }
  std::string bad = mpi_unknown_datatype(s, "all_to_allv", t);
  const errc category = bad.empty() ? errc::communicator : errc::input;
  for (std::size_t p = 0; p < n && bad.empty(); ++p) {
    if (theirs[p] != recv_counts[p])
      bad = concat("all_to_allv: send and receive counts disagree: rank ", s.rank, " expects ", recv_counts[p], " ",
                   to_string(t), " elements from rank ", p, ", which sends ", theirs[p]);
  }
  return mpi_agree(s, opt, "all_to_allv", {{"the datatype", static_cast<long long>(t)}}, bad, category,
                   large ? 1 : 0) != 0;
}

// all_to_allv_segments' count check: as mpi_check_counts_v, per peer and segment (arrays
// [peers][nseg]). The datatype and the segment count are agreed first (the count exchange's
// shape depends on them: ranks with different counts would match different calls), then
// the counts. `local_error`: this rank's own argument error, raised (errc::input) on every
// rank by the first agreement. Returns whether any rank needs the chunked path.
inline bool mpi_check_segment_counts(mpi_state& s, const mpi::options& opt, const std::size_t* send_counts,
                                     const std::size_t* recv_counts, std::size_t nseg, datatype t, bool large,
                                     const char* op = "all_to_allv_segments",
                                     const std::string& local_error = std::string()) {
  const std::string unknown = local_error.empty() ? mpi_unknown_datatype(s, op, t) : std::string();
  mpi_agree(s, opt, op, {{"the datatype", static_cast<long long>(t)}, {"the segment count", static_cast<long long>(nseg)}},
            unknown.empty() ? local_error : unknown, errc::input);
  const std::size_t m = static_cast<std::size_t>(s.size) * nseg;
  std::vector<unsigned long long> mine(m), theirs(m);  // theirs[p*nseg+i]: what p sends me in segment i
  for (std::size_t j = 0; j < m; ++j) mine[j] = send_counts[j];
  if (m > 0 && nseg <= static_cast<std::size_t>(INT_MAX)) {
    mpi_keep keep(mine, theirs);
    EPX_MPI_BOUNDED_KEEP(s, opt, mpi_buffers::own, &keep,
                         MPI_Ialltoall(mine.data(), static_cast<int>(nseg), MPI_UNSIGNED_LONG_LONG, theirs.data(),
                                       static_cast<int>(nseg), MPI_UNSIGNED_LONG_LONG, s.comm, &epx_req_));
  }
  std::string bad;
  for (std::size_t j = 0; j < m && bad.empty() && nseg <= static_cast<std::size_t>(INT_MAX); ++j) {
    if (theirs[j] != recv_counts[j])
      bad = concat(op, ": send and receive counts disagree: rank ", s.rank, " expects ",
                   recv_counts[j], " ", to_string(t), " elements in segment ", j % nseg, " from rank ", j / nseg,
                   ", which sends ", theirs[j]);
  }
  return mpi_agree(s, opt, op, {}, bad, errc::communicator, large ? 1 : 0) != 0;
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
