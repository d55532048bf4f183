// epx/impl/experts.hpp: the expert concept: what the user's expert computation provides.
//
// The layer hands the user's experts an expert-major buffer: the rows of local expert 0
// (from ep rank 0, then 1, ...), then its padding rows (zero), then local expert 1, and so
// on. `offsets[l]..offsets[l+1]` are the rows of local expert l, padding included; global
// expert id = first_global_expert + l. An Experts type provides
//
//   template <class Exec>
//   void forward(const Exec&, const expert_rows<const T>& in, T* out /*[in.num_rows, H]*/);
//   template <class Exec>
//   void backward(const Exec&, const expert_rows<const T>& in, const T* grad_out /*[num_rows, H]*/,
//                 T* grad_in /*[num_rows, H]*/);   // accumulates its own parameter gradients
//
// `rows`, `out`, `grad_out`, `grad_in` live in the execution policy's memory space;
// `offsets` is host memory; in bounded mode `device_counts` gives the rows that hold data
// (policy memory, see expert_rows). Outputs of padding rows are discarded; in backward their
// grad_out rows are zero, so a linear expert's parameter gradient gets nothing from them.
// The expert owns its math (GEMMs, activations, parameter storage and gradients).
//
// With layer_options::fp8_dispatch (spec section 12) the rows arrive as FP8 E4M3 with one
// float32 scale per 128 elements, and the experts provide instead of (or beside) the
// forward above
//
//   template <class Exec>
//   void forward(const Exec&, const expert_rows<const fp8_e4m3>& in,
//                const float* scales /*[in.num_rows, H/128]*/, T* out /*[num_rows, H]*/);
//
// (epx::kernels::dequantise_e4m3 turns rows back into T; padding rows are zero bytes with
// scale 1). Their backward gets the dequantised rows as `in`, in T.
//
// Optional: `static constexpr bool forward_in_place = true;` in the Experts type says that
// forward works with out == in.rows (each output row may overwrite its own input row, e.g.
// a row-blocked MLP that keeps one tile of rows in a temporary). Inference calls then write
// the outputs over the received rows, which saves one [num_rows, H] buffer. Training calls
// always pass a separate `out` (backward needs the inputs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "epx/core/fp8.hpp"

namespace epx {

template <class T>
struct expert_rows {
  T* rows = nullptr;                    // [num_rows, hidden] expert-major
  std::size_t num_rows = 0;             // offsets[num_local]
  std::size_t hidden = 0;
  const std::size_t* offsets = nullptr; // [num_local + 1], host memory
  int num_local = 0;                    // L
  int first_global_expert = 0;          // global id of local expert 0
  // Bounded mode (layer_options::counts == count_exchange::device): [num_local] rows of each
  // local expert that hold data, in the execution policy's memory (no host copy exists);
  // every expert's block then has count(l) rows, the rows past device_counts[l] are not
  // data (zero in training calls). Null in the normal mode.
  const std::int64_t* device_counts = nullptr;

  std::size_t begin(int l) const noexcept { return offsets[l]; }
  std::size_t count(int l) const noexcept { return offsets[l + 1] - offsets[l]; }
  T* expert(int l) const noexcept { return rows + offsets[l] * hidden; }
};

namespace detail {
template <class E, class Exec, class T, class = void>
struct has_expert_forward : std::false_type {};
template <class E, class Exec, class T>
struct has_expert_forward<E, Exec, T,
                          std::void_t<decltype(std::declval<E&>().forward(
                              std::declval<const Exec&>(), std::declval<const expert_rows<const T>&>(),
                              std::declval<T*>()))>> : std::true_type {};
template <class E, class Exec, class T, class = void>
struct has_expert_forward_fp8 : std::false_type {};
template <class E, class Exec, class T>
struct has_expert_forward_fp8<E, Exec, T,
                              std::void_t<decltype(std::declval<E&>().forward(
                                  std::declval<const Exec&>(), std::declval<const expert_rows<const fp8_e4m3>&>(),
                                  std::declval<const float*>(), std::declval<T*>()))>> : std::true_type {};
template <class E, class Exec, class T, class = void>
struct has_expert_backward : std::false_type {};
template <class E, class Exec, class T>
struct has_expert_backward<E, Exec, T,
                           std::void_t<decltype(std::declval<E&>().backward(
                               std::declval<const Exec&>(), std::declval<const expert_rows<const T>&>(),
                               std::declval<const T*>(), std::declval<T*>()))>> : std::true_type {};
template <class E, class = void>
struct forward_in_place : std::false_type {};
template <class E>
struct forward_in_place<E, std::void_t<decltype(E::forward_in_place)>>
    : std::bool_constant<static_cast<bool>(E::forward_in_place)> {};
}  // namespace detail

// Whether Experts declared that forward may write its outputs over its inputs.
template <class Experts>
inline constexpr bool forward_in_place_v = detail::forward_in_place<std::remove_cv_t<Experts>>::value;

// Whether Experts take FP8 rows and their scales (layer_options::fp8_dispatch).
template <class Experts, class Exec, class T>
inline constexpr bool has_fp8_forward_v = detail::has_expert_forward_fp8<Experts, Exec, T>::value;

// Checks the concept with a sentence instead of a template wall (one of the two forwards).
template <class Experts, class Exec, class T>
constexpr void check_experts_forward() {
  static_assert(detail::has_expert_forward<Experts, Exec, T>::value || has_fp8_forward_v<Experts, Exec, T>,
                "epx: the Experts type needs `template <class Exec> void forward(const Exec&, "
                "const epx::expert_rows<const T>&, T* out)` (see epx/impl/experts.hpp)");
}
template <class Experts, class Exec, class T>
constexpr void check_experts_backward() {
  static_assert(detail::has_expert_backward<Experts, Exec, T>::value,
                "epx: the Experts type needs `template <class Exec> void backward(const Exec&, "
                "const epx::expert_rows<const T>&, const T* grad_out, T* grad_in)` (see epx/impl/experts.hpp)");
}

}  // namespace epx
