// epx/comm/communicator.hpp: the communicator concept shared by every backend.
//
// A communicator `C` (threads::communicator, mpi::communicator, nccl::communicator) is a
// movable value exposing:
//
//   int  rank() const;                  // this rank in [0, size())
//   int  size() const;
//   C    split(int color, int key) const;   // collective over C; members with the same color
//                                           // form one new communicator, ordered by (key, rank)
//   void all_to_all(const void* send, void* recv, std::size_t count_per_peer, datatype t);
//   void all_to_allv(const void* send, const std::size_t* send_counts, const std::size_t* send_displs,
//                    void* recv, const std::size_t* recv_counts, const std::size_t* recv_displs,
//                    datatype t);       // counts and displacements in elements, one per peer
//   void all_reduce(const void* send, void* recv, std::size_t count, datatype t, double scale);
//                                       // recv = scale * sum over ranks (send == recv allowed);
//                                       // every rank gets bitwise the same result
//   void reduce_scatter(const void* send, void* recv, std::size_t recv_count, datatype t, double scale);
//                                       // send holds size()*recv_count elements, block r goes to rank r
//   void all_gather(const void* send, void* recv, std::size_t count, datatype t);
//   void broadcast(void* data, std::size_t count, datatype t, int root);
//   void barrier();
//
// Sums of 16-bit types accumulate in float; `scale` multiplies the sum before rounding, so
// gradient averaging costs no extra pass. Every failure raises epx::error; a failure on
// one rank reaches the others as an error too (never a hang).
//
// Optional, for backends whose ranks share one address space (threads::communicator):
//
//   class peer_pointers { const void* operator()(int r, std::size_t i) const; int size() const; };
//   template <class F> void access_peers(const void* const* mine, std::size_t count, F&& f);
//                                       // collective: f(peers) runs once every member has
//                                       // published its `count` pointers, and nobody leaves
//                                       // before every member's f has returned
//
// With it the MoE layer reads rows straight out of the peers' buffers (no send buffer, no
// separate combine pass); without it, it moves them through all_to_allv.
//
// The typed helpers in epx/comm/collectives.hpp are what library code calls.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "epx/comm/datatype.hpp"

namespace epx {

template <class C, class = void>
struct is_communicator : std::false_type {};

template <class C>
struct is_communicator<
    C, std::void_t<decltype(std::declval<const C&>().rank()), decltype(std::declval<const C&>().size()),
                   decltype(std::declval<const C&>().split(0, 0)),
                   decltype(std::declval<C&>().all_to_allv(
                       std::declval<const void*>(), std::declval<const std::size_t*>(),
                       std::declval<const std::size_t*>(), std::declval<void*>(),
                       std::declval<const std::size_t*>(), std::declval<const std::size_t*>(),
                       datatype::byte)),
                   decltype(std::declval<C&>().all_reduce(std::declval<const void*>(), std::declval<void*>(),
                                                           std::size_t{}, datatype::float32, 1.0)),
                   decltype(std::declval<C&>().barrier())>> : std::true_type {};

template <class C>
inline constexpr bool is_communicator_v = is_communicator<std::remove_cv_t<std::remove_reference_t<C>>>::value;

template <class C, class = void>
struct has_peer_access : std::false_type {};

template <class C>
struct has_peer_access<C, std::void_t<decltype(std::declval<C&>().access_peers(
                              std::declval<const void* const*>(), std::size_t{},
                              std::declval<void (*)(const typename C::peer_pointers&)>()))>> : std::true_type {};

// Whether C's ranks can read each other's memory (see access_peers above).
template <class C>
inline constexpr bool has_peer_access_v = has_peer_access<std::remove_cv_t<std::remove_reference_t<C>>>::value;

}  // namespace epx
