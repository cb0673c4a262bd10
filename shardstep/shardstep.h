// The one include for writing and training models in C++: the DSL (shardstep::dsl), the built-in
// models registry (shardstep::models) and the Session that trains, evaluates, predicts and
// checkpoints on a backend ("cpu" JIT or "interp" reference interpreter), and runtime::Train, the CLI's
// training loop (progress, metrics, evaluation, checkpoints), which runs on a Session. See examples/mlp_blobs.cc.
#pragma once

#include "api/session.h"   // shardstep::Session, Tensor, TensorMap, Error
#include "dsl/dsl.h"       // shardstep::dsl::Model, optimizers
#include "ir/error.h"      // shardstep::Error
#include "models/models.h" // shardstep::models::AllModels, FindModel
#include "runtime/tensor.h"
#include "runtime/trainer.h" // runtime::Train, TrainOptions
