// A communicator of a user's own (docs/communicators.md): the required members only, each
// forwarding to a process group the user already has. Here that group is epx's threads
// communicator, standing in for a framework's gloo or UCX group.
#pragma once

#include <cstddef>
#include <utility>

#include "epx/comm/communicator.hpp"
#include "epx/comm/threads.hpp"

namespace user {

class my_comm {
 public:
  explicit my_comm(epx::threads::communicator group) : group_(std::move(group)) {}

  int rank() const { return group_.rank(); }
  int size() const { return group_.size(); }
  // Members of one color ordered by (key, rank): the layer checks the groups it makes.
  my_comm split(int color, int key) const { return my_comm(group_.split(color, key)); }

  void all_to_all(const void* send, void* recv, std::size_t count_per_peer, epx::datatype t) {
    group_.all_to_all(send, recv, count_per_peer, t);
  }
  void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
                   const std::size_t* recv_counts, const std::size_t* recv_displs, epx::datatype t) {
    group_.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
  }
  // send == recv allowed; every rank gets bitwise the same sum (rank order), times scale.
  void all_reduce(const void* send, void* recv, std::size_t count, epx::datatype t, double scale) {
    group_.all_reduce(send, recv, count, t, scale);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, epx::datatype t, double scale) {
    group_.reduce_scatter(send, recv, recv_count, t, scale);
  }
  void all_gather(const void* send, void* recv, std::size_t count, epx::datatype t) {
    group_.all_gather(send, recv, count, t);
  }
  void broadcast(void* data, std::size_t count, epx::datatype t, int root) { group_.broadcast(data, count, t, root); }
  void barrier() { group_.barrier(); }

 private:
  epx::threads::communicator group_;
};

static_assert(epx::check_communicator<my_comm>());

}  // namespace user
