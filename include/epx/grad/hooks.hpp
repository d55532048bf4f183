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
#pragma once

#include <cstddef>
#include <memory>

#include "epx/comm/collectives.hpp"
#include "epx/core/error.hpp"
#include "epx/core/span.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx {

// Expert weights replicated over efsdp: grad = (sum over efsdp and dp_replicate) / B.
template <class Comm, class T>
void reduce_expert_gradients(Comm& efsdp, Comm& dp_replicate, const mesh& m, span<T> grad) {
  EPX_REQUIRE(efsdp.size() == m.efsdp() && dp_replicate.size() == m.dp_replicate(), errc::configuration,
              "reduce_expert_gradients: communicator sizes (efsdp ", efsdp.size(), ", dp_replicate ",
              dp_replicate.size(), ") do not match the mesh (efsdp ", m.efsdp(), ", dp_replicate ", m.dp_replicate(),
              ")");
  all_reduce(efsdp, grad, 1.0 / static_cast<double>(m.batches()));
  if (dp_replicate.size() > 1) all_reduce(dp_replicate, grad);
}

// Expert weights sharded over efsdp: `grad` holds the full gradient [efsdp * shard.size()],
// `shard` receives this rank's block, reduced over efsdp and dp_replicate and divided by B.
template <class Comm, class T>
void reduce_scatter_expert_gradients(Comm& efsdp, Comm& dp_replicate, const mesh& m, span<const T> grad,
                                     span<T> shard) {
  EPX_REQUIRE(efsdp.size() == m.efsdp() && dp_replicate.size() == m.dp_replicate(), errc::configuration,
              "reduce_scatter_expert_gradients: communicator sizes (efsdp ", efsdp.size(), ", dp_replicate ",
              dp_replicate.size(), ") do not match the mesh (efsdp ", m.efsdp(), ", dp_replicate ",
              m.dp_replicate(), ")");
  reduce_scatter(efsdp, grad, shard, 1.0 / static_cast<double>(m.batches()));
  if (dp_replicate.size() > 1) all_reduce(dp_replicate, shard);
}

// Dense (non-expert) weights replicated over fsdp and dp_replicate: mean over the B batches.
template <class Comm, class T>
void reduce_dense_gradients(Comm& fsdp, Comm& dp_replicate, const mesh& m, span<T> grad) {
  EPX_REQUIRE(fsdp.size() == m.fsdp() && dp_replicate.size() == m.dp_replicate(), errc::configuration,
              "reduce_dense_gradients: communicator sizes (fsdp ", fsdp.size(), ", dp_replicate ",
              dp_replicate.size(), ") do not match the mesh (fsdp ", m.fsdp(), ", dp_replicate ", m.dp_replicate(),
              ")");
  all_reduce(fsdp, grad, 1.0 / static_cast<double>(m.batches()));
  if (dp_replicate.size() > 1) all_reduce(dp_replicate, grad);
}

// The sub-communicators the hooks need, made once (collective over `world`).
template <class Comm>
class gradient_hooks {
 public:
  gradient_hooks(const mesh& m, const Comm& world)
      : mesh_(m),
        efsdp_(std::make_unique<Comm>(sub_communicator(world, m, group_kind::efsdp))),
        fsdp_(std::make_unique<Comm>(sub_communicator(world, m, group_kind::fsdp))),
        dp_replicate_(std::make_unique<Comm>(sub_communicator(world, m, group_kind::dp_replicate))) {}

  template <class T>
  void reduce_expert(span<T> grad) { reduce_expert_gradients(*efsdp_, *dp_replicate_, mesh_, grad); }
  template <class T>
  void reduce_scatter_expert(span<const T> grad, span<T> shard) {
    reduce_scatter_expert_gradients(*efsdp_, *dp_replicate_, mesh_, grad, shard);
  }
  template <class T>
  void reduce_dense(span<T> grad) { reduce_dense_gradients(*fsdp_, *dp_replicate_, mesh_, grad); }

  const mesh& topology() const noexcept { return mesh_; }
  Comm& efsdp() noexcept { return *efsdp_; }
  Comm& fsdp() noexcept { return *fsdp_; }
  Comm& dp_replicate() noexcept { return *dp_replicate_; }

 private:
  mesh mesh_;
  std::unique_ptr<Comm> efsdp_;
  std::unique_ptr<Comm> fsdp_;
  std::unique_ptr<Comm> dp_replicate_;
};

}  // namespace epx
