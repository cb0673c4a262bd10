// The DSL: models lower for any replica count, and user mistakes become errors naming the op, the
// shapes and the user's source line, reported at build() (never a crash).
#include <catch2/catch.hpp>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "ir/verifier.h"
#include "models/models.h"

using namespace shardstep;

namespace {
std::string BuildError(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("dense shape mismatch names the op, both shapes and the source line") {
  dsl::Model m("bad");
  auto x = m.input("x", dsl::f32({8, 4}));
  auto y = m.input("y", dsl::s32({8}));
  auto w = m.weight("w", dsl::f32({5, 3}), "zeros");
  const int line = __LINE__ + 1;
  auto bad = x.add(w);  // [8,4] + [5,3]
  auto loss = bad.cross_entropy(y).mean();  // later steps are held, not crashed
  std::string msg = BuildError([&] { m.train(loss).build(); });
  CHECK_THAT(msg, Catch::Contains("dsl_test.cc:" + std::to_string(line)));
  CHECK_THAT(msg, Catch::Contains("add"));
  CHECK_THAT(msg, Catch::Contains("f32[8,4]"));
  CHECK_THAT(msg, Catch::Contains("f32[5,3]"));
}

TEST_CASE("conv2d on a rank-2 input is reported at build()") {
  dsl::Model m("bad");
  auto x = m.input("x", dsl::f32({8, 784}));
  const int line = __LINE__ + 1;
  auto h = x.conv2d(4, 3, "conv1");
  std::string msg = BuildError([&] { m.train(h.mean()).build(); });
  CHECK_THAT(msg, Catch::Contains("dsl_test.cc:" + std::to_string(line)));
  CHECK_THAT(msg, Catch::Contains("conv2d 'conv1'"));
}

TEST_CASE("cross entropy with wrong label shape, and a non-scalar loss") {
  dsl::Model m("bad");
  auto x = m.input("x", dsl::f32({8, 10}));
  auto y = m.input("y", dsl::s32({4}));
  std::string msg = BuildError([&] { m.train(x.cross_entropy(y).mean()).build(); });
  CHECK_THAT(msg, Catch::Contains("cross_entropy"));
  CHECK_THAT(msg, Catch::Contains("s32[4]"));

  dsl::Model m2("bad2");
  auto x2 = m2.input("x", dsl::f32({8, 10}));
  msg = BuildError([&] { m2.train(x2.relu()).build(); });
  CHECK_THAT(msg, Catch::Contains("f32 scalar"));
}

TEST_CASE("a batch that does not divide across replicas is a clear error") {
  dsl::Model m("mlp");
  models::ModelOptions o;
  o.batch = 10;
  o.hidden = {8};
  auto loss = models::DefineMlp(m, o);
  std::string msg = BuildError([&] { m.train(loss).replicas(4).build(); });
  CHECK_THAT(msg, Catch::Contains("not divisible by 4"));
}

TEST_CASE("models lower for any replica count with the per-replica batch") {
  for (const auto& spec : models::AllModels()) {
    dsl::Model m(spec.name);
    models::ModelOptions o;
    o.batch = 16;
    o.hidden = {32};
    o.vocab = 64;  // language models take it from the data
    o.context = 16;
    auto loss = spec.define(m, o);
    ir::Module one = m.lower(1), four = m.lower(4);
    ir::Verify(one);
    ir::Verify(four);
    const char* first = spec.task == models::Task::kClassification ? "image" : "tokens";
    INFO(spec.name);
    REQUIRE(one.FindInput(first) != ir::kNoValue);
    CHECK(one.type(one.FindInput(first)).shape[0] == 16);
    CHECK(four.type(four.FindInput(first)).shape[0] == 4);
    CHECK(four.num_replicas == 4);
    // Same weights, same initialisers, whatever the replica count.
    for (ir::ValueId v : one.Variables()) {
      ir::ValueId u = four.FindVariable(one.at(v).name);
      REQUIRE(u != ir::kNoValue);
      CHECK(four.at(u).attrs == one.at(v).attrs);
    }
    (void)loss;
  }
}

TEST_CASE("the fluent sketch builds a whole training step") {
  dsl::Model m("mlp");
  auto x = m.input("image", dsl::f32({8, 784}));
  auto y = m.input("label", dsl::s32({8}));
  auto logits = x.dense(32, "fc1").relu().dense(10, "fc2");
  auto program = m.train(logits.cross_entropy(y).mean()).optimizer(dsl::Adam().lr(1e-3).clip_global_norm(1.0)).build();
  ir::Verify(program.step);
  CHECK(program.step.FindVariable("fc1.w/m") != ir::kNoValue);
  CHECK(program.step.FindVariable("step") != ir::kNoValue);
  CHECK(program.step.gradients.size() == 4);
  CHECK(program.step.assigns.size() == 4 * 3 + 1);
}
