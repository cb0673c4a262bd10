// Variable initializers: explicit PRNG (splitmix64 -> xoshiro256**, Box-Muller), no std:: distributions,
// so values are bit-identical across standard libraries and machines.
#include "runtime/initializers.h"

#include <cmath>
#include <numbers>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Typed attribute access that reports a user error (naming the variable) instead of aborting.
struct VarAttrs {
  const ir::Instr& v;

  [[noreturn]] void Fail(const std::string& why) const { throw Error(Str("variable @", v.name, ": ", why)); }
  double Number(const std::string& key) const {
    auto it = v.attrs.find(key);
    if (it == v.attrs.end()) Fail(Str("init '", Init(), "' needs attribute '", key, "'"));
    if (auto* d = std::get_if<double>(&it->second)) return *d;
    if (auto* i = std::get_if<int64_t>(&it->second)) return static_cast<double>(*i);
    Fail(Str("attribute '", key, "' must be a number"));
  }
  double Positive(const std::string& key) const {
    const double x = Number(key);
    if (!(x > 0)) Fail(Str("attribute '", key, "' must be positive, got ", x));
    return x;
  }
  std::string Init() const {
    auto it = v.attrs.find("init");
    if (it == v.attrs.end()) return "zeros";
    if (auto* s = std::get_if<std::string>(&it->second)) return *s;
    Fail("attribute 'init' must be a string");
  }
  uint64_t Seed() const {
    auto it = v.attrs.find("seed");
    if (it == v.attrs.end()) return 0;
    if (auto* i = std::get_if<int64_t>(&it->second)) return static_cast<uint64_t>(*i);
    Fail("attribute 'seed' must be an integer");
  }
};

}  // namespace

Xoshiro256::Xoshiro256(uint64_t seed) {
  for (uint64_t& s : s_) s = SplitMix64(seed);
}

uint64_t Xoshiro256::Next() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

double Xoshiro256::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

double Xoshiro256::Normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  const double u1 = 1.0 - Uniform();  // (0, 1]: log is finite
  const double u2 = Uniform();
  const double r = std::sqrt(-2.0 * std::log(u1)), theta = 2.0 * std::numbers::pi * u2;
  spare_ = r * std::sin(theta);
  has_spare_ = true;
  return r * std::cos(theta);
}

Tensor InitVariable(const ir::Instr& v) {
  SS_CHECK(v.op == ir::OpCode::kVariable, "InitVariable on a ", ir::OpName(v.op));
  const VarAttrs a{v};
  const std::string init = a.Init();
  Tensor t(v.type);

  auto fill = [&](double value) {
    if (t.dtype() == ir::DType::kF32) std::fill(t.f32.begin(), t.f32.end(), static_cast<float>(value));
    else std::fill(t.s32.begin(), t.s32.end(), static_cast<int32_t>(std::trunc(value)));
  };
  if (init == "zeros") return t;
  if (init == "ones" || init == "constant") {
    fill(init == "ones" ? 1.0 : a.Number("value"));
    return t;
  }

  // Random inits: each variable has its own stream, keyed by its seed and its name.
  enum { kUniform, kNormal } dist;
  double scale;  // limit of U(-scale, scale), or stddev of N(0, scale^2)
  if (init == "uniform") dist = kUniform, scale = a.Number("limit");
  else if (init == "normal") dist = kNormal, scale = a.Number("stddev");
  else if (init == "glorot_uniform") dist = kUniform, scale = std::sqrt(6.0 / (a.Positive("fan_in") + a.Positive("fan_out")));
  else if (init == "he_normal") dist = kNormal, scale = std::sqrt(2.0 / a.Positive("fan_in"));
  else if (init == "he_uniform") dist = kUniform, scale = std::sqrt(6.0 / a.Positive("fan_in"));
  else a.Fail(Str("unknown init '", init, "' (expected zeros, ones, constant, uniform, normal, glorot_uniform, ",
                  "he_normal or he_uniform)"));
  if (t.dtype() != ir::DType::kF32) a.Fail(Str("init '", init, "' needs an f32 variable, got ", v.type.ToString()));
  if (!(scale >= 0) || std::isinf(scale)) a.Fail(Str("init '", init, "' has a bad scale ", scale));

  Xoshiro256 rng(a.Seed() ^ Fnv1a(v.name));
  for (float& x : t.f32)
    x = static_cast<float>(dist == kUniform ? scale * (2.0 * rng.Uniform() - 1.0) : scale * rng.Normal());
  return t;
}

TensorMap InitVariables(const ir::Module& m) {
  TensorMap out;
  for (ir::ValueId v : m.Variables()) out[m.at(v).name] = InitVariable(m.at(v));
  return out;
}

}  // namespace shardstep::runtime
