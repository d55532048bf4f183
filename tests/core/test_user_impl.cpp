// A user-defined implementation plugs into epx::moe_layer (docs/implementations.md).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/layer_cases.hpp"
#include "core/user_implementation.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_user_impl_cpp {

namespace {
using comm_t = epx::threads::communicator;
using impl_t = user::local_only<comm_t>;
static_assert(std::is_same_v<epx::impl_for_t<impl_t, comm_t>, impl_t>);
static_assert(std::is_same_v<epx::impl_for_t<epx::impl::all_to_all, comm_t>, epx::detail::all_to_all_impl<comm_t>>);
}  // namespace

TEST_CASE("user implementation: local_only against the float64 reference") {
  for (auto mc : {epx::mesh_config{1, 4, 1, 1, 1, 4, 0}, epx::mesh_config{1, 2, 1, 2, 1, 8, 0}}) {
    for (int k : {1, 2, 4}) {
      epx::test::layer_case c;
      c.topology = mc;
      c.top_k = k;
      c.routing = epx::test::routing_kind::uneven;
      const int world = mc.fsdp * mc.dp_replicate;
      std::vector<std::string> f(static_cast<std::size_t>(world));
      epx::threads::run(world, [&](comm_t& comm) {
        f[static_cast<std::size_t>(comm.rank())] = epx::test::check_layer_case<comm_t, float, impl_t>(comm, c) +
                                                   epx::test::check_layer_case<comm_t, epx::bf16, impl_t>(comm, c);
      });
      for (const auto& s : f) CHECK_MESSAGE(s.empty(), s);
    }
  }
}

TEST_CASE("user implementation: its own validation raises at layer construction") {
  std::vector<std::string> msg(2);
  epx::threads::run(2, [&](comm_t& comm) {
    try {
      const epx::mesh m(epx::mesh_config{1, 2, 1, 1, 2, 4, 0});
      epx::moe_layer<comm_t, float, impl_t> layer(m, comm, epx::layer_options{4, 2});
    } catch (const epx::error& e) {
      msg[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& s : msg) CHECK(s.find("local_only needs ep_size 1, not 2") != std::string::npos);
}

}  // namespace test_user_impl_cpp
