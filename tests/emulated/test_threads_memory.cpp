// The threads communicator over memory the host may not read (threads::memory): what
// several ranks on one GPU use (<epx/comm/threads/cuda.cuh>). Here the "device" memory is
// host memory behind a counting copy, so the test sees every block the communicator moves:
// collectives give the same bits as on plain host memory, sums are staged through the host
// (every element read and written through the copy), the layer on exec::emulated_device
// matches the float64 reference and its host-memory run bitwise, and a failing copy raises
// on its rank after the collective, with no member left waiting.
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_threads_memory_cpp {

namespace {

std::atomic<long long> g_copies{0}, g_bytes{0}, g_fail_after{-1};

bool counting_copy(void* dst, const void* src, std::size_t bytes) noexcept {
  const long long n = g_copies.fetch_add(1);
  const long long f = g_fail_after.load();
  if (f >= 0 && n >= f) return false;
  g_bytes.fetch_add(static_cast<long long>(bytes));
  std::memcpy(dst, src, bytes);
  return true;
}

epx::threads::options staged_memory() {
  epx::threads::options o;
  o.memory.copy = &counting_copy;
  o.memory.host_accessible = false;
  o.memory.name = "counted";
  g_copies = 0;
  g_bytes = 0;
  g_fail_after = -1;
  return o;
}

using emu = epx::exec::emulated_device;

}  // namespace

TEST_CASE("threads memory: collectives give the host-memory bits; sums are staged through the copy") {
  for (int n : {1, 2, 3, 8}) {
    CAPTURE(n);
    const std::size_t count = 40000;  // several 16 Ki-element blocks per rank's chunk at n = 1
    std::vector<std::vector<float>> plain(static_cast<std::size_t>(n)), staged(plain.size());
    std::vector<std::vector<float>> a2a_plain(plain.size()), a2a_staged(plain.size());
    auto body = [&](std::vector<std::vector<float>>& sums, std::vector<std::vector<float>>& a2a) {
      return [&](epx::threads::communicator& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        std::vector<float> v(count);
        for (std::size_t i = 0; i < count; ++i) v[i] = 0.1f * static_cast<float>((i * 7 + r * 13) % 101) - 3.0f;
        std::vector<float> out(count);
        c.all_reduce(v.data(), out.data(), count, epx::datatype::float32, 0.5);
        std::vector<float> rs(count / static_cast<std::size_t>(n) + 1);
        const std::size_t per = count / static_cast<std::size_t>(n);
        c.reduce_scatter(v.data(), rs.data(), per, epx::datatype::float32, 1.0);
        out.insert(out.end(), rs.begin(), rs.begin() + static_cast<std::ptrdiff_t>(per));
        c.all_reduce(v.data(), v.data(), count, epx::datatype::float32, 1.0);  // in place
        out.insert(out.end(), v.begin(), v.end());
        sums[r] = out;
        std::vector<float> g(static_cast<std::size_t>(n) * 5);
        c.all_gather(out.data(), g.data(), 5, epx::datatype::float32);
        std::vector<float> t(static_cast<std::size_t>(n) * 3), u(t.size());
        for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(r * 100 + i);
        c.all_to_all(t.data(), u.data(), 3, epx::datatype::float32);
        g.insert(g.end(), u.begin(), u.end());
        a2a[r] = g;
      };
    };
    epx::threads::run(n, body(plain, a2a_plain));
    auto o = staged_memory();
    epx::threads::run(n, body(staged, a2a_staged), o);
    for (int r = 0; r < n; ++r) {
      CHECK(epx::test::bitwise_equal(plain[static_cast<std::size_t>(r)], staged[static_cast<std::size_t>(r)]));
      CHECK(epx::test::bitwise_equal(a2a_plain[static_cast<std::size_t>(r)], a2a_staged[static_cast<std::size_t>(r)]));
    }
    // Staged sums: every rank's whole send buffer goes to the host and every sum back to
    // every rank: 2 * n * count floats per all_reduce (two of them); reduce_scatter: each
    // rank fetches n blocks of `per` and writes its own, n * (n + 1) * per; plus the
    // blocks of all_gather and all_to_all, n * n * (5 + 3) floats (a rank's own included).
    const long long N = n, per = static_cast<long long>(count) / N;
    const long long want = 2 * (2 * N * static_cast<long long>(count) * 4) + N * (N + 1) * per * 4 + N * N * 8 * 4;
    CHECK(g_bytes.load() == want);
  }
}

TEST_CASE("threads memory: the layer on emulated_device, against float64 and bitwise against host memory") {
  using namespace epx::test;
  const epx::mesh_config meshes[] = {{2, 4, 1, 1, 4, 8, 0}, {1, 8, 1, 1, 8, 16, 0}, {4, 2, 1, 1, 4, 8, 0}};
  for (const auto& mc : meshes) {
    for (int hidden : {8, 256}) {
      layer_case c;
      c.topology = mc;
      c.hidden = hidden;
      c.top_k = 2;
      c.seed = 11 + static_cast<std::uint64_t>(hidden);
      CAPTURE(c.describe());
      const auto global = epx::ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
      const int world = mc.tp * mc.fsdp;
      std::vector<std::string> fails(static_cast<std::size_t>(world));
      std::vector<layer_outputs<float>> plain(fails.size()), staged(fails.size());
      epx::threads::run(world, [&](epx::threads::communicator& comm) {
        plain[static_cast<std::size_t>(comm.rank())] =
            run_layer<epx::threads::communicator, float, epx::impl::all_to_all, emu>(comm, c, global);
      });
      auto o = staged_memory();
      epx::threads::run(
          world,
          [&](epx::threads::communicator& comm) {
            fails[static_cast<std::size_t>(comm.rank())] =
                check_layer_case<epx::threads::communicator, float>(comm, c);  // float64 reference (test_exec)
            staged[static_cast<std::size_t>(comm.rank())] =
                run_layer<epx::threads::communicator, float, epx::impl::all_to_all, emu>(comm, c, global);
          },
          o);
      CHECK(g_copies.load() > 0);
      for (std::size_t r = 0; r < fails.size(); ++r) {
        CHECK_MESSAGE(fails[r].empty(), fails[r]);
        CHECK(bitwise_equal(plain[r].out, staged[r].out));
        CHECK(bitwise_equal(plain[r].grad_x, staged[r].grad_x));
        CHECK(bitwise_equal(plain[r].grad_w, staged[r].grad_w));
        CHECK(bitwise_equal(plain[r].expert_grads, staged[r].expert_grads));
      }
    }
  }
}

TEST_CASE("threads memory: a failing copy raises on its rank after the collective; nobody hangs") {
  auto o = staged_memory();
  o.timeout = std::chrono::seconds(20);
  g_fail_after = 3;  // the fourth block any rank copies fails
  std::string msg;
  epx::errc code = epx::errc::internal;
  try {
    epx::threads::run(
        4,
        [&](epx::threads::communicator& c) {
          std::vector<float> v(64, 1.0f), r(64 * 4);
          for (int i = 0; i < 3; ++i) c.all_gather(v.data(), r.data(), 64, epx::datatype::float32);
          c.barrier();
        },
        o);
  } catch (const epx::error& e) {
    msg = e.what();
    code = e.category();
  }
  CHECK(code == epx::errc::communicator);
  CHECK_MESSAGE(msg.find("copying a block between the ranks' buffers failed (memory 'counted')") != std::string::npos,
                msg);
}

TEST_CASE("threads memory: memory the host cannot read needs a copy function") {
  epx::threads::options o;
  o.memory.host_accessible = false;
  o.memory.name = "nowhere";
  std::string msg;
  try {
    epx::threads::run(2, [](epx::threads::communicator&) {}, o);
  } catch (const epx::error& e) {
    CHECK(e.category() == epx::errc::configuration);
    msg = e.what();
  }
  CHECK_MESSAGE(msg.find("memory 'nowhere' is not host-accessible but names no copy function") != std::string::npos,
                msg);
}

}  // namespace test_threads_memory_cpp
