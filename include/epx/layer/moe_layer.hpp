// epx/layer/moe_layer.hpp: the expert-parallel MoE layer a user instantiates.
//
//   epx::layer_options options;  options.hidden = H;  options.top_k = k;
//   epx::moe_layer<Comm, T, Impl, Exec> layer(mesh, world, options);
//   epx::moe_layer<Comm, T, Impl, Exec> layer(mesh, world_rank, ep_comm, tp_comm, options);  // own groups
//   auto saved = layer.forward(x, ids, weights, out, experts, epx::mode::train);  // or mode::inference
//   layer.backward(std::move(saved), grad_out, grad_x, grad_weights, experts);
//   layer.stats();   // load of the last call that completed
//
// The same calls in phases (spec section 13; handles in epx/layer/split.hpp), so that a
// caller runs one micro-batch's experts while another's rows travel:
//   auto h = layer.dispatch_start(x, ids, weights, mode);  layer.dispatch_wait(h);
//   experts.forward(policy, h.inputs(), h.outputs().data());
//   layer.combine_start(h, h.outputs(), out);  auto saved = layer.combine_wait(h);
//   auto g = layer.backward_dispatch_start(std::move(saved), grad_out, grad_weights);  ...
// bitwise the results of forward and backward, which are made of the same stages.
//
// Comm: a communicator (threads, MPI, NCCL). T: float, double, bf16 or fp16 activations.
// Impl: impl::all_to_all (default), impl::all_reduce (ep == tp), impl::automatic, or a
// user type meeting the concept of epx/impl/implementation.hpp. Exec: an execution
// policy (exec::serial, exec::openmp, exec::cuda; epx/exec/policy.hpp). Each is checked
// with a static_assert that names what is missing.
//
// Construction is collective over `world` (it makes the ep and tp sub-communicators once),
// or, from communicators the caller already has, over the ep and tp groups. Either way it
// checks that every rank built the same mesh, options, T, Impl and kind of Exec (host or
// device policy), that the communicators match the mesh (sizes, members), that the
// implementation runs this mesh (can_implement), that a device communicator runs on the
// policy's stream, and that a host communicator (threads, MPI) is not handed a policy
// whose memory the host cannot touch (exec::host_addressable_v false: exec::cuda) unless
// it moves device memory (threads over threads::device_memory()); any failure raises
// errc::configuration on every rank, naming the rank and the values
// (epx/layer/agreement.hpp).
// Every call is collective over the EP group. Bad input on any rank (shapes, expert ids,
// non-finite weights) raises epx::error(errc::input) on every rank of the EP group before
// any row moves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "epx/comm/collectives.hpp"
#include "epx/comm/communicator.hpp"
#include "epx/comm/settle.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/impl/all_reduce.hpp"
#include "epx/impl/automatic.hpp"
#include "epx/impl/bounded.hpp"
#include "epx/impl/all_to_all.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/impl/limits.hpp"
#include "epx/exec/host.hpp"
#include "epx/exec/policy.hpp"
#include "epx/layer/agreement.hpp"
#include "epx/layer/split.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/options.hpp"
#include "epx/impl/stats.hpp"
#include "epx/kernels/fp8.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx {
namespace detail {
template <class Impl, class Comm, class = void>
struct bind_impl {
  using type = Impl;  // a user implementation written for one communicator type
};
template <class Impl, class Comm>
struct bind_impl<Impl, Comm, std::void_t<typename Impl::template with<Comm>>> {
  using type = typename Impl::template with<Comm>;  // a tag with `template <class C> using with`
};
}  // namespace detail

template <class Impl, class Comm>
using impl_for_t = typename detail::bind_impl<Impl, Comm>::type;

template <class Comm, class T, class Impl = impl::all_to_all, class Exec = exec::serial>
class moe_layer {
  static_assert(is_activation_type_v<T>, "epx::moe_layer: T must be float, double, epx::bf16 or epx::fp16");
  static_assert(check_communicator<Comm>(), "epx::moe_layer: Comm must be a communicator");
  static_assert(exec::check_execution_policy<Exec>(), "epx::moe_layer: Exec must be an execution policy");

 public:
  using value_type = T;
  using impl_type = impl_for_t<Impl, Comm>;
  static_assert(check_implementation<impl_type, Comm>(), "epx::moe_layer: Impl must be an implementation");

  // Collective over `world`: makes the ep and tp sub-communicators. Raises
  // errc::configuration on every rank when a rank's mesh does not fit `world`, its options
  // do not fit the mesh or the implementation, two ranks built different meshes, options,
  // T or Impl, or one a host and another a device policy, or when Comm::split did not
  // make the mesh's groups (members ordered by (key, rank)).
  moe_layer(const mesh& m, Comm& world, const layer_options& options, Exec policy = Exec{})
      : mesh_(std::make_unique<mesh>(m)), exec_(policy), options_(options) {
    std::string why = local_check(m, world.size(), options_);
    if (why.empty()) why = queue_check(world, policy);
    if (why.empty()) why = memory_check(world);
    detail::agree_on_layer(world, m, options_, world.rank(), "world", why, types());
    ep_ = std::make_unique<Comm>(sub_communicator(world, m, group_kind::ep));
    tp_ = std::make_unique<Comm>(sub_communicator(world, m, group_kind::tp));
    {
      Comm* const groups[2] = {ep_.get(), tp_.get()};
      const group_kind kinds[2] = {group_kind::ep, group_kind::tp};
      detail::agree_on_split(world, m, groups, kinds, "moe_layer");
    }
    start(world.rank());
  }

  // For frameworks that already have the groups: `ep` and `tp` are this rank's EP and TP
  // communicators of mesh `m` (their members in the mesh's order), `world_rank` this rank's
  // place in the mesh. Collective over ep and over tp; the layer keeps its own copies of
  // the communicators. Raises errc::configuration on every rank of a group whose sizes,
  // members, mesh or options disagree.
  moe_layer(const mesh& m, int world_rank, Comm ep, Comm tp, const layer_options& options, Exec policy = Exec{})
      : mesh_(std::make_unique<mesh>(m)), exec_(policy), options_(options) {
    std::string why = local_check(m, m.world(), options_);
    if (why.empty()) why = group_check(m, world_rank, ep.size(), ep.rank(), tp.size(), tp.rank());
    if (why.empty()) why = queue_check(ep, policy);
    if (why.empty()) why = queue_check(tp, policy);
    if (why.empty()) why = memory_check(ep);
    if (why.empty()) why = memory_check(tp);
    // Every rank joins all four collectives whatever their verdicts, then raises the first:
    // a tp communicator that crosses ep communicators would otherwise leave the ranks of a
    // group that passed waiting for those of a group that raised.
    std::exception_ptr first;
    const auto join = [&first](auto&& agree) {
      try {
        agree();
      } catch (const error&) {
        if (!first) first = std::current_exception();
      }
    };
    join([&] { detail::agree_on_layer(ep, m, options_, world_rank, "ep", why, types()); });
    join([&] { detail::agree_on_layer(tp, m, options_, world_rank, "tp", why, types()); });
    join([&] { detail::agree_on_group(ep, m, group_kind::ep, world_rank); });
    join([&] { detail::agree_on_group(tp, m, group_kind::tp, world_rank); });
    if (first) std::rethrow_exception(first);
    ep_ = std::make_unique<Comm>(std::move(ep));
    tp_ = std::make_unique<Comm>(std::move(tp));
    start(world_rank);
  }

  // x: [N, H]; ids, weights: [N, k]; out: [N, H] (fully written). Returns what backward
  // needs for mode::train, an empty handle for mode::inference.
  template <class Experts>
  saved_state<T> forward(span<const T> x, span<const std::int32_t> ids, span<const float> weights, span<T> out,
                         Experts& experts, mode m) {
    check_experts_forward<Experts, Exec, T>();
    check_implementation_calls<impl_type, Exec, T, Experts>();
    require_live("forward");
    require_queues("forward");
    // The same on every rank (agreed options, one Experts type): raised before any row moves.
    if (options_.fp8_dispatch)
      EPX_REQUIRE((has_fp8_forward_v<Experts, Exec, T>), errc::configuration,
                  "layer_options::fp8_dispatch needs experts with `forward(const Exec&, const "
                  "epx::expert_rows<const epx::fp8_e4m3>&, const float* scales, T* out)` (epx/impl/experts.hpp)");
    else if (options_.counts == count_exchange::device)  // bounded mode, which refuses fp8_dispatch
      EPX_REQUIRE((detail::has_expert_forward<Experts, Exec, T>::value), errc::configuration,
                  "bounded mode needs experts with `forward(const Exec&, const epx::expert_rows<const T>&, T* out)`: "
                  "these experts take only FP8 rows, and layer_options::fp8_dispatch is not available in bounded mode");
    else
      EPX_REQUIRE((detail::has_expert_forward<Experts, Exec, T>::value), errc::configuration,
                  "these experts take only FP8 rows: set layer_options::fp8_dispatch");
    const std::size_t H = options_.hidden, N = x.size() / H;
    const auto k = static_cast<std::size_t>(options_.top_k);
    forward_args<T> a;
    a.x = x.data();
    a.ids = ids.data();
    a.weights = weights.data();
    a.out = out.data();
    const std::string msg = shape_error("x", x.size(), {{"expert ids have", ids.size(), N, k, "N*k"},
                                                       {"routing weights have", weights.size(), N, k, "N*k"},
                                                       {"out has", out.size(), N, H, "N*H"}});
    set_shape(a, N, msg);
    require_in_step("forward");
    const std::uint64_t serial = forward_calls_ + 1;
    if (bound_) forward_calls_ = serial;  // bounded mode counts the calls that raise too (forward_calls_)
    saved_state<T> saved;
    const long long syncs = detail::host_syncs_on_this_thread();
    keeping_stats([&] {
      bounded_call("forward", [&] { impl_->forward(exec_, a, experts, m == mode::train ? &saved : nullptr); });
    });
    forward_calls_ = serial;
    saved.stamp(id_, serial);
    stats_->host_syncs = detail::host_syncs_on_this_thread() - syncs;
    stats_->calls += 1;
    if (stats_->path == nullptr || stats_->path[0] == '\0') stats_->path = detail::impl_name<impl_type>::value;
    return saved;
  }

  // grad_out: [N, H]; grad_x: [N, H]; grad_weights: [N, k] (both fully written, per batch,
  // unscaled). The user's experts accumulate their parameter gradients; reduce them with
  // epx/grad/hooks.hpp. Consumes the saved state, except when every rank of the group
  // raises at the call's input check (bad sizes on some rank, or ranks that take back
  // different forward calls; in the normal mode, bounded mode counting different calls for
  // check()): then the states stay, and the call may be made again. An empty or foreign
  // state (another implementation's or another layer's) on one rank raises errc::input on
  // every rank of the group (bounded mode: on that rank, then on every rank at the next
  // check()).
  template <class Experts>
  void backward(saved_state<T>&& saved, span<const T> grad_out, span<T> grad_x, span<float> grad_weights,
                Experts& experts) {
    check_experts_backward<Experts, Exec, T>();
    require_live("backward");
    require_queues("backward");
    const std::size_t H = options_.hidden, N = grad_out.size() / H;
    const auto k = static_cast<std::size_t>(options_.top_k);
    backward_args<T> a;
    a.grad_out = grad_out.data();
    a.grad_x = grad_x.data();
    a.grad_weights = grad_weights.data();
    const std::string msg = shape_error("grad_out", grad_out.size(), {{"grad_x has", grad_x.size(), N, H, "N*H"},
                                                                     {"grad_weights have", grad_weights.size(), N, k, "N*k"}});
    set_shape(a, N, msg);
    require_in_step("backward");
    const long long syncs = detail::host_syncs_on_this_thread();
    // Experts without a backward get the static_assert above alone, not the errors of the
    // implementation's calls after it.
    if constexpr (detail::has_expert_backward<Experts, Exec, T>::value)
      keeping_stats([&] {
        consume(saved, [&] { bounded_call("backward", [&] { impl_->backward(exec_, a, experts, saved); }); });
      });
    stats_->host_syncs = detail::host_syncs_on_this_thread() - syncs;
  }

  // ---- Split phase (spec section 13) ---------------------------------------------------
  // forward = dispatch_start, dispatch_wait, the caller's experts, combine_start,
  // combine_wait; backward likewise. Each start is collective over the EP group (all ranks
  // make the starts of their calls in the same order); each wait is local. On host
  // communicators a start does its communication before it returns (the wait completes the
  // phase and checks the handle); a caller overlaps by running experts elsewhere (another
  // thread, a device stream) while this thread starts the next call. Bad input raises in
  // the start on every rank of the group (as in forward); a handle in the wrong phase, of
  // another layer, or outputs of the wrong size raise errc::configuration (handles) or
  // errc::input (sizes) in combine_start on every rank of the group, and in a wait on the
  // rank that makes it.

  // x: [N, H]; ids, weights: [N, k]; read before the call returns. The rows land in the
  // handle's expert-major buffer (h.inputs() after dispatch_wait).
  forward_handle<T> dispatch_start(span<const T> x, span<const std::int32_t> ids, span<const float> weights, mode m) {
    static_assert(check_split_phase<impl_type, Exec, T>(), "epx::moe_layer: split phase");
    require_live("dispatch_start");
    require_queues("dispatch_start");
    const std::size_t H = options_.hidden, N = x.size() / H;
    const auto k = static_cast<std::size_t>(options_.top_k);
    forward_args<T> a;
    a.x = x.data();
    a.ids = ids.data();
    a.weights = weights.data();
    const std::string msg = shape_error("x", x.size(), {{"expert ids have", ids.size(), N, k, "N*k"},
                                                       {"routing weights have", weights.size(), N, k, "N*k"}});
    set_shape(a, N, msg);
    forward_handle<T> h;
    const long long syncs = detail::host_syncs_on_this_thread();
    keeping_stats([&] { h.batch_ = impl_->dispatch(exec_, a, h.call_.flight, m == mode::train, false); });
    h.call_.host_syncs = detail::host_syncs_on_this_thread() - syncs;
    h.call_.layer = id_;
    h.call_.serial = ++forward_calls_;  // counted once it completed (forward_calls_)
    h.call_.tokens = N;
    h.training_ = m == mode::train;
    h.call_.phase = detail::split_phase::dispatching;
    return h;
  }
  void dispatch_wait(forward_handle<T>& h) {
    wait_for(h.call_, detail::split_phase::dispatching, "dispatch_wait");
  }
  forward_handle<T> dispatch(span<const T> x, span<const std::int32_t> ids, span<const float> weights, mode m) {
    forward_handle<T> h = dispatch_start(x, ids, weights, m);
    dispatch_wait(h);
    return h;
  }
  // expert_outputs: [h.inputs().num_rows, H], the experts' outputs (h.outputs() itself, or
  // a buffer of the policy's memory that is copied there); out: [N, H], all written by
  // combine_wait.
  void combine_start(forward_handle<T>& h, span<const T> expert_outputs, span<T> out) {
    start_combine(h, "combine_start", "the expert outputs", expert_outputs, h.batch_.out, "out", out.size(),
                  [&] { impl_->combine(exec_, h.call_.flight, out.data(), h.training_ ? &h.saved_ : nullptr); });
  }
  // out is final; returns what backward needs for mode::train, an empty state otherwise.
  saved_state<T> combine_wait(forward_handle<T>& h) {
    wait_for(h.call_, detail::split_phase::combining, "combine_wait");
    stats_->host_syncs = h.call_.host_syncs;
    stats_->calls += 1;
    if (stats_->path == nullptr || stats_->path[0] == '\0') stats_->path = detail::impl_name<impl_type>::value;
    h.saved_.stamp(id_, h.call_.serial);
    return std::move(h.saved_);
  }
  saved_state<T> combine(forward_handle<T>& h, span<const T> expert_outputs, span<T> out) {
    combine_start(h, expert_outputs, out);
    return combine_wait(h);
  }

  // Consumes the saved state; grad_out: [N, H], read before the call returns;
  // grad_weights: [N, k], all written once backward_combine_wait returns (keep it until
  // then). The experts read g.inputs() and g.grad_outputs() and write g.grad_inputs().
  backward_handle<T> backward_dispatch_start(saved_state<T>&& saved, span<const T> grad_out, span<float> grad_weights) {
    static_assert(check_split_phase<impl_type, Exec, T>(), "epx::moe_layer: split phase");
    require_live("backward_dispatch_start");
    require_queues("backward_dispatch_start");
    const std::uint64_t serial = ++backward_starts_;
    const std::size_t H = options_.hidden, N = grad_out.size() / H;
    const auto k = static_cast<std::size_t>(options_.top_k);
    backward_args<T> a;
    a.grad_out = grad_out.data();
    a.grad_weights = grad_weights.data();
    const std::string msg =
        shape_error("grad_out", grad_out.size(), {{"grad_weights have", grad_weights.size(), N, k, "N*k"}});
    set_shape(a, N, msg);
    backward_handle<T> h;
    const long long syncs = detail::host_syncs_on_this_thread();
    keeping_stats(
        [&] { consume(saved, [&] { h.batch_ = impl_->backward_dispatch(exec_, a, saved, h.call_.flight); }); });
    h.call_.host_syncs = detail::host_syncs_on_this_thread() - syncs;
    h.call_.layer = id_;
    h.call_.serial = serial;
    h.call_.tokens = N;
    h.call_.phase = detail::split_phase::dispatching;
    return h;
  }
  void backward_dispatch_wait(backward_handle<T>& h) {
    wait_for(h.call_, detail::split_phase::dispatching, "backward_dispatch_wait");
  }
  backward_handle<T> backward_dispatch(saved_state<T>&& saved, span<const T> grad_out, span<float> grad_weights) {
    backward_handle<T> h = backward_dispatch_start(std::move(saved), grad_out, grad_weights);
    backward_dispatch_wait(h);
    return h;
  }
  // grad_inputs: [g.inputs().num_rows, H], the experts' input gradients (g.grad_inputs()
  // itself, or a buffer of the policy's memory copied there); grad_x: [N, H], all written
  // by backward_combine_wait.
  void backward_combine_start(backward_handle<T>& h, span<const T> grad_inputs, span<T> grad_x) {
    start_combine(h, "backward_combine_start", "the experts' input gradients", grad_inputs, h.batch_.grad_in, "grad_x",
                  grad_x.size(), [&] { impl_->backward_combine(exec_, h.call_.flight, grad_x.data()); });
  }
  void backward_combine_wait(backward_handle<T>& h) {
    wait_for(h.call_, detail::split_phase::combining, "backward_combine_wait");
    stats_->host_syncs = h.call_.host_syncs;
  }
  void backward_combine(backward_handle<T>& h, span<const T> grad_inputs, span<T> grad_x) {
    backward_combine_start(h, grad_inputs, grad_x);
    backward_combine_wait(h);
  }

  // The statistics of the last call (section 6 of docs/layer.md). A layer that was moved
  // from raises errc::configuration here, as its calls do.
  const layer_stats& stats() const {
    require_live("stats");
    return *stats_;
  }

  // Bounded mode (layer_options::counts == count_exchange::device, spec section 11).
  // Collective over the EP group and a synchronising call: sums the group's counters since
  // the last check (then resets them) and returns them; raises errc::input on every rank
  // when a call had bad input, and when pairs overflowed the bound with
  // layer_options::bound.raise_on_overflow. In the normal mode it returns an empty report.
  bound_report check() {
    require_live("check");
    if (!bound_) return {};
    require_queues("check");
    require_in_step("check");
    return detail::check_bound(exec_, *ep_, *static_cast<detail::bound_buffers<T, Exec>*>(bound_.get()), rank_);
  }
  // The same over `group`, a communicator made of whole EP groups (typically the world):
  // the counters of all its ranks, raised on all of them. With several EP groups
  // (dp_replicate > 1, or efsdp > 1) check() raises in one group only, and the others go on
  // into collectives (the gradient hooks) that wait for the raising ranks until their
  // timeout; a check over the world raises everywhere at once. Collective over `group`.
  bound_report check(Comm& group) {
    require_live("check");
    if (!bound_) return {};
    require_queues("check");
    require_in_step("check");
    EPX_REQUIRE(group.size() % ep_->size() == 0, errc::configuration, "moe_layer::check(group) (rank ", rank_,
                "): the group has ", group.size(), " ranks, not a multiple of the EP group's ", ep_->size(),
                ": it must be made of whole EP groups");
    return detail::check_bound(exec_, group, *static_cast<detail::bound_buffers<T, Exec>*>(bound_.get()), rank_,
                               "the group");
  }
  // Bounded mode: this rank's counters in the execution policy's memory, read when the
  // caller likes (no synchronisation here): [0] pairs it dropped beyond the bound as a
  // sender, [1] calls with bad expert ids or weights, [2] calls with bad shapes (or
  // backwards of different forward calls), [3] calls, then [E] dropped pairs per global expert; reset by check(). Null in the normal mode.
  const std::int64_t* overflow_counter() const noexcept {
    return bound_ ? static_cast<const detail::bound_buffers<T, Exec>*>(bound_.get())->counters.data() : nullptr;
  }
  // The node limit of layer_options::ranks_per_node and max_nodes, for the routing policies
  // (`policy.limit = layer.node_limit();`); no limit when max_nodes is 0.
  // The accessors of what the layer holds on the heap (node_limit, topology, the
  // communicators, like stats) raise errc::configuration on a layer that was moved from;
  // options() and policy() are the layer's own copies and stay readable, and
  // overflow_counter() is null there.
  routing::node_limit node_limit() const {
    require_live("node_limit");
    return detail::node_limit_for(*mesh_, options_);
  }
  const mesh& topology() const {
    require_live("topology");
    return *mesh_;
  }
  const layer_options& options() const noexcept { return options_; }
  const Exec& policy() const noexcept { return exec_; }
  Comm& ep_communicator() {
    require_live("ep_communicator");
    return *ep_;
  }
  Comm& tp_communicator() {
    require_live("tp_communicator");
    return *tp_;
  }

 private:
  // The shape fields every call's arguments carry; `msg` must outlive the call.
  template <class Args>
  void set_shape(Args& a, std::size_t rows, const std::string& msg) const {
    a.rows = rows;
    a.hidden = options_.hidden;
    a.top_k = options_.top_k;
    a.status = msg.empty() ? 0 : 1;
    a.status_message = msg.c_str();
  }

  // Runs one of the implementation's calls so that, when it raises, the statistics are
  // those from before it: the implementation fills them as the call goes (the routing
  // figures after the count exchange, the route, the rounds), and a call that fails midway
  // (its experts threw, a collective failed) would otherwise leave its first figures beside
  // the last completed call's. The copy reuses kept_stats_'s storage from call to call.
  template <class Call>
  void keeping_stats(Call call) {
    kept_stats_ = *stats_;
    try {
      call();
    } catch (...) {
      std::swap(*stats_, kept_stats_);
      throw;
    }
  }

  // Runs a backward call that consumes `saved`. The built-in implementations move the state
  // out only once every rank's input has passed the call's check, so a call that the whole
  // group rejects leaves it for a retry; in bounded mode (no such check: the peers go on)
  // and once the call has run it is consumed.
  template <class Call>
  void consume(saved_state<T>& saved, Call call) {
    try {
      call();
    } catch (...) {
      if (bound_) saved.reset();
      throw;
    }
    saved.reset();
  }

  // Bounded mode has no exchange that would see ranks out of step: a fused call that an
  // exception ends on this rank before its last collective (the experts threw, a collective
  // failed; the routes' bound_buffers::in_call) leaves its peers inside the call, where
  // this rank's next collectives would pair with theirs. The layer then refuses every
  // later call on this rank (require_in_step). A call that raises after joining all its
  // collectives (bad shapes, an empty saved state) leaves the ranks in step.
  template <class Call>
  void bounded_call(const char* call, Call run) {
    if (!bound_) return run();
    auto& b = *static_cast<detail::bound_buffers<T, Exec>*>(bound_.get());
    try {
      run();
    } catch (...) {
      if (b.in_call) {
        b.in_call = false;
        out_of_step_ = detail::concat("its ", call, " ended before its last collective: ",
                                      detail::describe_exception(std::current_exception()));
      }
      throw;
    }
  }
  void require_in_step(const char* call) const {
    EPX_REQUIRE(out_of_step_.empty(), errc::communicator, "moe_layer ", call, " (rank ", rank_,
                "): bounded mode: an earlier call of this layer on this rank failed (", out_of_step_,
                "); the other ranks of the expert-parallel group may still be inside that call, so this rank's "
                "collectives would pair with theirs: the layer cannot be used any more on this rank");
  }

  // A layer that was moved from has no implementation, communicators or buffers left (they
  // went to the layer it was moved into): its calls and the accessors of that state raise
  // on the rank that makes them.
  void require_live(const char* call) const {
    EPX_REQUIRE(impl_ != nullptr, errc::configuration, "moe_layer ", call, " (rank ", rank_,
                "): this layer was moved from; its state belongs to the layer it was moved into");
  }

  // A device communicator's queue can change after construction (set_stream through
  // ep_communicator() or tp_communicator()), and its collectives would then no longer be
  // ordered after the policy's work. Each collective call compares the queues again before
  // anything is queued: errc::configuration on this rank (a rank whose queues still match
  // goes into the call and waits for it until the communicator's time limit).
  void require_queues(const char* call) const {
    if constexpr (detail::is_device_communicator_v<Comm>) {
      const char* which = "ep";
      std::string why = queue_check(*ep_, exec_);
      if (why.empty()) {
        which = "tp";
        why = queue_check(*tp_, exec_);
      }
      EPX_REQUIRE(why.empty(), errc::configuration, "moe_layer ", call, " (rank ", rank_, "): the layer's ", which,
                  " communicator no longer matches the policy it was built with: ", why);
    }
    (void)call;
  }

  // The start of a split combine, forward or backward (`call`): raises on every rank of the
  // EP group when a rank's handle is not dispatched, or its experts' rows (`rows`, "<rows_are>
  // have ...") or its output (`out_size` elements, "<out_is> has ...") have the wrong size;
  // copies the rows where the route reads them (`route_rows`), runs `combine` and empties
  // the handle, which is spent from then on.
  template <class Handle, class Combine>
  void start_combine(Handle& h, const char* call, const char* rows_are, span<const T> rows, T* route_rows,
                     const char* out_is, std::size_t out_size, Combine combine) {
    static_assert(check_split_phase<impl_type, Exec, T>(), "epx::moe_layer: split phase");
    require_live(call);
    require_queues(call);
    errc category = errc::configuration;
    std::string why = phase_error(h.call_, detail::split_phase::dispatched, call);
    if (why.empty()) {
      category = errc::input;
      const std::size_t H = options_.hidden, R = h.batch_.in.num_rows, N = h.call_.tokens;
      if (rows.size() != R * H)
        why = detail::concat(call, ": ", rows_are, " have ", rows.size(), " elements but the dispatched rows need rows*H = ",
                             R, "*", H, " = ", R * H);
      else if (out_size != N * H)
        why = detail::concat(call, ": ", out_is, " has ", out_size, " elements but N*H = ", N, "*", H, " = ", N * H);
    }
    const long long syncs = detail::host_syncs_on_this_thread();
    const std::string what = detail::concat("moe_layer ", call);
    detail::agree_on_phase(*ep_, !why.empty(), category, why, rank_, h.call_.serial, what.c_str());
    if (rows.size() > 0 && rows.data() != route_rows) exec::copy_n(exec_, rows.data(), rows.size(), route_rows);
    h.call_.phase = detail::split_phase::combining;  // spent from here, whatever happens below
    keeping_stats(combine);
    h.call_.flight.reset();
    h.batch_ = {};
    h.call_.host_syncs += detail::host_syncs_on_this_thread() - syncs;
  }

  // Why a split call's handle cannot take phase `want` here ("" when it can).
  std::string phase_error(const detail::split_call<T>& c, detail::split_phase want, const char* call) const {
    if (c.phase == detail::split_phase::empty)
      return detail::concat(call, " got an empty handle (default-constructed, moved from, or never started)");
    if (c.layer != id_) return detail::concat(call, " got a handle made by another layer");
    if (c.phase != want)
      return detail::concat(call, " needs a handle whose phase is '", to_string(want), "' but this one's is '",
                            to_string(c.phase), "'", phase_hint(c.phase, want, call));
    return {};
  }
  // What the caller does about a handle in phase `have` where `want` was needed: the call
  // that moves it on, or that each phase runs once.
  static std::string phase_hint(detail::split_phase have, detail::split_phase want, const char* call) {
    if (static_cast<int>(have) > static_cast<int>(want)) return ": each phase of a handle runs once";
    const bool back = std::string(call).rfind("backward_", 0) == 0;
    const char* next = "";
    switch (have) {
      case detail::split_phase::dispatching: next = "dispatch_wait"; break;
      case detail::split_phase::dispatched: next = "combine_start"; break;
      case detail::split_phase::combining: next = "combine_wait"; break;
      default: return {};
    }
    return detail::concat(": call ", back ? "backward_" : "", next, " on it first");
  }
  // A wait: local (no communication), raises errc::configuration on this rank when the
  // handle is not in the phase its start left it in.
  void wait_for(detail::split_call<T>& c, detail::split_phase started, const char* call) const {
    require_live(call);
    const std::string why = phase_error(c, started, call);
    EPX_REQUIRE(why.empty(), errc::configuration, why, " (rank ", rank_, ")");
    c.phase = static_cast<detail::split_phase>(static_cast<int>(started) + 1);
  }

  struct size_rule {
    const char* what;  // "out has"
    std::size_t have, rows, cols;
    const char* product;  // "N*H"
  };
  // The first shape mismatch of a call as a sentence ("" when the shapes fit): `first`
  // holds whole rows of H; every rule's tensor holds rows*cols elements (cols: H or k, >= 1).
  // k is named as the option it comes from: tensors made for another k than the layer's
  // (top_k left at its default 1) fail here.
  std::string shape_error(const char* first, std::size_t first_size, std::initializer_list<size_rule> rules) const {
    const std::size_t H = options_.hidden;
    if (first_size % H != 0)
      return detail::concat(first, " has ", first_size, " elements, not a multiple of the hidden size H=", H);
    // Divided, not multiplied: rows*cols may wrap (N = 2^61 rows and k = 8 give 0), and a
    // tensor of the wrapped size must not pass.
    for (const auto& r : rules)
      if (r.have % r.cols != 0 || r.have / r.cols != r.rows)
        return detail::concat(r.what, " ", r.have, " elements but ", r.product, " = ", r.rows, "*", r.cols, " = ",
                              r.rows > SIZE_MAX / r.cols ? std::string("more than SIZE_MAX")
                                                         : std::to_string(r.rows * r.cols),
                              std::string(r.product) == "N*k" ? " (k is layer_options.top_k)" : "");
    return {};
  }

  // This rank's own checks, as a sentence ("" when fine): the mesh against a world of
  // `world_size` ranks, the options against the mesh and the implementation.
  static std::string local_check(const mesh& m, int world_size, const layer_options& o) {
    try {
      m.validate_world(world_size);
      m.validate_top_k(o.top_k);
      EPX_REQUIRE(o.hidden >= 1, errc::configuration, "layer_options.hidden (", o.hidden, ") must be at least 1");
      EPX_REQUIRE(o.hidden <= detail::max_buffer_bytes / sizeof(T), errc::configuration, "layer_options.hidden (",
                  o.hidden, ") is too large: a row of hidden * sizeof(T) bytes must stay within ",
                  detail::max_buffer_bytes, " bytes (hidden at most ", detail::max_buffer_bytes / sizeof(T), ")");
      o.pad.validate();
      const int counts = static_cast<int>(o.counts);
      EPX_REQUIRE(counts == 0 || counts == 1, errc::configuration, "layer_options.counts (", counts,
                  ") must be count_exchange::host or count_exchange::device");
      const std::string bound = detail::bound_check(m, o);  // bounded mode (epx/impl/bounded.hpp)
      EPX_REQUIRE(bound.empty(), errc::configuration, bound);
      detail::validate_limits(m, o);  // capacity, ranks_per_node, max_nodes (epx/impl/limits.hpp)
      if (o.fp8_dispatch) kernels::check_fp8_hidden(o.hidden);
      const int sends = static_cast<int>(o.sends);
      EPX_REQUIRE(sends == 0 || sends == 1, errc::configuration, "layer_options.sends (", sends,
                  ") must be row_sends::per_slot or row_sends::per_rank");
      EPX_REQUIRE(!(o.fp8_dispatch && o.sends == row_sends::per_rank), errc::configuration,
                  "layer_options.sends == row_sends::per_rank is not available with fp8_dispatch: the FP8 rows "
                  "travel once per slot");
      return can_implement<impl_type>(m, o);
    } catch (const error& e) {
      return e.message();
    }
  }

  // The caller's communicators against the mesh, as a sentence ("" when they fit).
  static std::string group_check(const mesh& m, int world_rank, int ep_size, int ep_rank, int tp_size, int tp_rank) {
    if (world_rank < 0 || world_rank >= m.world())
      return detail::concat("world rank (", world_rank, ") out of range [0, ", m.world(),
                            "): the layer's world_rank is this rank's rank in the mesh's world (the communicator whose "
                            "ranks the mesh numbers), not in a larger job that holds it");
    if (ep_size != m.ep())
      return detail::concat("the ep communicator has ", ep_size, " ranks but the mesh has ep=", m.ep());
    if (tp_size != m.tp())
      return detail::concat("the tp communicator has ", tp_size, " ranks but the mesh has tp=", m.tp());
    if (ep_rank != m.ep_rank(world_rank))
      return detail::concat("world rank ", world_rank, " is rank ", ep_rank, " of the ep communicator but rank ",
                            m.ep_rank(world_rank), " of the mesh's ep group");
    if (tp_rank != m.coords(world_rank).tp)
      return detail::concat("world rank ", world_rank, " is rank ", tp_rank, " of the tp communicator but rank ",
                            m.coords(world_rank).tp, " of the mesh's tp group");
    return {};
  }

  // A host communicator (threads, MPI) reads and writes the layer's buffers from the host:
  // the policy's memory must be host memory, or the communicator must say that it moves
  // device memory (threads over threads::device_memory()).
  static std::string memory_check(const Comm& c) {
    if constexpr (!exec::host_addressable_v<Exec> && !detail::is_device_communicator_v<Comm>) {
      if constexpr (detail::has_device_buffers<Comm>::value) {
        if (c.device_buffers()) return {};
      }
      return "the execution policy's buffers are device memory, which this communicator would touch from the "
             "host: use epx::nccl::communicator, or threads over threads::device_memory()";
    }
    (void)c;
    return {};
  }

  // A device communicator runs its collectives on its own queue (a CUDA stream); the layer
  // orders them after the policy's work by running both on one queue, so they must match.
  static std::string queue_check(const Comm& c, const Exec& policy) {
    if constexpr (detail::is_device_communicator_v<Comm>) {
      using exec::same_queue;  // found by argument-dependent lookup for exec::cuda and the others
      if (!same_queue(c.execution(), policy))
        return "the communicator runs on another device queue (stream) than the execution policy: build the policy "
               "on the communicator's stream (e.g. exec::cuda{comm.stream()}) or set_stream the communicator";
    }
    (void)c;
    (void)policy;
    return {};
  }

  // What the ranks' records say of T, Impl and Exec.
  static detail::layer_types types() {
    detail::layer_types t;
    t.element_type = detail::element_type_code<T>();
    t.implementation = detail::implementation_code(detail::impl_name<impl_type>::value);
    t.host_policy = exec::is_host_policy_v<Exec> ? 1 : 0;
    return t;
  }

  void start(int world_rank) {
    id_ = detail::next_layer_id();
    rank_ = world_rank;
    stats_ = std::make_unique<layer_stats>();
    layer_context<Comm> ctx;
    ctx.topology = mesh_.get();
    ctx.rank = world_rank;
    ctx.ep = ep_.get();
    ctx.tp = tp_.get();
    ctx.options = options_;
    ctx.stats = stats_.get();
    ctx.layer = id_;
    if (options_.counts == count_exchange::device) {
      bound_ = std::make_shared<detail::bound_buffers<T, Exec>>(exec_, *mesh_, options_,
                                                                detail::bounded_masked_impl<impl_type>::value);
      ctx.bound = bound_.get();
    }
    impl_ = std::make_unique<impl_type>(ctx);
  }

  // Heap-held so that the layer can move while the implementation keeps pointers to them.
  std::unique_ptr<mesh> mesh_;
  Exec exec_;
  layer_options options_;
  std::unique_ptr<Comm> ep_;
  std::unique_ptr<Comm> tp_;
  std::unique_ptr<layer_stats> stats_;
  layer_stats kept_stats_;  // the statistics before the running call (keeping_stats)
  std::shared_ptr<void> bound_;  // bounded mode: detail::bound_buffers<T, Exec>
  std::unique_ptr<impl_type> impl_;
  std::uint64_t id_ = 0;  // names the layer in its split-phase handles and saved states
  // Calls per direction: forward counts the fused calls and split starts that completed
  // (the number of each, the same on every rank of the group, stamps its saved state),
  // backward split starts. In the normal mode a forward call that raised is not counted: a
  // rank whose experts threw alone raises again in its next call (which meets its peers
  // still inside the failed one), so it fails one call more than its peers; counting those
  // would leave its numbers ahead of theirs for good, and every later backward would
  // raise. Bounded mode counts every fused call: one that raises on a rank after its
  // collectives (bad shapes) completes on the peers, and one that leaves them earlier
  // ends the layer on that rank (require_in_step).
  std::uint64_t forward_calls_ = 0, backward_starts_ = 0;
  int rank_ = 0;          // in the world
  std::string out_of_step_;  // bounded mode: why this rank left a call before its last collective ("" if it did not)
};

}  // namespace epx
