// The weight-update phase as a module of its own (per-replica gradients in, all-reduce or
// reduce-scatter + all-gather, Adam, assigns), built by the same passes as training (for
// bench/weight_update).
#pragma once

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dsl/dsl.h"
#include "ir/builder.h"
#include "ir/passes/collective_combiner.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/optimizer_lowering.h"
#include "ir/passes/weight_update_sharder.h"
#include "models/models.h"
#include "runtime/tensor.h"

namespace shardstep::bench {

using WeightShapes = std::vector<std::pair<std::string, ir::Shape>>;

// The weights of the MLP 784-hidden-10.
inline WeightShapes MlpWeights(const std::vector<int64_t>& hidden) {
  dsl::Model m("mlp");
  models::ModelOptions mo;
  mo.hidden = hidden;
  models::DefineMlp(m, mo);
  ir::Module fwd = m.lower(1);
  WeightShapes weights;
  for (ir::ValueId v : fwd.VariablesWithRole(ir::kRoleWeight)) weights.push_back({fwd.at(v).name, fwd.type(v).shape});
  return weights;
}

// Update-only Adam module at n replicas, replicated or sharded; gradients are inputs "grad/<weight>".
inline ir::Module UpdateModule(const WeightShapes& weights, int n, bool shard) {
  ir::Module m;
  m.name = "adam_update";
  m.num_replicas = n;
  ir::Builder b(&m);
  for (auto& [name, shape] : weights) {
    ir::ValueId w = b.Variable(name, {ir::DType::kF32, shape}, ir::kRoleWeight, {{"init", std::string("zeros")}});
    m.gradients.push_back({w, b.Input("grad/" + name, {ir::DType::kF32, shape})});
  }
  ir::DataParallelLowering().Run(m);
  ir::OptimizerLowering(dsl::Adam().lr(1e-3)).Run(m);
  if (shard) ir::WeightUpdateSharder().Run(m);
  ir::CollectiveCombiner(4 << 20, 64).Run(m);
  return m;
}

// Random global-batch gradients for UpdateModule at n replicas.
inline std::map<std::string, runtime::Tensor> RandomGradients(const WeightShapes& weights, int n) {
  std::map<std::string, runtime::Tensor> grads;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& [name, shape] : weights) {
    ir::Shape global = shape;
    global[0] *= n;
    runtime::Tensor t(ir::TensorType{ir::DType::kF32, global});
    for (float& x : t.f32) x = u(rng);
    grads["grad/" + name] = std::move(t);
  }
  return grads;
}

}  // namespace shardstep::bench
