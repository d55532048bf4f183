// The split-phase calls of the layer (spec section 13) and FP8 dispatch (section 12) on the
// MPI backend: the bodies of core/split_cases.hpp and core/fp8_layer_cases.hpp for the
// meshes that fit the job's size (np 1, 2, 4, 8).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/fp8_layer_cases.hpp"
#include "core/mpi_cases.hpp"
#include "core/split_cases.hpp"
#include "epx/comm/mpi.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using epx::test::split_misuse;
using comm_t = epx::mpi::communicator;

const epx::test::case_maker make{};

std::vector<layer_case> cases_for(int n) {
  switch (n) {
    case 1: return {make(1, 1, 1, 4, 2)};
    case 2: return {make(1, 2, 2, 8, 2), make(2, 1, 2, 4, 1)};
    case 4: return {make(2, 2, 4, 8, 2, routing_kind::uneven), make(1, 4, 2, 8, 8), make(1, 2, 2, 4, 2, routing_kind::random, 2)};
    case 8: return {make(4, 2, 4, 16, 2), make(2, 4, 4, 16, 2, routing_kind::uneven), make(2, 4, 8, 16, 8)};
    default: return {};
  }
}

}  // namespace

TEST_CASE("split phase (MPI): bitwise the fused calls, float32 and bf16, train and inference") {
  comm_t world = comm_t::world();
  for (const auto& c : cases_for(world.size())) {
    CAPTURE(c.describe());
    std::string f = epx::test::check_split_matches_fused<comm_t, float>(world, c);
    f += epx::test::check_split_matches_fused<comm_t, epx::bf16>(world, c);
    f += epx::test::check_split_matches_fused<comm_t, float>(world, c, epx::mode::inference);
    if (c.topology.ep == c.topology.tp) {
      f += epx::test::check_split_matches_fused<comm_t, float, epx::impl::all_reduce>(world, c);
      f += epx::test::check_split_matches_fused<comm_t, float, epx::impl::automatic>(world, c, epx::mode::inference);
    }
    CHECK_MESSAGE(f.empty(), f);
  }
  // A realistic hidden size with elementwise experts.
  auto big = make(1, world.size(), world.size(), 2 * world.size(), 2, routing_kind::uneven);
  big.hidden = 4096;
  big.rows = [](int) { return std::size_t{32}; };
  const std::string f = epx::test::check_split_matches_fused<comm_t, epx::bf16>(world, big, epx::mode::train, {}, false);
  CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("split phase (MPI): misuse on the last rank raises on every rank of its EP group") {
  comm_t world = comm_t::world();
  const int n = world.size();
  layer_case c = make(1, n, n, 2 * n, 2);
  struct expectation {
    split_misuse kind;
    bool everyone;
    epx::errc want;
    std::string text;
  };
  const std::vector<expectation> all = {
      {split_misuse::dispatch_wait_without_start, true, epx::errc::configuration, "dispatch_wait got an empty handle"},
      {split_misuse::combine_wait_without_start, true, epx::errc::configuration, "combine_wait needs a handle"},
      {split_misuse::combine_twice, false, epx::errc::configuration, "'already combined'"},
      {split_misuse::combine_other_layer, false, epx::errc::configuration, "made by another layer"},
      {split_misuse::out_size, false, epx::errc::input, "combine_start: out has"},
      {split_misuse::backward_combine_twice, false, epx::errc::configuration, "backward_combine_start needs"},
      {split_misuse::grad_x_size, false, epx::errc::input, "backward_combine_start: grad_x has"},
  };
  for (const auto& e : all) {
    CAPTURE(epx::test::to_string(e.kind));
    const auto r = epx::test::run_split_misuse<comm_t, float>(world, c, e.kind, e.everyone || world.rank() == n - 1);
    CAPTURE(r.message);
    REQUIRE(r.thrown);
    CHECK(r.category == e.want);
    CHECK(r.message.find(e.text) != std::string::npos);
    if (!e.everyone) CHECK(r.message.find("rank " + std::to_string(n - 1) + ": ") != std::string::npos);
  }
}

TEST_CASE("fp8 dispatch (MPI): against float64 and the E4M3 bound, split phase bitwise the fused calls") {
  comm_t world = comm_t::world();
  const int n = world.size();
  std::vector<layer_case> cases = {make(1, n, n, 2 * n, 2, routing_kind::uneven)};
  if (n % 2 == 0) cases.push_back(make(2, n / 2, n, 2 * n, 2));
  for (auto c : cases) {
    c.hidden = 256;
    CAPTURE(c.describe());
    const std::string f = epx::test::check_fp8_layer<comm_t, float>(world, c) +
                          epx::test::check_fp8_layer<comm_t, epx::bf16>(world, c);
    CHECK_MESSAGE(f.empty(), f);
  }
}
