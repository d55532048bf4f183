// epx/comm/threads/options.hpp: epx::threads::options, the settings of one epx::threads::run.
#pragma once

#include <chrono>

namespace epx::threads {

// Settings of one epx::threads::run.
struct options {
  // A collective that some members have not entered after this long fails with an error
  // listing them (on every rank).
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

}  // namespace epx::threads
