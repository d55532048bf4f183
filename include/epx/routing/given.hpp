// epx/routing/given.hpp: the user computes ids and weights; there is nothing to route.
//
// The layer takes the user's ids [N, k] and weights [N, k] as they are. route() and
// route_backward() refuse this policy at compile time (see routing.hpp).
#pragma once

#include "epx/routing/common.hpp"

namespace epx::routing {

// The user supplies ids and weights; there is nothing to route.
struct given {};

namespace detail {

inline const char* policy_name(const given&) { return "given"; }

}  // namespace detail
}  // namespace epx::routing
