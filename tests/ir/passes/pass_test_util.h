// Shared helpers for the IR pass tests: a small FileCheck, op counts, and before/after training on replicas.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ir/error.h"
#include "ir/module.h"
#include "ir/parser.h"
#include "ir/shard_format.h"
#include "ir/verifier.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"
#include "runtime/tensor.h"

namespace shardstep::ir::testing {

using runtime::Tensor;
using runtime::TensorMap;

// ---- CHECK lines: a small FileCheck ----
//
// Each non-empty line of `checks` is "CHECK: p", "CHECK-NEXT: p" or "CHECK-NOT: p". A pattern p is
// literal text except {{regex}}, [[NAME:regex]] (matches regex and binds NAME) and [[NAME]] (the text
// NAME was bound to). CHECK matches the first line at or after the line following the previous match;
// CHECK-NEXT must match exactly that line; CHECK-NOT must match no line between the surrounding
// matches (or up to the end). Returns "" on success, else what failed followed by the text.

inline std::string EscapeRegex(const std::string& s) {
  static const std::string kSpecial = R"(\^$.|?*+()[]{})";
  std::string out;
  for (char c : s) {
    if (kSpecial.find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

struct Pattern {
  std::regex re;
  std::vector<std::pair<std::string, size_t>> binds;  // (name, capture group)
};

inline Pattern CompilePattern(const std::string& p, const std::map<std::string, std::string>& vars) {
  static const std::regex kVar(R"(^\[\[([A-Za-z_][A-Za-z0-9_]*)(:|\]\]))");
  Pattern out;
  std::string re;
  size_t groups = 0, i = 0;
  std::smatch m;
  while (i < p.size()) {
    std::string rest = p.substr(i);
    if (rest.rfind("{{", 0) == 0) {
      size_t e = p.find("}}", i + 2);
      if (e == std::string::npos) throw std::runtime_error("unterminated {{ in " + p);
      std::string r = p.substr(i + 2, e - i - 2);
      groups += std::regex(r).mark_count();
      re += "(?:" + r + ")";
      i = e + 2;
    } else if (std::regex_search(rest, m, kVar)) {
      const std::string name = m[1];
      if (m[2] == "]]") {
        auto it = vars.find(name);
        if (it == vars.end()) throw std::runtime_error("undefined [[" + name + "]] in " + p);
        re += EscapeRegex(it->second);
        i += m[0].length();
      } else {
        size_t e = p.find("]]", i + m[0].length());
        if (e == std::string::npos) throw std::runtime_error("unterminated [[ in " + p);
        std::string r = p.substr(i + m[0].length(), e - i - m[0].length());
        out.binds.push_back({name, ++groups});
        groups += std::regex(r).mark_count();
        re += "(" + r + ")";
        i = e + 2;
      }
    } else {
      re += EscapeRegex(std::string(1, p[i]));
      ++i;
    }
  }
  out.re = std::regex(re);
  return out;
}

inline std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream is(text);
  for (std::string l; std::getline(is, l);) lines.push_back(l);
  return lines;
}

inline std::string FileCheck(const std::string& text, const std::string& checks) {
  const std::vector<std::string> lines = Lines(text);
  std::map<std::string, std::string> vars;
  std::vector<std::string> nots;
  size_t pos = 0;  // first line the next CHECK may match
  auto failed = [&](const std::string& why) { return why + "\n--- in ---\n" + text; };
  auto check_nots = [&](size_t from, size_t to) -> std::string {
    for (const std::string& n : nots) {
      Pattern p = CompilePattern(n, vars);
      for (size_t k = from; k < to; ++k)
        if (std::regex_search(lines[k], p.re))
          return "CHECK-NOT: " + n + "\n  matched line " + std::to_string(k + 1) + ": " + lines[k];
    }
    nots.clear();
    return "";
  };
  for (std::string c : Lines(checks)) {
    c.erase(0, c.find_first_not_of(" \t"));
    if (c.empty()) continue;
    std::string directive = c.substr(0, c.find(':'));
    std::string pattern = c.substr(std::min(c.size(), directive.size() + 1));
    pattern.erase(0, pattern.find_first_not_of(' '));
    if (directive == "CHECK-NOT") {
      nots.push_back(pattern);
      continue;
    }
    if (directive != "CHECK" && directive != "CHECK-NEXT") return "bad check line: " + c;
    Pattern p = CompilePattern(pattern, vars);
    std::smatch m;
    size_t found = lines.size();
    if (directive == "CHECK-NEXT") {
      if (pos < lines.size() && std::regex_search(lines[pos], m, p.re)) found = pos;
    } else {
      for (size_t k = pos; k < lines.size(); ++k)
        if (std::regex_search(lines[k], m, p.re)) {
          found = k;
          break;
        }
    }
    if (found == lines.size())
      return failed(directive + ": " + pattern + "\n  not found from line " + std::to_string(pos + 1));
    if (std::string e = check_nots(pos, found); !e.empty()) return failed(e);
    for (auto& [name, group] : p.binds) vars[name] = m[group].str();
    pos = found + 1;
  }
  if (std::string e = check_nots(pos, lines.size()); !e.empty()) return failed(e);
  return "";
}

inline int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

inline int CountOps(const Module& m, OpCode op) {
  int n = 0;
  for (const Instr& in : m.instrs) n += in.op == op;
  return n;
}

// ---- Running the modules: N replica threads, one TensorMap of variables per replica ----

inline Tensor RandomTensor(const TensorType& t, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  Tensor out(t);  // s32 (step counters) start at zero
  if (t.dtype == DType::kF32) {
    std::uniform_real_distribution<float> d(lo, hi);
    for (float& x : out.f32) x = d(rng);
  }
  return out;
}

// Random logical state for every variable (of its logical type when sharded): weights in [-1, 1),
// optimizer state in [0, 1) (Adam's and LAMB's v must not be negative).
inline TensorMap RandomLogicalState(const Module& m, std::mt19937& rng) {
  TensorMap state;
  const std::map<std::string, TensorType> types = runtime::LogicalTypes(m);
  for (ValueId v : m.Variables()) {
    const bool state_var = m.at(v).GetString("role", "") == kRoleOptimizerState;
    state[m.at(v).name] = RandomTensor(types.at(m.at(v).name), rng, state_var ? 0.0f : -1.0f, 1.0f);
  }
  return state;
}

// inputs[step][replica]: every replica gets its own batch.
inline std::vector<std::vector<TensorMap>> RandomInputs(const Module& m, int steps, std::mt19937& rng) {
  std::vector<std::vector<TensorMap>> inputs(steps, std::vector<TensorMap>(m.num_replicas));
  for (auto& step : inputs)
    for (TensorMap& replica : step)
      for (ValueId v : m.Inputs()) replica[m.at(v).name] = RandomTensor(m.type(v), rng, -2.0f, 2.0f);
  return inputs;
}

struct Run {
  std::vector<std::vector<TensorMap>> states;   // [step][replica], after the step
  std::vector<std::vector<TensorMap>> outputs;  // [step][replica]
};

inline Run Train(const Module& m, const TensorMap& logical, const std::vector<std::vector<TensorMap>>& inputs) {
  const int n = m.num_replicas;
  std::vector<TensorMap> states(n);
  for (int r = 0; r < n; ++r) states[r] = runtime::ReplicaState(m, logical, r);
  runtime::InProcessCollectives collectives(n);
  Run run;
  for (const auto& step : inputs) {
    std::vector<TensorMap> outs(n);
    runtime::RunReplicas(n, &collectives, [&](int r) {
      outs[r] = runtime::RunStep(m, states[r], step[r], r, &collectives);
    });
    run.states.push_back(states);
    run.outputs.push_back(outs);
  }
  return run;
}

// "" when a and b agree: bitwise for tol == 0, else |a - b| <= tol * (1 + |b|) element by element.
// The reference b must be finite (a NaN on both sides would prove nothing).
inline std::string Compare(const std::string& what, const Tensor& a, const Tensor& b, double tol) {
  if (a.type != b.type) return what + ": type " + a.type.ToString() + " vs " + b.type.ToString();
  for (int64_t i = 0; i < b.elements(); ++i)
    if (!std::isfinite(b.at(i))) return Str(what, ": the reference is not finite at element ", i, ": ", b.at(i));
  if (tol == 0) {
    if (a == b) return "";
    for (int64_t i = 0; i < a.elements(); ++i)
      if (a.dtype() == DType::kF32 ? std::memcmp(&a.f32[i], &b.f32[i], sizeof(float)) != 0 : a.s32[i] != b.s32[i])
        return Str(what, ": element ", i, " differs bitwise: ", a.at(i), " vs ", b.at(i));
    return what + ": differs";
  }
  for (int64_t i = 0; i < a.elements(); ++i) {
    const double x = a.at(i), y = b.at(i);
    if (!(std::fabs(x - y) <= tol * (1 + std::fabs(y))))
      return Str(what, ": element ", i, ": ", x, " vs ", y, " (tolerance ", tol, ")");
  }
  return "";
}

// Trains `before` (replicated) and `after` (sharded) from the same logical state on the same
// per-replica batches and compares after every step: every replica's copy of the variables that stay
// whole, each replica group's logical state (sharded variables reassembled with LogicalStateFrom), and
// every replica's outputs. Returns "" when all agree, else the first mismatches and their count; also
// fails when training did not move the weights (the comparison would prove nothing).
inline std::string TrainingDifference(const Module& before, const Module& after, double tol,
                                      int group_size = 0, int steps = 3, unsigned seed = 7) {
  if (before.num_replicas != after.num_replicas) return "replica counts differ";
  const int n = before.num_replicas, g = group_size > 0 ? group_size : n;
  std::mt19937 rng(seed);
  const TensorMap logical = RandomLogicalState(before, rng);
  const auto inputs = RandomInputs(before, steps, rng);
  const Run rb = Train(before, logical, inputs), ra = Train(after, logical, inputs);
  std::vector<std::string> diffs;
  auto note = [&](const std::string& where, const std::string& d) {
    if (!d.empty()) diffs.push_back(where + ": " + d);
  };
  // Sharded variables must be sharded over exactly the replica groups being compared.
  bool counts_match = true;
  for (ValueId v : after.Variables()) {
    ShardFormat f;
    if (ShardFormat::FromAttrs(after.at(v), &f) && f.count != g) {
      counts_match = false;
      note("module", Str("@", after.at(v).name, " is sharded ", f.count, " ways, the replica groups have ", g));
    }
  }
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < n; ++r)
      for (ValueId v : after.Variables()) {
        const std::string& name = after.at(v).name;
        ShardFormat f;
        if (ShardFormat::FromAttrs(after.at(v), &f)) continue;
        note(Str("step ", s, ", replica ", r),
             Compare("variable @" + name, ra.states[s][r].at(name), rb.states[s][r].at(name), tol));
      }
    for (int first = 0; counts_match && first < n; first += g) {
      const TensorMap lb = runtime::LogicalStateFrom(before, rb.states[s], first);
      const TensorMap la = runtime::LogicalStateFrom(after, ra.states[s], first);
      for (auto& [name, t] : lb)
        note(Str("step ", s, ", group of replica ", first),
             la.count(name) ? Compare("variable @" + name, la.at(name), t, tol) : "@" + name + " missing");
    }
    for (int r = 0; r < n; ++r)
      for (auto& [name, t] : rb.outputs[s][r])
        note(Str("step ", s, ", replica ", r),
             ra.outputs[s][r].count(name) ? Compare("output @" + name, ra.outputs[s][r].at(name), t, tol)
                                          : "output @" + name + " missing");
  }
  bool moved = false;
  const TensorMap last = runtime::LogicalStateFrom(before, rb.states.back(), 0);
  for (ValueId v : before.VariablesWithRole(kRoleWeight))
    moved |= !(last.at(before.at(v).name) == logical.at(before.at(v).name));
  if (!moved && !before.VariablesWithRole(kRoleWeight).empty()) diffs.push_back("training did not change any weight");
  std::string out;
  for (size_t i = 0; i < diffs.size() && i < 6; ++i) out += diffs[i] + "\n";
  if (diffs.size() > 6) out += Str("... ", diffs.size(), " mismatches in all\n");
  return out;
}

#define EXPECT_SAME_TRAINING(before, after, ...) \
  CHECK(::shardstep::ir::testing::TrainingDifference(before, after, __VA_ARGS__) == "")

// ---- Running the passes ----

inline Module ParseVerified(const std::string& text) {
  Module m = Parse(text);
  Verify(m);
  return m;
}

}  // namespace shardstep::ir::testing
