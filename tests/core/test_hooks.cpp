// Gradient hooks (spec section 6): expert gradients become the mean over all B batches.
#include <doctest/doctest.h>

#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_hooks_cpp {

namespace {

using comm_t = epx::threads::communicator;
constexpr std::size_t kLen = 6;

// A per-batch gradient contribution: random, determined by (stage, batch, owner slot).
std::vector<double> contribution(int stage, int batch, int slot, std::size_t n) {
  return epx::ref::random_normal(1, n, static_cast<std::uint64_t>(stage * 10007 + batch * 101 + slot * 7 + 1));
}

void check_hooks(const epx::mesh_config& mc) {
  const epx::mesh m(mc);
  const int world = m.world();
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  epx::threads::run(world, [&](comm_t& comm) {
    std::string& f = failures[static_cast<std::size_t>(comm.rank())];
    const int r = comm.rank();
    const auto x = m.coords(r);
    const int q = m.ep_rank(r);
    epx::gradient_hooks<comm_t> hooks(m, comm);
    // Expert gradient of ep rank q's experts: summed over the distinct batches of its EP group.
    std::set<int> mine;
    for (int member : m.group_members(epx::group_kind::ep, r)) mine.insert(m.batch(member));
    std::vector<double> g(kLen, 0.0), want(kLen, 0.0);
    for (int b : mine) {
      const auto c = contribution(x.pp, b, q, kLen);
      for (std::size_t i = 0; i < kLen; ++i) g[i] += c[i];
    }
    for (int b = 0; b < m.batches(); ++b) {
      const auto c = contribution(x.pp, b, q, kLen);
      for (std::size_t i = 0; i < kLen; ++i) want[i] += c[i] / m.batches();
    }
    std::vector<float> gf(g.begin(), g.end());
    hooks.reduce_expert(epx::span<double>(g));
    hooks.reduce_expert(epx::span<float>(gf));
    auto c1 = epx::ref::compare(g, want, 1e-12, 1e-12, "reduce_expert (double)");
    auto c2 = epx::ref::compare(gf, want, 1e-5, 1e-5, "reduce_expert (float)");
    if (!c1.ok) f += c1.message + "\n";
    if (!c2.ok) f += c2.message + "\n";

    // Sharded expert weights: the full gradient reduce-scattered over efsdp.
    const std::size_t shard = kLen;
    const std::size_t full = shard * static_cast<std::size_t>(m.efsdp());
    std::vector<double> gfull(full, 0.0), wfull(full, 0.0), out(shard, -1.0);
    for (int b : mine) {
      const auto c = contribution(x.pp, b, q + 100, full);
      for (std::size_t i = 0; i < full; ++i) gfull[i] += c[i];
    }
    for (int b = 0; b < m.batches(); ++b) {
      const auto c = contribution(x.pp, b, q + 100, full);
      for (std::size_t i = 0; i < full; ++i) wfull[i] += c[i] / m.batches();
    }
    hooks.reduce_scatter_expert(epx::span<const double>(gfull), epx::span<double>(out));
    const std::size_t at = static_cast<std::size_t>(m.efsdp_rank(r)) * shard;
    const std::vector<double> wshard(wfull.begin() + static_cast<std::ptrdiff_t>(at),
                                     wfull.begin() + static_cast<std::ptrdiff_t>(at + shard));
    auto c3 = epx::ref::compare(out, wshard, 1e-12, 1e-12, "reduce_scatter_expert");
    if (!c3.ok) f += c3.message + "\n";

    // Dense weights (a TP shard each): mean over the B batches.
    std::vector<double> d = contribution(x.pp, m.batch(r), 1000 + x.tp, kLen), dwant(kLen, 0.0);
    for (int b = 0; b < m.batches(); ++b) {
      const auto c = contribution(x.pp, b, 1000 + x.tp, kLen);
      for (std::size_t i = 0; i < kLen; ++i) dwant[i] += c[i] / m.batches();
    }
    hooks.reduce_dense(epx::span<double>(d));
    auto c4 = epx::ref::compare(d, dwant, 1e-12, 1e-12, "reduce_dense");
    if (!c4.ok) f += c4.message + "\n";
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(failures[static_cast<std::size_t>(r)].empty(), failures[static_cast<std::size_t>(r)]);
  }
}

}  // namespace

TEST_CASE("hooks: expert, sharded expert and dense gradients are the mean over B = dp_replicate * fsdp") {
  //                       tp fsdp pp R ep E
  check_hooks(epx::mesh_config{2, 4, 1, 1, 4, 8, 0});
  check_hooks(epx::mesh_config{1, 8, 1, 1, 4, 8, 0});
  check_hooks(epx::mesh_config{4, 2, 1, 1, 4, 8, 0});
  check_hooks(epx::mesh_config{8, 1, 1, 1, 8, 8, 0});
  check_hooks(epx::mesh_config{2, 4, 1, 1, 8, 8, 0});
  check_hooks(epx::mesh_config{1, 2, 1, 2, 2, 4, 0});  // dp_replicate = 2
  check_hooks(epx::mesh_config{2, 2, 2, 1, 2, 4, 0});  // pp = 2
  check_hooks(epx::mesh_config{1, 3, 1, 2, 3, 3, 0});  // odd, world 6
  check_hooks(epx::mesh_config{1, 1, 1, 1, 1, 1, 0});  // one rank
}

TEST_CASE("hooks: communicators that do not match the mesh raise") {
  epx::threads::run(2, [](comm_t& comm) {
    const epx::mesh m(epx::mesh_config{1, 2, 1, 1, 1, 2, 0});  // efsdp = 2
    std::vector<float> g(3, 1.0f);
    bool raised = false;
    try {
      epx::reduce_expert_gradients(comm, comm, m, epx::span<float>(g));  // dp_replicate comm of size 2 != 1
    } catch (const epx::error& e) {
      raised = e.category() == epx::errc::configuration &&
               std::string(e.what()).find("dp_replicate 2") != std::string::npos;
    }
    if (!raised) throw std::runtime_error("mismatched communicators were accepted");
  });
  CHECK(true);
}

TEST_CASE("hooks: each hook names itself and both sizes when its communicators do not match the mesh") {
  epx::mesh_config mc;
  mc.fsdp = 2;
  mc.ep = 1;
  mc.experts = 2;  // efsdp = fsdp * tp / ep = 2, dp_replicate = 1
  const epx::mesh m(mc);
  std::vector<std::string> got(2);
  epx::threads::run(2, [&](comm_t& comm) {
    comm_t self = comm.split(comm.rank(), 0);  // one rank: too small for efsdp and fsdp
    std::vector<float> g(4, 1.0f), shard(2, -1.0f);
    std::string& mine = got[static_cast<std::size_t>(comm.rank())];
    const auto seen = [&mine](auto call) {
      try {
        call();
        mine += "[no error]";
      } catch (const epx::error& e) {
        mine += e.category() == epx::errc::configuration ? "[" + e.message() + "]" : "[wrong category]";
      }
    };
    seen([&] { epx::reduce_expert_gradients(self, self, m, epx::span<float>(g)); });
    seen([&] {
      epx::reduce_scatter_expert_gradients(comm, comm, m, epx::span<const float>(g), epx::span<float>(shard));
    });
    seen([&] { epx::reduce_dense_gradients(self, comm, m, epx::span<float>(g)); });
    // Nothing was reduced: the gradients are as they were.
    for (float x : g)
      if (x != 1.0f) mine += "[a gradient changed]";
    for (float x : shard)
      if (x != -1.0f) mine += "[the shard was written]";
  });
  for (const auto& x : got)
    CHECK(x ==
          "[reduce_expert_gradients: communicator sizes (efsdp 1, dp_replicate 1) do not match the mesh (efsdp 2, "
          "dp_replicate 1)]"
          "[reduce_scatter_expert_gradients: communicator sizes (efsdp 2, dp_replicate 2) do not match the mesh "
          "(efsdp 2, dp_replicate 1)]"
          "[reduce_dense_gradients: communicator sizes (fsdp 1, dp_replicate 2) do not match the mesh (fsdp 2, "
          "dp_replicate 1)]");
}

namespace {

struct hook_outcome {
  bool thrown = false;
  epx::errc category = epx::errc::internal;
  std::string message;
};

// Runs `call(comm, hooks)` on every rank of `mc` under a 30 s watchdog; returns what each
// rank raised and the seconds the run took.
template <class Call>
std::vector<hook_outcome> run_hooks(const epx::mesh_config& mc, Call call, double& seconds) {
  const epx::mesh m(mc);
  std::vector<hook_outcome> seen(static_cast<std::size_t>(m.world()));
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(30);
  const auto t0 = std::chrono::steady_clock::now();
  epx::threads::run(
      m.world(),
      [&](comm_t& comm) {
        epx::gradient_hooks<comm_t> hooks(m, comm);
        auto& o = seen[static_cast<std::size_t>(comm.rank())];
        try {
          call(comm.rank(), hooks);
        } catch (const epx::error& e) {
          o.thrown = true;
          o.category = e.category();
          o.message = e.what();
        }
        // The ranks are still in step: a hook with the same sizes everywhere goes through
        // (ones summed over efsdp and dp_replicate, divided by B).
        std::vector<double> g(kLen, 1.0);
        hooks.reduce_expert(epx::span<double>(g));
        const double want = static_cast<double>(m.efsdp() * m.dp_replicate()) / m.batches();
        if (g != std::vector<double>(kLen, want))
          o.message += " [the next hook gave " + std::to_string(g[0]) + ", not " + std::to_string(want) + "]";
      },
      opts);
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return seen;
}

// Every rank raised (or those of `raising`, when given; the others completed the hook).
void expect_refused(const std::vector<hook_outcome>& seen, double seconds, const std::string& hook,
                    const std::string& words, const std::set<std::size_t>& raising = {}) {
  CHECK(seconds < 10.0);  // no rank waited for the watchdog
  for (std::size_t r = 0; r < seen.size(); ++r) {
    CAPTURE(r);
    CAPTURE(seen[r].message);
    if (!raising.empty() && raising.count(r) == 0) {
      CHECK(!seen[r].thrown);
      CHECK(seen[r].message.empty());
      continue;
    }
    CHECK(seen[r].thrown);
    CHECK(seen[r].category == epx::errc::input);
    CHECK(seen[r].message.find(hook + ": the ranks disagree on the gradient they reduce") != std::string::npos);
    CHECK(seen[r].message.find(words) != std::string::npos);
    CHECK(seen[r].message.find("nothing was reduced") != std::string::npos);
    CHECK(seen[r].message.find("the next hook gave") == std::string::npos);
  }
}

}  // namespace

TEST_CASE("hooks: a rank that passes another size or element type raises errc::input on every rank, naming the hook") {
  // world 4: efsdp (and fsdp) groups {0,1} and {2,3}; dp_replicate groups {0,2} and {1,3}.
  const epx::mesh_config mc{1, 2, 1, 2, 1, 2, 0};
  double seconds = 0.0;
  SUBCASE("reduce_expert: one rank of one efsdp group passes one element more") {
    // Each rank's own values, kept: nothing is reduced on any rank, the other efsdp group's
    // included (docs/guarantees.md: the error comes before anything is reduced).
    const auto mine = [](int rank) { return std::vector<double>(kLen + (rank == 1 ? 1 : 0), 1.0 + rank); };
    std::vector<std::vector<double>> grads(4);
    const auto seen = run_hooks(mc, [&](int rank, epx::gradient_hooks<comm_t>& h) {
      auto& g = grads[static_cast<std::size_t>(rank)];
      g = mine(rank);
      h.reduce_expert(epx::span<double>(g));
    }, seconds);
    expect_refused(seen, seconds, "reduce_expert_gradients",
                   "rank 1 of the efsdp group (world rank 1) passes a gradient of 7 elements but rank 0 (world rank 0) "
                   "passes 6");
    for (int r = 0; r < 4; ++r) CHECK_MESSAGE(grads[static_cast<std::size_t>(r)] == mine(r), "rank ", r, "'s gradient changed");
    // The other efsdp group agreed within itself and learns why through dp_replicate.
    CHECK(seen[2].message.find("in the efsdp group of rank 0 of the dp_replicate group (world rank 0): rank 1 of "
                               "the efsdp group (world rank 1) passes") != std::string::npos);
  }
  SUBCASE("the free function without a world rank names the rank in its group alone") {
    const auto seen = run_hooks(mc, [](int rank, epx::gradient_hooks<comm_t>& h) {
      std::vector<double> g(kLen + (rank == 1 ? 1 : 0), 1.0);
      epx::reduce_expert_gradients(h.efsdp(), h.dp_replicate(), h.topology(), epx::span<double>(g));
    }, seconds);
    expect_refused(seen, seconds, "reduce_expert_gradients",
                   "rank 1 of the efsdp group passes a gradient of 7 elements but rank 0 passes 6");
    for (const auto& x : seen) CHECK(x.message.find("world rank") == std::string::npos);
  }
  SUBCASE("reduce_dense: the fsdp groups agree within themselves but not across dp_replicate") {
    const auto seen = run_hooks(mc, [](int rank, epx::gradient_hooks<comm_t>& h) {
      std::vector<float> g(kLen + (rank >= 2 ? 1 : 0), 1.0f);
      h.reduce_dense(epx::span<float>(g));
    }, seconds);
    expect_refused(seen, seconds, "reduce_dense_gradients", "passes a gradient of 7 elements");
    // dp_replicate groups {0,2} and {1,3}: the member that passes more is world rank 2 or 3.
    for (std::size_t r = 0; r < seen.size(); ++r)
      CHECK(seen[r].message.find("rank 1 of the dp_replicate group (world rank " + std::to_string(2 + r % 2) +
                                 ") passes a gradient of 7 elements but rank 0 (world rank " + std::to_string(r % 2) +
                                 ") passes 6") != std::string::npos);
  }
  SUBCASE("reduce_scatter_expert: one rank's gradient is not efsdp x its shard") {
    const auto seen = run_hooks(mc, [](int rank, epx::gradient_hooks<comm_t>& h) {
      std::vector<double> g(2 * kLen + (rank == 3 ? 1 : 0), 1.0), shard(kLen);
      h.reduce_scatter_expert(epx::span<const double>(g), epx::span<double>(shard));
    }, seconds);
    expect_refused(seen, seconds, "reduce_scatter_expert_gradients",
                   "rank 1 of the efsdp group (world rank 3) passes a gradient of 13 elements, not efsdp size (2) x its shard "
                   "(6)");
  }
  SUBCASE("reduce_scatter_expert: shards of different sizes") {
    const auto seen = run_hooks(mc, [](int rank, epx::gradient_hooks<comm_t>& h) {
      const std::size_t n = kLen + (rank == 0 ? 1 : 0);
      std::vector<double> g(2 * n, 1.0), shard(n);
      h.reduce_scatter_expert(epx::span<const double>(g), epx::span<double>(shard));
    }, seconds);
    expect_refused(seen, seconds, "reduce_scatter_expert_gradients",
                   "rank 1 of the efsdp group (world rank 1) passes a gradient of 12 elements but rank 0 (world rank 0) "
                   "passes 14");
  }
  SUBCASE("reduce_expert: one rank passes float, the others double") {
    const auto seen = run_hooks(mc, [](int rank, epx::gradient_hooks<comm_t>& h) {
      if (rank == 0) {
        std::vector<float> g(kLen, 1.0f);
        h.reduce_expert(epx::span<float>(g));
      } else {
        std::vector<double> g(kLen, 1.0);
        h.reduce_expert(epx::span<double>(g));
      }
    }, seconds);
    expect_refused(seen, seconds, "reduce_expert_gradients",
                   "rank 1 of the efsdp group (world rank 1) passes float64 elements but rank 0 (world rank 0) passes "
                   "float32");
  }
  SUBCASE("refuse_hook: a rank that cannot hand the hook a gradient joins the agreement, named everywhere") {
    const auto seen = run_hooks(mc, [](int rank, epx::gradient_hooks<comm_t>& h) {
      if (rank == 1) {
        epx::detail::refuse_hook("reduce_dense_gradients", h.fsdp(), "fsdp", h.dp_replicate(), false,
                                 "gradients of dtype Long cannot be reduced", rank);
      } else {
        std::vector<double> g(kLen, 1.0);
        h.reduce_dense(epx::span<double>(g));
      }
    }, seconds);
    expect_refused(seen, seconds, "reduce_dense_gradients",
                   "rank 1 of the fsdp group (world rank 1) cannot reduce its gradient: gradients of dtype Long "
                   "cannot be reduced");
    // Rank 1's sizes (none) are not compared: only its reason is named.
    CHECK(seen[0].message.find("passes") == std::string::npos);
    // The other fsdp group agreed within itself and learns why through dp_replicate.
    CHECK(seen[3].message.find("in the fsdp group of rank 0 of the dp_replicate group (world rank 1): rank 1 of "
                               "the fsdp group (world rank 1) cannot reduce its gradient") != std::string::npos);
  }
  SUBCASE("efsdp = 1: the sizes are compared over dp_replicate alone, in the group that disagrees") {
    // ep = fsdp: efsdp groups of one rank; dp_replicate groups {0,2} and {1,3}, which
    // share no reduction: {0,2} reduces as usual.
    const epx::mesh_config one{1, 2, 1, 2, 2, 2, 0};
    const auto seen = run_hooks(one, [](int rank, epx::gradient_hooks<comm_t>& h) {
      std::vector<double> g(kLen + (rank == 3 ? 2 : 0), 1.0);
      h.reduce_expert(epx::span<double>(g));
    }, seconds);
    expect_refused(seen, seconds, "reduce_expert_gradients",
                   "rank 1 of the dp_replicate group (world rank 3) passes a gradient of 8 elements but rank 0 (world "
                   "rank 1) passes 6",
                   {1, 3});
  }
}

}  // namespace test_hooks_cpp
