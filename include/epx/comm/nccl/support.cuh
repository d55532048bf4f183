// epx/comm/nccl/support.cuh: NCCL call checking, datatype mapping, the device guard and
// group_guard of the NCCL backend (needs nvcc and NCCL >= 2.18).
//
// Every NCCL call is checked (EPX_NCCL_CHECK): epx::error(errc::nccl) naming the call,
// ncclGetErrorString, ncclGetLastError and the ncclResult_t code. Calls on a communicator
// go through its bounded check instead (epx/comm/nccl/wait.cuh), which settles
// ncclInProgress and names the rank.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "epx/comm/datatype.hpp"
#include "epx/core/error.hpp"
#include "epx/exec/cuda.cuh"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0),
              "epx's NCCL backend (epx/comm/nccl/) needs NCCL 2.18 or newer (ncclCommSplit, ncclGetLastError, "
              "ncclRedOpCreatePreMulSum, bfloat16)");

namespace epx::nccl::detail {

inline std::string describe(ncclResult_t r, ncclComm_t c) {
  std::string s = ncclGetErrorString(r);
  s += " (ncclResult_t ";
  s += std::to_string(static_cast<int>(r));
  s += ')';
  const char* last = ncclGetLastError(c);
  if (last != nullptr && last[0] != '\0') {
    s += ": ";
    s += last;
  }
  return s;
}

// Raises epx::error(errc::nccl) for any result but ncclSuccess. ncclInProgress is an error
// here: calls on communicators go through handle::check (epx/comm/nccl/wait.cuh), which
// settles it.
inline void nccl_check(ncclResult_t r, const char* call, source_location where, ncclComm_t c = nullptr) {
  if (r == ncclSuccess) return;
  throw error(errc::nccl, ::epx::detail::concat(call, " failed: ", describe(r, c)), where, static_cast<long>(r));
}

inline ncclDataType_t to_nccl(datatype t) noexcept {
  switch (t) {
    case datatype::int32: return ncclInt32;
    case datatype::int64: return ncclInt64;
    case datatype::float32: return ncclFloat32;
    case datatype::float64: return ncclFloat64;
    case datatype::bfloat16: return ncclBfloat16;
    case datatype::float16: return ncclFloat16;
    case datatype::byte: return ncclUint8;
  }
  return ncclUint8;
}

// Makes `dev` current for the scope (NCCL calls and stream 0 refer to the current device).
class device_guard {
 public:
  explicit device_guard(int dev) {
    EPX_CUDA_CHECK(cudaGetDevice(&prev_));
    if (dev >= 0 && dev != prev_) {
      EPX_CUDA_CHECK(cudaSetDevice(dev));
      restore_ = true;
    }
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (restore_ && cudaSetDevice(prev_) != cudaSuccess) (void)cudaGetLastError();
  }

 private:
  int prev_ = 0;
  bool restore_ = false;
};

}  // namespace epx::nccl::detail

// EPX_NCCL_CHECK(ncclGroupStart());  for calls without a communicator at hand.
#define EPX_NCCL_CHECK(...) ::epx::nccl::detail::nccl_check((__VA_ARGS__), #__VA_ARGS__, EPX_HERE)

namespace epx::nccl {

// Grouped NCCL calls: ncclGroupStart in the constructor; end() calls ncclGroupEnd and
// returns its result (ncclSuccess, or ncclInProgress for nonblocking communicators;
// anything else raises epx::error). If end() was not reached (an exception while the
// group was open), the destructor ends the group and ignores the result, so NCCL's group
// depth stays balanced while unwinding (NCCL drops the group's operations after an error).
class group_guard {
 public:
  group_guard() {
    EPX_NCCL_CHECK(ncclGroupStart());
    open_ = true;
  }
  group_guard(const group_guard&) = delete;
  group_guard& operator=(const group_guard&) = delete;
  ~group_guard() {
    if (open_) (void)ncclGroupEnd();
  }
  [[nodiscard]] ncclResult_t end() {
    open_ = false;
    const ncclResult_t r = ncclGroupEnd();
    if (r != ncclSuccess && r != ncclInProgress) detail::nccl_check(r, "ncclGroupEnd()", EPX_HERE);
    return r;
  }

 private:
  bool open_ = false;
};

}  // namespace epx::nccl
