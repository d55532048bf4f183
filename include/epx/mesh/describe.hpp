// epx/mesh/describe.hpp: the rank table of a mesh, in the format of the seed's picture.
//
//   rank         0      1       2      3   ...
//   batch       [====B0====]   [====B1====] ...
//   tp           0      1       0      1   ...
//   ep_size=2   E0-3   E4-7    E0-3   E4-7 ...   efsdp_size=4
//
// Columns are grouped by TP group (one batch each) with one extra space between groups.
// `replica` and `pp` lines appear only when dp_replicate > 1 or pp > 1.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "epx/mesh/mesh.hpp"

namespace epx {
namespace detail {

inline std::string expert_label(int begin, int count) {
  const std::string b = std::to_string(begin);
  if (count == 1) return "E" + b;
  if (count == 2) return "E" + b + "E" + std::to_string(begin + 1);
  return "E" + b + "-" + std::to_string(begin + count - 1);
}

inline void rstrip(std::string& s) {
  while (!s.empty() && s.back() == ' ') s.pop_back();
}

inline void pad_to(std::string& s, std::size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
}

}  // namespace detail

// Table of `base` (its ep field ignored) for each ep size in `ep_sizes`; each
// configuration is validated and the first invalid one throws.
inline std::string describe(const mesh_config& base, const std::vector<int>& ep_sizes) {
  std::vector<mesh> meshes;
  for (int ep : ep_sizes) {
    mesh_config c = base;
    c.ep = ep;
    meshes.emplace_back(c);
  }
  if (meshes.empty()) meshes.emplace_back(base);
  const mesh& m0 = meshes.front();
  const int W = m0.world();
  const int tp = m0.tp();

  std::size_t cell = 7;
  cell = std::max(cell, std::to_string(W - 1).size() + 3);
  std::size_t label = 12;
  std::vector<std::string> ep_labels;
  for (const mesh& m : meshes) {
    const std::string l = "ep_size=" + std::to_string(m.ep());
    ep_labels.push_back(l);
    label = std::max(label, l.size() + 2);
    for (int r = 0; r < W; ++r)
      cell = std::max(cell, detail::expert_label(m.expert_begin(r), m.local_experts()).size() + 2);
  }

  // One line: a label, then one cell per rank, one extra space after every TP group.
  auto row = [&](const std::string& name, auto&& text_of_rank) {
    std::string s = name;
    detail::pad_to(s, label);
    for (int r = 0; r < W; ++r) {
      const std::size_t start = s.size();
      s += text_of_rank(r);
      detail::pad_to(s, start + cell);
      if (r % tp == tp - 1) s += ' ';
    }
    return s;
  };

  std::string out;
  auto emit = [&](std::string line) {
    detail::rstrip(line);
    out += line;
    out += '\n';
  };
  emit(row("rank", [&](int r) { return " " + std::to_string(r); }));
  {
    std::string s = "batch";
    detail::pad_to(s, label);
    for (int g = 0; g < W / tp; ++g) {
      const std::size_t start = s.size();
      const std::string b = "B" + std::to_string(m0.batch(g * tp));
      const long inner = static_cast<long>(cell) * tp - 4;
      const long fill = std::max(0L, inner - static_cast<long>(b.size()));
      s += '[';
      s.append(static_cast<std::size_t>(fill / 2), '=');
      s += b;
      s.append(static_cast<std::size_t>(fill - fill / 2), '=');
      s += ']';
      detail::pad_to(s, start + cell * static_cast<std::size_t>(tp) + 1);
    }
    emit(s);
  }
  emit(row("tp", [&](int r) { return " " + std::to_string(m0.coords(r).tp); }));
  if (m0.dp_replicate() > 1) emit(row("replica", [&](int r) { return " " + std::to_string(m0.coords(r).replica); }));
  if (m0.pp() > 1) emit(row("pp", [&](int r) { return " " + std::to_string(m0.coords(r).pp); }));
  for (std::size_t i = 0; i < meshes.size(); ++i) {
    const mesh& m = meshes[i];
    std::string s = row(ep_labels[i], [&](int r) { return detail::expert_label(m.expert_begin(r), m.local_experts()); });
    s += "efsdp_size=" + std::to_string(m.efsdp());
    emit(s);
  }
  return out;
}

// Table of one mesh.
inline std::string describe(const mesh& m) { return describe(m.config(), {m.ep()}); }

}  // namespace epx
