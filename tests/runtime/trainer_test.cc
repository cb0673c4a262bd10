// The general trainer: prefetching hands out exactly the batches of the source (also across epochs,
// after Seek and for text), the task metrics against hand-computed values, training with and without
// prefetching is bitwise the same, --save-batches holds every step's inputs, and a language model trains
// through the same loop with bits per character in its metrics.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "models/models.h"
#include "runtime/checkpoint.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "runtime/image_data.h"
#include "runtime/metrics_file.h"
#include "runtime/plot.h"
#include "runtime/text_data.h"
#include "runtime/trainer.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Matchers::Contains;

namespace {

bool Same(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !(t.type == it->second.type) || t.f32 != it->second.f32 || t.s32 != it->second.s32) return false;
  }
  return true;
}

std::shared_ptr<const Dataset> Synthetic(int64_t n) {
  return std::make_shared<Dataset>(SyntheticClassification(n, 1, 28, 28, 10, /*seed=*/4));
}

// Compares `count` batches of a plain and a prefetching source, with their epoch and position.
void ExpectSameBatches(BatchSource& plain, BatchSource& prefetching, int count) {
  TensorMap a, b;
  for (int i = 0; i < count; ++i) {
    plain.Next(&a);
    prefetching.Next(&b);
    INFO("batch " << i);
    REQUIRE(Same(a, b));
    CHECK(prefetching.epoch() == plain.epoch());
    CHECK(prefetching.position() == plain.position());
  }
}

std::string TempPath(const std::string& tag) { return Str("/tmp/trainer_test_", ::getpid(), "_", tag); }

}  // namespace

TEST_CASE("prefetching gives the same batches in the same order, across epochs and after Seek") {
  auto data = Synthetic(100);  // batch 16: 6 batches an epoch, 4 examples dropped
  ImageBatchSource plain(data, 16, /*shuffle=*/true, 7, ir::Shape{784}, "synthetic");
  PrefetchingSource prefetching(std::make_unique<ImageBatchSource>(data, 16, true, 7, ir::Shape{784}, "synthetic"));
  CHECK(prefetching.epoch() == 0);
  CHECK(prefetching.position() == 0);
  ExpectSameBatches(plain, prefetching, 20);  // into epoch 3
  CHECK(plain.epoch() == 3);
  // A resume: both sources continue from a checkpoint's (epoch, position).
  plain.Seek(5, 32);
  prefetching.Seek(5, 32);
  CHECK(prefetching.epoch() == 5);
  CHECK(prefetching.position() == 32);
  ExpectSameBatches(plain, prefetching, 9);
  // And the batches differ from batch to batch (the test can fail).
  TensorMap x, y;
  plain.Next(&x);
  plain.Next(&y);
  CHECK_FALSE(Same(x, y));
}

TEST_CASE("prefetching a text source gives the same batches") {
  const std::string corpus = TempPath("corpus.txt");
  {
    std::ofstream f(corpus);
    for (int i = 0; i < 400; ++i) f << "line " << i << ": and the word was " << (i * 7919 % 1000) << " times said.\n";
  }
  TextDataOptions o;
  o.file = corpus;
  o.context = 16;
  o.batch = 8;
  o.eval_batch = 8;
  o.seed = 3;
  TextData a = MakeCharLmData(o), b = MakeCharLmData(o);
  PrefetchingSource prefetching(std::move(b.train));
  ExpectSameBatches(*a.train, prefetching, a.train->batches_per_epoch() + 5);
  a.train->Seek(1, 16);
  prefetching.Seek(1, 16);
  ExpectSameBatches(*a.train, prefetching, 4);
  TextData m1 = MakeMaskedLmData(o), m2 = MakeMaskedLmData(o);
  PrefetchingSource prefetching_mlm(std::move(m2.train));
  ExpectSameBatches(*m1.train, prefetching_mlm, 6);
  std::remove(corpus.c_str());
}

TEST_CASE("the task metrics from logits and inputs, against hand counts") {
  SECTION("classification: accuracy") {
    MetricSum m;
    TensorMap in{{"label", Tensor::S32({3}, {1, 1, 0})}};
    m.Add(kClassificationTask, Tensor::F32({3, 2}, {1, 2, 3, 0, 0, 5}), in);
    CHECK(m.count == 3);
    CHECK(m.value() == Approx(1.0 / 3));  // only the first row's arg-max is its label
    CHECK(std::string(MetricKey(kClassificationTask)) == "accuracy");
  }
  SECTION("language model: bits per character = mean of -log2 softmax(logits)[target]") {
    MetricSum m;
    // Position 0: uniform over 2 -> 1 bit. Position 1: p(target) = 3/4 -> -log2(0.75). Position 2: p = 1/4.
    TensorMap in{{"tokens", Tensor::S32({1, 3}, {0, 0, 0})}, {"targets", Tensor::S32({1, 3}, {1, 0, 1})}};
    const float ln3 = std::log(3.0f);
    m.Add(kLanguageModelTask, Tensor::F32({1, 3, 2}, {0, 0, ln3, 0, ln3, 0}), in);
    CHECK(m.count == 3);
    CHECK(m.value() == Approx((1 - std::log2(0.75) - std::log2(0.25)) / 3).epsilon(1e-6));
    CHECK(std::string(MetricKey(kLanguageModelTask)) == "bits_per_char");
  }
  SECTION("masked LM: accuracy over the positions with mask_weights > 0 only") {
    MetricSum m;
    TensorMap in{{"tokens", Tensor::S32({2, 2}, {4, 4, 4, 4})},
                 {"targets", Tensor::S32({2, 2}, {0, 1, 1, 0})},
                 {"mask_weights", Tensor::F32({2, 2}, {1, 0, 1, 1})}};
    // Arg-maxes 0, 0 (not counted), 0 (wrong), 0 (right).
    m.Add(kMaskedLmTask, Tensor::F32({2, 2, 2}, {5, 1, 5, 1, 5, 1, 5, 1}), in);
    CHECK(m.count == 3);
    CHECK(m.value() == Approx(2.0 / 3));
    CHECK(std::string(MetricKey(kMaskedLmTask)) == "masked_accuracy");
  }
  SECTION("shape mismatches and bad targets are errors") {
    MetricSum m;
    TensorMap in{{"targets", Tensor::S32({1, 2}, {0, 7})}};
    CHECK_THROWS_WITH(m.Add(kLanguageModelTask, Tensor::F32({1, 2, 2}, {0, 0, 0, 0}), in), Contains("target 7"));
    CHECK_THROWS_WITH(m.Add(kClassificationTask, Tensor::F32({1, 2}, {0, 0}), in), Contains("\"label\""));
  }
}

namespace {

struct Mlp {
  dsl::Program program;
};

dsl::Program BuildMlp(int64_t batch) {
  dsl::Model m("mlp", /*seed=*/2);
  models::ModelOptions mo;
  mo.batch = batch;
  mo.hidden = {16};
  return m.train(models::DefineMlp(m, mo)).optimizer(ir::OptimizerConfig().kind(ir::OptimizerKind::kAdam).lr(3e-3)).build();
}

ir::Module Forward(int64_t batch) {
  dsl::Model m("mlp", /*seed=*/2);
  models::ModelOptions mo;
  mo.batch = batch;
  mo.hidden = {16};
  m.train(models::DefineMlp(m, mo));
  return m.lower(1);
}

}  // namespace

TEST_CASE("training with prefetching is bitwise training without; --save-batches holds every step's inputs") {
  const Dataset all = SyntheticClassification(300, 1, 28, 28, 10, /*seed=*/4);
  auto data = std::make_shared<Dataset>(TakeExamples(all, 0, 200));
  auto test = std::make_shared<Dataset>(TakeExamples(all, 200, 300));
  const dsl::Program p = BuildMlp(16);
  const ir::Module forward = Forward(50);
  TrainOptions o;
  o.steps = 60;  // 12 batches an epoch: into the fifth epoch
  o.batch = 16;
  o.log_every = 10;
  TrainResult results[2];
  TensorMap states[2];
  const std::string batches = TempPath("batches.safetensors");
  for (int prefetch = 0; prefetch < 2; ++prefetch) {
    auto exec = MakeInterpreterExecutor(p.step, InitLogicalState(p.step));
    ImageBatchSource source(data, 16, true, 11, ir::Shape{784}, "synthetic");
    ImageEvalSet eval(test, 50, ir::Shape{784}, "synthetic");
    o.prefetch = prefetch == 1;
    o.save_batches = prefetch ? batches : "";
    std::ostringstream log;
    results[prefetch] = Train(*exec, forward, source, &eval, kClassificationTask, o, log);
    states[prefetch] = exec->LogicalState();
    CHECK_THAT(log.str(), Contains("eval  step 60  test accuracy"));
  }
  REQUIRE(results[0].losses.size() == 60);
  CHECK(results[0].losses == results[1].losses);
  CHECK(Same(states[0], states[1]));
  CHECK(results[0].test_metric == results[1].test_metric);
  CHECK(results[1].test_accuracy == results[1].test_metric);
  CHECK(results[1].test_metric > 0.1);  // better than chance (10 classes), after 960 examples
  CHECK(results[1].test_loss < results[1].losses[0]);
  // The saved batches are the source's batches, step by step.
  TensorMap saved = LoadCheckpoint(batches);
  CHECK(saved.size() == 120);
  ImageBatchSource again(data, 16, true, 11, ir::Shape{784}, "synthetic");
  TensorMap in;
  for (int k = 0; k < 60; ++k) {
    again.Next(&in);
    INFO("step " << k);
    REQUIRE(saved.count(Str("step", k, "/image")));
    CHECK(saved.at(Str("step", k, "/image")).f32 == in.at("image").f32);
    CHECK(saved.at(Str("step", k, "/label")).s32 == in.at("label").s32);
  }
  std::remove(batches.c_str());
}

TEST_CASE("a resumed run continues the data order: the same losses as the uninterrupted run") {
  auto data = Synthetic(200);
  const dsl::Program p = BuildMlp(16);
  const ir::Module forward = Forward(50);
  TrainOptions o;
  o.batch = 16;
  o.steps = 20;
  std::ostringstream log;
  auto full = MakeInterpreterExecutor(p.step, InitLogicalState(p.step));
  ImageBatchSource s1(data, 16, true, 11, ir::Shape{784}, "synthetic");
  TrainResult whole = Train(*full, forward, s1, nullptr, kClassificationTask, o, log);
  // The first 14 steps, then a resume from (epoch, position) after step 14.
  auto part = MakeInterpreterExecutor(p.step, InitLogicalState(p.step));
  ImageBatchSource s2(data, 16, true, 11, ir::Shape{784}, "synthetic");
  o.steps = 14;
  TrainResult first = Train(*part, forward, s2, nullptr, kClassificationTask, o, log);
  o.steps = 20;
  o.start_step = 14;
  CHECK(first.data_position == 14 * 16 % 192);  // 12 batches an epoch
  CHECK(first.data_epoch == 1);
  CHECK(s2.position() == first.data_position + 16);  // the prefetcher took the next batch already
  o.data_epoch = first.data_epoch;
  o.data_position = first.data_position;
  ImageBatchSource s3(data, 16, true, 11, ir::Shape{784}, "synthetic");
  TrainResult second = Train(*part, forward, s3, nullptr, kClassificationTask, o, log);
  std::vector<double> joined = first.losses;
  joined.insert(joined.end(), second.losses.begin(), second.losses.end());
  CHECK(joined == whole.losses);
}

TEST_CASE("a language model trains through the same loop; metrics report bits per character") {
  const std::string corpus = TempPath("lm.txt");
  {
    std::ofstream f(corpus);
    for (int i = 0; i < 300; ++i) f << "abcabcabc abcab cabcabc " << (i % 3 ? "abc" : "cab") << "\n";
  }
  TextDataOptions to;
  to.file = corpus;
  to.context = 16;
  to.batch = 8;
  to.eval_batch = 4;
  to.max_eval_batches = 2;
  TextData td = MakeCharLmData(to);
  const models::ModelSpec& spec = models::FindModel("transformer_lm");
  REQUIRE(spec.task == models::Task::kLanguageModel);
  models::ModelOptions mo;
  mo.context = 16;
  mo.layers = 1;
  mo.width = 16;
  mo.heads = 2;
  mo.vocab = td.vocab;
  mo.batch = 8;
  dsl::Model m("transformer_lm", 0);
  dsl::Program p = m.train(spec.define(m, mo)).optimizer(ir::OptimizerConfig().kind(ir::OptimizerKind::kAdam).lr(1e-2)).build();
  mo.batch = 4;
  dsl::Model mf("transformer_lm", 0);
  mf.train(spec.define(mf, mo));
  const ir::Module forward = mf.lower(1);
  auto exec = MakeInterpreterExecutor(p.step, InitLogicalState(p.step));
  TrainOptions o;
  o.steps = 40;
  o.batch = 8;
  o.log_every = 20;
  o.eval_every = 20;
  o.metrics_out = TempPath("lm_metrics.jsonl");
  std::ostringstream log;
  TrainResult r = Train(*exec, forward, *td.train, td.eval.get(), models::Task::kLanguageModel, o, log);
  CHECK_THAT(log.str(), Contains("test bits_per_char"));
  std::ifstream f(o.metrics_out);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Contains("{\"split\":\"test\",\"step\":40,\"bits_per_char\":"));
  CHECK(r.test_accuracy == -1);  // not a classification
  // Learnt the repetitive text: well under the log2(vocab) bits of a uniform guess.
  CHECK(r.test_metric < 0.6 * std::log2(static_cast<double>(td.vocab)));
  CHECK(r.curves.evals.size() == 2);
  std::remove(o.metrics_out.c_str());
  std::remove(corpus.c_str());
}

TEST_CASE("plots and resumed metrics carry the task's metric") {
  TrainingCurves c;
  c.loss = {3, 2.5, 2};
  c.step_ms = c.comm_ms = {1, 1, 1};
  c.evals.push_back({3, 1.875, 1.3});
  c.metric = "bits_per_char";
  const std::string svg = TrainingPlotSvg(c, "lm");
  CHECK_THAT(svg, Contains("test loss (bits_per_char)"));
  CHECK_THAT(svg, Contains(">1.875</text>"));  // the metric labels the evaluation point
  // A resumed run reads its curves back from the metrics file, whatever the metric's key.
  const std::string path = TempPath("resume_metrics.jsonl");
  {
    std::ofstream f(path);
    f << "{\"step\":1,\"loss\":3,\"step_ms\":1,\"comm_ms\":0}\n"
      << "{\"step\":2,\"loss\":2.5,\"step_ms\":1,\"comm_ms\":0}\n"
      << "{\"split\":\"test\",\"step\":2,\"bits_per_char\":2.25,\"loss\":1.5}\n"
      << "{\"step\":3,\"loss\":2,\"step_ms\":1,\"comm_ms\":0}\n";
  }
  TrainingCurves back;
  REQUIRE(KeepMetricsUpTo(path, 2, &back));
  REQUIRE(back.evals.size() == 1);
  CHECK(back.evals[0].accuracy == 2.25);
  CHECK(back.evals[0].loss == 1.5);
  CHECK(back.loss.size() == 2);
  std::remove(path.c_str());
}
