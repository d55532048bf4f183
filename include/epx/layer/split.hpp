// epx/layer/split.hpp: the handles of the layer's split-phase calls (spec section 13).
//
//   auto h = layer.dispatch_start(x, ids, weights, epx::mode::train);
//   layer.dispatch_wait(h);                        // h.inputs(): expert-major rows, h.outputs(): [rows, H]
//   experts.forward(policy, h.inputs(), h.outputs().data());
//   layer.combine_start(h, h.outputs(), out);
//   epx::saved_state<T> saved = layer.combine_wait(h);
//
//   auto g = layer.backward_dispatch_start(std::move(saved), grad_out, grad_weights);
//   layer.backward_dispatch_wait(g);
//   experts.backward(policy, g.inputs(), g.grad_outputs().data(), g.grad_inputs().data());
//   layer.backward_combine_start(g, g.grad_inputs(), grad_x);
//   layer.backward_combine_wait(g);               // grad_x and grad_weights final
//
// A handle is one call in flight: move-only, bound to the layer that made it, and walked
// through its phases exactly once (start, wait, start, wait). Each phase checks that the
// handle is in the phase before it; a handle used twice, a wait without its start or a
// handle of another layer raises errc::configuration. Handles of different calls are
// independent: a caller keeps several in flight (micro-batches) and may interleave their
// phases, in the same order on every rank of the EP group (every start is collective).
// The rows buffers a handle holds are the layer's; a handle may outlive its layer (its
// buffers are freed with it).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "epx/core/error.hpp"
#include "epx/core/span.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/implementation.hpp"
#include "epx/layout/exchange.hpp"

namespace epx {

template <class Comm, class T, class Impl, class Exec>
class moe_layer;

namespace detail {
// The phases of a split call, in order.
enum class split_phase : int { empty = 0, dispatching, dispatched, combining, done };

inline const char* to_string(split_phase p) noexcept {
  switch (p) {
    case split_phase::empty: return "empty (default-constructed or moved from)";
    case split_phase::dispatching: return "dispatch started, not waited for";
    case split_phase::dispatched: return "dispatched";
    case split_phase::combining: return "combine started, not waited for";
    case split_phase::done: return "already combined";
  }
  return "?";
}

// Why a handle's accessor `what` cannot be used in phase `p`: where it is available (from
// the wait `from` until the start `until`), the phase, and the wait to call first while
// the dispatch is under way.
inline std::string accessor_error(const char* handle, const char* what, const char* from, const char* until,
                                  split_phase p) {
  return concat(handle, "::", what, " is only available between ", from, " and ", until,
                "; this handle's phase is '", to_string(p), "'",
                p == split_phase::dispatching ? concat(": call ", from, " on it first") : std::string());
}

// A new layer's id, unique in the process over every layer type (handles name the layer
// that made them; handles depend on T only, so the ids must not repeat across types) and
// over the shared libraries that make layers: each library built with hidden visibility
// has its own counter, so the count is added to a bijective mix of the counter's address,
// which differs between libraries (two libraries' ids meet only if their mixed addresses
// fall within a count of each other: about one chance in 2^64 / layers). Never 0.
inline std::uint64_t next_layer_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  std::uint64_t base = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(&next));
  base = (base ^ (base >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64's finaliser
  base = (base ^ (base >> 27)) * 0x94d049bb133111ebull;
  base ^= base >> 31;
  const std::uint64_t id = base + next.fetch_add(1);
  return id != 0 ? id : base + next.fetch_add(1);
}

// What one split call keeps between its phases (both directions).
template <class T>
struct split_call {
  std::uint64_t layer = 0;  // the id of the layer that made it
  std::uint64_t serial = 0; // its start's number among the layer's starts of its direction
  split_phase phase = split_phase::empty;
  saved_state<T> flight;    // the implementation's state between its stages
  std::size_t tokens = 0;   // N
  long long host_syncs = 0;

  split_call() = default;
  split_call(split_call&& o) noexcept
      : layer(std::exchange(o.layer, 0)),
        serial(std::exchange(o.serial, 0)),
        phase(std::exchange(o.phase, split_phase::empty)),
        flight(std::move(o.flight)),
        tokens(std::exchange(o.tokens, 0)),
        host_syncs(std::exchange(o.host_syncs, 0)) {}
  split_call& operator=(split_call&& o) noexcept {
    if (this != &o) {
      layer = std::exchange(o.layer, 0);
      serial = std::exchange(o.serial, 0);
      phase = std::exchange(o.phase, split_phase::empty);
      flight = std::move(o.flight);
      tokens = std::exchange(o.tokens, 0);
      host_syncs = std::exchange(o.host_syncs, 0);
    }
    return *this;
  }
};

// Collective over `comm`: every rank says whether its own part of a split call is wrong
// (`category` and `message`; errc::internal with an empty message: fine) and which of its
// calls it combines (`serial`, split_call::serial). When any rank's part is wrong, every
// rank raises: errc::configuration if any rank misused a handle, else errc::input, naming
// each failing rank and its reason. When all are fine but the ranks combine different
// calls (they started the phases of their calls in different orders), every rank raises
// errc::configuration naming each rank's call. One all_gather of three integers per rank;
// a second one with the messages only on the error path.
template <class Comm>
void agree_on_phase(Comm& comm, bool failed, errc category, const std::string& message, int world_rank,
                    std::uint64_t serial, const char* what) {
  const int n = comm.size();
  const auto at = [](int r, int f) { return 3 * static_cast<std::size_t>(r) + static_cast<std::size_t>(f); };
  std::int64_t mine[3] = {failed ? 1 + static_cast<std::int64_t>(category) : 0, world_rank,
                          static_cast<std::int64_t>(serial)};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(n), 0);
  all_gather_host(comm, mine, 3, all.data());
  bool any = false, configuration = false, same_call = true;
  for (int r = 0; r < n; ++r) {
    const std::int64_t c = all[at(r, 0)];
    any = any || c != 0;
    configuration = configuration || c == 1 + static_cast<std::int64_t>(errc::configuration);
    same_call = same_call && all[at(r, 2)] == all[at(0, 2)];
  }
  if (!any && !same_call) {
    std::string full = concat(what, ": the ranks of the expert-parallel group combine different calls (");
    for (int r = 0; r < n; ++r)
      full += concat(r ? ", " : "", "rank ", all[at(r, 1)], ": its call ", all[at(r, 2)]);
    throw error(errc::configuration,
                full + " since the layer was made); every rank must start the phases of its calls in the same order",
                EPX_HERE);
  }
  if (!any) return;
  std::vector<char> msg(message_bytes, '\0');
  std::memcpy(msg.data(), message.data(), std::min(message.size(), message_bytes - 1));
  std::vector<char> texts(message_bytes * static_cast<std::size_t>(n), '\0');
  all_gather_host(comm, msg.data(), message_bytes, texts.data());
  rank_messages bad;  // one entry per distinct message, with the ranks that report it
  for (int r = 0; r < n; ++r) {
    if (all[at(r, 0)] == 0) continue;
    const char* m = texts.data() + static_cast<std::size_t>(r) * message_bytes;
    bad.add(all[at(r, 1)], std::string(m, std::find(m, m + message_bytes, '\0')));
  }
  throw error(configuration ? errc::configuration : errc::input,
              concat(what, ": a split-phase call failed in the expert-parallel group", bad.str()), EPX_HERE);
}
}  // namespace detail

// One forward call in flight (dispatch_start .. combine_wait).
template <class T>
class forward_handle {
 public:
  forward_handle() = default;
  forward_handle(forward_handle&&) noexcept = default;
  forward_handle& operator=(forward_handle&&) noexcept = default;

  bool empty() const noexcept { return call_.phase == detail::split_phase::empty; }
  // Between dispatch_wait and combine_start: the expert-major rows the experts read
  // (epx/impl/experts.hpp) and the buffer [inputs().num_rows, H] where they write, in the
  // policy's memory space. Raise errc::configuration in any other phase.
  const expert_rows<const T>& inputs() const {
    require_dispatched("inputs()");
    EPX_REQUIRE(!batch_.fp8, errc::configuration,
                "forward_handle::inputs(): the layer dispatches FP8 rows (layer_options::fp8_dispatch); read "
                "fp8_inputs() and scales()");
    return batch_.in;
  }
  // With layer_options::fp8_dispatch: the rows as E4M3 and their scales [num_rows, H/128].
  bool fp8() const noexcept { return batch_.fp8; }
  const expert_rows<const fp8_e4m3>& fp8_inputs() const {
    require_dispatched("fp8_inputs()");
    EPX_REQUIRE(batch_.fp8, errc::configuration,
                "forward_handle::fp8_inputs(): the layer dispatches rows in T (layer_options::fp8_dispatch is off)");
    return batch_.in8;
  }
  const float* scales() const {
    require_dispatched("scales()");
    EPX_REQUIRE(batch_.fp8, errc::configuration,
                "forward_handle::scales(): the layer dispatches rows in T (layer_options::fp8_dispatch is off)");
    return batch_.scales;
  }
  span<T> outputs() const {
    require_dispatched("outputs()");
    return span<T>(batch_.out, batch_.in.num_rows * batch_.in.hidden);
  }
  // N, the tokens of the call.
  std::size_t tokens() const noexcept { return call_.tokens; }

 private:
  template <class, class, class, class>
  friend class moe_layer;

  void require_dispatched(const char* what) const {
    EPX_REQUIRE(call_.phase == detail::split_phase::dispatched, errc::configuration,
                detail::accessor_error("forward_handle", what, "dispatch_wait", "combine_start", call_.phase));
  }

  detail::split_call<T> call_;
  expert_batch<T> batch_;
  bool training_ = false;
  saved_state<T> saved_;  // a training call's state, from combine_start to combine_wait
};

// One backward call in flight (backward_dispatch_start .. backward_combine_wait).
template <class T>
class backward_handle {
 public:
  backward_handle() = default;
  backward_handle(backward_handle&&) noexcept = default;
  backward_handle& operator=(backward_handle&&) noexcept = default;

  bool empty() const noexcept { return call_.phase == detail::split_phase::empty; }
  // Between backward_dispatch_wait and backward_combine_start: the forward's expert-major
  // inputs, the gradients of the experts' outputs ([num_rows, H], padding rows zero) and the
  // buffer [num_rows, H] where the experts write the gradients of their inputs.
  const expert_rows<const T>& inputs() const {
    require_dispatched("inputs()");
    return batch_.in;
  }
  span<const T> grad_outputs() const {
    require_dispatched("grad_outputs()");
    return span<const T>(batch_.grad_out, batch_.in.num_rows * batch_.in.hidden);
  }
  span<T> grad_inputs() const {
    require_dispatched("grad_inputs()");
    return span<T>(batch_.grad_in, batch_.in.num_rows * batch_.in.hidden);
  }
  std::size_t tokens() const noexcept { return call_.tokens; }

 private:
  template <class, class, class, class>
  friend class moe_layer;

  void require_dispatched(const char* what) const {
    EPX_REQUIRE(call_.phase == detail::split_phase::dispatched, errc::configuration,
                detail::accessor_error("backward_handle", what, "backward_dispatch_wait", "backward_combine_start",
                                       call_.phase));
  }

  detail::split_call<T> call_;
  expert_grad_batch<T> batch_;
};

}  // namespace epx
