// MeshCollectives: the Collectives of the emulated TPU mesh (DESIGN §4). Every collective runs as the
// ring schedules of ring_schedule.h, so data moves only by neighbour transfers over one link (or on
// chip) and every byte is counted per link.
//
// Groups: the whole mesh in replica order (reduce-scatter over the cores of a chip, then X, then Y;
// all-gather in reverse), or one group of MeshTopology::GroupsAlong(axis) (a bidirectional ring along
// that axis). Any other group is an error naming it. A group of one copies.
//
// Shard order: one for both phases. ReduceScatter(in[n·g] -> out[n]): member p ends with chunk p
// reduced (the fold order of each element is the ring's, starting next to the chunk's owner; so not
// the in-process 0..g-1 order: results match it within rounding). AllReduce(n) pads to g·ceil(n/g)
// with zeros and runs exactly ReduceScatter + AllGather on that buffer, so it equals the two calls on
// the padded buffer bit for bit. "mean" divides each reduced shard by g once, after the reduction.
// Broadcast is an all-gather of which members keep the root's chunk.
//
// Execution: members rendezvous per group (mutex + condition variable, never spinning); the last to
// arrive checks that all called the same collective with the same size and runs the schedules on
// every member's buffer (one thread at a time, so the per-link counters are exact); then all leave.
// After Abort(why) every pending and future call throws shardstep::Error(why).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/collectives.h"
#include "runtime/mailboxes.h"
#include "tpu_backend/mesh_topology.h"
#include "tpu_backend/ring_schedule.h"

namespace shardstep::tpu {

class MeshCollectives final : public runtime::Collectives {
 public:
  explicit MeshCollectives(const MeshTopology& mesh);
  ~MeshCollectives() override;

  int num_replicas() const override { return mesh_.replicas(); }
  const MeshTopology& mesh() const { return mesh_; }

  void AllReduce(int replica, const runtime::ReplicaGroup& group, float* data, int64_t n,
                 runtime::Reduction op) override;
  void AllReduce(int replica, const runtime::ReplicaGroup& group, const float* in, float* out, int64_t n,
                 runtime::Reduction op) override;
  void ReduceScatter(int replica, const runtime::ReplicaGroup& group, const float* in, float* out, int64_t n,
                     runtime::Reduction op) override;
  void AllGather(int replica, const runtime::ReplicaGroup& group, const float* in, float* out, int64_t n) override;
  void Broadcast(int replica, const runtime::ReplicaGroup& group, float* data, int64_t n, int root) override;
  void Barrier(int replica, const runtime::ReplicaGroup& group) override;
  // The emulator's link transfer (collective_permute, tpu_backend/ring_lowering.h): `to` and `from`
  // must be torus neighbours along x or y, or cores of the same chip (else an Error naming both and the
  // mesh). The message is counted as RunSchedule counts a transfer: on the link from this replica's
  // chip along that axis in `direction` (either direction if that is not a neighbour that way), or on
  // chip. A send does not wait for its receiver (runtime/mailboxes.h).
  void Permute(int replica, int to, const float* send, int from, float* recv, int64_t n, int direction) override;
  void Abort(const std::string& why) override;

  // What crossed the links (MeshTopology::LinkIndex order) and the chips since construction or the last
  // ResetTraffic; read it between steps (a copy, taken under the lock).
  LinkTraffic traffic() const;
  void ResetTraffic();
  // Collectives completed (one per group call, not per member).
  int64_t calls() const;

 private:
  enum class Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };
  struct Call {
    Kind kind = Kind::kBarrier;
    const float* in = nullptr;
    float* out = nullptr;
    int64_t n = 0;
    runtime::Reduction op = runtime::Reduction::kSum;
    int root = 0;
  };
  struct Group;

  // Posts the caller's call, waits for the group, and (last arrival) runs it.
  void Run(int replica, const runtime::ReplicaGroup& group, const Call& call);
  // Runs the group's posted calls (under the lock).
  void Execute(Group& g);
  // The reduce-scatter or all-gather schedule of `g` for chunks of `shard` floats (cached).
  const RingSchedule& ScheduleOf(Group& g, bool reduce, int64_t shard);
  [[noreturn]] void ThrowAborted() const;

  const MeshTopology mesh_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<runtime::ReplicaGroup, std::unique_ptr<Group>> groups_;
  LinkTraffic traffic_;
  runtime::Mailboxes mailboxes_;
  int64_t calls_ = 0;
  bool aborted_ = false;
  std::string why_;
};

}  // namespace shardstep::tpu
