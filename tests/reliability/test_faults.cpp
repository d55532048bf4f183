// Fault injection on the threads backend, through the MoE layer (construction, forward,
// backward, expert-gradient hook) on random meshes of 1..8 ranks.
//
// Faults: a rank that throws before or after any of its collective calls or from the
// user's experts callback (which runs between the two all-to-alls); a rank that leaves
// its function instead of entering a collective; a rank that stalls past the watchdog; a
// rank whose N (inside its TP group) or H disagrees, or that passes a bad expert id or a
// NaN weight. Every rank must end with an epx::error naming the cause, within a bounded
// time; threads::run must return (no thread left behind); and a new run with the same
// configuration right afterwards must match the float64 reference.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "epx/comm/threads.hpp"
#include "reliability/reliability_support.hpp"

namespace {

namespace rel = epx::test::rel;
using comm_t = epx::threads::communicator;
using clock_type = std::chrono::steady_clock;
using rel::fault_kind;

struct run_outcome {
  std::vector<rel::rank_result> ranks;
  std::vector<double> rank_seconds;  // when each rank's function ended, from the start
  bool threw = false;                // threads::run rethrew a failure
  epx::errc category = epx::errc::internal;
  std::string message;
  double seconds = 0;  // until threads::run returned
};

run_outcome run_step(const rel::step_config& s, const rel::fault_spec& f, std::chrono::milliseconds watchdog) {
  const int n = s.world();
  run_outcome o;
  o.ranks.resize(static_cast<std::size_t>(n));
  o.rank_seconds.assign(static_cast<std::size_t>(n), 0.0);
  epx::threads::options opts;
  opts.timeout = watchdog;
  const auto t0 = clock_type::now();
  auto seconds_since = [t0] { return std::chrono::duration<double>(clock_type::now() - t0).count(); };
  try {
    epx::threads::run(
        n,
        [&](comm_t& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          try {
            rel::run_rank(comm, s, f, o.ranks[r]);
          } catch (...) {
            o.rank_seconds[r] = seconds_since();
            throw;
          }
          o.rank_seconds[r] = seconds_since();
        },
        opts);
  } catch (const epx::error& e) {
    o.threw = true;
    o.category = e.category();
    o.message = e.what();
  } catch (const std::exception& e) {
    o.threw = true;
    o.message = std::string("non-epx exception: ") + e.what();
  }
  o.seconds = seconds_since();
  return o;
}

// A clean run: every rank done, everything matches the reference.
void check_clean(const rel::step_config& s, const run_outcome& o, const char* when) {
  CAPTURE(when);
  CAPTURE(o.message);
  REQUIRE_FALSE(o.threw);
  for (const auto& r : o.ranks) {
    CHECK(r.done);
    CHECK_MESSAGE(r.mismatches.empty(), r.mismatches);
  }
  (void)s;
}

struct counts {
  int trials = 0, by_kind[16] = {}, by_phase_throw[5] = {}, watchdog_named_stalled = 0;
};

int phase_index(const std::string& msg) {
  const char* phases[] = {"(construction)", "(forward)", "(backward)", "(hook)", "callback"};
  for (int i = 0; i < 5; ++i)
    if (msg.find(phases[i]) != std::string::npos) return i;
  return 4;
}

// Runs one faulty step and checks what every rank saw; then a fresh clean step.
void inject(const rel::step_config& s, const rel::fault_spec& f, const std::vector<long>& calls, counts& n) {
  const int world = s.world();
  const epx::mesh m(s.c.topology);
  const auto watchdog = f.kind == fault_kind::stall ? std::chrono::milliseconds(250) : std::chrono::milliseconds(4000);
  const std::string kind = rel::to_string(f.kind);
  CAPTURE(kind);
  CAPTURE(f.rank);
  CAPTURE(f.target);
  const std::string step = s.describe();
  CAPTURE(step);
  const run_outcome o = run_step(s, f, watchdog);
  CAPTURE(o.message);
  ++n.trials;
  ++n.by_kind[static_cast<int>(f.kind)];

  // threads::run returned (every thread joined) with an error.
  REQUIRE(o.threw);
  const auto& bad = o.ranks[static_cast<std::size_t>(f.rank)];
  CHECK(bad.fired);
  const std::string injected = "injected fault on world rank " + std::to_string(f.rank);

  switch (f.kind) {
    case fault_kind::throw_before:
    case fault_kind::throw_after:
    case fault_kind::throw_in_experts_forward:
    case fault_kind::throw_in_experts_backward: {
      ++n.by_phase_throw[phase_index(bad.message)];
      // The failure rethrown by run is the injected one, as thrown.
      CHECK(o.category == epx::errc::input);
      CHECK(o.message.find(injected) != std::string::npos);
      // Bounded: the error reached everybody without the watchdog.
      CHECK(o.seconds < watchdog.count() / 1000.0);
      for (int r = 0; r < world; ++r) {
        const auto& x = o.ranks[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CAPTURE(x.message);
        REQUIRE(x.thrown);
        CHECK(x.message.find(injected) != std::string::npos);
        CHECK(x.message.find("watchdog") == std::string::npos);
        if (r == f.rank) {
          CHECK(x.category == epx::errc::input);
        } else {
          CHECK(x.category == epx::errc::communicator);
          CHECK(x.message.find("rank " + std::to_string(f.rank) + " failed: ") != std::string::npos);
        }
      }
      break;
    }
    case fault_kind::vanish: {
      CHECK(o.category == epx::errc::communicator);
      CHECK(o.message.find("can never complete") != std::string::npos);
      CHECK(rel::names_rank(o.message, f.rank));
      CHECK(o.seconds < watchdog.count() / 1000.0);
      CHECK(bad.vanished);
      for (int r = 0; r < world; ++r) {
        if (r == f.rank) continue;
        const auto& x = o.ranks[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CAPTURE(x.message);
        REQUIRE(x.thrown);
        CHECK(x.category == epx::errc::communicator);
        CHECK(x.message.find("ranks that returned from their function without entering it") != std::string::npos);
        CHECK(rel::names_rank(x.message, f.rank));
      }
      break;
    }
    case fault_kind::stall: {
      const double stall = f.stall.count() / 1000.0;
      CHECK(o.category == epx::errc::communicator);
      CHECK(o.message.find("watchdog: ") != std::string::npos);
      CHECK(o.message.find("ranks that never entered it: ") != std::string::npos);
      if (rel::names_rank(o.message, f.rank)) ++n.watchdog_named_stalled;
      // The stalled rank is joined after it wakes; the others fail on the watchdog, long
      // before it wakes up.
      CHECK(o.seconds >= stall);
      CHECK(o.seconds < stall + 2.0);
      for (int r = 0; r < world; ++r) {
        const auto& x = o.ranks[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CAPTURE(x.message);
        REQUIRE(x.thrown);
        CHECK(x.category == epx::errc::communicator);
        CHECK(x.message.find("watchdog: ") != std::string::npos);
        if (r != f.rank) {
          CHECK(o.rank_seconds[static_cast<std::size_t>(r)] >= watchdog.count() / 1000.0 * 0.9);
          CHECK(o.rank_seconds[static_cast<std::size_t>(r)] < stall);
        }
      }
      break;
    }
    case fault_kind::hidden_differs: {
      // Layer options that differ between ranks: the constructor's agreement refuses them
      // on every rank of the world, naming the rank and the value.
      const std::string values = "hidden=" + std::to_string(s.c.hidden + 1);
      CHECK(o.category == epx::errc::configuration);
      CHECK(o.seconds < watchdog.count() / 1000.0);
      for (int r = 0; r < world; ++r) {
        const auto& x = o.ranks[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CAPTURE(x.message);
        REQUIRE(x.thrown);
        CHECK(x.category == epx::errc::configuration);
        CHECK(x.message.find(values) != std::string::npos);
        CHECK(rel::names_rank(x.message, f.rank));
      }
      break;
    }
    case fault_kind::rows_differ:
    case fault_kind::bad_id:
    case fault_kind::nan_weight: {
      // The EP group of the bad rank agrees on an errc::input error naming the values; the
      // first rank to rethrow it aborts the run, so everybody else sees it as the cause.
      CHECK(o.category == epx::errc::input);
      CHECK(o.message.find("bad input in the expert-parallel group") != std::string::npos);
      CHECK(o.seconds < watchdog.count() / 1000.0);
      const auto group = m.group_members(epx::group_kind::ep, f.rank);
      const int b = m.batch(f.rank);
      std::string values;
      switch (f.kind) {
        case fault_kind::rows_differ: values = "N=" + std::to_string(s.rows[static_cast<std::size_t>(b)] + 1); break;
        case fault_kind::bad_id: values = "expert id (" + std::to_string(s.c.topology.experts) + ") of token"; break;
        default: values = "is not finite"; break;
      }
      CHECK(o.message.find(values) != std::string::npos);
      for (int r = 0; r < world; ++r) {
        const auto& x = o.ranks[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CAPTURE(x.message);
        REQUIRE(x.thrown);
        CHECK(x.message.find(values) != std::string::npos);
        CHECK(rel::names_rank(x.message, f.rank));
        if (std::find(group.begin(), group.end(), r) != group.end()) {
          CHECK(x.category == epx::errc::input);
        } else {
          CHECK((x.category == epx::errc::communicator || x.category == epx::errc::input));
        }
      }
      break;
    }
    case fault_kind::none: break;
  }

  // A new run right afterwards is correct and makes the same calls.
  const run_outcome again = run_step(s, rel::fault_spec{}, std::chrono::milliseconds(20000));
  check_clean(s, again, "after the fault");
  for (int r = 0; r < world; ++r) CHECK(again.ranks[static_cast<std::size_t>(r)].calls == calls[static_cast<std::size_t>(r)]);
}

// Draws a fault for step `s` (clean per-rank call counts `calls`); false if none fits.
bool draw_fault(epx::ref::rng& g, const rel::step_config& s, const std::vector<long>& calls,
                const std::vector<fault_kind>& kinds, rel::fault_spec& f) {
  const int world = s.world();
  const epx::mesh m(s.c.topology);
  f.kind = kinds[static_cast<std::size_t>(g.below(static_cast<int>(kinds.size())))];
  f.rank = g.below(world);
  const long c = calls[static_cast<std::size_t>(f.rank)];
  f.target = c > 0 ? static_cast<long>(g.next() % static_cast<std::uint64_t>(c)) : 0;
  f.stall = std::chrono::milliseconds(1500);
  const std::size_t N = s.rows[static_cast<std::size_t>(m.batch(f.rank))];
  const auto sl = epx::slice_bounds(N, m.tp(), m.coords(f.rank).tp);
  switch (f.kind) {
    case fault_kind::vanish:
    case fault_kind::stall: return world >= 2;
    case fault_kind::throw_in_experts_backward: return !s.inference;
    case fault_kind::rows_differ: return m.tp() >= 2;
    case fault_kind::hidden_differs: return m.ep() >= 2;
    case fault_kind::bad_id:
    case fault_kind::nan_weight: return !sl.empty();
    default: return true;
  }
}

void run_campaign(std::uint64_t seed, int trials, const std::vector<fault_kind>& kinds, const char* name) {
  const auto meshes = rel::valid_meshes(8);
  epx::ref::rng g(seed);
  counts n;
  while (n.trials < trials) {
    rel::step_config s = rel::random_step(g, meshes);
    // Counting run: the clean step passes and tells each rank's number of collectives.
    const run_outcome clean = run_step(s, rel::fault_spec{}, std::chrono::milliseconds(20000));
    const std::string step = s.describe();
    CAPTURE(step);
    check_clean(s, clean, "counting run");
    std::vector<long> calls;
    for (const auto& r : clean.ranks) calls.push_back(r.calls);
    rel::fault_spec f;
    if (!draw_fault(g, s, calls, kinds, f)) continue;
    inject(s, f, calls, n);
  }
  std::printf("%s: %d faulty runs (+%d clean runs before and after):", name, n.trials, 2 * n.trials);
  for (int k = 1; k <= static_cast<int>(fault_kind::nan_weight); ++k)
    if (n.by_kind[k]) std::printf(" %s=%d", rel::to_string(static_cast<fault_kind>(k)), n.by_kind[k]);
  if (n.by_phase_throw[0] + n.by_phase_throw[1] + n.by_phase_throw[2] + n.by_phase_throw[3] + n.by_phase_throw[4])
    std::printf("; throws by phase: construction=%d forward=%d backward=%d hook=%d experts=%d", n.by_phase_throw[0],
                n.by_phase_throw[1], n.by_phase_throw[2], n.by_phase_throw[3], n.by_phase_throw[4]);
  if (n.by_kind[static_cast<int>(fault_kind::stall)])
    std::printf("; watchdog messages naming the stalled rank: %d of %d", n.watchdog_named_stalled,
                n.by_kind[static_cast<int>(fault_kind::stall)]);
  std::printf("\n");
}

}  // namespace

TEST_CASE("threads: a rank that throws before, inside or after a collective fails every rank with its message") {
  run_campaign(0x5eed01, 120,
               {fault_kind::throw_before, fault_kind::throw_before, fault_kind::throw_after, fault_kind::throw_after,
                fault_kind::throw_in_experts_forward, fault_kind::throw_in_experts_backward},
               "throw");
}

TEST_CASE("threads: a rank that never arrives is named by the peer-exit check or the watchdog") {
  run_campaign(0x5eed02, 30, {fault_kind::vanish, fault_kind::vanish, fault_kind::vanish}, "vanish");
  // Each stall costs 1.5 s (the sleeping rank is joined): a handful.
  run_campaign(0x5eed03, 4, {fault_kind::stall}, "stall");
}

TEST_CASE("threads: mismatched N or H and bad ids or weights raise on every rank naming the values") {
  run_campaign(0x5eed04, 60,
               {fault_kind::rows_differ, fault_kind::hidden_differs, fault_kind::bad_id, fault_kind::nan_weight},
               "input");
}

TEST_CASE("threads: the injection points cover every collective of a step") {
  // On one fixed mesh, throw before and after EVERY collective call of rank 1 in turn.
  const auto meshes = rel::valid_meshes(8);
  epx::ref::rng g(0x5eed05);
  rel::step_config s;
  do {
    s = rel::random_step(g, meshes, 4, false);
  } while (s.c.topology.tp != 2 || s.c.topology.fsdp != 2);
  const run_outcome clean = run_step(s, rel::fault_spec{}, std::chrono::milliseconds(20000));
  check_clean(s, clean, "counting run");
  std::vector<long> calls;
  for (const auto& r : clean.ranks) calls.push_back(r.calls);
  counts n;
  for (long t = 0; t < calls[1]; ++t)
    for (auto k : {fault_kind::throw_before, fault_kind::throw_after}) {
      rel::fault_spec f;
      f.kind = k;
      f.rank = 1;
      f.target = t;
      inject(s, f, calls, n);
    }
  std::printf("every point: %ld collectives on rank 1 of %s, %d faulty runs\n", calls[1], s.describe().c_str(),
              n.trials);
  CHECK(calls[1] >= 8);
}
