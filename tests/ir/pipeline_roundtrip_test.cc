// The text form round-trips for the IR of every built-in model after every pass of the training
// pipeline (replicated and sharded, every optimizer): parse(print(m)) == m.
#include <catch2/catch.hpp>

#include <algorithm>
#include <iterator>

#include "dsl/dsl.h"
#include "ir/parser.h"
#include "ir/passes/pipeline.h"
#include "ir/printer.h"
#include "models/models.h"

using namespace shardstep;

TEST_CASE("every model's IR round-trips after every pass") {
  const char* optimizers[] = {"sgd", "momentum", "adam", "adamw", "adagrad", "lamb", "lars"};
  for (const auto& spec : models::AllModels()) {
    for (const char* opt : optimizers) {
      for (int replicas : {1, 4}) {
        dsl::Model m(spec.name);
        models::ModelOptions o;
        o.batch = 8;
        o.hidden = {24, 10};
        o.vocab = 64;  // language models take it from the data
        m.train(spec.define(m, o));
        ir::Module module = m.lower(replicas);
        ir::PipelineOptions po;
        ir::ParseOptimizerKind(opt, &po.optimizer.kind_);
        po.optimizer.clip_global_norm(1.0).warmup(3);
        po.replicas = replicas;
        const auto index = std::find(std::begin(optimizers), std::end(optimizers), opt) - std::begin(optimizers);
        po.nonfinite_guard = replicas > 1 || index % 2 == 0;  // the guard, sharded and not
        int stages = 0;
        auto check = [&](const std::string& stage, const ir::Module& mod) {
          INFO(spec.name << " " << opt << " N=" << replicas << " after " << stage);
          const std::string text = ir::Print(mod);
          ir::Module back = ir::Parse(text, stage + ".ir");
          CHECK(back == mod);
          CHECK(ir::Print(back) == text);
          ++stages;
        };
        check("dsl", module);
        ir::BuildTrainingPipeline(po).OnPass([&](const ir::Pass& p, const ir::Module& mod) { check(p.name(), mod); }).Run(module);
        CHECK(stages >= (po.nonfinite_guard ? 6 : 5));
      }
    }
  }
}
