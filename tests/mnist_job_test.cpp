// The MNIST job under every launcher, exact resume from a checkpoint, and a
// restart after a rank was killed. Short runs (--max-steps); the accuracy
// run of the demo is the separate ctest entry mnist.demo_accuracy.

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/version.h>

#include "support/documented_error.h"
#include "support/job_output.h"
#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "support/process.h"
#include "support/paths.h"

namespace lockstep::testing {
namespace {

std::vector<std::string> job(std::vector<std::string> flags) {
  std::vector<std::string> args{lockstep::testing::mnist_train_binary(), "--data", mnist_dir(), "--max-steps", "30"};
  args.insert(args.end(), flags.begin(), flags.end());
  return args;
}

// `launcher` followed by `command`.
std::vector<std::string> under(std::vector<std::string> launcher,
                               const std::vector<std::string>& command) {
  launcher.insert(launcher.end(), command.begin(), command.end());
  return launcher;
}

std::vector<std::string> under_launcher(std::vector<std::string> launcher_flags,
                                        const std::vector<std::string>& command) {
  launcher_flags.insert(launcher_flags.begin(), lockstep::testing::lockstep_run_binary());
  launcher_flags.push_back("--");
  return under(launcher_flags, command);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

TEST(MnistJob, RunsAsOnePlainProcess) {
  auto result = run_process(job({}), {{"RANK", ""}, {"WORLD_SIZE", ""}});
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "| 1 ranks |")) << result.output;
}

TEST(MnistJob, RunsUnderTorchrun) {
  if (run_process({"/usr/bin/python3", "-c", "import torch"}).exit_code != 0) {
    GTEST_SKIP() << "python3-torch is not installed: no torchrun here";
  }
  auto result = run_process(under(
      {"/usr/bin/python3", std::string(lockstep::testing::source_dir()) + "/tests/support/torchrun.py",
       "--nproc_per_node", "2", "--master_port", std::to_string(free_port()), "--no_python"},
      job({})));
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "| 2 ranks |")) << result.output;
}

TEST(MnistJob, RunsUnderMpirun) {
  if (run_process({"sh", "-c", "command -v mpirun"}).exit_code != 0) {
    GTEST_SKIP() << "openmpi-bin is not installed: no mpirun here";
  }
  auto result = run_process(under(
      {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x",
       "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=" + std::to_string(free_port())},
      job({})));
  ASSERT_TRUE(result.ok()) << result.output;
  EXPECT_TRUE(contains(result.output, "| 2 ranks |")) << result.output;
}

TEST(MnistJob, MissingDataSaysWhereItLookedAndHowToGetIt) {
  auto result = run_process({lockstep::testing::mnist_train_binary(), "--data", "/nonexistent/mnist"},
                            {{"RANK", ""}, {"WORLD_SIZE", ""}});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_TRUE(contains(result.output, "no MNIST data in /nonexistent/mnist")) << result.output;
  EXPECT_TRUE(contains(result.output, "Run scripts/setup")) << result.output;
}

TEST(MnistJob, UnevenWithSyncBatchNormIsRefusedBeforeTraining) {
  auto result = run_process({lockstep::testing::mnist_train_binary(), "--uneven", "--sync-bn"});
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_TRUE(contains(result.output, "--uneven and --sync-bn do not go together"))
      << result.output;
}

TEST(MnistJob, HelpPrintsTheUsage) {
  auto result = run_process({lockstep::testing::mnist_train_binary(), "--help"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output.rfind("usage: mnist_train [flags]", 0), 0u) << result.output;
  EXPECT_FALSE(contains(result.output, "unknown flag")) << result.output;
}

TEST(MnistJob, ACheckpointPathThatIsAFolderFailsBeforeTraining) {
  ScratchFolder folder("unwritable");
  std::string blocked = folder / "checkpoint.pt";
  ASSERT_EQ(::mkdir(blocked.c_str(), 0700), 0);
  auto result = run_process(
      under_launcher({"--nproc-per-node", "2"}, job({"--checkpoint-dir", folder.path()})));
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(contains(result.output, "mnist_train: cannot write the checkpoint " + blocked +
                                          ": it is a directory. Remove it, or pass another "
                                          "--checkpoint-dir."))
      << result.output;
  EXPECT_FALSE(contains(result.output, " step ")) << "it trained first:\n" << result.output;
}

// Whether this CPU's flags (/proc/cpuinfo) include every one of `flags`.
bool cpu_has(const std::vector<std::string>& flags) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      line += " ";
      for (const auto& flag : flags) {
        if (!contains(line, " " + flag + " ")) {
          return false;
        }
      }
      return true;
    }
  }
  return false;
}

// The lines of `output` that contain `part`.
std::vector<std::string> lines_with(const std::string& output, const std::string& part) {
  std::vector<std::string> found;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (contains(line, part)) {
      found.push_back(line);
    }
  }
  return found;
}

// With oneDNN limited to AVX2 (as the tests' environment limits it, and as
// some sites do), LibTorch 1.13 still hands a bfloat16 convolution to
// oneDNN on a CPU with AVX-512, and oneDNN has none: the job is refused
// before its first step, by name, on every rank, instead of failing in it
// with oneDNN's "could not create a primitive descriptor iterator". Where
// this LibTorch and CPU can convolve in bfloat16 so limited, the job trains.
TEST(MnistJob, SixteenBitWorkThatCannotRunHereIsNamedBeforeTheFirstStep) {
  bool must_refuse = TORCH_VERSION_MAJOR < 2 && cpu_has({"avx512bw", "avx512vl", "avx512dq"});
  std::string documented = documented_message("bf16-cpu-work");
  const std::string autocast = "autocast (lockstep::amp::Autocast)";
  for (const std::string& who :
       {autocast, std::string("the mixed-precision policy (DdpOptions::mixed_precision)")}) {
    std::string flag = who == autocast ? "--autocast" : "--mixed-precision";
    auto result =
        run_process(under_launcher({"--nproc-per-node", "2"}, job({flag, "--log-every", "1"})),
                    {{"ONEDNN_MAX_CPU_ISA", "AVX2"}}, std::chrono::seconds(180));
    if (result.ok()) {
      EXPECT_FALSE(must_refuse) << "LibTorch 1.13 on an AVX-512 CPU trained " << flag
                                << " under ONEDNN_MAX_CPU_ISA=AVX2:\n" << result.output;
      EXPECT_TRUE(contains(result.output, "final test accuracy")) << result.output;
      std::cout << flag << ": 16-bit convolutions run here under ONEDNN_MAX_CPU_ISA=AVX2\n";
      continue;
    }
    EXPECT_FALSE(contains(result.output, " step 1/")) << flag << " trained first:\n"
                                                     << result.output;
    EXPECT_FALSE(contains(result.output, "could not create a primitive descriptor iterator\n"))
        << "oneDNN's words reached the user alone:\n" << result.output;
    auto messages = lines_with(result.output, "computes the model's ");
    // Every rank raises it; the launcher stops the others once the first
    // has exited, so that the second may not have printed it yet.
    EXPECT_TRUE(messages.size() == 1 || messages.size() == 2)
        << "one message per rank expected:\n" << result.output;
    std::string expected = documented;
    auto named = expected.find(autocast);
    ASSERT_NE(named, std::string::npos) << documented;
    expected.replace(named, autocast.size(), who);
    for (auto message : messages) {
      message = message.substr(message.find("lockstep: ")); // after lockstep-run's "[r] "
      EXPECT_TRUE(matches_documented(message, expected))
          << "docs/troubleshooting.md, message 'bf16-cpu-work', reads:\n"
          << expected << "\nbut the error reads:\n" << message;
    }
  }
}

// Exact at any world size over shared memory, which sums each element in
// rank order whatever the bucket layout; over Gloo at 2 ranks (a + b either
// way). Gloo's ring at 3 ranks and more sums in an order that follows the
// bucket's chunk boundaries, and the first iteration after a resume runs on
// the construction layout before the rebuild: docs/guide.md says so.
// With PowerSGD, whose state (error feedback of each rank, warm-start
// matrices) travels in the checkpoint.
class ExactResume
    : public ::testing::TestWithParam<std::tuple<int, std::string, std::string>> {};

TEST_P(ExactResume, AfterAnEpochIsBitwiseExact) {
  auto [ranks, transport, hook] = GetParam();
  ScratchFolder scratch("mnist");
  Environment env{{"LOCKSTEP_TRANSPORT", transport}};
  std::vector<std::string> launcher{"--nproc-per-node", std::to_string(ranks)};
  auto whole = run_process(
      under_launcher(launcher,
                     job({"--epochs", "2", "--save-parameters", scratch / "uninterrupted.bin",
                          "--comm-hook", hook})),
      env);
  ASSERT_TRUE(whole.ok()) << whole.output;

  auto first = run_process(
      under_launcher(launcher, job({"--epochs", "1", "--checkpoint-dir", scratch / "checkpoints",
                                    "--comm-hook", hook})),
      env);
  ASSERT_TRUE(first.ok()) << first.output;
  auto second = run_process(
      under_launcher(launcher, job({"--epochs", "2", "--checkpoint-dir", scratch / "checkpoints",
                                    "--resume", "--save-parameters", scratch / "resumed.bin",
                                    "--comm-hook", hook})),
      env);
  ASSERT_TRUE(second.ok()) << second.output;
  EXPECT_TRUE(contains(second.output, "resumed from")) << second.output;

  auto expected = read_all(scratch / "uninterrupted.bin");
  ASSERT_FALSE(expected.empty());
  EXPECT_TRUE(read_all(scratch / "resumed.bin") == expected)
      << "the resumed run's parameters differ from the uninterrupted run's";
}

INSTANTIATE_TEST_SUITE_P(
    MnistJob, ExactResume,
    ::testing::Values(std::make_tuple(2, std::string("shm"), std::string("none")),
                      std::make_tuple(3, std::string("shm"), std::string("none")),
                      std::make_tuple(2, std::string("gloo"), std::string("none")),
                      std::make_tuple(2, std::string("shm"), std::string("powersgd:2"))),
    [](const auto& info) {
      std::string hook = std::get<2>(info.param);
      return std::to_string(std::get<0>(info.param)) + "_ranks_" + std::get<1>(info.param) +
          (hook == "none" ? "" : "_powersgd");
    });

TEST(MnistJob, ARankKilledMidEpochIsRestartedFromTheCheckpoint) {
  ScratchFolder scratch("mnist");
  auto whole = run_process(under_launcher(
      {"--nproc-per-node", "2"},
      job({"--epochs", "2", "--save-parameters", scratch / "uninterrupted.bin"})));
  ASSERT_TRUE(whole.ok()) << whole.output;

  auto restarted = run_process(
      under_launcher({"--nproc-per-node", "2", "--max-restarts", "1"},
                     job({"--epochs", "2", "--checkpoint-dir", scratch / "checkpoints",
                          "--resume", "--save-parameters", scratch / "restarted.bin"})),
      {{"LOCKSTEP_MNIST_CRASH", "2:10:1"}, {"LOCKSTEP_TIMEOUT", "30"}});
  ASSERT_TRUE(restarted.ok()) << restarted.output;
  EXPECT_TRUE(contains(restarted.output, "rank 1 was killed by signal 9")) << restarted.output;
  EXPECT_TRUE(contains(restarted.output, "restarting every rank (restart 1 of 1)"));
  EXPECT_TRUE(contains(restarted.output, "resumed from")) << restarted.output;
  EXPECT_TRUE(read_all(scratch / "restarted.bin") == read_all(scratch / "uninterrupted.bin"))
      << "the restarted run's parameters differ from the uninterrupted run's";
}

} // namespace
} // namespace lockstep::testing
