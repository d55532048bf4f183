// tests/support/sanitizers.hpp: whether the tests run under ThreadSanitizer.
//
// TSan checks every byte each thread reads or writes (10-20 times slower), and a race does
// not depend on a row's length: the cases at large hidden sizes take a smaller one there
// (tsan_hidden). The host and ASan builds run them at the size their names give.
#pragma once

#include <cstddef>

#if defined(__SANITIZE_THREAD__)
#define EPX_TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EPX_TEST_UNDER_TSAN 1
#endif
#endif

namespace epx::test {

#ifdef EPX_TEST_UNDER_TSAN
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif

// `full`, or `small` under ThreadSanitizer.
constexpr std::size_t tsan_hidden(std::size_t full, std::size_t small) { return under_tsan ? small : full; }

}  // namespace epx::test
