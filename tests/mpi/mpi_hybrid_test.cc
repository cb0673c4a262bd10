// K MPI ranks x T replica threads per rank (runtime::MpiExecutor over HybridCollectives) give the same bits
// as the in-process run with K*T replicas: 2 ranks x 2 threads vs 4 replicas, MLP, 20 steps, Adam sharded
// (and LAMB sharded), every step's loss and every variable (tests/mpi/training_worker.cc compares).
// Starts mpirun itself.
#include <catch2/catch.hpp>

#include <regex>
#include <string>
#include <utility>

#include "tests/cli/cli_util.h"

TEST_CASE("2 ranks x 2 replica threads are bitwise the in-process run with 4 replicas", "[mpi]") {
  for (const char* optimizer : {"adam", "lamb"}) {
    const std::string cmd = std::string("timeout 60 mpirun --allow-run-as-root --oversubscribe --mca "
                                        "btl_vader_single_copy_mechanism none -np 2 " SS_BINARY_DIR
                                        "/mpi_training_worker --model mlp --shard on --steps 20 "
                                        "--replicas-per-process 2 --optimizer ") + optimizer;
    const cli_test::Result r = cli_test::Shell(cmd);
    INFO(cmd << "\n" << r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find(std::string("bitwise equal to in-process: 2 ranks x 2 replicas, mlp, ") + optimizer +
                        ", shard on, 20 steps") != std::string::npos);
    CHECK(r.output.find("MISMATCH") == std::string::npos);
  }
}

// Every collective, reduction and grouping (whole, pairs, interleaved halves; groups within a rank and across
// ranks) of HybridCollectives against InProcessCollectives with ranks x T replicas
// (tests/mpi/collectives_worker.cc --replicas-per-process T).
TEST_CASE("HybridCollectives give the in-process collectives' bits", "[mpi]") {
  for (auto [ranks, per_process] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 2}}) {
    const std::string cmd = "timeout 60 mpirun --allow-run-as-root --oversubscribe --mca "
                            "btl_vader_single_copy_mechanism none -np " + std::to_string(ranks) +
                            " " SS_BINARY_DIR "/mpi_collectives_worker "
                            "--replicas-per-process " + std::to_string(per_process);
    const cli_test::Result r = cli_test::Shell(cmd);
    INFO(cmd << "\n" << r.output);
    CHECK(r.status == 0);
    std::regex line("rank (\\d+) of (\\d+): ok, (\\d+) cases, (\\d+) elements, (\\d+) order-sensitive sums");
    int ok_ranks = 0;
    long order_sensitive = 0;
    for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it) {
      ++ok_ranks;
      CHECK(std::stoi((*it)[2]) == ranks);
      CHECK(std::stol((*it)[3]) > 100);
      order_sensitive += std::stol((*it)[5]);
    }
    CHECK(ok_ranks == ranks);
    CHECK(order_sensitive > 100);  // the order of the sums shows in the bits: the check means something
  }
}
