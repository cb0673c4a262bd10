// ResNets with batch norm (contract "resnet20", and ResNet-50 v1.5): task kClassification, inputs
// "image" [B, C, H, W] and "label" s32 [B], output "logits", mean cross-entropy loss with
// ModelOptions::label_smoothing.
#pragma once

#include "dsl/dsl.h"
#include "models/models.h"

namespace shardstep::models {

// CIFAR-style ResNet-20 (He et al. 2016) on [B, 1, 28, 28] (image_size / channels override), 3 stages
// of 3 basic blocks (16, 32, 64 filters), projection shortcuts, global average pool, fc.
dsl::Tensor DefineResnet20(dsl::Model& m, const ModelOptions& o);
// ResNet-50 v1.5 (torchvision's resnet50: stride on the 3x3 of the bottleneck), [B, 3, 224, 224] by
// default, 1000 classes by default: 25,557,032 trainable parameters.
dsl::Tensor DefineResnet50(dsl::Model& m, const ModelOptions& o);

}  // namespace shardstep::models
