// The MoE layer at the hidden sizes people run (H = 4096 and 7168) on the MPI backend,
// against the float64 reference with the bounds of core/sizes_cases.hpp (the threads run is
// tests/core/test_layer_sizes.cpp): the direct route through the communicator's shared
// window, the staged route (MPI's all-to-all), per-rank sends, the staged route in rounds
// and the masked all-reduce path, in float32 and bf16 (fp16 at H = 4096), for the meshes of
// the job's size.
#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "core/sizes_cases.hpp"
#include "epx/comm/mpi.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using epx::test::sizes::make;
using comm_t = epx::mpi::communicator;

// The all-to-all cases of a world of n ranks at hidden size H.
std::vector<layer_case> cases_for(int n, int H) {
  std::vector<layer_case> v;
  for (bool direct : {true, false}) {
    v.push_back(make(1, n, n, 2 * n, n == 1 ? 2 : 4, H, 3, direct));
    if (n % 2 == 0) v.push_back(make(2, n / 2, n == 2 ? 2 : n / 2, 2 * n, 3, H, 4, direct, routing_kind::random));
  }
  auto per_rank = make(1, n, n, 2 * n, n == 1 ? 2 : 4, H, 3, false, routing_kind::random);
  per_rank.sends = epx::row_sends::per_rank;
  v.push_back(per_rank);
  auto rounds = make(1, n, n, 2 * n, 2, H, 4, false, routing_kind::random);
  rounds.stage_bytes = 2 * 2 * static_cast<std::size_t>(H) * sizeof(float);
  v.push_back(rounds);
  return v;
}

template <class T>
void check_at(comm_t& world, int H) {
  const int n = world.size();
  for (const auto& c : cases_for(n, H)) {
    CAPTURE(c.describe());
    const std::string f = epx::test::sizes::check_diag_case<comm_t, T>(world, c);
    CHECK_MESSAGE(f.empty(), f);
  }
  const auto masked = make(n, 1, n, 2 * n, n == 1 ? 1 : 2, H, 3, true);
  CAPTURE(masked.describe());
  const std::string f = epx::test::sizes::check_diag_case<comm_t, T, epx::impl::all_reduce>(world, masked);
  CHECK_MESSAGE(f.empty(), f);
}

}  // namespace

TEST_CASE_TEMPLATE("layer sizes (MPI): H = 4096 and 7168 against float64 with derived bounds", T, float, epx::bf16) {
  comm_t world = comm_t::world();
  for (int H : {4096, 7168}) {
    CAPTURE(H);
    check_at<T>(world, H);
  }
}

// fp16 (IEEE binary16) within the bounds derived from its 11-bit significand, at one size.
TEST_CASE("layer sizes (MPI): fp16 at H = 4096 against float64 with derived bounds") {
  comm_t world = comm_t::world();
  check_at<epx::fp16>(world, 4096);
}
