// epx/core/error.hpp: the single exception type of the library.
//
// Every validation and every failing backend call raises `epx::error`, which carries a
// category, the backend status code (cudaError_t, ncclResult_t, MPI error code; 0 where
// none applies), a message naming the offending values and the source location.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <ios>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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
  // Backend status code (cudaError_t, ncclResult_t, MPI error code), 0 if none.
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

// One argument of an error message: its address and the function that writes it to a
// stream. The stream code is compiled once per argument type (put<T>), and the message is
// built and thrown by functions the compiler keeps out of line (raise), so that each of
// the library's many EPX_REQUIRE sites only fills a small array and makes one call. A
// fold over operator<< and the construction of the exception at every site made the
// messages a fifth of the object code of a test file under ASan.
class message_part {
 public:
  template <class T, std::enable_if_t<!std::is_function_v<T> && !std::is_convertible_v<const T&, const char*>, int> = 0>
  message_part(const T& v) noexcept : p_(&v), put_(&put<T>) {}
  message_part(const char* s) noexcept : p_(s), put_(&put_text) {}
  // Stream manipulators such as std::hex and std::dec.
  message_part(std::ios_base& (*m)(std::ios_base&)) noexcept : p_(nullptr), manip_(m), put_(nullptr) {}

  void write(std::ostream& os) const {
    if (put_ != nullptr)
      put_(os, p_);
    else
      os << manip_;
  }

 private:
  template <class T>
  static void put(std::ostream& os, const void* p) {
    os << *static_cast<const T*>(p);
  }
  static void put_text(std::ostream& os, const void* p) { os << static_cast<const char*>(p); }

  const void* p_;
  std::ios_base& (*manip_)(std::ios_base&) = nullptr;
  void (*put_)(std::ostream&, const void*);
};

#if defined(__GNUC__) || defined(__clang__)
#define EPX_DETAIL_COLD __attribute__((noinline, cold))
#else
#define EPX_DETAIL_COLD
#endif

EPX_DETAIL_COLD inline std::string concat_parts(const message_part* parts, std::size_t n) {
  std::ostringstream os;
  for (std::size_t i = 0; i < n; ++i) parts[i].write(os);
  return os.str();
}

// The arguments written one after the other to a stream, as `(os << ... << args)`.
template <class... Args>
std::string concat(const Args&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return std::string();
  } else {
    const message_part parts[] = {message_part(args)...};
    return concat_parts(parts, sizeof...(Args));
  }
}

[[noreturn]] EPX_DETAIL_COLD inline void raise_message(errc category, const source_location& where,
                                                       const std::string& message) {
  throw error(category, message, where);
}

// throw error(category, concat(args...), where), out of line.
template <class... Args>
[[noreturn]] EPX_DETAIL_COLD void raise(errc category, const source_location& where, const Args&... args) {
  raise_message(category, where, concat(args...));
}

// The ranks' messages of a collective error, one entry per distinct message with the ranks
// that report it, in the order of their first rank: "; rank 0,2: <a>; rank 1: <b>".
class rank_messages {
 public:
  void add(long long rank, const std::string& message) {
    std::size_t i = 0;
    while (i < text_.size() && text_[i] != message) ++i;
    if (i == text_.size()) {
      text_.push_back(message);
      ranks_.emplace_back();
    }
    ranks_[i] += (ranks_[i].empty() ? "" : ",") + std::to_string(rank);
  }
  std::string str() const {
    std::string out;
    for (std::size_t i = 0; i < text_.size(); ++i) out += "; rank " + ranks_[i] + ": " + text_[i];
    return out;
  }

 private:
  std::vector<std::string> text_, ranks_;
};

// Message of an in-flight exception: epx::error's message, what() otherwise.
inline std::string describe_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    return x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace detail
}  // namespace epx

#define EPX_HERE (::epx::source_location{__FILE__, __LINE__, __func__})

// EPX_THROW(errc::input, "expert id (", id, ") out of range [0, ", E, ")")
#define EPX_THROW(category, ...) ::epx::detail::raise((category), EPX_HERE, __VA_ARGS__)

// EPX_REQUIRE(cond, errc::configuration, "message parts", ...)
#define EPX_REQUIRE(cond, category, ...)        \
  do {                                          \
    if (!(cond)) EPX_THROW(category, __VA_ARGS__); \
  } while (0)
