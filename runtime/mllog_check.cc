#include "runtime/mllog_check.h"

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ir/error.h"

namespace shardstep::runtime {
namespace {

using Json = nlohmann::json;

const std::set<std::string> kExactlyOne = {
    "submission_org", "submission_platform", "submission_division", "submission_status", "submission_benchmark",
    "init_stop",      "run_start",           "run_stop",            "train_samples",     "eval_samples",
    "seed",           "global_batch_size"};
const std::set<std::string> kAtLeastOne = {"cache_clear", "init_start", "eval_accuracy"};
const std::set<std::string> kBenchmarks = {"resnet", "ssd",  "stable_diffusion", "maskrcnn", "gpt3",
                                           "dlrm_dcnv2", "bert", "rnnt", "unet3d", "gnn"};

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool HasInt(const Json& md, const char* key) { return md.contains(key) && md[key].is_number_integer(); }

}  // namespace

std::vector<std::string> CheckMlLog(const std::string& text) {
  std::vector<std::string> problems;
  auto bad = [&](int line, const std::string& what) { problems.push_back(Str("line ", line, ": ", what)); };

  std::map<std::string, int> count;
  std::vector<std::pair<std::string, int>> open;  // interval names ("run", "block", ...) and their lines
  double last_time = -1;
  int last_line = 0, run_stop_line = 0, init_start_line = 0, init_stop_line = 0, run_start_line = 0;
  std::istringstream in(text);
  std::string raw;
  for (int n = 1; std::getline(in, raw); ++n) {
    const size_t at = raw.find(":::MLLOG");
    if (at == std::string::npos) continue;  // other output may share the stream
    if (run_stop_line) bad(n, "a line after run_stop (line " + std::to_string(run_stop_line) + ")");
    last_line = n;
    Json j;
    try {
      j = Json::parse(raw.substr(at + 8));
    } catch (const std::exception& e) {
      bad(n, Str("not one JSON object after :::MLLOG: ", e.what()));
      continue;
    }
    if (!j.is_object()) {
      bad(n, "not one JSON object after :::MLLOG");
      continue;
    }
    bool fields_ok = true;
    for (const char* field : {"namespace", "time_ms", "event_type", "key", "value", "metadata"})
      if (!j.contains(field)) bad(n, Str("no \"", field, "\"")), fields_ok = false;
    if (!fields_ok) continue;
    if (!j["key"].is_string() || !j["event_type"].is_string() || !j["time_ms"].is_number() ||
        !j["metadata"].is_object()) {
      bad(n, "\"key\" and \"event_type\" must be strings, \"time_ms\" a number, \"metadata\" an object");
      continue;
    }
    const std::string key = j["key"], type = j["event_type"];
    const Json& v = j["value"];
    const Json& md = j["metadata"];
    if (!md.contains("file") || !md["file"].is_string() || !HasInt(md, "lineno"))
      bad(n, key + ": metadata without \"file\" and \"lineno\"");
    const double t = j["time_ms"];
    if (t < last_time) bad(n, Str(key, ": time_ms ", t, " is before the previous line's ", last_time));
    last_time = std::max(last_time, t);
    ++count[key];

    // Intervals: x_start opens "x", x_stop closes it, innermost first.
    const bool starts = EndsWith(key, "_start"), stops = EndsWith(key, "_stop");
    if (type == "INTERVAL_START" || type == "INTERVAL_END") {
      if (!(type == "INTERVAL_START" ? starts : stops)) bad(n, key + ": " + type + " on a key that is not x_" +
                                                                    (type == "INTERVAL_START" ? "start" : "stop"));
    } else if (type != "POINT_IN_TIME") {
      bad(n, key + ": unknown event_type " + type);
    } else if (starts || stops) {
      bad(n, key + ": an interval key logged as POINT_IN_TIME");
    }
    if (starts) {
      open.emplace_back(key.substr(0, key.size() - 6), n);
    } else if (stops) {
      const std::string name = key.substr(0, key.size() - 5);
      if (open.empty()) {
        bad(n, key + " without an open " + name + "_start");
      } else if (open.back().first != name) {
        bad(n, Str(key, " while ", open.back().first, "_start (line ", open.back().second, ") is still open"));
      } else {
        open.pop_back();
      }
    }

    // Order and per-key rules.
    const bool in_run = run_start_line > 0;
    if (key == "init_start") {
      if (init_stop_line || in_run) bad(n, "init_start after init_stop or run_start");
      if (!init_start_line) init_start_line = n;
    } else if (key == "init_stop") {
      if (!init_start_line) bad(n, "init_stop before any init_start");
      init_stop_line = n;
    } else if (key == "run_start") {
      if (!init_stop_line) bad(n, "run_start before init_stop");
      run_start_line = n;
    } else if (key == "run_stop") {
      if (!in_run) bad(n, "run_stop before run_start");
      if (!md.contains("status") || !md["status"].is_string() ||
          (md["status"] != "success" && md["status"] != "aborted"))
        bad(n, "run_stop without metadata status success or aborted");
      run_stop_line = n;
    } else if (key == "epoch_start" || key == "epoch_stop") {
      if (!HasInt(md, "epoch_num")) bad(n, key + " without metadata epoch_num");
    } else if (key == "block_start") {
      const bool by_epochs = HasInt(md, "epoch_count") && md["epoch_count"] > 0 && HasInt(md, "first_epoch_num");
      const bool by_steps = HasInt(md, "step_num") && md["step_num"] >= 0;
      if (!by_epochs && !by_steps) bad(n, "block_start without epoch_count > 0 and first_epoch_num, or step_num >= 0");
    } else if (key == "block_stop") {
      if (!HasInt(md, "first_epoch_num") && !HasInt(md, "step_num")) bad(n, "block_stop without first_epoch_num or step_num");
    } else if (key == "eval_start" || key == "eval_stop" || key == "eval_accuracy") {
      if (!HasInt(md, "epoch_num") && !HasInt(md, "step_num")) bad(n, key + " without metadata epoch_num or step_num");
    } else if (key == "submission_division") {
      if (v != "closed" && v != "open") bad(n, "submission_division must be closed or open");
    } else if (key == "submission_status") {
      if (v != "cloud" && v != "onprem" && v != "preview" && v != "research")
        bad(n, "submission_status must be cloud, onprem, preview or research");
    } else if (key == "submission_benchmark") {
      if (!v.is_string() || !kBenchmarks.count(v.get<std::string>()))
        bad(n, "submission_benchmark " + v.dump() + " is not an MLPerf training benchmark");
    } else if (key == "submission_org" || key == "submission_platform") {
      if (!v.is_string() || v.get<std::string>().empty()) bad(n, key + " must be a non-empty string");
    } else if (key == "cache_clear" || key == "train_samples" || key == "eval_samples") {
      if (v.is_null() || v == "") bad(n, key + " without a value");
    }
    const bool run_only = key.rfind("block_", 0) == 0 || key.rfind("epoch_", 0) == 0 || key == "eval_start" ||
                          key == "eval_stop" || key == "eval_accuracy";
    if (run_only && !in_run)
      bad(n, key + " outside run_start .. run_stop");
  }

  const int end = last_line + 1;
  for (const std::string& k : kExactlyOne)
    if (count[k] != 1) bad(end, Str(k, " appears ", count[k], " times; the rules want exactly one"));
  for (const std::string& k : kAtLeastOne)
    if (count[k] < 1) bad(end, k + " never appears; the rules want at least one");
  if (count["epoch_start"] + count["block_start"] == 0) bad(end, "neither epoch_start nor block_start appears");
  for (const auto& [name, line] : open) bad(line, name + "_start is never closed");
  if (run_stop_line && run_stop_line != last_line) bad(run_stop_line, "run_stop is not the last line");
  return problems;
}

}  // namespace shardstep::runtime
