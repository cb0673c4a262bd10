// ir/cost: parameters, FLOPs and activation memory of the MLP against a hand count.
#include <catch2/catch.hpp>

#include "dsl/dsl.h"
#include "ir/cost.h"
#include "ir/passes/pipeline.h"
#include "models/models.h"

using namespace shardstep;

TEST_CASE("cost of the MLP 784-8-10 at batch 4, counted by hand") {
  models::ModelOptions mo;
  mo.batch = 4;
  mo.hidden = {8};
  dsl::Model m("mlp", 0);
  dsl::Tensor loss = models::DefineMlp(m, mo);
  dsl::Program p = m.train(loss).optimizer(ir::OptimizerConfig().kind(ir::OptimizerKind::kSgd).lr(0.1)).build();
  ir::Module grad = m.lower(1);
  ir::PipelineOptions po;
  ir::BuildPipeline({"autodiff"}, po).Run(grad);

  const ir::CostReport r = ir::ComputeCost(grad, p.step, 4);
  CHECK(r.parameters == 784 * 8 + 8 + 8 * 10 + 10);
  // Forward matmuls: x[4,784] @ w1[784,8] and h[4,8] @ w2[8,10]: 2*M*N*K each.
  const int64_t fwd_matmul = 2 * 4 * 8 * 784 + 2 * 4 * 10 * 8;
  CHECK(r.forward.by_op.at("matmul") == fwd_matmul);
  // Backward: dw2 = h^T dy, dh = dy w2^T, dw1 = x^T dh (no dx for the input): the forward's again, less
  // nothing for layer 2 and plus layer 1's weight gradient only.
  CHECK(r.step.by_op.at("matmul") == fwd_matmul + 2 * 4 * 10 * 8 * 2 + 2 * 4 * 8 * 784);
  // Elementwise and reductions of the forward: bias adds (32 + 40) and relu (32) at least, the loss's
  // softmax cross-entropy a few per logit (40 logits): small next to the matmuls.
  const int64_t other = r.forward.total - fwd_matmul;
  CHECK(other >= 32 + 40 + 32 + 40);
  CHECK(other < 20 * 40 + 200);
  CHECK(r.step.total > r.forward.total * 2);
  // The SGD update: at least one multiply and one subtract per parameter.
  CHECK(r.step.total - r.step.by_op.at("matmul") >= 2 * r.parameters);
  // Activations kept for the backward include the ReLU's output h [4,8] (for dw2) or its input, and the
  // softmax of the logits [4,10]; never more than every forward value.
  CHECK(r.activation_bytes >= (4 * 8 + 4 * 10) * 4);
  int64_t all_forward = 0;
  const std::vector<char> fwd = ir::AncestorsOf(grad, grad.FindOutput("loss"));
  for (ir::ValueId v = 0; v < grad.size(); ++v)
    if (fwd[v] && !ir::HasProperty(grad.at(v).op, ir::kLeaf)) all_forward += grad.type(v).bytes();
  CHECK(r.activation_bytes <= all_forward);
  CHECK(r.activation_bytes > 0);
  const std::string text = r.ToString();
  CHECK_THAT(text, Catch::Contains("parameters: 6370"));
  CHECK_THAT(text, Catch::Contains("FLOPs per example: forward"));
  CHECK_THAT(text, Catch::Contains("activation memory per replica"));
}
