// Checkpoints in the safetensors format: atomic save, fully validated load, and a check against the
// tensors a model expects.
#pragma once

#include <map>
#include <string>

#include "ir/types.h"
#include "runtime/tensor.h"

namespace shardstep::runtime {

// The metadata entry holding the file's checksum: CRC32 (zlib's, as 8 lower-case hex digits) of the
// whole file — length field, header text, data — computed with those 8 digits written as "00000000".
// It covers every byte, so a truncated, bit-flipped or partly written file is rejected.
inline constexpr const char* kChecksumKey = "shardstep.crc32";

// Writes `tensors` (f32 -> "F32", s32 -> "I32") and string metadata to `path`, plus the checksum
// entry kChecksumKey in "__metadata__". Atomic: the data goes to `path`.tmp.<pid>, is fsynced and
// renamed over `path` (then the directory is fsynced), so an existing file is replaced whole or left
// untouched. Throws shardstep::Error naming the path on failure (the temporary file is removed).
void SaveCheckpoint(const std::string& path, const std::map<std::string, Tensor>& tensors,
                    const std::map<std::string, std::string>& metadata = {});

// Reads a safetensors file, validating the header length, the JSON, dtypes, shapes against byte
// ranges and that the ranges tile the data buffer exactly. Throws shardstep::Error naming the path
// and the problem. When "__metadata__" holds kChecksumKey the checksum must match ("checksum
// mismatch: the file is corrupt"); files without it (written before shardstep had checksums, or by
// other tools) still load, with only the structural checks: `checksummed` (when given) says which.
// Fills `metadata` from "__metadata__" (without the checksum entry) when given.
std::map<std::string, Tensor> LoadCheckpoint(const std::string& path,
                                             std::map<std::string, std::string>* metadata = nullptr,
                                             bool* checksummed = nullptr);
// The same for the file's contents `bytes` already in memory; `path` only names it in messages
// (LoadCheckpoint reads the file and calls this; the fuzz target calls it directly).
std::map<std::string, Tensor> LoadCheckpointFromBytes(const std::string& bytes, const std::string& path,
                                                      std::map<std::string, std::string>* metadata = nullptr,
                                                      bool* checksummed = nullptr);

// Throws shardstep::Error listing every missing, unexpected, mis-shaped or mis-typed tensor of
// `loaded` (read from `path`) compared with what the model expects.
void CheckCheckpointMatches(const std::map<std::string, Tensor>& loaded,
                            const std::map<std::string, ir::TensorType>& expected, const std::string& path);

}  // namespace shardstep::runtime
