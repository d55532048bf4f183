// epx/comm/threads/options.hpp: epx::threads::options, the settings of one epx::threads::run.
#pragma once

#include <chrono>
#include <cstddef>

namespace epx::threads {

// Where the ranks' buffers live, and how the communicator copies between them.
//
// The default is host memory: blocks move with memcpy and sums are computed in place. A
// run whose ranks hand the communicator buffers in other memory (device memory of one GPU
// shared by several ranks: <epx/comm/threads/cuda.cuh>, threads::device_memory) names a
// copy that moves bytes between any two such buffers, and says whether the host may read
// them: if not, all_reduce and reduce_scatter copy each block to the host, sum it there (in
// rank order, as always) and copy the result back. `copy` returns false when it failed;
// the collective then completes on every member and raises errc::communicator on the rank
// whose copy failed. The arrays of counts and displacements, and access_peers' pointer
// lists, are always host memory.
struct memory {
  bool (*copy)(void* dst, const void* src, std::size_t bytes) noexcept = nullptr;  // null: memcpy
  bool host_accessible = true;
  const char* name = "host";
};

// Settings of one epx::threads::run.
struct options {
  // A collective that some members have not entered after this long fails with an error
  // listing them (on every rank). Must be positive; one too long for the clock to add
  // (e.g. std::chrono::milliseconds::max()) never fires.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  // The memory of the buffers the ranks pass to collectives (see memory above).
  threads::memory memory = {};
};

}  // namespace epx::threads
