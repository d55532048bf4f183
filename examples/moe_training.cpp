// epx-moe-example: a small MoE block trained for a few SGD steps on an expert-parallel mesh.
//
//   epx-moe-example                        # threads backend: 8 ranks as 8 threads
//   mpirun -np 8 epx-moe-example           # MPI backend: one rank per process
//   epx-moe-example --backend threads --tp 2 --fsdp 4 --ep 4 --experts 16 --top-k 2 --steps 5
//   epx-moe-example --router-skew 1.5 --balance bias --steps 20      # bias balancing at work
//   epx-moe-example --capacity-factor 1.0 --max-nodes 1 --ranks-per-node 2
//
// The block, on the batch x [N, H] a rank holds:
//   logits = x Wr^T + br                    router, dense weights Wr [E, H] and br [E]
//                                           (br starts skewed with --router-skew)
//   ids, w = softmax_topk(logits)           epx::routing::route (sigmoid_bias with
//                                           --balance bias; node-limited with --max-nodes)
//   out    = sum_j w[:, j] * expert_{ids[:, j]}(x)      epx::moe_layer (all-to-all dispatch;
//                                           pairs beyond the capacity dropped)
//   expert_e(x) = W2_e (silu(W1_e x) * (W3_e x))        SwiGLU, W1, W3 [F, H], W2 [H, F]
//   loss   = 0.5 * mean((out - target)^2)   per batch (+ the auxiliary loss with --balance aux)
// Backward: the layer gives grad_x, the routing-weight gradient grad_w [N, k] and (through
// the experts' backward) the expert parameter gradients; route_backward turns grad_w into
// the logits' gradient (plus aux_loss_backward's with --balance aux) and so the router's.
// The router gradient is reduced with the dense hook and the expert gradients with the
// expert hook (both: mean over the batches), then every rank takes the same SGD step. With
// --balance bias every rank adds gamma * sign(mean load - load) to the selection bias, the
// load summed over every batch of the job (routing::sum_over_batches).
//
// Per step the example prints the loss (mean over the batches, auxiliary loss included),
// the imbalance (max/mean of the pairs routed to each expert over all batches), the pairs
// the capacity dropped, the nodes per token (mean and max, from the layer's statistics)
// and the load of every expert.
//
// After the first step every number is compared with a float64 single-process computation
// of the whole block over all batches (reference_step below: routing, node limit, capacity,
// auxiliary loss included), and the last line reads
//   check: output=<max abs err> grad_x=<..> grad_w=<..> grad_experts=<..> vs float64 reference
// The exit status is 1 when an error exceeds its tolerance (printed above that line), when
// the ranks' parameters disagree after training or when the run fails; 2 for a command-line
// error (its message and the usage on standard error, before the run starts).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
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
  // Capacity (spec section 8): factor 0 is off.
  double capacity_factor = 0.0;
  epx::capacity_mode capacity_mode = epx::capacity_mode::local;
  epx::drop_priority drop = epx::drop_priority::position;
  // Balancing (spec section 9): none, aux (Switch loss, global-batch f), bias (DeepSeek-V3).
  std::string balance = "none";
  double aux_alpha = 0.01;
  double bias_rate = 0.02;  // gamma
  double router_skew = 0.0;  // br[e] starts at skew * (E - 1 - 2e) / (E - 1)
  // Node-limited routing (spec section 10): 0 is off.
  int max_nodes = 0, ranks_per_node = 0;

  std::string routing = "softmax_topk";  // or sigmoid_bias (always with --balance bias)

  bool sigmoid() const { return routing == "sigmoid_bias" || balance == "bias"; }

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

// Router weights [Wr [E, H] | br [E]]: br is 0, or skewed towards the low experts.
std::vector<float> init_router(const options& o) {
  const std::size_t n = static_cast<std::size_t>(o.experts) * o.hidden;
  std::vector<float> wr(n + o.experts);
  const double scale = 4.0 / std::sqrt(static_cast<double>(o.hidden));
  for (std::size_t i = 0; i < n; ++i) wr[i] = static_cast<float>(scale * uniform(o.seed, router_stream, i));
  for (int e = 0; e < o.experts; ++e)
    wr[n + e] = o.experts > 1 ? static_cast<float>(o.router_skew * (o.experts - 1 - 2 * e) / (o.experts - 1)) : 0.0f;
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
  std::vector<double> grad_router;                       // [E, H] then [E] (Wr, br), mean over the batches
};

// Token routing in float64: ids [k] and weights [k] from logits [E]. softmax_topk (p =
// softmax, weights p) or, with --balance bias, sigmoid_bias (key s + bias, weights s /
// (sum + 1e-20)); with a node limit the experts come from the max_nodes nodes whose
// ceil(k / M) best keys sum highest. Ties to the lower id.
void reference_route(const options& o, const double* logits, const std::vector<float>& bias, std::vector<int>& ids,
                     std::vector<double>& w, std::vector<double>& p) {
  const int E = o.experts, k = o.top_k;
  std::vector<double> key(E);
  if (o.sigmoid()) {
    for (int e = 0; e < E; ++e) key[e] = (p[e] = sigmoid(logits[e])) + bias[e];
  } else {
    double mx = -1e300, z = 0.0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    for (int e = 0; e < E; ++e) z += std::exp(logits[e] - mx);
    for (int e = 0; e < E; ++e) key[e] = p[e] = std::exp(logits[e] - mx) / z;
  }
  std::vector<char> allowed(E, 1);
  const int nodes = o.ranks_per_node > 0 ? o.ep / o.ranks_per_node : 0;
  if (o.max_nodes > 0 && o.max_nodes < nodes) {
    const int per = E / nodes, best = (k + o.max_nodes - 1) / o.max_nodes;
    std::vector<double> score(nodes);
    for (int g = 0; g < nodes; ++g) {
      std::vector<double> v(key.begin() + g * per, key.begin() + (g + 1) * per);
      std::sort(v.begin(), v.end(), std::greater<double>());
      score[g] = std::accumulate(v.begin(), v.begin() + best, 0.0);
    }
    std::vector<char> kept(nodes, 0);
    for (int r = 0; r < o.max_nodes; ++r) {
      int pick = -1;
      for (int g = 0; g < nodes; ++g)
        if (!kept[g] && (pick < 0 || score[g] > score[pick])) pick = g;
      kept[pick] = 1;
    }
    for (int e = 0; e < E; ++e) allowed[e] = kept[e / per];
  }
  ids.clear();
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (allowed[e] && std::find(ids.begin(), ids.end(), e) == ids.end() && (best < 0 || key[e] > key[best])) best = e;
    ids.push_back(best);
  }
  double sum = 0.0;
  for (int j = 0; j < k; ++j) sum += p[ids[j]];
  for (int j = 0; j < k; ++j) w[j] = o.sigmoid() ? p[ids[j]] / (sum + 1e-20) : p[ids[j]];
}

// keep[b][t * k + j]: the pairs the capacity keeps. Every EP group's members, in ep-rank
// order, send the rows floor(N t / tp) .. floor(N (t + 1) / tp) of their batch (t: their
// tp rank); local: each keeps ceil(factor * rows * k / E) per expert; global: an expert
// takes ceil(factor * P / E) of the group's P pairs, lower ep ranks first. By position
// (row, slot) or by weight (descending, ties by position).
std::vector<std::vector<char>> reference_keep(const options& o, const epx::mesh& m,
                                              const std::vector<std::vector<int>>& ids,
                                              const std::vector<std::vector<double>>& w) {
  const int E = o.experts, k = o.top_k, N = o.tokens;
  std::vector<std::vector<char>> keep(ids.size());
  for (std::size_t b = 0; b < ids.size(); ++b) keep[b].assign(ids[b].size(), 1);
  if (o.capacity_factor <= 0.0) return keep;
  for (int first = 0; first < m.world(); ++first) {
    if (m.ep_rank(first) != 0) continue;
    std::vector<std::pair<int, std::pair<int, int>>> src;  // batch, [row begin, row end)
    double P = 0;
    for (int i = 0; i < o.ep; ++i) {
      const int r = first + i, t = r % o.tp;
      const int b0 = static_cast<int>(1LL * N * t / o.tp), b1 = static_cast<int>(1LL * N * (t + 1) / o.tp);
      src.push_back({m.batch(r), {b0, b1}});
      P += static_cast<double>(b1 - b0) * k;
    }
    for (int e = 0; e < E; ++e) {
      long long before = 0;
      for (const auto& s : src) {
        std::vector<int> mine;  // pair indices t * k + j, in (row, slot) order
        for (int i = s.second.first * k; i < s.second.second * k; ++i)
          if (ids[s.first][i] == e) mine.push_back(i);
        const long long n = static_cast<long long>(mine.size());
        long long C;
        if (o.capacity_mode == epx::capacity_mode::local) {
          C = std::min(n, static_cast<long long>(std::ceil(o.capacity_factor * ((s.second.second - s.second.first) * k) / E)));
        } else {
          C = std::max(0LL, std::min(n, static_cast<long long>(std::ceil(o.capacity_factor * P / E)) - before));
          before += n;
        }
        if (o.drop == epx::drop_priority::score)
          std::stable_sort(mine.begin(), mine.end(), [&](int a, int c) { return w[s.first][a] > w[s.first][c]; });
        for (std::size_t r = static_cast<std::size_t>(C); r < mine.size(); ++r) keep[s.first][mine[r]] = 0;
      }
    }
  }
  return keep;
}

// The first training step of the whole block in float64, from the initial parameters;
// `bias` is the selection bias of --balance bias.
reference_result reference_step(const options& o, const std::vector<float>& bias) {
  const int E = o.experts, k = o.top_k, H = o.hidden, F = o.ffn, N = o.tokens;
  const int B = o.fsdp * o.dp_replicate;
  const std::size_t P = o.expert_params();
  const epx::mesh m(o.mesh());
  const std::vector<float> wr32 = init_router(o);
  const std::vector<double> wr(wr32.begin(), wr32.end());
  const double* br = wr.data() + static_cast<std::size_t>(E) * H;
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
  r.grad_router.assign(static_cast<std::size_t>(E) * (H + 1), 0.0);
  // Routing of every batch first: the capacity and the global-batch load need all of it.
  std::vector<batch> data;
  std::vector<std::vector<double>> logits(B), probs(B), wts(B);
  std::vector<std::vector<int>> ids(B);
  std::vector<double> load(E, 0.0);
  for (int b = 0; b < B; ++b) {
    data.push_back(make_batch(o, b));
    logits[b].assign(static_cast<std::size_t>(N) * E, 0.0);
    probs[b].assign(logits[b].size(), 0.0);
    wts[b].assign(static_cast<std::size_t>(N) * k, 0.0);
    ids[b].assign(static_cast<std::size_t>(N) * k, 0);
    std::vector<int> id;
    std::vector<double> w(k), p(E);
    for (int t = 0; t < N; ++t) {
      const float* x = &data[b].x[static_cast<std::size_t>(t) * H];
      double* l = &logits[b][static_cast<std::size_t>(t) * E];
      for (int e = 0; e < E; ++e) {
        l[e] = br[e];
        for (int h = 0; h < H; ++h) l[e] += wr[e * H + h] * x[h];
      }
      reference_route(o, l, bias, id, w, p);
      std::copy(p.begin(), p.end(), probs[b].begin() + static_cast<std::ptrdiff_t>(t) * E);
      for (int j = 0; j < k; ++j) {
        ids[b][t * k + j] = id[j];
        wts[b][t * k + j] = w[j];
        load[id[j]] += 1.0;
      }
    }
  }
  const auto keep = reference_keep(o, m, ids, wts);
  std::vector<double> f(E);  // global-batch fractions of the auxiliary loss
  for (int e = 0; e < E; ++e) f[e] = load[e] / (static_cast<double>(B) * N * k);
  std::vector<double> a(F), g(F), act(F), da(F), dg(F), y(static_cast<std::size_t>(k) * H), dl(E);
  for (int b = 0; b < B; ++b) {
    const batch& d = data[b];
    std::vector<double> out(static_cast<std::size_t>(N) * H), gx(out.size()), gw(static_cast<std::size_t>(N) * k);
    for (int t = 0; t < N; ++t) {
      const float* x = &d.x[static_cast<std::size_t>(t) * H];
      const int* id = &ids[b][static_cast<std::size_t>(t) * k];
      const double* w = &wts[b][static_cast<std::size_t>(t) * k];
      const char* kp = &keep[b][static_cast<std::size_t>(t) * k];
      // Experts and combine (a dropped pair adds nothing).
      for (int j = 0; j < k; ++j) {
        if (!kp[j]) continue;
        const double* w1 = &params[id[j] * P];
        const double* w3 = w1 + F * H;
        const double* w2 = w1 + 2 * F * H;
        for (int q = 0; q < F; ++q) {
          a[q] = g[q] = 0.0;
          for (int h = 0; h < H; ++h) {
            a[q] += w1[q * H + h] * x[h];
            g[q] += w3[q * H + h] * x[h];
          }
          act[q] = a[q] * sigmoid(a[q]) * g[q];
        }
        for (int h = 0; h < H; ++h) {
          y[j * H + h] = 0.0;
          for (int q = 0; q < F; ++q) y[j * H + h] += w2[h * F + q] * act[q];
          out[t * H + h] += w[j] * y[j * H + h];
        }
      }
      // Loss 0.5 * mean((out - target)^2) over the N * H values of the batch.
      std::vector<double> dout(H);
      for (int h = 0; h < H; ++h) dout[h] = (out[t * H + h] - d.target[t * H + h]) / (static_cast<double>(N) * H);
      // Backward: routing-weight gradient (0 for a dropped pair), experts, input gradient.
      for (int j = 0; j < k; ++j) {
        if (!kp[j]) continue;
        double* gw_tj = &gw[t * k + j];
        for (int h = 0; h < H; ++h) *gw_tj += y[j * H + h] * dout[h];
        const double* w1 = &params[id[j] * P];
        const double* w3 = w1 + F * H;
        const double* w2 = w1 + 2 * F * H;
        double* g1 = &r.grad_experts[id[j] * P];
        double* g3 = g1 + F * H;
        double* g2 = g1 + 2 * F * H;
        for (int q = 0; q < F; ++q) {
          a[q] = g[q] = 0.0;
          for (int h = 0; h < H; ++h) {
            a[q] += w1[q * H + h] * x[h];
            g[q] += w3[q * H + h] * x[h];
          }
          const double s = sigmoid(a[q]);
          double dact = 0.0;
          for (int h = 0; h < H; ++h) {
            dact += w2[h * F + q] * w[j] * dout[h];
            g2[h * F + q] += w[j] * dout[h] * a[q] * s * g[q];
          }
          dg[q] = dact * a[q] * s;
          da[q] = dact * g[q] * s * (1.0 + a[q] * (1.0 - s));
          for (int h = 0; h < H; ++h) {
            g1[q * H + h] += da[q] * x[h];
            g3[q * H + h] += dg[q] * x[h];
            gx[t * H + h] += w1[q * H + h] * da[q] + w3[q * H + h] * dg[q];
          }
        }
      }
      // Router: d loss / d logits through the routing weights, then the dense weights.
      const double* p = &probs[b][static_cast<std::size_t>(t) * E];
      std::fill(dl.begin(), dl.end(), 0.0);
      if (o.sigmoid()) {  // w_j = s_j / D, D = sum of the selected s + 1e-20
        double D = 1e-20, gs = 0.0;
        for (int j = 0; j < k; ++j) D += p[id[j]];
        for (int j = 0; j < k; ++j) gs += gw[t * k + j] * p[id[j]];
        for (int j = 0; j < k; ++j) {
          const double s = p[id[j]];
          dl[id[j]] += (gw[t * k + j] - gs / D) / D * s * (1.0 - s);
        }
      } else {  // w_j = p_{id_j}, through the full softmax
        double pg = 0.0;
        for (int j = 0; j < k; ++j) pg += p[id[j]] * gw[t * k + j];
        for (int e = 0; e < E; ++e) {
          double ge = 0.0;
          for (int j = 0; j < k; ++j)
            if (id[j] == e) ge = gw[t * k + j];
          dl[e] = p[e] * (ge - pg);
        }
      }
      if (o.balance == "aux") {  // alpha * E * sum_e f_e mean_t q[t, e], f over all batches
        // q: the softmax of the logits, whatever the routing (sigmoid_bias's p is no softmax).
        const double* l = &logits[b][static_cast<std::size_t>(t) * E];
        std::vector<double> q(E);
        double mx = -1e300, z = 0.0, fq = 0.0;
        for (int e = 0; e < E; ++e) mx = std::max(mx, l[e]);
        for (int e = 0; e < E; ++e) z += (q[e] = std::exp(l[e] - mx));
        for (int e = 0; e < E; ++e) fq += f[e] * (q[e] /= z);
        for (int e = 0; e < E; ++e) dl[e] += o.aux_alpha * E / N * q[e] * (f[e] - fq);
      }
      for (int e = 0; e < E; ++e) {
        for (int h = 0; h < H; ++h) r.grad_router[e * H + h] += dl[e] * x[h];
        r.grad_router[static_cast<std::size_t>(E) * H + e] += dl[e];
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

// The larger error, a NaN over any number (std::max would drop a NaN and pass the check).
double worse(double a, double b) { return std::isnan(a) || b <= a ? a : b; }

template <class A>
void accumulate(error_norm& n, const A* got, const double* want, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    n.err = worse(n.err, std::abs(static_cast<double>(got[i]) - want[i]));
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
  std::vector<float> wr = init_router(o);           // [E, H] then [E], replicated on every rank
  swiglu_experts experts(o, m.expert_begin(rank), L);

  epx::layer_options lo;
  lo.hidden = H;
  lo.top_k = k;  // padding: the default, one zero row per local expert
  if (o.capacity_factor > 0.0) {
    lo.capacity.mode = o.capacity_mode;
    lo.capacity.factor = o.capacity_factor;
    lo.capacity.priority = o.drop;
  }
  lo.ranks_per_node = o.ranks_per_node;
  lo.max_nodes = o.max_nodes;
  epx::moe_layer<Comm, float> layer(m, world, lo);  // impl::all_to_all, exec::serial
  epx::gradient_hooks<Comm> hooks(m, world);
  Comm batches = epx::routing::batch_communicator(world, m);  // one rank per batch: the job's load
  std::vector<float> bias(static_cast<std::size_t>(E), 0.0f);  // selection bias of --balance bias
  epx::routing::softmax_topk softmax{false, layer.node_limit()};
  epx::routing::sigmoid_bias sig;
  sig.bias = bias.data();
  sig.limit = layer.node_limit();
  const epx::exec::serial exec{};

  if (root) {
    std::printf("epx MoE example: backend %s, %d ranks, tp=%d fsdp=%d ep=%d dp_replicate=%d\n", backend, W, o.tp,
                o.fsdp, o.ep, o.dp_replicate);
    std::printf("%d experts (%d per rank), top-%d %s routing, SwiGLU H=%zu F=%d, %zu tokens per batch, "
                "%d batches, SGD lr=%g\n",
                E, L, k, o.sigmoid() ? "sigmoid_bias" : "softmax_topk", H, o.ffn, N, m.batches(), o.lr);
    std::printf("balance %s", o.balance.c_str());
    if (o.balance == "aux") std::printf(" (alpha %g, global-batch f)", o.aux_alpha);
    if (o.balance == "bias") std::printf(" (gamma %g)", o.bias_rate);
    if (o.router_skew != 0.0) std::printf(", router skew %g", o.router_skew);
    if (o.capacity_factor > 0.0)
      std::printf(", capacity factor %g (%s, by %s)", o.capacity_factor, epx::to_string(o.capacity_mode),
                  epx::to_string(o.drop));
    if (o.ranks_per_node > 0) std::printf(", %d ranks per node", o.ranks_per_node);
    if (o.max_nodes > 0) std::printf(", at most %d node(s) per token", o.max_nodes);
    std::printf("\n\n%s\n", epx::describe(m).c_str());
    std::printf("step  loss      max/mean  dropped  nodes/token  (token, slot) pairs per expert over all batches\n");
  }

  std::vector<float> logits(N * E), weights(N * k), out(N * H), grad_out(N * H), grad_x(N * H), grad_w(N * k),
      grad_logits(N * E), aux_grad(N * E), grad_wr(wr.size());
  std::vector<std::int32_t> ids(N * k);
  error_norm errs[5];  // output, grad_x, grad_w, grad_experts, grad_router (first step)

  for (int step = 0; step < o.steps; ++step) {
    // Router and routing, on the whole batch (every rank of the TP group does the same).
    for (std::size_t t = 0; t < N; ++t)
      for (int e = 0; e < E; ++e) {
        float v = wr[static_cast<std::size_t>(E) * H + e];
        for (std::size_t h = 0; h < H; ++h) v += wr[e * H + h] * data.x[t * H + h];
        logits[t * E + e] = v;
      }
    if (o.sigmoid())
      epx::routing::route(sig, exec, logits.data(), N, E, k, ids.data(), weights.data());
    else
      epx::routing::route(softmax, exec, logits.data(), N, E, k, ids.data(), weights.data());
    // The pairs routed to each expert over every batch of the job: the same integers on
    // every rank (the global-batch f of the auxiliary loss, the load of the bias update).
    std::vector<std::int64_t> load = epx::routing::expert_load(exec, ids.data(), N, k, E);
    epx::routing::sum_over_batches(batches, epx::span<std::int64_t>(load));
    const std::vector<float> bias_used = bias;  // the selection bias of this step

    // The MoE layer: forward, loss, backward.
    auto saved = layer.forward(epx::span<const float>(data.x), epx::span<const std::int32_t>(ids),
                               epx::span<const float>(weights), epx::span<float>(out), experts, epx::mode::train);
    const epx::layer_stats stats = layer.stats();
    double loss = 0.0;
    for (std::size_t i = 0; i < N * H; ++i) {
      const double diff = static_cast<double>(out[i]) - data.target[i];
      loss += 0.5 * diff * diff / static_cast<double>(N * H);
      grad_out[i] = static_cast<float>(diff / static_cast<double>(N * H));
    }
    // The loss the router's gradient is of: the auxiliary loss too with --balance aux.
    if (o.balance == "aux")
      loss += epx::routing::aux_loss(exec, logits.data(), N, E, epx::span<const std::int64_t>(load), o.aux_alpha);
    std::fill(experts.grads.begin(), experts.grads.end(), 0.0f);
    layer.backward(std::move(saved), epx::span<const float>(grad_out), epx::span<float>(grad_x),
                   epx::span<float>(grad_w), experts);

    // Router gradient: grad_w -> grad_logits (+ the auxiliary loss's) -> [grad_Wr | grad_br].
    if (o.sigmoid())
      epx::routing::route_backward(sig, exec, logits.data(), N, E, k, ids.data(), weights.data(), grad_w.data(),
                                   grad_logits.data());
    else
      epx::routing::route_backward(softmax, exec, logits.data(), N, E, k, ids.data(), weights.data(), grad_w.data(),
                                   grad_logits.data());
    if (o.balance == "aux") {
      epx::routing::aux_loss_backward(exec, logits.data(), N, E, epx::span<const std::int64_t>(load), o.aux_alpha,
                                      1.0f, aux_grad.data());
      for (std::size_t i = 0; i < grad_logits.size(); ++i) grad_logits[i] += aux_grad[i];
    }
    for (int e = 0; e < E; ++e) {
      float gb = 0.0f;
      for (std::size_t t = 0; t < N; ++t) gb += grad_logits[t * E + e];
      grad_wr[static_cast<std::size_t>(E) * H + e] = gb;
      for (std::size_t h = 0; h < H; ++h) {
        float v = 0.0f;
        for (std::size_t t = 0; t < N; ++t) v += grad_logits[t * E + e] * data.x[t * H + h];
        grad_wr[e * H + h] = v;
      }
    }

    // Gradient hooks: both become the mean over all batches.
    hooks.reduce_dense(epx::span<float>(grad_wr));
    hooks.reduce_expert(epx::span<float>(experts.grads));

    if (step == 0) {  // compare the first step with the float64 reference
      const reference_result ref = reference_step(o, bias_used);
      const int b = m.batch(rank);
      accumulate(errs[0], out.data(), ref.out[b].data(), N * H);
      accumulate(errs[1], grad_x.data(), ref.grad_x[b].data(), N * H);
      accumulate(errs[2], grad_w.data(), ref.grad_w[b].data(), N * k);
      accumulate(errs[3], experts.grads.data(), &ref.grad_experts[m.expert_begin(rank) * o.expert_params()],
                 experts.grads.size());
      accumulate(errs[4], grad_wr.data(), ref.grad_router.data(), grad_wr.size());
    }

    // Loss (mean over the batches: one rank per TP group); dropped pairs and nodes per
    // token from the layer's statistics (one rank per EP group: every rank of a group has
    // the group's figures).
    const double mine[4] = {loss, static_cast<double>(stats.dropped_pairs), stats.mean_nodes_per_token,
                            static_cast<double>(stats.max_nodes_per_token)};
    std::vector<double> all(4 * static_cast<std::size_t>(W));
    epx::all_gather(world, epx::span<const double>(mine, 4), epx::span<double>(all));
    if (root) {
      double mean_loss = 0.0, dropped = 0.0, nodes = 0.0, max_nodes = 0.0;
      int groups = 0;
      for (int r = 0; r < W; ++r) {
        if (m.coords(r).tp == 0) mean_loss += all[4 * r] / m.batches();
        if (m.ep_rank(r) == 0) {
          dropped += all[4 * r + 1];
          nodes += all[4 * r + 2];
          max_nodes = std::max(max_nodes, all[4 * r + 3]);
          ++groups;
        }
      }
      const double mx = static_cast<double>(*std::max_element(load.begin(), load.end()));
      const double mean = static_cast<double>(m.batches()) * N * k / E;
      char node_text[32] = "-";
      if (o.ranks_per_node > 0) std::snprintf(node_text, sizeof node_text, "%.2f (max %.0f)", nodes / groups, max_nodes);
      std::printf("%4d  %.6f  %8.2f  %7.0f  %-11s  ", step + 1, mean_loss, mx / mean, dropped, node_text);
      for (int e = 0; e < E; ++e) std::printf("%s%lld", e ? " " : "", static_cast<long long>(load[e]));
      std::printf("\n");
    }

    // SGD: every rank holds the same reduced gradients, so replicas stay equal. The bias
    // update reads the same integers everywhere, so the bias stays bitwise equal too.
    for (std::size_t i = 0; i < wr.size(); ++i) wr[i] -= static_cast<float>(o.lr) * grad_wr[i];
    for (std::size_t i = 0; i < experts.params.size(); ++i)
      experts.params[i] -= static_cast<float>(o.lr) * experts.grads[i];
    if (o.balance == "bias")
      epx::routing::update_bias(exec, bias.data(), epx::span<const std::int64_t>(load), static_cast<float>(o.bias_rate));
  }

  // Replicas must agree bitwise: the router and the selection bias on every rank, each
  // expert group on its efsdp and dp_replicate replicas (the ranks with the same ep rank).
  const std::int64_t mine[3] = {fingerprint(wr), fingerprint(experts.params), fingerprint(bias)};
  std::vector<std::int64_t> prints(3 * static_cast<std::size_t>(W));
  epx::all_gather(world, epx::span<const std::int64_t>(mine, 3), epx::span<std::int64_t>(prints));
  bool consistent = true;
  for (int r = 0; r < W; ++r) {
    consistent = consistent && prints[3 * r] == prints[0] && prints[3 * r + 2] == prints[2];
    for (int q = 0; q < r; ++q)
      if (m.ep_rank(q) == m.ep_rank(r)) consistent = consistent && prints[3 * r + 1] == prints[3 * q + 1];
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
      total[i].err = worse(total[i].err, all[10 * r + 2 * i]);
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
                consistent ? "router and bias equal on every rank, each expert equal on all its replicas (bitwise)"
                           : "REPLICAS DISAGREE");
    std::printf("router gradient (dense hook): grad_router=%.3e (tolerance %.3e)\n", total[4].err, tol[4]);
    std::printf("tolerance (%.0e x largest |reference|): output=%.3e grad_x=%.3e grad_w=%.3e grad_experts=%.3e\n",
                o.rtol, tol[0], tol[1], tol[2], tol[3]);
    std::printf("check: output=%.3e grad_x=%.3e grad_w=%.3e grad_experts=%.3e vs float64 reference\n", total[0].err,
                total[1].err, total[2].err, total[3].err);
    std::fflush(stdout);
    for (int i = 0; i < 5; ++i)
      if (!(total[i].err <= tol[i]))
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
               "                       [--capacity-factor X] [--capacity-mode local|global]\n"
               "                       [--drop-priority position|score] [--routing softmax_topk|sigmoid_bias]\n"
               "                       [--balance none|aux|bias]\n"
               "                       [--aux-alpha X] [--bias-rate X] [--router-skew X]\n"
               "                       [--max-nodes M --ranks-per-node R]\n"
               "Defaults: threads backend with tp*fsdp*dp_replicate ranks (mpi when launched by mpirun),\n"
               "tp=2 fsdp=4 ep=4 dp_replicate=1, 16 experts, top-2, 5 steps, H=32, F=64, 64 tokens,\n"
               "lr=500, seed 7, rtol=1e-4 (errors allowed relative to the largest |reference| value).\n"
               "Capacity off (a factor turns it on: local mode, by position), softmax_topk routing, balance\n"
               "none (aux: Switch loss with alpha 0.01; bias: sigmoid_bias routing whose selection bias moves\n"
               "by gamma 0.02 per step), router skew 0 (the router bias starts at skew..-skew over the\n"
               "experts), no node limit (M nodes of R consecutive ep ranks each).\n");
}

// `lowest` 0: the flag's value 0 is its default (off, or no skew). Decimal digits only:
// strtol alone would also take leading blanks and a sign.
long parse_number(const std::string& flag, const std::string& v, long lowest = 1) {
  const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
  char* end = nullptr;
  errno = 0;
  const long x = digits ? std::strtol(v.c_str(), &end, 10) : -1;
  if (!digits || *end != '\0' || errno != 0 || x < lowest || x > (1L << 24))
    EPX_THROW(epx::errc::configuration, flag, " expects an integer from ", lowest, " to 16777216, got '", v, "'");
  return x;
}

constexpr double float_max = static_cast<double>(std::numeric_limits<float>::max());

// A decimal number (digits, a point, an exponent): strtod alone would also take leading
// blanks, a sign, hexadecimal and inf or nan. `max`: float_max for a value the run turns
// into a float32 (beyond it the float would be infinite).
double parse_real(const std::string& flag, const std::string& v, bool zero = false,
                  double max = std::numeric_limits<double>::max()) {
  const bool plain = !v.empty() && (std::isdigit(static_cast<unsigned char>(v[0])) || v[0] == '.') &&
                     v.find_first_not_of("0123456789.eE+-") == std::string::npos;
  char* end = nullptr;
  const double x = plain ? std::strtod(v.c_str(), &end) : -1.0;
  if (!plain || *end != '\0' || !(x > 0.0 || (zero && x == 0.0)) || !std::isfinite(x))
    EPX_THROW(epx::errc::configuration, flag, zero ? " expects a number >= 0, got '" : " expects a positive number, got '",
              v, "'");
  if (x > max)
    EPX_THROW(epx::errc::configuration, flag, " expects a number up to ", max, " (float32's largest), got '", v, "'");
  return x;
}

options parse(int argc, char** argv) {
  options o;
  std::vector<std::string> given;  // the flags on the command line
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    given.push_back(a);
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
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(parse_number(a, value(), 0));
    else if (a == "--lr") o.lr = parse_real(a, value(), false, float_max);
    else if (a == "--rtol") o.rtol = parse_real(a, value());
    else if (a == "--capacity-factor") o.capacity_factor = parse_real(a, value(), true);
    else if (a == "--capacity-mode") {
      const std::string v = value();
      if (v != "local" && v != "global")
        EPX_THROW(epx::errc::configuration, "--capacity-mode expects local or global, got '", v, "'");
      o.capacity_mode = v == "local" ? epx::capacity_mode::local : epx::capacity_mode::global;
    } else if (a == "--drop-priority") {
      const std::string v = value();
      if (v != "position" && v != "score")
        EPX_THROW(epx::errc::configuration, "--drop-priority expects position or score, got '", v, "'");
      o.drop = v == "position" ? epx::drop_priority::position : epx::drop_priority::score;
    } else if (a == "--balance") {
      o.balance = value();
      if (o.balance != "none" && o.balance != "aux" && o.balance != "bias")
        EPX_THROW(epx::errc::configuration, "--balance expects none, aux or bias, got '", o.balance, "'");
    } else if (a == "--routing") {
      o.routing = value();
      if (o.routing != "softmax_topk" && o.routing != "sigmoid_bias")
        EPX_THROW(epx::errc::configuration, "--routing expects softmax_topk or sigmoid_bias, got '", o.routing, "'");
    } else if (a == "--aux-alpha") o.aux_alpha = parse_real(a, value());
    else if (a == "--bias-rate") o.bias_rate = parse_real(a, value(), false, float_max);
    else if (a == "--router-skew") o.router_skew = parse_real(a, value(), true, float_max);
    else if (a == "--max-nodes") o.max_nodes = static_cast<int>(parse_number(a, value(), 0));
    else if (a == "--ranks-per-node") o.ranks_per_node = static_cast<int>(parse_number(a, value(), 0));
    else {
      EPX_THROW(epx::errc::configuration, "unknown argument '", a, "' (see --help)");
    }
  }
  // A flag that would change nothing without another one is refused, not ignored.
  const auto has = [&](const char* flag) { return std::find(given.begin(), given.end(), flag) != given.end(); };
  for (const char* flag : {"--capacity-mode", "--drop-priority"})
    if (has(flag) && o.capacity_factor <= 0.0)
      EPX_THROW(epx::errc::configuration, flag, " needs a capacity (--capacity-factor X, X > 0)");
  if (o.max_nodes > 0 && o.ranks_per_node == 0)
    EPX_THROW(epx::errc::configuration, "--max-nodes needs --ranks-per-node R (the ep ranks of a node)");
  if (has("--aux-alpha") && o.balance != "aux")
    EPX_THROW(epx::errc::configuration, "--aux-alpha needs --balance aux");
  // The loss's gradient coefficient alpha * E / N is a float32 (epx::routing::aux_loss
  // refuses a larger one from inside the run).
  if (o.aux_alpha * o.experts / o.tokens > float_max)
    EPX_THROW(epx::errc::configuration, "--aux-alpha (", o.aux_alpha, ") times --experts / --tokens = ", o.experts, " / ",
              o.tokens, " is ", o.aux_alpha * o.experts / o.tokens, ", beyond float32's largest number ", float_max);
  if (has("--bias-rate") && o.balance != "bias")
    EPX_THROW(epx::errc::configuration, "--bias-rate needs --balance bias");
  if (o.balance == "bias" && o.routing != "sigmoid_bias" && has("--routing"))
    EPX_THROW(epx::errc::configuration, "--balance bias routes with sigmoid_bias, not --routing ", o.routing);
  epx::mesh check(o.mesh());  // validates the sizes with the mesh's own messages
  check.validate_top_k(o.top_k);
  // The node limit against the mesh, named by its flags (the layer would refuse the same
  // values from inside the run, naming its options).
  if (o.ranks_per_node > 0 && o.ep % o.ranks_per_node != 0)
    EPX_THROW(epx::errc::configuration, "--ranks-per-node (", o.ranks_per_node, ") must divide --ep (", o.ep, ")");
  if (o.max_nodes > 0) {
    const int nodes = o.ep / o.ranks_per_node;
    if (o.max_nodes > nodes)
      EPX_THROW(epx::errc::configuration, "--max-nodes (", o.max_nodes, ") exceeds the number of nodes, --ep / "
                "--ranks-per-node = ", o.ep, " / ", o.ranks_per_node, " = ", nodes);
    const int room = o.max_nodes * o.ranks_per_node * check.local_experts();
    if (o.top_k > room)
      EPX_THROW(epx::errc::configuration, "--top-k (", o.top_k, ") exceeds what --max-nodes (", o.max_nodes,
                ") nodes hold: max-nodes * ranks-per-node * local experts = ", o.max_nodes, " * ", o.ranks_per_node,
                " * ", check.local_experts(), " = ", room);
  }
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
    // An exception on any rank aborts the whole job with its message (epx::mpi::run). A job
    // whose size is not the mesh's is a command-line error: every rank returns 2.
    return epx::mpi::run(argc, argv, [&](epx::mpi::communicator& world) {
      if (world.size() != o.world()) {
        if (world.rank() == 0) {
          std::fprintf(stderr,
                       "epx-moe-example: the mpi job has %d ranks but the mesh needs --tp * --fsdp * --dp-replicate "
                       "= %d * %d * %d = %d (mpirun -np %d, or other mesh flags)\n",
                       world.size(), o.tp, o.fsdp, o.dp_replicate, o.world(), o.world());
          usage(stderr);
        }
        return 2;
      }
      return train(world, o, "mpi");
    });
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
