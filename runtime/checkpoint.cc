// safetensors reading and writing: 8-byte little-endian header length, JSON header, packed data.
#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>
#include <zlib.h>

#include "ir/error.h"
#include "runtime/atomic_file.h"

namespace shardstep::runtime {
namespace {

using nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "tensor bytes are written as stored; safetensors is little-endian");

const char* SafetensorsDType(ir::DType t) {
  switch (t) {
    case ir::DType::kF32: return "F32";
    case ir::DType::kS32: return "I32";
    case ir::DType::kBF16: return "BF16";  // safetensors' name for bfloat16 (torch.bfloat16)
  }
  return "?";
}

std::string ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(Str("cannot open ", path, ": ", std::strerror(errno)));
  std::string bytes;
  char buf[1 << 16];
  for (;;) {
    ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      ::close(fd);
      throw Error(Str("cannot read ", path, ": ", std::strerror(e)));
    }
    if (r == 0) break;
    bytes.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return bytes;
}

// The non-negative integer at `j`, or nullopt if it is anything else.
std::optional<uint64_t> AsUnsigned(const json& j) {
  if (!j.is_number_unsigned()) return std::nullopt;
  return j.get<uint64_t>();
}

struct Entry {
  std::string name;
  ir::TensorType type;
  uint64_t begin, end;
};

// Parses and checks one tensor entry of the header against a data buffer of `buffer` bytes.
Entry ParseEntry(const std::string& path, const std::string& name, const json& v, uint64_t buffer) {
  auto bad = [&](const std::string& what) { return Error(Str(path, ": tensor '", name, "': ", what)); };
  if (!v.is_object()) throw bad("entry is not a JSON object");
  Entry e{name, {}, 0, 0};
  auto dtype = v.find("dtype");
  if (dtype == v.end() || !dtype->is_string()) throw bad("missing or non-string \"dtype\"");
  const std::string dt = dtype->get<std::string>();
  if (dt == "F32") e.type.dtype = ir::DType::kF32;
  else if (dt == "I32") e.type.dtype = ir::DType::kS32;
  else if (dt == "BF16") e.type.dtype = ir::DType::kBF16;
  else throw bad(Str("unsupported dtype '", dt, "' (supported: F32, I32, BF16)"));

  auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array()) throw bad("missing or non-array \"shape\"");
  uint64_t bytes = static_cast<uint64_t>(ir::DTypeBytes(e.type.dtype));
  for (const json& d : *shape) {
    auto dim = AsUnsigned(d);
    if (!dim || *dim > uint64_t{INT64_MAX}) throw bad(Str("bad dimension ", d.dump(), " in shape ", shape->dump()));
    if (__builtin_mul_overflow(bytes, *dim, &bytes)) throw bad(Str("shape ", shape->dump(), " is too large"));
    e.type.shape.push_back(static_cast<int64_t>(*dim));
  }

  auto offsets = v.find("data_offsets");
  if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 || !AsUnsigned((*offsets)[0]) ||
      !AsUnsigned((*offsets)[1])) {
    throw bad("\"data_offsets\" must be [begin, end] with non-negative integers");
  }
  e.begin = *AsUnsigned((*offsets)[0]);
  e.end = *AsUnsigned((*offsets)[1]);
  if (e.begin > e.end) throw bad(Str("data_offsets ", offsets->dump(), " end before they begin"));
  if (e.end > buffer) {
    throw bad(Str("data_offsets ", offsets->dump(), " run past the end of the ", buffer,
                  "-byte data buffer (truncated file?)"));
  }
  if (bytes != e.end - e.begin) {
    throw bad(Str("shape ", ir::ShapeToString(e.type.shape), " of ", dt, " needs ", bytes,
                  " bytes but data_offsets ", offsets->dump(), " hold ", e.end - e.begin));
  }
  return e;
}

// The checksum entry as it appears in the header text (nlohmann's dump: no spaces), before the 8 hex digits.
std::string ChecksumNeedle() { return Str("\"", kChecksumKey, "\":\""); }

uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
  if (n == 0) return crc;  // zlib returns its initial value for a null buffer (an empty tensor's)
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

std::string Hex8(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

// Checks the file's checksum (see checkpoint.h) when its metadata holds one. A key one character away
// from kChecksumKey (a flipped bit in the key) is corruption, not an old file without a checksum.
bool VerifyChecksum(const std::string& path, const std::string& bytes, uint64_t header_end,
                    const std::map<std::string, std::string>& meta) {
  const std::string key = kChecksumKey;
  for (const auto& [k, v] : meta) {
    if (k == key || k.size() != key.size()) continue;
    int diff = 0;
    for (size_t i = 0; i < k.size(); ++i) diff += k[i] != key[i];
    if (diff == 1) throw Error(Str(path, ": corrupt header: metadata key '", k, "' is a damaged '", key, "'"));
  }
  auto it = meta.find(key);
  if (it == meta.end()) return false;
  const std::string& stored = it->second;
  if (stored.size() != 8 || stored.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw Error(Str(path, ": corrupt header: checksum '", stored, "' is not 8 lower-case hex digits"));
  // The entry must occur once in the header text; it is hashed as "00000000".
  const std::string needle = ChecksumNeedle() + stored + "\"";
  const std::string_view header(bytes.data(), header_end);
  const size_t at = header.find(needle);
  if (at == std::string::npos || header.find(needle, at + 1) != std::string::npos)
    throw Error(Str(path, ": corrupt header: the checksum entry does not appear exactly once in the header text"));
  const size_t digits = at + needle.size() - 9;
  uint32_t crc = Crc32(0, bytes.data(), digits);
  crc = Crc32(crc, "00000000", 8);
  crc = Crc32(crc, bytes.data() + digits + 8, bytes.size() - digits - 8);
  if (Hex8(crc) != stored)
    throw Error(Str(path, ": checksum mismatch: the file is corrupt (", kChecksumKey, " ", stored,
                    " in the header, ", Hex8(crc), " computed over the ", bytes.size(), " bytes)"));
  return true;
}

}  // namespace

void SaveCheckpoint(const std::string& path, const std::map<std::string, Tensor>& tensors,
                    const std::map<std::string, std::string>& metadata) {
  // 1. Build the header; tensors are packed in name order.
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw Error(Str(path, ": cannot save a tensor named '__metadata__'"));
    size_t stored = t.held();
    if (static_cast<int64_t>(stored) != t.elements()) {
      throw Error(Str(path, ": cannot save tensor '", name, "': type ", t.type.ToString(), " but ", stored,
                      " elements stored"));
    }
    const uint64_t bytes = static_cast<uint64_t>(t.bytes());
    header[name] = {{"dtype", SafetensorsDType(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", json::array({offset, offset + bytes})}};
    offset += bytes;
  }
  std::map<std::string, std::string> meta = metadata;
  meta[kChecksumKey] = "00000000";  // the placeholder the checksum is computed with
  header["__metadata__"] = meta;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // e.g. a name that is not valid UTF-8
    throw Error(Str(path, ": cannot save checkpoint: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  // 2. The checksum: CRC32 of the whole file with its own 8 hex digits as "00000000".
  const std::string needle = ChecksumNeedle() + "00000000\"";
  const size_t at = text.find(ChecksumNeedle());
  if (at == std::string::npos || text.compare(at, needle.size(), needle) != 0 ||
      text.find(ChecksumNeedle(), at + 1) != std::string::npos)
    throw Error(Str(path, ": cannot save checkpoint: a tensor or metadata name contains ", ChecksumNeedle()));
  uint32_t crc = Crc32(0, len, sizeof(len));
  crc = Crc32(crc, text.data(), text.size());
  for (const auto& [name, t] : tensors) crc = Crc32(crc, t.raw(), static_cast<size_t>(t.bytes()));
  text.replace(at + needle.size() - 9, 8, Hex8(crc));

  // 3. Write a temporary file next to the target, fsync, rename over the target.
  std::vector<std::pair<const void*, size_t>> pieces = {{len, sizeof(len)}, {text.data(), text.size()}};
  for (const auto& [name, t] : tensors) pieces.push_back({t.raw(), static_cast<size_t>(t.bytes())});
  WriteFileAtomically(path, pieces, "checkpoint");
}

std::map<std::string, Tensor> LoadCheckpoint(const std::string& path,
                                             std::map<std::string, std::string>* metadata, bool* checksummed) {
  return LoadCheckpointFromBytes(ReadFile(path), path, metadata, checksummed);
}

std::map<std::string, Tensor> LoadCheckpointFromBytes(const std::string& bytes, const std::string& path,
                                                      std::map<std::string, std::string>* metadata,
                                                      bool* checksummed) {
  const uint64_t size = bytes.size();
  if (size < 8) {
    throw Error(Str(path, ": truncated: file is ", size, " bytes, too short for the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  if (n > size - 8) {
    throw Error(Str(path, ": header length ", n, " exceeds the ", size - 8,
                    " bytes after the length field (truncated or corrupt file)"));
  }
  json header;
  try {
    header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const json::exception& e) {
    throw Error(Str(path, ": bad JSON header: ", e.what()));
  }
  if (!header.is_object()) throw Error(Str(path, ": JSON header is not an object"));

  const uint64_t buffer = size - 8 - n;
  const char* data = bytes.data() + 8 + n;
  std::vector<Entry> entries;
  std::map<std::string, std::string> meta;
  for (const auto& [name, v] : header.items()) {
    if (name != "__metadata__") {
      entries.push_back(ParseEntry(path, name, v, buffer));
      continue;
    }
    if (!v.is_object()) throw Error(Str(path, ": \"__metadata__\" is not a JSON object"));
    for (const auto& [k, s] : v.items()) {
      if (!s.is_string()) throw Error(Str(path, ": metadata '", k, "' is not a string"));
      meta[k] = s.get<std::string>();
    }
  }
  const bool verified = VerifyChecksum(path, bytes, 8 + n, meta);
  meta.erase(kChecksumKey);

  // The byte ranges must tile the data buffer: no overlap, no gap, nothing left over.
  std::vector<const Entry*> sorted;
  for (const Entry& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(),
            [](const Entry* a, const Entry* b) { return std::tie(a->begin, a->end) < std::tie(b->begin, b->end); });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : sorted) {
    if (e->begin < covered) {
      throw Error(Str(path, ": tensors '", prev->name, "' and '", e->name, "' overlap in the data buffer"));
    }
    if (e->begin > covered) {
      throw Error(Str(path, ": gap in the data buffer at bytes [", covered, ",", e->begin, ")"));
    }
    if (e->end > covered) {
      covered = e->end;
      prev = e;
    }
  }
  if (covered != buffer) {
    throw Error(Str(path, ": data buffer is ", buffer, " bytes but the tensors cover ", covered));
  }

  std::map<std::string, Tensor> out;
  for (const Entry& e : entries) {
    Tensor t(e.type);
    if (e.end > e.begin) std::memcpy(t.raw(), data + e.begin, e.end - e.begin);
    out.emplace(e.name, std::move(t));
  }
  if (metadata) *metadata = std::move(meta);
  if (checksummed) *checksummed = verified;
  return out;
}

void CheckCheckpointMatches(const std::map<std::string, Tensor>& loaded,
                            const std::map<std::string, ir::TensorType>& expected, const std::string& path) {
  std::vector<std::string> problems;
  for (const auto& [name, type] : expected) {
    auto it = loaded.find(name);
    if (it == loaded.end()) {
      problems.push_back(Str("tensor '", name, "' (", type.ToString(), ") is missing from the file"));
    } else if (it->second.dtype() != type.dtype) {
      problems.push_back(Str("tensor '", name, "' has dtype ", ir::DTypeName(it->second.dtype()),
                             " in the file but the model expects ", ir::DTypeName(type.dtype)));
    } else if (it->second.shape() != type.shape) {
      problems.push_back(Str("tensor '", name, "' has shape ", ir::ShapeToString(it->second.shape()),
                             " in the file but the model expects ", ir::ShapeToString(type.shape)));
    }
  }
  for (const auto& [name, t] : loaded) {
    if (!expected.count(name)) {
      problems.push_back(Str("tensor '", name, "' (", t.type.ToString(), ") in the file is not part of the model"));
    }
  }
  if (problems.empty()) return;
  std::string msg = path + ": ";
  const size_t shown = std::min<size_t>(problems.size(), 10);
  for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : "") + problems[i];
  if (problems.size() > shown) msg += Str("; and ", problems.size() - shown, " more");
  throw Error(msg);
}

}  // namespace shardstep::runtime
