// A directory of periodic checkpoints (`shardstep train --save-every K --checkpoint-dir DIR --keep M`)
// and finding the one to resume from (`--resume DIR`).
//
// Layout: DIR/step-<step, at least 9 digits>.safetensors, e.g. step-000001200.safetensors; the newest
// is the one with the highest step. Each is an ordinary checkpoint (checkpoint.h: the logical state,
// which includes the optimizer's step counter, and a CRC32 of the whole file) whose metadata also
// holds what a resume needs: the training-loop step, the data order's epoch and position, and the
// options that identify the run. A file is written as <name>.tmp.<pid>, fsynced, renamed and the
// directory fsynced; older files beyond the newest M are removed only after that. A name of the form
// step-N.safetensors is therefore always a complete file, and a process killed at any moment leaves
// at most a temporary file behind.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace shardstep::runtime {

// Metadata keys of a periodic checkpoint (values are decimal integers, or a JSON object for the run).
inline constexpr const char* kMetaTrainStep = "shardstep.train_step";        // steps done by the training loop
inline constexpr const char* kMetaDataEpoch = "shardstep.data_epoch";        // BatchIterator::epoch()
inline constexpr const char* kMetaDataPosition = "shardstep.data_position";  // BatchIterator::position()
inline constexpr const char* kMetaRunOptions = "shardstep.run_options";      // {"--flag": "value", ...}
inline constexpr const char* kMetaSkippedSteps = "shardstep.skipped_steps";  // --on-nonfinite skip's count
inline constexpr const char* kMetaReplicas = "shardstep.replicas";           // informational

// "step-000001200.safetensors".
std::string PeriodicCheckpointName(int64_t step);

struct PeriodicCheckpointFile {
  int64_t step;
  std::string path;
};
// The files of `dir` named like periodic checkpoints, lowest step first (empty when `dir` is missing).
std::vector<PeriodicCheckpointFile> ListPeriodicCheckpoints(const std::string& dir);
// Temporary files "<name>.tmp.<pid>" left in `dir` by a writer that was killed.
std::vector<std::string> ListTemporaryFiles(const std::string& dir);

struct ResumePoint {
  std::string path;
  int64_t step = 0;           // kMetaTrainStep
  int64_t data_epoch = 0, data_position = 0;
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
  bool checksummed = false;
  std::vector<std::string> skipped;      // "<path>: <why>" for each newer file that is not a complete checkpoint
  std::vector<std::string> temporaries;  // leftover temporary files (never read)
};
// The newest complete periodic checkpoint of `dir`: files are tried from the highest step down and
// the first that loads (structure and checksum) and holds the resume metadata wins. Throws
// shardstep::Error when `dir` is missing or holds none, listing what was skipped and why.
ResumePoint FindResumePoint(const std::string& dir);

// Readies `dir` for periodic checkpoints before training: creates it, removes temporary files whose
// writer no longer runs, and
//  - for a new run (`resumed_step` empty), refuses a directory that already holds checkpoints (a later
//    --resume would pick another run's newest file);
//  - when resuming from this same directory at `resumed_step`, renames the files with a higher step
//    (the ones FindResumePoint skipped as incomplete or corrupt) to <name>.corrupt, out of the way.
// Says what it did on `log`. Throws shardstep::Error naming the directory.
void PrepareCheckpointDirectory(const std::string& dir, std::optional<int64_t> resumed_step, std::ostream& log);

// Removes the temporary files "<path>.tmp.<pid>" that a killed writer of `path` left next to it (those
// of processes still running are left alone), saying so on `log`. Used before the final --save.
void RemoveStaleTemporaryFiles(const std::string& path, std::ostream& log);

// Writes DIR/step-N.safetensors atomically, then removes all but the newest `keep` periodic
// checkpoints (only once the new one is complete). Returns the new file's path; `removed` gets the
// removed paths.
std::string SavePeriodicCheckpoint(const std::string& dir, int64_t step, const std::map<std::string, Tensor>& tensors,
                                   const std::map<std::string, std::string>& metadata, int64_t keep,
                                   std::vector<std::string>* removed = nullptr);

}  // namespace shardstep::runtime
