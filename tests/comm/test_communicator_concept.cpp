// The communicator concept (epx/comm/communicator.hpp), checked at compile time: a complete
// communicator passes is_communicator_v and check_communicator; the backends pass; a type
// that lacks any one required call, or has it with other arguments, fails, and the trait
// behind the diagnostic names that call. (compile_fail/missing_all_gather.cpp shows the
// message check_communicator prints for a missing member.)
#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <type_traits>

#include "epx/comm/collectives.hpp"
#include "epx/comm/communicator.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_communicator_concept_cpp {

namespace {

using epx::datatype;

// Every required call, with the concept's argument types; a single rank that copies.
struct complete_comm {
  int rank() const { return 0; }
  int size() const { return 1; }
  complete_comm split(int, int) const { return {}; }
  void all_to_all(const void*, void*, std::size_t, datatype) {}
  void all_to_allv(const void*, const std::size_t*, const std::size_t*, void*, const std::size_t*,
                   const std::size_t*, datatype) {}
  void all_reduce(const void*, void*, std::size_t, datatype, double) {}
  void reduce_scatter(const void*, void*, std::size_t, datatype, double) {}
  void all_gather(const void*, void*, std::size_t, datatype) {}
  void broadcast(void*, std::size_t, datatype, int) {}
  void barrier() {}
};

static_assert(epx::is_communicator_v<complete_comm>);
static_assert(epx::is_communicator_v<const complete_comm&>);
static_assert(epx::check_communicator<complete_comm>());
static_assert(!epx::has_peer_access_v<complete_comm>);
static_assert(!epx::detail::has_native_segments<complete_comm>::value);

// The optional members do not change the verdict.
struct complete_comm_with_options : complete_comm {
  complete_comm_with_options split(int, int) const { return {}; }
  void all_to_allv_segments(const void*, const std::size_t*, const std::size_t*, void*, const std::size_t*,
                            const std::size_t*, std::size_t, datatype) {}
  void wait() {}
};
static_assert(epx::check_communicator<complete_comm_with_options>());
static_assert(epx::detail::has_native_segments<complete_comm_with_options>::value);

// Move-only is enough (the threads communicator is move-only).
struct move_only_comm : complete_comm {
  move_only_comm() = default;
  move_only_comm(move_only_comm&&) = default;
  move_only_comm& operator=(move_only_comm&&) = default;
  move_only_comm(const move_only_comm&) = delete;
  move_only_comm& operator=(const move_only_comm&) = delete;
  move_only_comm split(int, int) const { return {}; }
};
static_assert(epx::check_communicator<move_only_comm>());

// The backends that build here.
static_assert(epx::check_communicator<epx::threads::communicator>());
static_assert(epx::is_communicator_v<epx::threads::communicator&>);

// One type per requirement, lacking just that one: bit i of Missing removes call i.
enum missing : unsigned {
  no_rank = 1u << 0,
  no_size = 1u << 1,
  no_split = 1u << 2,
  no_all_to_all = 1u << 3,
  no_all_to_allv = 1u << 4,
  no_all_reduce = 1u << 5,
  no_reduce_scatter = 1u << 6,
  no_all_gather = 1u << 7,
  no_broadcast = 1u << 8,
  no_barrier = 1u << 9,
};

template <unsigned Missing>
struct partial_comm {
  template <unsigned M = Missing, std::enable_if_t<!(M & no_rank), int> = 0>
  int rank() const { return 0; }
  template <unsigned M = Missing, std::enable_if_t<!(M & no_size), int> = 0>
  int size() const { return 1; }
  template <unsigned M = Missing, std::enable_if_t<!(M & no_split), int> = 0>
  partial_comm split(int, int) const { return {}; }
  template <unsigned M = Missing, std::enable_if_t<!(M & no_all_to_all), int> = 0>
  void all_to_all(const void*, void*, std::size_t, datatype) {}
  template <unsigned M = Missing, std::enable_if_t<!(M & no_all_to_allv), int> = 0>
  void all_to_allv(const void*, const std::size_t*, const std::size_t*, void*, const std::size_t*,
                   const std::size_t*, datatype) {}
  template <unsigned M = Missing, std::enable_if_t<!(M & no_all_reduce), int> = 0>
  void all_reduce(const void*, void*, std::size_t, datatype, double) {}
  template <unsigned M = Missing, std::enable_if_t<!(M & no_reduce_scatter), int> = 0>
  void reduce_scatter(const void*, void*, std::size_t, datatype, double) {}
  template <unsigned M = Missing, std::enable_if_t<!(M & no_all_gather), int> = 0>
  void all_gather(const void*, void*, std::size_t, datatype) {}
  template <unsigned M = Missing, std::enable_if_t<!(M & no_broadcast), int> = 0>
  void broadcast(void*, std::size_t, datatype, int) {}
  template <unsigned M = Missing, std::enable_if_t<!(M & no_barrier), int> = 0>
  void barrier() {}
};

template <unsigned Missing>
using has = epx::detail::communicator_has<partial_comm<Missing>>;

static_assert(epx::check_communicator<partial_comm<0>>(), "nothing missing: a communicator");

static_assert(!epx::is_communicator_v<partial_comm<no_rank>> && !has<no_rank>::rank && has<no_rank>::size);
static_assert(!epx::is_communicator_v<partial_comm<no_size>> && !has<no_size>::size && has<no_size>::rank);
static_assert(!epx::is_communicator_v<partial_comm<no_split>> && !has<no_split>::split);
static_assert(!epx::is_communicator_v<partial_comm<no_all_to_all>> && !has<no_all_to_all>::all_to_all);
static_assert(!epx::is_communicator_v<partial_comm<no_all_to_allv>> && !has<no_all_to_allv>::all_to_allv);
static_assert(!epx::is_communicator_v<partial_comm<no_all_reduce>> && !has<no_all_reduce>::all_reduce);
static_assert(!epx::is_communicator_v<partial_comm<no_reduce_scatter>> &&
              !has<no_reduce_scatter>::reduce_scatter);
static_assert(!epx::is_communicator_v<partial_comm<no_all_gather>> && !has<no_all_gather>::all_gather &&
              has<no_all_gather>::all_to_allv && has<no_all_gather>::reduce_scatter);
static_assert(!epx::is_communicator_v<partial_comm<no_broadcast>> && !has<no_broadcast>::broadcast);
static_assert(!epx::is_communicator_v<partial_comm<no_barrier>> && !has<no_barrier>::barrier);
static_assert(!epx::is_communicator_v<partial_comm<no_all_gather | no_reduce_scatter>>);

// Present, but with other arguments or results.
struct all_reduce_without_scale : complete_comm {
  all_reduce_without_scale split(int, int) const { return {}; }
  void all_reduce(const void*, void*, std::size_t, datatype) {}
};
static_assert(!epx::is_communicator_v<all_reduce_without_scale>);
static_assert(!epx::detail::communicator_has<all_reduce_without_scale>::all_reduce);

struct split_returns_the_base : complete_comm {
  using complete_comm::split;  // returns complete_comm, not split_returns_the_base
};
static_assert(!epx::is_communicator_v<split_returns_the_base>);
static_assert(!epx::detail::communicator_has<split_returns_the_base>::split);

struct rank_is_a_string : complete_comm {
  rank_is_a_string split(int, int) const { return {}; }
  std::string rank() const { return "0"; }
};
static_assert(!epx::is_communicator_v<rank_is_a_string>);
static_assert(!epx::detail::communicator_has<rank_is_a_string>::rank);

struct split_not_const : complete_comm {
  split_not_const split(int, int) { return {}; }  // sub_communicator splits a const communicator
};
static_assert(!epx::is_communicator_v<split_not_const>);

struct not_movable : complete_comm {
  not_movable() = default;
  not_movable(not_movable&&) = delete;
};
static_assert(!epx::is_communicator_v<not_movable>);
static_assert(!epx::detail::communicator_has<not_movable>::move_constructible);

static_assert(!epx::is_communicator_v<int>);

}  // namespace

TEST_CASE("communicator concept: a complete communicator passes, every missing call is named") {
  // Everything above is checked by the compiler; this repeats the verdicts at run time.
  CHECK(epx::is_communicator_v<complete_comm>);
  CHECK(epx::check_communicator<complete_comm>());
  CHECK(epx::is_communicator_v<epx::threads::communicator>);
  CHECK_FALSE(epx::is_communicator_v<partial_comm<no_all_gather>>);
  CHECK_FALSE(epx::is_communicator_v<partial_comm<no_reduce_scatter>>);
  // The typed collectives work on the complete communicator (one rank).
  complete_comm c;
  float x[2] = {1.0f, 2.0f};
  epx::all_reduce(c, epx::span<float>(x, 2));
  auto sub = c.split(0, 0);
  CHECK(sub.size() == 1);
}

}  // namespace test_communicator_concept_cpp
