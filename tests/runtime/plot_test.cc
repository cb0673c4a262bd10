// Training plots: a well-formed SVG with both panels, long runs downsampled, NaN steps skipped,
// text escaped, written atomically.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <sstream>

#include "ir/error.h"
#include "runtime/plot.h"
#include "tests/test_util.h"

using namespace shardstep;
using namespace shardstep::runtime;

namespace {

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TrainingCurves Curves(int steps) {
  TrainingCurves c;
  for (int i = 0; i < steps; ++i) {
    c.loss.push_back(2.3 * std::exp(-i / 100.0));
    c.step_ms.push_back(i == 0 ? 500 : 10 + i % 3);
    c.comm_ms.push_back(2);
  }
  c.evals.push_back({steps / 2, 0.8, 0.5});
  c.evals.push_back({steps, 0.85, 0.4});
  return c;
}

}  // namespace

TEST_CASE("the training plot is one SVG with the loss, the evaluations and the step-time breakdown", "[plot]") {
  const std::string svg = TrainingPlotSvg(Curves(300), "mlp <adam> & friends");
  CHECK(svg.rfind("<svg xmlns='http://www.w3.org/2000/svg'", 0) == 0);
  CHECK(svg.size() > 1000);
  CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
  CHECK(Count(svg, "<polyline") == 4);  // training loss, test loss, step time, collectives
  CHECK(Count(svg, "<circle") == 2);    // one marker per evaluation
  CHECK_THAT(svg, Catch::Contains("mlp &lt;adam&gt; &amp; friends"));
  CHECK_THAT(svg, Catch::Contains("0.85"));            // the last accuracy is labelled
  CHECK_THAT(svg, Catch::Contains("above the scale"));  // the 500 ms first step is clipped, and said
}

TEST_CASE("long runs are averaged into a bounded number of points; NaN steps are skipped", "[plot]") {
  TrainingCurves c = Curves(100000);
  c.loss[5] = NAN;
  const std::string svg = TrainingPlotSvg(c, "long");
  const size_t at = svg.find("<polyline");
  const std::string first = svg.substr(at, svg.find("/>", at) - at);
  const int points = Count(first, ",");
  CHECK(points > 100);
  CHECK(points <= 600);
  CHECK(Count(svg, "nan") == 0);
  CHECK(Count(svg, "inf") == 0);
}

TEST_CASE("an empty run still gives a valid SVG", "[plot]") {
  const std::string svg = TrainingPlotSvg(TrainingCurves{}, "empty");
  CHECK(svg.substr(svg.size() - 7) == "</svg>\n");
  CHECK(Count(svg, "nan") == 0);
}

TEST_CASE("WriteTrainingPlot writes atomically and names the path on failure", "[plot]") {
  const testing::TempDir dir;
  const std::string path = dir / "plot.svg";
  WriteTrainingPlot(path, Curves(50), "t");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == TrainingPlotSvg(Curves(50), "t"));
  CHECK_THROWS_WITH(WriteTrainingPlot(dir / "missing/plot.svg", Curves(5), "t"),
                    Catch::Contains(dir / "missing/plot.svg: cannot save plot: cannot create"));
  CHECK(dir.Files() == std::vector<std::string>{"plot.svg"});  // no temporary left behind
}
