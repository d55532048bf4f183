// tests/comm/comm_cases.hpp: the test body shared by every host communicator backend.
//
// Each `case_*` function is collective over `world` (a communicator of any size, any
// backend satisfying epx::is_communicator_v) and checks its results with doctest CHECKs.
// Only CHECK is used, never REQUIRE, so that a failed check on one rank cannot leave the
// others waiting in the next collective. Inputs are seeded pseudo-random values that every
// rank can recompute for any (sender, receiver, index), so each rank checks what it
// received against an independent float64 computation without extra communication.
//
//   epx::threads::run(n, [](auto& comm) { comm_cases::run_comm_cases(comm); });
//   // or, under mpirun: auto comm = ...; comm_cases::run_comm_cases(comm);
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/mesh/mesh.hpp"

namespace comm_cases {

// --- inputs --------------------------------------------------------------------------------

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline std::uint64_t hash(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t i) {
  return mix(mix(mix(seed ^ (a << 20)) ^ b) ^ i);
}

// Uniform in [-1, 1).
inline double unit(std::uint64_t h) { return static_cast<double>(h >> 11) * 0x1p-52 - 1.0; }

// The value `from` contributes at index i of a message to `to` (seeded, deterministic).
template <class T>
T value(std::uint64_t seed, int from, int to, std::size_t i) {
  const std::uint64_t h = hash(seed, static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to), i);
  if constexpr (std::is_same_v<T, std::int32_t>) return static_cast<std::int32_t>(h % 2000001) - 1000000;
  else if constexpr (std::is_same_v<T, std::int64_t>) return static_cast<std::int64_t>(h >> 8) - (std::int64_t{1} << 55);
  else if constexpr (std::is_same_v<T, float>) return static_cast<float>(unit(h) * 4.0);
  else if constexpr (std::is_same_v<T, double>) return unit(h) * 4.0;
  else if constexpr (std::is_same_v<T, epx::bf16> || std::is_same_v<T, epx::fp16>) return T(static_cast<float>(unit(h) * 4.0));
  else return static_cast<std::byte>(h & 0xff);
}

template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, epx::bf16> || std::is_same_v<T, epx::fp16>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
std::string type_name() {
  return epx::to_string(epx::datatype_of<T>());
}

template <class T>
T sentinel() {
  T v;
  std::memset(&v, 0x5a, sizeof v);
  return v;
}

// Tolerance of a sum of n values of magnitude sum_abs, rounded to T.
template <class T>
double sum_tolerance(double exact, double sum_abs, int n) {
  double eps_store = 0.0;  // rounding of the final store
  if constexpr (std::is_same_v<T, epx::bf16>) eps_store = 0x1p-8;
  else if constexpr (std::is_same_v<T, epx::fp16>) eps_store = 0x1p-11;
  else if constexpr (std::is_same_v<T, float>) eps_store = 0x1p-24;
  else if constexpr (std::is_same_v<T, double>) eps_store = 0x1p-53;
  const double eps_acc = std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24;  // float accumulation
  return eps_store * std::fabs(exact) + (n + 1) * eps_acc * sum_abs + 1e-7 * eps_store;
}

// --- all_to_all / all_to_allv --------------------------------------------------------------

// Equal counts (the count exchange): every element type, counts 0, 1, 5.
template <class T, class Comm>
void case_all_to_all_type(Comm& c, std::uint64_t seed) {
  const int n = c.size(), me = c.rank();
  for (std::size_t cnt : {std::size_t{0}, std::size_t{1}, std::size_t{5}}) {
    std::vector<T> send(cnt * n), recv(cnt * n, sentinel<T>());
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < cnt; ++i) send[p * cnt + i] = value<T>(seed + cnt, me, p, i);
    epx::all_to_all(c, epx::span<const T>(send), epx::span<T>(recv));
    std::size_t bad = 0;
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < cnt; ++i) bad += !same_bits(recv[p * cnt + i], value<T>(seed + cnt, p, me, i));
    CHECK_MESSAGE(bad == 0, "all_to_all<" << type_name<T>() << "> count " << cnt << " on " << n
                                          << " ranks: " << bad << " wrong elements on rank " << me);
  }
}

template <class Comm>
void case_all_to_all(Comm& c) {
  case_all_to_all_type<std::int32_t>(c, 11);
  case_all_to_all_type<std::int64_t>(c, 12);
  case_all_to_all_type<float>(c, 13);
  case_all_to_all_type<double>(c, 14);
  case_all_to_all_type<epx::bf16>(c, 15);
  case_all_to_all_type<epx::fp16>(c, 16);
  case_all_to_all_type<std::byte>(c, 17);
}

// Uneven per-pair counts: zero-length messages, a rank that sends nothing, a rank that
// receives nothing, blocks in reverse order on the send side, gaps on the receive side
// (which must stay untouched).
inline std::size_t pair_count(std::uint64_t seed, int from, int to, int n, std::size_t max_count) {
  if (n > 1 && from == n - 1) return 0;  // sends nothing
  if (n > 2 && to == 1) return 0;        // receives nothing
  const std::uint64_t h = hash(seed, static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to), 999);
  if (h % 5 == 0) return 0;  // zero-length messages between other pairs
  return static_cast<std::size_t>(h % (max_count + 1));
}

template <class T, class Comm>
void case_all_to_allv_type(Comm& c, std::uint64_t seed, std::size_t max_count) {
  const int n = c.size(), me = c.rank();
  std::vector<std::size_t> sc(n), sd(n), rc(n), rd(n);
  std::size_t off = 0;
  for (int p = n - 1; p >= 0; --p) {  // reverse order in the send buffer
    sc[p] = pair_count(seed, me, p, n, max_count);
    sd[p] = off;
    off += sc[p];
  }
  std::vector<T> send(off);
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = value<T>(seed, me, p, i);
  constexpr std::size_t gap = 3;
  off = gap;
  for (int p = 0; p < n; ++p) {
    rc[p] = pair_count(seed, p, me, n, max_count);
    rd[p] = off;
    off += rc[p] + gap;
  }
  std::vector<T> recv(off, sentinel<T>());
  epx::all_to_allv(c, send.data(), epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd), recv.data(),
                   epx::span<const std::size_t>(rc), epx::span<const std::size_t>(rd));
  std::size_t bad = 0, gaps_touched = 0;
  std::vector<char> covered(recv.size(), 0);
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < rc[p]; ++i) {
      bad += !same_bits(recv[rd[p] + i], value<T>(seed, p, me, i));
      covered[rd[p] + i] = 1;
    }
  for (std::size_t j = 0; j < recv.size(); ++j)
    if (!covered[j]) gaps_touched += !same_bits(recv[j], sentinel<T>());
  CHECK_MESSAGE(bad == 0, "all_to_allv<" << type_name<T>() << "> on " << n << " ranks: " << bad
                                         << " wrong elements on rank " << me);
  CHECK_MESSAGE(gaps_touched == 0, "all_to_allv<" << type_name<T>() << "> wrote " << gaps_touched
                                                  << " elements outside the blocks on rank " << me);
}

template <class Comm>
void case_all_to_allv(Comm& c) {
  for (std::size_t max_count : {std::size_t{0}, std::size_t{3}, std::size_t{300}}) {
    case_all_to_allv_type<std::int32_t>(c, 21 + max_count, max_count);
    case_all_to_allv_type<std::int64_t>(c, 22 + max_count, max_count);
    case_all_to_allv_type<float>(c, 23 + max_count, max_count);
    case_all_to_allv_type<double>(c, 24 + max_count, max_count);
    case_all_to_allv_type<epx::bf16>(c, 25 + max_count, max_count);
    case_all_to_allv_type<epx::fp16>(c, 26 + max_count, max_count);
    case_all_to_allv_type<std::byte>(c, 27 + max_count, max_count);
  }
}

// Whole rows of H elements, counts and offsets in rows.
template <class Comm>
void case_all_to_allv_rows(Comm& c) {
  const int n = c.size(), me = c.rank();
  for (std::size_t H : {std::size_t{1}, std::size_t{7}, std::size_t{64}}) {
    const std::uint64_t seed = 31 + H;
    std::vector<std::size_t> sr(n), so(n), rr(n), ro(n);
    std::size_t rows = 0;
    for (int p = 0; p < n; ++p) {
      sr[p] = pair_count(seed, me, p, n, 9);
      so[p] = rows;
      rows += sr[p];
    }
    std::vector<float> send(rows * H);
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < sr[p] * H; ++i) send[so[p] * H + i] = value<float>(seed, me, p, i);
    rows = 0;
    for (int p = 0; p < n; ++p) {
      rr[p] = pair_count(seed, p, me, n, 9);
      ro[p] = rows;
      rows += rr[p];
    }
    std::vector<float> recv(rows * H, -77.0f);
    epx::all_to_allv_rows(c, send.data(), epx::span<const std::size_t>(sr), epx::span<const std::size_t>(so),
                          recv.data(), epx::span<const std::size_t>(rr), epx::span<const std::size_t>(ro), H);
    std::size_t bad = 0;
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < rr[p] * H; ++i) bad += !same_bits(recv[ro[p] * H + i], value<float>(seed, p, me, i));
    CHECK_MESSAGE(bad == 0, "all_to_allv_rows H=" << H << " on " << n << " ranks: " << bad
                                                  << " wrong elements on rank " << me);
  }
}

// The receiver's side of a segmented exchange laid out segment-major ([segment][peer], as
// dispatch lands rows expert-major) with a one-row gap after each segment; rows(p, me, i)
// is what peer p sends in segment i. Returns the rows the receive buffer needs.
template <class Rows>
std::size_t segment_major_layout(const Rows& rows, int n, int me, std::size_t nseg, std::vector<std::size_t>& rc,
                                 std::vector<std::size_t>& rd) {
  std::size_t off = 0;
  for (std::size_t i = 0; i < nseg; ++i)
    for (int p = 0; p < n; ++p) {
      rc[p * nseg + i] = rows(p, me, i);
      rd[p * nseg + i] = off;
      off += rc[p * nseg + i] + 1;  // a one-row gap
    }
  return off;
}

// The checks of a segmented exchange's receive buffer: `bad` wrong elements among those
// `covered`, and every element not covered (the gaps) still the sentinel.
template <class T>
void check_landing(const char* op, const std::vector<T>& recv, const std::vector<char>& covered, std::size_t bad,
                   std::size_t nseg, std::size_t H, int n, int me) {
  std::size_t gaps_touched = 0;
  for (std::size_t j = 0; j < recv.size(); ++j)
    if (!covered[j]) gaps_touched += !same_bits(recv[j], sentinel<T>());
  CHECK_MESSAGE(bad == 0, op << "<" << type_name<T>() << "> nseg " << nseg << " H " << H << " on " << n
                             << " ranks: " << bad << " wrong elements on rank " << me);
  CHECK_MESSAGE(gaps_touched == 0, op << "<" << type_name<T>() << "> nseg " << nseg << " wrote " << gaps_touched
                                      << " elements outside the segments on rank " << me);
}

// Segmented all-to-all: the sender keeps its segments peer-major ([peer][segment]), the
// receiver lays them out segment-major ([segment][peer], as dispatch lands rows expert-major)
// with a one-element gap after each (which must stay untouched); some segments are empty.
// Goes through the backend's native all_to_allv_segments where it has one.
template <class T, class Comm>
void case_all_to_allv_segments_type(Comm& c, std::uint64_t seed, std::size_t nseg, std::size_t H) {
  const int n = c.size(), me = c.rank();
  const std::size_t m = static_cast<std::size_t>(n) * nseg;
  auto rows = [&](int src, int dst, std::size_t i) -> std::size_t {
    const std::uint64_t h = hash(seed, static_cast<std::uint64_t>(src), static_cast<std::uint64_t>(dst), 5000 + i);
    return h % 4 == 0 ? 0 : static_cast<std::size_t>(h % 7);  // 0..6 rows, a quarter empty
  };
  std::vector<std::size_t> sc(m), sd(m), rc(m), rd(m);
  std::size_t off = 0;
  for (int q = 0; q < n; ++q)
    for (std::size_t i = 0; i < nseg; ++i) {
      sc[q * nseg + i] = rows(me, q, i);
      sd[q * nseg + i] = off;
      off += sc[q * nseg + i];
    }
  // Element e of segment i from src to dst: value(seed, src, dst * 4096 + i, e).
  std::vector<T> send(off * H);
  for (int q = 0; q < n; ++q)
    for (std::size_t i = 0; i < nseg; ++i)
      for (std::size_t e = 0; e < sc[q * nseg + i] * H; ++e)
        send[sd[q * nseg + i] * H + e] = value<T>(seed, me, q * 4096 + static_cast<int>(i), e);
  off = segment_major_layout(rows, n, me, nseg, rc, rd);
  std::vector<T> recv(off * H, sentinel<T>());
  epx::all_to_allv_segments(c, send.data(), epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd),
                            recv.data(), epx::span<const std::size_t>(rc), epx::span<const std::size_t>(rd), nseg, H);
  std::size_t bad = 0;
  std::vector<char> covered(recv.size(), 0);
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < nseg; ++i)
      for (std::size_t e = 0; e < rc[p * nseg + i] * H; ++e) {
        bad += !same_bits(recv[rd[p * nseg + i] * H + e], value<T>(seed, p, me * 4096 + static_cast<int>(i), e));
        covered[rd[p * nseg + i] * H + e] = 1;
      }
  check_landing("all_to_allv_segments", recv, covered, bad, nseg, H, n, me);
}

template <class Comm>
void case_all_to_allv_segments(Comm& c) {
  for (std::size_t nseg : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
    case_all_to_allv_segments_type<std::int32_t>(c, 41 + nseg, nseg, 1);
    case_all_to_allv_segments_type<std::int64_t>(c, 42 + nseg, nseg, 3);
    case_all_to_allv_segments_type<float>(c, 43 + nseg, nseg, 5);
    case_all_to_allv_segments_type<double>(c, 44 + nseg, nseg, 2);
    case_all_to_allv_segments_type<epx::bf16>(c, 45 + nseg, nseg, 16);
    case_all_to_allv_segments_type<epx::fp16>(c, 46 + nseg, nseg, 4);
    case_all_to_allv_segments_type<std::byte>(c, 47 + nseg, nseg, 7);
  }
}

// Segmented all-to-all of rows picked by index: each rank's src holds 9 rows; the index
// list names them in any order, with repeats; segments as in the segmented case, landing
// segment-major with a one-row gap after each (which must stay untouched). Goes through the
// backend's native all_to_allv_indexed where it has one (epx::has_indexed_sends_v), else
// the gathering fallback.
template <class T, class Comm>
void case_all_to_allv_indexed_type(Comm& c, std::uint64_t seed, std::size_t nseg, std::size_t H) {
  const int n = c.size(), me = c.rank();
  const std::size_t m = static_cast<std::size_t>(n) * nseg, src_rows = 9;
  auto rows = [&](int src, int dst, std::size_t i) -> std::size_t {
    const std::uint64_t h = hash(seed, static_cast<std::uint64_t>(src), static_cast<std::uint64_t>(dst), 7000 + i);
    return h % 4 == 0 ? 0 : static_cast<std::size_t>(h % 7);  // 0..6 rows, a quarter empty
  };
  // Row j of segment i from src to dst is src's row pick(...) (repeats and any order).
  auto pick = [&](int src, int dst, std::size_t i, std::size_t j) -> std::int64_t {
    return static_cast<std::int64_t>(hash(seed ^ 0x51ull, static_cast<std::uint64_t>(src),
                                          static_cast<std::uint64_t>(dst) * 64 + i, j) %
                                     src_rows);
  };
  std::vector<T> src(src_rows * H);
  for (std::size_t r = 0; r < src_rows; ++r)
    for (std::size_t e = 0; e < H; ++e) src[r * H + e] = value<T>(seed, me, static_cast<int>(r), e);
  std::vector<std::size_t> sc(m), sd(m), rc(m), rd(m);
  std::vector<std::int64_t> idx;
  for (int q = 0; q < n; ++q)
    for (std::size_t i = 0; i < nseg; ++i) {
      sc[q * nseg + i] = rows(me, q, i);
      sd[q * nseg + i] = idx.size();
      for (std::size_t j = 0; j < sc[q * nseg + i]; ++j) idx.push_back(pick(me, q, i, j));
    }
  const std::size_t off = segment_major_layout(rows, n, me, nseg, rc, rd);
  std::vector<T> recv(off * H, sentinel<T>());
  epx::all_to_allv_indexed(c, epx::span<const T>(src), epx::span<const std::int64_t>(idx),
                           epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd), recv.data(),
                           epx::span<const std::size_t>(rc), epx::span<const std::size_t>(rd), nseg, H);
  std::size_t bad = 0;
  std::vector<char> covered(recv.size(), 0);
  for (int p = 0; p < n; ++p)
    for (std::size_t i = 0; i < nseg; ++i)
      for (std::size_t j = 0; j < rc[p * nseg + i]; ++j) {
        const int row = static_cast<int>(pick(p, me, i, j));
        for (std::size_t e = 0; e < H; ++e) {
          const std::size_t at = (rd[p * nseg + i] + j) * H + e;
          bad += !same_bits(recv[at], value<T>(seed, p, row, e));
          covered[at] = 1;
        }
      }
  check_landing("all_to_allv_indexed", recv, covered, bad, nseg, H, n, me);
}

template <class Comm>
void case_all_to_allv_indexed(Comm& c) {
  for (std::size_t nseg : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
    case_all_to_allv_indexed_type<std::int32_t>(c, 61 + nseg, nseg, 1);
    case_all_to_allv_indexed_type<float>(c, 63 + nseg, nseg, 5);
    case_all_to_allv_indexed_type<double>(c, 64 + nseg, nseg, 2);
    case_all_to_allv_indexed_type<epx::bf16>(c, 65 + nseg, nseg, 16);
    case_all_to_allv_indexed_type<std::byte>(c, 67 + nseg, nseg, 7);
  }
}

// One message of `bytes` (64 MiB by default) from every rank to the next one, as int64.
template <class Comm>
void case_large(Comm& c, std::size_t bytes = std::size_t{64} << 20) {
  const int n = c.size(), me = c.rank();
  const std::size_t elems = bytes / sizeof(std::int64_t);
  const int to = (me + 1) % n, from = (me + n - 1) % n;
  std::vector<std::size_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  sc[to] = elems;
  rc[from] = elems;
  auto v = [](int src, std::size_t i) {
    return static_cast<std::int64_t>((static_cast<std::uint64_t>(src) << 48) ^ (i * 0x9e3779b97f4a7c15ull >> 16));
  };
  std::vector<std::int64_t> send(elems), recv(elems, -1);
  for (std::size_t i = 0; i < elems; ++i) send[i] = v(me, i);
  epx::all_to_allv(c, send.data(), epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd), recv.data(),
                   epx::span<const std::size_t>(rc), epx::span<const std::size_t>(rd));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < elems; ++i) bad += recv[i] != v(from, i);
  CHECK_MESSAGE(bad == 0, "all_to_allv of " << bytes << " bytes on " << n << " ranks: " << bad
                                            << " wrong elements on rank " << me);
}

// --- reductions ----------------------------------------------------------------------------

// Checks `got` (on every rank) against scale * (sum over ranks of value(seed, r, 0, i))
// computed in float64, bitwise against the summation rule of the host backends
// (epx/comm/communicator.hpp: summed in rank order in the accumulation type, scaled, rounded
// once; worked out here), and that every rank holds bitwise rank 0's result.
template <class T, class Comm>
void check_sum(Comm& c, const std::vector<T>& got, std::uint64_t seed, std::size_t first_index, double scale, const std::string& what) {
  const int n = c.size(), me = c.rank();
  std::size_t bad = 0, not_rule = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::size_t idx = first_index + i;
    if constexpr (std::is_integral_v<T>) {
      std::int64_t exact = 0;
      for (int r = 0; r < n; ++r) exact += static_cast<std::int64_t>(value<T>(seed, r, 0, idx));
      // Integers: exact sum; a scaled sum is rounded to nearest from double.
      const auto want = scale == 1.0 ? static_cast<T>(exact) : static_cast<T>(std::llround(static_cast<double>(exact) * scale));
      bad += got[i] != want;
    } else {
      double exact = 0.0, sum_abs = 0.0;
      for (int r = 0; r < n; ++r) {
        const double x = to_double(value<T>(seed, r, 0, idx));
        exact += x;
        sum_abs += std::fabs(x);
      }
      exact *= scale;
      const double err = std::fabs(to_double(got[i]) - exact);
      const double tol = sum_tolerance<T>(exact, sum_abs * std::fabs(scale), n);
      if (!(err <= tol)) {
        ++bad;
        worst = std::max(worst, err);
      }
      using A = epx::accum_t<T>;
      A acc = epx::convert<A>(value<T>(seed, 0, 0, idx));
      for (int r = 1; r < n; ++r) acc += epx::convert<A>(value<T>(seed, r, 0, idx));
      if (scale != 1.0) acc *= static_cast<A>(scale);
      not_rule += !same_bits(got[i], epx::convert<T>(acc));
    }
  }
  CHECK_MESSAGE(bad == 0, what << "<" << type_name<T>() << "> of " << got.size() << " elements, scale " << scale
                               << ", on " << n << " ranks: " << bad << " elements off the float64 reference on rank "
                               << me << " (worst error " << worst << ")");
  CHECK_MESSAGE(not_rule == 0, what << "<" << type_name<T>() << "> of " << got.size() << " elements, scale " << scale
                                    << ", on " << n << " ranks: " << not_rule
                                    << " elements are not the rank-order sum in the accumulation type on rank " << me);
}

template <class T, class Comm>
void check_same_on_every_rank(Comm& c, const std::vector<T>& got, const std::string& what) {
  std::vector<T> ref(got);
  epx::broadcast(c, epx::span<T>(ref), 0);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) differ += !same_bits(ref[i], got[i]);
  CHECK_MESSAGE(differ == 0, what << "<" << type_name<T>() << ">: rank " << c.rank() << " differs from rank 0 in "
                                  << differ << " elements (the result must be bitwise identical)");
}

template <class T, class Comm>
void case_all_reduce_type(Comm& c, std::uint64_t seed) {
  const int n = c.size(), me = c.rank();
  const double scales[] = {1.0, 1.0 / n, std::is_integral_v<T> ? 3.0 : 0.3};
  // 40000 elements: several reduction blocks per rank's chunk; one scale is enough there.
  for (std::size_t cnt : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1000}, std::size_t{40000}}) {
    for (double scale : scales) {
      if (cnt > 1000 && scale == 1.0) continue;
      const std::uint64_t s = seed + cnt * 7;
      std::vector<T> send(cnt), recv(cnt, sentinel<T>());
      for (std::size_t i = 0; i < cnt; ++i) send[i] = value<T>(s, me, 0, i);
      epx::all_reduce(c, epx::span<const T>(send), epx::span<T>(recv), scale);
      check_sum(c, recv, s, 0, scale, "all_reduce");
      check_same_on_every_rank(c, recv, "all_reduce");
      // In place gives the same bits.
      std::vector<T> inplace(send);
      epx::all_reduce(c, epx::span<T>(inplace), scale);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < cnt; ++i) differ += !same_bits(inplace[i], recv[i]);
      CHECK_MESSAGE(differ == 0, "in-place all_reduce<" << type_name<T>() << "> differs from out-of-place in "
                                                        << differ << " elements on rank " << me);
    }
  }
}

template <class Comm>
void case_all_reduce(Comm& c) {
  case_all_reduce_type<std::int32_t>(c, 41);
  case_all_reduce_type<std::int64_t>(c, 42);
  case_all_reduce_type<float>(c, 43);
  case_all_reduce_type<double>(c, 44);
  case_all_reduce_type<epx::bf16>(c, 45);
  case_all_reduce_type<epx::fp16>(c, 46);
}

template <class T, class Comm>
void case_reduce_scatter_type(Comm& c, std::uint64_t seed) {
  const int n = c.size(), me = c.rank();
  for (std::size_t cnt : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{5000}}) {
    for (double scale : {1.0, 0.25}) {
      const std::uint64_t s = seed + cnt * 5;
      std::vector<T> send(cnt * n), recv(cnt, sentinel<T>());
      for (std::size_t i = 0; i < cnt * n; ++i) send[i] = value<T>(s, me, 0, i);
      epx::reduce_scatter(c, epx::span<const T>(send), epx::span<T>(recv), scale);
      check_sum(c, recv, s, cnt * static_cast<std::size_t>(me), scale, "reduce_scatter");
    }
  }
}

template <class Comm>
void case_reduce_scatter(Comm& c) {
  case_reduce_scatter_type<std::int32_t>(c, 51);
  case_reduce_scatter_type<std::int64_t>(c, 52);
  case_reduce_scatter_type<float>(c, 53);
  case_reduce_scatter_type<double>(c, 54);
  case_reduce_scatter_type<epx::bf16>(c, 55);
  case_reduce_scatter_type<epx::fp16>(c, 56);
}

// --- all_gather / broadcast / barrier -------------------------------------------------------

template <class T, class Comm>
void case_all_gather_type(Comm& c, std::uint64_t seed) {
  const int n = c.size(), me = c.rank();
  for (std::size_t cnt : {std::size_t{0}, std::size_t{3}, std::size_t{1000}}) {
    std::vector<T> send(cnt), recv(cnt * n, sentinel<T>());
    for (std::size_t i = 0; i < cnt; ++i) send[i] = value<T>(seed + cnt, me, 0, i);
    epx::all_gather(c, epx::span<const T>(send), epx::span<T>(recv));
    std::size_t bad = 0;
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < cnt; ++i) bad += !same_bits(recv[p * cnt + i], value<T>(seed + cnt, p, 0, i));
    CHECK_MESSAGE(bad == 0, "all_gather<" << type_name<T>() << "> count " << cnt << " on " << n << " ranks: " << bad
                                          << " wrong elements on rank " << me);
  }
}

template <class Comm>
void case_all_gather(Comm& c) {
  case_all_gather_type<std::int32_t>(c, 61);
  case_all_gather_type<std::int64_t>(c, 62);
  case_all_gather_type<float>(c, 63);
  case_all_gather_type<double>(c, 64);
  case_all_gather_type<epx::bf16>(c, 65);
  case_all_gather_type<epx::fp16>(c, 66);
  case_all_gather_type<std::byte>(c, 67);
}

template <class T, class Comm>
void case_broadcast_type(Comm& c, std::uint64_t seed) {
  const int n = c.size(), me = c.rank();
  for (int root = 0; root < n; ++root) {
    for (std::size_t cnt : {std::size_t{0}, std::size_t{1}, std::size_t{777}}) {
      std::vector<T> data(cnt);
      for (std::size_t i = 0; i < cnt; ++i) data[i] = me == root ? value<T>(seed, root, 0, i) : sentinel<T>();
      epx::broadcast(c, epx::span<T>(data), root);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < cnt; ++i) bad += !same_bits(data[i], value<T>(seed, root, 0, i));
      CHECK_MESSAGE(bad == 0, "broadcast<" << type_name<T>() << "> from root " << root << " count " << cnt << " on "
                                           << n << " ranks: " << bad << " wrong elements on rank " << me);
    }
  }
}

template <class Comm>
void case_broadcast(Comm& c) {
  case_broadcast_type<std::int32_t>(c, 71);
  case_broadcast_type<std::int64_t>(c, 72);
  case_broadcast_type<float>(c, 73);
  case_broadcast_type<double>(c, 74);
  case_broadcast_type<epx::bf16>(c, 75);
  case_broadcast_type<epx::fp16>(c, 76);
  case_broadcast_type<std::byte>(c, 77);
}

// The last rank arrives late; nobody may leave the barrier before it arrives.
template <class Comm>
void case_barrier(Comm& c) {
  using clock = std::chrono::steady_clock;
  const int n = c.size();
  c.barrier();
  const auto delay = std::chrono::milliseconds(60);
  const auto t0 = clock::now();
  if (c.rank() == n - 1) std::this_thread::sleep_for(delay);
  c.barrier();
  const auto waited = clock::now() - t0;
  CHECK_MESSAGE(waited >= delay - std::chrono::milliseconds(5),
                "rank " << c.rank() << " left the barrier after "
                        << std::chrono::duration_cast<std::chrono::microseconds>(waited).count()
                        << " us, before the late rank arrived (" << delay.count() << " ms)");
  for (int i = 0; i < 20; ++i) c.barrier();
}

// --- sub-communicators ---------------------------------------------------------------------

// Checks that `sub` holds exactly `members` (world ranks, in order) and that it is isolated:
// a sum over it only sees its members.
template <class Comm>
void check_members(Comm& world, Comm& sub, const std::vector<int>& members, const std::string& what) {
  const int me = world.rank();
  CHECK_MESSAGE(sub.size() == static_cast<int>(members.size()),
                what << ": size " << sub.size() << " on world rank " << me << ", expected " << members.size());
  if (sub.size() != static_cast<int>(members.size())) return;
  CHECK_MESSAGE((sub.rank() >= 0 && sub.rank() < sub.size() && members[sub.rank()] == me),
                what << ": world rank " << me << " has rank " << sub.rank() << " in the sub-communicator");
  std::vector<std::int32_t> mine{me}, all(members.size(), -1);
  epx::all_gather(sub, epx::span<const std::int32_t>(mine), epx::span<std::int32_t>(all));
  bool same = true;
  for (std::size_t i = 0; i < members.size(); ++i) same = same && all[i] == members[i];
  std::string got;
  for (auto r : all) got += std::to_string(r) + " ";
  std::string want;
  for (auto r : members) want += std::to_string(r) + " ";
  CHECK_MESSAGE(same, what << ": members [ " << got << "] on world rank " << me << ", expected [ " << want << "]");
  std::vector<std::int64_t> x{static_cast<std::int64_t>(me) + 1};
  epx::all_reduce(sub, epx::span<std::int64_t>(x));
  std::int64_t want_sum = 0;
  for (auto r : members) want_sum += r + 1;
  CHECK_MESSAGE(x[0] == want_sum, what << ": sum over the sub-communicator " << x[0] << ", expected " << want_sum);
}

// Every mesh (pp, dp_replicate, fsdp, tp) whose product is the world size, with ep = tp and
// ep = fsdp * tp; every group kind checked against mesh::group_members.
template <class Comm>
void case_sub_communicators(Comm& c) {
  const int n = c.size(), me = c.rank();
  int meshes = 0;
  for (int pp = 1; pp <= n; ++pp)
    for (int rep = 1; rep * pp <= n; ++rep)
      for (int fsdp = 1; fsdp * rep * pp <= n; ++fsdp) {
        if (n % (pp * rep * fsdp) != 0) continue;
        const int tp = n / (pp * rep * fsdp);
        const int eps[2] = {tp, fsdp * tp};
        for (int k = 0; k < (fsdp > 1 ? 2 : 1); ++k) {
          const int ep = eps[k];
          epx::mesh_config cfg;
          cfg.pp = pp;
          cfg.dp_replicate = rep;
          cfg.fsdp = fsdp;
          cfg.tp = tp;
          cfg.ep = ep;
          cfg.experts = 2 * ep;
          const epx::mesh m(cfg);
          ++meshes;
          for (auto g : epx::all_group_kinds) {
            auto sub = epx::sub_communicator(c, m, g);
            const std::string what = std::string("mesh pp=") + std::to_string(pp) + " dp_replicate=" +
                                     std::to_string(rep) + " fsdp=" + std::to_string(fsdp) +
                                     " tp=" + std::to_string(tp) + " ep=" + std::to_string(ep) + " group " +
                                     epx::to_string(g);
            CHECK_MESSAGE(sub.rank() == m.group_rank(g, me), what << ": rank " << sub.rank() << " on world rank " << me
                                                                  << ", expected " << m.group_rank(g, me));
            check_members(c, sub, m.group_members(g, me), what);
          }
        }
      }
  CHECK(meshes >= 1);
}

// Arbitrary color/key splits: keys reverse the order; a split of a split works.
template <class Comm>
void case_split(Comm& c) {
  const int n = c.size(), me = c.rank();
  for (int colors : {1, 2, 3}) {
    auto sub = c.split(me % colors, -me);  // descending world rank
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r)
      if (r % colors == me % colors) members.push_back(r);
    check_members(c, sub, members, "split(rank % " + std::to_string(colors) + ", -rank)");
    // Split the split in halves by its own rank.
    auto half = sub.split(sub.rank() < (sub.size() + 1) / 2 ? 0 : 1, sub.rank());
    std::vector<int> hm;
    const int lo = sub.rank() < (sub.size() + 1) / 2 ? 0 : (sub.size() + 1) / 2;
    const int hi = sub.rank() < (sub.size() + 1) / 2 ? (sub.size() + 1) / 2 : sub.size();
    for (int i = lo; i < hi; ++i) hm.push_back(members[static_cast<std::size_t>(i)]);
    check_members(c, half, hm, "split of split(rank % " + std::to_string(colors) + ")");
  }
}

// --- everything ----------------------------------------------------------------------------

// Every case above except case_large (whose memory use a caller may want to control).
template <class Comm>
void run_comm_cases(Comm& world) {
  static_assert(epx::is_communicator_v<Comm>, "comm_cases needs a communicator");
  case_all_to_all(world);
  case_all_to_allv(world);
  case_all_to_allv_rows(world);
  case_all_to_allv_segments(world);
  case_all_to_allv_indexed(world);
  case_all_reduce(world);
  case_reduce_scatter(world);
  case_all_gather(world);
  case_broadcast(world);
  case_barrier(world);
  case_split(world);
  case_sub_communicators(world);
}

}  // namespace comm_cases
