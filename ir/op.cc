// Static op properties, generated from the op table.
#include "ir/op.h"

#include <unordered_map>

namespace shardstep::ir {
namespace {
struct OpInfo {
  const char* name;
  int arity;
  unsigned props;
};
constexpr OpInfo kOps[] = {
#define OP(name, mnemonic, arity, props) {mnemonic, arity, static_cast<unsigned>(props)},
#include "ir/ops.def"
#undef OP
};
}  // namespace

const char* OpName(OpCode op) { return kOps[static_cast<int>(op)].name; }
int OpArity(OpCode op) { return kOps[static_cast<int>(op)].arity; }
unsigned OpProperties(OpCode op) { return kOps[static_cast<int>(op)].props; }

bool ParseOpCode(const std::string& mnemonic, OpCode* out) {
  static const std::unordered_map<std::string, OpCode> table = [] {
    std::unordered_map<std::string, OpCode> t;
    for (int i = 0; i < kNumOpCodes; ++i) t[kOps[i].name] = static_cast<OpCode>(i);
    return t;
  }();
  auto it = table.find(mnemonic);
  if (it == table.end()) return false;
  *out = it->second;
  return true;
}

}  // namespace shardstep::ir
