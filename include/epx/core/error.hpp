// epx/core/error.hpp: the single exception type of the library.
//
// Every validation and every failing backend call raises `epx::error`, which carries a
// category, the backend status code (cudaError_t, ncclResult_t, MPI error code; 0 where
// none applies), a message naming the offending values and the source location.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace epx {

enum class errc : std::uint8_t {
  configuration,  // a mesh or policy that cannot work (sizes, divisibility, composition)
  input,          // tensors handed to a call: shapes, expert ids, non-finite values
  communicator,   // a collective that failed: a peer raised, timed out or disagreed
  cuda,           // a CUDA runtime call failed
  nccl,           // an NCCL call failed
  mpi,            // an MPI call failed
  internal,       // a broken invariant inside epx (please report)
};

inline const char* to_string(errc c) noexcept {
  switch (c) {
    case errc::configuration: return "configuration";
    case errc::input: return "input";
    case errc::communicator: return "communicator";
    case errc::cuda: return "cuda";
    case errc::nccl: return "nccl";
    case errc::mpi: return "mpi";
    case errc::internal: return "internal";
  }
  return "unknown";
}

struct source_location {
  const char* file = "";
  int line = 0;
  const char* function = "";
};

class error : public std::runtime_error {
 public:
  error(errc category, const std::string& message, source_location where = {}, long status = 0)
      : std::runtime_error(format(category, message, where)),
        category_(category),
        message_(message),
        where_(where),
        status_(status) {}

  errc category() const noexcept { return category_; }
  // The message alone, without the "epx <category> error" prefix and location.
  const std::string& message() const noexcept { return message_; }
  const source_location& where() const noexcept { return where_; }
  // Backend status code (cudaError_t, ncclResult_t, MPI error class), 0 if none.
  long status() const noexcept { return status_; }

 private:
  static std::string format(errc c, const std::string& m, const source_location& w) {
    std::string s = "epx ";
    s += to_string(c);
    s += " error: ";
    s += m;
    if (w.file != nullptr && w.file[0] != '\0') {
      s += " [";
      s += w.file;
      s += ':';
      s += std::to_string(w.line);
      s += ']';
    }
    return s;
  }

  errc category_;
  std::string message_;
  source_location where_;
  long status_;
};

namespace detail {

template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

}  // namespace detail
}  // namespace epx

#define EPX_HERE (::epx::source_location{__FILE__, __LINE__, __func__})

// EPX_THROW(errc::input, "expert id (", id, ") out of range [0, ", E, ")")
#define EPX_THROW(category, ...) \
  throw ::epx::error((category), ::epx::detail::concat(__VA_ARGS__), EPX_HERE)

// EPX_REQUIRE(cond, errc::configuration, "message parts", ...)
#define EPX_REQUIRE(cond, category, ...)        \
  do {                                          \
    if (!(cond)) EPX_THROW(category, __VA_ARGS__); \
  } while (0)
