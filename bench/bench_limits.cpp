// The cost of capacity enforcement and node-limited routing next to the plain layout
// (spec sections 8 and 10), on one rank (one thread, exec::serial).
//
//   ./bench_limits --benchmark_out=limits.json --benchmark_out_format=json
//   ./bench_limits --benchmark_filter=capacity --benchmark_min_time=0.2
//
// capacity/...: every iteration builds the counting-sort send plan of n tokens x top-k
// twice: plain (layout::build_plan, the layout stage) and with the capacity the way the
// all-to-all path does on one rank of an EP group (layout::build_plan_counts, then
// detail::scatter_with_capacity from the counts of the count exchange, no communication
// here: the plan's scatter cuts the dropped pairs). Counters, medians over the iterations:
//   layout_us         the plain plan
//   with_capacity_us  the plan with the capacity
//   added_vs_layout   with_capacity_us / layout_us - 1 (target: <= 0.10 at 4096 tokens,
//                     top-8, 256 experts)
//   dropped           pairs dropped on this rank
// The last plan is checked once (kept counts against min(count, C) with the capacity C
// computed here, kept pairs at the front of their block, by position no dropped pair before
// a kept one, by score no dropped pair heavier than a kept one). A global capacity reads the counts
// of all `ep` ranks (the gathered matrix; the other
// ranks' counts are this rank's, shifted).
//
// routing/...: routing::route with softmax_topk over n tokens x E experts, without and with
// a node limit (nodes, M): routing_us, limited_us, added_vs_routing = limited / plain - 1,
// and added_vs_layout = (limited - plain) / the plain layout of the same pairs. Both
// routings are checked once: distinct experts on at most M nodes (limited), the k best
// logits of the nodes used, the weights the softmax of the chosen logits.
//
// nodes/...: the layer's nodes-per-token statistic, which the plan counts in its pass 1
// (layout::nodes_per_token): the plain plan against the plan that also counts the nodes,
// layout_us, with_nodes_us, added_vs_layout = with_nodes_us / layout_us - 1, and the
// mean nodes per token; the tally is checked once against a plain count.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "check_failed.hpp"
#include "epx/epx.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

enum routing_kind : int { balanced = 0, zipf = 1 };

// [n, k] distinct experts per token: uniform, or P(e) ~ 1 / (e + 1) (zipf).
std::vector<std::int32_t> make_ids(std::size_t n, int k, int E, routing_kind r, std::uint64_t seed) {
  std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
  std::vector<double> cdf(static_cast<std::size_t>(E));
  double s = 0;
  for (int e = 0; e < E; ++e) cdf[static_cast<std::size_t>(e)] = (s += r == balanced ? 1.0 : 1.0 / (e + 1.0));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(0.0, s);
  std::vector<char> used(static_cast<std::size_t>(E));
  for (std::size_t t = 0; t < n; ++t) {
    std::fill(used.begin(), used.end(), 0);
    for (int j = 0; j < k; ++j) {
      int e;
      do {
        e = std::min(E - 1, static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u(gen)) - cdf.begin()));
      } while (used[static_cast<std::size_t>(e)]);
      used[static_cast<std::size_t>(e)] = 1;
      ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)] = e;
    }
  }
  return ids;
}

std::vector<float> make_weights(std::size_t n, int k, std::uint64_t seed) {
  std::vector<float> w(n * static_cast<std::size_t>(k));
  std::mt19937 gen(static_cast<unsigned>(seed));
  std::uniform_real_distribution<float> u(0.01f, 1.0f);
  for (auto& v : w) v = u(gen);
  return w;
}

struct capacity_shape {
  std::size_t tokens;
  int k, E, ep;
  routing_kind routing;
  epx::capacity_mode mode;
  double factor;
  epx::drop_priority priority;
};

void bench_capacity(benchmark::State& state, capacity_shape s) {
  const epx::exec::serial ex;
  const auto ids = make_ids(s.tokens, s.k, s.E, s.routing, 17);
  const auto w = make_weights(s.tokens, s.k, 18);
  epx::capacity_policy cap;
  cap.mode = s.mode;
  cap.factor = s.factor;
  cap.priority = s.priority;
  // The gathered records of `ep` ranks: this rank (0) and the others with its counts
  // rotated, so that every expert sees several senders.
  const auto probe = epx::layout::build_plan(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1);
  epx::detail::group_records g;
  g.size = s.ep;
  g.stride = epx::detail::record_header + static_cast<std::size_t>(s.E);
  g.data.assign(g.stride * static_cast<std::size_t>(s.ep), 0);
  for (int r = 0; r < s.ep; ++r) {
    std::int64_t* rec = g.data.data() + static_cast<std::size_t>(r) * g.stride;
    rec[1] = static_cast<std::int64_t>(s.tokens);
    for (int e = 0; e < s.E; ++e) rec[epx::detail::record_header + e] = probe.host_counts[static_cast<std::size_t>((e + r) % s.E)];
  }
  std::vector<double> t_layout, t_cap;
  std::int64_t dropped = 0;
  for (auto _ : state) {
    // The plain layout stage, then the layout stage with the capacity, alternating.
    const auto t0 = clock_type::now();
    {
      auto plain = epx::layout::build_plan(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1);
      benchmark::DoNotOptimize(plain.pos.data());
    }
    const auto t1 = clock_type::now();
    auto plan = epx::layout::build_plan_counts(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1);
    epx::detail::call_limits lim;
    epx::detail::scatter_with_capacity(cap, ex, g, 0, 1, s.E, s.k, ids.data(), w.data(), plan, lim);
    benchmark::DoNotOptimize(plan.pos.data());
    const auto t2 = clock_type::now();
    t_layout.push_back(seconds_since(t0, t1));
    t_cap.push_back(seconds_since(t1, t2));
    state.SetIterationTime(seconds_since(t0, t2));
    dropped = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) dropped += plan.pos.data()[i] < 0 ? 1 : 0;
  }
  // Checked once, on the last plan: each expert keeps exactly its kept count, at the front
  // of its block, each kept position naming its pair's row; by score no dropped pair of an
  // expert outweighs a kept one.
  {
    auto plan = epx::layout::build_plan_counts(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1);
    epx::detail::call_limits lim;
    epx::detail::scatter_with_capacity(cap, ex, g, 0, 1, s.E, s.k, ids.data(), w.data(), plan, lim);
    const auto Es = static_cast<std::size_t>(s.E);
    std::vector<std::int64_t> kept(Es, 0);
    std::vector<float> least_kept(Es, 2.0f), most_dropped(Es, -1.0f);
    bool ok = true;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto e = static_cast<std::size_t>(ids[i]);
      const std::int64_t p = plan.pos.data()[i];
      const std::int64_t keep = lim.kept.empty() ? plan.host_counts[e] : lim.kept[e];
      if (p < 0) {
        most_dropped[e] = std::max(most_dropped[e], w[i]);
        continue;
      }
      ++kept[e];
      least_kept[e] = std::min(least_kept[e], w[i]);
      ok = ok && p >= plan.host_offset[e] && p < plan.host_offset[e] + keep &&
           plan.src_row.data()[p] == static_cast<std::int64_t>(i / static_cast<std::size_t>(s.k));
    }
    // The capacity computed here (capacity.hpp): C = ceil(factor * pairs / E), pairs this
    // rank's (local) or the group's (global); this rank is the first of the group, so it
    // keeps min(count, C) either way. By position the kept pairs precede the dropped ones.
    const double pairs = static_cast<double>(s.tokens) * s.k * (s.mode == epx::capacity_mode::global ? s.ep : 1);
    const auto C = static_cast<std::int64_t>(std::ceil(s.factor * pairs / static_cast<double>(s.E)));
    std::vector<std::size_t> last_kept(Es, 0), first_dropped(Es, ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto e = static_cast<std::size_t>(ids[i]);
      if (plan.pos.data()[i] < 0) first_dropped[e] = std::min(first_dropped[e], i);
      else last_kept[e] = i;
    }
    for (std::size_t e = 0; e < Es; ++e) {
      ok = ok && kept[e] == (lim.kept.empty() ? plan.host_counts[e] : std::min(lim.kept[e], plan.host_counts[e]));
      ok = ok && kept[e] == (s.mode == epx::capacity_mode::off ? plan.host_counts[e] : std::min(plan.host_counts[e], C));
      if (s.priority == epx::drop_priority::score) ok = ok && most_dropped[e] <= least_kept[e];
      else ok = ok && (kept[e] == 0 || first_dropped[e] > last_kept[e]);
    }
    if (!ok) epx::bench::fail_check(state, "the plan with the capacity does not keep what the capacity says");
  }
  const double tl = median(t_layout), tc = median(t_cap);
  state.counters["layout_us"] = tl * 1e6;
  state.counters["with_capacity_us"] = tc * 1e6;
  state.counters["added_vs_layout"] = tl > 0 ? tc / tl - 1.0 : 0.0;
  state.counters["dropped"] = static_cast<double>(dropped);
}

struct routing_shape {
  std::size_t tokens;
  int k, E, nodes, M;
};

void bench_routing(benchmark::State& state, routing_shape s) {
  const epx::exec::serial ex;
  std::vector<float> logits(s.tokens * static_cast<std::size_t>(s.E));
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& v : logits) v = nd(gen);
  std::vector<std::int32_t> ids(s.tokens * static_cast<std::size_t>(s.k));
  std::vector<float> w(ids.size());
  const epx::routing::softmax_topk plain{true};
  const epx::routing::softmax_topk limited{true, epx::routing::node_limit{s.nodes, s.M}};
  std::vector<double> t_plain, t_limited, t_layout;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    epx::routing::route(plain, ex, logits.data(), s.tokens, s.E, s.k, ids.data(), w.data());
    benchmark::DoNotOptimize(ids.data());
    const auto t1 = clock_type::now();
    auto plan = epx::layout::build_plan(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1);
    benchmark::DoNotOptimize(plan.pos.data());
    const auto t2 = clock_type::now();
    epx::routing::route(limited, ex, logits.data(), s.tokens, s.E, s.k, ids.data(), w.data());
    benchmark::DoNotOptimize(ids.data());
    const auto t3 = clock_type::now();
    t_plain.push_back(seconds_since(t0, t1));
    t_layout.push_back(seconds_since(t1, t2));
    t_limited.push_back(seconds_since(t2, t3));
    state.SetIterationTime(seconds_since(t0, t3));
  }
  // Checked once, both routings: a token's k experts are distinct, lie on at most M nodes
  // (limited), and are the k best logits among the experts of the nodes they lie on (plain:
  // all nodes; ties may go either way); the renormalised weights are the softmax of their
  // logits.
  {
    const std::size_t K = static_cast<std::size_t>(s.k), Es = static_cast<std::size_t>(s.E);
    const int per_node = s.E / s.nodes;
    std::string bad;
    for (const auto* r : {&plain, &limited}) {
      epx::routing::route(*r, ex, logits.data(), s.tokens, s.E, s.k, ids.data(), w.data());
      const bool lim = r == &limited;
      for (std::size_t t = 0; t < s.tokens && bad.empty(); ++t) {
        const float* l = logits.data() + t * Es;
        const std::int32_t* id = ids.data() + t * K;
        std::vector<char> chosen(Es, 0), node(static_cast<std::size_t>(s.nodes), 0);
        float least = INFINITY, top = -INFINITY;
        for (std::size_t j = 0; j < K; ++j) {
          if (id[j] < 0 || id[j] >= s.E || chosen[static_cast<std::size_t>(id[j])]) {
            bad = epx::detail::concat(lim ? "limited" : "plain", " routing: token ", t, " has a bad or repeated id");
            break;
          }
          chosen[static_cast<std::size_t>(id[j])] = 1;
          node[static_cast<std::size_t>(id[j] / per_node)] = 1;
          least = std::min(least, l[id[j]]);
          top = std::max(top, l[id[j]]);
        }
        if (!bad.empty()) break;
        int used = 0;
        for (char c : node) used += c;
        if (lim && used > s.M) bad = epx::detail::concat("limited routing: token ", t, " uses ", used, " nodes");
        for (std::size_t e = 0; e < Es && bad.empty(); ++e)
          if (!chosen[e] && node[e / static_cast<std::size_t>(per_node)] && l[e] > least)
            bad = epx::detail::concat(lim ? "limited" : "plain", " routing: token ", t, " passes over expert ", e);
        double z = 0;
        for (std::size_t j = 0; j < K; ++j) z += std::exp(static_cast<double>(l[id[j]]) - top);
        for (std::size_t j = 0; j < K && bad.empty(); ++j) {
          const double want = std::exp(static_cast<double>(l[id[j]]) - top) / z;
          if (!(std::abs(w[t * K + j] - want) <= 1e-5 + 1e-5 * want))
            bad = epx::detail::concat(lim ? "limited" : "plain", " routing: weight[", t, ", ", j, "] = ", w[t * K + j],
                                      ", expected ", want);
        }
      }
    }
    if (!bad.empty()) {
      epx::bench::fail_check(state, "output check failed: " + bad);
      return;
    }
  }
  const double tp = median(t_plain), tl = median(t_limited), tlay = median(t_layout);
  state.counters["routing_us"] = tp * 1e6;
  state.counters["limited_us"] = tl * 1e6;
  state.counters["layout_us"] = tlay * 1e6;
  state.counters["added_vs_routing"] = tp > 0 ? tl / tp - 1.0 : 0.0;
  state.counters["added_vs_layout"] = tlay > 0 ? (tl - tp) / tlay : 0.0;
}

void bench_nodes(benchmark::State& state, capacity_shape s) {
  const epx::exec::serial ex;
  const auto ids = make_ids(s.tokens, s.k, s.E, s.routing, 21);
  const auto w = make_weights(s.tokens, s.k, 22);
  // s.ep nodes of E / ep experts (one rank per node), as the layer asks the plan.
  const epx::layout::nodes_per_token nodes{s.E / s.ep};
  std::vector<double> t_layout, t_nodes;
  std::int64_t tally[3] = {0, 0, 0};
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    {
      auto plain = epx::layout::build_plan(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1);
      benchmark::DoNotOptimize(plain.pos.data());
    }
    const auto t1 = clock_type::now();
    auto plan = epx::layout::build_plan_counts(ex, ids.data(), w.data(), s.tokens, s.k, s.E, 1, nodes);
    epx::layout::launch_scatter(ex, plan, ids.data(), w.data());
    benchmark::DoNotOptimize(plan.pos.data());
    const auto t2 = clock_type::now();
    t_layout.push_back(seconds_since(t0, t1));
    t_nodes.push_back(seconds_since(t1, t2));
    state.SetIterationTime(seconds_since(t0, t2));
    std::copy(plan.node_tally.data(), plan.node_tally.data() + 3, tally);
  }
  // Checked once: the tally against a plain count of each token's nodes.
  std::int64_t sum = 0, most = 0;
  for (std::size_t t = 0; t < s.tokens; ++t) {
    std::uint64_t mask = 0;
    for (int j = 0; j < s.k; ++j) mask |= std::uint64_t{1} << (ids[t * static_cast<std::size_t>(s.k) + static_cast<std::size_t>(j)] / (s.E / s.ep));
    std::int64_t c = 0;
    for (; mask != 0; mask &= mask - 1) ++c;
    sum += c;
    most = std::max(most, c);
  }
  if (tally[0] != static_cast<std::int64_t>(s.tokens) || tally[1] != sum || tally[2] != most)
    epx::bench::fail_check(state, "the plan's node tally differs from the count of each token's nodes");
  const double tl = median(t_layout), tn = median(t_nodes);
  state.counters["layout_us"] = tl * 1e6;
  state.counters["with_nodes_us"] = tn * 1e6;
  state.counters["added_vs_layout"] = tl > 0 ? tn / tl - 1.0 : 0.0;
  state.counters["mean_nodes"] = static_cast<double>(sum) / static_cast<double>(s.tokens);
}

std::string capacity_name(const capacity_shape& s) {
  return epx::detail::concat("capacity/tokens:", s.tokens, "/k:", s.k, "/experts:", s.E, "/",
                             s.routing == balanced ? "balanced" : "zipf", "/", epx::to_string(s.mode), "/factor:",
                             s.factor, "/", epx::to_string(s.priority));
}

}  // namespace

int main(int argc, char** argv) {
#if defined(__GLIBC__)
  // Both layouts allocate their arrays afresh each iteration; keep them on the heap (no
  // mmap and page faults per array, no trimming), so that the medians compare the work.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
  const std::size_t n = 4096;
  const int k = 8, E = 256, ep = 8;
  for (auto r : {balanced, zipf})
    for (auto mode : {epx::capacity_mode::local, epx::capacity_mode::global})
      for (double f : {1.0, 1.25})
        for (auto prio : {epx::drop_priority::position, epx::drop_priority::score}) {
          const capacity_shape s{n, k, E, ep, r, mode, f, prio};
          benchmark::RegisterBenchmark(capacity_name(s).c_str(), bench_capacity, s)->UseManualTime()->Unit(benchmark::kMicrosecond);
        }
  for (int M : {1, 2, 4}) {
    const routing_shape s{n, k, E, 8, M};
    benchmark::RegisterBenchmark(epx::detail::concat("routing/tokens:", n, "/k:", k, "/experts:", E, "/nodes:8/max_nodes:", M).c_str(),
                                 bench_routing, s)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  {
    const capacity_shape s{n, k, E, ep, balanced, epx::capacity_mode::off, 0.0, epx::drop_priority::position};
    benchmark::RegisterBenchmark(epx::detail::concat("nodes/tokens:", n, "/k:", k, "/experts:", E, "/nodes:", ep).c_str(),
                                 bench_nodes, s)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
