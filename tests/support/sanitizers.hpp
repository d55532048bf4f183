// tests/support/sanitizers.hpp: whether the tests run under ThreadSanitizer or
// AddressSanitizer.
//
// TSan checks every byte each thread reads or writes (10-20 times slower), and a race does
// not depend on a row's length: the cases at large hidden sizes take a smaller one there
// (tsan_hidden). The host and ASan builds run them at the size their names give, except
// the bitwise comparisons of tests/core/test_same_bits.cpp, which run every policy, chunk
// count and route of each case: under ASan they take a quarter of the hidden sizes above
// 2048 (asan_hidden), as an access out of a buffer does not depend on a row's length either.
#pragma once

#include <cstddef>

#if defined(__SANITIZE_THREAD__)
#define EPX_TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EPX_TEST_UNDER_TSAN 1
#endif
#endif

#if defined(__SANITIZE_ADDRESS__)
#define EPX_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EPX_TEST_UNDER_ASAN 1
#endif
#endif

namespace epx::test {

#ifdef EPX_TEST_UNDER_TSAN
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif

#ifdef EPX_TEST_UNDER_ASAN
inline constexpr bool under_asan = true;
#else
inline constexpr bool under_asan = false;
#endif

// `full`, or `small` under ThreadSanitizer.
constexpr std::size_t tsan_hidden(std::size_t full, std::size_t small) { return under_tsan ? small : full; }

// `full`, or under AddressSanitizer a quarter of it when it is above 2048 (4096 -> 1024,
// 7168 -> 1792: whole blocks of 128 elements still, as FP8 dispatch needs).
constexpr std::size_t asan_hidden(std::size_t full) { return under_asan && full > 2048 ? full / 4 : full; }

}  // namespace epx::test
