#include "tpu_backend/speedup_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

namespace shardstep::tpu {
namespace {

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
  return out;
}

std::string Fmt(const char* f, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

std::string SpeedupPlotSvg(const std::vector<SpeedupPoint>& points, const std::string& title) {
  const double w = 720, h = 440, left = 70, right = 150, top = 40, bottom = 60;
  std::map<int64_t, std::vector<SpeedupPoint>> lines;  // per-core (or global) batch -> points by chips
  std::map<int, std::string> ticks;
  double ymax = 1.1, ymin = 0.9;
  int cmin = 1 << 30, cmax = 1;
  for (const SpeedupPoint& p : points) {
    lines[p.global_batch > 0 ? p.global_batch : p.per_core_batch].push_back(p);
    ticks[p.chips] = p.mesh;
    ymax = std::max(ymax, p.speedup * 1.05);
    ymin = std::min(ymin, p.speedup * 0.95);
    cmin = std::min(cmin, p.chips), cmax = std::max(cmax, p.chips);
  }
  const double lx0 = std::log2(std::max(1, cmin)), lx1 = std::max(lx0 + 1, std::log2(std::max(1, cmax)));
  auto X = [&](int chips) { return left + (std::log2(chips) - lx0) / (lx1 - lx0) * (w - left - right); };
  auto Y = [&](double s) { return top + (ymax - s) / (ymax - ymin) * (h - top - bottom); };
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << h
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << w / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << Escape(title) << "</text>\n";
  // Axes, ticks, the no-speedup line.
  os << "<line x1=\"" << left << "\" y1=\"" << h - bottom << "\" x2=\"" << w - right << "\" y2=\"" << h - bottom
     << "\" stroke=\"black\"/>\n<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\""
     << h - bottom << "\" stroke=\"black\"/>\n";
  for (const auto& [chips, mesh] : ticks)
    os << "<text x=\"" << X(chips) << "\" y=\"" << h - bottom + 16 << "\" text-anchor=\"middle\">" << Escape(mesh)
       << "</text>\n";
  os << "<text x=\"" << (left + w - right) / 2 << "\" y=\"" << h - 18
     << "\" text-anchor=\"middle\">mesh (chips, 2 cores each)</text>\n";
  for (int i = 0; i <= 5; ++i) {
    const double v = ymin + (ymax - ymin) * i / 5;
    os << "<text x=\"" << left - 6 << "\" y=\"" << Y(v) + 4 << "\" text-anchor=\"end\">" << Fmt("%.2f", v)
       << "</text>\n";
  }
  os << "<text transform=\"translate(18," << (top + h - bottom) / 2
     << ") rotate(-90)\" text-anchor=\"middle\">speedup (replicated / sharded step time)</text>\n";
  os << "<line x1=\"" << left << "\" y1=\"" << Y(1) << "\" x2=\"" << w - right << "\" y2=\"" << Y(1)
     << "\" stroke=\"gray\" stroke-dasharray=\"4,4\"/>\n";
  int k = 0;
  for (auto& [batch, pts] : lines) {
    std::sort(pts.begin(), pts.end(), [](const SpeedupPoint& a, const SpeedupPoint& b) { return a.chips < b.chips; });
    const char* color = colors[k % 8];
    os << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"";
    for (const SpeedupPoint& p : pts) os << X(p.chips) << "," << Y(p.speedup) << " ";
    os << "\"/>\n";
    for (const SpeedupPoint& p : pts)
      os << "<circle cx=\"" << X(p.chips) << "\" cy=\"" << Y(p.speedup) << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    os << "<text x=\"" << w - right + 12 << "\" y=\"" << top + 16 * k + 10 << "\" fill=\"" << color
       << "\">" << (pts.front().global_batch > 0 ? "global batch " : "per-core batch ") << batch << "</text>\n";
    ++k;
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace shardstep::tpu
