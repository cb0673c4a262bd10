// MpiCollectives (runtime/mpi/): K ranks under mpirun give the same bits as InProcessCollectives with K
// replicas, for every collective, reduction and grouping (tests/mpi/collectives_worker.cc checks each
// rank's result against the in-process run). Starts mpirun itself (as root: --allow-run-as-root).
#include <catch2/catch.hpp>

#include "tests/cli/cli_util.h"

#include <cstdio>
#include <regex>
#include <string>

namespace {

// Runs `cmd` (sh), returns its exit status and fills `output` with its stdout + stderr.
int Run(const std::string& cmd, std::string* output) {
  const cli_test::Result r = cli_test::Shell(cmd);
  *output = r.output;
  return r.status;
}

}  // namespace

TEST_CASE("K MPI ranks give the in-process collectives' bits", "[mpi]") {
  for (int k : {2, 3, 4}) {
    std::string out;
    const int rc = Run("mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none -np " +
                           std::to_string(k) + " " SS_BINARY_DIR "/mpi_collectives_worker",
                       &out);
    INFO("np " << k << "\n" << out);
    CHECK(rc == 0);
    std::regex line("rank (\\d+) of (\\d+): ok, (\\d+) cases, (\\d+) elements, (\\d+) order-sensitive sums");
    int ok_ranks = 0;
    long order_sensitive = 0;
    for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it) {
      ++ok_ranks;
      CHECK(std::stoi((*it)[2]) == k);
      CHECK(std::stol((*it)[4]) > 10000);
      order_sensitive += std::stol((*it)[5]);
    }
    CHECK(ok_ranks == k);
    // With 3 or more members the order of the sum shows: the bitwise check means something.
    if (k >= 3) CHECK(order_sensitive > 100);
  }
}
