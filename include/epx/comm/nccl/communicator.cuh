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
// (epx/comm/nccl/wait.cuh)
//
// all_to_allv and all_to_allv_segments run as one NCCL group of ncclSend/ncclRecv
// (epx/comm/nccl/transport.cuh).
//
// Peer access (NCCL >= 2.28, options::peer_access, off by default): where every rank is in
// one NCCL LSA team (one node, CUDA P2P between the GPUs), access_peers publishes the
// ranks' buffers through a symmetric memory window, so that the layer's direct route reads
// rows out of the peers' memory
// (epx/comm/nccl/peers.cuh); peer_access_available() says whether it works (collective on
// its first call).
//
// Errors: every NCCL call is checked (EPX_NCCL_CHECK): epx::error(errc::nccl) naming the
// call, this rank, ncclGetErrorString, ncclGetLastError and the ncclResult_t code
// (epx/comm/nccl/support.cuh).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/nccl/options.cuh"
#include "epx/comm/nccl/peers.cuh"
#include "epx/comm/nccl/support.cuh"
#include "epx/comm/nccl/transport.cuh"
#include "epx/comm/nccl/wait.cuh"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/cuda.cuh"
#include "epx/exec/host_copy.hpp"

namespace epx::nccl {

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
    check_options_(opt, "nccl::from_unique_id");
    detail::device_guard dg(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = opt.blocking ? 1 : 0;
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, nranks, id, rank, &config);
    detail::settle_new(c, r, "ncclCommInitRankConfig", opt.timeout);
    return communicator(c, true, stream, opt);
  }

  // One process driving `devices.size()` GPUs: returns one owned communicator per device
  // (rank i on devices[i]). Collectives then need one host thread per communicator (or
  // an enclosing group_guard around the calls of all of them, without wait/barrier).
  static std::vector<communicator> init_all(const std::vector<int>& devices, options opt = {}) {
    EPX_REQUIRE(!devices.empty(), errc::input, "nccl::communicator::init_all: no devices given");
    check_options_(opt, "nccl::communicator::init_all");
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
    std::swap(h_, o.h_);
    std::swap(owned_, o.owned_);
    std::swap(stream_, o.stream_);
    std::swap(opt_, o.opt_);
    scratch_.swap(o.scratch_);
#if EPX_NCCL_PEER_ACCESS
    peers_.swap(o.peers_);
#endif
  }

  int rank() const noexcept { return h_.rank; }
  int size() const noexcept { return h_.size; }
  // The CUDA device of this rank (ncclCommCuDevice).
  int device() const noexcept { return h_.device; }
  cudaStream_t stream() const noexcept { return stream_; }
  // Later collectives are enqueued on `s` (a stream of device()).
  void set_stream(cudaStream_t s) noexcept { stream_ = s; }
  const options& get_options() const noexcept { return opt_; }
  // A timeout must be positive (errc::configuration): 0 would abort every wait with work queued.
  void set_timeout(std::chrono::milliseconds t) {
    EPX_REQUIRE(t.count() > 0, errc::configuration, "nccl::communicator::set_timeout: timeout (", t.count(),
                " ms) must be positive");
    opt_.timeout = t;
  }
  // The NCCL handle (null when empty or aborted).
  ncclComm_t native_handle() const noexcept { return h_.comm; }
  bool aborted() const noexcept { return h_.aborted; }
  // The execution policy on this communicator's stream.
  exec::cuda execution() const noexcept { return exec::cuda{stream_}; }

  // Collective over this communicator: members with the same color (>= 0) form one new
  // communicator (owned, same stream and options), ordered by (key, rank).
  communicator split(int color, int key) const {
    require_live_("split");
    detail::device_guard dg(h_.device);
    if (color < 0) {
      // This rank still takes part (as NCCL_SPLIT_NOCOLOR, getting no communicator), so that
      // the others' ncclCommSplit returns instead of waiting for it; then it raises.
      ncclComm_t none = nullptr;
      const ncclResult_t r = ncclCommSplit(h_.comm, NCCL_SPLIT_NOCOLOR, key, &none, nullptr);
      if (r != ncclSuccess && r != ncclInProgress) h_.fail(r, "ncclCommSplit", EPX_HERE);
      if (r == ncclInProgress) check_(r, "ncclCommSplit (parent)", EPX_HERE);
      EPX_THROW(errc::input, "nccl split: color (", color, ") must be >= 0 on rank ", h_.rank,
               " (it took part without a color; the other ranks got their communicators)");
    }
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommSplit(h_.comm, color, key, &c, nullptr);
    if (r != ncclSuccess && r != ncclInProgress) h_.fail(r, "ncclCommSplit", EPX_HERE);
    detail::settle_new(c, r, "ncclCommSplit", opt_.timeout);
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
    detail::exchange_segments(h_, stream_, opt_.timeout, send, send_counts, send_displs, recv, recv_counts,
                              recv_displs, nseg, t);
  }

  // Equal counts: block p of `send` (count_per_peer elements) goes to peer p.
  void all_to_all(const void* send, void* recv, std::size_t count_per_peer, datatype t) {
    std::vector<std::size_t> v(2 * static_cast<std::size_t>(h_.size));
    for (std::size_t p = 0; p < static_cast<std::size_t>(h_.size); ++p) {
      v[p] = count_per_peer;
      v[static_cast<std::size_t>(h_.size) + p] = p * count_per_peer;
    }
    all_to_allv(send, v.data(), v.data() + h_.size, recv, v.data(), v.data() + h_.size, t);
  }

  // recv = scale * sum over ranks of send (in place allowed). scale == 1: ncclSum;
  // otherwise ncclRedOpCreatePreMulSum (see the header comment for rounding).
  void all_reduce(const void* send, void* recv, std::size_t count, datatype t, double scale = 1.0) {
    require_live_("all_reduce");
    if (count == 0) return;
    detail::device_guard dg(h_.device);
    red_op op(*this, t, scale, "all_reduce");
    check_(ncclAllReduce(send, recv, count, detail::to_nccl(t), op.get(), h_.comm, stream_), "ncclAllReduce", EPX_HERE);
  }

  // send holds size()*recv_count elements; block r, summed and scaled, lands on rank r.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, datatype t, double scale = 1.0) {
    require_live_("reduce_scatter");
    if (recv_count == 0) return;
    detail::device_guard dg(h_.device);
    red_op op(*this, t, scale, "reduce_scatter");
    check_(ncclReduceScatter(send, recv, recv_count, detail::to_nccl(t), op.get(), h_.comm, stream_),
           "ncclReduceScatter", EPX_HERE);
  }

  // recv (size()*count elements) = the ranks' `send` blocks in rank order.
  void all_gather(const void* send, void* recv, std::size_t count, datatype t) {
    require_live_("all_gather");
    if (count == 0) return;
    detail::device_guard dg(h_.device);
    check_(ncclAllGather(send, recv, count, detail::to_nccl(t), h_.comm, stream_), "ncclAllGather", EPX_HERE);
  }

  void broadcast(void* data, std::size_t count, datatype t, int root) {
    require_live_("broadcast");
    EPX_REQUIRE(root >= 0 && root < h_.size, errc::input, "nccl broadcast: root (", root, ") out of range [0, ",
                h_.size, ")");
    if (count == 0) return;
    detail::device_guard dg(h_.device);
    check_(ncclBroadcast(data, data, count, detail::to_nccl(t), root, h_.comm, stream_), "ncclBroadcast", EPX_HERE);
  }

  // Returns when every rank has reached the barrier and this rank's earlier work on the
  // stream has finished: a one-element all-reduce, then wait() with the timeout.
  void barrier() {
    require_live_("barrier");
    {
      detail::device_guard dg(h_.device);
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
    EPX_REQUIRE(timeout.count() > 0, errc::configuration, "nccl wait: timeout (", timeout.count(),
                " ms) must be positive");
    detail::device_guard dg(h_.device);
    h_.wait(stream_, timeout);
  }
  void wait() { wait(opt_.timeout); }

  // Aborts the NCCL communicator now (ncclCommAbort): pending work ends, every later call
  // raises epx::error. For error paths of the caller's own (e.g. a peer is known dead).
  void abort() noexcept { h_.abort(); }

#if EPX_NCCL_PEER_ACCESS
  using peer_pointers = nccl::peer_pointers;

  // Whether access_peers works: options::peer_access, every rank in one NCCL LSA team
  // (ncclTeamLsa), and a symmetric window that NCCL really maps. The LSA team only says
  // which ranks share a node: NCCL 2.28 registers a "window" without peer mappings where
  // symmetric memory is unsupported (no CUDA P2P between the GPUs, NCCL_CUMEM_ENABLE=0,
  // NCCL_WIN_ENABLE=0), and the device API would then read a host or null pointer. So the
  // first call makes the first window and checks that NCCL's handle is device-accessible
  // memory, on every rank. With options::peer_access on, collective on the first call (up
  // to three agreements, each an all_reduce and its read-back, so every rank answers
  // alike), then remembered; off, false at once (every rank must set the same
  // options::peer_access: a rank that differs leaves the others' agreement waiting until
  // wait() times out).
  bool peer_access_available() {
    require_live_("peer_access_available");
    if (!opt_.peer_access) return false;
    if (!peers_) peers_ = std::make_unique<detail::peer_window>();
    detail::peer_window& w = *peers_;
    if (w.available < 0) {
      detail::device_guard dg(h_.device);
      const bool mine = ncclTeamLsa(h_.comm).nRanks == h_.size && !detail::symmetric_memory_disabled();
      w.available = agree_(mine) && grow_window(detail::peer_grain, false) ? 1 : 0;
    }
    return w.available == 1;
  }

  // Collective: every rank publishes `count` buffers (bytes[i] bytes of device memory at
  // mine[i]); f(peers) queues its reads of member r's buffer i at peers(r, i) on the
  // communicator's stream. The buffers are copied into the window first; no rank's later
  // work on the stream rewrites them before every member's reads have run. Bad arguments
  // or mismatched counts raise on every rank. (Steps in epx/comm/nccl/peers.cuh.)
  template <class F>
  void access_peers(const void* const* mine, const std::size_t* bytes, std::size_t count, F&& f) {
    require_live_("access_peers");
    EPX_REQUIRE(peer_access_available(), errc::configuration, "nccl access_peers: the ranks of this communicator (",
                h_.size, ") are not all in one NCCL LSA team (ncclTeamLsa) with symmetric memory, or "
                "options::peer_access is off");
    detail::device_guard dg(h_.device);
    detail::peer_window& w = *peers_;
    const exec::cuda ex{stream_};
    const auto n = static_cast<std::size_t>(h_.size), me = static_cast<std::size_t>(h_.rank);
    constexpr std::size_t L = detail::peer_record, M = detail::max_peer_buffers;
    // 1. The record exchange.
    std::vector<std::int64_t> rec(n * L, 0);
    std::int64_t* my = rec.data() + me * L;
    if (count > M) {
      my[0] = 1;
    } else if (count != 0 && (mine == nullptr || bytes == nullptr)) {
      my[0] = 2;
    } else {
      for (std::size_t i = 0; i < count; ++i) {
        my[3 + i] = static_cast<std::int64_t>(bytes[i]);
        if (mine[i] == nullptr && bytes[i] != 0 && my[0] == 0) {
          my[0] = 3;
          my[2] = static_cast<std::int64_t>(i);
        }
      }
    }
    my[1] = static_cast<std::int64_t>(count);
    if (w.records.size() != n * L) w.records = exec::device_buffer<std::int64_t>(n * L, ex);
    exec::copy_n(ex, static_cast<const std::int64_t*>(my), L, w.records.data() + me * L);
    all_gather(w.records.data() + me * L, w.records.data(), L, datatype::int64);
    wait();
    ::epx::detail::to_host(ex, w.records.data(), n * L, rec.data());  // counted in layer_stats::host_syncs
    check_peer_records(rec);
    w.offset.assign(n * M, 0);
    std::size_t most = 0;
    for (std::size_t r = 0; r < n; ++r) {
      std::size_t at = 0;
      for (std::size_t i = 0; i < count; ++i) {
        w.offset[r * M + i] = at;
        at += detail::peer_round(static_cast<std::size_t>(rec[r * L + 3 + i]), detail::peer_align);
      }
      most = std::max(most, at);
    }
    if (most > w.capacity || w.window == nullptr) grow_window(std::max(most, std::size_t{1}));
    // 2. This rank's buffers into its part.
    for (std::size_t i = 0; i < count; ++i)
      if (bytes[i] != 0)
        EPX_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(w.memory) + w.offset[me * M + i], mine[i], bytes[i],
                                       cudaMemcpyDefault, stream_));
    // 3-5.
    all_reduce(w.flag.data(), w.flag.data(), 1, datatype::int32, 1.0);
    std::exception_ptr failure;
    try {
      const peer_pointers peers(&w);
      f(peers);
    } catch (...) {
      failure = std::current_exception();
    }
    all_reduce(w.flag.data(), w.flag.data(), 1, datatype::int32, 1.0);
    if (failure) std::rethrow_exception(failure);
  }
#endif

 private:
  static void check_options_(const options& opt, const char* call) {
    EPX_REQUIRE(opt.timeout.count() > 0, errc::configuration, call, ": options::timeout (", opt.timeout.count(),
                " ms) must be positive");
  }

  communicator(ncclComm_t comm, bool owned, cudaStream_t stream, options opt)
      : owned_(owned), stream_(stream), opt_(opt) {
    h_.comm = comm;
    try {
      EPX_REQUIRE(comm != nullptr, errc::input, "nccl::communicator: null ncclComm_t");
      check_options_(opt, "nccl::communicator");
      EPX_NCCL_CHECK(ncclCommUserRank(comm, &h_.rank));
      EPX_NCCL_CHECK(ncclCommCount(comm, &h_.size));
      EPX_NCCL_CHECK(ncclCommCuDevice(comm, &h_.device));
    } catch (...) {
      if (owned && comm != nullptr) (void)ncclCommDestroy(comm);
      h_.comm = nullptr;
      throw;
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
      c_.check_(ncclRedOpCreatePreMulSum(&op_, &v, detail::to_nccl(t), ncclScalarHostImmediate, c_.h_.comm),
                "ncclRedOpCreatePreMulSum", EPX_HERE);
      created_ = true;
    }
    red_op(const red_op&) = delete;
    red_op& operator=(const red_op&) = delete;
    ~red_op() {
      if (created_ && c_.h_.comm != nullptr) (void)ncclRedOpDestroy(op_, c_.h_.comm);
    }
    ncclRedOp_t get() const noexcept { return op_; }

   private:
    const communicator& c_;
    ncclRedOp_t op_ = ncclSum;
    bool created_ = false;
  };

  void require_live_(const char* what) const {
    if (h_.aborted)
      EPX_THROW(errc::communicator, "nccl ", what, " on rank ", h_.rank, " of ", h_.size,
                ": the communicator was aborted after an earlier error or timeout");
    if (h_.comm == nullptr) EPX_THROW(errc::communicator, "nccl ", what, ": empty communicator");
  }

#if EPX_NCCL_PEER_ACCESS
  // After the record exchange of access_peers: raises on every rank, with the same message.
  void check_peer_records(const std::vector<std::int64_t>& rec) const {
    constexpr std::size_t L = detail::peer_record;
    for (int r = 0; r < h_.size; ++r) {
      const std::int64_t* q = rec.data() + static_cast<std::size_t>(r) * L;
      EPX_REQUIRE(q[0] != 1, errc::input, "nccl access_peers: rank ", r, " passed ", q[1], " buffers; at most ",
                  detail::max_peer_buffers);
      EPX_REQUIRE(q[0] != 2, errc::input, "nccl access_peers: rank ", r, " passed ", q[1],
                  " buffers with a null pointer or byte list");
      EPX_REQUIRE(q[0] != 3, errc::input, "nccl access_peers: rank ", r, ": buffer ", q[2],
                  " is null but holds bytes");
    }
    std::string differ;
    for (int r = 1; r < h_.size; ++r)
      if (rec[static_cast<std::size_t>(r) * L + 1] != rec[1])
        differ += ::epx::detail::concat(", rank ", r, " passed ", rec[static_cast<std::size_t>(r) * L + 1]);
    EPX_REQUIRE(differ.empty(), errc::communicator, "nccl access_peers: mismatched counts: rank 0 passed ", rec[1],
                differ);
  }

  // Whether every rank passes `ok` (an all_reduce of the flags and its read-back: one host
  // synchronisation). Collective.
  bool agree_(bool ok) {
    detail::peer_window& w = *peers_;
    const exec::cuda ex{stream_};
    if (w.flag.size() == 0) w.flag = exec::device_buffer<std::int32_t>(1, ex);
    const std::int32_t mine = ok ? 1 : 0;
    exec::copy_n(ex, &mine, 1, w.flag.data());
    all_reduce(w.flag.data(), w.flag.data(), 1, datatype::int32, 1.0);
    wait();
    std::int32_t all = 0;
    ::epx::detail::to_host(ex, w.flag.data(), 1, &all);  // counted in layer_stats::host_syncs
    return all == h_.size;
  }

  // A window of at least `bytes` on every rank (all pass the same size), in place of the
  // last one, at least twice its size; the stream is idle (after the record exchange's
  // wait). Collective. Every rank allocates first and the ranks agree before the
  // registration (NCCL's registration waits for every rank with no time limit, so a rank
  // that failed to allocate must not leave the others in it), then agree that NCCL's
  // window is device-accessible memory (see peer_access_available). When a step fails on
  // some rank every rank frees what it made and returns false, or raises with `raise`.
  bool grow_window(std::size_t bytes, bool raise = true) {
    detail::peer_window& w = *peers_;
    const exec::cuda ex{stream_};
    const std::size_t old = w.capacity;
    free_window();
    const std::size_t cap = detail::peer_round(std::max(bytes, 2 * old), detail::peer_grain);
    const ncclResult_t got = ncclMemAlloc(&w.memory, cap);
    if (got != ncclSuccess) w.memory = nullptr;
    if (!agree_(got == ncclSuccess)) {
      free_window();
      EPX_REQUIRE(!raise, errc::communicator, "nccl access_peers: rank ", h_.rank, " of ", h_.size,
                  ": a rank could not allocate a symmetric window of ", cap, " bytes (ncclMemAlloc",
                  got != ncclSuccess ? ::epx::detail::concat(" on this rank: ", ncclGetErrorString(got))
                                     : std::string(),
                  ")");
      return false;
    }
    check_(ncclCommWindowRegister(h_.comm, w.memory, cap, &w.window, NCCL_WIN_COLL_SYMMETRIC),
           "ncclCommWindowRegister", EPX_HERE);
    w.capacity = cap;
    if (!agree_(detail::is_device_accessible(w.window))) {
      free_window();
      EPX_REQUIRE(!raise, errc::communicator, "nccl access_peers: NCCL registered a symmetric window without "
                  "device-accessible peer mappings on some rank (symmetric memory unsupported here)");
      return false;
    }
    const auto n = static_cast<std::size_t>(h_.size);
    if (w.bases.size() != n) w.bases = exec::device_buffer<char*>(n, ex);
    detail::peer_bases_kernel<<<1, 1, 0, stream_>>>(w.window, h_.size, w.bases.data());
    EPX_CUDA_CHECK(cudaGetLastError());
    w.base.assign(n, nullptr);
    ::epx::detail::to_host(ex, w.bases.data(), n, w.base.data());
    return true;
  }

  // The window's registration and memory, if any (the stream is idle, or the communicator
  // is being released and release_ waited for it). Deregistration is treated as collective
  // (NCCL documents the registration as one): while an exception unwinds (this rank may be
  // alone in its destructor) it is not attempted, and the memory stays with the process
  // rather than be freed under a live registration. After an abort NCCL has dropped the
  // window's mappings, so the memory is freed.
  void free_window() noexcept {
    if (!peers_) return;
    detail::peer_window& w = *peers_;
    const bool alone = std::uncaught_exceptions() > 0 || h_.comm == nullptr || h_.aborted;
    if (w.window != nullptr && !alone) (void)ncclCommWindowDeregister(h_.comm, w.window);
    if (w.memory != nullptr && (w.window == nullptr || !alone || h_.aborted)) (void)ncclMemFree(w.memory);
    w.window = nullptr;
    w.memory = nullptr;
    w.capacity = 0;
  }
#endif

  // Calls on the communicator settle through its handle (epx/comm/nccl/wait.cuh), bounded
  // by the communicator's timeout.
  void check_(ncclResult_t r, const char* call, source_location where) const {
    h_.check(r, call, where, opt_.timeout);
  }

  void release_() noexcept {
#if EPX_NCCL_PEER_ACCESS
    if (peers_) {
      // On the communicator's device, then the caller's again.
      int prev = -1;
      const bool switched =
          cudaGetDevice(&prev) == cudaSuccess && prev != h_.device && cudaSetDevice(h_.device) == cudaSuccess;
      // access_peers returns without waiting: its copies, the caller's reads and the exit
      // barrier may still be queued. Unmapping the window under them would fault, so the
      // stream is waited for first (bounded by the timeout; a wait that fails leaves the
      // window and its memory to the process).
      bool idle = true;
      if (peers_->window != nullptr && std::uncaught_exceptions() == 0 && h_.comm != nullptr && !h_.aborted) {
        try {
          h_.wait(stream_, opt_.timeout);
        } catch (...) {
          idle = false;
        }
      }
      if (idle) free_window();
      peers_.reset();
      if (switched) (void)cudaSetDevice(prev);
      (void)cudaGetLastError();
    }
#endif
    if (scratch_.size() != 0) {
      // Free on the communicator's device, then restore the caller's.
      int prev = -1;
      const bool switched =
          cudaGetDevice(&prev) == cudaSuccess && prev != h_.device && cudaSetDevice(h_.device) == cudaSuccess;
      scratch_ = exec::device_buffer<std::int32_t>();
      if (switched) (void)cudaSetDevice(prev);
      (void)cudaGetLastError();
    }
    if (h_.comm != nullptr && owned_ && !h_.aborted) (void)ncclCommDestroy(h_.comm);
    h_.comm = nullptr;
    owned_ = false;
    h_.aborted = false;
  }

  detail::handle h_;  // the NCCL communicator, its rank, size, device and abort state
  bool owned_ = false;
  cudaStream_t stream_ = 0;
  options opt_{};
  exec::device_buffer<std::int32_t> scratch_;  // [1] for barrier()
#if EPX_NCCL_PEER_ACCESS
  std::unique_ptr<detail::peer_window> peers_;  // peer access (epx/comm/nccl/peers.cuh), made when first asked
#endif
};

static_assert(check_communicator<communicator>(),
              "epx::nccl::communicator must meet the communicator concept (epx/comm/communicator.hpp)");

}  // namespace epx::nccl
