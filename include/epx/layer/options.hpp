// epx/layer/options.hpp: the tuning knobs of a MoE layer (plain aggregates with defaults).
#pragma once

#include <cstddef>

#include "epx/core/error.hpp"

namespace epx {

// Zero rows appended to every local expert's segment of the expert-major buffer.
// Expert l gets round_up(count_l + rows_per_expert, align) - count_l padding rows, so every
// local expert runs (and produces a gradient, exactly zero when it received nothing).
// rows_per_expert = 0 and align = 1 turn padding off; align = M makes every expert's row
// count a multiple of M (grouped GEMMs, low-precision formats).
struct padding {
  int rows_per_expert = 1;
  int align = 1;

  std::size_t padded_rows(std::size_t count) const noexcept {
    const std::size_t a = static_cast<std::size_t>(align);
    const std::size_t need = count + static_cast<std::size_t>(rows_per_expert);
    return (need + a - 1) / a * a;
  }
  void validate() const {
    EPX_REQUIRE(rows_per_expert >= 0, errc::configuration, "padding.rows_per_expert (", rows_per_expert,
                ") must be >= 0");
    EPX_REQUIRE(align >= 1, errc::configuration, "padding.align (", align, ") must be >= 1");
  }
};

// How the all-to-all path learns the receive counts.
//   host: one all_gather of a small record per rank {status, N, H, k, counts[E]}; the one
//         host synchronisation per layer call. Bad input and shape disagreement are seen by
//         every rank of the EP group before any row moves.
// A later `device` mode (counts exchanged on the device into fixed worst-case receive
// buffers, no host synchronisation, capturable in a CUDA graph) takes this slot; it is
// not built yet, and choosing it is refused at layer construction.
enum class count_exchange : int { host = 0, device = 1 };

// Forward for training keeps what backward needs; inference keeps nothing.
enum class mode : int { train = 0, inference = 1 };

struct layer_options {
  std::size_t hidden = 0;  // H, the row length; required (>= 1)
  int top_k = 1;           // k, slots per token, in [1, num_experts]
  padding pad = {};
  count_exchange counts = count_exchange::host;
  std::size_t chunks = 0;  // chunks of the counting sort; 0: the execution policy's default
  // On communicators whose ranks share memory (epx::has_peer_access_v: threads) and host
  // policies, the all-to-all path reads rows straight out of the peers' buffers: the gather
  // is fused into the dispatch and the combine into the return, with no send buffer.
  // false: always move rows through the communicator's all-to-all (same results, bitwise).
  bool peer_access = true;
};

}  // namespace epx
