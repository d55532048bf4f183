// Fuzz target: the send layout and the routing checks from arbitrary ids, weights, logits
// and shapes (out-of-range and negative ids, NaN and infinite values, empty inputs).
//
// Either the input is rejected the way the library promises (the layout names the first
// bad pair; routing raises epx::error(errc::input) or errc::configuration for a bad k),
// or the result is checked against an independent model: the layout is the stable order
// by (expert, row, slot) and routing returns k distinct in-range experts with finite
// weights. Anything else aborts.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "epx/layout/plan.hpp"
#include "epx/routing/routing.hpp"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

struct reader {
  const std::uint8_t* p;
  std::size_t n;
  std::uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  float number() {
    // Mostly small exact values; byte 0xff introduces raw float bits (NaN, inf, huge).
    const std::uint8_t b = byte();
    if (b != 0xff) return static_cast<float>(static_cast<std::int8_t>(b)) / 8.0f;
    std::uint32_t u = 0;
    for (int i = 0; i < 4; ++i) u = (u << 8) | byte();
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

void check_layout(reader& in) {
  const std::size_t n = in.byte() % 24;
  const int k = 1 + in.byte() % 4;
  const int E = 1 + in.byte() % 12;
  const std::size_t chunks = in.byte() % 5;  // 0: the policy's default
  std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
  std::vector<float> w(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<std::int8_t>(in.byte()) % (E + 2);  // some out of range, some negative
    w[i] = in.number();
  }
  const auto plan = epx::layout::build_plan(epx::exec::serial{}, ids.data(), w.data(), n, k, E, chunks);

  // The first bad pair, computed independently.
  std::int64_t first_bad = -1;
  for (std::size_t i = 0; i < ids.size() && first_bad < 0; ++i)
    if (ids[i] < 0 || ids[i] >= E || !std::isfinite(w[i])) first_bad = static_cast<std::int64_t>(i);
  if (first_bad >= 0) {
    require(!plan.check);
    require(plan.check.pair == first_bad);
    require(!epx::layout::describe(plan.check, k, E).empty());
    return;
  }
  require(static_cast<bool>(plan.check));
  // Expected position of every pair: stable counting by (expert, row, slot).
  std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0), offset(static_cast<std::size_t>(E) + 1, 0);
  for (auto e : ids) ++counts[static_cast<std::size_t>(e)];
  for (int e = 0; e < E; ++e) offset[static_cast<std::size_t>(e) + 1] = offset[static_cast<std::size_t>(e)] + counts[static_cast<std::size_t>(e)];
  std::vector<std::int64_t> next(offset.begin(), offset.end() - 1);
  for (int e = 0; e < E; ++e) require(plan.host_counts[static_cast<std::size_t>(e)] == counts[static_cast<std::size_t>(e)]);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t want = next[static_cast<std::size_t>(ids[i])]++;
    require(plan.pos[i] == want);
    require(plan.src_row[static_cast<std::size_t>(want)] == static_cast<std::int64_t>(i / static_cast<std::size_t>(k)));
  }
}

template <class Policy>
void check_routing(reader& in, const Policy& policy, int E, int k, std::size_t N) {
  std::vector<float> logits(N * static_cast<std::size_t>(E));
  for (auto& v : logits) v = in.number();
  std::vector<std::int32_t> ids(N * static_cast<std::size_t>(k > 0 ? k : 0));
  std::vector<float> w(ids.size());
  bool any_non_finite = false;
  for (float v : logits) any_non_finite |= !std::isfinite(v);
  try {
    epx::routing::route(policy, epx::exec::serial{}, logits.data(), N, E, k, ids.data(), w.data());
  } catch (const epx::error& e) {
    // Rejections: a bad k, named in the message, or a non-finite logit (errc::input).
    const bool bad_k = k < 1 || k > E;
    if (bad_k)
      require(std::strstr(e.what(), "top_k") != nullptr && e.category() != epx::errc::internal);
    else
      require(e.category() == epx::errc::input && any_non_finite);
    return;
  }
  require(k >= 1 && k <= E && !any_non_finite);
  for (std::size_t t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const std::size_t i = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
      require(ids[i] >= 0 && ids[i] < E);
      require(std::isfinite(w[i]) && w[i] >= 0.0f);
      for (int j2 = 0; j2 < j; ++j2) require(ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j2)] != ids[i]);
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader in{data, size};
  const std::uint8_t what = in.byte() % 4;
  if (what == 0) {
    check_layout(in);
    return 0;
  }
  const int E = 1 + in.byte() % 16;
  const int k = static_cast<int>(in.byte() % 20) - 1;  // -1 .. 18: out-of-range k too
  const std::size_t N = in.byte() % 6;
  if (what == 1) check_routing(in, epx::routing::softmax_topk{(in.byte() & 1) != 0}, E, k, N);
  if (what == 2) check_routing(in, epx::routing::topk_softmax{}, E, k, N);
  if (what == 3) check_routing(in, epx::routing::sigmoid_bias{}, E, k, N);
  return 0;
}
