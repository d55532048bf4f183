// The host versions of the row loops (epx/exec/host_isa.hpp): every version this CPU runs
// gives the bits of a scalar model written here from the kernels' contracts (each product
// and each sum rounded on its own, slot order, lanes of the dot product), for every element
// type, at hidden sizes with and without a tail, in the host and the device launch shape
// (exec::emulated_device); and the choice of version itself.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/host_isa.hpp"
#include "epx/kernels/fp8.hpp"
#include "epx/kernels/launch.hpp"
#include "support/host_isa.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_host_isa_cpp {

namespace {

using epx::test::for_each_host_isa;

using epx::exec::host_isa;

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The models: one rounding per operation, in accum_t<T>, in the kernels' order. Each product
// is a call of its own, so that no build of this file (test_core_test_host_isa_fma: for
// AVX2 and FMA) fuses it with the sum that follows.
template <class A>
#if defined(__GNUC__) || defined(__clang__)
__attribute__((noinline))
#endif
A product(A a, A b) {
  return a * b;
}

template <class T>
std::vector<T> model_combine(std::size_t n, std::size_t H, std::size_t k, const std::vector<T>& y,
                             const float* w, const std::vector<std::int64_t>& pos) {
  using A = epx::accum_t<T>;
  std::vector<T> out(n * H);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t h = 0; h < H; ++h) {
      A acc = A(0);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int64_t p = pos[t * k + j];
        if (p < 0) continue;
        const A prod = product(w ? static_cast<A>(w[t * k + j]) : A(1), epx::convert<A>(y[static_cast<std::size_t>(p) * H + h]));
        acc = acc + prod;
      }
      out[t * H + h] = epx::convert<T>(acc);
    }
  return out;
}

template <class T>
std::vector<T> model_scaled_gather(std::size_t rows, std::size_t H, const std::vector<T>& x,
                                   const std::vector<std::int64_t>& index, const std::vector<float>& scale) {
  using A = epx::accum_t<T>;
  std::vector<T> out(rows * H);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t h = 0; h < H; ++h)
      out[r * H + h] = index[r] < 0 ? epx::convert<T>(0.0f)
                                    : epx::convert<T>(static_cast<A>(scale[r]) *
                                                      epx::convert<A>(x[static_cast<std::size_t>(index[r]) * H + h]));
  return out;
}

template <class T>
std::vector<float> model_dots(std::size_t n, std::size_t H, std::size_t k, const std::vector<T>& y,
                              const std::vector<T>& g, const std::vector<std::int64_t>& pos) {
  using A = epx::accum_t<T>;
  constexpr std::size_t L = 16;  // docs/semantics.md and docs/guarantees.md: 16 interleaved lanes
  std::vector<float> out(n * k);
  for (std::size_t i = 0; i < n * k; ++i) {
    if (pos[i] < 0) {
      out[i] = 0.0f;
      continue;
    }
    A lane[L] = {};
    for (std::size_t h = 0; h < H; ++h) {
      const A prod = product(epx::convert<A>(y[static_cast<std::size_t>(pos[i]) * H + h]), epx::convert<A>(g[(i / k) * H + h]));
      lane[h % L] = lane[h % L] + prod;
    }
    A s = A(0);
    for (std::size_t w = 0; w < L; ++w) s += lane[w];
    out[i] = static_cast<float>(s);
  }
  return out;
}

template <class T>
void check_row_loops(std::size_t H, std::size_t k) {
  CAPTURE(H);
  CAPTURE(k);
  const std::size_t n = 9, R = 23;
  epx::ref::rng g(H * 31 + sizeof(T));
  std::vector<T> y(R * H), x(n * H), grad(n * H);
  for (auto& v : y) v = epx::convert<T>(g.normal());
  for (auto& v : x) v = epx::convert<T>(g.normal() * 3);
  for (auto& v : grad) v = epx::convert<T>(g.normal());
  std::vector<float> w(n * k), scale(R);
  for (auto& v : w) v = static_cast<float>(g.uniform(-1, 1));
  for (auto& v : scale) v = static_cast<float>(g.uniform(-2, 2));
  std::vector<std::int64_t> pos(n * k), index(R);
  for (std::size_t i = 0; i < n * k; ++i) pos[i] = i % 7 == 3 ? -1 : static_cast<std::int64_t>(g.next() % R);
  for (std::size_t r = 0; r < R; ++r) index[r] = r % 5 == 1 ? -1 : static_cast<std::int64_t>(g.next() % n);

  const auto want_combine = model_combine(n, H, k, y, w.data(), pos);
  const auto want_reduce = model_combine<T>(n, H, k, y, nullptr, pos);
  const auto want_gather = model_scaled_gather(R, H, x, index, scale);
  const auto want_dots = model_dots(n, H, k, y, grad, pos);
  const auto run = [&](const auto& ex) {
    std::vector<T> out(n * H), red(n * H), gat(R * H);
    std::vector<float> dots(n * k);
    epx::kernels::combine(ex, n, H, static_cast<int>(k), y.data(), w.data(), pos.data(), out.data());
    epx::kernels::reduce(ex, n, H, static_cast<int>(k), y.data(), pos.data(), red.data());
    epx::kernels::gather(ex, R, H, x.data(), index.data(), scale.data(), gat.data());
    epx::kernels::weight_gradients(ex, n, H, static_cast<int>(k), y.data(), grad.data(), pos.data(), dots.data());
    // y through a table of rows: the direct route's shape.
    std::vector<const T*> table(R);
    for (std::size_t r = 0; r < R; ++r) table[r] = y.data() + r * H;
    std::vector<float> table_dots(n * k);
    epx::kernels::weight_gradients(ex, n, H, static_cast<int>(k), epx::kernels::row_table<T>{table.data()}, grad.data(),
                                   pos.data(), table_dots.data());
    CHECK(same_bits(table_dots, want_dots));
    CHECK(same_bits(out, want_combine));
    CHECK(same_bits(red, want_reduce));
    CHECK(same_bits(gat, want_gather));
    CHECK(same_bits(dots, want_dots));
  };
  for_each_host_isa([&] {
    run(epx::exec::serial{});
    // The device launch shape on the host: 16-byte chunks, the dot product a call per lane.
    run(epx::exec::emulated_device{});
  });
}

TEST_CASE_TEMPLATE("host versions: combine, reduce, scaled gather and weight gradients give the model's bits", T, float,
                   double, epx::bf16, epx::fp16) {
  for (std::size_t H : {std::size_t{16}, std::size_t{300}, std::size_t{4096}, std::size_t{7168 + 5}})
    for (std::size_t k : {std::size_t{4}, std::size_t{9}, std::size_t{15}}) check_row_loops<T>(H, k);
}

TEST_CASE_TEMPLATE("host versions: FP8 dequantisation gives the model's bits", T, float, double, epx::bf16, epx::fp16) {
  const std::size_t rows = 5, H = 3 * 128;
  epx::ref::rng g(7);
  std::vector<epx::fp8_e4m3> q(rows * H);
  std::vector<float> scale(rows * 3);
  for (auto& v : q) v = epx::fp8_e4m3::from_bits(static_cast<std::uint8_t>(g.next()));
  for (auto& v : scale) v = static_cast<float>(g.uniform(1e-3, 10));
  using A = epx::accum_t<T>;
  std::vector<T> want(rows * H);
  for (std::size_t i = 0; i < rows * H; ++i)
    want[i] = epx::convert<T>(product(static_cast<A>(static_cast<float>(q[i])), static_cast<A>(scale[i / 128])));
  for_each_host_isa([&] {
    std::vector<T> out(rows * H);
    epx::kernels::dequantise_e4m3(epx::exec::serial{}, rows, H, q.data(), scale.data(), out.data());
    CHECK(same_bits(out, want));
  });
}

TEST_CASE("host_isa: the widest supported version is active, an unsupported one is refused") {
  const host_isa active = epx::exec::active_host_isa();
  CHECK(epx::exec::host_isa_supported(host_isa::baseline));
  CHECK(epx::exec::host_isa_supported(active));
  if (epx::exec::host_isa_supported(host_isa::avx512))
    CHECK(active == host_isa::avx512);
  else if (epx::exec::host_isa_supported(host_isa::avx2))
    CHECK(active == host_isa::avx2);
  else
    CHECK(active == host_isa::baseline);
  MESSAGE("host vector instructions: " << std::string(epx::exec::to_string(active)));
  try {
    epx::exec::use_host_isa(static_cast<host_isa>(7));
    FAIL("an unknown instruction set was accepted");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::input);
    CHECK(e.message().find("does not support unknown (7)") != std::string::npos);
  }
  CHECK(epx::exec::active_host_isa() == active);
  CHECK(epx::exec::use_host_isa(host_isa::baseline) == active);
  CHECK(epx::exec::active_host_isa() == host_isa::baseline);
  epx::exec::use_host_isa(active);
}

}  // namespace

}  // namespace test_host_isa_cpp
