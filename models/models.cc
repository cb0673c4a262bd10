// The built-in models.
#include "models/models.h"

#include "ir/error.h"
#include "models/resnet.h"
#include "models/transformer.h"

namespace shardstep::models {

dsl::Tensor DefineMlp(dsl::Model& m, const ModelOptions& o) {
  auto x = m.input("image", dsl::f32({o.batch, 784}));
  auto y = m.input("label", dsl::s32({o.batch}));
  for (size_t i = 0; i < o.hidden.size(); ++i) x = x.dense(o.hidden[i], "fc" + std::to_string(i + 1)).relu();
  auto logits = x.dense(o.classes, "fc" + std::to_string(o.hidden.size() + 1));
  m.output("logits", logits);
  return logits.cross_entropy(y).mean();
}

dsl::Tensor DefineCnn(dsl::Model& m, const ModelOptions& o) {
  auto x = m.input("image", dsl::f32({o.batch, 1, 28, 28}));
  auto y = m.input("label", dsl::s32({o.batch}));
  auto h = x.conv2d(32, 3, "conv1", 1, 1).relu().max_pool(2)
               .conv2d(64, 3, "conv2", 1, 1).relu().max_pool(2)
               .flatten()
               .dense(128, "fc1").relu();
  auto logits = h.dense(o.classes, "fc2");
  m.output("logits", logits);
  return logits.cross_entropy(y).mean();
}

const char* TaskName(Task t) {
  switch (t) {
    case Task::kClassification: return "classification";
    case Task::kLanguageModel: return "language_model";
    case Task::kMaskedLm: return "masked_lm";
  }
  return "?";
}

const char* MetricName(Task t) {
  switch (t) {
    case Task::kClassification: return "accuracy";
    case Task::kLanguageModel: return "bits_per_char";
    case Task::kMaskedLm: return "masked_accuracy";
  }
  return "?";
}

const std::vector<ModelSpec>& AllModels() {
  static const std::vector<ModelSpec> models = {
      {"mlp", "multi-layer perceptron on flattened 28x28 images (--hidden sets the widths)", Task::kClassification,
       "fashion-mnist", {784}, DefineMlp},
      {"cnn", "two 3x3 conv + max-pool blocks, then dense 128 and dense 10", Task::kClassification, "fashion-mnist",
       {1, 28, 28}, DefineCnn},
      {"resnet20", "CIFAR-style ResNet-20 with batch norm (3 stages of 3 basic blocks, 16/32/64 filters)",
       Task::kClassification, "fashion-mnist", {1, 28, 28}, DefineResnet20},
      {"resnet50", "ResNet-50 v1.5 with batch norm (bottlenecks 3/4/6/3; 25,557,032 parameters at --classes 1000)",
       Task::kClassification, "synthetic-imagenet", {3, 224, 224}, DefineResnet50},
      {"transformer_lm", "GPT-style character language model (pre-LN, causal; --context 128 --layers 4 --width 256 --heads 4)",
       Task::kLanguageModel, "kjv", {}, DefineTransformerLm},
      {"bert", "BERT pre-training: encoder, masked-LM and next-sentence heads (post-LN; --size small|base|large)", Task::kMaskedLm, "kjv", {},
       DefineBert},
  };
  return models;
}

const ModelSpec& FindModel(const std::string& name) {
  std::string known;
  for (const ModelSpec& s : AllModels()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  throw Error(Str("unknown model '", name, "' (known: ", known, ")"));
}

}  // namespace shardstep::models
