// epx/comm/mpi/wait.hpp: the watchdog wait of the MPI backend (needs <mpi.h>).
//
// Every collective of epx::mpi::communicator but split runs as the nonblocking MPI call and
// waits for it here: with `options::timeout` (default 10 minutes) the requests are polled,
// and a collective still unfinished at the deadline is a watchdog timeout, so a rank that
// stalls or leaves turns into an error on the ranks that wait instead of a hang. A zero
// timeout waits forever (MPI_Waitall).
//
// A timed-out request stays pending (MPI cannot cancel a collective), and it still reads
// and writes its buffers whenever the late rank arrives. So a timeout must not free them:
//   - calls whose buffers are all the library's own (the agreement reductions, the count
//     exchanges, barrier, the small all_reduce, which copies its input into its own
//     buffer first) raise epx::error(errc::communicator). The requests and those buffers
//     move into the communicator's state (mpi_state::orphans), which keeps them until the
//     requests complete (mpi_state frees them then, or never), and the communicator is
//     marked failed: every later collective on it, on any copy, raises at once;
//   - calls that read or write the caller's buffers (the row exchanges, all_to_all,
//     all_gather, broadcast, the large all_reduce, reduce_scatter) end the job instead:
//     "epx: rank R failed: <the watchdog's message>" and MPI_Abort. Raising would unwind
//     the caller, whose buffers a late rank could then write into after they were freed.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epx/comm/detail/deadline.hpp"
#include "epx/comm/mpi/options.hpp"
#include "epx/comm/mpi/state.hpp"
#include "epx/comm/mpi/support.hpp"
#include "epx/core/error.hpp"

namespace epx::detail {

// Whose memory a nonblocking call touches until it completes.
enum class mpi_buffers {
  own,     // only the library's (listed in an mpi_keep): a timeout raises
  caller,  // the caller's too: a timeout ends the job
  gate,    // the library's, and a blocking MPI call follows (a window's allocation, a
           // communicator split): a timeout ends the job, since a late rank would pass the
           // pending call and then block in a call that this rank never makes
};

// The library's buffers of one nonblocking call (std::vectors, up to 4). On a timeout they
// move into the communicator's state; a vector's move keeps its data where it is, so the
// pending request keeps writing into live memory.
class mpi_keep {
 public:
  mpi_keep() = default;
  template <class... V>
  explicit mpi_keep(std::vector<V>&... v) {
    (add(v), ...);
  }
  template <class V>
  void add(std::vector<V>& v) {
    if (n_ == max) return;
    e_[n_++] = {&v, [](void* p) -> std::shared_ptr<void> {
                  return std::make_shared<std::vector<V>>(std::move(*static_cast<std::vector<V>*>(p)));
                }};
  }
  std::vector<std::shared_ptr<void>> take() {
    std::vector<std::shared_ptr<void>> r;
    for (int i = 0; i < n_; ++i) r.push_back(e_[i].move(e_[i].v));
    n_ = 0;
    return r;
  }

 private:
  static constexpr int max = 4;
  struct entry {
    void* v;
    std::shared_ptr<void> (*move)(void*);
  };
  entry e_[max] = {};
  int n_ = 0;
};

// Raises when an earlier watchdog timeout left this communicator failed, or when a thread
// other than MPI's main thread calls where MPI provides less than MPI_THREAD_SERIALIZED
// (MPI would crash or corrupt its state, not report it); else names `op` as the collective
// in progress.
inline void mpi_enter(mpi_state& s, const char* op) {
  if (s.thread_level < MPI_THREAD_SERIALIZED) {
    int main_thread = 1;
    if (MPI_Is_thread_main(&main_thread) == MPI_SUCCESS && !main_thread)
      throw error(errc::configuration,
                  concat("MPI ", op, " on rank ", s.rank, ": called from a thread other than the one that initialised MPI, "
                         "which MPI's thread level ",
                         s.thread_level == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : "MPI_THREAD_FUNNELED",
                         " does not allow (nothing was sent); initialise MPI with MPI_THREAD_SERIALIZED (one thread "
                         "in MPI at a time) or MPI_THREAD_MULTIPLE (threads on different communicators at once), "
                         "e.g. MPI_Init_thread or epx::mpi::environment(argc, argv, MPI_THREAD_MULTIPLE)"),
                  EPX_HERE);
  }
  if (!s.failed.empty())
    throw error(errc::communicator,
                concat("MPI ", op, " on rank ", s.rank, ": this communicator failed earlier and cannot be used (",
                       s.failed, ")"),
                EPX_HERE);
  s.op = op;
}

// Prints "epx: rank R failed: <message>" and aborts every process (as epx::mpi::run does
// for an escaping exception).
[[noreturn]] inline void mpi_end_job(const std::string& message) noexcept {
  int r = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  std::fprintf(stderr, "epx: rank %d failed: %s\n", r, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

// Waits for n requests of the collective `s.op` on the communicator of `s`, under the
// watchdog of `opt` (see above). `kind` says whose buffers the requests touch; `keep`
// lists the library's own (kind == own).
//
// `idle`: the requests only synchronize (a barrier, a gather of a few bytes), so a long wait
// means that peers still compute; past the first few thousand polls the wait then sleeps
// 50 us between polls instead of spinning, so that ranks sharing cores (more ranks than
// cores) leave them to the ranks still working. Calls that move data keep polling, which
// is what drives their progress.
// An MPI_Waitall / MPI_Testall return code `rc` other than MPI_SUCCESS as epx::error(errc::mpi)
// naming the collective and the rank; for an error that shows only when a request completes
// (MPI_ERR_IN_STATUS), each failing request's own error from `st`.
[[noreturn]] inline void mpi_raise_wait(const mpi_state& s, int rc, const MPI_Status* st, int n) {
  std::string why = mpi_error_string(rc);
  int cls = rc;
  if (MPI_Error_class(rc, &cls) == MPI_SUCCESS && cls == MPI_ERR_IN_STATUS)
    for (int i = 0; i < n; ++i)
      if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING)
        why += concat("; request ", i, ": ", mpi_error_string(st[i].MPI_ERROR));
  throw error(errc::mpi, concat("MPI ", s.op, " on rank ", s.rank, " failed: ", why), EPX_HERE, rc);
}

inline void mpi_wait_bounded(mpi_state& s, const mpi::options& opt, MPI_Request* reqs, int n,
                             mpi_buffers kind = mpi_buffers::caller, mpi_keep* keep = nullptr, bool idle = false) {
  if (n == 0) return;
  std::vector<MPI_Status> st(static_cast<std::size_t>(n));
  if (opt.timeout.count() == 0) {
    const int rc = MPI_Waitall(n, reqs, st.data());
    if (rc != MPI_SUCCESS) mpi_raise_wait(s, rc, st.data(), n);
    return;
  }
  const auto deadline = deadline_after(opt.timeout);
  for (unsigned spin = 1;; ++spin) {
    int done = 0;
    const int rc = MPI_Testall(n, reqs, &done, st.data());
    if (rc != MPI_SUCCESS) mpi_raise_wait(s, rc, st.data(), n);
    if (done) return;
    const bool sleep = idle && spin >= 4096;
    if (spin % 64 == 0 || sleep) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string msg = concat("watchdog: MPI ", s.op, " on rank ", s.rank, " of a communicator of ", s.size,
                                 " ranks still waits after ", opt.timeout.count(),
                                 " ms: a rank stalled, died, or returned without calling it (one that caught an "
                                 "exception and went on leaves its peers here until this limit: epx::mpi::run, or "
                                 "epx::mpi::abort_job where it catches, ends the job at once)");
        if (kind == mpi_buffers::caller)
          mpi_end_job(msg + " (the job ends: the pending call still reads or writes the caller's buffers)");
        if (kind == mpi_buffers::gate)
          mpi_end_job(msg + " (the job ends: a blocking MPI call follows, in which a late rank would wait forever)");
        mpi_orphan o;
        o.requests.assign(reqs, reqs + n);
        if (keep != nullptr) o.buffers = keep->take();
        s.orphans.push_back(std::move(o));
        s.failed = msg;
        throw error(errc::communicator, msg + " (the communicator cannot be used any more)", EPX_HERE);
      }
      if (sleep) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
    }
  }
}

}  // namespace epx::detail

// Starts the nonblocking MPI call `call`, whose request argument is `&epx_req_`, and waits
// for it under the watchdog of state `s` and options `opt` (mpi_wait_bounded). `kind` and
// `keep`: whose buffers the call touches (see above).
#define EPX_MPI_BOUNDED_KEEP(s, opt, kind, keep, call)                      \
  do {                                                                      \
    MPI_Request epx_req_ = MPI_REQUEST_NULL;                                \
    EPX_MPI_CHECK(call);                                                    \
    ::epx::detail::mpi_wait_bounded((s), (opt), &epx_req_, 1, kind, keep);  \
  } while (0)
// The same for a call that only synchronizes (`idle` above; the library's buffers only).
#define EPX_MPI_BOUNDED_IDLE(s, opt, keep, call)                                                             \
  do {                                                                                                      \
    MPI_Request epx_req_ = MPI_REQUEST_NULL;                                                                \
    EPX_MPI_CHECK(call);                                                                                    \
    ::epx::detail::mpi_wait_bounded((s), (opt), &epx_req_, 1, ::epx::detail::mpi_buffers::own, keep, true); \
  } while (0)
#define EPX_MPI_BOUNDED_ON(s, opt, call) \
  EPX_MPI_BOUNDED_KEEP(s, opt, ::epx::detail::mpi_buffers::caller, nullptr, call)

// Inside epx::mpi::communicator: the same on the communicator's own state and options.
#define EPX_MPI_BOUNDED(call) EPX_MPI_BOUNDED_ON(*s_, opt_, call)
