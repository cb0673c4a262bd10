// Shard formats. The verifier checks every variable's shard spec; the checks here are internal
// invariants (a bug, or a module that skipped the verifier), never undefined behaviour.
#include "ir/shard_format.h"

#include "ir/error.h"

namespace shardstep::ir {

ShardFormat ShardFormat::For(const Shape& logical, int64_t count) {
  SS_CHECK(count >= 1, "shard count ", count, " for logical shape ", ShapeToString(logical));
  for (int64_t d : logical) SS_CHECK(d >= 0, "negative dimension in logical shape ", ShapeToString(logical));
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
  SS_CHECK(count >= 1, "shard count ", count);
  if (!flat) {
    SS_CHECK(!logical.empty() && logical[0] % count == 0, "logical shape ", ShapeToString(logical),
             " does not split along dimension 0 into ", count, " parts");
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
  *out = For(v.GetInts("logical_shape"), v.GetInt("shard_count"));  // GetInts/GetInt check the types
  SS_CHECK(v.GetString("shard_format") == out->kind(), "@", v.name, " says shard_format=", v.GetString("shard_format"),
           " but its logical shape gives ", out->kind());
  return true;
}

}  // namespace shardstep::ir
