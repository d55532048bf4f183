// A token that names one expert in several of its k slots (routers that sample with
// replacement, hash routing): each slot is a (token, slot) pair of its own, so the expert
// sees the row once per slot, out = sum_j w_j * expert_{ids[t, j]}(x[t]), and every slot has
// its own routing-weight gradient (spec section 3). Every way of running the layer against
// the float64 reference on routing_kind::duplicates (core/layer_cases.hpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/bounded_cases.hpp"
#include "core/fp8_layer_cases.hpp"
#include "core/layer_cases.hpp"
#include "core/split_cases.hpp"
#include "epx/comm/threads.hpp"
#include "support/on_ranks.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_duplicates_cpp {

namespace {

using epx::test::layer_case;
using epx::test::on_ranks;
using epx::test::routing_kind;
using epx::test::world_of;
using comm_t = epx::threads::communicator;

layer_case make(int tp, int fsdp, int ep, int E, int k, int R = 1) {
  layer_case c;
  c.topology.tp = tp;
  c.topology.fsdp = fsdp;
  c.topology.ep = ep;
  c.topology.dp_replicate = R;
  c.topology.experts = E;
  c.top_k = k;
  c.routing = routing_kind::duplicates;
  c.rows = [](int b) { return static_cast<std::size_t>(15 + 2 * b); };
  c.seed = static_cast<std::uint64_t>(7 + tp * 1000 + fsdp * 100 + ep * 10 + E + k * 7 + R);
  return c;
}

template <class T, class Impl = epx::impl::all_to_all>
void check_case(const layer_case& c) {
  CAPTURE(c.describe());
  on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_layer_case<comm_t, T, Impl>(comm, c); });
}

// The all-to-all meshes: ep = 1, ep = world, tp > 1, dp_replicate = 2, k up to 8.
std::vector<layer_case> meshes() {
  return {make(2, 4, 4, 16, 2), make(1, 4, 4, 8, 4), make(2, 2, 4, 16, 8), make(1, 4, 1, 4, 3),
          make(1, 2, 2, 4, 3, 2)};
}

}  // namespace

TEST_CASE("duplicate ids: the routing repeats experts within tokens (and the reference counts each slot)") {
  const layer_case c = make(1, 4, 4, 8, 4);
  const auto d = epx::test::make_batch<float>(c, 0);
  std::size_t repeated = 0, all_one = 0;
  for (std::size_t t = 0; t < c.rows_of(0); ++t) {
    std::vector<std::int32_t> row(d.ids.begin() + static_cast<std::ptrdiff_t>(t * 4),
                                  d.ids.begin() + static_cast<std::ptrdiff_t>(t * 4 + 4));
    std::sort(row.begin(), row.end());
    repeated += std::adjacent_find(row.begin(), row.end()) != row.end();
    all_one += row.front() == row.back();
  }
  CHECK(repeated >= 7);
  CHECK(all_one >= 3);
  // Two slots on one expert: the reference's out is (w0 + w1) * expert(x).
  const auto ex = epx::ref::linear_experts::random(4, 3, 5);
  const std::vector<double> x = {0.5, -1.0, 2.0}, w = {0.25, 0.5};
  const auto out = epx::ref::moe_forward(x, {2, 2}, w, ex);
  std::vector<double> y(3);
  ex.forward_row(2, x.data(), y.data());
  for (int h = 0; h < 3; ++h) CHECK(out[static_cast<std::size_t>(h)] == doctest::Approx(0.75 * y[static_cast<std::size_t>(h)]));
}

TEST_CASE("duplicate ids: per-slot sends, the direct and the staged route, rounds (float32, bf16)") {
  for (auto c : meshes()) {
    check_case<float>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_routes_agree<comm_t, float>(comm, c); });
    c.peer_access = false;
    check_case<float>(c);
    c.stage_bytes = 2 * static_cast<std::size_t>(c.top_k) * static_cast<std::size_t>(c.hidden) * sizeof(float);
    check_case<float>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_rounds_agree<comm_t, float>(comm, c); });
  }
  auto c = make(2, 4, 4, 16, 4);
  check_case<epx::bf16>(c);
  on_ranks(8, [&](comm_t& comm) { return epx::test::check_routes_agree<comm_t, epx::bf16>(comm, c); });
  // One case at H = 1024.
  auto wide = make(1, 2, 2, 4, 2);
  wide.hidden = 1024;
  wide.rows = [](int) { return std::size_t{6}; };
  check_case<float>(wide);
}

TEST_CASE("duplicate ids: per-rank sends (one row per owner, slots summed) against float64 and per-slot sends") {
  for (auto c : meshes()) {
    c.sends = epx::row_sends::per_rank;
    check_case<float>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_sends_agree<comm_t, float>(comm, c); });
  }
  auto c = make(2, 4, 4, 16, 4);
  c.sends = epx::row_sends::per_rank;
  check_case<epx::bf16>(c);
  on_ranks(8, [&](comm_t& comm) { return epx::test::check_sends_agree<comm_t, epx::bf16>(comm, c); });
}

TEST_CASE("duplicate ids: the masked all-reduce path (ep == tp)") {
  for (auto c : {make(2, 2, 2, 8, 2), make(4, 1, 4, 8, 4)}) {
    check_case<float, epx::impl::all_reduce>(c);
    check_case<epx::bf16, epx::impl::all_reduce>(c);
    on_ranks(world_of(c.topology), [&](comm_t& comm) { return epx::test::check_paths_agree<comm_t, float>(comm, c); });
  }
}

TEST_CASE("duplicate ids: capacity by position and by score, local and global") {
  for (auto mode : {epx::capacity_mode::local, epx::capacity_mode::global})
    for (auto priority : {epx::drop_priority::position, epx::drop_priority::score}) {
      auto c = make(2, 4, 4, 8, 4);
      c.capacity.mode = mode;
      c.capacity.factor = 0.75;
      c.capacity.priority = priority;
      check_case<float>(c);
      c.sends = epx::row_sends::per_rank;
      check_case<float>(c);
      auto masked = make(2, 2, 2, 8, 4);
      masked.capacity = c.capacity;
      check_case<float, epx::impl::all_reduce>(masked);
    }
}

TEST_CASE("duplicate ids: bounded mode (counts on the device), with and without overflow") {
  const auto run = [](const layer_case& c, std::int64_t cap, bool drops, bool masked) {
    CAPTURE(c.describe());
    CAPTURE(cap);
    on_ranks(world_of(c.topology), [&](comm_t& comm) {
      return masked ? epx::test::check_bounded_case<comm_t, float, epx::test::test_exec, epx::impl::all_reduce>(
                          comm, c, cap, drops)
                    : epx::test::check_bounded_case<comm_t, float, epx::test::test_exec>(comm, c, cap, drops);
    });
  };
  for (auto c : {make(2, 4, 4, 8, 4), make(1, 4, 4, 8, 2)}) {
    // No block exceeds every pair of a slice (k pairs a row where all slots name one expert).
    run(c, static_cast<std::int64_t>(c.rows_of(3)) * c.top_k, false, false);
    run(c, 2, true, false);
  }
  auto masked = make(2, 2, 2, 8, 4);
  run(masked, static_cast<std::int64_t>(masked.rows_of(1)) * masked.top_k, false, true);
  run(masked, 2, true, true);
}

TEST_CASE("duplicate ids: node statistics count a token's distinct nodes") {
  for (int rpn : {1, 2}) {
    auto c = make(1, 4, 4, 8, 4);
    c.ranks_per_node = rpn;
    check_case<float>(c);
    c.sends = epx::row_sends::per_rank;
    check_case<float>(c);
  }
  auto masked = make(4, 1, 4, 8, 4);
  masked.ranks_per_node = 2;
  check_case<float, epx::impl::all_reduce>(masked);
}

TEST_CASE("duplicate ids: determinism on OpenMP, experts in place in inference") {
  for (auto sends : {epx::row_sends::per_slot, epx::row_sends::per_rank}) {
    auto c = make(2, 4, 4, 16, 4);
    c.sends = sends;
    on_ranks(8, [&](comm_t& comm) {
      return epx::test::check_determinism<comm_t, float, epx::impl::all_to_all, epx::exec::openmp>(comm, c,
                                                                                                  epx::exec::openmp{2});
    });
    on_ranks(8, [&](comm_t& comm) { return epx::test::check_in_place_experts<comm_t, float>(comm, c); });
  }
  auto masked = make(2, 2, 2, 8, 4);
  on_ranks(4, [&](comm_t& comm) {
    return epx::test::check_in_place_experts<comm_t, float, epx::impl::all_reduce>(comm, masked);
  });
}

TEST_CASE("duplicate ids: the split phase bitwise the fused calls, FP8 dispatch") {
  for (const auto& c : {make(2, 4, 4, 16, 4), make(1, 4, 4, 8, 2)}) {
    on_ranks(world_of(c.topology),
             [&](comm_t& comm) { return epx::test::check_split_matches_fused<comm_t, float>(comm, c); });
    auto pr = c;
    pr.sends = epx::row_sends::per_rank;
    on_ranks(world_of(pr.topology),
             [&](comm_t& comm) { return epx::test::check_split_matches_fused<comm_t, float>(comm, pr); });
  }
  auto masked = make(2, 2, 2, 8, 4);
  on_ranks(4, [&](comm_t& comm) {
    return epx::test::check_split_matches_fused<comm_t, float, epx::impl::all_reduce>(comm, masked);
  });
  auto fp8 = make(2, 2, 4, 8, 4);
  fp8.hidden = 128;
  on_ranks(world_of(fp8.topology), [&](comm_t& comm) { return epx::test::check_fp8_layer<comm_t, float>(comm, fp8); });
  on_ranks(world_of(fp8.topology),
           [&](comm_t& comm) { return epx::test::check_fp8_layer<comm_t, epx::bf16>(comm, fp8); });
}

}  // namespace test_duplicates_cpp
