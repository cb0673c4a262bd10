#include "tpu_backend/ring_cost.h"

#include <algorithm>
#include <map>

#include "ir/error.h"

namespace shardstep::tpu {

ScheduleTime TimeOf(const MeshTopology& mesh, const RingSchedule& schedule, const LinkModel& ici,
                    const LinkModel& on_chip) {
  for (const LinkModel* m : {&ici, &on_chip})
    if (!(m->bytes_per_s > 0) || !(m->latency_s >= 0))
      throw Error(Str(m == &ici ? "inter-chip" : "on-chip", " link model needs a positive bandwidth and a ",
                      "non-negative latency (got ", m->bytes_per_s, " B/s, ", m->latency_s, " s)"));
  ScheduleTime out;
  std::vector<int64_t> link_bytes(mesh.Links().size());
  std::map<std::pair<int, int>, int64_t> core_bytes;  // on chip: per ordered pair of cores
  for (const auto& step : schedule.steps) {
    std::fill(link_bytes.begin(), link_bytes.end(), 0);
    core_bytes.clear();
    for (const Transfer& t : step) {
      const int64_t bytes = t.count * static_cast<int64_t>(sizeof(float));
      if (t.axis == MeshAxis::kCore) core_bytes[{t.from, t.to}] += bytes;
      else link_bytes[mesh.LinkIndex(mesh.LinkBetween(t.from, t.to, t.axis, t.dir))] += bytes;
    }
    double seconds = 0;
    int64_t busiest = 0;
    for (int64_t b : link_bytes)
      if (b > 0) seconds = std::max(seconds, ici.latency_s + static_cast<double>(b) / ici.bytes_per_s), busiest = std::max(busiest, b);
    for (const auto& [pair, b] : core_bytes)
      seconds = std::max(seconds, on_chip.latency_s + static_cast<double>(b) / on_chip.bytes_per_s), busiest = std::max(busiest, b);
    out.seconds += seconds;
    out.max_link_bytes_per_step = std::max(out.max_link_bytes_per_step, busiest);
    ++out.steps;
  }
  return out;
}

}  // namespace shardstep::tpu
