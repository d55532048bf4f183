// epx/grad/hooks.hpp: gradient reduction for expert and dense weights (spec section 6).
//
// Each rank computes a loss on the batch it holds; B = dp_replicate * fsdp batches exist.
// Inside an EP group an expert accumulates contributions from ep/tp batches (the layer's
// backward). The expert hook sums over the efsdp replicas (scaled by 1/B) and then over
// dp_replicate, so every expert gradient ends as the sum over all B batches divided by B:
// the same per-batch mean data parallelism applies to dense weights.
//
// These are plain functions over communicators: call them (or register them with an
// autograd system) when a gradient is ready. `gradient_hooks<Comm>` makes the needed
// sub-communicators once.
//
// Every rank of a hook's groups must pass the same sizes and element type: a rank that
// does not would make the reductions pair buffers of different lengths (a hang, a
// communicator error in one group only while the others wait in the next, or, where the
// communicator does not check counts, a wrong sum). On host communicators (threads, MPI)
// each hook therefore first all-gathers one small record per rank over its first group
// (efsdp or fsdp), then over dp_replicate (detail::agree_on_hook_sizes), and every rank of
// the two groups raises errc::input, naming the hook and the ranks (in their groups, and by
// world rank where the caller passes it: gradient_hooks does), before any element is
// reduced. A rank that cannot hand the hook a gradient at all (a binding's tensor of a type
// or on a device the hooks do not take) calls detail::refuse_hook in its place, which joins
// the same agreement with its reason, so that the others raise too instead of waiting in
// the sum. A device communicator (NCCL) skips this (it would cost a host synchronisation
// per hook): there the sizes are the caller's to keep equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/communicator.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/core/error.hpp"
#include "epx/core/span.hpp"
#include "epx/layer/agreement.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx {

namespace detail {

// What a rank hands a hook: its gradient's elements, its shard's (reduce-scatter; 0
// otherwise) and the element type.
struct hook_sizes {
  std::int64_t grad = 0, shard = 0, type = 0;
};

// How a message names rank `r` of a group: "rank 1 of the efsdp group", with its world rank
// (the mesh's) where the caller told it (`job` >= 0: " (world rank 5)").
inline std::string hook_member(const char* group, std::size_t r, std::int64_t job) {
  return job >= 0 ? concat("rank ", r, " of the ", group, " group (world rank ", job, ")")
                  : concat("rank ", r, " of the ", group, " group");
}

// Why the sizes of a rank of a group (`who`, hook_member's text; the group `group_name`)
// do not fit those of `ref` (its rank 0, with world rank `ref_world`, -1 not known), or its
// own reduce-scatter shape is wrong; "" when they fit.
inline std::string hook_sizes_error(const std::string& who, const char* group_name, const hook_sizes& have,
                                    const hook_sizes& ref, std::int64_t ref_world, bool scatter,
                                    std::int64_t group_size) {
  const std::string rank0 = ref_world >= 0 ? concat("rank 0 (world rank ", ref_world, ")") : std::string("rank 0");
  std::string why;
  if (scatter && have.grad != group_size * have.shard)
    why += concat("; ", who, " passes a gradient of ", have.grad, " elements, not ", group_name, " size (",
                  group_size, ") x its shard (", have.shard, ")");
  if (have.type != ref.type)
    why += concat("; ", who, " passes ", to_string(static_cast<datatype>(have.type)), " elements but ", rank0,
                  " passes ", to_string(static_cast<datatype>(ref.type)));
  if (have.grad != ref.grad)
    why += concat("; ", who, " passes a gradient of ", have.grad, " elements but ", rank0, " passes ", ref.grad);
  else if (scatter && have.shard != ref.shard)
    why += concat("; ", who, " passes a shard of ", have.shard, " elements but ", rank0, " passes ", ref.shard);
  return why;
}

// The texts of every rank of `comm` (each cut to 511 characters): collective, for the
// failures only, where every rank of `comm` has seen the same records and takes the branch.
template <class Comm>
std::vector<std::string> gather_hook_texts(Comm& comm, const std::string& mine) {
  constexpr std::size_t B = 512;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<char> msg(B, '\0'), msgs(B * n, '\0');
  mine.copy(msg.data(), B - 1);
  all_gather_host(comm, msg.data(), B, msgs.data());
  std::vector<std::string> out(n);
  for (std::size_t r = 0; r < n; ++r) out[r] = std::string(msgs.data() + r * B);
  return out;
}

// Collective over `group` (efsdp or fsdp, named `group_name`), then over `replicas`
// (dp_replicate): every rank of both raises errc::input with the same reasons when any rank
// of the groups that meet through them passes other sizes or another element type than its
// peers (or, `scatter`, a gradient that is not group size x shard), or cannot hand the hook
// a gradient at all (`refusal`, the caller's reason: a binding's tensor of a type or on a
// device the hooks do not take; `mine` is then not read), before anything is reduced. The
// first group's verdict travels in the second exchange, so the ranks of a group that
// agreed raise too instead of waiting in the dp_replicate sum for those that raised.
// `world_rank` (-1: not known) travels with the records, for the messages only. Host
// communicators only (see the top of this file).
template <class Comm>
void agree_on_hook_sizes(const char* hook, Comm& group, const char* group_name, Comm& replicas, hook_sizes mine,
                         bool scatter, const std::string& refusal = {}, int world_rank = -1) {
  // 1. Over the first group: every rank sees every record and reaches the same verdict.
  constexpr std::size_t F = 5;
  const auto G = static_cast<std::size_t>(group.size());
  const std::int64_t refused = refusal.empty() ? 0 : 1;
  std::vector<std::int64_t> rec{mine.grad, mine.shard, mine.type, refused, world_rank < 0 ? -1 : world_rank}, all(F * G);
  if (G > 1) all_gather_host(group, rec.data(), F, all.data());
  else all = rec;
  const auto at = [&all](std::size_t r) { return hook_sizes{all[F * r], all[F * r + 1], all[F * r + 2]}; };
  const auto who = [&all, group_name](std::size_t r) { return hook_member(group_name, r, all[F * r + 4]); };
  bool any_refused = false;
  for (std::size_t r = 0; r < G; ++r) any_refused = any_refused || all[F * r + 3] != 0;
  std::string why;
  if (any_refused) {  // the sizes of a rank that refused mean nothing: its reason instead
    const std::vector<std::string> reasons = G > 1 ? gather_hook_texts(group, refusal) : std::vector<std::string>{refusal};
    for (std::size_t r = 0; r < G; ++r)
      if (all[F * r + 3] != 0) why += concat("; ", who(r), " cannot reduce its gradient: ", reasons[r]);
  } else {
    for (std::size_t r = 0; r < G; ++r)
      why += hook_sizes_error(who(r), group_name, at(r), at(0), all[4], scatter, static_cast<std::int64_t>(G));
  }
  // 2. Over dp_replicate: each first group's verdict, and the sizes across the replicas.
  const auto R = static_cast<std::size_t>(replicas.size());
  if (R > 1) {
    std::vector<std::int64_t> rec2{why.empty() ? 0 : 1, mine.grad, mine.shard, mine.type, rec[4]}, all2(F * R);
    all_gather_host(replicas, rec2.data(), F, all2.data());
    const auto who2 = [&all2](std::size_t r) { return hook_member("dp_replicate", r, all2[F * r + 4]); };
    bool failed = false;
    for (std::size_t r = 0; r < R; ++r) failed = failed || all2[F * r] != 0;
    if (failed) {  // every rank of `replicas` takes this branch: the texts' all_gather matches
      const std::vector<std::string> theirs = gather_hook_texts(replicas, why);
      const auto me = static_cast<std::size_t>(replicas.rank());
      for (std::size_t r = 0; r < R; ++r)
        if (r != me && all2[F * r] != 0)
          why += concat("; in the ", group_name, " group of ", who2(r), ": ", theirs[r].substr(2));
    } else {
      // Every first group agreed within itself, so these records are the same for each of them.
      const auto at2 = [&all2](std::size_t r) { return hook_sizes{all2[F * r + 1], all2[F * r + 2], all2[F * r + 3]}; };
      for (std::size_t r = 0; r < R; ++r)
        why += hook_sizes_error(who2(r), "dp_replicate", at2(r), at2(0), all2[4], false, 0);
    }
  }
  EPX_REQUIRE(why.empty(), errc::input, hook, ": the ranks disagree on the gradient they reduce", why,
              "; nothing was reduced");
}

// The agreement of a hook where the communicator takes host arrays without a host
// synchronisation (threads, MPI); nothing on a device communicator.
template <class Comm, class T>
void check_hook_sizes(const char* hook, Comm& group, const char* group_name, Comm& replicas, std::size_t grad,
                      std::size_t shard, bool scatter, int world_rank) {
  if constexpr (!is_device_communicator_v<Comm>) {
    agree_on_hook_sizes(hook, group, group_name, replicas,
                        hook_sizes{static_cast<std::int64_t>(grad), static_cast<std::int64_t>(shard),
                                   static_cast<std::int64_t>(datatype_of<T>())},
                        scatter, {}, world_rank);
  } else {
    (void)hook, (void)group, (void)group_name, (void)replicas, (void)grad, (void)shard, (void)scatter,
        (void)world_rank;
  }
}

// A rank that cannot hand a hook a gradient (`why`, e.g. a binding's tensor of a dtype the
// hooks do not take) in place of the hook's call: on a host communicator it joins the
// agreement, so that every rank of the hook's groups raises errc::input naming it (the
// others call the hook as usual); on a device communicator, where the hooks do not agree,
// it raises on this rank only.
template <class Comm>
[[noreturn]] void refuse_hook(const char* hook, Comm& group, const char* group_name, Comm& replicas, bool scatter,
                              const std::string& why, int world_rank = -1) {
  if constexpr (!is_device_communicator_v<Comm>)
    agree_on_hook_sizes(hook, group, group_name, replicas, {}, scatter, why, world_rank);
  else (void)group, (void)group_name, (void)replicas, (void)scatter, (void)world_rank;
  EPX_THROW(errc::input, hook, ": ", why);
}

}  // namespace detail

// `world_rank` (optional, every hook): this rank's world rank in the mesh, for the messages
// of a disagreement only ("rank 1 of the efsdp group (world rank 5)"); gradient_hooks
// passes it.

// Expert weights replicated over efsdp: grad = (sum over efsdp and dp_replicate) / B.
template <class Comm, class T>
void reduce_expert_gradients(Comm& efsdp, Comm& dp_replicate, const mesh& m, span<T> grad, int world_rank = -1) {
  EPX_REQUIRE(efsdp.size() == m.efsdp() && dp_replicate.size() == m.dp_replicate(), errc::configuration,
              "reduce_expert_gradients: communicator sizes (efsdp ", efsdp.size(), ", dp_replicate ",
              dp_replicate.size(), ") do not match the mesh (efsdp ", m.efsdp(), ", dp_replicate ", m.dp_replicate(),
              ")");
  detail::check_hook_sizes<Comm, T>("reduce_expert_gradients", efsdp, "efsdp", dp_replicate, grad.size(), 0, false,
                                    world_rank);
  all_reduce(efsdp, grad, 1.0 / static_cast<double>(m.batches()));
  if (dp_replicate.size() > 1) all_reduce(dp_replicate, grad);
}

// Expert weights sharded over efsdp: `grad` holds the full gradient [efsdp * shard.size()],
// `shard` receives this rank's block, reduced over efsdp and dp_replicate and divided by B.
template <class Comm, class T>
void reduce_scatter_expert_gradients(Comm& efsdp, Comm& dp_replicate, const mesh& m, span<const T> grad,
                                     span<T> shard, int world_rank = -1) {
  EPX_REQUIRE(efsdp.size() == m.efsdp() && dp_replicate.size() == m.dp_replicate(), errc::configuration,
              "reduce_scatter_expert_gradients: communicator sizes (efsdp ", efsdp.size(), ", dp_replicate ",
              dp_replicate.size(), ") do not match the mesh (efsdp ", m.efsdp(), ", dp_replicate ",
              m.dp_replicate(), ")");
  detail::check_hook_sizes<Comm, T>("reduce_scatter_expert_gradients", efsdp, "efsdp", dp_replicate, grad.size(),
                                    shard.size(), true, world_rank);
  reduce_scatter(efsdp, grad, shard, 1.0 / static_cast<double>(m.batches()));
  if (dp_replicate.size() > 1) all_reduce(dp_replicate, shard);
}

// Dense (non-expert) weights replicated over fsdp and dp_replicate: mean over the B batches.
template <class Comm, class T>
void reduce_dense_gradients(Comm& fsdp, Comm& dp_replicate, const mesh& m, span<T> grad, int world_rank = -1) {
  EPX_REQUIRE(fsdp.size() == m.fsdp() && dp_replicate.size() == m.dp_replicate(), errc::configuration,
              "reduce_dense_gradients: communicator sizes (fsdp ", fsdp.size(), ", dp_replicate ",
              dp_replicate.size(), ") do not match the mesh (fsdp ", m.fsdp(), ", dp_replicate ", m.dp_replicate(),
              ")");
  detail::check_hook_sizes<Comm, T>("reduce_dense_gradients", fsdp, "fsdp", dp_replicate, grad.size(), 0, false,
                                    world_rank);
  all_reduce(fsdp, grad, 1.0 / static_cast<double>(m.batches()));
  if (dp_replicate.size() > 1) all_reduce(dp_replicate, grad);
}

// The sub-communicators the hooks need, made once (collective over `world`; raises
// errc::configuration on every rank when Comm::split did not make the mesh's groups).
template <class Comm>
class gradient_hooks {
  static_assert(check_communicator<Comm>(), "epx::gradient_hooks: Comm must be a communicator");

 public:
  gradient_hooks(const mesh& m, Comm& world)
      : mesh_(m),
        world_rank_(world.rank()),
        efsdp_(std::make_unique<Comm>(sub_communicator(world, m, group_kind::efsdp))),
        fsdp_(std::make_unique<Comm>(sub_communicator(world, m, group_kind::fsdp))),
        dp_replicate_(std::make_unique<Comm>(sub_communicator(world, m, group_kind::dp_replicate))) {
    Comm* const groups[3] = {efsdp_.get(), fsdp_.get(), dp_replicate_.get()};
    const group_kind kinds[3] = {group_kind::efsdp, group_kind::fsdp, group_kind::dp_replicate};
    detail::agree_on_split(world, m, groups, kinds, "gradient_hooks");
  }

  template <class T>
  void reduce_expert(span<T> grad) { reduce_expert_gradients(*efsdp_, *dp_replicate_, mesh_, grad, world_rank_); }
  template <class T>
  void reduce_scatter_expert(span<const T> grad, span<T> shard) {
    reduce_scatter_expert_gradients(*efsdp_, *dp_replicate_, mesh_, grad, shard, world_rank_);
  }
  template <class T>
  void reduce_dense(span<T> grad) { reduce_dense_gradients(*fsdp_, *dp_replicate_, mesh_, grad, world_rank_); }

  const mesh& topology() const noexcept { return mesh_; }
  Comm& efsdp() noexcept { return *efsdp_; }
  Comm& fsdp() noexcept { return *fsdp_; }
  Comm& dp_replicate() noexcept { return *dp_replicate_; }

 private:
  mesh mesh_;
  int world_rank_;
  std::unique_ptr<Comm> efsdp_;
  std::unique_ptr<Comm> fsdp_;
  std::unique_ptr<Comm> dp_replicate_;
};

}  // namespace epx
