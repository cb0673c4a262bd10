// InProcessCollectives: the Collectives of N replicas that are threads of one process (shared memory).
//
// Every collective is a rendezvous of the group's members on a mutex + condition variable (blocking,
// never spinning, so 64 replica threads on 2 cores are fine):
//   1. publish: each member posts its buffer pointers; the last arrival checks that all members called
//      the same collective with the same size, and sizes the group's scratch buffer;
//   2. work: member p reduces its own 1/N chunk, reading every member's input buffer directly, into
//      scratch (the shared-memory equivalent of a ring reduce-scatter);
//   3. done: after a second rendezvous each member copies what it needs out of scratch (the gather).
// Element j is always folded in group order (position 0 first) by one function, so AllReduce has
// exactly the bits of ReduceScatter + AllGather and the bits never depend on thread timing. "max"
// propagates NaN. Inputs and outputs may alias (all results go through scratch).
//
// Disjoint replica groups run concurrently: each group (keyed by its member list, in order) has its own
// rendezvous state. After Abort(why) every pending and future call throws shardstep::Error(why); a
// member whose buffers others are still reading waits for them to finish before it throws.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/collectives.h"

namespace shardstep::runtime {

class InProcessCollectives final : public Collectives {
 public:
  explicit InProcessCollectives(int num_replicas);
  ~InProcessCollectives() override;

  int num_replicas() const override { return num_replicas_; }

  void AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) override;
  void ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                     Reduction op) override;
  void AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) override;
  void Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) override;
  void Barrier(int replica, const ReplicaGroup& group) override;

  // The first Abort wins; later calls keep its message.
  void Abort(const std::string& why) override;
  bool aborted() const { return aborted_.load(); }

 private:
  struct Group;
  struct Slot;

  // Validates the call and returns the group's state and the caller's position in it.
  Group& Enter(int replica, const ReplicaGroup& group, int64_t n, int* position);
  // Rendezvous of all members. `publish` != nullptr: post the caller's call and open the work phase;
  // nullptr: the caller has finished reading other members' buffers.
  void Sync(Group& g, int position, const Slot* publish);
  [[noreturn]] void ThrowAborted();

  const int num_replicas_;
  std::mutex groups_mu_;
  std::map<ReplicaGroup, std::unique_ptr<Group>> groups_;
  std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::string why_;
};

}  // namespace shardstep::runtime
