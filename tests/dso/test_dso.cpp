// Forward in one shared library, backward in another, both built with hidden visibility:
// the saved state is taken back (its type key is the same in both libraries) with the
// right gradients, and layers made in different libraries have different ids (a state of
// one is refused by the other's backward, on every rank).
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "dso/dso_layer.hpp"

int main() {
  const std::size_t n = 5, H = 8, k = 2;
  // Each library counts its layers; the ids they hand out still differ (each counted from
  // 1 before, so the first ids of the two were equal).
  const std::uint64_t a1 = dso_a_next_layer_id(), b1 = dso_b_next_layer_id();
  if (a1 == b1) {
    std::printf("libraries A and B hand out the same layer id %llu\n", static_cast<unsigned long long>(a1));
    return 1;
  }
  std::vector<std::string> failures(2);
  epx::threads::run(2, [&](dso::comm_t& world) {
    std::string& f = failures[static_cast<std::size_t>(world.rank())];
    std::vector<float> x(n * H), w(n * k), out(n * H), g(n * H), gx(n * H), gw(n * k);
    std::vector<std::int32_t> ids(n * k);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 5 + 3 * world.rank()) % 7) - 3.0f;
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i * 3 + world.rank()) % 5) - 2.0f;
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t j = 0; j < k; ++j) {
        ids[t * k + j] = static_cast<std::int32_t>((t + 2 * j + static_cast<std::size_t>(world.rank())) % 4);
        w[t * k + j] = 0.25f * static_cast<float>(j + 1);
      }
    // 1. One layer (made by A): forward in A, backward in B.
    auto layer = dso_a_make(world);
    try {
      auto saved = dso_a_forward(*layer, x.data(), ids.data(), w.data(), out.data(), n);
      dso_b_backward(*layer, std::move(saved), g.data(), gx.data(), gw.data(), n);
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t h = 0; h < H; ++h) {
          const float ws = w[t * k] + w[t * k + 1];
          // out = sum_j w_j * 2x; grad_x = sum_j 2 * (w_j * g) (w_j * g rounded, then 2x exact).
          if (out[t * H + h] != 2.0f * x[t * H + h] * w[t * k] + 2.0f * x[t * H + h] * w[t * k + 1] &&
              std::fabs(out[t * H + h] - 2.0f * x[t * H + h] * ws) > 1e-5f)
            f += "wrong out; ";
          if (std::fabs(gx[t * H + h] - 2.0f * g[t * H + h] * ws) > 1e-5f) f += "wrong grad_x; ";
        }
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t j = 0; j < k; ++j) {
          double dot = 0;
          for (std::size_t h = 0; h < H; ++h) dot += 2.0 * x[t * H + h] * g[t * H + h];
          if (std::fabs(gw[t * k + j] - dot) > 1e-4) f += "wrong grad_weights; ";
        }
    } catch (const epx::error& e) {
      f += std::string("forward in A, backward in B: ") + e.what();
    }
    // 2. Layers made by A and by B: B's backward refuses A's state, on every rank.
    auto other = dso_b_make(world);
    try {
      auto saved = dso_a_forward(*layer, x.data(), ids.data(), w.data(), out.data(), n);
      dso_b_backward(*other, std::move(saved), g.data(), gx.data(), gw.data(), n);
      f += "a state of a layer made in A was taken back by a layer made in B; ";
    } catch (const epx::error& e) {
      if (std::string(e.what()).find("the saved state was made by another layer") == std::string::npos)
        f += std::string("unexpected error: ") + e.what();
    }
  });
  int bad = 0;
  for (std::size_t r = 0; r < failures.size(); ++r)
    if (!failures[r].empty()) {
      std::printf("rank %zu: %s\n", r, failures[r].c_str());
      bad = 1;
    }
  if (!bad) std::printf("ok: forward in one shared library, backward in another; layer ids differ across them\n");
  return bad;
}
