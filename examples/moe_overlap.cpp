// epx-overlap-example: two micro-batches through the split-phase calls of epx::moe_layer
// (spec section 13), the experts of one running while the other's rows travel.
//
//   epx-overlap-example [--backend threads|mpi] [--ranks 4] [--tokens 1024] [--hidden 1024]
//                       [--experts 8] [--top-k 2] [--work 16] [--repeats 3]
//
// Schedule on every rank, against the fused forward of both micro-batches one after the other:
//
//   main thread:    dispatch(mb0) | dispatch(mb1)        | combine(mb0)        | combine(mb1)
//   worker thread:                | experts(mb0)         | experts(mb1)        |
//
// epx's starts communicate on the thread that calls them (the communicators have no
// progress of their own), so the overlap is the caller's: the experts of one micro-batch
// run on a worker thread over the rows its dispatch left in the handle, while the main
// thread moves the other micro-batch's rows. The printout gives, on rank 0, the intervals
// and how long the experts and the communication were both under way; whether that
// shortens the total depends on free cores (ranks x 2 threads want as many). The last line
// checks that the outputs are bitwise those of the fused forward; the program exits with
// status 1 otherwise (or when the run fails), and with 2 for a command-line error.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/comm/threads.hpp"
#include "epx/epx.hpp"
#ifdef EPX_HAVE_MPI
#include "epx/comm/mpi.hpp"
#endif

namespace {

struct options {
  std::string backend;
  int ranks = 4;
  bool ranks_given = false;  // --ranks: the threads backend's size; under MPI it must be the job's
  std::size_t tokens = 1024, hidden = 1024;
  int experts = 8, top_k = 2, work = 16, repeats = 3;
};

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: epx-overlap-example [--backend threads|mpi] [--ranks N] [--tokens N] [--hidden H] "
               "[--experts E] [--top-k k] [--work W] [--repeats R]\n"
               "--ranks: the threads backend's rank count (default 4); under mpirun the job's size\n");
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
    const std::string v = argv[++i];
    const auto num = [&] {  // decimal digits only (strtoll alone takes leading blanks and a sign)
      const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
      char* end = nullptr;
      errno = 0;
      const long long n = digits ? std::strtoll(v.c_str(), &end, 10) : 0;
      if (!digits || *end != '\0' || errno != 0 || n < 1 || n > (1LL << 24))
        throw std::runtime_error(a + " expects an integer from 1 to 16777216, got '" + v + "'");
      return n;
    };
    if (a == "--backend") {
      if (v != "threads" && v != "mpi") throw std::runtime_error("--backend expects threads or mpi, got '" + v + "'");
      o.backend = v;
    } else if (a == "--ranks") {
      o.ranks = static_cast<int>(num());
      o.ranks_given = true;
    }
    else if (a == "--tokens") o.tokens = static_cast<std::size_t>(num());
    else if (a == "--hidden") o.hidden = static_cast<std::size_t>(num());
    else if (a == "--experts") o.experts = static_cast<int>(num());
    else if (a == "--top-k") o.top_k = static_cast<int>(num());
    else if (a == "--work") o.work = static_cast<int>(num());
    else if (a == "--repeats") o.repeats = static_cast<int>(num());
    else throw std::runtime_error("unknown option " + a);
  }
  return o;
}

// Experts with some arithmetic per element (`work` steps of a damped recurrence towards
// s_e * x, s_e = 1 + e / 16), so that their time is comparable to the communication's.
struct work_experts {
  int work = 16;
  template <class Exec>
  void forward(const Exec&, const epx::expert_rows<const float>& in, float* out) const {
    for (int l = 0; l < in.num_local; ++l) {
      const float s = 1.0f + static_cast<float>(in.first_global_expert + l) / 16.0f;
      const float* x = in.expert(l);
      float* y = out + in.begin(l) * in.hidden;
      for (std::size_t i = 0; i < in.count(l) * in.hidden; ++i) {
        const float target = s * x[i];
        float v = 0.0f;
        for (int r = 0; r < work; ++r) v = 0.5f * v + 0.5f * target;
        y[i] = v;
      }
    }
  }
  template <class Exec>
  void backward(const Exec&, const epx::expert_rows<const float>&, const float*, float*) const {}
};

using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t0, clock_type::time_point t) {
  return std::chrono::duration<double, std::milli>(t - t0).count();
}
struct interval {
  double begin = 0, end = 0;
  double length() const { return end - begin; }
};
double overlap(const interval& a, const interval& b) { return std::max(0.0, std::min(a.end, b.end) - std::max(a.begin, b.begin)); }

struct micro_batch {
  std::vector<float> x, w;
  std::vector<std::int32_t> ids;
};

micro_batch make_batch(const options& o, int rank, int index) {
  micro_batch m;
  std::mt19937 rng(static_cast<unsigned>(1000 * rank + index + 1));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  m.x.resize(o.tokens * o.hidden);
  for (auto& v : m.x) v = u(rng);
  const auto k = static_cast<std::size_t>(o.top_k);
  m.ids.resize(o.tokens * k);
  m.w.resize(o.tokens * k);
  for (std::size_t t = 0; t < o.tokens; ++t)
    for (std::size_t j = 0; j < k; ++j) {
      // k distinct experts per token.
      m.ids[t * k + j] = static_cast<std::int32_t>((rng() % static_cast<unsigned>(o.experts / o.top_k)) * o.top_k + j);
      m.w[t * k + j] = 1.0f / static_cast<float>(k);
    }
  return m;
}

// One EP group of all n ranks.
epx::mesh_config mesh_of(const options& o, int n) {
  epx::mesh_config mc;
  mc.tp = 1;
  mc.fsdp = n;
  mc.ep = n;
  mc.experts = o.experts;
  return mc;
}

// The options against the job's n ranks: the message of a command-line error (exit status
// 2), empty if none. The same on every rank of a job, so every rank returns alike.
std::string usage_error(const options& o, int n, const char* backend) {
  if (o.ranks_given && o.ranks != n)
    return "--ranks " + std::to_string(o.ranks) + " but the " + backend + " job has " + std::to_string(n) + " ranks";
  if (o.experts % n != 0)
    return "--experts (" + std::to_string(o.experts) + ") must be a multiple of the number of ranks (" +
           std::to_string(n) + ")";
  try {
    epx::mesh::validate(mesh_of(o, n));
  } catch (const epx::error& e) {
    return e.message();
  }
  return {};
}

template <class Comm>
int run(Comm& world, const options& o, const char* backend) {
  const int n = world.size();
  if (const std::string bad = usage_error(o, n, backend); !bad.empty()) {  // under MPI: the job's size
    if (world.rank() == 0) {
      std::fprintf(stderr, "epx-overlap-example: %s\n", bad.c_str());
      usage(stderr);
    }
    return 2;
  }
  const epx::mesh m(mesh_of(o, n));
  epx::layer_options lo;
  lo.hidden = o.hidden;
  lo.top_k = o.top_k;
  epx::moe_layer<Comm, float> layer(m, world, lo);
  const work_experts experts{o.work};
  std::vector<micro_batch> mb = {make_batch(o, world.rank(), 0), make_batch(o, world.rank(), 1)};
  const std::size_t NH = o.tokens * o.hidden;
  // split: the overlapped split-phase outputs; solo: mb0 again, its experts run alone.
  std::vector<std::vector<float>> fused(2, std::vector<float>(NH)), split(2, std::vector<float>(NH));
  std::vector<float> solo(NH);
  const auto dispatch = [&](int i) {
    return layer.dispatch(epx::span<const float>(mb[i].x), epx::span<const std::int32_t>(mb[i].ids),
                          epx::span<const float>(mb[i].w), epx::mode::inference);
  };
  const auto run_experts = [&](epx::forward_handle<float>& h) { experts.forward(epx::exec::serial{}, h.inputs(), h.outputs().data()); };

  double best_fused = 1e300, best_split = 1e300;
  float mismatches = 0;
  interval e0, d1, c0, e1, total;
  double experts_alone = 0;
  for (int rep = 0; rep < o.repeats; ++rep) {
    // The fused forward of both micro-batches, one after the other.
    world.barrier();
    auto t0 = clock_type::now();
    for (int i = 0; i < 2; ++i) {
      work_experts e = experts;
      layer.forward(epx::span<const float>(mb[i].x), epx::span<const std::int32_t>(mb[i].ids),
                    epx::span<const float>(mb[i].w), epx::span<float>(fused[i]), e, epx::mode::inference);
    }
    best_fused = std::min(best_fused, ms_since(t0, clock_type::now()));

    // Split phase: experts on a worker thread while the main thread communicates.
    world.barrier();
    t0 = clock_type::now();
    auto h0 = dispatch(0);
    interval ie0, id1, ic0, ie1;
    std::thread worker([&] {
      ie0.begin = ms_since(t0, clock_type::now());
      run_experts(h0);
      ie0.end = ms_since(t0, clock_type::now());
    });
    id1.begin = ms_since(t0, clock_type::now());
    auto h1 = dispatch(1);
    id1.end = ms_since(t0, clock_type::now());
    worker.join();
    worker = std::thread([&] {
      ie1.begin = ms_since(t0, clock_type::now());
      run_experts(h1);
      ie1.end = ms_since(t0, clock_type::now());
    });
    ic0.begin = ms_since(t0, clock_type::now());
    layer.combine_start(h0, h0.outputs(), epx::span<float>(split[0]));
    (void)layer.combine_wait(h0);
    ic0.end = ms_since(t0, clock_type::now());
    worker.join();
    layer.combine(h1, h1.outputs(), epx::span<float>(split[1]));
    const double t = ms_since(t0, clock_type::now());
    if (t < best_split) {
      best_split = t;
      e0 = ie0;
      d1 = id1;
      c0 = ic0;
      e1 = ie1;
      total = {0, t};
    }
    // The experts alone (no communication under way), for scale.
    auto h = dispatch(0);
    t0 = clock_type::now();
    run_experts(h);
    const double alone = ms_since(t0, clock_type::now());
    experts_alone = rep == 0 ? alone : std::min(experts_alone, alone);
    layer.combine(h, h.outputs(), epx::span<float>(solo));
    // Every rank checks its outputs of every repetition; rank 0 reports for all.
    for (int i = 0; i < 2; ++i)
      if (std::memcmp(fused[i].data(), split[i].data(), NH * sizeof(float)) != 0) mismatches += 1;
    if (std::memcmp(fused[0].data(), solo.data(), NH * sizeof(float)) != 0) mismatches += 1;
  }

  epx::all_reduce(world, epx::span<float>(&mismatches, 1));
  if (world.rank() == 0) {
    std::printf("backend %s, %d ranks, %zu tokens x H=%zu per micro-batch, %d experts, top-%d, work %d, best of %d\n",
                backend, n, o.tokens, o.hidden, o.experts, o.top_k, o.work, o.repeats);
    std::printf("the layer's starts communicate on the calling thread; the experts run on a worker thread meanwhile\n");
    std::printf("fused forward of mb0 then mb1:      %8.2f ms\n", best_fused);
    std::printf("split phase, total:                 %8.2f ms\n", total.length());
    std::printf("  experts(mb0) on the worker:       %8.2f .. %8.2f ms\n", e0.begin, e0.end);
    std::printf("  dispatch(mb1) on the main thread: %8.2f .. %8.2f ms  (both under way: %.2f ms)\n", d1.begin, d1.end,
                overlap(e0, d1));
    std::printf("  experts(mb1) on the worker:       %8.2f .. %8.2f ms\n", e1.begin, e1.end);
    std::printf("  combine(mb0) on the main thread:  %8.2f .. %8.2f ms  (both under way: %.2f ms)\n", c0.begin, c0.end,
                overlap(e1, c0));
    std::printf("experts of one micro-batch alone:   %8.2f ms; cores: %u\n", experts_alone,
                std::thread::hardware_concurrency());
    std::printf("check: split-phase outputs %s the fused forward\n",
                mismatches == 0 ? "bitwise equal to" : "DIFFER from");
  }
  return mismatches == 0 ? 0 : 1;
}

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    o = parse(argc, argv);
    if (o.experts % o.top_k != 0) throw std::runtime_error("--experts must be a multiple of --top-k");
    const bool mpi = o.backend == "mpi" || (o.backend.empty() && launched_by_mpirun());
    if (!mpi)  // under MPI, run() checks against the job's size
      if (const std::string bad = usage_error(o, o.ranks, "threads"); !bad.empty()) throw std::runtime_error(bad);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-overlap-example: %s\n", e.what());
    usage(stderr);
    return 2;
  }
  if (o.backend == "mpi" || (o.backend.empty() && launched_by_mpirun())) {
#ifdef EPX_HAVE_MPI
    return epx::mpi::run(argc, argv, [&](epx::mpi::communicator& world) { return run(world, o, "mpi"); });
#else
    std::fprintf(stderr, "epx-overlap-example: this build has no MPI backend; pass --backend threads\n");
    return 2;
#endif
  }
  int status = 1;
  try {
    epx::threads::run(o.ranks, [&](epx::threads::communicator& world) {
      const int s = run(world, o, "threads");
      if (world.rank() == 0) status = s;
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-overlap-example: %s\n", e.what());
    return 1;
  }
  return status;
}
