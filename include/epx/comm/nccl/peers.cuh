// epx/comm/nccl/peers.cuh: peer access on the NCCL communicator (the layer's direct route)
// through a symmetric memory window; NCCL 2.28 or newer (its device API), else none.
//
// Where every rank of the communicator is in one load/store-accessible team of NCCL
// (ncclTeamLsa: the ranks of one node, or of one multi-node NVLink clique) and NCCL maps
// symmetric memory there (CUDA P2P between the GPUs; checked on the first window, see
// communicator::peer_access_available), each rank's kernels can read every other rank's
// window memory. The communicator keeps one window: ncclMemAlloc'd memory
// registered collectively (ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC), the same size
// on every rank, grown when an access needs more. Member r's part of it is at
// ncclGetPeerPointer(window, 0, r) in this process, which a one-thread kernel reads once per
// registration. An access (communicator::access_peers):
//   1. the record exchange: each rank's {problem, count, bad buffer, bytes[i]} in one
//      all_gather and its read-back, the access's one host synchronisation: bad arguments
//      and mismatched counts raise on every rank, naming the rank and the values; every
//      rank places every member's buffers alike (each at a multiple of 256 bytes), and the
//      window grows (at least doubling) when some member needs more (the stream is idle
//      then): every rank allocates, the ranks agree, register, and agree that the window
//      is device-accessible (two more synchronisations, on growth only);
//   2. each rank copies its buffers into its part of the window (cudaMemcpyAsync);
//   3. the entry barrier, a one-element all_reduce on the stream: when it completes on a
//      rank, every member's copies have run, since each member's all_reduce starts after
//      them;
//   4. f(peers) queues its kernels on the stream (the layer's policy runs on it);
//      peers(r, i) is member r's copy of buffer i;
//   5. the exit barrier, another one-element all_reduce: no rank rewrites its part (the
//      next access's copies) before every member's kernels of step 4 have read it.
// Steps 2 to 5 are queued on the stream with no host wait. Peer access is off unless
// options::peer_access turns it on (the read-back of step 1 is a host synchronisation per
// access). The layer's direct route moves
// the rows once more than NVLink needs (step 2); reading the caller's own buffers in place
// needs them allocated in the window, which the layer does not do yet.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#include "epx/exec/cuda.cuh"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define EPX_NCCL_PEER_ACCESS 1
#include <nccl_device.h>
#else
#define EPX_NCCL_PEER_ACCESS 0
#endif

#if EPX_NCCL_PEER_ACCESS
namespace epx::nccl {
class communicator;
}

namespace epx::nccl::detail {

inline constexpr std::size_t max_peer_buffers = 8;
// A rank's record: problem (0 none, 1 too many buffers, 2 null lists, 3 a null buffer with
// bytes), count, the bad buffer, then the bytes of each buffer.
inline constexpr std::size_t peer_record = 3 + max_peer_buffers;
inline constexpr std::size_t peer_align = 256;
inline constexpr std::size_t peer_grain = std::size_t{2} << 20;  // windows grow in 2 MiB steps

inline std::size_t peer_round(std::size_t bytes, std::size_t to) noexcept { return (bytes + to - 1) / to * to; }

// Whether NCCL was told not to make symmetric memory (NCCL_CUMEM_ENABLE=0 or
// NCCL_WIN_ENABLE=0 in the environment): then no window maps peers' memory.
inline bool symmetric_memory_disabled() noexcept {
  for (const char* name : {"NCCL_CUMEM_ENABLE", "NCCL_WIN_ENABLE"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0' && std::strtol(v, nullptr, 10) == 0) return true;
  }
  return false;
}

// Whether `p` is memory the device can read (device, managed or page-locked host memory).
// A window NCCL 2.28 registers without symmetric support is a host-heap handle (or null),
// which the device API must not dereference.
inline bool is_device_accessible(const void* p) noexcept {
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged || a.type == cudaMemoryTypeHost;
}

// Each member's part of window `w`, as this process addresses it (one thread).
template <int = 0>
__global__ void peer_bases_kernel(ncclWindow_t w, int n, char** out) {
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (int r = 0; r < n; ++r) out[r] = static_cast<char*>(ncclGetPeerPointer(w, 0, r));
}

// The communicator's window and the small device arrays of its exchanges.
struct peer_window {
  int available = -1;  // peer_access_available's answer (-1: not asked yet)
  void* memory = nullptr;  // ncclMemAlloc'd, `capacity` bytes
  std::size_t capacity = 0;
  ncclWindow_t window = nullptr;
  std::vector<char*> base;  // [size]: each member's part
  std::vector<std::size_t> offset;  // [size * max_peer_buffers]: each member's buffers in its part
  exec::device_buffer<std::int64_t> records;  // [size * peer_record]
  exec::device_buffer<char*> bases;  // [size]
  exec::device_buffer<std::int32_t> flag;  // [1]: the agreement and the barriers
};

}  // namespace epx::nccl::detail

namespace epx::nccl {

// The view access_peers hands to its function: member r's copy of buffer i.
class peer_pointers {
 public:
  const void* operator()(int r, std::size_t i) const noexcept {
    return w_->base[static_cast<std::size_t>(r)] + w_->offset[static_cast<std::size_t>(r) * detail::max_peer_buffers + i];
  }
  int size() const noexcept { return static_cast<int>(w_->base.size()); }

 private:
  friend class communicator;
  explicit peer_pointers(const detail::peer_window* w) noexcept : w_(w) {}
  const detail::peer_window* w_;
};

}  // namespace epx::nccl
#endif
