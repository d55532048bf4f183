// tests/support/forwarding_comm.hpp: the base of the tests' communicators that wrap another
// one and change one thing: its rank, size and the seven collectives, forwarded to the
// wrapped communicator `c`. A wrapper adds its `split` (returning its own type) and
// declares whatever it changes, which hides the base's member of that name. Only the
// collectives of epx's communicator concept are forwarded, so the layer sees none of the
// optional capabilities of `Comm` (peer access, indexed or segmented sends).
#pragma once

#include <cstddef>

#include "epx/comm/datatype.hpp"

namespace epx::test {

template <class Comm>
struct forwarding_comm {
  Comm c;
  int rank() const { return c.rank(); }
  int size() const { return c.size(); }
  void all_to_all(const void* s, void* r, std::size_t n, epx::datatype t) { c.all_to_all(s, r, n, t); }
  void all_to_allv(const void* s, const std::size_t* sc, const std::size_t* sd, void* r, const std::size_t* rc,
                   const std::size_t* rd, epx::datatype t) {
    c.all_to_allv(s, sc, sd, r, rc, rd, t);
  }
  void all_reduce(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    c.all_reduce(s, r, n, t, scale);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, epx::datatype t, double scale) {
    c.reduce_scatter(s, r, n, t, scale);
  }
  void all_gather(const void* s, void* r, std::size_t n, epx::datatype t) { c.all_gather(s, r, n, t); }
  void broadcast(void* d, std::size_t n, epx::datatype t, int root) { c.broadcast(d, n, t, root); }
  void barrier() { c.barrier(); }
};

}  // namespace epx::test
