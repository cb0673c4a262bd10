// `shardstep train`: checks everything it can first (output paths, dataset files, memory, evaluation
// batch), then builds the step, loads or initialises the state and trains.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/preflight.h"
#include "ir/error.h"
#include "ir/memory_plan.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_dir.h"
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
  // Periodic checkpoints and resuming (runtime/checkpoint_dir.h).
  int64_t save_every = 0, keep = 3;
  std::string checkpoint_dir, resume;
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

// The options that make a run what it is, as flag -> value: a resume with any other value is refused.
// Not among them: --steps (a resume may go further; the decay horizon of a decaying schedule is, as
// --decay-steps), --replicas and the pass flags (the checkpoint is logical; results are bitwise equal
// on the same replica count), the backend, and the output flags.
std::map<std::string, std::string> RunIdentity(const TrainFlags& t) {
  const ProgramFlags& p = t.program;
  const ir::OptimizerConfig c = PipelineFromFlags(p, t.steps).optimizer;
  auto exact = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%.17g", v);
    return std::string(buf);
  };
  std::string hidden;
  for (size_t i = 0; i < p.hidden.size(); ++i) hidden += Str(i ? "," : "", p.hidden[i]);
  std::map<std::string, std::string> id = {
      {"--dataset", t.dataset}, {"--model", p.model}, {"--hidden", hidden}, {"--batch", Str(p.batch)},
      {"--seed", Str(p.seed)}, {"--no-shuffle", t.no_shuffle ? "true" : "false"}, {"--optimizer", p.optimizer},
      {"--lr", exact(c.lr_)}, {"--eps", exact(c.eps_)}, {"--weight-decay", exact(c.weight_decay_)},
      {"--clip-norm", exact(c.clip_norm_)}, {"--schedule", p.schedule}};
  if (c.kind_ == ir::OptimizerKind::kMomentum || c.kind_ == ir::OptimizerKind::kLars) {
    id["--momentum"] = exact(c.momentum_);
    id["--nesterov"] = c.nesterov_ ? "true" : "false";
  }
  if (c.kind_ == ir::OptimizerKind::kAdam || c.kind_ == ir::OptimizerKind::kAdamW || c.kind_ == ir::OptimizerKind::kLamb) {
    id["--beta1"] = exact(c.beta1_);
    id["--beta2"] = exact(c.beta2_);
  }
  if (c.kind_ == ir::OptimizerKind::kLars) id["--trust-coefficient"] = exact(c.trust_coefficient_);
  if (c.kind_ == ir::OptimizerKind::kAdagrad) id["--initial-accumulator"] = exact(c.initial_accumulator_);
  if (c.schedule_ != ir::ScheduleKind::kConstant) id["--warmup-steps"] = Str(c.warmup_steps_);
  if (c.schedule_ == ir::ScheduleKind::kCosine || c.schedule_ == ir::ScheduleKind::kPolynomial) {
    id["--decay-steps"] = Str(c.total_steps_);  // the horizon: --decay-steps, else --steps
    id["--end-lr-factor"] = exact(c.end_lr_factor_);
    if (c.schedule_ == ir::ScheduleKind::kPolynomial) id["--power"] = exact(c.power_);
  }
  return id;
}

// Throws when the checkpoint `rp` was written by a run with other identifying options.
// `horizon_is_steps`: the decay horizon comes from --steps (no --decay-steps given).
void CheckSameRun(const runtime::ResumePoint& rp, const std::map<std::string, std::string>& now, bool horizon_is_steps) {
  nlohmann::json saved = nlohmann::json::parse(rp.metadata.at(runtime::kMetaRunOptions), nullptr, false);
  if (!saved.is_object()) throw Error(Str(rp.path, ": metadata \"", runtime::kMetaRunOptions, "\" is not a JSON object"));
  std::vector<std::string> diffs;
  bool horizon = false;
  for (const auto& [flag, value] : now) {
    auto it = saved.find(flag);
    const std::string was = it == saved.end() || !it->is_string() ? "(not set)" : it->get<std::string>();
    if (was == value) continue;
    diffs.push_back(Str(flag, " ", was, " (this run: ", value, ")"));
    horizon |= flag == "--decay-steps";
  }
  for (const auto& [flag, value] : saved.items())
    if (!now.count(flag)) diffs.push_back(Str(flag, " ", value.is_string() ? value.get<std::string>() : value.dump(), " (this run: not set)"));
  if (diffs.empty()) return;
  std::string msg = Str("--resume: ", rp.path, " was written by a run with other options: ");
  for (size_t i = 0; i < diffs.size(); ++i) msg += (i ? "; " : "") + diffs[i];
  if (horizon && horizon_is_steps)
    msg += ". The decay horizon of --schedule cosine/polynomial is --steps unless --decay-steps is given: pass "
           "the original horizon as --decay-steps";
  msg += ". Resume with the same options, or start a new run from its weights with --load " + rp.path;
  throw Error(msg);
}

int RunTrain(const TrainFlags& t) {
  const models::ModelSpec& spec = models::FindModel(t.program.model);
  // 1. Outputs and inputs that can be checked without building anything.
  CheckOutputPaths({{"--save", t.save}, {"--save-init", t.save_init}, {"--metrics-out", t.metrics_out}, {"--plot-out", t.plot_out}});
  if (!t.load.empty() && ::access(t.load.c_str(), R_OK) != 0)
    throw Error(Str("cannot read --load ", t.load, ": ", std::strerror(errno)));
  // Periodic checkpoints and resuming: the directory to resume from, and the one to save into
  // (--checkpoint-dir, by default the --resume directory).
  if (!t.resume.empty() && !t.load.empty()) throw Error("--resume and --load exclude each other (--resume restores the state too)");
  const std::string checkpoint_dir = !t.checkpoint_dir.empty() ? t.checkpoint_dir : t.save_every > 0 ? t.resume : "";
  if (t.save_every > 0 && checkpoint_dir.empty()) throw Error("--save-every needs --checkpoint-dir DIR (or --resume DIR)");
  if (t.save_every == 0 && !t.checkpoint_dir.empty()) throw Error("--checkpoint-dir needs --save-every K");
  const std::map<std::string, std::string> identity = RunIdentity(t);
  std::optional<runtime::ResumePoint> resume;
  if (!t.resume.empty()) {
    resume = runtime::FindResumePoint(t.resume);
    for (const std::string& s : resume->skipped) std::cout << "skipped " << s << "\n";
    for (const std::string& f : resume->temporaries) std::cout << "ignored " << f << " (an incomplete write)\n";
    CheckSameRun(*resume, identity, t.program.decay_steps == 0);
    if (resume->step > t.steps)
      throw Error(Str("--resume: ", resume->path, " is at step ", resume->step, ", past --steps ", t.steps));
  }
  if (t.save_every > 0) {
    std::error_code ec;
    const bool same = resume && std::filesystem::equivalent(checkpoint_dir, t.resume, ec);
    runtime::PrepareCheckpointDirectory(checkpoint_dir, same ? std::optional<int64_t>(resume->step) : std::nullopt,
                                        std::cout);
  }
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
  if (resume) {
    runtime::CheckCheckpointMatches(resume->tensors, runtime::LogicalTypes(program.step), resume->path);
    state = std::move(resume->tensors);
    std::cout << "resuming from " << resume->path << " at step " << resume->step << " of " << t.steps
              << (resume->checksummed ? "" : " (the file has no checksum: its integrity was not verified)") << "\n";
  }
  if (!t.load.empty()) {
    bool checksummed = false;
    runtime::TensorMap loaded = runtime::LoadCheckpoint(t.load, nullptr, &checksummed);
    runtime::CheckCheckpointMatches(loaded, runtime::LogicalTypes(program.step), t.load);
    state = loaded;
    std::cout << "loaded checkpoint " << t.load
              << (checksummed ? "" : " (no checksum, as written by older shardstep or other tools: only its structure was checked)")
              << "\n";
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
  o.save_every = t.save_every;
  o.checkpoint_dir = checkpoint_dir;
  o.keep = t.keep;
  o.checkpoint_metadata = {{runtime::kMetaRunOptions, nlohmann::json(identity).dump()},
                           {runtime::kMetaReplicas, Str(t.program.replicas)}};
  if (resume) {
    o.start_step = resume->step;
    o.data_epoch = resume->data_epoch;
    o.data_position = resume->data_position;
    auto skipped = resume->metadata.find(runtime::kMetaSkippedSteps);
    if (skipped != resume->metadata.end()) o.start_skipped_steps = std::stoll(skipped->second);
    auto replicas = resume->metadata.find(runtime::kMetaReplicas);
    if (replicas != resume->metadata.end() && replicas->second != Str(t.program.replicas))
      std::cout << "note: the checkpoint was written with " << replicas->second << " replica(s), this run has "
                << t.program.replicas << " (the state is resharded; losses match the uninterrupted run bitwise only "
                << "on the same replica count)\n";
  }
  o.on_nonfinite = t.program.on_nonfinite == "skip"   ? runtime::TrainOptions::OnNonfinite::kSkip
                   : t.program.on_nonfinite == "ignore" ? runtime::TrainOptions::OnNonfinite::kIgnore
                                                        : runtime::TrainOptions::OnNonfinite::kStop;
  const ir::MemoryPlan mem = ir::PlanMemory(program.step);
  o.memory = {{"weights_bytes", mem.weight_bytes},
              {"optimizer_state_bytes", mem.optimizer_state_bytes},
              {"gradients_bytes", mem.gradient_bytes},
              {"peak_temporaries_bytes", mem.peak_temp_bytes}};
  runtime::TrainResult r = runtime::Train(*exec, forward, train, &test, o, std::cout);
  if (r.skipped_steps) std::cout << "skipped " << r.skipped_steps << " step(s) with non-finite values\n";
  std::cout << "final: loss " << (r.losses.empty() ? std::string("(no step run)") : Str(r.losses.back())) << ", test accuracy " << r.test_accuracy << ", "
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
  cmd->add_option("--save-every", t->save_every,
                  "every K steps write a checkpoint of the state and what a resume needs into --checkpoint-dir")
      ->check(kNonNegativeInt);
  cmd->add_option("--checkpoint-dir", t->checkpoint_dir,
                  "directory of the periodic checkpoints, step-<step>.safetensors (default: the --resume directory)");
  cmd->add_option("--keep", t->keep, "keep the newest K periodic checkpoints")->check(kPositiveInt)->capture_default_str();
  cmd->add_option("--resume", t->resume,
                  "continue the run from the newest complete checkpoint in this directory (same options; --steps is "
                  "the total)");
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
