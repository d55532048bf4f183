// bench/decode_common.hpp: the decode step of bench_decode.cpp (threads) and
// bench_decode_mpi.cpp (MPI), one rank's part of it, and what both report.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "layer_common.hpp"
#include "epx/epx.hpp"

namespace epx::bench::decode {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// A communicator (threads or MPI) with the time spent inside it counted (peer access: the
// time outside the caller's function, i.e. the waits around it).
template <class C>
class timed_comm {
 public:
  using peer_pointers = typename C::peer_pointers;
  timed_comm(C c, std::shared_ptr<double> waited) : c_(std::move(c)), waited_(std::move(waited)) {}
  int rank() const noexcept { return c_.rank(); }
  int size() const noexcept { return c_.size(); }
  timed_comm split(int color, int key) const { return timed_comm(c_.split(color, key), waited_); }
  void all_to_all(const void* s, void* r, std::size_t n, epx::datatype t) {
    timed([&] { c_.all_to_all(s, r, n, t); });
  }
  void all_to_allv(const void* s, const std::size_t* sc, const std::size_t* sd, void* r, const std::size_t* rc,
                   const std::size_t* rd, epx::datatype t) {
    timed([&] { c_.all_to_allv(s, sc, sd, r, rc, rd, t); });
  }
  void all_reduce(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    timed([&] { c_.all_reduce(s, r, n, t, scale); });
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    timed([&] { c_.reduce_scatter(s, r, n, t, scale); });
  }
  void all_gather(const void* s, void* r, std::size_t n, epx::datatype t) {
    timed([&] { c_.all_gather(s, r, n, t); });
  }
  void broadcast(void* d, std::size_t n, epx::datatype t, int root) { timed([&] { c_.broadcast(d, n, t, root); }); }
  // The optional members, where C has them (without them the layer would take another
  // path than on C itself: gather its rows before sending, or send segments one by one).
  template <class CC = C>
  auto all_to_allv_segments(const void* s, const std::size_t* sc, const std::size_t* sd, void* r,
                            const std::size_t* rc, const std::size_t* rd, std::size_t nseg, epx::datatype t)
      -> decltype(std::declval<CC&>().all_to_allv_segments(s, sc, sd, r, rc, rd, nseg, t), void()) {
    timed([&] { c_.all_to_allv_segments(s, sc, sd, r, rc, rd, nseg, t); });
  }
  template <class CC = C>
  auto all_to_allv_indexed(const void* src, const std::int64_t* rows, std::size_t row_elems, const std::size_t* sc,
                           const std::size_t* sd, void* r, const std::size_t* rc, const std::size_t* rd,
                           std::size_t nseg, epx::datatype t)
      -> decltype(std::declval<CC&>().all_to_allv_indexed(src, rows, row_elems, sc, sd, r, rc, rd, nseg, t), void()) {
    timed([&] { c_.all_to_allv_indexed(src, rows, row_elems, sc, sd, r, rc, rd, nseg, t); });
  }
  void barrier() { timed([&] { c_.barrier(); }); }
  bool peer_access_available() { return epx::peer_access_available(c_); }
  template <class CC = C>
  auto peer_buffer(std::size_t bytes) -> decltype(std::declval<CC&>().peer_buffer(bytes)) {
    std::shared_ptr<void> p;
    timed([&] { p = c_.peer_buffer(bytes); });
    return p;
  }
  template <class F>
  void access_peers(const void* const* mine, const std::size_t* bytes, std::size_t count, F&& f) {
    double inside = 0;
    const auto t0 = clock_type::now();
    c_.access_peers(mine, bytes, count, [&](const peer_pointers& p) {
      const auto t1 = clock_type::now();
      f(p);
      inside += seconds_since(t1);
    });
    *waited_ += seconds_since(t0) - inside;
  }

 private:
  template <class F>
  void timed(F&& f) {
    const auto t0 = clock_type::now();
    f();
    *waited_ += seconds_since(t0);
  }
  C c_;
  std::shared_ptr<double> waited_;
};

struct shape {
  std::size_t tokens = 128, hidden = 7168;
  int top_k = 8, experts = 256, ep = 8;
  std::int64_t cap = 16;
};

struct result {
  std::vector<double> latency;  // seconds per call
  double wait_share = 0, floor_s = 0, bytes = 0;
  std::int64_t overflow = 0;
  bool checked = true;
  std::string failure;
};

inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Rows each rank reads plus writes per call (identity experts in place move nothing):
//   direct  pull 2R, padding P (normal), combine S + n; on MPI (`window`) also the copy
//           of x into the communicator's shared window, 2n (the outputs are made in a
//           peer buffer)
//   staged  gather 2S (bounded; the normal mode sends rows by index straight from x),
//           all-to-all out (the threads all-to-all copies what each rank receives: normal
//           2R, bounded the fixed slabs 2*ep*slab), unpack 2R (bounded) or padding P
//           (normal), pack 2R (bounded), all-to-all back (as out), combine S + n
//   fp8     (normal) quantise n rows (read n, write n/2), experts dequantise (read R/2,
//           write R), and by route:
//           direct  pull R/2 + R/2, padding P/2, combine S + n; on MPI also the copy of
//                   the quantised rows into the shared window, n
//           staged  all-to-all out by index out of the quantised rows R/2 + R/2, padding
//                   P/2, all-to-all back 2R, combine S + n
//           (in rows of T; E4M3 rows are half as wide; scales left out)
// S = n*k pairs sent, R = rows received (mean over ranks: S), P = L padding rows (one zero
// row per local expert, the default padding), slab = hdr + L*cap.
inline double route_rows(const shape& s, bool bounded, bool direct, bool fp8 = false, bool window = false) {
  const double n = static_cast<double>(s.tokens), S = n * s.top_k, R = S;
  const int L = s.experts / s.ep;
  if (fp8 && direct) return 1.5 * n + 1.5 * R + R + 0.5 * L + S + n + (window ? n : 0.0);
  if (fp8) return 1.5 * n + R + 0.5 * L + 1.5 * R + 2 * R + S + n;
  if (direct) return 2 * R + (bounded ? 0.0 : static_cast<double>(L)) + S + n + (window ? 2 * n : 0.0);
  const double slab = 1.0 + static_cast<double>(L) * static_cast<double>(s.cap);
  const double moved = bounded ? 2.0 * s.ep * slab : 2 * R;
  const double pack = bounded ? 4 * R : static_cast<double>(L);
  return (bounded ? 2 * S : 0.0) + 2 * moved + pack + S + n;
}

// Identity experts for FP8 rows: out = float(q) * scale, rounded to T (the library's
// dequantisation, epx::kernels::dequantise_e4m3).
struct fp8_identity_experts {
  using T = epx::bf16;
  template <class Exec>
  void forward(const Exec& ex, const epx::expert_rows<const epx::fp8_e4m3>& in, const float* scales, T* out) {
    epx::kernels::dequantise_e4m3(ex, in.num_rows, in.hidden, in.rows, scales, out);
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const T>& in, const T* g, T* gi) {
    if (in.num_rows) std::memcpy(gi, g, in.num_rows * in.hidden * sizeof(T));
  }
};

// out against sum_j w_j x[t] within the E4M3 bound: each element of x' is within |x|/16
// plus half a subnormal step of its block (scale * 2^-10) of x, then the bf16 roundings.
inline std::string check_fp8_forward(const epx::bf16* x, const float* w, const epx::bf16* out, std::size_t n, std::size_t H,
                              int k) {
  for (std::size_t t = 0; t < n; ++t) {
    for (std::size_t b0 = 0; b0 < H; b0 += 128) {
      double amax = 0;
      for (std::size_t h = b0; h < b0 + 128; ++h) amax = std::max(amax, std::fabs(epx::convert<double>(x[t * H + h])));
      const double scale = amax / 448.0;
      for (std::size_t h = b0; h < b0 + 128; ++h) {
        const double xv = epx::convert<double>(x[t * H + h]);
        double ref = 0, sw = 0;
        for (int j = 0; j < k; ++j) {
          ref += static_cast<double>(w[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)]) * xv;
          sw += std::fabs(w[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)]);
        }
        const double bound = sw * (std::fabs(xv) / 16 + scale * 0x1p-10) * (1 + 0x1p-7) + std::fabs(ref) * 0x1p-7 + 1e-30;
        const double got = epx::convert<double>(out[t * H + h]);
        if (!(std::fabs(got - ref) <= bound))
          return epx::detail::concat("fp8 out[", t, ",", h, "] = ", got, ", expected ", ref, " within ", bound);
      }
    }
  }
  return {};
}

// What one rank measured in one decode run.
struct rank_result {
  std::vector<double> latency;  // seconds per call, barrier to barrier (the slowest rank's)
  std::vector<double> floors;   // seconds per memcpy floor round, barrier to barrier
  double wait_share = 0;        // mean over calls of the time inside the communicator / latency
  double bytes = 0;             // bytes the route reads plus writes per call
  std::int64_t overflow = 0;    // bounded mode: pairs dropped over the run
  std::string failure;          // the output check ("" when fine)
};

// One rank of a decode measurement over `world` (threads or MPI): bounded or normal mode,
// direct or staged route, bf16 rows or (fp8: normal mode) E4M3 rows with
// experts that dequantise; `calls` timed calls after 10 warm-up calls. `window`: the
// direct route copies x into a shared window (MPI), which the floor counts.
template <class C>
rank_result decode_rank(C& world, const shape& s, int calls, bool bounded, bool direct, bool fp8, bool window) {
  using T = epx::bf16;
  const int P = s.ep, r = world.rank();
  auto waited = std::make_shared<double>(0.0);
  timed_comm<C> comm(world.split(0, r), waited);
  const epx::mesh m = ep_mesh(P, s.experts);
  epx::layer_options o;
  o.hidden = s.hidden;
  o.top_k = s.top_k;
  o.peer_access = direct;
  o.stage_bytes = epx::bench::stage_bytes();
  o.fp8_dispatch = fp8;
  epx::layer_options ob = o;
  ob.counts = epx::count_exchange::device;
  ob.bound.cap = s.cap;
  const std::size_t n = s.tokens, H = s.hidden;
  const auto x = make_rows<T>(n, H, r);
  const auto ids = make_ids(n, s.top_k, s.experts, balanced, r);
  const auto w = make_weights(n, s.top_k, r);
  std::vector<T> out(n * H), ref(n * H);
  identity_experts<T> experts;
  fp8_identity_experts experts8;
  epx::moe_layer<timed_comm<C>, T, epx::impl::all_to_all> layer(m, comm, bounded ? ob : o);
  auto call = [&](std::vector<T>& y) {
    if (fp8)
      (void)layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                          epx::span<T>(y), experts8, epx::mode::inference);
    else
      (void)layer.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                          epx::span<T>(y), experts, epx::mode::inference);
  };
  rank_result res;
  // Check once: against the direct computation (FP8: within the E4M3 bound), and bounded
  // against the normal mode.
  call(out);
  res.failure = fp8 ? check_fp8_forward(x.data(), w.data(), out.data(), n, H, s.top_k)
                    : check_forward(x.data(), w.data(), out.data(), n, H, s.top_k);
  if (bounded) {
    epx::moe_layer<timed_comm<C>, T, epx::impl::all_to_all> normal(m, comm, o);
    (void)normal.forward(epx::span<const T>(x), epx::span<const std::int32_t>(ids), epx::span<const float>(w),
                         epx::span<T>(ref), experts, epx::mode::inference);
    if (std::memcmp(out.data(), ref.data(), out.size() * sizeof(T)) != 0)
      res.failure += " bounded output differs bitwise from the normal mode's";
  }
  if (layer.stats().peer_access != direct) res.failure += " the layer did not take the requested route";
  if (!bounded && !direct && !layer.stats().indexed_sends)
    res.failure += " the staged sends were not as the floor counts them (by index)";
  for (int i = 0; i < 10; ++i) call(out);
  double share = 0;
  for (int i = 0; i < calls; ++i) {
    world.barrier();
    *waited = 0;
    const auto t0 = clock_type::now();
    call(out);
    const double mine = seconds_since(t0);
    world.barrier();
    const double total = seconds_since(t0);
    res.latency.push_back(total);
    share += mine > 0 ? *waited / total : 0;
  }
  res.wait_share = share / calls;
  if (bounded) res.overflow = layer.check().overflow_pairs;
  // The memcpy floor of the route's bytes.
  const std::size_t bytes = static_cast<std::size_t>(route_rows(s, bounded, direct, fp8, window) *
                                                     static_cast<double>(H) * sizeof(T) / 2.0);  // a memcpy of B reads B and writes B
  const std::size_t chunk = std::min<std::size_t>(bytes, std::size_t{16} << 20);  // copied again until done
  std::vector<unsigned char> a(chunk, 1), b(chunk);
  for (int i = 0; i < 20; ++i) {
    world.barrier();
    const auto t0 = clock_type::now();
    for (std::size_t done = 0; done < bytes; done += chunk) std::memcpy(b.data(), a.data(), std::min(chunk, bytes - done));
    benchmark::DoNotOptimize(b.data());
    world.barrier();
    res.floors.push_back(seconds_since(t0));
  }
  res.bytes = 2.0 * static_cast<double>(bytes);
  return res;
}

}  // namespace epx::bench::decode
