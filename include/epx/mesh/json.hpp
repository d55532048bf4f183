// epx/mesh/json.hpp: the mesh as JSON (what `epx-mesh --json` prints).
//
// {"world":W,"efsdp_size":F,"ranks":[{"rank":0,"tp":0,"fsdp":0,"replica":0,"pp":0,"batch":0,
//   "ep_rank":0,"efsdp_rank":0,"experts":[...],"groups":{"tp":[...],"fsdp":[...],"ep":[...],
//   "efsdp":[...],"dp_replicate":[...],"pp":[...]}}, ...]}
#pragma once

#include <string>
#include <vector>

#include "epx/mesh/mesh.hpp"

namespace epx {

inline std::string to_json(const mesh& m) {
  auto list = [](const std::vector<int>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(v[i]);
    }
    return s + "]";
  };
  auto field = [](const char* k, int v) { return std::string("\"") + k + "\":" + std::to_string(v); };
  std::string s = "{" + field("world", m.world()) + "," + field("efsdp_size", m.efsdp()) + ",\"ranks\":[";
  for (int r = 0; r < m.world(); ++r) {
    const rank_coords x = m.coords(r);
    if (r) s += ',';
    s += "{" + field("rank", r) + "," + field("tp", x.tp) + "," + field("fsdp", x.fsdp) + "," +
         field("replica", x.replica) + "," + field("pp", x.pp) + "," + field("batch", m.batch(r)) + "," +
         field("ep_rank", m.ep_rank(r)) + "," + field("efsdp_rank", m.efsdp_rank(r)) + ",\"experts\":";
    std::vector<int> ex;
    for (int e = m.expert_begin(r); e < m.expert_end(r); ++e) ex.push_back(e);
    s += list(ex) + ",\"groups\":{";
    bool first = true;
    for (group_kind g : all_group_kinds) {
      if (!first) s += ',';
      first = false;
      s += std::string("\"") + to_string(g) + "\":" + list(m.group_members(g, r));
    }
    s += "}}";
  }
  return s + "]}";
}

}  // namespace epx
