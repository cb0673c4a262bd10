// Tests for safetensors checkpoints: bitwise round trips, the on-disk format, atomic replacement and
// clear errors for every kind of damaged file.
#include "runtime/checkpoint.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "ir/error.h"
#include "tests/test_util.h"

using namespace shardstep;
using namespace shardstep::runtime;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

using shardstep::testing::TempDir;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

// A safetensors file from a header text and a data buffer, the way any writer would lay it out.
std::string Safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  return out + header + data;
}

std::map<std::string, Tensor> Sample() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {
      {"fc1.w", Tensor::F32({2, 3}, {1.5f, -0.0f, nan, std::numeric_limits<float>::denorm_min(),
                                     std::numeric_limits<float>::infinity(), 3.14159f})},
      {"fc1.b", Tensor::F32({3}, {0.1f, 0.2f, 0.3f})},
      {"step", Tensor::S32({}, {123456})},
      {"empty", Tensor::F32({0, 4}, {})},
      {"labels", Tensor::S32({4}, {-1, 0, INT32_MAX, INT32_MIN})},
  };
}

void RequireSameBits(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name));
    REQUIRE(b.at(name) == t);  // type and memcmp of the contents (NaN payloads included)
  }
}

}  // namespace

TEST_CASE("Checkpoints round-trip bitwise, with metadata") {
  TempDir dir;
  const std::string path = dir / "model.safetensors";
  std::map<std::string, std::string> meta{{"step", "100"}, {"replicas", "8"}, {"note", "ünïcode \"quoted\""}};
  SaveCheckpoint(path, Sample(), meta);
  std::map<std::string, std::string> meta2;
  RequireSameBits(Sample(), LoadCheckpoint(path, &meta2));
  REQUIRE(meta2 == meta);
  REQUIRE(dir.Files() == std::vector<std::string>{"model.safetensors"});

  SaveCheckpoint(path, {});
  REQUIRE(LoadCheckpoint(path, &meta2).empty());
  REQUIRE(meta2.empty());
}

TEST_CASE("The file follows the safetensors layout") {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  SaveCheckpoint(path, {{"b", Tensor::F32({2}, {1.0f, 2.0f})}, {"a", Tensor::S32({1, 1}, {7})}}, {{"k", "v"}});
  const std::string bytes = ReadBytes(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  REQUIRE((8 + n) % 8 == 0);
  REQUIRE(bytes.size() == 8 + n + 12);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  REQUIRE(header["a"] == nlohmann::json::parse(R"({"dtype":"I32","shape":[1,1],"data_offsets":[0,4]})"));
  REQUIRE(header["b"] == nlohmann::json::parse(R"({"dtype":"F32","shape":[2],"data_offsets":[4,12]})"));
  // The metadata given, plus the checksum of the whole file (checkpoint.h).
  REQUIRE(header["__metadata__"].size() == 2);
  REQUIRE(header["__metadata__"]["k"] == "v");
  REQUIRE(header["__metadata__"][kChecksumKey].get<std::string>().size() == 8);
  // Little-endian data: int 7, then float 1.0f = 0x3f800000.
  REQUIRE(bytes.substr(8 + n, 8) == std::string("\x07\0\0\0\0\0\x80\x3f", 8));
}

TEST_CASE("A file written by another safetensors writer loads") {
  TempDir dir;
  const std::string path = dir / "other.safetensors";
  // Key order differs from data order, no padding, no metadata.
  float w[2] = {0.5f, -2.0f};
  int32_t s = 9;
  std::string data(reinterpret_cast<const char*>(w), 8);
  data += std::string(reinterpret_cast<const char*>(&s), 4);
  WriteBytes(path, Safetensors(R"({"z":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("a":{"dtype":"I32","shape":[],"data_offsets":[8,12]}})",
                               data));
  auto t = LoadCheckpoint(path);
  REQUIRE(t.at("z") == Tensor::F32({2}, {0.5f, -2.0f}));
  REQUIRE(t.at("a") == Tensor::S32({}, {9}));
}

TEST_CASE("Saving replaces a file whole and leaves no temporary file") {
  TempDir dir;
  const std::string path = dir / "model.ckpt";
  SaveCheckpoint(path, Sample());
  std::map<std::string, Tensor> small{{"w", Tensor::F32({1}, {42.0f})}};
  SaveCheckpoint(path, small);
  RequireSameBits(small, LoadCheckpoint(path));
  REQUIRE(dir.Files() == std::vector<std::string>{"model.ckpt"});
}

TEST_CASE("A failed save leaves the old checkpoint intact and removes its temporary file") {
  TempDir dir;
  const std::string path = dir / "model.ckpt";
  SaveCheckpoint(path, Sample());
  const std::string before = ReadBytes(path);

  SECTION("write fails midway (file size limit)") {
    // Make write() fail with EFBIG after 64 KiB, as a full disk would fail it.
    struct sigaction ignore {}, old {};
    ignore.sa_handler = SIG_IGN;
    REQUIRE(sigaction(SIGXFSZ, &ignore, &old) == 0);
    rlimit saved{};
    REQUIRE(getrlimit(RLIMIT_FSIZE, &saved) == 0);
    rlimit limited = saved;
    limited.rlim_cur = 64 << 10;
    REQUIRE(setrlimit(RLIMIT_FSIZE, &limited) == 0);
    std::map<std::string, Tensor> big{{"w", Tensor(ir::TensorType{ir::DType::kF32, {1 << 20}})}};
    bool threw = false;
    std::string msg;
    try {
      SaveCheckpoint(path, big);
    } catch (const Error& e) {
      threw = true;
      msg = e.what();
    }
    setrlimit(RLIMIT_FSIZE, &saved);
    sigaction(SIGXFSZ, &old, nullptr);
    REQUIRE(threw);
    REQUIRE_THAT(msg, Contains(path + ": cannot save checkpoint: write: File too large"));
  }
  SECTION("target is a directory, so the rename fails") {
    const std::string dpath = dir / "sub";
    fs::create_directory(dpath);
    fs::create_directory(dpath + "/keep");  // a non-empty directory cannot be replaced
    REQUIRE_THROWS_WITH(SaveCheckpoint(dpath, Sample()), Contains(dpath + ": cannot save checkpoint: rename"));
    REQUIRE(fs::is_directory(dpath + "/keep"));
    fs::remove_all(dpath);
  }
  SECTION("invalid tensor") {
    Tensor bad = Tensor::F32({2}, {1, 2});
    bad.f32.pop_back();
    REQUIRE_THROWS_WITH(SaveCheckpoint(path, {{"bad", bad}}), Contains(path + ": cannot save tensor 'bad'"));
    REQUIRE_THROWS_WITH(SaveCheckpoint(path, {{"__metadata__", Tensor::Scalar(1)}}), Contains("__metadata__"));
  }
  REQUIRE(ReadBytes(path) == before);
  RequireSameBits(Sample(), LoadCheckpoint(path));
  REQUIRE(dir.Files() == std::vector<std::string>{"model.ckpt"});
}

TEST_CASE("Saving into a missing directory names the path") {
  TempDir dir;
  const std::string path = dir / "no/such/dir/model.ckpt";
  REQUIRE_THROWS_WITH(SaveCheckpoint(path, Sample()), Contains(path) && Contains("No such file or directory"));
}

TEST_CASE("Loading a missing file names it") {
  REQUIRE_THROWS_WITH(LoadCheckpoint("/nonexistent/model.ckpt"),
                      Contains("cannot open /nonexistent/model.ckpt: No such file or directory"));
}

TEST_CASE("A checkpoint cut at any point gives an Error naming the path") {
  TempDir dir;
  const std::string good = dir / "good.ckpt", cut = dir / "cut.ckpt";
  SaveCheckpoint(good, Sample(), {{"step", "3"}});
  const std::string bytes = ReadBytes(good);
  for (size_t len = 0; len < bytes.size(); ++len) {
    INFO("cut at " << len << " of " << bytes.size());
    WriteBytes(cut, bytes.substr(0, len));
    REQUIRE_THROWS_WITH(LoadCheckpoint(cut), Contains(cut + ": "));
  }
  // The specific messages at the interesting points.
  uint64_t n = static_cast<uint8_t>(bytes[0]) | static_cast<uint64_t>(static_cast<uint8_t>(bytes[1])) << 8;
  WriteBytes(cut, bytes.substr(0, 5));
  REQUIRE_THROWS_WITH(LoadCheckpoint(cut), Contains(cut + ": truncated: file is 5 bytes"));
  WriteBytes(cut, bytes.substr(0, 8 + n / 2));
  REQUIRE_THROWS_WITH(LoadCheckpoint(cut), Contains(cut + ": header length " + std::to_string(n) + " exceeds"));
  WriteBytes(cut, bytes.substr(0, bytes.size() - 1));
  REQUIRE_THROWS_WITH(LoadCheckpoint(cut), Contains("run past the end of the") && Contains("truncated file?"));
}

TEST_CASE("Corrupt checkpoints give an Error with the path and the problem") {
  TempDir dir;
  const std::string path = dir / "model.ckpt";
  const std::string f8(8, '\0'), f12(12, '\0');

  SECTION("header length flipped to huge") {
    SaveCheckpoint(path, Sample());
    std::string bytes = ReadBytes(path);
    bytes[7] = '\x80';
    WriteBytes(path, bytes);
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": header length 9223372036854") && Contains("exceeds"));
  }
  SECTION("bad JSON") {
    WriteBytes(path, Safetensors(R"({"w": {"dtype": "F32",)", ""));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": bad JSON header: ") && Contains("parse error"));
  }
  SECTION("JSON that is not an object") {
    WriteBytes(path, Safetensors("[1,2]   ", ""));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": JSON header is not an object"));
  }
  SECTION("unknown dtype") {
    WriteBytes(path, Safetensors(R"({"w":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": tensor 'w': unsupported dtype 'F16'"));
  }
  SECTION("shape does not match the byte range") {
    WriteBytes(path, Safetensors(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path),
                        Contains(path + ": tensor 'w': shape [3] of F32 needs 12 bytes but data_offsets [0,8] hold 8"));
  }
  SECTION("negative, fractional or missing fields") {
    WriteBytes(path, Safetensors(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": tensor 'w': bad dimension -2"));
    WriteBytes(path, Safetensors(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains("\"data_offsets\" must be [begin, end]"));
    WriteBytes(path, Safetensors(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains("missing or non-string \"dtype\""));
    WriteBytes(path, Safetensors(R"({"w":[1]})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains("tensor 'w': entry is not a JSON object"));
  }
  SECTION("shape so large its size overflows") {
    WriteBytes(path, Safetensors(
                         R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains("is too large"));
  }
  SECTION("overlapping tensors") {
    WriteBytes(path, Safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                 f12));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": tensors 'a' and 'b' overlap"));
  }
  SECTION("gap between tensors") {
    WriteBytes(path, Safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                 f12));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": gap in the data buffer at bytes [4,8)"));
  }
  SECTION("bytes left over after the tensors") {
    WriteBytes(path, Safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": data buffer is 8 bytes but the tensors cover 4"));
  }
  SECTION("reversed offsets") {
    WriteBytes(path, Safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", f8));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains("data_offsets [8,4] end before they begin"));
  }
  SECTION("metadata that is not strings") {
    WriteBytes(path, Safetensors(R"({"__metadata__":{"step":3}})", ""));
    REQUIRE_THROWS_WITH(LoadCheckpoint(path), Contains(path + ": metadata 'step' is not a string"));
  }
  SECTION("a directory") {
    REQUIRE_THROWS_WITH(LoadCheckpoint(dir.path), Contains("cannot read " + dir.path + ": Is a directory"));
  }
}

TEST_CASE("Flipping any header byte never crashes the loader") {
  TempDir dir;
  const std::string good = dir / "good.ckpt", bad = dir / "bad.ckpt";
  SaveCheckpoint(good, Sample(), {{"step", "3"}});
  const std::string bytes = ReadBytes(good);
  uint64_t n = static_cast<uint8_t>(bytes[0]) | static_cast<uint64_t>(static_cast<uint8_t>(bytes[1])) << 8;
  for (size_t i = 0; i < 8 + n; ++i) {
    for (unsigned char mask : {0x01, 0x20, 0xff}) {
      std::string b = bytes;
      b[i] = static_cast<char>(b[i] ^ mask);
      WriteBytes(bad, b);
      INFO("byte " << i << " ^ " << int(mask));
      try {
        LoadCheckpoint(bad);  // some flips are harmless (e.g. inside padding or a name)
      } catch (const Error& e) {
        REQUIRE_THAT(e.what(), Contains(bad + ": "));
      }
    }
  }
}

TEST_CASE("CheckCheckpointMatches explains every mismatch") {
  const std::map<std::string, Tensor> loaded{{"fc1.w", Tensor(ir::TensorType{ir::DType::kF32, {784, 256}})},
                                             {"fc1.b", Tensor(ir::TensorType{ir::DType::kF32, {256}})},
                                             {"step", Tensor(ir::TensorType{ir::DType::kS32, {}})}};
  std::map<std::string, ir::TensorType> expected{{"fc1.w", {ir::DType::kF32, {784, 256}}},
                                                 {"fc1.b", {ir::DType::kF32, {256}}},
                                                 {"step", {ir::DType::kS32, {}}}};
  REQUIRE_NOTHROW(CheckCheckpointMatches(loaded, expected, "model.ckpt"));

  SECTION("wrong shape") {
    expected["fc1.w"].shape = {784, 512};
    REQUIRE_THROWS_WITH(CheckCheckpointMatches(loaded, expected, "model.ckpt"),
                        "model.ckpt: tensor 'fc1.w' has shape [784,256] in the file but the model expects [784,512]");
  }
  SECTION("wrong dtype") {
    expected["step"].dtype = ir::DType::kF32;
    REQUIRE_THROWS_WITH(CheckCheckpointMatches(loaded, expected, "model.ckpt"),
                        "model.ckpt: tensor 'step' has dtype s32 in the file but the model expects f32");
  }
  SECTION("missing and unexpected, all reported") {
    expected.erase("fc1.b");
    expected["fc2.w"] = {ir::DType::kF32, {256, 10}};
    REQUIRE_THROWS_WITH(CheckCheckpointMatches(loaded, expected, "model.ckpt"),
                        Contains("model.ckpt: ") &&
                            Contains("tensor 'fc2.w' (f32[256,10]) is missing from the file") &&
                            Contains("tensor 'fc1.b' (f32[256]) in the file is not part of the model"));
  }
}
