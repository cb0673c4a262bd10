// Running a command as one rank of an mpirun job (see the header).
#include "cli/mpi_launch.h"

#include <mpi.h>
#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include "api/session.h"
#include "ir/error.h"
#include "runtime/mpi/hybrid_collectives.h"
#include "runtime/mpi/mpi_collectives.h"
#include "runtime/mpi/mpi_executor.h"

namespace shardstep::cli {

bool UnderMpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

int MpiReplicaCount(const MpiRank& r, int64_t batch, int replicas_flag, const std::string& replica_groups) {
  const int K = r.ranks, T = r.replicas_per_process, n = K * T;
  if (replicas_flag != 1 && replicas_flag != n)
    throw Error(Str("--replicas ", replicas_flag, " does not match the ", K, " ranks (mpirun -np ", K, ") x ", T,
                    " replica(s) per process (--replicas-per-process) = ", n,
                    ": under mpirun the replica count is ranks x --replicas-per-process; leave out --replicas"));
  if (batch % K != 0)
    throw Error(Str("the rank count ", K, " (mpirun -np ", K, ") does not divide --batch ", batch,
                    ": each rank takes an equal share of every global batch"));
  if ((batch / K) % T != 0)
    throw Error(Str("--replicas-per-process ", T, " does not divide the per-process share of the batch (--batch ",
                    batch, " over ", K, " ranks: ", batch / K, " examples per rank)"));
  int a = 0, b = 0;
  char x = 0;
  if (!replica_groups.empty() && std::sscanf(replica_groups.c_str(), "%d%c%d", &a, &x, &b) == 3 && x == 'x' &&
      int64_t{a} * b != n)
    throw Error(Str("--replica-groups ", replica_groups, " makes ", int64_t{a} * b, " replicas but the ", K,
                    " ranks (mpirun -np ", K, ") x ", T, " replica(s) per process (--replicas-per-process) make ", n));
  return n;
}

int RunUnderMpi(int replicas_per_process, double collective_timeout, const std::function<int(const MpiRank&)>& body) {
  runtime::MpiSession session(nullptr, nullptr);
  MpiRank me{session.rank(), session.size(), std::max(1, replicas_per_process), ""};
  auto collectives = std::make_unique<runtime::HybridCollectives>(me.replicas_per_process, collective_timeout);
  runtime::MpiExecutor* executor = nullptr;  // while the Session that owns it lives
  for (const std::string& name : BackendNames())
    RegisterBackend(name, [&, name](const ir::Module& step,
                                    const TensorMap& state) -> std::unique_ptr<runtime::Executor> {
      uint64_t hash = runtime::StepModuleHash(step);
      // Tests simulate a rank running another build: SHARDSTEP_TEST_PERTURB_STEP_HASH=<rank>.
      if (const char* p = std::getenv("SHARDSTEP_TEST_PERTURB_STEP_HASH"); p && std::atoi(p) == me.rank) ++hash;
      runtime::CheckSameStepModule(hash, "the lowered step module");
      if (name != "cpu") throw Error(Str("--backend ", name, " is not supported under mpirun yet (use --backend cpu)"));
      auto e = std::make_unique<runtime::MpiExecutor>(step, state, *collectives);
      executor = e.get();
      return e;
    });

  std::streambuf* saved_cout = nullptr;
  if (me.rank != 0) {
    std::string dir = (std::filesystem::temp_directory_path() / Str("shardstep-rank", me.rank, "-XXXXXX")).string();
    if (!::mkdtemp(dir.data())) throw Error(Str("rank ", me.rank, ": cannot create a temporary directory ", dir));
    me.private_dir = dir;
    saved_cout = std::cout.rdbuf(nullptr);  // progress, logs and metrics come from rank 0
  }
  int rc = 1;
  try {
    rc = body(me);
  } catch (const std::exception& e) {
    const bool started = executor != nullptr;  // the ranks have met in a collective: they may be waiting in one
    // One write: the ranks' lines arrive whole.
    const std::string line = Str("shardstep: error: rank ", me.rank, ": ", e.what(), "\n");
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
    if (started) {
      std::error_code ec;
      if (!me.private_dir.empty()) std::filesystem::remove_all(me.private_dir, ec);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    rc = 1;
  }
  if (saved_cout) std::cout.rdbuf(saved_cout);
  if (!me.private_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(me.private_dir, ec);
  }
  collectives.reset();
  return rc;
}

}  // namespace shardstep::cli
