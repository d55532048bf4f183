// bench/baseline.hpp: the dispatch/combine a user writes by hand today, for comparison.
//
// This is the structure of the common hand-written expert-parallel layer (and of the
// seed documents' description): one rank, one EP group, TP = 1.
// Forward:
//   1. argsort of the flattened expert ids with a comparison sort (std::stable_sort, so the
//      order is the same as epx's: expert, then row, then slot);
//   2. per-peer row counts, exchanged with an all_to_all of the counts;
//   3. gather of the rows into a staging buffer in sorted order;
//   4. all_to_allv of the rows (they arrive peer-major: all of peer 0's rows, then peer 1's);
//   5. the experts (here: identity, in place: nothing to do, as for epx's layer);
//   6. all_to_allv of the outputs back into sorted order;
//   7. a separate un-permute: output rows back to (token, slot) order in another buffer;
//   8. the weighted sum over the k slots of each token (in float, slot order).
// Backward (after a training forward, which keeps the un-permuted outputs):
//   1. grad_y rows w[t,j] * grad_out[t] in sorted order (staging);
//   2. grad_w[t,j] = <y[t,j], grad_out[t]> from the kept outputs;
//   3. all_to_allv of the grad_y rows to the owners;
//   4. the experts' backward (identity: grad_in = a copy of grad_y, as epx's bench experts);
//   5. all_to_allv of grad_in back into sorted order;
//   6. un-permute to (token, slot) order;
//   7. the sum over the k slots of each token.
// Buffers live in a workspace kept between calls (what a framework's caching allocator
// gives the hand-written code), so the baseline pays no page faults. Every stage's time is
// recorded (stage_seconds()), the collectives' waits included.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/exec/host.hpp"

namespace epx::bench {

// The argsort layout: send position p holds pair order[p]; counts per peer, in rows.
struct baseline_layout {
  std::vector<std::int64_t> order;         // [n*k] pair index (t*k+j) of send position p
  std::vector<std::size_t> send_counts;    // [ep]
  std::vector<std::size_t> send_displs;    // [ep]

  void build(const std::int32_t* ids, std::size_t pairs, int num_experts, int ep) {
    order.resize(pairs);
    std::iota(order.begin(), order.end(), std::int64_t{0});
    std::stable_sort(order.begin(), order.end(), [ids](std::int64_t a, std::int64_t b) { return ids[a] < ids[b]; });
    const int L = num_experts / ep;
    send_counts.assign(static_cast<std::size_t>(ep), 0);
    send_displs.assign(static_cast<std::size_t>(ep), 0);
    for (std::size_t i = 0; i < pairs; ++i) ++send_counts[static_cast<std::size_t>(ids[i] / L)];
    for (std::size_t d = 1; d < send_counts.size(); ++d) send_displs[d] = send_displs[d - 1] + send_counts[d - 1];
  }
};

// Per-stage wall times of the last call, in seconds.
class stage_clock {
 public:
  void start() {
    n_ = 0;
    t_ = std::chrono::steady_clock::now();
  }
  void lap() {
    const auto now = std::chrono::steady_clock::now();
    if (n_ < max) s_[n_++] = std::chrono::duration<double>(now - t_).count();
    t_ = now;
  }
  const double* seconds() const { return s_; }
  int count() const { return n_; }

 private:
  static constexpr int max = 12;
  double s_[max] = {};
  int n_ = 0;
  std::chrono::steady_clock::time_point t_;
};

template <class T>
class baseline_layer {
 public:
  // Stage names of forward() and backward(), in order.
  static constexpr const char* forward_stages[] = {"argsort_counts", "gather", "dispatch", "return", "unpermute",
                                                   "weighted_sum"};
  static constexpr const char* backward_stages[] = {"grad_rows", "weight_grads", "dispatch", "experts",
                                                    "return", "unpermute", "sum"};

  // x: [n, H]; ids, weights: [n, k]; out: [n, H]. Collective over `comm` (the EP group).
  // `training`: keep the outputs for backward.
  template <class Comm>
  void forward(Comm& comm, const T* x, const std::int32_t* ids, const float* weights, std::size_t n, std::size_t H,
               int k, int num_experts, T* out, bool training = false) {
    clock_.start();
    const int ep = comm.size();
    const std::size_t S = n * static_cast<std::size_t>(k);
    n_ = n;
    H_ = H;
    k_ = k;
    // 1-2: argsort and counts.
    layout_.build(ids, S, num_experts, ep);
    std::vector<std::uint64_t> sc(layout_.send_counts.begin(), layout_.send_counts.end()), rc(sc.size());
    comm.all_to_all(sc.data(), rc.data(), 1, datatype::int64);
    recv_counts_.assign(rc.begin(), rc.end());
    recv_displs_.assign(recv_counts_.size(), 0);
    for (std::size_t d = 1; d < recv_counts_.size(); ++d) recv_displs_[d] = recv_displs_[d - 1] + recv_counts_[d - 1];
    const std::size_t R = recv_displs_.back() + recv_counts_.back();
    staging_.reserve_discard(S * H);
    recv_.reserve_discard(R * H);
    unpermuted_.reserve_discard(S * H);
    clock_.lap();
    // 3: gather into sorted order.
    for (std::size_t p = 0; p < S; ++p)
      std::memcpy(staging_.data() + p * H, x + static_cast<std::size_t>(layout_.order[p]) / k * H, H * sizeof(T));
    clock_.lap();
    // 4: rows to the experts' owners.
    all_to_allv_rows(comm, static_cast<const T*>(staging_.data()), make_span(layout_.send_counts),
                     make_span(layout_.send_displs), recv_.data(), make_span(recv_counts_), make_span(recv_displs_), H);
    clock_.lap();
    // 5: identity experts, in place on recv_.
    // 6: outputs back, into sorted order (the staging buffer is free again).
    all_to_allv_rows(comm, static_cast<const T*>(recv_.data()), make_span(recv_counts_), make_span(recv_displs_),
                     staging_.data(), make_span(layout_.send_counts), make_span(layout_.send_displs), H);
    clock_.lap();
    // 7: un-permute to (token, slot) order.
    for (std::size_t p = 0; p < S; ++p)
      std::memcpy(unpermuted_.data() + static_cast<std::size_t>(layout_.order[p]) * H, staging_.data() + p * H,
                  H * sizeof(T));
    clock_.lap();
    // 8: weighted sum.
    using A = accum_t<T>;
    const auto kk = static_cast<std::size_t>(k);
    for (std::size_t t = 0; t < n; ++t) {
      T* o = out + t * H;
      for (std::size_t h = 0; h < H; ++h) {
        A acc = A(0);
        for (std::size_t j = 0; j < kk; ++j)
          acc += static_cast<A>(weights[t * kk + j]) * convert<A>(unpermuted_[(t * kk + j) * H + h]);
        o[h] = convert<T>(acc);
      }
    }
    clock_.lap();
    trained_ = training;
    weights_ = weights;
  }

  // grad_out: [n, H] -> grad_x [n, H], grad_w [n, k], after a training forward.
  template <class Comm>
  void backward(Comm& comm, const T* grad_out, T* grad_x, float* grad_w) {
    clock_.start();
    using A = accum_t<T>;
    const std::size_t n = n_, H = H_, kk = static_cast<std::size_t>(k_), S = n * kk;
    const std::size_t R = recv_displs_.back() + recv_counts_.back();
    grad_in_.reserve_discard(R * H);
    // 1: grad_y rows in sorted order (the outputs of forward stay in unpermuted_).
    for (std::size_t p = 0; p < S; ++p) {
      const auto pair = static_cast<std::size_t>(layout_.order[p]);
      const A w = static_cast<A>(weights_[pair]);
      const T* g = grad_out + pair / kk * H;
      T* d = staging_.data() + p * H;
      for (std::size_t h = 0; h < H; ++h) d[h] = convert<T>(w * convert<A>(g[h]));
    }
    clock_.lap();
    // 2: routing-weight gradients from the kept outputs.
    for (std::size_t i = 0; i < S; ++i) {
      const T* y = unpermuted_.data() + i * H;
      const T* g = grad_out + i / kk * H;
      A s = A(0);
      for (std::size_t h = 0; h < H; ++h) s += convert<A>(y[h]) * convert<A>(g[h]);
      grad_w[i] = static_cast<float>(s);
    }
    clock_.lap();
    // 3: to the owners.
    all_to_allv_rows(comm, static_cast<const T*>(staging_.data()), make_span(layout_.send_counts),
                     make_span(layout_.send_displs), recv_.data(), make_span(recv_counts_), make_span(recv_displs_), H);
    clock_.lap();
    // 4: identity experts' backward: grad_in = grad_y.
    if (R) std::memcpy(grad_in_.data(), recv_.data(), R * H * sizeof(T));
    clock_.lap();
    // 5: back into sorted order.
    all_to_allv_rows(comm, static_cast<const T*>(grad_in_.data()), make_span(recv_counts_), make_span(recv_displs_),
                     staging_.data(), make_span(layout_.send_counts), make_span(layout_.send_displs), H);
    clock_.lap();
    // 6: un-permute.
    for (std::size_t p = 0; p < S; ++p)
      std::memcpy(unpermuted_.data() + static_cast<std::size_t>(layout_.order[p]) * H, staging_.data() + p * H,
                  H * sizeof(T));
    clock_.lap();
    // 7: sum over the slots.
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t h = 0; h < H; ++h) {
        A acc = A(0);
        for (std::size_t j = 0; j < kk; ++j) acc += convert<A>(unpermuted_[(t * kk + j) * H + h]);
        grad_x[t * H + h] = convert<T>(acc);
      }
    clock_.lap();
    trained_ = false;
  }

  // Workspace bytes held between calls (the baseline's extra memory).
  std::size_t workspace_bytes() const noexcept {
    return (staging_.size() + recv_.size() + unpermuted_.size() + grad_in_.size()) * sizeof(T) +
           layout_.order.size() * sizeof(std::int64_t);
  }
  // Rows this rank received in the last forward.
  std::size_t rows_received() const noexcept { return recv_counts_.empty() ? 0 : recv_displs_.back() + recv_counts_.back(); }
  const stage_clock& stages() const noexcept { return clock_; }

 private:
  baseline_layout layout_;
  std::vector<std::size_t> recv_counts_, recv_displs_;
  exec::host_buffer<T> staging_;     // [S, H] sorted order, reused for the returned outputs
  exec::host_buffer<T> recv_;        // [R, H] peer-major; the experts' outputs in place
  exec::host_buffer<T> unpermuted_;  // [S, H] (token, slot) order; kept for backward
  exec::host_buffer<T> grad_in_;     // [R, H] backward: the experts' input gradients
  stage_clock clock_;
  std::size_t n_ = 0, H_ = 0;
  int k_ = 0;
  bool trained_ = false;
  const float* weights_ = nullptr;
};

}  // namespace epx::bench
