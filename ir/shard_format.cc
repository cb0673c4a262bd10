// Shard formats.
#include "ir/shard_format.h"

namespace shardstep::ir {

ShardFormat ShardFormat::For(const Shape& logical, int64_t count) {
  ShardFormat f;
  f.logical = logical;
  f.count = count;
  if (!logical.empty() && logical[0] % count == 0) return f;
  f.flat = true;
  const int64_t e = NumElements(logical);
  f.padding = (count - e % count) % count;
  return f;
}

Shape ShardFormat::ShardShape() const {
  if (!flat) {
    Shape s = logical;
    s[0] /= count;
    return s;
  }
  return {(NumElements(logical) + padding) / count};
}

Shape ShardFormat::FormattedShape() const {
  Shape s = ShardShape();
  s[0] *= count;
  return s;
}

void ShardFormat::ToAttrs(Attrs* attrs) const {
  (*attrs)["shard_format"] = std::string(kind());
  (*attrs)["shard_count"] = count;
  (*attrs)["logical_shape"] = IntList(logical);
}

bool ShardFormat::FromAttrs(const Instr& v, ShardFormat* out) {
  if (!v.Has("shard_format")) return false;
  *out = For(v.GetInts("logical_shape"), v.GetInt("shard_count"));
  return true;
}

}  // namespace shardstep::ir
