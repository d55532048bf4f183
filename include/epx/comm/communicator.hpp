// epx/comm/communicator.hpp: the communicator concept shared by every backend.
//
// A communicator `C` (threads::communicator, mpi::communicator, nccl::communicator) is a
// move-constructible value exposing:
//
//   int  rank() const;                  // this rank in [0, size())
//   int  size() const;
//   C    split(int color, int key) const;   // collective over C; members with the same color
//                                           // (>= 0) form one new communicator, ordered by
//                                           // (key, rank)
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
// is_communicator_v<C> is true when C has all of the above (these are the calls the layer,
// the gradient hooks and the typed collectives make). check_communicator<C>() says which
// call is missing: one static_assert per requirement, each naming the member it needs:
//
//   static_assert(epx::check_communicator<my_comm>());
//
// Optional members, used when present (with exactly these arguments):
//
//   void all_to_allv_segments(const void* send, const std::size_t* send_counts,
//                             const std::size_t* send_displs, void* recv, const std::size_t* recv_counts,
//                             const std::size_t* recv_displs, std::size_t nseg, datatype t);
//                                       // arrays [peers][nseg]: every segment of every peer in
//                                       // one collective (epx::all_to_allv_segments, which
//                                       // otherwise runs nseg rounds of all_to_allv)
//   void all_to_allv_indexed(const void* src, const std::int64_t* rows, std::size_t row_elems,
//                            const std::size_t* send_counts, const std::size_t* send_displs, void* recv,
//                            const std::size_t* recv_counts, const std::size_t* recv_displs,
//                            std::size_t nseg, datatype t);
//                                       // as all_to_allv_segments, in rows of row_elems elements,
//                                       // but row j of the send order is row rows[j] of src:
//                                       // rows are read by index as they are sent, with no send
//                                       // buffer (epx::all_to_allv_indexed, which otherwise
//                                       // gathers them first; epx::has_indexed_sends_v)
//   void wait();                        // bounded wait for the work the communicator queued on
//                                       // a device stream (epx/comm/settle.hpp)
//   Policy execution() const;           // a device communicator: the execution policy whose
//                                       // queue its collectives run on, which then take
//                                       // that policy's memory only (epx::nccl::communicator;
//                                       // epx/comm/settle.hpp, epx/comm/host_arrays.hpp)
//   bool device_buffers() const;        // a host communicator that can also move device
//                                       // memory says whether this one does (threads over
//                                       // threads::device_memory()); the layer refuses a
//                                       // device policy with a host communicator otherwise
//
// and, for backends whose ranks can read each other's memory (threads::communicator: one
// address space; mpi::communicator: MPI-3 shared memory when every rank is on one node;
// nccl::communicator: a symmetric memory window, NCCL >= 2.28, nccl::options::peer_access):
//
//   class peer_pointers { const void* operator()(int r, std::size_t i) const; int size() const; };
//   template <class F> void access_peers(const void* const* mine, const std::size_t* bytes,
//                                        std::size_t count, F&& f);
//                                       // collective: f(peers) runs once every member has
//                                       // published its `count` buffers (bytes[i] bytes at
//                                       // mine[i]), and nobody leaves before every member's
//                                       // f has returned; peers(r, i) is member r's buffer i
//                                       // or a copy of it (a backend may copy the buffers
//                                       // into memory the peers can map, as MPI does)
//   bool peer_access_available();       // optional: whether access_peers works on this
//                                       // communicator at run time (the same answer on every
//                                       // member; may be collective on its first call);
//                                       // without it, always
//   std::shared_ptr<void> peer_buffer(std::size_t bytes);
//                                       // optional, collective (each member its own size):
//                                       // `bytes` of this rank's memory that access_peers
//                                       // publishes without a copy, held while a copy of the
//                                       // pointer lives, or null when there is none to give;
//                                       // the layer makes the rows its peers read in place
//                                       // there (MPI: no copy into the window)
//   void* peer_memory(std::size_t bytes);  // optional, collective: the same, held by the
//                                       // communicator until its next peer_memory call
//
// With it the MoE layer reads rows straight out of the peers' buffers (no send buffer, no
// separate combine pass); without it, it moves them through all_to_allv.
//
// The typed helpers in epx/comm/collectives.hpp are what library code calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "epx/comm/datatype.hpp"

namespace epx {

namespace detail {

// One detector per required call: the expression, with the argument types of the concept.
template <class C>
using comm_rank_t = decltype(std::declval<const C&>().rank());
template <class C>
using comm_size_t = decltype(std::declval<const C&>().size());
template <class C>
using comm_split_t = decltype(std::declval<const C&>().split(0, 0));
template <class C>
using comm_all_to_all_t = decltype(std::declval<C&>().all_to_all(std::declval<const void*>(), std::declval<void*>(),
                                                                  std::size_t{}, datatype::byte));
template <class C>
using comm_all_to_allv_t = decltype(std::declval<C&>().all_to_allv(
    std::declval<const void*>(), std::declval<const std::size_t*>(), std::declval<const std::size_t*>(),
    std::declval<void*>(), std::declval<const std::size_t*>(), std::declval<const std::size_t*>(), datatype::byte));
template <class C>
using comm_all_reduce_t = decltype(std::declval<C&>().all_reduce(std::declval<const void*>(), std::declval<void*>(),
                                                                  std::size_t{}, datatype::float32, 1.0));
template <class C>
using comm_reduce_scatter_t = decltype(std::declval<C&>().reduce_scatter(
    std::declval<const void*>(), std::declval<void*>(), std::size_t{}, datatype::float32, 1.0));
template <class C>
using comm_all_gather_t = decltype(std::declval<C&>().all_gather(std::declval<const void*>(), std::declval<void*>(),
                                                                  std::size_t{}, datatype::byte));
template <class C>
using comm_broadcast_t =
    decltype(std::declval<C&>().broadcast(std::declval<void*>(), std::size_t{}, datatype::byte, 0));
template <class C>
using comm_barrier_t = decltype(std::declval<C&>().barrier());

template <template <class> class Op, class C, class = void>
struct comm_detect : std::false_type {};
template <template <class> class Op, class C>
struct comm_detect<Op, C, std::void_t<Op<C>>> : std::true_type {};

// Detected, and the result converts to R.
template <template <class> class Op, class C, class R, class = void>
struct comm_detect_r : std::false_type {};
template <template <class> class Op, class C, class R>
struct comm_detect_r<Op, C, R, std::void_t<Op<C>>> : std::is_convertible<Op<C>, R> {};

// Which requirements of the communicator concept `C` (no reference, no cv) meets.
template <class C>
struct communicator_has {
  static constexpr bool move_constructible = std::is_move_constructible_v<C>;
  static constexpr bool rank = comm_detect_r<comm_rank_t, C, int>::value;
  static constexpr bool size = comm_detect_r<comm_size_t, C, int>::value;
  static constexpr bool split = comm_detect_r<comm_split_t, C, C>::value;
  static constexpr bool all_to_all = comm_detect<comm_all_to_all_t, C>::value;
  static constexpr bool all_to_allv = comm_detect<comm_all_to_allv_t, C>::value;
  static constexpr bool all_reduce = comm_detect<comm_all_reduce_t, C>::value;
  static constexpr bool reduce_scatter = comm_detect<comm_reduce_scatter_t, C>::value;
  static constexpr bool all_gather = comm_detect<comm_all_gather_t, C>::value;
  static constexpr bool broadcast = comm_detect<comm_broadcast_t, C>::value;
  static constexpr bool barrier = comm_detect<comm_barrier_t, C>::value;
  static constexpr bool all = move_constructible && rank && size && split && all_to_all && all_to_allv &&
                              all_reduce && reduce_scatter && all_gather && broadcast && barrier;
};

template <class C>
using communicator_has_t = communicator_has<std::remove_cv_t<std::remove_reference_t<C>>>;

}  // namespace detail

// Whether C meets the communicator concept (every required call above).
template <class C, class = void>
struct is_communicator : std::bool_constant<detail::communicator_has_t<C>::all> {};

template <class C>
inline constexpr bool is_communicator_v = is_communicator<std::remove_cv_t<std::remove_reference_t<C>>>::value;

// The concept as a diagnostic: fails to compile, with one message per missing call, unless
// C meets it; returns true otherwise. `static_assert(epx::check_communicator<C>());`
template <class C>
constexpr bool check_communicator() {
  using has = detail::communicator_has_t<C>;
  static_assert(has::move_constructible,
                "epx: the communicator type must be move constructible (sub-communicators made by split are "
                "returned and kept by value)");
  static_assert(has::rank, "epx: the communicator type needs `int rank() const`");
  static_assert(has::size, "epx: the communicator type needs `int size() const`");
  static_assert(has::split,
                "epx: the communicator type needs `C split(int color, int key) const` returning the communicator "
                "type");
  static_assert(has::all_to_all,
                "epx: the communicator type needs `void all_to_all(const void* send, void* recv, std::size_t "
                "count_per_peer, datatype t)`");
  static_assert(has::all_to_allv,
                "epx: the communicator type needs `void all_to_allv(const void* send, const std::size_t* "
                "send_counts, const std::size_t* send_displs, void* recv, const std::size_t* recv_counts, const "
                "std::size_t* recv_displs, datatype t)`");
  static_assert(has::all_reduce,
                "epx: the communicator type needs `void all_reduce(const void* send, void* recv, std::size_t "
                "count, datatype t, double scale)`");
  static_assert(has::reduce_scatter,
                "epx: the communicator type needs `void reduce_scatter(const void* send, void* recv, std::size_t "
                "recv_count, datatype t, double scale)`");
  static_assert(has::all_gather,
                "epx: the communicator type needs `void all_gather(const void* send, void* recv, std::size_t "
                "count, datatype t)`");
  static_assert(has::broadcast,
                "epx: the communicator type needs `void broadcast(void* data, std::size_t count, datatype t, int "
                "root)`");
  static_assert(has::barrier, "epx: the communicator type needs `void barrier()`");
  return has::all;
}

template <class C, class = void>
struct has_peer_access : std::false_type {};

template <class C>
struct has_peer_access<C, std::void_t<decltype(std::declval<C&>().access_peers(
                              std::declval<const void* const*>(), std::declval<const std::size_t*>(), std::size_t{},
                              std::declval<void (*)(const typename C::peer_pointers&)>()))>> : std::true_type {};

// Whether C's ranks can read each other's memory (see access_peers above); at run time,
// peer_access_available(comm) says whether this communicator's ranks can.
template <class C>
inline constexpr bool has_peer_access_v = has_peer_access<std::remove_cv_t<std::remove_reference_t<C>>>::value;

namespace detail {
template <class C, class = void>
struct has_peer_access_query : std::false_type {};
template <class C>
struct has_peer_access_query<C, std::void_t<decltype(bool(std::declval<C&>().peer_access_available()))>>
    : std::true_type {};
}  // namespace detail

namespace detail {
template <class C, class = void>
struct has_indexed_sends : std::false_type {};
template <class C>
struct has_indexed_sends<C, std::void_t<decltype(std::declval<C&>().all_to_allv_indexed(
                                std::declval<const void*>(), std::declval<const std::int64_t*>(), std::size_t{},
                                std::declval<const std::size_t*>(), std::declval<const std::size_t*>(),
                                std::declval<void*>(), std::declval<const std::size_t*>(),
                                std::declval<const std::size_t*>(), std::size_t{}, datatype::byte))>>
    : std::true_type {};
}  // namespace detail

namespace detail {
// The host gather of all_to_allv_indexed's rows into send order: the rows named by
// rows[displs[j] .. + counts[j]] for j in [0, m), one after the other, rows of row_bytes
// bytes, from src into dst (a communicator without the native call, and MPI's path for
// transfers over its max_count).
inline void gather_indexed_rows(const void* src, const std::int64_t* rows, std::size_t row_bytes,
                                const std::size_t* counts, const std::size_t* displs, std::size_t m, void* dst) {
  auto* out = static_cast<unsigned char*>(dst);
  for (std::size_t j = 0; j < m; ++j)
    for (std::size_t r = 0; r < counts[j]; ++r, out += row_bytes)
      std::memcpy(out, static_cast<const unsigned char*>(src) + static_cast<std::size_t>(rows[displs[j] + r]) * row_bytes,
                  row_bytes);
}
}  // namespace detail

// Whether C sends rows by index (the optional all_to_allv_indexed above).
template <class C>
inline constexpr bool has_indexed_sends_v =
    detail::has_indexed_sends<std::remove_cv_t<std::remove_reference_t<C>>>::value;

namespace detail {
template <class C, class = void>
struct has_peer_memory : std::false_type {};
template <class C>
struct has_peer_memory<C, std::void_t<decltype(static_cast<void*>(std::declval<C&>().peer_memory(std::size_t{})))>>
    : std::true_type {};
}  // namespace detail

// Whether C can give out memory that access_peers publishes without a copy (see above).
template <class C>
inline constexpr bool has_peer_memory_v =
    has_peer_access_v<C> && detail::has_peer_memory<std::remove_cv_t<std::remove_reference_t<C>>>::value;

namespace detail {
template <class C, class = void>
struct has_peer_buffer : std::false_type {};
template <class C>
struct has_peer_buffer<C, std::void_t<decltype(std::shared_ptr<void>(std::declval<C&>().peer_buffer(std::size_t{})))>>
    : std::true_type {};
}  // namespace detail

// Whether C hands out blocks of memory that access_peers publishes without a copy (see
// above).
template <class C>
inline constexpr bool has_peer_buffer_v =
    has_peer_access_v<C> && detail::has_peer_buffer<std::remove_cv_t<std::remove_reference_t<C>>>::value;

// Whether access_peers works on `comm` now: has_peer_access_v<C> and, when C has the
// query, comm.peer_access_available() (which may be collective on its first call: call it
// on every member).
template <class C>
bool peer_access_available(C& comm) {
  if constexpr (!has_peer_access_v<C>) {
    (void)comm;
    return false;
  } else if constexpr (detail::has_peer_access_query<C>::value) {
    return comm.peer_access_available();
  } else {
    (void)comm;
    return true;
  }
}

}  // namespace epx
