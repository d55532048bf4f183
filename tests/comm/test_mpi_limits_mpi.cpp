// MPI backend at its limits: what a watchdog timeout leaves behind, and a message over
// 2^31 bytes through the segmented exchange.
//
// - A caught timeout (a call whose buffers are all the library's own) must not let the late
//   rank write into freed memory: the timed-out request and its buffer stay alive in the
//   communicator until the late rank arrives, and the communicator refuses further use.
// - A timeout in a call that writes the caller's buffers ends the job (ctest
//   test_comm_mpi_watchdog_caller_buffers_np2, with the message as its pass condition).
// - A per-peer segment of 2^30 + 1000 bf16 elements (2^31 + 2000 bytes) through
//   all_to_allv_segments, in chunks of max_count = 2^27 elements (the artificial limit that
//   stands in for INT_MAX) and on the native path (byte displacements past 2^31): ctest
//   test_comm_mpi_segments_over_2gib_np2 (about 2 GiB of memory on the receiving rank).
#include <doctest/doctest.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/mpi.hpp"

namespace {

using epx::mpi::communicator;

communicator fresh(const epx::mpi::options& o) {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  return communicator::adopt(dup, o);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("mpi: a caught watchdog timeout keeps its buffers alive until the late rank arrives") {
  communicator world = communicator::world();
  const int n = world.size(), me = world.rank();
  if (n < 2) return;
  const bool late = me == n - 1;
  constexpr std::size_t count = 64;
  const std::size_t gather_bytes = static_cast<std::size_t>(n) * count * sizeof(float);
  epx::mpi::options o;
  o.timeout = std::chrono::milliseconds(300);
  o.check_counts = false;  // the all_reduce is then one MPI_Iallgather into the library's buffer
  communicator w = fresh(o);
  std::vector<std::vector<unsigned char>> probes;
  if (!late) {
    {
      std::vector<float> x(count, 1.0f);
      std::string what;
      try {
        epx::all_reduce(w, epx::make_span(x));
      } catch (const epx::error& e) {
        what = e.what();
        CHECK(e.category() == epx::errc::communicator);
      }
      CHECK_MESSAGE(contains(what, "watchdog: MPI all_reduce"), what);
    }  // x is freed here, as a caller that caught the error would free it
    // Fresh blocks of the gather buffer's size: without the fix, malloc hands out the freed
    // gather buffer again and the late rank's data lands in one of these.
    for (int i = 0; i < 32; ++i) probes.emplace_back(gather_bytes, static_cast<unsigned char>(0xa5));
    CHECK(w.pending_after_timeout() == 1);
    CHECK(contains(w.failure(), "watchdog"));
    std::string again;
    try {
      w.barrier();
    } catch (const epx::error& e) {
      again = e.what();
    }
    CHECK_MESSAGE(contains(again, "failed earlier and cannot be used"), again);
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    std::vector<float> x(count, 2.0f);
    epx::all_reduce(w, epx::make_span(x));  // matches the others' timed-out gathers
    CHECK(x[0] == static_cast<float>(n - 1) + 2.0f);  // their inputs were kept too
  }
  world.barrier();
  if (!late) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (w.pending_after_timeout() != 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(w.pending_after_timeout() == 0);
    std::size_t touched = 0;
    for (const auto& p : probes)
      for (unsigned char c : p) touched += c != 0xa5;
    CHECK_MESSAGE(touched == 0, touched, " bytes of freshly allocated memory were written by the late rank");
  }
  world.barrier();
}

TEST_CASE("mpi: a caught timeout at access_peers' entry names access_peers") {
  communicator world = communicator::world();
  const int n = world.size(), me = world.rank();
  if (n < 2) return;
  epx::mpi::options o;
  o.timeout = std::chrono::milliseconds(300);
  communicator w = fresh(o);
  if (!w.peer_access_available()) return;  // ranks on several nodes: no peer access to time out in
  const bool late = me == n - 1;
  int v = me;
  const void* mine[1] = {&v};
  const std::size_t bytes[1] = {sizeof(int)};
  int seen = 0;
  const auto access = [&] {
    w.access_peers(mine, bytes, 1, [&](const auto& peers) {
      seen = 0;
      for (int r = 0; r < n; ++r) seen += *static_cast<const int*>(peers(r, 0));
    });
  };
  access();  // together once: the shared window exists before the late call
  CHECK(seen == n * (n - 1) / 2);
  if (!late) {
    std::string what;
    try {
      access();
    } catch (const epx::error& e) {
      what = e.what();
      CHECK(e.category() == epx::errc::communicator);
    }
    CHECK_MESSAGE(contains(what, "watchdog: MPI access_peers on rank " + std::to_string(me)), what);
    // The timeout hit the call header (the agreement), which the late rank's header
    // completes. The rest of the late rank's access_peers, as nonblocking calls (only those
    // match them), so that it leaves access_peers normally: its gather of the records, with
    // this rank's record of the first call's copy (one int at offset 0 of its segment), and
    // its exit barrier.
    constexpr std::size_t L = epx::detail::mpi_peer_record;
    std::vector<std::uint64_t> rec(static_cast<std::size_t>(n) * L, 0);
    rec[static_cast<std::size_t>(me) * L + 1] = 1;
    rec[static_cast<std::size_t>(me) * L + 2] = epx::detail::mpi_peer_round(sizeof(int));
    MPI_Request gather = MPI_REQUEST_NULL;
    MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, rec.data(), static_cast<int>(L), MPI_UINT64_T, w.native(),
                   &gather);
    MPI_Wait(&gather, MPI_STATUS_IGNORE);
    MPI_Request exit_barrier = MPI_REQUEST_NULL;
    MPI_Ibarrier(w.native(), &exit_barrier);
    MPI_Wait(&exit_barrier, MPI_STATUS_IGNORE);
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    access();  // meets the others' timed-out headers, then their gather and barrier above
    CHECK(seen == n * (n - 1) / 2);
  }
  world.barrier();
}

// Run only by the ctest test_comm_mpi_watchdog_caller_buffers_np2 (--no-skip): the last
// rank stalls past the watchdog before an all_to_allv without the count check, so the
// others time out inside the row exchange, whose buffers are the caller's: the job ends
// with the watchdog's message (a raise would free them under the pending receive).
TEST_CASE("mpi: a timeout that holds the caller's buffers ends the job" * doctest::skip()) {
  communicator world = communicator::world();
  epx::mpi::options o;
  o.timeout = std::chrono::milliseconds(1000);
  o.check_counts = false;
  communicator w = fresh(o);
  const int n = w.size();
  std::vector<std::size_t> c(static_cast<std::size_t>(n), 4), d(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) d[static_cast<std::size_t>(p)] = 4 * static_cast<std::size_t>(p);
  std::vector<float> send(4 * static_cast<std::size_t>(n), 1.0f), recv(send.size());
  auto exchange = [&] {
    epx::all_to_allv(w, send.data(), epx::make_span(c), epx::make_span(d), recv.data(), epx::make_span(c),
                     epx::make_span(d));
  };
  exchange();  // together once (the first one also sets up the point-to-point communicator)
  if (w.rank() == n - 1) std::this_thread::sleep_for(std::chrono::seconds(20));
  exchange();
  FAIL("the all_to_allv returned");
}

namespace {

// Anonymous memory: untouched pages cost nothing (they read as zeros).
struct mapping {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit mapping(std::size_t b) : bytes(b) {
    p = mmap(nullptr, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) p = nullptr;
  }
  ~mapping() {
    if (p != nullptr) munmap(p, bytes);
  }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  std::uint16_t* u16() const { return static_cast<std::uint16_t*>(p); }
};

// The marked elements of the big segment and their values; every other element is zero.
std::vector<std::size_t> marks(std::size_t big, std::size_t chunk) {
  std::vector<std::size_t> m;
  for (std::size_t i = 0; i < 8; ++i) m.push_back(i);
  for (std::size_t b = chunk; b < big; b += chunk)
    for (std::size_t i = b - 3; i < b + 3; ++i) m.push_back(i);
  for (std::size_t i = big - 8; i < big; ++i) m.push_back(i);
  const std::size_t two_gib = (std::size_t{1} << 31) / 2;  // the element at byte 2^31
  for (std::size_t i = two_gib - 3; i < two_gib + 3; ++i) m.push_back(i);
  for (std::size_t i = 12345; i < big; i += 40000017) m.push_back(i);
  std::sort(m.begin(), m.end());
  m.erase(std::unique(m.begin(), m.end()), m.end());
  return m;
}
std::uint16_t mark_value(std::size_t i) { return static_cast<std::uint16_t>(((i * 2654435761u) >> 7) | 1u); }

// Whether [b, e) of a is all zero.
bool zeros(const std::uint16_t* a, std::size_t b, std::size_t e) {
  for (; b < e && (b & 3) != 0; ++b)
    if (a[b] != 0) return false;
  const auto* w = reinterpret_cast<const std::uint64_t*>(a + b);
  const std::size_t words = (e - b) / 4;
  for (std::size_t i = 0; i < words; ++i)
    if (w[i] != 0) return false;
  for (b += words * 4; b < e; ++b)
    if (a[b] != 0) return false;
  return true;
}

}  // namespace

// Run only by the ctest test_comm_mpi_segments_over_2gib_np2 (--no-skip), at np 2.
TEST_CASE("mpi: a segmented exchange with a per-peer segment over 2^31 bytes" * doctest::skip()) {
  communicator world = communicator::world();
  if (world.size() != 2) {
    MESSAGE("needs exactly 2 ranks");
    return;
  }
  const int me = world.rank();
  const std::size_t big = (std::size_t{1} << 30) + 1000;  // bf16 elements: 2^31 + 2000 bytes
  const std::size_t small0 = 3, small1 = 5, nseg = 2;
  // Rank 0 sends segment 0 = big and segment 1 = small0 elements to rank 1; rank 1 sends
  // small1 and small0 back; nothing to self. Arrays are [peer][segment].
  std::vector<std::size_t> sc(4, 0), sd(4, 0), rc(4, 0), rd(4, 0);
  const std::size_t peer = me == 0 ? 1 : 0;
  if (me == 0) {
    sc[peer * nseg + 0] = big;
    sc[peer * nseg + 1] = small0;
    sd[peer * nseg + 1] = big;
    rc[peer * nseg + 0] = small1;
    rc[peer * nseg + 1] = small0;
    rd[peer * nseg + 1] = small1;
  } else {
    sc[peer * nseg + 0] = small1;
    sc[peer * nseg + 1] = small0;
    sd[peer * nseg + 1] = small1;
    rc[peer * nseg + 0] = big;
    rc[peer * nseg + 1] = small0;
    rd[peer * nseg + 1] = big;
  }
  const std::size_t send_n = me == 0 ? big + small0 : small1 + small0;
  const std::size_t recv_n = me == 0 ? small1 + small0 : big + small0;
  for (std::size_t limit : {std::size_t{1} << 27, static_cast<std::size_t>(INT_MAX)}) {
    CAPTURE(limit);
    epx::mpi::options o;
    o.max_count = limit;
    o.timeout = std::chrono::seconds(120);
    communicator c = fresh(o);
    const std::size_t rounds_before = c.chunked_rounds();
    mapping send(send_n * 2), recv(recv_n * 2);
    REQUIRE(send.p != nullptr);
    REQUIRE(recv.p != nullptr);
    const auto m = marks(big, std::size_t{1} << 27);
    if (me == 0) {
      for (std::size_t i : m) send.u16()[i] = mark_value(i);
      for (std::size_t i = 0; i < small0; ++i) send.u16()[big + i] = static_cast<std::uint16_t>(100 + i);
    } else {
      for (std::size_t i = 0; i < send_n; ++i) send.u16()[i] = static_cast<std::uint16_t>(200 + i);
      std::memset(recv.p, 0xff, recv_n * 2);  // every byte must be overwritten
    }
    epx::all_to_allv_segments(c, static_cast<const epx::bf16*>(send.p), epx::make_span(sc), epx::make_span(sd),
                              static_cast<epx::bf16*>(recv.p), epx::make_span(rc), epx::make_span(rd), nseg, 1);
    if (limit < INT_MAX) CHECK(c.chunked_rounds() - rounds_before >= 9);  // ceil((2^30 + 1000) / 2^27)
    if (me == 1) {
      const std::uint16_t* r = recv.u16();
      std::size_t wrong = 0, at = 0;
      for (std::size_t i : m) {
        if (!zeros(r, at, i)) ++wrong;
        if (r[i] != mark_value(i)) ++wrong;
        at = i + 1;
      }
      if (!zeros(r, at, big)) ++wrong;
      for (std::size_t i = 0; i < small0; ++i) wrong += r[big + i] != 100 + i;
      CHECK_MESSAGE(wrong == 0, wrong, " wrong regions or marks in the segment of ", big * 2, " bytes");
    } else {
      const std::uint16_t* r = recv.u16();
      for (std::size_t i = 0; i < small1 + small0; ++i) CHECK(r[i] == 200 + i);
    }
    world.barrier();
  }
}
