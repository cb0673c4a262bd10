#include "runtime/mpi/distributed_state.h"

#include <cstring>

#include "ir/error.h"
#include "runtime/sharding.h"

namespace shardstep::runtime {

TensorMap GatherLogicalState(const ir::Module& step, const TensorMap& local_state, int replica, Collectives& c) {
  const int n = c.num_replicas();
  ReplicaGroup all(n);
  for (int r = 0; r < n; ++r) all[r] = r;
  std::vector<TensorMap> states(n);
  std::vector<float> gathered;
  // In name order (a std::map): every replica walks the variables in the same order.
  for (const auto& [name, t] : local_state) {
    if (t.dtype() != ir::DType::kF32) {  // s32 variables (the step counter) are never sharded
      for (auto& s : states) s[name] = t;
      continue;
    }
    const int64_t e = t.elements();
    gathered.resize(static_cast<size_t>(e) * n);
    c.AllGather(replica, all, t.f32.data(), gathered.data(), e);
    for (int r = 0; r < n; ++r) {
      Tensor piece(t.type);
      std::memcpy(piece.f32.data(), gathered.data() + static_cast<size_t>(r) * e, e * sizeof(float));
      states[r][name] = std::move(piece);
    }
  }
  return LogicalStateFrom(step, states, 0);
}

}  // namespace shardstep::runtime
