// Trimming the metrics file of a resumed run.
#include "runtime/metrics_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "ir/error.h"
#include "runtime/atomic_file.h"

namespace shardstep::runtime {

bool KeepMetricsUpTo(const std::string& path, int64_t step, TrainingCurves* curves) {
  if (curves) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    *curves = TrainingCurves{};
    curves->loss.assign(step, nan);
    curves->step_ms.assign(step, nan);
    curves->comm_ms.assign(step, nan);
  }
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Str("cannot read metrics file ", path, ": ", std::strerror(errno)));
  std::string kept, line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline after it: a line torn by a kill
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    auto s = j.find("step");
    if (s != j.end() && (!s->is_number_integer() || s->get<int64_t>() > step)) continue;
    if (curves && s != j.end() && s->get<int64_t>() >= 1) {
      const int64_t i = s->get<int64_t>() - 1;
      auto num = [&](const char* key) {
        auto v = j.find(key);
        return v != j.end() && v->is_number() ? v->get<double>() : std::numeric_limits<double>::quiet_NaN();
      };
      if (j.contains("split")) {
        // The task's metric: whichever of the metric keys the line has.
        double metric = num("accuracy");
        for (const char* key : {"bits_per_char", "masked_accuracy"})
          if (j.contains(key)) metric = num(key);
        curves->evals.push_back({i + 1, metric, num("loss")});
      }
      else {
        curves->loss[i] = num("loss");
        curves->step_ms[i] = num("step_ms");
        curves->comm_ms[i] = num("comm_ms");
      }
    }
    kept += line;
    kept += '\n';
  }
  if (in.bad()) throw Error(Str("cannot read metrics file ", path));
  WriteFileAtomically(path, {{kept.data(), kept.size()}}, "metrics");
  return true;
}

}  // namespace shardstep::runtime
