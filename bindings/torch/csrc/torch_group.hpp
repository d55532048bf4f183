// bindings/torch/csrc/torch_group.hpp: what both communicators over a torch process group
// share (torch_communicator.hpp on host memory, device_communicator.hpp on device memory):
// the group, looked up by name; its collectives started and waited for, their failures
// raised as epx::error(errc::communicator); and split, which makes torch groups.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "epx/comm/datatype.hpp"
#include "epx/core/error.hpp"

namespace epx_torch {

// Makes the group of `members` (world ranks) for every group of a split, on every rank of
// the job, and returns the name of the one at index `mine` (set from Python at import).
using split_callback = std::function<std::string(const std::vector<std::vector<int>>&, int)>;
inline split_callback& split_hook() {
  static split_callback f;
  return f;
}

inline at::ScalarType scalar_type_of(epx::datatype t) {
  switch (t) {
    case epx::datatype::int32: return at::kInt;
    case epx::datatype::int64: return at::kLong;
    case epx::datatype::float32: return at::kFloat;
    case epx::datatype::float64: return at::kDouble;
    case epx::datatype::bfloat16: return at::kBFloat16;
    case epx::datatype::float16: return at::kHalf;
    case epx::datatype::byte: return at::kByte;
  }
  return at::kByte;
}

class torch_group {
 public:
  // `group_name`: a registered c10d group (ProcessGroup.group_name); `world_rank` and
  // `world_size`: this process in the default group (for split and messages).
  torch_group(const std::string& group_name, int world_rank, int world_size)
      : name_(group_name), world_rank_(world_rank), world_size_(world_size) {
    auto pg = group();
    rank_ = pg->getRank();
    size_ = pg->getSize();
    backend_ = pg->getBackendName();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const noexcept { return name_; }
  const std::string& backend() const noexcept { return backend_; }
  int world_rank() const noexcept { return world_rank_; }

 protected:
  // The name of this rank's group of a split, from every rank's (color, key, world rank)
  // (`all`, [size][3], gathered by the caller): members of each color ordered by (key,
  // rank), as world ranks, colors ascending; every rank makes every group. One color holding
  // every rank in order is the group itself (no new group; its timeout stays its own).
  std::string split_name(int color, const std::vector<std::int64_t>& all) const {
    const int P = size();
    EPX_REQUIRE(P == world_size_, epx::errc::configuration, "split: the torch backend splits only a communicator over "
                "the whole job (", world_size_, " ranks); this one (", name_, ") has ", P);
    std::map<std::int64_t, std::vector<std::pair<std::pair<std::int64_t, int>, int>>> by_color;
    for (int r = 0; r < P; ++r) {
      const auto* rec = all.data() + 3 * static_cast<std::size_t>(r);
      by_color[rec[0]].push_back({{rec[1], r}, static_cast<int>(rec[2])});
    }
    std::vector<std::vector<int>> groups;
    int index = -1;
    for (auto& [c, v] : by_color) {
      std::sort(v.begin(), v.end());
      std::vector<int> g;
      for (const auto& m : v) g.push_back(m.second);
      // torch.distributed.new_group numbers a group's members by their rank in the job.
      EPX_REQUIRE(std::is_sorted(g.begin(), g.end()), epx::errc::configuration,
                  "split: the keys of color ", c, " order its members differently from their ranks in the job, "
                  "which a torch process group cannot (its ranks follow the job's)");
      if (c == color) index = static_cast<int>(groups.size());
      groups.push_back(std::move(g));
    }
    if (groups.size() == 1) return name_;
    EPX_REQUIRE(static_cast<bool>(split_hook()), epx::errc::internal, "split: no group maker registered");
    pybind11::gil_scoped_acquire gil;
    return split_hook()(groups, index);
  }

  // Starts a collective of the group and waits for it (gloo: until it is done; NCCL: the
  // caller's current CUDA stream waits for it, the host does not).
  template <class F>
  void run(const char* what, F&& start) const {
    try {
      auto work = start();
      work->wait();
    } catch (const epx::error&) {
      throw;
    } catch (const std::exception& e) {
      throw epx::error(epx::errc::communicator,
                       epx::detail::concat(what, " over torch process group '", name_, "' (", backend(), ", rank ",
                                           rank(), " of ", size(), ") failed: ", e.what()),
                       EPX_HERE);
    }
  }

  // The group, looked up by name for each call: the communicator keeps no reference, so a
  // group destroyed by torch.distributed.destroy_process_group is gone (its collectives then
  // raise here) and is never destroyed late, at interpreter exit, through a layer.
  c10::intrusive_ptr<c10d::ProcessGroup> group() const {
    try {
      return c10d::resolve_process_group(name_);
    } catch (const std::exception& e) {
      throw epx::error(epx::errc::configuration,
                       epx::detail::concat("no torch process group named '", name_,
                                           "' (destroyed, or never made): ", e.what()),
                       EPX_HERE);
    }
  }

  // all_to_all's blocks as all_to_allv's arrays: P counts of `count`, then their P
  // displacements.
  static std::vector<std::size_t> equal_blocks(std::size_t P, std::size_t count) {
    std::vector<std::size_t> v(2 * P, count);
    for (std::size_t p = 0; p < P; ++p) v[P + p] = p * count;
    return v;
  }

  // The packed split sizes of all_to_all_single: true when block p starts where block p-1
  // ends (empty blocks anywhere).
  static bool packed(const std::size_t* c, const std::size_t* d, std::size_t P) {
    std::size_t at = 0;
    for (std::size_t p = 0; p < P; ++p) {
      if (c[p] != 0 && d[p] != at) return false;
      at += c[p];
    }
    return true;
  }

  int rank_ = 0, size_ = 0;
  std::string backend_;
  std::string name_;
  int world_rank_ = 0;
  int world_size_ = 0;
};

}  // namespace epx_torch
