// Small MLP and CNN training programs (models/models.h) and batches of synthetic 28 x 28 images for the
// JIT executor's tests: one place for the shape of these fixtures, each test keeping its own sizes and seeds.
#pragma once

#include <string>
#include <vector>

#include "dsl/dsl.h"
#include "models/models.h"
#include "runtime/dataset.h"

namespace shardstep::test {

struct SmallProgram {
  bool cnn = false;
  int64_t batch = 24;
  std::vector<int64_t> hidden = {25, 10};
  uint64_t seed = 1;
  std::string precision = "f32";
};

inline dsl::Program Build(const SmallProgram& s, ir::OptimizerConfig opt, int replicas = 1, bool shard = false) {
  dsl::Model m(s.cnn ? "cnn" : "mlp", s.seed);
  models::ModelOptions mo;
  mo.batch = s.batch;
  mo.hidden = s.hidden;
  mo.classes = 10;
  dsl::Tensor loss = s.cnn ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
  return m.train(loss).optimizer(opt).precision(s.precision).replicas(replicas).shard_weight_update(shard).build();
}

// `steps` batches of `d` in a shuffled order (seed `order_seed`), shaped for the CNN or the MLP.
inline std::vector<runtime::TensorMap> Batches(const runtime::Dataset& d, bool cnn, int64_t batch, int steps,
                                               uint64_t order_seed) {
  runtime::BatchIterator it(d, batch, /*shuffle=*/true, order_seed, cnn ? ir::Shape{1, 28, 28} : ir::Shape{784});
  std::vector<runtime::TensorMap> out(steps);
  for (auto& in : out) it.Next(&in["image"], &in["label"]);
  return out;
}

}  // namespace shardstep::test
