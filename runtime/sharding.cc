// Resharding state between the logical form and per-replica shards.
#include "runtime/sharding.h"

#include <algorithm>
#include <cstring>

#include "ir/error.h"
#include "ir/shard_format.h"
#include "runtime/initializers.h"

namespace shardstep::runtime {

using ir::ShardFormat;

namespace {

// The copies below trust the spec: the variable's type is f32 and exactly the shard shape (the
// verifier's rule; a module that skipped it stops here rather than overflowing a buffer).
void CheckShardSpec(const ir::Instr& var, const ShardFormat& f) {
  SS_CHECK(var.type.dtype == ir::DType::kF32 && var.type.shape == f.ShardShape(), "sharded variable @", var.name, " is ",
           var.type.ToString(), ", not a ", f.kind(), " shard of ", ir::ShapeToString(f.logical), " in ", f.count,
           " parts (run the verifier)");
}

}  // namespace

std::map<std::string, ir::TensorType> LogicalTypes(const ir::Module& step) {
  std::map<std::string, ir::TensorType> types;
  for (ir::ValueId v : step.Variables()) {
    const ir::Instr& var = step.at(v);
    ShardFormat f;
    types[var.name] = ShardFormat::FromAttrs(var, &f) ? ir::TensorType{var.type.dtype, f.logical} : var.type;
  }
  return types;
}

TensorMap InitLogicalState(const ir::Module& step) {
  ir::Module logical = step;
  for (ir::Instr& in : logical.instrs) {
    ShardFormat f;
    if (in.op == ir::OpCode::kVariable && ShardFormat::FromAttrs(in, &f)) in.type.shape = f.logical;
  }
  return InitVariables(logical);
}

TensorMap ReplicaState(const ir::Module& step, const TensorMap& logical, int replica) {
  TensorMap out;
  for (ir::ValueId v : step.Variables()) {
    const ir::Instr& var = step.at(v);
    auto it = logical.find(var.name);
    if (it == logical.end()) throw Error(Str("state has no value for variable @", var.name));
    const Tensor& t = it->second;
    ShardFormat f;
    if (!ShardFormat::FromAttrs(var, &f)) {
      if (t.type != var.type)
        throw Error(Str("variable @", var.name, ": expected ", var.type.ToString(), ", got ", t.type.ToString()));
      out[var.name] = t;
      continue;
    }
    if (t.type != ir::TensorType{var.type.dtype, f.logical})
      throw Error(Str("variable @", var.name, ": expected logical ", ir::TensorType{var.type.dtype, f.logical}.ToString(),
                      ", got ", t.type.ToString()));
    CheckShardSpec(var, f);
    SS_CHECK(static_cast<int64_t>(t.f32.size()) == t.elements(), "logical @", var.name, " holds ", t.f32.size(),
             " values for ", t.type.ToString());
    // Formatted = flattened logical + zero padding; this replica's shard is chunk (replica mod G).
    const int64_t k = f.shard_elements(), pos = replica % f.count, e = t.elements();
    Tensor s(var.type);
    const int64_t begin = pos * k, end = std::min(begin + k, e);
    if (end > begin) std::memcpy(s.f32.data(), t.f32.data() + begin, (end - begin) * sizeof(float));
    out[var.name] = std::move(s);
  }
  return out;
}

TensorMap LogicalStateFrom(const ir::Module& step, const std::vector<TensorMap>& states, int first) {
  TensorMap out;
  for (ir::ValueId v : step.Variables()) {
    const ir::Instr& var = step.at(v);
    ShardFormat f;
    if (!ShardFormat::FromAttrs(var, &f)) {
      out[var.name] = states.at(first).at(var.name);
      continue;
    }
    CheckShardSpec(var, f);
    Tensor t(ir::TensorType{var.type.dtype, f.logical});
    const int64_t k = f.shard_elements(), e = t.elements();
    // Replica `first`'s group for this variable: groups are contiguous blocks of f.count replicas.
    const int64_t begin_replica = first - first % f.count;
    for (int64_t p = 0; p < f.count; ++p) {
      const Tensor& s = states.at(begin_replica + p).at(var.name);
      SS_CHECK(s.type == var.type && static_cast<int64_t>(s.f32.size()) == k, "replica ", begin_replica + p, "'s @",
               var.name, " is ", s.type.ToString(), " holding ", s.f32.size(), " values, expected ", var.type.ToString());
      const int64_t begin = p * k, end = std::min(begin + k, e);
      if (end > begin) std::memcpy(t.f32.data() + begin, s.f32.data(), (end - begin) * sizeof(float));
    }
    out[var.name] = std::move(t);
  }
  return out;
}

}  // namespace shardstep::runtime
