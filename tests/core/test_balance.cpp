// Load-balancing losses and the bias update (spec section 9) against the float64
// reference: the Switch/GShard auxiliary loss (local and global-batch f), DeepSeek-V3's
// sequence-wise loss, the router z-loss, each with its logit gradient, for every logit type
// and execution policy; the reference gradients against finite differences; expert loads;
// the bias update, bitwise equal on every rank after summing the loads over every batch.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"
#include "support/reference.hpp"

// The file's names in a namespace of its own: the tests of a label compile as one unity
// source, where another file may use the same names.
namespace test_balance_cpp {

namespace ref = epx::ref;
namespace routing = epx::routing;

namespace {

std::vector<std::int64_t> load_of(const std::vector<std::int32_t>& ids, int E) {
  std::vector<std::int64_t> l(static_cast<std::size_t>(E), 0);
  for (auto id : ids) ++l[static_cast<std::size_t>(id)];
  return l;
}

template <class T, class Exec>
void check_losses(const Exec& ex, std::size_t N, int E, int k, std::size_t T_len, std::uint64_t seed) {
  CAPTURE(N);
  CAPTURE(E);
  CAPTURE(k);
  const auto ld = ref::round_through<T>(ref::random_logits(N, E, seed));
  const auto lt = ref::from_double<T>(ld);
  const auto ids = ref::uneven_routing(N, E, k, seed);
  const float g = 0.75f;
  const double alpha = 0.01, beta = 0.001;
  std::vector<float> grad(N * E, -7.0f);
  const auto rel = [](double got, double want) { return std::abs(got - want) <= 1e-5 * std::abs(want) + 1e-9; };
  const auto scaled = [&](const std::vector<double>& v) {
    std::vector<double> r(v);
    for (auto& x : r) x *= g;
    return r;
  };

  // Switch/GShard with the local load, and with a "global" load (any other counts).
  auto load = routing::expert_load(ex, ids.data(), N, k, E);
  CHECK(load == load_of(ids, E));
  std::vector<std::int64_t> global = load;
  for (std::size_t e = 0; e < global.size(); ++e) global[e] += static_cast<std::int64_t>(3 * e % 7);
  for (const auto& ld_e : {load, global}) {
    const auto want = ref::aux_loss(ld, N, E, ld_e, alpha);
    const double got = routing::aux_loss(ex, lt.data(), N, E, epx::make_span(ld_e), alpha);
    CHECK_MESSAGE(rel(got, want.loss), "aux_loss " << got << " want " << want.loss);
    routing::aux_loss_backward(ex, lt.data(), N, E, epx::make_span(ld_e), alpha, g, grad.data());
    ref::check_close(grad, scaled(want.grad), 1e-9, 1e-4, "aux_loss gradient");
  }

  // DeepSeek-V3 sequence-wise.
  {
    const auto want = ref::sequence_balance_loss(ld, ids, N, E, k, T_len, alpha);
    const double got = routing::sequence_balance_loss(ex, lt.data(), ids.data(), N, E, k, T_len, alpha);
    CHECK_MESSAGE(rel(got, want.loss), "sequence_balance_loss " << got << " want " << want.loss);
    routing::sequence_balance_loss_backward(ex, lt.data(), ids.data(), N, E, k, T_len, alpha, g, grad.data());
    ref::check_close(grad, scaled(want.grad), 1e-9, 1e-4, "sequence_balance_loss gradient");
  }

  // z-loss.
  {
    const auto want = ref::z_loss(ld, N, E, beta);
    const double got = routing::z_loss(ex, lt.data(), N, E, beta);
    CHECK_MESSAGE(rel(got, want.loss), "z_loss " << got << " want " << want.loss);
    routing::z_loss_backward(ex, lt.data(), N, E, beta, g, grad.data());
    ref::check_close(grad, scaled(want.grad), 1e-9, 1e-4, "z_loss gradient");
  }
}

}  // namespace

TEST_CASE("balance: the reference gradients are the derivatives of the reference losses") {
  const std::size_t N = 6;
  const int E = 5, k = 2;
  const auto l = ref::random_logits(N, E, 3);
  const auto ids = ref::random_routing(N, E, k, 3);
  const auto load = load_of(ids, E);
  const auto fd_check = [&](const std::function<ref::loss_result(const std::vector<double>&)>& f, const char* what) {
    const auto g = ref::finite_difference([&](const std::vector<double>& x) { return f(x).loss; }, l);
    ref::check_close(f(l).grad, g, 1e-8, 1e-5, what);
  };
  // f (the loads, the selections) is a constant of the loss: no gradient flows through it.
  fd_check([&](const std::vector<double>& x) { return ref::aux_loss(x, N, E, load, 0.3); }, "aux");
  fd_check([&](const std::vector<double>& x) { return ref::sequence_balance_loss(x, ids, N, E, k, 3, 0.3); }, "seq");
  fd_check([&](const std::vector<double>& x) { return ref::z_loss(x, N, E, 0.2); }, "z");
}

TEST_CASE_TEMPLATE("balance: losses and gradients against float64 on serial, openmp and emulated_device", T, float,
                   double, epx::bf16, epx::fp16) {
  for (const auto& s : std::vector<std::array<std::size_t, 4>>{{64, 8, 2, 16}, {96, 64, 8, 32}, {7, 3, 1, 7}, {0, 4, 2, 1}}) {
    const auto N = s[0], T_len = s[3];
    const int E = static_cast<int>(s[1]), k = static_cast<int>(s[2]);
    check_losses<T>(epx::exec::serial{}, N, E, k, T_len, 11 + N);
    check_losses<T>(epx::exec::openmp{2}, N, E, k, T_len, 12 + N);
    check_losses<T>(epx::exec::emulated_device{}, N, E, k, T_len, 13 + N);
  }
}

TEST_CASE("balance: expert_load on emulated_device counts every pair of its 256 chunks, a short last one too") {
  // The device counts the pairs in up to 256 chunks of ceil(pairs / 256): pair counts that
  // fill them evenly, leave the last chunk short, or make fewer chunks; a bad id in the last
  // pair is still found there.
  const int E = 5;
  for (const std::size_t pairs : {std::size_t{255}, std::size_t{256}, std::size_t{257}, std::size_t{511},
                                  std::size_t{513}, std::size_t{3003}, std::size_t{4099}}) {
    for (const int k : {1, 3}) {
      if (pairs % static_cast<std::size_t>(k) != 0) continue;
      const std::size_t N = pairs / static_cast<std::size_t>(k);
      CAPTURE(pairs);
      CAPTURE(k);
      std::vector<std::int32_t> ids(pairs);
      for (std::size_t i = 0; i < pairs; ++i) ids[i] = static_cast<std::int32_t>((i * 7 + i / 3) % E);
      CHECK(routing::expert_load(epx::exec::emulated_device{}, ids.data(), N, k, E) == load_of(ids, E));
      ids.back() = E;
      const std::string want = "expert id (" + std::to_string(E) + ") of token " + std::to_string(N - 1) + " slot " +
                               std::to_string(k - 1) + " out of range";
      CHECK_THROWS_WITH_AS(routing::expert_load(epx::exec::emulated_device{}, ids.data(), N, k, E),
                           doctest::Contains(want.c_str()), epx::error);
    }
  }
}

TEST_CASE("balance: the bias update follows sign(mean load - load), sign(0) = 0") {
  const std::vector<std::int64_t> load = {10, 2, 6, 6, 0, 12};  // mean 6
  const auto want = ref::bias_update_signs(load);
  CHECK(routing::bias_signs(epx::make_span(load)) == want);
  CHECK(want == std::vector<int>{-1, 1, 0, 0, 1, -1});
  // A mean that is not an integer: 7 / 3.
  const std::vector<std::int64_t> odd = {3, 2, 2};
  CHECK(routing::bias_signs(epx::make_span(odd)) == ref::bias_update_signs(odd));
  std::vector<float> bias = {0.1f, -0.2f, 0.3f, 0.0f, 1e-3f, -1.0f};
  const std::vector<float> before = bias;
  routing::update_bias(epx::exec::emulated_device{}, bias.data(), epx::make_span(load), 1e-3f);
  for (std::size_t e = 0; e < bias.size(); ++e)
    CHECK(bias[e] == before[e] + 1e-3f * static_cast<float>(want[e]));
}

TEST_CASE("balance: loads summed over every batch give a bias that is bitwise equal on every rank") {
  // 16 ranks: tp=2, fsdp=2, dp_replicate=2, pp=2 (4 batches per stage; TP ranks share one).
  epx::mesh_config mc;
  mc.tp = 2;
  mc.fsdp = 2;
  mc.dp_replicate = 2;
  mc.pp = 2;
  mc.ep = 2;
  mc.experts = 8;
  const epx::mesh m(mc);
  const int E = 8, k = 2, steps = 5;
  const std::size_t N = 24;
  const auto ids_of = [&](int b, int step) {
    return ref::uneven_routing(N, E, k, 1000 + static_cast<std::uint64_t>(b) * 10 + static_cast<std::uint64_t>(step));
  };
  using comm_t = epx::threads::communicator;
  std::vector<std::vector<float>> biases(16);
  std::vector<std::string> failures(16);
  epx::threads::run(16, [&](comm_t& world) {
    auto batches = routing::batch_communicator(world, m);
    std::string& f = failures[static_cast<std::size_t>(world.rank())];
    if (batches.size() != m.batches()) f += "the batch communicator does not hold one rank per batch\n";
    std::vector<float> bias(static_cast<std::size_t>(E), 0.0f);
    for (int step = 0; step < steps; ++step) {
      const auto ids = ids_of(m.batch(world.rank()), step);
      auto load = routing::expert_load(epx::exec::serial{}, ids.data(), N, k, E);
      routing::sum_over_batches(batches, epx::make_span(load));
      std::vector<std::int64_t> want(static_cast<std::size_t>(E), 0);
      for (int b = 0; b < m.batches(); ++b)
        for (auto id : ids_of(b, step)) ++want[static_cast<std::size_t>(id)];
      if (load != want) f += "sum_over_batches differs from the sum over the batches\n";
      routing::update_bias(epx::exec::serial{}, bias.data(), epx::make_span(load), 0.01f);
    }
    biases[static_cast<std::size_t>(world.rank())] = bias;
  });
  for (const auto& f : failures) CHECK_MESSAGE(f.empty(), f);
  for (int r = 1; r < 16; ++r)
    CHECK(std::memcmp(biases[0].data(), biases[static_cast<std::size_t>(r)].data(), E * sizeof(float)) == 0);
}

TEST_CASE("balance: a token whose sigmoids all underflow gives a finite sequence loss and zero gradient") {
  // Every float32 sigmoid of token 0 is 0 below about -104: S_t = 1e-20, not 0.
  const epx::exec::serial ex;
  const std::size_t N = 4;
  const int E = 4, k = 2, T_len = 2;
  std::vector<float> l = {-110.0f, -111.0f, -112.0f, -113.0f, 0.5f, -0.5f, 1.0f, 0.0f,
                          0.25f,   -1.0f,   2.0f,    -2.0f,   0.0f, 0.1f,  0.2f, 0.3f};
  const std::vector<std::int32_t> ids = {0, 1, 2, 0, 1, 3, 2, 3};
  const double loss = routing::sequence_balance_loss(ex, l.data(), ids.data(), N, E, k, T_len, 0.1);
  CHECK(std::isfinite(loss));
  std::vector<float> grad(N * E, -1.0f);
  routing::sequence_balance_loss_backward(ex, l.data(), ids.data(), N, E, k, T_len, 0.1, 1.0, grad.data());
  for (float g : grad) CHECK(std::isfinite(g));
  for (int e = 0; e < E; ++e) CHECK(grad[static_cast<std::size_t>(e)] == 0.0f);  // s (1 - s) = 0
  // The other sequence is what it is without token 0's: the second half alone.
  const double second = routing::sequence_balance_loss(ex, l.data() + 2 * E, ids.data() + 2 * k, 2, E, k, T_len, 0.1);
  CHECK(std::isfinite(second));
  CHECK(loss >= second / 2 - 1e-12);
}

TEST_CASE("balance: sequence loss counts an expert a token selects twice once") {
  // Given ids may repeat an expert within a token; f_e counts tokens that select e.
  const std::size_t N = 6, T_len = 3;
  const int E = 5, k = 3;
  const auto ld = ref::round_through<float>(ref::random_logits(N, E, 41));
  const auto lt = ref::from_double<float>(ld);
  const std::vector<std::int32_t> ids = {1, 1, 2, 0, 3, 0, 4, 4, 4, 2, 2, 1, 3, 0, 3, 1, 1, 1};
  const double alpha = 0.2;
  const auto want = ref::sequence_balance_loss(ld, ids, N, E, k, T_len, alpha);
  const auto check = [&](const auto& ex, const char* what) {
    const std::string policy = what;
    CAPTURE(policy);
    const double got = routing::sequence_balance_loss(ex, lt.data(), ids.data(), N, E, k, T_len, alpha);
    CHECK(std::abs(got - want.loss) <= 1e-5 * std::abs(want.loss));
    std::vector<float> grad(N * static_cast<std::size_t>(E), -7.0f);
    routing::sequence_balance_loss_backward(ex, lt.data(), ids.data(), N, E, k, T_len, alpha, 1.0, grad.data());
    ref::check_close(grad, want.grad, 1e-9, 1e-4, "sequence_balance_loss gradient");
  };
  check(epx::exec::serial{}, "serial");
  check(epx::exec::openmp{2}, "openmp");
  check(epx::exec::emulated_device{}, "emulated_device");
}

TEST_CASE("balance: bad inputs and parameters") {
  const epx::exec::serial ex;
  std::vector<float> l(12, 0.5f), g(12);
  std::vector<std::int32_t> ids = {0, 1, 2, 3, 0, 1};
  const std::vector<std::int64_t> load = {1, 1, 1, 1};
  CHECK_THROWS_WITH_AS(routing::aux_loss(ex, l.data(), 3, 4, epx::span<const std::int64_t>(load.data(), 3), 0.1),
                       doctest::Contains("aux_loss: load holds 3 values, not E = 4"), epx::error);
  CHECK_THROWS_WITH_AS(routing::aux_loss(ex, l.data(), 3, 4, epx::make_span(load), NAN),
                       doctest::Contains("aux_loss: alpha (nan) is not finite"), epx::error);
  CHECK_THROWS_WITH_AS(routing::sequence_balance_loss(ex, l.data(), ids.data(), 3, 4, 2, 2, 0.1),
                       doctest::Contains("N (3) must be a multiple of the sequence length T (2)"), epx::error);
  ids[3] = 9;
  CHECK_THROWS_WITH_AS(routing::sequence_balance_loss(ex, l.data(), ids.data(), 3, 4, 2, 1, 0.1),
                       doctest::Contains("expert id of token 1, slot 1 (9) is out of range"), epx::error);
  CHECK_THROWS_WITH_AS(routing::expert_load(ex, ids.data(), 3, 2, 4),
                       doctest::Contains("expert_load: expert id (9) of token 1 slot 1 out of range [0, 4)"), epx::error);
  l[5] = INFINITY;
  CHECK_THROWS_WITH_AS(routing::z_loss(ex, l.data(), 3, 4, 0.1), doctest::Contains("logit of token 1, expert 1 is not finite"),
                       epx::error);
  std::vector<float> bias(4);
  CHECK_THROWS_WITH_AS(routing::update_bias(ex, bias.data(), epx::make_span(load), INFINITY),
                       doctest::Contains("update_bias: gamma (inf) is not finite"), epx::error);
  // A non-finite gradient of the loss is refused like a non-finite grad_weights of
  // route_backward, before any gradient is written.
  l[5] = 0.5f;
  ids[3] = 3;
  for (const float bad : {NAN, INFINITY, -INFINITY}) {
    g.assign(12, -7.0f);
    CHECK_THROWS_WITH_AS(routing::aux_loss_backward(ex, l.data(), 3, 4, epx::make_span(load), 0.1, bad, g.data()),
                         doctest::Contains("aux_loss_backward: grad_loss"), epx::error);
    CHECK_THROWS_WITH_AS(
        routing::sequence_balance_loss_backward(ex, l.data(), ids.data(), 3, 4, 2, 1, 0.1, bad, g.data()),
        doctest::Contains("sequence_balance_loss_backward: grad_loss"), epx::error);
    CHECK_THROWS_WITH_AS(routing::z_loss_backward(ex, l.data(), 3, 4, 0.1, bad, g.data()),
                         doctest::Contains("z_loss_backward: grad_loss"), epx::error);
    try {
      routing::z_loss_backward(ex, l.data(), 3, 4, 0.1, bad, g.data());
    } catch (const epx::error& e) {
      CHECK(e.category() == epx::errc::input);
      CHECK(e.message().find("is not finite") != std::string::npos);
    }
    for (float x : g) CHECK(x == -7.0f);
  }
  const std::vector<std::int64_t> negative = {1, -1};
  CHECK_THROWS_WITH_AS(routing::update_bias(ex, bias.data(), epx::make_span(negative), 0.1f),
                       doctest::Contains("load of expert 1 is negative (-1)"), epx::error);
}

TEST_CASE("balance: a missing buffer, E or k below 1 and a negative load are errc::input naming the values") {
  const epx::exec::serial ex;
  std::vector<float> l(12, 0.5f), g(12, -7.0f), bias(4, 0.0f);
  const std::vector<std::int32_t> ids = {0, 1, 2, 3, 0, 1};
  const std::vector<std::int64_t> load = {1, 1, 1, 1};
  const float* no_logits = nullptr;
  // Each call raises errc::input holding `words`.
  const auto input_error = [](auto call, const std::string& words) {
    std::string got = "no error";
    try {
      call();
    } catch (const epx::error& e) {
      got = e.category() == epx::errc::input ? e.message() : std::string("wrong category: ") + e.what();
    }
    CHECK_MESSAGE(got.find(words) != std::string::npos, got, " (wanted: ", words, ")");
  };
  input_error([&] { (void)routing::aux_loss(ex, no_logits, 3, 4, epx::make_span(load), 0.1); },
              "aux_loss: null logits for N = 3 tokens");
  input_error([&] { (void)routing::z_loss(ex, no_logits, 2, 4, 0.1); }, "z_loss: null logits for N = 2 tokens");
  input_error([&] { (void)routing::z_loss(ex, l.data(), 3, 0, 0.1); }, "z_loss: number of experts E (0) must be at least 1");
  input_error([&] { routing::aux_loss_backward(ex, l.data(), 3, 4, epx::make_span(load), 0.1, 1.0f, nullptr); },
              "aux_loss_backward: null grad_logits for N = 3");
  input_error([&] { routing::z_loss_backward(ex, l.data(), 3, 4, 0.1, 1.0f, nullptr); },
              "z_loss_backward: null grad_logits for N = 3");
  input_error([&] { (void)routing::sequence_balance_loss(ex, l.data(), nullptr, 3, 4, 2, 1, 0.1); },
              "sequence_balance_loss: null ids for N = 3 tokens");
  input_error([&] { (void)routing::sequence_balance_loss(ex, l.data(), ids.data(), 3, 4, 5, 1, 0.1); },
              "sequence_balance_loss: top_k (5) must be in [1, E] with E = 4");
  input_error(
      [&] { routing::sequence_balance_loss_backward(ex, l.data(), ids.data(), 3, 4, 0, 1, 0.1, 1.0f, g.data()); },
      "sequence_balance_loss_backward: top_k (0) must be in [1, E] with E = 4");
  input_error([&] { (void)routing::sequence_balance_loss(ex, l.data(), ids.data(), 3, 4, 2, 0, 0.1); },
              "N (3) must be a multiple of the sequence length T (0)");
  const std::vector<std::int64_t> negative = {1, 1, -2, 1};
  input_error([&] { (void)routing::aux_loss(ex, l.data(), 3, 4, epx::make_span(negative), 0.1); },
              "aux_loss: load of expert 2 is negative (-2)");
  input_error([&] { routing::aux_loss_backward(ex, l.data(), 3, 4, epx::make_span(negative), 0.1, 1.0f, g.data()); },
              "aux_loss_backward: load of expert 2 is negative (-2)");
  input_error([&] { (void)routing::expert_load(ex, ids.data(), 3, 2, 0); }, "expert_load: E (0) and k (2) must be at least 1");
  input_error([&] { (void)routing::expert_load(ex, ids.data(), 3, 0, 4); }, "expert_load: E (4) and k (0) must be at least 1");
  input_error([&] { (void)routing::expert_load(ex, static_cast<const std::int32_t*>(nullptr), 3, 2, 4); },
              "expert_load: null ids for N = 3 tokens");
  input_error([&] { routing::update_bias(ex, nullptr, epx::make_span(load), 0.1f); }, "update_bias: null bias for E = 4");
  // No gradient was written by the refused _backward calls.
  for (float x : g) CHECK(x == -7.0f);
  // Zero tokens need no buffers, and no expert needs no bias.
  CHECK(routing::z_loss(ex, no_logits, 0, 4, 0.1) == 0.0);
  CHECK(routing::expert_load(ex, static_cast<const std::int32_t*>(nullptr), 0, 2, 4) == std::vector<std::int64_t>(4, 0));
  routing::update_bias(ex, nullptr, epx::span<const std::int64_t>(), 0.1f);
}

// A finite coefficient whose scaled value is beyond float32's range would make the float32
// coefficient of the gradient infinite: the loss and its _backward refuse it
// (errc::configuration), before any gradient is written; a grad_loss that takes the
// coefficient beyond the range is errc::input.
TEST_CASE("balance: coefficients beyond float32's range") {
  const epx::exec::serial ex;
  const std::vector<float> l(12, 0.5f);
  const std::vector<std::int32_t> ids = {0, 1, 2, 3, 0, 1};
  const std::vector<std::int64_t> load = {1, 2, 2, 1};
  std::vector<float> g(12, -7.0f);
  const auto category = [](auto&& call) {
    try {
      call();
    } catch (const epx::error& e) {
      return e.category();
    }
    return epx::errc::internal;  // did not raise
  };
  for (const double big : {4e38, -4e38, 1e300}) {
    CHECK_THROWS_WITH_AS(routing::aux_loss(ex, l.data(), 3, 4, epx::make_span(load), big),
                         doctest::Contains("aux_loss: alpha ("), epx::error);
    CHECK_THROWS_WITH_AS(routing::aux_loss_backward(ex, l.data(), 3, 4, epx::make_span(load), big, 1.0f, g.data()),
                         doctest::Contains("not finite in float32"), epx::error);
    CHECK_THROWS_WITH_AS(routing::sequence_balance_loss(ex, l.data(), ids.data(), 3, 4, 2, 1, big * 3),
                         doctest::Contains("sequence_balance_loss: alpha ("), epx::error);
    CHECK_THROWS_WITH_AS(
        routing::sequence_balance_loss_backward(ex, l.data(), ids.data(), 3, 4, 2, 1, big * 3, 1.0f, g.data()),
        doctest::Contains("not finite in float32"), epx::error);
    CHECK_THROWS_WITH_AS(routing::z_loss(ex, l.data(), 3, 4, big * 1.5), doctest::Contains("z_loss: beta ("),
                         epx::error);
    CHECK_THROWS_WITH_AS(routing::z_loss_backward(ex, l.data(), 3, 4, big * 1.5, 1.0f, g.data()),
                         doctest::Contains("not finite in float32"), epx::error);
    CHECK(category([&] { routing::z_loss_backward(ex, l.data(), 3, 4, big * 1.5, 0.5f, g.data()); }) ==
          epx::errc::configuration);
  }
  // The message names the coefficient and its scaled value.
  CHECK_THROWS_WITH_AS(routing::aux_loss_backward(ex, l.data(), 3, 4, epx::make_span(load), 3e38, 1.0f, g.data()),
                       doctest::Contains(
                           ": aux_loss_backward: alpha (3e+38) scaled by 4 / 3 is 4e+38, not finite in float32 ["),
                       epx::error);
  // alpha 3e38 with E = 4, N = 3 is refused; with N = 12 tokens (scaled value 1e38) taken.
  const std::vector<float> l12(48, 0.5f);
  std::vector<float> g12(48, -7.0f);
  routing::aux_loss_backward(ex, l12.data(), 12, 4, epx::make_span(load), 3e38, 1.0f, g12.data());
  for (float x : g12) CHECK(std::isfinite(x));
  // A grad_loss that takes a representable coefficient beyond the range: errc::input.
  CHECK(category([&] {
          routing::aux_loss_backward(ex, l12.data(), 12, 4, epx::make_span(load), 3e38, 1e3f, g12.data());
        }) == epx::errc::input);
  CHECK_THROWS_WITH_AS(routing::z_loss_backward(ex, l.data(), 3, 4, 1e30, 1e30f, g.data()),
                       doctest::Contains("z_loss_backward: grad_loss (1e+30) times the scaled beta"), epx::error);
  for (float x : g) CHECK(x == -7.0f);
  // The N = 0 case scales by 1 / 1.
  CHECK(category([&] { routing::z_loss(ex, l.data(), 0, 4, 2e38); }) == epx::errc::configuration);
}

// The z-loss gradient coef * lse * p with a coefficient above 1 (few tokens, a large beta)
// and a logsumexp whose product with the coefficient is beyond float32's range, though
// every gradient is not: p <= 1/2 on each token here, and p = 0 gives 0, not inf * 0.
TEST_CASE("balance: z-loss gradient of extreme finite logits is finite where the float64 one is") {
  const epx::exec::serial ex;
  const float big = 2e38f;
  // Token 0: four logits -2e38 (p = 1/4, lse -2e38); token 1: two logits 2e38 (p = 1/2,
  // lse 2e38) and two far below them (p = 0).
  const std::vector<float> l = {-big, -big, -big, -big, big, big, -big, 0.0f};
  const int N = 2, E = 4;
  const double beta = 2.0, coef = 1.0 * beta * 2.0 / N;  // grad_loss 1: the coefficient is 2
  std::vector<float> grad(8, -7.0f);
  routing::z_loss_backward(ex, l.data(), N, E, beta, 1.0f, grad.data());
  for (int t = 0; t < N; ++t) {
    const float* lt = &l[static_cast<std::size_t>(t * E)];
    const double mx = *std::max_element(lt, lt + E);
    double z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(lt[e] - mx);
    const double lse = mx + std::log(z);
    for (int e = 0; e < E; ++e) {
      const double want = coef * lse * (std::exp(lt[e] - mx) / z);
      const float got = grad[static_cast<std::size_t>(t * E + e)];
      CAPTURE(t);
      CAPTURE(e);
      CAPTURE(got);
      CAPTURE(want);
      REQUIRE(std::isfinite(got));
      CHECK(std::abs(got - want) <= 1e-6 * std::abs(want));
    }
  }
  CHECK(grad[6] == 0.0f);
  CHECK(grad[7] == 0.0f);
}

TEST_CASE("balance: the edge cases worked out by hand: every pair to one expert, no pair, k = E, equal logits") {
  // Each loss and gradient below is worked out from section 9's formulas in the test.
  const epx::exec::serial ex;
  const std::size_t N = 6;
  const int E = 4;
  const double alpha = 0.3, beta = 0.2;
  const auto l = ref::round_through<float>(ref::random_logits(N, E, 77));
  const auto lf = ref::from_double<float>(l);
  std::vector<double> p(N * E), s(N * E);
  for (std::size_t t = 0; t < N; ++t) {
    double z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(l[t * E + e]);
    for (int e = 0; e < E; ++e) {
      p[t * E + e] = std::exp(l[t * E + e]) / z;
      s[t * E + e] = 1.0 / (1.0 + std::exp(-l[t * E + e]));
    }
  }
  std::vector<float> grad(N * E, -7.0f);

  // Every pair to expert 2: f = (0, 0, 1, 0), so L = alpha E P_2 and dL/dl[t, e] =
  // alpha E / N * p[t, 2] (1[e = 2] - p[t, e]).
  const std::vector<std::int64_t> one = {0, 0, static_cast<std::int64_t>(2 * N), 0};
  double P2 = 0;
  for (std::size_t t = 0; t < N; ++t) P2 += p[t * E + 2] / static_cast<double>(N);
  const double aux = routing::aux_loss(ex, lf.data(), N, E, epx::make_span(one), alpha);
  CHECK(std::abs(aux - alpha * E * P2) <= 1e-6 * alpha * E * P2);
  routing::aux_loss_backward(ex, lf.data(), N, E, epx::make_span(one), alpha, 1.0f, grad.data());
  for (std::size_t t = 0; t < N; ++t)
    for (int e = 0; e < E; ++e) {
      const double want = alpha * E / static_cast<double>(N) * p[t * E + 2] * ((e == 2 ? 1.0 : 0.0) - p[t * E + e]);
      CHECK(std::abs(grad[t * E + static_cast<std::size_t>(e)] - want) <= 1e-6 * alpha + 1e-6 * std::abs(want));
    }

  // No pair routed (a load of zeros): f = 0, so L = 0 and the gradient is 0.
  const std::vector<std::int64_t> none(static_cast<std::size_t>(E), 0);
  CHECK(routing::aux_loss(ex, lf.data(), N, E, epx::make_span(none), alpha) == 0.0);
  routing::aux_loss_backward(ex, lf.data(), N, E, epx::make_span(none), alpha, 1.0f, grad.data());
  for (float g : grad) CHECK(g == 0.0f);

  // k = E: every token selects every expert, f'_e = E / (E T) * T = 1, so each token adds
  // sum_e s_e / S_t = 1 (up to the 1e-20 in S_t) and L = alpha; the gradient
  // alpha / N * (1 - sum_e' r_e') * s_e (1 - s_e) / S_t is 0 up to float32 rounding.
  std::vector<std::int32_t> all(N * E);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::int32_t>(i % E);
  const double seq = routing::sequence_balance_loss(ex, lf.data(), all.data(), N, E, E, 3, alpha);
  CHECK(std::abs(seq - alpha) <= 1e-6 * alpha);
  routing::sequence_balance_loss_backward(ex, lf.data(), all.data(), N, E, E, 3, alpha, 1.0f, grad.data());
  for (float g : grad) CHECK(std::abs(g) <= 1e-6 * alpha);
  // One expert per token, the same in the whole sequence (T = 3): f' = (E / T * T = 4, 0, 0,
  // 0) for expert 1, L = alpha * mean over the sequences of 4 * mean_t r[t, 1].
  const std::vector<std::int32_t> same = {1, 1, 1, 1, 1, 1};
  double want_seq = 0;
  for (std::size_t t = 0; t < N; ++t) {
    double S = 0;
    for (int e = 0; e < E; ++e) S += s[t * E + e];
    want_seq += alpha * 4.0 * s[t * E + 1] / S / static_cast<double>(N);
  }
  const double seq1 = routing::sequence_balance_loss(ex, lf.data(), same.data(), N, E, 1, 3, alpha);
  CHECK(std::abs(seq1 - want_seq) <= 1e-6 * want_seq);

  // Equal logits c: lse = c + log E, p = 1 / E, L = beta (c + log E)^2, dL/dl = beta * 2 / N *
  // lse / E.
  const float c = 1.5f;
  const std::vector<float> flat(N * E, c);
  const double lse = c + std::log(static_cast<double>(E));
  CHECK(std::abs(routing::z_loss(ex, flat.data(), N, E, beta) - beta * lse * lse) <= 1e-6 * beta * lse * lse);
  routing::z_loss_backward(ex, flat.data(), N, E, beta, 1.0f, grad.data());
  for (float g : grad) CHECK(std::abs(g - beta * 2.0 / N * lse / E) <= 1e-6 * beta * lse / N);
}

}  // namespace test_balance_cpp
