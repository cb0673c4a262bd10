// LowerCollectivesToRingSteps (see the header).
#include "tpu_backend/ring_lowering.h"

#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/shape_inference.h"

namespace shardstep::tpu {

using ir::DType;
using ir::OpCode;
using ir::ValueId;

namespace {

// The halves of the p local chunks of one phase: lo[k] (ceil(c/2) floats) and hi[k] (floor(c/2);
// none when c == 1). kNoValue where a chunk is not known yet (all-gather).
struct Halves {
  int64_t nlo = 0, nhi = 0;
  std::vector<ValueId> lo, hi;
};

class RingLowerer {
 public:
  RingLowerer(ir::Module& m, const MeshTopology& mesh) : m_(m), mesh_(mesh), b_(&m) {}

  // The whole mesh (nullopt) or one axis's groups; the lowered value replaces collective v.
  ValueId Lower(ValueId v, std::optional<MeshAxis> axis) {
    const ir::Instr in = m_.at(v);
    const ir::TensorType type = in.type;
    ValueId x = m_.at(v).operands[0];
    const int64_t g = axis ? mesh_.AxisSize(*axis) : mesh_.replicas();
    const std::string reduction = in.GetString("reduction", "sum");
    const bool max = reduction == "max", mean = reduction == "mean";
    const int64_t nin = m_.type(x).elements(), nout = type.elements();
    if (g == 1 || nin == 0 || nout == 0) return b_.Reshape(x, type.shape);  // nothing moves
    x = b_.Reshape(b_.Convert(x, DType::kF32), {nin});
    ValueId out;
    if (in.op == OpCode::kAllGather) {
      out = AllGather(x, axis);
    } else if (in.op == OpCode::kReduceScatter) {
      out = Finish(ReduceScatter(x, axis, max), mean, g);
    } else {  // all-reduce: reduce-scatter + all-gather of the zero-padded buffer, as MeshCollectives
      const int64_t shard = (nin + g - 1) / g;
      const ValueId padded = shard * g == nin ? x : b_.Pad(x, {0}, {shard * g - nin});
      const ValueId full = AllGather(Finish(ReduceScatter(padded, axis, max), mean, g), axis);
      out = shard * g == nin ? full : b_.Slice(full, {0}, {nin});
    }
    return b_.Convert(b_.Reshape(out, type.shape), type.dtype);
  }

 private:
  ValueId Finish(ValueId shard, bool mean, int64_t g) {
    return mean ? b_.Div(shard, b_.ScalarLike(static_cast<double>(g), shard)) : shard;
  }

  std::vector<MeshAxis> Axes(std::optional<MeshAxis> axis, bool reduce) const {
    if (axis) return {*axis};
    if (reduce) return {MeshAxis::kCore, MeshAxis::kX, MeshAxis::kY};
    return {MeshAxis::kY, MeshAxis::kX, MeshAxis::kCore};
  }

  ValueId S32(int64_t value) { return b_.Scalar(static_cast<double>(value), DType::kS32); }
  // a mod p for a >= 0 (s32).
  ValueId Mod(ValueId a, int64_t p) {
    const ValueId q = b_.Div(a, b_.ScalarLike(static_cast<double>(p), a));
    return b_.Sub(a, b_.Mul(q, b_.ScalarLike(static_cast<double>(p), a)));
  }
  // This replica's coordinate along `axis` (replica = (core·X + x)·Y + y), from replica_id.
  ValueId Position(MeshAxis axis) {
    auto it = position_.find(axis);
    if (it != position_.end()) return it->second;
    if (replica_ == ir::kNoValue) replica_ = b_.ReplicaId();
    const int64_t X = mesh_.x(), Y = mesh_.y();
    ValueId pos = axis == MeshAxis::kCore ? b_.Div(replica_, S32(X * Y))
                  : axis == MeshAxis::kX  ? Mod(b_.Div(replica_, S32(Y)), X)
                                          : Mod(replica_, Y);
    return position_[axis] = pos;
  }
  // s32[p]: (k + pos) mod p (rotate) or (k - pos) mod p (put back in order), k = 0 .. p-1.
  ValueId RotationIndex(MeshAxis axis, bool inverse) {
    auto key = std::make_pair(axis, inverse);
    if (auto it = rotation_.find(key); it != rotation_.end()) return it->second;
    const int64_t p = mesh_.AxisSize(axis);
    const ValueId k = b_.Iota({DType::kS32, {p}}, 0);
    const ValueId shift = inverse ? b_.Sub(S32(p), Position(axis)) : Position(axis);
    return rotation_[key] = Mod(b_.Add(k, b_.BroadcastScalar(shift, {p})), p);
  }
  // region f32[p·c] -> [p, c] with row k = chunk (k ± pos) mod p.
  ValueId Rotate(ValueId region2d, MeshAxis axis, bool inverse) {
    return b_.Emit(OpCode::kGather, {region2d, RotationIndex(axis, inverse)});
  }

  ValueId Permute(ValueId value, MeshAxis axis, int dir) {
    const int p = mesh_.AxisSize(axis);
    ir::IntLists pairs;
    for (const auto& group : mesh_.GroupsAlong(axis))
      for (int i = 0; i < p; ++i) pairs.push_back({group[i], group[((i + dir) % p + p) % p]});
    return b_.Emit(OpCode::kCollectivePermute, {value}, {{"pairs", pairs}, {"direction", int64_t{dir}}});
  }
  ValueId Fold(ValueId own, ValueId received, bool max) {
    return max ? b_.Binary(OpCode::kMax, own, received) : b_.Add(own, received);
  }

  Halves Split(ValueId rows, int64_t p, int64_t c) {  // rows f32[p, c]
    Halves h{(c + 1) / 2, c / 2, std::vector<ValueId>(p), std::vector<ValueId>(p, ir::kNoValue)};
    for (int64_t k = 0; k < p; ++k) {
      h.lo[k] = b_.Reshape(b_.Slice(rows, {k, 0}, {k + 1, h.nlo}), {h.nlo});
      if (h.nhi > 0) h.hi[k] = b_.Reshape(b_.Slice(rows, {k, h.nlo}, {k + 1, c}), {h.nhi});
    }
    return h;
  }
  ValueId Chunk(const Halves& h, int64_t k) { return h.nhi > 0 ? b_.Concat({h.lo[k], h.hi[k]}, 0) : h.lo[k]; }

  // x f32[g·shard] -> this member's reduced shard f32[shard].
  ValueId ReduceScatter(ValueId x, std::optional<MeshAxis> only, bool max) {
    ValueId region = x;
    for (MeshAxis axis : Axes(only, true)) {
      const int64_t p = mesh_.AxisSize(axis), c = m_.type(region).elements() / p;
      if (p < 2) continue;
      Halves h = Split(Rotate(b_.Reshape(region, {p, c}), axis, false), p, c);
      for (int64_t s = 0; s + 1 < p; ++s) {
        // Every member sends the same local chunks (see the header); the receiver folds own + received.
        const int64_t lo_from = p - 1 - s, lo_to = p - 2 - s, hi_from = s + 1, hi_to = (s + 2) % p;
        const ValueId lo_in = Permute(h.lo[lo_from], axis, +1);
        const ValueId hi_in = h.nhi > 0 ? Permute(h.hi[hi_from], axis, -1) : ir::kNoValue;
        h.lo[lo_to] = Fold(h.lo[lo_to], lo_in, max);
        if (h.nhi > 0) h.hi[hi_to] = Fold(h.hi[hi_to], hi_in, max);
      }
      region = Chunk(h, 0);
    }
    return region;
  }

  // own f32[shard] -> every member's shard in replica (group) order, f32[g·shard].
  ValueId AllGather(ValueId own, std::optional<MeshAxis> only) {
    ValueId region = own;
    for (MeshAxis axis : Axes(only, false)) {
      const int64_t p = mesh_.AxisSize(axis), c = m_.type(region).elements();
      if (p < 2) continue;
      Halves h{(c + 1) / 2, c / 2, std::vector<ValueId>(p, ir::kNoValue), std::vector<ValueId>(p, ir::kNoValue)};
      h.lo[0] = b_.Slice(region, {0}, {h.nlo});
      if (h.nhi > 0) h.hi[0] = b_.Slice(region, {h.nlo}, {c});
      for (int64_t s = 0; s + 1 < p; ++s) {
        h.lo[p - 1 - s] = Permute(h.lo[(p - s) % p], axis, +1);
        if (h.nhi > 0) h.hi[s + 1] = Permute(h.hi[s], axis, -1);
      }
      // Rows back in order: [p, c] of the local chunks, then the inverse rotation.
      std::vector<ValueId> lo_rows, hi_rows;
      for (int64_t k = 0; k < p; ++k) {
        lo_rows.push_back(b_.Reshape(h.lo[k], {1, h.nlo}));
        if (h.nhi > 0) hi_rows.push_back(b_.Reshape(h.hi[k], {1, h.nhi}));
      }
      ValueId rows = b_.Concat(lo_rows, 0);
      if (h.nhi > 0) rows = b_.Concat({rows, b_.Concat(hi_rows, 0)}, 1);
      region = b_.Reshape(Rotate(rows, axis, true), {p * c});
    }
    return region;
  }

  ir::Module& m_;
  const MeshTopology& mesh_;
  ir::Builder b_;
  ValueId replica_ = ir::kNoValue;
  std::map<MeshAxis, ValueId> position_;
  std::map<std::pair<MeshAxis, bool>, ValueId> rotation_;
};

ir::IntLists Sorted(ir::IntLists groups) {
  std::sort(groups.begin(), groups.end());
  return groups;
}

}  // namespace

int LowerCollectivesToRingSteps(ir::Module& m, const MeshTopology& mesh) {
  if (m.num_replicas != mesh.replicas())
    throw Error(Str("ring lowering: module \"", m.name, "\" has ", m.num_replicas, " replicas, the mesh of ",
                    mesh.ToString(), " has ", mesh.replicas()));
  struct Target {
    ValueId v;
    std::optional<MeshAxis> axis;  // nullopt: the whole mesh
    bool identity;                 // groups of one
  };
  std::vector<Target> targets;
  for (ValueId v = 0; v < m.size(); ++v) {
    const ir::Instr& in = m.at(v);
    if (in.op != OpCode::kAllReduce && in.op != OpCode::kReduceScatter && in.op != OpCode::kAllGather) continue;
    if (!ir::IsFloat(in.type.dtype)) continue;  // the collectives refuse s32 at run time; so does this
    const ir::IntLists groups = ir::ReplicaGroups(in, m.num_replicas);
    if (groups.size() == 1 && groups[0] == mesh.AllReplicas()) {
      targets.push_back({v, std::nullopt, mesh.replicas() == 1});
    } else if (groups[0].size() == 1) {
      targets.push_back({v, std::nullopt, true});
    } else {
      for (MeshAxis axis : {MeshAxis::kCore, MeshAxis::kX, MeshAxis::kY})
        if (Sorted(groups) == Sorted(mesh.GroupsAlong(axis))) {
          targets.push_back({v, axis, false});
          break;
        }
    }
  }
  RingLowerer lower(m, mesh);
  for (const Target& t : targets) {
    const ValueId x = m.at(t.v).operands[0];
    const ir::Shape shape = m.at(t.v).type.shape;  // g = 1: sum, mean and max of one are the operand
    m.ReplaceAllUses(t.v, t.identity ? ir::Builder(&m).Reshape(x, shape) : lower.Lower(t.v, t.axis));
  }
  if (!targets.empty()) m.Canonicalize();
  return static_cast<int>(targets.size());
}

}  // namespace shardstep::tpu
