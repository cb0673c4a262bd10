// The built-in models (`--model mlp|cnn|resnet20|resnet50|transformer_lm|bert`): each defines its inputs, returns its loss, and names its
// logits output so evaluation can read them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dsl/dsl.h"

namespace shardstep::models {

// What a model learns, which fixes its inputs, its "logits" output and its evaluation metric:
//   kClassification: inputs "image" f32 [B, example_shape...], "label" s32 [B];
//                    output "logits" f32 [B, classes]; metric "accuracy".
//   kLanguageModel:  inputs "tokens" s32 [B, T], "targets" s32 [B, T] (next token);
//                    output "logits" f32 [B, T, vocab]; metric "bits_per_char" (mean over positions).
//   kMaskedLm:       inputs "tokens" s32 [B, T] (with mask tokens substituted), "targets" s32 [B, T],
//                    "mask_weights" f32 [B, T] (1 at predicted positions, else 0);
//                    output "logits" f32 [B, T, vocab]; metric "masked_accuracy". With sentence pairs
//                    (bert): also "segments" s32 [B, T] (0 = [CLS] A [SEP], 1 = B [SEP]) and
//                    "next_sentence" s32 [B] (1 = B follows A); output "nsp_logits" f32 [B, 2] (the
//                    trainer also reports "nsp_accuracy" when both are there).
// The trainer computes the metric from "logits" and the inputs, so a loss with label smoothing or
// weights does not change what is reported.
enum class Task { kClassification, kLanguageModel, kMaskedLm };
const char* TaskName(Task t);    // "classification", "language_model", "masked_lm"
const char* MetricName(Task t);  // "accuracy", "bits_per_char", "masked_accuracy"

struct ModelOptions {
  int64_t batch = 64;                       // global batch
  std::vector<int64_t> hidden = {1024, 1024};  // MLP widths
  int64_t classes = 10;
  // Image models: 0 = the model's default.
  int64_t image_size = 0;
  int64_t channels = 0;
  bool cross_replica_bn = false;  // batch-norm statistics all-reduced over the replica group
  // Sequence models (transformer_lm, bert): 0 = the model's or size's default.
  int64_t context = 0;  // T
  int64_t layers = 0;
  int64_t width = 0;
  int64_t heads = 0;
  int64_t mlp_width = 0;
  int64_t vocab = 0;    // from the data's vocabulary
  double dropout = 0.0;
  std::string size;     // bert: "small" | "base" | "large"
  double label_smoothing = 0.0;
};

struct ModelSpec {
  std::string name;
  std::string description;
  Task task = Task::kClassification;
  std::string dataset;      // default data: "fashion-mnist", "kjv", "synthetic-imagenet"
  ir::Shape example_shape;  // classification: per-example shape of "image" (at default options)
  std::function<dsl::Tensor(dsl::Model&, const ModelOptions&)> define;  // returns the scalar loss
};

const std::vector<ModelSpec>& AllModels();
// Throws shardstep::Error listing the known models.
const ModelSpec& FindModel(const std::string& name);

// MLP on flattened 28x28 images: dense(h1) relu ... dense(classes).
dsl::Tensor DefineMlp(dsl::Model& m, const ModelOptions& o);
// CNN: conv3x3(32) relu maxpool2 conv3x3(64) relu maxpool2 dense(128) relu dense(classes).
dsl::Tensor DefineCnn(dsl::Model& m, const ModelOptions& o);

}  // namespace shardstep::models
