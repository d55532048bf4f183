// epx/exec/policy.hpp: the execution policy concept, checked with one sentence per part.
//
// An execution policy P (exec::serial, exec::openmp, exec::cuda, ...) provides, in namespace
// epx::exec (found by argument-dependent lookup):
//   for_each_n(const P&, std::size_t n, F f)         f(i) for i in [0, n)
//   buffer<T, P> (buffer_for<T, P>::type)            n elements in the policy's memory
//   make_buffer<T>(const P&, std::size_t n)          one such buffer
//   copy_n(const P&, const T* src, std::size_t n, T* dst), fill_zero(const P&, T* dst, std::size_t n)
//   synchronize(const P&)                            waits for the policy's queued work
// and, optionally, is_host_policy<P> (host memory, no queue), host_addressable<P> (the
// host may read and write the policy's memory, as with the emulated device: host
// communicators then take its buffers) or row_shape_of<P>.
//
//   static_assert(epx::exec::check_execution_policy<P>());   // names the missing part
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "epx/core/config.hpp"
#include "epx/exec/host.hpp"

namespace epx::exec {
namespace detail {

struct probe_functor {
  EPX_HOST_DEVICE void operator()(std::size_t) const noexcept {}
};

template <class P, class = void>
struct has_for_each_n : std::false_type {};
template <class P>
struct has_for_each_n<P, std::void_t<decltype(for_each_n(std::declval<const P&>(), std::size_t{}, probe_functor{}))>>
    : std::true_type {};

template <class P, class = void>
struct has_buffer : std::false_type {};
template <class P>
struct has_buffer<P, std::void_t<decltype(std::declval<typename buffer_for<float, P>::type&>().data())>>
    : std::true_type {};

template <class P, class = void>
struct has_make_buffer : std::false_type {};
template <class P>
struct has_make_buffer<P, std::void_t<decltype(make_buffer<float>(std::declval<const P&>(), std::size_t{}))>>
    : std::true_type {};

template <class P, class = void>
struct has_copy_n : std::false_type {};
template <class P>
struct has_copy_n<P, std::void_t<decltype(copy_n(std::declval<const P&>(), std::declval<const float*>(), std::size_t{},
                                                 std::declval<float*>()))>> : std::true_type {};

template <class P, class = void>
struct has_fill_zero : std::false_type {};
template <class P>
struct has_fill_zero<P, std::void_t<decltype(fill_zero(std::declval<const P&>(), std::declval<float*>(), std::size_t{}))>>
    : std::true_type {};

template <class P, class = void>
struct has_synchronize : std::false_type {};
template <class P>
struct has_synchronize<P, std::void_t<decltype(synchronize(std::declval<const P&>()))>> : std::true_type {};

}  // namespace detail

template <class P>
inline constexpr bool is_execution_policy_v =
    detail::has_for_each_n<P>::value && detail::has_buffer<P>::value && detail::has_make_buffer<P>::value &&
    detail::has_copy_n<P>::value && detail::has_fill_zero<P>::value && detail::has_synchronize<P>::value;

// One static_assert per part, so a failing policy is named with what it lacks.
template <class P>
constexpr bool check_execution_policy() {
  static_assert(detail::has_for_each_n<P>::value,
                "epx: the execution policy needs `void epx::exec::for_each_n(const P&, std::size_t n, F f)` "
                "(see epx/exec/policy.hpp)");
  static_assert(detail::has_buffer<P>::value,
                "epx: the execution policy needs `epx::exec::buffer_for<T, P>::type`, a buffer with data() "
                "(see epx/exec/policy.hpp)");
  static_assert(detail::has_make_buffer<P>::value,
                "epx: the execution policy needs `buffer<T, P> epx::exec::make_buffer<T>(const P&, std::size_t n)` "
                "(see epx/exec/policy.hpp)");
  static_assert(detail::has_copy_n<P>::value,
                "epx: the execution policy needs `void epx::exec::copy_n(const P&, const T* src, std::size_t n, T* dst)` "
                "(see epx/exec/policy.hpp)");
  static_assert(detail::has_fill_zero<P>::value,
                "epx: the execution policy needs `void epx::exec::fill_zero(const P&, T* dst, std::size_t n)` "
                "(see epx/exec/policy.hpp)");
  static_assert(detail::has_synchronize<P>::value,
                "epx: the execution policy needs `void epx::exec::synchronize(const P&)` (see epx/exec/policy.hpp)");
  return is_execution_policy_v<P>;
}

}  // namespace epx::exec
