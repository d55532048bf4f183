// epx/core/span.hpp: a minimal C++17 contiguous view (std::span arrives only in C++20).
#pragma once

#include <cstddef>
#include <type_traits>
#include <vector>

#include "epx/core/config.hpp"

namespace epx {

template <class T>
class span {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using size_type = std::size_t;

  constexpr span() noexcept = default;
  EPX_HOST_DEVICE constexpr span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  template <class U, class = std::enable_if_t<std::is_convertible_v<U (*)[], T (*)[]>>>
  EPX_HOST_DEVICE constexpr span(const span<U>& other) noexcept
      : data_(other.data()), size_(other.size()) {}
  template <class U, class A,
            class = std::enable_if_t<std::is_convertible_v<U (*)[], T (*)[]>>>
  span(std::vector<U, A>& v) noexcept : data_(v.data()), size_(v.size()) {}
  template <class U, class A,
            class = std::enable_if_t<std::is_convertible_v<const U (*)[], T (*)[]>>>
  span(const std::vector<U, A>& v) noexcept : data_(v.data()), size_(v.size()) {}

  EPX_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  EPX_HOST_DEVICE constexpr std::size_t size() const noexcept { return size_; }
  EPX_HOST_DEVICE constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  EPX_HOST_DEVICE constexpr bool empty() const noexcept { return size_ == 0; }
  EPX_HOST_DEVICE constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  EPX_HOST_DEVICE constexpr T* begin() const noexcept { return data_; }
  EPX_HOST_DEVICE constexpr T* end() const noexcept { return data_ + size_; }
  EPX_HOST_DEVICE constexpr span subspan(std::size_t offset, std::size_t count) const noexcept {
    return span(data_ + offset, count);
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T, class A>
span<T> make_span(std::vector<T, A>& v) noexcept { return span<T>(v.data(), v.size()); }
template <class T, class A>
span<const T> make_span(const std::vector<T, A>& v) noexcept {
  return span<const T>(v.data(), v.size());
}

}  // namespace epx
