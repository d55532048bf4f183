// epx/impl/implementation.hpp: the implementation concept of a MoE layer.
//
// An implementation moves rows between the ranks of an EP group and runs the user's
// experts. epx ships impl::all_to_all (token dispatch), impl::all_reduce (masked path,
// ep == tp) and impl::automatic. The set is open: any class with this shape plugs into
// epx::moe_layer<Comm, T, Impl, Exec>:
//
//   struct my_impl {
//     explicit my_impl(const epx::layer_context<Comm>& ctx);   // collective-free; may validate
//     static constexpr const char* name = "my_impl";            // optional, shown in stats
//     static std::string can_implement(const epx::mesh&, const epx::layer_options&);
//                                  // optional: "" if it runs this mesh and these options,
//                                  // else the reason (the layer raises errc::configuration)
//     template <class T, class Exec, class Experts>
//     void forward(const Exec&, const epx::forward_args<T>& a, Experts& experts,
//                  epx::saved_state<T>* saved);                 // null for inference
//     template <class T, class Exec, class Experts>
//     void backward(const Exec&, const epx::backward_args<T>& a, Experts& experts,
//                   epx::saved_state<T>& saved);
//   };
//
// Optional, for the split-phase calls of the layer (moe_layer::dispatch_start and the
// others, spec section 13): the same work cut at the experts, into stages that keep what
// the next stage needs in an opaque `flight` state:
//
//     template <class T, class Exec>
//     epx::expert_batch<T> dispatch(const Exec&, const epx::forward_args<T>& a,
//                                   epx::saved_state<T>& flight, bool training, bool in_place);
//     template <class T, class Exec>
//     void combine(const Exec&, epx::saved_state<T>& flight, T* out, epx::saved_state<T>* saved);
//     template <class T, class Exec>
//     epx::expert_grad_batch<T> backward_dispatch(const Exec&, const epx::backward_args<T>& a,
//                                                 epx::saved_state<T>& saved, epx::saved_state<T>& flight);
//     template <class T, class Exec>
//     void backward_combine(const Exec&, epx::saved_state<T>& flight, T* grad_x);
//
// dispatch reads a.x, a.ids, a.weights (not a.out) and returns the experts' input rows and
// the buffer they write (their own inputs when `in_place` and not `training`); combine
// writes all of out ([N, H]) and, for training, moves what backward needs into *saved.
// backward_dispatch consumes `saved` and reads a.grad_out (not a.grad_x);
// backward_combine writes all of grad_x and of the a.grad_weights its dispatch was given. The built-in implementations
// make their fused forward and backward from these stages (detail::forward_by_stages,
// detail::backward_by_stages), so that both give bitwise the same results.
//
// The layer uses a user type as it is. The built-in ones are tags with
// `template <class Comm> using with = ...;` that the layer binds to its communicator type
// (epx::impl_for_t<Impl, Comm>). docs/implementations.md shows a complete user-defined one.
//
// forward must write all of a.out ([N, H]); backward all of a.grad_x ([N, H]) and
// a.grad_weights ([N, k]). Whatever backward needs is stored in the saved state with
// `saved->emplace<my_state>(...)` and read back with `saved.get<my_state>()`. The
// context gives the mesh, the ep and tp communicators of this rank (made once by the
// layer), the padding policy and the stats object to fill.
//
// A forward or backward call is collective over the EP group: when one rank's input is bad
// (a.status != 0, or ids/weights it reads), every rank of the group must raise before rows
// move (see epx::detail::exchange_records), so that nobody waits in a collective forever.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "epx/core/error.hpp"
#include "epx/impl/experts.hpp"
#include "epx/impl/options.hpp"
#include "epx/impl/stats.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx {

template <class Comm>
struct layer_context {
  const mesh* topology = nullptr;
  int rank = 0;               // in the world communicator
  Comm* ep = nullptr;         // this rank's EP group
  Comm* tp = nullptr;         // this rank's TP group
  layer_options options = {};
  layer_stats* stats = nullptr;
  // Bounded mode: the layer's fixed buffers (detail::bound_buffers<T, Exec> of
  // epx/impl/bounded.hpp, made by the layer at construction); null otherwise.
  void* bound = nullptr;
  std::uint64_t layer = 0;    // the layer's id: backward refuses the saved states of other layers

  int ep_size() const noexcept { return topology->ep(); }
  int tp_size() const noexcept { return topology->tp(); }
  int ep_rank() const { return topology->ep_rank(rank); }
  int tp_rank() const { return topology->coords(rank).tp; }
  int num_experts() const noexcept { return topology->experts(); }
  int local_experts() const noexcept { return topology->local_experts(); }
  int first_expert() const { return topology->expert_begin(rank); }
};

// One forward call. Pointers are in the execution policy's memory space.
template <class T>
struct forward_args {
  const T* x = nullptr;               // [N, H]
  const std::int32_t* ids = nullptr;  // [N, k] global expert ids
  const float* weights = nullptr;     // [N, k] routing weights
  T* out = nullptr;                   // [N, H]
  std::size_t rows = 0;               // N
  std::size_t hidden = 0;             // H
  int top_k = 0;                      // k
  int status = 0;                     // non-zero: this rank's shapes failed local checks
  const char* status_message = "";    // why (shown on every rank of the group)
};

template <class T>
struct backward_args {
  const T* grad_out = nullptr;        // [N, H]
  T* grad_x = nullptr;                // [N, H]
  float* grad_weights = nullptr;      // [N, k]
  std::size_t rows = 0;
  std::size_t hidden = 0;
  int top_k = 0;
  int status = 0;
  const char* status_message = "";
};

// What a training forward keeps for backward: an opaque, move-only handle. Empty after an
// inference call, after backward consumed it, or when default-constructed.
template <class T>
class saved_state {
 public:
  saved_state() = default;
  saved_state(saved_state&&) noexcept = default;
  saved_state& operator=(saved_state&&) noexcept = default;
  saved_state(const saved_state&) = delete;
  saved_state& operator=(const saved_state&) = delete;

  bool empty() const noexcept { return state_ == nullptr; }
  explicit operator bool() const noexcept { return !empty(); }

  // For implementations: store / read their own state type.
  template <class S, class... Args>
  S& emplace(Args&&... args) {
    auto* s = new S(std::forward<Args>(args)...);
    state_ = holder(s, [](void* p) noexcept { delete static_cast<S*>(p); });
    type_ = type_id<S>();
    return *s;
  }
  template <class S>
  bool holds() const noexcept {
    return state_ != nullptr && type_ == type_id<S>();
  }
  // Why this state cannot serve a backward that needs an S ("" when it can); `layer`, when
  // not 0, the id of the layer that takes it back (layer_context::layer).
  template <class S>
  const char* unusable_as(std::uint64_t layer = 0) const noexcept {
    if (empty())
      return "backward needs the saved state of a training forward (this one is empty: an inference call, already "
             "consumed by backward, or default-constructed)";
    if (!holds<S>()) return "the saved state was made by a different implementation";
    if (layer != 0 && layer_ != 0 && layer_ != layer)
      return "the saved state was made by another layer (each layer takes back only its own forward calls)";
    return "";
  }
  template <class S>
  S& get() {
    const char* why = unusable_as<S>();
    EPX_REQUIRE(*why == '\0', errc::input, why);
    return *static_cast<S*>(state_.get());
  }
  void reset() noexcept {
    state_.reset();
    type_ = 0;
    layer_ = 0;
    call_ = 0;
  }
  // Set by the layer (0 when unset): the id of the layer that made it, and the number of its
  // forward call, counted per layer on every rank of the group. Backward takes back only
  // its own layer's states, and checks that the ranks of a group take back the same call.
  std::uint64_t layer() const noexcept { return layer_; }
  std::uint64_t call() const noexcept { return call_; }
  void stamp(std::uint64_t layer, std::uint64_t call) noexcept {
    layer_ = layer;
    call_ = call;
  }

 private:
  using holder = std::unique_ptr<void, void (*)(void*) noexcept>;
  // A key of state type S that is the same in every shared library of the process built
  // by one compiler: the address of a function-local static is not (a library built with
  // hidden visibility has its own copy, and a state that one library's forward made would
  // look foreign to another's backward). The compiler's name of this function names S; its
  // size is mixed in. Where that name does not tell S apart from other types (S in an
  // anonymous namespace, or local to a function or lambda: two translation units may spell
  // different types alike) the key is the static's address, as before.
  template <class S>
  static std::uint64_t type_id() noexcept {
    static const char here = 0;
#if defined(__GNUC__) || defined(__clang__)
    static const std::uint64_t id = name_key(__PRETTY_FUNCTION__, &here) ^ sizeof(S);
#elif defined(_MSC_VER)
    static const std::uint64_t id = name_key(__FUNCSIG__, &here) ^ sizeof(S);
#else
    static const std::uint64_t id = address_key(&here);
#endif
    return id;
  }
  static std::uint64_t address_key(const void* p) noexcept {
    return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
  }
  // 64-bit FNV-1a of a name; `here`'s address for a name that holds an unnamed or local
  // scope (GCC's "{anonymous}", Clang's "(anonymous namespace)", MSVC's
  // "`anonymous-namespace'", a lambda's or an unnamed type's, or a function's scope ")::").
  static std::uint64_t name_key(const char* name, const void* here) noexcept {
    const std::string_view n(name);
    for (const char* mark : {"anonymous", "lambda", "unnamed", ")::"})
      if (n.find(mark) != std::string_view::npos) return address_key(here);
    std::uint64_t h = 14695981039346656037ull;
    for (char c : n) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return h;
  }
  holder state_{nullptr, [](void*) noexcept {}};
  std::uint64_t type_ = 0;
  std::uint64_t layer_ = 0;
  std::uint64_t call_ = 0;
};

// The experts' side of one dispatched call (split phase): the expert-major rows they
// read and the [in.num_rows, H] buffer they write, in the policy's memory space.
// With FP8 dispatch (`fp8`) the rows are `in8` with their `scales` [num_rows, H/128],
// and in.rows is null (in keeps the shape).
template <class T>
struct expert_batch {
  expert_rows<const T> in;
  T* out = nullptr;
  bool fp8 = false;
  expert_rows<const fp8_e4m3> in8;
  const float* scales = nullptr;
};

// The experts' side of one dispatched backward call: the forward's expert-major inputs,
// the gradients of their outputs ([in.num_rows, H], padding rows zero) and the buffer
// where the experts write the gradients of their inputs.
template <class T>
struct expert_grad_batch {
  expert_rows<const T> in;
  const T* grad_out = nullptr;
  T* grad_in = nullptr;
};

namespace detail {
template <class I, class = void>
struct impl_name {
  static constexpr const char* value = "user";
};
template <class I>
struct impl_name<I, std::void_t<decltype(I::name)>> {
  static constexpr const char* value = I::name;
};

template <class I, class = void>
struct has_can_implement : std::false_type {};
template <class I>
struct has_can_implement<I, std::void_t<decltype(std::string(
                                I::can_implement(std::declval<const mesh&>(), std::declval<const layer_options&>())))>>
    : std::true_type {};
}  // namespace detail

// "" when implementation I runs mesh m with options o, else the reason. Implementations
// without a can_implement run everything.
template <class I>
std::string can_implement(const mesh& m, const layer_options& o) {
  if constexpr (detail::has_can_implement<I>::value)
    return std::string(I::can_implement(m, o));
  else
    return {};
}

// The implementation concept, one sentence per part (the forward/backward members are
// templates, checked where the layer calls them with its own types).
template <class I, class Comm>
constexpr bool check_implementation() {
  static_assert(std::is_constructible_v<I, const layer_context<Comm>&>,
                "epx: the implementation must be constructible from `const epx::layer_context<Comm>&` "
                "(see epx/impl/implementation.hpp)");
  return std::is_constructible_v<I, const layer_context<Comm>&>;
}

namespace detail {
template <class I, class Exec, class T, class Experts, class = void>
struct has_impl_forward : std::false_type {};
template <class I, class Exec, class T, class Experts>
struct has_impl_forward<I, Exec, T, Experts,
                        std::void_t<decltype(std::declval<I&>().forward(
                            std::declval<const Exec&>(), std::declval<const forward_args<T>&>(),
                            std::declval<Experts&>(), std::declval<saved_state<T>*>()))>> : std::true_type {};
template <class I, class Exec, class T, class Experts, class = void>
struct has_impl_backward : std::false_type {};
template <class I, class Exec, class T, class Experts>
struct has_impl_backward<I, Exec, T, Experts,
                         std::void_t<decltype(std::declval<I&>().backward(
                             std::declval<const Exec&>(), std::declval<const backward_args<T>&>(),
                             std::declval<Experts&>(), std::declval<saved_state<T>&>()))>> : std::true_type {};

template <class I, class Exec, class T, class = void>
struct has_impl_stages : std::false_type {};
template <class I, class Exec, class T>
struct has_impl_stages<
    I, Exec, T,
    std::void_t<decltype(expert_batch<T>(std::declval<I&>().dispatch(std::declval<const Exec&>(),
                                                                      std::declval<const forward_args<T>&>(),
                                                                      std::declval<saved_state<T>&>(), true, true))),
                decltype(std::declval<I&>().combine(std::declval<const Exec&>(), std::declval<saved_state<T>&>(),
                                                    std::declval<T*>(), std::declval<saved_state<T>*>())),
                decltype(expert_grad_batch<T>(std::declval<I&>().backward_dispatch(
                    std::declval<const Exec&>(), std::declval<const backward_args<T>&>(),
                    std::declval<saved_state<T>&>(), std::declval<saved_state<T>&>()))),
                decltype(std::declval<I&>().backward_combine(std::declval<const Exec&>(),
                                                             std::declval<saved_state<T>&>(), std::declval<T*>()))>>
    : std::true_type {};

// The experts over a dispatched batch: their FP8 forward when the rows came as FP8.
template <class T, class Exec, class Experts>
void run_expert_batch(const Exec& ex, Experts& experts, const expert_batch<T>& b) {
  if (b.fp8) {
    if constexpr (has_fp8_forward_v<Experts, Exec, T>)
      experts.forward(ex, b.in8, b.scales, b.out);
    else
      EPX_THROW(errc::configuration, "layer_options::fp8_dispatch needs experts with `forward(const Exec&, "
                                     "const epx::expert_rows<const epx::fp8_e4m3>&, const float* scales, T* out)`");
  } else {
    if constexpr (has_expert_forward<Experts, Exec, T>::value)
      experts.forward(ex, b.in, b.out);
    else
      EPX_THROW(errc::configuration, "these experts take only FP8 rows: set layer_options::fp8_dispatch");
  }
}

// The fused calls made from the stages: one body per operation.
template <class I, class T, class Exec, class Experts>
void forward_by_stages(I& impl, const Exec& ex, const forward_args<T>& a, Experts& experts, saved_state<T>* saved) {
  saved_state<T> flight;
  const expert_batch<T> b = impl.dispatch(ex, a, flight, saved != nullptr, forward_in_place_v<Experts>);
  run_expert_batch(ex, experts, b);
  impl.combine(ex, flight, a.out, saved);
}
template <class I, class T, class Exec, class Experts>
void backward_by_stages(I& impl, const Exec& ex, const backward_args<T>& a, Experts& experts, saved_state<T>& saved) {
  saved_state<T> flight;
  const expert_grad_batch<T> b = impl.backward_dispatch(ex, a, saved, flight);
  experts.backward(ex, b.in, b.grad_out, b.grad_in);
  impl.backward_combine(ex, flight, a.grad_x);
}
}  // namespace detail

// Whether implementation I offers the split-phase stages (for the layer's split calls).
template <class I, class Exec, class T>
inline constexpr bool has_split_phase_v = detail::has_impl_stages<I, Exec, T>::value;

template <class I, class Exec, class T>
constexpr bool check_split_phase() {
  static_assert(has_split_phase_v<I, Exec, T>,
                "epx: the split-phase calls (dispatch_start, combine_start, ...) need an implementation with the "
                "stages `dispatch`, `combine`, `backward_dispatch` and `backward_combine` (see "
                "epx/impl/implementation.hpp); the fused forward and backward work without them");
  return true;
}

template <class I, class Exec, class T, class Experts>
constexpr bool check_implementation_calls() {
  static_assert(detail::has_impl_forward<I, Exec, T, Experts>::value,
                "epx: the implementation needs `template <class T, class Exec, class Experts> void forward(const Exec&, "
                "const epx::forward_args<T>&, Experts&, epx::saved_state<T>*)` (see epx/impl/implementation.hpp)");
  static_assert(detail::has_impl_backward<I, Exec, T, Experts>::value,
                "epx: the implementation needs `template <class T, class Exec, class Experts> void backward(const Exec&, "
                "const epx::backward_args<T>&, Experts&, epx::saved_state<T>&)` (see epx/impl/implementation.hpp)");
  return true;
}

}  // namespace epx
