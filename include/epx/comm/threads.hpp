// epx/comm/threads.hpp: the in-process threads backend (the embedded default): N ranks as N
// threads of one process. epx::threads::communicator and epx::threads::run.
#pragma once

#include "epx/comm/threads/communicator.hpp"
#include "epx/comm/threads/run.hpp"
