// Host copies that write around the caches (epx/exec/stream.hpp): exec::stream_copy against
// memcpy at every alignment of both sides and lengths around its 16- and 64-byte steps; the
// row copies of kernels::gather and kernels::copy, and the threads communicator's
// all-to-alls, streamed (threshold 0) against the same calls through the caches, bitwise,
// on serial and openmp. The layer with every copy streamed is checked against float64 in
// test_layer_sizes.cpp.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/threads.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/stream.hpp"
#include "epx/kernels/launch.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_stream_cpp {

namespace {

// Sets the stream threshold for a scope.
struct threshold_scope {
  std::size_t before;
  explicit threshold_scope(std::size_t bytes) : before(epx::exec::set_stream_threshold(bytes)) {}
  ~threshold_scope() { epx::exec::set_stream_threshold(before); }
};

template <class T>
std::vector<T> random_rows(std::size_t rows, std::size_t H, std::uint64_t seed) {
  epx::ref::rng g(seed);
  std::vector<T> v(rows * H);
  for (auto& e : v) e = epx::convert<T>(static_cast<float>(g.uniform(-4, 4)));
  return v;
}

}  // namespace

TEST_CASE("stream_copy: the bytes of memcpy at every alignment, nothing written outside") {
  const std::size_t lengths[] = {0, 1, 15, 16, 17, 63, 64, 65, 79, 80, 127, 128, 129, 600, 4096, 8193};
  std::vector<unsigned char> src(8193 + 64), dst(8193 + 96), want(dst.size());
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  std::size_t checked = 0;
  for (std::size_t n : lengths)
    for (std::size_t so = 0; so < 16; so += 5)
      for (std::size_t d_off = 16; d_off < 32; ++d_off) {
        std::memset(dst.data(), 0xa5, dst.size());
        want = dst;
        std::memcpy(want.data() + d_off, src.data() + so, n);
        epx::exec::stream_copy(dst.data() + d_off, src.data() + so, n);
        epx::exec::stream_fence();
        if (dst != want) FAIL_CHECK("length " << n << ", source offset " << so << ", destination offset " << d_off);
        ++checked;
      }
  CHECK(checked == 16 * 4 * 16);
}

TEST_CASE("stream threshold: set for every thread, returns the previous value") {
  const std::size_t before = epx::exec::stream_threshold();
  CHECK(before == (std::size_t{4} << 20));  // the documented default
  CHECK(epx::exec::set_stream_threshold(100) == before);
  CHECK(epx::exec::stream_threshold() == 100);
  CHECK(epx::exec::streams(100));
  CHECK_FALSE(epx::exec::streams(99));
  CHECK(epx::exec::set_stream_threshold(before) == 100);
}

// gather (rows by index, -1 a zero row) and copy (rows through a table, null a zero row),
// streamed and not, over row sizes that are and are not multiples of 16 bytes; the
// destination starts as garbage so that a zero row that is not written shows.
template <class T, class Exec>
void check_row_copies(const Exec& ex) {
  for (std::size_t H : {std::size_t{1}, std::size_t{7}, std::size_t{300}, std::size_t{4096}, std::size_t{7168}}) {
    CAPTURE(H);
    const std::size_t n = 37, rows = 53;
    const auto x = random_rows<T>(n, H, 11 + H);
    std::vector<std::int64_t> index(rows);
    std::vector<const T*> table(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      index[r] = r % 9 == 4 ? -1 : static_cast<std::int64_t>((r * 17) % n);
      table[r] = index[r] < 0 ? nullptr : x.data() + static_cast<std::size_t>(index[r]) * H;
    }
    std::vector<float> w(rows);
    for (std::size_t r = 0; r < rows; ++r) w[r] = 0.03f + 0.11f * static_cast<float>(r % 13);
    // The destination one element off a 16-byte boundary where H is odd (unaligned rows).
    std::vector<T> a(rows * H + 1, epx::convert<T>(9.0f)), b = a, c = a, d = a, e = a, f = a;
    {
      threshold_scope s(std::numeric_limits<std::size_t>::max());
      epx::kernels::gather(ex, rows, H, x.data(), index.data(), a.data() + 1);
      epx::kernels::copy(ex, rows, H, table.data(), c.data() + 1);
      epx::kernels::gather(ex, rows, H, x.data(), index.data(), w.data(), e.data() + 1);
    }
    {
      threshold_scope s(0);
      epx::kernels::gather(ex, rows, H, x.data(), index.data(), b.data() + 1);
      epx::kernels::copy(ex, rows, H, table.data(), d.data() + 1);
      epx::kernels::gather(ex, rows, H, x.data(), index.data(), w.data(), f.data() + 1);
    }
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(c.data(), d.data(), c.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(a.data(), c.data(), a.size() * sizeof(T)) == 0);
    // Scaled (w[r] * row, rounded to T in accum_t<T>; float and double stream it in chunks
    // through a buffer, bf16 takes the caches either way): the bits of the copy through the
    // caches, and each element the rounded product.
    CHECK(std::memcmp(e.data(), f.data(), e.size() * sizeof(T)) == 0);
    using A = epx::accum_t<T>;
    bool products = true;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t h = 0; h < H; ++h) {
        const A v = index[r] < 0 ? A(0)
                                 : static_cast<A>(w[r]) *
                                       epx::convert<A>(x[static_cast<std::size_t>(index[r]) * H + h]);
        const T want = epx::convert<T>(v);
        products = products && std::memcmp(&f[1 + r * H + h], &want, sizeof(T)) == 0;
      }
    CHECK(products);
    CHECK(epx::convert<float>(b[1 + 4 * H]) == 0.0f);   // row 4: index -1, a zero row
    CHECK(epx::convert<float>(b[1 + 5 * H]) == epx::convert<float>(x[(5 * 17 % n) * H]));
  }
}

TEST_CASE_TEMPLATE("gather and copy: streamed rows equal rows through the caches, serial and openmp", T, float, double,
                   epx::bf16) {
  check_row_copies<T>(epx::exec::serial{});
  check_row_copies<T>(epx::exec::openmp{});
}

// The threads communicator's all_to_allv (blocks) and all_to_allv_indexed (rows by index),
// streamed and not, 4 ranks, rows of 300 bf16 (600 bytes: heads and tails).
TEST_CASE("threads all-to-alls: streamed blocks and rows equal those through the caches") {
  const int P = 4;
  const std::size_t H = 300, n = 41;
  std::vector<std::vector<epx::bf16>> results[2];
  for (int streamed = 0; streamed < 2; ++streamed) {
    threshold_scope s(streamed ? 0 : std::numeric_limits<std::size_t>::max());
    results[streamed].assign(2 * P, {});
    epx::threads::run(P, [&](epx::threads::communicator& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      const auto x = random_rows<epx::bf16>(n, H, 100 + me);
      // Rank q sends (me + q + 1) rows to each peer q: rows (j * 7 + q) % n by index.
      std::vector<std::size_t> sc(P), sd(P), rc(P), rd(P);
      std::vector<std::int64_t> rows;
      std::size_t at = 0, rat = 0;
      for (std::size_t q = 0; q < static_cast<std::size_t>(P); ++q) {
        sc[q] = me + q + 1;
        sd[q] = at;
        for (std::size_t j = 0; j < sc[q]; ++j) rows.push_back(static_cast<std::int64_t>((j * 7 + q) % n));
        at += sc[q];
        rc[q] = q + me + 1;  // what q sends to me
        rd[q] = rat;
        rat += rc[q];
      }
      std::vector<epx::bf16> recv(rat * H, epx::convert<epx::bf16>(9.0f));
      epx::all_to_allv_indexed(comm, epx::span<const epx::bf16>(x), epx::span<const std::int64_t>(rows),
                               epx::span<const std::size_t>(sc), epx::span<const std::size_t>(sd), recv.data(),
                               epx::span<const std::size_t>(rc), epx::span<const std::size_t>(rd), 1, H);
      // The same rows as blocks of elements (gathered into send order first).
      std::vector<epx::bf16> send(at * H);
      for (std::size_t j = 0; j < at; ++j)
        std::memcpy(send.data() + j * H, x.data() + static_cast<std::size_t>(rows[j]) * H, H * sizeof(epx::bf16));
      std::vector<std::size_t> sce(P), sde(P), rce(P), rde(P);
      for (int q = 0; q < P; ++q) {
        sce[q] = sc[q] * H;
        sde[q] = sd[q] * H;
        rce[q] = rc[q] * H;
        rde[q] = rd[q] * H;
      }
      std::vector<epx::bf16> blocks(rat * H, epx::convert<epx::bf16>(9.0f));
      epx::all_to_allv(comm, send.data(), epx::span<const std::size_t>(sce), epx::span<const std::size_t>(sde),
                       blocks.data(), epx::span<const std::size_t>(rce), epx::span<const std::size_t>(rde));
      results[streamed][2 * me] = recv;
      results[streamed][2 * me + 1] = blocks;
    });
  }
  for (std::size_t i = 0; i < results[0].size(); ++i) {
    CAPTURE(i);
    REQUIRE(results[0][i].size() == results[1][i].size());
    CHECK(std::memcmp(results[0][i].data(), results[1][i].data(), results[0][i].size() * sizeof(epx::bf16)) == 0);
  }
  for (int r = 0; r < P; ++r)  // rows by index and blocks agree
    CHECK(std::memcmp(results[1][2 * r].data(), results[1][2 * r + 1].data(),
                      results[1][2 * r].size() * sizeof(epx::bf16)) == 0);
}

}  // namespace test_stream_cpp
