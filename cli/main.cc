// The `shardstep` command: train a built-in model, or compile one and print any pipeline stage.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "ir/memory_plan.h"
#include "ir/passes/pipeline.h"
#include "ir/passes/weight_update_sharder.h"
#include "ir/passes/elementwise_fuser.h"
#include "ir/printer.h"
#include "jit/compiled_step.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/executor.h"
#include "runtime/initializers.h"
#include "runtime/sharding.h"
#include "runtime/trainer.h"

using namespace shardstep;

namespace {

// Flags that choose the model and its training program (shared by train and compile).
struct ProgramFlags {
  std::string model = "mlp";
  std::vector<int64_t> hidden = {1024, 1024};
  int64_t batch = 64;
  int replicas = 1;
  uint64_t seed = 0;
  std::string optimizer = "adam";
  double lr = 1e-3;
  double momentum = 0.9;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = -1;  // -1: the optimizer's default
  double weight_decay = 0;
  double clip_norm = 0;
  std::string schedule = "constant";
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;
  double end_lr_factor = 0;
  double power = 1.0;
  double trust_coefficient = 0.001;
  double initial_accumulator = 0.0;
  std::string replica_groups;          // "AxB": A groups of B replicas each
  std::string shard_weight_update = "auto";
  std::string gather_weights = "end";
  int64_t combine_bytes = 4 << 20, combine_count = 64;
};

void AddProgramFlags(CLI::App* app, ProgramFlags* f) {
  std::vector<std::string> model_names;
  for (auto& s : models::AllModels()) model_names.push_back(s.name);
  app->add_option("--model", f->model, "model to train")->check(CLI::IsMember(model_names))->capture_default_str();
  app->add_option("--hidden", f->hidden, "MLP hidden widths, e.g. 1024,1024")->delimiter(',')->capture_default_str();
  app->add_option("--batch", f->batch, "global batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--replicas", f->replicas, "data-parallel replicas")->check(CLI::Range(1, 4096))->capture_default_str();
  app->add_option("--seed", f->seed, "seed for initialisation and shuffling")->capture_default_str();
  app->add_option("--optimizer", f->optimizer, "sgd|momentum|adam|adamw|adagrad|lamb|lars")
      ->check(CLI::IsMember({"sgd", "momentum", "adam", "adamw", "adagrad", "lamb", "lars"}))
      ->capture_default_str();
  app->add_option("--lr", f->lr, "base learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--momentum", f->momentum, "momentum (momentum, lars)")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_flag("--nesterov", f->nesterov, "Nesterov momentum");
  app->add_option("--beta1", f->beta1, "Adam/LAMB beta1")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_option("--beta2", f->beta2, "Adam/LAMB beta2")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_option("--eps", f->eps, "epsilon (default: the optimizer's)");
  app->add_option("--weight-decay", f->weight_decay, "weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app->add_option("--clip-norm", f->clip_norm, "clip gradients to this global norm (0: off)")->check(CLI::NonNegativeNumber);
  app->add_option("--schedule", f->schedule, "constant|warmup|cosine|polynomial")
      ->check(CLI::IsMember({"constant", "warmup", "cosine", "polynomial"}))->capture_default_str();
  app->add_option("--warmup-steps", f->warmup_steps, "linear warm-up steps")->check(CLI::NonNegativeNumber);
  app->add_option("--decay-steps", f->decay_steps, "cosine/polynomial decay horizon (default: --steps)")->check(CLI::NonNegativeNumber);
  app->add_option("--end-lr-factor", f->end_lr_factor, "final lr / base lr for decays")->check(CLI::Range(0.0, 1.0));
  app->add_option("--power", f->power, "polynomial decay power")->check(CLI::PositiveNumber);
  app->add_option("--trust-coefficient", f->trust_coefficient, "LARS eta")->check(CLI::PositiveNumber);
  app->add_option("--initial-accumulator", f->initial_accumulator, "Adagrad's initial accumulator value")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--replica-groups", f->replica_groups, "AxB: data parallel within A groups of B replicas");
  app->add_option("--shard-weight-update", f->shard_weight_update, "on|off|auto (auto: on when replicas > 1)")
      ->check(CLI::IsMember({"on", "off", "auto"}))->capture_default_str();
  app->add_option("--gather-weights", f->gather_weights,
                  "all-gather of updated weights: at the end of the step, or deferred to the start of the next")
      ->check(CLI::IsMember({"end", "start"}))->capture_default_str();
  app->add_option("--combine-threshold-bytes", f->combine_bytes, "combine collectives up to this many bytes (0: off)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app->add_option("--combine-threshold-count", f->combine_count, "combine at most this many collectives")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
}

ir::PipelineOptions PipelineFromFlags(const ProgramFlags& f, int64_t steps);

ir::OptimizerConfig OptimizerFromFlags(const ProgramFlags& f, int64_t steps) {
  ir::OptimizerConfig c;
  ir::OptimizerKind kind;
  ir::ParseOptimizerKind(f.optimizer, &kind);
  c.kind(kind).lr(f.lr).betas(f.beta1, f.beta2).weight_decay(f.weight_decay).clip_global_norm(f.clip_norm)
      .trust_coefficient(f.trust_coefficient).initial_accumulator(f.initial_accumulator);
  if (kind == ir::OptimizerKind::kMomentum || kind == ir::OptimizerKind::kLars) c.momentum(f.momentum).nesterov(f.nesterov);
  c.eps(f.eps >= 0 ? f.eps : kind == ir::OptimizerKind::kAdagrad ? 1e-10 : kind == ir::OptimizerKind::kLamb ? 1e-6 : 1e-8);
  ir::ScheduleKind sk;
  ir::ParseScheduleKind(f.schedule, &sk);
  c.schedule(sk);
  c.warmup_steps_ = f.warmup_steps;
  c.total_steps_ = f.decay_steps > 0 ? f.decay_steps : steps;
  c.end_lr_factor_ = f.end_lr_factor;
  c.power_ = f.power;
  if (sk == ir::ScheduleKind::kWarmupConstant && f.warmup_steps == 0)
    throw Error("--schedule warmup needs --warmup-steps > 0");
  return c;
}

ir::PipelineOptions PipelineFromFlags(const ProgramFlags& f, int64_t steps) {
  ir::PipelineOptions o;
  o.optimizer = OptimizerFromFlags(f, steps);
  o.replicas = f.replicas;
  if (!f.replica_groups.empty()) {
    int a = 0, b = 0;
    char x = 0, extra = 0;
    if (std::sscanf(f.replica_groups.c_str(), "%d%c%d%c", &a, &x, &b, &extra) != 3 || x != 'x' || a < 1 || b < 1)
      throw Error(Str("--replica-groups: expected AxB (A groups of B replicas), got '", f.replica_groups, "'"));
    if (a * b != f.replicas)
      throw Error(Str("--replica-groups ", f.replica_groups, " makes ", a * b, " replicas but --replicas is ", f.replicas));
    o.group_size = b;
  }
  o.shard_weight_update = f.shard_weight_update != "off";
  o.gather_at_start = f.gather_weights == "start";
  o.combine_bytes = f.combine_bytes;
  o.combine_count = f.combine_count;
  return o;
}

models::ModelOptions ModelOptionsFromFlags(const ProgramFlags& f, int64_t batch) {
  models::ModelOptions o;
  o.batch = batch;
  o.hidden = f.hidden;
  for (int64_t h : o.hidden)
    if (h <= 0) throw Error(Str("--hidden: widths must be positive, got ", h));
  return o;
}

dsl::Program BuildProgram(const ProgramFlags& f, int64_t steps) {
  const models::ModelSpec& spec = models::FindModel(f.model);
  dsl::Model m(spec.name, f.seed);
  dsl::Tensor loss = spec.define(m, ModelOptionsFromFlags(f, f.batch));
  return m.train(loss).options(PipelineFromFlags(f, steps)).build();
}

ir::Module BuildForward(const ProgramFlags& f, int64_t batch) {
  const models::ModelSpec& spec = models::FindModel(f.model);
  dsl::Model m(spec.name, f.seed);
  m.train(spec.define(m, ModelOptionsFromFlags(f, batch)));
  return m.lower(1);
}


struct TrainFlags {
  ProgramFlags program;
  std::string dataset = "fashion-mnist";
  std::string data_dir = runtime::kFashionMnistDir;
  int64_t steps = 2000;
  bool no_shuffle = false;
  std::string save, load, save_init, metrics_out, plot_out;
  int64_t log_every = 100, eval_every = 0, eval_batch = 1000;
  std::string backend = "cpu";
};

int RunTrain(const TrainFlags& t) {
  const models::ModelSpec& spec = models::FindModel(t.program.model);
  dsl::Program program = BuildProgram(t.program, t.steps);
  ir::Module forward = BuildForward(t.program, t.eval_batch);

  runtime::TensorMap state = runtime::InitLogicalState(program.step);
  if (!t.load.empty()) {
    runtime::TensorMap loaded = runtime::LoadCheckpoint(t.load);
    runtime::CheckCheckpointMatches(loaded, runtime::LogicalTypes(program.step), t.load);
    state = loaded;
    std::cout << "loaded checkpoint " << t.load << "\n";
  }
  if (!t.save_init.empty()) {
    runtime::SaveCheckpoint(t.save_init, state);
    std::cout << "saved initial state " << t.save_init << "\n";
  }

  runtime::Dataset train, test;
  if (t.dataset == "fashion-mnist") {
    train = runtime::LoadFashionMnist(t.data_dir, true);
    test = runtime::LoadFashionMnist(t.data_dir, false);
  } else {
    // One distribution, split into train and test.
    runtime::Dataset all = runtime::SyntheticClassification(10000, 1, 28, 28, 10, t.program.seed);
    train = runtime::TakeExamples(all, 0, 8000);
    test = runtime::TakeExamples(all, 8000, 10000);
  }

  int64_t params = 0;
  for (ir::ValueId v : program.step.VariablesWithRole(ir::kRoleWeight)) params += program.step.type(v).elements();
  std::cout << "model " << spec.name << " (" << params << " parameters), " << t.dataset << " (" << train.size()
            << " train / " << test.size() << " test), batch " << t.program.batch << ", " << t.program.replicas
            << " replica(s), " << program.options.optimizer.ToString() << ", backend " << t.backend << "\n"
            << ir::PlanMemory(program.step).ToString();

  std::unique_ptr<runtime::Executor> exec;
  if (t.backend == "cpu") {
    auto cpu = std::make_unique<jit::CpuExecutor>(program.step, state);
    const jit::CompileInfo& ci = cpu->compile_info();
    std::cout << "jit: " << ci.kernels << " fused kernels (" << ci.fused_ops << " ops), " << ci.source << " in "
              << ci.seconds << " s" << (ci.rejected_corrupt ? " (a corrupt cache entry was rejected)" : "") << "\n"
              << "jit buffer plan per replica: " << std::fixed << std::setprecision(3) << ci.arena_bytes / 1048576.0
              << " MiB arena for " << ci.buffer_bytes / 1048576.0 << " MiB of temporaries, plus "
              << ci.swapped_bytes / 1048576.0 << " MiB of new variable values\n"
              << std::defaultfloat;
    exec = std::move(cpu);
  } else {
    exec = runtime::MakeInterpreterExecutor(program.step, state);
  }
  runtime::TrainOptions o;
  o.steps = t.steps;
  o.batch = t.program.batch;
  o.example_shape = spec.example_shape;
  o.shuffle = !t.no_shuffle;
  o.seed = t.program.seed;
  o.log_every = t.log_every;
  o.eval_every = t.eval_every;
  o.eval_batch = t.eval_batch;
  o.metrics_out = t.metrics_out;
  o.plot_out = t.plot_out;
  o.plot_title = Str("shardstep ", t.program.model, ", ", program.options.optimizer.ToString(), ", ",
                     program.step.num_replicas, " replica(s), backend ", t.backend);
  o.save = t.save;
  const ir::MemoryPlan mem = ir::PlanMemory(program.step);
  o.memory = {{"weights_bytes", mem.weight_bytes},
              {"optimizer_state_bytes", mem.optimizer_state_bytes},
              {"gradients_bytes", mem.gradient_bytes},
              {"peak_temporaries_bytes", mem.peak_temp_bytes}};
  runtime::TrainResult r = runtime::Train(*exec, forward, train, &test, o, std::cout);
  std::cout << "final: loss " << r.losses.back() << ", test accuracy " << r.test_accuracy << ", "
            << static_cast<int64_t>(r.examples_per_second) << " examples/s\n";
  return 0;
}

int RunCompile(const ProgramFlags& f, const std::string& emit, const std::string& out_path, bool report) {
  const models::ModelSpec& spec = models::FindModel(f.model);
  dsl::Model m(spec.name, f.seed);
  dsl::Tensor loss = spec.define(m, ModelOptionsFromFlags(f, f.batch));
  m.train(loss);
  ir::Module module = m.lower(f.replicas);
  ir::PipelineOptions po = PipelineFromFlags(f, 1000);
  ir::Module before_sharding;
  std::string sharding_report;
  if (emit != "ir" || report) {
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
      if (p.name() == stop.at(emit)) module = mod;
      if (p.name() == "optimizer-lowering") before_sharding = mod;
      if (auto* s = dynamic_cast<const ir::WeightUpdateSharder*>(&p)) sharding_report = s->report().ToString();
    });
    pipeline.Run(full);
    if (report) {
      if (sharding_report.empty()) sharding_report = "weight-update sharding is off (one replica or --shard-weight-update=off)\n";
      std::cout << sharding_report << "before sharding " << ir::PlanMemory(before_sharding).ToString() << "after  sharding "
                << ir::PlanMemory(full).ToString();
      return 0;
    }
  }
  if (emit == "fused") ir::ElementwiseFuser().Run(module);
  std::string text = emit == "llvm" ? jit::EmitLlvmIr(module) : ir::Print(module);
  if (out_path.empty()) {
    std::cout << text;
  } else {
    std::ofstream os(out_path);
    if (!(os << text)) throw Error(Str("cannot write ", out_path));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardstep: a C++ training framework with automatic cross-replica sharding of the weight update"};
  app.require_subcommand(1);

  TrainFlags train;
  CLI::App* train_cmd = app.add_subcommand("train", "train a model");
  AddProgramFlags(train_cmd, &train.program);
  train_cmd->add_option("--dataset", train.dataset, "fashion-mnist|synthetic")
      ->check(CLI::IsMember({"fashion-mnist", "synthetic"}))->capture_default_str();
  train_cmd->add_option("--data-dir", train.data_dir, "directory of the IDX files")->capture_default_str();
  train_cmd->add_option("--steps", train.steps, "training steps")->check(CLI::PositiveNumber)->capture_default_str();
  train_cmd->add_flag("--no-shuffle", train.no_shuffle, "feed batches in file order");
  train_cmd->add_option("--save", train.save, "write the final state to this safetensors file");
  train_cmd->add_option("--load", train.load, "start from this safetensors checkpoint");
  train_cmd->add_option("--save-init", train.save_init, "write the initial state to this safetensors file");
  train_cmd->add_option("--metrics-out", train.metrics_out, "write per-step metrics as JSON Lines");
  train_cmd->add_option("--plot-out", train.plot_out, "write an SVG of the loss curve and the step-time breakdown");
  train_cmd->add_option("--log-every", train.log_every, "progress line every N steps")->check(CLI::PositiveNumber);
  train_cmd->add_option("--eval-every", train.eval_every, "evaluate every N steps (0: at the end)")->check(CLI::NonNegativeNumber);
  train_cmd->add_option("--backend", train.backend, "interp (reference interpreter) | cpu (LLVM JIT)")
      ->check(CLI::IsMember({"interp", "cpu"}))->capture_default_str();
  train_cmd->add_option("--eval-batch", train.eval_batch, "evaluation batch (divides 10000)")->check(CLI::PositiveNumber);
  // Scripted runs: `shardstep train --config run.toml` reads the [train] table of a TOML/INI file;
  // flags given on the command line win over the file.
  app.set_config("--config", "", "read flags from a config file ([train] table: key = value)");

  ProgramFlags compile;
  std::string emit = "ir", out_path;
  CLI::App* compile_cmd = app.add_subcommand("compile", "build a model's training step and print a stage of it");
  AddProgramFlags(compile_cmd, &compile);
  bool report = false;
  compile_cmd->add_option("--emit", emit, "stop after a stage and print it: ir|grad|dp|opt|sharded|combined|fused|llvm")
      ->check(CLI::IsMember({"ir", "grad", "dp", "opt", "sharded", "combined", "fused", "llvm"}))->capture_default_str();
  compile_cmd->add_flag("--report", report, "print the per-variable sharding table and per-replica memory instead");
  compile_cmd->add_option("-o,--output", out_path, "write to this file instead of stdout");

  // CLI11 reads a config file at the top level; let users write it after the subcommand too.
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) {
      std::string file = args[i + 1];
      args.erase(args.begin() + i, args.begin() + i + 2);
      args.insert(args.begin(), {"--config", file});
      break;
    }
    if (args[i].rfind("--config=", 0) == 0) {
      std::string opt = args[i];
      args.erase(args.begin() + i);
      args.insert(args.begin(), opt);
      break;
    }
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments in reverse order

  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  try {
    if (*train_cmd) return RunTrain(train);
    if (*compile_cmd) return RunCompile(compile, emit, out_path, report);
  } catch (const Error& e) {
    std::cerr << "shardstep: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
