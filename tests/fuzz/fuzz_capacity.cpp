// Fuzz target: capacity options, token dropping and node-limited routing from arbitrary
// shapes, options, ids, weights (with many ties) and logits.
//
// Either the options are rejected the way the library promises (errc::configuration for a
// bad capacity or node limit), or the result is checked against an independent model:
//   - the kept pairs of every sender and expert are the first C by position, or by weight
//     (descending, ties to the lower position), C from the local or global rule;
//   - masked path (several senders in one plan): the plan is compacted to the kept pairs
//     in (expert, row, slot) order; all-to-all path (one sender): kept pairs keep their
//     positions, dropped ones get -1;
//   - node-limited routing puts every token's k distinct experts on at most M nodes.
// Anything else aborts.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "epx/impl/limits.hpp"
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
};

// The model: keep[i] over the pairs of `S` consecutive slices of n rows (slice s: rows
// [floor(n s / S), floor(n (s+1) / S))).
std::vector<char> model_keep(const epx::capacity_policy& c, const std::vector<std::int32_t>& ids,
                             const std::vector<float>& w, std::size_t n, int k, int E, int S) {
  std::vector<char> keep(ids.size(), 1);
  if (!c.enabled()) return keep;
  const auto limit = [&](double pairs) {
    return c.rows > 0 ? c.rows : static_cast<std::int64_t>(std::ceil(c.factor * pairs / E));
  };
  std::vector<std::size_t> b(static_cast<std::size_t>(S) + 1);
  for (int s = 0; s <= S; ++s) b[static_cast<std::size_t>(s)] = n * static_cast<std::size_t>(s) / static_cast<std::size_t>(S);
  for (int e = 0; e < E; ++e) {
    std::int64_t before = 0;
    for (int s = 0; s < S; ++s) {
      std::vector<std::size_t> mine;
      for (std::size_t i = b[static_cast<std::size_t>(s)] * k; i < b[static_cast<std::size_t>(s) + 1] * k; ++i)
        if (ids[i] == e) mine.push_back(i);
      std::int64_t C;
      const auto count = static_cast<std::int64_t>(mine.size());
      if (c.mode == epx::capacity_mode::local) {
        C = std::min(count, limit(static_cast<double>((b[static_cast<std::size_t>(s) + 1] - b[static_cast<std::size_t>(s)]) * k)));
      } else {
        C = std::max<std::int64_t>(0, std::min(count, limit(static_cast<double>(n * k)) - before));
        before += count;
      }
      if (c.priority == epx::drop_priority::score)
        std::stable_sort(mine.begin(), mine.end(), [&](std::size_t x, std::size_t y) { return w[x] > w[y]; });
      for (std::size_t r = static_cast<std::size_t>(C); r < mine.size(); ++r) keep[mine[r]] = 0;
    }
  }
  return keep;
}

void check_capacity(reader& in) {
  const std::size_t n = in.byte() % 20;
  const int E = 1 + in.byte() % 9;
  const int k = 1 + in.byte() % std::min(E, 4);
  const int S = 1 + in.byte() % 4;
  epx::capacity_policy c;
  c.mode = static_cast<epx::capacity_mode>(in.byte() % 4);  // 3: invalid
  const std::uint8_t f = in.byte();
  c.factor = f == 0xff ? NAN : f == 0xfe ? -1.0 : f / 32.0;
  c.rows = static_cast<std::int64_t>(in.byte() % 6) - 1;  // -1: invalid
  c.priority = static_cast<epx::drop_priority>(in.byte() % 3);  // 2: invalid
  std::vector<std::int32_t> ids(n * static_cast<std::size_t>(k));
  std::vector<float> w(ids.size());
  for (std::size_t t = 0; t < n; ++t) {
    // k distinct experts per token, from the input.
    std::vector<int> pool(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) pool[static_cast<std::size_t>(e)] = e;
    for (int j = 0; j < k; ++j) {
      const int r = j + in.byte() % (E - j);
      std::swap(pool[static_cast<std::size_t>(j)], pool[static_cast<std::size_t>(r)]);
      ids[t * k + j] = pool[static_cast<std::size_t>(j)];
      const int b = in.byte() % 6;  // ties, negative and zero weights, -0 (a tie with +0)
      w[t * k + j] = b == 5 ? -0.0f : static_cast<float>(b) * 0.25f - 0.5f;
    }
  }
  try {
    c.validate();
  } catch (const epx::error& e) {
    require(e.category() == epx::errc::configuration);
    const int m = static_cast<int>(c.mode), p = static_cast<int>(c.priority);
    require(m > 2 || p > 1 || c.rows < 0 || !(c.factor >= 0.0) ||
            (c.enabled() && c.rows == 0 && c.factor == 0.0));
    return;
  }
  const epx::exec::serial ex;
  const auto want = model_keep(c, ids, w, n, k, E, S);

  // Masked path: S slices in one plan, compacted.
  auto plan = epx::layout::build_plan(ex, ids.data(), w.data(), n, k, E, 1 + in.byte() % 3);
  epx::detail::call_limits lim;
  epx::detail::apply_capacity_masked(c, ex, S, E, k, n, ids.data(), w.data(), plan, lim);
  std::int64_t at = 0;
  for (int e = 0; e < E; ++e)
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == e) {
        if (want[i]) {
          require(plan.pos.data()[i] == at);
          require(plan.src_row.data()[at] == static_cast<std::int64_t>(i / k));
          ++at;
        } else {
          require(plan.pos.data()[i] == -1);
        }
      }
  require(plan.host_offset.back() == at);

  // All-to-all path with one sender (S = 1): kept pairs keep their plan positions.
  if (S == 1 || c.mode == epx::capacity_mode::local) {
    const auto one = model_keep(c, ids, w, n, k, E, 1);
    const auto p0 = epx::layout::build_plan(ex, ids.data(), w.data(), n, k, E);
    const auto before = std::vector<std::int64_t>(p0.pos.data(), p0.pos.data() + ids.size());
    auto p1 = epx::layout::build_plan_counts(ex, ids.data(), w.data(), n, k, E, 1 + in.byte() % 3);
    epx::detail::group_records g;
    g.size = 1;
    g.stride = epx::detail::record_header + static_cast<std::size_t>(E);
    g.data.assign(g.stride, 0);
    g.data[1] = static_cast<std::int64_t>(n);
    std::copy(p1.host_counts.begin(), p1.host_counts.end(), g.data.begin() + epx::detail::record_header);
    epx::detail::call_limits l1;
    epx::detail::scatter_with_capacity(c, ex, g, 0, 1, E, k, ids.data(), w.data(), p1, l1);
    for (int e = 0; e < E; ++e) {
      std::int64_t r = 0;  // rank of the kept pair inside its expert's block
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] != e) continue;
        if (one[i]) {
          require(p1.pos.data()[i] == p1.host_offset[static_cast<std::size_t>(e)] + r);
          ++r;
        } else {
          require(p1.pos.data()[i] == -1);
        }
      }
      if (c.priority == epx::drop_priority::position)
        for (std::size_t i = 0; i < ids.size(); ++i)
          if (ids[i] == e && one[i]) require(p1.pos.data()[i] == before[i]);
    }
  }
}

void check_node_limit(reader& in) {
  const int nodes = 1 + in.byte() % 8;
  const int per = 1 + in.byte() % 4;
  const int E = nodes * per;
  const int M = in.byte() % (nodes + 2);  // nodes + 1: invalid
  const int k = 1 + in.byte() % std::min(E, 8);
  const std::size_t N = in.byte() % 6;
  std::vector<float> l(N * static_cast<std::size_t>(E));
  for (auto& v : l) v = static_cast<float>(static_cast<std::int8_t>(in.byte())) / 16.0f;  // many ties
  std::vector<std::int32_t> ids(N * static_cast<std::size_t>(k));
  std::vector<float> w(ids.size());
  const epx::routing::node_limit nl{nodes, M};
  const int which = in.byte() % 3;
  try {
    if (which == 0) epx::routing::route(epx::routing::softmax_topk{true, nl}, epx::exec::serial{}, l.data(), N, E, k, ids.data(), w.data());
    if (which == 1) epx::routing::route(epx::routing::topk_softmax{nl}, epx::exec::serial{}, l.data(), N, E, k, ids.data(), w.data());
    if (which == 2) {
      epx::routing::sigmoid_bias p;
      p.limit = nl;
      epx::routing::route(p, epx::exec::serial{}, l.data(), N, E, k, ids.data(), w.data());
    }
  } catch (const epx::error& e) {
    require(e.category() == epx::errc::configuration);
    require(M > nodes || (M > 0 && k > M * per));
    return;
  }
  require(M <= nodes && (M == 0 || k <= M * per));
  for (std::size_t t = 0; t < N; ++t) {
    std::vector<char> used(static_cast<std::size_t>(nodes), 0);
    int count = 0;
    for (int j = 0; j < k; ++j) {
      const auto id = ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
      require(id >= 0 && id < E);
      for (int j2 = 0; j2 < j; ++j2) require(ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j2)] != id);
      if (!used[static_cast<std::size_t>(id / per)]) ++count;
      used[static_cast<std::size_t>(id / per)] = 1;
    }
    require(M == 0 || count <= M);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader in{data, size};
  if (in.byte() % 2 == 0)
    check_capacity(in);
  else
    check_node_limit(in);
  return 0;
}
