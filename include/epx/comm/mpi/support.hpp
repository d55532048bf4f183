// epx/comm/mpi/support.hpp: MPI call checking, datatype mapping and the local block
// reduction of the MPI backend. Needs <mpi.h>; included by the epx/comm/mpi/ headers.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epx/comm/datatype.hpp"
#include "epx/comm/detail/reduce.hpp"
#include "epx/core/error.hpp"

namespace epx::detail {

// MPI's description of an error code, e.g. "MPI_ERR_TRUNCATE: message truncated".
inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<std::size_t>(len));
}

// Turns a failing MPI return code into epx::error(errc::mpi) naming the call, MPI's message
// and the code (also kept as the error's status).
inline void mpi_check(int code, const char* call, source_location where) {
  if (code == MPI_SUCCESS) return;
  int cls = code;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) cls = code;
  throw error(errc::mpi, concat(call, " failed: ", mpi_error_string(code), " (MPI error code ", code,
                                ", class ", cls, ")"),
              where, code);
}

#define EPX_MPI_CHECK(call) ::epx::detail::mpi_check((call), #call, EPX_HERE)
// (EPX_MPI_BOUNDED, a nonblocking call waited for under the watchdog: epx/comm/mpi/wait.hpp.)

// The MPI datatype that moves elements of `t`. The 16-bit float types travel as raw 16-bit
// words: MPI never does arithmetic on them (sums are local, in float).
inline MPI_Datatype mpi_type(datatype t) {
  switch (t) {
    case datatype::int32: return MPI_INT32_T;
    case datatype::int64: return MPI_INT64_T;
    case datatype::float32: return MPI_FLOAT;
    case datatype::float64: return MPI_DOUBLE;
    case datatype::bfloat16: return MPI_UINT16_T;
    case datatype::float16: return MPI_UINT16_T;
    case datatype::byte: return MPI_BYTE;
  }
  EPX_THROW(errc::input, "datatype ", static_cast<int>(t), " is none of epx::datatype's");
}

// Derived datatypes of one call, freed when the list goes out of scope (also while unwinding).
class mpi_type_list {
 public:
  explicit mpi_type_list(std::size_t n) : types_(n, MPI_DATATYPE_NULL) {}
  mpi_type_list(const mpi_type_list&) = delete;
  mpi_type_list& operator=(const mpi_type_list&) = delete;
  ~mpi_type_list() {
    for (MPI_Datatype& t : types_)
      if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  }
  MPI_Datatype& operator[](std::size_t i) noexcept { return types_[i]; }
  MPI_Datatype* data() noexcept { return types_.data(); }

 private:
  std::vector<MPI_Datatype> types_;
};

// out[i] = round(scale * sum over r of blocks[r][i]) for blocks [n, count], summed in rank
// order by the rule shared with every host backend (epx/comm/detail/reduce.hpp).
inline void mpi_reduce_blocks(const void* blocks, int n, std::size_t count, void* out, datatype t,
                              double scale) {
  std::vector<const void*> srcs(static_cast<std::size_t>(n));
  const auto* b = static_cast<const unsigned char*>(blocks);
  for (int r = 0; r < n; ++r) srcs[static_cast<std::size_t>(r)] = b + static_cast<std::size_t>(r) * count * size_of(t);
  reduce_sum(t, srcs.data(), n, out, count, scale);
}

}  // namespace epx::detail
