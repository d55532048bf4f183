// The NCCL communicator on device memory: world size 1 (blocking and nonblocking NCCL
// modes), and every visible GPU of this process through init_all (one host thread per
// device) when there are two or more. Needs a GPU (label cuda).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/support/device.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/nccl.cuh"
#include "epx/exec/cuda.cuh"

namespace {

using epx::test::cuda::test_stream;
using epx::datatype;
using epx::exec::device_buffer;
using epx::nccl::communicator;

template <class T>
device_buffer<T> to_device(const communicator& c, const std::vector<T>& v) {
  device_buffer<T> b(v.size());
  epx::exec::copy_from_host(c.execution(), v.data(), v.size(), b.data());
  return b;
}

template <class T>
std::vector<T> to_host(communicator& c, const device_buffer<T>& d) {
  c.wait();
  std::vector<T> v(d.size());
  epx::exec::copy_to_host(c.execution(), d.data(), d.size(), v.data());
  return v;
}

communicator world_of_one(bool blocking, cudaStream_t s) {
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  epx::nccl::options o;
  o.blocking = blocking;
  o.timeout = std::chrono::seconds(60);
  return communicator::from_unique_id(id, 1, 0, -1, s, o);
}

}  // namespace

static_assert(epx::is_communicator_v<communicator>);
// Peer access (the layer's direct route) where NCCL has symmetric windows and its device API.
static_assert(epx::has_peer_access_v<communicator> == (EPX_NCCL_PEER_ACCESS == 1));

#if EPX_NCCL_PEER_ACCESS
TEST_CASE("nccl access_peers at world size 1: buffers published through the symmetric window; bad arguments") {
  test_stream ts;
  {
    auto off = world_of_one(true, ts.s);  // options::peer_access is off by default
    CHECK(!epx::peer_access_available(off));
  }
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id));
  epx::nccl::options o;
  o.peer_access = true;
  auto c = communicator::from_unique_id(id, 1, 0, -1, ts.s, o);
  if (!epx::peer_access_available(c)) {
    MESSAGE("no peer access on this machine (ncclTeamLsa, or no device-accessible symmetric window): nothing more "
            "to test");
    return;
  }
  std::vector<float> a(1000);
  std::vector<std::int64_t> b(77);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i) - 3.0f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::int64_t>(i * i) - 40;
  auto da = to_device(c, a);
  auto db = to_device(c, b);
  device_buffer<float> ra(a.size());
  device_buffer<std::int64_t> rb(b.size());
  // Twice: the second access reuses the window; the third needs a larger one.
  for (int round = 0; round < 2; ++round) {
    const void* mine[2] = {da.data(), db.data()};
    const std::size_t bytes[2] = {a.size() * sizeof(float), b.size() * sizeof(std::int64_t)};
    c.access_peers(mine, bytes, 2, [&](const communicator::peer_pointers& peers) {
      CHECK(peers.size() == 1);
      CHECK(peers(0, 0) != static_cast<const void*>(da.data()));  // a copy in the window
      EPX_CUDA_CHECK(cudaMemcpyAsync(ra.data(), peers(0, 0), bytes[0], cudaMemcpyDefault, c.stream()));
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb.data(), peers(0, 1), bytes[1], cudaMemcpyDefault, c.stream()));
    });
    CHECK(to_host(c, ra) == a);
    CHECK(to_host(c, rb) == b);
  }
  std::vector<float> big(3u << 20, 1.25f);  // 12 MiB: the window grows
  auto dbig = to_device(c, big);
  device_buffer<float> rbig(big.size());
  const void* one[1] = {dbig.data()};
  const std::size_t one_bytes[1] = {big.size() * sizeof(float)};
  c.access_peers(one, one_bytes, 1, [&](const communicator::peer_pointers& peers) {
    EPX_CUDA_CHECK(cudaMemcpyAsync(rbig.data(), peers(0, 0), one_bytes[0], cudaMemcpyDefault, c.stream()));
  });
  CHECK(to_host(c, rbig) == big);
  // Bad arguments raise errc::input naming them; the communicator stays usable.
  const void* nine[9] = {};
  const std::size_t nine_bytes[9] = {};
  try {
    c.access_peers(nine, nine_bytes, 9, [](const communicator::peer_pointers&) {});
    FAIL("nine buffers were accepted");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::input);
    CHECK(e.message().find("9 buffers") != std::string::npos);
  }
  const void* null_one[1] = {nullptr};
  try {
    c.access_peers(null_one, one_bytes, 1, [](const communicator::peer_pointers&) {});
    FAIL("a null buffer with bytes was accepted");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::input);
    CHECK(e.message().find("null") != std::string::npos);
  }
  c.barrier();
  // NCCL told not to make symmetric memory: no peer access, and nothing registered. (NCCL
  // read its own copy of the variable when the first communicator started.)
  const char* was = std::getenv("NCCL_WIN_ENABLE");
  const std::string saved = was != nullptr ? was : "";
  setenv("NCCL_WIN_ENABLE", "0", 1);
  {
    ncclUniqueId id2;
    EPX_NCCL_CHECK(ncclGetUniqueId(&id2));
    auto d = communicator::from_unique_id(id2, 1, 0, -1, ts.s, o);
    CHECK(!epx::peer_access_available(d));
    CHECK_THROWS_AS(d.access_peers(one, one_bytes, 1, [](const communicator::peer_pointers&) {}), epx::error);
  }
  if (was != nullptr) setenv("NCCL_WIN_ENABLE", saved.c_str(), 1);
  else unsetenv("NCCL_WIN_ENABLE");
}
#endif

TEST_CASE("nccl communicator at world size 1: every collective, both NCCL modes") {
  for (bool blocking : {true, false}) {
    CAPTURE(blocking);
    test_stream ts;
    auto c = world_of_one(blocking, ts.s);
    REQUIRE(c.size() == 1);
    REQUIRE(c.rank() == 0);
    CHECK(c.stream() == ts.s);
    int dev = -1;
    EPX_CUDA_CHECK(cudaGetDevice(&dev));
    CHECK(c.device() == dev);

    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);

    SUBCASE("all_to_allv and the segmented all-to-all land rows where the receiver names them") {
      // 3 segments of rows of H = 5 floats; the receiver puts them in reverse order.
      const std::size_t H = 5;
      std::vector<std::size_t> rows = {4, 0, 7};
      const std::size_t R = 11;
      std::vector<float> send(R * H);
      for (auto& v : send) v = u(rng);
      std::vector<std::size_t> sc = rows, sd = {0, 4, 4}, rc = rows, rd = {7, 7, 0};
      auto d_send = to_device(c, send);
      device_buffer<float> d_recv(R * H);
      epx::exec::fill_zero(c.execution(), d_recv.data(), R * H);
      epx::all_to_allv_segments(c, d_send.data(), epx::span<const std::size_t>(sc.data(), 3),
                                epx::span<const std::size_t>(sd.data(), 3), d_recv.data(),
                                epx::span<const std::size_t>(rc.data(), 3), epx::span<const std::size_t>(rd.data(), 3),
                                3, H);
      const auto got = to_host(c, d_recv);
      std::vector<float> want(R * H);
      std::copy(send.begin(), send.begin() + 4 * H, want.begin() + 7 * H);
      std::copy(send.begin() + 4 * H, send.end(), want.begin());
      CHECK(got == want);

      // Plain all_to_allv (elements) and all_to_all.
      std::vector<std::size_t> c1 = {R * H}, d0 = {0};
      device_buffer<float> d_r2(R * H);
      c.all_to_allv(d_send.data(), c1.data(), d0.data(), d_r2.data(), c1.data(), d0.data(), datatype::float32);
      CHECK(to_host(c, d_r2) == send);
      device_buffer<float> d_r3(R * H);
      c.all_to_all(d_send.data(), d_r3.data(), R * H, datatype::float32);
      CHECK(to_host(c, d_r3) == send);

      // Counts to itself that disagree are found before anything moves.
      std::vector<std::size_t> bad = {R * H - 1};
      try {
        c.all_to_allv(d_send.data(), c1.data(), d0.data(), d_r2.data(), bad.data(), d0.data(), datatype::float32);
        FAIL("mismatched self counts were accepted");
      } catch (const epx::error& e) {
        CHECK(e.category() == epx::errc::communicator);
        CHECK(e.message().find("expects to receive 54") != std::string::npos);
      }
    }

    SUBCASE("all_reduce: sum and pre-multiplied sum for float, double, bf16, fp16, int32") {
      const std::size_t n = 1000;
      std::vector<float> f(n);
      for (auto& v : f) v = u(rng);
      auto d_f = to_device(c, f);
      device_buffer<float> d_out(n);
      c.all_reduce(d_f.data(), d_out.data(), n, datatype::float32, 1.0);
      CHECK(to_host(c, d_out) == f);  // one rank: the sum is the input
      c.all_reduce(d_f.data(), d_out.data(), n, datatype::float32, 0.25);
      auto got = to_host(c, d_out);
      double err = 0;
      for (std::size_t i = 0; i < n; ++i) err = std::max(err, std::fabs(got[i] - 0.25 * f[i]));
      CHECK(err <= 1e-6);
      // In place.
      c.all_reduce(d_f.data(), d_f.data(), n, datatype::float32, 2.0);
      got = to_host(c, d_f);
      for (std::size_t i = 0; i < n; ++i) err = std::max(err, std::fabs(got[i] - 2.0 * f[i]));
      CHECK(err <= 1e-6);

      std::vector<double> dd(n);
      for (auto& v : dd) v = u(rng);
      auto d_d = to_device(c, dd);
      c.all_reduce(d_d.data(), d_d.data(), n, datatype::float64, 1.0 / 3.0);
      const auto gd = to_host(c, d_d);
      double errd = 0;
      for (std::size_t i = 0; i < n; ++i) errd = std::max(errd, std::fabs(gd[i] - dd[i] / 3.0));
      CHECK(errd <= 1e-15);

      std::vector<epx::bf16> b(n);
      for (auto& v : b) v = epx::bf16(u(rng));
      auto d_b = to_device(c, b);
      c.all_reduce(d_b.data(), d_b.data(), n, datatype::bfloat16, 0.5);
      const auto gb = to_host(c, d_b);
      double errb = 0;
      for (std::size_t i = 0; i < n; ++i)
        errb = std::max(errb, std::fabs(static_cast<double>(static_cast<float>(gb[i])) -
                                        0.5 * static_cast<double>(static_cast<float>(b[i]))));
      CHECK(errb == 0.0);  // halving is exact in bf16

      std::vector<epx::fp16> h(n);
      for (auto& v : h) v = epx::fp16(u(rng));
      auto d_h = to_device(c, h);
      c.all_reduce(d_h.data(), d_h.data(), n, datatype::float16, 0.1);
      const auto gh = to_host(c, d_h);
      double errh = 0;
      for (std::size_t i = 0; i < n; ++i)
        errh = std::max(errh, std::fabs(static_cast<double>(static_cast<float>(gh[i])) -
                                        0.1 * static_cast<double>(static_cast<float>(h[i]))));
      CHECK(errh <= 2e-3);  // scale and result rounded to fp16

      std::vector<std::int32_t> iv(n);
      std::iota(iv.begin(), iv.end(), -300);
      auto d_i = to_device(c, iv);
      c.all_reduce(d_i.data(), d_i.data(), n, datatype::int32, 3.0);
      const auto gi = to_host(c, d_i);
      bool ok = true;
      for (std::size_t i = 0; i < n; ++i) ok = ok && gi[i] == 3 * iv[i];
      CHECK(ok);

      try {
        c.all_reduce(d_i.data(), d_i.data(), n, datatype::int32, 0.5);
        FAIL("a fractional scale on int32 was accepted");
      } catch (const epx::error& e) {
        CHECK(e.category() == epx::errc::input);
        CHECK(e.message().find("0.5") != std::string::npos);
      }
      CHECK_THROWS_AS(c.all_reduce(d_i.data(), d_i.data(), n, datatype::byte, 1.0), epx::error);
    }

    SUBCASE("reduce_scatter, all_gather, broadcast, barrier, split") {
      const std::size_t n = 64;
      std::vector<float> f(n);
      for (auto& v : f) v = u(rng);
      auto d_f = to_device(c, f);
      device_buffer<float> d_o(n);
      c.reduce_scatter(d_f.data(), d_o.data(), n, datatype::float32, 0.5);
      auto got = to_host(c, d_o);
      double err = 0;
      for (std::size_t i = 0; i < n; ++i) err = std::max(err, std::fabs(got[i] - 0.5 * f[i]));
      CHECK(err <= 1e-6);
      device_buffer<float> d_g(n);
      c.all_gather(d_f.data(), d_g.data(), n, datatype::float32);
      CHECK(to_host(c, d_g) == f);
      c.broadcast(d_f.data(), n, datatype::float32, 0);
      CHECK(to_host(c, d_f) == f);
      CHECK_THROWS_AS(c.broadcast(d_f.data(), n, datatype::float32, 1), epx::error);
      c.barrier();
      auto s = c.split(3, 0);
      CHECK(s.size() == 1);
      CHECK(s.rank() == 0);
      CHECK(s.stream() == c.stream());
      s.barrier();
      // A negative color raises errc::input after taking part in the split without a color,
      // so the communicator stays usable (the other ranks' split would return).
      for (int color : {-1, -7}) {
        try {
          (void)c.split(color, 0);
          FAIL_CHECK("split(", color, ") did not raise");
        } catch (const epx::error& e) {
          CHECK(e.category() == epx::errc::input);
          CHECK(e.message().find("must be >= 0") != std::string::npos);
        }
        CHECK_FALSE(c.aborted());
        c.barrier();
      }
      // A timeout must be positive: 0 would abort every wait with work queued.
      CHECK_THROWS_WITH_AS(c.set_timeout(std::chrono::milliseconds(0)), doctest::Contains("must be positive"),
                           epx::error);
      CHECK_THROWS_WITH_AS(c.wait(std::chrono::milliseconds(-1)), doctest::Contains("must be positive"),
                           epx::error);
      // Zero counts are no-ops.
      c.all_reduce(nullptr, nullptr, 0, datatype::float32, 1.0);
      c.all_gather(nullptr, nullptr, 0, datatype::float32);
      c.wait();
    }

    SUBCASE("a wrapped communicator is not destroyed; moved-from and empty ones raise") {
      {
        communicator w(c.native_handle(), ts.s);
        CHECK(w.size() == 1);
        w.barrier();
      }
      c.barrier();  // still alive after the wrapper went away
      communicator m(std::move(c));
      CHECK_THROWS_AS(c.barrier(), epx::error);
      m.barrier();
      communicator empty;
      CHECK_THROWS_AS(empty.barrier(), epx::error);
    }
  }
}

namespace {
int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
}  // namespace

// Needs two GPUs: on a machine with fewer, doctest reports the case as skipped.
TEST_CASE("nccl communicator over every GPU of this process (init_all, one thread per device)" *
          doctest::skip(device_count() < 2)) {
  const int ndev = device_count();
  auto comms = communicator::init_all(ndev);
  REQUIRE(static_cast<int>(comms.size()) == ndev);
  const auto n = static_cast<std::size_t>(ndev);
  const std::size_t H = 33;
  // rows[s][d]: rows s sends to d, uneven and some zero; in nseg = 2 segments.
  auto rows = [](std::size_t s, std::size_t d, std::size_t i) { return (s * 7 + d * 3 + i * 5) % 6; };
  auto value = [](std::size_t s, std::size_t d, std::size_t i, std::size_t r, std::size_t h) {
    return static_cast<float>(s * 1000 + d * 100 + i * 10 + r) + static_cast<float>(h) / 64.0f;
  };
  std::vector<std::string> failures(n);
  std::mutex mu;
  std::vector<std::thread> threads;
  for (std::size_t me = 0; me < n; ++me) {
    threads.emplace_back([&, me] {
      try {
        auto& c = comms[me];
        EPX_CUDA_CHECK(cudaSetDevice(c.device()));
        const std::size_t nseg = 2;
        std::vector<std::size_t> sc(n * nseg), sd(n * nseg), rc(n * nseg), rd(n * nseg);
        std::size_t so = 0;
        for (std::size_t d = 0; d < n; ++d)
          for (std::size_t i = 0; i < nseg; ++i) {
            sc[d * nseg + i] = rows(me, d, i);
            sd[d * nseg + i] = so;
            so += sc[d * nseg + i];
          }
        // Receiver: segment-major (all peers' segment 0, then all peers' segment 1).
        std::size_t ro = 0;
        for (std::size_t i = 0; i < nseg; ++i)
          for (std::size_t s = 0; s < n; ++s) {
            rc[s * nseg + i] = rows(s, me, i);
            rd[s * nseg + i] = ro;
            ro += rc[s * nseg + i];
          }
        std::vector<epx::bf16> send(so * H);
        for (std::size_t d = 0; d < n; ++d)
          for (std::size_t i = 0; i < nseg; ++i)
            for (std::size_t r = 0; r < sc[d * nseg + i]; ++r)
              for (std::size_t h = 0; h < H; ++h)
                send[(sd[d * nseg + i] + r) * H + h] = epx::bf16(value(me, d, i, r, h));
        auto d_send = to_device(c, send);
        device_buffer<epx::bf16> d_recv(std::max<std::size_t>(ro * H, 1));
        epx::all_to_allv_segments(c, d_send.data(), epx::span<const std::size_t>(sc.data(), sc.size()),
                                  epx::span<const std::size_t>(sd.data(), sd.size()), d_recv.data(),
                                  epx::span<const std::size_t>(rc.data(), rc.size()),
                                  epx::span<const std::size_t>(rd.data(), rd.size()), nseg, H);
        const auto got = to_host(c, d_recv);
        for (std::size_t s = 0; s < n; ++s)
          for (std::size_t i = 0; i < nseg; ++i)
            for (std::size_t r = 0; r < rc[s * nseg + i]; ++r)
              for (std::size_t h = 0; h < H; ++h)
                if (got[(rd[s * nseg + i] + r) * H + h].bits != epx::bf16(value(s, me, i, r, h)).bits)
                  throw std::runtime_error("segment row mismatch from rank " + std::to_string(s));

        // bf16 scaled all-reduce: every rank contributes (rank+1) * x; scale 1/n.
        const std::size_t m = 4096;
        std::vector<epx::bf16> x(m);
        for (std::size_t i = 0; i < m; ++i) x[i] = epx::bf16(static_cast<float>((i % 17) * (me + 1)) / 8.0f);
        auto d_x = to_device(c, x);
        c.all_reduce(d_x.data(), d_x.data(), m, datatype::bfloat16, 1.0 / static_cast<double>(n));
        const auto gx = to_host(c, d_x);
        const double tri = static_cast<double>(n * (n + 1) / 2);
        for (std::size_t i = 0; i < m; ++i) {
          const double ref = static_cast<double>(i % 17) / 8.0 * tri / static_cast<double>(n);
          if (std::fabs(static_cast<float>(gx[i]) - ref) > 0.02 * (1.0 + ref))
            throw std::runtime_error("bf16 all_reduce value " + std::to_string(static_cast<float>(gx[i])) +
                                     " vs " + std::to_string(ref));
        }
        // Sub-communicators: even and odd ranks.
        auto sub = c.split(static_cast<int>(me % 2), static_cast<int>(me));
        if (sub.size() != static_cast<int>((n - me % 2 + 1) / 2)) throw std::runtime_error("split size");
        if (sub.rank() != static_cast<int>(me / 2)) throw std::runtime_error("split rank");
        sub.barrier();
        c.barrier();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        failures[me] = e.what();
        comms[me].abort();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(failures[r] == "");
  }
}

// Spins until the host sets *flag, or for at most about 20 s (%globaltimer, nanoseconds), so
// that a test that never releases it cannot hang the device.
__global__ void spin_until_released(volatile int* flag) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*flag == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 20000000000ull) break;
  }
}

// Last in the file: it leaves an aborted communicator behind.
TEST_CASE("nccl errors carry the call and NCCL's text; wait() aborts a collective that never completes") {
  try {
    EPX_NCCL_CHECK(ncclCommInitRank(nullptr, 1, ncclUniqueId{}, 0));
    FAIL("ncclCommInitRank(nullptr) did not fail");
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::nccl);
    CHECK(e.status() != 0);
    CHECK(e.message().find("ncclCommInitRank") != std::string::npos);
  }

  // A collective queued behind a kernel that spins until the host releases it: the stream
  // cannot drain, so wait(timeout) must abort the communicator and raise instead of hanging
  // (and only wait() may raise: the enqueue itself succeeds). ncclCommAbort frees the
  // communicator's device memory, which waits for the device to go idle, so the kernel is
  // released by another thread 2 s after the wait starts: wait() returns once the abort is
  // done, after the release, well before the kernel's own 20 s bound.
  test_stream ts;
  // Nonblocking mode: no NCCL call can block this thread.
  auto c = world_of_one(false, ts.s);
  device_buffer<float> d(256);
  int* flag = nullptr;
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped));
  *flag = 0;
  int* d_flag = nullptr;
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_flag), flag, 0));
  spin_until_released<<<1, 1, 0, c.stream()>>>(d_flag);
  EPX_CUDA_CHECK(cudaGetLastError());
  c.all_reduce(d.data(), d.data(), 256, epx::datatype::float32, 1.0);  // queued behind the spin
  const auto t0 = std::chrono::steady_clock::now();
  std::thread release([flag] {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    *reinterpret_cast<volatile int*>(flag) = 1;  // let the kernel finish
  });
  bool raised = false;
  try {
    c.wait(std::chrono::milliseconds(500));
  } catch (const epx::error& e) {
    raised = true;
    MESSAGE("raised: ", e.what());
  } catch (...) {
    FAIL_CHECK("wait() raised something other than epx::error");
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  release.join();
  (void)cudaStreamSynchronize(ts.s);
  (void)cudaGetLastError();
  EPX_CUDA_CHECK(cudaFreeHost(flag));
  CHECK(raised);
  CHECK(secs >= 0.4);
  CHECK(secs < 30.0);
  CHECK(c.aborted());
  CHECK_THROWS_AS(c.barrier(), epx::error);
}
