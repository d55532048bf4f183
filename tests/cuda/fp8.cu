// FP8 E4M3 on the device: epx's conversions (epx/core/fp8.hpp) against __nv_fp8_e4m3 run
// on the device (the cvt instructions on sm_89 and later, CUDA's emulation before), over
// all 2^32 floats and all 256 codes; and the row quantisation (epx/kernels/fp8.hpp) on
// exec::cuda against exec::serial, byte for byte. Needs a GPU (label cuda); the host-only
// comparison with cuda_fp8.h is tests/cuda/host/fp8.cu.
#include <doctest/doctest.h>

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/core/fp8.hpp"
#include "epx/core/numeric.hpp"
#include "epx/exec/cuda.cuh"
#include "epx/exec/host.hpp"
#include "epx/kernels/fp8.hpp"
#include "support/bits.hpp"

using namespace epx::test::cuda;

namespace {

struct mismatch_record {
  unsigned long long count;
  unsigned long long first;  // the smallest input (bits) that differs
};

__global__ void compare_all_floats(mismatch_record* r) {
  const std::uint64_t n = std::uint64_t{1} << 32;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float f = __uint_as_float(static_cast<unsigned>(i));
    const unsigned char got = epx::fp8_e4m3(f).bits;
    const unsigned char want = static_cast<unsigned char>(__nv_fp8_e4m3(f).__x);
    if (got != want) {
      atomicAdd(&r->count, 1ull);
      atomicMin(&r->first, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void decode_all_codes(unsigned* epx_bits, unsigned* cuda_bits) {
  const unsigned b = threadIdx.x;
  __nv_fp8_e4m3 c;
  c.__x = static_cast<__nv_fp8_storage_t>(b);
  epx_bits[b] = __float_as_uint(static_cast<float>(epx::fp8_e4m3::from_bits(static_cast<std::uint8_t>(b))));
  cuda_bits[b] = __float_as_uint(static_cast<float>(c));
}





template <class T>
void check_rows(const epx::exec::cuda& dev) {
  const std::size_t rows = 67, H = 7 * 128, S = rows * H / 128;
  std::vector<T> x(rows * H);
  std::uint64_t s = 99;
  for (std::size_t i = 0; i < x.size(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(s >> 11) * 0x1p-53 - 0.5;
    x[i] = epx::convert<T>(std::ldexp(u, static_cast<int>((i / 128) % 17) - 9));
  }
  for (std::size_t h = 0; h < 128; ++h) x[5 * 128 + h] = epx::convert<T>(0.0f);
  std::vector<std::int64_t> index(rows);
  for (std::size_t r = 0; r < rows; ++r) index[r] = r % 6 == 1 ? -1 : static_cast<std::int64_t>((r * 13) % rows);

  // host
  std::vector<epx::fp8_e4m3> hq(2 * rows * H);
  std::vector<float> hs(2 * S);
  std::vector<T> ho(2 * rows * H);
  epx::exec::serial cpu;
  epx::kernels::quantise_e4m3(cpu, rows, H, x.data(), hq.data(), hs.data());
  epx::kernels::quantise_e4m3(cpu, rows, H, x.data(), index.data(), hq.data() + rows * H, hs.data() + S);
  epx::kernels::dequantise_e4m3(cpu, 2 * rows, H, hq.data(), hs.data(), ho.data());

  // device
  auto dx = to_device(dev, x);
  auto di = to_device(dev, index);
  epx::exec::device_buffer<epx::fp8_e4m3> dq(2 * rows * H, dev);
  epx::exec::device_buffer<float> ds(2 * S, dev);
  epx::exec::device_buffer<T> dout(2 * rows * H, dev);
  epx::kernels::quantise_e4m3(dev, rows, H, static_cast<const T*>(dx.data()), dq.data(), ds.data());
  epx::kernels::quantise_e4m3(dev, rows, H, static_cast<const T*>(dx.data()), static_cast<const std::int64_t*>(di.data()),
                              dq.data() + rows * H, ds.data() + S);
  epx::kernels::dequantise_e4m3(dev, 2 * rows, H, static_cast<const epx::fp8_e4m3*>(dq.data()),
                                static_cast<const float*>(ds.data()), dout.data());
  const auto q = to_host(dev, dq.data(), dq.size());
  const auto sc = to_host(dev, ds.data(), ds.size());
  const auto out = to_host(dev, dout.data(), dout.size());
  epx::exec::synchronize(dev);
  CHECK(same_bits(q, hq));
  CHECK(same_bits(sc, hs));
  CHECK(same_bits(out, ho));
}

}  // namespace

TEST_CASE("E4M3 on the device: all 2^32 floats encode as __nv_fp8_e4m3 does on the device") {
  mismatch_record* r = nullptr;
  EPX_CUDA_CHECK(cudaMallocManaged(&r, sizeof *r));
  r->count = 0;
  r->first = ~0ull;
  compare_all_floats<<<4096, 256>>>(r);
  EPX_CUDA_CHECK(cudaGetLastError());
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK_MESSAGE(r->count == 0, r->count, " floats differ; the first has the bits ", r->first);
  EPX_CUDA_CHECK(cudaFree(r));
}

TEST_CASE("E4M3 on the device: all 256 codes decode as __nv_fp8_e4m3 does on the device and as epx does on the host") {
  unsigned* e = nullptr;
  unsigned* c = nullptr;
  EPX_CUDA_CHECK(cudaMallocManaged(&e, 256 * sizeof(unsigned)));
  EPX_CUDA_CHECK(cudaMallocManaged(&c, 256 * sizeof(unsigned)));
  decode_all_codes<<<1, 256>>>(e, c);
  EPX_CUDA_CHECK(cudaGetLastError());
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  for (unsigned b = 0; b < 256; ++b) {
    CAPTURE(b);
    const float host = static_cast<float>(epx::fp8_e4m3::from_bits(static_cast<std::uint8_t>(b)));
    CHECK(e[b] == c[b]);
    CHECK(e[b] == epx::test::bits_of(host));
  }
  EPX_CUDA_CHECK(cudaFree(e));
  EPX_CUDA_CHECK(cudaFree(c));
}

TEST_CASE_TEMPLATE("quantise_e4m3 and dequantise_e4m3 on exec::cuda: the bytes of exec::serial", T, float, double, epx::bf16,
                   epx::fp16) {
  test_stream ts;
  check_rows<T>(ts.policy());
}
