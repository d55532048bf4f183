// bindings/torch/csrc/device_communicator.hpp: epx's communicator concept over a torch
// process group whose collectives move the memory of a device policy: a device
// communicator (epx/comm/settle.hpp), whose `execution()` is the policy on torch's current
// queue. Its collectives are queued there and return without waiting (NCCL: c10d's
// Work::wait makes the current CUDA stream wait for the group's stream); `wait()` is the
// bounded host wait that the layer's one synchronisation per call goes through.
//
//   Exec = epx::exec::cuda             CUDA tensors over the group's NCCL backend
//                                      (layer_cuda.cu, built by _build.load_cuda)
//   Exec = epx::exec::emulated_device  CPU tensors over gloo: the same calls on the CPU,
//                                      run by the tests (Layer(device="emulated"))
//
//   all_gather            ProcessGroup::all_gather_single (one flat output)
//   all_to_allv(_segments) ProcessGroup::all_to_all_single with split sizes; segments not
//                         packed in peer order go through a scratch buffer, packed or placed
//                         by one launch (copy_segments) whatever their number
//   all_reduce            all_gather into scratch, then the rank-order sum on the policy
//                         (epx::detail::rank_order_sum, epx/comm/detail/reduce.hpp): the
//                         bits of the host communicator and of every host backend, the
//                         same on every rank
//   reduce_scatter        all_to_all of the blocks, then the same sum
//   broadcast, barrier    the group's own (barrier: then wait())
//   split                 as torch_communicator (torch_group.hpp)
//
// device_side<Exec> (below, and for CUDA in layer_cuda.cu) tells the layer and this
// communicator the policy on torch's current queue, the device of its tensors and how to
// wait for the queue within a time limit.
#pragma once

#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/detail/reduce.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/emulated.hpp"
#include "epx/exec/policy.hpp"
#include "torch_group.hpp"

namespace epx_torch {

// What a device policy needs from torch: specialised per policy.
//   static Exec current();                 the policy on torch's current queue
//   static at::Device device();            where the layer's tensors live
//   static bool wait(const Exec&, std::chrono::milliseconds);  false on timeout
//   static void copy(const Exec&, std::byte* d, const std::byte* s, std::size_t n);  on the queue
//   static void collective_queued(), collective_waited();  bookkeeping (emulated only)
//   scope                                  held while a collective runs on the device's
//                                          memory (emulated: opens it to the host threads)
//   guard(at::Device)                      makes the layer's device the current one
template <class Exec>
struct device_side;

template <>
struct device_side<epx::exec::emulated_device> {
  static epx::exec::emulated_device current() {
    static const epx::exec::emulated_device queue{};  // one queue, one set of counters
    return queue;
  }
  static at::Device device() { return at::Device(at::kCPU); }
  static const char* name() { return "emulated device (CPU)"; }
  static bool wait(const epx::exec::emulated_device& ex, std::chrono::milliseconds) {
    epx::exec::emulated_collective_waited();  // this is the bounded wait
    epx::exec::synchronize(ex);
    return true;
  }
  // A copy between two buffers of the device's memory on the queue. (The layer's tensors are
  // torch's CPU tensors, which the emulated device's registry does not know: exec::copy_n
  // would count a copy into one as a read-back to the host.)
  static void copy(const epx::exec::emulated_device&, std::byte* d, const std::byte* s, std::size_t n) {
    const epx::exec::emulated_launch_scope on_device;
    std::memcpy(d, s, n);
  }
  // The emulated queue runs each collective at once; these keep its record of which
  // host reads would wait for one on a GPU (epx/exec/emulated.hpp).
  static void collective_queued() { epx::exec::emulated_collective_queued(); }
  static void collective_waited() { epx::exec::emulated_collective_waited(); }
  // In strict mode (epx::exec::emulated_strict_memory) the emulated buffers are open to the
  // host only inside a launch scope: the group's threads run the collective inside this one.
  using scope = epx::exec::emulated_launch_scope;
  struct guard {
    explicit guard(at::Device) {}
  };
};

// m byte segments copied in one launch, `unit` bytes (U) per index: index i belongs to the
// segment j with start[j] <= i < start[j + 1] (a binary search; empty segments are passed
// over), at offset i - start[j] of it. table: [m + 1] start | [m] source | [m] destination,
// in units.
template <class U>
struct copy_segments {
  const std::int64_t* table;
  std::size_t m;
  const U* src;
  U* dst;
  EPX_HOST_DEVICE void operator()(std::size_t i) const {
    const auto at = static_cast<std::int64_t>(i);
    std::size_t lo = 0, hi = m;  // table[lo] <= i < table[hi]
    while (hi - lo > 1) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (table[mid] <= at) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const std::int64_t r = at - table[lo];
    dst[table[2 * m + 1 + lo] + r] = src[table[m + 1 + lo] + r];
  }
};

// Copy units: the widest that divides every offset, length and both base addresses.
struct alignas(16) unit16 {
  std::uint64_t a, b;
};
struct alignas(8) unit8 {
  std::uint64_t a;
};
struct alignas(4) unit4 {
  std::uint32_t a;
};

template <class Exec>
class torch_device_communicator : public torch_group {
  using side = device_side<Exec>;

 public:
  // `timeout`: the limit of wait() (the group's own timeout, from Python).
  torch_device_communicator(const std::string& group_name, int world_rank, int world_size,
                            std::chrono::milliseconds timeout)
      : torch_group(group_name, world_rank, world_size), timeout_(timeout),
        scratch_(std::make_shared<scratch>()) {}

  Exec execution() const { return side::current(); }

  torch_device_communicator split(int color, int key) const {
    const std::int64_t mine[3] = {color, key, world_rank_};
    std::vector<std::int64_t> all(3 * static_cast<std::size_t>(size()));
    epx::detail::all_gather_host(const_cast<torch_device_communicator&>(*this), mine, 3, all.data());
    return torch_device_communicator(split_name(color, all), world_rank_, world_size_, timeout_);
  }

  // Into one flat buffer (ProcessGroup::all_gather_single: NCCL's all-gather in place).
  void all_gather(const void* send, void* recv, std::size_t count, epx::datatype t) {
    if (count == 0) return;
    at::Tensor in = view(send, count, t), out = view(recv, static_cast<std::size_t>(size()) * count, t);
    queue("all_gather", [&] { return group()->all_gather_single(out, in); });
  }

  void all_to_all(const void* send, void* recv, std::size_t count, epx::datatype t) {
    const auto P = static_cast<std::size_t>(size());
    const std::vector<std::size_t> v = equal_blocks(P, count);
    all_to_allv(send, v.data(), v.data() + P, recv, v.data(), v.data() + P, t);
  }

  void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                   const std::size_t* recv_counts, const std::size_t* recv_displs, epx::datatype t) {
    all_to_allv_segments(send, send_counts, send_displs, recv, recv_counts, recv_displs, 1, t);
  }

  // Every segment of every peer in one all_to_all_single: the blocks to one peer are sent in
  // place when they follow each other in peer order (epx's send order), else packed; the
  // received ones land source-major in scratch (or in place when packed) and are copied to
  // where the receiver named them. Counts and displacements: host arrays, in elements.
  void all_to_allv_segments(const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
                            void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
                            std::size_t nseg, epx::datatype t) {
    const auto P = static_cast<std::size_t>(size());
    const std::size_t m = P * nseg, es = epx::size_of(t);
    const auto ex = execution();
    std::vector<std::int64_t> sc(P, 0), rc(P, 0);
    std::size_t ns = 0, nr = 0;
    for (std::size_t p = 0; p < P; ++p)
      for (std::size_t i = 0; i < nseg; ++i) {
        sc[p] += static_cast<std::int64_t>(send_counts[p * nseg + i]);
        rc[p] += static_cast<std::int64_t>(recv_counts[p * nseg + i]);
      }
    for (std::size_t p = 0; p < P; ++p) {
      ns += static_cast<std::size_t>(sc[p]);
      nr += static_cast<std::size_t>(rc[p]);
    }
    const bool send_packed = packed(send_counts, send_displs, m);
    const bool recv_packed = packed(recv_counts, recv_displs, m);
    const auto* s = static_cast<const std::byte*>(send);
    auto* r = static_cast<std::byte*>(recv);
    std::byte* sbuf = nullptr;
    std::byte* rbuf = nullptr;
    if (!send_packed && ns > 0) {
      sbuf = scratch_->get(ex, scratch::send, ns * es);
      place(ex, s, sbuf, send_counts, send_displs, nullptr, m, es);
      s = sbuf;
    }
    if (!recv_packed && nr > 0) r = rbuf = scratch_->get(ex, scratch::recv, nr * es);
    at::Tensor in = view(s, ns, t), out = view(r, nr, t);
    queue("all_to_all", [&] { return group()->all_to_all_single(out, in, rc, sc); });
    if (rbuf != nullptr) place(ex, rbuf, static_cast<std::byte*>(recv), recv_counts, nullptr, recv_displs, m, es);
  }

  void all_reduce(const void* send, void* recv, std::size_t count, epx::datatype t, double scale) {
    gather_and_sum("all_reduce", send, recv, count, t, scale, false);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, epx::datatype t, double scale) {
    gather_and_sum("reduce_scatter", send, recv, recv_count, t, scale, true);
  }

  void broadcast(void* data, std::size_t count, epx::datatype t, int root) {
    if (count == 0) return;
    std::vector<at::Tensor> v = {view(data, count, t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    queue("broadcast", [&] { return group()->broadcast(v, o); });
  }

  void barrier() {
    run("barrier", [&] { return group()->barrier(); });
    wait();
  }

  // The bounded wait: returns once the queue's work (the collectives included) is done;
  // raises errc::communicator after the group's timeout.
  void wait() {
    const bool done = side::wait(execution(), timeout_);
    EPX_REQUIRE(done, epx::errc::communicator, "torch process group '", name_, "' (", backend(), ", rank ", rank(),
                " of ", size(), "): the device queue did not finish within ", timeout_.count(),
                " ms (a peer that left, or a collective that never completes)");
    side::collective_waited();
  }

 private:
  // Grow-only scratch in the policy's memory, kept between calls; shared by the copies of a
  // communicator (which epx uses one at a time). A buffer may only be replaced when the
  // queue has finished with it: the policy's queue orders the free after its last use.
  struct scratch {
    enum : int { send = 0, recv, reduce, table, count };
    std::byte* get(const Exec& ex, int slot, std::size_t n) {
      auto& b = bufs[static_cast<std::size_t>(slot)];
      if (n > b.size()) b = epx::exec::make_buffer<std::byte>(ex, n);
      return b.data();
    }
    epx::exec::buffer<std::byte, Exec> bufs[count];
  };

  static std::size_t bytes(std::size_t n, epx::datatype t) { return n * epx::size_of(t); }

  // Segment j (counts[j] elements of es bytes) from src + src_displs[j] to dst +
  // dst_displs[j]; a null displacement array means the segments follow each other from 0.
  // One segment: one copy; more: one launch over their units (copy_segments), its table
  // copied to the device first (queued; from pageable memory the copy has read it when it
  // returns).
  void place(const Exec& ex, const std::byte* src, std::byte* dst, const std::size_t* counts,
             const std::size_t* src_displs, const std::size_t* dst_displs, std::size_t m, std::size_t es) {
    std::vector<std::int64_t> t(3 * m + 1);
    std::size_t packed_at = 0, align = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst);
    std::size_t nonempty = 0, last = 0;
    for (std::size_t j = 0; j < m; ++j) {
      const std::size_t sd = (src_displs ? src_displs[j] : packed_at) * es;
      const std::size_t dd = (dst_displs ? dst_displs[j] : packed_at) * es;
      const std::size_t len = counts[j] * es;
      packed_at += counts[j];
      if (len != 0) {
        align |= sd | dd | len;
        ++nonempty;
        last = j;
      }
      t[j] = static_cast<std::int64_t>(sd);  // bytes for now
      t[m + 1 + j] = static_cast<std::int64_t>(dd);
      t[2 * m + 1 + j] = static_cast<std::int64_t>(len);
    }
    if (nonempty == 0) return;
    if (nonempty == 1) {
      side::copy(ex, dst + t[m + 1 + last], src + t[last], static_cast<std::size_t>(t[2 * m + 1 + last]));
      return;
    }
    const std::size_t unit = align % 16 == 0 ? 16 : align % 8 == 0 ? 8 : align % 4 == 0 ? 4 : 1;
    // In units: [m + 1] start | [m] source | [m] destination.
    std::vector<std::int64_t> u(3 * m + 1);
    std::int64_t at = 0;
    for (std::size_t j = 0; j < m; ++j) {
      u[j] = at;
      at += t[2 * m + 1 + j] / static_cast<std::int64_t>(unit);
      u[m + 1 + j] = t[j] / static_cast<std::int64_t>(unit);
      u[2 * m + 1 + j] = t[m + 1 + j] / static_cast<std::int64_t>(unit);
    }
    u[m] = at;
    auto* table = reinterpret_cast<std::int64_t*>(scratch_->get(ex, scratch::table, u.size() * sizeof(std::int64_t)));
    epx::exec::copy_n(ex, static_cast<const std::int64_t*>(u.data()), u.size(), table);
    const auto go = [&](auto zero) {
      using U = decltype(zero);
      epx::exec::for_each_n(ex, static_cast<std::size_t>(at),
                            copy_segments<U>{table, m, reinterpret_cast<const U*>(src), reinterpret_cast<U*>(dst)});
    };
    switch (unit) {
      case 16: go(unit16{}); break;
      case 8: go(unit8{}); break;
      case 4: go(unit4{}); break;
      default: go(std::byte{}); break;
    }
  }

  // A tensor of the policy's device over `count` elements at `p` (not owned; may be empty).
  static at::Tensor view(const void* p, std::size_t count, epx::datatype t) {
    const auto opt = at::TensorOptions().dtype(scalar_type_of(t)).device(side::device());
    if (count == 0) return at::empty({0}, opt);
    return at::from_blob(const_cast<void*>(p), {static_cast<std::int64_t>(count)}, opt);
  }

  template <class F>
  void queue(const char* what, F&& start) {
    {
      const typename side::scope on_device;  // the collective runs on the device
      run(what, start);
    }
    side::collective_queued();
  }

  // Every rank's `count` elements (all_reduce: its whole buffer, by all_gather; reduce_scatter:
  // its block for this rank, by all_to_all) into scratch, then their rank-order sum into recv.
  void gather_and_sum(const char* what, const void* send, void* recv, std::size_t count, epx::datatype t,
                      double scale, bool blocks) {
    EPX_REQUIRE(epx::is_reducible(t), epx::errc::input, what, ": datatype ", epx::to_string(t), " cannot be summed");
    if (count == 0) return;
    const auto ex = execution();
    std::byte* all = scratch_->get(ex, scratch::reduce, static_cast<std::size_t>(size()) * bytes(count, t));
    if (blocks)
      all_to_all(send, all, count, t);
    else
      all_gather(send, all, count, t);
    sum(ex, all, recv, count, t, scale);
  }

  void sum(const Exec& ex, const std::byte* all, void* dst, std::size_t count, epx::datatype t, double scale) {
    const int P = size();
    const auto go = [&](auto zero) {
      using T = decltype(zero);
      epx::exec::for_each_n(ex, count, epx::detail::rank_order_sum<T>{reinterpret_cast<const T*>(all), count, P, scale,
                                                                  static_cast<T*>(dst)});
    };
    switch (t) {
      case epx::datatype::int32: go(std::int32_t{}); break;
      case epx::datatype::int64: go(std::int64_t{}); break;
      case epx::datatype::float32: go(float{}); break;
      case epx::datatype::float64: go(double{}); break;
      case epx::datatype::bfloat16: go(epx::bf16{}); break;
      case epx::datatype::float16: go(epx::fp16{}); break;
      case epx::datatype::byte: break;
    }
  }

  std::chrono::milliseconds timeout_;
  std::shared_ptr<scratch> scratch_;
};

static_assert(epx::check_communicator<torch_device_communicator<epx::exec::emulated_device>>());

}  // namespace epx_torch
