// epx/comm/detail/deadline.hpp: when a wait that starts now and may last `timeout` ends.
#pragma once

#include <chrono>

namespace epx::detail {

// now + timeout on the steady clock. A timeout too long to add to the clock (e.g.
// std::chrono::milliseconds::max(), which a user may pass for "wait for ever") gives
// time_point::max(), a deadline never reached, instead of one that wrapped into the past.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const clock::time_point now = clock::now();
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(clock::time_point::max() - now);
  return timeout >= room ? clock::time_point::max() : now + timeout;
}

}  // namespace epx::detail
