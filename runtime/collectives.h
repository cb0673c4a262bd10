// Collectives: the one interface every communication backend implements (in-process threads, MPI,
// the TPU mesh). Every replica of a group calls the same collective in the same order.
//
// Semantics (all implementations, checked by one conformance test):
//  - Reductions are deterministic: element j of the result is op(x_r0[j], x_r1[j], ...) folded in
//    increasing position within the group, so the same inputs give the same bits.
//  - "mean" is the sum divided by the group size (one division at the end).
//  - AllReduce gives exactly the bits of ReduceScatter followed by AllGather.
//  - A failure in any replica (Abort) makes every pending and future call throw instead of hanging.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace shardstep::runtime {

enum class Reduction { kSum, kMean, kMax };
Reduction ParseReduction(const std::string& s);  // "sum" | "mean" | "max"

// One step of a max fold, the same in every implementation: a NaN wins, then the larger value.
inline float FoldMax(float acc, float x) { return (x > acc || x != x) ? x : acc; }

// The replica ids of one group, in group order (a replica's position in it is its group rank).
using ReplicaGroup = std::vector<int64_t>;

// A part of a reduce-scatter computed where it is folded: produce(context, chunk, dst) writes chunk
// `chunk` of the owner's part into dst. Any member of the collective calls it, on the owner's
// operands (a weight gradient's product: each member computes its chunk of every member's product,
// so the products are never written out whole and read back).
// add, where set, adds the chunk to dst with the bits of produce into a buffer and then dst[j] + buf[j]
// (a sum's or a mean's fold then reads and writes each chunk once).
struct PartProducer {
  void (*produce)(const void* context, int64_t chunk, float* dst) = nullptr;
  const void* context = nullptr;
  void (*add)(const void* context, int64_t chunk, float* dst) = nullptr;
};

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int num_replicas() const = 0;

  // data[n] in place on every member.
  virtual void AllReduce(int replica, const ReplicaGroup& group, float* data, int64_t n, Reduction op) = 0;
  // in[n] -> out[n] (may be the same buffer); saves the caller's copy into `out` first.
  virtual void AllReduce(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n, Reduction op) {
    if (in != out) std::copy_n(in, n, out);
    AllReduce(replica, group, out, n, op);
  }
  // in[n * |group|] -> out[n]: member at group position p gets the reduced chunk p. For this and
  // AllGather, `in` and `out` must not overlap.
  virtual void ReduceScatter(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n,
                             Reduction op) = 0;
  // in[n] -> out[n * |group|]: chunk p is the input of the member at group position p.
  virtual void AllGather(int replica, const ReplicaGroup& group, const float* in, float* out, int64_t n) = 0;
  // The packed collectives of the collective combiner without the packing copies. A reduce-scatter of
  // the column-wise concatenation of `parts` tensors [|group|, ns[i]] (part i at ins[i], row-major)
  // into out[sum ns]: the member at position p gets row p of part i, reduced, at out + ns[0] + ... +
  // ns[i-1]. An all-gather of the concatenation of parts ins[i][ns[i]] into outs[i][|group|, ns[i]]:
  // row q of part i is member q's ins[i]. The bits (and the checks) of ReduceScatter / AllGather on
  // the packed buffers; the defaults pack into a buffer of the calling thread (grown only) and call
  // them, so a backend overrides them only to skip that copy.
  virtual void ReduceScatterParts(int replica, const ReplicaGroup& group, const float* const* ins, const int64_t* ns,
                                  int parts, float* out, Reduction op);
  virtual void AllGatherParts(int replica, const ReplicaGroup& group, const float* const* ins, const int64_t* ns,
                              int parts, float* const* outs);
  // Whether ReduceScatterProducts is supported: members that read each other's memory (in-process).
  virtual bool FoldsProducts() const { return false; }
  // ReduceScatterParts where part i with producers[i].produce set is never materialised: the member at
  // position p folds, in group order, what each member q's producer writes for chunk p (row p of
  // [|group|, ns[i]]) instead of reading row p of ins[i]. The same bits as ReduceScatterParts on the
  // materialised parts when a producer writes the bits the part would hold. The default throws.
  virtual void ReduceScatterProducts(int replica, const ReplicaGroup& group, const float* const* ins,
                                     const PartProducer* producers, const int64_t* ns, int parts, float* out,
                                     Reduction op);
  // data[n] from the member at group position `root` to all members.
  virtual void Broadcast(int replica, const ReplicaGroup& group, float* data, int64_t n, int root) = 0;
  virtual void Barrier(int replica, const ReplicaGroup& group) = 0;

  // Point to point (collective_permute): sends send[n] to replica `to` and receives recv[n] from
  // replica `from` (-1: none; recv is then zero-filled). Every replica of the permute calls it once,
  // in the same order; a send does not wait for its receiver, messages between two replicas arrive in
  // order. `direction` (+1 or -1) says which way round a ring the message goes (a torus axis of size
  // 2 joins the same two chips by two links); other backends ignore it. The default throws: a backend
  // without point-to-point transfers.
  virtual void Permute(int replica, int to, const float* send, int from, float* recv, int64_t n, int direction);

  // Called when a replica fails: wakes every waiting replica, which then throws `why`.
  virtual void Abort(const std::string& why) = 0;
};

}  // namespace shardstep::runtime
