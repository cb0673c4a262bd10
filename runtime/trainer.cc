// The training loop.
#include "runtime/trainer.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <ostream>

#include "ir/error.h"
#include "ir/passes/nonfinite_guard.h"
#include "ir/printer.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_dir.h"
#include "runtime/image_data.h"
#include "runtime/metrics_file.h"
#include "runtime/stop_signal.h"

namespace shardstep::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

std::string Duration(double s) {
  if (!std::isfinite(s)) return "?";
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return Str(t / 3600, "h", std::setw(2), std::setfill('0'), (t / 60) % 60, "m");
  if (t >= 60) return Str(t / 60, "m", std::setw(2), std::setfill('0'), t % 60, "s");
  return Str(t, "s");
}

// JSON number text that stays valid JSON for non-finite values.
std::string Num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os << std::setprecision(9) << v;
  return os.str();
}

}  // namespace

namespace {

// "" when every element of `t` is finite, else "(3 of 784 elements non-finite, first at index 5: nan)".
std::string NonfiniteElements(const Tensor& t) {
  if (t.dtype() != ir::DType::kF32) return "";
  int64_t count = 0, first = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(t.f32.size()); ++i)
    if (!std::isfinite(t.f32[i])) {
      if (first < 0) first = i;
      ++count;
    }
  if (count == 0) return "";
  return Str("(", count, " of ", t.f32.size(), " elements non-finite, first at index ", first, ": ", t.f32[first], ")");
}

}  // namespace

std::string DescribeNonfiniteStep(int64_t step, const TensorMap& inputs, const TensorMap& outputs, const TensorMap& state) {
  const std::string prefix = ir::kGradCheckOutputPrefix;
  // What the step's check saw.
  std::vector<std::string> grads;
  for (auto& [name, t] : outputs)
    if (name.rfind(prefix, 0) == 0 && !NonfiniteElements(t).empty()) grads.push_back(ir::PrintName(name.substr(prefix.size())));
  auto loss = outputs.find("loss");
  const bool bad_loss = loss != outputs.end() && !NonfiniteElements(loss->second).empty();
  std::string saw;
  if (bad_loss) saw = Str("loss (", loss->second.f32[0], ")");
  if (!grads.empty()) {
    saw += Str(saw.empty() ? "" : " and ", "gradients of ");
    for (size_t i = 0; i < grads.size() && i < 3; ++i) saw += (i ? ", " : "") + grads[i];
    if (grads.size() > 3) saw += Str(" and ", grads.size() - 3, " more");
  }
  if (saw.empty()) saw = "values";
  // The first tensor holding one: inputs, the state the step started from, the loss, the gradients.
  std::string first;
  for (auto& [name, t] : inputs)
    if (first.empty() && !NonfiniteElements(t).empty()) first = Str("input ", ir::PrintName(name), " ", NonfiniteElements(t));
  for (auto& [name, t] : state)
    if (first.empty() && !NonfiniteElements(t).empty()) first = Str("variable ", ir::PrintName(name), " ", NonfiniteElements(t));
  if (first.empty() && bad_loss) first = "the loss";
  if (first.empty() && !grads.empty()) first = "gradient of " + grads[0];
  if (first.empty()) first = "none found on the host (a value inside the step)";
  return Str("step ", step, ": non-finite ", saw, "; first non-finite tensor: ", first,
             "; step ", step, " changed no state");
}

int64_t CountCorrect(const Tensor& logits, const Tensor& labels) {
  const int64_t b = logits.shape()[0], c = logits.shape()[1];
  int64_t correct = 0;
  for (int64_t i = 0; i < b; ++i) {
    const float* row = logits.f32.data() + i * c;
    int64_t best = 0;
    for (int64_t j = 1; j < c; ++j)
      if (row[j] > row[best]) best = j;
    correct += best == labels.s32[i];
  }
  return correct;
}

const char* MetricKey(models::Task task) {
  if (task == kClassificationTask) return "accuracy";
  if (task == kLanguageModelTask) return "bits_per_char";
  if (task == kMaskedLmTask) return "masked_accuracy";
  throw Error(Str("unknown task ", static_cast<int>(task)));
}

namespace {

const Tensor& InputOf(const TensorMap& inputs, const char* name, models::Task task) {
  auto it = inputs.find(name);
  if (it == inputs.end()) throw Error(Str("evaluation: the ", MetricKey(task), " metric needs input \"", name, "\""));
  return it->second;
}

int64_t ArgMax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 1; j < n; ++j)
    if (row[j] > row[best]) best = j;
  return best;
}

}  // namespace

void MetricSum::Add(models::Task task, const Tensor& logits, const TensorMap& inputs) {
  const ir::Shape& ls = logits.shape();
  if (task == kClassificationTask) {
    const Tensor& labels = InputOf(inputs, "label", task);
    if (ls.size() != 2 || labels.shape() != ir::Shape{ls[0]})
      throw Error(Str("evaluation: logits ", logits.type.ToString(), " do not match labels ", labels.type.ToString()));
    sum += CountCorrect(logits, labels);
    count += ls[0];
    return;
  }
  const Tensor& targets = InputOf(inputs, "targets", task);
  if (ls.size() != 3 || targets.shape() != ir::Shape{ls[0], ls[1]})
    throw Error(Str("evaluation: logits ", logits.type.ToString(), " do not match targets ", targets.type.ToString(),
                    " (expected [B, T, vocab] and [B, T])"));
  const int64_t positions = ls[0] * ls[1], v = ls[2];
  auto check_target = [&](int32_t t) {
    if (t < 0 || t >= v) throw Error(Str("evaluation: target ", t, " outside the vocabulary [0, ", v, ")"));
  };
  if (task == kLanguageModelTask) {
    for (int64_t p = 0; p < positions; ++p) {
      const float* row = logits.f32.data() + p * v;
      const int32_t t = targets.s32[p];
      check_target(t);
      const double m = row[ArgMax(row, v)];
      double z = 0;
      for (int64_t j = 0; j < v; ++j) z += std::exp(static_cast<double>(row[j]) - m);
      sum += (m + std::log(z) - row[t]) / std::log(2.0);  // -log2 softmax(row)[t]
    }
    count += positions;
    return;
  }
  const Tensor& weights = InputOf(inputs, "mask_weights", task);
  if (weights.shape() != targets.shape())
    throw Error(Str("evaluation: mask_weights ", weights.type.ToString(), " do not match targets ", targets.type.ToString()));
  for (int64_t p = 0; p < positions; ++p) {
    if (!(weights.f32[p] > 0)) continue;
    check_target(targets.s32[p]);
    sum += ArgMax(logits.f32.data() + p * v, v) == targets.s32[p];
    ++count;
  }
}

EvalResult EvaluateSet(Executor& exec, const ir::Module& forward, const EvalSet& set, models::Task task) {
  ExecutorTrainable model(exec, forward);
  return EvaluateSet(model, set, task);
}

EvalResult EvaluateSet(Trainable& model, const EvalSet& set, models::Task task) {
  const int64_t batches = set.num_batches();
  if (batches == 0) throw Error(Str("evaluation: ", set.Describe(), " has no batch"));
  MetricSum metric;
  double loss_sum = 0;
  int64_t nsp_correct = 0, nsp_count = 0;
  TensorMap in;
  for (int64_t i = 0; i < batches; ++i) {
    set.Batch(i, &in);
    TensorMap out = model.EvaluateBatch(in);
    auto logits = out.find("logits");
    if (logits == out.end()) throw Error("evaluation: the forward program has no \"logits\" output");
    metric.Add(task, logits->second, in);
    loss_sum += out.at("loss").f32[0];
    auto nsp = out.find("nsp_logits");
    auto next = in.find("next_sentence");
    if (nsp != out.end() && next != in.end()) {
      nsp_correct += CountCorrect(nsp->second, next->second);
      nsp_count += next->second.elements();
    }
  }
  EvalResult r{metric.value(), loss_sum / batches};
  if (nsp_count > 0) r.nsp_accuracy = static_cast<double>(nsp_correct) / nsp_count;
  return r;
}

namespace {
// A Dataset the caller owns, shared without a copy (the deleter does nothing).
std::shared_ptr<const Dataset> Borrow(const Dataset& d) { return std::shared_ptr<const Dataset>(&d, [](const Dataset*) {}); }
}  // namespace

void Evaluate(Executor& exec, const ir::Module& forward, const Dataset& data, int64_t eval_batch,
              const ir::Shape& example_shape, double* accuracy, double* loss) {
  ImageEvalSet set(Borrow(data), eval_batch, example_shape, "test");
  EvalResult r = EvaluateSet(exec, forward, set, kClassificationTask);
  *accuracy = r.metric;
  *loss = r.loss;
}

TrainResult Train(Executor& exec, const ir::Module& forward_eval, const Dataset& train, const Dataset* test,
                  const TrainOptions& o, std::ostream& log) {
  ImageBatchSource source(Borrow(train), o.batch, o.shuffle, o.seed, o.example_shape, "train");
  std::unique_ptr<ImageEvalSet> eval;
  if (test) eval = std::make_unique<ImageEvalSet>(Borrow(*test), o.eval_batch, o.example_shape, "test");
  return Train(exec, forward_eval, source, eval.get(), kClassificationTask, o, log);
}

TrainResult Train(Executor& exec, const ir::Module& forward_eval, BatchSource& train_source, const EvalSet* test,
                  models::Task task, const TrainOptions& o, std::ostream& log) {
  ExecutorTrainable model(exec, forward_eval);
  return Train(model, train_source, test, task, o, log);
}

TrainResult Train(Trainable& model, BatchSource& train_source, const EvalSet* test, models::Task task,
                  const TrainOptions& o, std::ostream& log) {
  const std::string metric_key = MetricKey(task);
  std::ofstream metrics;
  // Resuming: the curves of steps 1..start_step, from the metrics file when there is one (else NaN: blank).
  TrainingCurves resumed_curves;
  resumed_curves.loss.assign(o.start_step, std::nan(""));
  resumed_curves.step_ms = resumed_curves.comm_ms = resumed_curves.loss;
  if (!o.metrics_out.empty()) {
    // Resuming: the lines up to the checkpoint's step stay, later ones (steps redone now) go.
    const bool append = o.start_step > 0 && KeepMetricsUpTo(o.metrics_out, o.start_step, &resumed_curves);
    metrics.open(o.metrics_out, append ? std::ios::app : std::ios::trunc);
    if (!metrics) throw Error(Str("cannot write metrics file ", o.metrics_out));
    if (!append && !o.memory.empty()) {
      metrics << "{\"memory\":{";
      for (size_t i = 0; i < o.memory.size(); ++i)
        metrics << (i ? "," : "") << "\"" << o.memory[i].first << "\":" << o.memory[i].second;
      metrics << "}}\n";
    }
  }
  if (!o.plot_out.empty()) {  // fail now, not after the run
    const size_t slash = o.plot_out.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : o.plot_out.substr(0, slash);
    if (::access(dir.c_str(), W_OK) != 0)
      throw Error(Str("cannot write plot file ", o.plot_out, ": directory ", dir, ": ", std::strerror(errno)));
  }
  TrainResult result;
  result.curves = std::move(resumed_curves);
  result.curves.metric = metric_key;
  if (o.start_step > 0) train_source.Seek(o.data_epoch, o.data_position);
  std::unique_ptr<PrefetchingSource> prefetching;
  if (o.prefetch) prefetching = std::make_unique<PrefetchingSource>(train_source);
  BatchSource& it = o.prefetch ? static_cast<BatchSource&>(*prefetching) : train_source;
  TensorMap saved_batches;
  result.skipped_steps = o.start_skipped_steps;
  // MLPerf log: blocks of steps between evaluations, each evaluation inside the run.
  namespace ml = mllog;
  bool block_open = false, eval_open = false;
  auto block_start = [&](int64_t steps_done) {
    if (!o.mllog) return;
    o.mllog->Start(ml::kBlockStart, nullptr, {{"step_num", steps_done}, {"samples_count", steps_done * o.batch}});
    block_open = true;
  };
  auto block_stop = [&](int64_t steps_done) {
    if (!o.mllog || !block_open) return;
    o.mllog->End(ml::kBlockStop, nullptr, {{"step_num", steps_done}, {"samples_count", steps_done * o.batch}});
    block_open = false;
  };
  auto eval = [&](int64_t step) {
    if (!test) return;
    auto t0 = Clock::now();
    block_stop(step);
    if (o.mllog) o.mllog->Start(ml::kEvalStart, nullptr, {{"step_num", step}}), eval_open = true;
    const EvalResult r = EvaluateSet(model, *test, task);
    if (o.mllog) {
      o.mllog->Event(ml::kEvalAccuracy, r.metric, {{"step_num", step}, {"samples_count", step * o.batch}, {"metric", metric_key}});
      o.mllog->End(ml::kEvalStop, nullptr, {{"step_num", step}});
      eval_open = false;
    }
    result.test_metric = r.metric;
    result.test_loss = r.loss;
    if (task == kClassificationTask) result.test_accuracy = r.metric;
    result.curves.evals.push_back({step, r.metric, r.loss});
    log << "eval  step " << step << "  test " << (task == kClassificationTask ? "accuracy" : metric_key.c_str())
        << " " << std::fixed << std::setprecision(4) << r.metric;
    if (r.nsp_accuracy >= 0) log << "  nsp accuracy " << r.nsp_accuracy;  // bert's next-sentence head
    log << "  test loss " << r.loss << "  ("
        << Duration(Seconds(t0, Clock::now())) << ")\n"
        << std::defaultfloat << std::flush;
    if (metrics)
      metrics << "{\"split\":\"test\",\"step\":" << step << ",\"" << metric_key << "\":" << Num(r.metric)
              << ",\"loss\":" << Num(r.loss)
              << (r.nsp_accuracy >= 0 ? Str(",\"nsp_accuracy\":", Num(r.nsp_accuracy)) : std::string()) << "}\n"
              << std::flush;
  };

  const auto start = Clock::now();
  auto window_start = start;
  int64_t window_steps = 0;
  TensorMap in;  // reused: the prefetcher swaps its buffers with these
  if (o.mllog) o.mllog->Start(ml::kRunStart);
  try {
  block_start(o.start_step);
  for (int64_t step = o.start_step + 1; step <= o.steps; ++step) {
    if (const int sig = o.stop_requested ? o.stop_requested() : 0)  // between steps (a signal handler set a flag)
      throw Error(Str("stopped by ", SignalName(sig), " after step ", step - 1));
    const auto d0 = Clock::now();
    it.Next(&in);  // with prefetching: waits only for what the previous step did not hide
    const double data_ms = Seconds(d0, Clock::now()) * 1e3;
    if (!o.save_batches.empty())
      for (const auto& [name, t] : in) saved_batches[Str("step", step - 1, "/", name)] = t;
    const double comm0 = model.CommunicationSeconds();
    auto t0 = Clock::now();
    TensorMap out = model.TrainStep(in);
    auto t1 = Clock::now();
    const double comm_ms = (model.CommunicationSeconds() - comm0) * 1e3;
    double loss = out.at("loss").f32[0];
    result.losses.push_back(loss);
    result.curves.loss.push_back(loss);
    result.curves.step_ms.push_back(Seconds(t0, t1) * 1e3);
    result.curves.comm_ms.push_back(comm_ms);
    // Non-finite values (the guarded step changed no state when step_finite is 0).
    bool skipped = false;
    auto finite = out.find(ir::kStepFiniteOutput);
    const bool guarded = finite != out.end() && o.on_nonfinite != TrainOptions::OnNonfinite::kIgnore;
    if (guarded && finite->second.f32[0] == 0) {
      if (o.on_nonfinite == TrainOptions::OnNonfinite::kStop)
        throw Error(DescribeNonfiniteStep(step, in, out, model.LogicalState()) + " (--on-nonfinite stop)");
      skipped = true;
      ++result.skipped_steps;
    }
    if (!guarded && !std::isfinite(loss)) throw Error(Str("loss became ", loss, " at step ", step, " (learning rate too high?)"));
    ++window_steps;
    if (metrics)
      metrics << "{\"step\":" << step << ",\"loss\":" << Num(loss) << ",\"step_ms\":" << Num(Seconds(t0, t1) * 1e3)
              << ",\"comm_ms\":" << Num(comm_ms) << ",\"data_ms\":" << Num(data_ms) << ",\"epoch\":" << it.epoch()
              << (skipped ? ",\"skipped\":true" : "")
              << (guarded ? Str(",\"skipped_steps\":", result.skipped_steps) : std::string()) << "}\n";
    if (step % o.log_every == 0 || step == o.steps) {
      auto now = Clock::now();
      double rate = window_steps * o.batch / Seconds(window_start, now);
      double elapsed = Seconds(start, now);
      log << "step " << step << "/" << o.steps << "  loss " << std::fixed << std::setprecision(4) << loss
          << "  " << std::setprecision(0) << rate << " ex/s  elapsed " << Duration(elapsed) << "  ETA "
          << Duration(elapsed / (step - o.start_step) * (o.steps - step))
          << (result.skipped_steps ? Str("  skipped ", result.skipped_steps, " non-finite step(s)") : std::string()) << "\n"
          << std::defaultfloat << std::flush;
      window_start = now;
      window_steps = 0;
    }
    if (o.eval_every > 0 && step % o.eval_every == 0 && step != o.steps) {
      eval(step);
      block_start(step);
    }
    if (o.save_every > 0 && step % o.save_every == 0) {
      if (metrics) metrics.flush();  // a resume from this checkpoint keeps the metrics up to here
      std::map<std::string, std::string> meta = o.checkpoint_metadata;
      meta[kMetaTrainStep] = std::to_string(step);
      meta[kMetaDataEpoch] = std::to_string(it.epoch());
      meta[kMetaDataPosition] = std::to_string(it.position());
      meta[kMetaSkippedSteps] = std::to_string(result.skipped_steps);
      std::vector<std::string> removed;
      const std::string path = SavePeriodicCheckpoint(o.checkpoint_dir, step, model.LogicalState(), meta, o.keep, &removed);
      log << "checkpoint " << path;
      for (size_t i = 0; i < removed.size(); ++i) log << (i ? ", " : " (removed ") << removed[i];
      log << (removed.empty() ? "" : ")") << "\n" << std::flush;
    }
  }
  result.examples_per_second = (o.steps - o.start_step) * o.batch / Seconds(start, Clock::now());
  result.data_epoch = it.epoch();
  result.data_position = it.position();
  eval(o.steps);
  block_stop(o.steps);
  } catch (const std::exception& e) {
    if (o.mllog) {
      const int64_t done = static_cast<int64_t>(result.losses.size()) + o.start_step;
      if (eval_open) o.mllog->End(ml::kEvalStop, nullptr, {{"step_num", done}});
      if (block_open) o.mllog->End(ml::kBlockStop, nullptr, {{"step_num", done}});
      o.mllog->End(ml::kRunStop, nullptr, {{"status", "aborted"}, {"error", e.what()}});
    }
    throw;
  }
  if (o.mllog) o.mllog->End(ml::kRunStop, nullptr, {{"status", "success"}});
  if (!o.plot_out.empty()) {
    WriteTrainingPlot(o.plot_out, result.curves, o.plot_title);
    log << "wrote plot " << o.plot_out << "\n";
  }
  if (!o.save_batches.empty()) {
    SaveCheckpoint(o.save_batches, saved_batches);
    log << "wrote the batches of steps " << o.start_step + 1 << ".." << o.steps << " to " << o.save_batches << "\n";
  }
  if (!o.save.empty()) {
    RemoveStaleTemporaryFiles(o.save, log);
    SaveCheckpoint(o.save, model.LogicalState());
    log << "saved checkpoint " << o.save << "\n";
  }
  return result;
}

}  // namespace shardstep::runtime
