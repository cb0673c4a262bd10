// MpiCollectives: the collectives interface over OpenMPI, one replica per rank (replica id = rank in
// MPI_COMM_WORLD). Deterministic with the same bits as InProcessCollectives (runtime/collectives.h):
// a reduction never uses MPI's own reduction (whose order is the library's); it exchanges shards and
// folds them locally in group order:
//   ReduceScatter: MPI_Alltoall sends chunk p of every member's input to member p, which folds the
//                  |group| copies in group position order;
//   AllGather:     MPI_Allgather;
//   AllReduce:     ReduceScatter of the (zero-padded) buffer, then AllGather: element j is folded in
//                  group order, exactly as the in-process fold does it.
// Groups become MPI communicators, created once per distinct group (MPI_Comm_create_group: only the
// members take part) and cached. With a timeout, a collective that has not completed after that many
// seconds (a rank hung or gone without the job noticing) aborts the job naming the collective and rank.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "runtime/collectives.h"

namespace shardstep::runtime {

// MPI_Init_thread / MPI_Finalize for the process's lifetime (thread level SERIALIZED: replica threads
// call MPI one at a time).
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0, size_ = 1;
};

class MpiCollectives final : public Collectives {
 public:
  // Needs a live MpiSession. timeout_seconds <= 0: wait forever.
  explicit MpiCollectives(double timeout_seconds = 0);
  ~MpiCollectives() override;

  int num_replicas() const override { return size_; }
  int rank() const { return rank_; }
  // Payload bytes this rank has handed to MPI for other ranks so far: what the algorithm must deliver
  // ((g-1) chunks per reduce-scatter or all-gather, (g-1) shards of each for an all-reduce), not what
  // MPI's own transport adds.
  int64_t bytes_sent() const { return bytes_sent_; }

  void AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) override;
  void ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                     Reduction op) override;
  void AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) override;
  void Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) override;
  void Barrier(int replica, const ReplicaGroup& group) override;
  // Prints `why` naming this rank and ends every rank of the job (MPI_Abort).
  void Abort(const std::string& why) override;

 private:
  struct Comm;
  const Comm& CommFor(int replica, const ReplicaGroup& group, const char* what);
  // Waits for a nonblocking collective (an MPI_Request), within the timeout.
  void Wait(void* request, const char* what, const ReplicaGroup& group);

  int rank_ = 0, size_ = 1;
  double timeout_seconds_ = 0;
  int64_t bytes_sent_ = 0;
  std::map<ReplicaGroup, Comm*> comms_;
  std::vector<float> scratch_, padded_;
};

}  // namespace shardstep::runtime
