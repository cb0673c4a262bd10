// transformer_lm and bert learn from the King James Bible on the JIT: the held-out loss falls well below
// its value at initialisation (a data + model + optimizer integration check; ~1 minute).
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cmath>

#include "dsl/dsl.h"
#include "jit/cpu_executor.h"
#include "models/models.h"
#include "models/transformer.h"
#include "runtime/executor.h"
#include "runtime/sharding.h"
#include "runtime/text_data.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

// Mean "loss" of the forward program over the eval set.
double EvalLoss(Executor& e, const ir::Module& forward, const EvalSet& eval) {
  double sum = 0;
  for (int64_t i = 0; i < eval.num_batches(); ++i) {
    TensorMap in;
    eval.Batch(i, &in);
    sum += e.Forward(forward, in).at("loss").f32[0];
  }
  return sum / static_cast<double>(eval.num_batches());
}

struct Run {
  double before, after;
};

Run Train(const std::string& model, TextData& data, models::ModelOptions o, int steps, double lr) {
  o.vocab = data.vocab;
  dsl::Model m(model, /*seed=*/1);
  dsl::Tensor loss = models::FindModel(model).define(m, o);
  dsl::Program p = m.train(loss).optimizer(dsl::Adam().lr(lr).clip_global_norm(1.0)).build();
  auto e = jit::MakeCpuExecutor(p.step, InitLogicalState(p.step));
  Run r;
  r.before = EvalLoss(*e, p.forward, *data.eval);
  for (int s = 0; s < steps; ++s) {
    TensorMap in;
    data.train->Next(&in);
    const float l = e->Step(in).at("loss").f32[0];
    REQUIRE(std::isfinite(l));
  }
  r.after = EvalLoss(*e, p.forward, *data.eval);
  return r;
}

}  // namespace

TEST_CASE("transformer_lm learns the KJV's characters", "[models][slow]") {
  TextDataOptions d;
  d.context = 64;
  d.batch = 32;
  d.eval_batch = 32;
  d.max_eval_batches = 4;
  TextData data = MakeCharLmData(d);
  models::ModelOptions o;
  o.batch = 32;
  o.context = 64;
  o.layers = 2;
  o.width = 64;
  o.heads = 2;
  const Run r = Train("transformer_lm", data, o, 300, 3e-3);
  INFO("held-out loss " << r.before << " -> " << r.after << " nats/char");
  CHECK(r.before > 3.5);  // ~ln 63 = 4.14 at initialisation
  CHECK(r.after < 2.5);   // unigram entropy of the text is ~3.0 nats/char (4.3 bits)
}

TEST_CASE("bert small learns masked KJV words", "[models][slow]") {
  TextDataOptions d;
  d.context = 32;
  d.batch = 16;
  d.eval_batch = 16;
  d.max_eval_batches = 4;
  d.vocab_size = 2000;
  TextData data = MakeMaskedLmData(d);
  models::ModelOptions o;
  o.batch = 16;
  o.context = 32;
  o.layers = 2;
  o.width = 64;
  o.heads = 2;
  const Run r = Train("bert", data, o, 300, 2e-3);
  // The loss is masked LM + next sentence (~ln 2 = 0.69 at chance): the masked-LM part below 6.0.
  INFO("held-out masked-LM + NSP loss " << r.before << " -> " << r.after);
  CHECK(r.before > 7.0);  // ~ln 2000 + ln 2 = 8.3 at initialisation
  CHECK(r.after < 6.0 + std::log(2.0));
}
