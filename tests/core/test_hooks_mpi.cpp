// Gradient hooks on the MPI backend when the ranks disagree on what they reduce: every rank
// of the hook's groups raises errc::input naming the hook before anything is reduced (the
// threads run is tests/core/test_hooks.cpp), with or without the communicator's own count
// checks, and the next hook with equal sizes goes through.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "epx/comm/mpi.hpp"
#include "epx/grad/hooks.hpp"

namespace {

using comm_t = epx::mpi::communicator;

// fsdp 2 x dp_replicate n/2 (efsdp 2): efsdp groups {2j, 2j+1}, dp_replicate groups {i, i+2, ...}.
epx::mesh_config mesh_for(int n) { return epx::mesh_config{1, 2, 1, n / 2, 1, 2, 0}; }

// Runs `call` on this rank and returns the message of the epx::error it raised, with its
// category checked, or "" when it raised none.
template <class Call>
std::string raised_input(Call call) {
  try {
    call();
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::input);
    return e.what();
  }
  return {};
}

void check_hooks_refuse(bool check_counts) {
  comm_t probe = comm_t::world();
  const int n = probe.size();
  if (n % 2 != 0) {
    MESSAGE("hooks_mpi: needs an even number of ranks (one rank has no peer to disagree with)");
    return;
  }
  epx::mpi::options opt;
  opt.check_counts = check_counts;
  comm_t world = comm_t::world(opt);
  const epx::mesh m(mesh_for(n));
  const int rank = world.rank();
  epx::gradient_hooks<comm_t> hooks(m, world);

  // The last rank passes one element more to the expert hook.
  std::vector<double> g(6 + (rank == n - 1 ? 1 : 0), 1.0);
  std::string msg = raised_input([&] { hooks.reduce_expert(epx::span<double>(g)); });
  CAPTURE(msg);
  CHECK(msg.find("reduce_expert_gradients: the ranks disagree on the gradient they reduce") != std::string::npos);
  CHECK(msg.find("rank 1 of the efsdp group (world rank " + std::to_string(n - 1) +
                 ") passes a gradient of 7 elements but rank 0 (world rank " +
                 std::to_string(m.group_member(epx::group_kind::efsdp, n - 1, 0)) + ") passes 6") !=
        std::string::npos);
  CHECK(msg.find("nothing was reduced") != std::string::npos);
  for (std::size_t i = 0; i < 6; ++i) CHECK(g[i] == 1.0);  // untouched

  // The fsdp groups agree within themselves, the replicas differ (with dp_replicate > 1).
  if (m.dp_replicate() > 1) {
    std::vector<float> d(6 + (m.coords(rank).replica == m.dp_replicate() - 1 ? 2 : 0), 1.0f);
    msg = raised_input([&] { hooks.reduce_dense(epx::span<float>(d)); });
    CAPTURE(msg);
    CHECK(msg.find("reduce_dense_gradients: the ranks disagree") != std::string::npos);
    const int last = m.dp_replicate() - 1;
    CHECK(msg.find("rank " + std::to_string(last) + " of the dp_replicate group (world rank " +
                   std::to_string(m.group_member(epx::group_kind::dp_replicate, rank, last)) +
                   ") passes a gradient of 8 elements but rank 0 (world rank " +
                   std::to_string(m.group_member(epx::group_kind::dp_replicate, rank, 0)) + ") passes 6") !=
          std::string::npos);
  }

  // A reduce-scatter whose gradient is not efsdp x shard on rank 0 only.
  std::vector<double> full(12 + (rank == 0 ? 1 : 0), 1.0), shard(6);
  msg = raised_input(
      [&] { hooks.reduce_scatter_expert(epx::span<const double>(full), epx::span<double>(shard)); });
  CAPTURE(msg);
  CHECK(msg.find("reduce_scatter_expert_gradients: the ranks disagree") != std::string::npos);
  CHECK(msg.find("passes a gradient of 13 elements, not efsdp size (2) x its shard (6)") != std::string::npos);

  // Rank 0 cannot hand the dense hook a gradient (a binding's tensor of another type):
  // it joins the agreement, and every rank raises naming it.
  std::vector<float> dense(6, 1.0f);
  msg = raised_input([&] {
    if (rank == 0)
      epx::detail::refuse_hook("reduce_dense_gradients", hooks.fsdp(), "fsdp", hooks.dp_replicate(), false,
                               "a gradient of int64 cannot be reduced");
    else
      hooks.reduce_dense(epx::span<float>(dense));
  });
  CAPTURE(msg);
  CHECK(msg.find("reduce_dense_gradients: the ranks disagree") != std::string::npos);
  // refuse_hook without the world rank: the rank is named in its group alone.
  CHECK(msg.find("rank 0 of the fsdp group cannot reduce its gradient: a gradient of int64 cannot be reduced") !=
        std::string::npos);
  for (float v : dense) CHECK(v == 1.0f);

  // The ranks are in step: equal sizes go through (ones summed over efsdp and dp_replicate, / B).
  std::vector<double> ok(6, 1.0);
  hooks.reduce_expert(epx::span<double>(ok));
  const double want = static_cast<double>(m.efsdp() * m.dp_replicate()) / m.batches();
  for (double v : ok) CHECK(v == want);
}

}  // namespace

TEST_CASE("hooks (MPI): ranks that pass other sizes raise errc::input on every rank, naming the hook") {
  check_hooks_refuse(true);
}

TEST_CASE("hooks (MPI): the same without the communicator's count checks") { check_hooks_refuse(false); }
