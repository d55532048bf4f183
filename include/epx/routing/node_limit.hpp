// epx/routing/node_limit.hpp: node-limited routing (spec section 10), for every policy.
//
// The EP group is split into nodes of ranks_per_node consecutive ep ranks; since ep rank q
// owns experts [q*L, (q+1)*L), node g owns the contiguous experts [g*E/nodes,
// (g+1)*E/nodes). With a limit of M nodes, each token first scores every node by the sum
// of its ceil(k / M) best selection scores on that node (p = softmax(logits) for the
// softmax policies, s + bias for sigmoid_bias), keeps the M best nodes (ties to the lower
// node id), then takes its top-k among their experts only. Weights are computed as the
// policy says from the selected ids, so backward is unchanged. Without a limit (max_nodes
// 0, or not below the number of nodes) routing is unchanged.
//
//   policy.limit = epx::routing::node_limit_of(mesh, /*ranks_per_node=*/8, /*max_nodes=*/4);
//   // or layer.node_limit(), from layer_options::ranks_per_node and max_nodes
//
// Also here: token_nodes, the per-token count of distinct nodes among a token's k experts
// (the layer's nodes-per-token statistics).
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/mesh/mesh.hpp"
#include "epx/routing/common.hpp"
#include "epx/routing/detail/topk.hpp"

namespace epx::routing {

// Largest number of nodes of a limit (the per-token functors keep the kept nodes in one
// 64-bit mask).
inline constexpr int max_node_count = 64;

struct node_limit {
  int nodes = 0;      // nodes of the EP group (ep / ranks_per_node); node g owns experts [g*E/nodes, ...)
  int max_nodes = 0;  // M: a token's experts lie on at most M nodes; 0: no limit

  // Whether the limit removes any choice (M below the number of nodes).
  EPX_HOST_DEVICE constexpr bool active() const noexcept { return max_nodes > 0 && max_nodes < nodes; }
};

// The limit for mesh m when every node holds `ranks_per_node` consecutive ep ranks and a
// token may use `max_nodes` of them. Raises errc::configuration naming the values when
// ranks_per_node does not divide ep, max_nodes is negative or larger than the number of
// nodes, or the nodes exceed max_node_count.
inline node_limit node_limit_of(const mesh& m, int ranks_per_node, int max_nodes) {
  EPX_REQUIRE(ranks_per_node >= 1 && m.ep() % ranks_per_node == 0, errc::configuration, "ranks_per_node (",
              ranks_per_node, ") must be >= 1 and divide ep (", m.ep(), ")");
  const int nodes = m.ep() / ranks_per_node;
  EPX_REQUIRE(max_nodes >= 0 && max_nodes <= nodes, errc::configuration, "max_nodes (", max_nodes,
              ") must be in [0, nodes] with nodes = ep / ranks_per_node = ", m.ep(), " / ", ranks_per_node, " = ",
              nodes);
  EPX_REQUIRE(max_nodes == 0 || nodes <= max_node_count, errc::configuration, "a node limit supports at most ",
              max_node_count, " nodes, not ", nodes);
  return node_limit{nodes, max_nodes};
}

namespace detail {

// The nodes a token may use, as a mask (bit g: node g); all ones without an active limit
// (nothing is called then). A node's score is the sum, in descending order, of score(e)
// over its ceil(k / M) best experts; offer_node(lo, hi, top) leaves `top` as offering
// rank(e) for the experts e in [lo, hi) in ascending id would, where rank must order the
// experts as score does (any order among equal scores): the logit for p, whose exp is then
// taken for those few experts only. The M best scores are kept, ties to the lower node.
template <class OfferNode, class Score>
EPX_HOST_DEVICE inline std::uint64_t select_nodes_by(const node_limit& nl, int E, int k, const OfferNode& offer_node,
                                                     const Score& score) {
  if (!nl.active()) return ~std::uint64_t{0};
  const int per = E / nl.nodes;
  const int best = (k + nl.max_nodes - 1) / nl.max_nodes;  // ceil(k / M) <= per (validated)
  float nscore[max_node_count];
  for (int g = 0; g < nl.nodes; ++g) {
    topk_list<max_top_k> top(best);
    offer_node(g * per, (g + 1) * per, top);
    float sum = 0.0f;
    for (int i = 0; i < top.size; ++i) sum += score(top.id[i]);
    nscore[g] = sum;
  }
  std::uint64_t kept = 0;
  for (int r = 0; r < nl.max_nodes; ++r) {
    int pick = -1;
    for (int g = 0; g < nl.nodes; ++g) {
      if ((kept >> g) & 1u) continue;
      if (pick < 0 || nscore[g] > nscore[pick]) pick = g;  // strict: ties keep the lower node
    }
    kept |= std::uint64_t{1} << pick;
  }
  return kept;
}

// select_nodes_by offering rank(e) for every expert of a node.
template <class Rank, class Score>
EPX_HOST_DEVICE inline std::uint64_t select_nodes(const node_limit& nl, int E, int k, const Rank& rank,
                                                  const Score& score) {
  const auto offer_node = [&](int lo, int hi, topk_list<max_top_k>& top) {
    for (int e = lo; e < hi; ++e) top.offer(rank(e), e);
  };
  return select_nodes_by(nl, E, k, offer_node, score);
}

// The same on the host from a token's key table (filled with unit = the experts of a
// node): each node's best keys come from its keys that reach the node's threshold
// (key_table::offer), the same nodes bit for bit.
template <class Score>
inline std::uint64_t select_nodes(const node_limit& nl, int E, int k, const key_table& keys, const Score& score) {
  const auto offer_node = [&](int lo, int hi, topk_list<max_top_k>& top) { keys.offer(lo, hi, top); };
  return select_nodes_by(nl, E, k, offer_node, score);
}

// The keys of the experts on the nodes of `mask` (all of them without an active limit)
// offered to `top` as offering each in ascending id would leave it: the threshold of the
// best top.k over the kept nodes' groups, then the keys that reach it.
template <class List>
inline void offer_allowed(const node_limit& nl, std::uint64_t mask, int E, const key_table& keys, List& top) {
  if (!nl.active()) return keys.offer(0, E, top);
  const int per = E / nl.nodes, gper = per / keys.span;
  float gm[max_key_table];
  int ng = 0;
  for (int g = 0; g < nl.nodes; ++g)
    if ((mask >> g) & 1u)
      for (int i = 0; i < gper; ++i) gm[ng++] = keys.gmax[g * gper + i];
  const float t = key_table::threshold(gm, ng, top.k);
  for (int g = 0; g < nl.nodes; ++g)
    if ((mask >> g) & 1u) keys.offer_reaching(g * per, (g + 1) * per, t, top);
}

// f(e) for every expert e on a node of `mask` (every expert without an active limit), in
// ascending e.
template <class F>
EPX_HOST_DEVICE inline void for_each_allowed(const node_limit& nl, std::uint64_t mask, int E, const F& f) {
  if (!nl.active()) {
    for (int e = 0; e < E; ++e) f(e);
    return;
  }
  const int per = E / nl.nodes;
  for (int g = 0; g < nl.nodes; ++g)
    if ((mask >> g) & 1u)
      for (int e = g * per; e < (g + 1) * per; ++e) f(e);
}

// The checks route() makes for a limit (errc::configuration naming the values): nodes
// dividing E, M not above the nodes, k within what M nodes hold, at most max_node_count
// nodes. `name` is the policy's name.
inline void validate_node_limit(const char* call, const char* name, const node_limit& nl, int E, int k) {
  if (nl.max_nodes == 0) return;
  EPX_REQUIRE(nl.max_nodes >= 0, errc::configuration, call, "(", name, "): node_limit.max_nodes (", nl.max_nodes,
              ") must be >= 0 (0: no limit)");
  EPX_REQUIRE(nl.nodes >= 1 && nl.nodes <= max_node_count && E % nl.nodes == 0, errc::configuration, call, "(",
              name, "): node_limit.nodes (", nl.nodes, ") must divide E (", E, ") and be in [1, ", max_node_count,
              "]");
  EPX_REQUIRE(nl.max_nodes >= 0 && nl.max_nodes <= nl.nodes, errc::configuration, call, "(", name,
              "): node_limit.max_nodes (", nl.max_nodes, ") must be in [0, nodes = ", nl.nodes, "]");
  EPX_REQUIRE(k <= nl.max_nodes * (E / nl.nodes), errc::configuration, call, "(", name, "): top_k (", k,
              ") exceeds the experts of max_nodes (", nl.max_nodes, ") nodes of E / nodes (", E / nl.nodes,
              ") experts each = ", nl.max_nodes * (E / nl.nodes));
}

}  // namespace detail

// Call with t in [0, n): nodes[t] = the distinct nodes among token t's k expert ids
// (node of e: e / experts_per_node; ids outside [0, E) are not counted).
struct token_nodes {
  const std::int32_t* ids;  // [n, k]
  std::int32_t* nodes;      // [n]
  int top_k;
  int num_experts;
  int experts_per_node;
  std::uint64_t magic;      // magic_for(E, experts_per_node): e / experts_per_node without a division; 0: divide

  // ceil(2^32 / d) when E * d <= 2^32, else 0. For 0 <= e < E, (e * magic) >> 32 == e / d:
  // the error e * (magic * d - 2^32) / (d * 2^32) < e / 2^32 < 1 / d stays below the gap
  // to the next multiple of 1 / d.
  static std::uint64_t magic_for(int E, int d) noexcept {
    const auto Eu = static_cast<std::uint64_t>(E), du = static_cast<std::uint64_t>(d);
    if (d < 1 || Eu * du > (std::uint64_t{1} << 32)) return 0;
    return ((std::uint64_t{1} << 32) + du - 1) / du;
  }

  EPX_HOST_DEVICE int node_of(std::int32_t e) const noexcept {
    const auto u = static_cast<std::uint64_t>(static_cast<std::uint32_t>(e));
    return magic != 0 ? static_cast<int>((u * magic) >> 32) : static_cast<int>(u / static_cast<std::uint64_t>(experts_per_node));
  }

  EPX_HOST_DEVICE static int popcount(std::uint64_t m) noexcept {
#if defined(__CUDA_ARCH__)
    return __popcll(m);
#elif defined(__POPCNT__)
    return __builtin_popcountll(m);
#else
    // Without the instruction, the bit-parallel sum (the builtin would call a library
    // function per token).
    m = m - ((m >> 1) & 0x5555555555555555ull);
    m = (m & 0x3333333333333333ull) + ((m >> 2) & 0x3333333333333333ull);
    m = (m + (m >> 4)) & 0x0f0f0f0f0f0f0f0full;
    return static_cast<int>((m * 0x0101010101010101ull) >> 56);
#endif
  }

  EPX_HOST_DEVICE void operator()(std::size_t t) const {
    const std::int32_t* id = ids + t * static_cast<std::size_t>(top_k);
    if (num_experts <= 64 * std::int64_t{experts_per_node}) {  // 64 bits: 64 * d overflows an int from 2^25
      // At most 64 nodes (the usual case): one mask, no branch per id (an id outside
      // [0, E) adds no bit).
      std::uint64_t mask = 0;
      for (int j = 0; j < top_k; ++j) {
        const std::int32_t e = id[j];
        const bool ok = static_cast<std::uint32_t>(e) < static_cast<std::uint32_t>(num_experts);
        mask |= static_cast<std::uint64_t>(ok) << node_of(ok ? e : 0);
      }
      nodes[t] = popcount(mask);
      return;
    }
    std::uint64_t mask = 0;  // nodes below 64
    std::int32_t beyond = 0;  // distinct nodes from 64 on, pairwise (rare)
    for (int j = 0; j < top_k; ++j) {
      if (id[j] < 0 || id[j] >= num_experts) continue;
      const int g = node_of(id[j]);
      if (g < 64) {
        mask |= std::uint64_t{1} << g;
        continue;
      }
      bool seen = false;
      for (int i = 0; i < j && !seen; ++i) seen = id[i] >= 0 && id[i] < num_experts && node_of(id[i]) == g;
      if (!seen) ++beyond;
    }
    std::int32_t count = 0;
    for (; mask != 0; mask &= mask - 1) ++count;  // one step per set bit
    nodes[t] = count + beyond;
  }
};

}  // namespace epx::routing
