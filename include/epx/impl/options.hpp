// epx/impl/options.hpp: the tuning knobs of a MoE layer (plain aggregates with defaults).
#pragma once

#include <cstddef>
#include <cstdint>

#include "epx/core/error.hpp"
#include "epx/layout/capacity.hpp"
#include "epx/layout/padding.hpp"

namespace epx {

// How the all-to-all path learns the receive counts.
//   host:   one all_gather of a small record per rank {status, N, H, k, rank, mode, counts[E]}; the one
//           host synchronisation per layer call. Bad input and shape disagreement are seen
//           by every rank of the EP group before any row moves.
//   device: bounded mode (spec section 11; epx/impl/bounded.hpp): buffers sized at
//           construction from layer_options::bound.cap, the counts travel with the rows,
//           no host synchronisation (capturable in a CUDA graph). Pairs beyond the bound
//           are dropped and counted; bad input is counted and raised by moe_layer::check().
enum class count_exchange : int { host = 0, device = 1 };

// Bounded mode (count_exchange::device). `cap`: at most this many (row, slot) pairs per
// (source ep rank, global expert) block travel; it must be at least 1 in bounded mode.
// Pairs beyond it are dropped by the local capacity rule (spec section 8, priority from
// layer_options::capacity.priority) and counted in the layer's overflow counter.
// `raise_on_overflow`: moe_layer::check() raises errc::input when pairs were dropped.
struct bound_options {
  std::int64_t cap = 0;
  bool raise_on_overflow = false;
};

// How rows travel to the owners of their experts (spec section 14).
//   per_slot: a token's row travels once per slot (k rows, repeats included) and every
//             slot's output row comes back on its own;
//   per_rank: once per distinct ep rank among its slots' owners. The owner copies it into
//             each of its local experts' segments (the experts see bitwise the per-slot
//             rows) and returns one row per (token, rank): the float32 sum of w * y over
//             the token's slots there in slot order, rounded once to T. Backward mirrors it.
//             Results differ from per_slot by rounding only. It takes the staged route
//             (rows through the communicator's all-to-all, also where peer access is
//             available), and is not available with FP8 dispatch, bounded mode or the
//             all_reduce implementation (errc::configuration at construction).
// layer_stats::rows_sent / rows_received count the rows of the mode that ran.
enum class row_sends : int { per_slot = 0, per_rank = 1 };

inline const char* to_string(row_sends s) noexcept { return s == row_sends::per_rank ? "per_rank" : "per_slot"; }

// Forward for training keeps what backward needs; inference keeps nothing.
enum class mode : int { train = 0, inference = 1 };

struct layer_options {
  std::size_t hidden = 0;  // H, the row length; required (>= 1)
  int top_k = 1;           // k, slots per token, in [1, num_experts]
  padding pad = {};
  count_exchange counts = count_exchange::host;
  bound_options bound = {};  // bounded mode (counts == count_exchange::device)
  std::size_t chunks = 0;  // chunks of the counting sort; 0: the execution policy's default
  // On communicators whose ranks share memory (epx::has_peer_access_v and, at run time,
  // epx::peer_access_available: threads, over host memory or one device's; MPI ranks all
  // on one node), the all-to-all path reads rows straight out of the peers' buffers, on
  // host and device policies alike: the gather is fused into the dispatch and the combine
  // into the return, with no send buffer. With a host communicator a device policy waits
  // for its queue on each side of each access (layer_stats::host_syncs). Bounded mode
  // takes it for inference on host policies only.
  // false: always move rows through the communicator's all-to-all (same results, bitwise).
  bool peer_access = true;
  // On communicators that send rows by index (epx::has_indexed_sends_v: threads, MPI) and
  // host policies, the staged route sends rows straight out of x (grad_out for per-rank
  // sends in backward; FP8 dispatch: out of the quantised rows, bytes and scales) by index,
  // with no gather into a send buffer and, for an inference call in rounds, in one
  // collective (the way back still takes the rounds).
  // false: gather first (same results, bitwise).
  bool indexed_sends = true;
  // Capacity and token dropping (spec section 8; epx/layout/capacity.hpp): off by default.
  capacity_policy capacity = {};
  // Nodes (spec section 10): `ranks_per_node` consecutive ep ranks form a node (must divide
  // ep; 0: not given, no node statistics); `max_nodes` M > 0 limits each token's experts to
  // M nodes (k must fit in M nodes). The layer checks them at construction and hands the
  // routing policies their limit (moe_layer::node_limit()); it reports nodes per token.
  int ranks_per_node = 0;
  int max_nodes = 0;
  // FP8 dispatch (spec section 12): the forward dispatch sends each row as E4M3 bytes with
  // one float32 scale per 128 elements (epx/kernels/fp8.hpp); the experts receive the FP8
  // rows and the scales (their fp8 forward, epx/impl/experts.hpp), their outputs come back
  // in T, and backward runs in T. Needs hidden % 128 == 0 and the all-to-all path; takes
  // either route (direct: the owners copy the senders' quantised rows; staged: in one
  // round). Checked at construction (errc::configuration on every rank).
  bool fp8_dispatch = false;
  // Rows once per slot or once per destination rank (spec section 14; row_sends above).
  row_sends sends = row_sends::per_slot;
  // The staged route's stage (epx/layout/rounds.hpp): an inference forward and every
  // backward move their rows in rounds through a stage of at most this many bytes (rounds
  // of whole slice rows, at least one row a round) instead of a send buffer of all n*k
  // rows. A value below one slice row's k rows (k * hidden * sizeof(T) bytes), 1 included,
  // is taken as that one row: one round per slice row of the EP group's largest slice.
  // Results are bitwise the same; each round costs one collective's latency, and the
  // rounds' plan holds a few integers per round and segment (ep * L).
  // 0: automatic: on host policies rounds of default_host_stage_bytes when the EP group's
  // largest slice would send more than default_host_one_round_bytes at once, one round
  // otherwise; one round on device policies. Must agree on every rank. Per-rank sends and
  // bounded mode take no rounds (one exchange each way; this value does not apply).
  std::size_t stage_bytes = 0;
};

// The automatic stage of host policies (layer_options::stage_bytes = 0): rounds of 4 MiB
// once one round would need a send buffer of more than 64 MiB.
inline constexpr std::size_t default_host_stage_bytes = std::size_t{4} << 20;
inline constexpr std::size_t default_host_one_round_bytes = std::size_t{64} << 20;

}  // namespace epx
