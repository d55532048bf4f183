// What the device path pays for, counted on exec::emulated_device: host synchronisations
// per call (layer_stats::host_syncs), with a host communicator (threads: a wait before each
// collective over device buffers) and with a device communicator (collectives on the
// policy's queue: the count exchange's one read-back per call); and the layer refusing a
// device communicator whose queue is not the policy's.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"

namespace {

using emu = epx::exec::emulated_device;

// The threads communicator presented as a device communicator: its collectives count as
// queued on `queue` of the emulated device (the emulated policy runs eagerly, so work
// before a collective has finished when the collective starts, as on one CUDA stream).
class queued_comm {
 public:
  queued_comm(epx::threads::communicator c, emu q) : c_(std::move(c)), q_(std::move(q)) {}
  int rank() const noexcept { return c_.rank(); }
  int size() const noexcept { return c_.size(); }
  queued_comm split(int color, int key) const { return queued_comm(c_.split(color, key), q_); }
  emu execution() const { return q_; }
  void all_to_all(const void* s, void* r, std::size_t n, epx::datatype t) { c_.all_to_all(s, r, n, t); }
  void all_to_allv(const void* s, const std::size_t* sc, const std::size_t* sd, void* r, const std::size_t* rc,
                   const std::size_t* rd, epx::datatype t) {
    c_.all_to_allv(s, sc, sd, r, rc, rd, t);
  }
  void all_reduce(const void* s, void* r, std::size_t n, epx::datatype t, double scale) { c_.all_reduce(s, r, n, t, scale); }
  void reduce_scatter(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    c_.reduce_scatter(s, r, n, t, scale);
  }
  void all_gather(const void* s, void* r, std::size_t n, epx::datatype t) { c_.all_gather(s, r, n, t); }
  void broadcast(void* d, std::size_t n, epx::datatype t, int root) { c_.broadcast(d, n, t, root); }
  void barrier() { c_.barrier(); }

 private:
  epx::threads::communicator c_;
  emu q_;
};
static_assert(epx::check_communicator<queued_comm>());
static_assert(epx::detail::is_device_communicator_v<queued_comm>);
static_assert(!epx::detail::is_device_communicator_v<epx::threads::communicator>);

struct unit_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) out[i] = in.rows[i];
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>& in, const float* g, float* gi) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) gi[i] = g[i];
  }
};

struct syncs {
  long long forward = -1, backward = -1;
  long long split_forward = -1, split_backward = -1;  // the same calls through the split phase
};

// One forward and backward of an 8-rank layer (tp=2, fsdp=4, ep=4) on Comm, Impl.
template <class Comm, class Impl, class Make>
std::vector<syncs> count_syncs(const epx::mesh_config& mc, Make make_comm) {
  std::vector<syncs> out(8);
  epx::threads::run(8, [&](epx::threads::communicator& world) {
    const epx::mesh m(mc);
    epx::layer_options o;
    o.hidden = 16;
    o.top_k = 2;
    emu policy;
    Comm comm = make_comm(std::move(world), policy);
    epx::moe_layer<Comm, float, Impl, emu> layer(m, comm, o, policy);
    const std::size_t N = 6, H = 16;
    std::vector<float> x(N * H, 0.5f), w(N * 2, 0.25f), y(N * H), gx(N * H), gw(N * 2);
    std::vector<std::int32_t> ids(N * 2);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 5 + 1) % 8);
    unit_experts e;
    auto s = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(y), e, epx::mode::train);
    auto& r = out[static_cast<std::size_t>(comm.rank())];
    r.forward = layer.stats().host_syncs;
    layer.backward(std::move(s), epx::span<const float>(y), epx::span<float>(gx), epx::span<float>(gw), e);
    r.backward = layer.stats().host_syncs;
    auto h = layer.dispatch(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                            epx::mode::train);
    e.forward(policy, h.inputs(), h.outputs().data());
    auto s2 = layer.combine(h, h.outputs(), epx::span<float>(y));
    r.split_forward = layer.stats().host_syncs;
    auto g = layer.backward_dispatch(std::move(s2), epx::span<const float>(y), epx::span<float>(gw));
    e.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
    layer.backward_combine(g, g.grad_inputs(), epx::span<float>(gx));
    r.split_backward = layer.stats().host_syncs;
  });
  return out;
}

}  // namespace

TEST_CASE("device path: one host synchronisation per call with a device communicator") {
  const epx::mesh_config mc{2, 4, 1, 1, 4, 8, 0};
  auto as_queued = [](epx::threads::communicator c, const emu& p) { return queued_comm(std::move(c), p); };
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_to_all>(mc, as_queued)) {
    CHECK(s.forward == 2);   // the plan's read-back (counts, offsets, bad-pair flags), the count exchange
    CHECK(s.backward == 1);  // the shape check's exchange
    // Split phase: one more each, the combine start's agreement on the handles.
    CHECK(s.split_forward == 3);
    CHECK(s.split_backward == 2);
  }
  // Host communicator: each collective over device buffers waits for the policy first.
  auto as_is = [](epx::threads::communicator c, const emu&) { return c; };
  for (const auto& s : count_syncs<epx::threads::communicator, epx::impl::all_to_all>(mc, as_is)) {
    CHECK(s.forward == 4);   // plan read-back, the dispatch, the return, the TP all-reduce
    CHECK(s.backward == 3);  // the dispatch of gradients, their return, the TP all-reduces
    CHECK(s.split_forward == 4);  // the agreement on the handles travels in host memory
    CHECK(s.split_backward == 3);
  }
}

TEST_CASE("device path: the masked path with a device communicator") {
  const epx::mesh_config mc{4, 2, 1, 1, 4, 8, 0};  // ep == tp
  auto as_queued = [](epx::threads::communicator c, const emu& p) { return queued_comm(std::move(c), p); };
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_reduce>(mc, as_queued)) {
    CHECK(s.forward == 2);
    CHECK(s.backward == 1);
  }
}

TEST_CASE("device path: a device communicator on another queue than the policy is refused on every rank") {
  std::vector<std::string> msgs(4);
  epx::threads::run(4, [&](epx::threads::communicator& world) {
    const epx::mesh m(epx::mesh_config{1, 4, 1, 1, 4, 8, 0});
    epx::layer_options o;
    o.hidden = 4;
    o.top_k = 1;
    emu mine;
    mine.queue = 1;
    emu other = mine;
    other.queue = 2;
    queued_comm comm(std::move(world), other);
    try {
      epx::moe_layer<queued_comm, float, epx::impl::all_to_all, emu> layer(m, comm, o, mine);
    } catch (const epx::error& e) {
      if (e.category() == epx::errc::configuration) msgs[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& m : msgs) {
    CAPTURE(m);
    CHECK(m.find("another device queue") != std::string::npos);
  }
}
