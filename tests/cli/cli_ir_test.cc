// IR in, IR out: `compile --ir` round-trips a model's printed IR and runs named passes with the
// results `--emit` gives; `run --ir` runs a module on safetensors inputs and saves its outputs and
// new state; config files set flags, and the command line wins.
#include "runtime/checkpoint.h"
#include "tests/cli/cli_util.h"

using namespace cli_test;
using Catch::Contains;
using shardstep::runtime::LoadCheckpoint;
using shardstep::runtime::SaveCheckpoint;
using shardstep::runtime::Tensor;

namespace {

const char* kTinyIr = R"(module @tiny replicas=2 {
  %0 = input @x : f32[2,3]
  %1 = variable @w {init="ones", role="weight"} : f32[3]
  %2 = reduce_sum(%0) {axes=[0]} : f32[3]
  %3 = all_reduce(%2) {reduction="sum"} : f32[3]
  %4 = add(%1, %3) : f32[3]
  %5 = reduce_sum(%4) {axes=[0]} : f32[]
  assign @w = %4
  output @loss = %5
  output @sum = %3
}
)";

}  // namespace

TEST_CASE("compile --ir round-trips every stage of a model: print(parse(x)) == x") {
  TempDir d("ir_roundtrip");
  for (const char* stage : {"ir", "grad", "opt", "sharded", "combined", "fused"}) {
    for (const char* model : {"--model mlp --hidden 8", "--model cnn"}) {
      INFO(stage << " " << model);
      auto r = Run(std::string("compile ") + model + " --batch 4 --replicas 2 --emit=" + stage);
      REQUIRE(r.status == 0);
      const std::string ir = d.Write("m.ir", r.output);
      auto back = Run("compile --ir " + ir);
      REQUIRE(back.status == 0);
      CHECK(back.output == r.output);
      // -o writes the same text (atomically: no temporary file is left behind).
      REQUIRE(Run("compile --ir " + ir + " -o " + d / "out.ir").status == 0);
      CHECK(ReadText(d / "out.ir") == r.output);
      // Standard input too.
      auto piped = Shell("cat " + ir + " | " + Binary() + " compile --ir -");
      CHECK(piped.output == r.output);
    }
  }
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(d.path)) files += e.is_regular_file();
  CHECK(files == 2);
}

TEST_CASE("compile --passes runs named passes; 'all' is the training pipeline") {
  TempDir d("ir_passes");
  const std::string flags = "--model mlp --hidden 8 --batch 4 --replicas 2 --optimizer lamb";
  auto emit = [&](const std::string& stage) {
    auto r = Run("compile " + flags + " --emit=" + stage);
    REQUIRE(r.status == 0);
    return r.output;
  };
  const std::string ir = d.Write("m.ir", emit("ir"));
  const std::string opts = " --optimizer lamb";  // pass options come from the same flags
  auto passes = [&](const std::string& list) {
    auto r = Run("compile --ir " + ir + opts + " --passes=" + list);
    INFO(r.output);
    REQUIRE(r.status == 0);
    return r.output;
  };
  CHECK(passes("autodiff") == emit("grad"));
  CHECK(passes("autodiff,data-parallel-lowering") == emit("dp"));
  CHECK(passes("autodiff,data-parallel-lowering,optimizer-lowering") == emit("opt"));
  CHECK(passes("all") == emit("combined"));
  CHECK(passes("all,elementwise-fuser") == emit("fused"));
  CHECK(passes("' autodiff , data-parallel-lowering '") == emit("dp"));  // spaces around names
  CHECK(passes("") == emit("ir"));
  // Passes on a module built from the model flags, and on a stage read back.
  auto r = Run("compile " + flags + " --passes=all");
  REQUIRE(r.status == 0);
  CHECK(r.output == emit("combined"));
  const std::string opt = d.Write("opt.ir", emit("opt"));
  r = Run("compile --ir " + opt + " --passes=nonfinite-guard,weight-update-sharder,collective-combiner");
  REQUIRE(r.status == 0);
  CHECK(r.output == emit("combined"));  // --on-nonfinite stop (the default) guards the step
  r = Run("compile --ir " + opt + " --passes=weight-update-sharder,collective-combiner");
  REQUIRE(r.status == 0);
  CHECK(r.output == Run("compile " + flags + " --on-nonfinite ignore --emit=combined").output);
  // A pass that does not apply is a clear error (the module already has its gradients).
  r = Run("compile --ir " + opt + " --passes=autodiff");
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("shardstep: error: "));
}

TEST_CASE("run --ir runs a module on safetensors inputs and saves its outputs and new state") {
  TempDir d("ir_run");
  const std::string ir = d.Write("tiny.ir", kTinyIr);
  std::vector<float> x(12);
  for (int i = 0; i < 12; ++i) x[i] = static_cast<float>(i);
  SaveCheckpoint(d / "in.safetensors", {{"x", Tensor::F32({4, 3}, x)}});
  // Replica 0 sums rows 0-1 ([3,5,7]), replica 1 rows 2-3 ([15,17,19]); the all-reduce gives
  // [18,22,26]; w = 1 + that; loss = 69 on both replicas.
  for (const char* backend : {"interp", "cpu"}) {
    INFO(backend);
    auto r = Run("run --ir " + ir + " --inputs " + d / "in.safetensors" + " --backend " + backend + " --outputs " +
                 d / "out.safetensors" + " --state-out " + d / "state.safetensors");
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK_THAT(r.output, Contains("2 replicas"));
    CHECK_THAT(r.output, Contains("  loss = f32[] 69\n"));
    CHECK_THAT(r.output, Contains("  sum = f32[3] [18, 22, 26] (3 values)\n"));
    auto out = LoadCheckpoint(d / "out.safetensors");
    CHECK(out.at("sum") == Tensor::F32({3}, {18, 22, 26}));
    CHECK(out.at("loss") == Tensor::Scalar(69));
    auto state = LoadCheckpoint(d / "state.safetensors");
    CHECK(state.at("w") == Tensor::F32({3}, {19, 23, 27}));
  }
  // The saved state feeds the next step.
  auto r = Run("run --ir " + ir + " --inputs " + d / "in.safetensors" + " --state " + d / "state.safetensors");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("  loss = f32[] 135\n"));  // (19+23+27) + (18+22+26)
  // One replica of a one-replica module, with a few values shown.
  SaveCheckpoint(d / "one.safetensors", {{"x", Tensor::F32({2, 3}, {0, 1, 2, 3, 4, 5})}});
  std::string one = kTinyIr;
  one.replace(one.find("replicas=2"), 10, "replicas=1");
  r = Run("run --ir " + d.Write("one.ir", one) + " --replica 0 --show 2 --inputs " + d / "one.safetensors");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("replica 0 of 1"));
  CHECK_THAT(r.output, Contains("  sum = f32[3] [3, 5, ...] (3 values)\n"));
}

TEST_CASE("config files: configs/*.toml parse; the command line wins; other tables are checked") {
  for (const char* cfg : {"configs/mlp.toml", "configs/cnn.toml"}) {
    // --eval-batch 0 fails after the file was read and applied: the file itself is accepted.
    auto r = Run(std::string("train --config ") + SS_SOURCE_DIR + "/" + cfg + " --steps 1 --eval-batch 0");
    INFO(r.output);
    CHECK(r.status == 2);
    CHECK_THAT(r.output, Contains("--eval-batch: must be a positive integer, got 0"));
  }
  TempDir d("cfg_ok");
  const std::string cfg = d.Write(
      "run.toml",
      "# a run\n[train]  # the train command\nmodel = 'mlp'\nhidden = [\n  16,  # one layer\n]\nsteps = 30\n"
      "dataset = \"synthetic\"\neval-batch = 500\nlog-every = 1_0\nnesterov = false\nno-shuffle = true\n\n"
      "[compile]\nemit = \"opt\"\n");
  auto r = Run("train --config " + cfg + " --steps 2");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("(12730 parameters), synthetic"));
  CHECK_THAT(r.output, Contains("step 2/2"));
  r = Run("compile --config " + cfg + " --hidden 8 --batch 4");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("assign @fc1.w/m"));
}
