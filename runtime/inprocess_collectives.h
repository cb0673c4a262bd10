// InProcessCollectives: the Collectives of N replicas that are threads of one process (shared memory).
//
// Every collective is a rendezvous of the group's members: arrivals counted under a mutex, waiters
// asleep on a futex (std::atomic::wait: a short spin with yields, then blocking, so 64 replica threads
// on 2 cores are fine):
//   1. publish: each member posts its buffer pointers; the last arrival checks that all members called
//      the same collective with the same size, and sizes the group's scratch buffer;
//   2. work: every member reads the other members' buffers directly. ReduceScatter: member p folds
//      its own chunk straight into its output; AllGather: member p copies every member's input
//      into its output; AllReduce: member p folds its chunk into the group's scratch buffer;
//   3. done: a second rendezvous, after which nobody reads another member's buffers (AllReduce
//      members then copy the whole result out of scratch).
// Every byte crosses memory once per member: no staging copies for ReduceScatter and AllGather,
// which the sharded weight update uses for its largest tensors. Their Parts forms read (and write)
// each tensor of a combined collective where it is, so the combiner's packing costs no copy either.
// AllGather and AllGatherParts may be given the same output (per part) by every member (replicas that
// share one copy of a replicated weight, jit::CpuExecutor): each member then writes only its own chunk
// and the done rendezvous publishes the whole; some members sharing an output and others not is an error.
// Element j is always folded in group order (position 0 first) by one function, so AllReduce has
// exactly the bits of ReduceScatter + AllGather and the bits never depend on thread timing. "max"
// propagates NaN. AllReduce works in place; the input and output of ReduceScatter and AllGather must
// not overlap (an overlap is reported as an error), except that AllGather's input may be exactly the
// member's own chunk of its output (in place: that chunk is not copied; jit::JitOptions::in_place_all_gathers).
//
// Communication time: for each group, the wall time from the last member's arrival at a collective
// (when the data exchange can start) to the last member's exit is summed; time spent waiting for a
// slower member is not communication and is not counted. A member that leaves early may already
// compute while others still copy; with set_phase_timing(true) members leave every collective
// together, so communication and computation never overlap and a step's wall time splits exactly
// into the two (benchmarks use this; it costs one more rendezvous per collective).
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
#include "runtime/mailboxes.h"

namespace shardstep::runtime {

class InProcessCollectives final : public Collectives {
 public:
  explicit InProcessCollectives(int num_replicas);
  ~InProcessCollectives() override;

  int num_replicas() const override { return num_replicas_; }

  void AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) override;
  void AllReduce(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n, Reduction op) override;
  void ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                     Reduction op) override;
  void AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) override;
  // Member p reads every member's parts directly: no packing copy.
  void ReduceScatterParts(int replica, const ReplicaGroup& group, const float* const* ins, const int64_t* ns, int parts,
                          float* out, Reduction op) override;
  void AllGatherParts(int replica, const ReplicaGroup& group, const float* const* ins, const int64_t* ns, int parts,
                      float* const* outs) override;
  // Member p calls every member's producers for chunk p (each member's operands are in this process).
  // On unless SHARDSTEP_JIT_FOLD_PRODUCTS=0 or set_fold_products(false).
  bool FoldsProducts() const override { return fold_products_.load(); }
  void set_fold_products(bool on) { fold_products_ = on; }
  void ReduceScatterProducts(int replica, const ReplicaGroup& group, const float* const* ins,
                             const PartProducer* producers, const int64_t* ns, int parts, float* out,
                             Reduction op) override;
  void Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) override;
  void Barrier(int replica, const ReplicaGroup& group) override;
  // Any pair of replicas (runtime/mailboxes.h).
  void Permute(int replica, int to, const float* send, int from, float* recv, int64_t n, int direction) override;

  // Wall seconds of communication since construction (see above): the largest sum over the replica
  // groups (disjoint groups overlap in time, so their sums are not added).
  double busy_seconds() const;
  int64_t calls() const { return calls_.load(); }
  void set_phase_timing(bool on) { phase_timing_ = on; }

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
  // The caller has finished the collective; the last member to leave closes its time interval.
  void Leave(Group& g);
  [[noreturn]] void ThrowAborted();

  const int num_replicas_;
  mutable std::mutex groups_mu_;
  std::atomic<int64_t> calls_{0};
  std::atomic<bool> phase_timing_{false};
  std::atomic<bool> fold_products_;
  std::map<ReplicaGroup, std::unique_ptr<Group>> groups_;
  std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::string why_;
  Mailboxes mailboxes_;
};

}  // namespace shardstep::runtime
