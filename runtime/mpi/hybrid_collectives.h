// HybridCollectives: the collectives of K MPI ranks x T replica threads per rank (global replica id =
// rank * T + t), with the bits of InProcessCollectives with K*T replicas (runtime/collectives.h).
//
// Per collective and group, the rank's member threads meet (publish their buffers); the last to arrive
// exchanges with every other rank that holds members of the group, one point-to-point message each way
// (the pieces the peer's members need, in group order), then every member computes its own result from
// its local peers' buffers (read in place) and the received pieces:
//   ReduceScatter: member p folds chunk p of every member's input in group order (x_0 + x_1 + ..., then
//                  the division for mean), exactly InProcessCollectives' fold;
//   AllGather:     every member's input, placed by group position;
//   AllReduce:     ReduceScatter of the zero-padded buffer, then AllGather (element j folded in group
//                  order, the in-process bits);
//   Broadcast / Barrier: the root's buffer / empty messages.
// A second local meeting ends the collective (nobody reads another member's buffers after it). A message
// that is one contiguous piece is sent from the caller's buffer (no staging copy); others are packed.
// MPI is called by one thread at a time (a process-wide mutex; waits poll MPI_Test, so disjoint groups
// progress concurrently). Messages use a duplicate of MPI_COMM_WORLD and a tag per group.
// With a timeout, a collective that has not completed in time aborts the job naming the collective.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/collectives.h"

namespace shardstep::runtime {

class HybridCollectives final : public Collectives {
 public:
  // Needs a live MpiSession (runtime/mpi/mpi_collectives.h); every rank constructs it (it duplicates
  // MPI_COMM_WORLD). timeout_seconds <= 0: wait forever.
  explicit HybridCollectives(int replicas_per_process, double timeout_seconds = 0);
  ~HybridCollectives() override;

  int num_replicas() const override { return ranks_ * per_rank_; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  int replicas_per_process() const { return per_rank_; }
  int first_replica() const { return rank_ * per_rank_; }
  // Payload bytes this rank sent to other ranks so far.
  int64_t bytes_sent() const { return bytes_sent_.load(); }

  void AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) override;
  void ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                     Reduction op) override;
  void AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) override;
  void Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) override;
  void Barrier(int replica, const ReplicaGroup& group) override;
  // Prints `why` naming this rank and ends every rank of the job (MPI_Abort).
  [[noreturn]] void Abort(const std::string& why) override;

  struct Group;  // per distinct group: its layout over the ranks and the local meeting

 private:
  struct Call;
  Group& GroupFor(int replica, const ReplicaGroup& group, const char* what, int* local);
  // The local meeting and the exchange; returns once every local member has published and the pieces
  // from the other ranks have arrived.
  void Exchange(Group& g, int local, const Call& call);
  void Done(Group& g);
  void RunExchange(Group& g);

  int rank_ = 0, ranks_ = 1, per_rank_ = 1;
  double timeout_seconds_ = 0;
  void* comm_;  // MPI_Comm (a duplicate of MPI_COMM_WORLD)
  std::mutex groups_mu_;
  std::map<ReplicaGroup, std::unique_ptr<Group>> groups_;
  std::mutex mpi_mu_;  // MPI is called by one thread at a time
  std::atomic<int64_t> bytes_sent_{0};
};

}  // namespace shardstep::runtime
