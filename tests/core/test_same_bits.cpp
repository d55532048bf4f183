// The same bits whatever runs the layer (docs/semantics.md section 4, "Determinism";
// docs/implementations.md; docs/layer.md, the options): for a fixed mesh and input, the
// training output, the inference output, grad_x, the routing-weight gradients and the
// expert gradients after the hook are bitwise equal
//   - on exec::serial, exec::openmp with 1, 2 and 3 threads, and exec::emulated_device (the
//     device path on the CPU: 16-byte chunks, device buffers; launches in reverse index
//     order, and forward);
//   - whatever layer_options::chunks is;
//   - on the direct route and the staged one, with rows sent by index or gathered first,
//     in one round or in many (layer_options::stage_bytes);
// in float and bf16, at the sizes people run (E = 64 experts, top-8, ep 4 and 8, H from
// 1024 to 7168), with a capacity that drops pairs (by position and by score), with FP8
// dispatch, with per-rank sends (whose grad_weights and expert gradients are also the
// per-slot mode's bits) and in bounded mode (whose results with drops are the normal
// mode's with the local capacity rule C = cap); the masked path and impl::automatic; and
// routing (epx/routing) with its backward. Every run is compared with memcmp against
// one run on exec::serial with the default options; the text names the first byte that
// differs. (tests/core/test_same_bits_mpi.cpp compares the MPI backend with these runs.)
//
// Experts: scale_experts of core/same_bits_cases.hpp (elementwise, cheap at any H) and, with FP8 dispatch,
// fp8_grad_experts there (fp8_scale_experts of core/fp8_layer_cases.hpp with an expert
// gradient of the rows backward gets); neither depends on the policy.
// tests/emulated/test_same_bits.cpp reruns this file with the device's algorithm variants
// (EPX_EMULATE_DEVICE_ALGORITHMS), where exec::emulated_device plans with Thrust's stable
// sort when the CCCL headers are there, against the host policies' counting sort.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/routing_cases.hpp"
#include "core/same_bits_cases.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/emulated.hpp"
#include "support/sanitizers.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_same_bits_cpp {

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::threads::communicator;
namespace ref = epx::ref;
using epx::test::bitwise_runs::differences;
using epx::test::bitwise_runs::make;
using epx::test::bitwise_runs::run_bits;
using epx::test::bitwise_runs::run_one;
using epx::test::bitwise_runs::stage_of;

// One way of running a case: a name, the policy and a change of the options.
struct variant {
  std::string name;
  std::function<void(epx::layer_options&)> change;
  int policy = 0;  // 0 serial, 1-3 openmp{policy}, 4 emulated_device, 5 the same launching forward
};

std::string policy_name(int p) {
  return p == 0   ? "serial"
         : p == 4 ? "emulated_device"
         : p == 5 ? "emulated_device (forward launch order)"
                  : epx::detail::concat("openmp{", p, "}");
}

// This thread's emulated launches run forward until the end of the scope.
struct forward_launches {
  forward_launches() { epx::exec::emulated_launch_order(epx::exec::emulated_order::forward); }
  ~forward_launches() { epx::exec::emulated_launch_order(epx::exec::emulated_order::reverse); }
};

template <class T, class Impl>
run_bits<T> run_variant(comm_t& world, const layer_case& c, const epx::layer_options& base, const variant& v) {
  epx::layer_options o = base;
  if (v.change) v.change(o);
  switch (v.policy) {
    case 0: return run_one<comm_t, T, epx::exec::serial, Impl>(world, c, o, {});
    case 4: return run_one<comm_t, T, epx::exec::emulated_device, Impl>(world, c, o, {});
    case 5: {
      const forward_launches forward;
      return run_one<comm_t, T, epx::exec::emulated_device, Impl>(world, c, o, {});
    }
    default: return run_one<comm_t, T, epx::exec::openmp, Impl>(world, c, o, epx::exec::openmp{v.policy});
  }
}

int world_of(const epx::mesh_config& m) { return m.tp * m.fsdp * m.dp_replicate * m.pp; }

// Every variant against the first one, rank by rank. `outputs` false compares only
// grad_weights and the expert gradients (per-rank sends against per-slot sends).
template <class T, class Impl = epx::impl::all_to_all>
std::int64_t check_same_bits(const layer_case& c, const epx::layer_options& base, const std::vector<variant>& variants,
                             const std::vector<bool>& outputs = {}, std::vector<std::int64_t>* rounds_of = nullptr) {
  CAPTURE(c.describe());
  const int world = world_of(c.topology);
  std::vector<std::vector<run_bits<T>>> got(variants.size(), std::vector<run_bits<T>>(static_cast<std::size_t>(world)));
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  epx::threads::run(world, [&](comm_t& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    try {
      for (std::size_t v = 0; v < variants.size(); ++v) got[v][r] = run_variant<T, Impl>(comm, c, base, variants[v]);
    } catch (const std::exception& ex) {
      errors[r] = epx::detail::concat("rank ", r, ": ", ex.what());
      throw;
    }
  });
  for (const auto& e : errors) CHECK_MESSAGE(e.empty(), e);
  // The variants ran the way they name: the staged route where peer access is off, the
  // direct one elsewhere (threads has peer access; per-rank sends are always staged;
  // bounded mode takes it for inference on host policies only), and the inference call in
  // several rounds where a small stage was asked for (per-rank sends and bounded mode take
  // none: docs/layer.md, section 4).
  constexpr bool masked = std::is_same_v<Impl, epx::impl::all_reduce>;
  for (std::size_t v = 0; v < variants.size(); ++v) {
    for (int r = 0; r < world; ++r) {
      const auto& g = got[v][static_cast<std::size_t>(r)];
      const std::string want = masked ? "all_reduce" : "all_to_all";
      CHECK_MESSAGE((g.path == want && g.inference_path == want), variants[v].name, " rank ", r, ": paths ", g.path,
                    " and ", g.inference_path);
    }
    if (rounds_of != nullptr) {
      std::int64_t most = 0;
      for (const auto& g : got[v]) most = std::max(most, g.stage_rounds);
      rounds_of->push_back(most);
    }
    if (masked) continue;  // no rows move, no route
    epx::layer_options o = base;
    if (variants[v].change) variants[v].change(o);
    const bool bounded = o.counts == epx::count_exchange::device;
    const bool direct = o.peer_access && o.sends == epx::row_sends::per_slot;
    const bool train_direct = direct && !bounded, inference_direct = direct && (!bounded || variants[v].policy < 4);
    const std::string name = variants[v].name + " on " + policy_name(variants[v].policy);
    std::int64_t rounds = 0;
    for (int r = 0; r < world; ++r) {
      const auto& g = got[v][static_cast<std::size_t>(r)];
      CHECK_MESSAGE(g.peer_access == train_direct, name, " rank ", r, ": stats.peer_access ", g.peer_access);
      CHECK_MESSAGE(g.inference_peer_access == inference_direct, name, " rank ", r, ": inference stats.peer_access ",
                    g.inference_peer_access);
      rounds = std::max(rounds, g.stage_rounds);
    }
    if (!inference_direct && o.stage_bytes > 0 && !bounded && o.sends == epx::row_sends::per_slot)
      CHECK_MESSAGE(rounds > 1, name, ": ", rounds, " rounds");
    if (bounded || o.sends == epx::row_sends::per_rank) CHECK_MESSAGE(rounds == 0, name, ": ", rounds, " rounds");
  }
  for (std::size_t v = 1; v < variants.size(); ++v) {
    std::string f;
    for (int r = 0; r < world; ++r)
      f += differences(got[0][static_cast<std::size_t>(r)], got[v][static_cast<std::size_t>(r)],
                       epx::detail::concat(variants[v].name, " on ", policy_name(variants[v].policy), " against ",
                                           variants[0].name, " on ", policy_name(variants[0].policy), ", rank ", r),
                       outputs.empty() || outputs[v]);
    CHECK_MESSAGE(f.empty(), f);
  }
  return got[0][0].overflow_pairs;
}

// The policies, the chunk counts and the routes, against serial on its default route.
std::vector<variant> every_way(const layer_case& c, std::size_t elem, std::size_t rows_per_round = 3) {
  const std::size_t few = stage_of(c, rows_per_round, elem);
  auto staged = [](epx::layer_options& o) { o.peer_access = false; };
  auto rounds = [few](epx::layer_options& o) {
    o.peer_access = false;
    o.stage_bytes = few;
  };
  return {
      {"default", {}, 0},
      {"default", {}, 1},
      {"default", {}, 2},
      {"default", {}, 3},
      {"default", {}, 4},
      {"default", {}, 5},
      {"chunks=1", [](epx::layer_options& o) { o.chunks = 1; }, 0},
      {"chunks=3", [](epx::layer_options& o) { o.chunks = 3; }, 0},
      {"chunks=7", [](epx::layer_options& o) { o.chunks = 7; }, 3},
      {"chunks=5", [](epx::layer_options& o) { o.chunks = 5; }, 4},
      {"staged", staged, 0},
      {"staged", staged, 2},
      {"staged", staged, 4},
      {"staged gathered", [](epx::layer_options& o) { o.peer_access = false; o.indexed_sends = false; }, 3},
      {"staged in small rounds", rounds, 0},
      {"staged in small rounds", rounds, 3},
      {"staged in small rounds", rounds, 4},
      {"staged in small rounds", rounds, 5},
      {"staged in rounds of 1 row, gathered",
       [](epx::layer_options& o) { o.peer_access = false; o.indexed_sends = false; o.stage_bytes = 1; }, 2},
  };
}

template <class T>
void check_every_way(const layer_case& c, const epx::layer_options& o, std::size_t rows_per_round = 3) {
  check_same_bits<T>(c, o, every_way(c, sizeof(T), rows_per_round));
}

}  // namespace

TEST_CASE_TEMPLATE("same bits: every policy, chunk count and route; ep = 8, E = 64, top-8, H = 4096", T, float,
                   epx::bf16) {
  const auto c = make(1, 8, 8, 4096, 20);
  check_every_way<T>(c, epx::test::options_for(c));
}

TEST_CASE_TEMPLATE("same bits: every policy, chunk count and route; tp = 2, ep = 4, H = 7168 and H = 1024 padded", T,
                   float, epx::bf16) {
  const auto c = make(2, 4, 4, 7168, 16, routing_kind::uneven);
  check_every_way<T>(c, epx::test::options_for(c));
  auto p = make(1, 4, 4, 1024, 40, routing_kind::uneven);
  p.pad = epx::padding{2, 8};
  check_every_way<T>(p, epx::test::options_for(p));
}

TEST_CASE_TEMPLATE("same bits: rows that are not whole 16-byte chunks (H = 1030), and decode batches of 0 to 2 rows",
                   T, float, epx::bf16) {
  const auto odd = make(1, 4, 4, 1030, 24, routing_kind::uneven);
  check_every_way<T>(odd, epx::test::options_for(odd));
  auto decode = make(1, 8, 8, 4096, 0);
  decode.rows = [](int b) { return static_cast<std::size_t>(b % 3); };
  check_every_way<T>(decode, epx::test::options_for(decode), 1);
}

// stage_bytes = 0 (automatic): host policies take rounds of 4 MiB once the EP group's
// largest slice would send more than 64 MiB in one round, device policies one round. Slices
// of 280 to 300 rows of k = 8 float rows of H = 7168 (64.2 to 68.8 MB): every rank takes the
// rounds of the largest, also those whose own slice would fit in one.
TEST_CASE("same bits: the automatic stage, in rounds on a host policy and in one on the emulated device") {
  if (epx::test::under_tsan) return;  // the size is the point (make() takes H = 256 there)
  auto c = make(1, 4, 4, 7168, 0, routing_kind::uneven);
  c.hidden = 7168;  // under ASan too
  c.rows = [](int b) { return std::size_t{280} + static_cast<std::size_t>(b % 2 ? 20 : 5 * b / 2); };
  const auto o = epx::test::options_for(c);
  auto staged = [](epx::layer_options& x) { x.peer_access = false; };
  std::vector<std::int64_t> rounds;
  check_same_bits<float>(c, o,
                         {{"staged, automatic stage", staged, 0}, {"staged, automatic stage", staged, 4}}, {},
                         &rounds);
  // 300 rows of 8 * 7168 floats in stages of 4 MiB (18 rows): 17 rounds; one on the device.
  CHECK(rounds == std::vector<std::int64_t>{17, 0});
}

TEST_CASE_TEMPLATE("same bits: a capacity that drops pairs, by position and by score, local and global", T, float,
                   epx::bf16) {
  auto c = make(1, 8, 8, 2048, 24, routing_kind::uneven);
  for (auto mode : {epx::capacity_mode::local, epx::capacity_mode::global})
    for (auto priority : {epx::drop_priority::position, epx::drop_priority::score}) {
      c.capacity.mode = mode;
      c.capacity.factor = 0.5;
      c.capacity.priority = priority;
      CAPTURE(c.describe());
      check_every_way<T>(c, epx::test::options_for(c));
    }
}

TEST_CASE_TEMPLATE("same bits: FP8 dispatch on every policy, chunk count and route; ep = 8, H = 4096", T, float,
                   epx::bf16) {
  const auto c = make(1, 8, 8, 4096, 20);
  auto o = epx::test::options_for(c);
  o.fp8_dispatch = true;
  check_every_way<T>(c, o);
}

TEST_CASE_TEMPLATE("same bits: FP8 dispatch on every policy, chunk count and route; tp = 2, ep = 4, H = 7168", T, float,
                   epx::bf16) {
  const auto c = make(2, 4, 4, 7168, 12, routing_kind::uneven);
  auto o = epx::test::options_for(c);
  o.fp8_dispatch = true;
  check_every_way<T>(c, o);
}

TEST_CASE_TEMPLATE("same bits: FP8 dispatch with a global capacity by score and padded blocks", T, float, epx::bf16) {
  auto c = make(1, 4, 4, 2048, 24, routing_kind::uneven);
  c.capacity.mode = epx::capacity_mode::global;
  c.capacity.factor = 0.5;
  c.capacity.priority = epx::drop_priority::score;
  c.pad = epx::padding{1, 4};
  auto o = epx::test::options_for(c);
  o.fp8_dispatch = true;
  check_every_way<T>(c, o);
}

TEST_CASE_TEMPLATE("same bits: per-rank sends on every policy, with a small stage and with drops; grad_weights "
                   "and expert grads are the per-slot mode's", T, float, epx::bf16) {
  // The third case drops pairs by score and pads the experts' blocks.
  auto capped = make(1, 4, 4, 2048, 24, routing_kind::uneven);
  capped.capacity.mode = epx::capacity_mode::local;
  capped.capacity.factor = 0.5;
  capped.capacity.priority = epx::drop_priority::score;
  capped.pad = epx::padding{2, 8};
  for (const auto& c : {make(1, 8, 8, 4096, 20), make(2, 4, 4, 7168, 12, routing_kind::uneven), capped}) {
    CAPTURE(c.describe());
    auto o = epx::test::options_for(c);
    o.sends = epx::row_sends::per_rank;
    const std::size_t few = stage_of(c, 3, sizeof(T));
    auto per_slot = [](epx::layer_options& x) { x.sends = epx::row_sends::per_slot; };
    check_same_bits<T>(
        c, o,
        {{"per_rank", {}, 0},
         {"per_rank", {}, 2},
         {"per_rank", {}, 3},
         {"per_rank", {}, 4},
         {"per_rank chunks=3", [](epx::layer_options& x) { x.chunks = 3; }, 1},
         {"per_rank gathered", [](epx::layer_options& x) { x.indexed_sends = false; }, 0},
         {"per_rank with a stage of 3 rows", [few](epx::layer_options& x) { x.stage_bytes = few; }, 0},
         {"per_rank with a stage of 3 rows", [few](epx::layer_options& x) { x.stage_bytes = few; }, 4},
         {"per_slot", per_slot, 0},
         {"per_slot", per_slot, 4}},
        {true, true, true, true, true, true, true, true, false, false});
  }
}

TEST_CASE_TEMPLATE("same bits: bounded mode on every policy and route, with and without drops, and the normal mode's",
                   T, float, epx::bf16) {
  // Bounded mode's slabs hold the whole bound (ep * L * cap rows each way): a smaller H.
  const auto c = make(1, 8, 8, 1024, 20, routing_kind::uneven);
  for (std::int64_t cap : {std::int64_t{2}, std::int64_t{24}}) {
    CAPTURE(cap);
    auto o = epx::test::options_for(c);
    o.counts = epx::count_exchange::device;
    o.bound.cap = cap;
    auto staged = [](epx::layer_options& x) { x.peer_access = false; };
    // The normal mode with bounded mode's drops: the local capacity rule, C = cap.
    auto normal = [cap](epx::layer_options& x) {
      x.counts = epx::count_exchange::host;
      x.bound = {};
      x.capacity.mode = epx::capacity_mode::local;
      x.capacity.rows = cap;
    };
    const auto drops = check_same_bits<T>(c, o,
                                          {{"bounded", {}, 0},
                                           {"bounded", {}, 1},
                                           {"bounded", {}, 3},
                                           {"bounded", {}, 4},
                                           {"bounded chunks=3", [](epx::layer_options& x) { x.chunks = 3; }, 2},
                                           {"bounded staged", staged, 0},
                                           {"bounded staged", staged, 4},
                                           {"bounded staged, stage_bytes = 1",
                                            [](epx::layer_options& x) { x.peer_access = false; x.stage_bytes = 1; }, 0},
                                           {"normal, local capacity C = cap", normal, 0},
                                           {"normal, local capacity C = cap", normal, 4}});
    // cap 2 drops pairs, cap 24 none (the uneven routing's hottest expert gets fewer).
    CHECK((drops > 0) == (cap == 2));
  }
}

TEST_CASE_TEMPLATE("same bits: the masked all-reduce path (ep == tp) on every policy and chunk count, with a capacity "
                   "and in bounded mode", T, float, epx::bf16) {
  for (const auto& c : {make(4, 2, 4, 4096, 16, routing_kind::uneven), make(8, 1, 8, 2048, 20)}) {
    const auto policies = std::vector<variant>{{"masked", {}, 0},
                                               {"masked", {}, 1},
                                               {"masked", {}, 2},
                                               {"masked", {}, 3},
                                               {"masked", {}, 4},
                                               {"masked chunks=3", [](epx::layer_options& o) { o.chunks = 3; }, 0},
                                               {"masked chunks=5", [](epx::layer_options& o) { o.chunks = 5; }, 3}};
    auto o = epx::test::options_for(c);
    check_same_bits<T, epx::impl::all_reduce>(c, o, policies);
    auto capped = o;
    capped.capacity.mode = epx::capacity_mode::local;
    capped.capacity.factor = 0.5;
    capped.capacity.priority = epx::drop_priority::score;
    check_same_bits<T, epx::impl::all_reduce>(c, capped, policies);
    auto bounded = o;
    bounded.counts = epx::count_exchange::device;
    bounded.bound.cap = 1;
    auto with_normal = policies;  // bounded mode's drops are the local capacity rule's, C = cap
    for (int p : {0, 4})
      with_normal.push_back({"normal masked, local capacity C = cap",
                             [](epx::layer_options& x) {
                               x.counts = epx::count_exchange::host;
                               x.bound = {};
                               x.capacity.mode = epx::capacity_mode::local;
                               x.capacity.rows = 1;
                             },
                             p});
    CHECK(check_same_bits<T, epx::impl::all_reduce>(c, bounded, with_normal) > 0);
  }
}

// impl::automatic runs the all-to-all path for training and the masked path for inference
// (ep == tp): its bits are theirs, on every policy.
TEST_CASE_TEMPLATE("same bits: impl::automatic is the all-to-all path in training and the masked path in inference",
                   T, float, epx::bf16) {
  const auto c = make(4, 2, 4, 2048, 16, routing_kind::uneven);
  const auto o = epx::test::options_for(c);
  const int world = world_of(c.topology);
  for (int policy : {0, 3, 4}) {
    CAPTURE(policy_name(policy));
    const variant v{"", {}, policy};
    std::vector<run_bits<T>> a2a(static_cast<std::size_t>(world)), masked(a2a.size()), automatic(a2a.size());
    epx::threads::run(world, [&](comm_t& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      a2a[r] = run_variant<T, epx::impl::all_to_all>(comm, c, o, v);
      masked[r] = run_variant<T, epx::impl::all_reduce>(comm, c, o, v);
      automatic[r] = run_variant<T, epx::impl::automatic>(comm, c, o, v);
    });
    std::string f;
    for (std::size_t r = 0; r < a2a.size(); ++r) {
      const std::string where = epx::detail::concat("automatic, rank ", r);
      if (automatic[r].path != "all_to_all" || automatic[r].inference_path != "all_reduce")
        f += epx::detail::concat(where, ": paths ", automatic[r].path, " and ", automatic[r].inference_path, "\n");
      f += epx::test::bitwise_runs::first_difference(automatic[r].out, a2a[r].out, where + " out (all_to_all)");
      f += epx::test::bitwise_runs::first_difference(automatic[r].grad_x, a2a[r].grad_x, where + " grad_x (all_to_all)");
      f += epx::test::bitwise_runs::first_difference(automatic[r].grad_w, a2a[r].grad_w,
                                                  where + " grad_weights (all_to_all)");
      f += epx::test::bitwise_runs::first_difference(automatic[r].expert_grads, a2a[r].expert_grads,
                                                  where + " expert grads (all_to_all)");
      f += epx::test::bitwise_runs::first_difference(automatic[r].inference_out, masked[r].inference_out,
                                                  where + " inference out (all_reduce)");
    }
    CHECK_MESSAGE(f.empty(), f);
  }
}

namespace {

// Routing (epx/routing) of N tokens over E experts, and its backward, on every policy: ids,
// weights and logit gradients byte for byte against exec::serial.
template <class T, class Policy>
void check_routing_bits(const Policy& p, const char* name) {
  CAPTURE(name);
  const std::size_t N = 2053;
  const int E = 64, k = 8;
  const auto logits = ref::from_double<T>(ref::random_logits(N, E, 31));
  const auto gw = ref::from_double<float>(ref::random_normal(N, k, 32));
  struct routed {
    epx::test::lib_routing r;
    std::vector<float> grad;
  };
  auto run = [&](auto ex) {
    routed o{epx::test::run_route(p, ex, logits, N, E, k), std::vector<float>(N * E, -7.0f)};
    epx::routing::route_backward(p, ex, epx::span<const T>(logits.data(), logits.size()), E, k,
                                 epx::make_span(o.r.ids), epx::span<const float>(), epx::make_span(gw),
                                 epx::make_span(o.grad));
    return o;
  };
  const auto base = run(epx::exec::serial{});
  std::vector<std::pair<std::string, routed>> others;
  others.emplace_back("openmp{1}", run(epx::exec::openmp{1}));
  others.emplace_back("openmp{2}", run(epx::exec::openmp{2}));
  others.emplace_back("openmp{3}", run(epx::exec::openmp{3}));
  others.emplace_back("emulated_device", run(epx::exec::emulated_device{}));
  {
    const forward_launches forward;
    others.emplace_back("emulated_device (forward launch order)", run(epx::exec::emulated_device{}));
  }
  for (const auto& [policy, o] : others) {
    std::string f = epx::test::bitwise_runs::first_difference(o.r.ids, base.r.ids, policy + " ids");
    f += epx::test::bitwise_runs::first_difference(o.r.weights, base.r.weights, policy + " weights");
    f += epx::test::bitwise_runs::first_difference(o.grad, base.grad, policy + " logit gradients");
    CHECK_MESSAGE(f.empty(), f);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("same bits: routing and its backward on every policy (E = 64, top-8)", T, float, epx::bf16) {
  namespace routing = epx::routing;
  check_routing_bits<T>(routing::softmax_topk{}, "softmax_topk");
  check_routing_bits<T>(routing::softmax_topk{true}, "softmax_topk renormalised");
  check_routing_bits<T>(routing::topk_softmax{}, "topk_softmax");
  const auto bias = ref::from_double<float>(ref::random_normal(1, 64, 33, 0.05));
  check_routing_bits<T>(routing::sigmoid_bias{bias.data(), 8, 3, 2.5f, true}, "sigmoid_bias");
}

}  // namespace test_same_bits_cpp
