// epx/epx.hpp: the umbrella header. Host-only: compiles with a plain C++17 compiler.
// CUDA headers (.cuh) and the MPI backend (epx/comm/mpi.hpp) are included separately.
#pragma once

#include "epx/core/config.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/mesh/mesh.hpp"
#include "epx/mesh/describe.hpp"
#include "epx/mesh/json.hpp"
#include "epx/comm/datatype.hpp"
#include "epx/comm/communicator.hpp"
#include "epx/comm/collectives.hpp"
#include "epx/comm/threads.hpp"
#include "epx/exec/host.hpp"
#include "epx/routing/routing.hpp"
