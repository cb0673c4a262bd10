// TrainingPlotSvg: hand-written SVG (no plotting dependency): a panel is a frame, y ticks at
// min/mid/max, and polylines in data coordinates mapped to pixels.
#include "runtime/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "runtime/atomic_file.h"

namespace shardstep::runtime {
namespace {

constexpr double kWidth = 900, kPanelHeight = 260, kLeft = 70, kRight = 20, kTop = 40, kGap = 60;
constexpr size_t kMaxPoints = 600;

std::string Fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

// (step, value) pairs, averaged over equal buckets of steps when there are more than kMaxPoints.
std::vector<std::pair<double, double>> Downsample(const std::vector<double>& v) {
  std::vector<std::pair<double, double>> out;
  const size_t n = v.size(), bucket = std::max<size_t>(1, (n + kMaxPoints - 1) / kMaxPoints);
  for (size_t i = 0; i < n; i += bucket) {
    const size_t end = std::min(n, i + bucket);
    double sum = 0;
    size_t finite = 0;
    for (size_t j = i; j < end; ++j)
      if (std::isfinite(v[j])) sum += v[j], ++finite;
    if (finite) out.push_back({0.5 * (i + end - 1) + 1, sum / finite});  // steps count from 1
  }
  return out;
}

struct Panel {
  double top, x0, x1, y0, y1;  // pixel top; data ranges
  double X(double x) const { return kLeft + (x - x0) / std::max(x1 - x0, 1e-12) * (kWidth - kLeft - kRight); }
  double Y(double y) const {  // values beyond the range are drawn at its edge
    y = std::clamp(y, y0, y1);
    return top + kPanelHeight - (y - y0) / std::max(y1 - y0, 1e-12) * kPanelHeight;
  }
};

void Frame(std::ostringstream& os, const Panel& p, const std::string& title, const std::string& ylabel) {
  os << "<rect x='" << kLeft << "' y='" << p.top << "' width='" << kWidth - kLeft - kRight << "' height='" << kPanelHeight
     << "' fill='none' stroke='#999'/>\n";
  os << "<text x='" << kLeft << "' y='" << p.top - 8 << "' font-size='14'>" << Escape(title) << "</text>\n";
  os << "<text x='14' y='" << p.top + kPanelHeight / 2 << "' font-size='12' transform='rotate(-90 14 "
     << p.top + kPanelHeight / 2 << ")' text-anchor='middle'>" << Escape(ylabel) << "</text>\n";
  for (double f : {0.0, 0.5, 1.0}) {
    const double y = p.y0 + f * (p.y1 - p.y0);
    os << "<text x='" << kLeft - 6 << "' y='" << p.Y(y) + 4 << "' font-size='11' text-anchor='end'>" << Fmt(y)
       << "</text>\n";
    os << "<line x1='" << kLeft << "' x2='" << kWidth - kRight << "' y1='" << p.Y(y) << "' y2='" << p.Y(y)
       << "' stroke='#eee'/>\n";
  }
  for (double f : {0.0, 0.5, 1.0}) {
    const double x = p.x0 + f * (p.x1 - p.x0);
    os << "<text x='" << p.X(x) << "' y='" << p.top + kPanelHeight + 16 << "' font-size='11' text-anchor='middle'>"
       << Fmt(std::round(x)) << "</text>\n";
  }
}

void Line(std::ostringstream& os, const Panel& p, const std::vector<std::pair<double, double>>& pts,
          const std::string& color, const std::string& name, int legend_row) {
  if (pts.empty()) return;
  os << "<polyline fill='none' stroke='" << color << "' stroke-width='1.5' points='";
  for (const auto& [x, y] : pts) os << Fmt(p.X(x)) << "," << Fmt(p.Y(y)) << " ";
  os << "'/>\n";
  const double ly = p.top + 16 + 16 * legend_row;
  os << "<line x1='" << kWidth - kRight - 170 << "' x2='" << kWidth - kRight - 150 << "' y1='" << ly - 4 << "' y2='"
     << ly - 4 << "' stroke='" << color << "' stroke-width='2'/>\n";
  os << "<text x='" << kWidth - kRight - 144 << "' y='" << ly << "' font-size='12'>" << Escape(name) << "</text>\n";
}

std::pair<double, double> Range(const std::vector<std::pair<double, double>>& pts, double lo_floor) {
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& [x, y] : pts) lo = std::min(lo, y), hi = std::max(hi, y);
  if (!std::isfinite(lo)) return {0, 1};
  lo = std::min(lo, lo_floor);
  if (hi <= lo) hi = lo + 1;
  return {lo, hi};
}

}  // namespace

std::string TrainingPlotSvg(const TrainingCurves& c, const std::string& title) {
  const double steps = std::max<double>(1, static_cast<double>(c.loss.size()));
  std::ostringstream os;
  const double height = kTop + 2 * kPanelHeight + kGap + 56;
  os << "<svg xmlns='http://www.w3.org/2000/svg' width='" << kWidth << "' height='" << height
     << "' font-family='sans-serif'>\n<rect width='100%' height='100%' fill='white'/>\n";
  os << "<text x='" << kLeft << "' y='20' font-size='16' font-weight='bold'>" << Escape(title) << "</text>\n";

  // Panel 1: loss per step, test loss and accuracy at each evaluation.
  const auto loss = Downsample(c.loss);
  std::vector<std::pair<double, double>> test_loss;
  for (const EvalPoint& e : c.evals) test_loss.push_back({static_cast<double>(e.step), e.loss});
  auto all = loss;
  all.insert(all.end(), test_loss.begin(), test_loss.end());
  const auto [lo, hi] = Range(all, 0);
  const Panel p1{kTop + 20, 1, steps, lo, hi};
  Frame(os, p1, "loss", "loss");
  Line(os, p1, loss, "#1f77b4", "training loss", 0);
  if (!test_loss.empty()) {
    Line(os, p1, test_loss, "#d62728", "test loss (" + c.metric + ")", 1);
    for (const EvalPoint& e : c.evals) {
      os << "<circle cx='" << Fmt(p1.X(e.step)) << "' cy='" << Fmt(p1.Y(e.loss)) << "' r='3.5' fill='#d62728'/>\n";
      os << "<text x='" << Fmt(p1.X(e.step) - 4) << "' y='" << Fmt(p1.Y(e.loss) - 8)
         << "' font-size='11' text-anchor='end' fill='#d62728'>" << Fmt(e.accuracy) << "</text>\n";
    }
  }

  // Panel 2: step time and the part of it spent in collectives.
  const auto step_ms = Downsample(c.step_ms), comm_ms = Downsample(c.comm_ms);
  auto times = step_ms;
  times.insert(times.end(), comm_ms.begin(), comm_ms.end());
  auto [tlo, thi] = Range(times, 0);
  // The first steps (compilation, page faults) can be 10x the rest: scale to 1.25x the 98th
  // percentile and say what went off the chart.
  std::vector<double> sorted;
  for (const auto& [x, y] : step_ms) sorted.push_back(y);
  std::sort(sorted.begin(), sorted.end());
  std::string clipped;
  if (sorted.size() >= 10) {
    const double cap = 1.25 * sorted[sorted.size() * 98 / 100];
    if (cap < thi) {
      thi = cap;
      clipped = " (max " + Fmt(sorted.back()) + " ms, above the scale)";
    }
  }
  const Panel p2{kTop + 20 + kPanelHeight + kGap, 1, steps, tlo, thi};
  Frame(os, p2, "step time" + clipped, "ms");
  Line(os, p2, step_ms, "#2ca02c", "step", 0);
  Line(os, p2, comm_ms, "#ff7f0e", "collectives", 1);
  os << "<text x='" << (kLeft + kWidth - kRight) / 2 << "' y='" << height - 4
     << "' font-size='12' text-anchor='middle'>step</text>\n</svg>\n";
  return os.str();
}

void WriteTrainingPlot(const std::string& path, const TrainingCurves& curves, const std::string& title) {
  const std::string svg = TrainingPlotSvg(curves, title);
  WriteFileAtomically(path, {{svg.data(), svg.size()}}, "plot");
}

}  // namespace shardstep::runtime
