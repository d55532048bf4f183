// bench/layer_common.hpp: what bench_layer (threads) and bench_layer_mpi share: the
// inputs, the identity experts, the output checks and the bytes each route reads and
// writes (see bench_layer.cpp's header comment).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/epx.hpp"
#include "epx/exec/host_isa.hpp"

namespace epx::bench {

// --- inputs ----------------------------------------------------------------------------------
enum routing_kind : int { balanced = 0, zipf = 1 };
constexpr double zipf_exponent = 1.0;

// [n, k] expert ids, k distinct experts per token. balanced: uniform over the E experts
// (every expert gets n*k/E pairs in expectation). zipf: P(e) proportional to 1/(e+1)^s,
// s = 1 (expert 0 the most loaded, so ep rank 0 receives the most rows).
std::vector<std::int32_t> make_ids(std::size_t n, int k, int E, routing_kind r, int rank) {
  std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
  std::vector<double> cdf(static_cast<std::size_t>(E));
  double s = 0;
  for (int e = 0; e < E; ++e)
    cdf[static_cast<std::size_t>(e)] = (s += r == balanced ? 1.0 : std::pow(e + 1.0, -zipf_exponent));
  std::mt19937_64 gen(0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<double> u(0.0, s);
  std::vector<char> used(static_cast<std::size_t>(E));
  for (std::size_t t = 0; t < n; ++t) {
    std::fill(used.begin(), used.end(), 0);
    for (int j = 0; j < k; ++j) {
      int e;
      do {
        e = static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u(gen)) - cdf.begin());
        e = std::min(e, E - 1);
      } while (used[static_cast<std::size_t>(e)]);
      used[static_cast<std::size_t>(e)] = 1;
      ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)] = e;
    }
  }
  return ids;
}

std::vector<float> make_weights(std::size_t n, int k, int rank) {
  std::vector<float> w(n * static_cast<std::size_t>(k));
  std::mt19937 gen(1234u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (auto& v : w) v = u(gen);
  return w;
}

template <class T>
std::vector<T> make_rows(std::size_t n, std::size_t H, int rank) {
  std::vector<T> x(n * H);
  std::uint32_t s = 0x12345u + static_cast<std::uint32_t>(rank) * 7919u;
  for (auto& v : x) {
    s = s * 1664525u + 1013904223u;
    v = epx::convert<T>(static_cast<float>(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
  return x;
}

// Identity experts: out = in (nothing to do in place, a copy otherwise), grad_in = grad_out.
template <class T>
struct identity_experts {
  static constexpr bool forward_in_place = true;
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const T>& in, T* out) {
    if (in.num_rows && static_cast<const T*>(out) != in.rows)
      std::memcpy(out, in.rows, in.num_rows * in.hidden * sizeof(T));
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    if (in.num_rows) std::memcpy(grad_in, grad_out, in.num_rows * in.hidden * sizeof(T));
  }
};

// --- output checks -----------------------------------------------------------------------
// With identity experts: out[t] = sum_j w_j x[t] (k products summed in accum_t<T>, rounded
// to T); grad_x[t] = sum_j round_T(w_j g[t]); grad_w[t,j] = <x[t], g[t]> (H products). Each
// element is checked within the rounding bound of that arithmetic (any summation order);
// `partials` > 1: rounded partial sums, of the masked path over the EP group or of the
// per-rank route over a token's owners (at most min(k, ep)).
template <class T>
std::string check_forward(const T* x, const float* w, const T* out, std::size_t n, std::size_t H, int k,
                          int partials = 1) {
  using A = epx::accum_t<T>;
  const double u = sizeof(T) == 2 ? 0x1p-8 : 0x1p-24, ua = std::is_same_v<A, double> ? 0x1p-53 : 0x1p-24;
  const double gk = (k + partials) * ua / (1 - (k + partials) * ua);
  const auto K = static_cast<std::size_t>(k);
  for (std::size_t t = 0; t < n; ++t) {
    double W = 0, Wa = 0;
    for (std::size_t j = 0; j < K; ++j) {
      W += w[t * K + j];
      Wa += std::abs(w[t * K + j]);
    }
    for (std::size_t h = 0; h < H; ++h) {
      const double xv = static_cast<double>(epx::convert<float>(x[t * H + h]));
      const double want = W * xv, S = Wa * std::abs(xv);
      const double got = static_cast<double>(epx::convert<float>(out[t * H + h]));
      const double bound = u * std::abs(want) + (1 + u) * (gk + (partials > 1 ? 2 * u : 0.0)) * S + 1e-30;
      if (!(std::abs(got - want) <= bound))
        return epx::detail::concat("out[", t, ", ", h, "] = ", got, ", expected ", want, " (bound ", bound, ")");
    }
  }
  return {};
}

template <class T>
std::string check_backward(const T* x, const float* w, const T* g, const T* grad_x, const float* grad_w,
                           std::size_t n, std::size_t H, int k, int partials = 1) {
  const double u = sizeof(T) == 2 ? 0x1p-8 : 0x1p-24, ua = 0x1p-24;
  const auto K = static_cast<std::size_t>(k);
  const double kp = static_cast<double>(K) + (partials > 1 ? partials : 0);
  const double gk = kp * ua / (1 - kp * ua), gh = static_cast<double>(H) * ua / (1 - static_cast<double>(H) * ua);
  for (std::size_t t = 0; t < n; ++t) {
    double W = 0, Wa = 0;
    for (std::size_t j = 0; j < K; ++j) {
      W += w[t * K + j];
      Wa += std::abs(w[t * K + j]);
    }
    double dot = 0, dot_abs = 0;
    for (std::size_t h = 0; h < H; ++h) {
      const double gv = static_cast<double>(epx::convert<float>(g[t * H + h]));
      const double xv = static_cast<double>(epx::convert<float>(x[t * H + h]));
      dot += xv * gv;
      dot_abs += std::abs(xv * gv);
      const double want = W * gv, S = Wa * std::abs(gv);
      const double got = static_cast<double>(epx::convert<float>(grad_x[t * H + h]));
      const double bound = u * std::abs(want) +
                           (1 + u) * ((u + 2 * ua) * (1 + u) + gk * (1 + 2 * u) + (partials > 1 ? 2 * u : 0.0)) * S +
                           1e-30;
      if (!(std::abs(got - want) <= bound))
        return epx::detail::concat("grad_x[", t, ", ", h, "] = ", got, ", expected ", want, " (bound ", bound, ")");
    }
    for (std::size_t j = 0; j < K; ++j) {
      const double got = grad_w[t * K + j];
      const double bound = (sizeof(T) == 2 ? gh : ua + gh * (1 + ua)) * dot_abs + ua * std::abs(dot) + 1e-30;
      if (!(std::abs(got - dot) <= bound))
        return epx::detail::concat("grad_w[", t, ", ", j, "] = ", got, ", expected ", dot, " (bound ", bound, ")");
    }
  }
  return {};
}

// staged, direct, masked: as in bench_layer.cpp's header; per_rank: the staged route with
// one row per (token, destination rank) (layer_options::sends, spec section 14).
enum class route { staged, direct, masked, per_rank };

const char* to_string(route r) {
  return r == route::staged ? "staged" : r == route::direct ? "direct" : r == route::masked ? "masked" : "per_rank";
}

// Per rank, in rows: what the epx call of `r` reads plus writes, stage by stage (see the top
// of the file). S: rows this rank sends (per_rank: its unique rows U), Ur: unique rows it
// receives (per_rank only), n: rows of this rank's slice, N: rows of the call, tp: TP
// group size. The per-rank route, with Rr = R - P pair rows at the owner:
//   forward   dispatch 2Ur, copies into the expert-major rows Rr + R,
//             the owner's sums Rr + Ur, return 2U, combine U + n
//   backward  dispatch 2Ur, w * grad rows Rr + R, dots 2Rr, experts 2R,
//             the owner's sums Rr + Ur, return 2U, reduce U + n
// Sends that read rows by index (layer_options::indexed_sends on the threads and MPI
// communicators, the default) move them straight from x or grad_out to the receiver; with
// `gathered`, the staged forward first gathers them (2S), and the per-rank route gathers
// its unique rows (2U) both ways.
std::vector<double> route_traffic(route r, bool backward, double S, double R, double P, double n, double N, int tp,
                                  double Ur = 0, bool gathered = false) {
  const double Rr = R - P;
  std::vector<double> v;
  if (r == route::masked) {
    v = {2 * Rr + P, Rr + N, 3 * N + N / tp};
    return v;
  }
  if (r == route::per_rank) {
    const double U = S;
    v = backward ? std::vector<double>{2 * Ur, Rr + R, 2 * Rr, 2 * R, Rr + Ur, 2 * U, U + n}
                 : std::vector<double>{2 * Ur, Rr + R, Rr + Ur, 2 * U, U + n};
    if (gathered) v.push_back(2 * U);
  } else if (r == route::staged) {
    v = backward ? std::vector<double>{2 * S, 2 * S, P, 2 * Rr, 2 * R, 2 * S, S + n}
                 : std::vector<double>{P, 2 * Rr, 2 * S, S + n};
    if (gathered && !backward) v.push_back(2 * S);
  }
  else
    v = backward ? std::vector<double>{Rr + R, 2 * S, 2 * R, S + n} : std::vector<double>{2 * Rr + P, S + n};
  if (tp > 1) v.push_back(3 * N + N / tp);
  return v;
}
std::vector<double> baseline_traffic(bool backward, double S, double Rr, double n) {
  return backward ? std::vector<double>{2 * S, 2 * S, 2 * Rr, 2 * Rr, 2 * S, 2 * S, S + n}
                  : std::vector<double>{2 * S, 2 * Rr, 2 * S, 2 * S, S + n};
}

// One EP group of `ep` ranks (fsdp = ep, tp = 1) over `experts` experts.
// `--host-isa=baseline|avx2|avx512`: the version of the host row loops to run
// (epx/exec/host_isa.hpp; default the widest the CPU supports). True when `arg` was that
// flag; an unknown or unsupported name is errc::input.
inline bool host_isa_flag(const std::string& arg) {
  if (arg.rfind("--host-isa=", 0) != 0) return false;
  const std::string v = arg.substr(11);
  using epx::exec::host_isa;
  host_isa isa = static_cast<host_isa>(-1);
  for (host_isa i : {host_isa::baseline, host_isa::avx2, host_isa::avx512})
    if (v == epx::exec::to_string(i)) isa = i;
  epx::exec::use_host_isa(isa);
  return true;
}

// --stage-bytes=B|all: layer_options::stage_bytes of the layers a benchmark makes (0, the
// default: automatic; `all`: one round). Returns whether `arg` was that flag.
inline std::size_t& stage_bytes() {
  static std::size_t v = 0;
  return v;
}
inline bool stage_bytes_flag(const std::string& arg) {
  if (arg.rfind("--stage-bytes=", 0) != 0) return false;
  const std::string v = arg.substr(14);
  stage_bytes() = v == "all" ? std::numeric_limits<std::size_t>::max() : static_cast<std::size_t>(std::stoull(v));
  return true;
}
// The context line for it.
inline std::string stage_bytes_context() {
  const std::size_t b = stage_bytes();
  return b == 0 ? "automatic" : b == std::numeric_limits<std::size_t>::max() ? "all (one round)" : std::to_string(b);
}

// --stream-threshold=B: exec::set_stream_threshold(B), the bytes from which the host row
// copies write around the caches (epx/exec/stream.hpp; 0: every copy streams). Returns
// whether `arg` was that flag.
inline bool stream_threshold_flag(const std::string& arg) {
  if (arg.rfind("--stream-threshold=", 0) != 0) return false;
  epx::exec::set_stream_threshold(static_cast<std::size_t>(std::stoull(arg.substr(19))));
  return true;
}

// --gathered: layer_options::indexed_sends = false in the layers a benchmark makes (the
// staged route gathers its rows into a send buffer before it sends them). Returns whether
// `arg` was that flag.
inline bool& gathered() {
  static bool v = false;
  return v;
}
inline bool gathered_flag(const std::string& arg) {
  if (arg != "--gathered") return false;
  gathered() = true;
  return true;
}

inline epx::mesh ep_mesh(int ep, int experts) {
  epx::mesh_config mc;
  mc.fsdp = ep;
  mc.ep = ep;
  mc.experts = experts;
  return epx::mesh(mc);
}

}  // namespace epx::bench
