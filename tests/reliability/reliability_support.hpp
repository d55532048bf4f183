// tests/reliability/reliability_support.hpp: random steps and fault injection for the
// reliability tests (fault injection on the threads and MPI backends, and the soak).
//
// - `random_step` draws one layer step: a valid mesh for 1..8 ranks (tp, fsdp, pp,
//   dp_replicate, ep with every rule of spec section 1), sizes (N per batch including 0
//   and 1, H, E, k), element type, padding, implementation, mode and routing (degenerate
//   ones included). Every rank draws the same step from the same seed.
// - `faulty_comm<Comm>` wraps any communicator and counts this rank's collective calls
//   over all its sub-communicators; a `fault_plan` makes it throw before or after call #i,
//   stall before it, or make the rank leave its function ("vanish") before it.
// - `faulty_experts<T>` wraps the float64-checked linear test experts and throws from the
//   user callback (which runs between the two all-to-alls of forward and backward).
// - `run_rank` runs one step on one rank: layer construction, forward, backward, the
//   expert-gradient hook, and compares everything with the float64 reference. Faults of
//   the input kind (bad id, NaN weight, N or H that disagree) modify this rank's tensors.
//
// Nothing here makes a doctest assertion: ranks report through `rank_result`, the test
// thread checks.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/layer_cases.hpp"
#include "epx/epx.hpp"
#include "support/reference.hpp"

namespace epx::test::rel {

// ---------------------------------------------------------------------------------------
// Random steps
// ---------------------------------------------------------------------------------------

enum class elem { f32, bf16, f64, f16 };
enum class impl_kind { all_to_all, all_reduce, automatic };

inline const char* to_string(elem e) {
  switch (e) {
    case elem::f32: return "float";
    case elem::bf16: return "bf16";
    case elem::f64: return "double";
    case elem::f16: return "fp16";
  }
  return "?";
}
inline const char* to_string(impl_kind i) {
  switch (i) {
    case impl_kind::all_to_all: return "all_to_all";
    case impl_kind::all_reduce: return "all_reduce";
    case impl_kind::automatic: return "automatic";
  }
  return "?";
}

// Every valid mesh (experts = ep, to be scaled) with pp*dp_replicate*fsdp*tp <= max_world.
inline std::vector<mesh_config> valid_meshes(int max_world) {
  std::vector<mesh_config> all;
  for (int tp = 1; tp <= max_world; ++tp)
    for (int fsdp = 1; tp * fsdp <= max_world; ++fsdp)
      for (int pp = 1; tp * fsdp * pp <= max_world; ++pp)
        for (int dp = 1; tp * fsdp * pp * dp <= max_world; ++dp)
          for (int ep = tp; ep <= tp * fsdp; ep += tp) {
            if ((tp * fsdp) % ep != 0) continue;
            mesh_config c;
            c.tp = tp;
            c.fsdp = fsdp;
            c.pp = pp;
            c.dp_replicate = dp;
            c.ep = ep;
            c.experts = ep;
            mesh::validate(c);  // the enumeration must only produce valid meshes
            all.push_back(c);
          }
  return all;
}

inline int world_of(const mesh_config& c) { return c.tp * c.fsdp * c.pp * c.dp_replicate; }

struct step_config {
  layer_case c;                     // topology, k, H, routing, rows per batch, padding, seed
  std::vector<std::size_t> rows;    // [batches]
  elem type = elem::f32;
  impl_kind impl = impl_kind::all_to_all;
  bool inference = false;           // forward only, mode::inference
  bool forward_only = false;        // mode::train forward, no backward (MPI input faults)

  int world() const { return world_of(c.topology); }
  std::string describe() const {
    std::string r = "[";
    for (std::size_t b = 0; b < rows.size(); ++b) r += (b ? "," : "") + std::to_string(rows[b]);
    r += "]";
    return detail::concat(c.describe(), " pp=", c.topology.pp, " N=", r, " type=", to_string(type),
                          " impl=", to_string(impl), inference ? " inference" : " train",
                          forward_only ? " forward-only" : "", " seed=", c.seed);
  }
  // The configuration without the seed and the row counts (for counting distinct ones).
  std::string shape_key() const {
    return detail::concat(c.topology.tp, ",", c.topology.fsdp, ",", c.topology.pp, ",", c.topology.dp_replicate,
                          ",", c.topology.ep, ",", c.topology.experts, ",", c.top_k, ",", c.hidden, ",",
                          static_cast<int>(c.routing), ",", c.pad.rows_per_expert, ",", c.pad.align, ",",
                          static_cast<int>(type), ",", static_cast<int>(impl), ",", inference, ",", c.peer_access,
                          ",", c.indexed_sends);
  }
};

// Draws one step. `meshes` from valid_meshes; `world` restricts to meshes of that size (0: any).
inline step_config random_step(ref::rng& g, const std::vector<mesh_config>& meshes, int world = 0,
                               bool allow_inference = true) {
  std::vector<const mesh_config*> pool;
  for (const auto& m : meshes)
    if (world == 0 || world_of(m) == world) pool.push_back(&m);
  ref::require(!pool.empty(), "random_step: no mesh of the requested world size");
  step_config s;
  s.c.topology = *pool[static_cast<std::size_t>(g.below(static_cast<int>(pool.size())))];
  s.c.topology.experts = s.c.topology.ep * (1 + g.below(3));
  const int E = s.c.topology.experts;
  s.c.top_k = 1 + g.below(std::min(E, 4));
  s.c.hidden = 1 + g.below(12);
  const routing_kind kinds[] = {routing_kind::random, routing_kind::balanced, routing_kind::uneven,
                                routing_kind::one_expert, routing_kind::first_rank_only};
  s.c.routing = kinds[g.below(5)];
  s.c.pad.rows_per_expert = g.below(3);
  const int aligns[] = {1, 1, 2, 4};
  s.c.pad.align = aligns[g.below(4)];
  s.c.seed = g.next() % 1000000007ull;
  const int B = s.c.topology.dp_replicate * s.c.topology.fsdp;
  for (int b = 0; b < B; ++b) {
    const int u = g.below(10);
    s.rows.push_back(u == 0 ? 0 : u == 1 ? 1 : static_cast<std::size_t>(2 + g.below(23)));
  }
  const std::vector<std::size_t> rows = s.rows;
  s.c.rows = [rows](int b) { return rows[static_cast<std::size_t>(b)]; };
  const elem types[] = {elem::f32, elem::f16, elem::bf16, elem::f64};
  s.type = types[g.below(4)];
  const bool masked_ok = s.c.topology.ep == s.c.topology.tp;
  const int im = g.below(3);
  s.impl = im == 1 && !masked_ok ? impl_kind::all_to_all : static_cast<impl_kind>(im);
  s.inference = allow_inference && g.below(6) == 0;
  s.c.peer_access = g.below(4) != 0;  // the direct route where the communicator allows it, else staged
  // Staged sends by index (threads, MPI) three times in four; from the seed, so that the
  // draws above and below stay what they were.
  s.c.indexed_sends = (s.c.seed >> 4) % 4 != 0;
  // One row per destination rank (spec section 14) now and then; the masked path refuses it.
  if (s.impl != impl_kind::all_reduce && g.below(4) == 0) s.c.sends = row_sends::per_rank;
  return s;
}

// ---------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------

enum class fault_kind {
  none,
  throw_before,               // the rank throws right before its collective call #target
  throw_after,                // ... right after it returned
  throw_in_experts_forward,   // the user's experts throw in forward (between the all-to-alls)
  throw_in_experts_backward,  // ... in backward
  vanish,                     // the rank returns from its function instead of entering call #target
  stall,                      // the rank sleeps `stall` before entering call #target
  rows_differ,                // this rank has one more row than its TP group (needs tp > 1)
  hidden_differs,             // this rank passes H + 1 (needs ep > 1: H must agree in the EP group)
  bad_id,                     // an expert id == E in this rank's TP slice
  nan_weight,                 // a NaN routing weight in this rank's TP slice
};

inline const char* to_string(fault_kind f) {
  switch (f) {
    case fault_kind::none: return "none";
    case fault_kind::throw_before: return "throw_before";
    case fault_kind::throw_after: return "throw_after";
    case fault_kind::throw_in_experts_forward: return "throw_in_experts_forward";
    case fault_kind::throw_in_experts_backward: return "throw_in_experts_backward";
    case fault_kind::vanish: return "vanish";
    case fault_kind::stall: return "stall";
    case fault_kind::rows_differ: return "rows_differ";
    case fault_kind::hidden_differs: return "hidden_differs";
    case fault_kind::bad_id: return "bad_id";
    case fault_kind::nan_weight: return "nan_weight";
  }
  return "?";
}

inline bool is_input_fault(fault_kind f) {
  return f == fault_kind::rows_differ || f == fault_kind::hidden_differs || f == fault_kind::bad_id ||
         f == fault_kind::nan_weight;
}

// Which rank fails, how and where (the same on every rank).
struct fault_spec {
  fault_kind kind = fault_kind::none;
  int rank = -1;      // world rank
  long target = 0;    // collective index on that rank (throw_before/after, vanish, stall)
  std::chrono::milliseconds stall{0};
};

// The message of an injected exception.
inline std::string injected_message(int rank, const char* where, const std::string& what) {
  return detail::concat("injected fault on world rank ", rank, " ", where, " ", what);
}

// Thrown by faulty_comm to make a rank leave its function without an error.
struct vanish_signal {};

// One rank's fault state, shared by all its wrapped communicators.
struct fault_plan {
  int rank = 0;  // world rank
  fault_kind kind = fault_kind::none;
  long target = -1;
  std::chrono::milliseconds stall{0};
  long calls = 0;        // collective calls made so far (split included)
  bool fired = false;
  const char* phase = "setup";
  std::string last_op;
};

// The optional parts of the communicator concept, forwarded when `Comm` has them: the
// native segmented all-to-all, the sends by index and peer access (the layer's direct
// route), each counted as one collective call like the others.
template <class Derived, class Comm, bool = has_peer_access_v<Comm>>
struct faulty_peer_access {};
template <class Derived, class Comm>
struct faulty_peer_access<Derived, Comm, true> {
  using peer_pointers = typename Comm::peer_pointers;
  template <class F>
  void access_peers(const void* const* mine, const std::size_t* bytes, std::size_t count, F&& f) {
    auto& self = static_cast<Derived&>(*this);
    self.before("access_peers");
    self.inner_->access_peers(mine, bytes, count, std::forward<F>(f));
    self.after("access_peers");
  }
  bool peer_access_available() { return epx::peer_access_available(*static_cast<Derived&>(*this).inner_); }
  // Peer memory (MPI), forwarded as one more collective call.
  template <class C = Comm, std::enable_if_t<epx::has_peer_memory_v<C>, int> = 0>
  void* peer_memory(std::size_t bytes) {
    auto& self = static_cast<Derived&>(*this);
    self.before("peer_memory");
    void* p = self.inner_->peer_memory(bytes);
    self.after("peer_memory");
    return p;
  }
  template <class C = Comm, std::enable_if_t<epx::has_peer_buffer_v<C>, int> = 0>
  std::shared_ptr<void> peer_buffer(std::size_t bytes) {
    auto& self = static_cast<Derived&>(*this);
    self.before("peer_buffer");
    auto p = self.inner_->peer_buffer(bytes);
    self.after("peer_buffer");
    return p;
  }
};

// A communicator that forwards to `Comm` and injects the fault of its plan.
template <class Comm>
class faulty_comm : public faulty_peer_access<faulty_comm<Comm>, Comm> {
  friend struct faulty_peer_access<faulty_comm<Comm>, Comm>;

 public:
  faulty_comm(std::shared_ptr<Comm> inner, std::shared_ptr<fault_plan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}
  // Wraps `world` without owning it.
  static faulty_comm wrap(Comm& world, std::shared_ptr<fault_plan> plan) {
    return faulty_comm(std::shared_ptr<Comm>(std::shared_ptr<Comm>{}, &world), std::move(plan));
  }

  int rank() const noexcept { return inner_->rank(); }
  int size() const noexcept { return inner_->size(); }

  faulty_comm split(int color, int key) const {
    before("split");
    faulty_comm r(std::make_shared<Comm>(inner_->split(color, key)), plan_);
    after("split");
    return r;
  }
  void all_to_all(const void* s, void* r, std::size_t n, datatype t) {
    before("all_to_all");
    inner_->all_to_all(s, r, n, t);
    after("all_to_all");
  }
  void all_to_allv(const void* s, const std::size_t* sc, const std::size_t* sd, void* r, const std::size_t* rc,
                   const std::size_t* rd, datatype t) {
    before("all_to_allv");
    inner_->all_to_allv(s, sc, sd, r, rc, rd, t);
    after("all_to_allv");
  }
  template <class C = Comm, class = std::enable_if_t<detail::has_native_segments<C>::value>>
  void all_to_allv_segments(const void* s, const std::size_t* sc, const std::size_t* sd, void* r,
                            const std::size_t* rc, const std::size_t* rd, std::size_t nseg, datatype t) {
    before("all_to_allv_segments");
    inner_->all_to_allv_segments(s, sc, sd, r, rc, rd, nseg, t);
    after("all_to_allv_segments");
  }
  template <class C = Comm, class = std::enable_if_t<has_indexed_sends_v<C>>>
  void all_to_allv_indexed(const void* src, const std::int64_t* rows, std::size_t row_elems, const std::size_t* sc,
                           const std::size_t* sd, void* r, const std::size_t* rc, const std::size_t* rd,
                           std::size_t nseg, datatype t) {
    before("all_to_allv_indexed");
    inner_->all_to_allv_indexed(src, rows, row_elems, sc, sd, r, rc, rd, nseg, t);
    after("all_to_allv_indexed");
  }
  void all_reduce(const void* s, void* r, std::size_t n, datatype t, double scale) {
    before("all_reduce");
    inner_->all_reduce(s, r, n, t, scale);
    after("all_reduce");
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, datatype t, double scale) {
    before("reduce_scatter");
    inner_->reduce_scatter(s, r, n, t, scale);
    after("reduce_scatter");
  }
  void all_gather(const void* s, void* r, std::size_t n, datatype t) {
    before("all_gather");
    inner_->all_gather(s, r, n, t);
    after("all_gather");
  }
  void broadcast(void* d, std::size_t n, datatype t, int root) {
    before("broadcast");
    inner_->broadcast(d, n, t, root);
    after("broadcast");
  }
  void barrier() {
    before("barrier");
    inner_->barrier();
    after("barrier");
  }

 private:
  std::string where(const char* op) const {
    return detail::concat(op, " #", plan_->calls, " (", plan_->phase, ")");
  }
  void before(const char* op) const {
    fault_plan& p = *plan_;
    p.last_op = op;
    if (p.calls != p.target || p.fired) return;
    switch (p.kind) {
      case fault_kind::throw_before:
        p.fired = true;
        throw error(errc::input, injected_message(p.rank, "before", where(op)));
      case fault_kind::vanish:
        p.fired = true;
        throw vanish_signal{};
      case fault_kind::stall:
        p.fired = true;
        std::this_thread::sleep_for(p.stall);
        break;
      default: break;
    }
  }
  void after(const char* op) const {
    fault_plan& p = *plan_;
    const bool hit = p.calls == p.target && !p.fired && p.kind == fault_kind::throw_after;
    if (hit) {
      p.fired = true;
      const std::string w = where(op);
      ++p.calls;
      throw error(errc::input, injected_message(p.rank, "after", w));
    }
    ++p.calls;
  }

  std::shared_ptr<Comm> inner_;
  std::shared_ptr<fault_plan> plan_;
};

// The linear test experts, throwing from the user callback when the plan says so.
template <class T>
class faulty_experts {
 public:
  faulty_experts(ref::test_linear_experts<T>& inner, fault_plan& plan) : inner_(inner), plan_(plan) {}

  template <class Exec, class Rows>
  void forward(const Exec& ex, const Rows& in, T* out) {
    if (plan_.kind == fault_kind::throw_in_experts_forward && !plan_.fired) {
      plan_.fired = true;
      throw error(errc::input, injected_message(plan_.rank, "in", "the experts forward callback"));
    }
    inner_.forward(ex, in, out);
  }
  template <class Exec, class Rows>
  void backward(const Exec& ex, const Rows& in, const T* grad_out, T* grad_in) {
    if (plan_.kind == fault_kind::throw_in_experts_backward && !plan_.fired) {
      plan_.fired = true;
      throw error(errc::input, injected_message(plan_.rank, "in", "the experts backward callback"));
    }
    inner_.backward(ex, in, grad_out, grad_in);
  }

 private:
  ref::test_linear_experts<T>& inner_;
  fault_plan& plan_;
};

// ---------------------------------------------------------------------------------------
// One step on one rank
// ---------------------------------------------------------------------------------------

struct rank_result {
  bool done = false;       // the rank reached the end of the step
  bool vanished = false;   // it left its function on purpose
  bool thrown = false;     // an epx::error escaped the layer
  errc category = errc::internal;
  std::string message;     // e.what()
  std::string other;       // a non-epx exception, if any
  std::string mismatches;  // comparison failures against the float64 reference ("" if none)
  long calls = 0;          // collective calls this rank made
  bool fired = false;      // this rank's fault was injected
};

namespace detail_rel {

template <class T>
double grad_w_atol() { return std::max(2 * atol_for<T>(), 1e-5); }

// Compares this rank's results with the float64 reference.
template <class T>
std::string compare_step(const step_config& s, const ref::linear_experts& global, int rank, const std::vector<T>& out,
                         const std::vector<T>& gx, const std::vector<float>& gw, const std::vector<double>& eg) {
  std::string f;
  const auto e = expect<T>(s.c, global, rank);
  const double at = atol_for<T>(), rt = rtol_for<T>();
  const std::string where = detail::concat(s.describe(), " rank ", rank);
  append(f, ref::compare(out, e.out, at, rt, where + " out"));
  if (s.inference || s.forward_only) return f;
  append(f, ref::compare(gx, e.grad_x, at, rt, where + " grad_x"));
  append(f, ref::compare(gw, e.grad_w, grad_w_atol<T>(), std::max(rt, 1e-5), where + " grad_weights"));
  append(f, ref::compare(eg, e.expert_grads, 2 * at, rt, where + " expert grads after hook"));
  return f;
}

}  // namespace detail_rel

// Runs step `s` on this rank of `raw_world` with fault `f` (none for a clean step).
// On an epx::error the rank records it and rethrows it (so that the run fails everywhere,
// as a training step would); `vanish` makes it return quietly. A clean step ends with a
// barrier on `raw_world` (outside the fault wrapper) and fills `res.mismatches`.
template <class Comm, class T, class Impl>
void run_rank_typed(Comm& raw_world, const step_config& s, const fault_spec& f, rank_result& res) {
  const mesh m(s.c.topology);
  const int rank = raw_world.rank();
  const bool me = f.rank == rank;
  auto plan = std::make_shared<fault_plan>();
  plan->rank = rank;
  if (me) {
    plan->kind = f.kind;
    plan->target = f.target;
    plan->stall = f.stall;
  }
  using fcomm = faulty_comm<Comm>;
  fcomm world = fcomm::wrap(raw_world, plan);

  const int b = m.batch(rank);
  const batch_data d = make_batch<T>(s.c, b);
  const std::size_t N = s.c.rows_of(b);
  std::size_t H = static_cast<std::size_t>(s.c.hidden);
  const std::size_t k = static_cast<std::size_t>(s.c.top_k);
  const auto global = ref::linear_experts::random(s.c.topology.experts, s.c.hidden, s.c.seed ^ 0xe9ull);
  ref::test_linear_experts<T> linear(global, m.ep_rank(rank), m.local_experts());
  faulty_experts<T> experts(linear, *plan);

  std::vector<T> x = ref::from_double<T>(d.x);
  std::vector<std::int32_t> ids = d.ids;
  std::vector<float> w(d.w.begin(), d.w.end());
  std::vector<T> go = ref::from_double<T>(d.grad_out);
  std::size_t rows = N;
  if (me && is_input_fault(f.kind)) {
    // Ids and weights are checked by the rank whose TP slice holds them.
    const auto sl = slice_bounds(N, m.tp(), m.coords(rank).tp);
    const std::size_t at = (sl.begin + sl.size() / 2) * k;
    switch (f.kind) {
      case fault_kind::bad_id:
        if (!sl.empty()) { ids[at] = s.c.topology.experts; plan->fired = true; }
        break;
      case fault_kind::nan_weight:
        if (!sl.empty()) { w[at] = std::nanf(""); plan->fired = true; }
        break;
      case fault_kind::rows_differ:
        rows = N + 1;
        x.resize(rows * H, convert<T>(0.25f));
        for (std::size_t j = 0; j < k; ++j) {
          ids.push_back(static_cast<std::int32_t>(j));
          w.push_back(0.5f);
        }
        plan->fired = true;
        break;
      case fault_kind::hidden_differs:
        H += 1;
        x.assign(rows * H, convert<T>(0.5f));
        plan->fired = true;
        break;
      default: break;
    }
  }
  std::vector<T> out(rows * H, convert<T>(7.0f));  // garbage: the layer must write everything
  std::vector<T> gx(rows * H, convert<T>(7.0f));
  std::vector<float> gw(rows * k, 7.0f);
  std::vector<double> eg;

  layer_options o;
  o.hidden = H;
  o.top_k = s.c.top_k;
  o.pad = s.c.pad;
  o.peer_access = s.c.peer_access;
  o.indexed_sends = s.c.indexed_sends;
  o.sends = s.c.sends;
  try {
    plan->phase = "construction";
    moe_layer<fcomm, T, Impl, test_exec> layer(m, world, o);
    plan->phase = "forward";
    auto saved = layer.forward(span<const T>(x), span<const std::int32_t>(ids), span<const float>(w), span<T>(out),
                               experts, s.inference ? mode::inference : mode::train);
    if (!s.inference && !s.forward_only) {
      plan->phase = "backward";
      layer.backward(std::move(saved), span<const T>(go), span<T>(gx), span<float>(gw), experts);
      plan->phase = "hook";
      gradient_hooks<fcomm> hooks(m, world);
      eg = linear.grads();
      hooks.reduce_expert(span<double>(eg));
    }
    plan->phase = "done";
  } catch (const vanish_signal&) {
    res.vanished = true;
    res.calls = plan->calls;
    res.fired = plan->fired;
    return;
  } catch (const error& e) {
    res.thrown = true;
    res.category = e.category();
    res.message = e.what();
    res.calls = plan->calls;
    res.fired = plan->fired;
    throw;
  } catch (const std::exception& e) {
    res.other = e.what();
    res.calls = plan->calls;
    res.fired = plan->fired;
    throw;
  }
  res.calls = plan->calls;
  res.fired = plan->fired;
  if (f.kind == fault_kind::none) {
    try {
      res.mismatches = detail_rel::compare_step<T>(s, global, rank, out, gx, gw, eg);
    } catch (const std::exception& e) {
      res.mismatches = detail::concat(s.describe(), " rank ", rank, ": reference failed: ", e.what());
    }
  }
  try {
    raw_world.barrier();  // the end of the step, on the unwrapped communicator
  } catch (const error& e) {
    res.thrown = true;
    res.category = e.category();
    res.message = e.what();
    throw;
  }
  res.done = true;
}

template <class Comm, class T>
void run_rank_impl(Comm& w, const step_config& s, const fault_spec& f, rank_result& r) {
  switch (s.impl) {
    case impl_kind::all_to_all: return run_rank_typed<Comm, T, impl::all_to_all>(w, s, f, r);
    case impl_kind::all_reduce: return run_rank_typed<Comm, T, impl::all_reduce>(w, s, f, r);
    case impl_kind::automatic: return run_rank_typed<Comm, T, impl::automatic>(w, s, f, r);
  }
}

// One step on this rank, dispatched on the element type and the implementation.
template <class Comm>
void run_rank(Comm& w, const step_config& s, const fault_spec& f, rank_result& r) {
  switch (s.type) {
    case elem::f32: return run_rank_impl<Comm, float>(w, s, f, r);
    case elem::bf16: return run_rank_impl<Comm, bf16>(w, s, f, r);
    case elem::f64: return run_rank_impl<Comm, double>(w, s, f, r);
    case elem::f16: return run_rank_impl<Comm, fp16>(w, s, f, r);
  }
}

// Whether `message` names world rank `r`: "world rank r)" inside a sub-communicator,
// "rank r" followed by a non-digit otherwise.
inline bool names_rank(const std::string& message, int r) {
  if (message.find(detail::concat("world rank ", r, ")")) != std::string::npos) return true;
  const std::string key = detail::concat("rank ", r);
  for (std::size_t p = message.find(key); p != std::string::npos; p = message.find(key, p + 1)) {
    const std::size_t e = p + key.size();
    const bool digit_after = e < message.size() && message[e] >= '0' && message[e] <= '9';
    const bool world_before = p >= 6 && message.compare(p - 6, 6, "world ") == 0;
    if (!digit_after && !world_before) return true;
  }
  return false;
}

// A size from the environment (unset or unparsable: `fallback`).
inline long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long r = std::strtol(v, &end, 10);
  return end != v && r >= 0 ? r : fallback;
}

}  // namespace epx::test::rel
