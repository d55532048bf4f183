// epx/impl/stats.hpp: load statistics of the last layer call that completed, readable by the user.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/layout/receive.hpp"

namespace epx {

struct layer_stats {
  // This rank, [L]: rows its local experts received (without padding) and their padding rows.
  std::vector<std::int64_t> tokens_per_local_expert;
  std::vector<std::int64_t> padding_per_local_expert;
  // This rank, [ep]: rows sent to and received from every ep peer (zero on the masked path).
  std::vector<std::int64_t> rows_sent;
  std::vector<std::int64_t> rows_received;
  // The whole EP group, [E]: (token, slot) pairs routed to each global expert (with a
  // capacity: routed, dropped ones included; tokens_per_local_expert holds what arrived).
  std::vector<std::int64_t> tokens_per_expert;
  // Over the E experts of the EP group.
  double max_expert_load = 0.0;
  double mean_expert_load = 0.0;
  // Over the ep ranks: pairs routed to each rank's experts (rows received, without a capacity).
  double max_rank_load = 0.0;
  double mean_rank_load = 0.0;
  // Capacity (layer_options::capacity), the whole EP group, [E]: pairs dropped for each
  // global expert (tokens_per_expert counts them too: it is the routing's load); empty
  // without a capacity. dropped_pairs: their sum.
  std::vector<std::int64_t> dropped_per_expert;
  std::int64_t dropped_pairs = 0;
  // With layer_options::ranks_per_node: distinct nodes among each token's k experts, over
  // the tokens the EP group dispatched (0 without ranks_per_node).
  std::int64_t max_nodes_per_token = 0;
  double mean_nodes_per_token = 0.0;
  // Which path ran last: "all_to_all", "all_reduce" or a user implementation's name.
  const char* path = "";
  // The all-to-all path read rows straight out of the peers' buffers (layer_options::peer_access)
  // instead of moving them through the communicator's all-to-all.
  bool peer_access = false;
  // The staged route's row sends (forward dispatch, and backward's with per-rank sends) read
  // the rows by index straight out of the caller's x or grad_out (FP8 dispatch: out of the
  // quantised rows) as they went (layer_options::indexed_sends) instead of gathering them
  // into a send buffer first.
  bool indexed_sends = false;
  // Rounds of the staged route in the last call that ran it in rounds
  // (layer_options::stage_bytes, epx/layout/rounds.hpp); 0 when it moved all rows at once.
  std::int64_t stage_rounds = 0;
  // Bounded mode (layer_options::counts == count_exchange::device) ran the last call: no
  // count reaches the host, so the load figures above stay empty (moe_layer::check()
  // reports the dropped pairs).
  bool bounded = false;
  std::int64_t calls = 0;
  // Host synchronisations the last forward or backward call made on a device policy (0 on
  // host policies, which have no queue to wait for): the count exchange's read-back, and
  // on host communicators (threads, MPI) one before each collective over device buffers.
  std::int64_t host_syncs = 0;

  // max/mean expert load; 1 is perfect balance, 0 when nothing was routed.
  double imbalance() const noexcept { return mean_expert_load > 0.0 ? max_expert_load / mean_expert_load : 0.0; }
};

namespace detail {

inline void summarize_loads(layer_stats& st, int owners, int L);

// The one statistics routine of the built-in implementations: this rank is owner and
// source `me` of the receive layout. `moves_rows`: rows travel between ranks (all-to-all);
// the masked path moves none (rows_sent, rows_received stay zero).
inline void record_stats(layer_stats& st, const char* path, const receive_layout& lay, int me, bool moves_rows) {
  const int L = lay.L, owners = lay.owners;
  const auto Ls = static_cast<std::size_t>(L);
  const std::size_t E = lay.E();
  st.path = path;
  st.peer_access = false;
  st.indexed_sends = false;
  st.stage_rounds = 0;
  st.bounded = false;
  st.tokens_per_local_expert.assign(Ls, 0);
  st.padding_per_local_expert.assign(Ls, 0);
  const std::size_t* off = lay.offsets(me);
  const std::size_t* got = lay.received(me);
  for (std::size_t l = 0; l < Ls; ++l) {
    st.tokens_per_local_expert[l] = static_cast<std::int64_t>(got[l]);
    st.padding_per_local_expert[l] = static_cast<std::int64_t>(off[l + 1] - off[l] - got[l]);
  }
  st.rows_sent.assign(static_cast<std::size_t>(owners), 0);
  st.rows_received.assign(static_cast<std::size_t>(owners), 0);
  if (moves_rows)
    for (int d = 0; d < owners; ++d)
      for (int l = 0; l < L; ++l) {
        const auto i = static_cast<std::size_t>(d) * Ls + static_cast<std::size_t>(l);
        st.rows_sent[static_cast<std::size_t>(d)] += lay.count(me, i);
        st.rows_received[static_cast<std::size_t>(d)] +=
            lay.count(d, static_cast<std::size_t>(me) * Ls + static_cast<std::size_t>(l));
      }
  // Group-wide loads: every source's pairs per global expert.
  st.tokens_per_expert.assign(E, 0);
  for (int s = 0; s < lay.sources; ++s)
    for (std::size_t e = 0; e < E; ++e) st.tokens_per_expert[e] += lay.count(s, e);
  st.dropped_per_expert.clear();
  st.dropped_pairs = 0;
  st.max_nodes_per_token = 0;
  st.mean_nodes_per_token = 0.0;
  summarize_loads(st, owners, L);
}

// The max/mean loads of tokens_per_expert ([owners * L]), over experts and over ep ranks.
inline void summarize_loads(layer_stats& st, int owners, int L) {
  const auto Ls = static_cast<std::size_t>(L);
  const std::size_t E = st.tokens_per_expert.size();
  std::int64_t total = 0, mx = 0;
  for (auto c : st.tokens_per_expert) {
    total += c;
    mx = std::max(mx, c);
  }
  st.max_expert_load = static_cast<double>(mx);
  st.mean_expert_load = E ? static_cast<double>(total) / static_cast<double>(E) : 0.0;
  std::int64_t rmx = 0;
  for (int d = 0; d < owners; ++d) {
    std::int64_t sum = 0;
    for (std::size_t l = 0; l < Ls; ++l) sum += st.tokens_per_expert[static_cast<std::size_t>(d) * Ls + l];
    rmx = std::max(rmx, sum);
  }
  st.max_rank_load = static_cast<double>(rmx);
  st.mean_rank_load = owners ? static_cast<double>(total) / owners : 0.0;
}

}  // namespace detail

}  // namespace epx
