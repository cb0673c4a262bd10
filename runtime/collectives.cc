// Collectives: parsing of reduction names shared by every backend.
#include "runtime/collectives.h"

#include "ir/error.h"

namespace shardstep::runtime {

Reduction ParseReduction(const std::string& s) {
  if (s == "sum") return Reduction::kSum;
  if (s == "mean") return Reduction::kMean;
  if (s == "max") return Reduction::kMax;
  throw Error(Str("unknown reduction '", s, "' (expected sum, mean or max)"));
}

}  // namespace shardstep::runtime
