// The code of docs/layer.md: it appears verbatim in the document, compiles, and computes what
// the document says (checked against float64 computed here).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/docs_layer_examples.hpp"
#include "epx/comm/threads.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_docs_examples_cpp {

namespace {

std::string directory_of(const std::string& file) {
  const auto slash = file.find_last_of('/');
  return slash == std::string::npos ? std::string(".") : file.substr(0, slash);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The `// [doc:NAME]` ... `// [/doc]` regions of `text`, without the marker lines.
std::vector<std::pair<std::string, std::string>> doc_regions(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  const std::string open = "// [doc:", close = "// [/doc]";
  std::size_t at = 0;
  while ((at = text.find(open, at)) != std::string::npos) {
    const std::size_t name_end = text.find(']', at);
    const std::size_t body = text.find('\n', at) + 1;
    const std::size_t end = text.find(close, body);
    REQUIRE(end != std::string::npos);
    out.emplace_back(text.substr(at + open.size(), name_end - at - open.size()), text.substr(body, end - body));
    at = end + close.size();
  }
  return out;
}

// Uniform in [-1, 1), deterministic.
struct rng {
  std::uint64_t s;
  double next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(s >> 11) * 0x1.0p-52 - 1.0;
  }
};

struct batch {
  std::vector<float> x, logits, grad_out;
};

batch make_batch(int b, std::size_t N, int H, int E) {
  rng r{0x5eedull + 977ull * static_cast<std::uint64_t>(b)};
  batch d;
  for (std::size_t i = 0; i < N * H; ++i) d.x.push_back(static_cast<float>(r.next()));
  for (std::size_t i = 0; i < N * E; ++i) d.logits.push_back(static_cast<float>(2.0 * r.next()));
  for (std::size_t i = 0; i < N * H; ++i) d.grad_out.push_back(static_cast<float>(r.next()));
  return d;
}

float diag_param(int e, int h) { return static_cast<float>(0.5 + 0.1 * e - 0.05 * h); }

// float64: softmax, top-k (ties to the lower id), renormalised weights, diagonal experts.
struct reference {
  std::vector<double> out, grad_x, grad_logits;  // [N, H], [N, H], [N, E]
  std::vector<double> grad_d;                    // [E, H], this batch's sum
};

reference compute_reference(const batch& d, std::size_t N, int H, int E, int k) {
  reference r;
  r.out.assign(N * H, 0.0);
  r.grad_x.assign(N * H, 0.0);
  r.grad_logits.assign(N * E, 0.0);
  r.grad_d.assign(static_cast<std::size_t>(E) * H, 0.0);
  for (std::size_t t = 0; t < N; ++t) {
    std::vector<double> p(E);
    double mx = -1e300, z = 0.0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(d.logits[t * E + e]));
    for (int e = 0; e < E; ++e) z += std::exp(d.logits[t * E + e] - mx);
    for (int e = 0; e < E; ++e) p[e] = std::exp(d.logits[t * E + e] - mx) / z;
    std::vector<int> ids;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (std::find(ids.begin(), ids.end(), e) == ids.end() && (best < 0 || p[e] > p[best])) best = e;
      ids.push_back(best);
    }
    double S = 0.0;
    for (int e : ids) S += p[e];
    std::vector<double> g(k, 0.0);  // d loss / d w_j, loss = <out, grad_out>
    for (int j = 0; j < k; ++j) {
      const int e = ids[j];
      const double w = p[e] / S;
      for (int h = 0; h < H; ++h) {
        const double y = diag_param(e, h) * static_cast<double>(d.x[t * H + h]);
        const double go = d.grad_out[t * H + h];
        r.out[t * H + h] += w * y;
        r.grad_x[t * H + h] += w * diag_param(e, h) * go;
        r.grad_d[static_cast<std::size_t>(e) * H + h] += w * d.x[t * H + h] * go;
        g[j] += y * go;
      }
    }
    // w_j = p_{id_j} / S: d loss / d p_c, then through the softmax.
    std::vector<double> dp(E, 0.0);
    for (int j = 0; j < k; ++j)
      for (int c : ids) dp[c] += g[j] * ((c == ids[j] ? 1.0 / S : 0.0) - p[ids[j]] / (S * S));
    for (int e = 0; e < E; ++e)
      for (int c = 0; c < E; ++c) r.grad_logits[t * E + e] += dp[c] * p[c] * ((c == e ? 1.0 : 0.0) - p[e]);
  }
  return r;
}

template <class A>
double max_error(const std::vector<A>& got, const std::vector<double>& want) {
  double m = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) m = std::max(m, std::abs(static_cast<double>(got[i]) - want[i]));
  return m;
}

}  // namespace

TEST_CASE("docs/layer.md: every code block of tests/core/docs_layer_examples.hpp appears verbatim") {
  const std::string here = directory_of(__FILE__);
  const std::string header = read_file(here + "/docs_layer_examples.hpp");
  const std::string doc = read_file(here + "/../../docs/layer.md");
  REQUIRE_MESSAGE(!header.empty(), "cannot read ", here, "/docs_layer_examples.hpp");
  REQUIRE_MESSAGE(!doc.empty(), "cannot read ", here, "/../../docs/layer.md");
  const auto regions = doc_regions(header);
  CHECK(regions.size() == 4);
  for (const auto& region : regions) {
    // Named references, not a structured binding: INFO captures in a lambda, which may
    // capture a structured binding only from C++20.
    const std::string& name = region.first;
    const std::string& code = region.second;
    INFO("region ", name);
    CHECK_MESSAGE(doc.find("```cpp\n" + code + "```") != std::string::npos,
                  "docs/layer.md has no ```cpp block equal to region '", name, "' of docs_layer_examples.hpp");
  }
}

TEST_CASE("docs/layer.md: diagonal_experts and moe_step against float64") {
  // tp=2, fsdp=2, ep=4: one EP group of 4 ranks holding 2 batches; 8 experts, top-2.
  const epx::mesh m(epx::mesh_config{2, 2, 1, 1, 4, 8, 0});
  const int H = 6, E = 8, k = 2, L = m.local_experts();
  const std::size_t rows[2] = {9, 5};
  std::vector<std::string> failures(4);
  epx::threads::run(4, [&](epx::threads::communicator& world) {
    const int rank = world.rank(), b = m.batch(rank);
    const std::size_t N = rows[b];
    const batch d = make_batch(b, N, H, E);
    docs::diagonal_experts experts;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) experts.d.push_back(diag_param(m.expert_begin(rank) + l, h));
    experts.grad.assign(experts.d.size(), 0.0f);
    const docs::step_result r = docs::moe_step(world, m, experts, d.x, d.logits, d.grad_out, H, k);

    const reference ref = compute_reference(d, N, H, E, k);
    std::string& f = failures[static_cast<std::size_t>(rank)];
    const auto check = [&](const char* what, double err) {
      if (!(err <= 1e-5)) f += epx::detail::concat("rank ", rank, ": ", what, " error ", err, "\n");
    };
    check("out", max_error(r.out, ref.out));
    check("grad_x", max_error(r.grad_x, ref.grad_x));
    check("grad_logits", max_error(r.grad_logits, ref.grad_logits));
    // After the hook: the mean over both batches of this rank's experts' gradients.
    const reference other = compute_reference(make_batch(1 - b, rows[1 - b], H, E), rows[1 - b], H, E, k);
    std::vector<double> want;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const std::size_t i = static_cast<std::size_t>(m.expert_begin(rank) + l) * H + h;
        want.push_back((ref.grad_d[i] + other.grad_d[i]) / 2.0);
      }
    check("expert gradient after the hook", max_error(experts.grad, want));
    // Statistics: every (token, slot) pair of both batches, padding rounded up to 4.
    std::int64_t pairs = 0;
    for (auto c : r.stats.tokens_per_expert) pairs += c;
    if (pairs != static_cast<std::int64_t>((rows[0] + rows[1]) * k))
      f += epx::detail::concat("rank ", rank, ": ", pairs, " pairs in the statistics\n");
    for (int l = 0; l < L; ++l) {
      const auto c = r.stats.tokens_per_local_expert[static_cast<std::size_t>(l)];
      const auto p = r.stats.padding_per_local_expert[static_cast<std::size_t>(l)];
      if (c != r.stats.tokens_per_expert[static_cast<std::size_t>(m.expert_begin(rank) + l)] || p < 1 ||
          (c + p) % 4 != 0 || p > 4)
        f += epx::detail::concat("rank ", rank, ": local expert ", l, " has ", c, " rows and ", p, " padding rows\n");
    }
    if (std::string(r.stats.path) != "all_to_all") f += "path is " + std::string(r.stats.path) + "\n";
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("docs/layer.md: counted_all_to_all is an implementation") {
  using comm_t = epx::threads::communicator;
  const epx::mesh m(epx::mesh_config{1, 2, 1, 1, 2, 4, 0});
  const int H = 3, E = 4, k = 1;
  std::vector<std::string> failures(2);
  epx::threads::run(2, [&](comm_t& world) {
    const int rank = world.rank();
    const std::size_t N = 4;
    const batch d = make_batch(rank, N, H, E);
    docs::diagonal_experts experts;
    for (int l = 0; l < m.local_experts(); ++l)
      for (int h = 0; h < H; ++h) experts.d.push_back(diag_param(m.expert_begin(rank) + l, h));
    experts.grad.assign(experts.d.size(), 0.0f);
    epx::layer_options o;
    o.hidden = H;
    o.top_k = k;
    epx::moe_layer<comm_t, float, docs::counted_all_to_all<comm_t>> layer(m, world, o);
    std::vector<std::int32_t> ids(N);
    std::vector<float> w(N, 1.0f), out(N * H), gx(N * H), gw(N);
    for (std::size_t t = 0; t < N; ++t) ids[t] = static_cast<std::int32_t>((t + rank) % E);
    auto saved = layer.forward(epx::span<const float>(d.x), epx::span<const std::int32_t>(ids),
                               epx::span<const float>(w), epx::span<float>(out), experts, epx::mode::train);
    layer.backward(std::move(saved), epx::span<const float>(d.grad_out), epx::span<float>(gx), epx::span<float>(gw),
                   experts);
    std::string& f = failures[static_cast<std::size_t>(rank)];
    if (std::string(layer.stats().path) != "counted_all_to_all") f += "path " + std::string(layer.stats().path) + "\n";
    for (std::size_t t = 0; t < N; ++t)
      for (int h = 0; h < H; ++h) {
        const double want = diag_param(ids[t], h) * static_cast<double>(d.x[t * H + h]);
        if (std::abs(out[t * H + h] - want) > 1e-6)
          f += epx::detail::concat("rank ", rank, " out[", t, ",", h, "] = ", out[t * H + h], ", want ", want, "\n");
      }
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("docs/layer.md: two_micro_batches is bitwise the fused calls and matches float64") {
  using comm_t = epx::threads::communicator;
  const epx::mesh m(epx::mesh_config{2, 2, 1, 1, 4, 8, 0});  // tp=2, fsdp=2, ep=4
  const int H = 5, E = 8, k = 2;
  std::vector<std::string> failures(4);
  epx::threads::run(4, [&](comm_t& world) {
    const int rank = world.rank(), b = m.batch(rank);
    std::string& f = failures[static_cast<std::size_t>(rank)];
    const auto make_experts = [&] {
      docs::diagonal_experts e;
      for (int l = 0; l < m.local_experts(); ++l)
        for (int h = 0; h < H; ++h) e.d.push_back(diag_param(m.expert_begin(rank) + l, h));
      e.grad.assign(e.d.size(), 0.0f);
      return e;
    };
    std::vector<docs::micro_batch> mbs(2);
    for (int i = 0; i < 2; ++i) {
      const std::size_t N = 6 + static_cast<std::size_t>(3 * i + b);
      const batch d = make_batch(10 * b + i, N, H, E);
      auto& mb = mbs[static_cast<std::size_t>(i)];
      mb.x = d.x;
      mb.grad_out = d.grad_out;
      for (std::size_t t = 0; t < N; ++t) {
        const auto e0 = static_cast<std::int32_t>((t * 3 + static_cast<std::size_t>(i)) % E);
        mb.ids.push_back(e0);
        mb.ids.push_back((e0 + 1 + static_cast<std::int32_t>(t % 5)) % E);
        mb.w.push_back(0.75f);
        mb.w.push_back(0.25f);
      }
    }
    epx::layer_options o;
    o.hidden = H;
    o.top_k = k;
    // The fused calls, micro-batch 0 then 1.
    epx::moe_layer<comm_t, float> fused_layer(m, world, o);
    docs::diagonal_experts fused_experts = make_experts();
    std::vector<docs::micro_batch> fused = mbs;
    for (auto& mb : fused) {
      mb.out.resize(mb.x.size());
      mb.grad_x.resize(mb.x.size());
      mb.grad_w.resize(mb.w.size());
      auto s = fused_layer.forward(epx::span<const float>(mb.x), epx::span<const std::int32_t>(mb.ids),
                                   epx::span<const float>(mb.w), epx::span<float>(mb.out), fused_experts,
                                   epx::mode::train);
      fused_layer.backward(std::move(s), epx::span<const float>(mb.grad_out), epx::span<float>(mb.grad_x),
                           epx::span<float>(mb.grad_w), fused_experts);
    }
    epx::moe_layer<comm_t, float> layer(m, world, o);
    docs::diagonal_experts experts = make_experts();
    docs::two_micro_batches(layer, experts, mbs[0], mbs[1]);
    const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](float p, float q) {
               return std::memcmp(&p, &q, sizeof p) == 0;
             });
    };
    for (int i = 0; i < 2; ++i) {
      const auto& s = mbs[static_cast<std::size_t>(i)];
      const auto& u = fused[static_cast<std::size_t>(i)];
      if (!same(s.out, u.out) || !same(s.grad_x, u.grad_x) || !same(s.grad_w, u.grad_w))
        f += epx::detail::concat("rank ", rank, " micro-batch ", i, ": differs bitwise from the fused calls\n");
      for (std::size_t t = 0; t < s.out.size() / H; ++t)
        for (int h = 0; h < H; ++h) {
          double want = 0;
          for (int j = 0; j < k; ++j)
            want += static_cast<double>(s.w[t * k + j]) * diag_param(s.ids[t * k + j], h) * static_cast<double>(s.x[t * H + h]);
          if (std::abs(s.out[t * H + h] - want) > 1e-6)
            f += epx::detail::concat("rank ", rank, " out[", t, ",", h, "] = ", s.out[t * H + h], ", want ", want, "\n");
        }
    }
    if (!same(experts.grad, fused_experts.grad)) f += epx::detail::concat("rank ", rank, ": expert gradients differ\n");
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
}

}  // namespace test_docs_examples_cpp
