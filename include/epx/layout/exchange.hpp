// epx/layout/exchange.hpp: the count exchange and group-wide input checks.
//
// Every rank of the EP group contributes one int64 record
//   [status, N, H, k, world rank, mode, counts[0..ncounts)]
// and all_gathers them. status != 0 means the rank found bad input (shapes, expert ids,
// non-finite weights). H, k and the mode (record_training for a training forward,
// record_inference for an inference one: the two take different routes; record_combine for
// the combine of the PyTorch bindings, whose record has dispatch's size, so that ranks whose
// calls got out of step raise) must agree across the group, N within each TP group (tp consecutive
// ep ranks). If anything is wrong every rank sees it in the same records, so
// every rank raises epx::error(errc::input) naming the offending ranks and values before
// any row moves, and nobody hangs. Only on that error path a second all_gather carries
// each failing rank's own message (fixed 256 bytes).
//
// A forward call builds its record on the execution policy (plan_record: the status takes
// the send plan's bad-pair flag, the counts come from the plan's summary) and exchanges it
// with exchange_policy_records: the gathered records reach the host with one
// synchronisation, the call's only one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/host.hpp"
#include "epx/comm/settle.hpp"
#include "epx/exec/host_copy.hpp"

namespace epx::detail {

inline constexpr std::size_t record_header = 6;
// The kinds of call a record's mode names (its field 5).
inline constexpr std::int64_t record_inference = 0;
inline constexpr std::int64_t record_training = 1;
inline constexpr std::int64_t record_combine = 2;
inline constexpr std::size_t message_bytes = 256;

// The gathered records of a group: [size][record_header + ncounts].
struct group_records {
  std::vector<std::int64_t> data;
  std::size_t stride = record_header;
  int size = 0;

  std::int64_t status(int r) const { return data[static_cast<std::size_t>(r) * stride + 0]; }
  std::int64_t rows(int r) const { return data[static_cast<std::size_t>(r) * stride + 1]; }
  std::int64_t hidden(int r) const { return data[static_cast<std::size_t>(r) * stride + 2]; }
  std::int64_t top_k(int r) const { return data[static_cast<std::size_t>(r) * stride + 3]; }
  std::int64_t world_rank(int r) const { return data[static_cast<std::size_t>(r) * stride + 4]; }
  std::int64_t mode(int r) const { return data[static_cast<std::size_t>(r) * stride + 5]; }
  const std::int64_t* counts(int r) const { return data.data() + static_cast<std::size_t>(r) * stride + record_header; }
};

// Checks gathered records (g.data filled) and raises errc::input on every rank of `comm`
// when anything is wrong. `message()` gives this rank's own message; it is called only
// on the error path and only when this rank's status is not 0.
template <class Comm, class Message>
void check_records(Comm& comm, const group_records& g, int me, Message&& message, const char* what, int tp) {
  std::string why;
  bool failed = false;
  for (int r = 0; r < g.size; ++r) failed = failed || g.status(r) != 0;
  const int group_tp = std::max(1, tp);
  for (int r = 0; r < g.size; ++r) {
    if (g.status(r) != 0) continue;
    // Compare with the first rank whose own input was fine.
    int ref = -1;
    for (int s = 0; s < g.size; ++s)
      if (g.status(s) == 0) { ref = s; break; }
    const int tp_first = (r / group_tp) * group_tp;
    int tref = -1;
    for (int s = tp_first; s < std::min(g.size, tp_first + group_tp); ++s)
      if (g.status(s) == 0) { tref = s; break; }
    if (g.hidden(r) != g.hidden(ref)) {
      why += concat("; rank ", g.world_rank(r), " has hidden size H=", g.hidden(r), " but rank ", g.world_rank(ref),
                    " has H=", g.hidden(ref));
      failed = true;
    }
    if (g.top_k(r) != g.top_k(ref)) {
      why += concat("; rank ", g.world_rank(r), " has top_k=", g.top_k(r), " but rank ", g.world_rank(ref),
                    " has top_k=", g.top_k(ref));
      failed = true;
    }
    if (g.mode(r) != g.mode(ref)) {
      const auto name = [](std::int64_t m) {
        return m == record_training ? "a training call (mode::train)"
               : m == record_combine ? "a combine"
                                     : "an inference call";
      };
      why += concat("; rank ", g.world_rank(r), " makes ", name(g.mode(r)), " but rank ", g.world_rank(ref), " makes ",
                    name(g.mode(ref)), " (every rank of the group must pass the same mode)");
      failed = true;
    }
    if (g.rows(r) != g.rows(tref)) {
      why += concat("; rank ", g.world_rank(r), " has N=", g.rows(r), " rows but rank ", g.world_rank(tref),
                    " of the same tensor-parallel group has N=", g.rows(tref));
      failed = true;
    }
  }
  if (!failed) return;

  // Error path: every rank gets there from the same records, so this all_gather matches.
  const std::string mine = g.status(me) != 0 ? std::string(message()) : std::string();
  std::vector<char> msg(message_bytes, '\0');
  std::memcpy(msg.data(), mine.data(), std::min(mine.size(), message_bytes - 1));
  std::vector<char> all(message_bytes * static_cast<std::size_t>(g.size), '\0');
  all_gather_host(comm, msg.data(), message_bytes, all.data());
  rank_messages bad;  // one entry per distinct message, with the ranks that report it
  for (int r = 0; r < g.size; ++r) {
    if (g.status(r) == 0) continue;
    const char* m = all.data() + static_cast<std::size_t>(r) * message_bytes;
    bad.add(g.world_rank(r), std::string(m, std::find(m, m + message_bytes, '\0')));
  }
  throw error(errc::input, concat(what, ": bad input in the expert-parallel group", bad.str(), why), EPX_HERE);
}

// Collective over `comm`. `counts` (host memory, ncounts entries) may be null when
// ncounts == 0. `what` names the call in messages; `tp` is the TP group size inside comm
// (N must agree within each run of tp consecutive ranks; pass comm.size() when every rank
// must hold the same N).
template <class Comm>
group_records exchange_records(Comm& comm, std::int64_t status, std::size_t N, std::size_t H, int k,
                               int world_rank, const std::int64_t* counts, std::size_t ncounts,
                               const std::string& message, const char* what, int tp, std::int64_t mode = 0) {
  group_records g;
  g.size = comm.size();
  g.stride = record_header + ncounts;
  std::vector<std::int64_t> mine(g.stride, 0);
  mine[0] = status;
  mine[1] = static_cast<std::int64_t>(N);
  mine[2] = static_cast<std::int64_t>(H);
  mine[3] = k;
  mine[4] = world_rank;
  mine[5] = mode;
  if (ncounts) std::memcpy(mine.data() + record_header, counts, ncounts * sizeof(std::int64_t));
  const std::size_t total = g.stride * static_cast<std::size_t>(g.size);
  g.data.assign(total, 0);
  all_gather_host(comm, mine.data(), g.stride, g.data.data());
  check_records(comm, g, comm.rank(), [&] { return message; }, what, tp);
  return g;
}

// This rank's record of the count exchange, built where the send plan lives (so the plan
// needs no read-back of its own): record[0] = `status`, or 2 when the plan's pass 1 found a
// bad pair (chunk_bad[c] >= 0 for some chunk); then N, H, k, the world rank, the mode; then
// `ncounts` counts and `nextra` further figures (node statistics). Call with i in
// [0, record_header + ncounts + nextra).
struct plan_record {
  std::int64_t status, rows, hidden, top_k, world_rank;
  const std::int64_t* chunk_bad;  // [chunks]
  std::size_t chunks;
  const std::int64_t* counts;     // [ncounts] or null
  std::size_t ncounts;
  const std::int64_t* extra;      // [nextra] or null
  std::size_t nextra;
  std::int64_t* record;           // [record_header + ncounts + nextra]
  std::int64_t mode = 0;          // 1: a training forward

  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    if (i >= record_header) {
      const std::size_t j = i - record_header;
      record[i] = j < ncounts ? counts[j] : extra[j - ncounts];
      return;
    }
    std::int64_t v = 0;
    switch (i) {
      case 0:
        v = status;
        for (std::size_t c = 0; v == 0 && c < chunks; ++c)
          if (chunk_bad[c] >= 0) v = 2;
        break;
      case 1: v = rows; break;
      case 2: v = hidden; break;
      case 3: v = top_k; break;
      case 4: v = world_rank; break;
      default: v = mode; break;
    }
    record[i] = v;
  }
};

// The exchange of records that live in the policy's memory (`record`, `stride` entries,
// e.g. from plan_record): the group's records reach the host with one synchronisation,
// whatever the communicator (a device communicator gathers on the policy's queue and the
// host waits once for the result; a host communicator gathers host copies, made with one
// wait). Then as exchange_records: errc::input on every rank when anything is wrong,
// with `message()` (called on the error path only) as this rank's message.
template <class Comm, class Exec, class Message>
group_records exchange_policy_records(Comm& comm, const Exec& ex, const std::int64_t* record, std::size_t stride,
                                      Message&& message, const char* what, int tp) {
  group_records g;
  g.size = comm.size();
  g.stride = stride;
  const std::size_t total = g.stride * static_cast<std::size_t>(g.size);
  g.data.assign(total, 0);
  if constexpr (is_device_communicator_v<Comm>) {
    auto recv = exec::make_buffer<std::int64_t>(ex, total);
    all_gather(comm, span<const std::int64_t>(record, stride), span<std::int64_t>(recv.data(), total));
    read_back(ex, comm, static_cast<const std::int64_t*>(recv.data()), total, g.data.data());
  } else {
    std::vector<std::int64_t> mine(stride);
    if constexpr (exec::is_host_policy_v<Exec>) {
      std::copy(record, record + stride, mine.begin());
    } else {
      exec::copy_n(ex, record, stride, mine.data());
      settle(ex, comm);
    }
    all_gather(comm, span<const std::int64_t>(mine.data(), stride), span<std::int64_t>(g.data.data(), total));
  }
  check_records(comm, g, comm.rank(), message, what, tp);
  return g;
}

// Backward's shapes against the forward call's, as a sentence ("" when they agree).
template <class Args>
std::string backward_shape_error(const Args& a, std::size_t rows, std::size_t hidden, int top_k) {
  if (a.rows == rows && a.hidden == hidden && a.top_k == top_k) return {};
  return concat("backward shapes N=", a.rows, " H=", a.hidden, " k=", a.top_k, " differ from the forward call's N=",
                rows, " H=", hidden, " k=", top_k);
}

// Backward's agreement check: this rank's status (its own, or 1 when the backward shapes
// differ from the forward call's) and the number of the forward call whose state it takes
// back (saved_state::call), exchanged over the EP group so that every rank raises
// together: errc::input when a status fails, or when the ranks take back different calls
// (their layouts differ: the rows would be read in the wrong places). `tp`: as for
// exchange_records.
template <class Comm, class Args>
void exchange_backward_status(Comm& comm, const Args& a, std::size_t rows, std::size_t hidden,
                              int top_k, int world_rank, int tp, std::uint64_t call = 0) {
  std::int64_t status = a.status;
  std::string msg = a.status_message;
  if (status == 0) {
    msg = backward_shape_error(a, rows, hidden, top_k);
    status = msg.empty() ? 0 : 1;
  }
  const auto mine = static_cast<std::int64_t>(call);
  const group_records g = exchange_records(comm, status, a.rows, a.hidden, a.top_k, world_rank, &mine, 1, msg,
                                           "moe_layer backward", tp);
  for (int r = 1; r < g.size; ++r)
    if (g.counts(r)[0] != g.counts(0)[0])
      throw error(errc::input,
                  concat("moe_layer backward: the ranks of the expert-parallel group take back different forward "
                         "calls: rank ", g.world_rank(0), " passes the saved state of the layer's forward call ",
                         g.counts(0)[0], ", rank ", g.world_rank(r), " that of call ", g.counts(r)[0],
                         " (every rank must take back the same call: backward in the same order on every rank)"),
                  EPX_HERE);
}

// Backward's agreement check when this rank's saved state is unusable (`why`,
// saved_state::unusable_as): this rank
// joins the exchange of exchange_backward_status with a failed status, so that every rank
// of the group raises errc::input naming it.
template <class Comm, class Args>
[[noreturn]] void reject_saved_state(Comm& comm, const Args& a, const char* why, int world_rank, int tp) {
  Args bad = a;
  bad.status = 1;
  bad.status_message = why;
  exchange_backward_status(comm, bad, a.rows, a.hidden, a.top_k, world_rank, tp);
  throw error(errc::internal, "reject_saved_state: the exchange did not raise", EPX_HERE);
}

}  // namespace epx::detail
