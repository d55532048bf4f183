// doctest main for tests run under mpiexec (tests/<label>/*_mpi.cpp).
//
// Every rank runs the same test cases. A failed assertion or an escaping exception on any
// rank prints the failure with the rank and aborts the whole job (MPI_Abort): the other
// ranks may be waiting in a collective the failing rank will never enter, so aborting is
// the only way that cannot hang. Ranks other than 0 print only failures.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <mpi.h>

#include <cstdio>
#include <string>

namespace {

int world_rank() {
  int r = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

struct abort_on_failure : doctest::IReporter {
  explicit abort_on_failure(const doctest::ContextOptions&) {}

  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override { name_ = tc.m_name; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException& e) override {
    // A signal is usually mpirun stopping this rank because another one failed first.
    fail(((e.is_crash ? "signal: " : "exception: ") + std::string(e.error_string.c_str())).c_str());
  }
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData& ad) override {
    if (!ad.m_failed) return;
    std::string what = std::string(ad.m_file) + ":" + std::to_string(ad.m_line) + ": " + ad.m_expr;
    if (ad.m_decomp.size() > 0) what += " with expansion " + std::string(ad.m_decomp.c_str());
    if (ad.m_threw) what += " threw " + std::string(ad.m_exception.c_str());
    fail(what.c_str());
  }
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}

 private:
  void fail(const char* what) {
    std::fprintf(stderr, "epx test: rank %d failed test case \"%s\": %s; aborting all ranks\n", world_rank(),
                 name_.c_str(), what);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::string name_;
};

}  // namespace

REGISTER_LISTENER("epx_mpi_abort_on_failure", 1, abort_on_failure);

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  if (world_rank() != 0) {
    ctx.setOption("minimal", true);
    ctx.setOption("no-colors", true);
  }
  int result = ctx.run();
  int finalized = 0;
  MPI_Finalized(&finalized);  // a test of what follows MPI_Finalize made it already
  if (finalized) return result;
  if (!ctx.shouldExit()) {
    int worst = result;
    MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    result = worst;
  }
  MPI_Finalize();
  return result;
}
