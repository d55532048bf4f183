// The threads communicator: the shared test body for world sizes 1, 2, 3, 4, 8, and the
// failure paths (a rank that throws, a rank that never arrives, mismatched calls).
#include <doctest/doctest.h>

#include <atomic>
#include <limits>
#include <cstring>
#include <cmath>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_cases.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/threads.hpp"
#include "support/sanitizers.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_threads_cpp {

namespace {

using clock_type = std::chrono::steady_clock;
using std::chrono::milliseconds;

const int world_sizes[] = {1, 2, 3, 4, 8};

// A generous watchdog for the passing cases: a bug fails the test instead of hanging it.
epx::threads::options normal_options() {
  epx::threads::options o;
  o.timeout = std::chrono::seconds(30);
  return o;
}

// A short watchdog for the failure cases.
epx::threads::options short_options() {
  epx::threads::options o;
  o.timeout = std::chrono::seconds(4);  // failures here are immediate; the margin absorbs loaded CI machines
  return o;
}

template <class F>
void for_each_world_size(F f) {
  for (int n : world_sizes) {
    CAPTURE(n);
    epx::threads::run(n, [&](epx::threads::communicator& comm) { f(comm); }, normal_options());
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// After a collective that failed alike on every rank: an all_reduce still gives every rank
// the right sum.
bool still_works(epx::threads::communicator& comm) {
  std::vector<double> x{1.0};
  epx::all_reduce(comm, epx::span<double>(x));
  return x[0] == comm.size();
}

// Per-rank record of the error a rank saw.
struct seen_errors {
  explicit seen_errors(int n) : messages(static_cast<std::size_t>(n)), categories(static_cast<std::size_t>(n)) {}
  void record(int rank, const epx::error& e) {
    std::lock_guard<std::mutex> lk(m);
    messages[static_cast<std::size_t>(rank)] = e.what();
    categories[static_cast<std::size_t>(rank)] = e.category();
  }
  std::mutex m;
  std::vector<std::string> messages;
  std::vector<epx::errc> categories;
};

// Every rank saw errc::communicator with `text` in its message.
void every_rank_saw(const seen_errors& seen, int n, const std::string& text) {
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(seen.categories[static_cast<std::size_t>(r)] == epx::errc::communicator);
    CHECK(contains(seen.messages[static_cast<std::size_t>(r)], text));
  }
}

// A run that must work after a failed one.
void check_next_run_works(int n) {
  std::atomic<int> ok{0};
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    std::vector<double> x{1.0 + comm.rank()};
    epx::all_reduce(comm, epx::span<double>(x));
    if (x[0] == n * (n + 1) / 2.0) ++ok;
  }, short_options());
  CHECK(ok.load() == n);
}

}  // namespace

static_assert(epx::is_communicator_v<epx::threads::communicator>);
static_assert(epx::is_communicator_v<epx::threads::communicator&>);
static_assert(epx::detail::has_native_segments<epx::threads::communicator>::value,
              "the threads communicator moves all segments in one collective");

TEST_CASE("threads: rank and size") {
  for (int n : world_sizes) {
    std::vector<int> ranks(static_cast<std::size_t>(n), -1);
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      CHECK(comm.size() == n);
      CHECK(comm.world_rank() == comm.rank());
      ranks[static_cast<std::size_t>(comm.rank())] = comm.rank();
    });
    for (int r = 0; r < n; ++r) CHECK(ranks[static_cast<std::size_t>(r)] == r);
  }
  CHECK_THROWS_AS(epx::threads::run(0, [](epx::threads::communicator&) {}), epx::error);
}

TEST_CASE("threads: all_to_all, every type") { for_each_world_size([](auto& c) { comm_cases::case_all_to_all(c); }); }
TEST_CASE("threads: all_to_allv, uneven counts, zero-length messages, every type") {
  for_each_world_size([](auto& c) { comm_cases::case_all_to_allv(c); });
}
TEST_CASE("threads: all_to_allv_rows") { for_each_world_size([](auto& c) { comm_cases::case_all_to_allv_rows(c); }); }
TEST_CASE("threads: native all_to_allv_segments, every type, empty segments, nseg 0") {
  for_each_world_size([](auto& c) { comm_cases::case_all_to_allv_segments(c); });
}
static_assert(epx::has_indexed_sends_v<epx::threads::communicator>,
              "the threads communicator reads rows by index as it sends them");

TEST_CASE("threads: native all_to_allv_indexed: rows by index, repeats, empty segments, nseg 0") {
  for_each_world_size([](auto& c) { comm_cases::case_all_to_allv_indexed(c); });
}

namespace {
// The threads communicator without its all_to_allv_indexed: epx::all_to_allv_indexed then
// gathers the rows on the host and calls all_to_allv_segments.
struct without_indexed_sends {
  epx::threads::communicator& c;
  int rank() const { return c.rank(); }
  int size() const { return c.size(); }
  void all_to_allv_segments(const void* send, const std::size_t* sc, const std::size_t* sd, void* recv,
                            const std::size_t* rc, const std::size_t* rd, std::size_t nseg, epx::datatype t) {
    c.all_to_allv_segments(send, sc, sd, recv, rc, rd, nseg, t);
  }
};
static_assert(!epx::has_indexed_sends_v<without_indexed_sends>);
}  // namespace

TEST_CASE("threads: all_to_allv_indexed through the gathering fallback") {
  for_each_world_size([](auto& c) {
    without_indexed_sends w{c};
    comm_cases::case_all_to_allv_indexed(w);
  });
}

TEST_CASE("threads: all_to_allv_indexed: an index outside src is errc::input before anything moves") {
  epx::threads::run(1, [](epx::threads::communicator& comm) {
    std::vector<float> src(3 * 4, 1.0f), recv(2 * 4, 0.0f);
    const std::vector<std::size_t> sc{2}, sd{0}, rc{2}, rd{0};
    for (std::int64_t bad : {std::int64_t{3}, std::int64_t{-1}}) {
      CAPTURE(bad);
      const std::vector<std::int64_t> rows{0, bad};
      try {
        epx::all_to_allv_indexed(comm, epx::span<const float>(src), epx::span<const std::int64_t>(rows),
                                 epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd), recv.data(),
                                 epx::span<const std::size_t>(rc), epx::span<const std::size_t>(rd), 1, 4);
        FAIL("no error");
      } catch (const epx::error& e) {
        CHECK(e.category() == epx::errc::input);
        CHECK(contains(e.what(), "all_to_allv_indexed: rows[1] = " + std::to_string(bad) +
                                     " (segment 0 to peer 0) is not a row of src (3 rows)"));
      }
      CHECK(recv == std::vector<float>(2 * 4, 0.0f));
    }
    // An index list too short for its segments.
    const std::vector<std::int64_t> one{0};
    CHECK_THROWS_WITH_AS(epx::all_to_allv_indexed(comm, epx::span<const float>(src), epx::span<const std::int64_t>(one),
                                                  epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd),
                                                  recv.data(), epx::span<const std::size_t>(rc),
                                                  epx::span<const std::size_t>(rd), 1, 4),
                         doctest::Contains("segment 0 to peer 0 reads rows[0, 0 + 2) of 1"), epx::error);
    // A displacement whose end does not fit in size_t: still refused, before anything moves.
    const std::vector<std::size_t> far{SIZE_MAX};
    const std::vector<std::int64_t> two{0, 1};
    CHECK_THROWS_WITH_AS(epx::all_to_allv_indexed(comm, epx::span<const float>(src), epx::span<const std::int64_t>(two),
                                                  epx::span<const std::size_t>(sc), epx::span<const std::size_t>(far),
                                                  recv.data(), epx::span<const std::size_t>(rc),
                                                  epx::span<const std::size_t>(rd), 1, 4),
                         doctest::Contains("reads rows[18446744073709551615, 18446744073709551615 + 2) of 2"),
                         epx::error);
    CHECK(recv == std::vector<float>(2 * 4, 0.0f));
  });
}

TEST_CASE("threads: all_to_allv_indexed: mismatched row widths and counts are detected on every rank") {
  const int n = 3;
  for (int which = 0; which < 2; ++which) {
    CAPTURE(which);
    seen_errors seen(n);
    std::atomic<int> recovered{0};
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      const int me = comm.rank();
      std::vector<float> src(4 * 8, 1.0f), recv(4 * 8 * n, 0.0f);
      std::vector<std::int64_t> rows(static_cast<std::size_t>(n), 0);
      std::vector<std::size_t> sc(n, 1), sd(n), rc(n, 1), rd(n);
      for (int p = 0; p < n; ++p) sd[p] = rd[p] = static_cast<std::size_t>(p);
      std::size_t width = 4;
      if (which == 0 && me == 1) width = 8;  // rank 1's rows are twice as wide
      if (which == 1 && me == 2) rc[0] = 2;  // rank 2 expects 2 rows from rank 0, which sends 1
      try {
        comm.all_to_allv_indexed(src.data(), rows.data(), width, sc.data(), sd.data(), recv.data(), rc.data(),
                                 rd.data(), 1, epx::datatype::float32);
      } catch (const epx::error& e) {
        seen.record(me, e);
      }
      if (still_works(comm)) ++recovered;
    }, short_options());
    CHECK(recovered.load() == n);
    every_rank_saw(seen, n, which == 0 ? "all_to_allv_indexed: mismatched row widths: rank 0 passed 4 elements per "
                                         "row, rank 1 passed 8"
                                       : "all_to_allv_indexed: mismatched counts: rank 0 sends 1 rows in segment 0 to "
                                         "rank 2, which expects 2 from it");
  }
}

TEST_CASE("threads: all_reduce, scaled, every type") { for_each_world_size([](auto& c) { comm_cases::case_all_reduce(c); }); }
TEST_CASE("threads: all_reduce and reduce_scatter sum every element in rank order, whichever rank sums its chunk") {
  // Float sums whose value depends on the order: (1e8 + 1) - 1e8 is 0 in float32, another
  // order gives 1. Each rank sums a chunk of all_reduce (and its own block of reduce_scatter);
  // every element of every chunk must be the rank-order sum, bitwise.
  const int n = 3;
  const float v[3] = {1e8f, 1.0f, -1e8f};
  float want = 0.0f;
  for (float x : v) want += x;
  REQUIRE(want == 0.0f);
  const std::size_t count = 3 * 64 * 5;  // several 64-element pieces per rank's chunk
  std::vector<std::string> failures(static_cast<std::size_t>(n));
  epx::threads::run(n, [&](epx::threads::communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const std::vector<float> send(count, v[r]);
    std::vector<float> x = send, block(count / 3);
    epx::all_reduce(c, epx::span<float>(x));
    epx::reduce_scatter(c, epx::span<const float>(send), epx::span<float>(block));
    std::size_t bad = 0;
    for (float y : x) bad += std::memcmp(&y, &want, sizeof y) != 0;
    for (float y : block) bad += std::memcmp(&y, &want, sizeof y) != 0;
    if (bad) failures[r] = std::to_string(bad) + " elements are not the rank-order sum";
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("threads: reduce_scatter") { for_each_world_size([](auto& c) { comm_cases::case_reduce_scatter(c); }); }
TEST_CASE("threads: all_gather") { for_each_world_size([](auto& c) { comm_cases::case_all_gather(c); }); }
TEST_CASE("threads: broadcast") { for_each_world_size([](auto& c) { comm_cases::case_broadcast(c); }); }
TEST_CASE("threads: barrier") { for_each_world_size([](auto& c) { comm_cases::case_barrier(c); }); }
TEST_CASE("threads: split by color and key") { for_each_world_size([](auto& c) { comm_cases::case_split(c); }); }
TEST_CASE("threads: sub-communicators of every mesh group") {
  for_each_world_size([](auto& c) { comm_cases::case_sub_communicators(c); });
}
TEST_CASE("threads: 64 MiB messages") {
#ifdef EPX_TEST_UNDER_TSAN
  const int sizes[] = {2};  // every byte copied is checked by the sanitizer: keep it to one size
#else
  const int sizes[] = {2, 8};
#endif
  for (int n : sizes) {
    CAPTURE(n);
    epx::threads::run(n, [](auto& c) { comm_cases::case_large(c); }, normal_options());
  }
}

TEST_CASE("threads: long random sequences of small collectives (slot reuse between back-to-back calls)") {
  for (int n : {2, 3, 8}) {
    CAPTURE(n);
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      const int me = comm.rank();
      std::size_t bad = 0;
      for (std::uint64_t it = 0; it < 400; ++it) {
        const std::uint64_t h = comm_cases::hash(77, it, 0, 0);  // the same op on every rank
        switch (h % 5) {
          case 0: {  // all_to_allv with fresh counts each time
            std::vector<std::size_t> sc(n), sd(n), rc(n), rd(n);
            std::size_t so = 0, ro = 0;
            for (int p = 0; p < n; ++p) {
              sc[p] = comm_cases::hash(it, me, p, 1) % 4;
              sd[p] = so;
              so += sc[p];
              rc[p] = comm_cases::hash(it, p, me, 1) % 4;
              rd[p] = ro;
              ro += rc[p];
            }
            std::vector<std::int64_t> send(so), recv(ro, -1);
            for (int p = 0; p < n; ++p)
              for (std::size_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = static_cast<std::int64_t>(it * 1000 + me * 10 + p);
            comm.all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), epx::datatype::int64);
            for (int p = 0; p < n; ++p)
              for (std::size_t i = 0; i < rc[p]; ++i) bad += recv[rd[p] + i] != static_cast<std::int64_t>(it * 1000 + p * 10 + me);
            break;
          }
          case 1: {
            std::vector<double> x(1 + h % 300, static_cast<double>(me + it));
            epx::all_reduce(comm, epx::span<double>(x), 2.0);
            const double want = 2.0 * (n * (n - 1) / 2.0 + static_cast<double>(n) * static_cast<double>(it));
            for (double v : x) bad += v != want;
            break;
          }
          case 2: {
            const int root = static_cast<int>(h % static_cast<std::uint64_t>(n));
            std::vector<std::int32_t> x(3, me == root ? static_cast<std::int32_t>(it) : -1);
            epx::broadcast(comm, epx::span<std::int32_t>(x), root);
            for (auto v : x) bad += v != static_cast<std::int32_t>(it);
            break;
          }
          case 3: comm.barrier(); break;
          case 4: {
            auto sub = comm.split(me % 2, me);
            std::vector<std::int32_t> x{me};
            epx::all_reduce(sub, epx::span<std::int32_t>(x));
            std::int32_t want = 0;
            for (int r = me % 2; r < n; r += 2) want += r;
            bad += x[0] != want;
            break;
          }
        }
      }
      CHECK_MESSAGE(bad == 0, "rank " << me << ": " << bad << " wrong results");
    }, normal_options());
  }
}

TEST_CASE("threads: a rank that throws before a collective fails every rank, and the next run works") {
  const int n = 4;
  seen_errors seen(n);
  const auto t0 = clock_type::now();
  bool threw = false;
  try {
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      if (comm.rank() == 2) throw std::runtime_error("boom from rank two");
      try {
        comm.barrier();
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, short_options());
  } catch (const std::runtime_error& e) {
    threw = true;
    // The first failure is rethrown as it was thrown.
    CHECK(std::string(e.what()) == "boom from rank two");
    CHECK(dynamic_cast<const epx::error*>(&e) == nullptr);
  }
  CHECK(threw);
  CHECK(clock_type::now() - t0 < milliseconds(5000));  // bounded (the messages show it was not the watchdog)
  for (int r : {0, 1, 3}) {
    CAPTURE(r);
    CHECK(seen.categories[r] == epx::errc::communicator);
    CHECK(contains(seen.messages[r], "rank 2 failed: boom from rank two"));
  }
  check_next_run_works(n);
}

TEST_CASE("threads: a rank that throws while the others wait inside a collective") {
  for (int n : {2, 3, 8}) {
    CAPTURE(n);
    seen_errors seen(n);
    const auto t0 = clock_type::now();
    bool threw = false;
    try {
      epx::threads::run(n, [&](epx::threads::communicator& comm) {
        std::vector<float> x(1000, 1.0f);
        epx::all_reduce(comm, epx::span<float>(x));  // a collective that succeeds first
        if (comm.rank() == n - 1) {
          std::this_thread::sleep_for(milliseconds(100));  // the others are waiting by now
          EPX_THROW(epx::errc::input, "expert id (99) out of range on the last rank");
        }
        try {
          epx::all_reduce(comm, epx::span<float>(x));
        } catch (const epx::error& e) {
          seen.record(comm.rank(), e);
          throw;
        }
      }, short_options());
    } catch (const epx::error& e) {
      threw = true;
      // The first failure keeps its category and message.
      CHECK(e.category() == epx::errc::input);
      CHECK(e.message() == "expert id (99) out of range on the last rank");
    }
    CHECK(threw);
    CHECK(clock_type::now() - t0 < milliseconds(5000));
    for (int r = 0; r + 1 < n; ++r) {
      CAPTURE(r);
      CHECK(seen.categories[r] == epx::errc::communicator);
      CHECK(contains(seen.messages[r], "rank " + std::to_string(n - 1) + " failed: expert id (99) out of range"));
    }
    check_next_run_works(n);
  }
}

TEST_CASE("threads: an abort while peers are copying from a rank's buffers (they stay valid until the copies end)") {
  const int n = 4;
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    seen_errors seen(n);
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      if (comm.rank() == n - 1) {
        std::this_thread::sleep_for(milliseconds(2 * round));  // the others are copying by now
        throw std::runtime_error("late rank fails");
      }
      // Heap buffers, freed as soon as the exception leaves this scope.
      const std::size_t block = std::size_t{1} << 20;  // elements per peer
      std::vector<std::size_t> sc(n, block), sd(n), rc(n, block), rd(n);
      for (int p = 0; p < n; ++p) sd[p] = rd[p] = block * static_cast<std::size_t>(p);
      std::vector<float> send(block * n, 1.0f), recv(block * n);
      try {
        comm.all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), epx::datatype::float32);
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, short_options()), doctest::Contains("late rank fails"), std::runtime_error);
    for (int r = 0; r + 1 < n; ++r) {
      CAPTURE(r);
      CHECK(contains(seen.messages[r], "rank 3 failed: late rank fails"));
    }
  }
  check_next_run_works(n);
}

TEST_CASE("threads: invalid arguments inside a collective on one rank reach the others") {
  const int n = 3;
  seen_errors seen(n);
  CHECK_THROWS_WITH_AS(
      epx::threads::run(n, [&](epx::threads::communicator& comm) {
        std::vector<std::size_t> counts(n, 0);
        try {
          comm.all_to_allv(nullptr, comm.rank() == 1 ? nullptr : counts.data(), counts.data(), nullptr,
                           counts.data(), counts.data(), epx::datatype::float32);
        } catch (const epx::error& e) {
          seen.record(comm.rank(), e);
          throw;
        }
      }, short_options()),
      doctest::Contains("all_to_allv: rank 1 passes null counts or displacements"), epx::error);
  // Every rank raises the bad rank's fault itself (errc::input), as soon as all have entered.
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(seen.categories[static_cast<std::size_t>(r)] == epx::errc::input);
    CHECK(contains(seen.messages[static_cast<std::size_t>(r)], "all_to_allv: rank 1 passes null counts or displacements"));
  }
  check_next_run_works(n);
}

TEST_CASE("threads: the watchdog names the ranks that never enter a collective") {
  const int n = 4;
  epx::threads::options o;
  o.timeout = milliseconds(300);
  seen_errors seen(n);
  const auto t0 = clock_type::now();
  bool threw = false;
  try {
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      std::vector<int> x(3, 1);
      epx::all_reduce(comm, epx::span<int>(x));
      if (comm.rank() == 1 || comm.rank() == 3) {
        std::this_thread::sleep_for(milliseconds(900));  // late: missing from the collective
      }
      try {
        epx::all_reduce(comm, epx::span<int>(x));
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, o);
  } catch (const epx::error& e) {
    threw = true;
    CHECK(e.category() == epx::errc::communicator);
    CHECK(contains(e.message(), "watchdog"));
    CHECK(contains(e.message(), "all_reduce"));
    CHECK(contains(e.message(), "never entered it: rank 1, rank 3"));
  }
  CHECK(threw);
  const auto elapsed = clock_type::now() - t0;
  CHECK(elapsed >= milliseconds(300));
  CHECK(elapsed < milliseconds(5000));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(seen.categories[r] == epx::errc::communicator);
    CHECK(contains(seen.messages[r], "rank 1, rank 3"));
  }
  check_next_run_works(n);
}

TEST_CASE("threads: a rank that returns without entering a collective fails the others at once") {
  const int n = 3;
  const auto t0 = clock_type::now();
  seen_errors seen(n);
  CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
    if (comm.rank() == 0) return;
    try {
      comm.barrier();
    } catch (const epx::error& e) {
      seen.record(comm.rank(), e);
      throw;
    }
  }, short_options()), doctest::Contains("returned from their function without entering it: rank 0"), epx::error);
  CHECK(clock_type::now() - t0 < milliseconds(5000));  // bounded (the messages show it was not the watchdog)
  for (int r : {1, 2}) {
    CAPTURE(r);
    CHECK(contains(seen.messages[r], "barrier (collective #1 on a communicator of 3 ranks) can never complete"));
  }
  // Inside a sub-communicator: the tp partner of rank 5 returns early.
  CHECK_THROWS_WITH_AS(epx::threads::run(8, [&](epx::threads::communicator& comm) {
    auto pair = comm.split(comm.rank() / 2, comm.rank());
    if (comm.rank() == 5) return;
    std::vector<int> x(4, 1);
    epx::all_reduce(pair, epx::span<int>(x));
  }, short_options()), doctest::Contains("without entering it: rank 1 (world rank 5)"), epx::error);
  check_next_run_works(n);
}

TEST_CASE("threads: mismatched all_to_allv counts are detected on every rank") {
  const int n = 4;
  seen_errors seen(n);
  std::atomic<int> recovered{0};
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    const int me = comm.rank();
    std::vector<std::size_t> sc(n, 2), sd(n), rc(n, 2), rd(n);
    for (int p = 0; p < n; ++p) sd[p] = rd[p] = 2 * static_cast<std::size_t>(p);
    if (me == 2) rc[0] = 1;  // rank 0 sends 2 elements to rank 2, which expects 1
    std::vector<float> send(2 * n, 1.0f), recv(2 * n, 0.0f);
    try {
      comm.all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), epx::datatype::float32);
    } catch (const epx::error& e) {
      seen.record(me, e);
    }
    // Every rank saw the same disagreement, so the communicator is still usable.
    if (still_works(comm)) ++recovered;
  }, short_options());
  CHECK(recovered.load() == n);
  every_rank_saw(seen, n, "rank 0 sends 2 elements to rank 2, which expects 1 from it");
}

namespace {
// Every rank sends `per` elements in each of 2 segments to every peer; `tweak` may change
// this rank's counts or segment number before the call. Records the error each rank saw;
// afterwards the communicator must still work.
template <class Tweak>
int run_segments_mismatch(int n, seen_errors& seen, Tweak tweak) {
  std::atomic<int> recovered{0};
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    const int me = comm.rank();
    std::size_t nseg = 2;
    const std::size_t per = 2;
    std::vector<std::size_t> sc(n * nseg, per), sd(n * nseg), rc(n * nseg, per), rd(n * nseg);
    for (std::size_t j = 0; j < sd.size(); ++j) sd[j] = rd[j] = per * j;
    tweak(me, sc, rc, nseg);
    std::vector<float> send(per * n * 2, 1.0f), recv(per * n * 2 + 8, 0.0f);
    try {
      comm.all_to_allv_segments(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), nseg,
                                epx::datatype::float32);
    } catch (const epx::error& e) {
      seen.record(me, e);
    }
    if (still_works(comm)) ++recovered;
  }, short_options());
  return recovered.load();
}
}  // namespace

TEST_CASE("threads: mismatched all_to_allv_segments counts and segment numbers are detected on every rank") {
  const int n = 4;
  {
    seen_errors seen(n);
    // Rank 3 expects 1 element in segment 1 from rank 2, which sends 2.
    CHECK(run_segments_mismatch(n, seen, [](int me, auto&, auto& rc, std::size_t& nseg) {
            if (me == 3) rc[2 * nseg + 1] = 1;
          }) == n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(seen.categories[r] == epx::errc::communicator);
      CHECK(contains(seen.messages[r],
                     "all_to_allv_segments: mismatched counts: rank 2 sends 2 elements in segment 1 to rank 3, which "
                     "expects 1 from it"));
    }
  }
  {
    seen_errors seen(n);
    // Rank 1 sends 3 elements in segment 0 to rank 0 (reads past nothing: its send buffer holds them).
    CHECK(run_segments_mismatch(n, seen, [](int me, auto& sc, auto&, std::size_t&) {
            if (me == 1) sc[0] = 3;
          }) == n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(contains(seen.messages[r], "rank 1 sends 3 elements in segment 0 to rank 0, which expects 2 from it"));
    }
  }
  {
    seen_errors seen(n);
    // Rank 2 passes 1 segment per peer where the others pass 2.
    CHECK(run_segments_mismatch(n, seen, [](int me, auto&, auto&, std::size_t& nseg) {
            if (me == 2) nseg = 1;
          }) == n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(seen.categories[r] == epx::errc::communicator);
      CHECK(contains(seen.messages[r],
                     "all_to_allv_segments: mismatched segment counts: rank 0 passed 2 segments per peer, rank 2 "
                     "passed 1"));
    }
  }
  {
    seen_errors seen(n);
    // Rank 1 calls all_to_allv_segments, the others all_reduce.
    std::atomic<int> done{0};
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      std::vector<std::size_t> c(n, 0);
      std::vector<float> x(4, 1.0f);
      try {
        if (comm.rank() == 1) comm.all_to_allv_segments(nullptr, c.data(), c.data(), nullptr, c.data(), c.data(), 1,
                                                        epx::datatype::float32);
        else epx::all_reduce(comm, epx::span<float>(x));
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
      ++done;
    }, short_options()), doctest::Contains("mismatched collectives: rank 0 called all_reduce, rank 1 called all_to_allv_segments"),
                         epx::error);
    CHECK(done.load() == 0);
    for (int r = 0; r < n; ++r) CHECK(contains(seen.messages[r], "rank 1 called all_to_allv_segments"));
  }
}

TEST_CASE("threads: all_to_allv_segments failures: invalid arguments, a rank that throws, a rank that never comes") {
  const int n = 3;
  {
    seen_errors seen(n);
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      std::vector<std::size_t> c(n * 2, 0);
      try {
        comm.all_to_allv_segments(nullptr, c.data(), comm.rank() == 2 ? nullptr : c.data(), nullptr, c.data(),
                                  c.data(), 2, epx::datatype::bfloat16);
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, short_options()), doctest::Contains("all_to_allv_segments: rank 2 passes null counts or displacements (3 peers "
                                           "x 2 segments)"),
                         epx::error);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(seen.categories[static_cast<std::size_t>(r)] == epx::errc::input);
      CHECK(contains(seen.messages[static_cast<std::size_t>(r)], "rank 2 passes null counts or displacements"));
    }
  }
  // A rank that throws while the others copy 4 MiB segments from each other.
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    seen_errors seen(n);
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      if (comm.rank() == 0) {
        std::this_thread::sleep_for(milliseconds(2 * round));
        throw std::runtime_error("segment rank fails");
      }
      const std::size_t nseg = 4, per = std::size_t{1} << 20;
      std::vector<std::size_t> sc(n * nseg, per), sd(n * nseg), rc(n * nseg, per), rd(n * nseg);
      for (std::size_t j = 0; j < sd.size(); ++j) sd[j] = rd[j] = per * j;
      std::vector<float> send(per * n * nseg, 1.0f), recv(per * n * nseg);
      try {
        comm.all_to_allv_segments(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), nseg,
                                  epx::datatype::float32);
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, short_options()), doctest::Contains("segment rank fails"), std::runtime_error);
    for (int r = 1; r < n; ++r) {
      CAPTURE(r);
      CHECK(contains(seen.messages[r], "rank 0 failed: segment rank fails"));
    }
  }
  // The watchdog names a rank that is late for the collective.
  {
    epx::threads::options o;
    o.timeout = milliseconds(300);
    seen_errors seen(n);
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      if (comm.rank() == 1) std::this_thread::sleep_for(milliseconds(900));
      std::vector<std::size_t> c(n, 1), d(n);
      for (int p = 0; p < n; ++p) d[p] = static_cast<std::size_t>(p);
      std::vector<int> send(n, comm.rank()), recv(n, -1);
      try {
        comm.all_to_allv_segments(send.data(), c.data(), d.data(), recv.data(), c.data(), d.data(), 1,
                                  epx::datatype::int32);
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, o), doctest::Contains("never entered it: rank 1"), epx::error);
    CHECK(clock_type::now() - t0 < milliseconds(5000));
    for (int r : {0, 2}) {
      CAPTURE(r);
      CHECK(contains(seen.messages[r], "watchdog: all_to_allv_segments"));
    }
  }
  check_next_run_works(n);
}

TEST_CASE("threads: mismatched collectives, datatypes, counts, roots and scales are detected on every rank") {
  struct scenario {
    const char* name;
    void (*call)(epx::threads::communicator&);
    const char* expect;
  };
  const scenario scenarios[] = {
      {"kinds",
       [](epx::threads::communicator& c) {
         std::vector<float> x(4, 1.0f);
         if (c.rank() == 1) c.barrier();
         else epx::all_reduce(c, epx::span<float>(x));
       },
       "mismatched collectives: rank 0 called all_reduce, rank 1 called barrier"},
      {"datatypes",
       [](epx::threads::communicator& c) {
         std::vector<double> x(4, 1.0);
         if (c.rank() == 2) c.all_reduce(x.data(), x.data(), 8, epx::datatype::float32, 1.0);
         else c.all_reduce(x.data(), x.data(), 4, epx::datatype::float64, 1.0);
       },
       "all_reduce: mismatched datatypes: rank 0 passed float64, rank 2 passed float32"},
      {"counts",
       [](epx::threads::communicator& c) {
         std::vector<float> x(8, 1.0f);
         epx::all_reduce(c, epx::span<float>(x.data(), c.rank() == 1 ? 7 : 8));
       },
       "all_reduce: mismatched counts: rank 0 passed 8, rank 1 passed 7"},
      {"roots",
       [](epx::threads::communicator& c) {
         std::vector<int> x(5, 0);
         epx::broadcast(c, epx::span<int>(x), c.rank() == 2 ? 1 : 0);
       },
       "broadcast: mismatched roots: rank 0 passed 0, rank 2 passed 1"},
      {"scales",
       [](epx::threads::communicator& c) {
         std::vector<float> x(8, 1.0f);
         epx::all_reduce(c, epx::span<float>(x), c.rank() == 1 ? 0.5 : 0.25);
       },
       "all_reduce: mismatched scales: rank 0 passed 0.25, rank 1 passed 0.5"},
  };
  const int n = 3;
  for (const auto& s : scenarios) {
    const std::string scenario = s.name;
    CAPTURE(scenario);
    seen_errors seen(n);
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      try {
        s.call(comm);
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
        throw;
      }
    }, short_options()), doctest::Contains(s.expect), epx::error);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(contains(seen.messages[r], s.expect));
    }
  }
  check_next_run_works(n);
}

TEST_CASE("threads: a failure inside a sub-communicator aborts the whole run") {
  const int n = 8;
  seen_errors seen(n);
  const auto t0 = clock_type::now();
  CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
    epx::mesh_config cfg;
    cfg.tp = 2;
    cfg.fsdp = 4;
    cfg.ep = 4;
    cfg.experts = 8;
    const epx::mesh m(cfg);
    auto tp = epx::sub_communicator(comm, m, epx::group_kind::tp);
    auto ep = epx::sub_communicator(comm, m, epx::group_kind::ep);
    std::vector<float> x(16, 1.0f);
    try {
      if (comm.rank() == 5) {
        epx::all_reduce(tp, epx::span<float>(x));  // the partner (rank 4) is in it too
        throw std::logic_error("rank five gives up");
      }
      if (comm.rank() == 4) epx::all_reduce(tp, epx::span<float>(x));
      // Everyone else (and rank 4 next) works in another group, then waits in the world.
      if (comm.rank() < 4) epx::all_reduce(ep, epx::span<float>(x));
      comm.barrier();
    } catch (const epx::error& e) {
      seen.record(comm.rank(), e);
      throw;
    }
  }, short_options()), doctest::Contains("rank five gives up"), std::logic_error);
  CHECK(clock_type::now() - t0 < milliseconds(5000));
  for (int r : {0, 1, 2, 3, 4, 6, 7}) {
    CAPTURE(r);
    CHECK(contains(seen.messages[r], "rank 5 failed: rank five gives up"));
  }
  check_next_run_works(n);
}

TEST_CASE("threads: after an aborted run, collectives on a rank that caught the error still throw") {
  const int n = 2;
  std::atomic<int> threw_again{0};
  CHECK_THROWS_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
    if (comm.rank() == 0) throw std::runtime_error("first");
    try {
      comm.barrier();
    } catch (const epx::error&) {
    }
    try {
      comm.barrier();  // a later collective fails at once
    } catch (const epx::error& e) {
      if (contains(e.what(), "rank 0 failed: first")) ++threw_again;
    }
  }, short_options()), std::runtime_error);
  CHECK(threw_again.load() == 1);
  check_next_run_works(n);
}

static_assert(epx::has_peer_access_v<epx::threads::communicator>, "threads ranks read each other's memory");

TEST_CASE("threads: access_peers shows every member's pointers, and nobody leaves before every reader is done") {
  for_each_world_size([](epx::threads::communicator& comm) {
    const int n = comm.size(), me = comm.rank();
    // Two buffers per rank; each rank reads its peers' second buffer while they stay inside.
    std::vector<int> a(4, me), b(static_cast<std::size_t>(n), 100 + me);
    const void* mine[2] = {a.data(), b.data()};
    std::vector<int> got(static_cast<std::size_t>(n), -1);
    int size_seen = 0;
    comm.access_peers(mine, 2, [&](const auto& peers) {
      size_seen = peers.size();
      for (int r = 0; r < n; ++r) {
        REQUIRE(static_cast<const int*>(peers(r, 0))[3] == r);
        got[static_cast<std::size_t>(r)] = static_cast<const int*>(peers(r, 1))[me];
      }
      REQUIRE(peers(me, 0) == a.data());
    });
    CHECK(size_seen == n);
    for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == 100 + r);
    // Immediately reused: the next call's pointers replace these (slot reuse).
    for (int round = 0; round < 20; ++round) {
      const int tag = round * 1000 + me;
      const void* one[1] = {&tag};
      int sum = 0;
      comm.access_peers(one, 1, [&](const auto& peers) {
        for (int r = 0; r < n; ++r) sum += *static_cast<const int*>(peers(r, 0)) - round * 1000;
      });
      CHECK(sum == n * (n - 1) / 2);
    }
    // No pointers: a barrier.
    comm.access_peers(nullptr, 0, [](const auto&) {});
  });
}

TEST_CASE("threads: access_peers failures: mismatched counts, a throwing function, a rank that never comes") {
  const int n = 3;
  {
    seen_errors seen(n);
    std::atomic<int> after{0};
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      int v = 0;
      const void* mine[2] = {&v, &v};
      bool ran = false;
      try {
        comm.access_peers(mine, comm.rank() == 2 ? 2 : 1, [&](const auto&) { ran = true; });
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
      }
      if (!ran) ++after;
      comm.barrier();  // the communicator still works
    }, short_options());
    CHECK(after.load() == n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(seen.categories[static_cast<std::size_t>(r)] == epx::errc::communicator);
      CHECK(contains(seen.messages[static_cast<std::size_t>(r)], "access_peers: mismatched counts: rank 0 passed 1, rank 2 passed 2"));
    }
  }
  {
    // The function throws on rank 1: rank 1 rethrows after every member is done; the
    // others carry on until their next collective, which reports rank 1's failure.
    std::atomic<int> completed{0};
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      int v = comm.rank();
      const void* mine[1] = {&v};
      comm.access_peers(mine, 1, [&](const auto& peers) {
        if (comm.rank() == 1) throw std::runtime_error("reader failed");
        for (int r = 0; r < n; ++r) CHECK(*static_cast<const int*>(peers(r, 0)) == r);
      });
      ++completed;
      comm.barrier();
    }, short_options()), doctest::Contains("reader failed"), std::runtime_error);
    CHECK(completed.load() == n - 1);
  }
  {
    const auto t0 = clock_type::now();
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      if (comm.rank() == 0) return;
      int v = 0;
      const void* mine[1] = {&v};
      comm.access_peers(mine, 1, [](const auto&) {});
    }, short_options()), doctest::Contains("access_peers (collective #1 on a communicator of 3 ranks) can never complete"),
                         epx::error);
    CHECK(clock_type::now() - t0 < milliseconds(3500));
  }
  check_next_run_works(n);
}

// --- failures a rank catches, and failures that escape ---------------------------------------
//
// epx::threads::run rethrows only an exception that escapes a rank's function. An error
// that every rank catches (calls that disagree, bad input found on every rank, a
// communicator ended by the watchdog or by a member that returned) leaves the run alive:
// run returns normally, and the communicators not involved keep working.

TEST_CASE("threads: errors that every rank catches leave the run alive, and later collectives work") {
  for (int n : {2, 3, 4, 8}) {
    CAPTURE(n);
    seen_errors mismatch(n), bad_input(n), counts(n);
    std::atomic<int> ok{0};
    // run returns normally: nothing escaped.
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      const int me = comm.rank();
      // 1. A collective whose counts disagree (errc::communicator on every rank).
      std::vector<float> x(8, 1.0f);
      try {
        epx::all_reduce(comm, epx::span<float>(x.data(), me == n - 1 ? 7 : 8));
      } catch (const epx::error& e) {
        mismatch.record(me, e);
      }
      // 2. Bad input seen by every rank after a collective agreement, as the layer does:
      // every rank contributes its status, and every rank raises errc::input together.
      try {
        std::vector<std::int32_t> status(static_cast<std::size_t>(n)), mine{me == 0 ? 1 : 0};
        epx::all_gather(comm, epx::span<const std::int32_t>(mine), epx::span<std::int32_t>(status));
        for (int r = 0; r < n; ++r)
          EPX_REQUIRE(status[static_cast<std::size_t>(r)] == 0, epx::errc::input, "bad input on rank ", r);
      } catch (const epx::error& e) {
        bad_input.record(me, e);
      }
      // 3. all_to_allv counts that disagree.
      std::vector<std::size_t> sc(n, 1), sd(n), rc(n, 1), rd(n);
      for (int p = 0; p < n; ++p) sd[p] = rd[p] = static_cast<std::size_t>(p);
      if (me == 1) rc[0] = 0;
      std::vector<int> send(n, me), recv(n, -1);
      try {
        comm.all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), epx::datatype::int32);
      } catch (const epx::error& e) {
        counts.record(me, e);
      }
      // The world and its sub-communicators still work.
      std::vector<double> y{1.0 + me};
      epx::all_reduce(comm, epx::span<double>(y));
      comm.barrier();
      auto halves = comm.split(me % 2, me);
      std::vector<int> one{1};
      epx::all_reduce(halves, epx::span<int>(one));
      if (y[0] == n * (n + 1) / 2.0 && one[0] == halves.size()) ++ok;
    }, short_options());
    CHECK(ok.load() == n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(mismatch.categories[r] == epx::errc::communicator);
      CHECK(contains(mismatch.messages[r], "all_reduce: mismatched counts"));
      CHECK(bad_input.categories[r] == epx::errc::input);
      CHECK(contains(bad_input.messages[r], "bad input on rank 0"));
      CHECK(counts.categories[r] == epx::errc::communicator);
      CHECK(contains(counts.messages[r], "rank 0 sends 1 elements to rank 1, which expects 0 from it"));
    }
  }
  check_next_run_works(4);
}

TEST_CASE("threads: a communicator ended by the watchdog fails its members, not the run, when they catch it") {
  // Pairs {0,1} and {2,3}. Rank 1 is late for the pair's all_reduce: rank 0's watchdog
  // ends the pair (rank 1 then sees the same failure); both catch it. The pair stays
  // broken; the other pair and the world keep working; run returns normally.
  const int n = 4;
  epx::threads::options o;
  o.timeout = milliseconds(300);
  seen_errors first(n), again(n);
  std::atomic<bool> rank0_caught{false}, rank1_caught{false};
  std::atomic<int> ok{0};
  const auto wait_for = [](const std::atomic<bool>& flag) {
    while (!flag.load()) std::this_thread::sleep_for(milliseconds(1));
  };
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    const int me = comm.rank();
    auto pair = comm.split(me / 2, me);
    std::vector<int> x{1};
    if (me == 1) wait_for(rank0_caught);  // enters only after rank 0's watchdog has fired
    try {
      epx::all_reduce(pair, epx::span<int>(x));
    } catch (const epx::error& e) {
      first.record(me, e);
    }
    if (me == 0) rank0_caught = true;
    if (me == 1) rank1_caught = true;
    if (me < 2) {
      try {
        pair.barrier();  // the pair stays broken
      } catch (const epx::error& e) {
        again.record(me, e);
      }
    }
    wait_for(rank1_caught);  // nobody waits in the world for rank 1 past the watchdog
    std::vector<double> y{1.0};
    epx::all_reduce(comm, epx::span<double>(y));
    comm.barrier();
    if (y[0] == n && (me < 2 || x[0] == 2)) ++ok;
  }, o);
  CHECK(ok.load() == n);
  CHECK(first.categories[0] == epx::errc::communicator);
  CHECK(contains(first.messages[0], "watchdog: all_reduce (collective #1 on a communicator of 2 ranks)"));
  CHECK(contains(first.messages[0], "ranks that never entered it: rank 1"));
  CHECK(first.categories[1] == epx::errc::communicator);
  CHECK(contains(first.messages[1], "rank 0 failed: watchdog: all_reduce"));
  for (int r : {0, 1}) {
    CAPTURE(r);
    CHECK(contains(again.messages[r], "rank 0 failed: watchdog: all_reduce"));
  }
  for (int r : {2, 3}) CHECK(first.messages[r].empty());
  check_next_run_works(n);
}

TEST_CASE("threads: a member that returns early fails its communicator, not the run, when the others catch it") {
  // Rank 3 returns right after the split; its pair partner (rank 2) finds the pair's
  // collective can never complete and catches it. Ranks 0 and 1 never notice.
  const int n = 4;
  seen_errors seen(n);
  std::atomic<int> ok{0};
  const auto t0 = clock_type::now();
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    const int me = comm.rank();
    auto pair = comm.split(me / 2, me);
    if (me == 3) return;
    std::vector<int> x{1};
    for (int round = 0; round < 2; ++round) {
      try {
        epx::all_reduce(pair, epx::span<int>(x));
        if (x[0] == 1 << (round + 1)) ++ok;
      } catch (const epx::error& e) {
        seen.record(me, e);
      }
    }
  }, short_options());
  CHECK(clock_type::now() - t0 < milliseconds(3500));  // not the watchdog
  CHECK(ok.load() == 4);                               // ranks 0 and 1, two rounds each
  CHECK(seen.categories[2] == epx::errc::communicator);
  CHECK(contains(seen.messages[2], "can never complete: ranks that returned from their function without entering it: "
                                   "rank 1 (world rank 3)"));
  CHECK(seen.messages[0].empty());
  CHECK(seen.messages[1].empty());
  check_next_run_works(n);
}

TEST_CASE("threads: a failure that escapes one rank still aborts the run, after errors the ranks caught") {
  const int n = 4;
  {
    // Every rank catches a mismatch; then rank 2 lets its own exception escape.
    seen_errors seen(n);
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      std::vector<float> x(4, 1.0f);
      try {
        epx::all_reduce(comm, epx::span<float>(x.data(), comm.rank() == 0 ? 3 : 4));
      } catch (const epx::error&) {
      }
      if (comm.rank() == 2) throw std::runtime_error("rank two escapes");
      try {
        comm.barrier();
      } catch (const epx::error& e) {
        seen.record(comm.rank(), e);
      }
    }, short_options()), doctest::Contains("rank two escapes"), std::runtime_error);
    for (int r : {0, 1, 3}) {
      CAPTURE(r);
      CHECK(contains(seen.messages[r], "rank 2 failed: rank two escapes"));
    }
  }
  {
    // Every rank gets the mismatch; rank 1 lets it escape, the others catch it. run
    // rethrows the one that escaped, as it was thrown.
    bool threw = false;
    try {
      epx::threads::run(n, [&](epx::threads::communicator& comm) {
        std::vector<int> x(5, 0);
        try {
          epx::broadcast(comm, epx::span<int>(x), comm.rank() == 3 ? 1 : 0);
        } catch (const epx::error&) {
          if (comm.rank() == 1) throw;
        }
      }, short_options());
    } catch (const epx::error& e) {
      threw = true;
      CHECK(e.category() == epx::errc::communicator);
      CHECK(contains(e.message(), "broadcast: mismatched roots: rank 0 passed 0, rank 3 passed 1"));
    }
    CHECK(threw);
  }
  {
    // The watchdog ends the world communicator; rank 0 lets it escape, the others catch it.
    epx::threads::options o;
    o.timeout = milliseconds(200);
    CHECK_THROWS_WITH_AS(epx::threads::run(n, [&](epx::threads::communicator& comm) {
      if (comm.rank() == 3) std::this_thread::sleep_for(milliseconds(600));
      try {
        comm.barrier();
      } catch (const epx::error&) {
        if (comm.rank() == 0) throw;
      }
    }, o), doctest::Contains("watchdog: barrier"), epx::error);
  }
  check_next_run_works(n);
}

// --- a member's own faults, raised on every member -----------------------------------------

namespace {

// Runs `call` on every rank of an n-rank run; every rank must catch errc::input naming
// `text`, and the communicator must work afterwards.
template <class Call>
void every_rank_refuses(int n, const std::string& text, Call call) {
  seen_errors seen(n);
  std::atomic<int> works{0};
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    try {
      call(comm);
    } catch (const epx::error& e) {
      seen.record(comm.rank(), e);
    }
    if (still_works(comm)) ++works;
  }, short_options());
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(seen.categories[static_cast<std::size_t>(r)] == epx::errc::input);
    CHECK(contains(seen.messages[static_cast<std::size_t>(r)], text));
  }
  CHECK(works.load() == n);
}

}  // namespace

TEST_CASE("threads: arguments one rank cannot use raise errc::input on every rank, at once") {
  // Each used to raise on the bad rank alone, before its call was published: the others
  // waited for the watchdog (a minute by default).
  SUBCASE("broadcast: a root out of range") {
    every_rank_refuses(3, "broadcast: rank 2 passes root 5, out of range [0, 3)", [](epx::threads::communicator& comm) {
      std::vector<int> v(4, comm.rank());
      comm.broadcast(v.data(), v.size(), epx::datatype::int32, comm.rank() == 2 ? 5 : 0);
    });
  }
  SUBCASE("all_reduce: a datatype that cannot be summed") {
    every_rank_refuses(3, "all_reduce: rank 0 passes datatype byte, which cannot be summed",
                       [](epx::threads::communicator& comm) {
                         std::vector<std::uint8_t> v(4, 1);
                         comm.all_reduce(v.data(), v.data(), v.size(),
                                         comm.rank() == 0 ? epx::datatype::byte : epx::datatype::int32, 1.0);
                       });
  }
  SUBCASE("reduce_scatter and all_gather: a null buffer that should hold elements") {
    every_rank_refuses(2, "reduce_scatter: rank 1 passes a null recv buffer that should hold 4 elements",
                       [](epx::threads::communicator& comm) {
                         std::vector<float> send(8, 1.0f), recv(4);
                         comm.reduce_scatter(send.data(), comm.rank() == 1 ? nullptr : recv.data(), 4,
                                             epx::datatype::float32, 1.0);
                       });
    every_rank_refuses(2, "all_gather: rank 0 passes a null send buffer that should hold 3 elements",
                       [](epx::threads::communicator& comm) {
                         std::vector<int> send(3, 1), recv(6);
                         comm.all_gather(comm.rank() == 0 ? nullptr : send.data(), recv.data(), 3, epx::datatype::int32);
                       });
  }
  SUBCASE("all_to_allv_indexed: rows of no elements") {
    every_rank_refuses(2, "all_to_allv_indexed: rank 1 passes row_elems 0", [](epx::threads::communicator& comm) {
      std::vector<float> src(8, 1.0f), recv(8);
      const std::int64_t rows[2] = {0, 1};
      const std::size_t counts[2] = {1, 1}, displs[2] = {0, 1};
      comm.all_to_allv_indexed(src.data(), rows, comm.rank() == 1 ? 0 : 4, counts, displs, recv.data(), counts, displs,
                               1, epx::datatype::float32);
    });
  }
}

TEST_CASE("threads: buffers that overlap other than in place raise errc::input on every rank") {
  const std::string overlap = "rank 1 passes send and recv buffers that overlap";
  SUBCASE("all_gather: send inside recv, not at this rank's block") {
    every_rank_refuses(3, "all_gather: " + overlap, [](epx::threads::communicator& comm) {
      std::vector<int> buf(3 * 4, comm.rank());
      const int* send = comm.rank() == 1 ? buf.data() : buf.data() + 4 * comm.rank();  // rank 1: block 0
      comm.all_gather(send, buf.data(), 4, epx::datatype::int32);
    });
  }
  SUBCASE("all_gather: the same buffer") {
    every_rank_refuses(2, "all_gather: " + overlap, [](epx::threads::communicator& comm) {
      std::vector<int> a(2 * 4, 0), b(2 * 4, 0);
      if (comm.rank() == 1) comm.all_gather(b.data(), b.data() + 1, 4, epx::datatype::int32);
      else comm.all_gather(a.data(), b.data(), 4, epx::datatype::int32);
    });
  }
  SUBCASE("reduce_scatter: recv inside send, not at this rank's block") {
    every_rank_refuses(3, "reduce_scatter: " + overlap, [](epx::threads::communicator& comm) {
      std::vector<float> buf(3 * 4, 1.0f);
      float* recv = buf.data() + 4 * (comm.rank() == 1 ? 2 : comm.rank());
      comm.reduce_scatter(buf.data(), recv, 4, epx::datatype::float32, 1.0);
    });
  }
  SUBCASE("all_reduce: overlapping, not the same") {
    every_rank_refuses(2, "all_reduce: " + overlap, [](epx::threads::communicator& comm) {
      std::vector<double> buf(8, 1.0);
      comm.all_reduce(buf.data(), buf.data() + (comm.rank() == 1 ? 2 : 0), 4, epx::datatype::float64, 1.0);
    });
  }
  SUBCASE("all_to_all and all_to_allv in place") {
    every_rank_refuses(2, "all_to_all: " + overlap, [](epx::threads::communicator& comm) {
      std::vector<int> a(4, 0), b(4, 0);
      comm.all_to_all(a.data(), comm.rank() == 1 ? a.data() : b.data(), 2, epx::datatype::int32);
    });
    every_rank_refuses(2, "all_to_allv: " + overlap, [](epx::threads::communicator& comm) {
      std::vector<int> a(8, 0), b(8, 0);
      const std::size_t c[2] = {2, 2}, d[2] = {0, 2}, rd[2] = {4, 6};
      comm.all_to_allv(a.data(), c, d, comm.rank() == 1 ? a.data() + 1 : b.data(), c, rd, epx::datatype::int32);
    });
  }
  SUBCASE("one rank: in place only where every block lands on itself") {
    every_rank_refuses(1, "all_to_allv: rank 0 passes send and recv buffers that overlap",
                       [](epx::threads::communicator& comm) {
                         std::vector<int> a{10, 11, 12, 13};
                         const std::size_t c[1] = {2}, d[1] = {0}, rd[1] = {1};
                         comm.all_to_allv(a.data(), c, d, a.data(), c, rd, epx::datatype::int32);
                       });
    every_rank_refuses(1, "all_to_allv_indexed: rank 0 passes send and recv buffers that overlap",
                       [](epx::threads::communicator& comm) {
                         std::vector<int> a{10, 11, 12, 13};
                         const std::int64_t rows[4] = {3, 2, 1, 0};
                         const std::size_t c[1] = {4}, d[1] = {0};
                         comm.all_to_allv_indexed(a.data(), rows, 1, c, d, a.data(), c, d, 1, epx::datatype::int32);
                       });
    // recv starting before src and reaching into it (found without a pass over the rows).
    every_rank_refuses(1, "all_to_allv_indexed: rank 0 passes send and recv buffers that overlap",
                       [](epx::threads::communicator& comm) {
                         std::vector<int> a{10, 11, 12, 13, 14, 15};
                         const std::int64_t rows[3] = {0, 1, 2};
                         const std::size_t c[1] = {3}, d[1] = {0};
                         comm.all_to_allv_indexed(a.data() + 2, rows, 1, c, d, a.data(), c, d, 1, epx::datatype::int32);
                       });
    epx::threads::run(1, [](epx::threads::communicator& comm) {
      std::vector<int> a{10, 11, 12, 13};
      const std::size_t c[2] = {2, 1}, d[2] = {0, 3};
      comm.all_to_allv_segments(a.data(), c, d, a.data(), c, d, 2, epx::datatype::int32);  // each block onto itself
      CHECK(a == std::vector<int>{10, 11, 12, 13});
      comm.all_to_all(a.data(), a.data(), 4, epx::datatype::int32);
      CHECK(a == std::vector<int>{10, 11, 12, 13});
    });
  }
}

TEST_CASE("threads: all_gather and reduce_scatter in place (this rank's own block) give the right results") {
  for (int n : {2, 3, 5}) {
    CAPTURE(n);
    for (int rep = 0; rep < 20; ++rep) {
      std::atomic<int> wrong{0};
      epx::threads::run(n, [&](epx::threads::communicator& comm) {
        const int me = comm.rank();
        const std::size_t c = 1000;
        std::vector<int> g(c * static_cast<std::size_t>(n), -1);
        for (std::size_t i = 0; i < c; ++i) g[static_cast<std::size_t>(me) * c + i] = me * 100000 + static_cast<int>(i);
        comm.all_gather(g.data() + static_cast<std::size_t>(me) * c, g.data(), c, epx::datatype::int32);
        for (int p = 0; p < n; ++p)
          for (std::size_t i = 0; i < c; ++i)
            if (g[static_cast<std::size_t>(p) * c + i] != p * 100000 + static_cast<int>(i)) ++wrong;
        std::vector<float> r(c * static_cast<std::size_t>(n));
        for (std::size_t i = 0; i < r.size(); ++i) r[i] = static_cast<float>(me + 1) * static_cast<float>(i % 7);
        float* mine = r.data() + static_cast<std::size_t>(me) * c;
        comm.reduce_scatter(r.data(), mine, c, epx::datatype::float32, 1.0);
        const float ranks = static_cast<float>(n * (n + 1) / 2);
        for (std::size_t i = 0; i < c; ++i)
          if (mine[i] != ranks * static_cast<float>((static_cast<std::size_t>(me) * c + i) % 7)) ++wrong;
      }, normal_options());
      CHECK(wrong.load() == 0);
    }
  }
}

TEST_CASE("threads: access_peers: a null buffer that claims bytes, and a collective inside its function") {
  every_rank_refuses(3, "access_peers: rank 2 publishes buffer 1 as null but claims 64 bytes for it",
                     [](epx::threads::communicator& comm) {
                       int v = 0;
                       const void* mine[2] = {&v, comm.rank() == 2 ? nullptr : &v};
                       const std::size_t bytes[2] = {4, 64};
                       comm.access_peers(mine, bytes, 2, [](const auto&) { FAIL("the function ran"); });
                     });
  // A null buffer of no bytes is fine.
  epx::threads::run(2, [](epx::threads::communicator& comm) {
    const void* mine[1] = {nullptr};
    const std::size_t bytes[1] = {0};
    bool ran = false;
    comm.access_peers(mine, bytes, 1, [&](const auto& peers) { ran = peers(1 - comm.rank(), 0) == nullptr; });
    CHECK(ran);
  });
  // Inside f, a collective on the same communicator would replace the pointers the peers
  // read: every member that tries raises errc::input, after the others' f are done.
  every_rank_refuses(3, "barrier on rank", [](epx::threads::communicator& comm) {
    int v = comm.rank();
    const void* mine[1] = {&v};
    comm.access_peers(mine, 1, [&](const auto& peers) {
      CHECK(*static_cast<const int*>(peers((comm.rank() + 1) % 3, 0)) == (comm.rank() + 1) % 3);
      comm.barrier();
    });
  });
}

TEST_CASE("threads: an unknown datatype and NaN scales") {
  every_rank_refuses(2, "all_reduce: rank 0 passes datatype 42, which is none of epx::datatype's",
                     [](epx::threads::communicator& comm) {
                       std::vector<float> x(4, 1.0f);
                       comm.all_reduce(x.data(), x.data(), 4, static_cast<epx::datatype>(42), 1.0);
                     });
  // The same NaN scale on every rank is the same call (e.g. 1 / 0 tokens): no mismatch.
  epx::threads::run(2, [](epx::threads::communicator& comm) {
    std::vector<float> x(4, 1.0f);
    comm.all_reduce(x.data(), x.data(), 4, epx::datatype::float32, std::numeric_limits<double>::quiet_NaN());
    CHECK(std::isnan(x[0]));
  }, short_options());
}

// docs/guarantees.md, "What you see on failure": every pending and later collective of
// every rank throws `rank R failed: <message> (collective aborted on rank Q)`, the message
// an epx::error's message(), another exception's what(), or "unknown exception" for one
// not derived from std::exception, Q the world rank of the rank that raises it, also in a
// sub-communicator; threads::run rethrows the first exception as it was thrown.
TEST_CASE("threads: the abort message names the failed rank, its message or \"unknown exception\", and the aborted rank") {
  struct not_std {
    int code;
  };
  const int n = 4;
  for (int kind = 0; kind < 3; ++kind) {
    CAPTURE(kind);
    const std::string what = kind == 0 ? "unknown exception" : kind == 1 ? "bad id on rank three" : "plain what";
    std::vector<std::string> pending(n), later(n);
    std::vector<epx::errc> categories(n, epx::errc::internal);
    bool rethrown = false;
    try {
      epx::threads::run(n, [&](epx::threads::communicator& comm) {
        const int r = comm.rank();
        auto sub = comm.split(r % 2, r);  // {0, 2} and {1, 3}
        if (r == 3) {
          std::this_thread::sleep_for(milliseconds(50));  // the others wait by now
          if (kind == 0) throw not_std{7};
          if (kind == 1) EPX_THROW(epx::errc::input, "bad id on rank three");
          throw std::logic_error("plain what");
        }
        // Pending when rank 3 fails: rank 1's barrier of {1, 3}, ranks 0 and 2's of the
        // world after one of {0, 2} that completes; later: the other one.
        if (r != 1) sub.barrier();
        epx::threads::communicator& first = r == 1 ? sub : comm;
        epx::threads::communicator& second = r == 1 ? comm : sub;
        try {
          first.barrier();
        } catch (const epx::error& e) {
          pending[static_cast<std::size_t>(r)] = e.message();
          categories[static_cast<std::size_t>(r)] = e.category();
        }
        try {
          second.barrier();
        } catch (const epx::error& e) {
          later[static_cast<std::size_t>(r)] = e.message();
          throw;
        }
      }, short_options());
    } catch (const not_std& e) {
      rethrown = kind == 0 && e.code == 7;
    } catch (const epx::error& e) {
      rethrown = kind == 1 && e.category() == epx::errc::input && e.message() == "bad id on rank three";
    } catch (const std::logic_error& e) {
      rethrown = kind == 2 && std::string(e.what()) == "plain what";
    }
    CHECK(rethrown);
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      const std::string want = "rank 3 failed: " + what + " (collective aborted on rank " + std::to_string(r) + ")";
      CHECK(categories[static_cast<std::size_t>(r)] == epx::errc::communicator);
      CHECK(pending[static_cast<std::size_t>(r)] == want);
      CHECK(later[static_cast<std::size_t>(r)] == want);
    }
  }
  check_next_run_works(n);
}

// docs/guarantees.md, "Timeouts": the threads watchdog waits 60 s unless told otherwise.
TEST_CASE("threads: the watchdog's default timeout is 60 s") {
  CHECK(epx::threads::options{}.timeout == std::chrono::seconds(60));
}

TEST_CASE("threads: a timeout too long for the clock never fires") {
  epx::threads::options o;
  o.timeout = milliseconds::max();
  epx::threads::run(2, [](epx::threads::communicator& comm) {
    if (comm.rank() == 1) std::this_thread::sleep_for(milliseconds(50));
    std::vector<double> x{1.0};
    epx::all_reduce(comm, epx::span<double>(x));
    CHECK(x[0] == 2.0);
    std::vector<int> a(2, comm.rank()), b(2, -1);
    if (comm.rank() == 0) std::this_thread::sleep_for(milliseconds(50));
    comm.all_to_all(a.data(), b.data(), 1, epx::datatype::int32);
    CHECK(b == std::vector<int>{0, 1});
  }, o);
}

namespace {
std::atomic<int> fail_next_copy{0};
bool flaky_copy(void* d, const void* s, std::size_t b) noexcept {
  if (fail_next_copy.exchange(0) != 0) return false;
  std::memcpy(d, s, b);
  return true;
}
}  // namespace

TEST_CASE("threads: a copy that failed in a call that raised something else is not raised again by the next call") {
  epx::threads::options o = short_options();
  o.memory.copy = &flaky_copy;
  o.memory.name = "flaky";
  seen_errors first(2);
  std::atomic<int> second_ok{0};
  epx::threads::run(2, [&](epx::threads::communicator& comm) {
    const int me = comm.rank();
    std::vector<int> s(8, me), r(16, -1);
    // Counts that disagree for the pair (0 <- 1) only: rank 0 copies its own block (the copy
    // fails), then the mismatch is raised on both.
    std::size_t sc[2] = {4, 4}, sd[2] = {0, 4}, rc[2] = {4, 4}, rd[2] = {0, 4};
    if (me == 1) sc[0] = 3;
    if (me == 0) fail_next_copy = 1;
    try {
      comm.all_to_allv(s.data(), sc, sd, r.data(), rc, rd, epx::datatype::int32);
    } catch (const epx::error& e) {
      first.record(me, e);
    }
    comm.barrier();
    std::vector<int> x(2, 1);
    comm.all_gather(x.data(), r.data(), 2, epx::datatype::int32);  // no copy fails here
    ++second_ok;
  }, o);
  every_rank_saw(first, 2, "all_to_allv: mismatched counts");
  CHECK(second_ok.load() == 2);
}

// One thread at a time per communicator: a second thread of a rank that calls a collective
// while the first is inside one on the same communicator is refused before it publishes
// anything (it replaced the first call's slot: wrong sums, or a mismatch or watchdog error
// on the peers); the first call completes.
TEST_CASE("threads: a second thread calling a collective on a communicator in use is refused") {
  std::atomic<int> refused{0}, done{0};
  std::string message;
  epx::threads::run(2, [&](epx::threads::communicator& comm) {
    int v = 10 + comm.rank();
    const void* mine[1] = {&v};
    int seen = -1;
    comm.access_peers(mine, 1, [&](const auto& peers) {
      seen = *static_cast<const int*>(peers(1 - comm.rank(), 0));
      if (comm.rank() != 0) return;
      // This thread is inside access_peers: another thread's collective must not get in.
      std::thread other([&] {
        try {
          comm.barrier();
        } catch (const epx::error& e) {
          if (e.category() == epx::errc::input) ++refused;
          message = e.message();
        }
      });
      other.join();
    });
    CHECK(seen == 11 - comm.rank());
    std::vector<double> x{1.0};
    epx::all_reduce(comm, epx::span<double>(x));  // the communicator still works
    if (x[0] == 2.0) ++done;
  }, short_options());
  CHECK(refused.load() == 1);
  CHECK(message ==
        "barrier on rank 0: another thread is inside a collective on this communicator (a communicator is used "
        "by one thread at a time)");
  CHECK(done.load() == 2);

  // The same while the first thread waits in a barrier for the other rank, which comes
  // only once the second thread has tried.
  std::atomic<bool> inside{false}, tried{false};
  std::atomic<int> refused2{0}, passed{0};
  epx::threads::run(2, [&](epx::threads::communicator& comm) {
    if (comm.rank() == 0) {
      std::thread other([&] {
        while (!inside.load()) std::this_thread::yield();
        std::this_thread::sleep_for(milliseconds(100));  // rank 0's first thread is in the barrier by then
        std::vector<double> x{1.0};
        try {
          epx::all_reduce(comm, epx::span<double>(x));
        } catch (const epx::error& e) {
          if (e.category() == epx::errc::input && contains(e.message(), "another thread is inside")) ++refused2;
        }
        tried = true;
      });
      inside = true;
      comm.barrier();
      other.join();
    } else {
      while (!tried.load()) std::this_thread::yield();
      comm.barrier();
    }
    std::vector<double> x{1.0 + comm.rank()};
    epx::all_reduce(comm, epx::span<double>(x));
    if (x[0] == 3.0) ++passed;
  }, short_options());
  CHECK(refused2.load() == 1);
  CHECK(passed.load() == 2);
}

// A rank's different communicators (its ep and tp groups) may be used by different threads
// of the rank at the same time.
TEST_CASE("threads: a rank's sub-communicators used at once from two threads of the rank") {
  std::atomic<int> ok{0};
  epx::threads::run(4, [&](epx::threads::communicator& world) {
    epx::threads::communicator ep = world.split(world.rank() / 2, 0);  // {0,1}, {2,3}
    epx::threads::communicator tp = world.split(world.rank() % 2, 0);  // {0,2}, {1,3}
    auto loop = [](epx::threads::communicator& c, int rounds) {
      bool good = true;
      for (int i = 0; i < rounds; ++i) {
        std::vector<double> x(100, 1.0 + i + c.world_rank());
        epx::all_reduce(c, epx::span<double>(x));
        std::vector<int> w(static_cast<std::size_t>(c.size()), -1);
        const int mine = c.world_rank();
        c.all_gather(&mine, w.data(), 1, epx::datatype::int32);
        double sum = 0;
        for (int r : w) sum += 1.0 + i + r;
        good = good && x[0] == sum && x[99] == sum;
      }
      return good;
    };
    bool a = false, b = false;
    std::thread t([&] { a = loop(ep, 300); });
    b = loop(tp, 300);
    t.join();
    if (a && b) ++ok;
  }, normal_options());
  CHECK(ok.load() == 4);
}

// Colors must be non-negative, as on MPI and NCCL: a negative one on one member raises
// errc::input on every member (it made a group of that color instead).
TEST_CASE("threads: split with a negative color raises errc::input on every member") {
  every_rank_refuses(3, "split: rank 1 passes color -1, which must be non-negative",
                     [](epx::threads::communicator& comm) {
                       auto sub = comm.split(comm.rank() == 1 ? -1 : 0, 0);
                       FAIL("split returned a communicator of ", sub.size(), " ranks");
                     });
}

// The typed reduce_scatter and all_gather check their spans by division: sizes whose
// product with the communicator's size wraps (2^63 * 2 = 0) used to pass, and the
// collective then read and wrote 2^63 elements.
TEST_CASE("threads: reduce_scatter and all_gather refuse spans whose size times the ranks wraps") {
  every_rank_refuses(2, "reduce_scatter: send (0) must hold size (2) x recv (9223372036854775808) elements",
                     [](epx::threads::communicator& comm) {
                       std::vector<float> send(4), recv(4);
                       epx::reduce_scatter(comm, epx::span<const float>(send.data(), 0),
                                           epx::span<float>(recv.data(), std::size_t{1} << 63));
                     });
  every_rank_refuses(2, "all_gather: recv (0) must hold size (2) x send (9223372036854775808) elements",
                     [](epx::threads::communicator& comm) {
                       std::vector<float> send(4), recv(4);
                       epx::all_gather(comm, epx::span<const float>(send.data(), std::size_t{1} << 63),
                                       epx::span<float>(recv.data(), 0));
                     });
}

TEST_CASE("threads: run refuses no ranks and a watchdog timeout that is not positive, before any rank starts") {
  std::atomic<int> ran{0};
  const auto refused = [&](int n, const epx::threads::options& o) {
    try {
      epx::threads::run(n, [&](epx::threads::communicator&) { ++ran; }, o);
    } catch (const epx::error& e) {
      CHECK(e.category() == epx::errc::configuration);
      return e.message();
    }
    return std::string("no error");
  };
  CHECK(contains(refused(0, normal_options()), "threads::run: number of ranks (0) must be at least 1"));
  CHECK(contains(refused(-3, normal_options()), "threads::run: number of ranks (-3) must be at least 1"));
  epx::threads::options o;
  o.timeout = milliseconds(0);
  CHECK(contains(refused(2, o), "threads::run: watchdog timeout (0 ms) must be positive"));
  o.timeout = milliseconds(-5);
  CHECK(contains(refused(2, o), "threads::run: watchdog timeout (-5 ms) must be positive"));
  CHECK(ran.load() == 0);
}

// The typed collectives of epx/comm/collectives.hpp check their spans on the calling rank,
// before the collective: every rank that passes spans that do not fit raises errc::input,
// nothing moves, and the communicator goes on.
TEST_CASE("threads: the typed collectives refuse spans that do not fit the communicator") {
  using sizes = std::vector<std::size_t>;
  SUBCASE("all_to_all: a send that is not a multiple of the size, a recv of another size") {
    every_rank_refuses(2, "all_to_all: send (5) and recv (5) must hold the same multiple of the communicator size (2)",
                       [](epx::threads::communicator& comm) {
                         std::vector<float> send(5, 1.0f), recv(5);
                         epx::all_to_all(comm, epx::span<const float>(send), epx::span<float>(recv));
                       });
    every_rank_refuses(3, "all_to_all: send (6) and recv (3) must hold the same multiple of the communicator size (3)",
                       [](epx::threads::communicator& comm) {
                         std::vector<float> send(6, 1.0f), recv(3);
                         epx::all_to_all(comm, epx::span<const float>(send), epx::span<float>(recv));
                       });
  }
  SUBCASE("all_to_allv and all_to_allv_rows: counts that are not one per peer") {
    every_rank_refuses(3, "all_to_allv: counts and displacements need one entry per peer (3)",
                       [](epx::threads::communicator& comm) {
                         std::vector<int> send(6, 1), recv(6);
                         const sizes c = {2, 2, 2}, d = {0, 2, 4}, short_d = {0, 2};
                         epx::all_to_allv(comm, send.data(), epx::span<const std::size_t>(c),
                                          epx::span<const std::size_t>(d), recv.data(), epx::span<const std::size_t>(c),
                                          epx::span<const std::size_t>(short_d));
                       });
    every_rank_refuses(2, "all_to_allv_rows: counts and offsets need one entry per peer (2)",
                       [](epx::threads::communicator& comm) {
                         std::vector<double> send(8, 1.0), recv(8);
                         const sizes c = {1, 1}, d = {0, 1}, long_c = {1, 1, 0};
                         epx::all_to_allv_rows(comm, send.data(), epx::span<const std::size_t>(long_c),
                                               epx::span<const std::size_t>(d), recv.data(),
                                               epx::span<const std::size_t>(c), epx::span<const std::size_t>(d), 4);
                       });
  }
  SUBCASE("all_to_allv_segments and all_to_allv_indexed: arrays that are not peers * nseg") {
    every_rank_refuses(2, "all_to_allv_segments: counts and displacements need peers*nseg (2*2 = 4) entries",
                       [](epx::threads::communicator& comm) {
                         std::vector<float> send(8, 1.0f), recv(8);
                         const sizes four = {1, 1, 1, 1}, d = {0, 1, 2, 3}, three = {1, 1, 1};
                         epx::all_to_allv_segments(comm, send.data(), epx::span<const std::size_t>(four),
                                                   epx::span<const std::size_t>(d), recv.data(),
                                                   epx::span<const std::size_t>(three),
                                                   epx::span<const std::size_t>(d), 2, 2);
                       });
    every_rank_refuses(2, "all_to_allv_indexed: counts and displacements need peers*nseg (2*1 = 2) entries",
                       [](epx::threads::communicator& comm) {
                         std::vector<float> src(8, 1.0f), recv(8);
                         const std::vector<std::int64_t> rows = {0, 1};
                         const sizes c = {1, 1}, d = {0, 1}, one = {0};
                         epx::all_to_allv_indexed(comm, epx::span<const float>(src),
                                                  epx::span<const std::int64_t>(rows), epx::span<const std::size_t>(c),
                                                  epx::span<const std::size_t>(one), recv.data(),
                                                  epx::span<const std::size_t>(c), epx::span<const std::size_t>(d), 1, 4);
                       });
  }
  SUBCASE("all_to_allv_indexed: a src that is not whole rows") {
    every_rank_refuses(2, "all_to_allv_indexed: src holds 10 elements, not a whole number of rows of 4",
                       [](epx::threads::communicator& comm) {
                         std::vector<float> src(10, 1.0f), recv(8);
                         const std::vector<std::int64_t> rows = {0, 1};
                         const sizes c = {1, 1}, d = {0, 1};
                         epx::all_to_allv_indexed(comm, epx::span<const float>(src),
                                                  epx::span<const std::int64_t>(rows), epx::span<const std::size_t>(c),
                                                  epx::span<const std::size_t>(d), recv.data(),
                                                  epx::span<const std::size_t>(c), epx::span<const std::size_t>(d), 1, 4);
                       });
  }
  SUBCASE("one rank's spans alone: it raises errc::input, its peers errc::communicator once it calls on") {
    // The check is the calling rank's (docs/errors.md): the peers wait in the collective
    // until that rank's next collective shows the calls differ, not for the watchdog.
    const int n = 3;
    seen_errors first(n);
    const auto t0 = clock_type::now();
    epx::threads::run(n, [&](epx::threads::communicator& comm) {
      std::vector<float> send(comm.rank() == 1 ? 5 : 6, 1.0f), recv(6);
      try {
        epx::all_to_all(comm, epx::span<const float>(send), epx::span<float>(recv));
      } catch (const epx::error& e) {
        first.record(comm.rank(), e);
      }
      try {
        (void)still_works(comm);  // rank 1's next collective: the calls differ, on every rank
      } catch (const epx::error&) {
      }
    }, normal_options());
    CHECK(clock_type::now() - t0 < std::chrono::seconds(10));  // well before the 30 s watchdog
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto& m = first.messages[static_cast<std::size_t>(r)];
      CAPTURE(m);
      if (r == 1) {
        CHECK(first.categories[1] == epx::errc::input);
        CHECK(contains(m, "all_to_all: send (5) and recv (6) must hold the same multiple of the communicator size (3)"));
      } else {
        CHECK(first.categories[static_cast<std::size_t>(r)] == epx::errc::communicator);
        CHECK(contains(m, "mismatched collectives"));
      }
    }
  }
  SUBCASE("all_reduce: send and recv of different sizes") {
    every_rank_refuses(3, "all_reduce: send (4) and recv (3) sizes differ", [](epx::threads::communicator& comm) {
      std::vector<float> send(4, 1.0f), recv(3, -1.0f);
      epx::all_reduce(comm, epx::span<const float>(send), epx::span<float>(recv));
      FAIL("the all_reduce ran");
    });
  }
}

}  // namespace test_threads_cpp
