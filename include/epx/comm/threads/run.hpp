// epx/comm/threads/run.hpp: epx::threads::run, N ranks as N threads of one process.
#pragma once

#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "epx/comm/threads/communicator.hpp"
#include "epx/comm/threads/options.hpp"
#include "epx/comm/threads/state.hpp"
#include "epx/core/error.hpp"

namespace epx {

namespace threads {

// Runs f(comm) on n threads, comm being rank i of n (an `epx::threads::communicator&`).
// Returns when every thread has finished. If an exception escapes any rank's function, the
// run is aborted (the other ranks' pending and later collectives throw
// epx::error(errc::communicator)) and, after all threads have joined, the first exception
// that escaped is rethrown on the calling thread as it was thrown (an epx::error keeps its
// category and message). Errors that the functions catch are theirs: a collective whose
// calls disagree, bad input the layer found on every rank, even a communicator ended by the
// watchdog. If every function returns normally, so does run.
template <class F>
void run(int n, F&& f, const options& opts = {}) {
  EPX_REQUIRE(n >= 1, errc::configuration, "threads::run: number of ranks (", n, ") must be at least 1");
  EPX_REQUIRE(opts.timeout.count() > 0, errc::configuration, "threads::run: watchdog timeout (",
              opts.timeout.count(), " ms) must be positive");
  EPX_REQUIRE(opts.memory.copy != nullptr || opts.memory.host_accessible, errc::configuration,
              "threads::run: memory '", opts.memory.name ? opts.memory.name : "?",
              "' is not host-accessible but names no copy function");
  auto world = std::make_shared<detail::threads_world>(n, opts.timeout, opts.memory);
  std::vector<int> ranks(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) ranks[static_cast<std::size_t>(i)] = i;
  auto group = world->make_group(std::move(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  auto body = [&world, &group, &f](int i) {
    try {
      communicator comm = detail::threads_access::make(world, group, i);
      f(comm);
    } catch (...) {
      world->fail(i, std::current_exception());
    }
    world->mark_finished(i);
  };
  try {
    for (int i = 0; i < n; ++i) threads.emplace_back(body, i);
  } catch (...) {
    world->fail(-1, std::make_exception_ptr(epx::error(errc::internal, detail::concat(
        "threads::run: could not start thread ", threads.size(), " of ", n, ": ",
        detail::describe_exception(std::current_exception())), EPX_HERE)));
  }
  for (auto& t : threads) t.join();
  if (auto e = world->first_failure()) std::rethrow_exception(e);
}

}  // namespace threads

}  // namespace epx
