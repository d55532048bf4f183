// fp16 (IEEE binary16, epx::fp16) beside bf16 on the threads backend: the layer paths that
// the other files run in float and bf16 only, and what is special about fp16.
//
//   - bounded mode (spec section 11) and the split-phase calls (section 13) at H = 1024
//     against the float64 reference within the bounds of core/sizes_cases.hpp, derived from
//     fp16's 11-bit significand (unit roundoff 2^-11, subnormals below 2^-14 in steps of
//     2^-24), and bitwise the normal mode and the fused calls; bounded mode with drops;
//   - the FP8 dispatch of fp16 rows at H = 4096 (test_fp8_layer.cpp) and the E4M3 round
//     trip of fp16's largest values, which stays finite;
//   - the bound is tight: it rejects the fp16 outputs of a layer that rounds its float sums
//     toward zero, or that accumulates in fp16;
//   - overflow: fp16 ends at 65504, so a weighted sum, a gradient row w * grad_out or a
//     sum of input gradients can exceed it. The result is the infinity of round to nearest
//     even (65520, the midpoint above 65504, included), bit for bit the model of
//     docs/layer.md, on every path and policy: serial, OpenMP, the emulated device; and the
//     same cases scaled into fp16's subnormal range (below 2^-14), where ties round to even;
//   - the gradient hooks on fp16 and bf16 gradients: sums past 65504 before the 1 / B scale
//     stay finite, subnormal means round to nearest even.
// tests/emulated/test_fp16.cpp reruns this file on exec::emulated_device.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/bounded_cases.hpp"
#include "core/fp8_layer_cases.hpp"
#include "core/sizes_cases.hpp"
#include "core/split_cases.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/emulated.hpp"
#include "support/on_ranks.hpp"
#include "support/sanitizers.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_fp16_cpp {

namespace {

using epx::fp16;
using epx::test::layer_case;
using epx::test::routing_kind;
using comm_t = epx::threads::communicator;
namespace ref = epx::ref;
namespace sizes = epx::test::sizes;

using epx::test::world_of;

using epx::test::on_ranks;  // support/on_ranks.hpp

const int wide = static_cast<int>(epx::test::tsan_hidden(1024, 256));

// The largest batch of a case: a bound that no expert of a slice can exceed.
std::int64_t no_overflow(const layer_case& c) {
  std::size_t most = 0;
  const epx::mesh m(c.topology);
  for (int b = 0; b < m.batches(); ++b) most = std::max(most, c.rows_of(b));
  return static_cast<std::int64_t>(most);
}

}  // namespace

TEST_CASE("fp16: bounded mode at H = 1024 against float64 within fp16's derived bounds") {
  using sizes::make;
  // The all-to-all path (tp = 1 and tp = 2) and the masked path (ep == tp).
  for (bool direct : {true, false}) {
    for (auto c : {make(1, 4, 4, 8, 4, wide, 6, direct), make(2, 2, 4, 8, 2, wide, 7, direct, routing_kind::random)}) {
      CAPTURE(c.describe());
      on_ranks(world_of(c.topology), [&](comm_t& comm) {
        return sizes::check_diag_case<comm_t, fp16>(comm, c, no_overflow(c));
      });
    }
  }
  const auto masked = make(4, 1, 4, 8, 4, wide, 6, true);
  CAPTURE(masked.describe());
  on_ranks(4, [&](comm_t& comm) {
    return sizes::check_diag_case<comm_t, fp16, epx::impl::all_reduce>(comm, masked, no_overflow(masked));
  });
}

TEST_CASE("fp16: bounded mode bitwise the normal mode, and with overflow the local-capacity drops of float64") {
  layer_case c;
  c.topology.tp = 2;
  c.topology.fsdp = 2;
  c.topology.ep = 4;
  c.topology.experts = 8;
  c.top_k = 2;
  c.rows = [](int b) { return static_cast<std::size_t>(10 + 3 * b); };
  c.seed = 2161;
  for (bool direct : {true, false}) {
    c.peer_access = direct;
    for (std::int64_t cap : {no_overflow(c), std::int64_t{1}}) {
      CAPTURE(c.describe());
      CAPTURE(cap);
      on_ranks(4, [&](comm_t& comm) {
        return epx::test::check_bounded_case<comm_t, fp16, epx::test::test_exec>(comm, c, cap, cap == 1);
      });
    }
  }
  layer_case m = c;  // the masked path: ep == tp
  m.topology.tp = 4;
  m.topology.fsdp = 1;
  m.peer_access = true;
  m.routing = routing_kind::one_expert;  // something overflows a bound of 1
  for (std::int64_t cap : {no_overflow(m), std::int64_t{1}}) {
    CAPTURE(m.describe());
    CAPTURE(cap);
    on_ranks(4, [&](comm_t& comm) {
      return epx::test::check_bounded_case<comm_t, fp16, epx::test::test_exec, epx::impl::all_reduce>(comm, m, cap,
                                                                                                      cap == 1);
    });
  }
}

namespace {
// The split calls with the diagonal experts of sizes_cases.hpp, bitwise the fused calls,
// and the fused calls (the same batch, options and experts) within the derived bounds.
template <class Impl = epx::impl::all_to_all>
void check_split_wide(const layer_case& c, epx::mode md = epx::mode::train) {
  CAPTURE(c.describe());
  const auto global = ref::diag_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  on_ranks(world_of(c.topology), [&](comm_t& comm) {
    std::string f = epx::test::check_split_with<comm_t, fp16, Impl, epx::test::test_exec>(
        comm, c, md, epx::test::test_exec{}, [&](const epx::mesh& m, int rank) {
          return ref::test_diag_experts<fp16>(global, m.ep_rank(rank), m.local_experts());
        });
    return f + sizes::check_diag_case<comm_t, fp16, Impl>(comm, c);
  });
}
}  // namespace

TEST_CASE("fp16: split phase at H = 1024: bitwise the fused calls, which match float64 within the derived bounds") {
  using sizes::make;
  for (bool direct : {true, false}) {
    check_split_wide(make(2, 2, 4, 8, 2, wide, 6, direct, routing_kind::random));
    check_split_wide(make(1, 4, 4, 8, 4, wide, 5, direct), epx::mode::inference);
  }
  auto per_rank = make(1, 4, 2, 8, 4, wide, 6, false, routing_kind::random);
  per_rank.sends = epx::row_sends::per_rank;
  check_split_wide(per_rank);
  auto rounds = make(2, 2, 2, 4, 3, wide, 5, false, routing_kind::random);
  rounds.stage_bytes = 2 * 3 * static_cast<std::size_t>(wide) * sizeof(fp16);
  check_split_wide(rounds);
  check_split_wide<epx::impl::all_reduce>(make(4, 1, 4, 8, 4, wide, 4, true));
  // The reference's linear experts, small H, with the fixed tolerances of layer_cases.hpp.
  layer_case c = make(2, 4, 4, 16, 2, 16, 9, true, routing_kind::uneven);
  CAPTURE(c.describe());
  on_ranks(8, [&](comm_t& comm) { return epx::test::check_split_matches_fused<comm_t, fp16>(comm, c); });
}

TEST_CASE("fp16: FP8 dispatch of fp16 rows at H = 4096 against float64, the E4M3 bound and the fused calls") {
  auto c = sizes::make(1, 4, 4, 8, 2, static_cast<int>(epx::test::tsan_hidden(4096, 1024)), 24, true,
                       routing_kind::uneven);
  for (bool direct : {true, false}) {
    c.peer_access = direct;
    CAPTURE(c.describe());
    on_ranks(4, [&](comm_t& comm) { return epx::test::check_fp8_layer<comm_t, fp16>(comm, c); });
  }
}

TEST_CASE("fp16: the E4M3 round trip of every positive fp16 value, the largest block included, stays finite") {
  // One block of 128 elements: the value v at element 0 sets amax, the others are v / 2^j.
  // Dequantised to fp16, no element rounds to infinity: 448 * (amax / 448) in float is within
  // an ulp of float of amax <= 65504, far below 65520 (fp16's overflow threshold).
  std::vector<fp16> x(128), back(128);
  std::vector<epx::fp8_e4m3> q(128);
  std::vector<float> scale(1);
  std::size_t bad = 0;
  for (std::uint16_t bits = 1; bits < 0x7c00u; ++bits) {
    const float v = static_cast<float>(fp16::from_bits(bits));
    for (std::size_t h = 0; h < 128; ++h) x[h] = fp16(std::ldexp(v, -static_cast<int>(h % 20)));
    epx::kernels::quantise_e4m3(epx::exec::serial{}, 1, 128, x.data(), q.data(), scale.data());
    epx::kernels::dequantise_e4m3(epx::exec::serial{}, 1, 128, q.data(), scale.data(), back.data());
    for (std::size_t h = 0; h < 128; ++h) {
      const float got = static_cast<float>(back[h]), want = static_cast<float>(x[h]);
      // E4M3 keeps 3 significand bits: within 1/16 of the value, or 1/1024 of the scale.
      const bool ok = std::isfinite(got) && std::abs(got - want) <= std::max(std::abs(want) / 16.0f, scale[0] / 1024.0f) +
                                                                         std::abs(want) * 0x1p-11f + 0x1p-24f;
      if (!ok && ++bad <= 5) FAIL_CHECK("fp16 0x" << std::hex << bits << std::dec << " element " << h << ": " << want
                                                  << " comes back as " << got);
    }
  }
  CHECK(bad == 0);
}

// Like "layer sizes: the bf16 bound rejects a bf16 accumulation of the same products"
// (test_layer_sizes.cpp), for fp16: the derived bound holds epx's outputs and rejects the
// same float sums rounded toward zero instead of to nearest, and the same products summed
// with every partial sum rounded to fp16.
TEST_CASE("fp16: the derived bound rejects round toward zero and an fp16 accumulation of the same products") {
  using T = fp16;
  for (bool direct : {true, false}) {
    const auto c = sizes::make(1, 4, 4, 8, 8, wide, 4, direct, routing_kind::random);
    CAPTURE(c.describe());
    std::vector<std::size_t> epx_out(4), toward_zero(4), fp16_acc(4), elements(4);
    on_ranks(4, [&](comm_t& comm) -> std::string {
      const auto global = ref::diag_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
      const auto r = sizes::run_diag<comm_t, T, epx::impl::all_to_all>(comm, c, global);
      const int rank = comm.rank();
      const auto rr = static_cast<std::size_t>(rank);
      const epx::mesh m(c.topology);
      const auto d = epx::test::make_batch<T>(c, m.batch(rank));
      const auto e = sizes::expect_rank<T>(c, global, rank);
      sizes::bounds<T> bd;
      bd.k = c.top_k;
      bd.hidden = static_cast<std::size_t>(c.hidden);
      const auto bound = bd.out(e);
      const std::size_t H = static_cast<std::size_t>(c.hidden), K = static_cast<std::size_t>(c.top_k);
      const std::size_t N = d.x.size() / H;
      elements[rr] = N * H;
      for (std::size_t t = 0; t < N; ++t)
        for (std::size_t h = 0; h < H; ++h) {
          float acc = 0.0f, acc16 = 0.0f;
          for (std::size_t j = 0; j < K; ++j) {
            const int id = d.ids[t * K + j];
            const double y = ref::round_value<T>(std::fma(global.a(id, static_cast<int>(h)), d.x[t * H + h],
                                                          global.b(id, static_cast<int>(h))));
            const float p = static_cast<float>(d.w[t * K + j]) * static_cast<float>(y);
            acc += p;
            acc16 = static_cast<float>(ref::round_value<T>(static_cast<double>(acc16 + p)));
          }
          // acc rounded to fp16 toward zero: the nearest value, one step down where it is larger.
          std::uint16_t b = ref::to_type_exact<T>(acc).bits;
          if (std::abs(static_cast<double>(static_cast<float>(T::from_bits(b)))) > std::abs(static_cast<double>(acc)))
            --b;
          const double trunc = static_cast<float>(T::from_bits(b));
          const std::size_t i = t * H + h;
          if (std::abs(trunc - e.out[i]) > bound[i]) ++toward_zero[rr];
          if (std::abs(static_cast<double>(acc16) - e.out[i]) > bound[i]) ++fp16_acc[rr];
          if (!(std::abs(ref::to_d(r.out[i]) - e.out[i]) <= bound[i])) ++epx_out[rr];
        }
      return {};
    });
    std::size_t total = 0, outside_epx = 0, outside_trunc = 0, outside_acc = 0;
    for (std::size_t r = 0; r < 4; ++r) {
      total += elements[r];
      outside_epx += epx_out[r];
      outside_trunc += toward_zero[r];
      outside_acc += fp16_acc[r];
    }
    MESSAGE("fp16 outside the derived bound: epx ", outside_epx, ", round toward zero ", outside_trunc,
            ", fp16 accumulation ", outside_acc, " of ", total, " elements");
    CHECK(outside_epx == 0);
    CHECK(outside_trunc * 10 > total);  // more than 10% of the elements
    CHECK(outside_acc * 20 > total);    // more than 5%
  }
}

namespace {
// ---------------------------------------------------------------------------------------
// Overflow: results beyond 65504
// ---------------------------------------------------------------------------------------
//
// Experts that return their rows as they came (y = x; FP8 rows: y = fp16(float(q) * scale))
// and pass the gradient through (grad_in = grad_out), so every value of the layer is known
// exactly: the activations below are fp16 values of at most 11 significant bits and the
// weights have 2, so every product and every sum of two of them is exact in float and the
// only rounding is the layer's to fp16, which the expectation makes with the independent
// ref::to_type_exact (a NaN: the canonical 0x7fff of docs/layer.md).
struct pass_experts {
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const fp16>& in, fp16* out) {
    if (in.num_rows > 0) std::memcpy(out, in.rows, in.num_rows * in.hidden * sizeof(fp16));
  }
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const epx::fp8_e4m3>& in, const float* scales, fp16* out) {
    const std::size_t H = in.hidden;
    for (std::size_t i = 0; i < in.num_rows * H; ++i)
      out[i] = fp16(static_cast<float>(in.rows[i]) * scales[i / 128]);
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const fp16>& in, const fp16* g, fp16* gi) {
    if (in.num_rows > 0) std::memcpy(gi, g, in.num_rows * in.hidden * sizeof(fp16));
  }
};

constexpr std::size_t ov_tokens = 14, ov_hidden = 512;
// Activations: around the top of fp16's range (52416 * 1.25 = 65520, the midpoint above
// 65504, rounds to infinity; 52384 * 1.25 = 65480 rounds to 65472) and ordinary values.
const float ov_x[] = {0.0f,     1.0f,     -3.0f,   0.25f,  1024.0f,  30000.0f, -30000.0f, 40000.0f, -40000.0f,
                      52384.0f, 52416.0f, 60000.0f, -65504.0f, 65504.0f, 2.0f,   100.0f,    -52416.0f, 0.5f};
const float ov_g[] = {1.0f,     -1.0f,   30000.0f, -30000.0f, 40000.0f, -40000.0f,
                      20000.0f, 0.5f,    65504.0f, -2.0f,     16384.0f, 32768.0f};
// Token kinds: the two slots' weights, and whether their experts share an owner (ep rank).
struct ov_kind {
  float w0, w1;
  bool same_owner;
};
const ov_kind ov_kinds[] = {{0.5f, 0.75f, true}, {0.5f, 0.75f, false}, {1.5f, 2.0f, true},  {1.5f, 2.0f, false},
                            {2.0f, -1.5f, false}, {2.0f, -2.0f, false}, {2.0f, -1.5f, true}};

struct ov_batch {
  std::vector<fp16> x, g;
  std::vector<std::int32_t> ids;  // [N, 2]
  std::vector<float> w;           // [N, 2]
};

// Batch b of the case (the same on the ranks of a TP group); 8 experts on ep = 4 ranks, two
// each: expert e lives on ep rank e / 2. The activations and gradients are the tables' values
// times 2^shift (shift -24: fp16's subnormal range, in steps of 2^-24, where 1.25 and 3.5
// times a value are often ties), rounded to fp16.
ov_batch ov_make(int b, int shift) {
  ov_batch d;
  const std::size_t N = ov_tokens, H = ov_hidden;
  d.x.resize(N * H);
  d.g.resize(N * H);
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t h = 0; h < H; ++h) {
      d.x[t * H + h] = fp16(std::ldexp(ov_x[(h + 5 * t + 3 * static_cast<std::size_t>(b)) % std::size(ov_x)], shift));
      d.g[t * H + h] = fp16(std::ldexp(ov_g[(3 * h + t + static_cast<std::size_t>(b)) % std::size(ov_g)], shift));
    }
  for (std::size_t t = 0; t < N; ++t) {
    const ov_kind& k = ov_kinds[(t + static_cast<std::size_t>(b)) % std::size(ov_kinds)];
    const int o = static_cast<int>((t + static_cast<std::size_t>(b)) % 4);
    d.ids.push_back(2 * o);
    d.ids.push_back(k.same_owner ? 2 * o + 1 : 2 * ((o + 1) % 4) + 1);
    d.w.push_back(k.w0);
    d.w.push_back(k.w1);
  }
  return d;
}

std::uint16_t ov_bits(float v) {
  return std::isnan(v) ? std::uint16_t{0x7fff} : ref::to_type_exact<fp16>(static_cast<double>(v)).bits;
}
float ov_value(std::uint16_t b) { return static_cast<float>(ref::format_decode(ref::fp16_format, b)); }

// The bits of sum_j v_j, the terms in slot order in float, rounded once to fp16; `grouped`:
// each owner's terms summed and rounded to fp16 first, those partial sums then summed in
// float and rounded (the masked path and per-rank sends, docs/semantics.md).
std::uint16_t ov_sum(const float v[2], const std::int32_t ids[2], bool grouped) {
  if (!grouped || ids[0] / 2 == ids[1] / 2) return ov_bits(0.0f + v[0] + v[1]);
  return ov_bits(0.0f + ov_value(ov_bits(0.0f + v[0])) + ov_value(ov_bits(0.0f + v[1])));
}

struct ov_expect {
  std::vector<std::uint16_t> out, grad_x;
  std::vector<double> grad_w, grad_w_mag;
  std::size_t inf_out = 0, inf_grad_rows = 0, nan_out = 0, subnormal_out = 0;  // what the case exercises
};

// y: the experts' output rows of the batch's tokens (x, or x through E4M3).
ov_expect ov_expectation(const ov_batch& d, const std::vector<fp16>& y, bool grouped) {
  const std::size_t N = ov_tokens, H = ov_hidden;
  ov_expect e;
  e.out.resize(N * H);
  e.grad_x.resize(N * H);
  e.grad_w.assign(N * 2, 0.0);
  e.grad_w_mag.assign(N * 2, 0.0);
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t i = t * H + h;
      const float yv = static_cast<float>(y[i]), gv = static_cast<float>(d.g[i]);
      float terms[2], rows[2];
      for (std::size_t j = 0; j < 2; ++j) {
        terms[j] = d.w[t * 2 + j] * yv;
        rows[j] = ov_value(ov_bits(d.w[t * 2 + j] * gv));  // the gradient row w * grad_out, in fp16
        e.inf_grad_rows += std::isinf(rows[j]);
        e.grad_w[t * 2 + j] += static_cast<double>(yv) * gv;
        e.grad_w_mag[t * 2 + j] += std::abs(static_cast<double>(yv) * gv);
      }
      e.out[i] = ov_sum(terms, &d.ids[t * 2], grouped);
      e.grad_x[i] = ov_sum(rows, &d.ids[t * 2], grouped);
      e.inf_out += (e.out[i] & 0x7fffu) == 0x7c00u;
      e.nan_out += e.out[i] == 0x7fffu;
      e.subnormal_out += (e.out[i] & 0x7c00u) == 0 && (e.out[i] & 0x3ffu) != 0;
    }
  return e;
}

struct ov_config {
  const char* name;
  epx::mesh_config mesh;
  bool masked = false;  // impl::all_reduce (ep == tp)
  bool peer_access = true;
  bool per_rank = false;
  std::size_t stage_bytes = 0;
  std::int64_t bound = 0;  // bounded mode
  bool fp8 = false;
  bool split = false;
  int shift = 0;  // ov_make's scale of the values
  bool grouped() const { return masked || per_rank; }
};

epx::mesh_config ov_mesh(int tp, int fsdp) {
  epx::mesh_config mc;
  mc.tp = tp;
  mc.fsdp = fsdp;
  mc.ep = 4;
  mc.experts = 8;
  return mc;
}

struct ov_result {
  std::vector<fp16> out, grad_x, inference;
  std::vector<float> grad_w;
};

template <class Impl, class Exec>
ov_result ov_run(comm_t& comm, const ov_config& cfg, const Exec& policy) {
  const epx::mesh m(cfg.mesh);
  const ov_batch d = ov_make(m.batch(comm.rank()), cfg.shift);
  const std::size_t N = ov_tokens, H = ov_hidden;
  epx::layer_options o;
  o.hidden = H;
  o.top_k = 2;
  o.peer_access = cfg.peer_access;
  o.sends = cfg.per_rank ? epx::row_sends::per_rank : epx::row_sends::per_slot;
  o.stage_bytes = cfg.stage_bytes;
  o.fp8_dispatch = cfg.fp8;
  if (cfg.bound > 0) {
    o.counts = epx::count_exchange::device;
    o.bound.cap = cfg.bound;
  }
  epx::moe_layer<comm_t, fp16, Impl, Exec> layer(m, comm, o, policy);
  pass_experts experts;
  ov_result r;
  r.out.assign(N * H, fp16(7.0f));
  r.grad_x.assign(N * H, fp16(7.0f));
  r.inference.assign(N * H, fp16(7.0f));
  r.grad_w.assign(N * 2, 7.0f);
  const epx::span<const fp16> x(d.x), g(d.g);
  const epx::span<const std::int32_t> ids(d.ids);
  const epx::span<const float> w(d.w);
  if (cfg.split) {
    auto h = layer.dispatch_start(x, ids, w, epx::mode::train);
    layer.dispatch_wait(h);
    experts.forward(policy, h.inputs(), h.outputs().data());
    layer.combine_start(h, epx::span<const fp16>(h.outputs().data(), h.outputs().size()), epx::span<fp16>(r.out));
    auto saved = layer.combine_wait(h);
    auto gh = layer.backward_dispatch_start(std::move(saved), g, epx::span<float>(r.grad_w));
    layer.backward_dispatch_wait(gh);
    experts.backward(policy, gh.inputs(), gh.grad_outputs().data(), gh.grad_inputs().data());
    layer.backward_combine_start(gh, epx::span<const fp16>(gh.grad_inputs().data(), gh.grad_inputs().size()),
                                 epx::span<fp16>(r.grad_x));
    layer.backward_combine_wait(gh);
  } else {
    auto saved = layer.forward(x, ids, w, epx::span<fp16>(r.out), experts, epx::mode::train);
    layer.backward(std::move(saved), g, epx::span<fp16>(r.grad_x), epx::span<float>(r.grad_w), experts);
  }
  (void)layer.forward(x, ids, w, epx::span<fp16>(r.inference), experts, epx::mode::inference);
  if (cfg.bound > 0 && layer.check().overflow_pairs != 0) throw std::runtime_error("bounded mode dropped pairs");
  return r;
}

std::string ov_compare(const char* what, const std::vector<fp16>& got, const std::vector<std::uint16_t>& want) {
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i].bits != want[i] && bad++ == 0) first = i;
  if (bad == 0) return {};
  return epx::detail::concat(what, ": ", bad, " of ", got.size(), " elements differ; first at ", first, " (token ",
                             first / ov_hidden, "): 0x", std::hex, got[first].bits, " (", std::dec,
                             static_cast<float>(got[first]), "), expected 0x", std::hex, want[first], " (", std::dec,
                             ov_value(want[first]), ")\n");
}

// Every rank of the case on `policy`: its out, grad_x, inference output and grad_weights
// against the expectation; the results go to `all` for the comparison across policies.
template <class Impl, class Exec>
void ov_check_policy(const ov_config& cfg, const Exec& policy, const char* policy_name,
                     std::vector<ov_result>& all, ov_expect& seen) {
  CAPTURE(policy_name);
  const int world = world_of(cfg.mesh);
  all.assign(static_cast<std::size_t>(world), {});
  std::vector<ov_expect> exp(static_cast<std::size_t>(world));
  on_ranks(world, [&](comm_t& comm) -> std::string {
    const auto rr = static_cast<std::size_t>(comm.rank());
    const std::string where = epx::detail::concat(cfg.name, " on ", policy_name, ", rank ", comm.rank(), ": ");
    try {
      all[rr] = ov_run<Impl>(comm, cfg, policy);
    } catch (const std::exception& ex) {
      return where + "exception: " + ex.what();
    }
    const epx::mesh m(cfg.mesh);
    const ov_batch d = ov_make(m.batch(comm.rank()), cfg.shift);
    std::vector<fp16> y = d.x;
    if (cfg.fp8) {  // the experts' outputs: x through E4M3, as the host quantises it
      std::vector<epx::fp8_e4m3> q(d.x.size());
      std::vector<float> sc(ov_tokens * ov_hidden / 128);
      epx::kernels::quantise_e4m3(epx::exec::serial{}, ov_tokens, ov_hidden, d.x.data(), q.data(), sc.data());
      for (std::size_t i = 0; i < y.size(); ++i) y[i] = fp16(static_cast<float>(q[i]) * sc[i / 128]);
    }
    exp[rr] = ov_expectation(d, y, cfg.grouped());
    const auto& r = all[rr];
    const auto& e = exp[rr];
    std::string f = ov_compare("out", r.out, e.out) + ov_compare("grad_x", r.grad_x, e.grad_x) +
                    ov_compare("inference out", r.inference, e.out);
    for (std::size_t i = 0; i < e.grad_w.size(); ++i)
      if (!(std::abs(static_cast<double>(r.grad_w[i]) - e.grad_w[i]) <= 1e-6 * e.grad_w_mag[i])) {
        f += epx::detail::concat("grad_weights[", i, "] = ", r.grad_w[i], ", float64 ", e.grad_w[i], "\n");
        break;
      }
    return f.empty() ? f : where + f;
  });
  seen = ov_expect{};
  for (const auto& e : exp) {
    seen.inf_out += e.inf_out;
    seen.subnormal_out += e.subnormal_out;
    seen.inf_grad_rows += e.inf_grad_rows;
    seen.nan_out += e.nan_out;
  }
}

template <class Impl>
void ov_check(const ov_config& cfg) {
  CAPTURE(cfg.name);
  std::vector<ov_result> serial, omp, device;
  ov_expect seen;
  ov_check_policy<Impl>(cfg, epx::exec::serial{}, "serial", serial, seen);
  ov_check_policy<Impl>(cfg, epx::exec::openmp{2}, "openmp", omp, seen);
  ov_check_policy<Impl>(cfg, epx::exec::emulated_device{}, "emulated_device", device, seen);
  if (cfg.shift == 0) {
    // The case reaches past fp16's range: infinite outputs and gradient rows (and, on the
    // grouped paths, NaN where partial sums overflow with opposite signs).
    CHECK(seen.inf_out > 0);
    CHECK(seen.inf_grad_rows > 0);
    CHECK((seen.nan_out > 0) == cfg.grouped());
  } else {
    CHECK(seen.subnormal_out > 0);
    CHECK(seen.inf_out + seen.inf_grad_rows + seen.nan_out == 0);
  }
  for (std::size_t r = 0; r < serial.size(); ++r) {
    CAPTURE(r);
    for (const auto* other : {&omp[r], &device[r]}) {
      CHECK(epx::test::bitwise_equal(other->out, serial[r].out));
      CHECK(epx::test::bitwise_equal(other->grad_x, serial[r].grad_x));
      CHECK(epx::test::bitwise_equal(other->grad_w, serial[r].grad_w));
    }
  }
}
}  // namespace

namespace {
// Every path of the layer (direct and staged routes, rounds, tp = 2, per-rank sends, the
// masked path, bounded mode on both, the split phase on both, FP8 dispatch) on every policy.
void ov_all_paths(int shift) {
  ov_config c{"all-to-all, direct route", ov_mesh(1, 4)};
  c.shift = shift;
  ov_check<epx::impl::all_to_all>(c);
  c.name = "all-to-all, staged route";
  c.peer_access = false;
  ov_check<epx::impl::all_to_all>(c);
  c.name = "all-to-all, staged route in rounds of one slice row";
  c.stage_bytes = 1;
  ov_check<epx::impl::all_to_all>(c);
  ov_config tp2{"all-to-all, tp = 2", ov_mesh(2, 2)};
  tp2.shift = shift;
  ov_check<epx::impl::all_to_all>(tp2);
  ov_config per_rank{"per-rank sends", ov_mesh(1, 4)};
  per_rank.shift = shift;
  per_rank.per_rank = true;
  ov_check<epx::impl::all_to_all>(per_rank);
  ov_config masked{"masked all-reduce path", ov_mesh(4, 1)};
  masked.shift = shift;
  masked.masked = true;
  ov_check<epx::impl::all_reduce>(masked);
  ov_config bounded{"bounded mode", ov_mesh(2, 2)};
  bounded.shift = shift;
  bounded.bound = static_cast<std::int64_t>(ov_tokens);
  ov_check<epx::impl::all_to_all>(bounded);
  bounded.name = "bounded mode, masked path";
  bounded.mesh = ov_mesh(4, 1);
  bounded.masked = true;
  ov_check<epx::impl::all_reduce>(bounded);
  ov_config split{"split phase", ov_mesh(1, 4)};
  split.shift = shift;
  split.split = true;
  ov_check<epx::impl::all_to_all>(split);
  split.name = "split phase, masked path";
  split.mesh = ov_mesh(4, 1);
  split.masked = true;
  ov_check<epx::impl::all_reduce>(split);
  ov_config fp8{"FP8 dispatch", ov_mesh(1, 4)};
  fp8.shift = shift;
  fp8.fp8 = true;
  ov_check<epx::impl::all_to_all>(fp8);
  fp8.name = "FP8 dispatch, staged route";
  fp8.peer_access = false;
  ov_check<epx::impl::all_to_all>(fp8);
}
}  // namespace

TEST_CASE("fp16: results beyond 65504 are infinities (round to nearest even), the same bits on every path and policy") {
  // The model itself: 65520 is the tie above 65504 and goes to infinity, 65519.99 does not.
  CHECK(fp16(65504.0f).bits == 0x7bffu);
  CHECK(fp16(65519.996f).bits == 0x7bffu);
  CHECK(fp16(65520.0f).bits == 0x7c00u);
  CHECK(fp16(-65520.0f).bits == 0xfc00u);
  CHECK(fp16(1.25f * 52384.0f).bits == ref::to_type_exact<fp16>(65472.0).bits);
  CHECK(ov_bits(1.25f * 52416.0f) == 0x7c00u);

  ov_all_paths(0);
}

TEST_CASE("fp16: results in the subnormal range (below 2^-14) round to nearest even, on every path and policy") {
  CHECK(fp16(1.5f * 0x1p-24f).bits == 0x0002u);      // a tie: to the even 2 * 2^-24
  CHECK(fp16(2.5f * 0x1p-24f).bits == 0x0002u);      // a tie: to the even 2 * 2^-24
  CHECK(fp16(0.5f * 0x1p-24f).bits == 0x0000u);      // a tie: to zero
  CHECK(fp16(0.75f * 0x1p-24f).bits == 0x0001u);
  CHECK(fp16(-1023.5f * 0x1p-24f).bits == 0x8400u);  // a tie: to -2^-14, the smallest normal
  ov_all_paths(-24);
}

namespace {
// The gradient hooks (spec section 6) on 16-bit gradients: each reduction sums in float,
// scales by 1 / B and rounds once, so sums past 65504 before the scale stay finite, and a
// subnormal mean rounds to nearest even. Every rank passes the same values v, so the
// expert hook gives T(T(n_efsdp v / B) * R) (the second sum over dp_replicate, when R > 1),
// the dense hook T(T(n_fsdp v / B) * R): exact in float before each rounding.
template <class T>
std::string check_hooks_16(comm_t& comm, const epx::mesh& m) {
  const std::vector<double> v = {60000.0, -65504.0, 65504.0, 40000.0, 3 * 0x1p-24, 0x1p-24, 5 * 0x1p-24, 0x1p-14,
                                 1.5,     0x1p-20,  -7 * 0x1p-24, 1000.0};
  const std::size_t n = v.size();
  const double B = m.batches(), R = m.dp_replicate();
  const auto mean_of = [&](double members, double x) {
    double r = ref::round_value<T>(members * x / B);
    if (R > 1) r = ref::round_value<T>(R * r);
    return r;
  };
  std::vector<T> g(n), dense(n), full(n * static_cast<std::size_t>(m.efsdp())), shard(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = dense[i] = ref::to_type_exact<T>(v[i]);
  for (std::size_t i = 0; i < full.size(); ++i) full[i] = g[i % n];
  epx::gradient_hooks<comm_t> hooks(m, comm);
  hooks.reduce_expert(epx::span<T>(g));
  hooks.reduce_dense(epx::span<T>(dense));
  hooks.reduce_scatter_expert(epx::span<const T>(full), epx::span<T>(shard));
  std::string f;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = ref::to_d(ref::to_type_exact<T>(v[i]));
    const double want_e = mean_of(m.efsdp(), x), want_d = mean_of(m.fsdp(), x);
    const auto bits = [](double w) { return ref::to_type_exact<T>(w).bits; };
    if (g[i].bits != bits(want_e) || shard[i].bits != bits(want_e) || dense[i].bits != bits(want_d))
      f += epx::detail::concat("rank ", comm.rank(), " value ", x, ": expert ", ref::to_d(g[i]), ", scattered ",
                               ref::to_d(shard[i]), " (want ", want_e, "), dense ", ref::to_d(dense[i]), " (want ",
                               want_d, ")\n");
  }
  return f;
}
}  // namespace

TEST_CASE_TEMPLATE("fp16: the gradient hooks sum 16-bit gradients in float: past 65504 before the 1 / B, finite after",
                   T, fp16, epx::bf16) {
  for (auto [tp, fsdp, R, ep, E] : std::vector<std::array<int, 5>>{{1, 4, 1, 2, 4}, {1, 2, 2, 2, 4}, {2, 4, 1, 4, 8}}) {
    epx::mesh_config mc;
    mc.tp = tp;
    mc.fsdp = fsdp;
    mc.dp_replicate = R;
    mc.ep = ep;
    mc.experts = E;
    const epx::mesh m(mc);
    CAPTURE(mc.tp);  // not the bindings: a lambda captures those only from C++20 (Clang)
    CAPTURE(mc.fsdp);
    CAPTURE(mc.dp_replicate);
    on_ranks(m.world(), [&](comm_t& comm) { return check_hooks_16<T>(comm, m); });
  }
}

}  // namespace test_fp16_cpp
