// The communicator of the compile-fail sources communicator.cpp and hooks.cpp: every member
// of the concept, except all_gather where EPX_COMPILE_FAIL is defined.
#pragma once

#include <cstddef>

#include "epx/comm/communicator.hpp"

namespace {

struct my_comm {
  int rank() const { return 0; }
  int size() const { return 1; }
  my_comm split(int, int) const { return {}; }
  void all_to_all(const void*, void*, std::size_t, epx::datatype) {}
  void all_to_allv(const void*, const std::size_t*, const std::size_t*, void*, const std::size_t*,
                   const std::size_t*, epx::datatype) {}
  void all_reduce(const void*, void*, std::size_t, epx::datatype, double) {}
  void reduce_scatter(const void*, void*, std::size_t, epx::datatype, double) {}
#ifndef EPX_COMPILE_FAIL
  void all_gather(const void*, void*, std::size_t, epx::datatype) {}
#endif
  void broadcast(void*, std::size_t, epx::datatype, int) {}
  void barrier() {}
};

}  // namespace
