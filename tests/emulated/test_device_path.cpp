// What the device path pays for, counted on exec::emulated_device: host synchronisations
// per call (layer_stats::host_syncs), with a host communicator (threads: a wait before each
// collective over device buffers) and with a device communicator (collectives on the
// policy's queue: the count exchange's one read-back per call); and the layer refusing a
// device communicator whose queue is not the policy's.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"
#include "support/copy_experts.hpp"
#include "support/forwarding_comm.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_device_path_cpp {

// This label's executables take the algorithms' device variants on the CPU.
static_assert(EPX_DEVICE_ALGORITHMS == 1, "the emulated label builds the device variants (tests/CMakeLists.txt)");
// With CCCL (Thrust), capacity by score selects with a sort here as under exec::cuda, so
// the capacity tests of this label check that route against the float64 reference.
static_assert(epx::detail::score_by_sort_v<epx::exec::emulated_device> == (EPX_HAS_CCCL == 1));

namespace {

using emu = epx::exec::emulated_device;

// The threads communicator presented as a device communicator: its collectives count as
// queued on `queue` of the emulated device (the emulated policy runs eagerly, so work
// before a collective has finished when the collective starts, as on one CUDA stream).
class queued_comm : public epx::test::forwarding_comm<epx::threads::communicator> {
 public:
  queued_comm(epx::threads::communicator comm, emu q) : forwarding_comm{std::move(comm)}, q_(std::move(q)) {}
  queued_comm split(int color, int key) const { return queued_comm(c.split(color, key), q_); }
  emu execution() const { return q_; }
  void set_queue(const emu& q) { q_ = q; }  // as a CUDA communicator's set_stream

 private:
  emu q_;
};
static_assert(epx::check_communicator<queued_comm>());
static_assert(epx::detail::is_device_communicator_v<queued_comm>);
static_assert(!epx::detail::is_device_communicator_v<epx::threads::communicator>);

struct syncs {
  long long forward = -1, backward = -1, inference = -1;
  epx::bound_report report;
  long long split_forward = -1, split_backward = -1;  // the same calls through the split phase
};

// One forward and backward of an 8-rank layer (tp=2, fsdp=4, ep=4) on Comm, Impl; the pairs
// go to the first `used` experts (0: 4 in bounded mode, all 8 otherwise).
template <class Comm, class Impl, class Make>
std::vector<syncs> count_syncs(const epx::mesh_config& mc, Make make_comm, epx::layer_options o = {},
                               std::int64_t bound = 0, int used = 0) {
  std::vector<syncs> out(8);
  epx::threads::run(8, [&, o](epx::threads::communicator& world) mutable {
    const epx::mesh m(mc);
    o.hidden = 16;
    o.top_k = 2;
    if (bound > 0) {  // bounded mode (spec section 11)
      o.counts = epx::count_exchange::device;
      o.bound.cap = bound;
    }
    emu policy;
    Comm comm = make_comm(std::move(world), policy);
    epx::moe_layer<Comm, float, Impl, emu> layer(m, comm, o, policy);
    const std::size_t N = 6, H = 16;
    std::vector<float> x(N * H, 0.5f), w(N * 2, 0.25f), y(N * H), gx(N * H), gw(N * 2);
    std::vector<std::int32_t> ids(N * 2);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 5 + 1) % (used > 0 ? used : bound > 0 ? 4 : 8));
    epx::test::copy_experts e;
    auto s = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(y), e, epx::mode::train);
    auto& r = out[static_cast<std::size_t>(comm.rank())];
    r.forward = layer.stats().host_syncs;
    layer.backward(std::move(s), epx::span<const float>(y), epx::span<float>(gx), epx::span<float>(gw), e);
    r.backward = layer.stats().host_syncs;
    if (bound > 0) {
      // A second forward (inference, the layer's own buffers), then the synchronising check.
      (void)layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                          epx::span<float>(y), e, epx::mode::inference);
      r.inference = layer.stats().host_syncs;
      r.report = layer.check();
    } else {
      auto h = layer.dispatch(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                              epx::mode::train);
      e.forward(policy, h.inputs(), h.outputs().data());
      auto s2 = layer.combine(h, h.outputs(), epx::span<float>(y));
      r.split_forward = layer.stats().host_syncs;
      auto g = layer.backward_dispatch(std::move(s2), epx::span<const float>(y), epx::span<float>(gw));
      e.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
      layer.backward_combine(g, g.grad_inputs(), epx::span<float>(gx));
      r.split_backward = layer.stats().host_syncs;
    }
  });
  return out;
}

}  // namespace

TEST_CASE("device path: one host synchronisation per call with a device communicator") {
  const epx::mesh_config mc{2, 4, 1, 1, 4, 8, 0};
  auto as_queued = [](epx::threads::communicator c, const emu& p) { return queued_comm(std::move(c), p); };
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_to_all>(mc, as_queued)) {
    CHECK(s.forward == 1);   // the count exchange: status with the bad-pair flag, shapes, counts
    CHECK(s.backward == 1);  // the shape check's exchange
    // Split phase: one more each, the combine start's agreement on the handles.
    CHECK(s.split_forward == 2);
    CHECK(s.split_backward == 2);
  }
  // Node figures and a capacity travel in the same record: still one.
  epx::layer_options o;
  o.ranks_per_node = 2;
  o.capacity.mode = epx::capacity_mode::global;
  o.capacity.factor = 0.5;
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_to_all>(mc, as_queued, o)) {
    CHECK(s.forward == 1);
    CHECK(s.backward == 1);
  }
  // Per-rank sends (spec section 14): the plan is made on the host, so forward reads back
  // the send positions and weights, the unique-row counts and the received slot entries:
  // three more. Backward makes none of its own.
  epx::layer_options pr;
  pr.sends = epx::row_sends::per_rank;
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_to_all>(mc, as_queued, pr)) {
    CHECK(s.forward == 4);
    CHECK(s.backward == 1);
    CHECK(s.split_forward == 5);
    CHECK(s.split_backward == 2);
  }
  // The staged route in rounds (a stage of one slice row, so each slice's 3 rows go in 3
  // rounds; inference forwards and backward): backward plans its rounds on the host from the
  // read-back send positions and source rows, one wait, and reads back how many rows each
  // source sends in each round, another. Forward in training makes one round.
  epx::layer_options rounds;
  rounds.stage_bytes = 1;
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_to_all>(mc, as_queued, rounds)) {
    CHECK(s.forward == 1);
    CHECK(s.backward == 3);
    CHECK(s.split_forward == 2);
    CHECK(s.split_backward == 4);
  }
  // Host communicator: each collective over device buffers waits for the policy first. The
  // threads communicator has peer access, so this is the direct route, where the policy's
  // reads of the peers' buffers must also have finished before the host leaves the access
  // (the exit barrier is the host's): a wait on each side of each access.
  auto as_is = [](epx::threads::communicator c, const emu&) { return c; };
  for (const auto& s : count_syncs<epx::threads::communicator, epx::impl::all_to_all>(mc, as_is)) {
    CHECK(s.forward == 6);   // the record's read-back, the pull (2), the combine (2), the TP all-reduce
    CHECK(s.backward == 5);  // the pull of gradients with the weight gradients (2), the input
                             // gradients' sum (2), the TP all-reduces
    CHECK(s.split_forward == 6);  // the agreement on the handles travels in host memory
    CHECK(s.split_backward == 5);
  }
  // The staged route on the same communicator: one wait before each collective.
  epx::layer_options staged;
  staged.peer_access = false;
  for (const auto& s : count_syncs<epx::threads::communicator, epx::impl::all_to_all>(mc, as_is, staged)) {
    CHECK(s.forward == 4);   // the record's read-back, the dispatch, the return, the TP all-reduce
    CHECK(s.backward == 3);  // the dispatch of gradients, their return, the TP all-reduces
    CHECK(s.split_forward == 4);
    CHECK(s.split_backward == 3);
  }
}

TEST_CASE("device path: bounded mode makes no host synchronisation in forward, backward or inference (both paths)") {
  const epx::mesh_config mc{2, 4, 1, 1, 4, 8, 0};  // tp = 2, ep = 4
  auto as_queued = [](epx::threads::communicator c, const emu& p) { return queued_comm(std::move(c), p); };
  for (const std::int64_t cap : {std::int64_t{8}, std::int64_t{1}}) {  // nothing dropped; overflow
    CAPTURE(cap);
    for (const auto& s : count_syncs<queued_comm, epx::impl::all_to_all>(mc, as_queued, {}, cap)) {
      CHECK(s.forward == 0);
      CHECK(s.backward == 0);
      CHECK(s.inference == 0);
      CHECK(s.report.calls == 8);  // two forward calls on each of the 4 ranks of the EP group
      CHECK((s.report.overflow_pairs > 0) == (cap == 1));
    }
  }
  // A host communicator waits for the policy before each collective over device buffers:
  // the two exchanges of forward and backward and the TP all-reduces, nothing else.
  auto as_is = [](epx::threads::communicator c, const emu&) { return c; };
  for (const auto& s : count_syncs<epx::threads::communicator, epx::impl::all_to_all>(mc, as_is, {}, 8)) {
    CHECK(s.forward == 3);
    CHECK(s.backward == 3);
  }
  // The masked path (ep == tp) in bounded mode: none either; its only collective is the
  // output's all-reduce (backward: grad_x and the routing-weight gradients). Every row goes
  // to experts 0 and 1, so that the slices of two rows overflow cap 1.
  const epx::mesh_config masked{4, 2, 1, 1, 4, 8, 0};  // tp = ep = 4
  for (const std::int64_t cap : {std::int64_t{8}, std::int64_t{1}}) {
    CAPTURE(cap);
    for (const auto& s : count_syncs<queued_comm, epx::impl::all_reduce>(masked, as_queued, {}, cap, 2)) {
      CHECK(s.forward == 0);
      CHECK(s.backward == 0);
      CHECK(s.inference == 0);
      CHECK(s.report.calls == 8);
      CHECK((s.report.overflow_pairs > 0) == (cap == 1));
    }
  }
  for (const auto& s : count_syncs<epx::threads::communicator, epx::impl::all_reduce>(masked, as_is, {}, 8)) {
    CHECK(s.forward == 1);   // the all-reduce of the output
    CHECK(s.backward == 1);  // one wait before both all-reduces
  }
}

TEST_CASE("device path: the masked path with a device communicator") {
  const epx::mesh_config mc{4, 2, 1, 1, 4, 8, 0};  // ep == tp
  auto as_queued = [](epx::threads::communicator c, const emu& p) { return queued_comm(std::move(c), p); };
  for (const auto& s : count_syncs<queued_comm, epx::impl::all_reduce>(mc, as_queued)) {
    CHECK(s.forward == 1);   // the record exchange (shapes, bad-pair flag, this rank's counts)
    CHECK(s.backward == 1);  // the shape check's exchange
  }
  auto as_is = [](epx::threads::communicator c, const emu&) { return c; };
  for (const auto& s : count_syncs<epx::threads::communicator, epx::impl::all_reduce>(mc, as_is)) {
    CHECK(s.forward == 2);   // the record's read-back, the EP all-reduce
    CHECK(s.backward == 1);  // the EP all-reduces (one wait before both)
  }
}

namespace {
// A bad expert id on rank `bad` of a device communicator: every rank raises errc::input
// naming it, within the threads communicator's timeout (no hang).
template <class Impl>
std::vector<std::string> bad_id_messages(const epx::mesh_config& mc, int bad) {
  std::vector<std::string> msgs(8);
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(20);
  epx::threads::run(
      8,
      [&](epx::threads::communicator& world) {
        const epx::mesh m(mc);
        epx::layer_options o;
        o.hidden = 16;
        o.top_k = 2;
        emu policy;
        queued_comm comm(std::move(world), policy);
        epx::moe_layer<queued_comm, float, Impl, emu> layer(m, comm, o, policy);
        const std::size_t N = 6, H = 16;
        std::vector<float> x(N * H, 0.5f), w(N * 2, 0.25f), y(N * H);
        std::vector<std::int32_t> ids(N * 2);
        for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 5 + 1) % 8);
        if (comm.rank() == bad)  // slot 1 of every token, so the rank's own TP slice holds one
          for (std::size_t t = 0; t < N; ++t) ids[2 * t + 1] = 8;
        epx::test::copy_experts e;
        try {
          layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                        epx::span<float>(y), e, epx::mode::train);
        } catch (const epx::error& err) {
          if (err.category() == epx::errc::input) msgs[static_cast<std::size_t>(comm.rank())] = err.what();
        }
      },
      opts);
  return msgs;
}
}  // namespace

TEST_CASE("device path: bad input found on the device raises on every rank of the EP group") {
  auto check = [](const std::vector<std::string>& msgs, const epx::mesh_config& mc, int bad) {
    const epx::mesh m(mc);
    const auto group = m.group_members(epx::group_kind::ep, bad);
    const std::string want = "rank " + std::to_string(bad) + ": expert id (8) of token ";
    for (int r = 0; r < 8; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[static_cast<std::size_t>(r)]);
      const bool in_group = std::find(group.begin(), group.end(), r) != group.end();
      CHECK((msgs[static_cast<std::size_t>(r)].find(want) != std::string::npos) == in_group);
    }
  };
  const epx::mesh_config a2a{2, 4, 1, 1, 4, 8, 0}, masked{4, 2, 1, 1, 4, 8, 0};
  for (int bad : {0, 3, 6}) {
    check(bad_id_messages<epx::impl::all_to_all>(a2a, bad), a2a, bad);
    check(bad_id_messages<epx::impl::all_reduce>(masked, bad), masked, bad);
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

// set_stream on the layer's communicators after construction: each collective call raises
// before anything is queued, and a call after the queue is set back goes through (the
// saved state of a refused backward is still there).
TEST_CASE("device path: a communicator's queue changed after construction is refused at each call") {
  struct seen {
    std::string forward, backward, dispatch, check;
    bool retried = false;
  };
  std::vector<seen> got(4);
  epx::threads::run(4, [&](epx::threads::communicator& world) {
    const epx::mesh m(epx::mesh_config{1, 4, 1, 1, 4, 8, 0});
    epx::layer_options o;
    o.hidden = 4;
    o.top_k = 1;
    emu mine;
    mine.queue = 1;
    emu other = mine;
    other.queue = 2;
    queued_comm comm(std::move(world), mine);
    epx::moe_layer<queued_comm, float, epx::impl::all_to_all, emu> layer(m, comm, o, mine);
    auto& r = got[static_cast<std::size_t>(comm.rank())];
    const std::size_t N = 3, H = 4;
    std::vector<float> x(N * H, 0.5f), w(N, 1.0f), y(N * H), gx(N * H), gw(N);
    std::vector<std::int32_t> ids{0, 3, 6};
    epx::test::copy_experts e;
    auto forward = [&](epx::mode md) {
      return layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                           epx::span<float>(y), e, md);
    };
    auto message = [](auto&& call) -> std::string {
      try {
        call();
      } catch (const epx::error& e) {
        return e.category() == epx::errc::configuration ? e.what() : std::string("another error: ") + e.what();
      }
      return "no error";
    };
    auto saved = forward(epx::mode::train);
    layer.ep_communicator().set_queue(other);
    r.forward = message([&] { (void)forward(epx::mode::inference); });
    r.backward = message([&] {
      layer.backward(std::move(saved), epx::span<const float>(y), epx::span<float>(gx), epx::span<float>(gw), e);
    });
    layer.ep_communicator().set_queue(mine);
    layer.tp_communicator().set_queue(other);
    r.dispatch = message([&] {
      (void)layer.dispatch_start(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                                 epx::span<const float>(w), epx::mode::inference);
    });
    layer.tp_communicator().set_queue(mine);
    layer.backward(std::move(saved), epx::span<const float>(y), epx::span<float>(gx), epx::span<float>(gw), e);
    r.retried = std::all_of(gx.begin(), gx.end(), [](float v) { return v == 0.5f; });
  });
  for (const auto& r : got) {
    CAPTURE(r.forward);
    CAPTURE(r.backward);
    CAPTURE(r.dispatch);
    CHECK(r.forward.find("moe_layer forward") != std::string::npos);
    CHECK(r.forward.find("the layer's ep communicator no longer matches") != std::string::npos);
    CHECK(r.forward.find("another device queue") != std::string::npos);
    CHECK(r.backward.find("moe_layer backward") != std::string::npos);
    CHECK(r.backward.find("ep communicator") != std::string::npos);
    CHECK(r.dispatch.find("moe_layer dispatch_start") != std::string::npos);
    CHECK(r.dispatch.find("the layer's tp communicator no longer matches") != std::string::npos);
    CHECK(r.retried);
  }
}

}  // namespace test_device_path_cpp
