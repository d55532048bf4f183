// epx/mesh/mesh.hpp: the process mesh (spec section 1).
//
// world = pp * dp_replicate * fsdp * tp ranks, laid out row-major with tp fastest:
//   rank = ((pp_i * R + rep_i) * fsdp + fsdp_i) * tp + tp_i
// `ep` regroups the ranks of one block (S = fsdp * tp ranks: one pipeline stage of one
// replica) for the expert weights; efsdp = S / ep replicas of each expert group exist.
#pragma once

#include <array>
#include <climits>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"

namespace epx {

enum class group_kind : int { tp = 0, fsdp, ep, efsdp, dp_replicate, pp };
inline constexpr std::array<group_kind, 6> all_group_kinds = {
    group_kind::tp, group_kind::fsdp, group_kind::ep,
    group_kind::efsdp, group_kind::dp_replicate, group_kind::pp};

inline const char* to_string(group_kind g) noexcept {
  switch (g) {
    case group_kind::tp: return "tp";
    case group_kind::fsdp: return "fsdp";
    case group_kind::ep: return "ep";
    case group_kind::efsdp: return "efsdp";
    case group_kind::dp_replicate: return "dp_replicate";
    case group_kind::pp: return "pp";
  }
  return "?";
}

// The sizes a user chooses. `world` is optional: 0 means "the product of the sizes";
// any other value is checked against that product.
struct mesh_config {
  int tp = 1;
  int fsdp = 1;
  int pp = 1;
  int dp_replicate = 1;
  int ep = 1;
  int experts = 1;
  int world = 0;
};

// Position of one rank in the mesh.
struct rank_coords {
  int rank;
  int tp;       // tp_i
  int fsdp;     // fsdp_i
  int replica;  // rep_i (dp_replicate index)
  int pp;       // pp_i
};

class mesh {
 public:
  // Validates every rule of spec section 1 and throws epx::error(errc::configuration)
  // naming the offending values.
  explicit mesh(const mesh_config& c) : c_(c) { validate(c); c_.world = c.pp * c.dp_replicate * c.fsdp * c.tp; }

  static void validate(const mesh_config& c) {
    const std::pair<const char*, int> sizes[] = {{"tp_size", c.tp},     {"fsdp_size", c.fsdp},
                                                 {"pp_size", c.pp},     {"dp_replicate_size", c.dp_replicate},
                                                 {"ep_size", c.ep},     {"num_experts", c.experts}};
    for (const auto& [name, v] : sizes)
      EPX_REQUIRE(v >= 1, errc::configuration, name, " (", v, ") must be at least 1");
    // Factor by factor: four sizes of up to 2^31 - 1 overflow even a long long.
    long long product = 1;
    bool fits = true;
    for (const int v : {c.pp, c.dp_replicate, c.fsdp, c.tp}) {
      fits = fits && product <= LLONG_MAX / v;
      if (fits) product *= v;
    }
    EPX_REQUIRE(fits && product <= (1LL << 30), errc::configuration, "world size pp*dp_replicate*fsdp*tp (",
                fits ? std::to_string(product) : detail::concat(c.pp, "*", c.dp_replicate, "*", c.fsdp, "*", c.tp),
                ") is too large");
    EPX_REQUIRE(c.world == 0 || c.world == product, errc::configuration, "world size (", c.world,
                ") must equal pp_size*dp_replicate_size*fsdp_size*tp_size (", c.pp, "*",
                c.dp_replicate, "*", c.fsdp, "*", c.tp, " = ", product, ")");
    EPX_REQUIRE(c.ep % c.tp == 0, errc::configuration, "ep_size (", c.ep,
                ") must be a multiple of tp_size (", c.tp, ")");
    const int S = c.fsdp * c.tp;
    EPX_REQUIRE(S % c.ep == 0, errc::configuration, "ep_size (", c.ep,
                ") must divide fsdp_size*tp_size (", c.fsdp, "*", c.tp, " = ", S, ")");
    EPX_REQUIRE(c.experts % c.ep == 0, errc::configuration, "num_experts (", c.experts,
                ") must be divisible by ep_size (", c.ep, ")");
  }

  // Checks a routing top-k against this mesh's expert count.
  void validate_top_k(int k) const {
    EPX_REQUIRE(k >= 1 && k <= c_.experts, errc::configuration, "top_k (", k,
                ") must be in [1, num_experts (", c_.experts, ")]");
  }
  // Checks that a communicator of `comm_size` ranks fits this mesh.
  void validate_world(int comm_size) const {
    EPX_REQUIRE(comm_size == c_.world, errc::configuration, "communicator size (", comm_size,
                ") must equal pp_size*dp_replicate_size*fsdp_size*tp_size (", c_.pp, "*",
                c_.dp_replicate, "*", c_.fsdp, "*", c_.tp, " = ", c_.world, ")");
  }

  const mesh_config& config() const noexcept { return c_; }
  int tp() const noexcept { return c_.tp; }
  int fsdp() const noexcept { return c_.fsdp; }
  int pp() const noexcept { return c_.pp; }
  int dp_replicate() const noexcept { return c_.dp_replicate; }
  int ep() const noexcept { return c_.ep; }
  int experts() const noexcept { return c_.experts; }
  int world() const noexcept { return c_.world; }
  int block_size() const noexcept { return c_.fsdp * c_.tp; }          // S
  int efsdp() const noexcept { return block_size() / c_.ep; }         // replicas of an expert group
  int local_experts() const noexcept { return c_.experts / c_.ep; }   // L
  int batches() const noexcept { return c_.dp_replicate * c_.fsdp; }  // B
  int batches_per_ep_group() const noexcept { return c_.ep / c_.tp; }

  rank_coords coords(int rank) const {
    check_rank(rank);
    rank_coords x{};
    x.rank = rank;
    x.tp = rank % c_.tp;
    int q = rank / c_.tp;
    x.fsdp = q % c_.fsdp;
    q /= c_.fsdp;
    x.replica = q % c_.dp_replicate;
    x.pp = q / c_.dp_replicate;
    return x;
  }
  // The rank at these coordinates; errc::input for a coordinate outside its size.
  int rank_of(int pp_i, int rep_i, int fsdp_i, int tp_i) const {
    const std::pair<const char*, std::pair<int, int>> at[] = {{"pp_i", {pp_i, c_.pp}},
                                                             {"rep_i", {rep_i, c_.dp_replicate}},
                                                             {"fsdp_i", {fsdp_i, c_.fsdp}},
                                                             {"tp_i", {tp_i, c_.tp}}};
    for (const auto& [name, v] : at)
      EPX_REQUIRE(v.first >= 0 && v.first < v.second, errc::input, "rank_of: ", name, " (", v.first,
                  ") out of range [0, ", v.second, ")");
    return ((pp_i * c_.dp_replicate + rep_i) * c_.fsdp + fsdp_i) * c_.tp + tp_i;
  }

  // Batch held by a rank: depends on (rep_i, fsdp_i) only. In [0, batches()).
  int batch(int rank) const { const auto x = coords(rank); return x.replica * c_.fsdp + x.fsdp; }
  int block_start(int rank) const { check_rank(rank); return rank - rank % block_size(); }
  // Position inside the EP group = the ep rank.
  int ep_rank(int rank) const { return (rank - block_start(rank)) % c_.ep; }
  // Position inside the efsdp group: which replica of the expert group.
  int efsdp_rank(int rank) const { return (rank - block_start(rank)) / c_.ep; }

  int group_size(group_kind g) const noexcept {
    switch (g) {
      case group_kind::tp: return c_.tp;
      case group_kind::fsdp: return c_.fsdp;
      case group_kind::ep: return c_.ep;
      case group_kind::efsdp: return efsdp();
      case group_kind::dp_replicate: return c_.dp_replicate;
      case group_kind::pp: return c_.pp;
    }
    return 0;
  }

  // The i-th member (global rank) of the group of kind `g` that holds `rank`.
  int group_member(group_kind g, int rank, int i) const {
    const auto x = coords(rank);
    const int b = block_start(rank);
    EPX_REQUIRE(i >= 0 && i < group_size(g), errc::input, to_string(g), " group index (", i,
                ") out of range [0, ", group_size(g), ")");
    switch (g) {
      case group_kind::tp: return rank - x.tp + i;
      case group_kind::fsdp: return b + x.tp + i * c_.tp;
      case group_kind::ep: return b + ((rank - b) / c_.ep) * c_.ep + i;
      case group_kind::efsdp: return b + (rank - b) % c_.ep + i * c_.ep;
      case group_kind::dp_replicate: return rank_of(x.pp, i, x.fsdp, x.tp);
      case group_kind::pp: return rank_of(i, x.replica, x.fsdp, x.tp);
    }
    return -1;
  }

  // This rank's index inside its group of kind `g`.
  int group_rank(group_kind g, int rank) const {
    const auto x = coords(rank);
    switch (g) {
      case group_kind::tp: return x.tp;
      case group_kind::fsdp: return x.fsdp;
      case group_kind::ep: return ep_rank(rank);
      case group_kind::efsdp: return efsdp_rank(rank);
      case group_kind::dp_replicate: return x.replica;
      case group_kind::pp: return x.pp;
    }
    return -1;
  }

  // An id shared by exactly the members of one group of kind `g` (the lowest member's rank):
  // the `color` of a communicator split.
  int group_color(group_kind g, int rank) const { return group_member(g, rank, 0); }

  std::vector<int> group_members(group_kind g, int rank) const {
    std::vector<int> m(static_cast<std::size_t>(group_size(g)));
    for (int i = 0; i < group_size(g); ++i) m[static_cast<std::size_t>(i)] = group_member(g, rank, i);
    return m;
  }

  // Experts: ep-rank q owns the contiguous global range [q*L, (q+1)*L).
  int expert_begin(int rank) const { return ep_rank(rank) * local_experts(); }
  int expert_end(int rank) const { return expert_begin(rank) + local_experts(); }
  int owner_ep_rank(int global_expert) const {
    check_expert(global_expert);
    return global_expert / local_experts();
  }
  int to_local(int global_expert, int rank) const {
    check_expert(global_expert);
    const int l = global_expert - expert_begin(rank);
    EPX_REQUIRE(l >= 0 && l < local_experts(), errc::input, "expert ", global_expert,
                " is not owned by rank ", rank, " (owns [", expert_begin(rank), ", ", expert_end(rank), "))");
    return l;
  }
  int to_global(int local_expert, int rank) const {
    EPX_REQUIRE(local_expert >= 0 && local_expert < local_experts(), errc::input, "local expert id (",
                local_expert, ") out of range [0, ", local_experts(), ")");
    return expert_begin(rank) + local_expert;
  }

  friend bool operator==(const mesh& a, const mesh& b) noexcept {
    return a.c_.tp == b.c_.tp && a.c_.fsdp == b.c_.fsdp && a.c_.pp == b.c_.pp &&
           a.c_.dp_replicate == b.c_.dp_replicate && a.c_.ep == b.c_.ep && a.c_.experts == b.c_.experts;
  }
  friend bool operator!=(const mesh& a, const mesh& b) noexcept { return !(a == b); }

 private:
  void check_rank(int rank) const {
    EPX_REQUIRE(rank >= 0 && rank < c_.world, errc::input, "rank (", rank, ") out of range [0, ",
                c_.world, ")");
  }
  void check_expert(int e) const {
    EPX_REQUIRE(e >= 0 && e < c_.experts, errc::input, "expert id (", e, ") out of range [0, ",
                c_.experts, ")");
  }

  mesh_config c_;
};

}  // namespace epx
