// tests/core/layer_cases.hpp: the MoE layer test bodies, templated over the communicator.
//
// Each function runs on ONE rank (a thread of epx::threads::run, or an MPI process) and
// returns a text listing what failed on that rank (empty when everything matched), so the
// caller checks it on its own thread: the threads tests gather one string per rank, the
// MPI tests check their own. No doctest assertion is made inside a rank.
//
// Data: batch b (of B = dp_replicate * fsdp) is generated from (seed, b) on every rank, so
// the ranks of a TP group hold the same rows and every rank can compute the float64
// reference of every batch (for the expert gradients after the hook); the rank threads of
// one process compute it once and share it (shared_reference::reference_of_batches).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "support/reference.hpp"

// The execution policy of the layer cases: exec::serial, or the policy a suite that
// includes this header names first (tests/emulated runs every case on
// exec::emulated_device, the device path on the CPU).
#ifndef EPX_TEST_EXEC
#define EPX_TEST_EXEC ::epx::exec::serial
#endif

namespace epx::test {

using test_exec = EPX_TEST_EXEC;

// duplicates: random routing where tokens name one expert in several of their k slots
// (routers that sample with replacement, hash routing): every third token repeats its first
// expert in its last slot, every fifth (from token 1) puts all k slots on one expert, and
// every seventh (from token 2) repeats its second expert in its first slot (k >= 2). Each
// slot is a pair of its own: the expert sees the row once per slot.
enum class routing_kind { random, balanced, uneven, one_expert, first_rank_only, duplicates };

inline const char* to_string(routing_kind r) {
  switch (r) {
    case routing_kind::random: return "random";
    case routing_kind::balanced: return "balanced";
    case routing_kind::uneven: return "uneven";
    case routing_kind::one_expert: return "one_expert";
    case routing_kind::first_rank_only: return "first_rank_only";
    case routing_kind::duplicates: return "duplicates";
  }
  return "?";
}

struct layer_case {
  mesh_config topology;                 // tp, fsdp, ep, dp_replicate, experts
  int top_k = 2;
  int hidden = 8;
  routing_kind routing = routing_kind::random;
  std::function<std::size_t(int)> rows;  // rows of batch b; default 12
  padding pad = {};
  std::uint64_t seed = 1;
  std::size_t chunks = 0;
  bool peer_access = true;  // layer_options::peer_access (false: the staged route everywhere)
  bool indexed_sends = true;  // layer_options::indexed_sends (false: staged sends gather first)
  capacity_policy capacity = {};  // layer_options::capacity (spec section 8)
  int ranks_per_node = 0;         // layer_options::ranks_per_node (node statistics)
  row_sends sends = row_sends::per_slot;  // layer_options::sends (spec section 14)
  std::size_t stage_bytes = 0;            // layer_options::stage_bytes (staged rounds)

  std::size_t rows_of(int b) const { return rows ? rows(b) : 12; }
  std::string describe() const {
    return detail::concat("tp=", topology.tp, " fsdp=", topology.fsdp, " ep=", topology.ep, " dp_replicate=",
                          topology.dp_replicate, " E=", topology.experts, " k=", top_k, " H=", hidden,
                          " routing=", to_string(routing), " pad=", pad.rows_per_expert, "/", pad.align,
                          peer_access ? "" : " staged", indexed_sends ? "" : " gathered",
                          capacity.enabled() ? detail::concat(" capacity=", to_string(capacity.mode), "/",
                                                              capacity.rows > 0 ? capacity.rows : 0, "/",
                                                              capacity.factor, "/", to_string(capacity.priority))
                                             : std::string(),
                          ranks_per_node ? detail::concat(" ranks_per_node=", ranks_per_node) : std::string(),
                          sends == row_sends::per_rank ? " per_rank" : "",
                          stage_bytes ? detail::concat(" stage_bytes=", stage_bytes) : std::string());
  }
};

// The inputs of one batch, in float64 (rounded through T where the layer sees T).
struct batch_data {
  std::vector<double> x;         // [N, H], rounded through T
  std::vector<std::int32_t> ids; // [N, k]
  std::vector<double> w;         // [N, k], rounded through float
  std::vector<double> grad_out;  // [N, H], rounded through T
};

template <class T>
batch_data make_batch(const layer_case& c, int b) {
  const std::size_t N = c.rows_of(b);
  const int E = c.topology.experts, k = c.top_k, H = c.hidden;
  const std::uint64_t s = c.seed * 1000003ull + static_cast<std::uint64_t>(b) * 7919ull;
  batch_data d;
  d.x = ref::round_through<T>(ref::random_x(N, H, s));
  d.grad_out = ref::round_through<T>(ref::random_normal(N, static_cast<std::size_t>(H), s ^ 0x96ull));
  d.w = ref::round_through<float>(ref::random_weights(N, k, s));
  switch (c.routing) {
    case routing_kind::random: d.ids = ref::random_routing(N, E, k, s); break;
    case routing_kind::balanced:
      d.ids = (N * static_cast<std::size_t>(k)) % static_cast<std::size_t>(E) == 0 ? ref::balanced_routing(N, E, k, s)
                                                                                    : ref::random_routing(N, E, k, s);
      break;
    case routing_kind::uneven: d.ids = ref::uneven_routing(N, E, k, s); break;
    case routing_kind::one_expert: d.ids = ref::one_expert_routing(N, E, k, static_cast<int>(s % static_cast<std::uint64_t>(E))); break;
    case routing_kind::first_rank_only: {
      auto allowed = ref::experts_of_ranks(E, c.topology.ep, {0});
      while (static_cast<int>(allowed.size()) < k) allowed.push_back(static_cast<int>(allowed.size()));
      d.ids = ref::subset_routing(N, k, allowed, s);
      break;
    }
    case routing_kind::duplicates: {
      d.ids = ref::random_routing(N, E, k, s);
      const auto kk = static_cast<std::size_t>(k);
      for (std::size_t t = 0; t < N && k >= 2; ++t) {
        std::int32_t* row = &d.ids[t * kk];
        if (t % 5 == 1) std::fill(row, row + kk, row[kk / 2]);
        else if (t % 3 == 0) row[kk - 1] = row[0];
        else if (t % 7 == 2) row[0] = row[1];
      }
      break;
    }
  }
  return d;
}

// The layer options of a case.
inline layer_options options_for(const layer_case& c) {
  layer_options o;
  o.hidden = static_cast<std::size_t>(c.hidden);
  o.top_k = c.top_k;
  o.pad = c.pad;
  o.chunks = c.chunks;
  o.peer_access = c.peer_access;
  o.indexed_sends = c.indexed_sends;
  o.capacity = c.capacity;
  o.ranks_per_node = c.ranks_per_node;
  o.sends = c.sends;
  o.stage_bytes = c.stage_bytes;
  return o;
}

// The pairs a capacity keeps (spec section 8), per batch [B][N_b * k]: every EP group of the
// first pipeline stage, its members in ep-rank order, each sending its TP slice of its batch.
// The groups, batches and slices come from the contract's formulas (sections 1 and 3), not
// from the library's mesh, so that a fault there cannot move the reference with it.
template <class T>
std::vector<std::vector<char>> keep_masks(const layer_case& c) {
  const mesh m(c.topology);
  const int k = c.top_k, tp = c.topology.tp, fsdp = c.topology.fsdp, ep = c.topology.ep;
  const int S = fsdp * tp, R = c.topology.dp_replicate;
  std::vector<std::vector<char>> keep(static_cast<std::size_t>(m.batches()));
  for (int b = 0; b < m.batches(); ++b) keep[static_cast<std::size_t>(b)].assign(c.rows_of(b) * k, 1);
  ref::capacity_params p;
  p.mode = static_cast<int>(c.capacity.mode);
  p.factor = c.capacity.factor;
  p.rows = c.capacity.rows;
  p.by_score = c.capacity.priority == drop_priority::score;
  // Pipeline stage 0: R blocks of S ranks, each made of EP groups of ep consecutive ranks.
  for (int first = 0; first < R * S; first += ep) {
    std::vector<std::vector<std::int32_t>> ids;
    std::vector<std::vector<double>> w;
    std::vector<std::pair<int, row_slice>> where;
    for (int r = first; r < first + ep; ++r) {
      const int rep = r / S, fsdp_i = (r % S) / tp, tp_i = r % tp;
      const int b = rep * fsdp + fsdp_i;  // a batch per (replica, fsdp position)
      if (b != m.batch(r))
        throw std::runtime_error(
            detail::concat("keep_masks: the mesh puts rank ", r, " on batch ", m.batch(r), ", the contract on batch ", b));
      const batch_data d = make_batch<T>(c, b);
      const std::size_t N = c.rows_of(b);
      const row_slice sl{N * static_cast<std::size_t>(tp_i) / static_cast<std::size_t>(tp),
                         N * static_cast<std::size_t>(tp_i + 1) / static_cast<std::size_t>(tp)};
      ids.emplace_back(d.ids.begin() + static_cast<std::ptrdiff_t>(sl.begin * k),
                       d.ids.begin() + static_cast<std::ptrdiff_t>(sl.end * k));
      w.emplace_back(d.w.begin() + static_cast<std::ptrdiff_t>(sl.begin * k),
                     d.w.begin() + static_cast<std::ptrdiff_t>(sl.end * k));
      where.emplace_back(b, sl);
    }
    const auto kept = ref::capacity_keep(ids, w, c.topology.experts, k, p);
    for (std::size_t s = 0; s < kept.size(); ++s)
      std::copy(kept[s].begin(), kept[s].end(),
                keep[static_cast<std::size_t>(where[s].first)].begin() + static_cast<std::ptrdiff_t>(where[s].second.begin * k));
  }
  return keep;
}

// What one rank of a case computes on: its batch, rounded through T, and the global experts.
template <class T>
struct rank_inputs {
  mesh m;
  ref::linear_experts global;
  int rank, b;
  batch_data d;
  std::size_t N, H;
  std::vector<T> x;
  std::vector<float> w;

  rank_inputs(const layer_case& c, int world_rank)
      : m(c.topology),
        global(ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull)),
        rank(world_rank),
        b(m.batch(world_rank)),
        d(make_batch<T>(c, b)),
        N(c.rows_of(b)),
        H(static_cast<std::size_t>(c.hidden)),
        x(ref::from_double<T>(d.x)),
        w(d.w.begin(), d.w.end()) {}
};

template <class T>
double atol_for() {
  if constexpr (std::is_same_v<T, double>) return 1e-10;
  else if constexpr (std::is_same_v<T, float>) return 2e-4;
  else if constexpr (std::is_same_v<T, fp16>) return 2e-2;
  else return 8e-2;
}
template <class T>
double rtol_for() {
  if constexpr (std::is_same_v<T, double>) return 1e-10;
  else if constexpr (std::is_same_v<T, float>) return 2e-4;
  else if constexpr (std::is_same_v<T, fp16>) return 1e-2;
  else return 4e-2;
}

// What one layer run produced on a rank.
template <class T>
struct layer_outputs {
  std::vector<T> out, grad_x;
  std::vector<float> grad_w;
  std::vector<double> expert_grads;  // [L, P] after the hook
  layer_stats stats;
  std::int64_t backward_stage_rounds = 0;  // layer_stats::stage_rounds after backward
};

// Runs forward (train), backward and the expert hook on this rank's batch.
template <class Comm, class T, class Impl, class Exec = test_exec>
layer_outputs<T> run_layer(Comm& world, const layer_case& c, const ref::linear_experts& global, Exec policy = {}) {
  const mesh m(c.topology);
  const int rank = world.rank(), b = m.batch(rank);
  const batch_data d = make_batch<T>(c, b);
  const std::size_t N = c.rows_of(b), H = static_cast<std::size_t>(c.hidden);
  moe_layer<Comm, T, Impl, Exec> layer(m, world, options_for(c), policy);
  ref::test_linear_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
  const auto x = ref::from_double<T>(d.x);
  const auto go = ref::from_double<T>(d.grad_out);
  std::vector<float> w(d.w.begin(), d.w.end());
  layer_outputs<T> r;
  r.out.assign(N * H, convert<T>(7.0f));  // garbage: the layer must write everything
  r.grad_x.assign(N * H, convert<T>(7.0f));
  r.grad_w.assign(N * static_cast<std::size_t>(c.top_k), 7.0f);
  auto saved = layer.forward(span<const T>(x), span<const std::int32_t>(d.ids), span<const float>(w), span<T>(r.out),
                             experts, mode::train);
  r.stats = layer.stats();
  layer.backward(std::move(saved), span<const T>(go), span<T>(r.grad_x), span<float>(r.grad_w), experts);
  r.backward_stage_rounds = layer.stats().stage_rounds;
  gradient_hooks<Comm> hooks(m, world);
  r.expert_grads = experts.grads();
  hooks.reduce_expert(span<double>(r.expert_grads));
  return r;
}

inline void append(std::string& f, const ref::comparison& c) {
  if (!c.ok) f += c.message + "\n";
}

// The float64 oracle for this rank: out, grad_x, grad_w of its batch; expert gradients of
// its local experts after the hook; tokens per local expert over its EP group.
struct rank_expectation {
  std::vector<double> out, grad_x, grad_w, expert_grads;
  std::vector<std::int64_t> tokens_per_local_expert;
  std::vector<std::int64_t> dropped_per_expert;  // [E] over the EP group (capacity only)
  std::int64_t max_nodes = 0;                    // nodes per token over the EP group (ranks_per_node only)
  double mean_nodes = 0;
  std::vector<std::int64_t> rows_sent;           // [ep] rows this rank sends each ep peer (all_to_all)
};

namespace shared_reference {

template <class V>
bool same_bytes(const std::vector<V>& a, const std::vector<V>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0);
}

// The float64 reference of every batch of a case: each batch's output and gradients, and the
// expert gradients after the hook (summed over the batches). Every rank of a case needs all
// batches for the last, so the rank threads of one process would each compute the same (a
// world of 8 ranks, 8 times); they share one computation instead. The last few are kept
// with their inputs, and a caller gets one only when its inputs are the same bit for bit
// (every batch's rows, ids, weights and gradients, the keep masks, the experts'
// parameters): a case that differs in anything the reference reads computes its own.
struct batch_references {
  std::vector<batch_data> batches;
  std::vector<std::vector<char>> keep;
  int experts = 0, hidden = 0;
  std::vector<double> params;
  std::vector<std::vector<double>> out;  // [B][N*H]
  std::vector<ref::moe_grads> grads;     // [B]
  std::vector<double> expert_grads;      // [E, P] after the hook

  bool same_inputs(const batch_references& o) const {
    if (experts != o.experts || hidden != o.hidden || batches.size() != o.batches.size() || keep.size() != o.keep.size() ||
        !same_bytes(params, o.params))
      return false;
    for (std::size_t b = 0; b < batches.size(); ++b) {
      const batch_data &x = batches[b], &y = o.batches[b];
      if (!same_bytes(x.x, y.x) || !same_bytes(x.ids, y.ids) || !same_bytes(x.w, y.w) ||
          !same_bytes(x.grad_out, y.grad_out) || !same_bytes(keep[b], o.keep[b]))
        return false;
    }
    return true;
  }
};

template <class T>
std::shared_ptr<const batch_references> reference_of_batches(const layer_case& c, const ref::linear_experts& global) {
  auto r = std::make_shared<batch_references>();
  const mesh m(c.topology);
  r->keep = keep_masks<T>(c);
  for (int bb = 0; bb < m.batches(); ++bb) r->batches.push_back(make_batch<T>(c, bb));
  r->experts = global.E;
  r->hidden = global.H;
  r->params = global.params;
  static std::mutex mu;
  static std::vector<std::shared_ptr<const batch_references>> kept;  // the most recent last
  const std::lock_guard<std::mutex> lock(mu);
  for (const auto& k : kept)
    if (k->same_inputs(*r)) return k;
  std::vector<std::vector<double>> per_batch;
  for (std::size_t bb = 0; bb < r->batches.size(); ++bb) {
    const batch_data& d = r->batches[bb];
    r->grads.push_back(ref::moe_backward(d.x, d.ids, d.w, d.grad_out, global, r->keep[bb]));
    r->out.push_back(ref::moe_forward(d.x, d.ids, d.w, global, r->keep[bb]));
    per_batch.push_back(r->grads.back().grad_params);
  }
  r->expert_grads = ref::expected_expert_grads_after_hook(per_batch);
  kept.push_back(r);
  if (kept.size() > 2) kept.erase(kept.begin());
  return r;
}

}  // namespace shared_reference

template <class T>
rank_expectation expect(const layer_case& c, const ref::linear_experts& global, int rank) {
  const mesh m(c.topology);
  rank_expectation e;
  const int b = m.batch(rank);
  const auto all = shared_reference::reference_of_batches<T>(c, global);
  const auto& keep = all->keep;
  e.out = all->out[static_cast<std::size_t>(b)];
  e.grad_x = all->grads[static_cast<std::size_t>(b)].grad_x;
  e.grad_w = all->grads[static_cast<std::size_t>(b)].grad_w;
  const int L = m.local_experts(), first = m.expert_begin(rank);
  e.expert_grads = ref::expert_slice(all->expert_grads, global.params_per_expert(), first, L);
  // Batches of the EP group: one per TP group inside it.
  std::set<int> group_batches;
  for (int member : m.group_members(group_kind::ep, rank)) group_batches.insert(m.batch(member));
  e.tokens_per_local_expert.assign(static_cast<std::size_t>(L), 0);
  e.dropped_per_expert.assign(static_cast<std::size_t>(c.topology.experts), 0);
  std::int64_t tokens = 0, nodes_sum = 0;
  for (int bb : group_batches) {
    const batch_data& d = all->batches[static_cast<std::size_t>(bb)];
    const auto& kb = keep[static_cast<std::size_t>(bb)];
    for (std::size_t i = 0; i < d.ids.size(); ++i) {
      const auto id = d.ids[i];
      if (!kb[i]) ++e.dropped_per_expert[static_cast<std::size_t>(id)];
      else if (id >= first && id < first + L) ++e.tokens_per_local_expert[static_cast<std::size_t>(id - first)];
    }
    if (c.ranks_per_node > 0) {
      const int per_node = L * c.ranks_per_node, k = c.top_k;
      for (std::size_t t = 0; t < c.rows_of(bb); ++t) {
        std::set<int> nodes;
        for (int j = 0; j < k; ++j) nodes.insert(d.ids[t * k + j] / per_node);
        ++tokens;
        nodes_sum += static_cast<std::int64_t>(nodes.size());
        e.max_nodes = std::max(e.max_nodes, static_cast<std::int64_t>(nodes.size()));
      }
    }
  }
  e.mean_nodes = tokens ? static_cast<double>(nodes_sum) / static_cast<double>(tokens) : 0.0;
  // Rows this rank sends: its TP slice's kept pairs, or (per-rank sends) its tokens' distinct
  // owners among their kept pairs.
  {
    const batch_data& d = all->batches[static_cast<std::size_t>(b)];
    const auto& kb = keep[static_cast<std::size_t>(b)];
    const auto k = static_cast<std::size_t>(c.top_k);
    const row_slice sl = slice_bounds(c.rows_of(b), m.tp(), m.coords(rank).tp);
    e.rows_sent.assign(static_cast<std::size_t>(m.ep()), 0);
    for (std::size_t t = sl.begin; t < sl.end; ++t) {
      std::set<int> owners;
      for (std::size_t j = 0; j < k; ++j) {
        if (!kb[t * k + j]) continue;
        const int owner = d.ids[t * k + j] / L;
        if (c.sends == row_sends::per_slot || owners.insert(owner).second) ++e.rows_sent[static_cast<std::size_t>(owner)];
      }
    }
  }
  return e;
}

// Forward/backward/hook against the float64 reference. Returns failures ("" when fine).
template <class Comm, class T, class Impl = impl::all_to_all>
std::string check_layer_case(Comm& world, const layer_case& c) {
  std::string f;
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    const auto r = run_layer<Comm, T, Impl>(world, c, global);
    const auto e = expect<T>(c, global, world.rank());
    const double at = atol_for<T>(), rt = rtol_for<T>();
    const std::string where = detail::concat(c.describe(), " rank ", world.rank());
    append(f, ref::compare(r.out, e.out, at, rt, where + " out"));
    append(f, ref::compare(r.grad_x, e.grad_x, at, rt, where + " grad_x"));
    // grad_weights are float32 whatever T is.
    append(f, ref::compare(r.grad_w, e.grad_w, std::max(2 * at, 1e-5), std::max(rt, 1e-5), where + " grad_weights"));
    append(f, ref::compare(r.expert_grads, e.expert_grads, 2 * at, rt, where + " expert grads after hook"));
    if (std::string(r.stats.path) != "all_reduce") {
      std::vector<double> got(r.stats.tokens_per_local_expert.begin(), r.stats.tokens_per_local_expert.end());
      std::vector<double> want(e.tokens_per_local_expert.begin(), e.tokens_per_local_expert.end());
      append(f, ref::compare(got, want, 0, 0, where + " stats.tokens_per_local_expert"));
    }
    if (c.capacity.enabled()) {
      std::vector<double> got(r.stats.dropped_per_expert.begin(), r.stats.dropped_per_expert.end());
      std::vector<double> want(e.dropped_per_expert.begin(), e.dropped_per_expert.end());
      append(f, ref::compare(got, want, 0, 0, where + " stats.dropped_per_expert"));
    } else if (!r.stats.dropped_per_expert.empty() || r.stats.dropped_pairs != 0) {
      f += where + ": dropped pairs reported without a capacity\n";
    }
    if (std::string(r.stats.path) == "all_to_all" && r.stats.rows_sent != e.rows_sent)
      f += detail::concat(where, ": stats.rows_sent differs from the rows the routing sends (",
                          c.sends == row_sends::per_rank ? "per rank" : "per slot", ")\n");
    if (c.ranks_per_node > 0 &&
        (r.stats.max_nodes_per_token != e.max_nodes || std::abs(r.stats.mean_nodes_per_token - e.mean_nodes) > 1e-12))
      f += detail::concat(where, ": nodes per token max ", r.stats.max_nodes_per_token, " mean ",
                          r.stats.mean_nodes_per_token, ", expected ", e.max_nodes, " and ", e.mean_nodes, "\n");
    const bool direct = std::string(r.stats.path) == "all_to_all" && c.peer_access &&
                        c.sends == row_sends::per_slot && has_peer_access_v<Comm>;
    if (r.stats.peer_access != direct)
      f += detail::concat(where, ": stats.peer_access is ", r.stats.peer_access, ", expected ", direct, "\n");
    const bool by_index = std::string(r.stats.path) == "all_to_all" && !direct && c.indexed_sends &&
                          has_indexed_sends_v<Comm> && exec::is_host_policy_v<test_exec>;
    if (r.stats.indexed_sends != by_index)
      f += detail::concat(where, ": stats.indexed_sends is ", r.stats.indexed_sends, ", expected ", by_index, "\n");
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

// An inference call: output against the reference, an empty saved state, and the path
// the implementation took (`want_path`).
template <class Comm, class T, class Impl>
std::string check_inference(Comm& world, const layer_case& c, const std::string& want_path) {
  std::string f;
  try {
    const rank_inputs<T> in(c, world.rank());
    const int rank = in.rank;
    const batch_data& d = in.d;
    moe_layer<Comm, T, Impl, test_exec> layer(in.m, world, options_for(c));
    ref::test_linear_experts<T> experts(in.global, in.m.ep_rank(rank), in.m.local_experts());
    const auto& x = in.x;
    const auto& w = in.w;
    const auto& global = in.global;
    std::vector<T> out(in.N * in.H, convert<T>(7.0f));
    auto saved = layer.forward(span<const T>(x), span<const std::int32_t>(d.ids), span<const float>(w), span<T>(out),
                               experts, mode::inference);
    const std::string where = detail::concat(c.describe(), " rank ", rank, " inference");
    if (!saved.empty()) f += where + ": saved state not empty\n";
    if (std::string(layer.stats().path) != want_path)
      f += where + ": path " + layer.stats().path + ", expected " + want_path + "\n";
    const auto keep = keep_masks<T>(c)[static_cast<std::size_t>(in.b)];
    append(f, ref::compare(out, ref::moe_forward(d.x, d.ids, d.w, global, keep), atol_for<T>(), rtol_for<T>(),
                           where + " out"));
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Two runs (and a run with another chunk count / execution policy) give bitwise equal
// outputs and gradients.
template <class Comm, class T, class Impl = impl::all_to_all, class Exec2 = exec::serial>
std::string check_determinism(Comm& world, const layer_case& c, Exec2 other = {}) {
  std::string f;
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    const auto a = run_layer<Comm, T, Impl>(world, c, global);
    const auto b = run_layer<Comm, T, Impl>(world, c, global);
    layer_case c3 = c;
    c3.chunks = 3;
    const auto d = run_layer<Comm, T, Impl, Exec2>(world, c3, global, other);
    for (const auto* o : {&b, &d}) {
      if (!bitwise_equal(a.out, o->out)) f += c.describe() + ": out differs bitwise between runs\n";
      if (!bitwise_equal(a.grad_x, o->grad_x)) f += c.describe() + ": grad_x differs bitwise between runs\n";
      if (!bitwise_equal(a.grad_w, o->grad_w)) f += c.describe() + ": grad_weights differ bitwise between runs\n";
      if (!bitwise_equal(a.expert_grads, o->expert_grads))
        f += c.describe() + ": expert grads differ bitwise between runs\n";
    }
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

// The masked all-reduce path against the all-to-all path (ep == tp): both close to each
// other (and each to the reference, checked by check_layer_case).
template <class Comm, class T>
std::string check_paths_agree(Comm& world, const layer_case& c) {
  std::string f;
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    const auto a = run_layer<Comm, T, impl::all_to_all>(world, c, global);
    const auto r = run_layer<Comm, T, impl::all_reduce>(world, c, global);
    if (std::string(r.stats.path) != "all_reduce") f += "all_reduce layer reported path " + std::string(r.stats.path) + "\n";
    const double at = atol_for<T>(), rt = rtol_for<T>();
    const std::string where = detail::concat(c.describe(), " rank ", world.rank(), " all_reduce vs all_to_all");
    append(f, ref::compare(r.out, ref::to_double(a.out), at, rt, where + " out"));
    append(f, ref::compare(r.grad_x, ref::to_double(a.grad_x), at, rt, where + " grad_x"));
    append(f, ref::compare(r.grad_w, ref::to_double(a.grad_w), 2 * at, rt, where + " grad_weights"));
    append(f, ref::compare(r.expert_grads, a.expert_grads, 2 * at, rt, where + " expert grads"));
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

// ---------------------------------------------------------------------------------------
// Bad input: every rank of the group must raise epx::error, none may hang.
// ---------------------------------------------------------------------------------------

enum class bad_input {
  id_too_large, id_negative, weight_nan, weight_inf, x_size, ids_size, weights_size, out_size,
  rows_differ_in_tp_group, hidden_differs, top_k_differs, grad_x_size, grad_weights_size,
  empty_state,   // backward of an empty saved state
  mode_differs   // an inference forward where the others train
};

inline const char* to_string(bad_input b) {
  switch (b) {
    case bad_input::id_too_large: return "id_too_large";
    case bad_input::id_negative: return "id_negative";
    case bad_input::weight_nan: return "weight_nan";
    case bad_input::weight_inf: return "weight_inf";
    case bad_input::x_size: return "x_size";
    case bad_input::ids_size: return "ids_size";
    case bad_input::weights_size: return "weights_size";
    case bad_input::out_size: return "out_size";
    case bad_input::rows_differ_in_tp_group: return "rows_differ_in_tp_group";
    case bad_input::hidden_differs: return "hidden_differs";
    case bad_input::top_k_differs: return "top_k_differs";
    case bad_input::grad_x_size: return "grad_x_size";
    case bad_input::grad_weights_size: return "grad_weights_size";
    case bad_input::empty_state: return "empty_state";
    case bad_input::mode_differs: return "mode_differs";
  }
  return "?";
}

// What a rank saw: the error it raised (category, message) or none.
struct raised {
  bool thrown = false;
  errc category = errc::internal;
  std::string message;
  std::string moved;  // run_bad_input: what the failed call did before it raised ("" when nothing)
};

// Runs f and returns what it raised (an epx::error), or nothing.
template <class F>
raised capture(F&& f) {
  raised r;
  try {
    f();
  } catch (const error& e) {
    r.thrown = true;
    r.category = e.category();
    r.message = e.what();
  }
  return r;
}

// Rank `bad_rank` (world rank) feeds bad input of kind `kind`; returns what this rank raised.
template <class Comm, class T, class Impl = impl::all_to_all>
raised run_bad_input(Comm& world, const layer_case& c, bad_input kind, int bad_rank) {
  const mesh m(c.topology);
  const int rank = world.rank();
  const bool me = rank == bad_rank;
  const int b = m.batch(rank);
  const batch_data d = make_batch<T>(c, b);
  std::size_t N = c.rows_of(b);
  std::size_t H = static_cast<std::size_t>(c.hidden);
  int k = c.top_k;
  layer_options o;
  o.hidden = me && kind == bad_input::hidden_differs ? H + 1 : H;
  o.top_k = me && kind == bad_input::top_k_differs ? (k > 1 ? k - 1 : k + 1) : k;
  o.pad = c.pad;
  const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
  ref::test_linear_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
  std::vector<T> x = ref::from_double<T>(d.x);
  std::vector<std::int32_t> ids = d.ids;
  std::vector<float> w(d.w.begin(), d.w.end());
  std::vector<T> out(N * H);
  std::vector<T> go = ref::from_double<T>(d.grad_out);
  std::vector<T> gx(N * H);
  std::vector<float> gw(N * static_cast<std::size_t>(k));
  if (me) {
    // Inside this rank's own TP slice: ids and weights are checked where they are read.
    const auto sl = slice_bounds(N, m.tp(), m.coords(rank).tp);
    const std::size_t at = (sl.begin + sl.size() / 2) * static_cast<std::size_t>(k) + (sl.empty() ? 0 : 1) % k;
    switch (kind) {
      case bad_input::id_too_large: if (!ids.empty()) ids[at] = c.topology.experts; break;
      case bad_input::id_negative: if (!ids.empty()) ids[at] = -1; break;
      case bad_input::weight_nan: if (!w.empty()) w[at] = std::nanf(""); break;
      case bad_input::weight_inf: if (!w.empty()) w[at] = -INFINITY; break;
      case bad_input::x_size: x.resize(x.size() + 1); break;
      case bad_input::ids_size: ids.push_back(0); break;
      case bad_input::weights_size: w.pop_back(); break;
      case bad_input::out_size: out.resize(out.size() + H); break;
      case bad_input::rows_differ_in_tp_group:
        x.resize(x.size() + H);
        out.resize(out.size() + H);
        for (int j = 0; j < k; ++j) {
          ids.push_back(j);
          w.push_back(0.5f);
        }
        break;
      case bad_input::hidden_differs: {
        // Consistent shapes for H+1 on this rank only.
        x.assign(N * (H + 1), convert<T>(0.5f));
        out.assign(N * (H + 1), convert<T>(0.0f));
        break;
      }
      case bad_input::top_k_differs: {
        const std::size_t k2 = static_cast<std::size_t>(o.top_k);
        ids.assign(N * k2, 0);
        w.assign(N * k2, 0.5f);
        break;
      }
      case bad_input::grad_x_size: gx.pop_back(); break;
      case bad_input::grad_weights_size: gw.push_back(0.0f); break;
      case bad_input::empty_state: break;   // below
      case bad_input::mode_differs: break;  // below
    }
  }
  // The outputs hold 7 until the layer writes them: a call that raises must not have
  // written them, nor run the experts (the error comes before any row moves).
  const T seven = convert<T>(7.0f);
  std::fill(out.begin(), out.end(), seven);
  std::fill(gx.begin(), gx.end(), seven);
  std::fill(gw.begin(), gw.end(), 7.0f);
  const auto untouched = [](const auto& v, auto s) {
    return std::all_of(v.begin(), v.end(), [s](auto e) { return std::memcmp(&e, &s, sizeof e) == 0; });
  };
  bool in_backward = false;
  try {
    moe_layer<Comm, T, Impl, test_exec> layer(m, world, o);
    const mode md = me && kind == bad_input::mode_differs ? mode::inference : mode::train;
    auto saved = layer.forward(span<const T>(x), span<const std::int32_t>(ids), span<const float>(w), span<T>(out),
                               experts, md);
    if (md == mode::inference) return raised{};
    if (me && kind == bad_input::empty_state) saved.reset();
    in_backward = true;
    layer.backward(std::move(saved), span<const T>(go), span<T>(gx), span<float>(gw), experts);
  } catch (const error& e) {
    raised r;
    r.thrown = true;
    r.category = e.category();
    r.message = e.what();
    if (!in_backward && experts.forward_calls() != 0) r.moved += "the experts' forward ran; ";
    if (!in_backward && !untouched(out, seven)) r.moved += "out was written; ";
    if (in_backward && experts.backward_calls() != 0) r.moved += "the experts' backward ran; ";
    if (in_backward && !untouched(gx, seven)) r.moved += "grad_x was written; ";
    if (in_backward && !untouched(gw, 7.0f)) r.moved += "grad_weights was written; ";
    return r;
  }
  return raised{};
}

}  // namespace epx::test

namespace epx::test {

// What differs bitwise between two runs' outputs and gradients ("" when nothing).
template <class T>
std::string bitwise_differences(const layer_outputs<T>& a, const layer_outputs<T>& b, const std::string& where) {
  std::string f;
  if (!bitwise_equal(a.out, b.out)) f += where + "out differs bitwise\n";
  if (!bitwise_equal(a.grad_x, b.grad_x)) f += where + "grad_x differs bitwise\n";
  if (!bitwise_equal(a.grad_w, b.grad_w)) f += where + "grad_weights differ bitwise\n";
  if (!bitwise_equal(a.expert_grads, b.expert_grads)) f += where + "expert grads differ bitwise\n";
  return f;
}

// The staged route and the direct one (peer access) give bitwise the same outputs and
// gradients (on communicators without peer access both runs take the staged route), and
// so does the staged route whose sends gather their rows first (indexed_sends = false).
template <class Comm, class T>
std::string check_routes_agree(Comm& world, const layer_case& c) {
  std::string f;
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    layer_case direct = c, staged = c, gathered = c;
    direct.peer_access = true;
    staged.peer_access = gathered.peer_access = false;
    staged.indexed_sends = true;
    gathered.indexed_sends = false;
    const auto a = run_layer<Comm, T, impl::all_to_all>(world, direct, global);
    const auto b = run_layer<Comm, T, impl::all_to_all>(world, staged, global);
    const auto g = run_layer<Comm, T, impl::all_to_all>(world, gathered, global);
    const std::string where = detail::concat(c.describe(), " rank ", world.rank(), " direct vs staged: ");
    f += bitwise_differences(a, b, where);
    const std::string where_g = detail::concat(c.describe(), " rank ", world.rank(), " staged by index vs gathered: ");
    f += bitwise_differences(b, g, where_g);
    // Device policies (exec::emulated_device here) take the direct route too (their row
    // tables made by the policy), and on the staged route gather before they send.
    const bool host = exec::is_host_policy_v<test_exec>;
    if (a.stats.peer_access != has_peer_access_v<Comm>)
      f += where + "the direct run did not take the expected route\n";
    if (b.stats.peer_access || g.stats.peer_access) f += where + "a staged run took the direct route\n";
    if (b.stats.indexed_sends != (has_indexed_sends_v<Comm> && host) || g.stats.indexed_sends)
      f += detail::concat(where_g, "stats.indexed_sends ", b.stats.indexed_sends, " and ", g.stats.indexed_sends,
                          ", expected ", has_indexed_sends_v<Comm> && host, " and 0\n");
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

// The rounds the staged route makes with stage_bytes `B` (epx/layout/rounds.hpp), worked
// out from the case: the EP group's largest TP slice over the rows a round holds (B = 0,
// automatic: 4 MiB rounds on host policies once one round would send over 64 MiB).
template <class T, class Exec = test_exec>
std::int64_t expected_stage_rounds(const layer_case& c, int rank, std::size_t B) {
  const mesh m(c.topology);
  std::size_t widest = 0;
  for (int member : m.group_members(group_kind::ep, rank))
    widest = std::max(widest, slice_bounds(c.rows_of(m.batch(member)), m.tp(), m.coords(member).tp).size());
  const std::size_t per_row = static_cast<std::size_t>(c.top_k) * static_cast<std::size_t>(c.hidden) * sizeof(T);
  if (B == 0) {
    if (!exec::is_host_policy_v<Exec> || widest * per_row <= default_host_one_round_bytes) return 0;
    B = default_host_stage_bytes;
  }
  const std::size_t rows = std::max<std::size_t>(1, B / per_row);
  const std::size_t rounds = widest == 0 ? 0 : 1 + (widest - 1) / rows;
  return rounds > 1 ? static_cast<std::int64_t>(rounds) : 0;
}

// The staged route in rounds (c.stage_bytes) against one round: training and inference
// give bitwise the same outputs and gradients, and the layer reports the rounds the case
// needs (an inference forward and every backward run in rounds; a training forward keeps
// its send buffer for backward and moves it at once).
template <class Comm, class T>
std::string check_rounds_agree(Comm& world, const layer_case& c) {
  std::string f;
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    layer_case once = c, rounds = c;
    once.peer_access = rounds.peer_access = false;
    once.stage_bytes = std::numeric_limits<std::size_t>::max();
    const std::string where = detail::concat(c.describe(), " rank ", world.rank(), " rounds vs one round: ");
    const std::int64_t want = expected_stage_rounds<T>(c, world.rank(), c.stage_bytes);
    const auto a = run_layer<Comm, T, impl::all_to_all>(world, once, global);
    const auto b = run_layer<Comm, T, impl::all_to_all>(world, rounds, global);
    f += bitwise_differences(a, b, where);
    if (a.backward_stage_rounds != 0 || b.stats.stage_rounds != 0 || b.backward_stage_rounds != want)
      f += detail::concat(where, "stage_rounds: one round's backward ", a.backward_stage_rounds, ", training forward ",
                          b.stats.stage_rounds, ", backward ", b.backward_stage_rounds, "; expected 0, 0, ", want, "\n");
    // Inference: rounds against one round, and against the training output.
    const rank_inputs<T> in(c, world.rank());
    ref::test_linear_experts<T> experts(in.global, in.m.ep_rank(in.rank), in.m.local_experts());
    std::vector<std::vector<T>> outs;
    for (const layer_case* k : {&once, &rounds}) {
      moe_layer<Comm, T, impl::all_to_all, test_exec> layer(in.m, world, options_for(*k));
      outs.emplace_back(in.N * in.H, convert<T>(7.0f));
      auto saved = layer.forward(span<const T>(in.x), span<const std::int32_t>(in.d.ids), span<const float>(in.w),
                                 span<T>(outs.back()), experts, mode::inference);
      const std::int64_t expect_rounds = k == &once ? 0 : want;
      if (layer.stats().stage_rounds != expect_rounds)
        f += detail::concat(where, "inference stage_rounds ", layer.stats().stage_rounds, ", expected ", expect_rounds,
                            "\n");
    }
    if (!bitwise_equal(outs[0], outs[1])) f += where + "inference out differs bitwise\n";
    if (!bitwise_equal(outs[1], b.out)) f += where + "inference out differs bitwise from the training out\n";
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

// Per-rank sends (spec section 14) against per-slot sends: the experts see bitwise the same
// rows and gradient rows, so the expert gradients and grad_weights are bitwise equal; out
// and grad_x differ by rounding only (each is checked against float64 by check_layer_case).
// Also: fewer rows sent whenever some token has two slots on one rank.
template <class Comm, class T>
std::string check_sends_agree(Comm& world, const layer_case& c) {
  std::string f;
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    layer_case slot = c, rank = c;
    slot.sends = row_sends::per_slot;
    rank.sends = row_sends::per_rank;
    const auto a = run_layer<Comm, T, impl::all_to_all>(world, slot, global);
    const auto b = run_layer<Comm, T, impl::all_to_all>(world, rank, global);
    const std::string where = detail::concat(c.describe(), " rank ", world.rank(), " per_slot vs per_rank: ");
    if (!bitwise_equal(a.grad_w, b.grad_w)) f += where + "grad_weights differ bitwise\n";
    if (!bitwise_equal(a.expert_grads, b.expert_grads)) f += where + "expert grads differ bitwise\n";
    // Per-rank sends that gather their unique rows first: bitwise the same.
    layer_case gathered = rank;
    gathered.indexed_sends = false;
    const auto g = run_layer<Comm, T, impl::all_to_all>(world, gathered, global);
    f += bitwise_differences(b, g, detail::concat(c.describe(), " rank ", world.rank(), " per_rank by index vs gathered: "));
    const double at = atol_for<T>(), rt = rtol_for<T>();
    append(f, ref::compare(ref::to_double(b.out), ref::to_double(a.out), at, rt, where + "out"));
    append(f, ref::compare(ref::to_double(b.grad_x), ref::to_double(a.grad_x), at, rt, where + "grad_x"));
    if (b.stats.peer_access) f += where + "the per-rank run took the direct route\n";
    std::int64_t sa = 0, sb = 0;
    for (auto v : a.stats.rows_sent) sa += v;
    for (auto v : b.stats.rows_sent) sb += v;
    if (sb > sa) f += detail::concat(where, "per-rank sent ", sb, " rows, per-slot ", sa, "\n");
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

// Experts that declare forward_in_place: they record whether the layer handed them their
// own inputs as `out`, and compute through a copy of the inputs (so writing over them is
// safe whichever buffer `out` is).
template <class T>
struct in_place_experts {
  static constexpr bool forward_in_place = true;
  ref::test_linear_experts<T>& inner;
  int calls = 0, in_place_calls = 0;

  template <class Exec>
  void forward(const Exec& ex, const expert_rows<const T>& in, T* out) {
    ++calls;
    if (static_cast<const T*>(out) == in.rows) ++in_place_calls;
    std::vector<T> copy(in.rows, in.rows + in.num_rows * in.hidden);
    expert_rows<const T> c = in;
    c.rows = copy.data();
    inner.forward(ex, c, out);
  }
  template <class Exec>
  void backward(const Exec& ex, const expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    inner.backward(ex, in, grad_out, grad_in);
  }
};

// Experts that allow it run in place in inference, never in training, and both calls
// match the reference.
template <class Comm, class T, class Impl = impl::all_to_all>
std::string check_in_place_experts(Comm& world, const layer_case& c) {
  std::string f;
  try {
    const rank_inputs<T> in(c, world.rank());
    const batch_data& d = in.d;
    moe_layer<Comm, T, Impl, test_exec> layer(in.m, world, options_for(c));
    ref::test_linear_experts<T> inner(in.global, in.m.ep_rank(in.rank), in.m.local_experts());
    in_place_experts<T> experts{inner};
    const auto& x = in.x;
    const auto& w = in.w;
    const int rank = in.rank;
    const std::size_t N = in.N, H = in.H;
    const auto want = ref::moe_forward(d.x, d.ids, d.w, in.global, keep_masks<T>(c)[static_cast<std::size_t>(in.b)]);
    const std::string where = detail::concat(c.describe(), " rank ", rank, " in-place experts");
    for (auto md : {mode::inference, mode::train}) {
      std::vector<T> out(N * H, convert<T>(7.0f));
      const int before = experts.in_place_calls;
      auto saved = layer.forward(span<const T>(x), span<const std::int32_t>(d.ids), span<const float>(w),
                                 span<T>(out), experts, md);
      const bool in_place = experts.in_place_calls > before;
      if (in_place != (md == mode::inference))
        f += detail::concat(where, md == mode::inference ? ": inference" : ": training",
                            in_place ? " ran the experts in place\n" : " did not run the experts in place\n");
      append(f, ref::compare(out, want, atol_for<T>(), rtol_for<T>(),
                             where + (md == mode::inference ? " inference out" : " training out")));
    }
  } catch (const std::exception& ex) {
    f += detail::concat(c.describe(), " rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

}  // namespace epx::test
