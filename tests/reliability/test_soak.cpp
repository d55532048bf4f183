// Soak: many random MoE layer steps on the threads backend, each compared with the float64
// reference, some with an injected input fault that every rank must report.
//
// Each step draws a valid mesh for 1..8 ranks (tp, fsdp, pp, dp_replicate, ep), N per batch
// (0 and 1 included), H, E (a multiple of ep), k, element type (float, bf16, fp16, double),
// padding, implementation (all_to_all; all_reduce when ep == tp; automatic), training or
// inference, and a routing (random, balanced, skewed, all to one expert, only the experts
// of EP rank 0; batches with N = 0 send nothing). One epx::threads::run per step, with
// world size = the mesh's world. Training steps run forward, backward and the expert
// gradient hook; out, grad_x, grad_weights and the expert gradients after the hook are
// compared with the reference.
//
// About 5% of the steps put a bad expert id or a NaN weight on one rank: the step must
// fail on every rank (errc::input naming the rank on every rank of its EP group, the
// abort naming it elsewhere) and the next step must be correct again.
//
// Size: EPX_SOAK_STEPS (default 6000) and EPX_SOAK_SECONDS (default 25): the soak stops at
// whichever comes first. A long soak: EPX_SOAK_SECONDS=600 EPX_SOAK_STEPS=100000000
// ./test_reliability_test_soak. EPX_SOAK_SEED picks another sequence.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "epx/comm/threads.hpp"
#include "reliability/reliability_support.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_soak_cpp {

namespace {

namespace rel = epx::test::rel;
using comm_t = epx::threads::communicator;
using rel::fault_kind;

struct soak_counts {
  long steps = 0, train = 0, inference = 0, rank_steps = 0, empty_batches = 0;
  long faults_injected = 0, faults_detected = 0, correct_after_fault = 0, mismatches = 0, unexpected_errors = 0;
  long by_type[4] = {}, by_impl[3] = {}, by_world[9] = {}, direct = 0;
  std::set<std::string> configurations, meshes;
};

}  // namespace

TEST_CASE("soak: random layer steps against the float64 reference, with injected input faults") {
  const long max_steps = rel::env_long("EPX_SOAK_STEPS", 6000);
  const long max_seconds = rel::env_long("EPX_SOAK_SECONDS", 25);
  const auto seed = static_cast<std::uint64_t>(rel::env_long("EPX_SOAK_SEED", 20261130));
  const auto meshes = rel::valid_meshes(8);
  epx::ref::rng g(seed);
  soak_counts n;
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [t0] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  epx::threads::options opts;
  opts.timeout = std::chrono::seconds(30);  // generous: sanitizer builds on two shared cores
  bool after_fault = false;
  std::string first_failures;

  while (n.steps < max_steps && elapsed() < static_cast<double>(max_seconds)) {
    const rel::step_config s = rel::random_step(g, meshes);
    const epx::mesh m(s.c.topology);
    const int world = s.world();
    rel::fault_spec f;
    if (g.below(20) == 0) {
      f.kind = g.below(2) == 0 ? fault_kind::bad_id : fault_kind::nan_weight;
      f.rank = g.below(world);
      const std::size_t N = s.rows[static_cast<std::size_t>(m.batch(f.rank))];
      if (epx::slice_bounds(N, m.tp(), m.coords(f.rank).tp).empty()) f.kind = fault_kind::none;  // nothing to spoil
    }
    std::vector<rel::rank_result> res(static_cast<std::size_t>(world));
    std::string run_error;
    epx::errc run_category = epx::errc::internal;
    try {
      epx::threads::run(
          world, [&](comm_t& comm) { rel::run_rank(comm, s, f, res[static_cast<std::size_t>(comm.rank())]); },
          opts);
    } catch (const epx::error& e) {
      run_error = e.what();
      run_category = e.category();
    } catch (const std::exception& e) {
      run_error = std::string("non-epx exception: ") + e.what();
    }

    ++n.steps;
    n.rank_steps += world;
    ++(s.inference ? n.inference : n.train);
    ++n.by_type[static_cast<int>(s.type)];
    ++n.by_impl[static_cast<int>(s.impl)];
    if (s.c.peer_access) ++n.direct;
    ++n.by_world[world];
    n.empty_batches += std::count(s.rows.begin(), s.rows.end(), std::size_t{0});
    n.configurations.insert(s.shape_key());
    n.meshes.insert(epx::detail::concat(s.c.topology.tp, ",", s.c.topology.fsdp, ",", s.c.topology.pp, ",",
                                        s.c.topology.dp_replicate, ",", s.c.topology.ep));

    std::string failure;
    if (f.kind == fault_kind::none) {
      if (!run_error.empty()) {
        ++n.unexpected_errors;
        failure = s.describe() + ": unexpected error: " + run_error + "\n";
      }
      for (const auto& r : res)
        if (!r.mismatches.empty()) {
          ++n.mismatches;
          failure += r.mismatches;
        }
      if (after_fault && failure.empty()) ++n.correct_after_fault;
      after_fault = false;
    } else {
      ++n.faults_injected;
      // Detected = the run failed with the agreed input error, and every rank raised an
      // error naming the bad rank and the bad value (errc::input in its EP group).
      const auto group = m.group_members(epx::group_kind::ep, f.rank);
      const std::string value = f.kind == fault_kind::bad_id
                                    ? "expert id (" + std::to_string(s.c.topology.experts) + ")"
                                    : std::string("is not finite");
      bool ok = run_category == epx::errc::input && run_error.find(value) != std::string::npos &&
                res[static_cast<std::size_t>(f.rank)].fired;
      for (int r = 0; r < world && ok; ++r) {
        const auto& x = res[static_cast<std::size_t>(r)];
        const bool in_group = std::find(group.begin(), group.end(), r) != group.end();
        ok = x.thrown && x.message.find(value) != std::string::npos && rel::names_rank(x.message, f.rank) &&
             (in_group ? x.category == epx::errc::input : x.category == epx::errc::communicator);
      }
      if (ok) {
        ++n.faults_detected;
      } else {
        failure = s.describe() + ": " + rel::to_string(f.kind) + " on rank " + std::to_string(f.rank) +
                  " not reported as expected; run error: " + run_error + "\n";
      }
      after_fault = true;
    }
    if (!failure.empty() && first_failures.size() < 4000) first_failures += failure;
  }

  const double secs = elapsed();
  std::printf(
      "soak: %ld steps (%ld train, %ld inference; %ld rank-steps) in %.1f s, seed %llu; %zu distinct "
      "configurations on %zu meshes; worlds 1..8: %ld %ld %ld %ld %ld %ld %ld %ld; float/bf16/double/fp16: %ld/%ld/%ld/%ld; "
      "all_to_all/all_reduce/automatic: %ld/%ld/%ld; peer access allowed (direct route): %ld; empty batches: %ld; faults injected: %ld, detected: %ld, "
      "clean steps right after a fault correct: %ld; "
      "unexpected errors: %ld; mismatches: %ld\n",
      n.steps, n.train, n.inference, n.rank_steps, secs, static_cast<unsigned long long>(seed),
      n.configurations.size(), n.meshes.size(), n.by_world[1], n.by_world[2], n.by_world[3], n.by_world[4],
      n.by_world[5], n.by_world[6], n.by_world[7], n.by_world[8], n.by_type[0], n.by_type[1], n.by_type[2], n.by_type[3],
      n.by_impl[0], n.by_impl[1], n.by_impl[2], n.direct, n.empty_batches, n.faults_injected, n.faults_detected, n.correct_after_fault,
      n.unexpected_errors, n.mismatches);
  std::fflush(stdout);
  CHECK_MESSAGE(first_failures.empty(), first_failures);
  CHECK(n.mismatches == 0);
  CHECK(n.unexpected_errors == 0);
  CHECK(n.faults_detected == n.faults_injected);
  CHECK(n.steps >= std::min<long>(max_steps, 100));  // the soak did run
}

}  // namespace test_soak_cpp
