// `shardstep train --resume DIR` (issue 13): a run stopped at step k and resumed to 40 steps gives the
// uninterrupted 40-step run's per-step losses (metrics JSONL) and final checkpoint, bitwise — with one
// replica, and with two replicas and the weight update sharded; across an epoch boundary of the
// shuffled data and under a warm-up + cosine learning-rate schedule. A resume with other options is
// refused with a message naming them.
#include <catch2/catch.hpp>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "tests/cli/cli_util.h"

using namespace cli_test;
using Catch::Contains;

namespace {

// 8000 synthetic training examples / 256 = 31 batches per epoch: step 32 starts epoch 1.
const std::string kRun =
    "train --dataset synthetic --model mlp --hidden 64 --batch 256 --eval-batch 2000 --eval-every 10 --log-every 10 "
    "--optimizer adam --lr 0.002 --schedule cosine --warmup-steps 5 --decay-steps 40 ";

// (step, loss as written) of each step line.
std::vector<std::pair<int, std::string>> Losses(const std::string& metrics) {
  std::vector<std::pair<int, std::string>> out;
  std::ifstream in(metrics);
  std::string line;
  static const std::regex re(R"(^\{"step":(\d+),"loss":([^,]+),)");
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) out.emplace_back(std::stoi(m[1]), m[2]);
  return out;
}

void CheckResumeIsBitwise(const std::string& tag, const std::string& replicas, int stop_at) {
  TempDir d(tag);
  auto r = Run(kRun + replicas + " --steps 40 --metrics-out " + (d / "ref.jsonl") + " --save " + (d / "ref.safetensors"));
  INFO(r.output);
  REQUIRE(r.status == 0);

  r = Run(kRun + replicas + " --steps " + std::to_string(stop_at) + " --save-every 5 --keep 2 --checkpoint-dir " +
          (d / "ck") + " --metrics-out " + (d / "m.jsonl"));
  REQUIRE(r.status == 0);
  r = Run(kRun + replicas + " --steps 40 --resume " + (d / "ck") + " --save-every 5 --keep 2 --metrics-out " +
          (d / "m.jsonl") + " --save " + (d / "resumed.safetensors"));
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("resuming from " + (d / "ck/step-0000000") + std::to_string(stop_at)));

  const auto ref = Losses(d / "ref.jsonl"), resumed = Losses(d / "m.jsonl");
  REQUIRE(ref.size() == 40);
  REQUIRE(resumed == ref);  // every step once, each loss bitwise
  const std::string a = ReadText(d / "ref.safetensors"), b = ReadText(d / "resumed.safetensors");
  REQUIRE(!a.empty());
  REQUIRE(a == b);
  // The evaluations continue too: one line per --eval-every step.
  const std::string m = ReadText(d / "m.jsonl");
  for (int s : {10, 20, 30, 40}) CHECK_THAT(m, Contains("{\"split\":\"test\",\"step\":" + std::to_string(s) + ","));
}

}  // namespace

TEST_CASE("A resumed run is bitwise the uninterrupted run, one replica") {
  CheckResumeIsBitwise("resume1", "--replicas 1", 20);
}

TEST_CASE("A resumed run is bitwise the uninterrupted run, two replicas with the weight update sharded") {
  CheckResumeIsBitwise("resume2", "--replicas 2 --shard-weight-update on", 35);
}

TEST_CASE("A resume with other options, or a misuse of the flags, is refused clearly") {
  TempDir d("resume_refused");
  const std::string ck = d / "ck";
  auto r = Run(kRun + "--steps 10 --save-every 5 --checkpoint-dir " + ck);
  REQUIRE(r.status == 0);

  r = Run(std::regex_replace(kRun, std::regex("--lr 0.002"), "--lr 0.01") + "--steps 20 --resume " + ck);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("step-000000010.safetensors was written by a run with other options: --lr 0.002"));
  CHECK_THAT(r.output, Contains("--load"));

  // Without --decay-steps the cosine horizon is --steps: the message says how to keep the schedule.
  const std::string no_horizon = std::regex_replace(kRun, std::regex("--decay-steps 40 "), "");
  r = Run(no_horizon + "--steps 20 --resume " + ck);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("--decay-steps 40 (this run: 20)") && Contains("pass the original horizon as --decay-steps"));

  r = Run(kRun + "--steps 20 --resume " + ck + " --load " + (ck + "/step-000000010.safetensors"));
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("--resume and --load exclude each other"));

  r = Run(kRun + "--steps 20 --save-every 5");
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("--save-every needs --checkpoint-dir"));

  r = Run(kRun + "--steps 20 --save-every 5 --checkpoint-dir " + ck);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("already holds checkpoints") && Contains("--resume " + ck));

  r = Run(kRun + "--steps 5 --resume " + ck);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("is at step 10, past --steps 5"));

  r = Run(kRun + "--steps 20 --resume " + (d / "nothing"));
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("not a directory"));

  // Another replica count resumes (the checkpoint is logical) and says it is not the bitwise case.
  r = Run(kRun + "--steps 15 --replicas 2 --resume " + ck + " --save-every 5");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Contains("written with 1 replica(s), this run has 2"));
  CHECK_THAT(r.output, Contains("checkpoint " + ck + "/step-000000015.safetensors"));
}
