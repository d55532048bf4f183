// tests/core/fp8_layer_cases.hpp: the layer with FP8 dispatch (spec section 12), run on ONE
// rank like the bodies of layer_cases.hpp (threads, MPI and emulated device suites).
//
// Experts (fp8_scale_experts): local expert of global id e dequantises its rows,
// x' = float(q) * scale in A = accum_t<T> (float; double for double), and computes
// y = T(s_e * x') with s_e = 1 + e / 8; backward grad_in = T(s_e * grad_out), in A. They check that backward hands them, as `in`, the
// rows they saw (T(x')), bitwise.
//
// Checks per rank, against float64:
//   - tight: out, grad_w from the same y (computed on the host from x quantised by the
//     host policy) summed in float64, within the tolerances of layer_cases.hpp and within
//     bounds derived from T's precision; grad_x (no quantisation on the way back) likewise;
//   - E4M3 bound: out against the unquantised float64 output, within
//     sum_j |w_j| s_e max(|x| / 16, scale / 1024) (3 mantissa bits: half a step is 2^-4 of
//     the value for normals, 2^-10 of the scale for subnormals) plus the tolerance of T;
//     and the quantisation is visible (the largest error is above a tenth of the bound's);
//   - the split-phase calls give bitwise the fused results, and the staged route the direct
//     route's (where the case takes the direct one: threads and MPI, host policies).
// With a capacity (section 8) the float64 sums leave out the pairs the reference drops,
// whose grad_weights are 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/split_cases.hpp"

namespace epx::test {

template <class T>
struct fp8_scale_experts {
  int first = 0;
  std::vector<T> seen;      // T(x') of the last forward, [rows, H]
  long long backward_mismatch = 0;
  long long zero_block_scale = 0;  // all-zero blocks (padding rows) whose scale is not 1

  static float scale_of(int e) { return 1.0f + static_cast<float>(e) / 8.0f; }

  template <class Exec>
  void forward(const Exec&, const expert_rows<const fp8_e4m3>& in, const float* scales, T* out) {
    const std::size_t H = in.hidden, B = H / 128;
    seen.assign(in.num_rows * H, convert<T>(0.0f));
    // A zero block has scale 1, as the quantiser makes it (the padding rows).
    for (std::size_t blk = 0; blk < in.num_rows * B; ++blk) {
      bool zero = true;
      for (std::size_t h = 0; h < 128; ++h) zero = zero && in.rows[blk * 128 + h].bits == 0;
      zero_block_scale += zero && scales[blk] != 1.0f;
    }
    using A = accum_t<T>;  // the layer's arithmetic: float, double for double
    for (int l = 0; l < in.num_local; ++l) {
      const A s = static_cast<A>(scale_of(in.first_global_expert + l));
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r)
        for (std::size_t h = 0; h < H; ++h) {
          const A xq = static_cast<A>(static_cast<float>(in.rows[r * H + h])) * static_cast<A>(scales[r * B + h / 128]);
          seen[r * H + h] = convert<T>(xq);
          out[r * H + h] = convert<T>(s * xq);
        }
    }
  }
  template <class Exec>
  void backward(const Exec&, const expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    const std::size_t H = in.hidden;
    if (seen.size() != in.num_rows * H ||
        (in.num_rows > 0 && std::memcmp(seen.data(), in.rows, seen.size() * sizeof(T)) != 0))
      ++backward_mismatch;
    using A = accum_t<T>;
    for (int l = 0; l < in.num_local; ++l) {
      const A s = static_cast<A>(scale_of(in.first_global_expert + l));
      for (std::size_t i = in.begin(l) * H; i < (in.begin(l) + in.count(l)) * H; ++i)
        grad_in[i] = convert<T>(s * convert<A>(grad_out[i]));
    }
  }
};

// x' of every row of x [N, H] as the layer makes it (quantised by the host policy, then
// float(q) * scale in accum_t<T>), and each element's block scale.
template <class T>
void quantised_rows(const std::vector<T>& x, std::size_t H, std::vector<accum_t<T>>& xq, std::vector<float>& scale_of) {
  using A = accum_t<T>;
  const std::size_t N = x.size() / H, B = H / 128;
  std::vector<fp8_e4m3> q(N * H);
  std::vector<float> sc(N * B);
  kernels::quantise_e4m3(exec::serial{}, N, H, x.data(), q.data(), sc.data());
  xq.resize(N * H);
  scale_of.resize(N * H);
  for (std::size_t i = 0; i < N * H; ++i) {
    scale_of[i] = sc[i / H * B + (i % H) / 128];
    xq[i] = static_cast<A>(static_cast<float>(q[i])) * static_cast<A>(scale_of[i]);
  }
}

template <class Comm, class T, class Exec = test_exec>
std::string check_fp8_layer(Comm& world, const layer_case& c, Exec policy = {}) {
  std::string f;
  const std::string where = detail::concat(c.describe(), " rank ", world.rank(), " fp8 dispatch: ");
  try {
    const mesh m(c.topology);
    const int rank = world.rank(), b = m.batch(rank);
    const std::size_t H = static_cast<std::size_t>(c.hidden);
    const int k = c.top_k;
    layer_options o = options_for(c);
    o.fp8_dispatch = true;

    // Fused forward and backward.
    micro_batch<T> mb(c, b);
    moe_layer<Comm, T, impl::all_to_all, Exec> layer(m, world, o, policy);
    fp8_scale_experts<T> experts{m.expert_begin(rank)};
    auto saved = layer.forward(span<const T>(mb.x), span<const std::int32_t>(mb.d.ids), span<const float>(mb.w),
                               span<T>(mb.out), experts, mode::train);
    const bool direct = c.peer_access && has_peer_access_v<Comm>;
    if (layer.stats().peer_access != direct)
      f += detail::concat(where, "stats.peer_access is ", layer.stats().peer_access, ", expected ", direct, "\n");
    layer.backward(std::move(saved), span<const T>(mb.go), span<T>(mb.gx), span<float>(mb.gw), experts);
    if (experts.backward_mismatch != 0) f += where + "backward's rows are not the dequantised rows forward saw\n";
    if (experts.zero_block_scale != 0)
      f += detail::concat(where, experts.zero_block_scale, " all-zero blocks (padding) have a scale other than 1\n");

    // The staged route (where the case took the direct one): bitwise the same.
    if (direct) {
      micro_batch<T> st(c, b);
      layer_options so = o;
      so.peer_access = false;
      moe_layer<Comm, T, impl::all_to_all, Exec> staged(m, world, so, policy);
      fp8_scale_experts<T> staged_experts{m.expert_begin(rank)};
      auto ss = staged.forward(span<const T>(st.x), span<const std::int32_t>(st.d.ids), span<const float>(st.w),
                               span<T>(st.out), staged_experts, mode::train);
      if (staged.stats().peer_access) f += where + "peer_access = false took the direct route\n";
      staged.backward(std::move(ss), span<const T>(st.go), span<T>(st.gx), span<float>(st.gw), staged_experts);
      if (!bitwise_equal(st.out, mb.out) || !bitwise_equal(st.gx, mb.gx) || !bitwise_equal(st.gw, mb.gw))
        f += where + "the direct and staged routes differ bitwise\n";
    }
    // The staged route with its rows gathered into send order first (where staged sends go
    // by index out of the quantised rows): bitwise the same.
    if (o.indexed_sends || direct) {
      micro_batch<T> gt(c, b);
      layer_options go = o;
      go.peer_access = false;
      go.indexed_sends = false;
      moe_layer<Comm, T, impl::all_to_all, Exec> gathered(m, world, go, policy);
      fp8_scale_experts<T> gathered_experts{m.expert_begin(rank)};
      auto gs = gathered.forward(span<const T>(gt.x), span<const std::int32_t>(gt.d.ids), span<const float>(gt.w),
                                 span<T>(gt.out), gathered_experts, mode::train);
      if (gathered.stats().peer_access || gathered.stats().indexed_sends)
        f += where + "peer_access = indexed_sends = false did not gather\n";
      gathered.backward(std::move(gs), span<const T>(gt.go), span<T>(gt.gx), span<float>(gt.gw), gathered_experts);
      if (!bitwise_equal(gt.out, mb.out) || !bitwise_equal(gt.gx, mb.gx) || !bitwise_equal(gt.gw, mb.gw))
        f += where + "the gathered staged route differs bitwise\n";
    }

    // The references.
    using A = accum_t<T>;
    std::vector<A> xq;
    std::vector<float> sc;
    quantised_rows(mb.x, H, xq, sc);
    const std::size_t N = mb.N;
    std::vector<double> out_q(N * H, 0.0), out_x(N * H, 0.0), bound(N * H, 0.0), gx(N * H, 0.0),
        gw(N * static_cast<std::size_t>(k), 0.0), gw_scale(N * static_cast<std::size_t>(k), 0.0),
        out_mag(N * H, 0.0), gx_mag(N * H, 0.0);
    const double at = atol_for<T>(), rt = rtol_for<T>();
    // A pair a capacity drops (section 8) adds nothing and gets grad_weights 0.
    const std::vector<char> keep = keep_masks<T>(c)[static_cast<std::size_t>(b)];
    for (std::size_t t = 0; t < N; ++t)
      for (int j = 0; j < k; ++j) {
        const std::size_t tj = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
        if (!keep[tj]) continue;
        const A s = static_cast<A>(fp8_scale_experts<T>::scale_of(mb.d.ids[tj]));
        const double w = mb.w[tj];
        for (std::size_t h = 0; h < H; ++h) {
          const std::size_t i = t * H + h;
          const double y = convert<double>(convert<T>(s * xq[i]));  // what the experts return
          const double xv = convert<double>(mb.x[i]), g = convert<double>(mb.go[i]);
          out_q[i] += w * y;
          out_mag[i] += std::abs(w * y);
          out_x[i] += w * s * xv;
          bound[i] += std::abs(w) * s * std::max(std::abs(xv) / 16.0, static_cast<double>(sc[i]) / 1024.0) * (1 + 1e-6);
          const double gterm =
              convert<double>(convert<T>(s * convert<A>(convert<T>(static_cast<A>(mb.w[tj]) * convert<A>(mb.go[i])))));
          gx[i] += gterm;
          gx_mag[i] += std::abs(gterm);
          gw[tj] += y * g;
          gw_scale[tj] += std::abs(y * g);
        }
      }
    append(f, ref::compare(mb.out, out_q, at, rt, where + "out (float64 from the quantised rows)"));
    append(f, ref::compare(mb.gx, gx, at, rt, where + "grad_x"));
    // The same against bounds derived from T's precision (the fixed tolerances above are
    // loose for 16-bit types): out sums k products w * y, each rounded in A, in A, then
    // rounds once to T; grad_x sums k rows of T in A and rounds once to T. With u, ua the
    // unit roundoffs of T and A, S the sum of the terms' magnitudes and eta half T's
    // smallest subnormal: |got - ref| <= u |ref| + (1 + u) (ua + gamma_k (1 + ua)) S + eta
    // (no ua term for grad_x). A rounding toward zero to fp16 or bf16 falls outside it.
    {
      const double u = ref::unit_roundoff<T>(), ua = ref::unit_roundoff<A>(), eta = ref::subnormal_half<T>();
      const double gk = ref::gamma_n(k, ua);
      std::size_t bad_out = 0, bad_gx = 0, first_out = 0, first_gx = 0;
      for (std::size_t i = 0; i < N * H; ++i) {
        const double bo = u * std::abs(out_q[i]) + (1 + u) * (ua + gk * (1 + ua)) * out_mag[i] + eta;
        const double bg = u * std::abs(gx[i]) + (1 + u) * gk * gx_mag[i] + eta;
        if (!(std::abs(convert<double>(mb.out[i]) - out_q[i]) <= bo) && bad_out++ == 0) first_out = i;
        if (!(std::abs(convert<double>(mb.gx[i]) - gx[i]) <= bg) && bad_gx++ == 0) first_gx = i;
      }
      if (bad_out != 0)
        f += detail::concat(where, "out: ", bad_out, " elements outside the bound derived from T; first at ", first_out,
                            ": got ", convert<double>(mb.out[first_out]), ", float64 ", out_q[first_out], "\n");
      if (bad_gx != 0)
        f += detail::concat(where, "grad_x: ", bad_gx, " elements outside the bound derived from T; first at ", first_gx,
                            ": got ", convert<double>(mb.gx[first_gx]), ", float64 ", gx[first_gx], "\n");
    }
    double worst = 0, largest_err = 0, largest_bound = 0;
    for (std::size_t i = 0; i < N * H; ++i) {
      const double err = std::abs(convert<double>(mb.out[i]) - out_x[i]);
      const double lim = bound[i] + at + rt * std::abs(out_x[i]);
      worst = std::max(worst, err / lim);
      largest_err = std::max(largest_err, err);
      largest_bound = std::max(largest_bound, bound[i]);
    }
    if (worst > 1.0)
      f += detail::concat(where, "out is off the unquantised float64 output by ", worst,
                          " times the E4M3 bound\n");
    if (N > 0 && largest_err < 0.1 * largest_bound)
      f += detail::concat(where, "the quantisation does not show (largest error ", largest_err, ", bound ",
                          largest_bound, ")\n");
    for (std::size_t tj = 0; tj < gw.size(); ++tj) {
      const double tol = 2e-6 * gw_scale[tj] + 1e-6;
      if (!(std::abs(static_cast<double>(mb.gw[tj]) - gw[tj]) <= tol)) {
        f += detail::concat(where, "grad_weights[", tj, "] = ", mb.gw[tj], ", float64 ", gw[tj], "\n");
        break;
      }
    }

    // The split-phase calls: bitwise the fused ones.
    micro_batch<T> sp(c, b);
    moe_layer<Comm, T, impl::all_to_all, Exec> split_layer(m, world, o, policy);
    fp8_scale_experts<T> split_experts{m.expert_begin(rank)};
    auto h = split_layer.dispatch(span<const T>(sp.x), span<const std::int32_t>(sp.d.ids), span<const float>(sp.w),
                                  mode::train);
    if (!h.fp8()) f += where + "the split handle does not hold FP8 rows\n";
    split_experts.forward(policy, h.fp8_inputs(), h.scales(), h.outputs().data());
    auto s = split_layer.combine(h, h.outputs(), span<T>(sp.out));
    auto g = split_layer.backward_dispatch(std::move(s), span<const T>(sp.go), span<float>(sp.gw));
    split_experts.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
    split_layer.backward_combine(g, g.grad_inputs(), span<T>(sp.gx));
    if (!bitwise_equal(sp.out, mb.out) || !bitwise_equal(sp.gx, mb.gx) || !bitwise_equal(sp.gw, mb.gw))
      f += where + "the split-phase calls differ bitwise from the fused ones\n";

    // An inference forward: bitwise the training output; the FP8 rows go out in one round,
    // the outputs come back in the rounds of the case's stage (staged route).
    micro_batch<T> inf(c, b);
    moe_layer<Comm, T, impl::all_to_all, Exec> inf_layer(m, world, o, policy);
    fp8_scale_experts<T> inf_experts{m.expert_begin(rank)};
    auto none = inf_layer.forward(span<const T>(inf.x), span<const std::int32_t>(inf.d.ids), span<const float>(inf.w),
                                  span<T>(inf.out), inf_experts, mode::inference);
    if (!bitwise_equal(inf.out, mb.out)) f += where + "the inference output differs bitwise from the training one\n";
    const std::int64_t rounds = direct ? 0 : expected_stage_rounds<T, Exec>(c, rank, c.stage_bytes);
    if (inf_layer.stats().stage_rounds != rounds)
      f += detail::concat(where, "inference stage_rounds ", inf_layer.stats().stage_rounds, ", expected ", rounds, "\n");
  } catch (const std::exception& ex) {
    f += where + "exception: " + ex.what() + "\n";
  }
  return f;
}

}  // namespace epx::test
