// WeightUpdateSharder.
//
// Algorithm:
//  1. Classify values: per-replica (depends on an input or the replica id; an all-reduce's result
//     is replica-invariant again) or invariant.
//  2. The weight-update region U: invariant, non-leaf values that flow into a variable assignment,
//     walking back from the assigned values and stopping at all-reduces (the region's entries).
//     Update chains: the region's tensors joined through the ops between them and through the
//     variables they update (replicated scalars such as the step counter, and constants, join
//     nothing). Each chain is sharded within the replica groups of its own gradient all-reduces,
//     which must agree (else an error names the all-reduces and their groups); one Rewriter per
//     grouping rebuilds its chains. Groups must be contiguous blocks of equal size.
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
//
// ShardOrderReductions (the update left replicated, groups of g > 1) runs steps 1-2b and rewrites only the full
// reductions step 4 would partition: each is computed as the sharded program computes it (the same g shard-shaped
// partial reductions, folded in replica order), so sharding on or off gives the same bits for LAMB, LARS and
// clipping too. Rule: a backend's reduction depends only on (op, operand shape, values), elementwise ops are exact
// per element (no FMA contraction), and a collective folds in replica order; so equal shards give equal partials and
// equal folds give equal norms.
#include "ir/passes/weight_update_sharder.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <sstream>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/printer.h"
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
  std::vector<std::string> fallbacks_, reductions_;
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

  // A reduction to a scalar of a rank >= 1 value: the reductions the sharder partitions and ShardOrderReductions
  // computes in the sharded order.
  bool IsFullReduction(ValueId v) const {
    const Instr& in = m_.at(v);
    return HasProperty(in.op, kReduction) && in.type.shape.empty() && !m_.type(in.operands[0]).shape.empty();
  }
  std::string Describe(ValueId v) const {
    const Instr& in = m_.at(v);
    return Str("%", v, " ", OpName(in.op), "(", LogicalShapeText(in.operands[0]), ")");
  }
  std::string LogicalShapeText(ValueId x) const { return TensorType{m_.type(x).dtype, LogicalShape(x)}.ToString(); }

  // A full reduction: partial on the shard, all-reduce of the result.
  bool RewriteFullReduction(ValueId v) {
    if (!IsFullReduction(v)) return false;
    const Instr in = m_.at(v);
    ValueId x = in.operands[0];
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
    const char* what = is_max ? "max" : "sum";
    reductions_.push_back(Str(Describe(v), ": partial ", what, " of each ", ShapeToString(f.ShardShape()), " shard",
                              f.padding ? " (padding masked)" : "", ", all_reduce(", what, ") of the scalar"));
    return true;
  }

  // The replicated update (no sharding, g > 1) computes full reduction v in the sharded program's order, so that
  // sharding changes no bits: x is laid out as the sharder lays it out (ToFormatted: dim-0 rows, or flattened and
  // zero-padded), each of the g shards is reduced on its own with the op and the shard shape RewriteFullReduction
  // uses (a backend's reduction is a function of the operand's shape and values only), and the g scalars are
  // folded in replica order, as the all-reduce of the partials folds them (InProcessCollectives: f32
  // ((p0 + p1) + p2) + ..., or max). Returns the value that replaces v; no communication.
  ValueId ShardOrderReduction(ValueId v) {
    const Instr in = m_.at(v);
    ValueId x = in.operands[0];
    ShardFormat f = Format(m_.type(x).shape);
    const bool is_max = in.op == OpCode::kReduceMax;
    ValueId formatted = ToFormatted(x);
    const Shape shard = f.ShardShape();
    const IntList axes = AllAxes(static_cast<int64_t>(shard.size()));
    ValueId ones = kNoValue;  // the sharded program's mask, before slicing (max with padding only)
    ValueId total = kNoValue;
    for (int64_t i = 0; i < g_; ++i) {
      IntList start(shard.size(), 0), limit(shard.begin(), shard.end());
      start[0] = i * shard[0];
      limit[0] = (i + 1) * shard[0];
      ValueId local = b_.Slice(formatted, start, limit);
      // Sums: the zero padding is what the sharded program's select puts there. Max: -inf, as it does.
      if (f.padding && is_max) {
        if (ones == kNoValue)
          ones = b_.Pad(b_.Constant(1.0, {DType::kF32, {NumElements(f.logical)}}), {0}, {f.padding});
        local = b_.Select(b_.Slice(ones, start, limit), local,
                          b_.ScalarLike(-std::numeric_limits<double>::infinity(), local));
      }
      ValueId partial = is_max ? b_.ReduceMax(local, axes) : b_.ReduceSum(local, axes);
      // The collective folds out = op(out, p_i): out + p_i for sums; for max, Max(p_i, out) picks as MaxOf does.
      total = total == kNoValue ? partial : is_max ? b_.Emit(OpCode::kMax, {partial, total}) : b_.Add(total, partial);
    }
    if (in.op == OpCode::kReduceMean) total = b_.Div(total, b_.Scalar(static_cast<double>(NumElements(f.logical))));
    reductions_.push_back(Str(Describe(v), ": ", g_, " partial ", is_max ? "maxima" : "sums", " of ",
                              ShapeToString(f.ShardShape()), " shards", f.padding ? " (zero-padded)" : "",
                              ", folded in replica order"));
    return total;
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

namespace {

// Union-find over value ids: the update chains.
struct Chains {
  std::vector<ValueId> parent;
  explicit Chains(int n) : parent(n) {
    for (ValueId v = 0; v < n; ++v) parent[v] = v;
  }
  ValueId Find(ValueId v) { return parent[v] == v ? v : parent[v] = Find(parent[v]); }
  void Join(ValueId a, ValueId b) { parent[Find(a)] = Find(b); }
};

std::string GroupsText(const IntLists& groups) { return PrintAttrValue(AttrValue(groups)); }

// Contiguous groups of `group_size` (0 or num_replicas: one group of all), listed explicitly.
IntLists ExplicitGroups(int num_replicas, int group_size) {
  IntLists groups = ContiguousGroups(num_replicas, group_size);
  if (groups.empty()) {
    groups.emplace_back();
    for (int r = 0; r < num_replicas; ++r) groups.back().push_back(r);
  }
  return groups;
}

// The weight-update region (steps 1-2b) and one Rewriter per grouping of its chains: what the sharder rebuilds on
// shards and where ShardOrderReductions finds the same full reductions.
struct UpdateRegion {
  std::vector<char> per, region;
  std::vector<std::unique_ptr<Rewriter>> rewriters;  // [0] also takes the replicated scalars
  std::vector<Rewriter*> rw_of;                      // per value: its chain's Rewriter (region values, grouped ones)
  Rewriter& at(ValueId v) { return rw_of[v] ? *rw_of[v] : *rewriters[0]; }
};

bool IsModelState(const Module& m, ValueId var) { return m.at(var).GetString("role", "") == kRoleModelState; }

// Steps 1-2b; throws (naming `pass`) on replica groups the sharder cannot shard within. False when there is nothing
// to shard: groups of one replica, no update, an already-sharded module.
bool FindUpdateRegion(Module& m, int group_size, const std::string& pass, UpdateRegion* out) {
  if (group_size == 1) return false;
  const std::string where = Str(pass, ": module ", PrintName(m.name), ": ");
  // Each gradient all-reduce shards within its own replica groups (contiguous blocks of equal size,
  // the layout ReplicaState and LogicalStateFrom reshard with); the options' group size, when given,
  // must agree with every one of them.
  // All-reduces in the forward/backward pass (cross-replica batch-norm statistics and their
  // gradients) feed per-replica values; they are not gradient reductions and may use other groups.
  std::vector<char> feeds_per_replica(m.size(), 0);
  {
    const std::vector<char> per = m.PerReplicaValues();
    for (ValueId v = m.size() - 1; v >= 0; --v)
      for (ValueId o : m.at(v).operands)
        if (per[v] || feeds_per_replica[v]) feeds_per_replica[o] = 1;
  }
  for (ValueId v = 0; v < m.size(); ++v) {
    const Instr& in = m.at(v);
    if (in.op != OpCode::kAllReduce || in.type.shape.empty() || feeds_per_replica[v]) continue;
    const int64_t ar_group = GroupSize(in, m.num_replicas);
    if (group_size > 0 && ar_group != group_size)
      throw Error(Str(where, "group size ", group_size, " disagrees with %", v, " (all_reduce) over groups ",
                      GroupsText(ReplicaGroups(in, m.num_replicas)), " of ", ar_group, " replicas"));
    IntLists contiguous = ContiguousGroups(m.num_replicas, static_cast<int>(ar_group));
    if (!contiguous.empty() && ReplicaGroups(in, m.num_replicas) != contiguous)
      throw Error(Str(where, "%", v, " (all_reduce) reduces over groups ", GroupsText(ReplicaGroups(in, m.num_replicas)),
                      "; only contiguous replica groups of equal size are supported, such as ", GroupsText(contiguous)));
  }
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
  std::vector<char> region(n, 0);
  std::vector<ValueId> work;
  // Model state (batch-norm running statistics) is assigned by the forward pass: not part of the
  // weight update, kept replicated with its assignment as it is.
  auto is_model_state = [&](ValueId var) { return IsModelState(m, var); };
  for (auto& [var, val] : m.assigns)
    if (!per[val] && !is_model_state(var)) work.push_back(val);
  while (!work.empty()) {
    ValueId v = work.back();
    work.pop_back();
    const Instr& in = m.at(v);
    if (region[v] || per[v] || HasProperty(in.op, kLeaf)) continue;
    region[v] = 1;
    if (in.op == OpCode::kAllReduce) continue;  // an entry: its operand is the per-replica gradient
    for (ValueId o : in.operands) work.push_back(o);
  }
  if (std::find(region.begin(), region.end(), 1) == region.end()) return false;  // no update

  // 2b. Update chains: the region's tensors joined through the ops between them and through the
  // variables they update. Scalars computed from scalars only (step counters, bias corrections) and
  // constants are replicated and join nothing. Every chain takes the replica groups of its gradient
  // all-reduces, which must agree; a chain without one takes the default grouping.
  std::vector<char> grouped(n, 0), assigned_from_region(n, 0);
  for (auto& [var, val] : m.assigns)
    if (!is_model_state(var) && (region[val] || (m.at(val).op == OpCode::kVariable && !per[val])))
      assigned_from_region[var] = 1;
  Chains chains(n);
  for (ValueId v = 0; v < n; ++v) {
    const Instr& in = m.at(v);
    if (in.op == OpCode::kVariable) grouped[v] = assigned_from_region[v] && !in.type.shape.empty();
    if (!region[v]) continue;
    if (in.op == OpCode::kAllReduce) {
      grouped[v] = !in.type.shape.empty();
      continue;
    }
    grouped[v] = !in.type.shape.empty();
    for (ValueId o : in.operands) grouped[v] |= grouped[o];
    if (grouped[v])
      for (ValueId o : in.operands)
        if (grouped[o]) chains.Join(v, o);
  }
  for (auto& [var, val] : m.assigns)
    if (grouped[var] && grouped[val]) chains.Join(var, val);
  // The groups of each chain, from its gradient all-reduces (in module order).
  std::map<ValueId, std::vector<ValueId>> entries;  // chain -> its rank >= 1 all-reduces
  for (ValueId v = 0; v < n; ++v)
    if (region[v] && m.at(v).op == OpCode::kAllReduce && grouped[v]) entries[chains.Find(v)].push_back(v);
  IntLists default_groups = ExplicitGroups(m.num_replicas, group_size);
  if (group_size <= 0) {
    std::vector<IntLists> seen;
    for (auto& [chain, ars] : entries)
      for (ValueId a : ars)
        if (std::find(seen.begin(), seen.end(), ReplicaGroups(m.at(a), m.num_replicas)) == seen.end())
          seen.push_back(ReplicaGroups(m.at(a), m.num_replicas));
    if (seen.size() == 1) default_groups = seen[0];  // else all replicas
  }
  std::map<ValueId, IntLists> chain_groups;
  for (auto& [chain, ars] : entries) {
    const IntLists groups = ReplicaGroups(m.at(ars[0]), m.num_replicas);
    for (ValueId a : ars) {
      if (ReplicaGroups(m.at(a), m.num_replicas) == groups) continue;
      std::string vars;
      for (auto& [var, val] : m.assigns)
        if (grouped[var] && chains.Find(var) == chain) vars += (vars.empty() ? "" : ", ") + PrintName(m.at(var).name);
      throw Error(Str(where, "the updates of ", vars, " are one computation, but its gradient all-reduces use different "
                      "replica groups: %", ars[0], " (all_reduce) groups=", GroupsText(groups), " and %", a,
                      " (all_reduce) groups=", GroupsText(ReplicaGroups(m.at(a), m.num_replicas)),
                      "; sharding needs one grouping per update chain"));
    }
    chain_groups[chain] = groups;
  }

  // One Rewriter per grouping, each over the chains sharded within it; the replicated scalars go to
  // the first (with a single grouping, the whole region is one Rewriter's, as before).
  std::vector<IntLists> groupings;
  std::vector<std::unique_ptr<Rewriter>> rewriters;
  auto rewriter_for = [&](const IntLists& groups) -> Rewriter& {
    for (size_t i = 0; i < groupings.size(); ++i)
      if (groupings[i] == groups) return *rewriters[i];
    groupings.push_back(groups);
    const int g = static_cast<int>(groups[0].size());
    rewriters.push_back(std::make_unique<Rewriter>(m, g, ContiguousGroups(m.num_replicas, g)));
    return *rewriters.back();
  };
  std::vector<Rewriter*> rw_of(n, nullptr);
  for (ValueId v = 0; v < n; ++v) {
    if (!grouped[v]) continue;
    auto it = chain_groups.find(chains.Find(v));
    rw_of[v] = &rewriter_for(it != chain_groups.end() ? it->second : default_groups);
  }
  if (rewriters.empty()) rewriter_for(default_groups);
  for (ValueId v = 0; v < n; ++v)
    if (region[v] && !rw_of[v]) rw_of[v] = rewriters[0].get();
  for (ValueId v = 0; v < n; ++v)
    if (region[v]) rw_of[v]->in_region_[v] = 1;
  bool any = false;
  for (auto& rw : rewriters) any |= rw->g_ > 1;
  out->per = per;
  out->region = std::move(region);
  out->rewriters = std::move(rewriters);
  out->rw_of = std::move(rw_of);
  return any;  // false: every update is reduced within groups of one replica, nothing to shard
}

}  // namespace

bool WeightUpdateSharder::Run(Module& m) {
  report_ = {};
  const Module before = m;
  UpdateRegion u;
  const bool found = FindUpdateRegion(m, o_.group_size, name(), &u);
  if (!u.rewriters.empty()) report_.group_size = static_cast<int>(u.rewriters[0]->g_);
  if (!found) return false;
  const int n = m.size();
  const std::vector<char>& per = u.per;
  const std::vector<char>& region = u.region;
  std::vector<std::unique_ptr<Rewriter>>& rewriters = u.rewriters;
  std::vector<Rewriter*>& rw_of = u.rw_of;
  auto rw_at = [&](ValueId v) -> Rewriter& { return u.at(v); };
  auto is_model_state = [&](ValueId var) { return IsModelState(m, var); };
  auto users = m.Users();

  // 3. Sharded variables.
  for (ValueId v : m.Variables()) {
    Instr& var = m.at(v);
    Rewriter& rw = rw_at(v);
    const int64_t g = rw.g_;
    VariableShardingRow row;
    row.name = var.name;
    row.role = var.GetString("role", "");
    row.bytes_before = row.bytes_after = var.type.bytes();
    row.format = "-";
    ValueId assigned = m.AssignedValue(v);
    bool only_update = true;
    for (ValueId u : users[v]) only_update &= region[u] != 0;
    for (auto& [name, out] : m.outputs) only_update &= out != v;
    const bool is_state = row.role == kRoleOptimizerState, is_weight = row.role == kRoleWeight;
    const std::string in_group = rewriters.size() > 1 ? Str(" (groups of ", g, ")") : "";
    if (row.role == kRoleModelState) {
      row.why = "model state: replicated, assigned by the forward pass on every replica";
    } else if (var.type.shape.empty()) {
      row.why = "scalar: replicated";
    } else if (assigned == kNoValue || !region[assigned]) {
      row.why = "not updated by the weight update";
    } else if (g <= 1) {
      row.why = "its gradient is reduced within groups of one replica: replicated";
    } else if (is_weight && !o_.gather_at_start) {
      ShardFormat f = ShardFormat::For(var.type.shape, g);
      row.format = f.kind();
      row.padding = f.padding;
      row.why = "weight: update runs on a local slice, all-gathered at the end of the step" + in_group;
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
      row.why = (is_state ? "optimizer state: lives as a 1/N shard" : "weight: sharded, all-gathered at the start of the step") +
                in_group;
    } else {
      row.why = "replicated";
    }
    report_.variables.push_back(row);
  }
  // Weights kept sharded across steps: the forward and backward read the all-gathered value.
  for (ValueId v : m.Variables()) {
    Rewriter& rw = rw_at(v);
    if (rw.shard_[v] != v || m.at(v).GetString("role", "") != kRoleWeight) continue;
    ValueId full = rw.Full(v);
    for (ValueId u : users[v])
      if (!region[u])
        for (ValueId& o : m.at(u).operands)
          if (o == v) o = full;
    for (auto& [name, out] : m.outputs)
      if (out == v) out = full;
  }

  // 4. Rebuild the region in order; a chain within groups of one stays as it is.
  for (ValueId v = 0; v < n; ++v) {
    if (!region[v]) continue;
    Rewriter& rw = *rw_of[v];
    if (rw.g_ <= 1) {
      rw.full_[v] = v;
      continue;
    }
    if (rw.RewriteFullReduction(v)) report_.reductions.push_back(rw.reductions_.back());
    else rw.Rewrite(v);
  }
  for (auto& rw : rewriters) report_.fallbacks.insert(report_.fallbacks.end(), rw->fallbacks_.begin(), rw->fallbacks_.end());

  // 5. Assignments. The gradient entries are dropped: the optimizer consumed them, and keeping the
  // whole all-reduced gradient alive would keep the all-reduce the reduce-scatter replaced.
  for (auto& [var, val] : m.assigns) {
    if (per[val] || is_model_state(var)) continue;
    Rewriter& rw = rw_of[var] ? *rw_of[var] : rw_at(val);
    val = rw.shard_[var] == var ? rw.Shard(val) : rw.Full(val);
  }
  for (auto& [name, out] : m.outputs)
    if (out < n && region[out]) out = rw_at(out).Full(out);
  // 6. Code outside the region that reads a value of the region reads its rewritten (full) value: the
  // nonfinite guard's step_finite flag (and its broadcasts, shared by CSE) also gates the model state's
  // assignments (batch-norm running statistics), and its original computation reads every whole
  // all-reduced gradient, which would keep alive the all-reduces the reduce-scatters replaced.
  for (ValueId user = 0; user < n; ++user) {
    if (region[user]) continue;
    for (size_t i = 0; i < m.at(user).operands.size(); ++i) {
      const ValueId o = m.at(user).operands[i];
      if (o >= n || !region[o]) continue;
      const Instr in = m.at(o);  // copy: the rewriters append to m.instrs
      Rewriter& rw = rw_at(o);
      ValueId full = rw.full_[o];
      if (full == kNoValue && in.op == OpCode::kBroadcast)  // a broadcast flag: broadcast again, don't gather
        full = rw.full_[o] = rw.Clone(in, {rw.Full(in.operands[0])});
      if (full == kNoValue) full = rw.Full(o);
      m.at(user).operands[i] = full;
    }
  }
  m.gradients.clear();
  m.Canonicalize();
  return !(m == before);
}

bool ShardOrderReductions::Run(Module& m) {
  reductions_.clear();
  UpdateRegion u;
  try {
    if (!FindUpdateRegion(m, o_.group_size, name(), &u)) return false;
  } catch (const Error&) {
    return false;  // the sharder refuses this module (its replica groups): there is no sharded program to agree with
  }
  // The same reductions step 4 of the sharder partitions: full reductions in the region of a chain of g > 1.
  std::vector<std::pair<ValueId, ValueId>> replaced;
  const int n = m.size();  // the rewrites append
  for (ValueId v = 0; v < n; ++v) {
    if (!u.region[v]) continue;
    Rewriter& rw = u.at(v);
    if (rw.g_ <= 1 || !rw.IsFullReduction(v)) continue;
    replaced.push_back({v, rw.ShardOrderReduction(v)});
    reductions_.push_back(rw.reductions_.back());
  }
  if (replaced.empty()) return false;
  for (auto [from, to] : replaced) m.ReplaceAllUses(from, to);
  m.Canonicalize();
  return true;
}

}  // namespace shardstep::ir
