// epx/comm/collectives.hpp: typed collectives over any communicator, and mesh sub-groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "epx/comm/communicator.hpp"
#include "epx/core/error.hpp"
#include "epx/core/span.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx {

// The communicator of the group of kind `g` that holds this rank. Collective over `comm`,
// whose size must be the mesh's world.
template <class Comm>
Comm sub_communicator(const Comm& comm, const mesh& m, group_kind g) {
  m.validate_world(comm.size());
  return comm.split(m.group_color(g, comm.rank()), m.group_rank(g, comm.rank()));
}

// Equal counts: `send` holds size()*count elements, block p goes to peer p.
template <class Comm, class T>
void all_to_all(Comm& comm, span<const T> send, span<T> recv) {
  const auto n = static_cast<std::size_t>(comm.size());
  EPX_REQUIRE(send.size() % n == 0 && recv.size() == send.size(), errc::input,
              "all_to_all: send (", send.size(), ") and recv (", recv.size(),
              ") must hold the same multiple of the communicator size (", n, ")");
  comm.all_to_all(send.data(), recv.data(), send.size() / n, datatype_of<T>());
}

// Per-peer counts and displacements, in elements.
template <class Comm, class T>
void all_to_allv(Comm& comm, const T* send, span<const std::size_t> send_counts,
                 span<const std::size_t> send_displs, T* recv, span<const std::size_t> recv_counts,
                 span<const std::size_t> recv_displs) {
  const auto n = static_cast<std::size_t>(comm.size());
  EPX_REQUIRE(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n &&
                  recv_displs.size() == n,
              errc::input, "all_to_allv: counts and displacements need one entry per peer (", n, ")");
  comm.all_to_allv(send, send_counts.data(), send_displs.data(), recv, recv_counts.data(),
                   recv_displs.data(), datatype_of<T>());
}

namespace detail {
// [send counts | send displs | recv counts | recv displs] of m entries each, in elements:
// entry j is entry first + j*stride of each row-count array, times row_elems.
inline std::vector<std::size_t> in_elements(span<const std::size_t> sc, span<const std::size_t> sd,
                                            span<const std::size_t> rc, span<const std::size_t> rd, std::size_t first,
                                            std::size_t stride, std::size_t m, std::size_t row_elems) {
  std::vector<std::size_t> v(4 * m);
  for (std::size_t j = 0; j < m; ++j) {
    const std::size_t i = first + j * stride;
    v[j] = sc[i] * row_elems;
    v[m + j] = sd[i] * row_elems;
    v[2 * m + j] = rc[i] * row_elems;
    v[3 * m + j] = rd[i] * row_elems;
  }
  return v;
}
}  // namespace detail

// Rows of `row_elems` elements each: counts and offsets are in rows. Moves whole rows
// without the caller multiplying by the row length.
template <class Comm, class T>
void all_to_allv_rows(Comm& comm, const T* send, span<const std::size_t> send_rows,
                      span<const std::size_t> send_row_offsets, T* recv, span<const std::size_t> recv_rows,
                      span<const std::size_t> recv_row_offsets, std::size_t row_elems) {
  const auto n = static_cast<std::size_t>(comm.size());
  EPX_REQUIRE(send_rows.size() == n && send_row_offsets.size() == n && recv_rows.size() == n &&
                  recv_row_offsets.size() == n,
              errc::input, "all_to_allv_rows: counts and offsets need one entry per peer (", n, ")");
  const auto v = detail::in_elements(send_rows, send_row_offsets, recv_rows, recv_row_offsets, 0, 1, n, row_elems);
  comm.all_to_allv(send, v.data(), v.data() + n, recv, v.data() + 2 * n, v.data() + 3 * n,
                   datatype_of<T>());
}

namespace detail {
template <class C, class = void>
struct has_native_segments : std::false_type {};
template <class C>
struct has_native_segments<C, std::void_t<decltype(std::declval<C&>().all_to_allv_segments(
                                  std::declval<const void*>(), std::declval<const std::size_t*>(),
                                  std::declval<const std::size_t*>(), std::declval<void*>(),
                                  std::declval<const std::size_t*>(), std::declval<const std::size_t*>(),
                                  std::size_t{}, datatype::byte))>> : std::true_type {};
}  // namespace detail

namespace detail {
// The four [peers][nseg] arrays of a segmented all-to-all hold peers*nseg entries each.
inline void require_segment_arrays(const char* op, std::size_t peers, std::size_t nseg,
                                   std::initializer_list<std::size_t> sizes) {
  const std::size_t m = peers * nseg;
  for (std::size_t sz : sizes)
    EPX_REQUIRE(sz == m, errc::input, op, ": counts and displacements need peers*nseg (", peers, "*", nseg, " = ", m,
                ") entries");
}
}  // namespace detail

// Segmented all-to-all of rows: every peer pair exchanges `nseg` segments. Arrays are
// [peers][nseg], in rows of `row_elems` elements: segment i that this rank sends to peer q
// (send_seg_counts[q*nseg+i] rows at send_seg_displs[q*nseg+i]) lands at q in the place q
// names for segment i from this rank (its recv_seg_displs[me*nseg+i]); counts must agree.
// This is how rows land expert-major at the receiver with no second permutation. Backends
// with a native `all_to_allv_segments` (same arguments, in elements) are used directly;
// otherwise it runs as `nseg` rounds of all_to_allv.
template <class Comm, class T>
void all_to_allv_segments(Comm& comm, const T* send, span<const std::size_t> send_seg_counts,
                          span<const std::size_t> send_seg_displs, T* recv,
                          span<const std::size_t> recv_seg_counts, span<const std::size_t> recv_seg_displs,
                          std::size_t nseg, std::size_t row_elems) {
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t m = n * nseg;
  detail::require_segment_arrays("all_to_allv_segments", n, nseg,
                                 {send_seg_counts.size(), send_seg_displs.size(), recv_seg_counts.size(),
                                  recv_seg_displs.size()});
  if constexpr (detail::has_native_segments<Comm>::value) {
    const auto v = detail::in_elements(send_seg_counts, send_seg_displs, recv_seg_counts, recv_seg_displs, 0, 1, m,
                                       row_elems);
    comm.all_to_allv_segments(send, v.data(), v.data() + m, recv, v.data() + 2 * m, v.data() + 3 * m, nseg,
                              datatype_of<T>());
  } else {
    for (std::size_t i = 0; i < nseg; ++i) {
      const auto v = detail::in_elements(send_seg_counts, send_seg_displs, recv_seg_counts, recv_seg_displs, i, nseg, n,
                                         row_elems);
      comm.all_to_allv(send, v.data(), v.data() + n, recv, v.data() + 2 * n, v.data() + 3 * n, datatype_of<T>());
    }
  }
}

// The segmented all-to-all of rows picked by index: as all_to_allv_segments, except that
// the send side names its rows instead of holding them in send order. Segment i to peer q
// is the rows src[rows[j]] (rows of row_elems elements) for j in
// [send_seg_displs[q*nseg+i], + send_seg_counts[q*nseg+i]); it lands as one block at q's
// recv_seg_displs[me*nseg+i]. Every index sent must name a row of src (src.size() /
// row_elems rows): errc::input on this rank otherwise, before anything moves. Backends
// with a native `all_to_allv_indexed` (epx::has_indexed_sends_v: threads, MPI) read the
// rows straight out of src as they send; otherwise the rows are gathered into send order
// on the host first (src and recv must then be host memory). The index check reads the
// indices on the host: `rows` must be host memory.
template <class Comm, class T>
void all_to_allv_indexed(Comm& comm, span<const T> src, span<const std::int64_t> rows,
                         span<const std::size_t> send_seg_counts, span<const std::size_t> send_seg_displs, T* recv,
                         span<const std::size_t> recv_seg_counts, span<const std::size_t> recv_seg_displs,
                         std::size_t nseg, std::size_t row_elems) {
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t m = n * nseg;
  detail::require_segment_arrays("all_to_allv_indexed", n, nseg,
                                 {send_seg_counts.size(), send_seg_displs.size(), recv_seg_counts.size(),
                                  recv_seg_displs.size()});
  EPX_REQUIRE(row_elems != 0, errc::input, "all_to_allv_indexed: row_elems must be positive");
  EPX_REQUIRE(src.size() % row_elems == 0, errc::input, "all_to_allv_indexed: src holds ", src.size(),
              " elements, not a whole number of rows of ", row_elems);
  const auto src_rows = static_cast<std::int64_t>(src.size() / row_elems);
  for (std::size_t j = 0; j < m; ++j) {
    EPX_REQUIRE(send_seg_displs[j] <= rows.size() && send_seg_counts[j] <= rows.size() - send_seg_displs[j], errc::input,
                "all_to_allv_indexed: segment ", j % nseg, " to peer ", j / nseg, " reads rows[",
                send_seg_displs[j], ", ", send_seg_displs[j], " + ", send_seg_counts[j], ") of ", rows.size());
    for (std::size_t r = send_seg_displs[j]; r < send_seg_displs[j] + send_seg_counts[j]; ++r)
      EPX_REQUIRE(rows[r] >= 0 && rows[r] < src_rows, errc::input, "all_to_allv_indexed: rows[", r, "] = ", rows[r],
                  " (segment ", j % nseg, " to peer ", j / nseg, ") is not a row of src (", src_rows, " rows)");
  }
  if constexpr (has_indexed_sends_v<Comm>) {
    comm.all_to_allv_indexed(src.data(), rows.data(), row_elems, send_seg_counts.data(), send_seg_displs.data(),
                             recv, recv_seg_counts.data(), recv_seg_displs.data(), nseg, datatype_of<T>());
  } else {
    std::size_t sent = 0;
    for (std::size_t j = 0; j < m; ++j) sent += send_seg_counts[j];
    std::vector<T> send(sent * row_elems);
    detail::gather_indexed_rows(src.data(), rows.data(), row_elems * sizeof(T), send_seg_counts.data(),
                                send_seg_displs.data(), m, send.data());
    std::vector<std::size_t> displs(m);
    for (std::size_t j = 0, at = 0; j < m; at += send_seg_counts[j], ++j) displs[j] = at;
    all_to_allv_segments(comm, static_cast<const T*>(send.data()), send_seg_counts,
                         span<const std::size_t>(displs.data(), m), recv, recv_seg_counts, recv_seg_displs, nseg,
                         row_elems);
  }
}

// In place: data = scale * sum over ranks of data.
template <class Comm, class T>
void all_reduce(Comm& comm, span<T> data, double scale = 1.0) {
  comm.all_reduce(data.data(), data.data(), data.size(), datatype_of<T>(), scale);
}

template <class Comm, class T>
void all_reduce(Comm& comm, span<const T> send, span<T> recv, double scale = 1.0) {
  EPX_REQUIRE(send.size() == recv.size(), errc::input, "all_reduce: send (", send.size(),
              ") and recv (", recv.size(), ") sizes differ");
  comm.all_reduce(send.data(), recv.data(), send.size(), datatype_of<T>(), scale);
}

// send: size()*recv.size() elements; block r (summed over ranks, times scale) lands on rank r.
template <class Comm, class T>
void reduce_scatter(Comm& comm, span<const T> send, span<T> recv, double scale = 1.0) {
  // Divided, not multiplied: a recv size whose product with the size wraps must not pass.
  const auto n = static_cast<std::size_t>(comm.size());
  EPX_REQUIRE(send.size() % n == 0 && send.size() / n == recv.size(), errc::input, "reduce_scatter: send (",
              send.size(), ") must hold size (", comm.size(), ") x recv (", recv.size(), ") elements");
  comm.reduce_scatter(send.data(), recv.data(), recv.size(), datatype_of<T>(), scale);
}

template <class Comm, class T>
void all_gather(Comm& comm, span<const T> send, span<T> recv) {
  const auto n = static_cast<std::size_t>(comm.size());
  EPX_REQUIRE(recv.size() % n == 0 && recv.size() / n == send.size(), errc::input, "all_gather: recv (",
              recv.size(), ") must hold size (", comm.size(), ") x send (", send.size(), ") elements");
  comm.all_gather(send.data(), recv.data(), send.size(), datatype_of<T>());
}

template <class Comm, class T>
void broadcast(Comm& comm, span<T> data, int root) {
  EPX_REQUIRE(root >= 0 && root < comm.size(), errc::input, "broadcast: root (", root,
              ") out of range [0, ", comm.size(), ")");
  comm.broadcast(data.data(), data.size(), datatype_of<T>(), root);
}

}  // namespace epx
