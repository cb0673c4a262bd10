// The Catch2 main shared by every test executable.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#if defined(__SANITIZE_THREAD__)
#include <tbb/global_control.h>
#endif

int main(int argc, char* argv[]) {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer build (scripts/sanitize): Debian's oneTBB is not instrumented, so TSan cannot see the
  // synchronisation between a parallel_for's caller and TBB's worker threads and would report our kernels' reads
  // of the results as races. With one thread allowed, every parallel_for runs on its calling thread (a replica
  // thread); the replica threads and our collectives, which are what the TSan build checks, are unaffected.
  tbb::global_control one_tbb_thread(tbb::global_control::max_allowed_parallelism, 1);
#endif
  return Catch::Session().run(argc, argv);
}
