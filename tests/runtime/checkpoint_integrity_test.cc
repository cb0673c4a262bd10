// Checkpoint integrity and the directory of periodic checkpoints: every truncation and every single
// bit flip of a checkpoint is rejected with a message naming the file; files without a checksum (older
// shardstep, other tools) still load; the newest complete checkpoint of a directory is found past
// damaged and temporary files; pruning keeps the newest M; the metrics file of a resumed run is
// trimmed; the batch iterator continues exactly from a saved (epoch, position).
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ir/error.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_dir.h"
#include "runtime/dataset.h"
#include "runtime/metrics_file.h"
#include "tests/test_util.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Contains;
using shardstep::testing::TempDir;

namespace {

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::map<std::string, Tensor> Small() {
  return {{"w", Tensor::F32({2, 3}, {1.5f, -2.0f, 0.25f, 3.0f, -0.5f, 7.0f})},
          {"b", Tensor::F32({3}, {0.1f, 0.2f, 0.3f})},
          {"step", Tensor::S32({}, {42})},
          {"empty", Tensor::F32({0, 2}, {})}};
}

// The message of the error `f` throws ("" when it throws none).
template <typename F>
std::string ErrorOf(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("Every truncation of a checkpoint is rejected, naming the file") {
  TempDir dir;
  const std::string good = dir / "good.safetensors", cut = dir / "cut.safetensors";
  SaveCheckpoint(good, Small(), {{"note", "x"}});
  const std::string bytes = ReadBytes(good);
  REQUIRE(LoadCheckpoint(good).size() == 4);
  for (size_t n = 0; n < bytes.size(); ++n) {
    WriteBytes(cut, bytes.substr(0, n));
    const std::string msg = ErrorOf([&] { LoadCheckpoint(cut); });
    INFO("truncated to " << n << " of " << bytes.size() << " bytes");
    REQUIRE_THAT(msg, Catch::StartsWith(cut + ": "));
  }
  // The data part cut off: the message says so.
  WriteBytes(cut, bytes.substr(0, bytes.size() - 4));
  REQUIRE_THAT(ErrorOf([&] { LoadCheckpoint(cut); }), Contains("truncated"));
}

TEST_CASE("Every single bit flip of a checkpoint is rejected, naming the file") {
  TempDir dir;
  const std::string good = dir / "good.safetensors";
  SaveCheckpoint(good, Small(), {{"shardstep.train_step", "20"}});
  const std::string bytes = ReadBytes(good);
  int mismatch = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = bytes;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      const std::string msg = ErrorOf([&] { LoadCheckpointFromBytes(flipped, good); });
      INFO("byte " << i << " bit " << bit);
      REQUIRE_THAT(msg, Catch::StartsWith(good + ": "));
      mismatch += msg.find("checksum mismatch") != std::string::npos;
    }
  }
  // Flips in the data and in metadata values can only be caught by the checksum.
  REQUIRE(mismatch > 8 * 60);
  // Through the file as well, with the message the user sees.
  std::string flipped = bytes;
  flipped[bytes.size() - 1] ^= 0x10;
  WriteBytes(dir / "bad.safetensors", flipped);
  REQUIRE_THAT(ErrorOf([&] { LoadCheckpoint(dir / "bad.safetensors"); }),
               Contains(dir / "bad.safetensors: checksum mismatch: the file is corrupt"));
}

TEST_CASE("A checkpoint without a checksum (older shardstep, other writers) still loads") {
  TempDir dir;
  const std::string path = dir / "old.safetensors";
  // The layout SaveCheckpoint wrote before checksums: no "__metadata__".
  const std::string header = R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  const float v = 2.5f;
  file += header + std::string(reinterpret_cast<const char*>(&v), 4);
  WriteBytes(path, file);
  bool checksummed = true;
  std::map<std::string, std::string> meta;
  auto t = LoadCheckpoint(path, &meta, &checksummed);
  CHECK_FALSE(checksummed);
  CHECK(t.at("b").f32 == std::vector<float>{2.5f});
  CHECK(meta.empty());

  SaveCheckpoint(path, t);
  LoadCheckpoint(path, &meta, &checksummed);
  CHECK(checksummed);
  CHECK(meta.empty());  // the checksum entry is not handed out as metadata
}

TEST_CASE("Periodic checkpoints: names, pruning, and the newest complete one") {
  TempDir dir;
  const std::string d = dir / "ck";
  CHECK(PeriodicCheckpointName(1200) == "step-000001200.safetensors");
  CHECK(PeriodicCheckpointName(12345678901) == "step-12345678901.safetensors");
  std::ostringstream log;
  PrepareCheckpointDirectory(d, std::nullopt, log);
  auto meta = [](int64_t step) {
    return std::map<std::string, std::string>{{kMetaTrainStep, std::to_string(step)},
                                              {kMetaDataEpoch, "0"},
                                              {kMetaDataPosition, std::to_string(step * 64)},
                                              {kMetaRunOptions, "{}"}};
  };
  std::vector<std::string> removed;
  for (int64_t s : {5, 10, 15, 20}) SavePeriodicCheckpoint(d, s, Small(), meta(s), 2, &removed);
  CHECK(removed == std::vector<std::string>{d + "/step-000000005.safetensors", d + "/step-000000010.safetensors"});
  auto files = ListPeriodicCheckpoints(d);
  REQUIRE(files.size() == 2);
  CHECK(files[0].step == 15);
  CHECK(files[1].step == 20);

  // A new run refuses a directory that holds checkpoints.
  REQUIRE_THAT(ErrorOf([&] { PrepareCheckpointDirectory(d, std::nullopt, log); }),
               Contains("already holds checkpoints") && Contains("--resume " + d));

  // Damage the newest, add a newer partial file and a leftover temporary: the resume point is step 15.
  std::string newest = ReadBytes(d + "/step-000000020.safetensors");
  newest[newest.size() - 3] ^= 1;
  WriteBytes(d + "/step-000000020.safetensors", newest);
  WriteBytes(d + "/step-000000025.safetensors", newest.substr(0, 100));
  WriteBytes(d + "/step-000000030.safetensors.tmp.999999999", "partial");
  ResumePoint rp = FindResumePoint(d);
  CHECK(rp.path == d + "/step-000000015.safetensors");
  CHECK(rp.step == 15);
  CHECK(rp.data_position == 15 * 64);
  CHECK(rp.checksummed);
  CHECK(rp.tensors.at("step").s32 == std::vector<int32_t>{42});
  REQUIRE(rp.skipped.size() == 2);
  CHECK_THAT(rp.skipped[0], Contains("step-000000025.safetensors: "));
  CHECK_THAT(rp.skipped[1], Contains("step-000000020.safetensors: checksum mismatch"));
  CHECK(rp.temporaries == std::vector<std::string>{d + "/step-000000030.safetensors.tmp.999999999"});

  // Resuming into the same directory moves the damaged files aside and removes the dead temporary.
  PrepareCheckpointDirectory(d, rp.step, log);
  files = ListPeriodicCheckpoints(d);
  REQUIRE(files.size() == 1);
  CHECK(files[0].step == 15);
  CHECK(std::filesystem::exists(d + "/step-000000020.safetensors.corrupt"));
  CHECK(ListTemporaryFiles(d).empty());

  // A file that is complete but not a periodic checkpoint is skipped, saying why.
  SaveCheckpoint(d + "/step-000000016.safetensors", Small());
  rp = FindResumePoint(d);
  CHECK(rp.step == 15);
  REQUIRE(rp.skipped.size() == 1);
  CHECK_THAT(rp.skipped[0], Contains("not a periodic checkpoint"));

  // Nothing complete: the error lists what was skipped.
  const std::string e = dir / "empty";
  std::filesystem::create_directories(e);
  WriteBytes(e + "/step-000000005.safetensors", "junk");
  REQUIRE_THAT(ErrorOf([&] { FindResumePoint(e); }),
               Contains("no complete checkpoint") && Contains("step-000000005.safetensors: truncated"));
  REQUIRE_THAT(ErrorOf([&] { FindResumePoint(dir / "missing"); }), Contains("not a directory"));
}

TEST_CASE("The metrics file of a resumed run keeps the lines up to the checkpoint's step") {
  TempDir dir;
  const std::string m = dir / "m.jsonl";
  CHECK_FALSE(KeepMetricsUpTo(m, 3));
  WriteBytes(m,
             "{\"memory\":{\"w\":1}}\n{\"step\":1,\"loss\":2}\n{\"step\":2,\"loss\":1}\n"
             "{\"split\":\"test\",\"step\":2,\"accuracy\":0.5}\n{\"step\":3,\"loss\":0.5}\n{\"step\":4,\"lo");
  TrainingCurves curves;
  CHECK(KeepMetricsUpTo(m, 3, &curves));  // the torn line of step 4 goes
  CHECK(curves.loss == std::vector<double>{2, 1, 0.5});
  REQUIRE(curves.evals.size() == 1);
  CHECK(curves.evals[0].step == 2);
  CHECK(curves.evals[0].accuracy == 0.5);
  CHECK(KeepMetricsUpTo(m, 2));
  CHECK(ReadBytes(m) ==
        "{\"memory\":{\"w\":1}}\n{\"step\":1,\"loss\":2}\n{\"step\":2,\"loss\":1}\n"
        "{\"split\":\"test\",\"step\":2,\"accuracy\":0.5}\n");
}

TEST_CASE("The batch iterator continues exactly from a saved epoch and position") {
  Dataset d = SyntheticClassification(100, 1, 2, 2, 3, 7);
  BatchIterator a(d, 32, true, 5);  // 3 batches per epoch, 4 examples dropped
  Tensor ia, la, ib, lb;
  for (int k = 0; k < 7; ++k) {
    BatchIterator b(d, 32, true, 5);
    b.Seek(a.epoch(), a.position());
    BatchIterator a2 = a;  // a copy continues as a does
    for (int j = 0; j < 5; ++j) {
      a2.Next(&ia, &la);
      b.Next(&ib, &lb);
      REQUIRE(ia.f32 == ib.f32);
      REQUIRE(la.s32 == lb.s32);
      REQUIRE(a2.epoch() == b.epoch());
    }
    a.Next(&ia, &la);
  }
  BatchIterator c(d, 32, true, 5);
  REQUIRE_THROWS_WITH(c.Seek(0, 101), Contains("cannot seek"));
}
