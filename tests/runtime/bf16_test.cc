// bf16 storage (issue 10): the f32 <-> bf16 conversions against a plain reference (round to nearest,
// ties to even, computed from the two neighbouring bf16 values in double), tensors, the text form of
// the type, and bf16 safetensors checkpoints (bitwise round trip; the file opens in PyTorch: see
// tests/parity/bf16_safetensors_torch.py, which runs the hidden "[.torch_export]" case below).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

#include "ir/error.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "runtime/checkpoint.h"
#include "runtime/tensor.h"
#include "tests/test_util.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The reference: the bf16 values just below and above |f| in magnitude (truncation and the next
// one), the nearer wins, a tie goes to the even mantissa; past the largest finite bf16 (by half an
// ulp or more) it is inf. NaN is any NaN. Arithmetic in double (exact for these values).
uint16_t ReferenceBf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t u = BitsOf(f);
  const uint16_t down = static_cast<uint16_t>(u >> 16);  // towards zero
  if ((u & 0xffff) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);    // away from zero (0x7f7f + 1 = inf)
  const double x = std::fabs(static_cast<double>(f));
  const double lo = std::fabs(static_cast<double>(Bf16ToF32(down)));
  const double hi = (up & 0x7fff) == 0x7f80 ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(Bf16ToF32(up)));
  if (x - lo < hi - x) return down;
  if (x - lo > hi - x) return up;
  return (down & 1) ? up : down;
}

}  // namespace

TEST_CASE("F32ToBf16 rounds to nearest even: ties, overflow to inf, NaN, subnormals, signed zeros", "[bf16]") {
  struct Case {
    uint32_t f;
    uint16_t want;
    const char* what;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80, "1 exact"},
      {0x3f808000u, 0x3f80, "tie below an even mantissa stays"},
      {0x3f818000u, 0x3f82, "tie above an odd mantissa goes up"},
      {0x3f807fffu, 0x3f80, "just below the tie: down"},
      {0x3f808001u, 0x3f81, "just above the tie: up"},
      {0xbf808001u, 0xbf81, "negative: away from zero as for positive"},
      {0x3fffffffu, 0x4000, "carry into the exponent"},
      {0x7f7f7fffu, 0x7f7f, "largest bf16 plus less than half an ulp: finite"},
      {0x7f7f8000u, 0x7f80, "largest bf16 plus half an ulp (a tie, odd): +inf"},
      {0x7f7fffffu, 0x7f80, "FLT_MAX: +inf"},
      {0xff7fffffu, 0xff80, "-FLT_MAX: -inf"},
      {0x7f800000u, 0x7f80, "+inf"},
      {0xff800000u, 0xff80, "-inf"},
      {0x7fc00000u, 0x7fc0, "quiet NaN"},
      {0x7f800001u, 0x7fc0, "signalling NaN with a low payload: quiet NaN, not inf"},
      {0xffffffffu, 0xffff, "negative NaN keeps sign and payload"},
      {0x00000001u, 0x0000, "smallest subnormal: +0"},
      {0x00008000u, 0x0000, "subnormal tie below even: +0"},
      {0x00018000u, 0x0002, "subnormal tie above odd: up"},
      {0x007fffffu, 0x0080, "largest subnormal: the smallest normal"},
      {0x80000000u, 0x8000, "-0"},
  };
  for (const Case& c : cases) {
    INFO(c.what << " (0x" << std::hex << c.f << ")");
    CHECK(F32ToBf16(FromBits(c.f)) == c.want);
    const uint16_t ref = ReferenceBf16(FromBits(c.f));
    if (!std::isnan(FromBits(c.f))) CHECK(ref == c.want);  // the reference agrees with the hand-written table
  }
  // NaN never becomes inf or a number, whatever the payload.
  for (uint32_t payload = 1; payload < (1u << 23); payload = payload * 3 + 1) {
    INFO("payload 0x" << std::hex << payload);
    CHECK(std::isnan(RoundToBf16(FromBits(0x7f800000u | payload))));
    CHECK(std::isnan(RoundToBf16(FromBits(0xff800000u | payload))));
  }
}

TEST_CASE("F32ToBf16 equals the reference on random and boundary bit patterns; widening is exact", "[bf16]") {
  std::mt19937 rng(10);
  int64_t checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    if (i % 4 == 1) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    if (i % 4 == 2) u = (u & 0xffff0000u) | (rng() & 1 ? 0x7fffu : 0x8001u);  // either side of a tie
    const float f = FromBits(u);
    if (std::isnan(f)) {
      CHECK(std::isnan(Bf16ToF32(F32ToBf16(f))));
      continue;
    }
    const uint16_t got = F32ToBf16(f), want = ReferenceBf16(f);
    if (got != want) {
      INFO("0x" << std::hex << u << ": got 0x" << got << ", want 0x" << want);
      CHECK(got == want);
    }
    ++checked;
  }
  CHECK(checked > 1900000);
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every bf16 widens exactly and narrows back to itself
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    CHECK(BitsOf(f) == h << 16);
    if (!std::isnan(f)) CHECK(F32ToBf16(f) == h);
  }
}

TEST_CASE("bf16 tensors: storage, conversion, equality and the text form of the type", "[bf16]") {
  const Tensor t = Tensor::BF16({2, 2}, {1.0f, 1.00390625f, -3.14159f, 65536.5f});
  CHECK(t.type.ToString() == "bf16[2,2]");
  CHECK(t.bytes() == 8);
  CHECK(t.held() == 4);
  CHECK(t.bf16 == std::vector<uint16_t>{0x3f80, 0x3f80, 0xc049, 0x4780});
  CHECK(t.at(2) == -3.140625);
  const Tensor wide = t.AsFloat(ir::DType::kF32);
  CHECK(wide.f32 == std::vector<float>{1.0f, 1.0f, -3.140625f, 65536.0f});
  CHECK(wide.AsFloat(ir::DType::kBF16) == t);
  CHECK(Tensor(ir::TensorType{ir::DType::kBF16, {3}}).bf16 == std::vector<uint16_t>(3, 0));
  CHECK_THROWS_AS(Tensor::S32({1}, {1}).AsFloat(ir::DType::kBF16), shardstep::Error);
  CHECK_THROWS_AS(Tensor::BF16({3}, {1.0f}), shardstep::Error);

  // Text form: bf16 leaves, a convert in and out, and a bf16 matmul round-trip through the printer.
  const std::string text = R"(module @m {
  %0 = input @x : bf16[2,3]
  %1 = variable @w {role="weight"} : f32[3,4]
  %2 = convert(%1) {dtype="bf16"} : bf16[3,4]
  %3 = matmul(%0, %2) : bf16[2,4]
  %4 = convert(%3) {dtype="f32"} : f32[2,4]
  %5 = constant {value=0.5} : bf16[]
  output @y = %4
}
)";
  const ir::Module m = ir::Parse(text);
  CHECK(m.type(0).dtype == ir::DType::kBF16);
  CHECK(m.type(3) == ir::TensorType{ir::DType::kBF16, {2, 4}});
  CHECK(ir::Parse(ir::Print(m)) == m);
  CHECK_THROWS_WITH(ir::Parse("module @m {\n  %0 = input @x : bf17[2]\n}\n"), Catch::Contains("unknown dtype 'bf17'"));
  // exp of s32 is refused with the float dtypes named.
  CHECK_THROWS_WITH(ir::Parse("module @m {\n  %0 = input @x : s32[2]\n  %1 = exp(%0) : s32[2]\n}\n"),
                    Catch::Contains("must be f32 or bf16"));
}

TEST_CASE("bf16 safetensors checkpoints round-trip bitwise next to f32 and s32 tensors", "[bf16][checkpoint]") {
  shardstep::testing::TempDir dir;
  const std::string path = dir.path + "/bf16.safetensors";
  std::map<std::string, Tensor> tensors;
  tensors["a"] = Tensor::BF16({2, 3}, {1.5f, -0.0f, std::numeric_limits<float>::infinity(), 3.4e38f, 1e-40f,
                                       std::numeric_limits<float>::quiet_NaN()});
  tensors["b"] = Tensor::F32({3}, {1, 2, 3});
  tensors["c"] = Tensor::S32({1}, {7});
  tensors["d"] = Tensor::BF16({0}, {});
  SaveCheckpoint(path, tensors, {{"note", "bf16"}});
  std::map<std::string, std::string> meta;
  bool checksummed = false;
  const auto back = LoadCheckpoint(path, &meta, &checksummed);
  CHECK(checksummed);
  REQUIRE(back.size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    CHECK(back.at(name) == t);  // type and bits
  }
  CHECK(back.at("a").bf16[3] == 0x7f80);  // 3.4e38 rounded to +inf on the way in, kept
  // The header names the dtype as safetensors does, and the data are 2 bytes per element.
  const std::string bytes = [&] {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    std::string s(1 << 12, '\0');
    s.resize(std::fread(s.data(), 1, s.size(), f));
    std::fclose(f);
    return s;
  }();
  CHECK(bytes.find("\"a\":{\"data_offsets\":[0,12],\"dtype\":\"BF16\",\"shape\":[2,3]}") != std::string::npos);
  // A model expecting f32 is told the file holds bf16.
  CHECK_THROWS_WITH(CheckCheckpointMatches(back, {{"a", {ir::DType::kF32, {2, 3}}}, {"b", tensors["b"].type},
                                                  {"c", tensors["c"].type}, {"d", tensors["d"].type}}, path),
                    Catch::Contains("tensor 'a' has dtype bf16 in the file but the model expects f32"));
}

// Run by tests/parity/bf16_safetensors_torch.py (hidden otherwise): writes $SS_BF16_EXPORT, a bf16
// tensor "x" of the values v_i = (i - 500) * 0.0123 + (i % 7) * 1e-3 for i < 1000, then four
// specials (+inf, -inf, NaN, 3.4e38: past the largest bf16, 3.3895e38, by more than half an ulp, so +inf),
// and "y" = the same values as f32.
TEST_CASE("export a bf16 safetensors file for PyTorch", "[.torch_export]") {
  const char* path = std::getenv("SS_BF16_EXPORT");
  REQUIRE(path != nullptr);
  std::vector<float> v;
  for (int i = 0; i < 1000; ++i) v.push_back(static_cast<float>((i - 500) * 0.0123 + (i % 7) * 1e-3));
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-std::numeric_limits<float>::infinity());
  v.push_back(std::numeric_limits<float>::quiet_NaN());
  v.push_back(3.4e38f);
  const int64_t n = static_cast<int64_t>(v.size());
  SaveCheckpoint(path, {{"x", Tensor::BF16({4, n / 4}, v)}, {"y", Tensor::F32({4, n / 4}, v)}});
}
