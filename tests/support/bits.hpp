// Test support: the bits of a float or double and back (std::memcpy: C++17 has no
// std::bit_cast). One definition for the host tests and the nvcc ones (tests/cuda).
#pragma once

#include <cstdint>
#include <cstring>

namespace epx::test {

// The bits of `from` as a `To` of the same size.
template <class To, class From>
To same_bits(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

inline std::uint32_t bits_of(float f) { return same_bits<std::uint32_t>(f); }
inline std::uint64_t bits_of(double d) { return same_bits<std::uint64_t>(d); }
inline float float_of(std::uint32_t u) { return same_bits<float>(u); }
inline double double_of(std::uint64_t u) { return same_bits<double>(u); }

}  // namespace epx::test
