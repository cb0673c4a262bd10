#include "tpu_backend/hardware.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <system_error>

#include "tpu_backend/hardware_dirs.h"

#include "ir/error.h"
#include "runtime/toml_subset.h"

namespace shardstep::tpu {
namespace {

#ifndef SHARDSTEP_HARDWARE_DIR
#error "SHARDSTEP_HARDWARE_DIR (the shipped tables' directory) is set by CMakeLists.txt"
#endif

// Where each key goes, with its unit conversion to SI.
struct Key {
  const char* table;
  const char* name;
  double scale;
  bool integer;
};
constexpr Key kKeys[] = {
    {"chip", "cores", 1, true},
    {"chip", "mxus_per_core", 1, true},
    {"chip", "mxu_dim", 1, true},
    {"chip", "peak_bf16_tflops", 1e12, false},
    {"chip", "hbm_gib", 1024.0 * 1024 * 1024, false},
    {"chip", "hbm_gbps", 1e9, false},
    {"chip", "vpu_lanes", 1, true},
    {"chip", "vpu_sublanes", 1, true},
    {"chip", "mxu_f32_passes", 1, true},
    {"interconnect", "links_per_chip", 1, true},
    {"interconnect", "link_gbps", 1e9, false},
    {"interconnect", "link_latency_us", 1e-6, false},
    {"interconnect", "on_chip_gbps", 1e9, false},
    {"interconnect", "on_chip_latency_us", 1e-6, false},
};

std::string KnownKeys(const std::string& table) {
  std::string out;
  for (const Key& k : kKeys)
    if (table == k.table) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

}  // namespace

double HardwareTable::ClockHz() const {
  return peak_bf16_flops_per_chip / (static_cast<double>(cores_per_chip) * mxus_per_core * mxu_dim * mxu_dim * 2);
}

HardwareTable ReadHardwareTable(const std::string& path) {
  const runtime::ConfigFile file = runtime::ReadConfigFile(path);
  std::map<std::string, double> values;  // "table.key" -> SI value
  for (const runtime::ConfigEntry& e : file.entries) {
    const Key* key = nullptr;
    for (const Key& k : kKeys)
      if (e.table == k.table && e.key == k.name) key = &k;
    if (!key) {
      if (e.table != "chip" && e.table != "interconnect")
        throw Error(Str(path, ":", e.line, ": '", e.key, "' is in table [", e.table,
                        "]; a hardware table has [chip] and [interconnect]"));
      throw Error(Str(path, ":", e.line, ": unknown key '", e.key, "' in [", e.table, "]; known: ", KnownKeys(e.table)));
    }
    const bool numeric = e.value.kind == runtime::ConfigValue::Kind::kInteger ||
                         (!key->integer && e.value.kind == runtime::ConfigValue::Kind::kFloat);
    if (!numeric)
      throw Error(Str(path, ":", e.line, ": ", e.key, " must be ", key->integer ? "an integer" : "a number", ", got '",
                      e.value.text, "'"));
    const double v = std::stod(e.value.text);
    if (!(v > 0)) throw Error(Str(path, ":", e.line, ": ", e.key, " must be positive, got ", e.value.text));
    values[Str(e.table, ".", e.key)] = v * key->scale;
  }
  for (const Key& k : kKeys)
    if (!values.count(Str(k.table, ".", k.name)))
      throw Error(Str(path, ": missing '", k.name, "' in [", k.table, "]"));
  auto get = [&](const char* table, const char* name) { return values.at(Str(table, ".", name)); };
  HardwareTable t;
  t.path = path;
  t.name = std::filesystem::path(path).stem().string();
  t.cores_per_chip = static_cast<int>(get("chip", "cores"));
  t.mxus_per_core = static_cast<int>(get("chip", "mxus_per_core"));
  t.mxu_dim = static_cast<int>(get("chip", "mxu_dim"));
  t.peak_bf16_flops_per_chip = get("chip", "peak_bf16_tflops");
  t.hbm_bytes_per_chip = get("chip", "hbm_gib");
  t.hbm_bytes_per_s_per_chip = get("chip", "hbm_gbps");
  t.vpu_lanes = static_cast<int>(get("chip", "vpu_lanes"));
  t.vpu_sublanes = static_cast<int>(get("chip", "vpu_sublanes"));
  t.mxu_f32_passes = static_cast<int>(get("chip", "mxu_f32_passes"));
  t.links_per_chip = static_cast<int>(get("interconnect", "links_per_chip"));
  t.link = LinkModel{get("interconnect", "link_latency_us"), get("interconnect", "link_gbps")};
  t.on_chip = LinkModel{get("interconnect", "on_chip_latency_us"), get("interconnect", "on_chip_gbps")};
  return t;
}

namespace {

bool HoldsTables(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return false;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
    if (entry.path().extension() == ".toml") return true;
  return false;
}

}  // namespace

std::vector<std::string> HardwareTableSearchPath() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("SHARDSTEP_HARDWARE_DIR"); env && *env) dirs.push_back(env);
#ifdef SHARDSTEP_HARDWARE_DIR_FROM_BIN
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back((exe.parent_path() / SHARDSTEP_HARDWARE_DIR_FROM_BIN).lexically_normal().string());
#endif
  dirs.push_back(SHARDSTEP_HARDWARE_DIR);
#ifdef SHARDSTEP_INSTALL_HARDWARE_DIR
  dirs.push_back(SHARDSTEP_INSTALL_HARDWARE_DIR);
#endif
  return dirs;
}

std::string HardwareTableDir() {
  const std::vector<std::string> dirs = HardwareTableSearchPath();
  const char* env = std::getenv("SHARDSTEP_HARDWARE_DIR");
  if (env && *env && !HoldsTables(env))  // an explicit choice is not silently passed over
    throw Error(Str("SHARDSTEP_HARDWARE_DIR=", env, " holds no hardware table (*.toml)"));
  for (const std::string& d : dirs)
    if (HoldsTables(d)) return d;
  std::string looked;
  for (const std::string& d : dirs) looked += (looked.empty() ? "" : ", ") + d;
  throw Error(Str("no hardware tables (*.toml) found; looked in ", looked, " (set SHARDSTEP_HARDWARE_DIR)"));
}

std::vector<std::string> HardwareTableNames() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(HardwareTableDir()))
    if (entry.path().extension() == ".toml") names.push_back(entry.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

HardwareTable FindHardwareTable(const std::string& name, const std::string& flag) {
  const std::vector<std::string> names = HardwareTableNames();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    throw Error(Str(flag, ": unknown hardware table '", name, "'; known: ", known, " (in ", HardwareTableDir(), ")"));
  }
  return ReadHardwareTable(HardwareTableDir() + "/" + name + ".toml");
}

}  // namespace shardstep::tpu
