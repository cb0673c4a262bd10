// The `shardstep` command: bad flags exit with status 2 and a clear message; bad files are clear
// errors (status 1), never a crash; compile prints each stage; a tiny training run reports metrics.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

struct Result {
  int status;
  std::string output;
};

Result Run(const std::string& args) {
  std::string cmd = std::string(SS_BINARY_DIR) + "/shardstep " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

std::string TempDir() {
  auto d = std::filesystem::temp_directory_path() / ("ss_cli_test_" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

}  // namespace

TEST_CASE("unknown flags and bad values exit with status 2 and name the flag") {
  auto r = Run("train --no-such-flag");
  CHECK(r.status == 2);
  CHECK_THAT(r.output, Catch::Contains("--no-such-flag"));

  r = Run("train --optimizer rmsprop");
  CHECK(r.status == 2);
  CHECK_THAT(r.output, Catch::Contains("--optimizer"));

  r = Run("train --steps -3");
  CHECK(r.status == 2);
  CHECK_THAT(r.output, Catch::Contains("--steps"));

  r = Run("compile --emit=bogus");
  CHECK(r.status == 2);
  CHECK_THAT(r.output, Catch::Contains("--emit"));

  r = Run("");
  CHECK(r.status == 2);
}

TEST_CASE("a missing dataset or a corrupt checkpoint is a clear error, not a crash") {
  std::string dir = TempDir();
  auto r = Run("train --steps 1 --hidden 8 --data-dir " + dir);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Catch::Contains("--data-dir " + dir));
  CHECK_THAT(r.output, Catch::Contains("train-images-idx3-ubyte.gz"));

  std::string bad = dir + "/bad.safetensors";
  std::ofstream(bad) << "this is not a checkpoint";
  r = Run("train --steps 1 --hidden 8 --dataset synthetic --load " + bad);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Catch::Contains("bad.safetensors"));

  // A checkpoint of another model shape: names the tensor and both shapes.
  std::string init = dir + "/init.safetensors";
  r = Run("train --steps 1 --hidden 8 --dataset synthetic --eval-batch 500 --save-init " + init);
  REQUIRE(r.status == 0);
  r = Run("train --steps 1 --hidden 16 --dataset synthetic --eval-batch 500 --load " + init);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Catch::Contains("fc1.w"));
  CHECK_THAT(r.output, Catch::Contains("[784,8]"));
  CHECK_THAT(r.output, Catch::Contains("[784,16]"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("compile prints every stage as IR text") {
  auto r = Run("compile --model mlp --hidden 8 --batch 4 --emit=ir");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Catch::StartsWith("module @mlp"));
  CHECK_THAT(r.output, !Catch::Contains("gradient @"));
  r = Run("compile --model cnn --batch 4 --emit=grad");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("gradient @conv1.w"));
  r = Run("compile --model mlp --hidden 8 --batch 4 --emit=opt --optimizer adam");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("assign @fc1.w/m"));
}

TEST_CASE("a short run writes JSON Lines metrics and a loadable checkpoint; a config file sets flags") {
  std::string dir = TempDir();
  std::ofstream(dir + "/run.toml") << "[train]\nmodel = \"mlp\"\nhidden = [16]\nsteps = 30\ndataset = \"synthetic\"\n"
                                      "eval-batch = 500\nlog-every = 10\n";
  auto r = Run("train --config " + dir + "/run.toml --metrics-out " + dir + "/m.jsonl --save " + dir + "/final.safetensors");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("step 30/30"));
  CHECK_THAT(r.output, Catch::Contains("ETA"));
  std::ifstream in(dir + "/m.jsonl");
  std::string line;
  int steps = 0, evals = 0;
  while (std::getline(in, line)) {
    if (line.find("\"memory\":") != std::string::npos) {
      CHECK_THAT(line, Catch::Contains("\"optimizer_state_bytes\":"));
    } else if (line.find("\"split\":\"test\"") != std::string::npos) {
      ++evals;
      CHECK_THAT(line, Catch::Contains("\"accuracy\":"));
    } else {
      ++steps;
      CHECK_THAT(line, Catch::Contains("\"loss\":"));
      CHECK_THAT(line, Catch::Contains("\"step_ms\":"));
      CHECK_THAT(line, Catch::Contains("\"comm_ms\":0,"));  // one replica: no collectives
    }
  }
  CHECK(steps == 30);
  CHECK(evals == 1);
  r = Run("train --config " + dir + "/run.toml --steps 1 --load " + dir + "/final.safetensors");
  CHECK(r.status == 0);
  // With replicas, comm_ms is the part of step_ms spent in collectives: positive, at most step_ms.
  r = Run("train --config " + dir + "/run.toml --steps 5 --replicas 4 --metrics-out " + dir + "/m4.jsonl");
  REQUIRE(r.status == 0);
  std::ifstream in4(dir + "/m4.jsonl");
  int with_comm = 0;
  while (std::getline(in4, line)) {
    const auto step_at = line.find("\"step_ms\":"), comm_at = line.find("\"comm_ms\":");
    if (step_at == std::string::npos) continue;
    REQUIRE(comm_at != std::string::npos);
    const double step_ms = std::stod(line.substr(step_at + 10)), comm_ms = std::stod(line.substr(comm_at + 10));
    CHECK(comm_ms > 0);
    CHECK(comm_ms <= step_ms);
    ++with_comm;
  }
  CHECK(with_comm == 5);
  // --plot-out: an SVG next to the metrics; a directory that does not exist fails before training.
  r = Run("train --config " + dir + "/run.toml --steps 20 --plot-out " + dir + "/run.svg");
  REQUIRE(r.status == 0);
  std::ifstream svg(dir + "/run.svg");
  std::string head;
  std::getline(svg, head);
  CHECK_THAT(head, Catch::StartsWith("<svg"));
  r = Run("train --config " + dir + "/run.toml --steps 20 --plot-out " + dir + "/no/such/dir/run.svg");
  CHECK(r.status != 0);
  CHECK_THAT(r.output, Catch::Contains("cannot write --plot-out " + dir + "/no/such/dir/run.svg"));
  CHECK_THAT(r.output, !Catch::Contains("step 1/"));
  std::filesystem::remove_all(dir);
}
