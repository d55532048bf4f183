// epx/comm/nccl_mpi.cuh: NCCL communicators bootstrapped over MPI.
#pragma once

#include "epx/comm/nccl/mpi.cuh"
