// epx/layer/agreement.hpp: every rank of a layer built the same mesh and options.
//
// A layer whose ranks disagree on the mesh or the options would move rows by different
// layouts: a buffer overflow or silently zero rows. At construction every rank contributes
// one small record (its world rank, the mesh, the options, the rows' element type, the
// implementation, whether its policy is a host one, and its own verdict on them) to
// an all_gather over a communicator (detail::all_gather_host: through device copies on a
// device communicator); every rank compares all records with
// the first one and, on any difference, raises epx::error(errc::configuration) naming the
// ranks and the values, on every rank (they all see the same records).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "epx/comm/collectives.hpp"
#include "epx/comm/host_arrays.hpp"
#include "epx/core/error.hpp"
#include "epx/core/numeric.hpp"
#include "epx/core/span.hpp"
#include "epx/impl/options.hpp"
#include "epx/mesh/mesh.hpp"

namespace epx::detail {

// How a field's value reads in a message: a number, or the name of a bool or an option's
// enumerator (as layer_options spells it).
enum class record_format : int {
  integer,
  double_bits,
  element_type,
  implementation,
  boolean,
  count_exchange,
  capacity_mode,
  drop_priority,
  row_sends
};

struct layer_record_field {
  const char* name;
  std::int64_t value;
  record_format format = record_format::integer;
};

inline std::int64_t double_bits(double v) {
  std::int64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// The element type of the rows as a record value: 1 float, 2 double, 3 bf16, 4 fp16
// (bf16 and fp16 have one size, so the size alone would not tell them apart).
template <class T>
constexpr std::int64_t element_type_code() noexcept {
  return std::is_same_v<T, float> ? 1 : std::is_same_v<T, double> ? 2 : std::is_same_v<T, bf16> ? 3
         : std::is_same_v<T, fp16> ? 4 : 0;
}

// The implementation as a record value: 64-bit FNV-1a of its name (impl_name: "user" for
// one without a name); 0 where the caller agrees on it itself.
inline std::int64_t implementation_code(const char* name) noexcept {
  std::uint64_t h = 14695981039346656037ull;
  for (const char* c = name; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}

// A field's value as a message shows it: a double as the shortest text that reads back to
// its bits; an element type, a built-in implementation, a bool and an enumerator by their
// names (a value outside the enumeration as a number).
inline std::string record_text(record_format f, std::int64_t v) {
  // An enumerator (values 0 to count - 1) as type::name, the name from to_name (the enums'
  // own to_string where they have one); another value as a number.
  const auto named = [v](const char* type, int count, auto to_name) {
    return v >= 0 && v < count ? concat(type, "::", to_name(v)) : std::to_string(v);
  };
  if (f == record_format::double_bits) {
    double d = 0.0;
    std::memcpy(&d, &v, sizeof d);
    char text[40] = {};
    for (int digits = 1; digits <= 17; ++digits) {
      std::snprintf(text, sizeof text, "%.*g", digits, d);
      if (double_bits(std::strtod(text, nullptr)) == v) break;
    }
    return text;
  }
  if (f == record_format::element_type) {
    const char* names[] = {"unknown", "float", "double", "bf16", "fp16"};
    return v >= 0 && v <= 4 ? names[v] : std::to_string(v);
  }
  if (f == record_format::implementation) {
    for (const char* name : {"all_to_all", "all_reduce", "automatic"})
      if (implementation_code(name) == v) return name;
    return v == 0 ? "unknown" : concat("another (name hash ", v, ")");
  }
  switch (f) {
    case record_format::boolean: return v == 0 ? "false" : v == 1 ? "true" : std::to_string(v);
    case record_format::count_exchange:
      return named("count_exchange", 2, [](std::int64_t e) { return e == 0 ? "host" : "device"; });
    case record_format::capacity_mode:
      return named("capacity_mode", 3, [](std::int64_t e) { return to_string(static_cast<capacity_mode>(e)); });
    case record_format::drop_priority:
      return named("drop_priority", 2, [](std::int64_t e) { return to_string(static_cast<drop_priority>(e)); });
    case record_format::row_sends:
      return named("row_sends", 2, [](std::int64_t e) { return to_string(static_cast<row_sends>(e)); });
    default: return std::to_string(v);
  }
}

// The layer's template arguments as record values (0 where the caller agrees on them
// itself): element_type_code<T>(), implementation_code of Impl's name, and whether Exec is
// a host policy (host and device policies take different routes: other collectives).
struct layer_types {
  std::int64_t element_type = 0;
  std::int64_t implementation = 0;
  std::int64_t host_policy = 0;
};

// The fields that must agree, in a fixed order (world_rank, first, is for messages only).
inline std::vector<layer_record_field> layer_record(const mesh& m, const layer_options& o, int world_rank,
                                                    const layer_types& types = {}) {
  return {{"world_rank", world_rank},
          {"element type T", types.element_type, record_format::element_type},
          {"implementation", types.implementation, record_format::implementation},
          {"exec::is_host_policy_v<Exec>", types.host_policy, record_format::boolean},
          {"tp", m.tp()},
          {"fsdp", m.fsdp()},
          {"ep", m.ep()},
          {"pp", m.pp()},
          {"dp_replicate", m.dp_replicate()},
          {"num_experts", m.experts()},
          {"hidden", static_cast<std::int64_t>(o.hidden)},
          {"top_k", o.top_k},
          {"pad.rows_per_expert", o.pad.rows_per_expert},
          {"pad.align", o.pad.align},
          {"counts", static_cast<std::int64_t>(o.counts), record_format::count_exchange},
          {"bound.cap", o.bound.cap},
          {"bound.raise_on_overflow", o.bound.raise_on_overflow ? 1 : 0, record_format::boolean},
          {"chunks", static_cast<std::int64_t>(o.chunks)},
          {"peer_access", o.peer_access ? 1 : 0, record_format::boolean},
          {"indexed_sends", o.indexed_sends ? 1 : 0, record_format::boolean},
          {"capacity.mode", static_cast<std::int64_t>(o.capacity.mode), record_format::capacity_mode},
          {"capacity.factor", double_bits(o.capacity.factor), record_format::double_bits},
          {"capacity.rows", o.capacity.rows},
          {"capacity.priority", static_cast<std::int64_t>(o.capacity.priority), record_format::drop_priority},
          {"ranks_per_node", o.ranks_per_node},
          {"max_nodes", o.max_nodes},
          {"fp8_dispatch", o.fp8_dispatch ? 1 : 0, record_format::boolean},
          {"sends", static_cast<std::int64_t>(o.sends), record_format::row_sends},
          {"stage_bytes", static_cast<std::int64_t>(o.stage_bytes)}};
}

// Collective over `comm`: raises errc::configuration on every rank of comm when a rank
// found its own configuration wrong (`local_error` non-empty: the mesh against its
// communicator, the options against the mesh), or when two ranks differ in any field of
// layer_record. `where` names the communicator in the message.
template <class Comm>
void agree_on_layer(Comm& comm, const mesh& m, const layer_options& o, int world_rank, const char* where,
                    const std::string& local_error = {}, const layer_types& types = {}) {
  auto fields = layer_record(m, o, world_rank, types);
  fields.push_back({"status", static_cast<std::int64_t>(local_error.size())});  // 0: no local error
  const std::size_t F = fields.size();
  const auto P = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> mine(F), all(F * P);
  for (std::size_t f = 0; f < F; ++f) mine[f] = fields[f].value;
  all_gather_host(comm, mine.data(), F, all.data());
  bool failed = false;
  for (std::size_t r = 0; r < P; ++r) failed = failed || all[r * F + F - 1] != 0;
  if (failed) {  // every rank takes this branch, with the same B: the second all_gather matches
    std::size_t B = 1;  // the longest message, whole, and its terminator
    for (std::size_t r = 0; r < P; ++r) B = std::max(B, static_cast<std::size_t>(all[r * F + F - 1]) + 1);
    std::vector<char> msg(B, '\0'), msgs(B * P, '\0');
    local_error.copy(msg.data(), B - 1);
    all_gather_host(comm, msg.data(), B, msgs.data());
    rank_messages why;  // one entry per distinct message, with the ranks that report it
    for (std::size_t r = 0; r < P; ++r)
      if (all[r * F + F - 1] != 0) why.add(all[r * F], std::string(msgs.data() + r * B));
    throw error(errc::configuration,
                concat("moe_layer: bad configuration in the ", where, " communicator", why.str()), EPX_HERE);
  }
  std::string why;
  for (std::size_t r = 1; r < P; ++r)
    for (std::size_t f = 1; f < F; ++f)
      if (all[r * F + f] != all[f])
        why += concat("; rank ", all[r * F], " has ", fields[f].name, "=",
                      record_text(fields[f].format, all[r * F + f]), " but rank ", all[0], " has ", fields[f].name,
                      "=", record_text(fields[f].format, all[f]));
  EPX_REQUIRE(why.empty(), errc::configuration, "moe_layer: the ranks of the ", where,
              " communicator built different meshes or layer options", why);
}

// Collective over `comm`, a group of kind g of mesh m holding world rank `world_rank`:
// raises errc::configuration on every rank of comm unless its members are, in rank order,
// the world ranks the mesh puts in that group. `who` begins the message.
template <class Comm>
void agree_on_group(Comm& comm, const mesh& m, group_kind g, int world_rank, const char* who = "moe_layer") {
  const auto P = static_cast<std::size_t>(comm.size());
  const std::int64_t mine[2] = {world_rank, comm.rank()};
  std::vector<std::int64_t> all(2 * P);
  all_gather_host(comm, mine, 2, all.data());
  std::string why;
  const auto w0 = static_cast<int>(all[0]);
  const bool w0_ok = w0 >= 0 && w0 < m.world() && static_cast<int>(P) == m.group_size(g);
  for (std::size_t r = 0; r < P; ++r) {
    const auto w = static_cast<int>(all[2 * r]);
    const int expect = w0_ok ? m.group_member(g, w0, static_cast<int>(r)) : -1;
    if (w != expect)
      why += concat("; member ", r, " is world rank ", w, " but the mesh puts world rank ", expect, " there");
  }
  EPX_REQUIRE(why.empty(), errc::configuration, who, ": the ", to_string(g),
              " communicator does not hold the ranks of the mesh's ", to_string(g), " group", why);
}

// Collective over `world` and over each of `groups` (the sub-communicators that
// sub_communicator made from `world` for the mesh's group kinds `kinds`): raises
// errc::configuration on every rank of `world` unless every group holds, in rank order,
// the world ranks the mesh puts in it. Comm::split orders a color's members by (key, rank);
// a communicator whose split does not (a user's own) would otherwise pair the wrong rows
// or the wrong blocks: a wrong result, or a hang where nothing checks counts. `who` begins
// the message.
//
// A group's check that fails as a collective (errc::communicator: the collective failed
// as a whole, e.g. the group's watchdog, calls that disagree, a communicator that failed
// earlier; or a backend's errc::cuda, nccl, mpi) does not end this rank's part at once:
// the rank goes on through the other groups and the world's exchange with a status that
// says so, and the world's other ranks, which the failed group does not reach, raise
// errc::communicator naming the rank and "the <kind> group's check failed: <message>"
// instead of waiting in the world's exchange for the watchdog. The ranks where it failed
// rethrow their own error as it was thrown; so do they where the world's exchange fails
// as well (the world is then the broken communicator, or a run that aborted). An error of
// another category (errc::input: agree_on_group passes well-formed buffers, so that is
// the communicator's own code raising, possibly before this rank entered the collective,
// as a rank's own exception; errc::internal) and any other exception go on at once, as
// before: the group's other members may be waiting in that collective for this rank, so
// the run's abort (threads::run, mpi::run) is what ends it.
template <class Comm, std::size_t N>
void agree_on_split(Comm& world, const mesh& m, Comm* const (&groups)[N], const group_kind (&kinds)[N],
                    const char* who) {
  std::string mine;        // the first group's verdict (errc::configuration) on this rank
  std::string broke;       // "the <kind> group's check failed: <message>" for the first failure
  std::exception_ptr own;  // that failure, to rethrow on this rank
  for (std::size_t i = 0; i < N; ++i) {
    try {
      agree_on_group(*groups[i], m, kinds[i], world.rank(), who);
    } catch (const error& e) {
      const errc c = e.category();
      if (c == errc::configuration) {
        if (mine.empty()) mine = e.message();
        continue;
      }
      if (c != errc::communicator && c != errc::cuda && c != errc::nccl && c != errc::mpi) throw;
      if (!own) {
        own = std::current_exception();
        broke = concat("the ", to_string(kinds[i]), " group's check failed: ", e.message());
      }
    }
  }
  const auto P = static_cast<std::size_t>(world.size());
  // status: 0 nothing, 1 a group's verdict, 2 a group's collective failed.
  const std::int64_t status[2] = {world.rank(), own ? 2 : mine.empty() ? 0 : 1};
  std::vector<std::int64_t> all(2 * P);
  constexpr std::size_t B = 384;  // every rank takes the same branches: the all_gathers match
  std::vector<char> msg(B, '\0'), msgs(B * P, '\0');
  bool failed = false, collective_failed = false;
  try {
    all_gather_host(world, status, 2, all.data());
    for (std::size_t r = 0; r < P; ++r) {
      failed = failed || all[2 * r + 1] != 0;
      collective_failed = collective_failed || all[2 * r + 1] == 2;
    }
    if (!failed) return;
    std::string text = own ? broke : mine;
    if (text.size() > B - 1) text = text.substr(0, B - 4) + "...";
    text.copy(msg.data(), B - 1);
    all_gather_host(world, msg.data(), B, msgs.data());
  } catch (const error&) {
    if (own) std::rethrow_exception(own);  // the world failed too: this rank's own error
    throw;
  }
  if (own) std::rethrow_exception(own);
  if (collective_failed) {
    // The ranks whose group's collective failed first (as "rank r failed: ..."), then the
    // verdicts of the others.
    std::string why;
    for (std::size_t r = 0; r < P; ++r)
      if (all[2 * r + 1] == 2) why += concat("; rank ", all[2 * r], " failed: ", std::string(msgs.data() + r * B));
    rank_messages verdicts;
    for (std::size_t r = 0; r < P; ++r)
      if (all[2 * r + 1] == 1) verdicts.add(all[2 * r], std::string(msgs.data() + r * B));
    throw error(errc::communicator,
                concat(who, ": the check of the communicators that split made from the world communicator "
                            "failed on another rank",
                       why, verdicts.str()),
                EPX_HERE);
  }
  rank_messages why;
  for (std::size_t r = 0; r < P; ++r)
    if (all[2 * r + 1] != 0) why.add(all[2 * r], std::string(msgs.data() + r * B));
  throw error(errc::configuration,
              concat(who, ": the communicators that split made from the world communicator do not hold the mesh's "
                          "groups (split must order the members of a color by (key, rank))",
                     why.str()),
              EPX_HERE);
}

}  // namespace epx::detail
