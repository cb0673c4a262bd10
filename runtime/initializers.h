// Variable initializers: the initial value of every variable from its "init" attributes, identical on
// every machine.
#pragma once

#include <cstdint>

#include "ir/module.h"
#include "runtime/interpreter.h"

namespace shardstep::runtime {

// Attributes of a variable (all optional; "init" defaults to "zeros", "seed" to 0):
//   init = "zeros" | "ones" | "constant" (value) | "uniform" (limit: U(-limit, limit))
//        | "normal" (stddev: N(0, stddev^2)) | "glorot_uniform" (fan_in, fan_out: U(-a, a),
//          a = sqrt(6 / (fan_in + fan_out))) | "he_normal" (fan_in: N(0, 2 / fan_in))
//        | "he_uniform" (fan_in: U(-a, a), a = sqrt(6 / fan_in))
// Random values come from xoshiro256** seeded by splitmix64 from (seed, variable name), with
// Box-Muller normals, so they depend only on the variable itself, not on the order of variables or
// the platform. Random inits need an f32 variable. Bad attributes throw shardstep::Error naming the
// variable.
Tensor InitVariable(const ir::Instr& variable);

// Every variable of `m`, by name.
TensorMap InitVariables(const ir::Module& m);

// The generator behind the random inits (exposed for tests and data synthesis).
class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed);  // the state is four splitmix64 outputs of `seed`
  uint64_t Next();
  double Uniform();  // [0, 1), 53 random bits
  double Normal();   // N(0, 1), Box-Muller (both values of each pair are used)

 private:
  uint64_t s_[4];
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace shardstep::runtime
