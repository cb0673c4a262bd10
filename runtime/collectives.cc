// Collectives: parsing of reduction names and the packing defaults of the parts collectives, shared
// by every backend.
#include "runtime/collectives.h"

#include <numeric>

#include "ir/error.h"

namespace shardstep::runtime {

Reduction ParseReduction(const std::string& s) {
  if (s == "sum") return Reduction::kSum;
  if (s == "mean") return Reduction::kMean;
  if (s == "max") return Reduction::kMax;
  throw Error(Str("unknown reduction '", s, "' (expected sum, mean or max)"));
}

namespace {
// The calling thread's packing buffer: grown only, so a step allocates nothing after its first.
float* PackBuffer(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
}  // namespace

void Collectives::ReduceScatterParts(int replica, const ReplicaGroup& group, const float* const* ins,
                                     const int64_t* ns, int parts, float* out, Reduction op) {
  const int64_t rows = static_cast<int64_t>(group.size()), total = std::accumulate(ns, ns + parts, int64_t{0});
  float* packed = PackBuffer(rows * total);
  for (int64_t r = 0, col = 0; r < rows; ++r, col = 0)
    for (int i = 0; i < parts; col += ns[i++]) std::copy_n(ins[i] + r * ns[i], ns[i], packed + r * total + col);
  ReduceScatter(replica, group, packed, out, total, op);
}

void Collectives::ReduceScatterProducts(int, const ReplicaGroup&, const float* const*, const PartProducer*,
                                        const int64_t*, int, float*, Reduction) {
  throw Error("this backend's collectives do not fold products (FoldsProducts() is false)");
}

void Collectives::AllGatherParts(int replica, const ReplicaGroup& group, const float* const* ins, const int64_t* ns,
                                 int parts, float* const* outs) {
  const int64_t rows = static_cast<int64_t>(group.size()), total = std::accumulate(ns, ns + parts, int64_t{0});
  float* packed = PackBuffer((rows + 1) * total);  // the input, then the gathered rows
  for (int64_t i = 0, col = 0; i < parts; col += ns[i++]) std::copy_n(ins[i], ns[i], packed + col);
  AllGather(replica, group, packed, packed + total, total);
  for (int64_t r = 0, col = 0; r < rows; ++r, col = 0)
    for (int i = 0; i < parts; col += ns[i++]) std::copy_n(packed + total + r * total + col, ns[i], outs[i] + r * ns[i]);
}

}  // namespace shardstep::runtime
