// The IR module: one whole training step as SSA instructions plus variable assignments.
//
// Values are instructions, numbered by their position (ValueId). Leaves are variables (persistent
// state, named with @name and a role attribute), inputs (the per-replica batch), constants and the
// replica id. At the end of the step each `assign` writes a value to a variable; `gradient` entries
// record d(loss)/d(variable) (filled by autodiff); `output` entries name values the caller reads
// (the loss, metrics).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "ir/op.h"
#include "ir/types.h"

namespace shardstep::ir {

using ValueId = int32_t;
constexpr ValueId kNoValue = -1;

using IntList = std::vector<int64_t>;
using IntLists = std::vector<std::vector<int64_t>>;
using AttrValue = std::variant<int64_t, double, std::string, IntList, IntLists>;
using Attrs = std::map<std::string, AttrValue>;

// Variable roles (attribute "role").
inline constexpr const char* kRoleWeight = "weight";
inline constexpr const char* kRoleOptimizerState = "optimizer_state";
inline constexpr const char* kRoleStep = "step";
// Non-trainable state updated by assignment in the forward pass (batch-norm running statistics):
// never given a gradient, never touched by the optimizer, never sharded.
inline constexpr const char* kRoleModelState = "model_state";

struct Instr {
  OpCode op = OpCode::kConstant;
  std::vector<ValueId> operands;
  TensorType type;
  Attrs attrs;
  std::string name;  // variables and inputs only

  bool Has(const std::string& key) const { return attrs.count(key) != 0; }
  int64_t GetInt(const std::string& key) const;          // internal error when missing
  int64_t GetInt(const std::string& key, int64_t dflt) const;
  double GetFloat(const std::string& key) const;         // accepts an int too
  const std::string& GetString(const std::string& key) const;
  std::string GetString(const std::string& key, const std::string& dflt) const;
  const IntList& GetInts(const std::string& key) const;
  IntList GetInts(const std::string& key, const IntList& dflt) const;
  IntLists GetIntLists(const std::string& key) const;    // empty when missing
  bool operator==(const Instr& o) const;
};

struct Module {
  std::string name = "step";
  int num_replicas = 1;
  std::vector<Instr> instrs;
  std::vector<std::pair<ValueId, ValueId>> assigns;    // (variable, new value)
  std::vector<std::pair<ValueId, ValueId>> gradients;  // (variable, d loss / d variable)
  std::vector<std::pair<std::string, ValueId>> outputs;

  const Instr& at(ValueId v) const;
  Instr& at(ValueId v);
  const TensorType& type(ValueId v) const { return at(v).type; }
  int size() const { return static_cast<int>(instrs.size()); }

  ValueId FindVariable(const std::string& name) const;  // kNoValue when absent
  ValueId FindInput(const std::string& name) const;
  ValueId FindOutput(const std::string& name) const;
  ValueId GradientOf(ValueId variable) const;
  ValueId AssignedValue(ValueId variable) const;
  std::vector<ValueId> Variables() const;  // in module order
  std::vector<ValueId> Inputs() const;
  std::vector<ValueId> VariablesWithRole(const std::string& role) const;

  // Appends an instruction (no checking; use Builder for inferred types).
  ValueId Append(Instr instr);
  // Redirects every use of `from` (operands, assigns, gradients, outputs) to `to`, except inside
  // instruction `except` (pass kNoValue for none).
  void ReplaceAllUses(ValueId from, ValueId to, ValueId except = kNoValue);
  // Topologically sorts (stable: keeps the existing order where it can), drops dead non-leaf
  // instructions, keeps every variable and input, and renumbers. Passes append freely, then call this.
  // With `place` (one entry per instruction), an instruction is ordered as if it stood at position
  // place[v] (ties by id): a pass that appends the replacement of an earlier op keeps it where that op
  // ran, before the values computed after it.
  void Canonicalize(const std::vector<ValueId>& place = {});
  // Users of each value.
  std::vector<std::vector<ValueId>> Users() const;
  // 1 for values that differ between replicas: inputs, the replica id and what depends on them. An
  // all-reduce's result is the same on every replica of its group again.
  std::vector<char> PerReplicaValues() const;

  bool operator==(const Module& o) const;
};

}  // namespace shardstep::ir
