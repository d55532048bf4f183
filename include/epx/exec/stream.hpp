// epx/exec/stream.hpp: host copies that write around the caches (non-temporal stores).
//
// A copy with ordinary stores reads every cache line it writes before writing it (the
// store misses, the line comes in, then goes back out): three transfers per line where the
// bytes need two. Non-temporal stores write whole lines to memory without reading them.
// libc's memcpy avoids the extra read for one large block, not for the row-sized blocks a
// gather, a pull or an all-to-all of rows moves one by one: 32768 rows of 8 KiB pulled
// into an owner's buffer took twice as long as one memcpy of the same bytes, and 1.4 times
// with streamed stores (bench/README.md, "Streamed row copies").
//
// The library's host row copies stream when the whole operation writes at least
// stream_threshold() bytes (by default 4 MiB): a destination that large is mostly out of
// the caches again by the time its reader comes (it is larger than a core's L2, and the
// ranks of a node fill their shared last-level cache together), so writing it around them
// costs the reader little. Below that the copies go through the caches as before. (It was
// 16 MiB: at 1024 x 1024 bf16 a rank's 16 MiB of received rows then streamed on some ranks
// and not on others, and the bf16 layer took 5-16% longer; bench/README.md.)
//
//   exec::stream_copy(dst, src, bytes)  memcpy's contract (no overlap); non-temporal 16-byte
//                                       stores where dst is 16-byte aligned (x86-64 with
//                                       SSE2), the unaligned head and the tail by memcpy;
//                                       memcpy on other targets
//   exec::stream_fence()                orders this thread's streamed stores before its later
//                                       stores (SFENCE). Streamed stores are weakly ordered: a
//                                       thread fences after its stream copies and before
//                                       whatever publishes them to another thread.
//   exec::stream_threshold()            bytes from which an operation streams
//   exec::set_stream_threshold(bytes)   sets it for every thread, returns the previous value
//                                       (0: every copy streams; tests, benchmarks)
//   exec::streams(bytes)                bytes >= stream_threshold()
// Host memory only (device policies copy with their own kernels).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#define EPX_HAS_STREAM_STORES 1
#else
#define EPX_HAS_STREAM_STORES 0
#endif

namespace epx::exec {

namespace detail {
inline std::atomic<std::size_t>& stream_threshold_value() noexcept {
  static std::atomic<std::size_t> bytes{std::size_t{4} << 20};
  return bytes;
}
}  // namespace detail

inline std::size_t stream_threshold() noexcept {
  return detail::stream_threshold_value().load(std::memory_order_relaxed);
}
inline std::size_t set_stream_threshold(std::size_t bytes) noexcept {
  return detail::stream_threshold_value().exchange(bytes, std::memory_order_relaxed);
}
inline bool streams(std::size_t bytes) noexcept { return bytes >= stream_threshold(); }

inline void stream_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if EPX_HAS_STREAM_STORES
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15u)) & 15u;
  if (bytes < head + 64) {
    if (bytes) std::memcpy(d, s, bytes);
    return;
  }
  if (head) std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  auto* dv = reinterpret_cast<__m128i*>(d);
  const auto* sv = reinterpret_cast<const __m128i*>(s);
  const std::size_t v = bytes / 16;
  std::size_t i = 0;
  for (; i + 4 <= v; i += 4) {  // four loads, then four stores: a 64-byte line at a time
    const __m128i a = _mm_loadu_si128(sv + i), b = _mm_loadu_si128(sv + i + 1);
    const __m128i c = _mm_loadu_si128(sv + i + 2), e = _mm_loadu_si128(sv + i + 3);
    _mm_stream_si128(dv + i, a);
    _mm_stream_si128(dv + i + 1, b);
    _mm_stream_si128(dv + i + 2, c);
    _mm_stream_si128(dv + i + 3, e);
  }
  for (; i < v; ++i) _mm_stream_si128(dv + i, _mm_loadu_si128(sv + i));
  if (bytes > v * 16) std::memcpy(d + v * 16, s + v * 16, bytes - v * 16);
#else
  if (bytes) std::memcpy(dst, src, bytes);
#endif
}

inline void stream_fence() noexcept {
#if EPX_HAS_STREAM_STORES
  _mm_sfence();
#endif
}

}  // namespace epx::exec
