// The CUDA execution policy: for_each_n, device_buffer, copies, fill_zero, errors; and the
// library's EPX_HOST_DEVICE functors (epx/kernels) run on the device against the host policy and a
// float64 reference. Needs a GPU (label cuda).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/comm/detail/reduce.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/cuda.cuh"
#include "epx/exec/host.hpp"

#include "epx/kernels/launch.hpp"
#include "epx/layout/plan.hpp"

using namespace epx::test::cuda;

namespace {

struct affine_index {
  const float* x;
  float* y;
  float a;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { y[i] = a * x[i] + static_cast<float>(i % 7u); }
};

struct index_bytes {
  unsigned char* out;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = static_cast<unsigned char>((i * 31u) % 251u); }
};

}  // namespace

TEST_CASE("exec::cuda for_each_n runs the host functor on the device") {
  test_stream ts;
  const auto dev = ts.policy();
  std::mt19937 rng(101);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{257},
                        std::size_t{(1u << 20) + 3u}}) {
    CAPTURE(n);
    std::vector<float> x(n), y_host(n, -1.0f);
    for (auto& v : x) v = u(rng);
    epx::exec::for_each_n(epx::exec::serial{}, n, affine_index{x.data(), y_host.data(), 1.75f});
    auto dx = to_device(dev, x);
    device_buffer<float> dy(n, dev);
    epx::exec::fill_zero(dev, dy.data(), n);
    epx::exec::for_each_n(dev, n, affine_index{dx.data(), dy.data(), 1.75f});
    const auto y = to_host(dev, dy.data(), n);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double ref = 1.75 * static_cast<double>(x[i]) + static_cast<double>(i % 7u);
      // The device may contract a*x+b into one FMA: equal to the host within one rounding.
      if (std::fabs(y[i] - ref) > 1e-6 * (1.0 + std::fabs(ref)) || std::fabs(y[i] - y_host[i]) > 1e-6f * (1.0f + std::fabs(y_host[i])))
        ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("exec::cuda for_each_n covers more indices than one grid (grid-stride loop)") {
  test_stream ts;
  const auto dev = ts.policy();
  // More than for_each_max_blocks * for_each_block indices: every index is visited once.
  const std::size_t n = epx::exec::detail::for_each_max_blocks * epx::exec::detail::for_each_block + 12345u;
  device_buffer<unsigned char> d(n, dev);
  epx::exec::fill_zero(dev, d.data(), n);
  epx::exec::for_each_n(dev, n, index_bytes{d.data()});
  const auto h = to_host(dev, d.data(), n);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += h[i] != static_cast<unsigned char>((i * 31u) % 251u);
  CHECK(bad == 0);
}

namespace {

// rank_order_sum launched on the device against reduce_sum on the host: the same bits.
template <class T>
void check_rank_order_sum(const epx::exec::cuda& dev, int P, std::size_t count, double scale) {
  CAPTURE(P);
  CAPTURE(count);
  CAPTURE(scale);
  std::mt19937 rng(7u + static_cast<unsigned>(P));
  std::uniform_real_distribution<double> u(-1000.0, 1000.0);
  std::vector<T> all(static_cast<std::size_t>(P) * count);
  for (auto& v : all) v = epx::convert<T>(u(rng));
  std::vector<const void*> srcs;
  for (int r = 0; r < P; ++r) srcs.push_back(all.data() + static_cast<std::size_t>(r) * count);
  std::vector<T> want(count);
  epx::detail::reduce_sum(epx::datatype_of<T>(), srcs.data(), P, want.data(), count, scale);
  auto d_all = to_device(dev, all);
  device_buffer<T> d_out(count, dev);
  epx::exec::for_each_n(dev, count, epx::detail::rank_order_sum<T>{d_all.data(), count, P, scale, d_out.data()});
  CHECK(same_bits(to_host(dev, d_out.data(), count), want));
}

}  // namespace

TEST_CASE_TEMPLATE("rank_order_sum on the device gives reduce_sum's bits", T, std::int32_t, std::int64_t, float,
                   double, epx::bf16, epx::fp16) {
  test_stream ts;
  for (int P : {1, 3, 8})
    for (double scale : {1.0, 1.0 / 3.0}) check_rank_order_sum<T>(ts.policy(), P, 4099, scale);
}

TEST_CASE("device_buffer: allocation, move, reserve_discard, copies in every direction, fill_zero") {
  test_stream ts;
  const auto dev = ts.policy();
  std::vector<std::int64_t> a(1000);
  std::iota(a.begin(), a.end(), -500);

  device_buffer<std::int64_t> b0;
  CHECK(b0.size() == 0);
  CHECK(b0.data() == nullptr);

  auto b = epx::exec::make_buffer<std::int64_t>(dev, a.size());
  REQUIRE(b.size() == a.size());
  REQUIRE(b.data() != nullptr);
  epx::exec::copy_from_host(dev, a.data(), a.size(), b.data());        // host -> device
  device_buffer<std::int64_t> c(a.size());                              // cudaMalloc
  epx::exec::copy_n(dev, b.data(), a.size(), c.data());                 // device -> device
  CHECK(same_bits(to_host(dev, c.data(), a.size()), a));               // device -> host

  // Move: the source is empty afterwards, the target owns the memory.
  std::int64_t* raw = c.data();
  device_buffer<std::int64_t> m(std::move(c));
  CHECK(c.data() == nullptr);
  CHECK(m.data() == raw);
  CHECK(same_bits(to_host(dev, m.data(), a.size()), a));
  b = std::move(m);
  CHECK(b.data() == raw);

  // fill_zero of a part.
  epx::exec::fill_zero(dev, b.data() + 10, 20);
  auto z = a;
  std::fill(z.begin() + 10, z.begin() + 30, 0);
  CHECK(same_bits(to_host(dev, b.data(), a.size()), z));

  // Growing discards; shrinking keeps the allocation.
  b.reserve_discard(4000);
  CHECK(b.size() == 4000);
  CHECK(b.capacity() >= 4000);
  std::int64_t* grown = b.data();
  b.reserve_discard(10);
  CHECK(b.size() == 10);
  CHECK(b.data() == grown);

  // Zero-length operations are no-ops (null pointers allowed).
  epx::exec::copy_n(dev, static_cast<const std::int64_t*>(nullptr), 0, static_cast<std::int64_t*>(nullptr));
  epx::exec::fill_zero(dev, static_cast<std::int64_t*>(nullptr), 0);
  epx::exec::for_each_n(dev, 0, index_bytes{nullptr});
  epx::exec::synchronize(dev);

  // exec::buffer<T, cuda> is the device buffer.
  static_assert(std::is_same_v<epx::exec::buffer<float, epx::exec::cuda>, device_buffer<float>>);
  static_assert(epx::exec::is_device_policy_v<epx::exec::cuda> && !epx::exec::is_host_policy_v<epx::exec::cuda>);
}

TEST_CASE("CUDA errors become epx::error(errc::cuda) naming the call, the text and the code") {
  try {
    EPX_CUDA_CHECK(cudaSetDevice(-1));
    FAIL("cudaSetDevice(-1) did not raise");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::cuda);
    CHECK(e.status() == static_cast<long>(cudaErrorInvalidDevice));
    const std::string m = e.message();
    CHECK(m.find("cudaSetDevice(-1)") != std::string::npos);
    CHECK(m.find(cudaGetErrorString(cudaErrorInvalidDevice)) != std::string::npos);
    CHECK(m.find("cudaErrorInvalidDevice") != std::string::npos);
  }
  // An impossible allocation: errc::cuda from cudaMalloc(Async); a size that overflows: errc::input.
  test_stream ts;
  try {
    device_buffer<double> huge(std::size_t{1} << 58, ts.policy());
    FAIL("a 2 EiB allocation succeeded");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::cuda);
    CHECK((e.status() == static_cast<long>(cudaErrorMemoryAllocation) ||
           e.status() == static_cast<long>(cudaErrorInvalidValue)));
    CHECK(e.message().find("cudaMalloc") != std::string::npos);
  }
  CHECK_THROWS_AS(device_buffer<double>(~std::size_t{0} / 4), epx::error);
  // The error state was cleared: the next calls work.
  device_buffer<int> ok(16, ts.policy());
  epx::exec::fill_zero(ts.policy(), ok.data(), 16);
  CHECK_NOTHROW(epx::exec::synchronize(ts.policy()));
  CHECK(cudaGetLastError() == cudaSuccess);
}

namespace {

// combine's error against float64, as the host tests bound it (tests/core/sizes_cases.hpp):
// k products w y summed in float (gamma_k of float on the sum S of their magnitudes), the
// sum rounded to T once (u the unit roundoff of T: 2^-24 float, 2^-11 fp16, 2^-8 bf16; eta
// half T's smallest subnormal):
//   |out - ref| <= u |ref| + (1 + u) gamma_k S + eta.
// An fp16 or bf16 sum rounded toward zero instead of to nearest fails it. double: 1e-12
// relative to 1 + |ref|.
template <class T>
double combine_bound(double ref, double S, std::size_t k) {
  if constexpr (std::is_same_v<T, double>) {
    return 1e-12 * (1.0 + std::fabs(ref));
  } else {
    constexpr double u = std::is_same_v<T, float> ? 0x1p-24 : std::is_same_v<T, epx::fp16> ? 0x1p-11 : 0x1p-8;
    constexpr double eta = std::is_same_v<T, float> ? 0x1p-150 : std::is_same_v<T, epx::fp16> ? 0x1p-25 : 0x1p-134;
    constexpr double ua = 0x1p-24;  // float: epx::accum_t of float, bf16 and fp16
    const double gamma_k = static_cast<double>(k) * ua / (1 - static_cast<double>(k) * ua);
    return u * std::fabs(ref) + (1 + u) * gamma_k * S + eta;
  }
}

// Random routing of n tokens x k slots into S = n*k send rows: pos is a permutation of the
// rows (a few slots -1: "not here"), src_row the matching token (a few rows -1: zero rows).
struct routing_case {
  std::size_t n, k, H, S;
  std::vector<std::int64_t> pos, src_row;
  std::vector<float> w;
};

routing_case make_case(std::size_t n, std::size_t k, std::size_t H, unsigned seed) {
  routing_case c{n, k, H, n * k, {}, {}, {}};
  std::mt19937 rng(seed);
  std::vector<std::int64_t> perm(c.S);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.pos = perm;
  c.src_row.assign(c.S, -1);
  for (std::size_t i = 0; i < c.S; ++i) c.src_row[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i / k);
  for (std::size_t i = 0; i < c.S; i += 11) c.pos[i] = -1;
  for (std::size_t i = 3; i < c.S; i += 13) c.src_row[i] = -1;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  c.w.resize(c.S);
  for (auto& v : c.w) v = u(rng);
  return c;
}

template <class T>
std::vector<T> random_rows(std::size_t rows, std::size_t H, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<T> v(rows * H);
  for (auto& e : v) e = epx::convert<T>(u(rng));
  return v;
}

template <class T>
double as_double(T v) {
  return epx::convert<double>(v);
}

}  // namespace

// Every kernel of epx/kernels on the device (16-byte chunks) against the host policy (whole
// rows): the same functors, the same operations per element (multiply-adds are not
// contracted on the device), so the same bits; and against float64.
TEST_CASE_TEMPLATE("kernels on the device give the host policy's bits and match float64", T, float, double,
                   epx::bf16, epx::fp16) {
  test_stream ts;
  const auto dev = ts.policy();
  const epx::exec::serial host{};
  for (const auto& shape : {std::array<std::size_t, 3>{37, 3, 65}, std::array<std::size_t, 3>{256, 8, 128},
                            std::array<std::size_t, 3>{64, 8, 7168}, std::array<std::size_t, 3>{1, 1, 1}}) {
    const std::size_t n = shape[0], k = shape[1], H = shape[2];
    CAPTURE(n);
    CAPTURE(k);
    CAPTURE(H);
    const auto c = make_case(n, k, H, static_cast<unsigned>(7 * n + k));
    const auto x = random_rows<T>(n, H, 11);
    const auto y = random_rows<T>(c.S, H, 12);
    const auto g = random_rows<T>(n, H, 13);
    const int kk = static_cast<int>(k);

    auto d_pos = to_device(dev, c.pos);
    auto d_src = to_device(dev, c.src_row);
    auto d_w = to_device(dev, c.w);
    auto d_x = to_device(dev, x);
    auto d_y = to_device(dev, y);
    auto d_g = to_device(dev, g);

    // gather (plain and scaled).
    std::vector<T> send_h(c.S * H);
    epx::kernels::gather(host, c.S, H, x.data(), c.src_row.data(), send_h.data());
    device_buffer<T> d_send(c.S * H, dev);
    epx::kernels::gather(dev, c.S, H, static_cast<const T*>(d_x.data()), static_cast<const std::int64_t*>(d_src.data()),
                         d_send.data());
    CHECK(same_bits(to_host(dev, d_send.data(), c.S * H), send_h));
    epx::kernels::gather(host, c.S, H, g.data(), c.src_row.data(), c.w.data(), send_h.data());
    epx::kernels::gather(dev, c.S, H, static_cast<const T*>(d_g.data()), static_cast<const std::int64_t*>(d_src.data()),
                         static_cast<const float*>(d_w.data()), d_send.data());
    CHECK(same_bits(to_host(dev, d_send.data(), c.S * H), send_h));

    // combine, and against float64.
    std::vector<T> out_h(n * H);
    epx::kernels::combine(host, n, H, kk, y.data(), c.w.data(), c.pos.data(), out_h.data());
    device_buffer<T> d_out(n * H, dev);
    epx::kernels::combine(dev, n, H, kk, static_cast<const T*>(d_y.data()), static_cast<const float*>(d_w.data()),
                          static_cast<const std::int64_t*>(d_pos.data()), d_out.data());
    const auto out_d = to_host(dev, d_out.data(), n * H);
    CHECK(same_bits(out_d, out_h));
    double err_ref = 0;
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t h = 0; h < H; ++h) {
        double ref = 0, mag = 0;
        for (std::size_t j = 0; j < k; ++j) {
          const auto p = c.pos[t * k + j];
          if (p < 0) continue;
          const double term = static_cast<double>(c.w[t * k + j]) * as_double(y[static_cast<std::size_t>(p) * H + h]);
          ref += term;
          mag += std::fabs(term);
        }
        err_ref = std::max(err_ref, std::fabs(as_double(out_d[t * H + h]) - ref) / combine_bound<T>(ref, mag, k));
      }
    CHECK(err_ref <= 1.0);  // worst error / bound

    // weight gradients (16 lanes, lane order): the host's bits; against float64.
    std::vector<float> gw_h(n * k, -7.0f);
    epx::kernels::weight_gradients(host, n, H, kk, y.data(), g.data(), c.pos.data(), gw_h.data());
    device_buffer<float> d_gw(n * k, dev);
    epx::kernels::weight_gradients(dev, n, H, kk, static_cast<const T*>(d_y.data()), static_cast<const T*>(d_g.data()),
                                   static_cast<const std::int64_t*>(d_pos.data()), d_gw.data());
    const auto gw_d = to_host(dev, d_gw.data(), n * k);
    CHECK(same_bits(gw_d, gw_h));
    double err_gw = 0;
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t j = 0; j < k; ++j) {
        const auto p = c.pos[t * k + j];
        double ref = 0;
        if (p >= 0)
          for (std::size_t h = 0; h < H; ++h)
            ref += as_double(y[static_cast<std::size_t>(p) * H + h]) * as_double(g[t * H + h]);
        const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-4 * std::sqrt(static_cast<double>(H));
        err_gw = std::max(err_gw, std::fabs(gw_d[t * k + j] - ref) / (1.0 + std::fabs(ref)) / tol);
        if (p < 0) CHECK(gw_d[t * k + j] == 0.0f);
      }
    CHECK(err_gw <= 1.0);

    // reduce: sums in slot order: the host's bits.
    std::vector<T> gx_h(n * H);
    epx::kernels::reduce(host, n, H, kk, y.data(), c.pos.data(), gx_h.data());
    device_buffer<T> d_gx(n * H, dev);
    epx::kernels::reduce(dev, n, H, kk, static_cast<const T*>(d_y.data()), static_cast<const std::int64_t*>(d_pos.data()),
                         d_gx.data());
    CHECK(same_bits(to_host(dev, d_gx.data(), n * H), gx_h));

    // scatter of the weights into send order.
    std::vector<float> ws_h(c.S, -1.0f);
    epx::kernels::scatter(host, c.S, c.pos.data(), c.w.data(), ws_h.data());
    device_buffer<float> d_ws(c.S, dev);
    const std::vector<float> minus_one(c.S, -1.0f);
    epx::exec::copy_from_host(dev, minus_one.data(), c.S, d_ws.data());
    epx::exec::synchronize(dev);
    epx::kernels::scatter(dev, c.S, static_cast<const std::int64_t*>(d_pos.data()), static_cast<const float*>(d_w.data()),
                          d_ws.data());
    CHECK(same_bits(to_host(dev, d_ws.data(), c.S), ws_h));
  }
}

TEST_CASE("layout plan on the device equals the host plan (counting sort, bad ids found)") {
  test_stream ts;
  const auto dev = ts.policy();
  for (const auto& shape : {std::array<int, 3>{1000, 2, 8}, std::array<int, 3>{4096, 8, 64},
                            std::array<int, 3>{3, 1, 256}, std::array<int, 3>{0, 2, 4}}) {
    const int n = shape[0], k = shape[1], E = shape[2];
    CAPTURE(n);
    CAPTURE(k);
    CAPTURE(E);
    const std::size_t pairs = static_cast<std::size_t>(n) * static_cast<std::size_t>(k);
    std::mt19937 rng(static_cast<unsigned>(n + 17 * E));
    // Skewed: half the pairs go to expert 0's neighbourhood.
    std::uniform_int_distribution<int> any(0, E - 1), low(0, std::min(E - 1, 2));
    std::vector<std::int32_t> ids(pairs);
    for (std::size_t i = 0; i < pairs; ++i) ids[i] = (i % 2) ? any(rng) : low(rng);
    std::vector<float> w(pairs, 0.5f);
    auto d_ids = to_device(dev, ids);
    auto d_w = to_device(dev, w);
    const auto hp = epx::layout::build_plan(epx::exec::serial{}, ids.data(), w.data(), static_cast<std::size_t>(n), k, E);
    const auto dp = epx::layout::build_plan(dev, d_ids.data(), d_w.data(), static_cast<std::size_t>(n), k, E);
    REQUIRE(hp.check.kind == 0);
    REQUIRE(dp.check.kind == 0);
    CHECK(dp.host_counts == hp.host_counts);
    CHECK(dp.host_offset == hp.host_offset);
    std::vector<std::int64_t> hpos(hp.pos.data(), hp.pos.data() + pairs);
    std::vector<std::int64_t> hsrc(hp.src_row.data(), hp.src_row.data() + pairs);
    CHECK(same_bits(to_host(dev, dp.pos.data(), pairs), hpos));
    CHECK(same_bits(to_host(dev, dp.src_row.data(), pairs), hsrc));
    // Independent check: counts per expert.
    std::vector<std::int64_t> cnt(static_cast<std::size_t>(E), 0);
    for (auto e : ids) ++cnt[static_cast<std::size_t>(e)];
    CHECK(dp.host_counts == cnt);
  }
  // A bad id is found on the device too, naming the first bad pair.
  std::vector<std::int32_t> ids = {0, 1, 2, 3, 9, 1, -1, 0};
  std::vector<float> w(ids.size(), 1.0f);
  auto d_ids = to_device(dev, ids);
  auto d_w = to_device(dev, w);
  const auto dp = epx::layout::build_plan(dev, d_ids.data(), d_w.data(), 4, 2, 4);
  CHECK(dp.check.kind == epx::layout::input_check::bad_expert_id);
  CHECK(dp.check.pair == 4);
  CHECK(dp.check.id == 9);
}

TEST_CASE("layout plan on the device: the Thrust (CUB) plan is the counting sort's, bad pairs included") {
  test_stream ts;
  const auto dev = ts.policy();
  REQUIRE(std::string(epx::layout::plan_algorithm<epx::exec::cuda>()) == "stable sort (Thrust)");
  // 32768 pairs over 256 experts (4096 tokens, top-8), with and without bad pairs.
  const int n = 4096, k = 8, E = 256;
  const std::size_t pairs = static_cast<std::size_t>(n) * k;
  for (int bad : {0, 1}) {
    CAPTURE(bad);
    std::mt19937 rng(static_cast<unsigned>(99 + bad));
    std::uniform_int_distribution<int> any(0, E - 1);
    std::vector<std::int32_t> ids(pairs);
    for (auto& e : ids) e = any(rng);
    std::vector<float> w(pairs, 0.25f);
    if (bad) {
      ids[777] = E;
      w[500] = NAN;
      ids[20000] = -4;
    }
    auto d_ids = to_device(dev, ids);
    auto d_w = to_device(dev, w);
    auto sp = epx::layout::launch_sorted_plan(dev, d_ids.data(), d_w.data(), static_cast<std::size_t>(n), k, E);
    epx::layout::read_plan(dev, sp, d_ids.data(), d_w.data());
    auto cp = epx::layout::launch_counting_plan(dev, d_ids.data(), d_w.data(), static_cast<std::size_t>(n), k, E);
    epx::layout::read_plan(dev, cp, d_ids.data(), d_w.data());
    CHECK(sp.check.kind == cp.check.kind);
    CHECK(sp.check.pair == cp.check.pair);
    CHECK(sp.host_counts == cp.host_counts);
    CHECK(sp.host_offset == cp.host_offset);
    if (bad) {
      CHECK(sp.check.pair == 500);
      continue;
    }
    CHECK(same_bits(to_host(dev, sp.pos.data(), pairs), to_host(dev, cp.pos.data(), pairs)));
    CHECK(same_bits(to_host(dev, sp.src_row.data(), pairs), to_host(dev, cp.src_row.data(), pairs)));
  }
}
