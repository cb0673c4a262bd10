// MeshTopology: X×Y TPU chips on a 2D torus (wrap links on both axes), C cores per chip (2 on TPU
// v3), one replica per core (DESIGN §4 "TPU-mesh emulation").
//
// Numbering: replica = (core·X + x)·Y + y. It is the shard order of the mesh's reduce-scatter, which
// reduces along the cores of a chip first (no link), then along X, then along Y (ring_schedule.h),
// so replica r ends holding shard r, as the collectives interface requires. Links are directed: every chip has one outgoing link per axis
// and direction (+x, −x, +y, −y) to its torus neighbour, and on an axis of size 2 the "+" and "−"
// links are the two distinct cables of the wrap-around (a TPU torus of 2 keeps both). An axis of size
// 1 has no links. The cores of one chip talk over the chip, not over a link (kOnChip).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/collectives.h"

namespace shardstep::tpu {

enum class MeshAxis { kX, kY, kCore };
const char* AxisName(MeshAxis a);  // "x", "y", "core"

struct CoreCoord {
  int x = 0, y = 0, core = 0;
  bool operator==(const CoreCoord&) const = default;
};

// A directed inter-chip link: from chip (x, y) along `axis` (kX or kY) in direction +1 or -1.
struct Link {
  int x = 0, y = 0;
  MeshAxis axis = MeshAxis::kX;
  int dir = +1;
  bool operator==(const Link&) const = default;
};
std::string LinkName(const Link& l);  // "(1,0)+x"

class MeshTopology {
 public:
  // Throws shardstep::Error naming `flag` unless 1 <= x, y and cores >= 1 and the mesh has at most
  // kMaxChipsPerAxis chips per axis.
  MeshTopology(int x, int y, int cores_per_chip = 2, const std::string& flag = "--mesh");
  // Parses "XxY" (e.g. "4x4"); errors name `flag` and quote the text.
  static MeshTopology Parse(const std::string& spec, int cores_per_chip = 2, const std::string& flag = "--mesh");

  static constexpr int kMaxChipsPerAxis = 128;

  int x() const { return x_; }
  int y() const { return y_; }
  int cores_per_chip() const { return cores_; }
  int chips() const { return x_ * y_; }
  int replicas() const { return x_ * y_ * cores_; }
  std::string ToString() const;  // "4x4 chips, 2 cores each (32 replicas)"

  CoreCoord CoordOf(int replica) const;  // throws on an out-of-range replica
  int ReplicaAt(const CoreCoord& c) const;
  // Size of `axis` (X, Y or cores per chip).
  int AxisSize(MeshAxis axis) const;

  // The replica one step along `axis` (wrapping) in direction dir = +1 or -1; kCore moves to the
  // chip's next/previous core.
  int Neighbor(int replica, MeshAxis axis, int dir) const;
  // The link a transfer from `from` to its neighbour `to` uses; throws if the two are not torus
  // neighbours along an inter-chip axis (same core index). On an axis of size 2, `dir` picks which
  // of the two cables (they join the same chips).
  Link LinkBetween(int from, int to, MeshAxis axis, int dir) const;
  // Every directed link of the mesh: 2 per chip and axis of size >= 2.
  std::vector<Link> Links() const;
  int LinkIndex(const Link& l) const;  // dense index in [0, Links().size())

  // Replica groups along `axis`: one group per position on the other axes, members in increasing
  // coordinate along `axis` (which is also increasing replica id). kX: groups of X replicas with the
  // same (y, core); kY: same (x, core); kCore: the cores of one chip.
  std::vector<runtime::ReplicaGroup> GroupsAlong(MeshAxis axis) const;
  // All replicas in one group, in replica order.
  runtime::ReplicaGroup AllReplicas() const;

 private:
  int x_, y_, cores_;
};

}  // namespace shardstep::tpu
