// bindings/torch/csrc/torch_communicator.hpp: epx's communicator concept over a torch
// process group (c10d::ProcessGroup: gloo on CPU; the calls are the group's own).
//
//   all_gather          ProcessGroup::allgather (one output view per rank)
//   all_to_all(v)       ProcessGroup::all_to_all_single with split sizes
//   all_to_allv_segments one all_to_all_single into a source-major buffer, then a local copy
//                       of every segment to the place the receiver named for it
//   all_reduce          all_gather, then the sum of epx's host backends: rank order, in the
//                       accumulation type, scale applied before the one rounding
//                       (epx/comm/detail/reduce.hpp), so every rank gets the same bits
//   reduce_scatter      all_to_all of the blocks, then the same rank-order sum
//   broadcast, barrier  the group's own
//   with enable_shared_memory() (collective; when every rank of the group is on one host),
//   all_gather, all_to_allv and all_to_allv_segments (and so all_reduce and
//   reduce_scatter) go through shared memory instead (shm_exchange.hpp): two memcpy and one
//   barrier per call
//   split               all_gather of (color, key) and one torch.distributed.new_group per
//                       color, made in Python (every rank of the job makes every group, in
//                       color order); only a communicator over the whole job can split, and
//                       the keys must keep the members in job-rank order (as a torch group
//                       numbers them; every group of epx's mesh does)
//
// Every failure of a collective (a peer that left, a timeout of the group) is raised as
// epx::error(errc::communicator) with the group's message.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/detail/reduce.hpp"
#include "epx/core/error.hpp"
#include "shm_exchange.hpp"
#include "torch_group.hpp"

namespace epx_torch {

// Grow-only host buffers for the communicator's temporaries (pack, unpack, gather), kept
// between calls: no zero-filling and no fresh pages per call. Shared by the copies of a
// communicator (which epx uses one at a time).
class scratch_pool {
 public:
  std::byte* get(int slot, std::size_t bytes) {
    auto& b = slots_[static_cast<std::size_t>(slot)];
    if (bytes > b.size) {
      b.data.reset(new std::byte[bytes]);  // not value-initialised
      b.size = bytes;
    }
    return b.data.get();
  }
  enum : int { segment_send = 0, segment_recv, v_send, v_recv, reduce, count };

 private:
  struct block {
    std::unique_ptr<std::byte[]> data;
    std::size_t size = 0;
  };
  block slots_[count];
};

class torch_communicator : public torch_group {
 public:
  torch_communicator(const std::string& group_name, int world_rank, int world_size)
      : torch_group(group_name, world_rank, world_size), scratch_(std::make_shared<scratch_pool>()) {}

  torch_communicator split(int color, int key) const {
    std::vector<std::int64_t> mine = {color, key, world_rank_}, all(3 * static_cast<std::size_t>(size()));
    const_cast<torch_communicator*>(this)->all_gather(mine.data(), all.data(), 3, epx::datatype::int64);
    return torch_communicator(split_name(color, all), world_rank_, world_size_);
  }

  void all_gather(const void* send, void* recv, std::size_t count, epx::datatype t) {
    if (shm_) {
      shm_->all_gather(static_cast<const std::byte*>(send), static_cast<std::byte*>(recv), bytes(count, t));
      return;
    }
    const int P = size();
    std::vector<at::Tensor> in = {view(send, count, t)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < P; ++r) out[0].push_back(view(static_cast<std::byte*>(recv) + bytes(r * count, t), count, t));
    run("all_gather", [&] { return group()->allgather(out, in); });
  }

  void all_to_all(const void* send, void* recv, std::size_t count, epx::datatype t) {
    const auto P = static_cast<std::size_t>(size());
    const std::vector<std::size_t> v = equal_blocks(P, count);
    all_to_allv(send, v.data(), v.data() + P, recv, v.data(), v.data() + P, t);
  }

  // Collective: moves the all-to-alls to shared memory when every rank of the group runs on
  // this host and can map the others' segments. Returns whether it did (the same on every
  // rank). `required`: raise errc::configuration on every rank instead of falling back.
  bool enable_shared_memory(double timeout_s, bool required) {
    // One exchange per process group, shared by every layer over it (their calls are ordered
    // like any collectives on the group). Kept for the life of the group: whether a group
    // has one then depends only on the calls made so far, the same on every rank. Found by
    // the group's name and object: after destroy_process_group and a new
    // init_process_group, names start again at "0", and a group of the same name is
    // another group (the entry's weak reference has expired, or names another object).
    struct entry {
      std::shared_ptr<shm_exchange> x;
      std::string why;
      c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
    };
    static std::map<std::string, entry> made;
    const auto pg = group();
    if (auto it = made.find(name_); it != made.end() && it->second.group.lock().get() == pg.get()) {
      EPX_REQUIRE(it->second.x || !required, epx::errc::configuration,
                  "transport='shm': the group's ranks cannot share memory: ", it->second.why);
      shm_ = it->second.x;
      return shm_ != nullptr;
    }
    constexpr std::size_t rec = 16 + shm_exchange::name_len;
    const auto P = static_cast<std::size_t>(size());
    std::shared_ptr<shm_exchange> x;
    std::string why;
    try {
      x = std::make_shared<shm_exchange>(rank(), size(), timeout_s);
    } catch (const epx::error& e) {
      why = e.message();
    }
    std::vector<char> mine(rec, 0), all(rec * P, 0);
    const std::uint64_t host = host_id(), ok = x ? 1 : 0;
    std::memcpy(mine.data(), &host, 8);
    std::memcpy(mine.data() + 8, &ok, 8);
    if (x) std::memcpy(mine.data() + 16, x->control_name().data(), std::min(x->control_name().size(), shm_exchange::name_len - 1));
    all_gather(mine.data(), all.data(), rec, epx::datatype::byte);
    bool usable = true;
    std::vector<std::string> names(P);
    for (std::size_t r = 0; r < P; ++r) {
      std::uint64_t h = 0, o = 0;
      std::memcpy(&h, all.data() + r * rec, 8);
      std::memcpy(&o, all.data() + r * rec + 8, 8);
      if (o == 0) {
        usable = false;
        if (why.empty()) why = epx::detail::concat("rank ", r, " could not create its shared-memory segment");
      }
      if (h != host) {
        usable = false;
        if (why.empty()) why = "the ranks of the group run on different hosts";
      }
      names[r] = std::string(all.data() + r * rec + 16);
    }
    std::int64_t attached = 0;
    if (usable) {
      try {
        x->attach(names);
        attached = 1;
      } catch (const epx::error& e) {
        why = e.message();
      }
    }
    // Every rank must have mapped every peer (separate IPC namespaces share a host id).
    std::vector<std::int64_t> flags(P);
    all_gather(&attached, flags.data(), 1, epx::datatype::int64);
    for (std::size_t r = 0; r < P; ++r)
      if (flags[r] == 0) {
        usable = false;
        if (why.empty()) why = epx::detail::concat("rank ", r, " could not map its peers' shared memory");
      }
    if (usable) x->unlink_control();  // every rank has mapped every control segment
    made.insert_or_assign(name_, entry{usable ? x : nullptr, why, c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg)});
    EPX_REQUIRE(usable || !required, epx::errc::configuration,
                "transport='shm': the group's ranks cannot share memory: ", why);
    shm_ = usable ? x : nullptr;
    return usable;
  }
  bool shared_memory() const noexcept { return shm_ != nullptr; }
  // With shared memory: a buffer of `bytes` bytes that the next all_to_allv_segments (with
  // `nseg` segments) sends from without copying, when the caller builds its send buffer
  // there and passes it. Null without shared memory.
  void* outbox(std::size_t bytes, std::size_t nseg) { return shm_ ? shm_->outbox(bytes, nseg) : nullptr; }
  // With shared memory: all_to_allv_segments of rows of `row_elems` elements of T (counts
  // and displacements in rows), whose received segments the caller reads where they sit in
  // the senders' buffers: at(q, i, rows) for each peer q and segment i, `rows` pointing to
  // its recv_counts[q*nseg+i] rows, valid until this communicator's next collective. False,
  // and nothing exchanged, without shared memory.
  template <class T, class At>
  bool all_to_allv_segments_in_place(const T* send, const std::size_t* send_counts, const std::size_t* send_displs,
                                     const std::size_t* recv_counts, std::size_t nseg, std::size_t row_elems,
                                     At&& at) {
    if (!shm_) return false;
    const std::size_t m = static_cast<std::size_t>(size()) * nseg, rb = row_elems * sizeof(T);
    std::vector<std::size_t> v(3 * m);
    for (std::size_t j = 0; j < m; ++j) {
      v[j] = send_counts[j] * rb;
      v[m + j] = send_displs[j] * rb;
      v[2 * m + j] = recv_counts[j] * rb;
    }
    shm_->exchange_in_place(reinterpret_cast<const std::byte*>(send), v.data(), v.data() + m, v.data() + 2 * m, nseg,
                            [&](std::size_t q, std::size_t i, const std::byte* block, std::size_t) {
                              at(q, i, reinterpret_cast<const T*>(block));
                            });
    return true;
  }

  void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                   const std::size_t* recv_counts, const std::size_t* recv_displs, epx::datatype t) {
    const auto P = static_cast<std::size_t>(size());
    if (shm_) {
      shm_all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, 1, t);
      return;
    }
    // all_to_all_single takes packed blocks in peer order: use the buffers in place when the
    // displacements are the packed ones, else pack/unpack through a temporary.
    const bool send_packed = packed(send_counts, send_displs, P), recv_packed = packed(recv_counts, recv_displs, P);
    std::size_t ns = 0, nr = 0;
    for (std::size_t p = 0; p < P; ++p) {
      ns += send_counts[p];
      nr += recv_counts[p];
    }
    const std::size_t es = epx::size_of(t);
    const void* s = send;
    void* r = recv;
    std::byte* rbuf = nullptr;
    if (!send_packed) {
      std::byte* sbuf = scratch_->get(scratch_pool::v_send, ns * es);
      std::size_t at = 0;
      for (std::size_t p = 0; p < P; ++p) {
        copy(sbuf + at * es, static_cast<const std::byte*>(send) + send_displs[p] * es, send_counts[p] * es);
        at += send_counts[p];
      }
      s = sbuf;
    }
    if (!recv_packed) {
      rbuf = scratch_->get(scratch_pool::v_recv, nr * es);
      r = rbuf;
    }
    exchange(s, send_counts, r, recv_counts, t);
    if (!recv_packed) {
      std::size_t at = 0;
      for (std::size_t p = 0; p < P; ++p) {
        copy(static_cast<std::byte*>(recv) + recv_displs[p] * es, rbuf + at * es, recv_counts[p] * es);
        at += recv_counts[p];
      }
    }
  }

  // Every segment of every peer in one all_to_all_single (epx::all_to_allv_segments).
  void all_to_allv_segments(const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
                            void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
                            std::size_t nseg, epx::datatype t) {
    const auto P = static_cast<std::size_t>(size());
    if (shm_) {
      shm_all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, nseg, t);
      return;
    }
    std::vector<std::size_t> sc(P, 0), rc(P, 0), sd(P, 0), rd(P, 0);
    for (std::size_t p = 0; p < P; ++p)
      for (std::size_t i = 0; i < nseg; ++i) {
        sc[p] += send_counts[p * nseg + i];
        rc[p] += recv_counts[p * nseg + i];
      }
    // The segments this rank sends to one peer are usually one contiguous block (epx's send
    // order is expert-major); use it in place then, else pack them.
    bool contiguous = true;
    for (std::size_t p = 0; p < P && contiguous; ++p) {
      std::size_t at = send_displs[p * nseg];
      for (std::size_t i = 0; i < nseg; ++i) {
        if (send_counts[p * nseg + i] != 0 && send_displs[p * nseg + i] != at) contiguous = false;
        at += send_counts[p * nseg + i];
      }
      sd[p] = send_displs[p * nseg];
    }
    const std::size_t es = epx::size_of(t);
    const void* s = send;
    if (!contiguous) {
      std::size_t total = 0;
      for (std::size_t p = 0; p < P; ++p) total += sc[p];
      std::byte* packed_send = scratch_->get(scratch_pool::segment_send, total * es);
      std::size_t at = 0;
      for (std::size_t p = 0; p < P; ++p) {
        sd[p] = at;
        for (std::size_t i = 0; i < nseg; ++i) {
          const std::size_t c = send_counts[p * nseg + i];
          copy(packed_send + at * es, static_cast<const std::byte*>(send) + send_displs[p * nseg + i] * es, c * es);
          at += c;
        }
      }
      s = packed_send;
    }
    std::size_t nr = 0;
    for (std::size_t p = 0; p < P; ++p) {
      rd[p] = nr;
      nr += rc[p];
    }
    std::byte* rbuf = scratch_->get(scratch_pool::segment_recv, nr * es);
    // Send blocks in place: all_to_allv packs them only when their displacements are not.
    all_to_allv(s, sc.data(), sd.data(), rbuf, rc.data(), rd.data(), t);
    for (std::size_t p = 0; p < P; ++p) {
      std::size_t at = rd[p];
      for (std::size_t i = 0; i < nseg; ++i) {
        const std::size_t c = recv_counts[p * nseg + i];
        copy(static_cast<std::byte*>(recv) + recv_displs[p * nseg + i] * es, rbuf + at * es, c * es);
        at += c;
      }
    }
  }

  void all_reduce(const void* send, void* recv, std::size_t count, epx::datatype t, double scale) {
    EPX_REQUIRE(epx::is_reducible(t), epx::errc::input, "all_reduce: datatype ", epx::to_string(t),
                " cannot be summed");
    const auto P = static_cast<std::size_t>(size());
    std::byte* all = scratch_->get(scratch_pool::reduce, P * count * epx::size_of(t));
    all_gather(send, all, count, t);
    sum_blocks(all, P, recv, count, t, scale);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, epx::datatype t, double scale) {
    EPX_REQUIRE(epx::is_reducible(t), epx::errc::input, "reduce_scatter: datatype ", epx::to_string(t),
                " cannot be summed");
    const auto P = static_cast<std::size_t>(size());
    std::byte* all = scratch_->get(scratch_pool::reduce, P * recv_count * epx::size_of(t));
    all_to_all(send, all, recv_count, t);
    sum_blocks(all, P, recv, recv_count, t, scale);
  }

  void broadcast(void* data, std::size_t count, epx::datatype t, int root) {
    std::vector<at::Tensor> v = {view(data, count, t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    run("broadcast", [&] { return group()->broadcast(v, o); });
  }

  void barrier() {
    run("barrier", [&] { return group()->barrier(); });
  }

 private:
  static std::size_t bytes(std::size_t n, epx::datatype t) { return n * epx::size_of(t); }
  void shm_all_to_allv(const void* send, const std::size_t* sc, const std::size_t* sd, void* recv,
                       const std::size_t* rc, const std::size_t* rd, std::size_t nseg, epx::datatype t) {
    const std::size_t m = static_cast<std::size_t>(size()) * nseg, es = epx::size_of(t);
    std::vector<std::size_t> v(4 * m);
    for (std::size_t j = 0; j < m; ++j) {
      v[j] = sc[j] * es;
      v[m + j] = sd[j] * es;
      v[2 * m + j] = rc[j] * es;
      v[3 * m + j] = rd[j] * es;
    }
    shm_->exchange(static_cast<const std::byte*>(send), v.data(), v.data() + m, static_cast<std::byte*>(recv),
                   v.data() + 2 * m, v.data() + 3 * m, nseg);
  }
  // This host: its name and boot id.
  static std::uint64_t host_id() {
    char buf[256] = {0};
    gethostname(buf, sizeof buf - 1);
    std::string id(buf);
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char b[64] = {0};
      if (std::fgets(b, sizeof b, f) != nullptr) id += b;
      std::fclose(f);
    }
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (unsigned char c : id) h = (h ^ c) * 1099511628211ull;
    return h;
  }
  static void copy(std::byte* d, const std::byte* s, std::size_t n) {
    if (n) std::memcpy(d, s, n);
  }
  // A CPU tensor over `count` elements at `p` (not owned; may be empty).
  static at::Tensor view(const void* p, std::size_t count, epx::datatype t) {
    static std::byte dummy[16];
    void* q = p != nullptr ? const_cast<void*>(p) : static_cast<void*>(dummy);
    return at::from_blob(q, {static_cast<std::int64_t>(count)}, at::TensorOptions().dtype(scalar_type_of(t)));
  }
  void exchange(const void* send, const std::size_t* send_counts, void* recv, const std::size_t* recv_counts,
                epx::datatype t) {
    const auto P = static_cast<std::size_t>(size());
    std::vector<std::int64_t> sc(P), rc(P);
    std::size_t ns = 0, nr = 0;
    for (std::size_t p = 0; p < P; ++p) {
      sc[p] = static_cast<std::int64_t>(send_counts[p]);
      rc[p] = static_cast<std::int64_t>(recv_counts[p]);
      ns += send_counts[p];
      nr += recv_counts[p];
    }
    at::Tensor in = view(send, ns, t), out = view(recv, nr, t);
    run("all_to_all", [&] { return group()->all_to_all_single(out, in, rc, sc); });
  }
  static void sum_blocks(const std::byte* all, std::size_t P, void* recv, std::size_t count, epx::datatype t,
                         double scale) {
    std::vector<const void*> srcs(P);
    for (std::size_t r = 0; r < P; ++r) srcs[r] = all + r * count * epx::size_of(t);
    epx::detail::reduce_sum(t, srcs.data(), static_cast<int>(P), recv, count, scale);
  }
  std::shared_ptr<scratch_pool> scratch_;
  std::shared_ptr<shm_exchange> shm_;
};

static_assert(epx::check_communicator<torch_communicator>());

}  // namespace epx_torch
