// Checkpoints in the safetensors format: atomic save, fully validated load, and a check against the
// tensors a model expects.
#pragma once

#include <map>
#include <string>

#include "ir/types.h"
#include "runtime/tensor.h"

namespace shardstep::runtime {

// Writes `tensors` (f32 -> "F32", s32 -> "I32") and string metadata to `path`. Atomic: the data goes
// to `path`.tmp.<pid>, is fsynced and renamed over `path`, so an existing file is replaced whole or
// left untouched. Throws shardstep::Error naming the path on failure (the temporary file is removed).
void SaveCheckpoint(const std::string& path, const std::map<std::string, Tensor>& tensors,
                    const std::map<std::string, std::string>& metadata = {});

// Reads a safetensors file, validating the header length, the JSON, dtypes, shapes against byte
// ranges and that the ranges tile the data buffer exactly. Throws shardstep::Error naming the path
// and the problem. Fills `metadata` from "__metadata__" when given.
std::map<std::string, Tensor> LoadCheckpoint(const std::string& path,
                                             std::map<std::string, std::string>* metadata = nullptr);

// Throws shardstep::Error listing every missing, unexpected, mis-shaped or mis-typed tensor of
// `loaded` (read from `path`) compared with what the model expects.
void CheckCheckpointMatches(const std::map<std::string, Tensor>& loaded,
                            const std::map<std::string, ir::TensorType>& expected, const std::string& path);

}  // namespace shardstep::runtime
