// `mpirun -np K shardstep train ... [--replicas-per-process T]`: the command runs as one rank of K, with
// T replica threads (global replica = rank * T + t; K*T replicas in all, the same bits as `--replicas K*T`
// in one process). Detected by OpenMPI's environment (OMPI_COMM_WORLD_SIZE); without it nothing here runs
// and MPI is never initialised.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace shardstep::cli {

// Under mpirun (OpenMPI sets OMPI_COMM_WORLD_SIZE in every rank's environment)?
bool UnderMpirun();

struct MpiRank {
  int rank = 0, ranks = 1, replicas_per_process = 1;
  // Rank != 0: a private temporary directory for the outputs only rank 0 keeps (removed at the end).
  std::string private_dir;
};

// The replica count of the run (ranks x T) after checking that the layout fits --batch, --replicas and
// --replica-groups ("" if none); the errors name the flag and value.
int MpiReplicaCount(const MpiRank& r, int64_t batch, int replicas_flag, const std::string& replica_groups);

// Initialises MPI, makes the "cpu" backend this rank's part of the run (runtime::MpiExecutor; the ranks
// compare a hash of the step module at start), silences stdout on ranks other than 0, runs `body` and
// finalises. An error names the rank ("rank 1: ..."); one raised after training started ends the whole
// job (MPI_Abort), one before it (bad input, which every rank sees) lets every rank report it.
int RunUnderMpi(int replicas_per_process, double collective_timeout, const std::function<int(const MpiRank&)>& body);

}  // namespace shardstep::cli
