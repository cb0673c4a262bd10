// Training over MPI (one replica per rank, MpiCollectives) gives the same bits as the in-process run with
// the same replica count: MLP, 20 steps, Adam replicated and sharded, LAMB sharded, at 2 and 4 ranks
// (tests/mpi/training_worker.cc compares every variable and every step's loss). Starts mpirun itself.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

namespace {

int Run(const std::string& cmd, std::string* output) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, p)) > 0) output->append(buf, got);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

}  // namespace

TEST_CASE("MLP training over 2 and 4 MPI ranks is bitwise the in-process run", "[mpi]") {
  struct Case {
    const char* optimizer;
    const char* shard;
  };
  for (int k : {2, 4})
    for (Case c : {Case{"adam", "off"}, Case{"adam", "on"}, Case{"lamb", "on"}}) {
      std::string out;
      const std::string cmd = "mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none -np " +
                              std::to_string(k) + " " SS_BINARY_DIR "/mpi_training_worker --optimizer " + c.optimizer +
                              " --shard " + c.shard + " --steps 20";
      const int rc = Run(cmd, &out);
      INFO(cmd << "\n" << out);
      CHECK(rc == 0);
      CHECK(out.find("bitwise equal to in-process: " + std::to_string(k) + " ranks, " + c.optimizer + ", shard " +
                     c.shard + ", 20 steps") != std::string::npos);
    }
}
