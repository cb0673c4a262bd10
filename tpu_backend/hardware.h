// Hardware tables (tpu_backend/hardware/*.toml): the public numbers of a TPU generation that the
// step-time simulator uses, each with its source in a comment of the file. Read by the strict
// TOML-subset reader; every problem is "FILE:LINE: message" naming the key.
#pragma once

#include <string>
#include <vector>

#include "tpu_backend/ring_cost.h"

namespace shardstep::tpu {

struct HardwareTable {
  std::string name, path;
  // [chip]
  int cores_per_chip = 0;
  int mxus_per_core = 0;
  int mxu_dim = 0;
  double peak_bf16_flops_per_chip = 0;  // FLOP/s
  double hbm_bytes_per_chip = 0;
  double hbm_bytes_per_s_per_chip = 0;
  int vpu_lanes = 0, vpu_sublanes = 0;  // the vector unit: one f32 op per element and clock cycle
  int mxu_f32_passes = 0;               // bf16 MXU passes per f32 matmul
  // [interconnect]
  int links_per_chip = 0;
  LinkModel link;     // one direction of one inter-chip link
  LinkModel on_chip;  // between the cores of a chip

  // Derived: the matrix units' clock, peak_bf16_flops / (cores * mxus * mxu_dim^2 * 2).
  double ClockHz() const;
  double PeakFlopsPerCore() const { return peak_bf16_flops_per_chip / cores_per_chip; }
  double HbmBytesPerSPerCore() const { return hbm_bytes_per_s_per_chip / cores_per_chip; }
  double VectorFlopsPerCore() const { return static_cast<double>(vpu_lanes) * vpu_sublanes * ClockHz(); }
  double PeakF32FlopsPerCore() const { return PeakFlopsPerCore() / mxu_f32_passes; }
};

// Reads a table. Every key must be present once, numeric and positive; an unknown table or key is an
// error listing the known keys.
HardwareTable ReadHardwareTable(const std::string& path);
// The table called `name` in the shipped directory (tpu_backend/hardware/<name>.toml); an unknown name
// is an error listing the known ones, naming `flag`.
HardwareTable FindHardwareTable(const std::string& name, const std::string& flag = "--hardware");
std::vector<std::string> HardwareTableNames();

}  // namespace shardstep::tpu
