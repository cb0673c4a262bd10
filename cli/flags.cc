// Model and program flags, their translation into pipeline options, and short validators.
#include "cli/flags.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "ir/error.h"
#include "ir/passes/mixed_precision.h"
#include "models/models.h"
#include "runtime/text_data.h"

namespace shardstep::cli {
namespace {

// A validator that parses the whole value as T and checks `ok`; the message names what was expected.
template <typename T, typename Ok>
CLI::Validator NumberValidator(const char* what, const char* desc, Ok ok) {
  return CLI::Validator(
      [what, ok](std::string& s) -> std::string {
        T v{};
        const char* b = s.data();
        const char* e = s.data() + s.size();
        bool parsed = false;
        if constexpr (std::is_integral_v<T>) {
          auto r = std::from_chars(b + (b != e && *b == '+'), e, v);
          parsed = r.ec == std::errc() && r.ptr == e;
          if (r.ec == std::errc::result_out_of_range) return Str("must be ", what, ", got ", s, " (out of range)");
        } else {
          try {
            size_t pos = 0;
            v = std::stod(s, &pos);
            parsed = pos == s.size();
          } catch (const std::exception&) {
          }
        }
        if (!parsed || !ok(v)) return Str("must be ", what, ", got ", s);
        return "";
      },
      desc);
}

}  // namespace

const CLI::Validator kPositiveInt =
    NumberValidator<int64_t>("a positive integer", "POSITIVE", [](int64_t v) { return v > 0; });
const CLI::Validator kNonNegativeInt =
    NumberValidator<int64_t>("a non-negative integer", "NONNEGATIVE", [](int64_t v) { return v >= 0; });
const CLI::Validator kPositiveFloat =
    NumberValidator<double>("a positive number", "POSITIVE", [](double v) { return v > 0 && v < HUGE_VAL; });
const CLI::Validator kNonNegativeFloat =
    NumberValidator<double>("a non-negative number", "NONNEGATIVE", [](double v) { return v >= 0 && v < HUGE_VAL; });

std::vector<CLI::Option*> AddModelFlags(CLI::App* app, ProgramFlags* f) {
  std::vector<std::string> model_names;
  std::string listing;
  for (auto& s : models::AllModels()) {
    model_names.push_back(s.name);
    listing += Str("\n    ", s.name, ": ", s.description, " [", models::TaskName(s.task), ", default --dataset ",
                   s.dataset, "]");
  }
  return {
      app->add_option("--model", f->model, "model to train:" + listing)->check(CLI::IsMember(model_names))->capture_default_str(),
      app->add_option("--context", f->context, "sequence models: context length T (0: the model's default)")
          ->check(kNonNegativeInt),
      app->add_option("--layers", f->layers, "sequence models: transformer blocks (0: the model's default)")
          ->check(kNonNegativeInt),
      app->add_option("--width", f->width, "sequence models: model width D (0: the model's default)")->check(kNonNegativeInt),
      app->add_option("--heads", f->heads, "sequence models: attention heads (0: the model's default)")->check(kNonNegativeInt),
      app->add_option("--mlp-width", f->mlp_width, "sequence models: MLP hidden width (0: 4 x --width)")
          ->check(kNonNegativeInt),
      app->add_option("--dropout", f->dropout, "dropout probability (sequence models)")->check(CLI::Range(0.0, 0.99)),
      app->add_option("--size", f->size, "bert: small|base|large")->check(CLI::IsMember({"small", "base", "large"})),
      app->add_option("--label-smoothing", f->label_smoothing, "label smoothing of the cross-entropy loss")
          ->check(CLI::Range(0.0, 0.99)),
      app->add_flag("--cross-replica-bn", f->cross_replica_bn,
                    "batch-norm statistics over the replica group's batches, not each replica's"),
      app->add_option("--classes", f->classes,
                      "classification: number of classes (0: 1000 on synthetic-imagenet, else 10)")
          ->check(kNonNegativeInt),
      app->add_option("--image-size", f->image_size, "image models: input height and width (0: the model's default)")
          ->check(kNonNegativeInt),
      app->add_option("--vocab", f->vocab,
                      "masked LM: word vocabulary size incl. special tokens (0: the data's default); character "
                      "models take the vocabulary of the text")
          ->check(kNonNegativeInt),
      app->add_option("--hidden", f->hidden, "MLP hidden widths, e.g. 1024,1024")->delimiter(',')->capture_default_str(),
      app->add_option("--batch", f->batch, "global batch size")->check(kPositiveInt)->capture_default_str(),
      app->add_option("--replicas", f->replicas, "data-parallel replicas")->check(CLI::Range(1, 4096))->capture_default_str(),
      app->add_option("--seed", f->seed, "seed for initialisation and shuffling")->check(kNonNegativeInt)->capture_default_str(),
  };
}

void AddPipelineFlags(CLI::App* app, ProgramFlags* f) {
  app->add_option("--optimizer", f->optimizer, "sgd|momentum|adam|adamw|adagrad|lamb|lars")
      ->check(CLI::IsMember({"sgd", "momentum", "adam", "adamw", "adagrad", "lamb", "lars"}))
      ->capture_default_str();
  app->add_option("--lr", f->lr, "base learning rate")->check(kPositiveFloat)->capture_default_str();
  app->add_option("--momentum", f->momentum, "momentum (momentum, lars)")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_flag("--nesterov", f->nesterov, "Nesterov momentum");
  app->add_option("--beta1", f->beta1, "Adam/LAMB beta1")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_option("--beta2", f->beta2, "Adam/LAMB beta2")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app->add_option("--eps", f->eps, "epsilon (default: the optimizer's)")->check(kNonNegativeFloat);
  app->add_option("--weight-decay", f->weight_decay, "weight decay")->check(kNonNegativeFloat)->capture_default_str();
  app->add_option("--clip-norm", f->clip_norm, "clip gradients to this global norm (0: off)")->check(kNonNegativeFloat);
  app->add_option("--schedule", f->schedule, "constant|warmup|cosine|polynomial")
      ->check(CLI::IsMember({"constant", "warmup", "cosine", "polynomial"}))->capture_default_str();
  app->add_option("--warmup-steps", f->warmup_steps, "linear warm-up steps")->check(kNonNegativeInt);
  app->add_option("--decay-steps", f->decay_steps, "cosine/polynomial decay horizon (default: --steps)")->check(kNonNegativeInt);
  app->add_option("--end-lr-factor", f->end_lr_factor, "final lr / base lr for decays")->check(CLI::Range(0.0, 1.0));
  app->add_option("--power", f->power, "polynomial decay power")->check(kPositiveFloat);
  app->add_option("--trust-coefficient", f->trust_coefficient, "LARS eta")->check(kPositiveFloat);
  app->add_option("--initial-accumulator", f->initial_accumulator, "Adagrad's initial accumulator value")
      ->check(kNonNegativeFloat);
  app->add_option("--replica-groups", f->replica_groups, "AxB: data parallel within A groups of B replicas");
  app->add_option("--shard-weight-update", f->shard_weight_update, "on|off|auto (auto: on when replicas > 1)")
      ->check(CLI::IsMember({"on", "off", "auto"}))->capture_default_str();
  app->add_option("--gather-weights", f->gather_weights,
                  "all-gather of updated weights: at the end of the step, or deferred to the start of the next")
      ->check(CLI::IsMember({"end", "start"}))->capture_default_str();
  app->add_option("--combine-threshold-bytes", f->combine_bytes, "combine collectives up to this many bytes (0: off)")
      ->check(kNonNegativeInt)->capture_default_str();
  app->add_option("--combine-threshold-count", f->combine_count, "combine at most this many collectives")
      ->check(kNonNegativeInt)->capture_default_str();
  app->add_option("--on-nonfinite", f->on_nonfinite,
                  "a step with a NaN/inf loss or gradient: stop (exit naming the step and the first non-finite "
                  "tensor; the state stays that of the step before), skip (leave weights and optimizer state "
                  "unchanged, count it, go on) or ignore (no check in the step)")
      ->check(CLI::IsMember({"stop", "skip", "ignore"}))->capture_default_str();
  // Mixed precision (issue 10): matmul and convolution operands rounded to bf16, f32 accumulation.
  app->add_option("--precision", f->precision,
                  "bf16: round the inputs of matmuls and convolutions to bf16 (f32 accumulation; weights, "
                  "optimizer state and collectives stay f32), or f32")
      ->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
}

namespace {

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

}  // namespace

models::ModelOptions ModelOptionsFromFlags(const ProgramFlags& f, int64_t batch) {
  models::ModelOptions o;
  o.batch = batch;
  o.hidden = f.hidden;
  for (int64_t h : o.hidden)
    if (h <= 0) throw Error(Str("--hidden: widths must be positive, got ", h));
  o.classes = f.classes > 0 ? f.classes : models::FindModel(f.model).dataset == "synthetic-imagenet" ? 1000 : 10;
  o.context = f.context;
  o.layers = f.layers;
  o.width = f.width;
  o.heads = f.heads;
  o.mlp_width = f.mlp_width;
  o.image_size = f.image_size;
  o.vocab = f.vocab;
  o.dropout = f.dropout;
  o.label_smoothing = f.label_smoothing;
  o.size = f.size;
  o.cross_replica_bn = f.cross_replica_bn;
  return o;
}

std::map<std::string, std::string> ModelOptionFlags(const ProgramFlags& f) {
  std::map<std::string, std::string> m;
  auto num = [&](const char* flag, double v) {
    if (v == 0) return;
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%.17g", v);
    m[flag] = buf;
  };
  num("--context", f.context);
  num("--layers", f.layers);
  num("--width", f.width);
  num("--heads", f.heads);
  num("--mlp-width", f.mlp_width);
  num("--image-size", f.image_size);
  num("--vocab", f.vocab);
  num("--classes", f.classes);
  num("--dropout", f.dropout);
  num("--label-smoothing", f.label_smoothing);
  if (!f.size.empty()) m["--size"] = f.size;
  if (f.cross_replica_bn) m["--cross-replica-bn"] = "true";
  return m;
}

ir::PipelineOptions PipelineFromFlags(const ProgramFlags& f, int64_t steps, int replicas) {
  ir::PipelineOptions o;
  o.optimizer = OptimizerFromFlags(f, steps);
  o.replicas = replicas > 0 ? replicas : f.replicas;
  if (!f.replica_groups.empty()) {
    int a = 0, b = 0;
    char x = 0, extra = 0;
    if (std::sscanf(f.replica_groups.c_str(), "%d%c%d%c", &a, &x, &b, &extra) != 3 || x != 'x' || a < 1 || b < 1)
      throw Error(Str("--replica-groups: expected AxB (A groups of B replicas), got '", f.replica_groups, "'"));
    if (int64_t{a} * b != o.replicas)
      throw Error(Str("--replica-groups ", f.replica_groups, " makes ", int64_t{a} * b, " replicas but ",
                      replicas > 0 ? "the module has " : "--replicas is ", o.replicas));
    o.group_size = b;
  }
  o.shard_weight_update = f.shard_weight_update != "off";
  o.gather_at_start = f.gather_weights == "start";
  o.combine_bytes = f.combine_bytes;
  o.combine_count = f.combine_count;
  o.nonfinite_guard = f.on_nonfinite != "ignore";
  o.bf16_contractions = ir::ParsePrecision(f.precision);
  return o;
}

void ResolveTextVocab(ProgramFlags* f) {
  const models::Task task = models::FindModel(f->model).task;
  if (task == models::Task::kClassification || f->vocab > 0) return;
  // bert base/large: the published WordPiece vocabulary (30522) is the size's own, as their counts have it.
  if (f->model == "bert" && (f->size == "base" || f->size == "large")) return;
  runtime::TextDataOptions o;
  o.context = f->context > 0 ? f->context : 128;
  o.batch = o.eval_batch = 1;
  o.max_eval_batches = 1;
  f->vocab = (task == models::Task::kMaskedLm ? runtime::MakeMaskedLmData(o) : runtime::MakeCharLmData(o)).vocab;
}

// Each replica takes an equal share of the global batch: said here with the flags' names, before the model's
// first input would say it with the model's source line.
void CheckBatchSplits(const ProgramFlags& f) {
  if (f.replicas <= 1 || f.batch % f.replicas == 0) return;
  const int64_t below = f.batch / f.replicas * f.replicas, above = below + f.replicas;
  std::string divisors;
  for (int r = f.replicas - 1; r >= 1 && divisors.empty(); --r)
    if (f.batch % r == 0) divisors = Str(r);
  throw Error(Str("--batch ", f.batch, " does not split evenly over ", f.replicas,
                  " replicas (each takes batch / replicas examples): use --batch ",
                  below > 0 ? Str(below, " or ", above) : Str(above), ", or --replicas ", divisors));
}

dsl::Program BuildProgram(const ProgramFlags& f, int64_t steps) {
  CheckBatchSplits(f);
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

ir::Module BuildModule(const ProgramFlags& f) {
  CheckBatchSplits(f);
  const models::ModelSpec& spec = models::FindModel(f.model);
  dsl::Model m(spec.name, f.seed);
  m.train(spec.define(m, ModelOptionsFromFlags(f, f.batch)));
  // Training mode: the pipeline builds the training step from it (dropout, model-state assignments).
  return m.lower(f.replicas, dsl::Mode::kTrain, PipelineFromFlags(f, 1).group_size);
}

int EditDistance(const std::string& a, const std::string& b) {
  // Optimal string alignment: insertions, deletions, substitutions and swaps of neighbours ("modle").
  std::vector<std::vector<int>> d(a.size() + 1, std::vector<int>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

std::string ClosestMatch(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  int best_d = std::numeric_limits<int>::max();
  for (const std::string& c : candidates) {
    const int d = EditDistance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  // A likely typo: a third of the word's letters at most (at least one, at most three edits).
  const int limit = std::clamp(static_cast<int>(word.size()) / 3, 1, 3);
  return best_d <= limit ? best : "";
}

}  // namespace shardstep::cli
