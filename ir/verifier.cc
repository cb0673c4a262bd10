// Verifier: walks a module once and throws shardstep::Error at the first broken invariant.
#include "ir/verifier.h"

#include <set>

#include "ir/error.h"
#include "ir/printer.h"
#include "ir/shape_inference.h"

namespace shardstep::ir {
namespace {

std::string Where(const Module& m, ValueId id) { return Str("%", id, " (", OpName(m.instrs[id].op), ")"); }

void VerifyInstr(const Module& m, ValueId id, std::set<std::string>* variables, std::set<std::string>* inputs) {
  const Instr& in = m.instrs[id];
  auto fail = [&](const std::string& why) {
    throw Error(Str("module ", PrintName(m.name), ": ", Where(m, id), ": ", why));
  };
  for (ValueId o : in.operands)
    if (o < 0 || o >= id) fail(Str("operand %", o, " is not defined before use"));
  const int arity = OpArity(in.op), n = static_cast<int>(in.operands.size());
  if (HasProperty(in.op, kLeaf) && n != 0) fail(Str("a leaf takes no operands, got ", n));
  if (arity >= 0 && n != arity) fail(Str("takes ", arity, arity == 1 ? " operand" : " operands", ", got ", n));
  if (arity < 0 && n < 1) fail("takes at least 1 operand, got 0");
  if (in.op == OpCode::kVariable || in.op == OpCode::kInput) {
    auto* names = in.op == OpCode::kVariable ? variables : inputs;
    if (in.name.empty()) fail("has no name");
    if (!names->insert(in.name).second) fail(Str("name ", PrintName(in.name), " is used twice"));
  }
  std::vector<TensorType> types;
  for (ValueId o : in.operands) types.push_back(m.instrs[o].type);
  TensorType inferred;
  try {
    inferred = InferType(in.op, types, in.attrs, &in.type);
  } catch (const Error& e) {
    fail(e.what());
  }
  if (inferred != in.type)
    fail(Str("recorded type ", in.type.ToString(), " but its operands give ", inferred.ToString()));
  if (HasProperty(in.op, kCollective) && in.Has("groups")) {  // ReplicaGroups() relies on this shape
    const AttrValue& g = in.attrs.at("groups");
    auto* flat = std::get_if<IntList>(&g);
    if (!std::holds_alternative<IntLists>(g) && !(flat && flat->empty()))
      fail("attribute 'groups' must be a list of replica lists such as [[0,1],[2,3]]");
  }
}

// gradient/assign entries: (variable, value) pairs, each variable at most once.
void VerifyUpdates(const Module& m, const std::vector<std::pair<ValueId, ValueId>>& entries, const char* what) {
  std::set<ValueId> seen;
  for (const auto& [var, v] : entries) {
    auto fail = [&](const std::string& why) {
      throw Error(Str("module ", PrintName(m.name), ": ", what, " %", var, " = %", v, ": ", why));
    };
    if (var < 0 || var >= m.size() || m.instrs[var].op != OpCode::kVariable)
      fail(Str("target %", var, " is not a variable"));
    if (v < 0 || v >= m.size()) fail(Str("value %", v, " is not defined"));
    const Instr& target = m.instrs[var];
    if (m.instrs[v].type != target.type)
      fail(Str("value type ", m.instrs[v].type.ToString(), " differs from variable ", PrintName(target.name), " type ",
               target.type.ToString()));
    if (!seen.insert(var).second) fail(Str("variable ", PrintName(target.name), " has a second ", what));
  }
}

}  // namespace

void Verify(const Module& m) {
  if (m.num_replicas < 1)
    throw Error(Str("module ", PrintName(m.name), ": replicas=", m.num_replicas, " must be at least 1"));
  std::set<std::string> variables, inputs;
  for (ValueId id = 0; id < m.size(); ++id) VerifyInstr(m, id, &variables, &inputs);
  VerifyUpdates(m, m.gradients, "gradient");
  VerifyUpdates(m, m.assigns, "assign");
  std::set<std::string> outputs;
  for (const auto& [name, v] : m.outputs) {
    auto fail = [&](const std::string& why) {
      throw Error(Str("module ", PrintName(m.name), ": output ", PrintName(name), " = %", v, ": ", why));
    };
    if (v < 0 || v >= m.size()) fail(Str("value %", v, " is not defined"));
    if (!outputs.insert(name).second) fail("output name used twice");
  }
}

}  // namespace shardstep::ir
