// epx/comm/mpi.hpp: the MPI backend. epx::mpi::communicator and epx::mpi::run.
#pragma once

#include "epx/comm/mpi/communicator.hpp"
#include "epx/comm/mpi/run.hpp"
