// `shardstep train` on a text model (transformer_lm on a small --data-file): evaluation reports bits per
// character in the progress and the metrics, --save-batches holds every step's tokens and targets, a
// resumed run continues the text data order bitwise, and --load of a checkpoint trained on text with
// another alphabet (or at a longer --context) is an error naming the vocabulary (the context), not a shape crash;
// bert trains on sentence pairs and reports its next-sentence accuracy.
#include <catch2/catch.hpp>

#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "runtime/checkpoint.h"
#include "tests/cli/cli_util.h"

using namespace cli_test;
using Catch::Contains;

namespace {

std::string Corpus(const TempDir& d, const std::string& name, const std::string& alphabet) {
  std::string text;
  for (int i = 0; i < 300; ++i) {
    for (int k = 0; k < 30; ++k) text += alphabet[(i * 7 + k * k) % alphabet.size()];
    text += "\n";
  }
  return d.Write(name, text);
}

std::vector<std::string> StepLines(const std::string& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  std::string line;
  static const std::regex re(R"(^\{"step":(\d+),"loss":([^,]+),)");
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) out.push_back(m[1].str() + " " + m[2].str());
  return out;
}

const std::string kRun =
    "train --model transformer_lm --context 16 --layers 1 --width 16 --heads 2 --batch 8 --eval-batch 4 "
    "--eval-batches 2 --log-every 5 --eval-every 10 --lr 0.01 --backend interp ";

}  // namespace

TEST_CASE("a character LM trains from --data-file, resumes bitwise and saves its batches") {
  TempDir d("text_train");
  const std::string corpus = Corpus(d, "a.txt", "abcdefgh ");
  auto r = Run(kRun + "--data-file " + corpus + " --steps 20 --metrics-out " + (d / "ref.jsonl") + " --save " +
               (d / "ref.safetensors") + " --save-batches " + (d / "batches.safetensors"));
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("eval  step 10  test bits_per_char"));
  CHECK_THAT(r.output, Contains("final: loss"));
  const std::string metrics = ReadText(d / "ref.jsonl");
  CHECK_THAT(metrics, Contains("{\"split\":\"test\",\"step\":20,\"bits_per_char\":"));
  auto batches = shardstep::runtime::LoadCheckpoint(d / "batches.safetensors");
  CHECK(batches.size() == 40);  // tokens and targets of 20 steps
  REQUIRE(batches.count("step19/targets"));
  CHECK(batches.at("step0/tokens").shape() == shardstep::ir::Shape{8, 16});
  // targets are the tokens shifted by one position
  CHECK(std::equal(batches.at("step3/tokens").s32.begin() + 1, batches.at("step3/tokens").s32.begin() + 16,
                   batches.at("step3/targets").s32.begin()));

  // Stop at 12, resume to 20: the same losses, bitwise.
  r = Run(kRun + "--data-file " + corpus + " --steps 12 --save-every 6 --checkpoint-dir " + (d / "ck") +
          " --metrics-out " + (d / "resumed.jsonl"));
  REQUIRE(r.status == 0);
  r = Run(kRun + "--data-file " + corpus + " --steps 20 --resume " + (d / "ck") + " --metrics-out " + (d / "resumed.jsonl"));
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("resuming from"));
  const std::vector<std::string> ref = StepLines(d / "ref.jsonl"), resumed = StepLines(d / "resumed.jsonl");
  CHECK(ref.size() == 20);
  CHECK(ref == resumed);

  // A checkpoint of a model trained on another alphabet: named as a vocabulary problem.
  const std::string other = Corpus(d, "b.txt", "xyz ");
  r = Run(kRun + "--data-file " + other + " --steps 1 --load " + (d / "ref.safetensors"));
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("tok_emb.w is [10,16], a vocabulary of 10"));
  CHECK_THAT(r.output, Contains("gives a vocabulary of 5"));  // x, y, z, space, newline
  CHECK_THAT(r.output, Contains("--data-file"));

  // The same data at a longer --context than the checkpoint's position table: named as the option.
  r = Run("train --model transformer_lm --context 32 --layers 1 --width 16 --heads 2 --batch 8 --eval-batch 4 "
          "--eval-batches 2 --backend interp --data-file " + corpus + " --steps 1 --load " + (d / "ref.safetensors"));
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Contains("--context 32 is longer than the position table of"));
  CHECK_THAT(r.output, Contains("use --context 16"));
}

TEST_CASE("bert trains on sentence pairs from --data-file and reports next-sentence accuracy") {
  TempDir d("bert_train");
  const std::string corpus = Corpus(d, "a.txt", "abcdefgh ");
  auto r = Run("train --model bert --context 16 --layers 1 --width 16 --heads 2 --vocab 64 --batch 8 --eval-batch 4 "
               "--eval-batches 2 --log-every 2 --steps 4 --lr 0.01 --backend interp --data-file " + corpus +
               " --metrics-out " + (d / "m.jsonl") + " --save-batches " + (d / "batches.safetensors"));
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("eval  step 4  test masked_accuracy"));
  CHECK_THAT(r.output, Contains("nsp accuracy"));
  CHECK_THAT(ReadText(d / "m.jsonl"), Contains(",\"nsp_accuracy\":"));
  auto batches = shardstep::runtime::LoadCheckpoint(d / "batches.safetensors");
  CHECK(batches.size() == 4 * 5);  // tokens, segments, targets, mask_weights, next_sentence
  REQUIRE(batches.count("step0/next_sentence"));
  CHECK(batches.at("step0/next_sentence").shape() == shardstep::ir::Shape{8});
  CHECK(batches.at("step0/segments").shape() == shardstep::ir::Shape{8, 16});
}

TEST_CASE("compile --report gives bert large the parameters of the BERT pre-training checkpoints") {
  auto r = Run("compile --model bert --size large --batch 1 --report");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("parameters: 336226108\n"));  // BertForPreTraining: 1.11% under the rounded "340M"
  r = Run("compile --model bert --size base --batch 1 --report");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Contains("parameters: 110106428\n"));
}
