// The MoE layer at the hidden sizes people run (H = 300, 4096, 7168) against the float64
// reference, with error bounds derived from the arithmetic instead of fixed tolerances.
//
// Experts: ref::diag_experts (y = a * x + b elementwise), rounded once to T by the test
// experts; the reference and the bounds of each compared element are in
// core/sizes_cases.hpp (shared with the MPI run, test_layer_sizes_mpi.cpp).
//
// Also: the all-empty case (every rank passes N = 0) with exact zeros asserted, and the
// linear (H x H) experts at H = 300 with the fixed tolerances of layer_cases.hpp.
// tests/emulated/test_layer_sizes.cpp reruns this file on exec::emulated_device.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/layer_cases.hpp"
#include "core/sizes_cases.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/stream.hpp"
#include "support/on_ranks.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_layer_sizes_cpp {

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::threads::communicator;
namespace ref = epx::ref;
using namespace epx::test::sizes;

using epx::test::world_of;

using epx::test::on_ranks;  // support/on_ranks.hpp

template <class T, class Impl = epx::impl::all_to_all>
void check_diag(const layer_case& c) {
  CAPTURE(c.describe());
  on_ranks(world_of(c.topology), [&](comm_t& comm) { return check_diag_case<comm_t, T, Impl>(comm, c); });
}

// The cases at one hidden size: the all-to-all path on both routes (tp = 1 and tp = 2),
// with per-rank sends, the staged route in rounds, and the masked all-reduce path (ep == tp).
template <class T>
void check_sizes(int H) {
  for (bool direct : {true, false}) {
    check_diag<T>(make(1, 4, 4, 8, 4, H, 4, direct));
    check_diag<T>(make(2, 2, 2, 4, 2, H, 5, direct, routing_kind::random));
  }
  for (auto c : {make(1, 4, 4, 8, 4, H, 4, false), make(2, 2, 2, 4, 3, H, 5, false, routing_kind::random)}) {
    c.sends = epx::row_sends::per_rank;
    check_diag<T>(c);
  }
  // The staged route in rounds of two slice rows (backward; a training forward moves its
  // rows at once).
  auto rounds = make(2, 2, 2, 4, 3, H, 5, false, routing_kind::random);
  rounds.stage_bytes = 2 * 3 * static_cast<std::size_t>(H) * sizeof(T);
  check_diag<T>(rounds);
  check_diag<T, epx::impl::all_reduce>(make(4, 1, 4, 8, 4, H, 4, true));
}

}  // namespace

TEST_CASE_TEMPLATE("layer sizes: H = 300, 4096, 7168 against float64 with derived bounds", T, float, epx::bf16) {
  for (int H : {300, 4096, 7168}) {
    CAPTURE(H);
    check_sizes<T>(H);
  }
}

// Every host row copy and every block of the threads communicator written around the
// caches (epx/exec/stream.hpp: from 4 MiB of one operation by default, which the cases
// above do not reach): at H = 300 (rows of 600 or 1200 bytes, so heads and tails) and 4096.
TEST_CASE_TEMPLATE("layer sizes: every row copy streamed (stream threshold 0) against float64", T, float, epx::bf16,
                   epx::fp16) {
  const std::size_t before = epx::exec::set_stream_threshold(0);
  for (int H : {300, 4096}) {
    CAPTURE(H);
    check_sizes<T>(H);
  }
  epx::exec::set_stream_threshold(before);
}

TEST_CASE("layer sizes: fp16 at H = 4096, and padding at H = 7168") {
  check_sizes<epx::fp16>(4096);
  auto c = make(1, 4, 4, 8, 4, 7168, 3, false, routing_kind::first_rank_only);
  c.pad = epx::padding{2, 4};
  check_diag<epx::bf16>(c);
}

TEST_CASE("layer sizes: linear (H x H) experts at H = 300 with the fixed tolerances") {
  for (bool direct : {true, false}) {
    auto c = make(1, 4, 4, 8, 2, 300, 4, direct);
    on_ranks(4, [&](comm_t& comm) { return epx::test::check_layer_case<comm_t, float>(comm, c); });
    on_ranks(4, [&](comm_t& comm) { return epx::test::check_layer_case<comm_t, epx::bf16>(comm, c); });
  }
  auto m = make(2, 1, 2, 4, 2, 300, 4, true);
  on_ranks(2, [&](comm_t& comm) { return epx::test::check_layer_case<comm_t, epx::bf16, epx::impl::all_reduce>(comm, m); });
}

// The bound is tight enough to tell a float32 accumulation of the k bf16 products from a
// bf16 accumulation: the bf16-accumulated sum of the same products falls outside it on
// many elements, epx's output on none.
TEST_CASE("layer sizes: the bf16 bound rejects a bf16 accumulation of the same products") {
  using T = epx::bf16;
  for (bool direct : {true, false}) {
    const auto c = make(1, 4, 4, 8, 8, 4096, 4, direct, routing_kind::random);
    CAPTURE(c.describe());
    std::vector<std::size_t> epx_out(4), bf16_out(4), elements(4), loose(4);
    on_ranks(4, [&](comm_t& comm) -> std::string {
      const auto global = ref::diag_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
      const auto r = run_diag<comm_t, T, epx::impl::all_to_all>(comm, c, global);
      const int rank = comm.rank();
      const epx::mesh m(c.topology);
      const auto d = epx::test::make_batch<T>(c, m.batch(rank));
      const auto e = expect_rank<T>(c, global, rank);
      bounds<T> bd;
      bd.k = c.top_k;
      bd.hidden = static_cast<std::size_t>(c.hidden);
      const auto bound = bd.out(e);
      const std::size_t H = static_cast<std::size_t>(c.hidden), K = static_cast<std::size_t>(c.top_k);
      const std::size_t N = d.x.size() / H;
      auto& mine = epx_out[static_cast<std::size_t>(rank)];
      auto& theirs = bf16_out[static_cast<std::size_t>(rank)];
      auto& old = loose[static_cast<std::size_t>(rank)];
      elements[static_cast<std::size_t>(rank)] = N * H;
      const double at = epx::test::atol_for<T>(), rt = epx::test::rtol_for<T>();
      for (std::size_t t = 0; t < N; ++t)
        for (std::size_t h = 0; h < H; ++h) {
          // The same products (float), summed with every partial sum rounded to bf16.
          float acc = 0.0f;
          for (std::size_t j = 0; j < K; ++j) {
            const int id = d.ids[t * K + j];
            const double y = ref::round_value<T>(std::fma(global.a(id, static_cast<int>(h)), d.x[t * H + h],
                                                          global.b(id, static_cast<int>(h))));
            const float p = static_cast<float>(d.w[t * K + j]) * static_cast<float>(y);
            acc = static_cast<float>(ref::round_value<T>(static_cast<double>(acc + p)));
          }
          const std::size_t i = t * H + h;
          const double err_b = std::abs(static_cast<double>(acc) - e.out[i]);
          if (err_b > bound[i]) ++theirs;
          if (err_b <= at + rt * std::abs(e.out[i])) ++old;  // the fixed tolerance accepts it
          if (std::abs(ref::to_d(r.out[i]) - e.out[i]) > bound[i]) ++mine;
        }
      return {};
    });
    std::size_t total = 0, outside_b = 0, outside_epx = 0, accepted_old = 0;
    for (int r = 0; r < 4; ++r) {
      total += elements[static_cast<std::size_t>(r)];
      outside_b += bf16_out[static_cast<std::size_t>(r)];
      outside_epx += epx_out[static_cast<std::size_t>(r)];
      accepted_old += loose[static_cast<std::size_t>(r)];
    }
    MESSAGE("bf16 accumulation: ", outside_b, " of ", total, " elements outside the derived bound (epx: ", outside_epx,
            "); the fixed tolerance (atol ", epx::test::atol_for<T>(), ", rtol ", epx::test::rtol_for<T>(),
            ") accepts ", accepted_old, " of them");
    CHECK(outside_epx == 0);
    CHECK(outside_b * 20 > total);  // more than 5% of the elements
  }
}

// Every rank passes N = 0. Nothing to compute, but everything to check: the (empty) output
// spans sit inside sentinel-filled buffers that must stay untouched, the experts' parameter
// gradients are exactly zero before and after the hook, the stats count nothing, and the
// same layer then runs a non-empty call correctly.
template <class T, class Impl>
std::string check_all_empty(comm_t& comm, const layer_case& c) {
  std::string f;
  const epx::mesh m(c.topology);
  const int rank = comm.rank();
  const std::string where = epx::detail::concat(c.describe(), " rank ", rank, " all empty: ");
  const auto global = ref::diag_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  epx::moe_layer<comm_t, T, Impl, epx::test::test_exec> layer(m, comm, epx::test::options_for(c));
  ref::test_diag_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
  const std::size_t H = static_cast<std::size_t>(c.hidden), K = static_cast<std::size_t>(c.top_k);
  const T sentinel = epx::convert<T>(7.0f);
  std::vector<T> x(4 * H, epx::convert<T>(1.0f)), out(4 * H, sentinel), go(4 * H, epx::convert<T>(1.0f)),
      gx(4 * H, sentinel);
  std::vector<std::int32_t> ids(4 * K, 0);
  std::vector<float> w(4 * K, 0.5f), gw(4 * K, 7.0f);
  // Empty spans that point into the middle of the buffers.
  auto saved = layer.forward(epx::span<const T>(x.data() + H, 0), epx::span<const std::int32_t>(ids.data() + K, 0),
                             epx::span<const float>(w.data() + K, 0), epx::span<T>(out.data() + H, 0), experts,
                             epx::mode::train);
  const auto st = layer.stats();
  if (saved.empty()) f += where + "a training forward returned an empty saved state\n";
  layer.backward(std::move(saved), epx::span<const T>(go.data() + H, 0), epx::span<T>(gx.data() + H, 0),
                 epx::span<float>(gw.data() + K, 0), experts);
  for (std::size_t i = 0; i < out.size(); ++i)
    if (std::memcmp(&out[i], &sentinel, sizeof(T)) != 0 || std::memcmp(&gx[i], &sentinel, sizeof(T)) != 0) {
      f += where + "wrote outside its empty output spans\n";
      break;
    }
  for (float v : gw)
    if (v != 7.0f) {
      f += where + "wrote outside its empty grad_weights span\n";
      break;
    }
  auto grads = experts.grads();
  for (double v : grads)
    if (v != 0.0 || std::signbit(v)) {
      f += where + "expert gradients are not exactly zero before the hook\n";
      break;
    }
  epx::gradient_hooks<comm_t> hooks(m, comm);
  hooks.reduce_expert(epx::span<double>(grads));
  for (double v : grads)
    if (v != 0.0) {
      f += where + "expert gradients are not exactly zero after the hook\n";
      break;
    }
  for (auto v : st.tokens_per_local_expert)
    if (v != 0) f += where + "stats.tokens_per_local_expert not zero\n";
  for (auto v : st.tokens_per_expert)
    if (v != 0) f += where + "stats.tokens_per_expert not zero\n";
  for (auto v : st.rows_sent)
    if (v != 0) f += where + "stats.rows_sent not zero\n";
  for (auto v : st.rows_received)
    if (v != 0) f += where + "stats.rows_received not zero\n";
  if (st.max_expert_load != 0.0 || st.mean_expert_load != 0.0 || st.imbalance() != 0.0)
    f += where + "stats loads not zero\n";
  // Padding rows (zero) are all the experts may have seen.
  std::size_t padding = 0;
  for (auto v : st.padding_per_local_expert) padding += static_cast<std::size_t>(v);
  if (experts.rows_seen() != padding)
    f += epx::detail::concat(where, "experts saw ", experts.rows_seen(), " rows, the padding is ", padding, "\n");
  // The same layer, a non-empty call afterwards.
  if (f.empty()) {
    layer_case c2 = c;
    c2.rows = [](int) { return std::size_t{3}; };
    const auto d = epx::test::make_batch<T>(c2, m.batch(rank));
    const auto x2 = ref::from_double<T>(d.x);
    const std::vector<float> w2(d.w.begin(), d.w.end());
    std::vector<T> out2(3 * H);
    layer.forward(epx::span<const T>(x2), epx::span<const std::int32_t>(d.ids), epx::span<const float>(w2),
                  epx::span<T>(out2), experts, epx::mode::inference);
    auto e = expect_batch<T>(d, global, c.top_k);
    bounds<T> bd;
    bd.k = c.top_k;
    bd.partials = std::is_same_v<Impl, epx::impl::all_reduce> ? c.topology.ep : 1;
    f += within(out2, e.out, bd.out(e), where + "the next call's out");
  }
  return f;
}

TEST_CASE("layer sizes: all ranks empty: nothing written, gradients exactly zero, then a normal call") {
  for (auto pad : {epx::padding{}, epx::padding{2, 4}}) {
    for (bool direct : {true, false}) {
      auto c = make(2, 2, 4, 8, 2, 4096, 0, direct);
      c.rows = [](int) { return std::size_t{0}; };
      c.pad = pad;
      on_ranks(4, [&](comm_t& comm) { return check_all_empty<epx::bf16, epx::impl::all_to_all>(comm, c); });
    }
    auto c = make(4, 1, 4, 8, 2, 300, 0, true);
    c.rows = [](int) { return std::size_t{0}; };
    c.pad = pad;
    on_ranks(4, [&](comm_t& comm) { return check_all_empty<float, epx::impl::all_reduce>(comm, c); });
  }
}

}  // namespace test_layer_sizes_cpp
