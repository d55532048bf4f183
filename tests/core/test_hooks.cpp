// Gradient hooks (spec section 6): expert gradients become the mean over all B batches.
#include <doctest/doctest.h>

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

}  // namespace test_hooks_cpp
