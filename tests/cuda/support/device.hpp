// tests/cuda/support/device.hpp: what the CUDA tests share: a stream of their own, copies
// of host vectors to the device and back, and a bitwise comparison.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <vector>

#include "epx/exec/cuda.cuh"

namespace epx::test::cuda {

using epx::exec::device_buffer;

// A stream of its own per test, so that stream-ordered code is exercised (not stream 0).
struct test_stream {
  cudaStream_t s = nullptr;
  test_stream() { EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~test_stream() { (void)cudaStreamDestroy(s); }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
  epx::exec::cuda policy() const { return epx::exec::cuda{s}; }
};

template <class T>
device_buffer<T> to_device(const epx::exec::cuda& p, const std::vector<T>& v) {
  device_buffer<T> b(v.size(), p);
  epx::exec::copy_from_host(p, v.data(), v.size(), b.data());
  return b;
}

template <class T>
std::vector<T> to_host(const epx::exec::cuda& p, const T* d, std::size_t n) {
  std::vector<T> v(n);
  epx::exec::copy_to_host(p, d, n, v.data());
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace epx::test::cuda
