// Counting-sort send layout, TP slicing and the per-element functors, single rank.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

#include "epx/epx.hpp"
#include "support/reference.hpp"

namespace {

using epx::ref::rng;

// Independent model: pairs sorted stably by expert id (row, then slot, within an expert).
struct naive_layout {
  std::vector<std::int64_t> pos, src_row, counts, offset;
};

naive_layout naive(const std::vector<std::int32_t>& ids, int k, int E) {
  naive_layout l;
  l.counts.assign(E, 0);
  for (auto e : ids) ++l.counts[e];
  l.offset.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) l.offset[e + 1] = l.offset[e] + l.counts[e];
  l.pos.assign(ids.size(), -1);
  l.src_row.assign(ids.size(), -1);
  std::int64_t p = 0;
  for (int e = 0; e < E; ++e)
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == e) {
        l.pos[i] = p;
        l.src_row[p] = static_cast<std::int64_t>(i / k);
        ++p;
      }
  return l;
}

template <class Exec>
void check_plan(const Exec& ex, std::size_t N, int k, int E, std::size_t chunks, std::uint64_t seed) {
  const auto ids = epx::ref::uneven_routing(N, E, k, seed);
  const auto w = epx::ref::random_weights(N, k, seed);
  std::vector<float> wf(w.begin(), w.end());
  const auto p = epx::layout::build_plan(ex, ids.data(), wf.data(), N, k, E, chunks);
  const auto want = naive(ids, k, E);
  CAPTURE(N);
  CAPTURE(k);
  CAPTURE(E);
  CAPTURE(chunks);
  REQUIRE(static_cast<bool>(p.check));
  CHECK(p.host_counts == want.counts);
  CHECK(p.host_offset == want.offset);
  CHECK(std::vector<std::int64_t>(p.pos.data(), p.pos.data() + p.pairs) == want.pos);
  CHECK(std::vector<std::int64_t>(p.src_row.data(), p.src_row.data() + p.pairs) == want.src_row);
}

}  // namespace

TEST_CASE("layout: counting sort equals a stable sort by expert, any chunk count") {
  std::uint64_t seed = 11;
  for (int E : {1, 4, 7, 64})
    for (int k : {1, 2, 8})
      for (std::size_t N : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{37}}) {
        if (k > E) continue;
        for (std::size_t C : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1000}}) {
          check_plan(epx::exec::serial{}, N, k, E, C, ++seed);
          check_plan(epx::exec::openmp{2}, N, k, E, C, seed);
        }
      }
}

TEST_CASE("layout: bad ids and non-finite weights are reported with the first bad pair") {
  const int E = 8, k = 2;
  const std::size_t N = 10;
  auto ids = epx::ref::random_routing(N, E, k, 3);
  std::vector<float> w(N * k, 0.25f);
  SUBCASE("id too large") {
    ids[7] = E;
    ids[12] = -3;
    const auto p = epx::layout::build_plan(epx::exec::serial{}, ids.data(), w.data(), N, k, E, 4);
    CHECK_FALSE(static_cast<bool>(p.check));
    CHECK(p.check.kind == epx::layout::input_check::bad_expert_id);
    CHECK(p.check.pair == 7);
    CHECK(p.check.id == E);
    const auto msg = epx::layout::describe(p.check, k, E, 100);
    CHECK(msg.find("expert id (8) of token 103 slot 1 out of range [0, 8)") != std::string::npos);
    for (auto c : p.host_counts) CHECK(c == 0);
  }
  SUBCASE("negative id") {
    ids[0] = -1;
    const auto p = epx::layout::build_plan(epx::exec::openmp{2}, ids.data(), w.data(), N, k, E, 0);
    CHECK(p.check.kind == epx::layout::input_check::bad_expert_id);
    CHECK(p.check.pair == 0);
    CHECK(p.check.id == -1);
  }
  SUBCASE("NaN and inf weights") {
    w[5] = std::nanf("");
    w[9] = INFINITY;
    const auto p = epx::layout::build_plan(epx::exec::serial{}, ids.data(), w.data(), N, k, E, 3);
    CHECK(p.check.kind == epx::layout::input_check::non_finite_weight);
    CHECK(p.check.pair == 5);
    CHECK(epx::layout::describe(p.check, k, E).find("routing weight (nan) of token 2 slot 1 is not finite") !=
          std::string::npos);
    w[5] = 1.0f;
    const auto q = epx::layout::build_plan(epx::exec::serial{}, ids.data(), w.data(), N, k, E, 1);
    CHECK(q.check.pair == 9);
  }
}

TEST_CASE("slicing: floor bounds, uneven and empty slices, 64-bit") {
  CHECK(epx::slice_bounds(1, 2, 0).empty());
  CHECK(epx::slice_bounds(1, 2, 1).size() == 1);
  for (std::size_t N : {0, 1, 2, 5, 7, 64})
    for (int tp : {1, 2, 3, 4, 8}) {
      std::size_t next = 0;
      for (int t = 0; t < tp; ++t) {
        const auto s = epx::slice_bounds(N, tp, t);
        CHECK(s.begin == next);
        CHECK(s.begin == N * t / tp);
        next = s.end;
      }
      CHECK(next == N);
    }
  const std::size_t big = std::size_t{1} << 40;
  CHECK(epx::slice_bounds(big, 8, 7).begin == big / 8 * 7);
  CHECK_THROWS_AS(epx::slice_bounds(4, 2, 2), epx::error);
}

TEST_CASE_TEMPLATE("functors: combine, its backward and the row reduction against float64", T, float, double,
                   epx::bf16) {
  const std::size_t n = 9, H = 5;
  const int k = 3;
  const std::size_t S = n * k;
  rng g(77);
  // A random permutation as send positions, one slot masked out (-1) per token 4.
  std::vector<std::int64_t> pos(S);
  for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
  for (std::size_t i = S - 1; i > 0; --i) std::swap(pos[i], pos[static_cast<std::size_t>(g.below(static_cast<int>(i + 1)))]);
  pos[4 * k + 1] = -1;
  const auto yd = epx::ref::round_through<T>(epx::ref::random_normal(S, H, 5));
  const auto god = epx::ref::round_through<T>(epx::ref::random_normal(n, H, 6));
  const auto wd = epx::ref::round_through<float>(epx::ref::random_weights(n, k, 7, -1.0, 1.0));
  const auto y = epx::ref::from_double<T>(yd);
  const auto go = epx::ref::from_double<T>(god);
  std::vector<float> w(wd.begin(), wd.end());

  std::vector<T> out(n * H);
  epx::exec::for_each_n(epx::exec::serial{}, n, epx::dispatch::combine<T>{y.data(), w.data(), pos.data(), out.data(), H, k});
  std::vector<double> want(n * H, 0.0);
  for (std::size_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const auto p = pos[t * k + j];
      if (p < 0) continue;
      for (std::size_t h = 0; h < H; ++h) want[t * H + h] += wd[t * k + j] * yd[p * H + h];
    }
  const double tol = std::is_same_v<T, epx::bf16> ? 3e-2 : 1e-6;
  epx::ref::check_close(out, want, tol, tol, "combine");

  std::vector<T> gy(S * H, epx::convert<T>(0.0f));
  std::vector<float> gw(n * k, 9.0f);
  epx::exec::for_each_n(epx::exec::openmp{2}, n,
                        epx::dispatch::combine_backward<T>{y.data(), go.data(), w.data(), pos.data(), gy.data(),
                                                           gw.data(), H, k});
  std::vector<double> want_gy(S * H, 0.0), want_gw(n * k, 0.0);
  for (std::size_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const auto p = pos[t * k + j];
      if (p < 0) continue;
      for (std::size_t h = 0; h < H; ++h) {
        want_gy[p * H + h] = wd[t * k + j] * god[t * H + h];
        want_gw[t * k + j] += yd[p * H + h] * god[t * H + h];
      }
    }
  epx::ref::check_close(gy, want_gy, tol, tol, "combine_backward grad_y");
  epx::ref::check_close(gw, want_gw, tol, tol, "combine_backward grad_w");

  std::vector<T> gx(n * H);
  epx::exec::for_each_n(epx::exec::serial{}, n, epx::dispatch::reduce_grad_rows<T>{y.data(), pos.data(), gx.data(), H, k});
  std::vector<double> want_gx(n * H, 0.0);
  for (std::size_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const auto p = pos[t * k + j];
      if (p < 0) continue;
      for (std::size_t h = 0; h < H; ++h) want_gx[t * H + h] += yd[p * H + h];
    }
  epx::ref::check_close(gx, want_gx, tol, tol, "reduce_grad_rows");

  // gather_rows with a padding row (-1 source)
  std::vector<std::int64_t> src = {2, -1, 0, 8};
  std::vector<T> dst(src.size() * H, epx::convert<T>(5.0f));
  epx::exec::for_each_n(epx::exec::serial{}, src.size(), epx::dispatch::gather_rows<T>{go.data(), src.data(), dst.data(), H});
  std::vector<double> want_dst(src.size() * H, 0.0);
  for (std::size_t r = 0; r < src.size(); ++r)
    for (std::size_t h = 0; h < H; ++h) want_dst[r * H + h] = src[r] < 0 ? 0.0 : god[src[r] * H + h];
  epx::ref::check_close(dst, want_dst, 0, 0, "gather_rows");
}

TEST_CASE("functors are trivially copyable (device-launchable)") {
  static_assert(std::is_trivially_copyable_v<epx::layout::histogram_chunks>);
  static_assert(std::is_trivially_copyable_v<epx::layout::scan_chunks>);
  static_assert(std::is_trivially_copyable_v<epx::layout::expert_offsets>);
  static_assert(std::is_trivially_copyable_v<epx::layout::scatter_pairs>);
  static_assert(std::is_trivially_copyable_v<epx::dispatch::gather_rows<epx::bf16>>);
  static_assert(std::is_trivially_copyable_v<epx::dispatch::combine<float>>);
  static_assert(std::is_trivially_copyable_v<epx::dispatch::combine_backward<epx::fp16>>);
  static_assert(std::is_trivially_copyable_v<epx::dispatch::reduce_grad_rows<double>>);
  static_assert(std::is_trivially_copyable_v<epx::dispatch::masked_positions>);
  static_assert(std::is_trivially_copyable_v<epx::dispatch::masked_source_rows>);
  CHECK(true);
}

TEST_CASE("padding policy") {
  epx::padding p;
  CHECK(p.padded_rows(0) == 1);
  CHECK(p.padded_rows(5) == 6);
  epx::padding off{0, 1};
  CHECK(off.padded_rows(0) == 0);
  CHECK(off.padded_rows(5) == 5);
  epx::padding al{1, 4};
  CHECK(al.padded_rows(0) == 4);
  CHECK(al.padded_rows(3) == 4);
  CHECK(al.padded_rows(4) == 8);
  epx::padding al0{0, 4};
  CHECK(al0.padded_rows(0) == 0);
  CHECK(al0.padded_rows(5) == 8);
  CHECK_THROWS_AS((epx::padding{-1, 1}.validate()), epx::error);
  CHECK_THROWS_AS((epx::padding{1, 0}.validate()), epx::error);
}

TEST_CASE_TEMPLATE("per-element functors (device form) equal the row functors bitwise", T, float, double, epx::bf16,
                   epx::fp16) {
  const std::size_t n = 7, H = 13;
  const int k = 3;
  const std::size_t S = n * k;
  rng g(91);
  std::vector<std::int64_t> pos(S);
  for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
  for (std::size_t i = S - 1; i > 0; --i) std::swap(pos[i], pos[static_cast<std::size_t>(g.below(static_cast<int>(i + 1)))]);
  pos[2 * k] = -1;
  pos[5 * k + 2] = -1;
  const auto y = epx::ref::from_double<T>(epx::ref::random_normal(S, H, 15));
  const auto go = epx::ref::from_double<T>(epx::ref::random_normal(n, H, 16));
  const auto wd = epx::ref::random_weights(n, k, 17, -1.0, 1.0);
  std::vector<float> w(wd.begin(), wd.end());
  namespace d = epx::dispatch;
  auto bits_equal = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  const epx::exec::serial ser;

  std::vector<T> o1(n * H), o2(n * H);
  epx::exec::for_each_n(ser, n, d::combine<T>{y.data(), w.data(), pos.data(), o1.data(), H, k});
  epx::exec::for_each_n(ser, n * H, d::combine_elements<T>{y.data(), w.data(), pos.data(), o2.data(), H, k});
  CHECK(bits_equal(o1, o2));

  std::vector<T> gy1(S * H, epx::convert<T>(0.0f)), gy2(S * H, epx::convert<T>(0.0f));
  std::vector<float> gw1(S, 3.0f), gw2(S, 3.0f);
  epx::exec::for_each_n(ser, n, d::combine_backward<T>{y.data(), go.data(), w.data(), pos.data(), gy1.data(), gw1.data(), H, k});
  epx::exec::for_each_n(ser, S * H, d::scatter_grad_elements<T>{go.data(), w.data(), pos.data(), gy2.data(), H, k});
  epx::exec::for_each_n(ser, S, d::weight_gradients<T>{y.data(), go.data(), pos.data(), gw2.data(), H, k});
  CHECK(bits_equal(gy1, gy2));
  CHECK(bits_equal(gw1, gw2));
  CHECK(gw2[2 * k] == 0.0f);

  std::vector<T> gx1(n * H), gx2(n * H);
  epx::exec::for_each_n(ser, n, d::reduce_grad_rows<T>{y.data(), pos.data(), gx1.data(), H, k});
  epx::exec::for_each_n(ser, n * H, d::reduce_grad_elements<T>{y.data(), pos.data(), gx2.data(), H, k});
  CHECK(bits_equal(gx1, gx2));

  std::vector<std::int64_t> src = {4, -1, 0, 6, 6};
  std::vector<T> r1(src.size() * H), r2(src.size() * H);
  epx::exec::for_each_n(ser, src.size(), d::gather_rows<T>{go.data(), src.data(), r1.data(), H});
  epx::exec::for_each_n(ser, src.size() * H, d::gather_elements<T>{go.data(), src.data(), r2.data(), H});
  CHECK(bits_equal(r1, r2));

  // The launch helpers pick the row form on host policies.
  static_assert(!d::by_element_v<epx::exec::serial> && !d::by_element_v<epx::exec::openmp>);
  std::vector<T> o3(n * H);
  d::launch_combine(epx::exec::openmp{2}, n, H, k, y.data(), w.data(), pos.data(), o3.data());
  CHECK(bits_equal(o1, o3));
  static_assert(std::is_trivially_copyable_v<d::combine_elements<T>> && std::is_trivially_copyable_v<d::weight_gradients<T>> &&
                std::is_trivially_copyable_v<d::scatter_grad_elements<T>> &&
                std::is_trivially_copyable_v<d::reduce_grad_elements<T>> && std::is_trivially_copyable_v<d::gather_elements<T>>);
}

TEST_CASE_TEMPLATE("row tables read the same rows bitwise; copy_rows, scale_rows; the lane order of dot products", T,
                   float, double, epx::bf16, epx::fp16) {
  namespace d = epx::dispatch;
  using A = epx::accum_t<T>;
  const epx::exec::serial ser;
  auto bits_equal = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  for (std::size_t H : {std::size_t{1}, std::size_t{13}, std::size_t{16}, std::size_t{37}, std::size_t{300}}) {
    CAPTURE(H);
    const std::size_t n = 6;
    const int k = 3;
    const std::size_t S = n * k;
    std::vector<std::int64_t> pos(S);
    for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>((i * 7) % S);
    pos[4] = -1;
    const auto y = epx::ref::from_double<T>(epx::ref::random_normal(S, H, 31));
    const auto go = epx::ref::from_double<T>(epx::ref::random_normal(n, H, 32));
    const auto wd = epx::ref::random_weights(n, k, 33, -1.0, 1.0);
    std::vector<float> w(wd.begin(), wd.end());
    // The same rows scattered over separate allocations, reached through a table.
    std::vector<std::vector<T>> pieces(S);
    std::vector<const T*> table(S);
    for (std::size_t p = 0; p < S; ++p) {
      pieces[p].assign(y.begin() + static_cast<std::ptrdiff_t>(p * H), y.begin() + static_cast<std::ptrdiff_t>((p + 1) * H));
      table[p] = pieces[p].data();
    }
    const d::row_table<T> rows{table.data()};

    std::vector<T> o1(n * H), o2(n * H);
    epx::exec::for_each_n(ser, n, d::combine<T>{y.data(), w.data(), pos.data(), o1.data(), H, k});
    d::launch_combine(ser, n, H, k, rows, w.data(), pos.data(), o2.data());
    CHECK(bits_equal(o1, o2));

    std::vector<T> gy1(S * H, epx::convert<T>(0.0f)), gy2(S * H, epx::convert<T>(0.0f));
    std::vector<float> gw1(S, 3.0f), gw2(S, 3.0f), gw3(S, 3.0f);
    d::launch_combine_backward(ser, n, H, k, y.data(), go.data(), w.data(), pos.data(), gy1.data(), gw1.data());
    d::launch_combine_backward(ser, n, H, k, rows, go.data(), w.data(), pos.data(), gy2.data(), gw2.data());
    d::launch_weight_gradients(ser, n, H, k, rows, go.data(), pos.data(), gw3.data());
    CHECK(bits_equal(gy1, gy2));
    CHECK(bits_equal(gw1, gw2));
    CHECK(bits_equal(gw1, gw3));
    CHECK(gw3[4] == 0.0f);
    // grad_w sums 16 interleaved lanes in h order each, then the lanes in order.
    for (std::size_t i = 0; i < S; ++i) {
      if (pos[i] < 0) continue;
      A lane[16] = {};
      const std::size_t t = i / static_cast<std::size_t>(k);
      for (std::size_t h = 0; h < H; ++h)
        lane[h % 16] += epx::convert<A>(y[static_cast<std::size_t>(pos[i]) * H + h]) * epx::convert<A>(go[t * H + h]);
      A sum = A(0);
      for (A v : lane) sum += v;
      CHECK(gw1[i] == static_cast<float>(sum));
    }

    std::vector<T> gx1(n * H), gx2(n * H);
    d::launch_reduce_grad_rows(ser, n, H, k, y.data(), pos.data(), gx1.data());
    d::launch_reduce_grad_rows(ser, n, H, k, rows, pos.data(), gx2.data());
    CHECK(bits_equal(gx1, gx2));

    // copy_rows and scale_rows: a null source is a zero row.
    std::vector<const T*> src = {table[3], nullptr, table[0], table[3]};
    std::vector<float> sc = {0.5f, 9.0f, -2.0f, 1.0f};
    std::vector<T> c(src.size() * H, epx::convert<T>(5.0f)), sr(src.size() * H, epx::convert<T>(5.0f));
    d::launch_copy_rows(ser, src.size(), H, src.data(), c.data());
    d::launch_scale_rows(ser, src.size(), H, src.data(), sc.data(), sr.data());
    for (std::size_t r = 0; r < src.size(); ++r)
      for (std::size_t h = 0; h < H; ++h) {
        const double v = src[r] ? epx::convert<double>(src[r][h]) : 0.0;
        CHECK(epx::convert<double>(c[r * H + h]) == v);
        const T want = src[r] ? epx::convert<T>(static_cast<A>(sc[r]) * epx::convert<A>(src[r][h])) : epx::convert<T>(0.0f);
        CHECK(std::memcmp(&sr[r * H + h], &want, sizeof(T)) == 0);
      }
  }
}

TEST_CASE("peer rows: every member's layout from the gathered counts; dispatch and return are inverse maps") {
  namespace d = epx::detail;
  rng g(123);
  for (int trial = 0; trial < 40; ++trial) {
    const int ep = 1 + g.below(5), L = 1 + g.below(3), E = ep * L;
    const epx::padding pad{g.below(3), 1 + g.below(3)};
    d::group_records rec;
    rec.size = ep;
    rec.stride = d::record_header + static_cast<std::size_t>(E);
    rec.data.assign(rec.stride * static_cast<std::size_t>(ep), 0);
    for (int s = 0; s < ep; ++s)
      for (int e = 0; e < E; ++e)
        rec.data[static_cast<std::size_t>(s) * rec.stride + d::record_header + static_cast<std::size_t>(e)] =
            g.below(4) == 0 ? 0 : g.below(6);
    const d::group_layout gl = d::make_group_layout(rec, L, pad);
    // Each member's own layout (what the staged route uses) agrees with the group view.
    std::vector<std::size_t> R(static_cast<std::size_t>(ep)), S(static_cast<std::size_t>(ep));
    for (int me = 0; me < ep; ++me) {
      std::vector<std::int64_t> off(static_cast<std::size_t>(E) + 1, 0);
      for (int e = 0; e < E; ++e) off[static_cast<std::size_t>(e) + 1] = off[static_cast<std::size_t>(e)] + rec.counts(me)[e];
      const d::segment_layout lay = d::make_segment_layout(rec, off, me, L, pad);
      R[static_cast<std::size_t>(me)] = lay.offsets.back();
      S[static_cast<std::size_t>(me)] = static_cast<std::size_t>(off.back());
      for (int s = 0; s < ep; ++s)
        for (int l = 0; l < L; ++l)
          CHECK(gl.recv_at(me, s, l) == lay.recv_displs[static_cast<std::size_t>(s * L + l)]);
      for (int e = 0; e < E; ++e) CHECK(gl.send_at(me, static_cast<std::size_t>(e)) == lay.send_displs[static_cast<std::size_t>(e)]);
    }
    // received[d][r] = (s, q): row r of d comes from send position q of s; padding stays (-1, -1).
    std::vector<std::vector<std::pair<int, std::size_t>>> received(static_cast<std::size_t>(ep));
    for (int dd = 0; dd < ep; ++dd) {
      auto& v = received[static_cast<std::size_t>(dd)];
      v.assign(R[static_cast<std::size_t>(dd)], {-1, 0});
      d::for_each_received(gl, dd, [&](std::size_t i, int s, std::size_t q) {
        REQUIRE(i < v.size());
        CHECK(v[i].first == -1);  // every row written once
        v[i] = {s, q};
      });
    }
    // Every send position of every member returns from exactly the row it was sent to.
    for (int me = 0; me < ep; ++me) {
      std::vector<int> seen(S[static_cast<std::size_t>(me)], 0);
      d::for_each_returned(gl, me, [&](std::size_t p, int dd, std::size_t r) {
        REQUIRE(p < seen.size());
        ++seen[p];
        REQUIRE(r < received[static_cast<std::size_t>(dd)].size());
        CHECK(received[static_cast<std::size_t>(dd)][r] == std::make_pair(me, p));
      });
      for (int c : seen) CHECK(c == 1);
    }
  }
}
