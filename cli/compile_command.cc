// `shardstep compile`: build a model's step and print any pipeline stage (--emit), or read IR text
// (--ir FILE) and run named passes on it (--passes), as mlir-opt and hlo-opt do.
#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/ir_file.h"
#include "cli/preflight.h"
#include "ir/cost.h"
#include "ir/error.h"
#include "ir/memory_plan.h"
#include "ir/passes/elementwise_fuser.h"
#include "ir/passes/pipeline.h"
#include "ir/passes/weight_update_sharder.h"
#include "ir/printer.h"
#include "jit/compiled_step.h"
#include "runtime/atomic_file.h"

namespace shardstep::cli {
namespace {

struct CompileFlags {
  ProgramFlags program;
  std::string emit = "ir";
  std::string out_path;
  bool report = false;
  std::string ir_path;
  std::string passes;  // comma-separated names
};

void Write(const std::string& text, const std::string& out_path) {
  if (out_path.empty()) {
    std::cout << text << std::flush;
    return;
  }
  runtime::WriteFileAtomically(out_path, {{text.data(), text.size()}}, "output");
}

// Checks every name before anything is read or built.
void CheckPassNames(const std::vector<std::string>& names) {
  std::vector<std::string> known = ir::KnownPassNames();
  known.push_back("all");
  for (const std::string& n : names) {
    if (std::find(known.begin(), known.end(), n) != known.end()) continue;
    std::string list;
    for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
    const std::string near = ClosestMatch(n, known);
    throw Error(Str("--passes: unknown pass '", n, "'", near.empty() ? "" : Str(" (did you mean '", near, "'?)"),
                    "; known passes: ", list));
  }
}

// --passes / --ir: a module through named passes (the verifier runs before and after each one).
int RunPasses(const CompileFlags& c) {
  std::vector<std::string> names;
  std::stringstream list(c.passes);
  for (std::string name; std::getline(list, name, ',');) {
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) names.push_back(name);
  }
  CheckPassNames(names);
  CheckOutputPath("-o", c.out_path);
  ir::Module module = c.ir_path.empty() ? BuildModule(c.program) : ReadIrFile(c.ir_path);
  if (!names.empty()) {
    ir::PipelineOptions po = PipelineFromFlags(c.program, 1000, module.num_replicas);
    ir::BuildPipeline(names, po).ExternalInput(!c.ir_path.empty()).Run(module);
  }
  Write(ir::Print(module), c.out_path);
  return 0;
}

int RunEmit(const CompileFlags& c) {
  const ProgramFlags& f = c.program;
  CheckOutputPath("-o", c.out_path);
  ir::Module module = BuildModule(f);
  ir::PipelineOptions po = PipelineFromFlags(f, 1000);
  ir::Module before_sharding, grad;
  std::string sharding_report;
  if (c.emit != "ir" || c.report) {
    static const std::map<std::string, std::string> stop = {{"ir", ""},
                                                            {"grad", "autodiff"},
                                                            {"dp", "data-parallel-lowering"},
                                                            {"opt", "optimizer-lowering"},
                                                            {"sharded", "weight-update-sharder"},
                                                            {"combined", "collective-combiner"},
                                                            {"fused", "collective-combiner"},
                                                            {"llvm", "collective-combiner"}};
    ir::Module full = module;
    ir::PassPipeline pipeline = ir::BuildTrainingPipeline(po);
    pipeline.OnPass([&](const ir::Pass& p, const ir::Module& mod) {
      if (p.name() == stop.at(c.emit)) module = mod;
      if (p.name() == "optimizer-lowering") before_sharding = mod;
      if (p.name() == "autodiff") grad = mod;
      if (auto* s = dynamic_cast<const ir::WeightUpdateSharder*>(&p)) sharding_report = s->report().ToString();
    });
    pipeline.Run(full);
    if (c.report) {
      if (sharding_report.empty()) sharding_report = "weight-update sharding is off (one replica or --shard-weight-update=off)\n";
      std::ostringstream os;
      os << sharding_report << "before sharding " << ir::PlanMemory(before_sharding).ToString() << "after  sharding "
         << ir::PlanMemory(full).ToString();
      // Parameters, FLOPs and activation memory (ir/cost.h), per replica.
      os << ir::ComputeCost(grad, full, f.batch / std::max(1, f.replicas)).ToString();
      Write(os.str(), c.out_path);
      return 0;
    }
  }
  if (c.emit == "fused") ir::ElementwiseFuser().Run(module);
  Write(c.emit == "llvm" ? jit::EmitLlvmIr(module) : ir::Print(module), c.out_path);
  return 0;
}

}  // namespace

Command AddCompileCommand(CLI::App& app) {
  auto c = std::make_shared<CompileFlags>();
  CLI::App* cmd = app.add_subcommand(
      "compile",
      "build a model's training step and print a stage of it, or read IR text (--ir) and run passes on it");
  std::vector<CLI::Option*> model = AddModelFlags(cmd, &c->program);
  AddPipelineFlags(cmd, &c->program);
  CLI::Option* emit =
      cmd->add_option("--emit", c->emit, "stop after a stage and print it: ir|grad|dp|opt|sharded|combined|fused|llvm")
          ->check(CLI::IsMember({"ir", "grad", "dp", "opt", "sharded", "combined", "fused", "llvm"}))
          ->capture_default_str();
  CLI::Option* report =
      cmd->add_flag("--report", c->report, "print the per-variable sharding table, per-replica memory, parameters, FLOPs per example and "
                    "activation memory instead");
  cmd->add_option("-o,--output", c->out_path, "write to this file (atomically) instead of stdout");
  CLI::Option* ir = cmd->add_option("--ir", c->ir_path,
                                    "read the module from this IR text file ('-': stdin) instead of building a model; "
                                    "without --passes it is parsed, verified and printed back");
  CLI::Option* passes =
      cmd->add_option("--passes", c->passes,
                      "run these passes in order, verifying before and after each: comma-separated names from "
                      "autodiff, data-parallel-lowering, optimizer-lowering, nonfinite-guard, weight-update-sharder, "
                      "shard-order-reductions, collective-combiner, elementwise-fuser; 'all' is the training "
                      "pipeline; empty: none")
          ->expected(0, 1);
  for (CLI::Option* o : model) ir->excludes(o);
  ir->excludes(emit)->excludes(report);
  passes->excludes(emit)->excludes(report);
  return {cmd, [c, ir, passes] {
            if (ir->empty()) ResolveTextVocab(&c->program);  // text models: the corpus's vocabulary
            return !ir->empty() || passes->count() > 0 ? RunPasses(*c) : RunEmit(*c);
          }};
}

}  // namespace shardstep::cli
