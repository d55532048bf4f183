// epx/comm/datatype.hpp: element types that travel through a communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epx/core/config.hpp"
#include "epx/core/numeric.hpp"

namespace epx {

enum class datatype : std::uint8_t { int32, int64, float32, float64, bfloat16, float16, byte };

inline const char* to_string(datatype t) noexcept {
  switch (t) {
    case datatype::int32: return "int32";
    case datatype::int64: return "int64";
    case datatype::float32: return "float32";
    case datatype::float64: return "float64";
    case datatype::bfloat16: return "bfloat16";
    case datatype::float16: return "float16";
    case datatype::byte: return "byte";
  }
  return "?";
}

EPX_HOST_DEVICE constexpr std::size_t size_of(datatype t) noexcept {
  switch (t) {
    case datatype::int32: return 4;
    case datatype::int64: return 8;
    case datatype::float32: return 4;
    case datatype::float64: return 8;
    case datatype::bfloat16: return 2;
    case datatype::float16: return 2;
    case datatype::byte: return 1;
  }
  return 0;
}

template <class T>
constexpr datatype datatype_of() noexcept {
  if constexpr (std::is_same_v<T, std::int32_t>) return datatype::int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return datatype::int64;
  else if constexpr (std::is_same_v<T, float>) return datatype::float32;
  else if constexpr (std::is_same_v<T, double>) return datatype::float64;
  else if constexpr (std::is_same_v<T, bf16>) return datatype::bfloat16;
  else if constexpr (std::is_same_v<T, fp16>) return datatype::float16;
  else if constexpr (std::is_same_v<T, std::byte> || std::is_same_v<T, unsigned char> ||
                     std::is_same_v<T, char>) return datatype::byte;
  else static_assert(dependent_false<T>, "epx: no communicator datatype for this element type "
                                         "(use int32, int64, float, double, bf16, fp16 or bytes)");
}

// Whether a datatype may be summed (all_reduce / reduce_scatter).
constexpr bool is_reducible(datatype t) noexcept { return t != datatype::byte; }

}  // namespace epx
