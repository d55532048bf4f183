// The MoE layer on the threads backend against the float64 reference (spec sections 3-7).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <limits>
#include <cstring>
#include <cmath>
#include <string>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"
#include "support/on_ranks.hpp"
#include "support/sanitizers.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_layer_cpp {

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::threads::communicator;

using epx::test::on_ranks;  // support/on_ranks.hpp

using epx::test::world_of;

template <class T, class Impl = epx::impl::all_to_all>
void check_case(const layer_case& c) {
  CAPTURE(c.describe());
  on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_layer_case<comm_t, T, Impl>(comm, c); });
}

layer_case make(int tp, int fsdp, int ep, int E, int k, routing_kind r = routing_kind::random, int R = 1) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.dp_replicate = R;
  c.topology.experts = E;
  c.top_k = k;
  c.routing = r;
  c.seed = static_cast<std::uint64_t>(tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + static_cast<int>(r) * 13 + R);
  return c;
}

// Two edge cases: odd batches empty, and padding {2, 4} with every token on rank 0's
// experts (top-`padded_k`).
std::vector<layer_case> edge_cases(int padded_k) {
  auto some_empty = make(1, 4, 4, 8, 2);
  some_empty.rows = [](int b) { return b % 2 ? std::size_t{0} : std::size_t{10}; };
  auto padded = make(2, 2, 4, 8, padded_k, routing_kind::first_rank_only);
  padded.pad = {2, 4};
  return {some_empty, padded};
}

}  // namespace

TEST_CASE("layer: the seed's eight-rank table and the picture's ep sizes (float32)") {
  for (const auto& m : std::vector<std::array<int, 3>>{{4, 2, 4}, {1, 8, 4}, {2, 4, 4}, {8, 1, 8}, {2, 4, 2}, {2, 4, 8}}) {
    for (int k : {1, 2}) {
      check_case<float>(make(m[0], m[1], m[2], 16, k, routing_kind::random));
    }
  }
  check_case<float>(make(2, 4, 4, 16, 8, routing_kind::uneven));
}

TEST_CASE("layer: ep=1, ep=world, dp_replicate=2, odd worlds 3 and 6, pp=2") {
  check_case<float>(make(1, 4, 1, 4, 2));                            // ep = 1
  check_case<float>(make(1, 4, 4, 8, 2));                            // ep = world
  check_case<float>(make(1, 2, 2, 4, 2, routing_kind::random, 2));   // dp_replicate = 2
  check_case<float>(make(2, 2, 2, 8, 2, routing_kind::uneven, 2));   // dp_replicate = 2, tp = 2
  check_case<float>(make(1, 3, 3, 6, 2));                            // world 3
  check_case<float>(make(3, 1, 3, 9, 2));                            // world 3, tp = 3
  check_case<float>(make(1, 6, 3, 6, 2, routing_kind::uneven));      // world 6
  check_case<float>(make(3, 2, 3, 12, 2));                           // world 6, tp = 3
  check_case<float>(make(2, 3, 6, 12, 1));                           // world 6, ep = 6
  auto pp2 = make(2, 2, 2, 8, 2, routing_kind::uneven);                  // pp = 2: two stages of 4 ranks
  pp2.topology.pp = 2;
  check_case<float>(pp2);
}

TEST_CASE("layer: routings (balanced, uneven, one expert, experts receiving nothing), k in {1,2,8}, E up to 64") {
  for (auto r : {routing_kind::balanced, routing_kind::uneven, routing_kind::one_expert, routing_kind::first_rank_only})
    for (int k : {1, 2, 8}) check_case<float>(make(2, 2, 4, 16, k, r));
  auto big = make(1, 4, 4, 64, 8, routing_kind::uneven);
  big.rows = [](int) { return std::size_t{32}; };
  check_case<float>(big);
}

TEST_CASE("layer: ranks that send nothing, one-token decode with tp > 1, one efsdp replica idle") {
  auto some_empty = make(1, 4, 4, 8, 2);
  some_empty.rows = [](int b) { return b % 2 ? std::size_t{0} : std::size_t{10}; };
  check_case<float>(some_empty);
  auto all_empty = make(2, 2, 4, 8, 2);
  all_empty.rows = [](int) { return std::size_t{0}; };
  check_case<float>(all_empty);
  for (int tp : {2, 4}) {
    auto decode = make(tp, 8 / tp, 4, 8, 2);
    decode.rows = [](int) { return std::size_t{1}; };
    check_case<float>(decode);
  }
  auto decode3 = make(2, 4, 4, 8, 2);
  decode3.rows = [](int b) { return static_cast<std::size_t>(b % 3); };  // 0, 1, 2 rows
  check_case<float>(decode3);
  // tp=2, fsdp=4, ep=4: efsdp = 2; EP group 0 holds batches 0-1, EP group 1 batches 2-3.
  auto idle = make(2, 4, 4, 8, 2, routing_kind::uneven);
  idle.rows = [](int b) { return b < 2 ? std::size_t{16} : std::size_t{0}; };
  check_case<float>(idle);
}

TEST_CASE("layer: padding policies") {
  for (auto pad : {epx::padding{0, 1}, epx::padding{1, 1}, epx::padding{2, 4}, epx::padding{0, 8}}) {
    auto c = make(2, 2, 4, 8, 2, routing_kind::first_rank_only);
    c.pad = pad;
    check_case<float>(c);
  }
}

TEST_CASE_TEMPLATE("layer: element types", T, double, epx::bf16, epx::fp16) {
  check_case<T>(make(2, 4, 4, 16, 2, routing_kind::uneven));
  check_case<T>(make(1, 4, 2, 8, 8));
}

TEST_CASE("layer: masked all-reduce path (ep == tp) against the reference and the all-to-all path") {
  for (const auto& m : std::vector<std::array<int, 2>>{{2, 2}, {4, 1}, {8, 1}, {2, 3}}) {
    auto c = make(m[0], m[1], m[0], 16, 2, routing_kind::uneven);
    check_case<float, epx::impl::all_reduce>(c);
    check_case<epx::bf16, epx::impl::all_reduce>(c);
    check_case<float, epx::impl::automatic>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_paths_agree<comm_t, float>(comm, c); });
  }
  auto decode = make(2, 2, 2, 4, 2);
  decode.rows = [](int) { return std::size_t{1}; };
  check_case<float, epx::impl::all_reduce>(decode);
  auto pad = make(4, 2, 4, 8, 8, routing_kind::first_rank_only);
  pad.pad = {2, 4};
  check_case<float, epx::impl::all_reduce>(pad);
}

TEST_CASE("layer: determinism (bitwise equal across runs, chunk counts and host policies)") {
  for (const auto& c : {make(2, 4, 4, 16, 2, routing_kind::uneven), make(1, 4, 4, 8, 8)}) {
    on_ranks(world_of(c.topology), [&](comm_t& comm) {
      return epx::test::check_determinism<comm_t, float, epx::impl::all_to_all, epx::exec::openmp>(comm, c,
                                                                                                  epx::exec::openmp{2});
    });
    on_ranks(world_of(c.topology),
             [&](comm_t& comm) { return epx::test::check_determinism<comm_t, epx::bf16>(comm, c); });
  }
  auto c = make(4, 1, 4, 8, 2);
  on_ranks(4, [&](comm_t& comm) { return epx::test::check_determinism<comm_t, float, epx::impl::all_reduce>(comm, c); });
}

TEST_CASE("layer: the direct route (peer access) and the staged one agree bitwise, and each matches float64") {
  std::vector<layer_case> cases = {make(2, 4, 4, 16, 2, routing_kind::uneven), make(1, 4, 4, 8, 8),
                                   make(1, 2, 2, 4, 2, routing_kind::random, 2), make(3, 2, 3, 12, 2),
                                   make(2, 2, 4, 16, 8, routing_kind::first_rank_only),
                                   make(1, 4, 1, 4, 2), make(2, 3, 6, 12, 1)};
  for (const auto& e : edge_cases(2)) cases.push_back(e);
  for (auto c : cases) {
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_routes_agree<comm_t, float>(comm, c); });
    c.peer_access = false;
    check_case<float>(c);
  }
  auto c = make(2, 4, 4, 16, 2, routing_kind::uneven);
  on_ranks(8, [&](comm_t& comm) { return epx::test::check_routes_agree<comm_t, epx::bf16>(comm, c); });
  c.peer_access = false;
  check_case<epx::bf16>(c);
}

TEST_CASE("layer: the staged route in rounds (layer_options::stage_bytes) against float64 and against one round") {
  std::vector<layer_case> cases = {make(2, 4, 4, 16, 2, routing_kind::uneven), make(1, 4, 4, 8, 8),
                                   make(1, 2, 2, 4, 2, routing_kind::random, 2), make(3, 2, 3, 12, 2),
                                   make(2, 2, 4, 16, 8, routing_kind::first_rank_only), make(1, 4, 1, 4, 2),
                                   make(1, 8, 8, 64, 8), make(1, 4, 4, 8, 3, routing_kind::one_expert)};
  for (const auto& e : edge_cases(4)) cases.push_back(e);
  for (auto priority : {epx::drop_priority::position, epx::drop_priority::score}) {
    auto capped = make(1, 4, 4, 16, 4, routing_kind::uneven);
    capped.capacity.mode = epx::capacity_mode::local;
    capped.capacity.factor = 0.5;
    capped.capacity.priority = priority;
    cases.push_back(capped);
  }
  auto wide = make(2, 4, 4, 16, 6);
  wide.hidden = static_cast<int>(epx::test::tsan_hidden(300, 100));
  wide.rows = [](int b) { return static_cast<std::size_t>(37 + 3 * b); };
  cases.push_back(wide);
  for (auto c : cases) {
    c.peer_access = false;
    // One slice row a round, then a few rows a round (a last round part full).
    for (std::size_t per_round : {std::size_t{1}, std::size_t{5}}) {
      c.stage_bytes = per_round * static_cast<std::size_t>(c.top_k) * static_cast<std::size_t>(c.hidden) * sizeof(float);
      check_case<float>(c);
      on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_rounds_agree<comm_t, float>(comm, c); });
    }
  }
  for (auto c : {make(2, 4, 4, 16, 4, routing_kind::uneven), make(1, 4, 2, 8, 8)}) {
    c.peer_access = false;
    c.stage_bytes = 1;
    check_case<epx::bf16>(c);
    check_case<double>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_rounds_agree<comm_t, epx::bf16>(comm, c); });
  }
}

namespace {
// Experts that double their rows (forward only), for the sizes where the automatic stage
// takes rounds.
struct doubling_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    for (std::size_t i = 0; i < in.num_rows * in.hidden; ++i) out[i] = 2.0f * in.rows[i];
  }
};
}  // namespace

TEST_CASE("layer: the automatic stage takes rounds once one round would send more than 64 MiB") {
  // ep = 2, H = 8192, top-8 of 8 experts, float: a row's k rows are 256 KiB, so 256 rows
  // send 64 MiB. Slices of 300 rows (and 200 on the other rank) take 4 MiB rounds of 16
  // rows: ceil(300 / 16) = 19; slices of 200 and 100 rows take one round.
  const std::size_t H = 8192;
  const int k = 8, E = 8;
  for (std::size_t big : {std::size_t{300}, std::size_t{200}}) {
    epx::threads::run(2, [&](comm_t& comm) {
      const std::size_t n = comm.rank() == 0 ? big : big - 100;
      epx::mesh_config mc;
      mc.fsdp = 2;
      mc.ep = 2;
      mc.experts = E;
      const epx::mesh m(mc);
      std::vector<float> x(n * H), w(n * k), out(n * H), once(n * H);
      std::vector<std::int32_t> ids(n * k);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 997.0f - 0.5f;
      for (std::size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<std::int32_t>((i + i / k + static_cast<std::size_t>(comm.rank())) % E);
        w[i] = 0.125f + 0.01f * static_cast<float>(i % 7);
      }
      epx::layer_options o;
      o.hidden = H;
      o.top_k = k;
      o.peer_access = false;
      doubling_experts ex;
      epx::moe_layer<comm_t, float> automatic(m, comm, o);
      (void)automatic.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                              epx::span<float>(out), ex, epx::mode::inference);
      const std::int64_t rounds = automatic.stats().stage_rounds;
      o.stage_bytes = std::numeric_limits<std::size_t>::max();
      epx::moe_layer<comm_t, float> one(m, comm, o);
      (void)one.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                        epx::span<float>(once), ex, epx::mode::inference);
      // out[t] = sum_j w[t, j] * 2 x[t] in float64; k = 8 float32 terms round within 1e-6.
      std::size_t wrong = 0;
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t h = 0; h < H; ++h) {
          double acc = 0.0;
          for (int j = 0; j < k; ++j) acc += double{w[t * k + static_cast<std::size_t>(j)]} * (2.0 * x[t * H + h]);
          wrong += std::abs(acc - double{out[t * H + h]}) > 1e-6 * (1.0 + std::abs(acc));
        }
      CHECK_MESSAGE(rounds == (big == 300 ? 19 : 0), "rank ", comm.rank(), " slice ", n, ": stage_rounds ", rounds);
      CHECK(one.stats().stage_rounds == 0);
      CHECK_MESSAGE(std::memcmp(out.data(), once.data(), out.size() * sizeof(float)) == 0,
                    "rank ", comm.rank(), ": rounds differ bitwise from one round");
      CHECK_MESSAGE(wrong == 0, "rank ", comm.rank(), ": ", wrong, " elements off the direct sum");
    });
  }
}

TEST_CASE("layer: per-rank sends (spec section 14) against float64 and against per-slot sends") {
  std::vector<layer_case> cases = {make(2, 4, 4, 16, 2, routing_kind::uneven), make(1, 4, 4, 8, 8),
                                   make(1, 2, 2, 4, 4, routing_kind::random, 2), make(3, 2, 3, 12, 2),
                                   make(2, 2, 4, 16, 8, routing_kind::first_rank_only), make(1, 4, 1, 4, 2),
                                   make(2, 3, 6, 12, 1), make(1, 8, 8, 64, 8), make(1, 4, 4, 8, 3, routing_kind::one_expert)};
  for (const auto& e : edge_cases(4)) cases.push_back(e);
  auto capped = make(1, 4, 4, 16, 4, routing_kind::uneven);
  capped.capacity.mode = epx::capacity_mode::local;
  capped.capacity.factor = 0.5;
  cases.push_back(capped);
  auto wide = make(1, 4, 4, 16, 6);
  wide.hidden = static_cast<int>(epx::test::tsan_hidden(300, 100));
  wide.rows = [](int) { return std::size_t{40}; };
  cases.push_back(wide);
  for (auto c : cases) {
    c.sends = epx::row_sends::per_rank;
    check_case<float>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_sends_agree<comm_t, float>(comm, c); });
  }
  for (auto c : {make(2, 4, 4, 16, 4, routing_kind::uneven), make(1, 4, 2, 8, 8)}) {
    c.sends = epx::row_sends::per_rank;
    check_case<epx::bf16>(c);
    check_case<double>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_sends_agree<comm_t, epx::bf16>(comm, c); });
  }
}

namespace {

// Experts that return their rows (forward) and their gradient rows (backward) unchanged.
struct per_rank_identity_experts {
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const float>& in, float* out) {
    epx::exec::copy_n(ex, in.rows, in.num_rows * in.hidden, out);
  }
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const float>& in, const float* g, float* gi) {
    epx::exec::copy_n(ex, g, in.num_rows * in.hidden, gi);
  }
};

}  // namespace

TEST_CASE("layer: per-rank sends sum a token's slots on each owner in slot order, then the owners in the order of their first slots, bitwise") {
  // ep = 4 ranks of 2 experts (rank q owns 2q, 2q+1), top-4, x = 1 and grad_out = 1, experts
  // that return their rows: slot j contributes w[t, j] exactly, to out and to grad_x alike.
  // With weights 1, 2^-24 and 0 the order of the float32 sums shows in the bits: 1 + 2^-24
  // rounds back to 1, 2^-24 + 2^-24 + 1 does not. The expected values follow section 14
  // step by step here; the tokens are chosen so that summing in slot order (per-slot
  // sends), the owners in ep-rank order, or the owners in the order of their last slots
  // gives other bits for some token.
  constexpr int E = 8, k = 4, L = 2, ep = 4;
  constexpr std::size_t H = 4;
  const float u = std::ldexp(1.0f, -24);
  const std::vector<std::int32_t> ids = {6, 0, 2, 1,   // owners 3, 0, 1, 0
                                         2, 0, 3, 4,   // owners 1, 0, 1, 2
                                         1, 7, 4, 5,   // owners 0, 3, 2, 2
                                         2, 0, 4, 3,   // owners 1, 0, 2, 1
                                         3, 6, 1, 7};  // owners 1, 3, 0, 3
  const std::vector<float> w = {1, u, u, 0, u, 1, u, 0, u, u, 1, 0, u, u, 1, 0, u, u, 1, 0};
  const std::size_t N = ids.size() / k;
  // Section 14: each owner's sum in float32 over the token's slots there, in slot order;
  // the source adds those sums in the order of each owner's first slot.
  std::vector<float> want(N);
  int per_slot_differs = 0, by_rank_differs = 0, by_last_differs = 0;
  for (std::size_t t = 0; t < N; ++t) {
    float owner_sum[ep] = {}, per_slot = 0.0f;
    int first[ep], last[ep];
    std::fill(first, first + ep, k);
    std::fill(last, last + ep, -1);
    for (int j = 0; j < k; ++j) {
      const int d = ids[t * k + j] / L;
      owner_sum[d] += w[t * k + j];
      first[d] = std::min(first[d], j);
      last[d] = j;
      per_slot += w[t * k + j];
    }
    const auto in_order = [&](const int* slot_of) {  // the owners' sums by ascending slot_of
      float acc = 0.0f;
      for (int j = 0; j < k; ++j)
        for (int d = 0; d < ep; ++d)
          if (last[d] >= 0 && slot_of[d] == j) acc += owner_sum[d];
      return acc;
    };
    const int rank_order[ep] = {0, 1, 2, 3};
    want[t] = in_order(first);
    per_slot_differs += per_slot != want[t];
    by_rank_differs += in_order(rank_order) != want[t];
    by_last_differs += in_order(last) != want[t];
  }
  CHECK(per_slot_differs > 0);
  CHECK(by_rank_differs > 0);
  CHECK(by_last_differs > 0);
  epx::mesh_config mc;
  mc.fsdp = 4;
  mc.ep = 4;
  mc.experts = E;
  const epx::mesh m(mc);
  on_ranks(4, [&](comm_t& comm) {
    epx::layer_options o;
    o.hidden = H;
    o.top_k = k;
    o.sends = epx::row_sends::per_rank;
    epx::moe_layer<comm_t, float, epx::impl::all_to_all, epx::test::test_exec> layer(m, comm, o);
    per_rank_identity_experts experts;
    const std::vector<float> x(N * H, 1.0f), g(N * H, 1.0f);
    std::vector<float> out(N * H, 7.0f), gx(N * H, 7.0f), gw(N * k, 7.0f);
    auto saved = layer.forward(epx::span<const float>(x), epx::span<const std::int32_t>(ids),
                               epx::span<const float>(w), epx::span<float>(out), experts, epx::mode::train);
    layer.backward(std::move(saved), epx::span<const float>(g), epx::span<float>(gx), epx::span<float>(gw), experts);
    std::string f;
    for (std::size_t t = 0; t < N; ++t)
      for (std::size_t h = 0; h < H; ++h) {
        if (std::memcmp(&out[t * H + h], &want[t], sizeof(float)) != 0)
          f += epx::detail::concat("rank ", comm.rank(), " token ", t, ": out ", out[t * H + h], " - 1 = ",
                                   out[t * H + h] - 1.0f, ", want ", want[t], " - 1 = ", want[t] - 1.0f, "\n");
        if (std::memcmp(&gx[t * H + h], &want[t], sizeof(float)) != 0)
          f += epx::detail::concat("rank ", comm.rank(), " token ", t, ": grad_x ", gx[t * H + h], " - 1 = ",
                                   gx[t * H + h] - 1.0f, ", want ", want[t], " - 1 = ", want[t] - 1.0f, "\n");
      }
    for (std::size_t i = 0; i < N * k; ++i)  // <y, grad_out> = H ones
      if (gw[i] != static_cast<float>(H)) f += epx::detail::concat("rank ", comm.rank(), " grad_weights[", i, "] ", gw[i], "\n");
    return f;
  });
}

TEST_CASE("layer: experts that allow it run in place in inference (both routes, and the masked path)") {
  for (bool direct : {true, false}) {
    for (auto c : {make(2, 4, 4, 16, 2, routing_kind::uneven), make(1, 4, 4, 8, 8, routing_kind::first_rank_only)}) {
      c.peer_access = direct;
      on_ranks(world_of(c.topology),
               [&](comm_t& comm) { return epx::test::check_in_place_experts<comm_t, float>(comm, c); });
    }
  }
  // The masked all-reduce path (ep == tp) too.
  auto c = make(4, 2, 4, 8, 2, routing_kind::uneven);
  on_ranks(8, [&](comm_t& comm) {
    return epx::test::check_in_place_experts<comm_t, float, epx::impl::all_reduce>(comm, c);
  });
}

}  // namespace test_layer_cpp
