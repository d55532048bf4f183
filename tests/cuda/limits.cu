// Capacity, node-limited routing and the balancing functions on exec::cuda against the
// host policy (the same functors): positions of the capacity step bitwise, node-limited ids
// (the same float32 math, only exp ulps may differ), losses and gradients to float32
// rounding, the bias update bitwise. Needs a GPU (label cuda).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/exec/cuda.cuh"
#include "epx/impl/limits.hpp"
#include "epx/routing/balance.hpp"
#include "epx/routing/routing.hpp"

using namespace epx::test::cuda;

namespace {





std::vector<std::int32_t> skewed_ids(std::size_t n, int k, int E, unsigned seed) {
  std::mt19937 g(seed);
  std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
  for (std::size_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      int e;
      bool again;
      do {
        e = static_cast<int>(std::pow(static_cast<double>(g() % 1000) / 1000.0, 3.0) * E);
        again = false;
        for (int i = 0; i < j; ++i) again = again || ids[t * k + i] == e;
      } while (again);
      ids[t * k + j] = e;
    }
  return ids;
}

}  // namespace

TEST_CASE("capacity on the device: the same send positions as the host policy") {
  test_stream ts;
  const epx::exec::cuda dev{ts.s};
  const epx::exec::serial host;
  const std::size_t n = 2000;
  const int k = 4, E = 32, S = 4;
  const auto ids = skewed_ids(n, k, E, 3);
  std::vector<float> w(ids.size());
  std::mt19937 g(4);
  for (auto& v : w) v = static_cast<float>(g() % 9) * 0.125f;  // many ties
  auto d_ids = to_device(dev, ids);
  auto d_w = to_device(dev, w);
  for (auto mode : {epx::capacity_mode::local, epx::capacity_mode::global})
    for (auto prio : {epx::drop_priority::position, epx::drop_priority::score}) {
      epx::capacity_policy c;
      c.mode = mode;
      c.factor = 0.8;
      c.priority = prio;
      CAPTURE(static_cast<int>(mode));
      CAPTURE(static_cast<int>(prio));
      // Masked path (four sources in one plan, compacted) and all-to-all path (one source).
      auto hp = epx::layout::build_plan(host, ids.data(), w.data(), n, k, E);
      auto dp = epx::layout::build_plan(dev, d_ids.data(), d_w.data(), n, k, E);
      epx::detail::call_limits hl, dl;
      epx::detail::apply_capacity_masked(c, host, S, E, k, n, ids.data(), w.data(), hp, hl);
      epx::detail::apply_capacity_masked(c, dev, S, E, k, n, d_ids.data(), d_w.data(), dp, dl);
      CHECK(hl.dropped == dl.dropped);
      CHECK(std::vector<std::int64_t>(hp.pos.data(), hp.pos.data() + ids.size()) == to_host(dev, dp.pos.data(), ids.size()));
      CHECK(hp.host_offset == dp.host_offset);
      epx::detail::group_records r;
      r.size = 1;
      r.stride = epx::detail::record_header + static_cast<std::size_t>(E);
      r.data.assign(r.stride, 0);
      r.data[1] = static_cast<std::int64_t>(n);
      auto h1 = epx::layout::build_plan_counts(host, ids.data(), w.data(), n, k, E);
      auto d1 = epx::layout::build_plan_counts(dev, d_ids.data(), d_w.data(), n, k, E);
      std::copy(h1.host_counts.begin(), h1.host_counts.end(), r.data.begin() + epx::detail::record_header);
      epx::detail::call_limits hl1, dl1;
      epx::detail::scatter_with_capacity(c, host, r, 0, 1, E, k, ids.data(), w.data(), h1, hl1);
      epx::detail::scatter_with_capacity(c, dev, r, 0, 1, E, k, d_ids.data(), d_w.data(), d1, dl1);
      CHECK(std::vector<std::int64_t>(h1.pos.data(), h1.pos.data() + ids.size()) == to_host(dev, d1.pos.data(), ids.size()));
      CHECK(std::vector<std::int64_t>(h1.src_row.data(), h1.src_row.data() + ids.size()) ==
            to_host(dev, d1.src_row.data(), ids.size()));
    }
}

TEST_CASE("node-limited routing, node statistics, losses and the bias update on the device") {
  namespace routing = epx::routing;
  test_stream ts;
  const epx::exec::cuda dev{ts.s};
  const epx::exec::serial host;
  const std::size_t N = 512;
  const int E = 64, k = 8;
  std::mt19937 g(9);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(N * E);
  for (auto& v : logits) v = nd(g);
  auto d_logits = to_device(dev, logits);
  std::vector<std::int32_t> ids(N * k), ids_d;
  std::vector<float> w(N * k);
  device_buffer<std::int32_t> d_ids(N * k, dev);
  device_buffer<float> d_w(N * k, dev);
  const routing::node_limit nl{8, 2};
  for (int which = 0; which < 3; ++which) {
    std::vector<float> bias(E, 0.01f);
    auto d_bias = to_device(dev, bias);
    routing::sigmoid_bias sh, sd;
    sh.bias = bias.data();
    sd.bias = d_bias.data();
    sh.limit = sd.limit = nl;
    if (which == 0) {
      routing::route(routing::softmax_topk{true, nl}, host, logits.data(), N, E, k, ids.data(), w.data());
      routing::route(routing::softmax_topk{true, nl}, dev, d_logits.data(), N, E, k, d_ids.data(), d_w.data());
    } else if (which == 1) {
      routing::route(routing::topk_softmax{nl}, host, logits.data(), N, E, k, ids.data(), w.data());
      routing::route(routing::topk_softmax{nl}, dev, d_logits.data(), N, E, k, d_ids.data(), d_w.data());
    } else {
      routing::route(sh, host, logits.data(), N, E, k, ids.data(), w.data());
      routing::route(sd, dev, d_logits.data(), N, E, k, d_ids.data(), d_w.data());
    }
    ids_d = to_host(dev, d_ids.data(), ids.size());
    std::size_t mismatch = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) mismatch += ids[i] != ids_d[i];
    CHECK(mismatch * 100 <= ids.size());  // only near ties may differ (exp ulps)
  }
  // What follows compares host and device on the same ids: the host's.
  epx::exec::copy_from_host(dev, ids.data(), ids.size(), d_ids.data());
  // Node statistics through the layer's helper.
  epx::mesh_config mc;
  mc.fsdp = 8;
  mc.ep = 8;
  mc.experts = E;
  const epx::mesh m(mc);
  epx::layer_options o;
  o.top_k = k;
  o.ranks_per_node = 1;
  const std::vector<std::int64_t> none(E, 0);
  const auto th = epx::detail::count_nodes(m, o, host, ids.data(), N, k, none, false);
  const auto td = epx::detail::count_nodes(m, o, dev, d_ids.data(), N, k, none, false);
  for (int i = 0; i < 3; ++i) CHECK(th.tally[i] == td.tally[i]);
  // Losses and gradients.
  const auto load = routing::expert_load(host, ids.data(), N, k, E);
  CHECK(routing::expert_load(dev, d_ids.data(), N, k, E) == load);
  const epx::span<const std::int64_t> ls(load.data(), load.size());
  CHECK(std::fabs(routing::aux_loss(dev, d_logits.data(), N, E, ls, 0.01) -
                  routing::aux_loss(host, logits.data(), N, E, ls, 0.01)) <= 1e-6);
  CHECK(std::fabs(routing::z_loss(dev, d_logits.data(), N, E, 0.001) - routing::z_loss(host, logits.data(), N, E, 0.001)) <=
        1e-5);
  std::vector<float> gh(N * E);
  device_buffer<float> gd(N * E, dev);
  routing::sequence_balance_loss_backward(host, logits.data(), ids.data(), N, E, k, 64, 0.01, 1.0f, gh.data());
  routing::sequence_balance_loss_backward(dev, d_logits.data(), d_ids.data(), N, E, k, 64, 0.01, 1.0f, gd.data());
  const auto gdh = to_host(dev, gd.data(), gh.size());
  double err = 0;
  for (std::size_t i = 0; i < gh.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(gdh[i]) - gh[i]));
  CHECK(err <= 1e-7);
  std::vector<float> bias(E, 0.5f);
  auto d_bias = to_device(dev, bias);
  routing::update_bias(host, bias.data(), ls, 0.01f);
  routing::update_bias(dev, d_bias.data(), ls, 0.01f);
  CHECK(bias == to_host(dev, d_bias.data(), bias.size()));
}
