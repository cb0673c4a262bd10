// CollectiveCombiner.
//
// Algorithm:
//  1. Walk the collectives in order; candidates share a key (op, reduction, groups, group size,
//     dtype). A candidate joins the open group of its key unless it depends on a member (that
//     would make a cycle) or the group would pass the byte or count threshold; else it opens a new one.
//     Only the first group found is packed, then the dependencies are recomputed and the walk
//     repeats: a packed op depends on all its members' operands, which can make collectives of
//     another kind dependent on each other (packing two groups at once could close a cycle).
//  2. Replace each group of two or more by one collective over a packed buffer:
//       reduce-scatter: each x_i [G*a_i, ...] -> [G, k_i]; concat on axis 1 -> [G, K] -> [G*K];
//                       reduce-scatter -> [K]; member i is columns [o_i, o_i + k_i) reshaped.
//                       Row p of [G, k_i] is exactly the chunk replica p would have received,
//                       so one reduce-scatter hands every replica its slice of every tensor.
//       all-gather:     each y_i flattened to [k_i]; concat -> [K]; all-gather -> [G*K] -> [G, K];
//                       member i is columns [o_i, o_i + k_i) reshaped to [G*a_i, ...].
//       all-reduce:     flatten, concat, all-reduce, slice back.
//     A member packed in an earlier round (reduce-scatter or all-gather) is taken apart: its parts join
//     the new packed buffer and its slices read the new result at their new columns, so packing
//     twice never nests a concat in a concat or a slice in a slice (each a copy of every byte).
//  3. Canonicalize (the packed op depends on every member's operand; users follow it).
#include "ir/passes/collective_combiner.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "ir/builder.h"
#include "ir/error.h"
#include "ir/printer.h"

namespace shardstep::ir {
namespace {

std::string Key(const Instr& in) {
  std::string k = std::string(OpName(in.op)) + "/" + in.GetString("reduction", "") + "/" + DTypeName(in.type.dtype);
  auto it = in.attrs.find("groups");
  if (it != in.attrs.end()) k += "/" + PrintAttrValue(it->second);
  k += "/" + std::to_string(in.GetInt("group_size", 0));
  return k;
}

// Replaces every use of from[i] by to[i] in one walk over the module: what ReplaceAllUses does per pair
// (the pieces never use a member, so the order of the replacements does not matter), without a walk
// per member.
void ReplaceUses(Module& m, const std::vector<ValueId>& from, const std::vector<ValueId>& to) {
  std::vector<ValueId> with(m.size(), kNoValue);
  for (size_t i = 0; i < from.size(); ++i) with[from[i]] = to[i];
  auto replace = [&](ValueId& v) {
    if (v >= 0 && v < static_cast<ValueId>(with.size()) && with[v] != kNoValue) v = with[v];
  };
  for (Instr& in : m.instrs)
    for (ValueId& o : in.operands) replace(o);
  for (auto& [var, v] : m.assigns) replace(v);
  for (auto& [var, g] : m.gradients) replace(g);
  for (auto& [name, v] : m.outputs) replace(v);
}

// A member that is itself a packed collective of an earlier round, taken apart so the new packing
// holds its parts, not a copy of its packed buffer (a concat of a concat on the way in, a slice of a
// slice on the way out: two copies of every byte instead of one). `parts`: its packed parts;
// `slices`: the slices that read its result (for an all-gather, through reshape(c, {G, K})), which
// will read the new collective at `base` further on; empty when the member is not such a collective.
struct Unpacked {
  std::vector<ValueId> parts, slices;
};
Unpacked Unpack(const Module& m, const std::vector<std::vector<ValueId>>& users, const std::vector<char>& held,
                ValueId v) {
  const Instr& in = m.at(v);
  if (in.GetInt("combined", 1) < 2 || held[v]) return {};
  ValueId x = in.operands[0];
  const bool rs = in.op == OpCode::kReduceScatter;
  if (rs) {  // operand: reshape(concat(parts, axis 1) [G, K], {G * K})
    if (m.at(x).op != OpCode::kReshape) return {};
    x = m.at(x).operands[0];
  }
  const Instr& packed = m.at(x);
  if (packed.op != OpCode::kConcat || packed.GetInt("axis") != (rs ? 1 : 0)) return {};
  Unpacked u;
  u.parts = packed.operands;
  // The reads of the result: slices (reduce-scatter, all-reduce) or slices of reshape(c, {G, K}) (all-gather).
  std::vector<ValueId> readers;
  if (in.op == OpCode::kAllGather) {
    for (ValueId r : users[v]) {
      if (m.at(r).op != OpCode::kReshape || held[r] || m.type(r).rank() != 2) return {};
      readers.insert(readers.end(), users[r].begin(), users[r].end());
    }
  } else {
    readers = users[v];
  }
  for (ValueId r : readers) {
    if (m.at(r).op != OpCode::kSlice) return {};
    u.slices.push_back(r);
  }
  return u;
}

ValueId Combine(Builder& b, Module& m, const std::vector<ValueId>& members) {
  const Instr first = m.at(members[0]);
  const auto users = m.Users();
  std::vector<char> held(m.size(), 0);  // outputs, assigned values, gradients: not only read by ops
  for (auto& [name, v] : m.outputs) held[v] = 1;
  for (auto& [var, v] : m.assigns) held[v] = 1;
  for (auto& [var, v] : m.gradients) held[v] = 1;
  std::vector<ValueId> pieces, replaced;  // member i's replacement
  const OpCode op = first.op;
  Attrs attrs = first.attrs;
  int64_t originals = 0;
  for (ValueId v : members) originals += m.at(v).GetInt("combined", 1);
  attrs["combined"] = originals;  // how many collectives this one packs
  std::vector<ValueId> parts;
  std::vector<int64_t> widths;     // per member, its columns in the packed buffer
  std::vector<Unpacked> unpacked;  // per member
  const bool rs = op == OpCode::kReduceScatter;
  const int64_t g = first.GetInt("group_size", 1);
  for (ValueId v : members) {
    unpacked.push_back(op == OpCode::kAllReduce ? Unpacked{} : Unpack(m, users, held, v));
    ValueId x = m.at(v).operands[0];
    if (!unpacked.back().parts.empty()) {
      parts.insert(parts.end(), unpacked.back().parts.begin(), unpacked.back().parts.end());
      widths.push_back(rs ? m.type(x).elements() / g : m.type(x).elements());
    } else if (rs) {
      widths.push_back(m.type(x).elements() / g);
      parts.push_back(b.Reshape(x, {g, widths.back()}));
    } else {
      widths.push_back(m.type(x).elements());
      parts.push_back(b.Reshape(x, {widths.back()}));
    }
  }
  // The slices of an unpacked member read the new result `from`, `base` columns further on.
  auto move_slices = [&](const Unpacked& u, ValueId from, int64_t base) {
    for (ValueId s : u.slices) {
      Instr& in = m.at(s);
      in.operands[0] = from;
      IntList start = in.GetInts("start"), limit = in.GetInts("limit");
      start.back() += base;
      limit.back() += base;
      in.attrs["start"] = start;
      in.attrs["limit"] = limit;
    }
  };
  ValueId c = kNoValue, rows = kNoValue;
  if (rs) {
    ValueId packed = b.Concat(parts, 1);
    c = b.Emit(op, {b.Reshape(packed, {NumElements(b.shape(packed))})}, attrs);
    rows = c;
  } else {
    ValueId packed = b.Concat(parts, 0);
    c = b.Emit(op, {packed}, attrs);
    rows = op == OpCode::kAllGather ? b.Reshape(c, {g, b.type(packed).elements()}) : c;
  }
  int64_t off = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    if (!unpacked[i].parts.empty()) {
      move_slices(unpacked[i], rows, off);
    } else {
      const Shape shape = m.type(members[i]).shape;  // a copy: the builder may reallocate m.instrs
      const ValueId piece = op == OpCode::kAllGather ? b.Slice(rows, {0, off}, {g, off + widths[i]})
                                                     : b.Slice(c, {off}, {off + widths[i]});
      pieces.push_back(b.Reshape(piece, shape));
      replaced.push_back(members[i]);
    }
    off += widths[i];
  }
  ReplaceUses(m, replaced, pieces);
  return c;
}

// The dependency bitsets of FirstGroup, kept across its calls: a fresh multi-megabyte array per packed
// group cost more in page faults than the walk itself on a bert-large step.
thread_local std::vector<uint64_t> deps_scratch;

}  // namespace

// The first group of two or more collectives that can be packed (empty when none).
std::vector<ValueId> CollectiveCombiner::FirstGroup(const Module& m) const {
  const int n = m.size();
  // Collectives each value depends on (bitsets over the collectives' indices).
  std::vector<ValueId> colls;
  std::vector<int> index(n, -1);
  for (ValueId v = 0; v < n; ++v)
    if (HasProperty(m.at(v).op, kCollective)) {
      index[v] = static_cast<int>(colls.size());
      colls.push_back(v);
    }
  if (colls.size() < 2) return {};
  // One flat array, filled in module order only as far as the walk below gets (it usually stops at the
  // first group that closes; this pass runs the walk once per packed group).
  const size_t words = (colls.size() + 63) / 64;
  std::vector<uint64_t>& deps = deps_scratch;
  deps.resize(static_cast<size_t>(n) * words);  // each row is cleared when it is filled
  ValueId filled = 0;
  auto fill_to = [&](ValueId last) {
    for (; filled <= last; ++filled) {
      uint64_t* d = &deps[static_cast<size_t>(filled) * words];
      std::fill(d, d + words, uint64_t{0});
      for (ValueId o : m.at(filled).operands) {
        const uint64_t* od = &deps[static_cast<size_t>(o) * words];
        for (size_t w = 0; w < words; ++w) d[w] |= od[w];
        if (index[o] >= 0) d[index[o] / 64] |= 1ull << (index[o] % 64);
      }
    }
  };
  struct Group {
    std::vector<ValueId> members;
    int64_t bytes = 0;
    int64_t count = 0;  // original collectives (a packed one counts its members)
  };
  std::map<std::string, Group> open;
  for (ValueId v : colls) {
    const Instr& in = m.at(v);
    const int64_t bytes = std::max(in.type.bytes(), m.type(in.operands[0]).bytes());
    const int64_t count = in.GetInt("combined", 1);
    Group& g = open[Key(in)];
    fill_to(v);
    const uint64_t* dv = &deps[static_cast<size_t>(v) * words];
    bool depends = false;
    for (ValueId u : g.members) depends |= (dv[index[u] / 64] >> (index[u] % 64)) & 1;
    if (depends || g.bytes + bytes > max_bytes_ || g.count + count > max_count_) {
      if (g.members.size() > 1) return g.members;
      g = Group{};
    }
    g.members.push_back(v);
    g.bytes += bytes;
    g.count += count;
  }
  for (auto& [key, g] : open)
    if (g.members.size() > 1) return g.members;
  return {};
}

bool CollectiveCombiner::Run(Module& m) {
  if (max_bytes_ <= 0 || max_count_ < 2) return false;
  bool changed = false;
  for (std::vector<ValueId> group = FirstGroup(m); !group.empty(); group = FirstGroup(m)) {
    m.instrs.reserve(m.instrs.size() + 4 * group.size() + 8);  // the appends below: no reallocation per op
    Builder b(&m);
    Combine(b, m, group);
    m.Canonicalize();
    changed = true;
  }
  return changed;
}

}  // namespace shardstep::ir
