// epx/comm/nccl.cuh: the NCCL backend. epx::nccl::communicator.
#pragma once

#include "epx/comm/nccl/communicator.cuh"
