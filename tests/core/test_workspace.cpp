// The row-buffer pool of the layer implementations (epx/exec/workspace.hpp), and
// layers that reuse it across calls: bitwise the same results as a fresh layer per call,
// saved states that outlive (or overlap) each other and the layer.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/workspace.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_workspace_cpp {

namespace {

using epx::detail::pooled_buffer;
using epx::detail::workspace;
using comm_t = epx::threads::communicator;

template <class T>
bool aligned64(const T* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 64 == 0;
}

}  // namespace

TEST_CASE("workspace: blocks are reused, best fit, bounded, aligned") {
  workspace ws;
  CHECK(ws.pool() == nullptr);  // nothing allocated before the first acquire
  float* first = nullptr;
  {
    auto a = ws.acquire<float>(1000);
    REQUIRE(a.data() != nullptr);
    CHECK(a.size() == 1000);
    CHECK(aligned64(a.data()));
    first = a.data();
    for (std::size_t i = 0; i < a.size(); ++i) a.data()[i] = static_cast<float>(i);  // the whole block is usable
  }
  CHECK(ws.pool()->free_blocks() == 1);
  {
    auto b = ws.acquire<float>(900);  // smaller: the same block
    CHECK(b.data() == first);
    CHECK(ws.pool()->free_blocks() == 0);
    auto c = ws.acquire<float>(900);  // while b is held: a second block
    CHECK(c.data() != first);
    CHECK(aligned64(c.data()));
  }
  CHECK(ws.pool()->free_blocks() == 2);
  // A request larger than every free block replaces the largest one (the pool holds at most
  // as many blocks as were in use at once).
  {
    auto big = ws.acquire<double>(std::size_t{1} << 20);
    CHECK(big.size() == std::size_t{1} << 20);
    CHECK(ws.pool()->free_blocks() == 1);
  }
  CHECK(ws.pool()->free_blocks() == 2);
  CHECK(ws.pool()->free_bytes() >= (std::size_t{8} << 20) + 3600);
  // Best fit: the small request takes the small block, the large block stays free.
  {
    auto s = ws.acquire<std::uint16_t>(10);
    CHECK(ws.pool()->free_bytes() >= (std::size_t{8} << 20));
    auto e = ws.acquire<float>(0);  // empty handles hold no block
    CHECK(e.size() == 0);
    CHECK(ws.pool()->free_blocks() == 1);
  }
}

TEST_CASE("workspace: a free block of exactly the bytes asked for is handed out again") {
  workspace ws;
  const std::size_t n = (std::size_t{64} << 10) / sizeof(float);  // one 64 KiB granule, exactly
  float* first = nullptr;
  {
    auto a = ws.acquire<float>(n);
    first = a.data();
  }
  REQUIRE(ws.pool()->free_blocks() == 1);
  const std::size_t held = ws.pool()->free_bytes();
  CHECK(held == n * sizeof(float));
  {
    auto b = ws.acquire<float>(n);
    CHECK(b.data() == first);
    CHECK(ws.pool()->free_blocks() == 0);
  }
  CHECK(ws.pool()->free_bytes() == held);  // not replaced by a new block
}

TEST_CASE("workspace: a request whose bytes do not fit in size_t is refused, as operator new[] refuses it") {
  workspace ws;
  CHECK_THROWS_AS(ws.acquire<char>(SIZE_MAX - 100), std::bad_array_new_length);
  CHECK_THROWS_AS(ws.acquire<float>((std::size_t{1} << 62) + 1), std::bad_array_new_length);
  CHECK(ws.acquire<float>(16).size() == 16);  // the pool still works
}

TEST_CASE("workspace: handles are move-only and outlive the workspace") {
  pooled_buffer<int> kept;
  std::weak_ptr<epx::detail::workspace_pool> pool;
  {
    workspace ws;
    auto a = ws.acquire<int>(4096);
    pool = ws.pool();
    for (int i = 0; i < 4096; ++i) a.data()[i] = i;
    kept = std::move(a);
    CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from handles are empty
    CHECK(a.size() == 0);
    workspace moved(std::move(ws));
    auto b = ws.acquire<int>(16);  // a moved-from workspace makes a new pool
    CHECK(b.data() != nullptr);
    CHECK(ws.pool() != moved.pool());
    workspace copy(moved);  // copies never share blocks
    CHECK(copy.pool() == nullptr);
  }
  CHECK_FALSE(pool.expired());  // the handle keeps its pool alive
  int bad = 0;
  for (int i = 0; i < 4096; ++i) bad += kept.data()[i] != i;
  CHECK(bad == 0);
  kept.reset();
  CHECK(pool.expired());
}

namespace {

// Runs `calls` training forward+backward calls of the case on ONE layer (reusing its pool),
// with the batch changing between calls (seed and row count, so R changes too), the saved
// state of call i kept until after the forward of call i+1, and checks every call's outputs
// bitwise against a fresh layer per call. The layer is destroyed before the last saved state.
template <class T, class Impl>
std::string check_reuse(comm_t& world, epx::test::layer_case base, int calls) {
  using namespace epx;
  std::string f;
  try {
    const mesh m(base.topology);
    const int rank = world.rank(), b = m.batch(rank);
    const auto global = ref::linear_experts::random(base.topology.experts, base.hidden, base.seed ^ 0xe9ull);
    layer_options o;
    o.hidden = static_cast<std::size_t>(base.hidden);
    o.top_k = base.top_k;
    o.pad = base.pad;
    auto layer = std::make_unique<moe_layer<comm_t, T, Impl>>(m, world, o);
    saved_state<T> pending;  // the previous call's, consumed one call late
    struct call_data {
      epx::test::layer_case c;
      std::vector<T> x, go;
      std::vector<float> w;
      std::vector<std::int32_t> ids;
      std::vector<T> out;
    };
    call_data prev;
    auto finish = [&](call_data& d, saved_state<T>& s, int i) {
      const std::size_t N = d.c.rows_of(b), H = static_cast<std::size_t>(d.c.hidden);
      ref::test_linear_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
      std::vector<T> gx(N * H, convert<T>(7.0f));
      std::vector<float> gw(N * static_cast<std::size_t>(d.c.top_k), 7.0f);
      layer->backward(std::move(s), span<const T>(d.go), span<T>(gx), span<float>(gw), experts);
      const auto fresh = epx::test::run_layer<comm_t, T, Impl>(world, d.c, global);
      const bool same = d.out.size() == fresh.out.size() && gx.size() == fresh.grad_x.size() &&
                        std::memcmp(d.out.data(), fresh.out.data(), d.out.size() * sizeof(T)) == 0 &&
                        std::memcmp(gx.data(), fresh.grad_x.data(), gx.size() * sizeof(T)) == 0 &&
                        std::memcmp(gw.data(), fresh.grad_w.data(), gw.size() * sizeof(float)) == 0;
      if (!same) f += detail::concat(d.c.describe(), " rank ", rank, " call ", i, ": differs from a fresh layer\n");
    };
    for (int i = 0; i < calls; ++i) {
      call_data d;
      d.c = base;
      d.c.seed = base.seed + static_cast<std::uint64_t>(i) * 17;
      d.c.rows = [i](int bb) { return static_cast<std::size_t>(8 + ((i * 5 + bb * 3) % 11)); };
      const auto bd = epx::test::make_batch<T>(d.c, b);
      const std::size_t N = d.c.rows_of(b), H = static_cast<std::size_t>(d.c.hidden);
      d.x = ref::from_double<T>(bd.x);
      d.go = ref::from_double<T>(bd.grad_out);
      d.w.assign(bd.w.begin(), bd.w.end());
      d.ids = bd.ids;
      d.out.assign(N * H, convert<T>(7.0f));
      ref::test_linear_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
      auto s = layer->forward(span<const T>(d.x), span<const std::int32_t>(d.ids), span<const float>(d.w),
                              span<T>(d.out), experts, mode::train);
      if (i > 0) finish(prev, pending, i - 1);
      pending = std::move(s);
      prev = std::move(d);
    }
    // The last saved state outlives its layer (its buffers keep the pool alive).
    layer.reset();
    pending.reset();
  } catch (const std::exception& ex) {
    f += detail::concat("rank ", world.rank(), ": exception: ", ex.what(), "\n");
  }
  return f;
}

template <class T, class Impl>
void run_reuse(const epx::test::layer_case& c) {
  const int world = c.topology.tp * c.topology.fsdp * c.topology.dp_replicate * c.topology.pp;
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  epx::threads::run(world, [&](comm_t& comm) {
    failures[static_cast<std::size_t>(comm.rank())] = check_reuse<T, Impl>(comm, c, 5);
  });
  for (const auto& s : failures) CHECK_MESSAGE(s.empty(), s);
}

}  // namespace

TEST_CASE("workspace: a layer reused across calls (pooled row buffers) matches a fresh layer bitwise") {
  epx::test::layer_case c;
  c.topology.tp = 2;
  c.topology.fsdp = 2;
  c.topology.ep = 4;
  c.topology.experts = 8;
  c.top_k = 2;
  c.hidden = 16;
  c.routing = epx::test::routing_kind::uneven;
  c.seed = 77;
  run_reuse<float, epx::impl::all_to_all>(c);
  run_reuse<epx::bf16, epx::impl::all_to_all>(c);
  c.topology.tp = 4;
  c.topology.fsdp = 1;
  run_reuse<float, epx::impl::all_reduce>(c);
}

}  // namespace test_workspace_cpp
