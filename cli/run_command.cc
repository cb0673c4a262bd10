// `shardstep run --ir FILE`: runs one step of an IR module on inputs and state from safetensors
// files with the reference interpreter (or the CPU JIT), prints its outputs and saves them.
//
// Two modes:
//   all replicas (default): the module's replicas=N replicas run as threads with in-process
//     collectives; --inputs holds the global batch (each input's dimension 0 is N times the module's),
//     --state the logical (unsharded) state, as `train --save` writes it; the outputs are replica 0's
//     with "loss" averaged over the replicas, as in training.
//   --replica R: only replica R runs, without collectives (a collective over a group of more than one
//     replica is an error); --inputs and --state hold exactly the module's input and variable types
//     (a sharded variable as its shard).
// Variables not in --state (or all, without it) start from their init attributes.
#include <cstdio>
#include <iostream>
#include <memory>

#include "cli/backend_flag.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/ir_file.h"
#include "cli/preflight.h"
#include "ir/error.h"
#include "ir/printer.h"
#include "jit/cpu_executor.h"
#include "runtime/checkpoint.h"
#include "runtime/executor.h"
#include "runtime/interpreter.h"
#include "runtime/sharding.h"

namespace shardstep::cli {
namespace {

struct RunFlags {
  std::string ir_path, inputs, state, outputs, state_out;
  int replica = -1;
  std::string backend = "interp";
  int64_t show = 6;
  bool no_memory_check = false;
};

// "f32[4,10] [0.125, -1.5, ...] (40 values)".
std::string Describe(const runtime::Tensor& t, int64_t show) {
  std::string s = t.type.ToString();
  const int64_t n = t.elements();
  if (t.shape().empty()) return s + " " + Str(t.at(0));
  s += " [";
  for (int64_t i = 0; i < std::min(n, show); ++i) s += Str(i ? ", " : "", t.at(i));
  if (n > show) s += ", ...";
  s += Str("] (", n, " value", n == 1 ? "" : "s", ")");
  return s;
}

// Checks that `given` (read from `path`) holds exactly the module's inputs with the `expected`
// types; one error lists every problem.
void CheckInputs(const runtime::TensorMap& given, const std::map<std::string, ir::TensorType>& expected,
                 const std::string& path, const std::string& note) {
  std::vector<std::string> problems;
  const std::string where = path.empty() ? "no --inputs file given" : path;
  for (const auto& [name, type] : expected) {
    auto it = given.find(name);
    if (it == given.end())
      problems.push_back(Str("input '", name, "' (", type.ToString(), ") is missing"));
    else if (it->second.type != type)
      problems.push_back(Str("input '", name, "' is ", it->second.type.ToString(), ", expected ", type.ToString()));
  }
  std::string inputs;
  for (const auto& [name, type] : expected) inputs += Str(inputs.empty() ? "" : ", ", name);
  for (const auto& [name, t] : given)
    if (!expected.count(name))
      problems.push_back(Str("tensor '", name, "' (", t.type.ToString(), ") is not an input of the module (its inputs: ",
                             inputs.empty() ? "none" : inputs, ")"));
  if (problems.empty()) return;
  std::string msg = where + ": ";
  for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
  throw Error(msg + note);
}

int RunIr(const RunFlags& f) {
  if (f.ir_path.empty()) throw Error("run needs --ir FILE (the module to run)");
  CheckOutputPaths({{"--outputs", f.outputs}, {"--state-out", f.state_out}});
  ir::Module m = ReadIrFile(f.ir_path);
  const int n = m.num_replicas;
  const bool one = f.replica >= 0;
  if (one && f.replica >= n)
    throw Error(Str("--replica ", f.replica, " is outside the module's replicas [0, ", n, ")"));
  if (!f.no_memory_check) {
    MemoryNeed need = StepMemoryNeed(m, /*keeps_all_values=*/f.backend == "interp");
    if (one && n > 1) {  // one replica on its own inputs
      need.batch_bytes /= 2 * n;
      need.replicas = 1;
    }
    CheckMemory(need, AvailableMemoryBytes(), "run one replica with --replica R, or use a smaller module");
  }

  // Inputs: the module's types for one replica, the global batch for all of them.
  std::map<std::string, ir::TensorType> expected;
  for (ir::ValueId v : m.Inputs()) {
    ir::TensorType t = m.type(v);
    if (!one && n > 1) {
      if (t.shape.empty())
        throw Error(Str("input '", m.at(v).name, "' is a scalar (", t.ToString(), "): with replicas=", n,
                        " the inputs are split along dimension 0; run one replica with --replica R"));
      t.shape[0] *= n;
    }
    expected[m.at(v).name] = t;
  }
  runtime::TensorMap inputs;
  if (!f.inputs.empty()) inputs = runtime::LoadCheckpoint(f.inputs);
  CheckInputs(inputs, expected, f.inputs,
              !one && n > 1 ? Str(" (the global batch of ", n, " replicas: dimension 0 is ", n,
                                  " times the module's; --replica R runs one replica on its own inputs)")
                            : "");

  // State: per-replica types for one replica, the logical state for all.
  runtime::TensorMap state;
  const std::map<std::string, ir::TensorType> logical_types = runtime::LogicalTypes(m);
  if (one) {
    std::map<std::string, ir::TensorType> types;
    for (ir::ValueId v : m.Variables()) types[m.at(v).name] = m.type(v);
    if (!f.state.empty()) {
      state = runtime::LoadCheckpoint(f.state);
      runtime::CheckCheckpointMatches(state, types, f.state);
    } else {
      state = runtime::ReplicaState(m, runtime::InitLogicalState(m), f.replica);
    }
  } else if (!f.state.empty()) {
    state = runtime::LoadCheckpoint(f.state);
    runtime::CheckCheckpointMatches(state, logical_types, f.state);
  } else {
    state = runtime::InitLogicalState(m);
  }

  runtime::TensorMap outputs;
  if (one) {
    try {
      // One replica without collectives: the backends' single-replica entry points, not an executor.
      outputs = f.backend == "cpu" ? jit::JitRunStep(m, state, inputs, f.replica, nullptr)
                                   : runtime::RunStep(m, state, inputs, f.replica, nullptr);
    } catch (const Error& e) {
      if (n == 1) throw;
      throw Error(Str(e.what(), " (--replica runs one replica without collectives; without --replica all ", n,
                      " replicas run together)"));
    }
  } else {
    std::unique_ptr<runtime::Executor> exec = FindBackend(f.backend)(m, state);  // api/session.h's registry
    outputs = exec->Step(inputs);
    state = exec->LogicalState();
  }

  std::cout << "module " << ir::PrintName(m.name) << ", backend " << f.backend << ", "
            << (one ? Str("replica ", f.replica, " of ", n)
                    : n == 1 ? std::string("1 replica")
                             : Str(n, " replicas (outputs of replica 0; loss averaged over the replicas)"))
            << "\n";
  for (const auto& [name, v] : m.outputs) {
    auto it = outputs.find(name);
    if (it != outputs.end()) std::cout << "  " << name << " = " << Describe(it->second, f.show) << "\n";
  }
  std::cout << m.assigns.size() << " variable" << (m.assigns.size() == 1 ? "" : "s") << " assigned"
            << (f.state_out.empty() && !m.assigns.empty() ? " (--state-out FILE saves the new state)" : "") << "\n";
  if (!f.outputs.empty()) {
    runtime::SaveCheckpoint(f.outputs, outputs);
    std::cout << "saved outputs " << f.outputs << "\n";
  }
  if (!f.state_out.empty()) {
    runtime::SaveCheckpoint(f.state_out, state);
    std::cout << "saved state " << f.state_out << "\n";
  }
  return 0;
}

}  // namespace

Command AddRunCommand(CLI::App& app) {
  auto f = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "run one step of an IR module on safetensors inputs and print its outputs");
  cmd->add_option("--ir", f->ir_path, "the module's IR text file ('-': stdin); required");  // checked after --config
  cmd->add_option("--inputs", f->inputs,
                  "safetensors file of the inputs by name (the global batch; with --replica, that replica's)");
  cmd->add_option("--state", f->state,
                  "safetensors file of the variables (logical, as train --save writes; with --replica, that replica's "
                  "shards); default: their init attributes");
  cmd->add_option("--replica", f->replica, "run only this replica, without collectives")->check(kNonNegativeInt);
  cmd->add_option("--outputs", f->outputs, "save the outputs to this safetensors file");
  cmd->add_option("--state-out", f->state_out, "save the variables after the step to this safetensors file");
  cmd->add_option("--backend", f->backend, "interp (reference interpreter) | cpu (LLVM JIT)")
      ->check(BackendNameValidator())->capture_default_str();
  cmd->add_option("--show", f->show, "values printed per output")->check(kNonNegativeInt)->capture_default_str();
  cmd->add_flag("--no-memory-check", f->no_memory_check, "run even when the memory plan exceeds available memory");
  return {cmd, [f] { return RunIr(*f); }};
}

}  // namespace shardstep::cli
