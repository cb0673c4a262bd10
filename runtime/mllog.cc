#include "runtime/mllog.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <ostream>

#include "ir/error.h"

namespace shardstep::runtime {

MlLog::MlLog(std::ostream* out, std::function<int64_t()> clock_ms, std::string name_space)
    : out_(out), clock_ms_(std::move(clock_ms)), namespace_(std::move(name_space)) {
  if (!clock_ms_) {
    clock_ms_ = [] {
      using namespace std::chrono;
      return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
    };
  }
}

MlLog::~MlLog() = default;

std::unique_ptr<MlLog> MlLog::OpenFile(const std::string& path) {
  auto file = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::trunc);
  if (!*file) throw Error(Str("cannot write the MLPerf log ", path, ": ", std::strerror(errno)));
  auto log = std::make_unique<MlLog>(file.get());
  log->owned_ = std::move(file);
  return log;
}

void MlLog::Event(const std::string& key, const Json& value, Json metadata, const char* file, int line) {
  Write("POINT_IN_TIME", key, value, std::move(metadata), file, line);
}

void MlLog::Start(const std::string& key, const Json& value, Json metadata, const char* file, int line) {
  Write("INTERVAL_START", key, value, std::move(metadata), file, line);
}

void MlLog::End(const std::string& key, const Json& value, Json metadata, const char* file, int line) {
  Write("INTERVAL_END", key, value, std::move(metadata), file, line);
}

void MlLog::Write(const char* event_type, const std::string& key, const Json& value, Json metadata, const char* file,
                  int line) {
  if (metadata.is_null()) metadata = Json::object();
  if (!metadata.is_object()) throw Error(Str("MLPerf log key ", key, ": metadata must be a JSON object"));
  // The file's base name, as the reference logger records it.
  if (const char* slash = std::strrchr(file, '/')) file = slash + 1;
  metadata["file"] = file;
  metadata["lineno"] = line;
  // Field order as mlperf_logging writes it (nlohmann's ordered_json keeps insertion order).
  nlohmann::ordered_json record;
  record["namespace"] = namespace_;
  record["time_ms"] = clock_ms_();
  record["event_type"] = event_type;
  record["key"] = key;
  record["value"] = value;
  record["metadata"] = metadata;
  *out_ << ":::MLLOG " << record.dump() << '\n';
  out_->flush();
  if (!*out_) throw Error(Str("cannot write the MLPerf log line for key ", key));
}

}  // namespace shardstep::runtime
