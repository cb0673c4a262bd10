// `shardstep train`: checks everything it can first (output paths, dataset files, memory, evaluation
// batch), then builds the step, loads or initialises the state and trains.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/preflight.h"
#include "ir/error.h"
#include "ir/memory_plan.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "runtime/trainer.h"

namespace shardstep::cli {
namespace {

struct TrainFlags {
  ProgramFlags program;
  std::string dataset = "fashion-mnist";
  std::string data_dir = runtime::kFashionMnistDir;
  int64_t steps = 2000;
  bool no_shuffle = false;
  std::string save, load, save_init, metrics_out, plot_out;
  int64_t log_every = 100, eval_every = 0, eval_batch = 1000;
  std::string backend = "cpu";
  bool no_memory_check = false;
};

// Examples in each split, known before loading (the memory check runs first).
constexpr int64_t kFashionTrain = 60000, kFashionTest = 10000, kSyntheticAll = 10000, kSyntheticTrain = 8000;

// "use a divisor of 10000 such as 250 or 400" for an evaluation batch that does not divide the split.
std::string NearDivisors(int64_t n, int64_t b) {
  int64_t below = std::min(b, n), above = b;
  while (below > 1 && n % below) --below;
  while (above < n && n % above) ++above;
  return below == above || above > n ? Str(below) : Str(below, " or ", above);
}

int RunTrain(const TrainFlags& t) {
  const models::ModelSpec& spec = models::FindModel(t.program.model);
  // 1. Outputs and inputs that can be checked without building anything.
  CheckOutputPaths({{"--save", t.save}, {"--save-init", t.save_init}, {"--metrics-out", t.metrics_out}, {"--plot-out", t.plot_out}});
  if (!t.load.empty() && ::access(t.load.c_str(), R_OK) != 0)
    throw Error(Str("cannot read --load ", t.load, ": ", std::strerror(errno)));
  if (t.dataset == "fashion-mnist") CheckFashionMnistDir(t.data_dir);
  const int64_t train_size = t.dataset == "fashion-mnist" ? kFashionTrain : kSyntheticTrain;
  const int64_t test_size = t.dataset == "fashion-mnist" ? kFashionTest : kSyntheticAll - kSyntheticTrain;
  if (t.eval_batch > test_size)
    throw Error(Str("--eval-batch ", t.eval_batch, " is larger than the ", t.dataset, " test split (", test_size, " examples)"));
  if (test_size % t.eval_batch != 0)
    throw Error(Str("--eval-batch ", t.eval_batch, " does not divide the ", t.dataset, " test split (", test_size,
                    " examples): the last ", test_size % t.eval_batch, " would not be evaluated",
                    "; use ", NearDivisors(test_size, t.eval_batch)));
  if (t.program.batch > train_size)
    throw Error(Str("--batch ", t.program.batch, " is larger than the ", t.dataset, " train split (", train_size, " examples)"));

  // 2. The step (cheap: the DSL lowers one replica's module; no state is allocated) and its memory.
  dsl::Program program = BuildProgram(t.program, t.steps);
  ir::Module forward = BuildForward(t.program, t.eval_batch);
  if (!t.no_memory_check) {
    const int64_t example_bytes = ir::NumElements(spec.example_shape) * 4 + 4;
    const int64_t data = t.dataset == "fashion-mnist"
                             ? (kFashionTrain + kFashionTest) * example_bytes + kFashionTrain * (example_bytes / 4)  // + raw bytes while loading
                             : 2 * kSyntheticAll * example_bytes;
    int64_t logical = 0;
    for (auto& [name, type] : runtime::LogicalTypes(program.step)) logical += type.bytes();
    const ir::MemoryPlan eval = ir::PlanMemory(forward);
    const int64_t eval_bytes = eval.peak_temp_bytes + t.eval_batch * example_bytes;
    MemoryNeed need = StepMemoryNeed(program.step, /*keeps_all_values=*/t.backend == "interp");
    need.others = {{"dataset", data}, {"logical state", logical}, {"evaluation", eval_bytes}};
    CheckMemory(need, AvailableMemoryBytes(), "use fewer --replicas, a smaller --batch or model (--no-memory-check to try anyway)");
  }

  // 3. State, data, backend, training.
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
    runtime::Dataset all = runtime::SyntheticClassification(kSyntheticAll, 1, 28, 28, 10, t.program.seed);
    train = runtime::TakeExamples(all, 0, kSyntheticTrain);
    test = runtime::TakeExamples(all, kSyntheticTrain, kSyntheticAll);
  }
  if (test.size() % t.eval_batch != 0)  // a split of another size than expected
    throw Error(Str("--eval-batch ", t.eval_batch, " does not divide the test split (", test.size(), " examples)"));

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

}  // namespace

Command AddTrainCommand(CLI::App& app) {
  auto t = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "train a model");
  AddModelFlags(cmd, &t->program);
  AddPipelineFlags(cmd, &t->program);
  cmd->add_option("--dataset", t->dataset, "fashion-mnist|synthetic")
      ->check(CLI::IsMember({"fashion-mnist", "synthetic"}))->capture_default_str();
  cmd->add_option("--data-dir", t->data_dir, "directory of the Fashion-MNIST IDX files")->capture_default_str();
  cmd->add_option("--steps", t->steps, "training steps")->check(kPositiveInt)->capture_default_str();
  cmd->add_flag("--no-shuffle", t->no_shuffle, "feed batches in file order");
  cmd->add_option("--save", t->save, "write the final state to this safetensors file");
  cmd->add_option("--load", t->load, "start from this safetensors checkpoint");
  cmd->add_option("--save-init", t->save_init, "write the initial state to this safetensors file");
  cmd->add_option("--metrics-out", t->metrics_out, "write per-step metrics as JSON Lines");
  cmd->add_option("--plot-out", t->plot_out, "write an SVG of the loss curve and the step-time breakdown");
  cmd->add_option("--log-every", t->log_every, "progress line every N steps")->check(kPositiveInt);
  cmd->add_option("--eval-every", t->eval_every, "evaluate every N steps (0: at the end)")->check(kNonNegativeInt);
  cmd->add_option("--backend", t->backend, "interp (reference interpreter) | cpu (LLVM JIT)")
      ->check(CLI::IsMember({"interp", "cpu"}))->capture_default_str();
  cmd->add_option("--eval-batch", t->eval_batch, "evaluation batch; must divide the test split (10000, synthetic 2000)")
      ->check(kPositiveInt)->capture_default_str();
  cmd->add_flag("--no-memory-check", t->no_memory_check,
                "start even when the memory plan exceeds the machine's available memory");
  return {cmd, [t] { return RunTrain(*t); }};
}

}  // namespace shardstep::cli
