// LayOutAllReducesInShardOrder (see the header).
#include "tpu_backend/mesh_shard_order.h"

#include <vector>

#include "ir/builder.h"
#include "ir/shape_inference.h"

namespace shardstep::tpu {

using ir::OpCode;
using ir::ValueId;

bool LayOutAllReducesInShardOrder(ir::Module& m) {
  std::vector<ValueId> targets;
  for (ValueId v = 0; v < m.size(); ++v) {
    const ir::Instr& in = m.at(v);
    if (in.op != OpCode::kAllReduce || in.GetString("reduction", "") != "mean") continue;
    const ir::Instr& x = m.at(in.operands[0]);
    if (x.op != OpCode::kConcat || x.GetInt("axis", -1) != 0 || x.operands.size() < 2) continue;
    bool flat = in.type.dtype == ir::DType::kF32;
    for (ValueId p : x.operands) flat &= m.type(p).shape.size() == 1;
    const ir::IntLists groups = ir::ReplicaGroups(in, m.num_replicas);
    if (flat && !groups.empty() && groups[0].size() > 1) targets.push_back(v);
  }
  for (ValueId v : targets) {
    ir::Builder b(&m);
    const ir::Attrs attrs = m.at(v).attrs;
    const std::vector<ValueId> parts = m.at(m.at(v).operands[0]).operands;
    const int64_t g = static_cast<int64_t>(ir::ReplicaGroups(m.at(v), m.num_replicas)[0].size());
    std::vector<ValueId> rows;
    std::vector<int64_t> sizes, widths;
    for (ValueId p : parts) {
      const int64_t n = m.type(p).elements(), k = (n + g - 1) / g;
      sizes.push_back(n);
      widths.push_back(k);
      const ValueId padded = g * k == n ? p : b.Pad(p, {0}, {g * k - n});
      rows.push_back(b.Reshape(padded, {g, k}));
    }
    const ValueId packed = b.Concat(rows, 1);
    const int64_t total = b.type(packed).elements();
    const ValueId reduced = b.Emit(OpCode::kAllReduce, {b.Reshape(packed, {total})}, attrs);
    const ValueId grid = b.Reshape(reduced, {g, total / g});
    std::vector<ValueId> back;
    int64_t off = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const ValueId cols = b.Reshape(b.Slice(grid, {0, off}, {g, off + widths[i]}), {g * widths[i]});
      back.push_back(g * widths[i] == sizes[i] ? cols : b.Slice(cols, {0}, {sizes[i]}));
      off += widths[i];
    }
    m.ReplaceAllUses(v, b.Concat(back, 0));
  }
  if (!targets.empty()) m.Canonicalize();
  return !targets.empty();
}

}  // namespace shardstep::tpu
