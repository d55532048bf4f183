// The same bits on the MPI backend as on the threads backend (docs/semantics.md section 4,
// "Determinism": communicator sums computed once per element in rank order on threads and
// MPI): each rank runs a case on MPI (the direct route through MPI-3 shared memory, the
// staged route with rows sent by index through MPI_Alltoallw or gathered first, in one
// round or in many, a communicator without shared memory; a capacity that drops pairs,
// per-rank sends, FP8 dispatch, bounded mode), rank 0 gathers every rank's bytes, runs the
// same case on a threads communicator of as many ranks in its own process and compares
// them byte for byte (core/same_bits_cases.hpp), at E = 64, top-8, H 2048 and 7168, float
// and bf16.
#include <doctest/doctest.h>

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/same_bits_cases.hpp"
#include "epx/comm/mpi.hpp"
#include "epx/comm/threads.hpp"

namespace {

using epx::test::layer_case;
using epx::test::routing_kind;
using epx::test::bitwise_runs::differences;
using epx::test::bitwise_runs::make;
using epx::test::bitwise_runs::run_bits;
using epx::test::bitwise_runs::run_one;
using epx::test::bitwise_runs::stage_of;
using comm_t = epx::mpi::communicator;

template <class V>
void put(std::vector<char>& buf, const std::vector<V>& v) {
  const std::uint64_t n = v.size();
  const char* p = reinterpret_cast<const char*>(&n);
  buf.insert(buf.end(), p, p + sizeof n);
  p = reinterpret_cast<const char*>(v.data());
  buf.insert(buf.end(), p, p + v.size() * sizeof(V));
}

template <class V>
std::vector<V> take(const char*& p) {
  std::uint64_t n = 0;
  std::memcpy(&n, p, sizeof n);
  p += sizeof n;
  std::vector<V> v(static_cast<std::size_t>(n));
  if (n > 0) std::memcpy(v.data(), p, v.size() * sizeof(V));
  p += v.size() * sizeof(V);
  return v;
}

template <class T>
std::vector<char> pack(const run_bits<T>& r) {
  std::vector<char> b;
  put(b, r.out);
  put(b, r.inference_out);
  put(b, r.grad_x);
  put(b, r.grad_w);
  put(b, r.expert_grads);
  return b;
}

template <class T>
run_bits<T> unpack(const char* p) {
  run_bits<T> r;
  r.out = take<T>(p);
  r.inference_out = take<T>(p);
  r.grad_x = take<T>(p);
  r.grad_w = take<float>(p);
  r.expert_grads = take<double>(p);
  return r;
}

// Every rank's bytes at rank 0 (empty elsewhere).
std::vector<std::vector<char>> gather_at_root(const std::vector<char>& mine) {
  int n = 0, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  int size = static_cast<int>(mine.size());
  std::vector<int> sizes(static_cast<std::size_t>(n)), displs(static_cast<std::size_t>(n));
  MPI_Gather(&size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    displs[static_cast<std::size_t>(r)] = total;
    total += sizes[static_cast<std::size_t>(r)];
  }
  std::vector<char> all(me == 0 ? static_cast<std::size_t>(total) : 0);
  MPI_Gatherv(mine.data(), size, MPI_CHAR, all.data(), sizes.data(), displs.data(), MPI_CHAR, 0, MPI_COMM_WORLD);
  std::vector<std::vector<char>> v;
  if (me == 0)
    for (int r = 0; r < n; ++r)
      v.emplace_back(all.begin() + displs[static_cast<std::size_t>(r)],
                     all.begin() + displs[static_cast<std::size_t>(r)] + sizes[static_cast<std::size_t>(r)]);
  return v;
}

struct mpi_variant {
  std::string name;
  std::function<void(epx::layer_options&)> change;
  bool shared_memory = true;  // mpi::options::shared_memory (false: no peer access on MPI)
  std::function<void(epx::mpi::options&)> mpi = {};  // other options of the MPI communicator
};

template <class T, class Impl = epx::impl::all_to_all>
void check_against_threads(const layer_case& c, const std::vector<mpi_variant>& variants) {
  CAPTURE(c.describe());
  const int n = comm_t::world().size();
  for (const auto& v : variants) {
    CAPTURE(v.name);
    epx::layer_options o = epx::test::options_for(c);
    if (v.change) v.change(o);
    epx::mpi::options mo;
    mo.shared_memory = v.shared_memory;
    if (v.mpi) v.mpi(mo);
    comm_t world = comm_t::world(mo);
    const auto mine = run_one<comm_t, T, epx::exec::serial, Impl>(world, c, o, {});
    // The route the variant names (all ranks of the job run on one node: shared memory).
    const bool direct = std::is_same_v<Impl, epx::impl::all_to_all> && v.shared_memory && o.peer_access &&
                        o.sends == epx::row_sends::per_slot && o.counts == epx::count_exchange::host;
    CHECK(mine.peer_access == direct);
    const auto all = gather_at_root(pack(mine));
    if (world.rank() == 0) {
      std::vector<run_bits<T>> threads(static_cast<std::size_t>(n));
      epx::threads::run(n, [&](epx::threads::communicator& comm) {
        threads[static_cast<std::size_t>(comm.rank())] =
            run_one<epx::threads::communicator, T, epx::exec::serial, Impl>(comm, c, o, {});
      });
      std::string f;
      for (int r = 0; r < n; ++r)
        f += differences(unpack<T>(all[static_cast<std::size_t>(r)].data()), threads[static_cast<std::size_t>(r)],
                         epx::detail::concat(v.name, ": MPI against threads, rank ", r));
      if (!f.empty()) std::fprintf(stderr, "%s", f.c_str());  // the MPI main prints the expression only
      CHECK_MESSAGE(f.empty(), f);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

template <class T>
std::vector<mpi_variant> variants_for(const layer_case& c) {
  const std::size_t few = stage_of(c, 3, sizeof(T));
  return {
      {"default", {}, true},
      {"no shared memory", {}, false},
      {"staged", [](epx::layer_options& o) { o.peer_access = false; }, true},
      {"staged gathered", [](epx::layer_options& o) { o.peer_access = false; o.indexed_sends = false; }, true},
      {"staged in rounds of 3 rows",
       [few](epx::layer_options& o) {
         o.peer_access = false;
         o.stage_bytes = few;
       },
       true},
      {"local capacity by score",
       [](epx::layer_options& o) {
         o.capacity.mode = epx::capacity_mode::local;
         o.capacity.factor = 0.5;
         o.capacity.priority = epx::drop_priority::score;
       },
       true},
      {"per-rank sends", [](epx::layer_options& o) { o.sends = epx::row_sends::per_rank; }, true},
      {"FP8 dispatch", [](epx::layer_options& o) { o.fp8_dispatch = true; }, true},
      {"FP8 dispatch, staged", [](epx::layer_options& o) { o.fp8_dispatch = true; o.peer_access = false; }, true},
      {"bounded, cap 2",
       [](epx::layer_options& o) {
         o.counts = epx::count_exchange::device;
         o.bound.cap = 2;
       },
       true},
  };
}

}  // namespace

TEST_CASE_TEMPLATE("same bits (MPI): every rank's bytes equal the threads backend's, E = 64, top-8, ep = world", T,
                   float, epx::bf16) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const auto c = make(1, n, n, 2048, 12, routing_kind::uneven);
  check_against_threads<T>(c, variants_for<T>(c));
}

TEST_CASE_TEMPLATE("same bits (MPI): tp = 2, H = 7168", T, float, epx::bf16) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n % 4 != 0) return;  // ep = n / 2, a multiple of tp
  const auto c = make(2, n / 2, n / 2, 7168, 8);
  check_against_threads<T>(c, variants_for<T>(c));
}

// The expert gradients summed over an efsdp group of 4 ranks (ep = n / 4): the hook's sums
// in rank order, which two contributions (the cases above: efsdp 1 and 2) cannot show,
// whichever way the MPI communicator sums and moves them.
TEST_CASE_TEMPLATE("same bits (MPI): the expert hook over four ranks (efsdp = 4)", T, float, epx::bf16) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n % 4 != 0) return;
  const auto c = make(1, n, n / 4, 2048, 12, routing_kind::uneven);
  auto staged = [](epx::layer_options& o) { o.peer_access = false; };
  check_against_threads<T>(
      c, {{"default", {}, true},
          {"staged", staged, true},
          // The sums gathered whole on every rank, or split by blocks over the ranks (the
          // expert gradients here are 1 to 2 MiB, beyond the default 256 KiB of the gather).
          {"staged, all_reduce gathered", staged, true,
           [](epx::mpi::options& m) { m.all_reduce_gather_bytes = std::size_t{1} << 30; }},
          {"staged, all_reduce by blocks", staged, true, [](epx::mpi::options& m) { m.all_reduce_gather_bytes = 0; }},
          // Every transfer in chunks of at most 1000 elements, and without the count check.
          {"staged, chunked transfers", staged, true, [](epx::mpi::options& m) { m.max_count = 1000; }},
          {"default, no count check", {}, true, [](epx::mpi::options& m) { m.check_counts = false; }}});
}

// The masked all-reduce path (ep == tp = n): the output's sum over the EP group in rank
// order, gathered whole or split by blocks, bounded mode's too.
TEST_CASE_TEMPLATE("same bits (MPI): the masked all-reduce path, ep == tp = world", T, float, epx::bf16) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const auto c = make(n, 1, n, 2048, 16, routing_kind::uneven);
  auto gathered = [](epx::mpi::options& m) { m.all_reduce_gather_bytes = std::size_t{1} << 30; };
  auto blocks = [](epx::mpi::options& m) { m.all_reduce_gather_bytes = 0; };
  auto bounded = [](epx::layer_options& o) {
    o.counts = epx::count_exchange::device;
    o.bound.cap = 1;
  };
  check_against_threads<T, epx::impl::all_reduce>(c, {{"masked", {}, true},
                                                      {"masked, all_reduce gathered", {}, true, gathered},
                                                      {"masked, all_reduce by blocks", {}, true, blocks},
                                                      {"masked bounded", bounded, true},
                                                      {"masked bounded, all_reduce by blocks", bounded, true, blocks}});
}
