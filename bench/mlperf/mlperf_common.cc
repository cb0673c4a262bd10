#include "bench/mlperf/mlperf_common.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <thread>

#include "ir/builder.h"
#include "ir/memory_plan.h"
#include "ir/passes/collective_combiner.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/optimizer_lowering.h"
#include "ir/passes/weight_update_sharder.h"
#include "runtime/atomic_file.h"
#include "bench/mlperf/mlperf_simulate.h"
#include "runtime/mllog.h"
#include "runtime/stop_signal.h"

namespace shardstep::mlperf {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;
namespace k = runtime::mllog;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct EvalRecord {
  int64_t step = 0;
  double seconds = 0;  // since run_start
  double metric = 0, loss = 0;
};

using WeightShapes = std::vector<std::pair<std::string, ir::Shape>>;

struct RunResult {
  uint64_t seed = 0;
  std::string status = "aborted";  // or "success"
  std::string error;
  int signal = 0;  // SIGTERM / SIGINT that stopped the run (0: none)
  std::string log_path;
  double seconds = 0;  // run_start to run_stop
  int64_t steps = 0, batch = 0;
  double examples_per_second = 0;  // training steps only
  double median_step_ms = 0, median_comm_ms = 0;
  std::vector<EvalRecord> evals;
  int64_t weight_bytes = 0, optimizer_state_bytes = 0;  // per replica
  WeightShapes weights;
};

// The optimizer's hyperparameters as opt_* keys (the names of MLPerf's reference logs where there is one).
void LogOptimizer(runtime::MlLog& ml, const ir::OptimizerConfig& c, int64_t steps_per_epoch) {
  ml.Event(k::kOptName, ir::OptimizerName(c.kind_));
  ml.Event(k::kOptBaseLearningRate, c.lr_);
  ml.Event(k::kOptLearningRateWarmupSteps, c.warmup_steps_);
  if (steps_per_epoch > 0)
    ml.Event(k::kOptLearningRateWarmupEpochs, static_cast<double>(c.warmup_steps_) / steps_per_epoch);
  ml.Event(k::kOptWeightDecay, c.weight_decay_);
  ml.Event("opt_learning_rate_decay_schedule", ir::ScheduleName(c.schedule_));
  if (c.schedule_ == ir::ScheduleKind::kCosine || c.schedule_ == ir::ScheduleKind::kPolynomial) {
    ml.Event("opt_learning_rate_decay_steps", c.total_steps_);
    ml.Event("opt_end_learning_rate", c.lr_ * c.end_lr_factor_);
    if (c.schedule_ == ir::ScheduleKind::kPolynomial) ml.Event("opt_learning_rate_decay_poly_power", c.power_);
  }
  if (c.kind_ == ir::OptimizerKind::kMomentum || c.kind_ == ir::OptimizerKind::kLars) {
    ml.Event("opt_momentum", c.momentum_);
    ml.Event("opt_nesterov", c.nesterov_);
  }
  if (c.kind_ == ir::OptimizerKind::kLars) ml.Event("lars_opt_trust_coefficient", c.trust_coefficient_);
  if (c.kind_ == ir::OptimizerKind::kLamb) {
    ml.Event("opt_lamb_beta_1", c.beta1_);
    ml.Event("opt_lamb_beta_2", c.beta2_);
    ml.Event("opt_lamb_epsilon", c.eps_);
  } else if (c.kind_ == ir::OptimizerKind::kAdam || c.kind_ == ir::OptimizerKind::kAdamW) {
    ml.Event("opt_adam_beta_1", c.beta1_);
    ml.Event("opt_adam_beta_2", c.beta2_);
    ml.Event("opt_adam_epsilon", c.eps_);
  }
  if (c.clip_norm_ > 0) ml.Event("opt_gradient_clip_norm", c.clip_norm_);
}

bool Reached(const Benchmark& b, double target, double metric) {
  return b.lower_is_better ? metric <= target : metric >= target;
}

// One run of `b` with `seed`: the MLPerf log (to `log_path`, or nowhere), progress on stdout.
RunResult RunOnce(const Benchmark& b, const Flags& f, uint64_t seed, const std::string& log_path) {
  RunResult r;
  r.seed = seed;
  r.log_path = log_path;
  std::ostringstream discard;
  runtime::MlLog no_log(&discard);
  std::unique_ptr<runtime::MlLog> file_log = log_path.empty() ? nullptr : runtime::MlLog::OpenFile(log_path);
  runtime::MlLog& ml = file_log ? *file_log : no_log;
  const int64_t budget = f.max_steps > 0 ? f.max_steps : b.max_steps;
  const int64_t eval_every = std::min(budget, f.eval_every > 0 ? f.eval_every : b.eval_every);
  const double target = f.target != 0 ? f.target : b.target;
  const char* metric_key = runtime::MetricKey(b.task);

  ml.Event(k::kSubmissionBenchmark, b.mlperf_name);
  ml.Event(k::kSubmissionOrg, "shardstep");
  ml.Event(k::kSubmissionDivision, "open");  // not MLPerf's data sets
  ml.Event(k::kSubmissionStatus, "research");
  ml.Event(k::kSubmissionPlatform, Str(std::thread::hardware_concurrency(), "-core CPU, backend ", f.backend, ", ",
                                       f.replicas, " replica(s), weight update ",
                                       f.shard_weight_update ? "sharded" : "replicated"));
  ml.Event(k::kCacheClear, true);
  ml.Start(k::kInitStart);
  bool init_open = true, run_open = false, block_open = false, eval_open = false;
  // What an aborted run still reports (run_start to run_stop, throughput, step times).
  Clock::time_point start;
  double train_seconds = 0;
  std::vector<double> step_ms, comm_ms;
  try {
    Setup s = b.setup(f, seed, b.optimizer);
    r.batch = s.batch;
    ml.Event(k::kSeed, seed);
    ml.Event(k::kGlobalBatchSize, s.batch);
    ml.Event(k::kGradientAccumulationSteps, 1);
    ml.Event(k::kTrainSamples, s.train_samples);
    ml.Event(k::kEvalSamples, s.eval_samples);
    ml.Event("target_" + std::string(metric_key), target);
    LogOptimizer(ml, s.program.options.optimizer, s.train->batches_per_epoch());
    const int64_t steps_per_epoch = std::max<int64_t>(1, s.train->batches_per_epoch());
    const ir::MemoryPlan mem = ir::PlanMemory(s.program.step);
    r.weight_bytes = mem.weight_bytes;
    r.optimizer_state_bytes = mem.optimizer_state_bytes;
    for (ir::ValueId v : s.program.forward.VariablesWithRole(ir::kRoleWeight))
      r.weights.push_back({s.program.forward.at(v).name, s.program.forward.type(v).shape});

    std::cout << b.name << " (seed " << seed << "): " << s.data_name << ", batch " << s.batch << ", " << f.replicas
              << " replica(s), weight update " << (f.shard_weight_update ? "sharded" : "replicated") << ", "
              << s.program.options.optimizer.ToString() << ", target " << metric_key << (b.lower_is_better ? " <= " : " >= ")
              << target << " within " << budget << " steps\n"
              << std::flush;
    const auto c0 = Clock::now();
    Session session(*s.model, s.program, f.backend);  // compiles the step (inside init, as MLPerf wants)
    session.SetPhaseTiming(f.replicas > 1);           // exact communication / computation split
    {  // the evaluation program compiles now too: on zeros shaped as an evaluation batch, not on its data
      runtime::TensorMap zeros;
      s.eval->Batch(0, &zeros);
      for (auto& [name, t] : zeros) t = runtime::Tensor(t.type);
      session.EvaluateBatch(zeros);
    }
    std::cout << "init: " << std::fixed << std::setprecision(1) << Seconds(c0, Clock::now()) << " s (compilation)\n"
              << std::defaultfloat << std::setprecision(6) << std::flush;
    ml.End(k::kInitStop);
    init_open = false;

    ml.Start(k::kRunStart);
    run_open = true;
    start = Clock::now();
    runtime::PrefetchingSource batches(*s.train);
    runtime::TensorMap in;
    int64_t step = 0;
    bool reached = false;
    // epoch_num: whole epochs as an integer (the MLPerf rules' type), else the fraction.
    auto epoch_of = [&](int64_t st) {
      return st % steps_per_epoch == 0 ? Json(st / steps_per_epoch) : Json(static_cast<double>(st) / steps_per_epoch);
    };
    while (step < budget && !reached) {
      ml.Start(k::kBlockStart, nullptr, {{"step_num", step}, {"samples_count", step * s.batch}});
      block_open = true;
      const int64_t block_end = std::min(budget, step + eval_every);
      while (step < block_end) {
        // A stop request (SIGTERM, SIGINT) is taken between steps: the handler only set a flag.
        if (const int sig = runtime::StopSignalReceived()) {
          r.signal = sig;
          throw Error(Str("stopped by ", runtime::SignalName(sig), " after step ", step));
        }
        batches.Next(&in);
        const double comm0 = session.CommunicationSeconds();
        const auto t0 = Clock::now();
        const runtime::TensorMap out = session.TrainStep(in);
        const auto t1 = Clock::now();
        r.steps = ++step;  // also what an aborted run reports
        const double loss = out.at("loss").f32[0];
        if (!std::isfinite(loss)) throw Error(Str("non-finite loss (", loss, ") at step ", step));
        step_ms.push_back(Seconds(t0, t1) * 1e3);
        comm_ms.push_back((session.CommunicationSeconds() - comm0) * 1e3);
        train_seconds += Seconds(t0, t1);
        if (step % 50 == 0 && step % eval_every != 0)
          std::cout << "step " << step << "/" << budget << "  " << std::fixed << std::setprecision(1)
                    << Seconds(start, t1) << " s  loss " << std::setprecision(4) << loss << "\n"
                    << std::defaultfloat << std::setprecision(6) << std::flush;
      }
      ml.End(k::kBlockStop, nullptr, {{"step_num", step}, {"samples_count", step * s.batch}});
      block_open = false;
      ml.Start(k::kEvalStart, nullptr, {{"step_num", step}, {"epoch_num", epoch_of(step)}});
      eval_open = true;
      const runtime::EvalResult e = runtime::EvaluateSet(session, *s.eval, b.task);
      ml.Event(k::kEvalAccuracy, e.metric,
               {{"step_num", step}, {"epoch_num", epoch_of(step)}, {"samples_count", step * s.batch}, {"metric", metric_key}});
      ml.End(k::kEvalStop, nullptr, {{"step_num", step}, {"epoch_num", epoch_of(step)}});
      eval_open = false;
      const double now = Seconds(start, Clock::now());
      r.evals.push_back({step, now, e.metric, e.loss});
      std::cout << "step " << step << "/" << budget << "  " << std::fixed << std::setprecision(1) << now << " s  "
                << metric_key << " " << std::setprecision(4) << e.metric << "  eval loss " << e.loss << "  median step "
                << std::setprecision(1) << Median(step_ms) << " ms\n"
                << std::defaultfloat << std::setprecision(6) << std::flush;
      if (!std::isfinite(e.metric)) throw Error(Str("evaluation at step ", step, " gave a non-finite ", metric_key));
      reached = Reached(b, target, e.metric);
    }
    r.seconds = Seconds(start, Clock::now());
    r.steps = step;
    r.examples_per_second = train_seconds > 0 ? step * s.batch / train_seconds : 0;
    r.median_step_ms = Median(step_ms);
    r.median_comm_ms = Median(comm_ms);
    if (reached) {
      r.status = "success";
      ml.End(k::kRunStop, nullptr, {{"status", "success"}, {"step_num", step}});
    } else {
      r.error = Str("the target ", metric_key, (b.lower_is_better ? " <= " : " >= "), target,
                    " was not reached within the step budget of ", budget, " steps (last evaluation: ",
                    r.evals.empty() ? std::string("none") : Str(r.evals.back().metric), ")");
      ml.End(k::kRunStop, nullptr, {{"status", "aborted"}, {"step_num", step}, {"error", r.error}});
    }
  } catch (const std::exception& e) {
    r.error = e.what();
    r.status = "aborted";
    if (run_open) {
      r.seconds = Seconds(start, Clock::now());
      r.examples_per_second = train_seconds > 0 ? r.steps * r.batch / train_seconds : 0;
      r.median_step_ms = Median(step_ms);
      r.median_comm_ms = Median(comm_ms);
    }
    if (eval_open) ml.End(k::kEvalStop, nullptr, {{"step_num", r.steps}});
    if (block_open) ml.End(k::kBlockStop, nullptr, {{"step_num", r.steps}});
    if (init_open) ml.End(k::kInitStop, nullptr, {{"status", "aborted"}});
    if (!run_open) ml.Start(k::kRunStart);
    ml.End(k::kRunStop, nullptr, {{"status", "aborted"}, {"error", r.error}});
  }
  return r;
}

// The weight update alone (gradients in, all-reduce or reduce-scatter + all-gather, the recipe's
// optimizer, assigns), built by the same passes as training: median ms over `reps` steps after one
// warm-up. What sharding divides by N is this phase's computation.
double TimeWeightUpdate(const WeightShapes& weights, const ir::OptimizerConfig& opt, int n, bool shard,
                        const std::string& backend, int reps = 5) {
  ir::Module m;
  m.name = "weight_update";
  m.num_replicas = n;
  ir::Builder b(&m);
  runtime::TensorMap grads;
  for (const auto& [name, shape] : weights) {
    ir::ValueId w = b.Variable(name, {ir::DType::kF32, shape}, ir::kRoleWeight, {{"init", std::string("zeros")}});
    m.gradients.push_back({w, b.Input("grad/" + name, {ir::DType::kF32, shape})});
    ir::Shape global = shape;
    global[0] *= n;
    runtime::Tensor g(ir::TensorType{ir::DType::kF32, global});
    for (size_t i = 0; i < g.f32.size(); ++i) g.f32[i] = 1e-3f * static_cast<float>((i * 2654435761u) % 1000) - 0.5f;
    grads["grad/" + name] = std::move(g);
  }
  ir::DataParallelLowering().Run(m);
  ir::OptimizerLowering(opt).Run(m);
  if (shard && n > 1) ir::WeightUpdateSharder().Run(m);
  ir::CollectiveCombiner(4 << 20, 64).Run(m);
  Session session(m, std::nullopt, backend);
  session.TrainStep(grads);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    session.TrainStep(grads);
    ms.push_back(Seconds(t0, Clock::now()) * 1e3);
  }
  return Median(ms);
}

// Quality against time since run_start, one line per run, the target dashed: a self-contained SVG.
std::string QualitySvg(const Benchmark& b, const std::vector<RunResult>& runs, double target, const std::string& title) {
  const double W = 720, H = 420, L = 70, R = 20, T = 40, B = 50;
  double tmax = 1, lo = target, hi = target;
  for (const RunResult& r : runs)
    for (const EvalRecord& e : r.evals) {
      tmax = std::max(tmax, e.seconds);
      lo = std::min(lo, e.metric);
      hi = std::max(hi, e.metric);
    }
  const double pad = std::max(1e-6, (hi - lo) * 0.05);
  lo -= pad;
  hi += pad;
  auto X = [&](double t) { return L + (W - L - R) * t / tmax; };
  auto Y = [&](double v) { return T + (H - T - B) * (hi - v) / (hi - lo); };
  std::ostringstream s;
  s << std::fixed << std::setprecision(2);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" font-family=\"sans-serif\" "
    << "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">" << title << "</text>\n";
  s << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B << "\" stroke=\"black\"/>\n";
  s << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    const double t = tmax * i / 5, v = lo + (hi - lo) * i / 5;
    s << "<text x=\"" << X(t) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << std::setprecision(0) << t
      << "</text>\n<text x=\"" << L - 6 << "\" y=\"" << Y(v) + 4 << "\" text-anchor=\"end\">" << std::setprecision(3)
      << v << "</text>\n"
      << std::setprecision(2);
  }
  s << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">seconds since run_start</text>\n";
  s << "<text x=\"16\" y=\"" << (T + H - B) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " << (T + H - B) / 2
    << ")\">" << runtime::MetricKey(b.task) << "</text>\n";
  s << "<line x1=\"" << L << "\" y1=\"" << Y(target) << "\" x2=\"" << W - R << "\" y2=\"" << Y(target)
    << "\" stroke=\"gray\" stroke-dasharray=\"6 4\"/>\n<text x=\"" << W - R - 4 << "\" y=\"" << Y(target) - 4
    << "\" text-anchor=\"end\" fill=\"gray\">target " << std::setprecision(4) << target << "</text>\n"
    << std::setprecision(2);
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  for (size_t i = 0; i < runs.size(); ++i) {
    s << "<polyline fill=\"none\" stroke=\"" << colors[i % 6] << "\" stroke-width=\"2\" points=\"";
    for (const EvalRecord& e : runs[i].evals) s << X(e.seconds) << "," << Y(e.metric) << " ";
    s << "\"/>\n";
    for (const EvalRecord& e : runs[i].evals)
      s << "<circle cx=\"" << X(e.seconds) << "\" cy=\"" << Y(e.metric) << "\" r=\"3\" fill=\"" << colors[i % 6] << "\"/>\n";
    s << "<text x=\"" << L + 10 << "\" y=\"" << T + 14 * (i + 1) << "\" fill=\"" << colors[i % 6] << "\">seed "
      << runs[i].seed << " (" << runs[i].status << ")</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

void WriteText(const std::string& path, const std::string& text, const std::string& what) {
  runtime::WriteFileAtomically(path, {{text.data(), text.size()}}, what);
}

// The log file of run i of k: `path` itself for one run, else <stem>_run<i><ext>.
std::string LogPathFor(const std::string& path, int i, int k) {
  if (path.empty() || k == 1) return path;
  const size_t slash = path.rfind('/');
  const size_t dot = path.rfind('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return has_ext ? Str(path.substr(0, dot), "_run", i, path.substr(dot)) : Str(path, "_run", i);
}

}  // namespace

double OlympicMean(std::vector<double> seconds) {
  if (seconds.empty()) return 0;
  std::sort(seconds.begin(), seconds.end());
  if (seconds.size() >= 3) seconds = std::vector<double>(seconds.begin() + 1, seconds.end() - 1);
  return std::accumulate(seconds.begin(), seconds.end(), 0.0) / seconds.size();
}

int Main(const Benchmark& recipe, int argc, char** argv) {
  runtime::StartStopSignalWatcher();  // before any thread: no compute thread takes SIGTERM / SIGINT
  Benchmark b = recipe;  // with the flags' overrides
  Flags f;
  CLI::App app{Str(b.name, ": ", b.description)};
  std::string shard = "on";
  app.add_option("--replicas", f.replicas, "data-parallel replicas (threads)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--shard-weight-update", shard, "on: shard the weight update across the replicas; off: replicate it")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--backend", f.backend, "backend by name (" + [] {
    std::string names;
    for (const std::string& n : BackendNames()) names += (names.empty() ? "" : ", ") + n;
    return names;
  }() + ")")->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the (first) run: initialisation and data order")->capture_default_str();
  app.add_option("--seeds", f.seeds, "runs, with seeds --seed, --seed+1, ...; the result is their mean time to train "
                                     "with the fastest and the slowest dropped (K >= 3)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--log", f.log, "MLPerf training log (:::MLLOG lines) to FILE; with --seeds K > 1, FILE_run<i>");
  app.add_option("--out-dir", f.out_dir, "directory of <name>_result.json and <name>_quality.svg ('' = none)")
      ->capture_default_str();
  app.add_option("--max-steps", f.max_steps, Str("step budget: a run that has not reached the target by then is aborted "
                                                 "(default ", b.max_steps, ")"))
      ->check(CLI::PositiveNumber);
  app.add_option("--target", f.target, Str("quality target (default ", b.target, ")"));
  app.add_option("--lr", f.lr, Str("base learning rate (default ", b.optimizer.lr_, ")"))->check(CLI::PositiveNumber);
  app.add_option("--eval-every", f.eval_every, Str("steps between evaluations (default ", b.eval_every, ")"))
      ->check(CLI::PositiveNumber);
  app.add_option("--eval-batches", f.eval_batches, "text: evaluation batches (0 = the whole held-out split)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--data", f.data, "data directory (Fashion-MNIST) or text file (default: the recipe's)");
  app.add_flag("--smoke", f.smoke, "a tiny model of the same recipe, for tests (same log structure)");
  bool no_update_timing = false;
  app.add_flag("--no-update-timing", no_update_timing, "skip timing the weight update alone after the runs");
  app.add_flag("--simulate", f.simulate,
               "train nothing: predict the recipe's step time and time to train on a TPU pod slice (--mesh, "
               "--per-core-batch), weight update sharded and replicated");
  app.add_option("--mesh", f.mesh, "--simulate: XxY chips on a 2D torus, one replica per core");
  app.add_option("--per-core-batch", f.per_core_batch, "--simulate: examples per core and step")
      ->check(CLI::PositiveNumber);
  app.add_option("--hardware", f.hardware, "--simulate: hardware table, a name or a .toml path")->capture_default_str();
  app.add_option("--precision", f.precision, "--simulate: matrix-unit precision")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  app.add_option("--steps-from", f.steps_from,
                 "--simulate: a <name>_result.json of a real run; its steps to the target (default: the recipe's "
                 "step budget, an upper bound)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  f.shard_weight_update = shard == "on";
  if (f.lr > 0) b.optimizer.lr(f.lr);
  if (f.simulate) {
    try {
      return RunSimulation(b, f);
    } catch (const std::exception& e) {
      std::cerr << b.name << ": " << e.what() << "\n";
      return 2;
    }
  }
  for (const char* flag : {"--mesh", "--per-core-batch", "--hardware", "--precision", "--steps-from"})
    if (app.count(flag) > 0) {
      std::cerr << b.name << ": " << flag << " is a --simulate flag; add --simulate\n";
      return 2;
    }
  f.update_timing = !no_update_timing;
  if (f.eval_batches < 0) f.eval_batches = b.eval_batches;
  const double target = f.target != 0 ? f.target : b.target;
  const char* metric_key = runtime::MetricKey(b.task);
  try {
    FindBackend(f.backend);  // an unknown backend: the error lists the known ones
  } catch (const std::exception& e) {
    std::cerr << b.name << ": " << e.what() << "\n";
    return 2;
  }

  runtime::InstallStopSignalHandlers();  // SIGTERM / SIGINT: the run in progress ends aborted (exit 128 + signal)
  std::vector<RunResult> runs;
  int stop_signal = 0;
  for (int i = 0; i < f.seeds && !stop_signal; ++i) {
    runs.push_back(RunOnce(b, f, f.seed + i, LogPathFor(f.log, i, f.seeds)));
    const RunResult& r = runs.back();
    if (r.status == "success")
      std::cout << "run " << i << " (seed " << r.seed << "): reached " << metric_key << " target " << target << " in "
                << r.seconds << " s, " << r.steps << " steps\n";
    else
      std::cout << "run " << i << " (seed " << r.seed << "): aborted: " << r.error << "\n";
    std::cout << std::flush;
    stop_signal = r.signal ? r.signal : runtime::StopSignalReceived();
  }

  // The summary: time to train, steps, throughput, the weight update's share of the step, memory.
  std::vector<double> times;
  bool all_ok = true;
  for (const RunResult& r : runs) {
    all_ok &= r.status == "success";
    if (r.status == "success") times.push_back(r.seconds);
  }
  const RunResult& first = runs.front();
  Json update = nullptr;
  if (f.update_timing && !first.weights.empty() && !stop_signal) {
    try {
      const double here = TimeWeightUpdate(first.weights, b.optimizer, f.replicas, f.shard_weight_update, f.backend);
      update = {{"ms", here}, {"share_of_step", first.median_step_ms > 0 ? here / first.median_step_ms : 0.0}};
      if (f.replicas > 1) {
        update["sharded_ms"] = f.shard_weight_update ? here : TimeWeightUpdate(first.weights, b.optimizer, f.replicas, true, f.backend);
        update["replicated_ms"] = f.shard_weight_update ? TimeWeightUpdate(first.weights, b.optimizer, f.replicas, false, f.backend) : here;
      }
    } catch (const std::exception& e) {
      update = {{"error", e.what()}};
    }
  }
  std::cout << "\n== " << b.name << " summary (" << f.replicas << " replica(s), weight update "
            << (f.shard_weight_update ? "sharded" : "replicated") << ", backend " << f.backend << ") ==\n";
  for (const RunResult& r : runs)
    std::cout << "  seed " << r.seed << ": " << r.status << ", " << std::fixed << std::setprecision(1) << r.seconds
              << " s, " << r.steps << " steps, " << std::setprecision(1) << r.examples_per_second << " examples/s, median step "
              << r.median_step_ms << " ms (" << r.median_comm_ms << " ms in collectives), last " << metric_key << " "
              << std::setprecision(4) << (r.evals.empty() ? std::nan("") : r.evals.back().metric) << "\n"
              << std::defaultfloat << std::setprecision(6);
  if (!times.empty())
    std::cout << "  time to train: " << std::fixed << std::setprecision(1) << OlympicMean(times) << " s ("
              << (times.size() >= 3 ? "mean without the fastest and slowest of " : "mean of ") << times.size()
              << " successful run(s))\n" << std::defaultfloat << std::setprecision(6);
  std::cout << "  per replica: weights " << first.weight_bytes << " bytes, optimizer state " << first.optimizer_state_bytes
            << " bytes\n";
  if (update.is_object() && update.contains("ms")) {
    std::cout << "  weight update alone: " << std::fixed << std::setprecision(2) << update["ms"].get<double>() << " ms, "
              << std::setprecision(1) << 100 * update["share_of_step"].get<double>() << "% of the median step";
    if (update.contains("sharded_ms"))
      std::cout << " (sharded " << std::setprecision(2) << update["sharded_ms"].get<double>() << " ms, replicated "
                << update["replicated_ms"].get<double>() << " ms)";
    std::cout << "\n" << std::defaultfloat << std::setprecision(6);
  }

  if (!f.out_dir.empty()) {
    Json j = {{"benchmark", b.name}, {"submission_benchmark", b.mlperf_name}, {"metric", metric_key},
              {"target", target}, {"lower_is_better", b.lower_is_better}, {"replicas", f.replicas},
              {"shard_weight_update", f.shard_weight_update}, {"backend", f.backend},
              {"optimizer", b.optimizer.ToString()}, {"seeds", f.seeds}, {"all_reached_target", all_ok},
              {"time_to_train_s", times.empty() ? Json(nullptr) : Json(OlympicMean(times))},
              {"weights_bytes_per_replica", first.weight_bytes},
              {"optimizer_state_bytes_per_replica", first.optimizer_state_bytes}, {"weight_update", update}};
    for (const RunResult& r : runs) {
      Json evals = Json::array();
      for (const EvalRecord& e : r.evals)
        evals.push_back({{"step", e.step}, {"seconds", e.seconds}, {metric_key, e.metric}, {"loss", e.loss}});
      j["runs"].push_back({{"seed", r.seed}, {"status", r.status}, {"error", r.error}, {"seconds", r.seconds},
                           {"steps", r.steps}, {"global_batch", r.batch}, {"examples_per_second", r.examples_per_second},
                           {"median_step_ms", r.median_step_ms}, {"median_comm_ms", r.median_comm_ms},
                           {"log", r.log_path}, {"evals", evals}});
    }
    const std::string json_path = f.out_dir + "/" + b.name + "_result.json";
    const std::string svg_path = f.out_dir + "/" + b.name + "_quality.svg";
    try {
      WriteText(json_path, j.dump(2) + "\n", "result");
      WriteText(svg_path,
                QualitySvg(b, runs, target,
                           Str(b.name, ": ", metric_key, " vs time, ", f.replicas, " replica(s), update ",
                               f.shard_weight_update ? "sharded" : "replicated")),
                "plot");
      std::cout << "wrote " << json_path << " and " << svg_path << "\n";
    } catch (const std::exception& e) {
      std::cerr << b.name << ": " << e.what() << "\n";
      return 1;
    }
  }
  if (stop_signal) return 128 + stop_signal;
  return all_ok ? 0 : 1;
}

}  // namespace shardstep::mlperf
