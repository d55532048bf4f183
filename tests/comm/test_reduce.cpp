// detail::reduce_sum and detail::scale_in_place: the summation rule shared by the host
// backends, against float64 references; detail::rank_order_sum, the same rule one element
// at a time, against reduce_sum's bits.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "comm/comm_cases.hpp"
#include "epx/comm/detail/reduce.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_reduce_cpp {

namespace {

template <class T>
void check_reduce(int nsrcs, std::size_t count, double scale, bool in_place) {
  CAPTURE(nsrcs);
  CAPTURE(count);
  CAPTURE(scale);
  CAPTURE(in_place);
  std::vector<std::vector<T>> src(static_cast<std::size_t>(nsrcs), std::vector<T>(count));
  std::vector<const void*> ptrs;
  for (int k = 0; k < nsrcs; ++k) {
    for (std::size_t i = 0; i < count; ++i) src[k][i] = comm_cases::value<T>(5, k, 0, i);
    ptrs.push_back(src[k].data());
  }
  // The same sources stacked [nsrcs][count], for rank_order_sum (the element functor that
  // device policies launch), before reduce_sum may overwrite one of them.
  std::vector<T> stacked;
  for (int k = 0; k < nsrcs; ++k) stacked.insert(stacked.end(), src[k].begin(), src[k].end());
  std::vector<T> out(count);
  void* dst = in_place ? static_cast<void*>(src[nsrcs / 2].data()) : out.data();
  epx::detail::reduce_sum(epx::datatype_of<T>(), ptrs.data(), nsrcs, dst, count, scale);
  const T* got = static_cast<const T*>(dst);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_integral_v<T>) {
      std::int64_t exact = 0;
      for (int k = 0; k < nsrcs; ++k) exact += comm_cases::value<T>(5, k, 0, i);
      const T want = scale == 1.0 ? static_cast<T>(exact) : static_cast<T>(std::llround(static_cast<double>(exact) * scale));
      bad += got[i] != want;
    } else {
      double exact = 0, sum_abs = 0;
      for (int k = 0; k < nsrcs; ++k) {
        const double x = comm_cases::to_double(comm_cases::value<T>(5, k, 0, i));
        exact += x;
        sum_abs += std::fabs(x);
      }
      exact *= scale;
      // Summed left to right in the accumulation type, scaled, rounded once.
      using A = epx::accum_t<T>;
      A acc = epx::convert<A>(comm_cases::value<T>(5, 0, 0, i));
      for (int k = 1; k < nsrcs; ++k) acc += epx::convert<A>(comm_cases::value<T>(5, k, 0, i));
      if (scale != 1.0) acc *= static_cast<A>(scale);
      const T rule = epx::convert<T>(acc);
      bad += !comm_cases::same_bits(got[i], rule);
      bad += !(std::fabs(comm_cases::to_double(got[i]) - exact) <=
               comm_cases::sum_tolerance<T>(exact, sum_abs * std::fabs(scale), nsrcs));
    }
  }
  CHECK(bad == 0);
  // rank_order_sum, one call per element (in place: into the first block), gives the same bits.
  std::vector<T> one(count);
  T* one_dst = in_place ? stacked.data() : one.data();
  const epx::detail::rank_order_sum<T> f{stacked.data(), count, nsrcs, scale, one_dst};
  for (std::size_t i = 0; i < count; ++i) f(i);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < count; ++i) differ += !comm_cases::same_bits(one_dst[i], got[i]);
  CHECK(differ == 0);
}

template <class T>
void check_all() {
  for (int nsrcs : {1, 2, 3, 8})
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1023}, std::size_t{1025}, std::size_t{5000}})
      for (double scale : {1.0, 0.125, 1.0 / 3.0})
        for (bool in_place : {false, true}) check_reduce<T>(nsrcs, count, scale, in_place);
}

}  // namespace

TEST_CASE_TEMPLATE("reduce_sum: rank-order sum in the accumulation type, scaled before rounding", T, std::int32_t,
                   std::int64_t, float, double, epx::bf16, epx::fp16) {
  check_all<T>();
}

TEST_CASE("reduce_sum: bf16 accumulates in float, not in bf16") {
  // 256 + 1 + 1 ... : in bf16 (8 bits of mantissa) 256 + 1 rounds back to 256 each time.
  const int n = 9;
  std::vector<epx::bf16> a(1, epx::bf16(256.0f)), one(1, epx::bf16(1.0f));
  std::vector<const void*> ptrs{a.data()};
  for (int k = 1; k < n; ++k) ptrs.push_back(one.data());
  epx::bf16 out;
  epx::detail::reduce_sum(epx::datatype::bfloat16, ptrs.data(), n, &out, 1, 1.0);
  CHECK(static_cast<float>(out) == 264.0f);
  // Scaled before the one rounding: (256 + 8) * 0.5 = 132 exactly.
  epx::detail::reduce_sum(epx::datatype::bfloat16, ptrs.data(), n, &out, 1, 0.5);
  CHECK(static_cast<float>(out) == 132.0f);
}

TEST_CASE("scale_in_place and the byte datatype") {
  std::vector<epx::fp16> h{epx::fp16(3.0f), epx::fp16(-0.5f)};
  epx::detail::scale_in_place(epx::datatype::float16, h.data(), h.size(), 0.25);
  CHECK(static_cast<float>(h[0]) == 0.75f);
  CHECK(static_cast<float>(h[1]) == -0.125f);
  std::vector<std::int32_t> i{7, -9};
  epx::detail::scale_in_place(epx::datatype::int32, i.data(), i.size(), 2.0);
  CHECK(i[0] == 14);
  CHECK(i[1] == -18);
  std::vector<std::byte> b(4);
  const void* src[1] = {b.data()};
  CHECK_THROWS_WITH_AS(epx::detail::reduce_sum(epx::datatype::byte, src, 1, b.data(), 4, 1.0),
                       doctest::Contains("byte cannot be summed"), epx::error);
}

}  // namespace test_reduce_cpp
