#include "tpu_backend/mesh_topology.h"

#include <cctype>

#include "ir/error.h"

namespace shardstep::tpu {

const char* AxisName(MeshAxis a) {
  switch (a) {
    case MeshAxis::kX: return "x";
    case MeshAxis::kY: return "y";
    case MeshAxis::kCore: return "core";
  }
  return "?";
}

std::string LinkName(const Link& l) {
  return Str("(", l.x, ",", l.y, ")", l.dir > 0 ? "+" : "-", AxisName(l.axis));
}

MeshTopology::MeshTopology(int x, int y, int cores_per_chip, const std::string& flag)
    : x_(x), y_(y), cores_(cores_per_chip) {
  if (x < 1 || y < 1 || x > kMaxChipsPerAxis || y > kMaxChipsPerAxis)
    throw Error(Str(flag, ": a mesh of ", x, "x", y, " chips is not possible: each axis needs 1 to ",
                    kMaxChipsPerAxis, " chips"));
  if (cores_per_chip < 1) throw Error(Str(flag, ": ", cores_per_chip, " cores per chip; needs at least 1"));
}

MeshTopology MeshTopology::Parse(const std::string& spec, int cores_per_chip, const std::string& flag) {
  // Digits, 'x', digits: nothing else (no spaces, signs or a third axis).
  const size_t sep = spec.find_first_of("xX");
  auto digits = [](const std::string& s) {
    if (s.empty() || s.size() > 6) return false;
    for (char c : s)
      if (!std::isdigit(static_cast<unsigned char>(c))) return false;
    return true;
  };
  if (sep == std::string::npos || !digits(spec.substr(0, sep)) || !digits(spec.substr(sep + 1)))
    throw Error(Str(flag, ": '", spec, "' is not a mesh shape; write X×Y chips as XxY, e.g. 2x2 or 4x4"));
  return MeshTopology(std::stoi(spec.substr(0, sep)), std::stoi(spec.substr(sep + 1)), cores_per_chip, flag);
}

std::string MeshTopology::ToString() const {
  return Str(x_, "x", y_, " chips, ", cores_, cores_ == 1 ? " core" : " cores", " each (", replicas(),
             replicas() == 1 ? " replica)" : " replicas)");
}

CoreCoord MeshTopology::CoordOf(int replica) const {
  if (replica < 0 || replica >= replicas())
    throw Error(Str("replica ", replica, " is not on the ", ToString(), " mesh"));
  return CoreCoord{replica / y_ % x_, replica % y_, replica / (x_ * y_)};
}

int MeshTopology::ReplicaAt(const CoreCoord& c) const {
  if (c.x < 0 || c.x >= x_ || c.y < 0 || c.y >= y_ || c.core < 0 || c.core >= cores_)
    throw Error(Str("core (", c.x, ",", c.y, ",", c.core, ") is not on the ", ToString(), " mesh"));
  return (c.core * x_ + c.x) * y_ + c.y;
}

int MeshTopology::AxisSize(MeshAxis axis) const {
  switch (axis) {
    case MeshAxis::kX: return x_;
    case MeshAxis::kY: return y_;
    case MeshAxis::kCore: return cores_;
  }
  return 1;
}

int MeshTopology::Neighbor(int replica, MeshAxis axis, int dir) const {
  CoreCoord c = CoordOf(replica);
  const int n = AxisSize(axis), step = dir > 0 ? 1 : n - 1;  // -1 as a forward step mod n
  switch (axis) {
    case MeshAxis::kX: c.x = (c.x + step) % n; break;
    case MeshAxis::kY: c.y = (c.y + step) % n; break;
    case MeshAxis::kCore: c.core = (c.core + step) % n; break;
  }
  return ReplicaAt(c);
}

Link MeshTopology::LinkBetween(int from, int to, MeshAxis axis, int dir) const {
  if (axis == MeshAxis::kCore) throw Error("the cores of a chip are not joined by an inter-chip link");
  if (AxisSize(axis) < 2 || Neighbor(from, axis, dir) != to)
    throw Error(Str("replicas ", from, " and ", to, " are not neighbours along ", AxisName(axis), dir > 0 ? "+" : "-",
                    " on the ", ToString(), " mesh"));
  const CoreCoord c = CoordOf(from);
  return Link{c.x, c.y, axis, dir > 0 ? +1 : -1};
}

std::vector<Link> MeshTopology::Links() const {
  std::vector<Link> out;
  for (int y = 0; y < y_; ++y)
    for (int x = 0; x < x_; ++x)
      for (MeshAxis a : {MeshAxis::kX, MeshAxis::kY}) {
        if (AxisSize(a) < 2) continue;
        for (int dir : {+1, -1}) out.push_back(Link{x, y, a, dir});
      }
  return out;
}

int MeshTopology::LinkIndex(const Link& l) const {
  if (l.x < 0 || l.x >= x_ || l.y < 0 || l.y >= y_ || l.axis == MeshAxis::kCore || AxisSize(l.axis) < 2)
    throw Error(Str("link ", LinkName(l), " is not on the ", ToString(), " mesh"));
  // Per chip: [+x, -x] if X >= 2, then [+y, -y] if Y >= 2 (the order Links() lists them in).
  const int per_chip = 2 * ((x_ >= 2) + (y_ >= 2));
  int k = (l.axis == MeshAxis::kY && x_ >= 2) ? 2 : 0;
  k += l.dir > 0 ? 0 : 1;
  return (l.y * x_ + l.x) * per_chip + k;
}

std::vector<runtime::ReplicaGroup> MeshTopology::GroupsAlong(MeshAxis axis) const {
  std::vector<runtime::ReplicaGroup> groups;
  // Every replica whose coordinate along `axis` is 0 starts a group, in replica order.
  for (int r = 0; r < replicas(); ++r) {
    const CoreCoord c = CoordOf(r);
    const int pos = axis == MeshAxis::kX ? c.x : axis == MeshAxis::kY ? c.y : c.core;
    if (pos != 0) continue;
    runtime::ReplicaGroup g;
    for (int i = 0, m = r; i < AxisSize(axis); ++i, m = Neighbor(m, axis, +1)) g.push_back(m);
    groups.push_back(std::move(g));
  }
  return groups;
}

runtime::ReplicaGroup MeshTopology::AllReplicas() const {
  runtime::ReplicaGroup g(replicas());
  for (int r = 0; r < replicas(); ++r) g[r] = r;
  return g;
}

}  // namespace shardstep::tpu
