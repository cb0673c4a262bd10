// Module queries and the rewriting helpers passes use (use replacement, canonical ordering).
#include "ir/module.h"

#include <algorithm>
#include <queue>

#include "ir/error.h"

namespace shardstep::ir {

// ---- Instr attribute access ----

int64_t Instr::GetInt(const std::string& key) const {
  auto it = attrs.find(key);
  SS_CHECK(it != attrs.end(), OpName(op), " has no attribute ", key);
  if (auto* d = std::get_if<double>(&it->second)) return static_cast<int64_t>(*d);
  SS_CHECK(std::holds_alternative<int64_t>(it->second), OpName(op), " attribute ", key, " is not an int");
  return std::get<int64_t>(it->second);
}

int64_t Instr::GetInt(const std::string& key, int64_t dflt) const { return Has(key) ? GetInt(key) : dflt; }

double Instr::GetFloat(const std::string& key) const {
  auto it = attrs.find(key);
  SS_CHECK(it != attrs.end(), OpName(op), " has no attribute ", key);
  if (auto* i = std::get_if<int64_t>(&it->second)) return static_cast<double>(*i);
  SS_CHECK(std::holds_alternative<double>(it->second), OpName(op), " attribute ", key, " is not a number");
  return std::get<double>(it->second);
}

const std::string& Instr::GetString(const std::string& key) const {
  auto it = attrs.find(key);
  SS_CHECK(it != attrs.end(), OpName(op), " has no attribute ", key);
  SS_CHECK(std::holds_alternative<std::string>(it->second), OpName(op), " attribute ", key, " is not a string");
  return std::get<std::string>(it->second);
}

std::string Instr::GetString(const std::string& key, const std::string& dflt) const {
  return Has(key) ? GetString(key) : dflt;
}

const IntList& Instr::GetInts(const std::string& key) const {
  auto it = attrs.find(key);
  SS_CHECK(it != attrs.end(), OpName(op), " has no attribute ", key);
  SS_CHECK(std::holds_alternative<IntList>(it->second), OpName(op), " attribute ", key, " is not an int list");
  return std::get<IntList>(it->second);
}

IntList Instr::GetInts(const std::string& key, const IntList& dflt) const { return Has(key) ? GetInts(key) : dflt; }

IntLists Instr::GetIntLists(const std::string& key) const {
  auto it = attrs.find(key);
  if (it == attrs.end()) return {};
  if (auto* l = std::get_if<IntList>(&it->second)) {
    SS_CHECK(l->empty(), OpName(op), " attribute ", key, " is not a list of lists");
    return {};
  }
  SS_CHECK(std::holds_alternative<IntLists>(it->second), OpName(op), " attribute ", key, " is not a list of lists");
  return std::get<IntLists>(it->second);
}

bool Instr::operator==(const Instr& o) const {
  return op == o.op && operands == o.operands && type == o.type && attrs == o.attrs && name == o.name;
}

// ---- Module ----

const Instr& Module::at(ValueId v) const {
  SS_CHECK(v >= 0 && v < size(), "value id ", v, " out of range ", size());
  return instrs[v];
}
Instr& Module::at(ValueId v) {
  SS_CHECK(v >= 0 && v < size(), "value id ", v, " out of range ", size());
  return instrs[v];
}

static ValueId FindLeaf(const Module& m, OpCode op, const std::string& name) {
  for (ValueId i = 0; i < m.size(); ++i)
    if (m.instrs[i].op == op && m.instrs[i].name == name) return i;
  return kNoValue;
}

ValueId Module::FindVariable(const std::string& n) const { return FindLeaf(*this, OpCode::kVariable, n); }
ValueId Module::FindInput(const std::string& n) const { return FindLeaf(*this, OpCode::kInput, n); }

ValueId Module::FindOutput(const std::string& n) const {
  for (auto& [name, v] : outputs)
    if (name == n) return v;
  return kNoValue;
}

ValueId Module::GradientOf(ValueId variable) const {
  for (auto& [var, g] : gradients)
    if (var == variable) return g;
  return kNoValue;
}

ValueId Module::AssignedValue(ValueId variable) const {
  for (auto& [var, v] : assigns)
    if (var == variable) return v;
  return kNoValue;
}

std::vector<ValueId> Module::Variables() const {
  std::vector<ValueId> out;
  for (ValueId i = 0; i < size(); ++i)
    if (instrs[i].op == OpCode::kVariable) out.push_back(i);
  return out;
}

std::vector<ValueId> Module::Inputs() const {
  std::vector<ValueId> out;
  for (ValueId i = 0; i < size(); ++i)
    if (instrs[i].op == OpCode::kInput) out.push_back(i);
  return out;
}

std::vector<ValueId> Module::VariablesWithRole(const std::string& role) const {
  std::vector<ValueId> out;
  for (ValueId v : Variables())
    if (instrs[v].GetString("role", "") == role) out.push_back(v);
  return out;
}

ValueId Module::Append(Instr instr) {
  instrs.push_back(std::move(instr));
  return size() - 1;
}

void Module::ReplaceAllUses(ValueId from, ValueId to, ValueId except) {
  for (ValueId i = 0; i < size(); ++i) {
    if (i == except) continue;
    for (ValueId& o : instrs[i].operands)
      if (o == from) o = to;
  }
  for (auto& [var, v] : assigns)
    if (v == from) v = to;
  for (auto& [var, g] : gradients)
    if (g == from) g = to;
  for (auto& [name, v] : outputs)
    if (v == from) v = to;
}

std::vector<std::vector<ValueId>> Module::Users() const {
  std::vector<std::vector<ValueId>> users(size());
  for (ValueId i = 0; i < size(); ++i)
    for (ValueId o : instrs[i].operands) users[o].push_back(i);
  return users;
}

std::vector<char> Module::PerReplicaValues() const {
  std::vector<char> per(size(), 0);
  for (ValueId v = 0; v < size(); ++v) {
    const Instr& in = instrs[v];
    if (in.op == OpCode::kInput || in.op == OpCode::kReplicaId) per[v] = 1;
    else if (in.op != OpCode::kAllReduce)
      for (ValueId o : in.operands) per[v] |= per[o];
  }
  return per;
}

void Module::Canonicalize(const std::vector<ValueId>& place) {
  const int n = size();
  SS_CHECK(place.empty() || place.size() == static_cast<size_t>(n), "Canonicalize: ", place.size(),
           " places for ", n, " instructions");
  // 1. Liveness: roots are variables, inputs, and everything assigned, output or recorded as gradient.
  std::vector<char> live(n, 0);
  std::vector<ValueId> work;
  auto mark = [&](ValueId v) {
    if (v >= 0 && !live[v]) { live[v] = 1; work.push_back(v); }
  };
  for (ValueId i = 0; i < n; ++i)
    if (instrs[i].op == OpCode::kVariable || instrs[i].op == OpCode::kInput) mark(i);
  for (auto& [var, v] : assigns) { mark(var); mark(v); }
  for (auto& [var, g] : gradients) { mark(var); mark(g); }
  for (auto& [name, v] : outputs) mark(v);
  while (!work.empty()) {
    ValueId v = work.back();
    work.pop_back();
    for (ValueId o : instrs[v].operands) mark(o);
  }
  // 2. Stable topological order (Kahn's algorithm, always taking the ready value of the smallest place,
  // then id).
  std::vector<int> pending(n, 0);
  std::vector<std::vector<ValueId>> users(n);
  for (ValueId i = 0; i < n; ++i) {
    if (!live[i]) continue;
    for (ValueId o : instrs[i].operands) {
      ++pending[i];
      users[o].push_back(i);
    }
  }
  using Key = std::pair<ValueId, ValueId>;  // (place, id)
  auto key = [&](ValueId v) { return Key{place.empty() ? v : place[v], v}; };
  std::priority_queue<Key, std::vector<Key>, std::greater<>> ready;
  for (ValueId i = 0; i < n; ++i)
    if (live[i] && pending[i] == 0) ready.push(key(i));
  std::vector<ValueId> order;
  while (!ready.empty()) {
    const ValueId v = ready.top().second;
    ready.pop();
    order.push_back(v);
    for (ValueId u : users[v])
      if (--pending[u] == 0) ready.push(key(u));
  }
  SS_CHECK(order.size() == static_cast<size_t>(std::count(live.begin(), live.end(), 1)), "cycle in module ", name);
  // 3. Renumber.
  std::vector<ValueId> remap(n, kNoValue);
  std::vector<Instr> sorted;
  sorted.reserve(order.size());
  for (ValueId v : order) {
    remap[v] = static_cast<ValueId>(sorted.size());
    sorted.push_back(std::move(instrs[v]));
  }
  for (Instr& in : sorted)
    for (ValueId& o : in.operands) o = remap[o];
  for (auto& [var, v] : assigns) { var = remap[var]; v = remap[v]; }
  for (auto& [var, g] : gradients) { var = remap[var]; g = remap[g]; }
  for (auto& [nm, v] : outputs) v = remap[v];
  instrs = std::move(sorted);
}

bool Module::operator==(const Module& o) const {
  return name == o.name && num_replicas == o.num_replicas && instrs == o.instrs && assigns == o.assigns &&
         gradients == o.gradients && outputs == o.outputs;
}

}  // namespace shardstep::ir
