// epx/impl/stats.hpp: load statistics of the last layer call, readable by the user.
#pragma once

#include <cstdint>
#include <vector>

namespace epx {

struct layer_stats {
  // This rank, [L]: rows its local experts received (without padding) and their padding rows.
  std::vector<std::int64_t> tokens_per_local_expert;
  std::vector<std::int64_t> padding_per_local_expert;
  // This rank, [ep]: rows sent to and received from every ep peer (zero on the masked path).
  std::vector<std::int64_t> rows_sent;
  std::vector<std::int64_t> rows_received;
  // The whole EP group, [E]: (token, slot) pairs routed to each global expert.
  std::vector<std::int64_t> tokens_per_expert;
  // Over the E experts of the EP group.
  double max_expert_load = 0.0;
  double mean_expert_load = 0.0;
  // Over the ep ranks: rows each rank's experts received.
  double max_rank_load = 0.0;
  double mean_rank_load = 0.0;
  // Which path ran last: "all_to_all", "all_reduce" or a user implementation's name.
  const char* path = "";
  // The all-to-all path read rows straight out of the peers' buffers (layer_options::peer_access)
  // instead of moving them through the communicator's all-to-all.
  bool peer_access = false;
  std::int64_t calls = 0;

  // max/mean expert load; 1 is perfect balance, 0 when nothing was routed.
  double imbalance() const noexcept { return mean_expert_load > 0.0 ? max_expert_load / mean_expert_load : 0.0; }
};

}  // namespace epx
