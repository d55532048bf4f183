// The mesh of spec section 1, checked against an independent model built in this file.
//
// The model does not use the rank formula: it enumerates ranks with nested loops over
// (pp, replica, fsdp, tp), numbering them in visiting order, and forms each group by
// filtering all ranks on the property that defines it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "epx/mesh/describe.hpp"
#include "epx/mesh/json.hpp"
#include "epx/mesh/mesh.hpp"

namespace {

// ---- the independent model ---------------------------------------------------------------

struct model_rank {
  int rank, pp, rep, fsdp, tp;
  int block;     // index of the (pp, rep) block, in visiting order
  int position;  // index inside the block, in visiting order
  int batch;
};

struct model {
  epx::mesh_config c;
  std::vector<model_rank> ranks;

  explicit model(const epx::mesh_config& cfg) : c(cfg) {
    int next = 0, block = 0;
    std::map<std::pair<int, int>, int> batch_of;  // (rep, fsdp) -> batch, first-seen order
    for (int p = 0; p < c.pp; ++p)
      for (int r = 0; r < c.dp_replicate; ++r, ++block) {
        int position = 0;
        for (int f = 0; f < c.fsdp; ++f)
          for (int t = 0; t < c.tp; ++t) {
            auto it = batch_of.find({r, f});
            if (it == batch_of.end()) it = batch_of.emplace(std::make_pair(r, f), static_cast<int>(batch_of.size())).first;
            ranks.push_back({next++, p, r, f, t, block, position++, it->second});
          }
      }
  }

  int world() const { return static_cast<int>(ranks.size()); }

  template <class Same>
  std::vector<int> filter(int rank, Same same) const {
    std::vector<int> out;
    const model_rank& me = ranks[static_cast<std::size_t>(rank)];
    for (const model_rank& x : ranks)
      if (same(me, x)) out.push_back(x.rank);
    return out;
  }

  std::vector<int> group(epx::group_kind g, int rank) const {
    const int ep = c.ep;
    switch (g) {
      case epx::group_kind::tp:
        return filter(rank, [](const model_rank& a, const model_rank& b) {
          return a.pp == b.pp && a.rep == b.rep && a.fsdp == b.fsdp;
        });
      case epx::group_kind::fsdp:
        return filter(rank, [](const model_rank& a, const model_rank& b) {
          return a.pp == b.pp && a.rep == b.rep && a.tp == b.tp;
        });
      case epx::group_kind::ep:
        return filter(rank, [ep](const model_rank& a, const model_rank& b) {
          return a.block == b.block && a.position / ep == b.position / ep;
        });
      case epx::group_kind::efsdp:
        return filter(rank, [ep](const model_rank& a, const model_rank& b) {
          return a.block == b.block && a.position % ep == b.position % ep;
        });
      case epx::group_kind::dp_replicate:
        return filter(rank, [](const model_rank& a, const model_rank& b) {
          return a.pp == b.pp && a.fsdp == b.fsdp && a.tp == b.tp;
        });
      case epx::group_kind::pp:
        return filter(rank, [](const model_rank& a, const model_rank& b) {
          return a.rep == b.rep && a.fsdp == b.fsdp && a.tp == b.tp;
        });
    }
    return {};
  }

  static int index_of(const std::vector<int>& v, int x) {
    return static_cast<int>(std::find(v.begin(), v.end(), x) - v.begin());
  }
  int ep_rank(int rank) const { return index_of(group(epx::group_kind::ep, rank), rank); }
  int efsdp_rank(int rank) const { return index_of(group(epx::group_kind::efsdp, rank), rank); }
  std::vector<int> experts(int rank) const {
    const int L = c.experts / c.ep, q = ep_rank(rank);
    std::vector<int> e;
    for (int i = 0; i < L; ++i) e.push_back(q * L + i);
    return e;
  }
};

epx::mesh_config cfg(int tp, int fsdp, int pp, int rep, int ep, int experts) {
  epx::mesh_config c;
  c.tp = tp;
  c.fsdp = fsdp;
  c.pp = pp;
  c.dp_replicate = rep;
  c.ep = ep;
  c.experts = experts;
  return c;
}

std::string name_of(const epx::mesh_config& c) {
  return "tp=" + std::to_string(c.tp) + " fsdp=" + std::to_string(c.fsdp) + " pp=" + std::to_string(c.pp) +
         " R=" + std::to_string(c.dp_replicate) + " ep=" + std::to_string(c.ep) + " E=" + std::to_string(c.experts);
}

// Valid configurations covering every size: pp > 1, dp_replicate > 1, ep = 1, ep = world,
// tp = ep, odd sizes.
const std::vector<epx::mesh_config>& configurations() {
  static const std::vector<epx::mesh_config> v = {
      cfg(1, 1, 1, 1, 1, 1),   // one rank
      cfg(2, 4, 1, 1, 2, 8),   // the seed, ep = tp
      cfg(2, 4, 1, 1, 4, 8),   // the seed, ep = 4
      cfg(2, 4, 1, 1, 8, 16),  // ep = world
      cfg(1, 8, 1, 1, 1, 4),   // ep = 1
      cfg(2, 2, 2, 1, 4, 8),   // pp > 1
      cfg(2, 2, 1, 3, 2, 6),   // dp_replicate > 1, tp = ep
      cfg(3, 2, 1, 1, 3, 9),   // tp = 3 = ep
      cfg(3, 2, 1, 1, 6, 12),  // tp = 3, ep = world
      cfg(1, 6, 1, 2, 3, 6),   // dp_replicate = 2, ep = 3
      cfg(2, 3, 2, 2, 6, 6),   // pp = 2, R = 2, ep = block
      cfg(4, 1, 3, 1, 4, 8),   // pp = 3, fsdp = 1
      cfg(1, 5, 1, 1, 5, 5),   // odd prime block
      cfg(2, 4, 2, 2, 4, 32),  // 32 ranks, every size > 1
      cfg(1, 1, 4, 1, 1, 3),   // pipeline only
      cfg(8, 1, 1, 1, 8, 8),   // tp only, ep = tp = world
      cfg(1, 3, 1, 5, 1, 7),   // R = 5, ep = 1, odd experts
  };
  return v;
}

// Runs `f` and returns the epx::error it must raise.
template <class F>
epx::error raised(F&& f) {
  try {
    f();
  } catch (const epx::error& e) {
    return e;
  }
  FAIL("no epx::error was raised");
  return epx::error(epx::errc::internal, "unreachable");
}

void check_config_error(const epx::mesh_config& c, const std::string& message) {
  CAPTURE(name_of(c));
  const epx::error e = raised([&] { epx::mesh m(c); (void)m; });
  CHECK(e.category() == epx::errc::configuration);
  CHECK(e.message() == message);
  // validate() alone raises the same error, so it can be called before building anything.
  const epx::error e2 = raised([&] { epx::mesh::validate(c); });
  CHECK(e2.message() == message);
}

// ---- a small JSON reader (objects, arrays, integers, strings) ----------------------------

struct json {
  enum kind_t { number, string, array, object } kind = number;
  long long num = 0;
  std::string str;
  std::vector<json> items;
  std::vector<std::pair<std::string, json>> fields;  // in document order

  const json& at(const std::string& k) const {
    for (const auto& f : fields)
      if (f.first == k) return f.second;
    FAIL("missing key " << k);
    static const json none;
    return none;
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    for (const auto& f : fields) k.push_back(f.first);
    return k;
  }
  std::vector<int> ints() const {
    REQUIRE(kind == array);
    std::vector<int> v;
    for (const json& x : items) {
      REQUIRE(x.kind == number);
      v.push_back(static_cast<int>(x.num));
    }
    return v;
  }
};

struct json_reader {
  const std::string& s;
  std::size_t i = 0;

  void expect(char ch) {
    REQUIRE_MESSAGE(i < s.size(), "unexpected end of JSON, wanted '" << ch << "'");
    REQUIRE_MESSAGE(s[i] == ch, "at offset " << i << ": wanted '" << ch << "', got '" << s[i] << "'");
    ++i;
  }
  std::string read_string() {
    expect('"');
    std::string out;
    while (i < s.size() && s[i] != '"') out += s[i++];
    expect('"');
    return out;
  }
  json value() {
    REQUIRE(i < s.size());
    json v;
    if (s[i] == '{') {
      v.kind = json::object;
      ++i;
      if (s[i] == '}') { ++i; return v; }
      for (;;) {
        std::string k = read_string();
        expect(':');
        v.fields.emplace_back(std::move(k), value());
        if (s[i] == ',') { ++i; continue; }
        expect('}');
        return v;
      }
    }
    if (s[i] == '[') {
      v.kind = json::array;
      ++i;
      if (s[i] == ']') { ++i; return v; }
      for (;;) {
        v.items.push_back(value());
        if (s[i] == ',') { ++i; continue; }
        expect(']');
        return v;
      }
    }
    if (s[i] == '"') {
      v.kind = json::string;
      v.str = read_string();
      return v;
    }
    const std::size_t start = i;
    if (s[i] == '-') ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
    REQUIRE_MESSAGE(i > start, "at offset " << start << ": not a JSON value");
    v.num = std::stoll(s.substr(start, i - start));
    return v;
  }
};

json parse_json(const std::string& s) {
  json_reader r{s};
  json v = r.value();
  CHECK_MESSAGE(r.i == s.size(), "trailing characters after JSON value at offset " << r.i);
  return v;
}

}  // namespace

// The seed's picture, copied from spec section 1.
static const char* const kSeedPicture =
    "rank         0      1       2      3       4      5       6      7\n"
    "batch       [====B0====]   [====B1====]   [====B2====]   [====B3====]\n"
    "tp           0      1       0      1       0      1       0      1\n"
    "ep_size=2   E0-3   E4-7    E0-3   E4-7    E0-3   E4-7    E0-3   E4-7    efsdp_size=4\n"
    "ep_size=4   E0E1   E2E3    E4E5   E6E7    E0E1   E2E3    E4E5   E6E7    efsdp_size=2\n"
    "ep_size=8   E0     E1      E2     E3      E4     E5      E6     E7      efsdp_size=1\n";

TEST_CASE("describe prints the seed's picture byte for byte") {
  const std::string got = epx::describe(cfg(2, 4, 1, 1, 2, 8), {2, 4, 8});
  CHECK(got == kSeedPicture);
}

TEST_CASE("describe of one mesh is its line of the multi-ep table") {
  const epx::mesh m(cfg(2, 4, 1, 1, 4, 8));
  const std::string one = epx::describe(m);
  CHECK(one ==
        "rank         0      1       2      3       4      5       6      7\n"
        "batch       [====B0====]   [====B1====]   [====B2====]   [====B3====]\n"
        "tp           0      1       0      1       0      1       0      1\n"
        "ep_size=4   E0E1   E2E3    E4E5   E6E7    E0E1   E2E3    E4E5   E6E7    efsdp_size=2\n");
}

TEST_CASE("describe adds replica and pp lines and one batch bracket per TP group") {
  for (const epx::mesh_config& c : configurations()) {
    CAPTURE(name_of(c));
    const epx::mesh m(c);
    const model ref(c);
    const std::string d = epx::describe(m);
    std::vector<std::string> lines;
    for (std::size_t s = 0, e; s < d.size(); s = e + 1) {
      e = d.find('\n', s);
      REQUIRE(e != std::string::npos);  // every line ends in '\n'
      lines.push_back(d.substr(s, e - s));
    }
    std::vector<std::string> names;
    for (const std::string& l : lines) {
      CHECK(l.back() != ' ');  // no trailing blanks
      names.push_back(l.substr(0, l.find(' ')));
    }
    std::vector<std::string> want = {"rank", "batch", "tp"};
    if (c.dp_replicate > 1) want.push_back("replica");
    if (c.pp > 1) want.push_back("pp");
    want.push_back("ep_size=" + std::to_string(c.ep));
    CHECK(names == want);
    // One bracket per TP group, holding that group's batch id.
    std::string batches;
    for (int r = 0; r < ref.world(); r += c.tp) batches += "B" + std::to_string(ref.ranks[static_cast<std::size_t>(r)].batch) + " ";
    std::string seen;
    const std::string& bl = lines[1];
    for (std::size_t p = bl.find('B'); p != std::string::npos; p = bl.find('B', p + 1)) {
      std::size_t q = p + 1;
      while (q < bl.size() && std::isdigit(static_cast<unsigned char>(bl[q]))) ++q;
      seen += bl.substr(p, q - p) + " ";
    }
    CHECK(seen == batches);
    CHECK(std::count(bl.begin(), bl.end(), '[') == ref.world() / c.tp);
    CHECK(lines.back().find("efsdp_size=" + std::to_string(ref.group(epx::group_kind::efsdp, 0).size())) !=
          std::string::npos);
  }
}

TEST_CASE("mesh matches the independent model group by group, rank by rank") {
  for (const epx::mesh_config& c : configurations()) {
    CAPTURE(name_of(c));
    const epx::mesh m(c);
    const model ref(c);
    REQUIRE(m.world() == ref.world());
    CHECK(m.block_size() == c.fsdp * c.tp);
    CHECK(m.local_experts() * c.ep == c.experts);
    std::set<int> all_batches;
    for (const model_rank& x : ref.ranks) all_batches.insert(x.batch);
    CHECK(m.batches() == static_cast<int>(all_batches.size()));
    CHECK(*all_batches.rbegin() == m.batches() - 1);
    CHECK(m.batches_per_ep_group() == c.ep / c.tp);

    for (const model_rank& x : ref.ranks) {
      const int r = x.rank;
      CAPTURE(r);
      const epx::rank_coords k = m.coords(r);
      CHECK(k.rank == r);
      CHECK(k.tp == x.tp);
      CHECK(k.fsdp == x.fsdp);
      CHECK(k.replica == x.rep);
      CHECK(k.pp == x.pp);
      CHECK(m.rank_of(x.pp, x.rep, x.fsdp, x.tp) == r);
      CHECK(m.batch(r) == x.batch);
      CHECK(m.block_start(r) == r - x.position);
      CHECK(m.ep_rank(r) == ref.ep_rank(r));
      CHECK(m.efsdp_rank(r) == ref.efsdp_rank(r));

      for (epx::group_kind g : epx::all_group_kinds) {
        CAPTURE(epx::to_string(g));
        const std::vector<int> want = ref.group(g, r);
        CHECK(m.group_members(g, r) == want);
        CHECK(m.group_size(g) == static_cast<int>(want.size()));
        CHECK(m.group_rank(g, r) == model::index_of(want, r));
        CHECK(m.group_color(g, r) == want.front());
        for (int i = 0; i < static_cast<int>(want.size()); ++i)
          CHECK(m.group_member(g, r, i) == want[static_cast<std::size_t>(i)]);
      }

      // Expert ownership: contiguous, ep-rank q owns [q*L, (q+1)*L).
      const std::vector<int> mine = ref.experts(r);
      CHECK(m.expert_begin(r) == mine.front());
      CHECK(m.expert_end(r) == mine.back() + 1);
      for (int e = 0; e < c.experts; ++e) {
        const bool owned = std::find(mine.begin(), mine.end(), e) != mine.end();
        CHECK(m.owner_ep_rank(e) == e / (c.experts / c.ep));
        if (owned) {
          const int l = m.to_local(e, r);
          CHECK(l == e - mine.front());
          CHECK(m.to_global(l, r) == e);
        } else {
          CHECK_THROWS_AS(m.to_local(e, r), epx::error);
        }
      }
    }

    // Batches: a TP group shares one; an EP group holds ep/tp different ones and every
    // batch appears tp times in it.
    for (int r = 0; r < ref.world(); ++r) {
      std::map<int, int> count;
      for (int q : ref.group(epx::group_kind::ep, r)) ++count[m.batch(q)];
      CHECK(static_cast<int>(count.size()) == c.ep / c.tp);
      for (const auto& kv : count) CHECK(kv.second == c.tp);
      std::set<int> tp_batches;
      for (int q : ref.group(epx::group_kind::tp, r)) tp_batches.insert(m.batch(q));
      CHECK(tp_batches.size() == 1);
    }
  }
}

TEST_CASE("mesh equality compares every size; an explicit matching world is accepted") {
  // mesh_config is an aggregate; equality compares every size.
  const epx::mesh a(cfg(2, 4, 1, 1, 4, 8)), b(cfg(2, 4, 1, 1, 4, 8)), d(cfg(2, 4, 1, 1, 8, 8));
  CHECK(a == b);
  CHECK(a != d);
  CHECK_FALSE(a != b);
  epx::mesh_config w = cfg(2, 4, 1, 1, 4, 8);
  w.world = 8;  // an explicit, matching world is accepted
  CHECK(epx::mesh(w).world() == 8);
  CHECK(epx::mesh(w) == a);
}

TEST_CASE("to_json holds every rank's coordinates, experts and groups") {
  for (const epx::mesh_config& c : configurations()) {
    CAPTURE(name_of(c));
    const epx::mesh m(c);
    const model ref(c);
    const json doc = parse_json(epx::to_json(m));
    REQUIRE(doc.kind == json::object);
    CHECK(doc.keys() == std::vector<std::string>{"world", "efsdp_size", "ranks"});
    CHECK(doc.at("world").num == ref.world());
    CHECK(doc.at("efsdp_size").num == static_cast<long long>(ref.group(epx::group_kind::efsdp, 0).size()));
    const json& ranks = doc.at("ranks");
    REQUIRE(ranks.kind == json::array);
    REQUIRE(static_cast<int>(ranks.items.size()) == ref.world());
    for (const model_rank& x : ref.ranks) {
      CAPTURE(x.rank);
      const json& j = ranks.items[static_cast<std::size_t>(x.rank)];
      CHECK(j.keys() == std::vector<std::string>{"rank", "tp", "fsdp", "replica", "pp", "batch", "ep_rank",
                                                 "efsdp_rank", "experts", "groups"});
      CHECK(j.at("rank").num == x.rank);
      CHECK(j.at("tp").num == x.tp);
      CHECK(j.at("fsdp").num == x.fsdp);
      CHECK(j.at("replica").num == x.rep);
      CHECK(j.at("pp").num == x.pp);
      CHECK(j.at("batch").num == x.batch);
      CHECK(j.at("ep_rank").num == ref.ep_rank(x.rank));
      CHECK(j.at("efsdp_rank").num == ref.efsdp_rank(x.rank));
      CHECK(j.at("experts").ints() == ref.experts(x.rank));
      const json& groups = j.at("groups");
      CHECK(groups.keys() == std::vector<std::string>{"tp", "fsdp", "ep", "efsdp", "dp_replicate", "pp"});
      for (epx::group_kind g : epx::all_group_kinds) {
        CAPTURE(epx::to_string(g));
        CHECK(groups.at(epx::to_string(g)).ints() == ref.group(g, x.rank));
      }
    }
  }
}

TEST_CASE("every size below 1 is rejected with its name and value") {
  for (int bad : {0, -1, -7}) {
    const std::string v = "(" + std::to_string(bad) + ")";
    check_config_error(cfg(bad, 1, 1, 1, 1, 1), "tp_size " + v + " must be at least 1");
    check_config_error(cfg(1, bad, 1, 1, 1, 1), "fsdp_size " + v + " must be at least 1");
    check_config_error(cfg(1, 1, bad, 1, 1, 1), "pp_size " + v + " must be at least 1");
    check_config_error(cfg(1, 1, 1, bad, 1, 1), "dp_replicate_size " + v + " must be at least 1");
    check_config_error(cfg(1, 1, 1, 1, bad, 1), "ep_size " + v + " must be at least 1");
    check_config_error(cfg(1, 1, 1, 1, 1, bad), "num_experts " + v + " must be at least 1");
  }
}

TEST_CASE("divisibility and world rules name the offending values") {
  check_config_error(cfg(2, 3, 1, 1, 3, 6), "ep_size (3) must be a multiple of tp_size (2)");
  check_config_error(cfg(2, 2, 1, 1, 8, 8), "ep_size (8) must divide fsdp_size*tp_size (2*2 = 4)");
  check_config_error(cfg(1, 6, 1, 1, 4, 8), "ep_size (4) must divide fsdp_size*tp_size (6*1 = 6)");
  check_config_error(cfg(2, 4, 1, 1, 4, 6), "num_experts (6) must be divisible by ep_size (4)");
  check_config_error(cfg(2, 4, 1, 1, 8, 12), "num_experts (12) must be divisible by ep_size (8)");
  epx::mesh_config w = cfg(2, 4, 2, 1, 2, 8);
  w.world = 8;
  check_config_error(w, "world size (8) must equal pp_size*dp_replicate_size*fsdp_size*tp_size (2*1*4*2 = 16)");
  check_config_error(cfg(1 << 16, 1 << 16, 1, 1, 1, 1),
                     "world size pp*dp_replicate*fsdp*tp (4294967296) is too large");
  // Products beyond a long long (2^64 wraps to 0, 2^80 too) are too large as well, never a mesh of world 0.
  check_config_error(cfg(1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16, 1 << 16),
                     "world size pp*dp_replicate*fsdp*tp (65536*65536*65536*65536) is too large");
  check_config_error(cfg(1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20),
                     "world size pp*dp_replicate*fsdp*tp (1048576*1048576*1048576*1048576) is too large");
}

TEST_CASE("top-k and communicator size are validated against the mesh") {
  const epx::mesh m(cfg(2, 4, 1, 1, 4, 8));
  for (int k = 1; k <= 8; ++k) CHECK_NOTHROW(m.validate_top_k(k));
  for (int k : {0, -1, 9, 100}) {
    CAPTURE(k);
    const epx::error e = raised([&] { m.validate_top_k(k); });
    CHECK(e.category() == epx::errc::configuration);
    CHECK(e.message() == "top_k (" + std::to_string(k) + ") must be in [1, num_experts (8)]");
  }
  CHECK_NOTHROW(m.validate_world(8));
  const epx::error ws = raised([&] { m.validate_world(6); });
  CHECK(ws.category() == epx::errc::configuration);
  CHECK(ws.message() == "communicator size (6) must equal pp_size*dp_replicate_size*fsdp_size*tp_size (1*1*4*2 = 8)");
}

TEST_CASE("out-of-range ranks, experts and group indices are input errors") {
  const epx::mesh m(cfg(2, 4, 1, 1, 4, 8));
  const std::vector<std::pair<std::string, std::pair<std::function<void()>, std::string>>> cases = {
      {"coords(8)", {[&] { (void)m.coords(8); }, "rank (8) out of range [0, 8)"}},
      {"batch(-1)", {[&] { (void)m.batch(-1); }, "rank (-1) out of range [0, 8)"}},
      {"ep_rank(9)", {[&] { (void)m.ep_rank(9); }, "rank (9) out of range [0, 8)"}},
      {"owner_ep_rank(8)", {[&] { (void)m.owner_ep_rank(8); }, "expert id (8) out of range [0, 8)"}},
      {"to_local(-1)", {[&] { (void)m.to_local(-1, 0); }, "expert id (-1) out of range [0, 8)"}},
      {"to_local(not owned)", {[&] { (void)m.to_local(5, 1); }, "expert 5 is not owned by rank 1 (owns [2, 4))"}},
      {"to_global(2)", {[&] { (void)m.to_global(2, 0); }, "local expert id (2) out of range [0, 2)"}},
      {"to_global(-1)", {[&] { (void)m.to_global(-1, 0); }, "local expert id (-1) out of range [0, 2)"}},
      {"group_member(ep, 4)", {[&] { (void)m.group_member(epx::group_kind::ep, 0, 4); }, "ep group index (4) out of range [0, 4)"}},
      {"group_member(efsdp, -1)", {[&] { (void)m.group_member(epx::group_kind::efsdp, 0, -1); }, "efsdp group index (-1) out of range [0, 2)"}},
      // Coordinates outside their sizes: never the rank of other coordinates (tp_i = tp is the next TP group's rank).
      {"rank_of(tp_i 2)", {[&] { (void)m.rank_of(0, 0, 0, 2); }, "rank_of: tp_i (2) out of range [0, 2)"}},
      {"rank_of(fsdp_i 4)", {[&] { (void)m.rank_of(0, 0, 4, 0); }, "rank_of: fsdp_i (4) out of range [0, 4)"}},
      {"rank_of(rep_i 1)", {[&] { (void)m.rank_of(0, 1, 0, 0); }, "rank_of: rep_i (1) out of range [0, 1)"}},
      {"rank_of(pp_i -1)", {[&] { (void)m.rank_of(-1, 0, 0, 0); }, "rank_of: pp_i (-1) out of range [0, 1)"}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.first);
    const epx::error e = raised(c.second.first);
    CHECK(e.category() == epx::errc::input);
    CHECK(e.message() == c.second.second);
  }
}

TEST_CASE("epx::error carries category, message, status and source location") {
  const epx::error e = raised([] { epx::mesh m(cfg(2, 3, 1, 1, 3, 6)); (void)m; });
  CHECK(e.category() == epx::errc::configuration);
  CHECK(e.status() == 0);
  REQUIRE(e.where().file != nullptr);
  const std::string file = e.where().file;
  CHECK(file.find("mesh.hpp") != std::string::npos);
  CHECK(e.where().line > 0);
  REQUIRE(e.where().function != nullptr);
  CHECK(std::string(e.where().function) == "validate");
  const std::string what = e.what();
  CHECK(what == "epx configuration error: ep_size (3) must be a multiple of tp_size (2) [" + file + ":" +
                    std::to_string(e.where().line) + "]");
  // Caught as a std::runtime_error too.
  CHECK_THROWS_AS(epx::mesh(cfg(2, 3, 1, 1, 3, 6)), std::runtime_error);

  // Every category has a name; a status travels with backend errors.
  CHECK(std::string(epx::to_string(epx::errc::configuration)) == "configuration");
  CHECK(std::string(epx::to_string(epx::errc::input)) == "input");
  CHECK(std::string(epx::to_string(epx::errc::communicator)) == "communicator");
  CHECK(std::string(epx::to_string(epx::errc::cuda)) == "cuda");
  CHECK(std::string(epx::to_string(epx::errc::nccl)) == "nccl");
  CHECK(std::string(epx::to_string(epx::errc::mpi)) == "mpi");
  CHECK(std::string(epx::to_string(epx::errc::internal)) == "internal");
  const epx::error b(epx::errc::nccl, "ncclAllReduce failed", EPX_HERE, 3);
  CHECK(b.status() == 3);
  CHECK(b.category() == epx::errc::nccl);
  CHECK(std::string(b.what()).rfind("epx nccl error: ncclAllReduce failed [", 0) == 0);
  // Without a location there is no bracket.
  const epx::error n(epx::errc::input, "bad");
  CHECK(std::string(n.what()) == "epx input error: bad");
  // EPX_REQUIRE passes through when the condition holds.
  CHECK_NOTHROW([] { EPX_REQUIRE(1 + 1 == 2, epx::errc::internal, "arithmetic"); }());
  const epx::error t = raised([] { EPX_THROW(epx::errc::input, "value (", 42, ") and ", 1.5); });
  CHECK(t.message() == "value (42) and 1.5");
}

TEST_CASE("describe validates every ep size and raises the first invalid one") {
  const epx::error e = raised([] { (void)epx::describe(cfg(2, 4, 1, 1, 1, 8), {2, 3, 16}); });
  CHECK(e.category() == epx::errc::configuration);
  CHECK(e.message() == "ep_size (3) must be a multiple of tp_size (2)");
}
