// WeightUpdateSharder.
//
// Algorithm:
//  1. Classify values: per-replica (depends on an input or the replica id; an all-reduce's result
//     is replica-invariant again) or invariant.
//  2. The weight-update region U: invariant, non-leaf values that flow into a variable assignment,
//     walking back from the assigned values and stopping at all-reduces (the region's entries).
//  3. Auxiliary variables (optimizer state used only by U; with gather_at_start also the weights)
//     become sharded variables: their type becomes the shard shape and their format is recorded.
//  4. Rebuild U on shards, in order. Every tensor shape has one format (ShardFormat::For), so
//     elementwise ops between values of one shape line up shard by shard:
//       all-reduce(g)         -> reduce-scatter(format(g))
//       elementwise           -> the same op on the operands' shards (a replicated operand is
//                                sliced locally by replica id: no communication)
//       broadcast of a scalar -> broadcast to the shard shape
//       full reduction        -> local partial reduction (padding masked to a neutral value) plus
//                                an all-reduce of the scalar
//       scalar ops            -> replicated
//       anything else         -> fallback: runs replicated on all-gathered values, and is reported
//  5. Assignments: sharded variables take the new shard; weights take unformat(all-gather(shard)).
// The old update ops become dead and Canonicalize drops them.
#include "ir/passes/weight_update_sharder.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/shape_inference.h"

namespace shardstep::ir {
namespace {

class Rewriter {
 public:
  Rewriter(Module& m, int64_t group, IntLists groups) : m_(m), b_(&m), g_(group), groups_(std::move(groups)) {
    shard_.assign(m.size(), kNoValue);
    full_.assign(m.size(), kNoValue);
    in_region_.assign(m.size(), 0);
  }

  Module& m_;
  Builder b_;
  int64_t g_;
  IntLists groups_;
  std::vector<ValueId> shard_, full_;
  std::vector<char> in_region_;
  std::vector<std::string> fallbacks_;
  ValueId pos_ = kNoValue;
  std::map<Shape, ValueId> masks_;

  ShardFormat Format(const Shape& s) const { return ShardFormat::For(s, g_); }

  Attrs CollectiveAttrs() const {
    Attrs a{{"group_size", g_}};
    if (!groups_.empty()) a["groups"] = groups_;
    return a;
  }

  // This replica's position in its group (groups are contiguous blocks).
  ValueId Position() {
    if (pos_ != kNoValue) return pos_;
    ValueId r = b_.ReplicaId();
    if (groups_.empty()) return pos_ = r;
    ValueId gs = b_.Scalar(static_cast<double>(g_), DType::kS32);
    return pos_ = b_.Sub(r, b_.Mul(b_.Div(r, gs), gs));
  }

  // Full tensor -> [g * rows, ...] laid out for reduce-scatter / all-gather.
  ValueId ToFormatted(ValueId x) {
    ShardFormat f = Format(b_.shape(x));
    if (!f.flat) return x;
    ValueId flat = b_.Reshape(x, {NumElements(f.logical)});
    return f.padding ? b_.Pad(flat, {0}, {f.padding}) : flat;
  }
  ValueId FromFormatted(ValueId y, const ShardFormat& f) {
    if (!f.flat) return y;
    ValueId cut = f.padding ? b_.Slice(y, {0}, {NumElements(f.logical)}) : y;
    return b_.Reshape(cut, f.logical);
  }
  // This replica's shard of a formatted tensor, by replica id: no communication.
  ValueId LocalSlice(ValueId formatted, const ShardFormat& f) {
    ValueId rows = b_.Reshape(formatted, {g_, f.shard_elements()});
    ValueId mine = b_.Emit(OpCode::kGather, {rows, Position()});
    return b_.Reshape(mine, f.ShardShape());
  }
  // 1 on real elements of this replica's shard, 0 on padding (flat formats with padding only).
  ValueId Mask(const ShardFormat& f) {
    auto it = masks_.find(f.logical);
    if (it != masks_.end()) return it->second;
    ValueId ones = b_.Constant(1.0, {DType::kF32, {NumElements(f.logical)}});
    return masks_[f.logical] = LocalSlice(b_.Pad(ones, {0}, {f.padding}), f);
  }

  ValueId Full(ValueId v) {
    if (full_[v] != kNoValue) return full_[v];
    if (shard_[v] == kNoValue) return v;  // an invariant leaf outside the region
    ShardFormat f = Format(LogicalShape(v));
    ValueId gathered = b_.Emit(OpCode::kAllGather, {shard_[v]}, CollectiveAttrs());
    return full_[v] = FromFormatted(gathered, f);
  }
  ValueId Shard(ValueId v) {
    if (shard_[v] != kNoValue) return shard_[v];
    ShardFormat f = Format(m_.type(v).shape);
    if (m_.at(v).op == OpCode::kConstant)
      return shard_[v] = b_.Constant(m_.at(v).GetFloat("value"), {m_.type(v).dtype, f.ShardShape()});
    return shard_[v] = LocalSlice(ToFormatted(Full(v)), f);
  }

  std::map<ValueId, Shape> logical_;  // sharded variables' logical shapes
  Shape LogicalShape(ValueId v) const {
    auto it = logical_.find(v);
    return it != logical_.end() ? it->second : m_.type(v).shape;
  }

  ValueId Clone(const Instr& in, std::vector<ValueId> operands) { return b_.Emit(in.op, std::move(operands), in.attrs); }

  void Rewrite(ValueId v) {
    const Instr in = m_.at(v);  // copy: the builder appends to m_.instrs
    const Shape shape = in.type.shape;
    if (in.op == OpCode::kAllReduce && !shape.empty()) {
      Attrs a = CollectiveAttrs();
      a["reduction"] = in.GetString("reduction", "sum");
      if (a["reduction"] == AttrValue(std::string("max"))) {  // no reduce-scatter for max: keep it whole
        full_[v] = v;
        return;
      }
      shard_[v] = b_.Emit(OpCode::kReduceScatter, {ToFormatted(in.operands[0])}, a);
      return;
    }
    if (in.op == OpCode::kAllReduce) {
      full_[v] = v;  // scalar: stays as is (its operand is per-replica, outside the region)
      return;
    }
    if (shape.empty()) {  // scalar arithmetic: replicated, it is cheap
      std::vector<ValueId> ops;
      for (ValueId o : in.operands) ops.push_back(Full(o));
      full_[v] = Clone(in, ops);
      return;
    }
    if (HasProperty(in.op, kElementwise)) {
      std::vector<ValueId> ops;
      for (ValueId o : in.operands) ops.push_back(Shard(o));
      shard_[v] = Clone(in, ops);
      return;
    }
    if (in.op == OpCode::kBroadcast && m_.type(in.operands[0]).shape.empty()) {
      shard_[v] = b_.BroadcastScalar(Full(in.operands[0]), Format(shape).ShardShape());
      return;
    }
    Fallback(v, in);
  }

  // A reduction to a scalar of a rank >= 1 value: partial on the shard, all-reduce of the result.
  bool RewriteFullReduction(ValueId v) {
    const Instr in = m_.at(v);
    if (!HasProperty(in.op, kReduction) || !in.type.shape.empty()) return false;
    ValueId x = in.operands[0];
    if (m_.type(x).shape.empty()) return false;
    ShardFormat f = Format(LogicalShape(x));
    ValueId local = Shard(x);
    const bool is_max = in.op == OpCode::kReduceMax;
    if (f.padding) {
      double neutral = is_max ? -std::numeric_limits<double>::infinity() : 0.0;
      local = b_.Select(Mask(f), local, b_.ScalarLike(neutral, local));
    }
    IntList axes = AllAxes(b_.type(local).rank());
    ValueId partial = is_max ? b_.ReduceMax(local, axes) : b_.ReduceSum(local, axes);
    Attrs a = CollectiveAttrs();
    a.erase("group_size");
    a["reduction"] = std::string(is_max ? "max" : "sum");
    ValueId total = b_.Emit(OpCode::kAllReduce, {partial}, a);
    if (in.op == OpCode::kReduceMean) total = b_.Div(total, b_.Scalar(static_cast<double>(NumElements(f.logical))));
    full_[v] = total;
    return true;
  }

  void Fallback(ValueId v, const Instr& in) {
    std::vector<ValueId> ops;
    for (ValueId o : in.operands) ops.push_back(Full(o));
    full_[v] = Clone(in, ops);
    std::string operands;
    for (ValueId o : in.operands) operands += (operands.empty() ? "" : ", ") + m_.type(o).ToString();
    fallbacks_.push_back(Str("%", v, " ", OpName(in.op), "(", operands, ") -> ", in.type.ToString(),
                             ": not partitionable; runs replicated on all-gathered values"));
  }
};

std::string Bytes(int64_t b) {
  std::ostringstream os;
  if (b >= (1 << 20)) os << std::fixed << std::setprecision(2) << b / 1048576.0 << " MiB";
  else if (b >= 1024) os << std::fixed << std::setprecision(1) << b / 1024.0 << " KiB";
  else os << b << " B";
  return os.str();
}

}  // namespace

std::string ShardingReport::ToString() const {
  std::ostringstream os;
  size_t w = 8;
  for (auto& r : variables) w = std::max(w, r.name.size());
  os << std::left << std::setw(w + 2) << "variable" << std::setw(17) << "role" << std::setw(9) << "sharded"
     << std::setw(7) << "format" << std::setw(9) << "padding" << std::setw(13) << "bytes before" << std::setw(13)
     << "bytes after" << "why\n";
  int64_t before = 0, after = 0;
  for (auto& r : variables) {
    os << std::setw(w + 2) << r.name << std::setw(17) << r.role << std::setw(9) << (r.sharded ? "yes" : "no")
       << std::setw(7) << r.format << std::setw(9) << r.padding << std::setw(13) << Bytes(r.bytes_before)
       << std::setw(13) << Bytes(r.bytes_after) << r.why << "\n";
    before += r.bytes_before;
    after += r.bytes_after;
  }
  os << std::setw(w + 2) << "total" << std::setw(17 + 9 + 7 + 9) << "" << std::setw(13) << Bytes(before)
     << std::setw(13) << Bytes(after) << "(per replica, group of " << group_size << ")\n";
  for (auto& f : fallbacks) os << "fallback: " << f << "\n";
  return os.str();
}

bool WeightUpdateSharder::Run(Module& m) {
  report_ = {};
  if (o_.group_size == 1) return false;
  const Module before = m;
  // The sharding group is the data-parallel group: the one the gradients' all-reduces use.
  int64_t g = o_.group_size > 0 ? o_.group_size : m.num_replicas;
  for (const Instr& in : m.instrs) {
    if (in.op != OpCode::kAllReduce || in.type.shape.empty()) continue;
    const int64_t ar_group = GroupSize(in, m.num_replicas);
    if (o_.group_size > 0 && ar_group != o_.group_size)
      throw Error(Str("weight-update-sharder: group size ", o_.group_size, " disagrees with the gradient all-reduce's group of ",
                      ar_group, " replicas"));
    IntLists contiguous = ContiguousGroups(m.num_replicas, static_cast<int>(ar_group));
    if (!contiguous.empty() && ReplicaGroups(in, m.num_replicas) != contiguous)
      throw Error("weight-update-sharder: only contiguous replica groups of equal size are supported");
    g = ar_group;
  }
  report_.group_size = static_cast<int>(g);
  if (g <= 1) return false;
  for (ValueId v : m.Variables()) {
    ShardFormat f;
    if (ShardFormat::FromAttrs(m.at(v), &f)) return false;  // already sharded
  }
  for (const Instr& in : m.instrs)
    if (in.op == OpCode::kReduceScatter) return false;
  const int n = m.size();

  // 1. Per-replica values.
  const std::vector<char> per = m.PerReplicaValues();
  // 2. The update region.
  Rewriter rw(m, g, ContiguousGroups(m.num_replicas, static_cast<int>(g)));
  std::vector<ValueId> work;
  for (auto& [var, val] : m.assigns)
    if (!per[val]) work.push_back(val);
  while (!work.empty()) {
    ValueId v = work.back();
    work.pop_back();
    const Instr& in = m.at(v);
    if (rw.in_region_[v] || per[v] || HasProperty(in.op, kLeaf)) continue;
    rw.in_region_[v] = 1;
    if (in.op == OpCode::kAllReduce) continue;  // an entry: its operand is the per-replica gradient
    for (ValueId o : in.operands) work.push_back(o);
  }
  if (std::find(rw.in_region_.begin(), rw.in_region_.end(), 1) == rw.in_region_.end()) return false;  // no update
  auto users = m.Users();

  // 3. Sharded variables.
  for (ValueId v : m.Variables()) {
    Instr& var = m.at(v);
    VariableShardingRow row;
    row.name = var.name;
    row.role = var.GetString("role", "");
    row.bytes_before = row.bytes_after = var.type.bytes();
    row.format = "-";
    ValueId assigned = m.AssignedValue(v);
    bool only_update = true;
    for (ValueId u : users[v]) only_update &= rw.in_region_[u] != 0;
    for (auto& [name, out] : m.outputs) only_update &= out != v;
    const bool is_state = row.role == kRoleOptimizerState, is_weight = row.role == kRoleWeight;
    if (var.type.shape.empty()) {
      row.why = "scalar: replicated";
    } else if (assigned == kNoValue || !rw.in_region_[assigned]) {
      row.why = "not updated by the weight update";
    } else if (is_weight && !o_.gather_at_start) {
      ShardFormat f = ShardFormat::For(var.type.shape, g);
      row.format = f.kind();
      row.padding = f.padding;
      row.why = "weight: update runs on a local slice, all-gathered at the end of the step";
    } else if (is_state && !only_update) {
      row.why = "used outside the weight update: replicated";
    } else if (is_state || is_weight) {
      ShardFormat f = ShardFormat::For(var.type.shape, g);
      rw.logical_[v] = var.type.shape;
      f.ToAttrs(&var.attrs);
      var.type.shape = f.ShardShape();
      rw.shard_[v] = v;
      row.sharded = true;
      row.format = f.kind();
      row.padding = f.padding;
      row.bytes_after = var.type.bytes();
      row.why = is_state ? "optimizer state: lives as a 1/N shard" : "weight: sharded, all-gathered at the start of the step";
    } else {
      row.why = "replicated";
    }
    report_.variables.push_back(row);
  }
  // Weights kept sharded across steps: the forward and backward read the all-gathered value.
  for (ValueId v : m.Variables()) {
    if (rw.shard_[v] != v || m.at(v).GetString("role", "") != kRoleWeight) continue;
    ValueId full = rw.Full(v);
    for (ValueId u : users[v])
      if (!rw.in_region_[u])
        for (ValueId& o : m.at(u).operands)
          if (o == v) o = full;
    for (auto& [name, out] : m.outputs)
      if (out == v) out = full;
  }

  // 4. Rebuild the region in order.
  for (ValueId v = 0; v < n; ++v) {
    if (!rw.in_region_[v]) continue;
    if (!rw.RewriteFullReduction(v)) rw.Rewrite(v);
  }
  report_.fallbacks = rw.fallbacks_;

  // 5. Assignments. The gradient entries are dropped: the optimizer consumed them, and keeping the
  // whole all-reduced gradient alive would keep the all-reduce the reduce-scatter replaced.
  for (auto& [var, val] : m.assigns) {
    if (per[val]) continue;
    val = rw.shard_[var] == var ? rw.Shard(val) : rw.Full(val);
  }
  for (auto& [name, out] : m.outputs)
    if (out < n && rw.in_region_[out]) out = rw.Full(out);
  m.gradients.clear();
  m.Canonicalize();
  return !(m == before);
}

}  // namespace shardstep::ir
