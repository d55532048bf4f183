// Counting-sort send layout, TP slicing and the per-element functors, single rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <cstdint>
#include <utility>
#include <vector>

#include "epx/epx.hpp"
#include "epx/exec/emulated.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_layout_cpp {

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
  // Without weights (no weight check; its own scatter loop) the same plan.
  const auto q = epx::layout::build_plan(ex, ids.data(), static_cast<const float*>(nullptr), N, k, E, chunks);
  REQUIRE(static_cast<bool>(q.check));
  CHECK(q.host_counts == want.counts);
  CHECK(std::vector<std::int64_t>(q.pos.data(), q.pos.data() + q.pairs) == want.pos);
  CHECK(std::vector<std::int64_t>(q.src_row.data(), q.src_row.data() + q.pairs) == want.src_row);
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
          check_plan(epx::exec::emulated_device{}, N, k, E, C, seed);
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

TEST_CASE("layout: build_plan refuses E or k below 1 (errc::input naming both), on the host and on the emulated device") {
  const std::vector<std::int32_t> ids = {0, 1, 1, 0};
  const std::vector<float> w(4, 0.5f);
  const auto refused = [&](auto ex, int k, int E) {
    try {
      (void)epx::layout::build_plan(ex, ids.data(), w.data(), 2, k, E);
    } catch (const epx::error& e) {
      CHECK(e.category() == epx::errc::input);
      return e.message();
    }
    return std::string("no error");
  };
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    const auto call = [&](int k, int E) {
      return i == 0 ? refused(epx::exec::serial{}, k, E) : refused(epx::exec::emulated_device{}, k, E);
    };
    CHECK(call(2, 0) == "build_plan: num_experts (0) and top_k (2) must be at least 1");
    CHECK(call(0, 2) == "build_plan: num_experts (2) and top_k (0) must be at least 1");
    CHECK(call(-1, -4) == "build_plan: num_experts (-4) and top_k (-1) must be at least 1");
  }
}

TEST_CASE("layout: which layout plan the emulated device runs") {
  // Printed for the ctest that names the plan (tests/CMakeLists.txt).
  std::printf("layout plan on exec::emulated_device: %s\n",
              epx::layout::plan_algorithm<epx::exec::emulated_device>());
  CHECK(std::string(epx::layout::plan_algorithm<epx::exec::serial>()) == "counting sort");
#if EPX_HAS_CCCL
  CHECK(std::string(epx::layout::plan_algorithm<epx::exec::emulated_device>()) == "stable sort (Thrust)");
#else
  CHECK(std::string(epx::layout::plan_algorithm<epx::exec::emulated_device>()) == "counting sort");
#endif
}

TEST_CASE("layout: the emulated device's plan is bitwise the host's, bad pairs and capacity drops included, launches in either order") {
  // Random routings with bad ids and non-finite weights sprinkled in: the summary (first
  // bad pair, counts, offsets), every good pair's position and every row of the send
  // order are the host counting sort's; then a capacity drops the same pairs from both.
  // The emulated device calls a launch's functors in reverse index order, or forward: a
  // GPU runs them in any order, so the plan may not depend on it.
  struct order_reset {
    ~order_reset() { epx::exec::emulated_launch_order(epx::exec::emulated_order::reverse); }
  } reset;
  for (const auto order : {epx::exec::emulated_order::reverse, epx::exec::emulated_order::forward}) {
    epx::exec::emulated_launch_order(order);
    const bool forward = order == epx::exec::emulated_order::forward;
    CAPTURE(forward);
    rng g(77);
    for (int trial = 0; trial < 60; ++trial) {
      const int E = 1 + static_cast<int>(g.next() % 40);
      const int k = 1 + static_cast<int>(g.next() % static_cast<std::uint64_t>(std::min(E, 8)));
      const std::size_t N = static_cast<std::size_t>(g.next() % 300);
      auto ids = trial % 3 == 0 ? epx::ref::uneven_routing(N, E, k, g.next()) : epx::ref::random_routing(N, E, k, g.next());
      std::vector<float> w(N * static_cast<std::size_t>(k));
      for (auto& v : w) v = static_cast<float>(g.uniform());
      const int bad = trial % 4;  // 0: none; 1: ids; 2: weights; 3: both
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if ((bad & 1) && g.next() % 50 == 0) ids[i] = g.next() % 2 ? E + static_cast<int>(g.next() % 3) : -1;
        if ((bad & 2) && g.next() % 60 == 0) w[i] = g.next() % 2 ? std::nanf("") : -INFINITY;
      }
      CAPTURE(trial);
      CAPTURE(E);
      CAPTURE(k);
      CAPTURE(N);
      const auto h = epx::layout::build_plan(epx::exec::serial{}, ids.data(), w.data(), N, k, E, 1);
      const auto d = epx::layout::build_plan(epx::exec::emulated_device{}, ids.data(), w.data(), N, k, E);
      CHECK(d.check.kind == h.check.kind);
      CHECK(d.check.pair == h.check.pair);
      CHECK(d.host_counts == h.host_counts);
      CHECK(d.host_offset == h.host_offset);
      // Device-side summary (what the count exchange's record is built from).
      const auto Es = static_cast<std::size_t>(E);
      CHECK(std::vector<std::int64_t>(d.expert_offset(), d.expert_offset() + Es + 1) ==
            std::vector<std::int64_t>(h.expert_offset(), h.expert_offset() + Es + 1));
      CHECK(std::vector<std::int64_t>(d.expert_counts(), d.expert_counts() + Es) ==
            std::vector<std::int64_t>(h.expert_counts(), h.expert_counts() + Es));
      // The first bad pair: the host plan has one chunk; the emulated plan one (Thrust) or
      // several (the counting sort without CCCL), each with its own first bad pair.
      const std::int64_t first_bad_h = h.chunk_bad()[0];
      std::int64_t first_bad_d = -1;
      for (std::size_t c = 0; c < d.chunks; ++c) {
        const std::int64_t b = d.chunk_bad()[c];
        if (b >= 0 && (first_bad_d < 0 || b < first_bad_d)) first_bad_d = b;
      }
      CHECK(first_bad_d == first_bad_h);
      std::int64_t good = 0;
      bool same = true;
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const bool ok = ids[i] >= 0 && ids[i] < E && std::isfinite(w[i]);
        if (ok) same = same && d.pos[i] == h.pos[i];
        good += ok;
      }
      CHECK(same);
      CHECK(std::memcmp(d.src_row.data(), h.src_row.data(), static_cast<std::size_t>(good) * sizeof(std::int64_t)) == 0);
      if (h.check.kind != 0 || N == 0) continue;
      // A local capacity of about half the mean load drops pairs (by position or by score)
      // from both plans: the same positions and rows remain.
      epx::capacity_policy cap;
      cap.mode = epx::capacity_mode::local;
      cap.factor = 0.5;
      cap.priority = trial % 2 ? epx::drop_priority::score : epx::drop_priority::position;
      auto drop = [&](const auto& ex, auto& plan) {
        epx::detail::group_records rec;
        rec.size = 1;
        rec.stride = epx::detail::record_header + Es;
        rec.data.assign(rec.stride, 0);
        rec.data[1] = static_cast<std::int64_t>(N);
        std::copy(plan.host_counts.begin(), plan.host_counts.end(), rec.data.begin() + epx::detail::record_header);
        epx::detail::call_limits lim;
        epx::detail::scatter_with_capacity(cap, ex, rec, 0, 1, E, k, ids.data(), w.data(), plan, lim);
        return lim.dropped;
      };
      auto h2 = epx::layout::build_plan_counts(epx::exec::serial{}, ids.data(), w.data(), N, k, E, 3);
      auto d2 = epx::layout::build_plan_counts(epx::exec::emulated_device{}, ids.data(), w.data(), N, k, E);
      CHECK(drop(epx::exec::serial{}, h2) == drop(epx::exec::emulated_device{}, d2));
      CHECK(std::memcmp(d2.pos.data(), h2.pos.data(), h2.pairs * sizeof(std::int64_t)) == 0);
      CHECK(std::memcmp(d2.src_row.data(), h2.src_row.data(), h2.pairs * sizeof(std::int64_t)) == 0);
    }
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
  // errc::input naming the rank and the range, for a rank past the end, a negative one, or no rank at all.
  for (const auto& bad : {std::make_pair(2, 2), std::make_pair(2, -1), std::make_pair(0, 0)}) {
    CAPTURE(bad.first);
    CAPTURE(bad.second);
    std::string got = "no error";
    try {
      (void)epx::slice_bounds(4, bad.first, bad.second);
    } catch (const epx::error& e) {
      got = e.category() == epx::errc::input ? e.message() : std::string("wrong category");
    }
    CHECK(got == "slice_bounds: tp rank (" + std::to_string(bad.second) + ") out of range [0, " +
                     std::to_string(bad.first) + ")");
  }
}

TEST_CASE("slicing: slice_of_row names the slice holding a row, slice_begin its first row") {
  // Slice t holds rows [floor(N t / tp), floor(N (t+1) / tp)); empty slices hold none.
  for (std::size_t N : {1, 2, 3, 5, 7, 10, 64, 65})
    for (int tp : {1, 2, 3, 4, 6, 8}) {
      CAPTURE(N);
      CAPTURE(tp);
      for (int t = 0; t < tp; ++t) {
        const std::size_t b = N * static_cast<std::size_t>(t) / static_cast<std::size_t>(tp);
        const std::size_t e = N * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(tp);
        CHECK(epx::slice_begin(N, tp, t) == b);
        for (std::size_t r = b; r < e; ++r) {
          CAPTURE(r);
          CHECK(epx::slice_of_row(r, N, tp) == t);
        }
      }
    }
  // 64-bit row counts: the rows on both sides of every slice boundary.
  const std::size_t big = (std::size_t{1} << 40) + 3;
  for (int t = 1; t < 7; ++t) {
    const std::size_t b = big * static_cast<std::size_t>(t) / 7;  // 7 * 2^40 fits in 64 bits
    CHECK(epx::slice_begin(big, 7, t) == b);
    CHECK(epx::slice_of_row(b, big, 7) == t);
    CHECK(epx::slice_of_row(b - 1, big, 7) == t - 1);
  }
}

namespace {
// Runs every kernel of epx/kernels on policy P (whole rows on the host policies, 16-byte
// chunks on the emulated device) and returns what they wrote, concatenated as doubles.
template <class T, class P>
std::vector<double> run_kernels(const P& p, std::size_t n, std::size_t H, int k, const std::vector<std::int64_t>& pos,
                                const std::vector<T>& y, const std::vector<T>& go, const std::vector<float>& w,
                                const std::vector<std::int64_t>& src, const std::vector<float>& scale) {
  const std::size_t S = n * static_cast<std::size_t>(k);
  std::vector<double> all;
  auto put = [&](const auto& v) { for (const auto& e : v) all.push_back(epx::convert<double>(e)); };
  std::vector<T> out(n * H, epx::convert<T>(7.0f));
  epx::kernels::combine(p, n, H, k, y.data(), w.data(), pos.data(), out.data());
  put(out);
  std::vector<const T*> table(S);
  for (std::size_t q = 0; q < S; ++q) table[q] = y.data() + q * H;
  epx::kernels::combine(p, n, H, k, epx::kernels::row_table<T>{table.data()}, w.data(), pos.data(), out.data());
  put(out);
  std::vector<float> gw(S, 9.0f);
  epx::kernels::weight_gradients(p, n, H, k, y.data(), go.data(), pos.data(), gw.data());
  put(gw);
  epx::kernels::reduce(p, n, H, k, y.data(), pos.data(), out.data());
  put(out);
  std::vector<T> dst(src.size() * H, epx::convert<T>(5.0f));
  epx::kernels::gather(p, src.size(), H, go.data(), src.data(), dst.data());
  put(dst);
  epx::kernels::gather(p, src.size(), H, go.data(), src.data(), scale.data(), dst.data());
  put(dst);
  std::vector<const T*> rows(src.size());
  for (std::size_t r = 0; r < src.size(); ++r) rows[r] = src[r] < 0 ? nullptr : go.data() + src[r] * H;
  epx::kernels::copy(p, src.size(), H, rows.data(), scale.data(), dst.data());
  put(dst);
  std::vector<float> ws(S, -1.0f);
  epx::kernels::scatter(p, S, pos.data(), w.data(), ws.data());
  put(ws);
  return all;
}
}  // namespace

TEST_CASE_TEMPLATE("kernels against float64, the same bits on every policy and launch shape", T, float, double,
                   epx::bf16, epx::fp16) {
  rng g(77);
  // H crosses the host's column block (256) and the 16-byte chunks; 4096 is a real size.
  for (std::size_t H : {std::size_t{5}, std::size_t{300}, std::size_t{4096}}) {
    CAPTURE(H);
    const std::size_t n = 9;
    const int k = 3;
    const std::size_t S = n * k;
    // A random permutation as send positions, one slot masked out (-1) per token 4.
    std::vector<std::int64_t> pos(S);
    for (std::size_t i = 0; i < S; ++i) pos[i] = static_cast<std::int64_t>(i);
    for (std::size_t i = S - 1; i > 0; --i)
      std::swap(pos[i], pos[static_cast<std::size_t>(g.below(static_cast<int>(i + 1)))]);
    pos[4 * k + 1] = -1;
    const auto yd = epx::ref::round_through<T>(epx::ref::random_normal(S, H, 5 + H));
    const auto god = epx::ref::round_through<T>(epx::ref::random_normal(n, H, 6 + H));
    const auto wd = epx::ref::round_through<float>(epx::ref::random_weights(n, k, 7, -1.0, 1.0));
    const auto y = epx::ref::from_double<T>(yd);
    const auto go = epx::ref::from_double<T>(god);
    std::vector<float> w(wd.begin(), wd.end());
    const std::vector<std::int64_t> src = {2, -1, 0, 8};
    const std::vector<float> scale = {0.5f, 3.0f, -1.25f, 2.0f};

    const auto host = run_kernels<T>(epx::exec::serial{}, n, H, k, pos, y, go, w, src, scale);
    // The same functors under the other policies and the device launch shape: bitwise equal.
    const auto omp = run_kernels<T>(epx::exec::openmp{2}, n, H, k, pos, y, go, w, src, scale);
    epx::exec::emulated_device dev;
    const auto emu = run_kernels<T>(dev, n, H, k, pos, y, go, w, src, scale);
    CHECK(dev.counters->launches.load() > 0);
    REQUIRE(host.size() == emu.size());
    CHECK(std::memcmp(host.data(), omp.data(), host.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(host.data(), emu.data(), host.size() * sizeof(double)) == 0);

    // Against float64: out, out (table), grad_w, reduce, gather, scaled gather, scaled copy,
    // scatter; each with its rounding bound: a sum of m terms in accum_t (unit roundoff uA)
    // errs by at most m*uA*sum|terms|, and the final rounding to T by uT*|value|.
    const double uA = std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24;
    const double uT = std::is_same_v<T, double> ? 0x1p-53
                      : std::is_same_v<T, float> ? 0x1p-24
                      : std::is_same_v<T, epx::bf16> ? 0x1p-8 : 0x1p-11;
    std::vector<double> comb(n * H, 0.0), red(n * H, 0.0), gw(S, 0.0), comb_abs(n * H, 0.0), red_abs(n * H, 0.0),
        gw_abs(S, 0.0);
    for (std::size_t t = 0; t < n; ++t)
      for (int j = 0; j < k; ++j) {
        const auto p = pos[t * k + j];
        if (p < 0) continue;
        for (std::size_t h = 0; h < H; ++h) {
          comb[t * H + h] += wd[t * k + j] * yd[p * H + h];
          comb_abs[t * H + h] += std::abs(wd[t * k + j] * yd[p * H + h]);
          red[t * H + h] += yd[p * H + h];
          red_abs[t * H + h] += std::abs(yd[p * H + h]);
          gw[t * k + j] += yd[p * H + h] * god[t * H + h];
          gw_abs[t * k + j] += std::abs(yd[p * H + h] * god[t * H + h]);
        }
      }
    std::vector<double> gat(src.size() * H), sgat(src.size() * H);
    for (std::size_t r = 0; r < src.size(); ++r)
      for (std::size_t h = 0; h < H; ++h) {
        gat[r * H + h] = src[r] < 0 ? 0.0 : god[src[r] * H + h];
        sgat[r * H + h] = src[r] < 0 ? 0.0 : scale[r] * god[src[r] * H + h];
      }
    std::vector<double> sc(S, -1.0);
    for (std::size_t i = 0; i < S; ++i)
      if (pos[i] >= 0) sc[static_cast<std::size_t>(pos[i])] = wd[i];
    std::vector<double> want, bound;
    auto expect = [&](const std::vector<double>& v, const std::vector<double>* abs_sum, double terms, double u_out) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        want.push_back(v[i]);
        // fp16 subnormals (below 2^-14) round to a multiple of 2^-24: half of it absolute.
        const double sub = std::is_same_v<T, epx::fp16> && u_out > 0 ? 0x1p-25 : 0.0;
        bound.push_back((abs_sum ? terms * uA * (*abs_sum)[i] : 0.0) + u_out * std::abs(v[i]) + sub);
      }
    };
    expect(comb, &comb_abs, k, uT);
    expect(comb, &comb_abs, k, uT);
    expect(gw, &gw_abs, static_cast<double>(H) / 16 + 16, 0x1p-24);
    expect(red, &red_abs, k, uT);
    expect(gat, nullptr, 0, 0);
    expect(sgat, nullptr, 0, uT + uA);
    expect(sgat, nullptr, 0, uT + uA);
    expect(sc, nullptr, 0, 0);
    REQUIRE(want.size() == host.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (std::abs(host[i] - want[i]) > bound[i] * 1.01 + 1e-300) {
        FAIL_CHECK("kernel output " << i << " = " << host[i] << ", float64 says " << want[i] << ", bound "
                                    << bound[i]);
        break;
      }
    }
  }
}

TEST_CASE("row launches cover every column once, in the policy's shape") {
  for (std::size_t cols : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9}, std::size_t{300}}) {
    const std::size_t rows = 5;
    std::vector<int> hits(rows * cols, 0);
    std::size_t calls = 0, widest = 0;
    auto count = [&](std::size_t r, std::size_t h0, std::size_t h1) {
      ++calls;
      widest = std::max(widest, h1 - h0);
      for (std::size_t h = h0; h < h1; ++h) ++hits[r * cols + h];
    };
    epx::exec::for_each_row<epx::bf16>(epx::exec::serial{}, rows, cols, count);
    CHECK(calls == rows);
    CHECK(widest == cols);
    for (int c : hits) CHECK(c == 1);
    std::fill(hits.begin(), hits.end(), 0);
    calls = widest = 0;
    epx::exec::for_each_row<epx::bf16>(epx::exec::emulated_device{}, rows, cols, count);
    CHECK(calls == rows * ((cols + 7) / 8));  // 16 bytes = 8 bf16
    CHECK(widest == std::min<std::size_t>(cols, 8));
    for (int c : hits) CHECK(c == 1);
  }
}

TEST_CASE("for_each_range calls f once for each index of [first, last) on every policy") {
  const std::size_t n = 40;
  for (const auto& range : {std::pair<std::size_t, std::size_t>{0, 40}, {7, 19}, {39, 40}, {12, 12}, {30, 5}}) {
    // Named variables, not a structured binding: a lambda may capture those only from C++20.
    const std::size_t first = range.first, last = range.second;
    auto covered = [&](auto policy) {
      std::vector<int> hits(n, 0);
      epx::exec::for_each_range(policy, first, last, [&](std::size_t i) { ++hits[i]; });
      for (std::size_t i = 0; i < n; ++i) {
        const int want = i >= first && i < last ? 1 : 0;
        if (hits[i] != want) return false;
      }
      return true;
    };
    CHECK(covered(epx::exec::serial{}));
    CHECK(covered(epx::exec::openmp{1}));
    CHECK(covered(epx::exec::emulated_device{}));
  }
}

TEST_CASE("kernel functors are trivially copyable (device-launchable)") {
  static_assert(std::is_trivially_copyable_v<epx::layout::histogram_chunks>);
  static_assert(std::is_trivially_copyable_v<epx::layout::scan_chunks>);
  static_assert(std::is_trivially_copyable_v<epx::layout::expert_offsets>);
  static_assert(std::is_trivially_copyable_v<epx::layout::scatter_pairs>);
  static_assert(std::is_trivially_copyable_v<epx::layout::masked_positions>);
  static_assert(std::is_trivially_copyable_v<epx::layout::masked_source_rows>);
  static_assert(std::is_trivially_copyable_v<epx::kernels::row_copy<epx::bf16, epx::kernels::indexed_rows<epx::bf16>>>);
  static_assert(std::is_trivially_copyable_v<epx::kernels::row_copy<float, epx::kernels::row_table<float>>>);
  static_assert(std::is_trivially_copyable_v<epx::kernels::row_combine<float, epx::kernels::dense_rows<float>>>);
  static_assert(std::is_trivially_copyable_v<epx::kernels::token_dots<epx::fp16, epx::kernels::row_table<epx::fp16>>>);
  static_assert(std::is_trivially_copyable_v<epx::kernels::value_scatter<float>>);
  CHECK(epx::exec::row_shape_v<epx::exec::serial> == epx::exec::row_shape::whole_rows);
  CHECK(epx::exec::row_shape_v<epx::exec::emulated_device> == epx::exec::row_shape::chunks16);
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

TEST_CASE_TEMPLATE("the lane order of dot products, and scaled copies rounded once", T, float, double, epx::bf16,
                   epx::fp16) {
  using A = epx::accum_t<T>;
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
    std::vector<float> gw(S, 3.0f);
    epx::kernels::weight_gradients(epx::exec::emulated_device{}, n, H, k, y.data(), go.data(), pos.data(), gw.data());
    CHECK(gw[4] == 0.0f);
    // grad_w sums 16 interleaved lanes in h order each, then the lanes in order.
    for (std::size_t i = 0; i < S; ++i) {
      if (pos[i] < 0) continue;
      A lane[16] = {};
      const std::size_t t = i / static_cast<std::size_t>(k);
      for (std::size_t h = 0; h < H; ++h)
        lane[h % 16] += epx::convert<A>(y[static_cast<std::size_t>(pos[i]) * H + h]) * epx::convert<A>(go[t * H + h]);
      A sum = A(0);
      for (A v : lane) sum += v;
      CHECK(gw[i] == static_cast<float>(sum));
    }
    // A scaled copy: scale * row in accum_t, rounded once to T; a null source is a zero row.
    std::vector<const T*> src = {y.data() + 3 * H, nullptr, y.data(), y.data() + 3 * H};
    std::vector<float> sc = {0.5f, 9.0f, -2.0f, 1.0f};
    std::vector<T> sr(src.size() * H, epx::convert<T>(5.0f));
    epx::kernels::copy(epx::exec::emulated_device{}, src.size(), H, src.data(), sc.data(), sr.data());
    for (std::size_t r = 0; r < src.size(); ++r)
      for (std::size_t h = 0; h < H; ++h) {
        const T want = src[r] ? epx::convert<T>(static_cast<A>(sc[r]) * epx::convert<A>(src[r][h])) : epx::convert<T>(0.0f);
        CHECK(std::memcmp(&sr[r * H + h], &want, sizeof(T)) == 0);
      }
  }
}

TEST_CASE("receive layout: every member's segments, offsets and row records from one count matrix") {
  namespace d = epx::detail;
  rng g(123);
  for (int trial = 0; trial < 40; ++trial) {
    const int ep = 1 + g.below(5), L = 1 + g.below(3), E = ep * L;
    const epx::padding pad{g.below(3), 1 + g.below(3)};
    std::vector<std::vector<std::int64_t>> counts(static_cast<std::size_t>(ep), std::vector<std::int64_t>(static_cast<std::size_t>(E)));
    for (auto& c : counts)
      for (auto& v : c) v = g.below(4) == 0 ? 0 : g.below(6);
    const d::receive_layout lay =
        d::make_receive_layout(ep, ep, L, pad, [&](int s) { return counts[static_cast<std::size_t>(s)].data(); });
    // Each member's segments and offsets, recomputed here from the definition.
    std::vector<std::size_t> R(static_cast<std::size_t>(ep)), S(static_cast<std::size_t>(ep));
    for (int me = 0; me < ep; ++me) {
      const auto& mine = counts[static_cast<std::size_t>(me)];
      std::size_t at = 0;
      const d::segments seg = d::segments_of(lay, me);
      for (int e = 0; e < E; ++e) {
        CHECK(seg.send_displs[static_cast<std::size_t>(e)] == at);
        CHECK(seg.send_counts[static_cast<std::size_t>(e)] == static_cast<std::size_t>(mine[static_cast<std::size_t>(e)]));
        at += static_cast<std::size_t>(mine[static_cast<std::size_t>(e)]);
      }
      S[static_cast<std::size_t>(me)] = at;
      CHECK(lay.sent(me) == at);
      std::size_t off = 0;
      for (int l = 0; l < L; ++l) {
        CHECK(lay.offsets(me)[l] == off);
        std::size_t row = off;
        for (int s = 0; s < ep; ++s) {
          const auto c = static_cast<std::size_t>(counts[static_cast<std::size_t>(s)][static_cast<std::size_t>(me * L + l)]);
          CHECK(seg.recv_displs[static_cast<std::size_t>(s * L + l)] == row);
          CHECK(seg.recv_counts[static_cast<std::size_t>(s * L + l)] == c);
          row += c;
        }
        CHECK(lay.received(me)[l] == row - off);
        off += pad.padded_rows(row - off);
      }
      CHECK(lay.rows(me) == off);
      R[static_cast<std::size_t>(me)] = off;
    }
    // received[d][r] = (s, q): row r of d comes from send position q of s; padding stays (-1, -1).
    std::vector<std::vector<std::pair<int, std::size_t>>> received(static_cast<std::size_t>(ep));
    for (int dd = 0; dd < ep; ++dd) {
      auto& v = received[static_cast<std::size_t>(dd)];
      v.assign(R[static_cast<std::size_t>(dd)], {-1, 0});
      d::for_each_received(lay, dd, [&](std::size_t i, int s, std::size_t q) {
        REQUIRE(i < v.size());
        CHECK(v[i].first == -1);  // every row written once
        v[i] = {s, q};
      });
    }
    // Every send position of every member returns from exactly the row it was sent to.
    for (int me = 0; me < ep; ++me) {
      std::vector<int> seen(S[static_cast<std::size_t>(me)], 0);
      d::for_each_returned(lay, me, [&](std::size_t p, int dd, std::size_t r) {
        REQUIRE(p < seen.size());
        ++seen[p];
        REQUIRE(r < received[static_cast<std::size_t>(dd)].size());
        CHECK(received[static_cast<std::size_t>(dd)][r] == std::make_pair(me, p));
      });
      for (int c : seen) CHECK(c == 1);
    }
    // The masked path's layout: one source, the owner's local experts only.
    const int me = g.below(ep);
    const d::receive_layout one =
        d::make_receive_layout(1, ep, L, pad, [&](int) { return counts[static_cast<std::size_t>(me)].data(); });
    std::size_t off = 0;
    for (int l = 0; l < L; ++l) {
      CHECK(one.offsets(me)[l] == off);
      off += pad.padded_rows(static_cast<std::size_t>(counts[static_cast<std::size_t>(me)][static_cast<std::size_t>(me * L + l)]));
    }
    CHECK(one.rows(me) == off);
  }
}

// Per-rank sends (spec section 14): each source's plan of unique rows, and the owner's copy
// table made from what its sources send, against the per-slot layout they replace.
TEST_CASE("per-rank plan: each token once per owner, every kept pair lands on its per-slot row") {
  namespace d = epx::detail;
  rng g(321);
  for (int trial = 0; trial < 60; ++trial) {
    const int ep = 1 + g.below(5), L = 1 + g.below(3), E = ep * L, k = 1 + g.below(std::min(E, 6));
    const epx::padding pad{g.below(3), 1 + g.below(3)};
    const auto K = static_cast<std::size_t>(k);
    // Each source: n tokens, k distinct experts each, some pairs dropped; the per-slot plan
    // is the stable order by expert of its kept pairs (pos -1 for a dropped one).
    std::vector<std::size_t> n(static_cast<std::size_t>(ep));
    std::vector<std::vector<std::int32_t>> ids(static_cast<std::size_t>(ep));
    std::vector<std::vector<float>> w(static_cast<std::size_t>(ep));
    std::vector<std::vector<std::int64_t>> pos(static_cast<std::size_t>(ep));
    std::vector<std::vector<std::int64_t>> counts(static_cast<std::size_t>(ep), std::vector<std::int64_t>(static_cast<std::size_t>(E)));
    std::vector<std::vector<std::size_t>> pair_at(static_cast<std::size_t>(ep));  // send position -> t*k+j
    for (int s = 0; s < ep; ++s) {
      const auto si = static_cast<std::size_t>(s);
      n[si] = static_cast<std::size_t>(g.below(4) == 0 ? 0 : g.below(9));
      for (std::size_t t = 0; t < n[si]; ++t) {
        std::vector<int> all(static_cast<std::size_t>(E));
        for (int e = 0; e < E; ++e) all[static_cast<std::size_t>(e)] = e;
        for (std::size_t j = 0; j < K; ++j) {
          std::swap(all[j], all[j + static_cast<std::size_t>(g.below(E - static_cast<int>(j)))]);
          ids[si].push_back(all[j]);
          w[si].push_back(static_cast<float>(1 + g.below(100)) / 64.0f);
        }
      }
      pos[si].assign(n[si] * K, -1);
      std::int64_t at = 0;
      for (int e = 0; e < E; ++e)
        for (std::size_t i = 0; i < n[si] * K; ++i)
          if (ids[si][i] == e && g.below(5) != 0) {
            pos[si][i] = at++;
            ++counts[si][static_cast<std::size_t>(e)];
            pair_at[si].push_back(i);
          }
    }
    const d::receive_layout lay =
        d::make_receive_layout(ep, ep, L, pad, [&](int s) { return counts[static_cast<std::size_t>(s)].data(); });
    std::vector<d::per_rank_plan> plans;
    for (int s = 0; s < ep; ++s) {
      const auto si = static_cast<std::size_t>(s);
      plans.push_back(d::make_per_rank_plan(lay, s, n[si], k, pos[si].data(), w[si].data()));
      const auto& p = plans.back();
      // Unique rows per owner: the tokens with a kept slot there, in token order; first and
      // pair name them.
      for (int o = 0; o < ep; ++o) {
        std::vector<std::int64_t> want;
        for (std::size_t t = 0; t < n[si]; ++t) {
          bool there = false;
          for (std::size_t j = 0; j < K; ++j)
            there = there || (pos[si][t * K + j] >= 0 && ids[si][t * K + j] / L == o);
          if (there) want.push_back(static_cast<std::int64_t>(t));
        }
        const auto oi = static_cast<std::size_t>(o);
        REQUIRE(p.send_rows[oi] == want.size());
        for (std::size_t u = 0; u < want.size(); ++u) CHECK(p.src_row[p.send_offsets[oi] + u] == want[u]);
      }
      for (std::size_t t = 0; t < n[si]; ++t)
        for (std::size_t j = 0; j < K; ++j) {
          const std::size_t i = t * K + j;
          if (pos[si][i] < 0) {
            CHECK(p.first[i] == -1);
            CHECK(p.pair[i] == -1);
            continue;
          }
          const int o = ids[si][i] / L;
          bool earlier = false;
          for (std::size_t jj = 0; jj < j; ++jj)
            earlier = earlier || (pos[si][t * K + jj] >= 0 && ids[si][t * K + jj] / L == o);
          REQUIRE(p.pair[i] >= 0);
          const auto u = static_cast<std::size_t>(p.pair[i]) / K;
          CHECK(static_cast<std::size_t>(p.pair[i]) % K == j);
          CHECK(p.src_row[u] == static_cast<std::int64_t>(t));
          CHECK(u >= p.send_offsets[static_cast<std::size_t>(o)]);
          CHECK(u < p.send_offsets[static_cast<std::size_t>(o)] + p.send_rows[static_cast<std::size_t>(o)]);
          CHECK(p.first[i] == (earlier ? -1 : static_cast<std::int64_t>(u)));
        }
    }
    // Each owner: its sources' entries in source order, then the copy table.
    for (int o = 0; o < ep; ++o) {
      const auto oi = static_cast<std::size_t>(o);
      std::vector<std::int64_t> slot_row;
      std::vector<float> slot_weight;
      std::vector<std::size_t> first_of(static_cast<std::size_t>(ep));  // first received row of source s
      std::size_t received = 0;
      for (int s = 0; s < ep; ++s) {
        const auto& p = plans[static_cast<std::size_t>(s)];
        first_of[static_cast<std::size_t>(s)] = received;
        const std::size_t b = p.send_offsets[oi] * K, e = b + p.send_rows[oi] * K;
        slot_row.insert(slot_row.end(), p.slot_row.begin() + static_cast<std::ptrdiff_t>(b),
                        p.slot_row.begin() + static_cast<std::ptrdiff_t>(e));
        slot_weight.insert(slot_weight.end(), p.slot_weight.begin() + static_cast<std::ptrdiff_t>(b),
                           p.slot_weight.begin() + static_cast<std::ptrdiff_t>(e));
        received += p.send_rows[oi];
      }
      const std::size_t R = lay.rows(o);
      std::vector<std::int64_t> from(R, 99);
      std::vector<float> weight(R, 99.0f);
      d::receive_rows(received, k, slot_row.data(), slot_weight.data(), R, from.data(), weight.data());
      std::vector<int> named(R, 0);
      d::for_each_received(lay, o, [&](std::size_t r, int s, std::size_t q) {
        const auto si = static_cast<std::size_t>(s);
        const std::size_t i = pair_at[si][q];  // the pair (t, j) the per-slot mode sends to row r
        const auto& p = plans[si];
        ++named[r];
        REQUIRE(from[r] >= static_cast<std::int64_t>(first_of[si]));
        const std::size_t u = static_cast<std::size_t>(from[r]) - first_of[si] + p.send_offsets[oi];
        CHECK(p.src_row[u] == static_cast<std::int64_t>(i / K));
        CHECK(weight[r] == w[si][i]);
      });
      for (std::size_t r = 0; r < R; ++r)
        if (named[r] == 0) {
          CHECK(from[r] == -1);  // padding
          CHECK(weight[r] == 0.0f);
        }
    }
  }
}

}  // namespace test_layout_cpp
