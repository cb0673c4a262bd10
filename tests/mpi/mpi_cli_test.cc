// `mpirun -np K shardstep train` (cli/mpi_launch.h): the final checkpoint of 2 ranks equals the in-process
// `--replicas 2` run's tensor for tensor, bit for bit (f32, and bf16 with the replicated update), and 2 ranks x
// `--replicas-per-process 2` the `--replicas 4` run's; progress and the checkpoint come from rank 0 alone. Bad input (a
// --replicas-per-process that does not divide a rank's share of the batch, a rank count that does not
// divide the batch, ranks whose step modules differ) is a clear error from every rank. Starts mpirun itself.
#include <catch2/catch.hpp>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "runtime/checkpoint.h"
#include "runtime/interpreter.h"
#include "tests/cli/cli_util.h"

namespace {

const std::string kMpirun =
    "timeout 60 mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none ";
const std::string kTrain = "train --model mlp --dataset synthetic --hidden 64,32 --batch 32 --steps 20 "
                           "--eval-batch 500 --log-every 10 ";

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Every tensor of `a` and `b` (the same names), bit for bit; returns how many differ.
int Differences(const std::string& a, const std::string& b) {
  using shardstep::runtime::LoadCheckpoint;
  const shardstep::runtime::TensorMap ta = LoadCheckpoint(a), tb = LoadCheckpoint(b);
  REQUIRE(ta.size() == tb.size());
  REQUIRE(ta.size() > 5);
  int bad = 0;
  for (const auto& [name, t] : ta) {
    const auto it = tb.find(name);
    if (it == tb.end() || !(it->second == t)) {
      UNSCOPED_INFO(name << " differs");
      ++bad;
    }
  }
  return bad;
}

}  // namespace

TEST_CASE("mpirun shardstep train: the checkpoint is bitwise the in-process run's", "[mpi]") {
  cli_test::TempDir dir("mpi_cli");
  struct Case {
    int ranks, per_process;
    std::string extra;
  };
  int i = 0;
  // bf16 with the replicated update: each replica's weights' bf16 copies, written by the update's loop
  // (jit::CompiledStep::bf16_weight_copies), on the ranks as in process.
  for (const Case& c : {Case{2, 1, ""}, Case{2, 2, ""}, Case{2, 2, "--replica-groups 2x2 "},
                        Case{2, 1, "--precision bf16 --shard-weight-update off "}}) {
    const int replicas = c.ranks * c.per_process;
    const std::string ref = dir.path + "/ref" + std::to_string(i) + ".safetensors";
    const std::string mpi = dir.path + "/mpi" + std::to_string(i++) + ".safetensors";
    const cli_test::Result in_process =
        cli_test::Run(kTrain + c.extra + "--replicas " + std::to_string(replicas) + " --save " + ref);
    INFO(in_process.output);
    REQUIRE(in_process.status == 0);
    const std::string cmd = kMpirun + "-np " + std::to_string(c.ranks) + " " + cli_test::Binary() + " " + kTrain +
                            c.extra +
                            (c.per_process > 1 ? "--replicas-per-process " + std::to_string(c.per_process) + " " : "") +
                            "--save " + mpi;
    const cli_test::Result r = cli_test::Shell(cmd);
    INFO(cmd << "\n" << r.output);
    REQUIRE(r.status == 0);
    CHECK(Count(r.output, "step 20/20") == 1);  // progress from rank 0 only
    CHECK(Count(r.output, "saved checkpoint") == 1);
    CHECK(Count(r.output, std::to_string(replicas) + " replica(s)") == 1);
    CHECK(Differences(ref, mpi) == 0);
  }
}

TEST_CASE("mpirun shardstep train: bad layouts and mismatched builds are an error on every rank", "[mpi]") {
  struct Case {
    std::string args, env, message, flags;
  };
  for (const Case& c :
       {Case{"-np 2 ", "",
             "--replicas-per-process 3 does not divide the per-process share of the batch (--batch 32 over 2 ranks: "
             "16 examples per rank)", "--replicas-per-process 3"},
        Case{"-np 3 ", "", "the rank count 3 (mpirun -np 3) does not divide --batch 32"},
        Case{"-np 4 ", "", "--replica-groups 2x1 makes 2 replicas but the 4 ranks (mpirun -np 4) x 1 replica(s) per "
             "process (--replicas-per-process) make 4", "--replica-groups 2x1"},
        Case{"-np 2 -x SHARDSTEP_TEST_PERTURB_STEP_HASH ", "SHARDSTEP_TEST_PERTURB_STEP_HASH=1 ",
             "the lowered step module differs across ranks"}}) {
    const std::string cmd = c.env + kMpirun + c.args + cli_test::Binary() + " " + kTrain + c.flags;
    const cli_test::Result r = cli_test::Shell(cmd);
    INFO(cmd << "\n" << r.output);
    CHECK(r.status != 0);
    CHECK(r.status != 124);  // not the timeout's
    const int ranks = c.args[4] - '0';
    for (int rank = 0; rank < ranks; ++rank)
      CHECK(r.output.find("shardstep: error: rank " + std::to_string(rank) + ": " + c.message) != std::string::npos);
    CHECK(r.output.find("step 20/20") == std::string::npos);
  }
  // Outside mpirun the MPI flags are an error, not silently ignored.
  const cli_test::Result r = cli_test::Run(kTrain + "--replicas-per-process 2");
  CHECK(r.status == 1);
  CHECK(r.output.find("--replicas-per-process is for runs under mpirun") != std::string::npos);
}

namespace {

// The pid of the process of `mpirun` rank `rank` whose command line contains `marker` (-1: none yet).
int RankPid(int rank, const std::string& marker) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    auto read = [&](const char* file) {
      std::ifstream in(entry.path() / file, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    const std::string cmdline = read("cmdline"), environ = read("environ");
    if (cmdline.rfind(cli_test::Binary(), 0) == 0 && cmdline.find(marker) != std::string::npos &&
        environ.find(std::string("OMPI_COMM_WORLD_RANK=") + std::to_string(rank) + '\0') != std::string::npos)
      return std::stoi(name);
  }
  return -1;
}

std::vector<std::string> Checkpoints(const std::string& dir) {
  std::vector<std::string> files;
  if (!std::filesystem::exists(dir)) return files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("step-", 0) == 0 && f.size() > 12 && f.substr(f.size() - 12) == ".safetensors") files.push_back(e.path());
  }
  return files;
}

}  // namespace

// A rank killed mid-run (SIGKILL, as a lost machine; rank 0 is the one that writes the checkpoints): mpirun and
// the other rank end non-zero within 10 s, and every periodic checkpoint left in the directory loads with its
// checksum checked -- a checkpoint is written once, by rank 0, to a temporary file renamed into place, so a
// kill leaves no partial file under a checkpoint's name.
TEST_CASE("mpirun shardstep train: a killed rank ends the job within 10 s and the checkpoints stay intact", "[mpi]") {
  for (int victim : {1, 0}) {
    INFO("killed rank " << victim);
    cli_test::TempDir dir("mpi_kill");
    const std::string ck = dir.path + "/ck", rc_file = dir.path + "/rc";
    const std::string cmd = "(" + kMpirun + "-np 2 " + cli_test::Binary() + " " +
                            "train --model mlp --dataset synthetic --hidden 64,32 --batch 32 --steps 10000000 "
                            "--eval-batch 500 --log-every 100000 --save-every 20 --keep 3 --checkpoint-dir " + ck +
                            "; echo $? > " + rc_file + ") > " + dir.path + "/out.txt 2>&1 &";
    REQUIRE(std::system(cmd.c_str()) == 0);
    auto now = [] { return std::chrono::steady_clock::now(); };
    auto seconds_since = [&](auto t) { return std::chrono::duration<double>(now() - t).count(); };
    const auto start = now();
    while (Checkpoints(ck).size() < 2 && seconds_since(start) < 50)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    REQUIRE(Checkpoints(ck).size() >= 2);
    const int pid = RankPid(victim, ck);
    REQUIRE(pid > 0);
    REQUIRE(::kill(pid, SIGKILL) == 0);
    const auto killed = now();
    while (!std::filesystem::exists(rc_file) && seconds_since(killed) < 30)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const double took = seconds_since(killed);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the rc file's contents
    std::ifstream rc_in(rc_file), out_in(dir.path + "/out.txt");
    int rc = -1;
    rc_in >> rc;
    const std::string out((std::istreambuf_iterator<char>(out_in)), {});
    INFO(out);
    CHECK(took < 10);
    CHECK(rc != 0);
    CHECK(rc != 124);  // mpirun ended it, not the timeout
    CHECK(RankPid(1 - victim, ck) == -1);  // the other rank is gone too
    const std::vector<std::string> left = Checkpoints(ck);
    CHECK(!left.empty());
    for (const std::string& f : left) {
      INFO(f);
      CHECK_NOTHROW(shardstep::runtime::LoadCheckpoint(f));
    }
  }
}
