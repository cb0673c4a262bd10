// "This must fail with this message": every bad input the `shardstep` command can be given fails
// early, with one line that names the file, flag or value, and a non-zero status; never a crash.
#include <chrono>

#include "runtime/checkpoint.h"
#include "tests/cli/cli_util.h"

using namespace cli_test;
using Catch::Contains;
using Catch::StartsWith;

namespace {

// One line (plus CLI11's "Run with --help" for command-line errors), no training started.
void CheckOneLineError(const Result& r) {
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.status < 128);  // not killed by a signal (abort, the kernel's OOM killer)
  CHECK_THAT(r.output, !Contains("step 1/"));
  CHECK_THAT(r.output, !Contains("terminate called"));
  size_t lines = 0;
  for (char c : r.output) lines += c == '\n';
  CHECK(lines <= 2);
}

// A two-replica module: the per-replica column sums, all-reduced, are added to @w.
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

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  REQUIRE(at != std::string::npos);
  return s.replace(at, from.size(), to);
}

}  // namespace

TEST_CASE("a config file with a misspelt key names the file, the line and the likely key") {
  TempDir d("cfg_typo");
  std::string cfg = d.Write("x.toml", "# run\n[train]\nmodle = \"mlp\"\nsteps = 1\n");
  auto r = Run("train --dataset synthetic --config " + cfg);
  CheckOneLineError(r);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, StartsWith(cfg + ":3: error: unknown key 'modle' in [train] (did you mean 'model'?)"));

  cfg = d.Write("far.toml", "[train]\nxyzzy = 1\n");
  r = Run("train --config " + cfg);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains(cfg + ":2: error: unknown key 'xyzzy' in [train]"));

  cfg = d.Write("table.toml", "[trian]\nsteps = 1\n");
  r = Run("train --config " + cfg);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains(cfg + ":1: error: unknown table [trian] (did you mean [train]?)"));

  cfg = d.Write("outside.toml", "steps = 1\n[train]\n");
  r = Run("train --config " + cfg);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains(cfg + ":1: error: key 'steps' is outside a table"));

  // A typo in another command's table is caught too.
  cfg = d.Write("other.toml", "[train]\nsteps = 1\n[compile]\nemitt = \"ir\"\n");
  r = Run("train --config " + cfg);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains(cfg + ":4: error: unknown key 'emitt' in [compile] (did you mean 'emit'?)"));
}

TEST_CASE("a config file with broken syntax or bad values names the file and the line") {
  TempDir d("cfg_broken");
  struct Case {
    const char* text;
    const char* message;
  } cases[] = {
      {"[train\nmodel = \"mlp\"\n", ":1: error: expected ']' to close the table header"},
      {"# x\n[train]\nmodel = mlp\n", ":3: error: invalid value mlp for 'model' (strings need quotes"},
      {"[train]\nsteps = 3\nsteps = 4\n", ":3: error: key 'steps' is set twice in [train] (first at line 2)"},
      {"[train]\nhidden = [16,\n", ":2: error: unterminated array: '[' of 'hidden' is never closed"},
      {"[train]\nmodel = \"mlp\n", ":2: error: unterminated string"},
      {"[train]\nsteps 3\n", ":2: error: expected '=' after key 'steps'"},
      {"[train]\nsteps = 3 4\n", ":2: error: unexpected '4' after the value of 'steps'"},
      {"[train]\nsteps = -4\n", ":2: error: --steps: must be a positive integer, got -4"},
      {"[train]\nsteps = [1, 2]\n", ":2: error: 'steps' takes one value, got an array"},
      {"[train]\nnesterov = 1\n", ":2: error: 'nesterov' is a switch: use true or false, got an integer"},
      {"[train]\noptimizer = \"rmsprop\"\n", ":2: error: --optimizer: rmsprop not in"},
      {"[train]\na.b = 1\n", ":2: error: dotted keys (a.…) are not supported"},
      {"[train]\n[train]\n", ":2: error: table [train] is defined twice (first at line 1)"},
      {"[[train]]\n", ":1: error: arrays of tables ([[...]]) are not supported"},
      {"[train]\nlr = {a = 1}\n", ":2: error: inline tables ({...}) are not supported"},
  };
  int i = 0;
  for (const Case& c : cases) {
    std::string cfg = d.Write("c" + std::to_string(i++) + ".toml", c.text);
    auto r = Run("train --dataset synthetic --config " + cfg);
    INFO(c.text);
    CheckOneLineError(r);
    CHECK(r.status == 1);
    CHECK_THAT(r.output, StartsWith(cfg + c.message));
  }
  auto r = Run("train --config " + d / "missing.toml");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("cannot read config file " + d / "missing.toml" + ": No such file or directory"));
}

TEST_CASE("every output path is checked before anything is built or trained") {
  TempDir d("outputs");
  const std::string file = d.Write("a_file", "x");
  const std::string train = "train --dataset synthetic --steps 1 --hidden 8 --eval-batch 500 ";
  for (const char* flag : {"--save", "--save-init", "--metrics-out", "--plot-out"}) {
    INFO(flag);
    auto r = Run(train + flag + " " + d / "no/such/dir/out");
    CheckOneLineError(r);
    CHECK_THAT(r.output, Contains(std::string("cannot write ") + flag + " " + d / "no/such/dir/out" + ": directory " +
                                  d / "no/such/dir" + " does not exist"));
    r = Run(train + flag + " " + d.path);
    CheckOneLineError(r);
    CHECK_THAT(r.output, Contains(std::string("cannot write ") + flag + " " + d.path + ": it is a directory"));
    r = Run(train + flag + " " + file + "/out");
    CheckOneLineError(r);
    CHECK_THAT(r.output, Contains(std::string("cannot write ") + flag + " " + file + "/out: " + file + " is not a directory"));
    // Permissions do not stop root; a file system that refuses new files does.
    r = Run(train + flag + " /proc/out");
    CheckOneLineError(r);
    CHECK_THAT(r.output, Contains(std::string("cannot write ") + flag + " /proc/out: cannot create files in directory /proc"));
  }
  auto r = Run(train + "--save " + d / "same" + " --save-init " + d / "same");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--save and --save-init name the same file " + d / "same"));

  r = Run("compile --model mlp --hidden 8 --batch 4 -o " + d / "no/dir/x.ir");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("cannot write -o " + d / "no/dir/x.ir" + ": directory " + d / "no/dir" + " does not exist"));

  const std::string ir = d.Write("tiny.ir", kTinyIr);
  r = Run("compile --ir " + ir + " -o " + d.path);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("cannot write -o " + d.path + ": it is a directory"));
  for (const char* flag : {"--outputs", "--state-out"}) {
    r = Run("run --ir " + ir + " " + flag + " " + d / "no/dir/o.safetensors");
    CheckOneLineError(r);
    CHECK_THAT(r.output, Contains(std::string("cannot write ") + flag + " " + d / "no/dir/o.safetensors" +
                                  ": directory " + d / "no/dir" + " does not exist"));
  }
  r = Run(train + "--load " + d / "nothing.safetensors");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("cannot read --load " + d / "nothing.safetensors" + ": No such file or directory"));
}

TEST_CASE("a missing or incomplete dataset directory names the files, the flag and the package") {
  TempDir d("data");
  auto r = Run("train --steps 1 --hidden 8 --data-dir " + d.path);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--data-dir " + d.path + " holds none of the Fashion-MNIST files train-images-idx3-ubyte.gz"));
  CHECK_THAT(r.output, Contains("dataset-fashion-mnist"));
  CHECK_THAT(r.output, Contains("--dataset synthetic"));
  r = Run("train --steps 1 --hidden 8 --data-dir " + d / "nope");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--data-dir " + d / "nope" + ": No such file or directory; it must hold"));
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte"})
    d.Write(f, "");
  r = Run("train --steps 1 --hidden 8 --data-dir " + d.path);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--data-dir " + d.path + ": missing Fashion-MNIST file t10k-labels-idx1-ubyte.gz;"));
}

TEST_CASE("a run that does not fit in memory is refused with the figures, quickly") {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = Run("train --replicas 4096 --batch 4096 --hidden 8192,8192 --dataset synthetic --steps 1");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CheckOneLineError(r);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, StartsWith("shardstep: error: not enough memory: needs 2.3 TiB (4096 replicas x 586.4 MiB "
                                  "[state 281.0 MiB + peak temporaries 305.4 MiB]"));
  CHECK_THAT(r.output, Contains(" available (MemAvailable in /proc/meminfo); use fewer --replicas"));
  CHECK(seconds < 10);
  // The issue's case; the default MLP needs 82 GiB at 4096 replicas.
  r = Run("train --replicas 4096 --batch 4096");
  INFO(r.output);
  CHECK(r.status < 128);
  if (r.status != 0) CHECK_THAT(r.output, Contains("4096 replicas x 20.4 MiB"));
}

TEST_CASE("an allocation that fails is one line, 'out of memory', status 1") {
#if defined(__SANITIZE_ADDRESS__)
  WARN("skipped: AddressSanitizer reserves more address space than the limit this test sets");
  return;
#endif
  // Past the memory check on purpose, under an address-space limit so that an allocation fails.
  auto r = Shell("ulimit -v 1500000; exec " + Binary() +
                 " train --replicas 4096 --batch 4096 --no-memory-check --dataset synthetic --steps 1");
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("shardstep: error: out of memory"));
  CHECK_THAT(r.output, !Contains("terminate called"));
}

TEST_CASE("an evaluation batch that does not divide the test split is an error") {
  auto r = Run("train --dataset synthetic --steps 1 --hidden 8 --eval-batch 300");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("shardstep: error: --eval-batch 300 does not divide the synthetic test split (2000 "
                                "examples): the last 200 would not be evaluated; use 250 or 400"));
  r = Run("train --dataset synthetic --steps 1 --hidden 8 --eval-batch 5000");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--eval-batch 5000 is larger than the synthetic test split (2000 examples)"));
}

TEST_CASE("a batch that does not split over the replicas names both flags and the nearest fits") {
  for (const char* cmd : {"train --dataset synthetic --steps 1 --hidden 8", "compile --hidden 8"}) {
    auto r = Run(std::string(cmd) + " --batch 10 --replicas 4");
    CheckOneLineError(r);
    CHECK_THAT(r.output, Contains("shardstep: error: --batch 10 does not split evenly over 4 replicas (each takes "
                                  "batch / replicas examples): use --batch 8 or 12, or --replicas 2"));
  }
}

TEST_CASE("negative or malformed counts are a short error naming the flag") {
  for (const char* args : {"train --steps -3", "train --steps abc", "train --batch 0", "train --eval-batch -1",
                           "train --lr -1", "compile --batch -4"}) {
    auto r = Run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.status == 2);
    CHECK(r.output.size() < 200);
    CHECK_THAT(r.output, Contains(": must be a positive "));
  }
  auto r = Run("train --steps -3");
  CHECK_THAT(r.output, StartsWith("--steps: must be a positive integer, got -3\n"));
}

TEST_CASE("an unknown pass name lists the known ones") {
  TempDir d("passes");
  const std::string ir = d.Write("tiny.ir", kTinyIr);
  auto r = Run("compile --ir " + ir + " --passes=autodiff,autodif");
  CheckOneLineError(r);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("shardstep: error: --passes: unknown pass 'autodif' (did you mean 'autodiff'?); known "
                                "passes: autodiff, mixed-precision, data-parallel-lowering, optimizer-lowering, nonfinite-guard, "
                                "weight-update-sharder, "
                                "shard-order-reductions, collective-combiner, elementwise-fuser, all"));
  r = Run("compile --model mlp --hidden 8 --batch 4 --passes=bogus");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("unknown pass 'bogus'; known passes: autodiff,"));
  // A pass given a module it cannot handle (here: one whose variables are assigned already) is an
  // error naming the pass, not an abort.
  r = Run("compile --ir " + ir + " --passes=all");
  CheckOneLineError(r);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, StartsWith("shardstep: error: pass optimizer-lowering cannot handle this module"));
  r = Run("compile --ir " + ir + " --passes=optimizer-lowering");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("optimizer-lowering: the module has no gradients (run autodiff first)"));
  r = Run("compile --ir " + ir + " --model cnn");
  CHECK(r.status == 2);
  CHECK_THAT(r.output, Contains("--model excludes --ir"));
}

TEST_CASE("IR that does not parse or verify is an error located in the file, for compile and run") {
  TempDir d("bad_ir");
  struct Case {
    const char* name;
    std::string text;
    std::string message;
  } cases[] = {
      {"parse.ir", Replace(kTinyIr, "%0 = input @x : f32[2,3]", "%0 = input @x : f32[2,3"),
       ":3:3: error: expected ',' or ']' in shape"},
      {"op.ir", Replace(kTinyIr, "add(%1, %3)", "addd(%1, %3)"), ":6:8: error: unknown op 'addd'"},
      // An assignment whose type differs from the variable's.
      {"assign.ir", Replace(kTinyIr, "assign @w = %4", "assign @w = %5"),
       ":8: error: module @tiny: assign %1 = %5: value type f32[] differs from variable @w type f32[3]"},
      // A collective whose replica groups are malformed.
      {"groups.ir", Replace(kTinyIr, "{reduction=\"sum\"}", "{groups=[[0,1],[1]], reduction=\"sum\"}"),
       ":5: error: module @tiny: %3 (all_reduce): attribute 'groups'=[[0,1],[1]]"},
      {"groups2.ir", Replace(kTinyIr, "{reduction=\"sum\"}", "{groups=[[0,2]], reduction=\"sum\"}"),
       ":5: error: module @tiny: %3 (all_reduce): attribute 'groups'=[[0,2]]"},
      {"output.ir", Replace(kTinyIr, "output @sum = %3", "output @loss = %3"),
       ":10: error: module @tiny: output @loss = %3: output name used twice"},
  };
  for (const Case& c : cases) {
    const std::string path = d.Write(c.name, c.text);
    for (const std::string cmd : {"compile --ir ", "run --ir "}) {
      auto r = Run(cmd + path);
      INFO(cmd << c.name);
      CheckOneLineError(r);
      CHECK(r.status == 1);
      CHECK_THAT(r.output, StartsWith(path + c.message));
    }
  }
  auto r = Run("compile --ir " + d / "none.ir");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("cannot read IR file " + d / "none.ir" + ": No such file or directory"));
}

TEST_CASE("run --ir names missing or mistyped inputs and variables with their expected types") {
  using shardstep::runtime::SaveCheckpoint;
  using shardstep::runtime::Tensor;
  TempDir d("run_inputs");
  const std::string ir = d.Write("tiny.ir", kTinyIr);
  auto r = Run("run --ir " + ir);
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("no --inputs file given: input 'x' (f32[4,3]) is missing (the global batch of 2 "
                                "replicas"));
  SaveCheckpoint(d / "half.safetensors", {{"x", Tensor::F32({2, 3}, {0, 1, 2, 3, 4, 5})}, {"y", Tensor::Scalar(1)}});
  r = Run("run --ir " + ir + " --inputs " + d / "half.safetensors");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains(d / "half.safetensors" + ": input 'x' is f32[2,3], expected f32[4,3]; tensor 'y' "
                                "(f32[]) is not an input of the module (its inputs: x)"));
  // One replica takes its own inputs, and a collective over two replicas needs the other.
  r = Run("run --ir " + ir + " --replica 1 --inputs " + d / "half.safetensors");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("tensor 'y' (f32[]) is not an input of the module"));
  SaveCheckpoint(d / "x2.safetensors", {{"x", Tensor::F32({2, 3}, {0, 1, 2, 3, 4, 5})}});
  r = Run("run --ir " + ir + " --replica 1 --inputs " + d / "x2.safetensors");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--replica runs one replica without collectives"));
  r = Run("run --ir " + ir + " --replica 2 --inputs " + d / "x2.safetensors");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains("--replica 2 is outside the module's replicas [0, 2)"));
  SaveCheckpoint(d / "x4.safetensors", {{"x", Tensor::F32({4, 3}, std::vector<float>(12, 1.0f))}});
  SaveCheckpoint(d / "state.safetensors", {{"v", Tensor::F32({3}, {1, 2, 3})}});
  r = Run("run --ir " + ir + " --inputs " + d / "x4.safetensors" + " --state " + d / "state.safetensors");
  CheckOneLineError(r);
  CHECK_THAT(r.output, Contains(d / "state.safetensors" + ": tensor 'w' (f32[3]) is missing from the file; tensor 'v' "
                                "(f32[3]) in the file is not part of the model"));
}

TEST_CASE("a kernel-choice environment variable with an unknown value is an error naming it") {
  struct Case {
    const char* env;
    const char* args;
    const char* message;
  } cases[] = {
      {"SHARDSTEP_SMALL_GEMM=bogus", "--model mlp", "SHARDSTEP_SMALL_GEMM: 'bogus' is neither 'on' nor 'off'"},
      {"SHARDSTEP_CONV=fast", "--model cnn", "SHARDSTEP_CONV: 'fast' is neither 'im2col' nor 'direct'"},
      {"SHARDSTEP_BF16_MATMUL=x", "--model mlp --precision bf16",
       "SHARDSTEP_BF16_MATMUL: 'x' is neither 'widen' nor 'onednn'"},
  };
  for (const Case& c : cases) {
    auto r = Shell(std::string(c.env) + " " + Binary() + " train --dataset synthetic " + c.args +
                   " --batch 8 --steps 1 --eval-every 0 --eval-batches 1");
    INFO(c.env << "\n" << r.output);
    CHECK(r.status == 1);
    CHECK_THAT(r.output, Contains(c.message));
    CHECK_THAT(r.output, !Contains("internal error"));
  }
}
