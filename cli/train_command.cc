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

#include "api/session.h"
#include "cli/backend_flag.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/mpi_launch.h"
#include "cli/preflight.h"
#include "ir/error.h"
#include "ir/memory_plan.h"
#include "jit/cpu_executor.h"
#include "jit/dnnl_kernels.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_dir.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "runtime/image_data.h"
#include "runtime/mllog.h"
#include "runtime/stop_signal.h"
#include "runtime/text_data.h"
#include "runtime/trainer.h"
#include "tpu_backend/mesh_backend.h"

namespace shardstep::cli {
namespace {

struct TrainFlags {
  ProgramFlags program;
  std::string dataset;  // "" = the model's default (ModelSpec::dataset)
  std::string data_dir = runtime::kFashionMnistDir;
  std::string data_file;  // text corpus ("" = the King James Bible)
  int64_t steps = 2000;
  bool no_shuffle = false;
  std::string save, load, save_init, metrics_out, plot_out, save_batches, mllog;
  int64_t log_every = 100, eval_every = 0, eval_batch = 1000, eval_batches = 0;
  const CLI::Option* eval_batch_option = nullptr;  // given (on the command line or in --config)?
  std::string backend = "cpu";
  std::string mesh;  // --mesh XxY (tpu-mesh): 2·X·Y replicas
  const CLI::Option* replicas_option = nullptr;  // --replicas given (a conflict with --mesh is an error)?
  bool no_memory_check = false, no_prefetch = false, dry_run = false;
  // Periodic checkpoints and resuming (runtime/checkpoint_dir.h).
  int64_t save_every = 0, keep = 3;
  std::string checkpoint_dir, resume;
  // Under mpirun (cli/mpi_launch.h): replica threads per rank, and how long a collective may take.
  int replicas_per_process = 0;
  double collective_timeout = 0;
};

// runtime/trainer.h declares models::Task opaquely with these values.
static_assert(models::Task::kClassification == runtime::kClassificationTask &&
              models::Task::kLanguageModel == runtime::kLanguageModelTask &&
              models::Task::kMaskedLm == runtime::kMaskedLmTask);

// Examples in each split, known before loading (the memory check runs first).
constexpr int64_t kFashionTrain = runtime::kFashionTrainSize, kFashionTest = runtime::kFashionTestSize,
                  kSyntheticAll = runtime::kSyntheticSize, kSyntheticTrain = runtime::kSyntheticTrainSize;

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
std::map<std::string, std::string> RunIdentity(const TrainFlags& t, const std::string& dataset) {
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
      {"--dataset", dataset}, {"--model", p.model}, {"--hidden", hidden}, {"--batch", Str(p.batch)},
      {"--seed", Str(p.seed)}, {"--no-shuffle", t.no_shuffle ? "true" : "false"}, {"--optimizer", p.optimizer},
      {"--lr", exact(c.lr_)}, {"--eps", exact(c.eps_)}, {"--weight-decay", exact(c.weight_decay_)},
      {"--clip-norm", exact(c.clip_norm_)}, {"--schedule", p.schedule}};
  for (const auto& [flag, value] : ModelOptionFlags(p)) id[flag] = value;
  if (!t.data_file.empty()) id["--data-file"] = t.data_file;
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

bool IsImageDataset(const std::string& d) { return d == "fashion-mnist" || d == "synthetic" || d == "synthetic-imagenet"; }

// The sequence length of a text model at these flags: --context, else what its "tokens" input takes at
// the model's default (read from a forward module built with a stand-in vocabulary).
int64_t ContextOf(const ProgramFlags& f) {
  if (f.context > 0) return f.context;
  ProgramFlags probe = f;
  if (probe.vocab == 0) probe.vocab = 256;
  ir::Module m = BuildForward(probe, 1);
  for (ir::ValueId v : m.Inputs())
    if (m.instrs[v].name == "tokens" && m.type(v).shape.size() == 2) return m.type(v).shape[1];
  throw Error(Str("--model ", f.model, " has no \"tokens\" input [B, T]"));
}

// A checkpoint whose embedding tables disagree with the data's vocabulary: a clear error, not a list of
// shape mismatches.
void CheckVocabulary(const runtime::TensorMap& loaded, const std::map<std::string, ir::TensorType>& expected,
                     int64_t vocab, const std::string& path, const std::string& data) {
  for (const auto& [name, type] : expected) {
    auto it = loaded.find(name);
    if (it == loaded.end() || type.shape.empty() || type.shape[0] != vocab) continue;
    const ir::Shape& got = it->second.shape();
    if (got.size() != type.shape.size() || got[0] == vocab) continue;
    if (!std::equal(got.begin() + 1, got.end(), type.shape.begin() + 1)) continue;
    throw Error(Str(path, ": ", name, " is ", ir::ShapeToString(got), ", a vocabulary of ", got[0], ", but ", data,
                    " gives a vocabulary of ", vocab, " (", ir::ShapeToString(type.shape),
                    "): use the data the checkpoint was trained on (--data-file), or --vocab ", got[0],
                    " for a word vocabulary"));
  }
}

// A checkpoint whose position table ("pos_emb.w" [positions, D]) has another length than the model built
// at --context: name the option, not a shape mismatch.
void CheckContext(const runtime::TensorMap& loaded, const std::map<std::string, ir::TensorType>& expected,
                  int64_t context, const std::string& path) {
  auto want = expected.find("pos_emb.w");
  auto got = loaded.find("pos_emb.w");
  if (want == expected.end() || got == loaded.end() || got->second.shape().size() != 2) return;
  const int64_t have = got->second.shape()[0];
  if (have == want->second.shape[0]) return;
  throw Error(Str("--context ", context, (context > have ? " is longer than" : " does not match"),
                  " the position table of ", path, " (pos_emb.w is ", ir::ShapeToString(got->second.shape()),
                  ", ", have, " positions): use --context ", have, " with this checkpoint"));
}

// The MLPerf log of a `train` run (--mllog): what has been logged so far, so that a failure anywhere
// still ends the log with run_stop "aborted" and the reason.
struct MlRun {
  runtime::MlLog* log = nullptr;
  bool header = false, init_open = false, run_started = false;
};

// The MLPerf benchmark a model stands in for (open division: not MLPerf's data) and the header keys.
void LogMlHeader(const TrainFlags& t, const models::ModelSpec& spec, MlRun* ml) {
  namespace k = runtime::mllog;
  runtime::MlLog& log = *ml->log;
  const std::string benchmark = spec.name == "bert" ? "bert" : spec.name == "transformer_lm" ? "gpt3" : "resnet";
  log.Event(k::kSubmissionBenchmark, benchmark);
  log.Event(k::kSubmissionOrg, "shardstep");
  log.Event(k::kSubmissionDivision, "open");
  log.Event(k::kSubmissionStatus, "research");
  log.Event(k::kSubmissionPlatform, Str(jit::NumCores(), "-core CPU, backend ", t.backend, ", ", t.program.replicas,
                                        " replica(s)"));
  log.Event(k::kCacheClear, true);
  ml->header = true;
  log.Start(k::kInitStart);
  ml->init_open = true;
  log.Event(k::kSeed, t.program.seed);
  log.Event(k::kGlobalBatchSize, t.program.batch);
  log.Event(k::kGradientAccumulationSteps, 1);
  log.Event(k::kTrainSamples, t.steps * t.program.batch);
  log.Event(k::kOptName, t.program.optimizer);
  log.Event(k::kOptBaseLearningRate, t.program.lr);
  log.Event(k::kOptLearningRateWarmupSteps, t.program.warmup_steps);
  log.Event(k::kOptWeightDecay, t.program.weight_decay);
}

// --mesh XxY: the tpu-mesh backend on X×Y chips, one replica per core (2·X·Y replicas), registered for this
// run; --replicas may only repeat that count.
void ApplyMeshFlag(TrainFlags& t) {
  if (t.mesh.empty()) return;
  if (t.backend != "tpu-mesh")
    throw Error(Str("--mesh ", t.mesh, " is for --backend tpu-mesh; --backend is ", t.backend));
  const tpu::MeshTopology mesh = tpu::MeshTopology::Parse(t.mesh);
  if (t.replicas_option && t.replicas_option->count() > 0 && t.program.replicas != mesh.replicas())
    throw Error(Str("--mesh ", t.mesh, " means ", mesh.replicas(), " replicas (", mesh.cores_per_chip(),
                    " cores per chip, one replica each) but --replicas is ", t.program.replicas,
                    "; drop --replicas or make it ", mesh.replicas()));
  t.program.replicas = mesh.replicas();
  RegisterBackend("tpu-mesh", tpu::MeshBackendFactory(mesh));
}

int RunTrain(const TrainFlags& t_in, MlRun* ml) {
  TrainFlags t = t_in;
  const models::ModelSpec& spec = models::FindModel(t.program.model);
  const models::Task task = spec.task;
  const std::string dataset = t.dataset.empty() ? spec.dataset : t.dataset;
  const bool text = !IsImageDataset(dataset);
  if (task == models::Task::kClassification && text)
    throw Error(Str("--dataset ", dataset, " is a text corpus; --model ", spec.name,
                    " classifies images (fashion-mnist, synthetic, synthetic-imagenet)"));
  if (task != models::Task::kClassification && !text)
    throw Error(Str("--dataset ", dataset, " holds images; --model ", spec.name, " is a ", models::TaskName(task),
                    " model (--dataset kjv, optionally with --data-file FILE)"));
  if (t.program.classes == 0 && dataset == "synthetic-imagenet") t.program.classes = 1000;
  if (!t.data_file.empty() && !text) throw Error(Str("--data-file is for text models; --dataset ", dataset, " holds images"));
  if (t.eval_batch_option == nullptr || t.eval_batch_option->count() == 0)  // the task's default
    t.eval_batch = text ? 64 : dataset == "synthetic-imagenet" ? std::min<int64_t>(t.program.batch, 1000) : t.eval_batch;
  ApplyMeshFlag(t);
  // 1. Outputs and inputs that can be checked without building anything.
  CheckOutputPaths({{"--save", t.save}, {"--save-init", t.save_init}, {"--metrics-out", t.metrics_out},
                    {"--plot-out", t.plot_out}, {"--save-batches", t.save_batches}, {"--mllog", t.mllog}});
  if (!t.load.empty() && ::access(t.load.c_str(), R_OK) != 0)
    throw Error(Str("cannot read --load ", t.load, ": ", std::strerror(errno)));
  if (!t.data_file.empty() && ::access(t.data_file.c_str(), R_OK) != 0)
    throw Error(Str("cannot read --data-file ", t.data_file, ": ", std::strerror(errno)));
  // Periodic checkpoints and resuming: the directory to resume from, and the one to save into
  // (--checkpoint-dir, by default the --resume directory).
  if (!t.resume.empty() && !t.load.empty()) throw Error("--resume and --load exclude each other (--resume restores the state too)");
  const std::string checkpoint_dir = !t.checkpoint_dir.empty() ? t.checkpoint_dir : t.save_every > 0 ? t.resume : "";
  if (t.save_every > 0 && checkpoint_dir.empty()) throw Error("--save-every needs --checkpoint-dir DIR (or --resume DIR)");
  if (t.save_every == 0 && !t.checkpoint_dir.empty()) throw Error("--checkpoint-dir needs --save-every K");
  if (dataset == "fashion-mnist") CheckFashionMnistDir(t.data_dir);
  if (dataset == "fashion-mnist" || dataset == "synthetic") {
    const int64_t train_size = dataset == "fashion-mnist" ? kFashionTrain : kSyntheticTrain;
    const int64_t test_size = dataset == "fashion-mnist" ? kFashionTest : kSyntheticAll - kSyntheticTrain;
    if (t.eval_batch > test_size)
      throw Error(Str("--eval-batch ", t.eval_batch, " is larger than the ", dataset, " test split (", test_size, " examples)"));
    if (test_size % t.eval_batch != 0)
      throw Error(Str("--eval-batch ", t.eval_batch, " does not divide the ", dataset, " test split (", test_size,
                      " examples): the last ", test_size % t.eval_batch, " would not be evaluated",
                      "; use ", NearDivisors(test_size, t.eval_batch)));
    if (t.program.batch > train_size)
      throw Error(Str("--batch ", t.program.batch, " is larger than the ", dataset, " train split (", train_size, " examples)"));
  }

  // 2. Text data first: the model's vocabulary is the data's.
  std::unique_ptr<runtime::BatchSource> train_source;
  std::unique_ptr<runtime::EvalSet> eval_set;
  std::string data_name = dataset == "kjv" && t.data_file.empty() ? "the King James Bible (--dataset kjv)"
                                                                  : Str("--data-file ", t.data_file);
  if (text) {
    if (dataset != "kjv") throw Error(Str("--dataset ", dataset, ": unknown"));
    runtime::TextDataOptions to;
    to.file = t.data_file;
    to.context = ContextOf(t.program);
    to.batch = t.program.batch;
    to.eval_batch = t.eval_batch;
    to.seed = t.program.seed;
    to.shuffle = !t.no_shuffle;
    to.vocab_size = task == models::Task::kMaskedLm ? t.program.vocab : 0;
    to.max_eval_batches = t.eval_batches;
    runtime::TextData td = task == models::Task::kMaskedLm ? runtime::MakeMaskedLmData(to) : runtime::MakeCharLmData(to);
    if (task == models::Task::kLanguageModel && t.program.vocab > 0 && t.program.vocab != td.vocab)
      throw Error(Str("--vocab ", t.program.vocab, " disagrees with ", data_name, ", whose characters make a vocabulary of ",
                      td.vocab, " (character models take the text's vocabulary: leave --vocab out)"));
    t.program.vocab = td.vocab;
    if (t.program.context == 0) t.program.context = to.context;
    train_source = std::move(td.train);
    eval_set = std::move(td.eval);
  }

  const std::map<std::string, std::string> identity = RunIdentity(t, dataset);
  std::optional<runtime::ResumePoint> resume;
  if (!t.resume.empty()) {
    resume = runtime::FindResumePoint(t.resume);
    for (const std::string& s : resume->skipped) std::cout << "skipped " << s << "\n";
    for (const std::string& f : resume->temporaries) std::cout << "ignored " << f << " (an incomplete write)\n";
    CheckSameRun(*resume, identity, t.program.decay_steps == 0);
    if (resume->step > t.steps)
      throw Error(Str("--resume: ", resume->path, " is at step ", resume->step, ", past --steps ", t.steps));
  }
  if (t.save_every > 0 && !t.dry_run) {
    std::error_code ec;
    const bool same = resume && std::filesystem::equivalent(checkpoint_dir, t.resume, ec);
    runtime::PrepareCheckpointDirectory(checkpoint_dir, same ? std::optional<int64_t>(resume->step) : std::nullopt,
                                        std::cout);
  }

  // 3. The step (cheap: the DSL lowers one replica's module; no state is allocated) and its memory.
  dsl::Program program = BuildProgram(t.program, t.steps);
  ir::Module forward = BuildForward(t.program, t.eval_batch);
  ir::Shape example_shape = spec.example_shape;
  if (!text)
    for (ir::ValueId v : forward.Inputs())
      if (forward.instrs[v].name == "image") example_shape.assign(forward.type(v).shape.begin() + 1, forward.type(v).shape.end());
  if (!t.no_memory_check) {
    const int64_t example_bytes = ir::NumElements(example_shape) * 4 + 4;
    const int64_t data = dataset == "fashion-mnist"
                             ? (kFashionTrain + kFashionTest) * example_bytes + kFashionTrain * (example_bytes / 4)  // + raw bytes while loading
                         : dataset == "synthetic" ? 2 * kSyntheticAll * example_bytes
                                                  : 0;  // generated per batch, or text (small next to the model)
    int64_t logical = 0;
    for (auto& [name, type] : runtime::LogicalTypes(program.step)) logical += type.bytes();
    const ir::MemoryPlan eval = ir::PlanMemory(forward);
    int64_t eval_inputs = 0;
    for (ir::ValueId v : forward.Inputs()) eval_inputs += forward.type(v).bytes();
    const int64_t eval_bytes = eval.peak_temp_bytes + eval_inputs;
    MemoryNeed need = StepMemoryNeed(program.step, /*keeps_all_values=*/t.backend == "interp");
    need.others = {{"dataset", data}, {"logical state", logical}, {"evaluation", eval_bytes}};
    if (!t.no_prefetch) need.others.push_back({"prefetched batch", need.batch_bytes / std::max(1, program.step.num_replicas)});
    CheckMemory(need, AvailableMemoryBytes(), "use fewer --replicas, a smaller --batch or model (--no-memory-check to try anyway)");
  }
  int64_t params = 0;
  for (ir::ValueId v : program.step.VariablesWithRole(ir::kRoleWeight)) params += program.step.type(v).elements();
  if (t.dry_run) {
    std::cout << "dry run: model " << spec.name << " (" << params << " parameters, " << models::TaskName(task)
              << "), --dataset " << dataset << (text ? Str(" (vocabulary ", t.program.vocab, ", context ", t.program.context, ")") : "")
              << ", batch " << t.program.batch << ", eval batch " << t.eval_batch << ", " << t.steps << " steps, "
              << program.options.optimizer.ToString() << "; nothing trained\n";
    return 0;
  }

  // 4. State, data, backend, training. A checkpoint is checked here (its path in the errors) and loaded
  // into the Session once it exists. For the MLPerf log this is the init interval (compilation included).
  if (ml->log) LogMlHeader(t, spec, ml);
  std::optional<runtime::TensorMap> start_state;
  const std::map<std::string, ir::TensorType> logical_types = runtime::LogicalTypes(program.step);
  if (resume) {
    if (text) CheckVocabulary(resume->tensors, logical_types, t.program.vocab, resume->path, data_name);
    if (text) CheckContext(resume->tensors, logical_types, ContextOf(t.program), resume->path);
    runtime::CheckCheckpointMatches(resume->tensors, logical_types, resume->path);
    start_state = std::move(resume->tensors);
    std::cout << "resuming from " << resume->path << " at step " << resume->step << " of " << t.steps
              << (resume->checksummed ? "" : " (the file has no checksum: its integrity was not verified)") << "\n";
  }
  if (!t.load.empty()) {
    bool checksummed = false;
    runtime::TensorMap loaded = runtime::LoadCheckpoint(t.load, nullptr, &checksummed);
    if (text) CheckVocabulary(loaded, logical_types, t.program.vocab, t.load, data_name);
    if (text) CheckContext(loaded, logical_types, ContextOf(t.program), t.load);
    runtime::CheckCheckpointMatches(loaded, logical_types, t.load);
    start_state = std::move(loaded);
    std::cout << "loaded checkpoint " << t.load
              << (checksummed ? "" : " (no checksum, as written by older shardstep or other tools: only its structure was checked)")
              << "\n";
  }
  if (!text) {
    runtime::ImageDataOptions io;
    io.dataset = dataset;
    io.data_dir = t.data_dir;
    io.batch = t.program.batch;
    io.eval_batch = t.eval_batch;
    io.seed = t.program.seed;
    io.shuffle = !t.no_shuffle;
    io.example_shape = example_shape;
    io.classes = models::FindModel(t.program.model).task == models::Task::kClassification && t.program.classes > 0
                     ? t.program.classes
                     : dataset == "synthetic-imagenet" ? 1000 : 10;
    io.image_size = t.program.image_size > 0 ? t.program.image_size : 224;
    io.max_eval_batches = t.eval_batches;
    runtime::ImageData id = runtime::MakeImageData(io);
    train_source = std::move(id.train);
    eval_set = std::move(id.eval);
  }

  std::cout << "model " << spec.name << " (" << params << " parameters), " << dataset << " ("
            << train_source->Describe() << " / " << eval_set->Describe() << "), batch " << t.program.batch << ", "
            << t.program.replicas << " replica(s), " << program.options.optimizer.ToString() << ", backend " << t.backend
            << "\n"
            << ir::PlanMemory(program.step).ToString();

  // The backend by name (api/session.h's registry), the state from its initialisers or the checkpoint.
  Session session(program.step, std::move(forward), t.backend);
  if (start_state) {
    session.LoadState(*start_state, resume ? resume->step : 0);
    start_state.reset();
  }
  if (!t.save_init.empty()) {
    runtime::SaveCheckpoint(t.save_init, session.State());
    std::cout << "saved initial state " << t.save_init << "\n";
  }
  if (auto* cpu = dynamic_cast<jit::CpuExecutor*>(&session.executor())) {
    const jit::CompileInfo& ci = cpu->compile_info();
    std::cout << "jit: " << ci.kernels << " fused kernels (" << ci.fused_ops << " ops), " << ci.source << " in "
              << ci.seconds << " s" << (ci.rejected_corrupt ? " (a corrupt cache entry was rejected)" : "") << "\n"
              << "jit buffer plan per replica: " << std::fixed << std::setprecision(3) << ci.arena_bytes / 1048576.0
              << " MiB arena for " << ci.buffer_bytes / 1048576.0 << " MiB of temporaries, plus "
              << ci.swapped_bytes / 1048576.0 << " MiB of new variable values (" << ci.in_place_updates
              << " variables updated in place by their loop, " << ci.gathered_updates << " by their all-gather"
              << (ci.in_place_gathers > 0 ? Str(" (", ci.in_place_gathers, " of them with the replica's own slice stored there by its loop)") : "")
              << "; "
              << ci.reused_inputs << " loop outputs stored over a dead input)\n";
    if (ci.bf16_weight_copies > 0)
      std::cout << ci.bf16_weight_copies << " weights keep a bf16 copy (" << cpu->bf16_copy_bytes() / 1048576.0
                << " MiB per replica) that the optimizer's loop writes: no loop rounds them each step\n";
    if (cpu->shared_weights() > 0)
      std::cout << "replicas share " << cpu->shared_weights() << " weights (" << cpu->shared_weight_bytes() / 1048576.0
                << " MiB): one copy in this process instead of one per replica\n";
    if (cpu->shared_packed_products() > 0)
      std::cout << cpu->shared_packed_products() << " products of a shared weight read one packed copy ("
                << cpu->shared_packed_bytes() / 1048576.0 << " MiB), packed once a step by the replicas together\n";
    if (const int folded = cpu->folded_products(); folded > 0)
      std::cout << folded << " weight gradients computed by their reduce-scatter: each replica its chunk of"
                << " every replica's product, folded as it is made\n";
    std::cout << std::defaultfloat;
  }
  runtime::TrainOptions o;
  o.steps = t.steps;
  o.batch = t.program.batch;
  o.example_shape = example_shape;
  o.shuffle = !t.no_shuffle;
  o.seed = t.program.seed;
  o.log_every = t.log_every;
  o.eval_every = t.eval_every;
  o.eval_batch = t.eval_batch;
  o.prefetch = !t.no_prefetch;
  o.save_batches = t.save_batches;
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
  if (ml->log) {
    ml->log->Event(runtime::mllog::kEvalSamples, eval_set ? eval_set->num_batches() * t.eval_batch : 0);
    ml->log->End(runtime::mllog::kInitStop);
    ml->init_open = false;
    ml->run_started = true;  // runtime::Train logs the run, and its run_stop also when it throws
    o.mllog = ml->log;
    // A logged run stopped by SIGTERM/SIGINT ends between steps with run_stop "aborted" (a second signal
    // kills at once); without --mllog the default actions stay.
    runtime::InstallStopSignalHandlers();
    o.stop_requested = runtime::StopSignalReceived;
  }
  runtime::TrainResult r = runtime::Train(session, *train_source, eval_set.get(), task, o, std::cout);
  if (r.skipped_steps) std::cout << "skipped " << r.skipped_steps << " step(s) with non-finite values\n";
  std::cout << "final: loss " << (r.losses.empty() ? std::string("(no step run)") : Str(r.losses.back())) << ", test "
            << (task == models::Task::kClassification ? "accuracy" : runtime::MetricKey(task)) << " " << r.test_metric
            << ", " << static_cast<int64_t>(r.examples_per_second) << " examples/s\n";
  return 0;
}

// RunTrain with the MLPerf log open (when --mllog is given): a failure before the run started still
// ends the log, with init_stop, run_start and run_stop "aborted" and the reason.
int RunTrainLogged(const TrainFlags& t) {
  if (t.mllog.empty() || t.dry_run) {
    MlRun none;
    return RunTrain(t, &none);
  }
  CheckOutputPaths({{"--mllog", t.mllog}});
  std::unique_ptr<runtime::MlLog> log = runtime::MlLog::OpenFile(t.mllog);
  MlRun ml{log.get()};
  try {
    return RunTrain(t, &ml);
  } catch (const std::exception& e) {
    namespace k = runtime::mllog;
    if (!ml.run_started) {
      if (!ml.header) LogMlHeader(t, models::FindModel(t.program.model), &ml);
      if (ml.init_open) log->End(k::kInitStop, nullptr, {{"status", "aborted"}});
      log->Start(k::kRunStart);
      log->End(k::kRunStop, nullptr, {{"status", "aborted"}, {"error", e.what()}});
    }
    throw;
  }
}

// Under mpirun: this rank's part of the run (cli/mpi_launch.h). Every rank trains with the same flags; the
// replica count is ranks x --replicas-per-process; ranks other than 0 write their outputs (which rank 0
// writes for the run) into a private directory that goes away.
int RunTrainUnderMpi(const TrainFlags& flags) {
  return RunUnderMpi(flags.replicas_per_process, flags.collective_timeout, [&](const MpiRank& rank) {
    TrainFlags t = flags;
    t.program.replicas = MpiReplicaCount(rank, t.program.batch, t.program.replicas, t.program.replica_groups);
    if (rank.rank != 0) {
      for (std::string* path : {&t.save, &t.save_init, &t.metrics_out, &t.plot_out, &t.save_batches, &t.mllog})
        if (!path->empty()) *path = rank.private_dir + "/" + std::filesystem::path(*path).filename().string();
      if (t.save_every > 0) t.checkpoint_dir = rank.private_dir + "/checkpoints";
    }
    return RunTrainLogged(t);
  });
}

}  // namespace

Command AddTrainCommand(CLI::App& app) {
  auto t = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "train a model");
  AddModelFlags(cmd, &t->program);
  AddPipelineFlags(cmd, &t->program);
  cmd->add_option("--dataset", t->dataset,
                  "fashion-mnist|synthetic|synthetic-imagenet (images) or kjv (text: the King James Bible, or "
                  "--data-file); default: the model's")
      ->check(CLI::IsMember({"fashion-mnist", "synthetic", "synthetic-imagenet", "kjv"}));
  cmd->add_option("--data-dir", t->data_dir, "directory of the Fashion-MNIST IDX files")->capture_default_str();
  cmd->add_option("--data-file", t->data_file, "text models: a plain text corpus instead of the King James Bible");
  cmd->add_option("--save-batches", t->save_batches,
                  "write every step's global inputs to this safetensors file (tensors step<k>/<input>, k from 0)");
  cmd->add_flag("--no-prefetch", t->no_prefetch, "prepare each batch when the step needs it, not during the step before");
  cmd->add_flag("--dry-run", t->dry_run,
                "check the flags (and --config), the data and the memory, build the step, print what would run, "
                "and stop before training");
  cmd->add_option("--eval-batches", t->eval_batches,
                  "evaluate on at most this many batches (text and synthetic-imagenet; 0: the whole held-out split)")
      ->check(kNonNegativeInt);
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
  cmd->add_option("--backend", t->backend,
                  "interp (reference interpreter) | cpu (LLVM JIT) | tpu-mesh (emulated TPU torus, see --mesh)")
      ->check(BackendNameValidator())->capture_default_str();
  cmd->add_option("--mesh", t->mesh, "tpu-mesh: XxY chips on a 2D torus, 2 cores each; sets --replicas to 2*X*Y");
  t->replicas_option = cmd->get_option("--replicas");
  t->eval_batch_option =
      cmd->add_option("--eval-batch", t->eval_batch,
                      "evaluation batch; must divide the test split (10000, synthetic 2000); default 1000 for images, "
                      "64 for text, --batch for synthetic-imagenet")
          ->check(kPositiveInt)->capture_default_str();
  cmd->add_flag("--no-memory-check", t->no_memory_check,
                "start even when the memory plan exceeds the machine's available memory");
  cmd->add_option("--mllog", t->mllog,
                  "write the MLPerf training log (:::MLLOG lines, MLCommons training rules, open division) to FILE");
  // mpirun (cli/mpi_launch.h)
  cmd->add_option("--replicas-per-process", t->replicas_per_process,
                  "under mpirun: replica threads per rank (replicas = ranks x this)")->check(kPositiveInt);
  cmd->add_option("--collective-timeout", t->collective_timeout,
                  "under mpirun: end the job when a collective has not completed after SECONDS (0: wait forever)")
      ->check(kNonNegativeFloat);
  return {cmd, [t] {
            if (UnderMpirun()) return RunTrainUnderMpi(*t);
            if (t->replicas_per_process > 0 || t->collective_timeout > 0)
              throw Error(Str(t->replicas_per_process > 0 ? "--replicas-per-process" : "--collective-timeout",
                              " is for runs under mpirun (mpirun -np K shardstep train ...); in one process use "
                              "--replicas"));
            return RunTrainLogged(*t);
          }};
}

}  // namespace shardstep::cli
