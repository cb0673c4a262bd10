// "This must fail with this message" (as Halide's test/error/): every file in tests/ir/errors/ is a
// small broken module whose first line reads "// expect: <message>". Parsing and verifying it must
// throw shardstep::Error with exactly that message: parse errors give file:line:column, verifier
// errors name the module, the value ("%1 (all_reduce)"), the attribute and its bad value. A second
// test feeds each file down the interpreter path (parse, verify, initial and per-replica state, one
// step) and checks it stops with that error before anything runs: bad IR never crashes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ir/error.h"
#include "ir/parser.h"
#include "ir/verifier.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"

namespace shardstep {
namespace {

namespace fs = std::filesystem;

struct ErrorFile {
  std::string name;      // "groups_replica_twice.ir"
  std::string text;
  std::string expected;  // the message after "// expect: "
};

std::vector<ErrorFile> ErrorFiles() {
  std::vector<ErrorFile> files;
  for (const auto& entry : fs::directory_iterator(fs::path(SS_SOURCE_DIR) / "tests/ir/errors")) {
    if (entry.path().extension() != ".ir") continue;
    std::ifstream in(entry.path());
    std::stringstream ss;
    ss << in.rdbuf();
    ErrorFile f{entry.path().filename().string(), ss.str(), ""};
    const std::string prefix = "// expect: ";
    const std::string first = f.text.substr(0, f.text.find('\n'));
    if (first.rfind(prefix, 0) == 0) f.expected = first.substr(prefix.size());
    files.push_back(std::move(f));
  }
  std::sort(files.begin(), files.end(), [](const ErrorFile& a, const ErrorFile& b) { return a.name < b.name; });
  return files;
}

TEST_CASE("every file in tests/ir/errors fails to parse or verify with its expected message", "[ir][errors]") {
  const std::vector<ErrorFile> files = ErrorFiles();
  REQUIRE(files.size() >= 60);
  for (const ErrorFile& f : files) {
    INFO(f.name);
    REQUIRE_FALSE(f.expected.empty());  // the first line states the message
    std::string what;
    try {
      ir::Module m = ir::Parse(f.text, f.name);
      ir::Verify(m);
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK(what == f.expected);
  }
}

// Where the interpreter path stopped.
enum class Stage { kParse, kVerify, kState, kRun, kFinished };

Stage RunOnInterpreter(const std::string& text, const std::string& name, std::string* error) {
  Stage stage = Stage::kParse;
  try {
    ir::Module m = ir::Parse(text, name);
    stage = Stage::kVerify;
    ir::Verify(m);
    stage = Stage::kState;
    const runtime::TensorMap logical = runtime::InitLogicalState(m);
    std::vector<runtime::TensorMap> states(m.num_replicas);
    for (int r = 0; r < m.num_replicas; ++r) states[r] = runtime::ReplicaState(m, logical, r);
    runtime::TensorMap inputs;
    for (ir::ValueId v : m.Inputs()) inputs[m.at(v).name] = runtime::Tensor(m.type(v));
    stage = Stage::kRun;
    runtime::InProcessCollectives collectives(m.num_replicas);
    runtime::RunReplicas(m.num_replicas, &collectives,
                         [&](int r) { runtime::RunStep(m, states[r], inputs, r, &collectives); });
    stage = Stage::kFinished;
  } catch (const Error& e) {
    *error = e.what();
  }
  return stage;
}

TEST_CASE("every file in tests/ir/errors is refused on the interpreter path before it runs", "[ir][errors]") {
  for (const ErrorFile& f : ErrorFiles()) {
    INFO(f.name);
    std::string error;
    const Stage stage = RunOnInterpreter(f.text, f.name, &error);
    CHECK((stage == Stage::kParse || stage == Stage::kVerify));
    CHECK(error == f.expected);
  }
}

TEST_CASE("the interpreter path runs a valid module (the harness above can pass)", "[ir][errors]") {
  const char* text = R"(module @ok replicas=2 {
  %0 = input @x : f32[4]
  %1 = variable @m {logical_shape=[6], role="optimizer_state", shard_count=2, shard_format="dim0"} : f32[3]
  %2 = all_reduce(%0) {groups=[[0,1]], reduction="sum"} : f32[4]
  output @y = %2
})";
  std::string error;
  CHECK(RunOnInterpreter(text, "ok.ir", &error) == Stage::kFinished);
  CHECK(error.empty());
}

}  // namespace
}  // namespace shardstep
