// MPI communicator backend: run under mpiexec with 1, 2, 4 and 8 ranks (see tests/CMakeLists.txt).
//
// The shared body of every host backend (comm/comm_cases.hpp) runs on the world
// communicator, and again with a tiny max_count so that every transfer takes the chunked
// point-to-point path that carries counts over 2^31 elements. The MPI-specific cases follow.
// Every rank can regenerate what every other rank sends (values are a hash of source,
// destination, index and a salt), so each receiver checks its data bitwise, and sums are
// checked against a float64 reference computed from all ranks' regenerated inputs.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/comm_cases.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/mpi.hpp"
#include "epx/comm/threads.hpp"
#include "epx/mesh/mesh.hpp"

namespace {

using epx::bf16;
using epx::fp16;
using epx::mpi::communicator;

static_assert(epx::is_communicator_v<communicator>);

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint64_t key(std::uint64_t salt, std::uint64_t src, std::uint64_t dst, std::uint64_t i) {
  return mix(mix(mix(mix(salt) ^ src) ^ dst) ^ i);
}

// A deterministic value of T from a hash: small integers, or floats in [-4, 4).
template <class T>
T value_of(std::uint64_t h) {
  if constexpr (std::is_same_v<T, std::byte>) {
    return static_cast<std::byte>(h & 0xff);
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<std::int64_t>(h % 2001) - 1000);
  } else {
    const double v = (static_cast<double>(h >> 11) * 0x1.0p-53) * 8.0 - 4.0;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return static_cast<T>(v);
    else return T(static_cast<float>(v));
  }
}

template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
T sentinel() {
  T v;
  std::memset(&v, 0x5a, sizeof v);
  return v;
}

template <class T>
const char* type_name() {
  return epx::to_string(epx::datatype_of<T>());
}

// Elements rank `src` sends to rank `dst` in the uneven pattern: some pairs send nothing.
std::size_t uneven_count(int src, int dst, std::size_t salt) {
  return static_cast<std::size_t>((src * 7 + dst * 3 + static_cast<int>(salt)) % 5) * 3;
}

// all_to_allv with uneven counts, gaps between blocks (checked untouched) and every
// peer's data regenerated and compared bitwise.
template <class T>
void check_all_to_allv(communicator& comm, std::size_t salt) {
  const int n = comm.size(), me = comm.rank();
  std::vector<std::size_t> sc(n), sd(n), rc(n), rd(n);
  std::size_t stotal = 0, rtotal = 0;
  for (int p = 0; p < n; ++p) {
    sc[p] = uneven_count(me, p, salt);
    sd[p] = stotal;
    stotal += sc[p] + 1;  // one element gap after every block
    rc[p] = uneven_count(p, me, salt);
    rd[p] = rtotal;
    rtotal += rc[p] + 2;
  }
  std::vector<T> send(stotal, sentinel<T>()), recv(rtotal, sentinel<T>());
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = value_of<T>(key(salt, me, p, i));
  epx::all_to_allv(comm, send.data(), epx::make_span(sc), epx::make_span(sd), recv.data(), epx::make_span(rc),
                   epx::make_span(rd));
  std::size_t wrong = 0, gap_touched = 0;
  for (int p = 0; p < n; ++p) {
    for (std::size_t i = 0; i < rc[p]; ++i)
      if (!same_bits(recv[rd[p] + i], value_of<T>(key(salt, p, me, i)))) ++wrong;
    for (std::size_t i = rc[p]; i < rc[p] + 2; ++i)
      if (!same_bits(recv[rd[p] + i], sentinel<T>())) ++gap_touched;
  }
  CHECK_MESSAGE(wrong == 0, type_name<T>(), " rank ", me, " of ", n);
  CHECK(gap_touched == 0);
}

template <class T>
void check_all_to_all(communicator& comm, std::size_t count, std::size_t salt) {
  const int n = comm.size(), me = comm.rank();
  std::vector<T> send(count * n), recv(count * n, sentinel<T>());
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < count; ++i) send[p * count + i] = value_of<T>(key(salt, me, p, i));
  epx::all_to_all(comm, epx::span<const T>(send.data(), send.size()), epx::span<T>(recv.data(), recv.size()));
  std::size_t wrong = 0;
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < count; ++i)
      if (!same_bits(recv[p * count + i], value_of<T>(key(salt, p, me, i)))) ++wrong;
  CHECK_MESSAGE(wrong == 0, type_name<T>(), " count ", count);
}

template <class T>
void check_all_gather_broadcast(communicator& comm, std::size_t count, std::size_t salt) {
  const int n = comm.size(), me = comm.rank();
  std::vector<T> send(count), recv(count * n, sentinel<T>());
  for (std::size_t i = 0; i < count; ++i) send[i] = value_of<T>(key(salt, me, 0, i));
  epx::all_gather(comm, epx::span<const T>(send.data(), count), epx::span<T>(recv.data(), recv.size()));
  std::size_t wrong = 0;
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < count; ++i)
      if (!same_bits(recv[p * count + i], value_of<T>(key(salt, p, 0, i)))) ++wrong;
  CHECK_MESSAGE(wrong == 0, "all_gather ", type_name<T>(), " count ", count);
  for (int root = 0; root < n; ++root) {
    std::vector<T> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = value_of<T>(key(salt + 1, me, root, i));
    epx::broadcast(comm, epx::span<T>(data.data(), count), root);
    wrong = 0;
    for (std::size_t i = 0; i < count; ++i)
      if (!same_bits(data[i], value_of<T>(key(salt + 1, root, root, i)))) ++wrong;
    CHECK_MESSAGE(wrong == 0, "broadcast ", type_name<T>(), " root ", root);
  }
}

// Bound on |result - float64 reference| for one element: the accumulation-type rounding of
// every partial sum plus the final rounding to T.
template <class T>
double tolerance(double ref, double abs_sum, int n) {
  if constexpr (std::is_integral_v<T>) {
    (void)ref, (void)abs_sum, (void)n;
    return 0.0;
  } else {
    const double acc_eps = std::is_same_v<T, double> ? 0x1.0p-52 : 0x1.0p-23;
    const double out_eps = std::is_same_v<T, bf16> ? 0x1.0p-8 : std::is_same_v<T, fp16> ? 0x1.0p-11 : acc_eps;
    const double out_abs = std::is_same_v<T, fp16> ? 0x1.0p-25 : std::is_same_v<T, bf16> ? 0x1.0p-134 : 0.0;
    return (n + 1) * acc_eps * abs_sum + out_eps * std::fabs(ref) + out_abs;
  }
}

// Result bits of every rank are gathered and compared with rank 0's.
template <class T>
bool identical_on_all_ranks(communicator& comm, const std::vector<T>& v) {
  const int n = comm.size();
  const std::size_t bytes = v.size() * sizeof(T);
  std::vector<unsigned char> all(bytes * n);
  epx::all_gather(comm, epx::span<const unsigned char>(reinterpret_cast<const unsigned char*>(v.data()), bytes),
                  epx::span<unsigned char>(all.data(), all.size()));
  for (int p = 1; p < n; ++p)
    if (std::memcmp(all.data(), all.data() + p * bytes, bytes) != 0) return false;
  return true;
}

template <class T>
void check_all_reduce(communicator& comm, std::size_t count, double scale, bool in_place, std::size_t salt) {
  const int n = comm.size(), me = comm.rank();
  std::vector<T> send(count), recv(count, sentinel<T>());
  for (std::size_t i = 0; i < count; ++i) send[i] = value_of<T>(key(salt, me, 0, i));
  if (in_place) {
    recv = send;
    epx::all_reduce(comm, epx::span<T>(recv.data(), count), scale);
  } else {
    epx::all_reduce(comm, epx::span<const T>(send.data(), count), epx::span<T>(recv.data(), count), scale);
  }
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double sum = 0, abs_sum = 0;
    for (int p = 0; p < n; ++p) {
      const double x = to_double(value_of<T>(key(salt, p, 0, i)));
      sum += x;
      abs_sum += std::fabs(x);
    }
    double ref = sum * scale;
    if constexpr (std::is_integral_v<T>) ref = scale == 1.0 ? sum : static_cast<double>(std::llround(sum * scale));
    const double err = std::fabs(to_double(recv[i]) - ref);
    worst = std::max(worst, err);
    if (!(err <= tolerance<T>(ref, abs_sum * std::fabs(scale), n))) ++bad;
  }
  CHECK_MESSAGE(bad == 0, "all_reduce ", type_name<T>(), " count ", count, " scale ", scale, " worst ", worst);
  CHECK_MESSAGE(identical_on_all_ranks(comm, recv), "all_reduce ", type_name<T>(), " differs between ranks");
}

template <class T>
void check_reduce_scatter(communicator& comm, std::size_t count, double scale, std::size_t salt) {
  const int n = comm.size(), me = comm.rank();
  std::vector<T> send(count * n), recv(count, sentinel<T>());
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = value_of<T>(key(salt, me, 1, i));
  epx::reduce_scatter(comm, epx::span<const T>(send.data(), send.size()), epx::span<T>(recv.data(), count), scale);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double sum = 0, abs_sum = 0;
    for (int p = 0; p < n; ++p) {
      const double x = to_double(value_of<T>(key(salt, p, 1, me * count + i)));
      sum += x;
      abs_sum += std::fabs(x);
    }
    double ref = sum * scale;
    if constexpr (std::is_integral_v<T>) ref = scale == 1.0 ? sum : static_cast<double>(std::llround(sum * scale));
    if (!(std::fabs(to_double(recv[i]) - ref) <= tolerance<T>(ref, abs_sum * std::fabs(scale), n))) ++bad;
  }
  CHECK_MESSAGE(bad == 0, "reduce_scatter ", type_name<T>(), " count ", count, " scale ", scale);
}

// Runs `f` and expects epx::error of category `c` whose message contains `part`.
template <class F>
void check_error(F&& f, epx::errc c, const std::string& part) {
  bool thrown = false;
  try {
    f();
  } catch (const epx::error& e) {
    thrown = true;
    CHECK_MESSAGE(e.category() == c, e.what());
    CHECK_MESSAGE(e.message().find(part) != std::string::npos, "message \"", e.message(), "\" lacks \"", part,
                  "\"");
  }
  CHECK_MESSAGE(thrown, "expected an epx::error containing \"", part, "\"");
}

communicator small_chunks(std::size_t max_count) {
  epx::mpi::options o;
  o.max_count = max_count;
  return communicator::world(o);
}

}  // namespace

TEST_CASE("mpi: shared communicator cases") {
  communicator w = communicator::world();
  comm_cases::run_comm_cases(w);
  // 64 MiB messages at 2 ranks; smaller at 4 and 8 ranks to keep two-core CI short.
  comm_cases::case_large(w, w.size() <= 2 ? std::size_t{64} << 20 : std::size_t{4} << 20);
}

TEST_CASE("mpi: shared communicator cases through the chunked path (max_count = 257)") {
  // Messages over 257 elements go in chunks (a few rounds each: tiny limits are covered by
  // the cheaper chunked-path case below).
  // Only the cases whose transfers can exceed the limit; all_reduce with fewer, smaller
  // counts than the shared case (every round is a synchronization on oversubscribed CI).
  communicator w = small_chunks(257);
  const std::size_t before = w.chunked_rounds();
  comm_cases::case_all_to_all(w);
  comm_cases::case_all_to_allv(w);
  comm_cases::case_all_to_allv_rows(w);
  comm_cases::case_reduce_scatter(w);
  comm_cases::case_all_gather(w);
  comm_cases::case_broadcast(w);
  comm_cases::case_large(w, std::size_t{1} << 16);  // 8192 elements in 257-element chunks
  check_all_reduce<float>(w, 5000, 0.25, false, 21);
  check_all_reduce<bf16>(w, 3001, 1.0 / w.size(), true, 22);
  check_all_reduce<std::int64_t>(w, 2999, 1.0, false, 23);
  if (w.size() > 1) CHECK(w.chunked_rounds() > before);
}

TEST_CASE("mpi: world communicator, environment guard and wrapping") {
  epx::mpi::environment env;  // MPI is already up: the guard neither initializes nor finalizes
  CHECK_FALSE(env.owns_mpi());
  communicator w;
  int r = -1, s = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  CHECK(w.rank() == r);
  CHECK(w.size() == s);
  CHECK(w.native() == MPI_COMM_WORLD);
  communicator copy = w;  // copies share the wrapped communicator
  CHECK(copy.native() == MPI_COMM_WORLD);
  communicator moved = std::move(copy);
  CHECK(moved.size() == s);
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  {
    communicator user(dup);  // wrapped, not owned
    user.barrier();
  }
  int cmp = -1;
  CHECK(MPI_Comm_compare(dup, MPI_COMM_WORLD, &cmp) == MPI_SUCCESS);  // still valid after the wrapper died
  CHECK(cmp == MPI_CONGRUENT);
  MPI_Comm_free(&dup);
  check_error([] { communicator bad(MPI_COMM_NULL); }, epx::errc::input, "MPI_COMM_NULL");
  epx::mpi::options o;
  o.max_count = 0;
  check_error([&] { communicator bad(MPI_COMM_WORLD, o); }, epx::errc::configuration, "max_count (0)");
  o = {};
  o.timeout = std::chrono::milliseconds(-1);
  check_error([&] { communicator bad(MPI_COMM_WORLD, o); }, epx::errc::configuration, "timeout (-1 ms) must not be negative");
  // An intercommunicator (even ranks and odd ranks as its two groups) is refused: its
  // collectives pair the two groups (an all_reduce summed the other group's inputs only).
  if (s >= 2) {
    MPI_Comm half = MPI_COMM_NULL, inter = MPI_COMM_NULL;
    REQUIRE(MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &half) == MPI_SUCCESS);
    REQUIRE(MPI_Intercomm_create(half, 0, MPI_COMM_WORLD, r % 2 == 0 ? 1 : 0, 7, &inter) == MPI_SUCCESS);
    check_error([&] { communicator bad(inter); }, epx::errc::input, "an intercommunicator cannot be wrapped");
    MPI_Comm merged = MPI_COMM_NULL;
    REQUIRE(MPI_Intercomm_merge(inter, r % 2, &merged) == MPI_SUCCESS);
    {
      communicator ok(merged);  // merged: an intracommunicator of every rank
      std::vector<double> v{1.0};
      ok.all_reduce(v.data(), v.data(), 1, epx::datatype::float64, 1.0);
      CHECK(v[0] == s);
    }
    MPI_Comm_free(&merged);
    MPI_Comm_free(&inter);
    MPI_Comm_free(&half);
  }
  // A guard that needs a higher thread level than MPI was started with raises.
  if (env.thread_level() < MPI_THREAD_MULTIPLE)
    check_error([] { epx::mpi::environment more(nullptr, nullptr, MPI_THREAD_MULTIPLE); }, epx::errc::configuration,
                "MPI was started by the caller with a lower level: a program that initialises MPI itself needs no "
                "guard (wrap its communicators: epx::mpi::communicator(MPI_COMM_WORLD)), or ask for the level it "
                "started MPI with (a third argument)");
}

TEST_CASE("mpi: below MPI_THREAD_SERIALIZED, a collective from another thread than MPI's main one raises before any MPI call") {
  int level = MPI_THREAD_MULTIPLE;
  MPI_Query_thread(&level);
  communicator w = communicator::world();  // made on the main thread, used on a worker
  std::string caught;
  epx::errc category = epx::errc::internal;
  bool raised = false;
  std::thread worker([&] {
    try {
      float v = 1.0f;
      w.all_reduce(&v, &v, 1, epx::datatype::float32, 1.0);
    } catch (const epx::error& e) {
      raised = true;
      category = e.category();
      caught = e.message();
    }
  });
  worker.join();
  if (level >= MPI_THREAD_SERIALIZED) {
    CHECK_FALSE(raised);  // every rank took part in the sum on its worker
    return;
  }
  // Every rank raised on its own worker: no rank entered the sum, none waits in it.
  REQUIRE(raised);
  CHECK(category == epx::errc::configuration);
  CHECK(caught.find("MPI all_reduce on rank " + std::to_string(w.rank()) +
                    ": called from a thread other than the one that initialised MPI, which MPI's thread level " +
                    (level == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : "MPI_THREAD_FUNNELED") +
                    " does not allow (nothing was sent)") == 0);
  CHECK(caught.find("MPI_THREAD_MULTIPLE") != std::string::npos);
  // The communicator was not touched: the main thread goes on with it.
  double d = 1.0;
  w.all_reduce(&d, &d, 1, epx::datatype::float64, 1.0);
  CHECK(d == w.size());
}

// docs/guarantees.md: the count check is on unless turned off, and the watchdog waits 10
// minutes ("Timeouts").
TEST_CASE("mpi: the defaults: check_counts on, a watchdog of 10 minutes, shared memory") {
  const epx::mpi::options o;
  CHECK(o.check_counts);
  CHECK(o.timeout == std::chrono::minutes(10));
  CHECK(o.shared_memory);
}

TEST_CASE("mpi: the watchdog lets a late rank through, and is off with a zero timeout") {
  for (long long ms : {5000LL, 0LL}) {
    CAPTURE(ms);
    epx::mpi::options o;
    o.timeout = std::chrono::milliseconds(ms);
    communicator w(MPI_COMM_WORLD, o);
    // The last rank arrives 300 ms late at each kind of wait.
    const bool late = w.rank() == w.size() - 1;
    auto nap = [&] {
      if (late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    };
    std::vector<double> x(5, 1.0 + w.rank());
    nap();
    epx::all_reduce(w, epx::make_span(x));
    CHECK(x[0] == w.size() * (w.size() + 1) / 2.0);
    nap();
    w.barrier();
    std::vector<int> b(3, w.rank() == 0 ? 7 : 0);
    nap();
    epx::broadcast(w, epx::make_span(b), 0);
    CHECK(b[2] == 7);
  }
}

TEST_CASE_TEMPLATE("mpi: all_to_allv with uneven counts and silent peers", T, std::int32_t, std::int64_t, float,
                   double, bf16, fp16, std::byte) {
  communicator w = communicator::world();
  for (std::size_t salt = 0; salt < 5; ++salt) check_all_to_allv<T>(w, salt);
}

TEST_CASE_TEMPLATE("mpi: all_to_all, all_gather and broadcast", T, std::int32_t, std::int64_t, float, double, bf16,
                   fp16, std::byte) {
  communicator w = communicator::world();
  for (std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{1000}}) {
    check_all_to_all<T>(w, count, 11 + count);
    check_all_gather_broadcast<T>(w, count, 17 + count);
  }
}

TEST_CASE_TEMPLATE("mpi: scaled all_reduce and reduce_scatter against float64", T, std::int32_t, std::int64_t, float,
                   double, bf16, fp16) {
  communicator w = communicator::world();
  const int n = w.size();
  for (std::size_t count : {std::size_t{1}, static_cast<std::size_t>(n + 1), std::size_t{4099}}) {
    for (double scale : {1.0, 1.0 / n, 0.37}) {
      if (std::is_integral_v<T> && scale != 1.0 && scale != 0.37) continue;
      check_all_reduce<T>(w, count, scale, false, 100 + count);
      check_all_reduce<T>(w, count, scale, true, 200 + count);
      check_reduce_scatter<T>(w, count, scale, 300 + count);
    }
  }
}

// Segments land segment-major at the receiver (as dispatch lays rows out expert-major),
// while the sender keeps them peer-major; some segments are empty.
template <class T>
void check_segments(communicator& comm, std::size_t nseg, std::size_t salt) {
  const int n = comm.size(), me = comm.rank();
  const std::size_t m = static_cast<std::size_t>(n) * nseg;
  auto count = [&](int src, int dst, std::size_t i) {
    return static_cast<std::size_t>(key(salt, src, dst, 1000 + i) % 4) * 2;  // 0, 2, 4 or 6
  };
  std::vector<std::size_t> sc(m), sd(m), rc(m), rd(m);
  std::size_t off = 0;
  for (int q = 0; q < n; ++q)
    for (std::size_t i = 0; i < nseg; ++i) {
      sc[q * nseg + i] = count(me, q, i);
      sd[q * nseg + i] = off;
      off += sc[q * nseg + i];
    }
  std::vector<T> send(off);
  for (int q = 0; q < n; ++q)
    for (std::size_t i = 0; i < nseg; ++i)
      for (std::size_t e = 0; e < sc[q * nseg + i]; ++e)
        send[sd[q * nseg + i] + e] = value_of<T>(key(salt, me, q * 64 + i, e));
  off = 1;
  for (std::size_t i = 0; i < nseg; ++i)
    for (int p = 0; p < n; ++p) {
      rc[p * nseg + i] = count(p, me, i);
      rd[p * nseg + i] = off;
      off += rc[p * nseg + i] + 1;  // gaps stay untouched
    }
  std::vector<T> recv(off, sentinel<T>());
  epx::all_to_allv_segments(comm, send.data(), epx::make_span(sc), epx::make_span(sd), recv.data(), epx::make_span(rc),
                            epx::make_span(rd), nseg, 1);
  std::size_t wrong = 0, touched = 0;
  std::vector<char> covered(off, 0);
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < nseg; ++i)
      for (std::size_t e = 0; e < rc[p * nseg + i]; ++e) {
        wrong += !same_bits(recv[rd[p * nseg + i] + e], value_of<T>(key(salt, p, me * 64 + i, e)));
        covered[rd[p * nseg + i] + e] = 1;
      }
  for (std::size_t j = 0; j < off; ++j)
    if (!covered[j]) touched += !same_bits(recv[j], sentinel<T>());
  CHECK_MESSAGE(wrong == 0, "segments ", type_name<T>(), " nseg ", nseg, " max_count ", comm.opts().max_count);
  CHECK(touched == 0);
}

TEST_CASE("mpi: all_to_allv_indexed (one MPI_Alltoallw of indexed row types) and its chunked fallback") {
  static_assert(epx::has_indexed_sends_v<communicator>);
  communicator c = small_chunks(17);  // rows of 16 bf16 fit; segments of 2 or more rows exceed it
  const std::size_t before = c.chunked_rounds();
  comm_cases::case_all_to_allv_indexed(c);
  if (c.size() > 1) CHECK(c.chunked_rounds() > before);
  epx::mpi::options o;
  o.check_counts = false;
  communicator u = communicator::world(o);
  comm_cases::case_all_to_allv_indexed(u);
}

TEST_CASE("mpi: native segmented all_to_allv (one MPI_Alltoallw) and its chunked fallback") {
  static_assert(epx::detail::has_native_segments<communicator>::value);
  communicator w = communicator::world();
  for (std::size_t nseg : {std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
    check_segments<float>(w, nseg, 40 + nseg);
    check_segments<bf16>(w, nseg, 50 + nseg);
    check_segments<std::int64_t>(w, nseg, 60 + nseg);
    check_segments<std::byte>(w, nseg, 70 + nseg);
  }
  check_segments<double>(w, 0, 80);  // no segments at all
  communicator c = small_chunks(3);  // segments of 4 and 6 elements exceed it
  const std::size_t before = c.chunked_rounds();
  check_segments<float>(c, 3, 90);
  check_segments<fp16>(c, 5, 91);
  if (c.size() > 1) CHECK(c.chunked_rounds() > before);
  // Rows of H elements through the typed helper.
  const int n = w.size(), me = w.rank();
  const std::size_t H = 5, nseg = 2;
  std::vector<std::size_t> rows(n * nseg, 1), offs(n * nseg);
  for (std::size_t j = 0; j < rows.size(); ++j) offs[j] = j;
  std::vector<std::int32_t> send(rows.size() * H), recv(rows.size() * H, -1);
  for (std::size_t j = 0; j < send.size(); ++j) send[j] = me * 100000 + static_cast<std::int32_t>(j);
  epx::all_to_allv_segments(w, send.data(), epx::make_span(rows), epx::make_span(offs), recv.data(), epx::make_span(rows),
                            epx::make_span(offs), nseg, H);
  std::size_t wrong = 0;
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < nseg; ++i)
      for (std::size_t h = 0; h < H; ++h)
        wrong += recv[(p * nseg + i) * H + h] != p * 100000 + static_cast<std::int32_t>((me * nseg + i) * H + h);
  CHECK(wrong == 0);
  // A segment count that disagrees between sender and receiver is reported on every rank.
  if (n >= 2) {
    std::vector<std::size_t> sc(n * 2, 1), sd(n * 2), rc(n * 2, 1), rd(n * 2);
    for (std::size_t j = 0; j < sd.size(); ++j) sd[j] = rd[j] = 2 * j;
    if (me == 1) rc[0 * 2 + 1] = 2;  // rank 1 expects 2 elements in segment 1 from rank 0
    std::vector<float> sbuf(4 * n, 1.0f), rbuf(4 * n);
    check_error(
        [&] {
          w.all_to_allv_segments(sbuf.data(), sc.data(), sd.data(), rbuf.data(), rc.data(), rd.data(), 2,
                                 epx::datatype::float32);
        },
        epx::errc::communicator, "rank 1 expects 2 float32 elements in segment 1 from rank 0, which sends 1");
    // A segment count that differs between ranks (the count exchange's shape depends on it),
    // 2 against 1 and 1 against 0: agreed first, so every rank raises instead of matching
    // different calls.
    for (std::size_t other : {std::size_t{1}, std::size_t{0}}) {
      const std::size_t ns = me == n - 1 ? other : other + 1;
      std::vector<std::size_t> c(n * ns, 1), d(n * ns);
      for (std::size_t j = 0; j < d.size(); ++j) d[j] = j;
      std::vector<float> in(n * ns + 1, 1.0f), out(n * ns + 1);
      check_error([&] { w.all_to_allv_segments(in.data(), c.data(), d.data(), out.data(), c.data(), d.data(), ns,
                                               epx::datatype::float32); },
                  epx::errc::communicator, "all_to_allv_segments: ranks disagree on the segment count");
    }
    // A bad row size on one rank of all_to_allv_indexed raises on every rank.
    std::vector<std::size_t> c(n, 0), d(n, 0);
    std::vector<std::int64_t> rows(1, 0);
    std::vector<float> in(4, 1.0f), out(4);
    check_error([&] { w.all_to_allv_indexed(in.data(), rows.data(), me == 0 ? 0 : 4, c.data(), d.data(), out.data(),
                                            c.data(), d.data(), 1, epx::datatype::float32); },
                epx::errc::input, "all_to_allv_indexed: row_elems must be positive (rank 0)");
  }
}

TEST_CASE("mpi: an error that shows when a request completes names the call, the rank and the request's error") {
  // Without the count check a receive shorter than its message is MPI's truncation error,
  // which MPI reports in the request's status.
  epx::mpi::options o;
  o.check_counts = false;
  communicator w(MPI_COMM_WORLD, o);
  const auto n = static_cast<std::size_t>(w.size());
  const int me = w.rank();
  if (n < 2) return;
  std::vector<std::size_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  if (me == 0) sc[1] = 2;  // rank 0 sends 2 floats to rank 1,
  if (me == 1) rc[0] = 1;  // which expects 1
  std::vector<float> in(2, 1.0f), out(2);
  const auto call = [&] {
    w.all_to_allv(in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(), epx::datatype::float32);
  };
  if (me != 1) {
    call();
  } else {
    std::string got = "no error";
    try {
      call();
    } catch (const epx::error& e) {
      got = e.category() == epx::errc::mpi ? e.message() : std::string("wrong category: ") + e.what();
    }
    CHECK_MESSAGE(got.find("MPI all_to_allv on rank 1 failed: ") != std::string::npos, got);
    CHECK_MESSAGE(got.find("TRUNCATE") != std::string::npos, got);
  }
  w.barrier();
}

// Both host backends sum in rank order by the same rule, so a sum over MPI processes equals,
// bit for bit, the same sum over threads of one process fed the same per-rank inputs.
template <class T>
void check_same_bits_as_threads(communicator& w, std::size_t count, double scale, std::size_t salt) {
  const int n = w.size(), me = w.rank();
  auto input = [&](int r) {
    std::vector<T> v(count * n);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = value_of<T>(key(salt, r, 5, i));
    return v;
  };
  const std::vector<T> mine = input(me);
  std::vector<T> reduced(count * n), scattered(count);
  epx::all_reduce(w, epx::span<const T>(mine.data(), mine.size()), epx::span<T>(reduced.data(), reduced.size()), scale);
  epx::reduce_scatter(w, epx::span<const T>(mine.data(), mine.size()), epx::span<T>(scattered.data(), count), scale);
  if (me != 0) return;  // rank 0 replays all ranks as threads; the others move on
  std::vector<T> t_reduced(count * n), t_scattered0(count);
  epx::threads::run(n, [&](epx::threads::communicator& tc) {
    const std::vector<T> in = input(tc.rank());
    std::vector<T> out(count * n), sc(count);
    epx::all_reduce(tc, epx::span<const T>(in.data(), in.size()), epx::span<T>(out.data(), out.size()), scale);
    epx::reduce_scatter(tc, epx::span<const T>(in.data(), in.size()), epx::span<T>(sc.data(), count), scale);
    if (tc.rank() == 0) {
      t_reduced = out;
      t_scattered0 = sc;
    }
  });
  std::size_t differ = 0;
  for (std::size_t i = 0; i < reduced.size(); ++i) differ += !same_bits(reduced[i], t_reduced[i]);
  for (std::size_t i = 0; i < count; ++i) differ += !same_bits(scattered[i], t_scattered0[i]);
  CHECK_MESSAGE(differ == 0, type_name<T>(), ": MPI and threads sums differ in ", differ, " elements");
}

TEST_CASE("mpi: sums are bitwise those of the threads backend") {
  communicator w = communicator::world();
  check_same_bits_as_threads<float>(w, 257, 1.0 / w.size(), 1);
  check_same_bits_as_threads<bf16>(w, 129, 0.3, 2);
  check_same_bits_as_threads<fp16>(w, 65, 1.0, 3);
  check_same_bits_as_threads<double>(w, 33, 0.125, 4);
  check_same_bits_as_threads<std::int32_t>(w, 17, 3.0, 5);
}

TEST_CASE("mpi: all_reduce by gathering and by blocks give the same bits") {
  epx::mpi::options gather, blocks;
  gather.all_reduce_gather_bytes = std::size_t{1} << 30;
  blocks.all_reduce_gather_bytes = 0;
  communicator g = communicator::world(gather), b = communicator::world(blocks);
  const int me = g.rank();
  for (std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{1000}}) {
    std::vector<float> x(count), yg(count), yb(count);
    std::vector<bf16> h(count), hg(count), hb(count);
    for (std::size_t i = 0; i < count; ++i) {
      x[i] = value_of<float>(key(600 + count, me, 0, i));
      h[i] = value_of<bf16>(key(700 + count, me, 0, i));
    }
    epx::all_reduce(g, epx::span<const float>(x.data(), count), epx::span<float>(yg.data(), count), 0.3);
    epx::all_reduce(b, epx::span<const float>(x.data(), count), epx::span<float>(yb.data(), count), 0.3);
    epx::all_reduce(g, epx::span<const bf16>(h.data(), count), epx::span<bf16>(hg.data(), count), 0.5);
    epx::all_reduce(b, epx::span<const bf16>(h.data(), count), epx::span<bf16>(hb.data(), count), 0.5);
    CHECK(std::memcmp(yg.data(), yb.data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(hg.data(), hb.data(), count * sizeof(bf16)) == 0);
    // Both the summation rule, worked out here: the ranks in order in float, scaled, rounded once.
    std::size_t not_rule = 0;
    for (std::size_t i = 0; i < count; ++i) {
      float a = value_of<float>(key(600 + count, 0, 0, i));
      float c = static_cast<float>(value_of<bf16>(key(700 + count, 0, 0, i)));
      for (int r = 1; r < g.size(); ++r) {
        a += value_of<float>(key(600 + count, static_cast<std::uint64_t>(r), 0, i));
        c += static_cast<float>(value_of<bf16>(key(700 + count, static_cast<std::uint64_t>(r), 0, i)));
      }
      a *= 0.3f;
      c *= 0.5f;
      not_rule += !same_bits(yg[i], a);
      not_rule += !same_bits(hg[i], epx::convert<bf16>(c));
    }
    CHECK_MESSAGE(not_rule == 0, not_rule, " of ", 2 * count, " elements are not the rank-order sum");
  }
  check_all_reduce<fp16>(g, 333, 0.25, true, 601);
  check_all_reduce<fp16>(b, 333, 0.25, true, 602);
}

TEST_CASE("mpi: zero-length messages") {
  communicator w = communicator::world();
  const auto n = static_cast<std::size_t>(w.size());
  std::vector<std::size_t> zeros(n, 0);
  float* none = nullptr;
  epx::all_to_allv(w, static_cast<const float*>(none), epx::make_span(zeros), epx::make_span(zeros), none,
                   epx::make_span(zeros), epx::make_span(zeros));
  epx::all_to_allv_rows(w, static_cast<const float*>(none), epx::make_span(zeros), epx::make_span(zeros), none,
                        epx::make_span(zeros), epx::make_span(zeros), 64);
  epx::all_to_all(w, epx::span<const float>(), epx::span<float>());
  epx::all_reduce(w, epx::span<float>(), 0.5);
  epx::reduce_scatter(w, epx::span<const bf16>(), epx::span<bf16>(), 0.5);
  epx::all_gather(w, epx::span<const double>(), epx::span<double>());
  epx::broadcast(w, epx::span<std::int64_t>(), 0);
  w.barrier();
  // The communicator still works afterwards.
  check_all_to_allv<float>(w, 3);
}

TEST_CASE("mpi: large all_to_allv of rows (64 MiB per peer at 1 and 2 ranks)") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  const std::size_t H = 1024;  // int32 row of 4 KiB
  // Per peer: 64 MiB at n <= 2, 8 MiB at 4, 2 MiB at 8 ranks (two-core CI runs every rank).
  const std::size_t rows = (std::size_t{64} << 20) / (H * 4) / (n <= 2 ? 1 : static_cast<std::size_t>(n * n / 2));
  std::vector<std::size_t> cnt(n, rows), off(n);
  for (int p = 0; p < n; ++p) off[p] = p * rows;
  std::vector<std::int32_t> send(rows * H * n), recv(rows * H * n, -1);
  // [n, rows, H]: element (p, r, h) = hash of (me, p, r) + h, cheap to regenerate.
  for (int p = 0; p < n; ++p)
    for (std::size_t r = 0; r < rows; ++r) {
      const auto base = static_cast<std::int32_t>(key(7, me, p, r) & 0xffffff);
      std::int32_t* row = send.data() + (p * rows + r) * H;
      for (std::size_t h = 0; h < H; ++h) row[h] = base + static_cast<std::int32_t>(h);
    }
  epx::all_to_allv_rows(w, send.data(), epx::make_span(cnt), epx::make_span(off), recv.data(), epx::make_span(cnt),
                        epx::make_span(off), H);
  std::size_t wrong = 0;
  for (int p = 0; p < n; ++p)
    for (std::size_t r = 0; r < rows; ++r) {
      const auto base = static_cast<std::int32_t>(key(7, p, me, r) & 0xffffff);
      const std::int32_t* row = recv.data() + (p * rows + r) * H;
      for (std::size_t h = 0; h < H; ++h) wrong += row[h] != base + static_cast<std::int32_t>(h);
    }
  CHECK_MESSAGE(wrong == 0, rows * H * 4, " bytes per peer");
}

TEST_CASE("mpi: chunked path (counts over max_count) matches the direct path") {
  // max_count stands in for INT_MAX: every transfer above it goes in point-to-point rounds.
  for (std::size_t limit : {std::size_t{1}, std::size_t{2}, std::size_t{7}}) {
    communicator c = small_chunks(limit);
    const int n = c.size();
    CHECK(c.opts().max_count == limit);
    const std::size_t before = c.chunked_rounds();
    check_all_to_allv<float>(c, 1);
    check_all_to_allv<bf16>(c, 2);
    check_all_to_allv<std::int64_t>(c, 4);
    check_all_to_all<double>(c, 10, 5);
    check_all_to_all<fp16>(c, limit, 6);  // exactly at the limit: direct path
    check_all_gather_broadcast<std::int32_t>(c, 23, 7);
    check_all_reduce<float>(c, 50, 0.25, false, 8);
    check_all_reduce<bf16>(c, 33, 1.0 / n, true, 9);
    check_reduce_scatter<double>(c, 19, 0.5, 10);
    if (n > 1) CHECK(c.chunked_rounds() > before);  // the chunked path really ran
  }
  // The same communicator can also switch options: a 9-element limit with 4 KiB rows of bytes.
  communicator c = communicator::world();
  epx::mpi::options o = c.opts();
  o.max_count = 9;
  c.set_options(o);
  check_all_to_allv<std::byte>(c, 3);
}

TEST_CASE("mpi: displacements over max_count take the chunked path even where every count fits") {
  // MPI's displacements are int as its counts are: blocks whose counts fit but whose offsets
  // do not (max_count stands in for INT_MAX) must not go to MPI_Alltoallv.
  communicator c = small_chunks(2);
  const int n = c.size(), me = c.rank();
  const auto N = static_cast<std::size_t>(n);
  const std::size_t cnt = 2, stride = 5;  // counts == max_count, displacements p * 5
  std::vector<std::size_t> counts(N, cnt), displs(N);
  for (std::size_t p = 0; p < N; ++p) displs[p] = p * stride;
  std::vector<std::int32_t> send(N * stride, -1), recv(N * stride, -1);
  for (std::size_t p = 0; p < N; ++p)
    for (std::size_t i = 0; i < cnt; ++i)
      send[p * stride + i] = 1000 * me + 10 * static_cast<int>(p) + static_cast<int>(i);
  const std::size_t before = c.chunked_rounds();
  epx::all_to_allv(c, send.data(), epx::span<const std::size_t>(counts), epx::span<const std::size_t>(displs),
                   recv.data(), epx::span<const std::size_t>(counts), epx::span<const std::size_t>(displs));
  for (std::size_t p = 0; p < N; ++p)
    for (std::size_t i = 0; i < stride; ++i)
      CHECK(recv[p * stride + i] == (i < cnt ? 1000 * static_cast<int>(p) + 10 * me + static_cast<int>(i) : -1));
  if (n > 1) CHECK(c.chunked_rounds() > before);
}

TEST_CASE("mpi: sub-communicators of every mesh group match group_members") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  int meshes = 0;
  // Every factorization of n into pp * dp_replicate * fsdp * tp and every valid ep.
  for (int pp = 1; pp <= n; ++pp) {
    if (n % pp) continue;
    for (int rep = 1; rep <= n / pp; ++rep) {
      if ((n / pp) % rep) continue;
      for (int fsdp = 1; fsdp <= n / pp / rep; ++fsdp) {
        if ((n / pp / rep) % fsdp) continue;
        const int tp = n / pp / rep / fsdp;
        for (int ep = tp; ep <= fsdp * tp; ep += tp) {
          if ((fsdp * tp) % ep) continue;
          epx::mesh_config mc;
          mc.tp = tp, mc.fsdp = fsdp, mc.pp = pp, mc.dp_replicate = rep, mc.ep = ep, mc.experts = 2 * ep;
          const epx::mesh m(mc);
          ++meshes;
          for (epx::group_kind g : epx::all_group_kinds) {
            communicator sub = epx::sub_communicator(w, m, g);
            const std::vector<int> expect = m.group_members(g, me);
            REQUIRE(sub.size() == static_cast<int>(expect.size()));
            CHECK(sub.rank() == m.group_rank(g, me));
            // Who is in my group, in sub-communicator rank order, as world ranks.
            std::vector<std::int32_t> got(sub.size());
            const std::int32_t mine = me;
            epx::all_gather(sub, epx::span<const std::int32_t>(&mine, 1), epx::make_span(got));
            CHECK_MESSAGE(std::equal(got.begin(), got.end(), expect.begin()), epx::to_string(g), " tp ", tp,
                          " fsdp ", fsdp, " pp ", pp, " rep ", rep, " ep ", ep);
            // A collective inside the group sums over exactly its members.
            std::int64_t x = me + 1, sum = 0;
            epx::all_reduce(sub, epx::span<const std::int64_t>(&x, 1), epx::span<std::int64_t>(&sum, 1));
            std::int64_t expect_sum = 0;
            for (int r : expect) expect_sum += r + 1;
            CHECK(sum == expect_sum);
          }
        }
      }
    }
  }
  CHECK(meshes >= 1);
}

TEST_CASE("mpi: split by color and key") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  communicator sub = w.split(me % 2, -me);  // reversed order inside each parity class
  int members = 0, my_pos = 0;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) {
      if (r == me) my_pos = members;
      ++members;
    }
  CHECK(sub.size() == members);
  CHECK(sub.rank() == my_pos);
  CHECK(sub.native() != w.native());
  communicator subsub = sub.split(0, 0);  // owned splits of owned splits are freed in turn
  CHECK(subsub.size() == sub.size());
  check_all_to_allv<double>(subsub, 2);
  check_error([&] { (void)w.split(me == n - 1 ? -3 : 0, 0); }, epx::errc::input,
              "split: color (-3) on rank " + std::to_string(n - 1));
  // docs/guarantees.md: split agrees even without check_counts, so the last rank's bad
  // color raises on every rank there too, and the communicator goes on.
  epx::mpi::options unchecked;
  unchecked.check_counts = false;
  communicator u = communicator::world(unchecked);
  check_error([&] { (void)u.split(me == n - 1 ? -3 : 0, 0); }, epx::errc::input,
              "split: color (-3) on rank " + std::to_string(n - 1));
  CHECK(u.split(me % 2, me).size() == (n - me % 2 + 1) / 2);
}

TEST_CASE("mpi: mismatched counts are reported on every rank") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  if (n >= 2) {
    // Rank 0 expects one more element from rank 1 than rank 1 sends.
    std::vector<std::size_t> sc(n, 2), sd(n), rc(n, 2), rd(n);
    for (int p = 0; p < n; ++p) sd[p] = rd[p] = 3 * p;
    if (me == 0) rc[1] = 3;
    std::vector<float> send(3 * n, 1.0f), recv(3 * n, 0.0f);
    check_error(
        [&] {
          epx::all_to_allv(w, send.data(), epx::make_span(sc), epx::make_span(sd), recv.data(), epx::make_span(rc),
                           epx::make_span(rd));
        },
        epx::errc::communicator, "rank 0 expects 3 float32 elements from rank 1, which sends 2");
    // The same through all_to_allv_indexed: rank 0 expects 3 rows of 2 from rank 1, which sends 2.
    std::vector<std::int64_t> rows(2 * static_cast<std::size_t>(n), 0);
    std::vector<float> src(2, 1.0f), got(6 * n, 0.0f);
    for (int p = 0; p < n; ++p) sd[p] = 2 * p;
    check_error(
        [&] {
          epx::all_to_allv_indexed(w, epx::span<const float>(src), epx::span<const std::int64_t>(rows),
                                   epx::make_span(sc), epx::make_span(sd), got.data(), epx::make_span(rc),
                                   epx::make_span(rd), 1, 2);
        },
        epx::errc::communicator,
        "all_to_allv_indexed: send and receive counts disagree: rank 0 expects 6 float32 elements in segment 0 from "
        "rank 1, which sends 4");
  }
  // Equal-count collectives: rank-dependent counts, datatypes or roots.
  std::vector<double> buf(n + 8, 1.0), out(n + 8);
  if (n > 1) {
    check_error([&] { w.all_reduce(buf.data(), out.data(), me == 0 ? 3 : 4, epx::datatype::float64, 1.0); },
                epx::errc::communicator, "all_reduce: ranks disagree on the count (values from 3 to 4");
    check_error([&] { w.all_gather(buf.data(), out.data(), 1, me == 1 ? epx::datatype::int64 : epx::datatype::float64); },
                epx::errc::communicator,
                std::string("all_gather: ranks disagree on the datatype (values from int64 to float64; rank ") +
                    std::to_string(me) + " passed " + (me == 1 ? "int64" : "float64") + ")");
    check_error([&] { w.broadcast(buf.data(), 2, epx::datatype::float64, me == 0 ? 1 : 0); },
                epx::errc::communicator, "ranks disagree on the root");
    // Different collectives of one datatype and count: the small all_reduce and all_gather
    // are both one MPI_Iallgather, which would pair them without a word.
    std::vector<double> gathered(4 * static_cast<std::size_t>(n));
    check_error(
        [&] {
          if (me == 0)
            w.all_reduce(buf.data(), out.data(), 4, epx::datatype::float64, 1.0);
          else
            w.all_gather(buf.data(), gathered.data(), 4, epx::datatype::float64);
        },
        epx::errc::communicator, "ranks disagree on the collective: rank 0 called all_reduce, rank 1 called all_gather");
  }
  check_error([&] { w.broadcast(buf.data(), 2, epx::datatype::float64, me == 0 ? n : 0); },
              epx::errc::input, "broadcast: root (" + std::to_string(n) + ") on rank 0 out of range");
  check_error([&] { w.all_reduce(buf.data(), out.data(), 2, epx::datatype::byte, 1.0); }, epx::errc::input,
              "datatype byte cannot be summed");
  // Nothing is left half-done: the communicator still works.
  check_all_to_allv<std::int32_t>(w, 4);
  check_all_reduce<float>(w, 9, 1.0, false, 5);
}

// Every collective entry point opens with the same agreement, so ranks in different
// collectives (or in one whose counts differ) raise errc::communicator on every rank at once,
// naming the collectives and a rank of each, instead of pairing calls that MPI cannot pair
// and waiting for the watchdog. The communicator's watchdog is long (60 s) and every case
// must raise well within it.
TEST_CASE("mpi: every collective agrees on the collective and its counts, on every rank and at once") {
  epx::mpi::options o;
  o.timeout = std::chrono::seconds(60);
  communicator w = communicator::world(o);
  const int n = w.size(), me = w.rank();
  if (n < 2) return;
  const auto start = std::chrono::steady_clock::now();
  const std::string one = "ranks disagree on the collective: rank ";
  // Rank 0 calls `a`, the others `b` (a is the smaller kind): the message names both.
  auto across = [&](auto&& a, auto&& b, const char* name_a, const char* name_b) {
    check_error([&] { me == 0 ? a() : b(); }, epx::errc::communicator,
                one + "0 called " + name_a + ", rank 1 called " + name_b);
    // The smaller kind on the last rank: the message names the lowest rank of each.
    check_error([&] { me == n - 1 ? a() : b(); }, epx::errc::communicator,
                one + std::to_string(n - 1) + " called " + name_a + ", rank 0 called " + name_b);
  };
  const auto un = static_cast<std::size_t>(n);
  std::vector<float> in(8 * un, 1.0f), out(8 * un, 0.0f);
  std::vector<std::size_t> ones(2 * un, 1), displ(2 * un);
  for (std::size_t j = 0; j < displ.size(); ++j) displ[j] = j;
  std::vector<std::int64_t> rows(2 * un, 0);
  auto a2a = [&] { w.all_to_all(in.data(), out.data(), 1, epx::datatype::float32); };
  auto a2av = [&] { w.all_to_allv(in.data(), ones.data(), displ.data(), out.data(), ones.data(), displ.data(),
                                  epx::datatype::float32); };
  auto segs = [&] { w.all_to_allv_segments(in.data(), ones.data(), displ.data(), out.data(), ones.data(), displ.data(),
                                           2, epx::datatype::float32); };
  auto indexed = [&] { w.all_to_allv_indexed(in.data(), rows.data(), 1, ones.data(), displ.data(), out.data(),
                                             ones.data(), displ.data(), 2, epx::datatype::float32); };
  auto all_reduce = [&] { w.all_reduce(in.data(), out.data(), 4, epx::datatype::float32, 1.0); };
  auto barrier = [&] { w.barrier(); };
  auto split = [&] { (void)w.split(0, me); };
  // all_to_allv beside all_to_all: both open with an all-to-all, which MPI would pair.
  across(a2a, a2av, "all_to_all", "all_to_allv");
  // The segmented and indexed exchanges beside each other and beside all_to_allv.
  across(a2av, segs, "all_to_allv", "all_to_allv_segments");
  across(segs, indexed, "all_to_allv_segments", "all_to_allv_indexed");
  // barrier and split beside the collectives and each other.
  across(all_reduce, barrier, "all_reduce", "barrier");
  across(indexed, barrier, "all_to_allv_indexed", "barrier");
  across(barrier, split, "barrier", "split");
  across(a2a, split, "all_to_all", "split");
  // The peer access calls (when the ranks share a node, as in the tests).
  if (w.peer_access_available()) {
    int v = me;
    const void* mine[1] = {&v};
    const std::size_t bytes[1] = {sizeof(int)};
    bool ran = false;
    auto access = [&] { w.access_peers(mine, bytes, 1, [&](const auto&) { ran = true; }); };
    auto memory = [&] { (void)w.peer_memory(64); };
    across(barrier, access, "barrier", "access_peers");
    across(memory, access, "peer_memory", "access_peers");
    across(split, memory, "split", "peer_memory");
    CHECK(!ran);
    // peer_access_available is collective on its first call on a communicator.
    communicator fresh = communicator::world(o);
    check_error([&] { me == 0 ? fresh.barrier() : (void)fresh.peer_access_available(); }, epx::errc::communicator,
                one + "0 called barrier, rank 1 called peer_access_available");
    CHECK(fresh.peer_access_available());
    // peer_memory asks for each rank's own size: sizes that differ agree, and the largest grows it.
    void* p = w.peer_memory(64 + 64 * static_cast<std::size_t>(me));
    CHECK(p != nullptr);
  }
  // Counts that differ in the newly agreed collectives: the row width of all_to_allv_indexed.
  check_error([&] { w.all_to_allv_indexed(in.data(), rows.data(), me == 0 ? 1 : 2, ones.data(), displ.data(),
                                          out.data(), ones.data(), displ.data(), 2, epx::datatype::float32); },
              epx::errc::communicator, "all_to_allv_indexed: ranks disagree on the row width (values from 1 to 2");
  // all_to_allv's pairs: rank 1 expects 2 elements from rank 0, which sends 1 (checked in
  // the agreement's reduction; the all_to_all that names them only then).
  {
    std::vector<std::size_t> rc(ones.begin(), ones.begin() + n), d(displ.begin(), displ.begin() + n);
    for (int p = 0; p < n; ++p) d[p] = 2 * static_cast<std::size_t>(p);
    if (me == 1) rc[0] = 2;
    check_error([&] { w.all_to_allv(in.data(), ones.data(), d.data(), out.data(), rc.data(), d.data(),
                                    epx::datatype::float32); },
                epx::errc::communicator,
                "all_to_allv: send and receive counts disagree: rank 1 expects 2 float32 elements from rank 0, "
                "which sends 1");
    // Counts that differ pairwise but balance over the ranks in total still differ pair by pair.
    std::vector<std::size_t> sc(n, 1);
    std::fill(rc.begin(), rc.end(), 1);
    if (me == 0) sc[1] = 2, sc[0] = 0;        // rank 0 sends 2 to rank 1 and 0 to itself
    if (me == 1) rc[0] = 0, rc[1] = 2;        // rank 1 expects 0 from rank 0 and 2 from itself
    check_error([&] { w.all_to_allv(in.data(), sc.data(), d.data(), out.data(), rc.data(), d.data(),
                                    epx::datatype::float32); },
                epx::errc::communicator, "all_to_allv: send and receive counts disagree: rank ");
  }
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took < std::chrono::seconds(30));  // promptly: none of them waited for the watchdog
  // Nothing is left half-done: every collective still works.
  w.barrier();
  CHECK(w.split(me % 2, me).size() == (n - me % 2 + 1) / 2);
  check_all_to_allv<std::int32_t>(w, 4);
  check_all_reduce<float>(w, 9, 1.0, false, 5);
  check_segments<float>(w, 3, 7);
  // Without check_counts, barrier is a plain barrier and nothing is compared.
  epx::mpi::options off = o;
  off.check_counts = false;
  communicator unchecked = communicator::world(off);
  unchecked.barrier();
  check_all_to_allv<std::int32_t>(unchecked, 3);
}

// A datatype that is none of epx::datatype's on one rank: errc::input on every rank, naming
// the rank, before anything moves (was errc::internal, a "bug" category, or a disagreement
// on the datatype); the unchecked communicator refuses it on that rank.
TEST_CASE("mpi: an unknown datatype on one rank is errc::input on every rank") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  const auto bad = static_cast<epx::datatype>(42);
  const epx::datatype t = me == n - 1 ? bad : epx::datatype::float32;
  const std::string who = "rank " + std::to_string(n - 1) + " passes datatype 42, which is none of epx::datatype's";
  std::vector<float> a(4 * static_cast<std::size_t>(n), 1.0f), b(4 * static_cast<std::size_t>(n), 0.0f);
  std::vector<std::size_t> c(n, 1), d(n);
  for (int p = 0; p < n; ++p) d[p] = static_cast<std::size_t>(p);
  check_error([&] { w.all_reduce(a.data(), b.data(), 2, t, 1.0); }, epx::errc::input, "all_reduce: " + who);
  check_error([&] { w.all_to_all(a.data(), b.data(), 1, t); }, epx::errc::input, "all_to_all: " + who);
  check_error([&] { w.broadcast(a.data(), 2, t, 0); }, epx::errc::input, "broadcast: " + who);
  check_error([&] { w.all_to_allv(a.data(), c.data(), d.data(), b.data(), c.data(), d.data(), t); }, epx::errc::input,
              "all_to_allv: " + who);
  check_error([&] { w.all_to_allv_segments(a.data(), c.data(), d.data(), b.data(), c.data(), d.data(), 1, t); },
              epx::errc::input, "all_to_allv_segments: " + who);
  // Every rank with it: the same error (it used to pass the agreement and fail as internal).
  check_error([&] { w.all_gather(a.data(), b.data(), 1, bad); }, epx::errc::input, "all_gather: rank 0 passes datatype 42");
  epx::mpi::options o;
  o.check_counts = false;
  communicator unchecked = communicator::world(o);
  check_error([&] { unchecked.all_gather(a.data(), b.data(), 1, bad); }, epx::errc::input,
              "datatype 42 is none of epx::datatype's");
  // The communicator still works.
  check_all_to_allv<std::int32_t>(w, 4);
}

static_assert(epx::has_peer_access_v<communicator>, "MPI ranks on one node read each other's memory");

// The peers' buffers through the shared window: every rank's buffers (of rank-dependent
// sizes, growing over the rounds so that the window is replaced several times) are seen by
// every rank, bitwise, and stay valid until every reader is done.
TEST_CASE("mpi: access_peers through shared memory shows every rank's buffers") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  REQUIRE(w.peer_access_available());  // the tests run on one node
  CHECK(epx::peer_access_available(w));
  for (int round = 0; round < 12; ++round) {
    // Buffer 0: 3 ints; buffer 1: a rank- and round-dependent number of doubles (up to ~4 MiB).
    const std::size_t m = static_cast<std::size_t>(1 + (me + 1) * (round + 1) * (round + 1) * 300);
    std::vector<int> a = {me, round, 7};
    std::vector<double> b(m);
    for (std::size_t i = 0; i < m; ++i) b[i] = value_of<double>(key(round, static_cast<std::uint64_t>(me), 0, i));
    const void* mine[2] = {a.data(), b.data()};
    const std::size_t bytes[2] = {a.size() * sizeof(int), b.size() * sizeof(double)};
    std::string bad;
    int seen = 0;
    w.access_peers(mine, bytes, 2, [&](const auto& peers) {
      seen = peers.size();
      for (int r = 0; r < n; ++r) {
        const auto* pa = static_cast<const int*>(peers(r, 0));
        if (pa[0] != r || pa[1] != round || pa[2] != 7) bad += epx::detail::concat("rank ", r, " buffer 0; ");
        const std::size_t mr = static_cast<std::size_t>(1 + (r + 1) * (round + 1) * (round + 1) * 300);
        const auto* pb = static_cast<const double*>(peers(r, 1));
        for (std::size_t i = 0; i < mr; ++i)
          if (pb[i] != value_of<double>(key(round, static_cast<std::uint64_t>(r), 0, i))) {
            bad += epx::detail::concat("rank ", r, " buffer 1 element ", i, "; ");
            break;
          }
      }
    });
    CHECK(seen == n);
    CHECK_MESSAGE(bad.empty(), bad);
  }
  // No buffers: a barrier; zero-byte buffers (null allowed).
  w.access_peers(nullptr, nullptr, 0, [](const auto&) {});
  const void* none[1] = {nullptr};
  const std::size_t zero[1] = {0};
  w.access_peers(none, zero, 1, [](const auto&) {});
  // Copies of the communicator share the window; sub-communicators have their own.
  communicator copy = w;
  communicator half = w.split(me % 2, 0);
  REQUIRE(half.peer_access_available());
  const int v = 1000 + me;
  const void* one[1] = {&v};
  const std::size_t four[1] = {sizeof(int)};
  int sum = 0;
  half.access_peers(one, four, 1, [&](const auto& peers) {
    for (int r = 0; r < peers.size(); ++r) sum += *static_cast<const int*>(peers(r, 0));
  });
  int want = 0;
  for (int r = me % 2; r < n; r += 2) want += 1000 + r;
  CHECK(sum == want);
  copy.access_peers(one, four, 1, [&](const auto& peers) { CHECK(*static_cast<const int*>(peers(n - 1, 0)) == 999 + n); });
}

// Peer memory: buffers built there are published where they are (no copy), next to copied
// ones; it grows when a rank asks for more, and each call's memory is this rank's own.
TEST_CASE("mpi: peer_memory buffers are published without a copy") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  REQUIRE(w.peer_access_available());
  static_assert(epx::has_peer_memory_v<communicator>);
  static_assert(!epx::has_peer_memory_v<epx::threads::communicator>);
  for (std::size_t round = 0; round < 4; ++round) {
    const std::size_t m = 1000 * (round + 1) * static_cast<std::size_t>(me + 1);  // grows, differs by rank
    auto* p = static_cast<std::int64_t*>(w.peer_memory(m * sizeof(std::int64_t)));
    REQUIRE(p != nullptr);
    for (std::size_t i = 0; i < m; ++i) p[i] = static_cast<std::int64_t>(me * 1000000 + i + round);
    const int tag = me;
    const void* mine[2] = {p, &tag};
    const std::size_t bytes[2] = {m * sizeof(std::int64_t), sizeof(int)};
    std::string bad;
    w.access_peers(mine, bytes, 2, [&](const auto& peers) {
      if (peers(me, 0) != static_cast<const void*>(p)) bad += "own peer-memory buffer was copied; ";
      if (peers(me, 1) == static_cast<const void*>(&tag)) bad += "own stack buffer was not copied; ";
      for (int r = 0; r < n; ++r) {
        const auto* q = static_cast<const std::int64_t*>(peers(r, 0));
        const std::size_t mr = 1000 * (round + 1) * static_cast<std::size_t>(r + 1);
        if (q[0] != r * 1000000 + static_cast<std::int64_t>(round) ||
            q[mr - 1] != static_cast<std::int64_t>(r * 1000000 + mr - 1 + round))
          bad += epx::detail::concat("rank ", r, " peer memory; ");
        if (*static_cast<const int*>(peers(r, 1)) != r) bad += epx::detail::concat("rank ", r, " tag; ");
      }
    });
    CHECK_MESSAGE(bad.empty(), bad);
  }
  epx::mpi::options o;
  o.shared_memory = false;
  communicator off = communicator::world(o);
  check_error([&] { (void)off.peer_memory(8); }, epx::errc::configuration, "no peer access");
}

// docs/guarantees.md: a peer_buffer call takes the rank's smallest free block that fits,
// and makes a window only when some rank has none.
TEST_CASE("mpi: peer_buffer takes the smallest free block that fits") {
  communicator c = communicator::world();
  REQUIRE(c.peer_access_available());
  // The larger block made first and handed back last: first fit in either order would take it.
  auto big = c.peer_buffer(std::size_t{1} << 16);
  auto small = c.peer_buffer(2048);
  REQUIRE((small != nullptr && big != nullptr));
  const void* s = small.get();
  const void* b = big.get();
  small.reset();
  big.reset();
  auto x = c.peer_buffer(1024);
  CHECK(x.get() == s);
  auto y = c.peer_buffer(1024);  // the one free block left that fits
  CHECK(y.get() == b);
  auto z = c.peer_buffer(std::size_t{1} << 16);  // none free: a new window
  REQUIRE(z != nullptr);
  CHECK((z.get() != s && z.get() != b));
}

// Communicators over one MPI_Comm, each with its shared windows, destroyed in opposite
// orders on even and odd ranks: the frees must not pair one communicator's window with the
// other's (they hung in MPI_Win_free), and the MPI_Comm stays usable afterwards.
TEST_CASE("mpi: peer buffers are published without a copy, several held at once, and handed out again") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  REQUIRE(w.peer_access_available());
  static_assert(epx::has_peer_buffer_v<communicator>);
  static_assert(!epx::has_peer_buffer_v<epx::threads::communicator>);
  const auto fill = [&](std::int64_t* p, std::size_t m, int r, std::int64_t tag) {
    for (std::size_t i = 0; i < m; ++i) p[i] = tag * 1000000000 + r * 1000000 + static_cast<std::int64_t>(i);
  };
  // Three buffers held at once, of sizes that differ by rank (rank 0 asks for none of the
  // second), all read in place by every peer.
  const auto size_of = [](int r, int b) -> std::size_t {
    return b == 1 && r == 0 ? 0 : 1000 * static_cast<std::size_t>((b + 1) * (r + 1));
  };
  std::vector<std::shared_ptr<void>> held;
  for (int b = 0; b < 3; ++b) {
    held.push_back(w.peer_buffer(size_of(me, b) * sizeof(std::int64_t)));
    CHECK((held.back() == nullptr) == (size_of(me, b) == 0));
    if (held.back() != nullptr) fill(static_cast<std::int64_t*>(held.back().get()), size_of(me, b), me, b);
  }
  const void* mine[3] = {held[0].get(), held[1].get(), held[2].get()};
  std::size_t bytes[3];
  for (int b = 0; b < 3; ++b) bytes[b] = size_of(me, b) * sizeof(std::int64_t);
  std::string bad;
  w.access_peers(mine, bytes, 3, [&](const auto& peers) {
    for (int b = 0; b < 3; ++b) {
      if (bytes[b] > 0 && peers(me, b) != mine[b]) bad += epx::detail::concat("own buffer ", b, " was copied; ");
      for (int r = 0; r < n; ++r) {
        const std::size_t m = size_of(r, b);
        if (m == 0) continue;
        const auto* q = static_cast<const std::int64_t*>(peers(r, b));
        if (q[0] != b * std::int64_t{1000000000} + r * 1000000 ||
            q[m - 1] != b * std::int64_t{1000000000} + r * 1000000 + static_cast<std::int64_t>(m - 1))
          bad += epx::detail::concat("rank ", r, " buffer ", b, "; ");
      }
    }
  });
  CHECK_MESSAGE(bad.empty(), bad);
  // A buffer handed back is handed out again (the smallest free one that fits), on every
  // rank alike; one that no free block holds comes from a new window.
  const void* first = held[0].get();
  held[0].reset();
  auto again = w.peer_buffer(size_of(me, 0) * sizeof(std::int64_t));
  CHECK(again.get() == first);
  held.clear();
  auto larger = w.peer_buffer(100000 * sizeof(std::int64_t) * static_cast<std::size_t>(me + 1));
  REQUIRE(larger != nullptr);
  fill(static_cast<std::int64_t*>(larger.get()), 100000 * static_cast<std::size_t>(me + 1), me, 7);
  const void* one[1] = {larger.get()};
  const std::size_t one_bytes[1] = {100000 * sizeof(std::int64_t) * static_cast<std::size_t>(me + 1)};
  w.access_peers(one, one_bytes, 1, [&](const auto& peers) {
    if (peers(me, 0) != one[0]) bad += "own larger buffer was copied; ";
    for (int r = 0; r < n; ++r) {
      const auto* q = static_cast<const std::int64_t*>(peers(r, 0));
      const std::size_t m = 100000 * static_cast<std::size_t>(r + 1);
      if (q[m - 1] != 7 * std::int64_t{1000000000} + r * 1000000 + static_cast<std::int64_t>(m - 1))
        bad += epx::detail::concat("rank ", r, " larger buffer; ");
    }
  });
  CHECK_MESSAGE(bad.empty(), bad);
  // Many rounds of calls whose sizes vary a little reuse their blocks (a new window each
  // time would run out of the 64).
  for (int round = 0; round < 200; ++round) {
    auto a = w.peer_buffer(4096 + 64 * static_cast<std::size_t>((round * 7 + me) % 5));
    auto b = w.peer_buffer(8192 + 64 * static_cast<std::size_t>((round * 3 + me) % 5));
    CHECK((a != nullptr && b != nullptr && a.get() != b.get()));
  }
  // More blocks held at once than the 64 windows hold: past them a rank gets a null
  // pointer, and what it publishes from its own memory is copied; once blocks are handed
  // back the pool gives them out again.
  std::vector<std::shared_ptr<void>> many;
  for (int i = 0; i < 70; ++i) many.push_back(w.peer_buffer(64));
  std::size_t got = 0;
  while (got < many.size() && many[got] != nullptr) ++got;
  CHECK(got >= 1);
  CHECK(got <= 63);  // with `larger`
  for (std::size_t i = got; i < many.size(); ++i) CHECK(many[i] == nullptr);
  std::int64_t own = 1000 + me;
  const void* mixed[2] = {many[0].get(), &own};
  *static_cast<std::int64_t*>(many[0].get()) = me;
  const std::size_t mixed_bytes[2] = {sizeof(std::int64_t), sizeof(std::int64_t)};
  w.access_peers(mixed, mixed_bytes, 2, [&](const auto& peers) {
    if (peers(me, 0) != mixed[0] || peers(me, 1) == mixed[1]) bad += "published in the wrong place; ";
    for (int r = 0; r < n; ++r)
      if (*static_cast<const std::int64_t*>(peers(r, 0)) != r ||
          *static_cast<const std::int64_t*>(peers(r, 1)) != 1000 + r)
        bad += epx::detail::concat("rank ", r, " with a full pool; ");
  });
  CHECK_MESSAGE(bad.empty(), bad);
  many.clear();
  CHECK(w.peer_buffer(64) != nullptr);
  // A block may outlive the communicator's last copy: handing it back then does nothing.
  {
    std::shared_ptr<void> kept;
    {
      communicator c = communicator::world();
      kept = c.peer_buffer(1 << 20);
      std::memset(kept.get(), 1, 1 << 20);
    }
    kept.reset();
  }
  epx::mpi::options o;
  o.shared_memory = false;
  communicator off = communicator::world(o);
  check_error([&] { (void)off.peer_buffer(8); }, epx::errc::configuration, "no peer access");
}

TEST_CASE("mpi: communicators over one MPI_Comm with windows, destroyed in different orders on the ranks") {
  MPI_Comm dup = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &dup) == MPI_SUCCESS);
  {
    const int me = communicator::world().rank();
    epx::mpi::options o;
    o.timeout = std::chrono::seconds(20);
    std::vector<std::unique_ptr<communicator>> c;
    for (int k = 0; k < 3; ++k) c.push_back(std::make_unique<communicator>(dup, o));
    for (int round = 0; round < 2; ++round)
      for (auto& x : c) {
        REQUIRE(x->peer_access_available());
        const int v = me * 10 + round;
        const void* one[1] = {&v};
        const std::size_t four[1] = {sizeof(int)};
        int seen = -1;
        x->access_peers(one, four, 1, [&](const auto& peers) { seen = *static_cast<const int*>(peers(0, 0)); });
        CHECK(seen == round);
        if (round == 1) x->peer_memory(64);
      }
    // Even ranks destroy 0, 1, 2; odd ranks 2, 1, 0.
    if (me % 2 == 0) {
      for (auto& x : c) x.reset();
    } else {
      for (auto it = c.rbegin(); it != c.rend(); ++it) it->reset();
    }
    // The MPI_Comm still works, also for a new communicator with a window, freed in order.
    communicator again(dup, o);
    REQUIRE(again.peer_access_available());
    const int v = me;
    const void* one[1] = {&v};
    const std::size_t four[1] = {sizeof(int)};
    int sum = 0;
    again.access_peers(one, four, 1, [&](const auto& peers) {
      for (int r = 0; r < peers.size(); ++r) sum += *static_cast<const int*>(peers(r, 0));
    });
    CHECK(sum == again.size() * (again.size() - 1) / 2);
    again.barrier();
  }
  MPI_Comm_free(&dup);
}

// Communicators over two different MPI_Comms, with windows, destroyed in crossing orders
// (even ranks x then y, odd ranks y then x): each destructor's agreement waits for ranks that
// are in the other one, so both time out. No rank may then go on into an MPI_Win_free that
// another rank gave up (a late rank hung there for good); the windows are left to
// MPI_Finalize, and everything returns within the watchdog's time.
TEST_CASE("mpi: communicators over two MPI_Comms destroyed in crossing orders return after the watchdog") {
  MPI_Comm x = MPI_COMM_NULL, y = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &x) == MPI_SUCCESS);
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &y) == MPI_SUCCESS);
  const int me = communicator::world().rank();
  {
    epx::mpi::options o;
    o.timeout = std::chrono::seconds(1);
    auto a = std::make_unique<communicator>(x, o);
    auto b = std::make_unique<communicator>(y, o);
    for (communicator* c : {a.get(), b.get()}) {
      REQUIRE(c->peer_access_available());
      const int v = me;
      const void* one[1] = {&v};
      const std::size_t four[1] = {sizeof(int)};
      c->access_peers(one, four, 1, [](const auto&) {});
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (me % 2 == 0) {
      a.reset();
      b.reset();
    } else {
      b.reset();
      a.reset();
    }
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  }
  // Both MPI_Comms still carry collectives.
  for (MPI_Comm c : {x, y}) {
    communicator w(c);
    std::vector<double> v{1.0};
    w.all_reduce(v.data(), v.data(), 1, epx::datatype::float64, 1.0);
    CHECK(v[0] == w.size());
  }
  MPI_Comm_free(&x);
  MPI_Comm_free(&y);
}

TEST_CASE("mpi: access_peers failures: mismatched counts, bad buffers, a throwing function, no shared memory") {
  communicator w = communicator::world();
  const int n = w.size(), me = w.rank();
  int v = me;
  const void* mine[2] = {&v, &v};
  const std::size_t bytes[2] = {sizeof(int), sizeof(int)};
  if (n > 1) {
    bool ran = false;
    check_error([&] { w.access_peers(mine, bytes, me == n - 1 ? 2 : 1, [&](const auto&) { ran = true; }); },
                epx::errc::communicator,
                epx::detail::concat("access_peers: mismatched counts: rank 0 passed 1, rank ", n - 1, " passed 2"));
    CHECK(!ran);
  }
  // A null buffer that claims bytes, and too many buffers, on the last rank: every rank raises.
  const void* null_one[2] = {&v, nullptr};
  check_error([&] { w.access_peers(me == n - 1 ? null_one : mine, bytes, 2, [](const auto&) {}); }, epx::errc::input,
              epx::detail::concat("access_peers: rank ", n - 1, ": buffer 1 is null but holds bytes"));
  std::vector<const void*> many(17, &v);
  std::vector<std::size_t> many_bytes(17, sizeof(int));
  check_error([&] { w.access_peers(many.data(), many_bytes.data(), me == n - 1 ? 17 : 2, [](const auto&) {}); },
              epx::errc::input, epx::detail::concat("access_peers: rank ", n - 1, " passed 17 buffers; at most 16"));
  // The function throws on the last rank: it rethrows once every rank's function is done;
  // the others read every rank's buffer and carry on.
  bool threw = false, read_all = false;
  try {
    w.access_peers(mine, bytes, 1, [&](const auto& peers) {
      if (me == n - 1) throw std::runtime_error("reader failed");
      read_all = true;
      for (int r = 0; r < n; ++r) read_all = read_all && *static_cast<const int*>(peers(r, 0)) == r;
    });
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()) == "reader failed";
  }
  CHECK(threw == (me == n - 1));
  CHECK(read_all == (me != n - 1));
  // Nothing is left half-done: the communicator still works, with peer access.
  int sum = 0;
  w.access_peers(mine, bytes, 1, [&](const auto& peers) {
    for (int r = 0; r < n; ++r) sum += *static_cast<const int*>(peers(r, 0));
  });
  CHECK(sum == n * (n - 1) / 2);
  check_all_to_allv<std::int32_t>(w, 4);
  // Shared memory switched off: no peer access, and access_peers says why.
  epx::mpi::options o;
  o.shared_memory = false;
  communicator off = communicator::world(o);
  CHECK(!off.peer_access_available());
  CHECK(!epx::peer_access_available(off));
  check_error([&] { off.access_peers(mine, bytes, 1, [](const auto&) {}); }, epx::errc::configuration,
              "options::shared_memory is off: no peer access");
}

TEST_CASE("mpi: unchecked communicator (point-to-point all_to_allv) on the shared cases") {
  epx::mpi::options o;
  o.check_counts = false;
  communicator w = communicator::world(o);
  comm_cases::case_all_to_all(w);
  comm_cases::case_all_to_allv(w);
  comm_cases::case_all_to_allv_rows(w);
  comm_cases::case_large(w, std::size_t{4} << 20);
  check_all_reduce<bf16>(w, 1001, 0.5, false, 31);
  check_reduce_scatter<float>(w, 77, 1.0, 32);
  check_segments<float>(w, 3, 33);
}

TEST_CASE("mpi: unchecked communicator with one message over max_count") {
  epx::mpi::options o;
  o.check_counts = false;
  o.max_count = 5;
  communicator w = communicator::world(o);
  const int n = w.size(), me = w.rank();
  // Only rank 0 has a message over the limit: every rank must take the chunked path.
  std::vector<std::size_t> sc(n, 1), sd(n), rc(n, 1), rd(n);
  for (int p = 0; p < n; ++p) sd[p] = rd[p] = p;
  if (me == 0) {
    sc[0] = 12;
    rc[0] = 12;
    for (int p = 1; p < n; ++p) sd[p] = rd[p] = 12 + p;
  }
  std::vector<std::int64_t> send(12 + 2 * n), recv(12 + 2 * n, -1);
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = 1000 * me + static_cast<std::int64_t>(i);
  w.all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), epx::datatype::int64);
  std::size_t wrong = 0;
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < rc[p]; ++i) {
      const std::size_t src_off = (p == 0 ? (me == 0 ? 0 : 12 + me) : me) + i;
      wrong += recv[rd[p] + i] != 1000 * p + static_cast<std::int64_t>(src_off);
    }
  CHECK(wrong == 0);
}

TEST_CASE("mpi: MPI failures become epx::error(errc::mpi)") {
  communicator w = communicator::world();
  // A negative count is refused by MPI on every rank (argument checking happens before any
  // communication), and the wrapped communicator returns the error instead of aborting.
  int x = 0;
  bool thrown = false;
  try {
    EPX_MPI_CHECK(MPI_Bcast(&x, -1, MPI_INT, 0, w.native()));
  } catch (const epx::error& e) {
    thrown = true;
    CHECK(e.category() == epx::errc::mpi);
    CHECK(e.status() != 0);
    CHECK(e.message().find("MPI_Bcast") != std::string::npos);
    CHECK(e.message().find("MPI error code") != std::string::npos);
  }
  CHECK(thrown);
  check_error([] { epx::detail::mpi_check(MPI_ERR_TRUNCATE, "MPI_Recv", EPX_HERE); }, epx::errc::mpi,
              "MPI_Recv failed: " + epx::detail::mpi_error_string(MPI_ERR_TRUNCATE));
  w.barrier();
}

// Failure injection, run by ctest with --no-skip (see tests/CMakeLists.txt): the last rank
// throws inside run() while the others wait in a collective; run() must print the message
// and MPI_Abort the job instead of hanging.
TEST_CASE("mpi: injected failure inside run aborts every rank" * doctest::skip()) {
  int argc = 1;
  char name[] = "test";
  char* args[] = {name, nullptr};
  char** argv = args;
  epx::mpi::run(argc, argv, [](communicator& w) {
    if (w.rank() == w.size() - 1) throw epx::error(epx::errc::input, "injected failure");
    std::vector<float> x(4, 1.0f);
    epx::all_reduce(w, epx::make_span(x));  // never completes: the last rank is gone
  });
}

// Run only by the ctest test_comm_mpi_unknown_exception_np2 (--no-skip): the last rank
// throws something not derived from std::exception; run() must print "unknown exception"
// for it and end the job.
TEST_CASE("mpi: an exception not derived from std::exception inside run aborts every rank" * doctest::skip()) {
  struct not_std {
    int code;
  };
  int argc = 1;
  char name[] = "test";
  char* args[] = {name, nullptr};
  char** argv = args;
  epx::mpi::run(argc, argv, [](communicator& w) {
    if (w.rank() == w.size() - 1) throw not_std{7};
    std::vector<float> x(4, 1.0f);
    epx::all_reduce(w, epx::make_span(x));  // never completes: the last rank is gone
  });
}

// Run only by the ctest test_comm_mpi_watchdog_np2 (--no-skip): the last rank stalls for
// longer than the watchdog before an all_reduce; the others' wait turns into an error and
// epx::mpi::run ends the job with it (instead of a hang).
TEST_CASE("mpi: watchdog on a stalled rank inside run" * doctest::skip()) {
  int argc = 1;
  char name[] = "test";
  char* args[] = {name, nullptr};
  char** argv = args;
  epx::mpi::run(argc, argv, [](communicator& world) {
    epx::mpi::options o;
    o.timeout = std::chrono::milliseconds(1000);
    communicator w(world.native(), o);
    if (w.rank() == w.size() - 1) std::this_thread::sleep_for(std::chrono::seconds(20));
    std::vector<float> x(4, 1.0f);
    epx::all_reduce(w, epx::make_span(x));
  });
}

// Run only by the ctest test_comm_mpi_late_split_np2 (--no-skip): rank 0's split times out
// in its agreement (the last rank is late) and raises; the late rank's agreement then
// matches the pending one, and the bounded barrier before the blocking MPI_Comm_split ends
// the job instead of letting it block for good.
TEST_CASE("mpi: a late rank after a caught timeout in split ends the job" * doctest::skip()) {
  epx::mpi::options o;
  o.timeout = std::chrono::milliseconds(1000);
  communicator w(MPI_COMM_WORLD, o);
  if (w.rank() == w.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  try {
    (void)w.split(0, 0);
  } catch (const epx::error&) {
    // Alive and driving MPI's progress (as a program that goes on would), not in the split.
    for (int i = 0; i < 20000; ++i) {
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

// Run only by the ctest test_comm_mpi_caught_timeout_owned_np2 (--no-skip): a barrier on
// an owned (split) communicator times out on rank 0, which catches the error and destroys
// the communicator while its barrier is still pending; the late rank then arrives and MPI
// progresses that barrier. The communicator must not have been freed under it (Open MPI
// crashed there): every rank returns normally and the job ends with status 0.
TEST_CASE("mpi: a caught timeout on an owned communicator, then the late rank" * doctest::skip()) {
  epx::mpi::options o;
  o.timeout = std::chrono::milliseconds(1000);
  communicator w(MPI_COMM_WORLD, o);
  bool timed_out = false;
  {
    communicator sub = w.split(0, w.rank());
    if (sub.rank() == sub.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    try {
      sub.barrier();
    } catch (const epx::error& e) {
      timed_out = std::string(e.message()).find("watchdog") != std::string::npos;
    }
  }  // rank 0: destroyed with its barrier pending
  if (w.rank() == 0) CHECK(timed_out);
  // Alive and driving MPI's progress while the late rank's barrier completes rank 0's.
  for (int i = 0; i < 3000; ++i) {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Run only by the ctest test_comm_mpi_after_finalize_np1 (--no-skip; it finalizes MPI):
// wrapping a communicator after MPI_Finalize raises errc::mpi saying so (no MPI call).
TEST_CASE("mpi: a communicator made after MPI_Finalize raises" * doctest::skip()) {
  MPI_Finalize();
  bool raised = false;
  try {
    communicator w(MPI_COMM_WORLD);
  } catch (const epx::error& e) {
    raised = e.category() == epx::errc::mpi && e.message().find("MPI was finalized already") != std::string::npos;
  }
  CHECK(raised);
}

// A failed assertion on one rank while the others wait: the test main aborts the job.
TEST_CASE("mpi: injected assertion failure on one rank aborts every rank" * doctest::skip()) {
  communicator w = communicator::world();
  CHECK_MESSAGE(w.rank() != w.size() - 1, "injected assertion failure");
  w.barrier();
}

// Run only by the ctest test_comm_mpi_access_peers_watchdog_np2 (--no-skip): the last rank
// stays inside access_peers' function longer than the watchdog; the others' wait at the
// exit barrier turns into an error and epx::mpi::run ends the job with it.
TEST_CASE("mpi: watchdog on a rank stalled inside access_peers" * doctest::skip()) {
  int argc = 1;
  char name[] = "test";
  char* args[] = {name, nullptr};
  char** argv = args;
  epx::mpi::run(argc, argv, [](communicator& world) {
    epx::mpi::options o;
    o.timeout = std::chrono::milliseconds(1000);
    communicator w(world.native(), o);
    const int v = w.rank();
    const void* mine[1] = {&v};
    const std::size_t bytes[1] = {sizeof(int)};
    w.access_peers(mine, bytes, 1, [&](const auto&) {
      if (w.rank() == w.size() - 1) std::this_thread::sleep_for(std::chrono::seconds(20));
    });
  });
}

TEST_CASE("mpi: a rank's own error raises on every rank with that rank's category, not each rank's own") {
  // No public collective passes different categories on different ranks today, so this asks
  // the agreement itself: the last rank fails with errc::configuration, the others pass no
  // error and errc::input.
  epx::detail::mpi_state st;
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &st.comm) == MPI_SUCCESS);
  MPI_Comm_rank(st.comm, &st.rank);
  MPI_Comm_size(st.comm, &st.size);
  const epx::mpi::options opt{};
  const int culprit = st.size - 1;
  const std::string mine = st.rank == culprit ? std::string("bad thing on the last rank") : std::string();
  const epx::errc category = st.rank == culprit ? epx::errc::configuration : epx::errc::input;
  bool raised = false;
  try {
    (void)epx::detail::mpi_agree(st, opt, "test", {}, mine, category);
  } catch (const epx::error& e) {
    raised = true;
    CHECK(e.category() == epx::errc::configuration);
    CHECK(std::string(e.what()).find("bad thing on the last rank") != std::string::npos);
  }
  CHECK(raised);
  MPI_Comm_free(&st.comm);
}
