// The GPU path end to end: routing policies on the device against the host policy, and
// the MoE layer with exec::cuda + the NCCL communicator at world size 1, forward and
// backward, against a float64 reference. Needs a GPU (label cuda).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/comm/nccl.cuh"
#include "epx/exec/cuda.cuh"
#include "epx/grad/hooks.hpp"

#include "epx/routing/routing.hpp"
#include "epx/layer/moe_layer.hpp"

using namespace epx::test::cuda;

namespace {

template <class T, class Policy>
void check_route_on_device(const Policy& policy, std::size_t N, int E, int k, unsigned seed) {
  namespace routing = epx::routing;
  test_stream ts;
  const epx::exec::cuda dev{ts.s};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<T> logits(N * static_cast<std::size_t>(E));
  for (auto& v : logits) v = epx::convert<T>(u(rng));
  const std::size_t nk = N * static_cast<std::size_t>(k);
  std::vector<std::int32_t> ids_h(nk);
  std::vector<float> w_h(nk);
  routing::route(policy, epx::exec::serial{}, logits.data(), N, E, k, ids_h.data(), w_h.data());

  auto d_logits = to_device(dev, logits);
  device_buffer<std::int32_t> d_ids(nk, dev);
  device_buffer<float> d_w(nk, dev);
  routing::route(policy, dev, d_logits.data(), N, E, k, d_ids.data(), d_w.data());
  const auto ids_d = to_host(dev, d_ids.data(), nk);
  const auto w_d = to_host(dev, d_w.data(), nk);
  std::size_t id_mismatch = 0;
  double w_err = 0;
  for (std::size_t i = 0; i < nk; ++i) {
    id_mismatch += ids_d[i] != ids_h[i];
    w_err = std::max(w_err, std::fabs(static_cast<double>(w_d[i]) - w_h[i]));
  }
  CHECK(id_mismatch == 0);  // same functor, same float32 math: only exp/ulp-level differences
  CHECK(w_err <= 1e-5);

  // Backward: random weight gradients -> logit gradients.
  std::vector<float> gw(nk);
  for (auto& v : gw) v = u(rng);
  std::vector<float> gl_h(N * static_cast<std::size_t>(E));
  routing::route_backward(policy, epx::exec::serial{}, logits.data(), N, E, k, ids_h.data(), w_h.data(), gw.data(),
                          gl_h.data());
  auto d_gw = to_device(dev, gw);
  device_buffer<float> d_gl(gl_h.size(), dev);
  routing::route_backward(policy, dev, d_logits.data(), N, E, k, d_ids.data(), d_w.data(), d_gw.data(), d_gl.data());
  const auto gl_d = to_host(dev, d_gl.data(), gl_h.size());
  double g_err = 0;
  for (std::size_t i = 0; i < gl_h.size(); ++i)
    g_err = std::max(g_err, std::fabs(static_cast<double>(gl_d[i]) - gl_h[i]) / (1.0 + std::fabs(gl_h[i])));
  CHECK(g_err <= 1e-5);

  // A non-finite logit is reported from the device too, naming the token.
  logits[17 * static_cast<std::size_t>(E) + 3] = epx::convert<T>(std::numeric_limits<float>::quiet_NaN());
  auto d_bad = to_device(dev, logits);
  try {
    routing::route(policy, dev, d_bad.data(), N, E, k, d_ids.data(), d_w.data());
    FAIL("a NaN logit was accepted on the device");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::input);
    CHECK(e.message().find("token 17") != std::string::npos);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("routing policies on the device match the host policy", T, float, epx::bf16, epx::fp16) {
  namespace routing = epx::routing;
  SUBCASE("softmax_topk") { check_route_on_device<T>(routing::softmax_topk{false}, 300, 64, 8, 1); }
  SUBCASE("softmax_topk renormalized") { check_route_on_device<T>(routing::softmax_topk{true}, 300, 64, 2, 2); }
  SUBCASE("topk_softmax") { check_route_on_device<T>(routing::topk_softmax{}, 300, 8, 2, 3); }
  SUBCASE("sigmoid_bias, group-limited, with bias") {
    test_stream ts;
    std::vector<float> bias(64);
    for (std::size_t e = 0; e < bias.size(); ++e) bias[e] = 0.01f * static_cast<float>(e % 9);
    // The bias lives in the policy's memory space: host for the host run, device for the
    // device run; both runs see the same values.
    routing::sigmoid_bias host_policy{bias.data(), 8, 4, 2.5f, true};
    auto d_bias = to_device(epx::exec::cuda{ts.s}, bias);
    routing::sigmoid_bias dev_policy{d_bias.data(), 8, 4, 2.5f, true};
    // check_route_on_device runs one policy on both sides: run it twice with matching bias.
    const std::size_t N = 200;
    const int E = 64, k = 8;
    std::mt19937 rng(4);
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    std::vector<T> logits(N * E);
    for (auto& v : logits) v = epx::convert<T>(u(rng));
    std::vector<std::int32_t> ids_h(N * k);
    std::vector<float> w_h(N * k);
    routing::route(host_policy, epx::exec::serial{}, logits.data(), N, E, k, ids_h.data(), w_h.data());
    const epx::exec::cuda dev{ts.s};
    auto d_logits = to_device(dev, logits);
    device_buffer<std::int32_t> d_ids(N * k, dev);
    device_buffer<float> d_w(N * k, dev);
    routing::route(dev_policy, dev, d_logits.data(), N, E, k, d_ids.data(), d_w.data());
    CHECK(to_host(dev, d_ids.data(), N * k) == ids_h);
    const auto w_d = to_host(dev, d_w.data(), N * k);
    double err = 0;
    for (std::size_t i = 0; i < w_d.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(w_d[i]) - w_h[i]));
    CHECK(err <= 1e-5);
  }
}

namespace {

// A parameter-free test expert on the device: out = s_e * in with s_e = 1 + e/4 for
// global expert e; backward grad_in = s_e * grad_out.
template <class T>
struct scale_rows {
  const T* in;
  T* out;
  float s;
  EPX_HOST_DEVICE void operator()(std::size_t i) const { out[i] = epx::convert<T>(s * epx::convert<float>(in[i])); }
};

template <class T>
struct scaling_experts {
  static float scale(int e) { return 1.0f + 0.25f * static_cast<float>(e); }
  int forward_calls = 0;
  int backward_calls = 0;

  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const T>& in, T* out) {
    ++forward_calls;
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden, n = in.count(l) * in.hidden;
      epx::exec::for_each_n(ex, n, scale_rows<T>{in.rows + b, out + b, scale(in.first_global_expert + l)});
    }
  }
  template <class Exec>
  void backward(const Exec& ex, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    ++backward_calls;
    for (int l = 0; l < in.num_local; ++l) {
      const std::size_t b = in.offsets[l] * in.hidden, n = in.count(l) * in.hidden;
      epx::exec::for_each_n(ex, n, scale_rows<T>{grad_out + b, grad_in + b, scale(in.first_global_expert + l)});
    }
  }
};

// The bound on one element that the layer sums over a token's k slots, derived as the host
// tests derive theirs (tests/core/sizes_cases.hpp, tests/support/reference.hpp): the
// reference sums in float64 the terms that the device rounds where the device rounds them,
// and the device sums the same k terms in float (relative error gamma_k of float on the sum
// S of their magnitudes) and rounds the sum to T once:
//   |got - ref| <= u |ref| + (1 + u) gamma_k S + eta,
// u the unit roundoff of T (2^-24 float, 2^-11 fp16, 2^-8 bf16) and eta half T's smallest
// subnormal (the absolute error of rounding below T's normal range). An fp16 or bf16 output
// rounded toward zero instead of to nearest is off by up to 2u |ref|, and fails it (on these
// inputs, about a quarter of the outputs do).
template <class T>
double sum_bound(double ref, double S, int k) {
  constexpr double u = std::is_same_v<T, float> ? 0x1p-24 : std::is_same_v<T, epx::fp16> ? 0x1p-11 : 0x1p-8;
  constexpr double eta = std::is_same_v<T, float> ? 0x1p-150 : std::is_same_v<T, epx::fp16> ? 0x1p-25 : 0x1p-134;
  constexpr double ua = 0x1p-24;  // float: epx::accum_t of every T here
  const double gamma_k = k * ua / (1 - k * ua);
  return u * std::fabs(ref) + (1 + u) * gamma_k * S + eta;
}

}  // namespace

TEST_CASE_TEMPLATE("moe_layer with exec::cuda and the NCCL communicator at world size 1", T, float, epx::bf16,
                   epx::fp16) {
  test_stream ts;
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  epx::nccl::options peers;
  peers.peer_access = true;  // the direct route where NCCL can give it (off by default)
  auto world = epx::nccl::communicator::from_unique_id(id, 1, 0, -1, ts.s, peers);
  // The layer's collectives and its kernels share one stream.
  const epx::exec::cuda dev{world.stream()};
  const int E = 8, k = 2;
  const std::size_t N = 97, H = 72;
  epx::mesh_config mc;
  mc.experts = E;
  const epx::mesh m(mc);
  epx::layer_options opt;
  opt.hidden = H;
  opt.top_k = k;
  opt.pad.rows_per_expert = 1;
  opt.pad.align = 4;
  epx::moe_layer<epx::nccl::communicator, T, epx::impl::all_to_all, epx::exec::cuda> layer(m, world, opt, dev);

  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> x(N * H), g(N * H);
  for (auto& v : x) v = epx::convert<T>(u(rng));
  for (auto& v : g) v = epx::convert<T>(u(rng));
  std::vector<std::int32_t> ids(N * k);
  std::vector<float> w(N * k);
  for (std::size_t t = 0; t < N; ++t) {
    const int a = static_cast<int>(rng() % E);
    const int b = (a + 1 + static_cast<int>(rng() % (E - 1))) % E;
    ids[t * k] = t < 10 ? 5 : a;  // some skew: the first tokens all pick expert 5
    ids[t * k + 1] = ids[t * k] == b ? (b + 1) % E : b;
    w[t * k] = 0.25f + 0.5f * u(rng) * u(rng);
    w[t * k + 1] = 1.0f - w[t * k];
  }
  auto d_x = to_device(dev, x);
  auto d_g = to_device(dev, g);
  auto d_ids = to_device(dev, ids);
  auto d_w = to_device(dev, w);
  device_buffer<T> d_out(N * H, dev), d_gx(N * H, dev);
  device_buffer<float> d_gw(N * k, dev);
  scaling_experts<T> experts;

  auto saved = layer.forward(epx::span<const T>(d_x.data(), N * H), epx::span<const std::int32_t>(d_ids.data(), N * k),
                             epx::span<const float>(d_w.data(), N * k), epx::span<T>(d_out.data(), N * H), experts,
                             epx::mode::train);
  // The direct route where NCCL gives peer access (a symmetric window, NCCL >= 2.28).
  const bool direct = layer.stats().peer_access;
  CHECK(direct == epx::peer_access_available(world));
  MESSAGE("route: ", direct ? "direct (NCCL symmetric window)" : "staged");
  layer.backward(std::move(saved), epx::span<const T>(d_g.data(), N * H), epx::span<T>(d_gx.data(), N * H),
                 epx::span<float>(d_gw.data(), N * k), experts);
  world.wait();
  const auto out = to_host(dev, d_out.data(), N * H);
  const auto gx = to_host(dev, d_gx.data(), N * H);
  const auto gw = to_host(dev, d_gw.data(), N * k);
  CHECK(experts.forward_calls == 1);
  CHECK(experts.backward_calls == 1);
  {
    // The staged route over the same communicator gives the same bits.
    epx::layer_options staged_opt = opt;
    staged_opt.peer_access = false;
    epx::moe_layer<epx::nccl::communicator, T, epx::impl::all_to_all, epx::exec::cuda> staged(m, world, staged_opt,
                                                                                             dev);
    scaling_experts<T> e2;
    device_buffer<T> s_out(N * H, dev), s_gx(N * H, dev);
    device_buffer<float> s_gw(N * k, dev);
    auto s2 = staged.forward(epx::span<const T>(d_x.data(), N * H), epx::span<const std::int32_t>(d_ids.data(), N * k),
                             epx::span<const float>(d_w.data(), N * k), epx::span<T>(s_out.data(), N * H), e2,
                             epx::mode::train);
    CHECK(!staged.stats().peer_access);
    staged.backward(std::move(s2), epx::span<const T>(d_g.data(), N * H), epx::span<T>(s_gx.data(), N * H),
                    epx::span<float>(s_gw.data(), N * k), e2);
    world.wait();
    const auto so = to_host(dev, s_out.data(), N * H);
    const auto sg = to_host(dev, s_gx.data(), N * H);
    const auto sw = to_host(dev, s_gw.data(), N * k);
    CHECK(std::memcmp(so.data(), out.data(), out.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(sg.data(), gx.data(), gx.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(sw.data(), gw.data(), gw.size() * sizeof(float)) == 0);
  }

  // float64 reference that rounds where the GPU path stores T: the expert outputs
  // y = T(s_e * x), the row gradients T(w * g) and T(s_e * T(w * g)); sums are exact here
  // and in float on the device, so the bound (sum_bound) covers the float sums and the final
  // rounding; e_out and e_gx are the worst error / bound.
  const auto q = [](float v) { return epx::convert<double>(epx::convert<T>(v)); };
  double e_out = 0, e_gx = 0, e_gw = 0;
  for (std::size_t t = 0; t < N; ++t) {
    for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
      const float sj = scaling_experts<T>::scale(ids[t * k + j]);
      double dot = 0;  // d out / d w_j = y_j . g
      for (std::size_t h = 0; h < H; ++h)
        dot += q(sj * epx::convert<float>(x[t * H + h])) * epx::convert<double>(g[t * H + h]);
      e_gw = std::max(e_gw, std::fabs(gw[t * k + j] - dot) / (1.0 + std::fabs(dot)));
    }
    for (std::size_t h = 0; h < H; ++h) {
      double ro = 0, rg = 0, so = 0, sg = 0;  // values and the magnitudes of their terms
      for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
        const float sj = scaling_experts<T>::scale(ids[t * k + j]);
        const float wj = w[t * k + j];
        const double to = static_cast<double>(wj) * q(sj * epx::convert<float>(x[t * H + h]));
        const double tg = q(sj * static_cast<float>(q(wj * epx::convert<float>(g[t * H + h]))));
        ro += to;
        so += std::fabs(to);
        rg += tg;
        sg += std::fabs(tg);
      }
      e_out = std::max(e_out, std::fabs(epx::convert<double>(out[t * H + h]) - ro) / sum_bound<T>(ro, so, k));
      e_gx = std::max(e_gx, std::fabs(epx::convert<double>(gx[t * H + h]) - rg) / sum_bound<T>(rg, sg, k));
    }
  }
  CHECK(e_out <= 1.0);
  CHECK(e_gx <= 1.0);
  CHECK(e_gw <= 1e-4);
  const auto& st = layer.stats();
  MESSAGE("path: ", (st.path ? st.path : "?"));

  // A bad expert id on the device is reported before any row moves, naming the value.
  ids[5 * k + 1] = E + 3;
  auto d_bad = to_device(dev, ids);
  try {
    layer.forward(epx::span<const T>(d_x.data(), N * H), epx::span<const std::int32_t>(d_bad.data(), N * k),
                  epx::span<const float>(d_w.data(), N * k), epx::span<T>(d_out.data(), N * H), experts,
                  epx::mode::inference);
    FAIL("an out-of-range expert id was accepted");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::input);
    CHECK(e.message().find(std::to_string(E + 3)) != std::string::npos);
  }
  CHECK(experts.forward_calls == 1);
}

namespace {
// One forward and backward of a world-size-1 layer with implementation Impl and type T on
// the device, against the host policy running the same layer (exec::serial, threads
// communicator of one rank): the device path and the host path give the same outputs
// within one rounding of T, and the expert-gradient hooks run on the NCCL communicator.
template <class T, class Impl>
void device_matches_host() {
  test_stream ts;
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  auto world = epx::nccl::communicator::from_unique_id(id, 1, 0, -1, ts.s);
  const epx::exec::cuda dev{world.stream()};
  const int E = 4, k = 2;
  const std::size_t N = 33, H = 40;
  epx::mesh_config mc;
  mc.experts = E;
  const epx::mesh m(mc);
  epx::layer_options opt;
  opt.hidden = H;
  opt.top_k = k;
  epx::moe_layer<epx::nccl::communicator, T, Impl, epx::exec::cuda> layer(m, world, opt, dev);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> x(N * H), g(N * H);
  for (auto& v : x) v = epx::convert<T>(u(rng));
  for (auto& v : g) v = epx::convert<T>(u(rng));
  std::vector<std::int32_t> ids(N * k);
  std::vector<float> w(N * k);
  for (std::size_t t = 0; t < N; ++t) {
    ids[t * k] = static_cast<std::int32_t>(t % E);
    ids[t * k + 1] = static_cast<std::int32_t>((t + 1) % E);
    w[t * k] = 0.75f;
    w[t * k + 1] = 0.25f;
  }
  auto d_x = to_device(dev, x);
  auto d_g = to_device(dev, g);
  auto d_ids = to_device(dev, ids);
  auto d_w = to_device(dev, w);
  device_buffer<T> d_out(N * H, dev), d_gx(N * H, dev);
  device_buffer<float> d_gw(N * k, dev);
  scaling_experts<T> experts;
  auto saved = layer.forward(epx::span<const T>(d_x.data(), N * H), epx::span<const std::int32_t>(d_ids.data(), N * k),
                             epx::span<const float>(d_w.data(), N * k), epx::span<T>(d_out.data(), N * H), experts,
                             epx::mode::train);
  layer.backward(std::move(saved), epx::span<const T>(d_g.data(), N * H), epx::span<T>(d_gx.data(), N * H),
                 epx::span<float>(d_gw.data(), N * k), experts);
  world.wait();
  const auto out = to_host(dev, d_out.data(), N * H);
  // double: relative error within 1e-12; float, bf16 and fp16: error / sum_bound.
  double e_out = 0;
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t h = 0; h < H; ++h) {
      double ro = 0, so = 0;
      for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
        const double term =
            static_cast<double>(w[t * k + j]) *
            epx::convert<double>(epx::convert<T>(scaling_experts<T>::scale(ids[t * k + j]) * epx::convert<float>(x[t * H + h])));
        ro += term;
        so += std::fabs(term);
      }
      const double err = std::fabs(epx::convert<double>(out[t * H + h]) - ro);
      if constexpr (std::is_same_v<T, double>) e_out = std::max(e_out, err / (1.0 + std::fabs(ro)) / 1e-12);
      else e_out = std::max(e_out, err / sum_bound<T>(ro, so, k));
    }
  CHECK(e_out <= 1.0);
  // The split-phase calls on the device: bitwise the fused calls.
  {
    device_buffer<T> s_out(N * H, dev), s_gx(N * H, dev);
    device_buffer<float> s_gw(N * k, dev);
    auto h = layer.dispatch_start(epx::span<const T>(d_x.data(), N * H),
                                  epx::span<const std::int32_t>(d_ids.data(), N * k),
                                  epx::span<const float>(d_w.data(), N * k), epx::mode::train);
    layer.dispatch_wait(h);
    experts.forward(dev, h.inputs(), h.outputs().data());
    layer.combine_start(h, epx::span<const T>(h.outputs().data(), h.outputs().size()),
                        epx::span<T>(s_out.data(), N * H));
    auto s = layer.combine_wait(h);
    auto gh = layer.backward_dispatch(std::move(s), epx::span<const T>(d_g.data(), N * H),
                                      epx::span<float>(s_gw.data(), N * k));
    experts.backward(dev, gh.inputs(), gh.grad_outputs().data(), gh.grad_inputs().data());
    layer.backward_combine(gh, epx::span<const T>(gh.grad_inputs().data(), gh.grad_inputs().size()),
                           epx::span<T>(s_gx.data(), N * H));
    world.wait();
    const auto gx = to_host(dev, d_gx.data(), N * H);
    const auto gw = to_host(dev, d_gw.data(), N * k);
    CHECK(same_bits(to_host(dev, s_out.data(), N * H), out));
    CHECK(same_bits(to_host(dev, s_gx.data(), N * H), gx));
    CHECK(same_bits(to_host(dev, s_gw.data(), N * k), gw));
  }
  // The expert-gradient hook on the NCCL communicator (world size 1: a scaled copy).
  epx::gradient_hooks<epx::nccl::communicator> hooks(m, world);
  device_buffer<float> d_grad(16, dev);
  epx::exec::fill_zero(dev, d_grad.data(), 16);
  hooks.reduce_expert(epx::span<float>(d_grad.data(), 16));
  world.wait();
}
}  // namespace

TEST_CASE_TEMPLATE("every implementation and element type on the device (world size 1)", T, float, double, epx::bf16,
                   epx::fp16) {
  device_matches_host<T, epx::impl::all_to_all>();
  device_matches_host<T, epx::impl::all_reduce>();
  device_matches_host<T, epx::impl::automatic>();
}
