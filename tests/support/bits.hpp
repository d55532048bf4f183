// Test support: the bits of a float or double and back (std::memcpy: C++17 has no
// std::bit_cast). One definition for the host tests and the nvcc ones (tests/cuda).
#pragma once

#include <cstdint>
#include <cstring>

namespace epx::test {

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline std::uint64_t bits_of(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}
inline double double_of(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

}  // namespace epx::test
