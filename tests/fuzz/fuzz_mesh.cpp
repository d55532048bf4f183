// Fuzz target: mesh construction and validation from arbitrary sizes.
//
// Every input either builds a mesh whose groups are self-consistent, or raises an
// epx::error of category configuration. Anything else (a crash, another exception, a
// sanitizer report, an inconsistent group) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "epx/mesh/describe.hpp"
#include "epx/mesh/json.hpp"
#include "epx/mesh/mesh.hpp"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

int take(const std::uint8_t*& data, std::size_t& size) {
  // One signed byte per size: small values (the interesting ones), negatives and zero included.
  if (size == 0) return 1;
  const auto v = static_cast<std::int8_t>(*data);
  ++data;
  --size;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  epx::mesh_config c;
  c.tp = take(data, size);
  c.fsdp = take(data, size);
  c.pp = take(data, size) % 4;
  c.dp_replicate = take(data, size) % 4;
  c.ep = take(data, size);
  c.experts = take(data, size);
  c.world = take(data, size) % 2 == 0 ? 0 : take(data, size);
  try {
    const epx::mesh m(c);
    const int W = m.world();
    require(W == c.pp * c.dp_replicate * c.fsdp * c.tp);
    require(m.efsdp() * m.ep() == m.block_size());
    require(m.local_experts() * m.ep() == m.experts());
    // Every rank of small meshes; a spread of ranks (first, last, strided) of large ones.
    const int step = W <= 256 ? 1 : W / 97 + 1;
    for (int r = 0; r < W; r = (r + step < W || r == W - 1) ? r + step : W - 1) {
      const auto x = m.coords(r);
      require(m.rank_of(x.pp, x.replica, x.fsdp, x.tp) == r);
      require(m.batch(r) >= 0 && m.batch(r) < m.batches());
      for (epx::group_kind g : epx::all_group_kinds) {
        const auto members = m.group_members(g, r);
        require(static_cast<int>(members.size()) == m.group_size(g));
        require(members[static_cast<std::size_t>(m.group_rank(g, r))] == r);
        for (std::size_t i = 0; i < members.size(); ++i) {
          require(members[i] >= 0 && members[i] < W);
          if (i) require(members[i] > members[i - 1]);
          // Group membership is symmetric: every member sees the same group.
          if (members.size() <= 64 || i % 17 == 0) require(m.group_members(g, members[i]) == members);
        }
      }
      for (int l = 0; l < m.local_experts(); ++l) require(m.to_local(m.to_global(l, r), r) == l);
      require(m.owner_ep_rank(m.expert_begin(r)) == m.ep_rank(r));
    }
    if (W <= 64) {
      const std::string table = epx::describe(m);
      const std::string json = epx::to_json(m);
      require(!table.empty() && json.front() == '{' && json.back() == '}');
    }
  } catch (const epx::error& e) {
    require(e.category() == epx::errc::configuration);
    require(!e.message().empty());
  }
  return 0;
}
