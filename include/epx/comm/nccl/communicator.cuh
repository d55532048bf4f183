// epx/comm/nccl/communicator.cuh: the NCCL communicator (needs nvcc and NCCL >= 2.18; target epx::cuda).
//
// `epx::nccl::communicator` meets the communicator concept of epx/comm/communicator.hpp
// with DEVICE pointers: every collective is enqueued on the communicator's CUDA stream
// (set at construction or with set_stream) and returns without waiting. Order the work
// that produces and consumes the buffers on the same stream (exec::cuda{comm.stream()}),
// or call wait() before the host reads results.
//
// Where the NCCL communicator comes from:
//   communicator(ncclComm_t c, stream)          wraps the user's communicator (not destroyed)
//   communicator::adopt(c, stream)              takes ownership of `c`
//   communicator::from_unique_id(id, n, r)      ncclCommInitRankConfig, owned
//   communicator::init_all(ndev)                ncclCommInitAll: one process, several GPUs,
//                                               one communicator per device, owned
//   epx::nccl::from_unique_id(MPI_Comm, ...)    rank 0 makes the id, MPI broadcasts it
//                                               (epx/comm/nccl/mpi.cuh)
//   split(color, key)                           ncclCommSplit, owned
//
// Semantics that differ from the host backends (stated so that nobody is surprised):
//   - all_reduce/reduce_scatter with scale != 1 use ncclRedOpCreatePreMulSum: NCCL
//     multiplies each rank's input by `scale` (held in the element type, so a bf16/fp16
//     scale is rounded to that type) and sums in the element type. Integer types accept
//     only integral scales. Every rank still gets the same bits.
//   - NCCL cannot see count disagreements between peers: a mismatch shows up as a hang of
//     the stream, which wait() bounds (see below).
//
// Nothing hangs: wait(timeout) polls cudaStreamQuery and ncclCommGetAsyncError; on an
// asynchronous NCCL error or when the timeout passes it calls ncclCommAbort (the NCCL
// communicator is freed, also one that was only wrapped: do not use or destroy that
// handle afterwards) and raises epx::error. barrier() waits with the communicator's
// timeout (options::timeout, default 60 s). A peer that failed therefore reaches every
// other rank as an error within the timeout. Communicators made with
// options::blocking = false (NCCL's nonblocking mode) also bound initialisation and split
// by the timeout; every call's ncclInProgress is settled before the call returns.
//
// Errors: every NCCL call is checked (EPX_NCCL_CHECK): epx::error(errc::nccl) naming the
// call, this rank, ncclGetErrorString, ncclGetLastError and the ncclResult_t code.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/cuda.cuh"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0),
              "epx/comm/nccl/communicator.cuh needs NCCL 2.18 or newer (ncclCommSplit, ncclGetLastError, "
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
// here: calls on communicators go through communicator::check_, which settles it.
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

// Settings of a communicator.
struct options {
  // Bound on wait(), barrier() and on settling nonblocking calls; then ncclCommAbort.
  std::chrono::milliseconds timeout{60000};
  // NCCL config.blocking for communicators epx creates from a unique id (NCCL's
  // default: true). false makes initialisation and split abortable by the timeout.
  // Split communicators inherit their parent's mode; ncclCommInitAll has no config.
  bool blocking = true;
};

class communicator {
 public:
  // An empty communicator: every call raises epx::error.
  communicator() = default;

  // Wraps the user's `comm`, which stays the user's: the destructor does not destroy it
  // (an abort after a timeout does free it, as ncclCommAbort always does).
  explicit communicator(ncclComm_t comm, cudaStream_t stream = 0, options opt = {})
      : communicator(comm, false, stream, opt) {}

  // Takes ownership of `comm` (ncclCommDestroy in the destructor).
  static communicator adopt(ncclComm_t comm, cudaStream_t stream = 0, options opt = {}) {
    return communicator(comm, true, stream, opt);
  }

  // Collective over `nranks` callers (processes or threads) sharing `id`, each on its
  // own current CUDA device (or `device` when >= 0).
  static communicator from_unique_id(const ncclUniqueId& id, int nranks, int rank, int device = -1,
                                     cudaStream_t stream = 0, options opt = {}) {
    EPX_REQUIRE(nranks >= 1 && rank >= 0 && rank < nranks, errc::input, "nccl::from_unique_id: rank (", rank,
                ") must lie in [0, nranks = ", nranks, ")");
    detail::device_guard dg(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = opt.blocking ? 1 : 0;
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, nranks, id, rank, &config);
    settle_new_(c, r, "ncclCommInitRankConfig", opt);
    return communicator(c, true, stream, opt);
  }

  // One process driving `devices.size()` GPUs: returns one owned communicator per device
  // (rank i on devices[i]). Collectives then need one host thread per communicator (or
  // an enclosing group_guard around the calls of all of them, without wait/barrier).
  static std::vector<communicator> init_all(const std::vector<int>& devices, options opt = {}) {
    EPX_REQUIRE(!devices.empty(), errc::input, "nccl::communicator::init_all: no devices given");
    int count = 0;
    EPX_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (int d : devices)
      EPX_REQUIRE(d >= 0 && d < count, errc::input, "nccl::communicator::init_all: device ", d,
                  " out of range [0, ", count, ")");
    std::vector<ncclComm_t> comms(devices.size(), nullptr);
    EPX_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
    std::vector<communicator> out;
    out.reserve(devices.size());
    std::size_t i = 0;
    try {
      for (; i < comms.size(); ++i) out.push_back(communicator(comms[i], true, 0, opt));
    } catch (...) {
      for (std::size_t j = i + 1; j < comms.size(); ++j) (void)ncclCommDestroy(comms[j]);
      throw;
    }
    return out;
  }
  // Devices 0 .. ndev-1.
  static std::vector<communicator> init_all(int ndev, options opt = {}) {
    EPX_REQUIRE(ndev >= 1, errc::input, "nccl::communicator::init_all: ndev (", ndev, ") must be >= 1");
    std::vector<int> devices(static_cast<std::size_t>(ndev));
    for (int d = 0; d < ndev; ++d) devices[static_cast<std::size_t>(d)] = d;
    return init_all(devices, opt);
  }

  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  communicator(communicator&& o) noexcept { swap(o); }
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      release_();
      swap(o);
    }
    return *this;
  }
  ~communicator() { release_(); }

  void swap(communicator& o) noexcept {
    std::swap(comm_, o.comm_);
    std::swap(owned_, o.owned_);
    std::swap(aborted_, o.aborted_);
    std::swap(rank_, o.rank_);
    std::swap(size_, o.size_);
    std::swap(device_, o.device_);
    std::swap(stream_, o.stream_);
    std::swap(opt_, o.opt_);
    scratch_.swap(o.scratch_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  // The CUDA device of this rank (ncclCommCuDevice).
  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  // Later collectives are enqueued on `s` (a stream of device()).
  void set_stream(cudaStream_t s) noexcept { stream_ = s; }
  const options& get_options() const noexcept { return opt_; }
  void set_timeout(std::chrono::milliseconds t) noexcept { opt_.timeout = t; }
  // The NCCL handle (null when empty or aborted).
  ncclComm_t native_handle() const noexcept { return comm_; }
  bool aborted() const noexcept { return aborted_; }
  // The execution policy on this communicator's stream.
  exec::cuda execution() const noexcept { return exec::cuda{stream_}; }

  // Collective over this communicator: members with the same color (>= 0) form one new
  // communicator (owned, same stream and options), ordered by (key, rank).
  communicator split(int color, int key) const {
    require_live_("split");
    EPX_REQUIRE(color >= 0, errc::input, "nccl split: color (", color, ") must be >= 0 on rank ", rank_);
    detail::device_guard dg(device_);
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommSplit(comm_, color, key, &c, nullptr);
    if (r != ncclSuccess && r != ncclInProgress) fail_(r, "ncclCommSplit", EPX_HERE);
    settle_new_(c, r, "ncclCommSplit", opt_);
    communicator out(c, true, stream_, opt_);
    if (r == ncclInProgress) check_(r, "ncclCommSplit (parent)", EPX_HERE);  // nonblocking: the parent settles too
    return out;
  }

  // Per-peer counts and displacements in elements (device pointers). One NCCL group of
  // ncclSend/ncclRecv; the block to itself is a device-to-device copy on the stream.
  void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                   const std::size_t* recv_counts, const std::size_t* recv_displs, datatype t) {
    all_to_allv_segments(send, send_counts, send_displs, recv, recv_counts, recv_displs, 1, t);
  }

  // Segmented all-to-all (see epx::all_to_allv_segments): arrays [peers][nseg] in
  // elements; segment i sent to peer q lands where q names segment i from this rank. One
  // NCCL group of per-segment ncclSend/ncclRecv (NCCL matches sends and receives between
  // a pair in issue order, so segments pair up in order; empty segments are skipped on
  // both sides because the counts agree).
  void all_to_allv_segments(const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
                            void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
                            std::size_t nseg, datatype t) {
    require_live_("all_to_allv");
    const std::size_t es = size_of(t);
    const ncclDataType_t nt = detail::to_nccl(t);
    const auto n = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    for (std::size_t i = 0; i < nseg; ++i) {
      EPX_REQUIRE(send_counts[me * nseg + i] == recv_counts[me * nseg + i], errc::communicator,
                  "nccl all_to_allv: rank ", rank_, " sends itself ", send_counts[me * nseg + i],
                  " elements in segment ", i, " but expects to receive ", recv_counts[me * nseg + i]);
    }
    detail::device_guard dg(device_);
    const auto* s = static_cast<const unsigned char*>(send);
    auto* d = static_cast<unsigned char*>(recv);
    for (std::size_t i = 0; i < nseg; ++i) {
      const std::size_t k = me * nseg + i;
      if (send_counts[k] != 0)
        EPX_CUDA_CHECK(cudaMemcpyAsync(d + recv_displs[k] * es, s + send_displs[k] * es, send_counts[k] * es,
                                       cudaMemcpyDefault, stream_));
    }
    if (n == 1) return;
    group_guard g;
    for (std::size_t q = 1; q < n; ++q) {
      // Peers in ring order from this rank, so that not every rank starts with rank 0.
      const std::size_t to = (me + q) % n;
      const std::size_t from = (me + n - q) % n;
      for (std::size_t i = 0; i < nseg; ++i) {
        const std::size_t ks = to * nseg + i;
        if (send_counts[ks] != 0)
          check_(ncclSend(s + send_displs[ks] * es, send_counts[ks], nt, static_cast<int>(to), comm_, stream_),
                 "ncclSend", EPX_HERE);
        const std::size_t kr = from * nseg + i;
        if (recv_counts[kr] != 0)
          check_(ncclRecv(d + recv_displs[kr] * es, recv_counts[kr], nt, static_cast<int>(from), comm_, stream_),
                 "ncclRecv", EPX_HERE);
      }
    }
    check_(g.end(), "ncclGroupEnd (all_to_allv)", EPX_HERE);
  }

  // Equal counts: block p of `send` (count_per_peer elements) goes to peer p.
  void all_to_all(const void* send, void* recv, std::size_t count_per_peer, datatype t) {
    std::vector<std::size_t> v(2 * static_cast<std::size_t>(size_));
    for (std::size_t p = 0; p < static_cast<std::size_t>(size_); ++p) {
      v[p] = count_per_peer;
      v[static_cast<std::size_t>(size_) + p] = p * count_per_peer;
    }
    all_to_allv(send, v.data(), v.data() + size_, recv, v.data(), v.data() + size_, t);
  }

  // recv = scale * sum over ranks of send (in place allowed). scale == 1: ncclSum;
  // otherwise ncclRedOpCreatePreMulSum (see the header comment for rounding).
  void all_reduce(const void* send, void* recv, std::size_t count, datatype t, double scale = 1.0) {
    require_live_("all_reduce");
    if (count == 0) return;
    detail::device_guard dg(device_);
    red_op op(*this, t, scale, "all_reduce");
    check_(ncclAllReduce(send, recv, count, detail::to_nccl(t), op.get(), comm_, stream_), "ncclAllReduce", EPX_HERE);
  }

  // send holds size()*recv_count elements; block r, summed and scaled, lands on rank r.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, datatype t, double scale = 1.0) {
    require_live_("reduce_scatter");
    if (recv_count == 0) return;
    detail::device_guard dg(device_);
    red_op op(*this, t, scale, "reduce_scatter");
    check_(ncclReduceScatter(send, recv, recv_count, detail::to_nccl(t), op.get(), comm_, stream_),
           "ncclReduceScatter", EPX_HERE);
  }

  // recv (size()*count elements) = the ranks' `send` blocks in rank order.
  void all_gather(const void* send, void* recv, std::size_t count, datatype t) {
    require_live_("all_gather");
    if (count == 0) return;
    detail::device_guard dg(device_);
    check_(ncclAllGather(send, recv, count, detail::to_nccl(t), comm_, stream_), "ncclAllGather", EPX_HERE);
  }

  void broadcast(void* data, std::size_t count, datatype t, int root) {
    require_live_("broadcast");
    EPX_REQUIRE(root >= 0 && root < size_, errc::input, "nccl broadcast: root (", root, ") out of range [0, ",
                size_, ")");
    if (count == 0) return;
    detail::device_guard dg(device_);
    check_(ncclBroadcast(data, data, count, detail::to_nccl(t), root, comm_, stream_), "ncclBroadcast", EPX_HERE);
  }

  // Returns when every rank has reached the barrier and this rank's earlier work on the
  // stream has finished: a one-element all-reduce, then wait() with the timeout.
  void barrier() {
    require_live_("barrier");
    {
      detail::device_guard dg(device_);
      if (scratch_.size() == 0) {
        scratch_ = exec::device_buffer<std::int32_t>(1);
        exec::fill_zero(exec::cuda{stream_}, scratch_.data(), 1);
      }
    }
    all_reduce(scratch_.data(), scratch_.data(), 1, datatype::int32, 1.0);
    wait();
  }

  // Waits for the work enqueued on the stream, at most `timeout`. An asynchronous NCCL
  // error, a CUDA error on the stream or the timeout abort the communicator
  // (ncclCommAbort) and raise epx::error: errc::communicator for the timeout, errc::nccl
  // or errc::cuda otherwise.
  void wait(std::chrono::milliseconds timeout) {
    require_live_("wait");
    detail::device_guard dg(device_);
    const auto start = std::chrono::steady_clock::now();
    for (unsigned spin = 0;; ++spin) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &async);
      if (q != ncclSuccess) abort_and_fail_(q, "ncclCommGetAsyncError", EPX_HERE);
      if (async != ncclSuccess && async != ncclInProgress)
        abort_and_fail_(async, "asynchronous NCCL error (ncclCommGetAsyncError)", EPX_HERE);
      const cudaError_t s = cudaStreamQuery(stream_);
      if (s == cudaSuccess && async == ncclSuccess) return;
      if (s != cudaSuccess && s != cudaErrorNotReady) {
        (void)cudaGetLastError();
        abort_();
        throw error(errc::cuda,
                    ::epx::detail::concat("cudaStreamQuery on rank ", rank_, " of ", size_, " (device ", device_, ") failed: ",
                           cudaGetErrorName(s), " (", cudaGetErrorString(s), ", code ", static_cast<int>(s),
                           "); the NCCL communicator was aborted"),
                    EPX_HERE, static_cast<long>(s));
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > timeout) {
        abort_();
        EPX_THROW(errc::communicator, "nccl wait timed out after ", timeout.count(), " ms on rank ", rank_, " of ",
                  size_, " (device ", device_,
                  "): a peer did not join the collective, failed, or sent counts that disagree; the NCCL "
                  "communicator was aborted");
      }
      if (spin < 2000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  void wait() { wait(opt_.timeout); }

  // Aborts the NCCL communicator now (ncclCommAbort): pending work ends, every later call
  // raises epx::error. For error paths of the caller's own (e.g. a peer is known dead).
  void abort() noexcept { abort_(); }

 private:
  communicator(ncclComm_t comm, bool owned, cudaStream_t stream, options opt)
      : comm_(comm), owned_(owned), stream_(stream), opt_(opt) {
    try {
      EPX_REQUIRE(comm != nullptr, errc::input, "nccl::communicator: null ncclComm_t");
      EPX_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
      EPX_NCCL_CHECK(ncclCommCount(comm, &size_));
      EPX_NCCL_CHECK(ncclCommCuDevice(comm, &device_));
    } catch (...) {
      if (owned && comm != nullptr) (void)ncclCommDestroy(comm);
      comm_ = nullptr;
      throw;
    }
  }

  // A new communicator from an init or split: settles ncclInProgress (nonblocking mode)
  // within the timeout; on failure aborts it and raises.
  static void settle_new_(ncclComm_t& c, ncclResult_t r, const char* call, const options& opt) {
    if (r != ncclSuccess && r != ncclInProgress) {
      if (c != nullptr) (void)ncclCommAbort(c);
      c = nullptr;
      detail::nccl_check(r, call, EPX_HERE);
    }
    EPX_REQUIRE(c != nullptr, errc::nccl, call, " returned no communicator");
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(c, &async);
      if (q == ncclSuccess && async == ncclSuccess) return;
      if (q != ncclSuccess || async != ncclInProgress) {
        const ncclResult_t bad = q != ncclSuccess ? q : async;
        const std::string what = detail::describe(bad, c);
        (void)ncclCommAbort(c);
        c = nullptr;
        throw error(errc::nccl, ::epx::detail::concat(call, " failed: ", what), EPX_HERE, static_cast<long>(bad));
      }
      if (std::chrono::steady_clock::now() - start > opt.timeout) {
        (void)ncclCommAbort(c);
        c = nullptr;
        EPX_THROW(errc::communicator, call, " did not complete within ", opt.timeout.count(),
                  " ms (a peer did not join); the new NCCL communicator was aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // A reduction operator for one call: ncclSum for scale == 1, else a PreMulSum made for
  // this call and destroyed after it (allowed as soon as the call has returned).
  class red_op {
   public:
    red_op(const communicator& c, datatype t, double scale, const char* what) : c_(c) {
      EPX_REQUIRE(is_reducible(t), errc::input, "nccl ", what, ": datatype ", to_string(t), " cannot be summed");
      EPX_REQUIRE(std::isfinite(scale), errc::input, "nccl ", what, ": scale (", scale, ") must be finite");
      if (scale == 1.0) return;
      union {
        std::int32_t i32;
        std::int64_t i64;
        float f32;
        double f64;
        bf16 b16;
        fp16 h16;
      } v{};
      switch (t) {
        case datatype::int32:
        case datatype::int64:
          EPX_REQUIRE(std::floor(scale) == scale && std::fabs(scale) < 2147483648.0, errc::input, "nccl ", what,
                      ": integer data (", to_string(t), ") needs an integral scale, got ", scale);
          if (t == datatype::int32) v.i32 = static_cast<std::int32_t>(scale);
          else v.i64 = static_cast<std::int64_t>(scale);
          break;
        case datatype::float32: v.f32 = static_cast<float>(scale); break;
        case datatype::float64: v.f64 = scale; break;
        case datatype::bfloat16: v.b16 = bf16(static_cast<float>(scale)); break;
        case datatype::float16: v.h16 = fp16(static_cast<float>(scale)); break;
        case datatype::byte: break;
      }
      c_.check_(ncclRedOpCreatePreMulSum(&op_, &v, detail::to_nccl(t), ncclScalarHostImmediate, c_.comm_),
                "ncclRedOpCreatePreMulSum", EPX_HERE);
      created_ = true;
    }
    red_op(const red_op&) = delete;
    red_op& operator=(const red_op&) = delete;
    ~red_op() {
      if (created_ && c_.comm_ != nullptr) (void)ncclRedOpDestroy(op_, c_.comm_);
    }
    ncclRedOp_t get() const noexcept { return op_; }

   private:
    const communicator& c_;
    ncclRedOp_t op_ = ncclSum;
    bool created_ = false;
  };

  void require_live_(const char* what) const {
    if (aborted_)
      EPX_THROW(errc::communicator, "nccl ", what, " on rank ", rank_, " of ", size_,
                ": the communicator was aborted after an earlier error or timeout");
    if (comm_ == nullptr) EPX_THROW(errc::communicator, "nccl ", what, ": empty communicator");
  }

  // ncclSuccess: nothing. ncclInProgress (nonblocking mode): poll until the call has
  // settled, at most the timeout. Anything else: raise (after aborting when the
  // communicator's state is broken: asynchronous errors and timeouts).
  void check_(ncclResult_t r, const char* call, source_location where) const {
    if (r == ncclSuccess) return;
    if (r != ncclInProgress) fail_(r, call, where);
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &async);
      if (q != ncclSuccess) abort_and_fail_(q, "ncclCommGetAsyncError", where);
      if (async == ncclSuccess) return;
      if (async != ncclInProgress) abort_and_fail_(async, call, where);
      if (std::chrono::steady_clock::now() - start > opt_.timeout) {
        abort_();
        throw error(errc::communicator,
                    ::epx::detail::concat(call, " on rank ", rank_, " of ", size_, " did not complete within ", opt_.timeout.count(),
                           " ms; the NCCL communicator was aborted"),
                    where);
      }
      std::this_thread::yield();
    }
  }

  [[noreturn]] void fail_(ncclResult_t r, const char* call, source_location where) const {
    throw error(errc::nccl,
                ::epx::detail::concat(call, " failed on rank ", rank_, " of ", size_, " (device ", device_, "): ",
                       detail::describe(r, comm_)),
                where, static_cast<long>(r));
  }

  [[noreturn]] void abort_and_fail_(ncclResult_t r, const char* call, source_location where) const {
    const std::string what = detail::describe(r, comm_);
    abort_();
    throw error(errc::nccl,
                ::epx::detail::concat(call, " on rank ", rank_, " of ", size_, " (device ", device_, "): ", what,
                       "; the NCCL communicator was aborted"),
                where, static_cast<long>(r));
  }

  // Abort state is mutable: any call, const ones included, may find the communicator
  // broken and must stop every later call from using it.
  void abort_() const noexcept {
    if (comm_ != nullptr && !aborted_) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      aborted_ = true;
    }
  }

  void release_() noexcept {
    if (scratch_.size() != 0) {
      // Free on the communicator's device, then restore the caller's.
      int prev = -1;
      const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device_ && cudaSetDevice(device_) == cudaSuccess;
      scratch_ = exec::device_buffer<std::int32_t>();
      if (switched) (void)cudaSetDevice(prev);
      (void)cudaGetLastError();
    }
    if (comm_ != nullptr && owned_ && !aborted_) (void)ncclCommDestroy(comm_);
    comm_ = nullptr;
    owned_ = false;
    aborted_ = false;
  }

  mutable ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  mutable bool aborted_ = false;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = 0;
  options opt_{};
  exec::device_buffer<std::int32_t> scratch_;  // [1] for barrier()
};

static_assert(is_communicator_v<communicator>,
              "epx::nccl::communicator must meet the communicator concept (epx/comm/communicator.hpp)");

}  // namespace epx::nccl
