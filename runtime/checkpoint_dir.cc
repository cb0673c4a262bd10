// The directory of periodic checkpoints: names, listing, the newest complete file, pruning.
#include "runtime/checkpoint_dir.h"

#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <system_error>

#include "ir/error.h"
#include "runtime/checkpoint.h"

namespace shardstep::runtime {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPrefix = "step-";
constexpr const char* kSuffix = ".safetensors";
constexpr const char* kTempMark = ".tmp.";

// Parses all of `s` as a non-negative decimal integer.
std::optional<int64_t> ParseCount(std::string_view s) {
  if (s.empty()) return std::nullopt;
  int64_t v = 0;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

// The step of a periodic checkpoint's file name, or nullopt for any other name.
std::optional<int64_t> StepOfName(const std::string& name) {
  const std::string_view n(name), prefix(kPrefix), suffix(kSuffix);
  if (n.size() < prefix.size() + 9 + suffix.size() || n.substr(0, prefix.size()) != prefix ||
      n.substr(n.size() - suffix.size()) != suffix)
    return std::nullopt;
  const std::string_view digits = n.substr(prefix.size(), n.size() - prefix.size() - suffix.size());
  if (digits.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  return ParseCount(digits);
}

// The writer's pid of a temporary file name "<name>.tmp.<pid>", or nullopt.
std::optional<int64_t> TempWriterPid(const std::string& name) {
  const size_t at = name.rfind(kTempMark);
  if (at == std::string::npos || at == 0) return std::nullopt;
  const std::string_view pid = std::string_view(name).substr(at + std::string_view(kTempMark).size());
  if (pid.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  return ParseCount(pid);
}

bool ProcessRuns(int64_t pid) {
  if (pid <= 0 || pid > INT32_MAX) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

std::string Join(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += "\n  " + l;
  return s;
}

int64_t MetaCount(const std::map<std::string, std::string>& meta, const char* key) {
  auto it = meta.find(key);
  if (it == meta.end()) throw Error(Str("no \"", key, "\" in its metadata (not a periodic checkpoint)"));
  auto v = ParseCount(it->second);
  if (!v) throw Error(Str("metadata \"", key, "\" is '", it->second, "', not a non-negative integer"));
  return *v;
}

}  // namespace

std::string PeriodicCheckpointName(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%s%09lld%s", kPrefix, static_cast<long long>(step), kSuffix);
  return buf;
}

std::vector<PeriodicCheckpointFile> ListPeriodicCheckpoints(const std::string& dir) {
  std::vector<PeriodicCheckpointFile> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (auto step = StepOfName(name)) files.push_back({*step, (fs::path(dir) / name).string()});
  }
  if (ec) throw Error(Str("cannot list checkpoint directory ", dir, ": ", ec.message()));
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return files;
}

std::vector<std::string> ListTemporaryFiles(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (TempWriterPid(name)) files.push_back((fs::path(dir) / name).string());
  }
  if (ec) throw Error(Str("cannot list checkpoint directory ", dir, ": ", ec.message()));
  std::sort(files.begin(), files.end());
  return files;
}

ResumePoint FindResumePoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(Str("--resume ", dir, ": not a directory"));
  ResumePoint r;
  r.temporaries = ListTemporaryFiles(dir);
  const std::vector<PeriodicCheckpointFile> files = ListPeriodicCheckpoints(dir);
  for (auto f = files.rbegin(); f != files.rend(); ++f) {
    try {
      r.tensors = LoadCheckpoint(f->path, &r.metadata, &r.checksummed);
      r.step = MetaCount(r.metadata, kMetaTrainStep);
      r.data_epoch = MetaCount(r.metadata, kMetaDataEpoch);
      r.data_position = MetaCount(r.metadata, kMetaDataPosition);
      if (r.step != f->step) throw Error(Str("its metadata says step ", r.step, " but its name step ", f->step));
      if (!r.metadata.count(kMetaRunOptions)) throw Error(Str("no \"", kMetaRunOptions, "\" in its metadata"));
      r.path = f->path;
      return r;
    } catch (const Error& e) {
      // LoadCheckpoint's messages start with the path; the metadata checks' do not.
      const std::string what = e.what();
      r.skipped.push_back(what.rfind(f->path, 0) == 0 ? what : Str(f->path, ": ", what));
      r.tensors.clear();
      r.metadata.clear();
    }
  }
  std::string msg = Str("--resume ", dir, ": no complete checkpoint (", kPrefix, "<step>", kSuffix, ") in the directory");
  if (!r.skipped.empty()) msg += Str("; skipped:", Join(r.skipped));
  if (!r.temporaries.empty()) msg += Str("\nleftover temporary files (incomplete writes):", Join(r.temporaries));
  throw Error(msg);
}

void PrepareCheckpointDirectory(const std::string& dir, std::optional<int64_t> resumed_step, std::ostream& log) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) throw Error(Str("--checkpoint-dir ", dir, ": cannot create the directory: ", ec.message()));
  for (const std::string& t : ListTemporaryFiles(dir)) {
    const int64_t pid = *TempWriterPid(fs::path(t).filename().string());
    if (ProcessRuns(pid)) {
      log << "note: " << t << " is being written by process " << pid << " (left alone)\n";
      continue;
    }
    if (fs::remove(t, ec)) log << "removed " << t << " (an incomplete write by a process that no longer runs)\n";
  }
  const std::vector<PeriodicCheckpointFile> files = ListPeriodicCheckpoints(dir);
  if (!resumed_step) {
    if (!files.empty())
      throw Error(Str("--checkpoint-dir ", dir, " already holds checkpoints (newest ", files.back().path,
                      "); continue that run with --resume ", dir, ", or use an empty directory"));
    return;
  }
  for (const PeriodicCheckpointFile& f : files) {
    if (f.step <= *resumed_step) continue;
    const std::string aside = f.path + ".corrupt";
    fs::rename(f.path, aside, ec);
    if (ec) throw Error(Str("--checkpoint-dir ", dir, ": cannot rename ", f.path, " to ", aside, ": ", ec.message()));
    log << "renamed " << f.path << " (not a complete checkpoint) to " << aside << "\n";
  }
}

void RemoveStaleTemporaryFiles(const std::string& path, std::ostream& log) {
  const fs::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const std::string prefix = target.filename().string() + kTempMark;
  for (const std::string& t : ListTemporaryFiles(dir)) {
    const std::string name = fs::path(t).filename().string();
    if (name.rfind(prefix, 0) != 0 || name.find('.', prefix.size()) != std::string::npos) continue;
    std::error_code ec;
    if (!ProcessRuns(*TempWriterPid(name)) && fs::remove(t, ec))
      log << "removed " << t << " (an incomplete write by a process that no longer runs)\n";
  }
}

std::string SavePeriodicCheckpoint(const std::string& dir, int64_t step, const std::map<std::string, Tensor>& tensors,
                                   const std::map<std::string, std::string>& metadata, int64_t keep,
                                   std::vector<std::string>* removed) {
  const std::string path = (fs::path(dir) / PeriodicCheckpointName(step)).string();
  SaveCheckpoint(path, tensors, metadata);  // complete and durable once this returns
  std::vector<PeriodicCheckpointFile> files = ListPeriodicCheckpoints(dir);
  const int64_t excess = static_cast<int64_t>(files.size()) - std::max<int64_t>(keep, 1);
  for (int64_t i = 0; i < excess; ++i) {
    if (files[i].path == path) continue;
    std::error_code ec;
    if (fs::remove(files[i].path, ec) && removed) removed->push_back(files[i].path);
  }
  return path;
}

}  // namespace shardstep::runtime
