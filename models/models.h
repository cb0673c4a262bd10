// The built-in models (`--model mlp|cnn`): each defines its inputs, returns its loss, and names its
// logits output so evaluation can read them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dsl/dsl.h"

namespace shardstep::models {

struct ModelOptions {
  int64_t batch = 64;                       // global batch
  std::vector<int64_t> hidden = {1024, 1024};  // MLP widths
  int64_t classes = 10;
};

struct ModelSpec {
  std::string name;
  std::string description;
  ir::Shape example_shape;  // per-example image shape the model's "image" input takes
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
