// all_to_allv of rows over the threads communicator, against a memcpy of the same bytes.
//
//   ./bench_comm --benchmark_out=threads.json --benchmark_out_format=json
//
// Every rank sends `bytes_per_peer` (rows of H = 1024 floats) to every rank, itself
// included. Rank 0 drives Google Benchmark's loop; the other ranks follow it. Each
// iteration is timed on rank 0 from a barrier to the return of the call (whose exit
// barrier means every rank has its data), and handed to Google Benchmark as manual time.
// In the same iteration the floor is timed from a barrier to a barrier: every rank memcpys
// exactly the blocks it receives, from the same peers' send buffers into the same places
// of its receive buffer, with as many threads copying at once, and no protocol (no
// publishing, no entry barrier, no checks). The first exchange's received blocks are
// checked against the senders' (every rank's data differs). Counters:
//   GB/s              bytes moved by all ranks per call / median time
//   memcpy_GB/s       the same bytes moved by the plain memcpys / their median time
//   floor_ratio       median all_to_allv time / median memcpy time (1.0 would be the
//                     copy floor); medians, because on a shared machine a preempted
//                     thread adds a whole time slice to a few iterations
//   floor_ratio_mean  the same with means
//   checked           1: the received blocks matched
//
// The exchange is written against the communicator concept (`exchange_rows`); another host
// backend gets its variant by driving the same function from its own ranks (the MPI one
// lives in bench_comm_mpi.cpp, one process per rank).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check_failed.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/threads.hpp"

namespace {

constexpr std::size_t kRowElems = 1024;  // floats per row: 4 KiB rows

using clock_type = std::chrono::steady_clock;

// One rank's buffers: [rows, H] peer-major, `rows_per_peer` rows for each peer.
struct rank_buffers {
  std::vector<float> send, recv;
  std::vector<std::size_t> counts, offsets;
};

rank_buffers make_buffers(int rank, std::size_t n, std::size_t rows_per_peer) {
  rank_buffers b;
  b.send.resize(n * rows_per_peer * kRowElems);
  b.recv.assign(b.send.size(), 0.0f);  // touched: no page faults inside the timed region
  for (std::size_t i = 0; i < b.send.size(); ++i) b.send[i] = static_cast<float>((i + rank) % 1000) * 0.5f;
  b.counts.assign(n, rows_per_peer);
  b.offsets.resize(n);
  for (std::size_t p = 0; p < n; ++p) b.offsets[p] = p * rows_per_peer;
  return b;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

template <class Comm>
void exchange_rows(Comm& comm, rank_buffers& b) {
  epx::all_to_allv_rows(comm, b.send.data(), epx::make_span(b.counts), epx::make_span(b.offsets), b.recv.data(),
                        epx::make_span(b.counts), epx::make_span(b.offsets), kRowElems);
}

void threads_all_to_allv_rows(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const auto bytes_per_peer = static_cast<std::size_t>(state.range(1));
  const std::size_t rows_per_peer = std::max<std::size_t>(1, bytes_per_peer / (kRowElems * sizeof(float)));
  const std::size_t block_bytes = rows_per_peer * kRowElems * sizeof(float);

  std::vector<const float*> sends(static_cast<std::size_t>(n));  // every rank's send buffer
  std::atomic<bool> go{false};
  std::vector<double> times, copy_times;  // per iteration, seconds
  std::vector<char> bad(static_cast<std::size_t>(n), 0);  // per rank: its received blocks were wrong

  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    const int me = comm.rank();
    rank_buffers b = make_buffers(me, static_cast<std::size_t>(n), rows_per_peer);
    sends[static_cast<std::size_t>(me)] = b.send.data();
    // The floor: the very copies the exchange makes, without the protocol.
    auto copy_floor = [&] {
      for (int k = 0; k < n; ++k) {
        const int p = (me + k) % n;
        std::memcpy(b.recv.data() + static_cast<std::size_t>(p) * rows_per_peer * kRowElems,
                    sends[static_cast<std::size_t>(p)] + static_cast<std::size_t>(me) * rows_per_peer * kRowElems,
                    block_bytes);
      }
    };
    comm.barrier();  // sends[] complete
    for (int w = 0; w < 2; ++w) {  // warm-up
      exchange_rows(comm, b);
      if (w == 0) {  // the check, before the floor's copies write the same blocks
        const std::size_t block = rows_per_peer * kRowElems;
        for (std::size_t p = 0; p < static_cast<std::size_t>(n) && !bad[static_cast<std::size_t>(me)]; ++p)
          for (std::size_t i = 0; i < block; ++i)
            if (b.recv[p * block + i] !=
                static_cast<float>((static_cast<std::size_t>(me) * block + i + p) % 1000) * 0.5f) {
              bad[static_cast<std::size_t>(me)] = 1;
              break;
            }
      }
      copy_floor();
      comm.barrier();
    }
    // Per iteration: barrier, exchange (timed until it returns on rank 0: its exit barrier
    // means every rank is done), barrier, the floor's copies plus one barrier (timed).
    if (me == 0) {
      for (auto _ : state) {
        go.store(true);
        comm.barrier();
        const auto t0 = clock_type::now();
        exchange_rows(comm, b);
        const auto t1 = clock_type::now();
        comm.barrier();
        const auto t2 = clock_type::now();
        copy_floor();
        comm.barrier();
        const auto t3 = clock_type::now();
        const double t = std::chrono::duration<double>(t1 - t0).count();
        state.SetIterationTime(t);
        times.push_back(t);
        copy_times.push_back(std::chrono::duration<double>(t3 - t2).count());
      }
      go.store(false);
      comm.barrier();
    } else {
      for (;;) {
        comm.barrier();
        if (!go.load()) break;
        exchange_rows(comm, b);
        comm.barrier();
        copy_floor();
        comm.barrier();
      }
    }
    benchmark::DoNotOptimize(b.recv.data());
  });

  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) {
    epx::bench::fail_check(state, "output check failed: a received block differs from the sender's");
    return;
  }
  const double moved = static_cast<double>(block_bytes) * n * n;  // every pair, self included
  const double per_call = median(times), per_copy = median(copy_times);
  state.counters["ranks"] = n;
  state.counters["bytes_per_peer"] = static_cast<double>(block_bytes);
  state.counters["GB/s"] = moved / per_call * 1e-9;
  state.counters["memcpy_GB/s"] = moved / per_copy * 1e-9;
  state.counters["floor_ratio"] = per_call / per_copy;
  state.counters["floor_ratio_mean"] = mean(times) / mean(copy_times);
  state.counters["checked"] = 1;
  state.SetLabel("threads all_to_allv_rows");
  state.SetBytesProcessed(static_cast<std::int64_t>(moved) * state.iterations());
}

// 2, 4, 8 ranks; 64 KiB .. 16 MiB per peer pair.
void args(benchmark::internal::Benchmark* b) {
  for (std::int64_t ranks : {2, 4, 8})
    for (std::int64_t kib : {64, 256, 1024, 4096, 16384}) b->Args({ranks, kib * 1024});
  b->ArgNames({"ranks", "bytes_per_peer"});
}

BENCHMARK(threads_all_to_allv_rows)->Apply(args)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The fixed cost every collective pays: one barrier (entry barrier and check of the calls).
// An iteration is a batch of 100 barriers; `barriers` counts them per second.
void threads_barrier(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  std::atomic<bool> go{false};
  epx::threads::run(n, [&](epx::threads::communicator& comm) {
    constexpr int batch = 100;
    if (comm.rank() == 0) {
      for (auto _ : state) {
        go.store(true);
        comm.barrier();
        const auto t0 = clock_type::now();
        for (int i = 0; i < batch; ++i) comm.barrier();
        state.SetIterationTime(std::chrono::duration<double>(clock_type::now() - t0).count());
      }
      go.store(false);
      comm.barrier();
    } else {
      for (;;) {
        comm.barrier();
        if (!go.load()) break;
        for (int i = 0; i < batch; ++i) comm.barrier();
      }
    }
  });
  state.counters["ranks"] = n;
  state.counters["barriers"] = benchmark::Counter(100.0, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(threads_barrier)->ArgName("ranks")->Arg(2)->Arg(4)->Arg(8)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;  // a mistyped flag is not ignored
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return epx::bench::check_failed() ? 1 : 0;  // a failed output check fails the run
}
