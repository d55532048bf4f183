// Device memory only, on every path of the layer: a device communicator (NCCL on a GPU)
// reads and writes device memory alone, so every buffer the layer hands one must be the
// policy's memory, never a host array. On the CPU the emulated device's memory is host
// memory and forgives the mistake; here `device_only_comm`, the threads communicator
// presented as a device communicator on the policy's queue, asks exec::emulated_device's
// registry of live buffers (exec::emulated_device_memory) about every buffer of every
// collective and logs those that are not device memory. The layer runs with its inputs and
// outputs in the policy's buffers, as they are on a GPU: construction, training forward,
// backward and the expert hook, an inference forward, the split-phase calls, and
// moe_layer::check() in bounded mode, on both paths and with the options that add
// collectives (capacity, node statistics, rounds, one row per rank, FP8 dispatch); then
// routing::sum_over_batches. Each run's results equal, bitwise, those of the same layer over
// the plain threads communicator.
#include <doctest/doctest.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#ifndef EPX_TEST_EXEC
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#endif
#include "core/fp8_layer_cases.hpp"
#include "epx/comm/threads.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_device_memory_cpp {
// A device policy whose memory the host may not touch, as exec::cuda's (host_addressable
// is false): otherwise the emulated device, whose functions it takes.
struct opaque_device : epx::exec::emulated_device {};
}  // namespace test_device_memory_cpp

template <class T>
struct epx::exec::buffer_for<T, test_device_memory_cpp::opaque_device> {
  using type = emulated_buffer<T>;
};

namespace test_device_memory_cpp {
static_assert(epx::exec::check_execution_policy<opaque_device>());
static_assert(!epx::exec::host_addressable_v<opaque_device>);
static_assert(epx::exec::host_addressable_v<epx::exec::emulated_device>);

namespace {

using emu = epx::exec::emulated_device;
using epx::datatype;
using log_t = std::shared_ptr<std::vector<std::string>>;

class device_only_comm {
 public:
  device_only_comm(epx::threads::communicator c, emu q, log_t log)
      : c_(std::move(c)), q_(std::move(q)), log_(std::move(log)) {}
  int rank() const noexcept { return c_.rank(); }
  int size() const noexcept { return c_.size(); }
  device_only_comm split(int color, int key) const { return device_only_comm(c_.split(color, key), q_, log_); }
  emu execution() const { return q_; }

  void all_to_all(const void* s, void* r, std::size_t n, datatype t) {
    check("all_to_all", "send", s, n * peers(), t);
    check("all_to_all", "recv", r, n * peers(), t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.all_to_all(s, r, n, t);
  }
  void all_to_allv(const void* s, const std::size_t* sc, const std::size_t* sd, void* r, const std::size_t* rc,
                   const std::size_t* rd, datatype t) {
    check("all_to_allv", "send", s, extent(sc, sd, peers()), t);
    check("all_to_allv", "recv", r, extent(rc, rd, peers()), t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.all_to_allv(s, sc, sd, r, rc, rd, t);
  }
  void all_to_allv_segments(const void* s, const std::size_t* sc, const std::size_t* sd, void* r,
                            const std::size_t* rc, const std::size_t* rd, std::size_t nseg, datatype t) {
    check("all_to_allv_segments", "send", s, extent(sc, sd, peers() * nseg), t);
    check("all_to_allv_segments", "recv", r, extent(rc, rd, peers() * nseg), t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.all_to_allv_segments(s, sc, sd, r, rc, rd, nseg, t);
  }
  void all_reduce(const void* s, void* r, std::size_t n, datatype t, double scale) {
    check("all_reduce", "send", s, n, t);
    check("all_reduce", "recv", r, n, t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.all_reduce(s, r, n, t, scale);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, datatype t, double scale) {
    check("reduce_scatter", "send", s, n * peers(), t);
    check("reduce_scatter", "recv", r, n, t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.reduce_scatter(s, r, n, t, scale);
  }
  void all_gather(const void* s, void* r, std::size_t n, datatype t) {
    check("all_gather", "send", s, n, t);
    check("all_gather", "recv", r, n * peers(), t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.all_gather(s, r, n, t);
  }
  void broadcast(void* d, std::size_t n, datatype t, int root) {
    check("broadcast", "data", d, n, t);
    const epx::exec::emulated_launch_scope on_device;  // the collective runs on the device
    epx::exec::emulated_collective_queued();
    c_.broadcast(d, n, t, root);
  }
  void barrier() { c_.barrier(); }
  // The bounded wait of a device communicator (NCCL's polls the stream with a timeout).
  void wait() { epx::exec::emulated_collective_waited(); }

 private:
  std::size_t peers() const { return static_cast<std::size_t>(c_.size()); }
  static std::size_t extent(const std::size_t* counts, const std::size_t* displs, std::size_t m) {
    std::size_t e = 0;
    for (std::size_t i = 0; i < m; ++i)
      if (counts[i] != 0) e = std::max(e, displs[i] + counts[i]);
    return e;
  }
  void check(const char* op, const char* which, const void* p, std::size_t count, datatype t) {
    const std::size_t bytes = count * epx::size_of(t);
    if (bytes != 0 && !epx::exec::emulated_device_memory(p, bytes))
      log_->push_back(epx::detail::concat(op, ": the ", which, " buffer (", bytes, " bytes of ", epx::to_string(t),
                                          ") is not device memory"));
  }

  epx::threads::communicator c_;
  emu q_;
  log_t log_;
};
static_assert(epx::check_communicator<device_only_comm>());
static_assert(epx::detail::is_device_communicator_v<device_only_comm>);

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
epx::exec::emulated_buffer<T> on_device(const std::vector<T>& v) {
  epx::exec::emulated_buffer<T> b(v.size());
  const epx::exec::emulated_launch_scope copy;
  std::copy(v.begin(), v.end(), b.data());
  return b;
}
template <class T>
std::vector<T> on_host(const epx::exec::emulated_buffer<T>& b) {
  const epx::exec::emulated_launch_scope copy;
  return std::vector<T>(b.data(), b.data() + b.size());
}

// Experts run on the device: in strict mode their host loops open a launch scope.
template <class Inner>
struct on_device_experts {
  Inner inner;
  template <class Exec, class Rows, class T>
  auto forward(const Exec& ex, const Rows& in, T* out) -> decltype(inner.forward(ex, in, out)) {
    const epx::exec::emulated_launch_scope on_device;
    inner.forward(ex, in, out);
  }
  template <class Exec, class Rows, class S, class T>
  auto forward(const Exec& ex, const Rows& in, const S* scales, T* out) -> decltype(inner.forward(ex, in, scales, out)) {
    const epx::exec::emulated_launch_scope on_device;
    inner.forward(ex, in, scales, out);
  }
  template <class Exec, class Rows, class T>
  auto backward(const Exec& ex, const Rows& in, const T* g, T* gi) -> decltype(inner.backward(ex, in, g, gi)) {
    const epx::exec::emulated_launch_scope on_device;
    inner.backward(ex, in, g, gi);
  }
};

// Strict mode of the emulated device for a scope: a host access to its buffers outside a
// launch scope faults, and the handler says so before the process ends.
extern "C" inline void on_strict_fault(int, siginfo_t* info, void*) {
  const bool device = epx::exec::emulated_device_memory(info->si_addr, 1);
  const char* msg = device ? "test_device_memory: the host touched emulated device memory outside a launch scope "
                             "(a host read of device memory on a GPU); the stack of this fault names the code\n"
                           : "test_device_memory: segmentation fault\n";
  (void)!::write(2, msg, std::strlen(msg));
  std::signal(SIGSEGV, SIG_DFL);
  std::raise(SIGSEGV);
}
class strict_memory {
 public:
  explicit strict_memory(bool on) : on_(on && epx::exec::emulated_strict_memory(true)) {
    if (!on_) return;
    struct sigaction sa {};
    sa.sa_sigaction = &on_strict_fault;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &sa, &old_);
  }
  ~strict_memory() {
    if (!on_) return;
    epx::exec::emulated_strict_memory(false);
    sigaction(SIGSEGV, &old_, nullptr);
  }
  strict_memory(const strict_memory&) = delete;
  strict_memory& operator=(const strict_memory&) = delete;

 private:
  bool on_;
  struct sigaction old_ {};
};
template <class T>
epx::span<const T> cspan(const epx::exec::emulated_buffer<T>& b) {
  return epx::span<const T>(b.data(), b.size());
}
template <class T>
epx::span<T> mspan(epx::exec::emulated_buffer<T>& b) {
  return epx::span<T>(b.data(), b.size());
}

// What a rank computed: the fused training call's outputs and gradients, the expert
// gradients after the hook, the inference output, the split-phase step's output and
// gradients (or, in bounded mode, check()'s report), what the communicator logged, and
// the host waits made while one of its collectives was queued but not waited for.
template <class T>
struct rank_result {
  std::vector<T> out, grad_x, out_inference, out_split, grad_x_split;
  std::vector<float> grad_w, grad_w_split;
  std::vector<double> expert_grads;
  std::vector<std::int64_t> report;  // overflow pairs, calls, dropped per expert
  std::vector<std::string> log;
  long long unbounded_waits = 0;
  bool direct = false;  // the training forward took the direct route (layer_stats::peer_access)
  std::string error;
};

// One rank: the layer over Comm with every buffer in the policy's memory; `fp8` runs the
// FP8 experts (and only the fused calls), `bounded` adds moe_layer::check().
template <class T, class Impl, class Comm>
rank_result<T> run_rank(Comm& comm, const epx::test::layer_case& c, const epx::layer_options& o, emu policy) {
  using namespace epx;
  rank_result<T> r;
  const mesh m(c.topology);
  const int rank = comm.rank(), b = m.batch(rank);
  const test::batch_data d = test::make_batch<T>(c, b);
  const std::size_t N = c.rows_of(b), H = static_cast<std::size_t>(c.hidden), k = static_cast<std::size_t>(c.top_k);
  const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  auto x = on_device(ref::from_double<T>(d.x));
  auto go = on_device(ref::from_double<T>(d.grad_out));
  auto ids = on_device(d.ids);
  auto w = on_device(std::vector<float>(d.w.begin(), d.w.end()));
  exec::emulated_buffer<T> out(N * H), gx(N * H);
  exec::emulated_buffer<float> gw(N * k);
  moe_layer<Comm, T, Impl, emu> layer(m, comm, o, policy);
  if (o.fp8_dispatch) {
    on_device_experts<test::fp8_scale_experts<T>> experts;
    experts.inner.first = m.expert_begin(rank);
    auto saved = layer.forward(cspan(x), cspan(ids), cspan(w), mspan(out), experts, mode::train);
    r.direct = layer.stats().peer_access;
    layer.backward(std::move(saved), cspan(go), mspan(gx), mspan(gw), experts);
  } else {
    on_device_experts<ref::test_linear_experts<T>> experts{
        ref::test_linear_experts<T>(global, m.ep_rank(rank), m.local_experts())};
    auto saved = layer.forward(cspan(x), cspan(ids), cspan(w), mspan(out), experts, mode::train);
    r.direct = layer.stats().peer_access;
    layer.backward(std::move(saved), cspan(go), mspan(gx), mspan(gw), experts);
    auto grads = on_device(experts.inner.grads());
    gradient_hooks<Comm> hooks(m, comm);
    hooks.reduce_expert(mspan(grads));
    r.expert_grads = on_host(grads);
    // An inference forward, then the split-phase calls of a training step.
    exec::emulated_buffer<T> out2(N * H), gx2(N * H);
    exec::emulated_buffer<float> gw2(N * k);
    (void)layer.forward(cspan(x), cspan(ids), cspan(w), mspan(out2), experts, mode::inference);
    r.out_inference = on_host(out2);
    if (o.counts == count_exchange::host) {
      auto h = layer.dispatch(cspan(x), cspan(ids), cspan(w), mode::train);
      experts.forward(policy, h.inputs(), h.outputs().data());
      auto s = layer.combine(h, h.outputs(), mspan(out2));
      auto g = layer.backward_dispatch(std::move(s), cspan(go), mspan(gw2));
      experts.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
      layer.backward_combine(g, g.grad_inputs(), mspan(gx2));
      r.out_split = on_host(out2);
      r.grad_x_split = on_host(gx2);
      r.grad_w_split = on_host(gw2);
    } else {
      const bound_report rep = layer.check();
      r.report = {rep.overflow_pairs, rep.calls};
      r.report.insert(r.report.end(), rep.dropped_per_expert.begin(), rep.dropped_per_expert.end());
    }
  }
  r.out = on_host(out);
  r.grad_x = on_host(gx);
  r.grad_w = on_host(gw);
  r.unbounded_waits = exec::emulated_unbounded_waits();
  return r;
}

// Runs the case on 8 ranks over device_only_comm and over the plain threads communicator;
// returns what went wrong ("" when every rank logged nothing and the two agree bitwise).
template <class T, class Impl = epx::impl::all_to_all>
std::string run_case(const epx::test::layer_case& c, const epx::layer_options& o) {
  const int P = epx::mesh(c.topology).world();
  std::vector<rank_result<T>> checked(static_cast<std::size_t>(P)), plain(checked.size());
  auto body = [&](bool device_only) {
    return [&, device_only](epx::threads::communicator& world) {
      auto& r = (device_only ? checked : plain)[static_cast<std::size_t>(world.rank())];
      try {
        emu policy;
        if (device_only) {
          auto log = std::make_shared<std::vector<std::string>>();
          device_only_comm comm(std::move(world), policy, log);
          r = run_rank<T, Impl>(comm, c, o, policy);
          r.log = *log;
        } else {
          r = run_rank<T, Impl>(world, c, o, policy);
        }
      } catch (const std::exception& e) {
        r.error = e.what();
      }
    };
  };
  {
    const strict_memory strict(true);  // the host may touch the policy's memory only where a GPU's host could
    epx::threads::run(P, body(true));
  }
  epx::threads::run(P, body(false));
  std::string f;
  std::map<std::string, std::string> logged;  // message -> the ranks that logged it
  for (int q = 0; q < P; ++q) {
    const auto& a = checked[static_cast<std::size_t>(q)];
    const auto& b = plain[static_cast<std::size_t>(q)];
    const std::string where = epx::detail::concat(c.describe(), " rank ", q, ": ");
    if (!a.error.empty() || !b.error.empty()) f += where + "raised: " + a.error + " / " + b.error + "\n";
    for (const auto& l : std::set<std::string>(a.log.begin(), a.log.end()))
      logged[l] += epx::detail::concat(logged[l].empty() ? "" : ",", q);
    if (!(same_bits(a.out, b.out) && same_bits(a.grad_x, b.grad_x) && same_bits(a.grad_w, b.grad_w) &&
          same_bits(a.expert_grads, b.expert_grads) && same_bits(a.out_inference, b.out_inference) &&
          same_bits(a.out_split, b.out_split) && same_bits(a.grad_x_split, b.grad_x_split) &&
          same_bits(a.grad_w_split, b.grad_w_split) && a.report == b.report))
      f += where + "results differ from the plain threads communicator's\n";
    if (a.unbounded_waits != 0)
      f += where + epx::detail::concat(a.unbounded_waits, " host wait(s) while a collective was queued and not waited "
                                       "for through the communicator's bounded wait\n");
  }
  for (const auto& [l, ranks] : logged) f += c.describe() + " ranks " + ranks + ": " + l + "\n";
  return f;
}

// The threads communicator over the emulated device's memory, as threads::device_memory()
// is over one GPU's (epx/comm/threads/cuda.cuh): blocks move by a copy the host may not
// make itself (here a memcpy inside a launch scope, as a device copy), and sums are staged
// through the host.
bool device_copy(void* dst, const void* src, std::size_t bytes) noexcept {
  const auto on_device = epx::exec::launch_scope(emu{});
  std::memcpy(dst, src, bytes);
  return true;
}
epx::threads::options emulated_device_memory() {
  epx::threads::options o;
  o.memory.copy = &device_copy;
  o.memory.host_accessible = false;
  o.memory.name = "emulated device";
  return o;
}

// The direct route on the device policy: the threads communicator over the policy's memory
// (above), in strict mode (the host builds the row tables from the layout and the peers'
// pointers without touching the policy's memory; kernels::peer_table reads the senders'
// positions), against the staged route over the same communicator, bitwise.
template <class T>
std::string run_direct_case(const epx::test::layer_case& c, epx::layer_options o) {
  const int P = epx::mesh(c.topology).world();
  std::vector<rank_result<T>> direct(static_cast<std::size_t>(P)), staged(direct.size());
  auto body = [&](std::vector<rank_result<T>>& into, const epx::layer_options& opt) {
    return [&into, opt, &c](epx::threads::communicator& world) {
      auto& r = into[static_cast<std::size_t>(world.rank())];
      try {
        r = run_rank<T, epx::impl::all_to_all>(world, c, opt, emu{});
      } catch (const std::exception& e) {
        r.error = e.what();
      }
    };
  };
  o.peer_access = true;
  {
    const strict_memory strict(true);
    epx::threads::run(P, body(direct, o), emulated_device_memory());
  }
  o.peer_access = false;
  epx::threads::run(P, body(staged, o), emulated_device_memory());
  std::string f;
  for (int q = 0; q < P; ++q) {
    const auto& a = direct[static_cast<std::size_t>(q)];
    const auto& b = staged[static_cast<std::size_t>(q)];
    const std::string where = epx::detail::concat(c.describe(), " rank ", q, ": ");
    if (!a.error.empty() || !b.error.empty()) f += where + "raised: " + a.error + " / " + b.error + "\n";
    if (!a.direct || b.direct) f += epx::detail::concat(where, "routes: direct run ", a.direct, ", staged run ", b.direct, "\n");
    if (!(same_bits(a.out, b.out) && same_bits(a.grad_x, b.grad_x) && same_bits(a.grad_w, b.grad_w) &&
          same_bits(a.expert_grads, b.expert_grads) && same_bits(a.out_inference, b.out_inference) &&
          same_bits(a.out_split, b.out_split) && same_bits(a.grad_x_split, b.grad_x_split) &&
          same_bits(a.grad_w_split, b.grad_w_split)))
      f += where + "the direct route's results differ from the staged route's\n";
  }
  return f;
}

epx::test::layer_case make_case(int tp, int fsdp, int ep, int experts, int k, int hidden) {
  epx::test::layer_case c;
  c.topology = epx::mesh_config{tp, fsdp, 1, 1, ep, experts, 0};
  c.top_k = k;
  c.hidden = hidden;
  c.peer_access = false;
  return c;
}

}  // namespace

TEST_CASE("device memory: a new buffer holds 0xff bytes (NaN, -1), never zeros that a missed write would hide") {
  const emu ex;
  auto f = epx::exec::make_buffer<float>(ex, 37);
  auto i = epx::exec::make_buffer<std::int64_t>(ex, 5);
  const auto* fb = reinterpret_cast<const unsigned char*>(f.data());
  const auto* ib = reinterpret_cast<const unsigned char*>(i.data());
  for (std::size_t b = 0; b < 37 * sizeof(float); ++b) REQUIRE(fb[b] == 0xff);
  for (std::size_t b = 0; b < 5 * sizeof(std::int64_t); ++b) REQUIRE(ib[b] == 0xff);
  CHECK(i.data()[0] == -1);
}

TEST_CASE("device memory: a range is the policy's memory only when all of it lies in one live buffer") {
  const emu ex;
  auto a = epx::exec::make_buffer<float>(ex, 16);
  const float* p = a.data();
  CHECK(epx::exec::emulated_device_memory(p, 16 * sizeof(float)));
  CHECK(epx::exec::emulated_device_memory(p + 15, sizeof(float)));
  CHECK(epx::exec::emulated_device_memory(p + 4, 0));
  // One byte past the end, from the start or from inside, or just after the end: not.
  CHECK_FALSE(epx::exec::emulated_device_memory(p, 16 * sizeof(float) + 1));
  CHECK_FALSE(epx::exec::emulated_device_memory(p + 15, 2 * sizeof(float)));
  CHECK_FALSE(epx::exec::emulated_device_memory(p + 16, sizeof(float)));
  // A size so large that p + bytes wraps round to inside the buffer: not.
  CHECK_FALSE(epx::exec::emulated_device_memory(p + 4, SIZE_MAX - 3 * sizeof(float)));
  float host[4] = {};
  CHECK_FALSE(epx::exec::emulated_device_memory(host, sizeof host));
}

TEST_CASE("device memory: a device communicator gets only the policy's memory, on every path of the layer") {
  using epx::test::options_for;
  auto c = make_case(2, 4, 4, 8, 2, 16);  // 8 ranks, all-to-all path, tp 2
  SUBCASE("all-to-all path, the plain options") { CHECK(run_case<float>(c, options_for(c)) == ""); }
  SUBCASE("all-to-all path, global capacity and node statistics") {
    c.capacity.mode = epx::capacity_mode::global;
    c.capacity.factor = 0.75;
    c.ranks_per_node = 2;
    CHECK(run_case<float>(c, options_for(c)) == "");
  }
  SUBCASE("all-to-all path in rounds, bf16") {
    c.stage_bytes = 256;
    CHECK(run_case<epx::bf16>(c, options_for(c)) == "");
  }
  SUBCASE("one row per destination rank") {
    c.sends = epx::row_sends::per_rank;
    CHECK(run_case<float>(c, options_for(c)) == "");
  }
  SUBCASE("bounded mode") {
    auto o = options_for(c);
    o.counts = epx::count_exchange::device;
    o.bound.cap = 64;
    CHECK(run_case<float>(c, o) == "");
  }
  SUBCASE("FP8 dispatch") {
    c.hidden = 256;
    auto o = options_for(c);
    o.fp8_dispatch = true;
    CHECK(run_case<epx::bf16>(c, o) == "");
  }
  SUBCASE("masked path (ep == tp), normal and bounded, and the automatic choice") {
    auto m = make_case(2, 4, 2, 8, 2, 16);
    CHECK(run_case<float, epx::impl::all_reduce>(m, options_for(m)) == "");
    CHECK(run_case<float, epx::impl::automatic>(m, options_for(m)) == "");
    auto o = options_for(m);
    o.counts = epx::count_exchange::device;
    o.bound.cap = 64;
    CHECK(run_case<float, epx::impl::all_reduce>(m, o) == "");
  }
}

TEST_CASE("device memory: one rank in strict mode, where every host access outside a launch scope faults") {
  // With one rank no other thread holds a scope open, so the check is exact.
  using epx::test::options_for;
  auto c = make_case(1, 1, 1, 8, 2, 16);
  CHECK(run_case<float>(c, options_for(c)) == "");
  CHECK(run_case<float, epx::impl::all_reduce>(c, options_for(c)) == "");
  c.capacity.mode = epx::capacity_mode::global;
  c.capacity.factor = 0.75;
  c.ranks_per_node = 1;
  CHECK(run_case<float>(c, options_for(c)) == "");
  CHECK(run_case<float, epx::impl::all_reduce>(c, options_for(c)) == "");
  c = make_case(1, 1, 1, 8, 2, 16);
  c.stage_bytes = 256;
  CHECK(run_case<epx::bf16>(c, options_for(c)) == "");
  c.stage_bytes = 0;
  c.sends = epx::row_sends::per_rank;
  CHECK(run_case<float>(c, options_for(c)) == "");
  c.sends = epx::row_sends::per_slot;
  auto o = options_for(c);
  o.counts = epx::count_exchange::device;
  o.bound.cap = 64;
  CHECK(run_case<float>(c, o) == "");
  CHECK(run_case<float, epx::impl::all_reduce>(c, o) == "");
  c.hidden = 256;
  o = options_for(c);
  o.fp8_dispatch = true;
  CHECK(run_case<epx::bf16>(c, o) == "");
}

TEST_CASE("device memory: the direct route on the device policy, in strict mode, bitwise the staged route") {
  using epx::test::options_for;
  auto one = make_case(1, 1, 1, 8, 2, 16);  // one rank: no other thread holds a scope open
  CHECK(run_direct_case<float>(one, options_for(one)) == "");
  auto c = make_case(2, 4, 4, 8, 2, 16);  // 8 ranks, tp 2
  CHECK(run_direct_case<float>(c, options_for(c)) == "");
  c.capacity.mode = epx::capacity_mode::local;
  c.capacity.factor = 0.75;
  CHECK(run_direct_case<epx::bf16>(c, options_for(c)) == "");
  auto f = make_case(1, 4, 4, 8, 2, 256);
  auto o = options_for(f);
  o.fp8_dispatch = true;
  CHECK(run_direct_case<epx::bf16>(f, o) == "");
}

TEST_CASE("device memory: strict mode faults on a host access outside a launch scope, and only there") {
  // In a child process: the parent must survive the fault it expects.
  auto child_dies = [](bool touch_outside) {
    const pid_t pid = fork();
    if (pid == 0) {
      // The fault ends the child with status 42, without the test framework's report (and
      // under AddressSanitizer too, which honours a handler of the program's own).
      struct sigaction sa {};
      sa.sa_handler = [](int) { _exit(42); };
      sigaction(SIGSEGV, &sa, nullptr);
      if (!epx::exec::emulated_strict_memory(true)) _exit(3);
      epx::exec::emulated_buffer<float> b(1000);
      epx::exec::for_each_n(emu{}, 1000, [p = b.data()](std::size_t i) { p[i] = static_cast<float>(i); });
      float v = 0;
      epx::exec::copy_n(emu{}, b.data() + 999, 1, &v);
      if (v != 999.0f) _exit(4);
      if (touch_outside) v = *static_cast<volatile float*>(b.data() + 5);  // faults
      _exit(v == 999.0f || v == 5.0f ? 0 : 5);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  CHECK(child_dies(false) == 0);   // inside the scopes: no fault, the values written
  CHECK(child_dies(true) == 42);   // outside: the fault
}

TEST_CASE("device memory: a host communicator refuses a policy whose memory the host cannot touch") {
  // The threads communicator over host memory would memcpy and sum device pointers on the
  // host: errc::configuration on every rank, at construction. Over memory it moves with a
  // copy of its own (as threads::device_memory() does), the same layer is built.
  const epx::mesh m(epx::mesh_config{2, 4, 1, 1, 4, 8, 0});
  epx::layer_options o;
  o.hidden = 16;
  o.top_k = 2;
  for (bool device_buffers : {false, true}) {
    CAPTURE(device_buffers);
    epx::threads::options to;
    if (device_buffers) {
      to.memory.copy = [](void* d, const void* s, std::size_t n) noexcept {
        std::memcpy(d, s, n);
        return true;
      };
      to.memory.host_accessible = false;
      to.memory.name = "opaque";
    }
    std::vector<std::string> errors(8);
    epx::threads::run(
        8,
        [&](epx::threads::communicator& world) {
          CHECK(world.device_buffers() == device_buffers);
          try {
            epx::moe_layer<epx::threads::communicator, float, epx::impl::all_to_all, opaque_device> layer(m, world, o);
          } catch (const epx::error& e) {
            errors[static_cast<std::size_t>(world.rank())] =
                e.category() == epx::errc::configuration ? e.message() : std::string("wrong category: ") + e.what();
          }
        },
        to);
    for (const auto& e : errors) {
      if (device_buffers) {
        CHECK(e == "");
      } else {
        CHECK(e.find("the execution policy's buffers are device memory") != std::string::npos);
        CHECK(e.find("threads::device_memory()") != std::string::npos);
      }
    }
  }
}

TEST_CASE("device memory: a device communicator on the queue of a policy derived from the emulated device is taken") {
  // Same queue: the layer is built; another queue: errc::configuration, as for
  // exec::emulated_device itself (tests/emulated/test_device_path.cpp).
  using epx::exec::same_queue;
  opaque_device a, b;
  CHECK(same_queue(a, b));
  CHECK(same_queue(emu{}, a));
  CHECK(same_queue(a, emu{}));
  b.queue = 1;
  CHECK_FALSE(same_queue(a, b));
  CHECK_FALSE(same_queue(emu{}, b));
  CHECK_FALSE(same_queue(epx::exec::serial{}, a));
  const epx::mesh m(epx::mesh_config{2, 4, 1, 1, 4, 8, 0});
  epx::layer_options o;
  o.hidden = 16;
  o.top_k = 2;
  for (int queue : {0, 1}) {
    CAPTURE(queue);
    std::vector<std::string> errors(8);
    epx::threads::run(8, [&](epx::threads::communicator& world) {
      device_only_comm comm(std::move(world), emu{}, std::make_shared<std::vector<std::string>>());
      opaque_device policy;
      policy.queue = queue;
      try {
        epx::moe_layer<device_only_comm, float, epx::impl::all_to_all, opaque_device> layer(m, comm, o, policy);
      } catch (const epx::error& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    for (const auto& e : errors) {
      if (queue == 0)
        CHECK(e == "");
      else
        CHECK(e.find("another device queue") != std::string::npos);
    }
  }
}

TEST_CASE("device memory: routing::sum_over_batches takes a host load over a device communicator") {
  const epx::mesh m(epx::mesh_config{2, 4, 1, 1, 4, 8, 0});
  std::vector<std::vector<std::int64_t>> sums(8);
  std::vector<std::vector<std::string>> logs(8);
  epx::threads::run(8, [&](epx::threads::communicator& world) {
    const int me = world.rank();
    const auto r = static_cast<std::size_t>(me);
    auto log = std::make_shared<std::vector<std::string>>();
    device_only_comm comm(std::move(world), emu{}, log);
    auto batches = epx::routing::batch_communicator(comm, m);
    std::vector<std::int64_t> load(8);
    for (std::size_t e = 0; e < load.size(); ++e) load[e] = static_cast<std::int64_t>(m.batch(me) * 10 + e);
    epx::routing::sum_over_batches(batches, epx::span<std::int64_t>(load));
    sums[r] = load;
    logs[r] = *log;
  });
  for (std::size_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(logs[r].empty());
    for (std::size_t e = 0; e < 8; ++e) CHECK(sums[r][e] == static_cast<std::int64_t>((0 + 1 + 2 + 3) * 10 + 4 * e));
  }
}

TEST_CASE("device memory: one policy shared by the ranks counts every launch and synchronisation") {
  // Every copy of exec::emulated_device sees the same counters; ranks of threads::run that
  // share one policy count concurrently.
  const emu shared{};
  const int n = 4, each = 20000;
  epx::threads::run(n, [&](epx::threads::communicator&) {
    const emu mine = shared;
    for (int i = 0; i < each; ++i) {
      epx::exec::for_each_n(mine, 1, [](std::size_t) {});
      epx::exec::synchronize(mine);
    }
  });
  CHECK(shared.counters->launches.load() == static_cast<long long>(n) * each);
  CHECK(shared.counters->synchronizations.load() == static_cast<long long>(n) * each);
}

TEST_CASE("device memory: a buffer whose bytes do not fit in size_t is refused, as operator new[] refuses it") {
  const emu dev{};
  CHECK_THROWS_AS(epx::exec::make_buffer<float>(dev, (std::size_t{1} << 62) + 1), std::bad_array_new_length);
  CHECK(epx::exec::make_buffer<float>(dev, 4).size() == 4);
}

}  // namespace test_device_memory_cpp
