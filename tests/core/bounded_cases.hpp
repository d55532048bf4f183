// tests/core/bounded_cases.hpp: bounded mode (spec section 11) test bodies, templated over
// the communicator and the execution policy; each runs on one rank and returns the failures
// of that rank as text ("" when everything matched), like core/layer_cases.hpp.
//
// check_bounded_case runs the layer (implementation Impl: the all-to-all path, or the masked
// path on ep == tp) in the normal mode and in bounded mode with bound `cap` (training
// forward, backward, the expert hook, check(), then two inference calls):
//   - with a bound that drops nothing: bitwise equal to the normal mode;
//   - with overflow: bitwise equal to the normal mode with the local capacity rule
//     C = cap (same priority), close to the float64 reference with those drops, and
//     check() reports the EP group's dropped pairs per expert of the reference;
//   - the experts get their row counts in the policy's memory (expert_rows::device_counts):
//     the reference's kept pairs of each local expert over the EP group, in fixed blocks of
//     padded(ep * cap) rows, the rows past a count zero in training calls.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "core/layer_cases.hpp"

namespace epx::test {

// Experts that note what bounded mode hands them, call by call: the offsets, the row
// counts of expert_rows::device_counts (read through the policy; -1 where there are none)
// and whether every row past its count is zero; the work is the inner experts'.
template <class T>
struct count_noting_experts {
  ref::test_linear_experts<T>& inner;
  struct call {
    std::vector<std::size_t> offsets;
    std::vector<std::int64_t> counts;
    bool tail_zero = true;
  };
  std::vector<call> forwards, backwards;

  template <class Exec>
  static call note(const Exec& ex, const expert_rows<const T>& in) {
    call c;
    const auto L = static_cast<std::size_t>(in.num_local);
    c.offsets.assign(in.offsets, in.offsets + L + 1);
    c.counts.assign(L, -1);
    if (in.device_counts != nullptr) detail::to_host(ex, in.device_counts, L, c.counts.data());
    for (std::size_t l = 0; l < L; ++l) {
      const std::size_t from = c.offsets[l] + static_cast<std::size_t>(std::max<std::int64_t>(c.counts[l], 0));
      for (std::size_t i = from * in.hidden; i < c.offsets[l + 1] * in.hidden && c.tail_zero; ++i)
        c.tail_zero = convert<float>(in.rows[i]) == 0.0f;
    }
    return c;
  }
  template <class Exec>
  void forward(const Exec& ex, const expert_rows<const T>& in, T* out) {
    forwards.push_back(note(ex, in));
    inner.forward(ex, in, out);
  }
  template <class Exec>
  void backward(const Exec& ex, const expert_rows<const T>& in, const T* grad_out, T* grad_in) {
    backwards.push_back(note(ex, in));
    inner.backward(ex, in, grad_out, grad_in);
  }
};

template <class Comm, class T, class Exec, class Impl = impl::all_to_all>
std::string check_bounded_case(Comm& world, const layer_case& c, std::int64_t cap, bool expect_drops,
                               Exec policy = {}) {
  std::string f;
  const std::string where = detail::concat(c.describe(), " cap=", cap, " rank ", world.rank());
  try {
    const auto global = ref::linear_experts::random(c.topology.experts, c.hidden, c.seed ^ 0xe9ull);
    // The normal mode with the drops bounded mode makes: local capacity with C = cap.
    layer_case cc = c;
    cc.capacity.mode = capacity_mode::local;
    cc.capacity.rows = cap;
    const auto normal = run_layer<Comm, T, Impl, Exec>(world, expect_drops ? cc : c, global, policy);

    const mesh m(c.topology);
    const int rank = world.rank(), b = m.batch(rank);
    const batch_data d = make_batch<T>(c, b);
    const std::size_t N = c.rows_of(b), H = static_cast<std::size_t>(c.hidden), k = static_cast<std::size_t>(c.top_k);
    layer_options o = options_for(c);
    o.counts = count_exchange::device;
    o.bound.cap = cap;
    moe_layer<Comm, T, Impl, Exec> layer(m, world, o, policy);
    ref::test_linear_experts<T> experts(global, m.ep_rank(rank), m.local_experts());
    count_noting_experts<T> noting{experts, {}, {}};
    const auto x = ref::from_double<T>(d.x);
    const auto go = ref::from_double<T>(d.grad_out);
    std::vector<float> w(d.w.begin(), d.w.end());
    layer_outputs<T> r;
    r.out.assign(N * H, convert<T>(7.0f));
    r.grad_x.assign(N * H, convert<T>(7.0f));
    r.grad_w.assign(N * k, 7.0f);
    auto saved = layer.forward(span<const T>(x), span<const std::int32_t>(d.ids), span<const float>(w),
                               span<T>(r.out), noting, mode::train);
    if (!layer.stats().bounded) f += where + ": stats.bounded is false\n";
    if (std::string(layer.stats().path) != detail::impl_name<typename Impl::template with<Comm>>::value)
      f += where + ": stats.path is " + layer.stats().path + "\n";
    layer.backward(std::move(saved), span<const T>(go), span<T>(r.grad_x), span<float>(r.grad_w), noting);
    gradient_hooks<Comm> hooks(m, world);
    r.expert_grads = experts.grads();
    hooks.reduce_expert(span<double>(r.expert_grads));
    const std::int64_t* counter = layer.overflow_counter();
    if (counter == nullptr) f += where + ": no overflow counter\n";
    const bound_report rep = layer.check();

    if (!bitwise_equal(r.out, normal.out)) f += where + ": out differs bitwise from the normal mode\n";
    if (!bitwise_equal(r.grad_x, normal.grad_x)) f += where + ": grad_x differs bitwise from the normal mode\n";
    if (!bitwise_equal(r.grad_w, normal.grad_w)) f += where + ": grad_weights differ bitwise from the normal mode\n";
    if (!bitwise_equal(r.expert_grads, normal.expert_grads))
      f += where + ": expert grads differ bitwise from the normal mode\n";

    // Against the float64 reference with the local-capacity drops of C = cap.
    const auto e = expect<T>(cc, global, rank);
    const double at = atol_for<T>(), rt = rtol_for<T>();
    append(f, ref::compare(r.out, e.out, at, rt, where + " out"));
    append(f, ref::compare(r.grad_x, e.grad_x, at, rt, where + " grad_x"));
    append(f, ref::compare(r.grad_w, e.grad_w, std::max(2 * at, 1e-5), std::max(rt, 1e-5), where + " grad_weights"));
    append(f, ref::compare(r.expert_grads, e.expert_grads, 2 * at, rt, where + " expert grads after hook"));
    // check(): the group's dropped pairs per expert, one call per rank of the group.
    std::vector<double> got(rep.dropped_per_expert.begin(), rep.dropped_per_expert.end());
    std::vector<double> want(e.dropped_per_expert.begin(), e.dropped_per_expert.end());
    append(f, ref::compare(got, want, 0, 0, where + " check().dropped_per_expert"));
    std::int64_t total = 0;
    for (auto v : e.dropped_per_expert) total += v;
    if (rep.overflow_pairs != total)
      f += detail::concat(where, ": check().overflow_pairs ", rep.overflow_pairs, ", expected ", total, "\n");
    if (rep.calls != m.ep())
      f += detail::concat(where, ": check().calls ", rep.calls, ", expected ", m.ep(), "\n");
    if (expect_drops != (total > 0)) f += detail::concat(where, ": the case drops ", total, " pairs\n");

    // What the experts were handed: the rows of each local expert the reference keeps over
    // the EP group, in blocks of padded(ep * cap) rows at l * block; in training calls the
    // rows past a count are zero (forward) and so are their gradient rows' inputs (backward).
    {
      const std::size_t L = static_cast<std::size_t>(m.local_experts());
      const std::size_t need = static_cast<std::size_t>(m.ep()) * static_cast<std::size_t>(cap) +
                               static_cast<std::size_t>(c.pad.rows_per_expert);
      const std::size_t align = static_cast<std::size_t>(c.pad.align), block = (need + align - 1) / align * align;
      std::vector<std::size_t> offsets(L + 1);
      for (std::size_t l = 0; l <= L; ++l) offsets[l] = l * block;
      const auto check_call = [&](const typename count_noting_experts<T>::call& got, const char* which) {
        if (got.offsets != offsets)
          f += detail::concat(where, ": ", which, ": the experts' offsets are not l * ", block, "\n");
        if (got.counts != e.tokens_per_local_expert) {
          f += detail::concat(where, ": ", which, ": device_counts");
          for (auto v : got.counts) f += detail::concat(" ", v);
          f += ", the reference's kept pairs";
          for (auto v : e.tokens_per_local_expert) f += detail::concat(" ", v);
          f += "\n";
        }
        if (!got.tail_zero) f += detail::concat(where, ": ", which, ": a row past its expert's count is not zero\n");
      };
      if (noting.forwards.size() != 1 || noting.backwards.size() != 1)
        f += detail::concat(where, ": the experts ran ", noting.forwards.size(), " forwards and ",
                            noting.backwards.size(), " backwards\n");
      else {
        check_call(noting.forwards[0], "training forward");
        check_call(noting.backwards[0], "backward");
      }
    }

    // Inference, twice (the layer's buffers are reused), then with experts that run in
    // place (their outputs over their inputs, which the direct route then publishes):
    // bitwise the training forward's out.
    in_place_experts<T> in_place{experts};
    for (int rep_i = 0; rep_i < 3; ++rep_i) {
      std::vector<T> out(N * H, convert<T>(7.0f));
      const span<const T> xs(x);
      const span<const std::int32_t> ids(d.ids);
      const span<const float> ws(w);
      auto s = rep_i < 2 ? layer.forward(xs, ids, ws, span<T>(out), noting, mode::inference)
                         : layer.forward(xs, ids, ws, span<T>(out), in_place, mode::inference);
      if (!s.empty()) f += where + ": inference saved state not empty\n";
      if (!bitwise_equal(out, normal.out))
        f += detail::concat(where, ": inference call ", rep_i, " differs bitwise from the normal mode\n");
    }
    if (in_place.in_place_calls != 1) f += where + ": the experts that run in place did not\n";
    for (std::size_t i = 1; i < noting.forwards.size(); ++i)
      if (noting.forwards[i].counts != e.tokens_per_local_expert)
        f += detail::concat(where, ": inference call ", i - 1, ": device_counts differ from the reference's kept pairs\n");
    const bound_report rep2 = layer.check();
    if (rep2.overflow_pairs != 3 * total)
      f += detail::concat(where, ": second check().overflow_pairs ", rep2.overflow_pairs, ", expected ", 3 * total,
                          "\n");
  } catch (const std::exception& ex) {
    f += where + ": exception: " + ex.what() + "\n";
  }
  return f;
}

}  // namespace epx::test
