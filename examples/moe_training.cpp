// epx-moe-example: a small MoE block trained for a few SGD steps on an expert-parallel mesh.
//
//   epx-moe-example                        # threads backend: 8 ranks as 8 threads
//   mpirun -np 8 epx-moe-example           # MPI backend: one rank per process
//   epx-moe-example --backend threads --tp 2 --fsdp 4 --ep 4 --experts 16 --top-k 2 --steps 5
//
// The block, on the batch x [N, H] a rank holds:
//   logits = x Wr^T                         router, a dense weight Wr [E, H]
//   ids, w = softmax_topk(logits)           epx::routing::route
//   out    = sum_j w[:, j] * expert_{ids[:, j]}(x)      epx::moe_layer (all-to-all dispatch)
//   expert_e(x) = W2_e (silu(W1_e x) * (W3_e x))        SwiGLU, W1, W3 [F, H], W2 [H, F]
//   loss   = 0.5 * mean((out - target)^2)   per batch
// Backward: the layer gives grad_x, the routing-weight gradient grad_w [N, k] and (through
// the experts' backward) the expert parameter gradients; route_backward turns grad_w into
// the logits' gradient and so the router's. The router gradient is reduced with the dense
// hook and the expert gradients with the expert hook (both: mean over the batches), then
// every rank takes the same SGD step.
//
// After the first step every number is compared with a float64 single-process computation
// of the whole block over all batches (reference_step below), and the last line reads
//   check: output=<max abs err> grad_x=<..> grad_w=<..> grad_experts=<..> vs float64 reference
// The exit status is non-zero when an error exceeds its tolerance (printed above that line)
// or when the ranks' parameters disagree after training.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#ifdef EPX_HAVE_MPI
#include "epx/comm/mpi.hpp"
#endif

namespace {

// ---- settings ----------------------------------------------------------------------------

struct options {
  std::string backend;  // "threads", "mpi", or empty: mpi when launched by mpirun
  int tp = 2, fsdp = 4, ep = 4, dp_replicate = 1;
  int experts = 16, top_k = 2, steps = 5;
  int hidden = 32, ffn = 64, tokens = 64;  // H, F, N (rows per batch)
  double lr = 500.0;  // large because the loss is a mean over all N * H values
  double rtol = 1e-4;  // largest error allowed, relative to the largest |reference| value
  std::uint64_t seed = 7;

  epx::mesh_config mesh() const {
    epx::mesh_config c;
    c.tp = tp;
    c.fsdp = fsdp;
    c.ep = ep;
    c.dp_replicate = dp_replicate;
    c.experts = experts;
    return c;
  }
  int world() const { return tp * fsdp * dp_replicate; }
  std::size_t expert_params() const { return 3 * static_cast<std::size_t>(ffn) * hidden; }  // W1, W3, W2
};

// ---- deterministic data ------------------------------------------------------------------

// Value i of stream s, uniform in [-1, 1): every rank can make any parameter or batch alone.
double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t i) {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + stream * 0xBF58476D1CE4E5B9ull + i * 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
}

enum stream : std::uint64_t { router_stream = 1, batch_stream = 1000, expert_stream = 100000 };

// Router weight Wr [E, H].
std::vector<float> init_router(const options& o) {
  const std::size_t n = static_cast<std::size_t>(o.experts) * o.hidden;
  std::vector<float> wr(n);
  const double scale = 4.0 / std::sqrt(static_cast<double>(o.hidden));
  for (std::size_t i = 0; i < n; ++i) wr[i] = static_cast<float>(scale * uniform(o.seed, router_stream, i));
  return wr;
}

// The parameters of global expert e: [W1 [F, H] | W3 [F, H] | W2 [H, F]].
void init_expert(const options& o, int e, float* p) {
  const std::size_t fh = static_cast<std::size_t>(o.ffn) * o.hidden;
  const double s_in = std::sqrt(3.0 / o.hidden), s_out = std::sqrt(3.0 / o.ffn);
  for (std::size_t i = 0; i < 3 * fh; ++i)
    p[i] = static_cast<float>((i < 2 * fh ? s_in : s_out) * uniform(o.seed, expert_stream + e, i));
}

// Batch b: inputs x [N, H] and targets [N, H] (a fixed nonlinear function of x).
struct batch {
  std::vector<float> x, target;
};

batch make_batch(const options& o, int b) {
  const std::size_t N = o.tokens, H = o.hidden;
  batch d;
  d.x.resize(N * H);
  d.target.resize(N * H);
  for (std::size_t i = 0; i < N * H; ++i) d.x[i] = static_cast<float>(uniform(o.seed, batch_stream + b, i));
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t h = 0; h < H; ++h)
      d.target[t * H + h] = static_cast<float>(0.5 * std::sin(3.0 * d.x[t * H + (h + 1) % H]));
  return d;
}

// ---- the experts: SwiGLU, written plainly ------------------------------------------------

double sigmoid(double a) { return 1.0 / (1.0 + std::exp(-a)); }

// This rank's L experts, meeting the concept of epx/impl/experts.hpp. Parameters and their
// gradients: [L, W1 [F, H] | W3 [F, H] | W2 [H, F]]. Host memory (exec::serial).
struct swiglu_experts {
  int num_local = 0, hidden = 0, ffn = 0;
  std::vector<float> params, grads;

  swiglu_experts(const options& o, int first_expert, int L) : num_local(L), hidden(o.hidden), ffn(o.ffn) {
    params.resize(L * o.expert_params());
    grads.assign(params.size(), 0.0f);
    for (int l = 0; l < L; ++l) init_expert(o, first_expert + l, &params[l * o.expert_params()]);
  }

  std::size_t size() const { return 3 * static_cast<std::size_t>(ffn) * hidden; }
  const float* w1(int l) const { return &params[l * size()]; }
  const float* w3(int l) const { return w1(l) + ffn * hidden; }
  const float* w2(int l) const { return w1(l) + 2 * ffn * hidden; }

  // in.rows [R, H] expert-major; out [R, H]. Padding rows are zero and give zero.
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) {
    const int H = hidden, F = ffn;
    std::vector<float> act(F);
    for (int l = 0; l < in.num_local; ++l) {
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r) {
        const float* x = in.rows + r * H;
        for (int f = 0; f < F; ++f) {
          float a = 0.0f, g = 0.0f;
          for (int h = 0; h < H; ++h) {
            a += w1(l)[f * H + h] * x[h];
            g += w3(l)[f * H + h] * x[h];
          }
          act[f] = a * static_cast<float>(sigmoid(a)) * g;  // silu(a) * g
        }
        for (int h = 0; h < H; ++h) {
          float y = 0.0f;
          for (int f = 0; f < F; ++f) y += w2(l)[h * F + f] * act[f];
          out[r * H + h] = y;
        }
      }
    }
  }

  // grad_out, grad_in [R, H]; accumulates the parameter gradients into `grads`.
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>& in, const float* grad_out, float* grad_in) {
    const int H = hidden, F = ffn;
    std::vector<float> a(F), g(F), s(F), da(F), dg(F);
    for (int l = 0; l < in.num_local; ++l) {
      float* g1 = &grads[l * size()];
      float* g3 = g1 + F * H;
      float* g2 = g1 + 2 * F * H;
      for (std::size_t r = in.begin(l); r < in.begin(l) + in.count(l); ++r) {
        const float* x = in.rows + r * H;
        const float* dy = grad_out + r * H;
        for (int f = 0; f < F; ++f) {  // recompute the forward activations
          a[f] = g[f] = 0.0f;
          for (int h = 0; h < H; ++h) {
            a[f] += w1(l)[f * H + h] * x[h];
            g[f] += w3(l)[f * H + h] * x[h];
          }
          s[f] = static_cast<float>(sigmoid(a[f]));
        }
        for (int f = 0; f < F; ++f) {
          float dact = 0.0f;  // d loss / d (silu(a) * g)
          for (int h = 0; h < H; ++h) {
            dact += w2(l)[h * F + f] * dy[h];
            g2[h * F + f] += dy[h] * a[f] * s[f] * g[f];
          }
          dg[f] = dact * a[f] * s[f];
          da[f] = dact * g[f] * s[f] * (1.0f + a[f] * (1.0f - s[f]));
          for (int h = 0; h < H; ++h) {
            g1[f * H + h] += da[f] * x[h];
            g3[f * H + h] += dg[f] * x[h];
          }
        }
        for (int h = 0; h < H; ++h) {
          float dx = 0.0f;
          for (int f = 0; f < F; ++f) dx += w1(l)[f * H + h] * da[f] + w3(l)[f * H + h] * dg[f];
          grad_in[r * H + h] = dx;
        }
      }
    }
  }
};

// ---- the float64 reference: one process, every batch, plain loops -------------------------

struct reference_result {
  std::vector<std::vector<double>> out, grad_x, grad_w;  // per batch: [N, H], [N, H], [N, k]
  std::vector<double> grad_experts;                      // [E, P], mean over the batches
  std::vector<double> grad_router;                       // [E, H], mean over the batches
};

// The first training step of the whole block in float64, from the initial parameters.
reference_result reference_step(const options& o) {
  const int E = o.experts, k = o.top_k, H = o.hidden, F = o.ffn, N = o.tokens;
  const int B = o.fsdp * o.dp_replicate;
  const std::size_t P = o.expert_params();
  const std::vector<float> wr32 = init_router(o);
  const std::vector<double> wr(wr32.begin(), wr32.end());
  std::vector<double> params(E * P);
  {
    std::vector<float> p32(P);
    for (int e = 0; e < E; ++e) {
      init_expert(o, e, p32.data());
      std::copy(p32.begin(), p32.end(), params.begin() + e * P);
    }
  }
  reference_result r;
  r.grad_experts.assign(E * P, 0.0);
  r.grad_router.assign(static_cast<std::size_t>(E) * H, 0.0);
  std::vector<double> logits(E), p(E), a(F), g(F), act(F), da(F), dg(F), y(static_cast<std::size_t>(k) * H);
  for (int b = 0; b < B; ++b) {
    const batch d = make_batch(o, b);
    std::vector<double> out(static_cast<std::size_t>(N) * H), gx(out.size()), gw(static_cast<std::size_t>(N) * k);
    for (int t = 0; t < N; ++t) {
      const float* x = &d.x[static_cast<std::size_t>(t) * H];
      // Routing: softmax over all E, top-k of p (ties to the lower id), weights p.
      double mx = -1e300, z = 0.0;
      for (int e = 0; e < E; ++e) {
        logits[e] = 0.0;
        for (int h = 0; h < H; ++h) logits[e] += wr[e * H + h] * x[h];
        mx = std::max(mx, logits[e]);
      }
      for (int e = 0; e < E; ++e) z += std::exp(logits[e] - mx);
      for (int e = 0; e < E; ++e) p[e] = std::exp(logits[e] - mx) / z;
      std::vector<int> ids;
      for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < E; ++e)
          if (std::find(ids.begin(), ids.end(), e) == ids.end() && (best < 0 || p[e] > p[best])) best = e;
        ids.push_back(best);
      }
      // Experts and combine.
      for (int j = 0; j < k; ++j) {
        const double* w1 = &params[ids[j] * P];
        const double* w3 = w1 + F * H;
        const double* w2 = w1 + 2 * F * H;
        for (int f = 0; f < F; ++f) {
          a[f] = g[f] = 0.0;
          for (int h = 0; h < H; ++h) {
            a[f] += w1[f * H + h] * x[h];
            g[f] += w3[f * H + h] * x[h];
          }
          act[f] = a[f] * sigmoid(a[f]) * g[f];
        }
        for (int h = 0; h < H; ++h) {
          y[j * H + h] = 0.0;
          for (int f = 0; f < F; ++f) y[j * H + h] += w2[h * F + f] * act[f];
          out[t * H + h] += p[ids[j]] * y[j * H + h];
        }
      }
      // Loss 0.5 * mean((out - target)^2) over the N * H values of the batch.
      std::vector<double> dout(H);
      for (int h = 0; h < H; ++h) dout[h] = (out[t * H + h] - d.target[t * H + h]) / (static_cast<double>(N) * H);
      // Backward: routing-weight gradient, experts, input gradient.
      for (int j = 0; j < k; ++j) {
        const double w = p[ids[j]];
        double* gw_tj = &gw[t * k + j];
        for (int h = 0; h < H; ++h) *gw_tj += y[j * H + h] * dout[h];
        const double* w1 = &params[ids[j] * P];
        const double* w3 = w1 + F * H;
        const double* w2 = w1 + 2 * F * H;
        double* g1 = &r.grad_experts[ids[j] * P];
        double* g3 = g1 + F * H;
        double* g2 = g1 + 2 * F * H;
        for (int f = 0; f < F; ++f) {
          a[f] = g[f] = 0.0;
          for (int h = 0; h < H; ++h) {
            a[f] += w1[f * H + h] * x[h];
            g[f] += w3[f * H + h] * x[h];
          }
          const double s = sigmoid(a[f]);
          double dact = 0.0;
          for (int h = 0; h < H; ++h) {
            dact += w2[h * F + f] * w * dout[h];
            g2[h * F + f] += w * dout[h] * a[f] * s * g[f];
          }
          dg[f] = dact * a[f] * s;
          da[f] = dact * g[f] * s * (1.0 + a[f] * (1.0 - s));
          for (int h = 0; h < H; ++h) {
            g1[f * H + h] += da[f] * x[h];
            g3[f * H + h] += dg[f] * x[h];
            gx[t * H + h] += w1[f * H + h] * da[f] + w3[f * H + h] * dg[f];
          }
        }
      }
      // Router: d loss / d logits through the full softmax, then the dense weight.
      double pg = 0.0;  // sum_j p_{id_j} grad_w_j
      for (int j = 0; j < k; ++j) pg += p[ids[j]] * gw[t * k + j];
      for (int e = 0; e < E; ++e) {
        double ge = 0.0;
        for (int j = 0; j < k; ++j)
          if (ids[j] == e) ge = gw[t * k + j];
        const double dlogit = p[e] * (ge - pg);
        for (int h = 0; h < H; ++h) r.grad_router[e * H + h] += dlogit * x[h];
      }
    }
    r.out.push_back(std::move(out));
    r.grad_x.push_back(std::move(gx));
    r.grad_w.push_back(std::move(gw));
  }
  for (double& v : r.grad_experts) v /= B;
  for (double& v : r.grad_router) v /= B;
  return r;
}

// Largest |a - b| and largest |b| over n values.
struct error_norm {
  double err = 0.0, scale = 0.0;
};

template <class A>
void accumulate(error_norm& n, const A* got, const double* want, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    n.err = std::max(n.err, std::abs(static_cast<double>(got[i]) - want[i]));
    n.scale = std::max(n.scale, std::abs(want[i]));
  }
}

// Bytes of a float vector folded into a 64-bit value (FNV-1a): bitwise comparison across ranks.
std::int64_t fingerprint(const std::vector<float>& v) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}

// ---- one rank's training loop -------------------------------------------------------------

// Runs on every rank (a thread, or an MPI process); rank 0 prints. Returns the exit status,
// the same on every rank.
template <class Comm>
int train(Comm& world, const options& o, const char* backend) {
  const epx::mesh m(o.mesh());
  m.validate_world(world.size());
  const int rank = world.rank(), W = world.size();
  const int E = o.experts, k = o.top_k, L = m.local_experts();
  const std::size_t N = o.tokens, H = o.hidden;
  const bool root = rank == 0;

  const batch data = make_batch(o, m.batch(rank));  // shared by the TP group
  std::vector<float> wr = init_router(o);           // [E, H], replicated on every rank
  swiglu_experts experts(o, m.expert_begin(rank), L);

  epx::layer_options lo;
  lo.hidden = H;
  lo.top_k = k;  // padding: the default, one zero row per local expert
  epx::moe_layer<Comm, float> layer(m, world, lo);  // impl::all_to_all, exec::serial
  epx::gradient_hooks<Comm> hooks(m, world);
  const epx::routing::softmax_topk policy{};
  const epx::exec::serial exec{};

  if (root) {
    std::printf("epx MoE example: backend %s, %d ranks, tp=%d fsdp=%d ep=%d dp_replicate=%d\n", backend, W, o.tp,
                o.fsdp, o.ep, o.dp_replicate);
    std::printf("%d experts (%d per rank), top-%d softmax_topk routing, SwiGLU H=%zu F=%d, %zu tokens per batch, "
                "%d batches, SGD lr=%g\n\n",
                E, L, k, H, o.ffn, N, m.batches(), o.lr);
    std::printf("%s\n", epx::describe(m).c_str());
    std::printf("step  loss        max/mean  (token, slot) pairs per expert over all batches\n");
  }

  std::vector<float> logits(N * E), weights(N * k), out(N * H), grad_out(N * H), grad_x(N * H), grad_w(N * k),
      grad_logits(N * E), grad_wr(wr.size());
  std::vector<std::int32_t> ids(N * k);
  error_norm errs[5];  // output, grad_x, grad_w, grad_experts, grad_router (first step)

  for (int step = 0; step < o.steps; ++step) {
    // Router and routing, on the whole batch (every rank of the TP group does the same).
    for (std::size_t t = 0; t < N; ++t)
      for (int e = 0; e < E; ++e) {
        float v = 0.0f;
        for (std::size_t h = 0; h < H; ++h) v += wr[e * H + h] * data.x[t * H + h];
        logits[t * E + e] = v;
      }
    epx::routing::route(policy, exec, logits.data(), N, E, k, ids.data(), weights.data());

    // The MoE layer: forward, loss, backward.
    auto saved = layer.forward(epx::span<const float>(data.x), epx::span<const std::int32_t>(ids),
                               epx::span<const float>(weights), epx::span<float>(out), experts, epx::mode::train);
    double loss = 0.0;
    for (std::size_t i = 0; i < N * H; ++i) {
      const double diff = static_cast<double>(out[i]) - data.target[i];
      loss += 0.5 * diff * diff / static_cast<double>(N * H);
      grad_out[i] = static_cast<float>(diff / static_cast<double>(N * H));
    }
    std::fill(experts.grads.begin(), experts.grads.end(), 0.0f);
    layer.backward(std::move(saved), epx::span<const float>(grad_out), epx::span<float>(grad_x),
                   epx::span<float>(grad_w), experts);

    // Router gradient: grad_w -> grad_logits -> grad_wr [E, H] = grad_logits^T x.
    epx::routing::route_backward(policy, exec, logits.data(), N, E, k, ids.data(), weights.data(), grad_w.data(),
                                 grad_logits.data());
    for (int e = 0; e < E; ++e)
      for (std::size_t h = 0; h < H; ++h) {
        float v = 0.0f;
        for (std::size_t t = 0; t < N; ++t) v += grad_logits[t * E + e] * data.x[t * H + h];
        grad_wr[e * H + h] = v;
      }

    // Gradient hooks: both become the mean over all batches.
    hooks.reduce_dense(epx::span<float>(grad_wr));
    hooks.reduce_expert(epx::span<float>(experts.grads));

    if (step == 0) {  // compare the first step with the float64 reference
      const reference_result ref = reference_step(o);
      const int b = m.batch(rank);
      accumulate(errs[0], out.data(), ref.out[b].data(), N * H);
      accumulate(errs[1], grad_x.data(), ref.grad_x[b].data(), N * H);
      accumulate(errs[2], grad_w.data(), ref.grad_w[b].data(), N * k);
      accumulate(errs[3], experts.grads.data(), &ref.grad_experts[m.expert_begin(rank) * o.expert_params()],
                 experts.grads.size());
      accumulate(errs[4], grad_wr.data(), ref.grad_router.data(), grad_wr.size());
    }

    // Loss (mean over the batches: one rank per TP group) and load over all batches (one
    // rank per EP group; every rank of a group has the group's counts).
    std::vector<double> losses(W);
    epx::all_gather(world, epx::span<const double>(&loss, 1), epx::span<double>(losses));
    const auto& counts = layer.stats().tokens_per_expert;  // [E], this EP group
    std::vector<std::int64_t> all_counts(static_cast<std::size_t>(W) * E);
    epx::all_gather(world, epx::span<const std::int64_t>(counts), epx::span<std::int64_t>(all_counts));
    if (root) {
      double mean_loss = 0.0;
      std::vector<std::int64_t> load(E, 0);
      for (int r = 0; r < W; ++r) {
        if (m.coords(r).tp == 0) mean_loss += losses[r] / m.batches();
        if (m.ep_rank(r) == 0)
          for (int e = 0; e < E; ++e) load[e] += all_counts[r * E + e];
      }
      const double mx = static_cast<double>(*std::max_element(load.begin(), load.end()));
      const double mean = static_cast<double>(m.batches()) * N * k / E;
      std::printf("%4d  %.6f  %8.2f  ", step + 1, mean_loss, mx / mean);
      for (int e = 0; e < E; ++e) std::printf("%s%lld", e ? " " : "", static_cast<long long>(load[e]));
      std::printf("\n");
    }

    // SGD: every rank holds the same reduced gradients, so replicas stay equal.
    for (std::size_t i = 0; i < wr.size(); ++i) wr[i] -= static_cast<float>(o.lr) * grad_wr[i];
    for (std::size_t i = 0; i < experts.params.size(); ++i)
      experts.params[i] -= static_cast<float>(o.lr) * experts.grads[i];
  }

  // Replicas must agree bitwise: the router on every rank, each expert group on its efsdp
  // and dp_replicate replicas (the ranks with the same ep rank).
  const std::int64_t mine[2] = {fingerprint(wr), fingerprint(experts.params)};
  std::vector<std::int64_t> prints(2 * static_cast<std::size_t>(W));
  epx::all_gather(world, epx::span<const std::int64_t>(mine, 2), epx::span<std::int64_t>(prints));
  bool consistent = true;
  for (int r = 0; r < W; ++r) {
    consistent = consistent && prints[2 * r] == prints[0];
    for (int q = 0; q < r; ++q)
      if (m.ep_rank(q) == m.ep_rank(r)) consistent = consistent && prints[2 * r + 1] == prints[2 * q + 1];
  }

  // Errors: the largest over all ranks.
  double local[10];
  for (int i = 0; i < 5; ++i) {
    local[2 * i] = errs[i].err;
    local[2 * i + 1] = errs[i].scale;
  }
  std::vector<double> all(10 * static_cast<std::size_t>(W));
  epx::all_gather(world, epx::span<const double>(local, 10), epx::span<double>(all));
  error_norm total[5];
  for (int r = 0; r < W; ++r)
    for (int i = 0; i < 5; ++i) {
      total[i].err = std::max(total[i].err, all[10 * r + 2 * i]);
      total[i].scale = std::max(total[i].scale, all[10 * r + 2 * i + 1]);
    }
  static const char* names[5] = {"output", "grad_x", "grad_w", "grad_experts", "grad_router"};
  bool ok = consistent;
  double tol[5];
  for (int i = 0; i < 5; ++i) {
    tol[i] = o.rtol * total[i].scale;
    ok = ok && total[i].err <= tol[i];
  }
  if (root) {
    std::printf("\nparameters after %d steps: %s\n", o.steps,
                consistent ? "router equal on every rank, each expert equal on all its replicas (bitwise)"
                           : "REPLICAS DISAGREE");
    std::printf("router gradient (dense hook): grad_router=%.3e (tolerance %.3e)\n", total[4].err, tol[4]);
    std::printf("tolerance (%.0e x largest |reference|): output=%.3e grad_x=%.3e grad_w=%.3e grad_experts=%.3e\n",
                o.rtol, tol[0], tol[1], tol[2], tol[3]);
    std::printf("check: output=%.3e grad_x=%.3e grad_w=%.3e grad_experts=%.3e vs float64 reference\n", total[0].err,
                total[1].err, total[2].err, total[3].err);
    std::fflush(stdout);
    for (int i = 0; i < 5; ++i)
      if (total[i].err > tol[i])
        std::fprintf(stderr, "epx-moe-example: %s error %.3e exceeds the tolerance %.3e\n", names[i], total[i].err,
                     tol[i]);
    if (!consistent) std::fprintf(stderr, "epx-moe-example: parameter replicas disagree after training\n");
  }
  return ok ? 0 : 1;
}

// ---- command line -------------------------------------------------------------------------

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: epx-moe-example [--backend threads|mpi] [--tp N] [--fsdp N] [--ep N] [--dp-replicate N]\n"
               "                       [--experts E] [--top-k K] [--steps S] [--hidden H] [--ffn F]\n"
               "                       [--tokens N] [--lr X] [--rtol X] [--seed S]\n"
               "Defaults: threads backend with tp*fsdp*dp_replicate ranks (mpi when launched by mpirun),\n"
               "tp=2 fsdp=4 ep=4 dp_replicate=1, 16 experts, top-2, 5 steps, H=32, F=64, 64 tokens,\n"
               "lr=500, rtol=1e-4 (errors allowed relative to the largest |reference| value).\n");
}

long parse_number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < 1 || x > (1L << 24))
    EPX_THROW(epx::errc::configuration, flag, " expects a positive integer, got '", v, "'");
  return x;
}

double parse_real(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(x > 0.0) || !std::isfinite(x))
    EPX_THROW(epx::errc::configuration, flag, " expects a positive number, got '", v, "'");
  return x;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) EPX_THROW(epx::errc::configuration, a, " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--backend") {
      o.backend = value();
      if (o.backend != "threads" && o.backend != "mpi")
        EPX_THROW(epx::errc::configuration, "--backend expects threads or mpi, got '", o.backend, "'");
    } else if (a == "--tp") o.tp = static_cast<int>(parse_number(a, value()));
    else if (a == "--fsdp") o.fsdp = static_cast<int>(parse_number(a, value()));
    else if (a == "--ep") o.ep = static_cast<int>(parse_number(a, value()));
    else if (a == "--dp-replicate") o.dp_replicate = static_cast<int>(parse_number(a, value()));
    else if (a == "--experts") o.experts = static_cast<int>(parse_number(a, value()));
    else if (a == "--top-k") o.top_k = static_cast<int>(parse_number(a, value()));
    else if (a == "--steps") o.steps = static_cast<int>(parse_number(a, value()));
    else if (a == "--hidden") o.hidden = static_cast<int>(parse_number(a, value()));
    else if (a == "--ffn") o.ffn = static_cast<int>(parse_number(a, value()));
    else if (a == "--tokens") o.tokens = static_cast<int>(parse_number(a, value()));
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(parse_number(a, value()));
    else if (a == "--lr") o.lr = parse_real(a, value());
    else if (a == "--rtol") o.rtol = parse_real(a, value());
    else {
      EPX_THROW(epx::errc::configuration, "unknown argument '", a, "' (see --help)");
    }
  }
  epx::mesh check(o.mesh());  // validates the sizes with the mesh's own messages
  check.validate_top_k(o.top_k);
  return o;
}

// mpirun (Open MPI) and mpiexec (MPICH, Hydra) tell their processes the job size.
bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-moe-example: %s\n", e.what());
    usage(stderr);
    return 2;
  }
  const bool use_mpi = o.backend == "mpi" || (o.backend.empty() && launched_by_mpirun());
  if (use_mpi) {
#ifdef EPX_HAVE_MPI
    // An exception on any rank aborts the whole job with its message (epx::mpi::run).
    return epx::mpi::run(argc, argv, [&](epx::mpi::communicator& world) { return train(world, o, "mpi"); });
#else
    std::fprintf(stderr, "epx-moe-example: this build has no MPI backend (configure with MPI found and "
                         "EPX_ENABLE_MPI=ON), or pass --backend threads\n");
    return 2;
#endif
  }
  int status = 1;
  try {
    epx::threads::run(o.world(), [&](epx::threads::communicator& world) {
      const int s = train(world, o, "threads");
      if (world.rank() == 0) status = s;
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-moe-example: %s\n", e.what());
    return 1;
  }
  return status;
}
